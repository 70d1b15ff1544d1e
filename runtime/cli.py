"""Runtime commands: ``serve``, ``expert-server``, ``attention-client``, ``tiny-model``.

Each command is a thin shell: it parses options and calls the module that does the work.
"""

from __future__ import annotations

import math
import os
import re
import sys
from typing import Annotated, Any

import typer

# The NVSHMEM world options, declared once: `eaas expert-server` and `eaas attention-client`
# both join a world with them (docs/gpu.md "nvshmem:PE").
NvshmemWorldOption = Annotated[
    int | None,
    typer.Option(
        "--nvshmem-world",
        envvar="EAAS_NVSHMEM_WORLD_SIZE",
        help="Join an NVSHMEM world of this many PEs (clients + servers + spares; docs/gpu.md); "
        "needs nvshmem4py, a GPU and --device cuda.",
    ),
]
NvshmemPeOption = Annotated[
    int | None,
    typer.Option("--nvshmem-pe", envvar="EAAS_NVSHMEM_PE", help="This process's PE in the world."),
]
NvshmemUidFileOption = Annotated[
    str | None,
    typer.Option(
        "--nvshmem-uid-file",
        envvar="EAAS_NVSHMEM_UID_FILE",
        help="PE 0 writes the world's unique id here; the other PEs read it (shared storage).",
    ),
]
_CPU_BF16_HELP = (
    "With --dtype bfloat16 on CPU: fp32 computes in float32 with float32 copies of the "
    "bf16-rounded weights (KV cache and expert frames stay bfloat16), native in bfloat16, auto "
    "(default) times one linear layer both ways at load and takes the faster (docs/serving.md "
    "'bf16 on CPU'). No effect on cuda or with float32."
)

_DEVICE_HELP = "auto (cuda when available, else cpu), cpu, cuda or cuda:N."


def register(app: typer.Typer) -> None:
    app.command("tiny-model")(tiny_model)
    app.command("expert-server")(expert_server)
    app.command("attention-client")(attention_client)
    app.command("serve")(serve)


def client_id_of(value: str) -> int:
    """The attention client's integer id (int64 ``client_id`` of the transports' frames) from
    ``--client-id``: a decimal integer as is, any other non-empty string (a pod name) as the
    top 63 bits of its BLAKE2b-64 digest, so it is stable for the name and non-negative.
    Distinct names collide with probability about n^2 / 2^64 (n names).

    Raises:
        typer.BadParameter: ``value`` is empty or a negative integer.
    """
    import hashlib

    v = value.strip()
    if not v:
        raise typer.BadParameter("--client-id is empty")
    try:
        cid = int(v)
    except ValueError:
        return int.from_bytes(hashlib.blake2b(v.encode(), digest_size=8).digest(), "big") >> 1
    if cid < 0 or cid >= 2**63:
        raise typer.BadParameter(f"--client-id {v}: must be in [0, 2**63)")
    return cid


def tiny_model(
    out_dir: str = typer.Argument(..., help="Directory to write the checkpoint into."),
) -> None:
    """Write the built-in tiny DeepSeek-V3-architecture checkpoint (random weights) to OUT_DIR."""
    from eaas.runtime.models.arch import read_model_info
    from eaas.runtime.models.tiny import write_tiny_model

    path = write_tiny_model(out_dir)
    info = read_model_info(path)
    typer.echo(
        f"wrote {path}: {info.architecture}, {info.num_layers} layers (MoE {list(info.moe_layers)}), "
        f"{info.num_experts} experts top-{info.top_k}, hidden {info.hidden_size}, vocab {info.vocab_size}"
    )


def expert_server(
    model: str = typer.Option(
        None, "--model", help="Checkpoint directory (default: the built-in tiny model)."
    ),
    server_id: str = typer.Option(
        "expert-server-0", "--server-id", help="Id of this server (routing table, logs)."
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
        0, "--metrics-port", help="Serve Prometheus /metrics on this port (0: none)."
    ),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    cpu_bf16_compute: str = typer.Option("auto", "--cpu-bf16-compute", help=_CPU_BF16_HELP),
    device: str = typer.Option(
        "auto",
        "--device",
        help="Where the hosted experts' weights live and compute: " + _DEVICE_HELP + " On cuda "
        "the native grouped kernels run (docs/gpu.md); nvshmem: and cudaipc CUDA-payload "
        "clients need cuda.",
    ),
    spare: bool = typer.Option(
        False,
        "--spare",
        help="Start as a spare: no experts, serving and ready (hosting 0 experts) until the "
        "routing table assigns some (needs --push-token-file or --routing-table-configmap; "
        "not with --experts). An NVSHMEM world's spare PEs run this (docs/gpu.md).",
    ),
    threads: int = typer.Option(
        1, "--threads", min=0, help="torch intra-op threads (0: torch default)."
    ),
    cpus: str = typer.Option(
        None,
        "--cpus",
        help="Pin this server to these CPUs, Linux list format ('1', '0-3,8'); each must be one "
        "this process may run on. Default: not pinned. (eaas serve --server-cpus auto sets it.)",
    ),
    sched_policy: str = typer.Option(
        "other",
        "--sched-policy",
        help="Linux scheduling policy of this server's threads: other (SCHED_OTHER, the default "
        "policy) or batch (SCHED_BATCH: a woken server does not preempt the process running on "
        "its CPU, such as the attention client still writing its frames; eaas serve's default).",
    ),
    batch_window_us: float = typer.Option(
        0.0, "--batch-window-us", help="Extra gather time per dynamic batch."
    ),
    http_port: int = typer.Option(
        None,
        "--http-port",
        min=0,
        max=65535,
        help="Serve GET /health (200 only when weights are loaded, the listener is bound and the "
        "serving loop ran within --health-stale-s) and GET /metrics on this port (default: none).",
    ),
    http_host: str = typer.Option("0.0.0.0", "--http-host", help="Bind address of --http-port."),
    health_stale_s: float = typer.Option(
        5.0,
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
    from eaas.runtime.placement import SCHED_POLICIES

    if cpus is not None:  # first: every thread started later (torch, HTTP) inherits it
        try:
            os.sched_setaffinity(0, parse_cpu_list(cpus))
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--cpus") from None
    if sched_policy not in SCHED_POLICIES:
        raise typer.BadParameter(f"--sched-policy must be batch or other, got {sched_policy!r}")
    if SCHED_POLICIES[sched_policy] != os.sched_getscheduler(0):  # inherited by later threads
        os.sched_setscheduler(0, SCHED_POLICIES[sched_policy], os.sched_param(0))
    import torch

    from eaas.runtime.client.main import resolve_device
    from eaas.runtime.expert_server import ExpertServer, learn_from_table, run, start_http
    from eaas.runtime.gpu.device import check_listen_device, check_world_device
    from eaas.runtime.models.compute import check_policy, choose_compute
    from eaas.runtime.placement import parse_expert_spec

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise typer.BadParameter(f"--dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    try:
        check_policy(cpu_bf16_compute)
        dev = resolve_device(device)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if spare and experts:
        raise typer.BadParameter("--spare starts with no experts: not with --experts")
    if spare and not (push_token_file or routing_table_configmap):
        raise typer.BadParameter(
            "--spare needs --push-token-file or --routing-table-configmap (a spare gets its "
            "experts from the routing table)"
        )
    world_cfg = _nvshmem_world_config(nvshmem_world, nvshmem_pe, nvshmem_uid_file, listen)
    try:
        check_listen_device(listen, dev.type)
        if world_cfg is not None:
            check_world_device(dev.type)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if model is None:
        from eaas.runtime.models.tiny import default_model_dir

        model = str(default_model_dir())
    from eaas.runtime.models.arch import read_model_info
    from eaas.runtime.models.weights import load_expert_weights

    info = read_model_info(model)
    if experts:
        try:
            pairs = parse_expert_spec(experts)
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
    elif push_token_file or routing_table_configmap:
        pairs = []  # learnt from the routing table
    else:
        pairs = [(l, e) for l in info.moe_layers for e in range(info.num_experts)]
    if push_token_file and http_port is None:
        raise typer.BadParameter("--push-token-file needs --http-port (PUT /routing-table)")
    _check_listen_endpoint(listen)
    try:
        health = start_http(server_id, http_port, health_stale_s, http_host)  # 503 while loading
    except (OSError, OverflowError) as e:
        raise typer.BadParameter(f"--http-port {http_port}: {e}") from None
    hosted = _to_device(load_expert_weights(model, pairs, dtypes[dtype], progress=False), dev)
    if threads:  # the calibration times this process's threads
        torch.set_num_threads(threads)
    compute = choose_compute(
        dtypes[dtype], dev, cpu_bf16_compute, (32, info.hidden_size, info.moe_intermediate_size)
    )
    typer.echo(f"expert-server {server_id} {compute.log_line()}", err=True)
    listener_kw: dict[str, Any] = {}
    if listen.startswith("cudaipc:"):
        listener_kw["compute_device"] = str(dev)
    if world_cfg is not None:
        from eaas.runtime.transport.nvshmem import WorldSpec, open_world

        world = open_world(
            world_cfg, WorldSpec(world_cfg.world_size, info.hidden_size, dtypes[dtype])
        )
        if listen.startswith("nvshmem:"):
            listener_kw["world"] = world
    try:
        server = ExpertServer(
            listen,
            hosted,
            info.hidden_size,
            dtypes[dtype],
            server_id,
            num_threads=threads,
            batch_window_us=batch_window_us,
            device=dev,
            compute=compute,
            **listener_kw,
        )
    except (OSError, OverflowError) as e:  # bind: address in use, no such host, bad port
        raise typer.BadParameter(f"--listen {listen}: {e}") from None
    # the server keeps its own copies (compute dtype, stacked per layer on the CPU): holding
    # the loaded ones for the life of the process would keep every expert's weights twice
    del hosted
    try:
        learn_from_table(
            server,
            health,
            lambda want: load_expert_weights(model, want, dtypes[dtype], progress=False),
            push_token_file=push_token_file,
            routing_table_configmap=routing_table_configmap,
            num_experts=info.num_experts,
            moe_layers=info.moe_layers,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    run(server, metrics_port, health)
    _exit_now(f"expert-server {server_id}")


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


def _check_listen_endpoint(listen: str) -> None:
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


def _check_routing_table_file(path: str) -> None:
    """Read and parse ``--routing-table`` once at start-up.

    Raises:
        typer.BadParameter: the file cannot be read or is not a valid routing table (exit 2).
    """
    from eaas.runtime.routing import RoutingTable

    try:
        with open(path, encoding="utf-8") as f:
            RoutingTable.from_json(f.read())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise typer.BadParameter(f"--routing-table {path}: {e}") from None


def _to_device(hosted: dict, dev) -> dict:
    """``{(layer, expert): ExpertWeights}`` moved to ``dev`` (a no-op on the CPU)."""
    if dev.type == "cpu":
        return hosted
    from eaas.runtime.experts import ExpertWeights

    return {
        key: ExpertWeights(w.gate.to(dev), w.up.to(dev), w.down.to(dev))
        for key, w in hosted.items()
    }


def _nvshmem_world_config(world_size, pe, uid_file, listen: str | None = None):
    """The NVSHMEM world options as a ``WorldConfig`` (None when not given), checked before
    anything loads.

    Raises:
        typer.BadParameter: partial or bad options, ``--listen nvshmem:PE`` without the world or
            with another PE, or no nvshmem4py / GPU here (the message says which).
    """
    from eaas.runtime.transport.nvshmem import (
        WorldConfig,
        check_listen_pe,
        nvshmem_unavailable_reason,
    )

    try:
        cfg = WorldConfig.from_options(world_size, pe, uid_file)
        if listen is not None:
            check_listen_pe(listen, cfg)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if cfg is not None:
        reason = nvshmem_unavailable_reason()
        if reason is not None:
            raise typer.BadParameter(f"--nvshmem-world: {reason}")
    return cfg


def _claim_client_pe(world_size, pe, uid_file, client_pes: int) -> int:
    """``--nvshmem-client-pes``: this client's PE, claimed next to the uid file
    (:func:`eaas.runtime.transport.nvshmem_world.claim_client_pe`, holder = ``HOSTNAME``).
    Nothing is claimed where the world cannot be joined.

    Raises:
        typer.BadParameter: with ``--nvshmem-pe``, without the world size / uid file, a count
            outside ``1 .. world-1``, no nvshmem4py / GPU here, or no free client PE.
    """
    import socket

    from eaas.runtime.transport.nvshmem import nvshmem_unavailable_reason
    from eaas.runtime.transport.nvshmem_world import MembershipError, claim_client_pe

    if pe is not None:
        raise typer.BadParameter("give --nvshmem-pe or --nvshmem-client-pes, not both")
    if world_size is None or not uid_file:
        raise typer.BadParameter(
            "--nvshmem-client-pes needs --nvshmem-world and --nvshmem-uid-file"
        )
    if not 1 <= client_pes < world_size:
        raise typer.BadParameter(
            f"--nvshmem-client-pes must be in 1..{world_size - 1} (--nvshmem-world "
            f"{world_size}), got {client_pes}"
        )
    reason = nvshmem_unavailable_reason()
    if reason is not None:
        raise typer.BadParameter(f"--nvshmem-world: {reason}")
    holder = os.environ.get("HOSTNAME") or socket.gethostname()
    try:
        return claim_client_pe(uid_file, client_pes, holder)
    except (ValueError, MembershipError, OSError) as e:
        raise typer.BadParameter(f"--nvshmem-client-pes: {e}") from None


def _check_dispatch_timeout(seconds: float) -> None:
    """Raises: typer.BadParameter (exit code 2) unless ``seconds`` is a finite number > 0."""
    import math

    if not (math.isfinite(seconds) and seconds > 0):
        raise typer.BadParameter(f"--dispatch-timeout must be > 0 seconds, got {seconds}")


def _exit_now(what: str) -> None:
    """Leave at once after a graceful stop (sockets closed, socket path unlinked).

    Interpreter teardown of a torch process (unloading its libraries, collecting every
    module) costs seconds of CPU; on a busy machine with several servers stopping together
    that made Ctrl-C of ``eaas serve`` take 5-20 s. Nothing is left to flush but stdio:
    metrics files are memory-mapped and already written.
    """
    print(f"{what} stopped", flush=True)
    sys.stderr.flush()
    os._exit(0)


def attention_client(
    model: str = typer.Option(
        None, "--model", help="Checkpoint directory (default: the built-in tiny model)."
    ),
    routing_table: str = typer.Option(
        None,
        "--routing-table",
        help="Routing table JSON file; re-read when it changes (ConfigMap mount).",
    ),
    client_id: str = typer.Option(
        "0",
        "--client-id",
        help="Id of this attention client (frames, metrics, failure reports): an integer, or a "
        "name such as the pod name (the operator passes $(EAAS_POD_NAME)), mapped to a stable "
        "63-bit integer, so every replica of a fleet has its own id.",
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="API listen address."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="API port."),
    reuse_port: bool = typer.Option(
        False,
        "--reuse-port",
        help="Bind the API port with SO_REUSEPORT so several clients share it (eaas serve sets it).",
    ),
    dispatch_timeout: float = typer.Option(
        5.0,
        "--dispatch-timeout",
        help="Seconds (> 0) to wait for expert servers per MoE layer round.",
    ),
    local_experts: bool = typer.Option(
        False,
        "--local-experts",
        help="No expert servers: run the untouched model in-process (single-process baseline).",
    ),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    cpu_bf16_compute: str = typer.Option("auto", "--cpu-bf16-compute", help=_CPU_BF16_HELP),
    threads: int = typer.Option(
        1, "--threads", min=0, help="torch intra-op threads (0: torch default)."
    ),
    served_model_name: str = typer.Option(
        None, "--served-model-name", help="Model id in the API (default: directory name)."
    ),
    max_num_seqs: int = typer.Option(64, "--max-num-seqs", help="Running sequences at most."),
    routing_table_configmap: str = typer.Option(
        None,
        "--routing-table-configmap",
        help="NAMESPACE/NAME of the routing-table ConfigMap to watch through the Kubernetes API "
        "(in-cluster credentials or KUBECONFIG); newer versions are applied.",
    ),
    push_token_file: str = typer.Option(
        None,
        "--push-token-file",
        envvar="EAAS_PUSH_TOKEN_FILE",
        help="File with the bearer token (a mounted Secret) that PUT /routing-table requires and "
        "failure reports carry; without it pushes are refused (403).",
    ),
    failure_report_url: str = typer.Option(
        None,
        "--failure-report-url",
        help="POST a JSON report here when an expert server is marked down (background, bounded "
        "queue, dropped on overflow).",
    ),
    max_num_batched_tokens: int = typer.Option(
        512,
        "--max-num-batched-tokens",
        min=1,
        help="Tokens per forward (decode tokens + prefill chunks); longer prompts are chunked.",
    ),
    kv_cache_memory: str = typer.Option(
        None,
        "--kv-cache-memory",
        help="Preallocated paged KV cache, e.g. 512MiB or 2GiB (default: max-num-seqs full-length "
        "sequences, at most 4GiB; at least one full-length sequence).",
    ),
    device: str = typer.Option("auto", "--device", help=_DEVICE_HELP),
    max_request_body: str = typer.Option(
        "32MiB",
        "--max-request-body",
        help="Largest API request body; larger ones get 413 request_too_large.",
    ),
    prefill_tokens_while_decoding: str = typer.Option(
        "auto",
        "--prefill-tokens-while-decoding",
        help="Prefill tokens at most in a step that also decodes: auto (a mixed step costs "
        "~2 decode steps, less on a noisy machine, from measured step times; a burst of prompts "
        "may hold the decodes within 0.5% of the gaps), off, or a token count.",
    ),
    double_batch_overlap: bool = typer.Option(
        False,
        "--double-batch-overlap",
        help="Decode steps of 2+ sequences run as two micro-batches: one's attention while the "
        "other's MoE round trip is in flight (same greedy tokens; docs/gpu.md).",
    ),
    cuda_graphs: bool = typer.Option(
        False,
        "--cuda-graphs",
        help="Decode MoE round trips to cudaipc expert servers replay captured CUDA graphs "
        "(needs --device cuda and expert servers; docs/gpu.md).",
    ),
    spin_us: float = typer.Option(
        None,
        "--spin-us",
        min=0,
        help="shm / cudaipc: busy-poll for an expert server's answer at least this many "
        "microseconds before blocking (default 80; longer, up to 2 ms, when recent round trips "
        "took longer and the client and the servers it waits on fit on the CPUs). 0: block at "
        "once, never busy-poll (shm; cudaipc keeps its adaptive spin while a core is free for "
        "it) (pays on cores oversubscribed by other work; docs/serving.md).",
    ),
    nvshmem_world: NvshmemWorldOption = None,
    nvshmem_pe: NvshmemPeOption = None,
    nvshmem_uid_file: NvshmemUidFileOption = None,
    nvshmem_client_pes: int = typer.Option(
        None,
        "--nvshmem-client-pes",
        envvar="EAAS_NVSHMEM_CLIENT_PES",
        help="Instead of --nvshmem-pe: claim a free client PE 0..N-1 next to the uid file "
        "(identical pods of a Deployment; a restarted pod gets its PE back).",
    ),
) -> None:
    """Run one attention client with the OpenAI-compatible API (the process a client pod runs).

    Prints ``attention-client <id> ready on http://HOST:PORT ...`` once serving.
    """
    from eaas.runtime.client.main import run_attention_client

    _check_dispatch_timeout(dispatch_timeout)
    if nvshmem_client_pes is not None:
        nvshmem_pe = _claim_client_pe(
            nvshmem_world, nvshmem_pe, nvshmem_uid_file, nvshmem_client_pes
        )
    world_cfg = _nvshmem_world_config(nvshmem_world, nvshmem_pe, nvshmem_uid_file)
    if world_cfg is not None and local_experts:
        raise typer.BadParameter(
            "--nvshmem-world connects to expert servers; not with --local-experts"
        )
    if dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    if spin_us is not None and not math.isfinite(spin_us):
        raise typer.BadParameter(
            f"--spin-us must be a finite number of microseconds, got {spin_us}"
        )
    if not local_experts and not routing_table and not routing_table_configmap:
        raise typer.BadParameter(
            "--routing-table or --routing-table-configmap is required unless --local-experts "
            "is given"
        )
    if routing_table_configmap:
        from eaas.runtime.client.table_watch import parse_configmap_ref

        try:
            parse_configmap_ref(routing_table_configmap)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
    if failure_report_url and not failure_report_url.startswith(("http://", "https://")):
        raise typer.BadParameter(
            f"--failure-report-url must be http:// or https://, got {failure_report_url!r}"
        )
    if routing_table:
        _check_routing_table_file(routing_table)
    from eaas.runtime.client.kv_cache import parse_memory_size
    from eaas.runtime.client.main import resolve_device

    try:
        if kv_cache_memory is not None:
            parse_memory_size(kv_cache_memory)
        try:
            parse_memory_size(max_request_body)
        except ValueError as e:
            raise ValueError(f"--max-request-body: {e}") from None
        from eaas.runtime.client.engine import parse_prefill_cap

        parse_prefill_cap(prefill_tokens_while_decoding)
        from eaas.runtime.models.compute import check_policy

        check_policy(cpu_bf16_compute)
        dev = resolve_device(device)
        if world_cfg is not None:
            from eaas.runtime.gpu.device import check_world_device

            check_world_device(dev.type)
        if cuda_graphs:
            from eaas.runtime.gpu.graphs import check_cuda_graphs

            check_cuda_graphs(dev.type, local_experts)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    cid = client_id_of(client_id)
    if str(cid) != client_id.strip():
        typer.echo(f"attention-client: --client-id {client_id!r} is client id {cid}", err=True)
    run_attention_client(
        model_dir=model,
        routing_table=routing_table,
        client_id=cid,
        host=host,
        port=port,
        dispatch_timeout=dispatch_timeout,
        local_experts=local_experts,
        dtype=dtype,
        cpu_bf16_compute=cpu_bf16_compute,
        threads=threads,
        served_model_name=served_model_name,
        max_num_seqs=max_num_seqs,
        reuse_port=reuse_port,
        routing_table_configmap=routing_table_configmap,
        push_token_file=push_token_file,
        failure_report_url=failure_report_url,
        device=device,
        kv_cache_memory=kv_cache_memory,
        max_num_batched_tokens=max_num_batched_tokens,
        max_request_body=max_request_body,
        double_batch_overlap=double_batch_overlap,
        prefill_tokens_while_decoding=prefill_tokens_while_decoding,
        cuda_graphs=cuda_graphs,
        nvshmem_world=world_cfg,
        spin_us=spin_us,
    )
    _exit_now(f"attention-client {cid}")


def serve(
    expert_servers: int = typer.Option(
        4, "--expert-servers", help="Expert server processes (any count >= replicas)."
    ),
    replicas: int = typer.Option(
        2, "--replicas", help="Replicas of every logical expert, on distinct servers."
    ),
    attention_clients: int = typer.Option(
        1, "--attention-clients", help="Attention client processes sharing the API port."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="API listen address."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="API port."),
    model: str = typer.Option(
        None,
        "--model",
        help="Checkpoint directory (default: built-in tiny model, built on first use).",
    ),
    transport: str = typer.Option(
        "shm", "--transport", help="shm (same-host shared memory) or tcp."
    ),
    dispatch_timeout: float = typer.Option(
        5.0, "--dispatch-timeout", help="Clients' deadline per MoE layer round (s, > 0)."
    ),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    cpu_bf16_compute: str = typer.Option(
        "auto",
        "--cpu-bf16-compute",
        help="Every process's --cpu-bf16-compute (auto, native, fp32): " + _CPU_BF16_HELP,
    ),
    client_threads: int = typer.Option(
        1, "--client-threads", min=0, help="torch threads per attention client (0: torch default)."
    ),
    server_threads: int = typer.Option(
        1, "--server-threads", min=0, help="torch threads per expert server (0: torch default)."
    ),
    kv_cache_memory: str = typer.Option(
        None, "--kv-cache-memory", help="Each attention client's KV cache, e.g. 512MiB."
    ),
    max_num_batched_tokens: int = typer.Option(
        512, "--max-num-batched-tokens", min=1, help="Each attention client's tokens per forward."
    ),
    client_device: str = typer.Option(
        "auto", "--client-device", help="Attention clients' device: auto, cpu, cuda, cuda:N."
    ),
    double_batch_overlap: bool = typer.Option(
        False,
        "--double-batch-overlap",
        help="Attention clients' --double-batch-overlap (decode as two overlapped micro-batches).",
    ),
    server_device: str = typer.Option(
        "cpu",
        "--server-device",
        help="Expert servers' --device: cpu (default), auto, cuda or cuda:N (cuda: the native "
        "grouped kernels; frames still travel through host shared memory or TCP).",
    ),
    prefill_tokens_while_decoding: str = typer.Option(
        "auto",
        "--prefill-tokens-while-decoding",
        help="Attention clients' --prefill-tokens-while-decoding (auto, off or a token count).",
    ),
    client_spin_us: str = typer.Option(
        "default",
        "--client-spin-us",
        help="Attention clients' --spin-us (shm): default (the transport's busy-poll) or "
        "microseconds; 0 blocks at once (docs/serving.md: better only under heavy load).",
    ),
    server_sched_policy: str = typer.Option(
        "batch",
        "--server-sched-policy",
        help="Expert servers' --sched-policy: batch (default: a woken server does not preempt "
        "the attention client that woke it) or other.",
    ),
    server_cpus: str = typer.Option(
        "auto",
        "--server-cpus",
        help="auto: pin each expert server to one CPU (its --cpus), the servers one decode call "
        "reaches on different CPUs (with >= 2 servers and CPUs and --server-threads 1); "
        "none: not pinned.",
    ),
) -> None:
    """Start a whole deployment on this machine: expert servers + attention clients."""
    _check_dispatch_timeout(dispatch_timeout)
    from eaas.runtime.placement import PlacementError
    from eaas.runtime.serve import serve as run_serve

    try:
        code = run_serve(
            model_dir=model,
            expert_servers=expert_servers,
            replicas=replicas,
            attention_clients=attention_clients,
            host=host,
            port=port,
            transport=transport,
            dispatch_timeout=dispatch_timeout,
            dtype=dtype,
            cpu_bf16_compute=cpu_bf16_compute,
            client_threads=client_threads,
            server_threads=server_threads,
            kv_cache_memory=kv_cache_memory,
            max_num_batched_tokens=max_num_batched_tokens,
            client_device=client_device,
            server_device=server_device,
            double_batch_overlap=double_batch_overlap,
            prefill_tokens_while_decoding=prefill_tokens_while_decoding,
            client_spin_us=client_spin_us,
            server_cpus=server_cpus,
            server_sched_policy=server_sched_policy,
        )
    except (PlacementError, ValueError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc)) from None
    # Every child is stopped and the run directory removed: skip the seconds of interpreter
    # teardown (serve imported torch to check the port), as the children do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
