"""``eaas serve --engine vllm``'s ``vllm serve`` command line (pure: nothing is started): the
plugin's scheduler by default, the user's ``--scheduler-cls`` from ``--vllm-args`` instead,
and the API key in the environment, never in argv; and the check that the ``vllm`` command's
Python has the plugin (one real ``eaas serve`` that refuses to start)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eaas.runtime.options import ServeOptions
from eaas.runtime.options.vllm import SCHEDULER_CLS
from eaas.runtime.serve import Deployment
from eaas.runtime.serve.children import module_command
from eaas.runtime.serve.vllm_engine import VLLM_CLIENT_SPIN_US, vllm_child, vllm_python

from helpers.common import free_port

pytestmark = pytest.mark.vllm


def _argv_env(**over):
    o = ServeOptions(engine="vllm", vllm=sys.executable, **over)
    child, env = vllm_child(o, "/models/tiny", Path("/run/t.json"))
    return child.argv, env


def test_the_plugins_scheduler_by_default():
    argv, env = _argv_env(api_key=("sk-one",))
    i = argv.index("--scheduler-cls")
    assert argv[i + 1] == SCHEDULER_CLS == "eaas.vllm.scheduler.Scheduler"
    assert env["VLLM_API_KEY"] == "sk-one" and "sk-one" not in argv


@pytest.mark.parametrize("given", ["--scheduler-cls my.Sched", "--scheduler-cls=my.Sched"])
def test_a_scheduler_in_vllm_args_replaces_it(given):
    argv, _ = _argv_env(vllm_args=f"--enforce-eager {given}")
    assert SCHEDULER_CLS not in " ".join(argv)
    assert " ".join(argv).endswith(f"--enforce-eager {given}")


def test_the_plugin_blocks_at_once_unless_a_client_spin_is_given():
    # --client-spin-us default: the plugin's EAAS_SPIN_US is VLLM_CLIENT_SPIN_US (0: block at
    # once, vLLM's worker never spins on the CPU a server of its call may need); a number is kept
    _, env = _argv_env()
    assert env["EAAS_SPIN_US"] == "0.0" == str(VLLM_CLIENT_SPIN_US)
    _, env = _argv_env(client_spin_us="40")
    assert env["EAAS_SPIN_US"] == "40.0"


def test_expert_servers_are_not_pinned_beside_vllm():
    # --server-cpus auto pins the servers for serve's own clients (2+ CPUs); with --engine vllm
    # it does not: vLLM binds its worker's OpenMP thread to a CPU of its own choice
    port = free_port()
    cpus = len(os.sched_getaffinity(0))
    eaas = Deployment(ServeOptions(port=port))
    assert (eaas.server_cpu_list is not None) == (cpus >= 2)
    vllm = Deployment(ServeOptions(engine="vllm", vllm=sys.executable, port=port))
    assert vllm.server_cpu_list is None and "--engine vllm" in vllm.not_pinned_why


@pytest.mark.parametrize(
    ("given", "owned"),
    [
        ("--port=9", "--port"),
        ("--host 0.0.0.0", "--host"),
        ("--dtype bfloat16", "--dtype"),
        ("--served_model_name x", "--served-model-name"),
        ("--max-num-batched 64", "--max-num-batched-tokens"),
        ("--model /other", "--model"),
    ],
)
def test_vllm_args_that_set_a_flag_serve_sets_are_refused_by_name(given, owned):
    """``--vllm-args`` may not set what serve sets from its own flags (vLLM would take the later
    value, e.g. a port serve does not listen on), in any spelling vLLM's parser takes."""
    with pytest.raises(ValueError, match=f"sets vllm serve's {owned}, which serve sets itself"):
        ServeOptions(engine="vllm", vllm_args=f"--enforce-eager {given}")
    with pytest.raises(ValueError, match="bare --"):
        ServeOptions(engine="vllm", vllm_args="--enforce-eager --")
    ok = ServeOptions(engine="vllm", vllm_args="--enforce-eager --max-model-len 256 --seed 0")
    assert ok.vllm_args.startswith("--enforce-eager")


@pytest.mark.parametrize(
    "header,python",
    [
        ("#!/venv/bin/python\nimport sys\n", ["/venv/bin/python"]),
        ("#!/usr/bin/env python3 -S\n", ["python3", "-S"]),
        # pip's header when the interpreter's path is too long for #!
        (
            "#!/bin/sh\n'''exec' \"/a long/bin/python\" \"$0\" \"$@\"\n' '''\n",
            ["/a long/bin/python"],
        ),
        ('#!/bin/bash\nexec /opt/vllm/bin/vllm "$@"\n', None),  # a wrapper: not probed
        ("\x7fELF\x02\x01", None),  # a binary
    ],
)
def test_the_python_of_a_vllm_command_is_read_from_its_header(tmp_path, header, python):
    exe = tmp_path / "vllm"
    exe.write_text(header)
    assert vllm_python(str(exe)) == python


def test_a_vllm_whose_python_lacks_the_plugin_is_refused_before_anything_starts(tmp_path):
    # a console script of a Python without eaas (-S: no site-packages, so no eaas there);
    # without the check vLLM starts, logs "Failed to load plugin eaas" and dies much later
    exe = tmp_path / "vllm"
    exe.write_text(f"#!{sys.executable} -S\nraise SystemExit('not run')\n")
    exe.chmod(0o755)
    r = subprocess.run(
        [sys.executable, "-m", "eaas", "serve", "--engine", "vllm", "--vllm", str(exe)]
        + ["--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2, out
    assert f"its Python ({sys.executable}) has no eaas.vllm plugin" in out, out
    assert "No module named 'eaas'" in out and "pip install 'eaas[vllm]'" in out, out
    assert "Traceback" not in out and "expert-server" not in r.stdout, out


def test_servers_run_with_serves_python_unless_vllms_has_this_eaas():
    # a vllm that is not a Python script (here: the interpreter binary) is not probed: the
    # servers run with serve's own Python and its torch kernel
    d = Deployment(ServeOptions(engine="vllm", vllm=sys.executable, port=free_port()))
    assert d.server_python[0] == sys.executable
    assert module_command("eaas", ["/v/bin/python"])[:2] == ["/v/bin/python", "-c"]
