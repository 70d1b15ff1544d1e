"""``eaas expert-server``: one expert server process (what an expert-server pod runs)."""

from __future__ import annotations

import os
import re
from typing import Any

import typer

from eaas.runtime.cli.common import (
    DEVICE_HELP,
    CpuBf16Option,
    DtypeOption,
    ModelOption,
    NvshmemPeOption,
    NvshmemUidFileOption,
    NvshmemWorldOption,
    ThreadsOption,
    exit_now,
    nvshmem_world_config,
    options_from,
)
from eaas.runtime.common.dtypes import torch_dtype
from eaas.runtime.common.logs import configure_logging
from eaas.runtime.options import ExpertServerOptions
from eaas.runtime.placement import SCHED_POLICIES
from eaas.runtime.tables.expert_spec import parse_expert_spec

# torch and the expert server's modules are imported inside the functions: `eaas --help` and
# the operator's commands must start without torch.


#: The flags' defaults are the options object's (one source of truth).
DEFAULT = ExpertServerOptions


def expert_server(
    ctx: typer.Context,
    model: ModelOption = None,
    server_id: str = typer.Option(
        DEFAULT.server_id, "--server-id", help="Id of this server (routing table, logs)."
    ),
    experts: str = typer.Option(
        None,
        "--experts",
        help="Hosted experts, e.g. '1:0-3,7;2:5' (layer:experts; default: all of the model).",
    ),
    listen: str = typer.Option(
        ..., "--listen", help="unix:/path.sock (same host, shared memory) or tcp://host:port."
    ),
    metrics_port: int = typer.Option(
        DEFAULT.metrics_port,
        "--metrics-port",
        help="Serve Prometheus /metrics on this port (0: none).",
    ),
    dtype: DtypeOption = DEFAULT.dtype,
    cpu_bf16_compute: CpuBf16Option = DEFAULT.cpu_bf16_compute,
    cpu_kernel: str = typer.Option(
        DEFAULT.cpu_kernel,
        "--cpu-kernel",
        help="CPU expert compute: auto (vLLM's CPU fused-MoE kernel when this Python has "
        "vLLM's CPU build, else torch), torch (grouped_mm), vllm (that kernel; exit 2 when it "
        "does not load). The fused kernel runs batches of a few hundred pairs or fewer.",
    ),
    device: str = typer.Option(
        DEFAULT.device,
        "--device",
        help="Where the hosted experts' weights live and compute: " + DEVICE_HELP + " On cuda "
        "the native grouped kernels run (docs/gpu.md); nvshmem: and cudaipc CUDA-payload "
        "clients need cuda.",
    ),
    spare: bool = typer.Option(
        DEFAULT.spare,
        "--spare",
        help="Start as a spare: no experts, serving and ready (hosting 0 experts) until the "
        "routing table assigns some (needs --push-token-file or --routing-table-configmap; "
        "not with --experts). An NVSHMEM world's spare PEs run this (docs/gpu.md).",
    ),
    threads: ThreadsOption = DEFAULT.threads,
    cpus: str = typer.Option(
        None,
        "--cpus",
        help="Pin this server to these CPUs, Linux list format ('1', '0-3,8'); each must be one "
        "this process may run on. Default: not pinned. (eaas serve --server-cpus auto sets it.)",
    ),
    sched_policy: str = typer.Option(
        DEFAULT.sched_policy,
        "--sched-policy",
        help="Linux scheduling policy of this server's threads: other (SCHED_OTHER, the default "
        "policy) or batch (SCHED_BATCH: a woken server does not preempt the process running on "
        "its CPU, such as the attention client still writing its frames; eaas serve's default).",
    ),
    batch_window_us: float = typer.Option(
        DEFAULT.batch_window_us, "--batch-window-us", help="Extra gather time per dynamic batch."
    ),
    http_port: int = typer.Option(
        None,
        "--http-port",
        min=0,
        max=65535,
        help="Serve GET /health (200 only when weights are loaded, the listener is bound and the "
        "serving loop ran within --health-stale-s) and GET /metrics on this port (default: none).",
    ),
    http_host: str = typer.Option(
        DEFAULT.http_host, "--http-host", help="Bind address of --http-port."
    ),
    health_stale_s: float = typer.Option(
        DEFAULT.health_stale_s,
        "--health-stale-s",
        min=0.001,
        help="/health answers 503 when the serving loop's last iteration is older (s).",
    ),
    nvshmem_world: NvshmemWorldOption = None,
    nvshmem_pe: NvshmemPeOption = None,
    nvshmem_uid_file: NvshmemUidFileOption = None,
    push_token_file: str = typer.Option(
        None,
        "--push-token-file",
        envvar="EAAS_PUSH_TOKEN_FILE",
        help="Learn the hosted experts from routing tables PUT to --http-port /routing-table "
        "with this bearer token (a mounted Secret); without --experts the server starts empty.",
    ),
    routing_table_configmap: str = typer.Option(
        None,
        "--routing-table-configmap",
        help="NAMESPACE/NAME: learn the hosted experts from this routing-table ConfigMap "
        "(watched through the API); without --experts the server starts empty.",
    ),
) -> None:
    """Run one expert server (the process an expert-server pod runs).

    Loads only the hosted experts' weights, then prints
    ``expert-server <id> ready on <endpoint> hosting <N> experts`` (stdout, flushed) once the
    socket accepts connections. SIGTERM/SIGINT stop it gracefully (Unix socket path unlinked).
    In multiprocess metrics mode (``PROMETHEUS_MULTIPROC_DIR`` set) no port is opened: the
    process only writes its metric files.
    """
    # the device before the options' own checks, as the flags were always checked: a GPU that is
    # not there is said first
    from eaas.runtime.cuda.device import resolve_device

    try:
        resolve_device(ctx.params["device"])
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    options = options_from(ExpertServerOptions, ctx)
    run_expert_server(options)


def run_expert_server(o: ExpertServerOptions) -> None:
    """Run one expert server with ``o`` until SIGTERM/SIGINT, then leave at once.

    Raises:
        typer.BadParameter: an option the process cannot use here (a CPU it may not run on, a
            device that is not there, experts outside the model, a taken port; exit code 2).
    """
    import torch

    from eaas.runtime.cuda.device import check_listen_device, check_world_device, resolve_device
    from eaas.runtime.models.arch import read_model_info
    from eaas.runtime.models.compute import check_policy, choose_compute
    from eaas.runtime.models.tiny import default_model_dir
    from eaas.runtime.models.weights import load_expert_weights
    from eaas.runtime.server.main import learn_from_table, run, start_http
    from eaas.runtime.server.server import ExpertServer, resolve_cpu_kernel

    try:
        configure_logging(f"expert-server-{o.server_id}")
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if o.cpus is not None:  # first: every thread started later (torch, HTTP) inherits it
        try:
            os.sched_setaffinity(0, parse_cpu_list(o.cpus))
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--cpus") from None
    if o.sched_policy not in SCHED_POLICIES:
        raise typer.BadParameter(f"--sched-policy must be batch or other, got {o.sched_policy!r}")
    if SCHED_POLICIES[o.sched_policy] != os.sched_getscheduler(0):  # inherited by later threads
        os.sched_setscheduler(0, SCHED_POLICIES[o.sched_policy], os.sched_param(0))
    dtype = torch_dtype(o.dtype)
    try:
        check_policy(o.cpu_bf16_compute)
        dev = resolve_device(o.device)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    try:  # before the weights load: --cpu-kernel vllm where vLLM's kernel does not load
        resolve_cpu_kernel(o.cpu_kernel, dev)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--cpu-kernel") from None
    world_cfg = nvshmem_world_config(o.nvshmem_world, o.nvshmem_pe, o.nvshmem_uid_file, o.listen)
    try:
        check_listen_device(o.listen, dev.type)
        if world_cfg is not None:
            check_world_device(dev.type)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    model = o.model if o.model is not None else str(default_model_dir())
    info = read_model_info(model)
    if o.experts:
        try:
            pairs = parse_expert_spec(o.experts)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        bad = [
            (l, e) for l, e in pairs if l not in info.moe_layers or not 0 <= e < info.num_experts
        ]
        if bad:
            raise typer.BadParameter(
                f"--experts names {bad[:8]} outside the model (MoE layers {list(info.moe_layers)}, "
                f"{info.num_experts} experts per layer)"
            )
    elif o.learns_from_table:
        pairs = []  # learnt from the routing table
    else:
        pairs = [(l, e) for l in info.moe_layers for e in range(info.num_experts)]
    check_listen_endpoint(o.listen)
    try:  # 503 while loading
        health = start_http(o.server_id, o.http_port, o.health_stale_s, o.http_host)
    except (OSError, OverflowError) as e:
        raise typer.BadParameter(f"--http-port {o.http_port}: {e}") from None
    hosted = _to_device(load_expert_weights(model, pairs, dtype, progress=False), dev)
    if o.threads:  # the calibration times this process's threads
        torch.set_num_threads(o.threads)
    compute = choose_compute(
        dtype, dev, o.cpu_bf16_compute, (32, info.hidden_size, info.moe_intermediate_size)
    )
    typer.echo(f"expert-server {o.server_id} {compute.log_line()}", err=True)
    listener_kw: dict[str, Any] = {}
    if o.listen.startswith("cudaipc:"):
        listener_kw["compute_device"] = str(dev)
    if world_cfg is not None:
        from eaas.runtime.transport.nvshmem import WorldSpec, open_world

        world = open_world(world_cfg, WorldSpec(world_cfg.world_size, info.hidden_size, dtype))
        if o.listen.startswith("nvshmem:"):
            listener_kw["world"] = world
    try:
        server = ExpertServer(
            o.listen,
            hosted,
            info.hidden_size,
            dtype,
            o.server_id,
            num_threads=o.threads,
            batch_window_us=o.batch_window_us,
            device=dev,
            compute=compute,
            cpu_kernel=o.cpu_kernel,
            **listener_kw,
        )
    except (OSError, OverflowError) as e:  # bind: address in use, no such host, bad port
        raise typer.BadParameter(f"--listen {o.listen}: {e}") from None
    if dev.type == "cpu":
        typer.echo(
            f"expert-server {o.server_id} cpu kernel {server.cpu_kernel} ({server.cpu_kernel_why})",
            err=True,
        )
    # the server keeps its own copies (compute dtype, stacked per layer on the CPU): holding
    # the loaded ones for the life of the process would keep every expert's weights twice
    del hosted
    try:
        learn_from_table(
            server,
            health,
            lambda want: load_expert_weights(model, want, dtype, progress=False),
            push_token_file=o.push_token_file,
            routing_table_configmap=o.routing_table_configmap,
            num_experts=info.num_experts,
            moe_layers=info.moe_layers,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    run(server, o.metrics_port, health)
    exit_now(f"expert-server {o.server_id}")


def parse_cpu_list(text: str) -> set[int]:
    """``'0-3,8'`` -> ``{0, 1, 2, 3, 8}`` (the Linux CPU list format of ``taskset -c`` and
    ``/sys/devices/system/cpu/online``: decimal CPU ids and ranges ``a-b``, comma-separated).

    Raises:
        ValueError: malformed, empty, or a CPU this process may not run on
            (``os.sched_getaffinity(0)``; checked before a range is expanded).
    """
    allowed = os.sched_getaffinity(0)
    top = max(allowed)
    out: set[int] = set()
    for part in text.split(","):
        m = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", part.strip())
        if m is None:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a CPU or a range a-b")
        a = int(m[1])
        b = int(m[2]) if m[2] is not None else a
        if b < a:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a CPU or a range a-b")
        if b > top:  # before expanding: '0-100000000000' must not build a set of that size
            raise ValueError(
                f"CPU list {text!r}: CPU {b} not available to this process "
                f"(it may run on {sorted(allowed)})"
            )
        out.update(range(a, b + 1))
    if not out <= allowed:
        missing = sorted(out - allowed)
        raise ValueError(
            f"CPU list {text!r}: CPU(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} not "
            f"available to this process (it may run on {sorted(allowed)})"
        )
    return out


def check_listen_endpoint(listen: str) -> None:
    """Refuse a malformed ``--listen`` before any weight loads: an unknown scheme, an empty
    unix path or one whose directory does not exist, a tcp endpoint without ``host:port`` or with a port outside 0-65535.

    Raises:
        typer.BadParameter: naming ``--listen`` (exit 2).
    """
    from eaas.runtime.transport.factory import TRANSPORTS

    if not listen.startswith(tuple(TRANSPORTS)):
        known = ", ".join(f"{p}..." for p in TRANSPORTS)
        raise typer.BadParameter(f"--listen {listen!r}: unknown scheme (expected one of: {known})")
    if listen.startswith("tcp://"):
        from eaas.runtime.transport.tcp import parse_tcp

        try:
            _, port = parse_tcp(listen)
        except ValueError as e:
            raise typer.BadParameter(f"--listen: {e}") from None
        if not 0 <= port <= 65535:
            raise typer.BadParameter(f"--listen {listen!r}: port must be 0-65535")
    elif listen.startswith(("unix:", "cudaipc:")):
        path = listen.split(":", 1)[1]
        if path.startswith("//"):  # unix:///abs/path, as the transport reads it
            path = path[2:]
        if not path.strip():
            raise typer.BadParameter(f"--listen {listen!r}: empty socket path")
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            # the socket's directory is the caller's (serve's run dir, a pod's volume): a typo
            # must not silently create a directory tree nobody cleans up
            raise typer.BadParameter(
                f"--listen {listen!r}: directory {parent} does not exist (create it first)"
            )


def _to_device(hosted: dict, dev) -> dict:
    """``{(layer, expert): ExpertWeights}`` moved to ``dev`` (a no-op on the CPU)."""
    if dev.type == "cpu":
        return hosted
    return {key: w.to(dev) for key, w in hosted.items()}
