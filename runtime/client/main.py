"""``eaas attention-client``: one attention client process (what an attention-client pod runs).

Start-up: load the model (without routed experts, which are replaced by
:class:`~eaas.runtime.client.dispatch.RemoteExperts`; or the full local model with
``--local-experts``), load the routing table, start the engine, bind the HTTP socket and serve the
OpenAI-compatible API with uvicorn. Prints ``attention-client <id> ready on http://HOST:PORT``
(stdout, flushed) once the socket accepts connections.

Sharing one port between several clients (``eaas serve --attention-clients M``): the listening
socket is bound here with ``SO_REUSEPORT`` (``--reuse-port``, which ``eaas serve`` passes after
checking that the port is free; a lone client without it fails on a taken port) and handed to uvicorn (``Server.serve(sockets=[s])``);
the Linux kernel then spreads incoming TCP connections over all processes bound to that port
(hash of the connection 4-tuple). Each HTTP connection stays with one client for its lifetime,
so one keep-alive connection's requests all reach the same client; concurrent connections are
spread. ``GET /health`` tells which client answered (``client_id``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from pathlib import Path
from typing import Any

#: Seconds a SIGTERM/SIGINT leaves running requests to finish before they end with
#: 503 ``server_shutting_down``.
SHUTDOWN_GRACE_S = 1.0

log = logging.getLogger("eaas.client")


def bind_listener(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket on ``host:port``.

    Args:
        reuse_port: set ``SO_REUSEPORT`` so several attention clients can share the port (the
            kernel spreads connections over them); ``eaas serve`` sets it for its clients after
            checking the port is free. Without it a taken port fails loudly.

    Raises:
        OSError: the address is taken (``EADDRINUSE``) or not bindable.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # accepted sockets inherit it. With Nagle left on, a kept-alive streaming connection (the
    # openai client's) held every SSE chunk until the client's delayed ACK, ~40 ms
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def resolve_device(name: str):
    """``torch.device`` for a ``--device`` value.

    ``"auto"``: ``cuda`` when a CUDA device is available, else ``cpu``.

    Raises:
        ValueError: an unknown device string, or ``cuda`` asked for where none is available.
    """
    import re

    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA device is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) available"
            )
    return dev


def run_attention_client(
    *,
    model_dir: str | None,
    routing_table: str | None,
    client_id: int,
    host: str,
    port: int,
    dispatch_timeout: float,
    local_experts: bool,
    dtype: str,
    threads: int,
    served_model_name: str | None = None,
    max_num_seqs: int = 64,
    reuse_port: bool = False,
    log_level: str = "warning",
    routing_table_configmap: str | None = None,
    push_token_file: str | None = None,
    failure_report_url: str | None = None,
    device: str = "auto",
    kv_cache_memory: str | None = None,
    max_num_batched_tokens: int = 512,
    max_request_body: str | None = None,
    double_batch_overlap: bool = False,
    prefill_tokens_while_decoding: int | str | None = "auto",
    cuda_graphs: bool = False,
    nvshmem_world=None,
    spin_us: float | None = None,
    cpu_bf16_compute: str = "auto",
) -> None:
    """Run one attention client until SIGINT/SIGTERM.

    Routing-table sources (any of them; newer versions win): ``routing_table`` (a JSON file,
    polled), ``routing_table_configmap`` (``NAMESPACE/NAME``, watched through the API:
    :mod:`.table_watch`) and pushes to ``PUT /routing-table`` authenticated with the token in
    ``push_token_file`` (:mod:`.table_push`). ``failure_report_url``: where servers marked down
    are reported (:mod:`.failure_report`, same token).

    Args:
        device: ``"auto"`` (cuda when available, else cpu), ``"cpu"``, ``"cuda"``, ``"cuda:N"``:
            where the model and its KV cache live.
        kv_cache_memory: KV-cache budget such as ``"2GiB"`` (``None``: the engine's default).
        max_num_batched_tokens: tokens per forward (decode tokens + prefill chunks).
        max_request_body: largest API request body, e.g. ``"32MiB"`` (``None``: 32 MiB); larger
            bodies get 413 ``request_too_large``.
        prefill_tokens_while_decoding: the engine's prefill cap in steps that also decode
            (``"auto"``, ``"off"`` or a token count; :class:`~eaas.runtime.client.engine.Engine`).
        double_batch_overlap: the engine's decode steps run as two overlapped micro-batches
            (:class:`~eaas.runtime.gpu.overlap.PagedOverlapRunner`).
        cuda_graphs: decode MoE round trips to ``cudaipc`` servers replay captured CUDA graphs
            (:class:`~eaas.runtime.gpu.graphs.GraphRoundTrips`); needs a CUDA ``device`` and
            expert servers (ValueError otherwise).
        nvshmem_world: a :class:`~eaas.runtime.transport.nvshmem.WorldConfig`: join that
            NVSHMEM world before connecting; ``nvshmem:PE`` endpoints use it.
        cpu_bf16_compute: ``"auto"``, ``"native"`` or ``"fp32"``: what a bfloat16 model
            computes in on CPU (:mod:`eaas.runtime.models.compute`; the KV cache and the frames
            to expert servers stay bfloat16). Logged at start and in ``/health``'s ``compute``.

    Raises:
        ValueError: no routing-table source and not ``local_experts``, a bad ``dtype``,
            ``device``, ``kv_cache_memory``, ``routing_table_configmap`` or
            ``failure_report_url``, an empty token file.
        typer.BadParameter: a KV cache smaller than one longest sequence (exit code 2 in the CLI).
        OSError / RoutingTableError: unreadable routing table or token file at start-up, port
            in use.
    """
    import torch

    from eaas.runtime.models.attention import load_attention_model

    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s client-{client_id} %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise ValueError(f"--dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    torch_dtype = dtypes[dtype]
    from eaas.runtime.client.kv_cache import parse_memory_size

    dev = resolve_device(device)
    if cuda_graphs:
        from eaas.runtime.gpu.graphs import check_cuda_graphs

        check_cuda_graphs(dev.type, local_experts)
    kv_bytes = None if kv_cache_memory in (None, "", "auto") else parse_memory_size(kv_cache_memory)
    if threads > 0:
        torch.set_num_threads(threads)
    if model_dir is None:
        from eaas.runtime.models.tiny import default_model_dir

        model_dir = str(default_model_dir())
    from eaas.runtime.models.arch import read_model_info as _read_info
    from eaas.runtime.models.compute import choose_compute

    hidden = _read_info(model_dir).hidden_size
    compute = choose_compute(torch_dtype, dev, cpu_bf16_compute, (32, hidden, hidden))
    log.info("%s", compute.log_line())

    from eaas.runtime.client.failure_report import FailureReporter
    from eaas.runtime.client.table_push import BearerToken, TablePush

    token = None
    if push_token_file:
        token = BearerToken(push_token_file)
        token.get()  # a missing/empty Secret fails the start, loudly
    dispatcher = watcher = cm_watcher = reporter = None
    if local_experts:
        model, tokenizer, info = load_attention_model(
            model_dir, torch_dtype, device=dev, compute_dtype=compute.compute_dtype
        )
    else:
        if not routing_table and not routing_table_configmap:
            raise ValueError(
                "--routing-table or --routing-table-configmap is required unless "
                "--local-experts is given"
            )
        from eaas.runtime.client.dispatch import Dispatcher, RoutingTableWatcher, experts_factory
        from eaas.runtime.models.arch import read_model_info

        info = read_model_info(model_dir)
        graphs = None
        if cuda_graphs:
            from eaas.runtime.gpu.graphs import GraphRoundTrips

            graphs = GraphRoundTrips(max_num_seqs, timeout_s=dispatch_timeout)
        connect_kw: dict[str, Any] = {}
        if spin_us is not None:  # --spin-us: the shm / cudaipc wait for an answer
            from eaas.runtime.client.dispatch import _default_connect

            def connect_spin(endpoint: str, server_id: str, **kw):
                if endpoint.startswith(("unix:", "cudaipc:")):
                    kw["spin_us"] = spin_us
                    if spin_us == 0 and endpoint.startswith("unix:"):
                        kw["max_spin_us"] = 0.0  # block at once: no adaptive spin either
                return _default_connect(endpoint, server_id, **kw)

            connect_kw["connect"] = connect_spin
        if nvshmem_world is not None:
            from eaas.runtime.client.dispatch import _default_connect
            from eaas.runtime.transport.nvshmem import WorldSpec, open_world

            world = open_world(
                nvshmem_world, WorldSpec(nvshmem_world.world_size, info.hidden_size, torch_dtype)
            )

            def connect_in_world(endpoint: str, server_id: str, **kw):
                if endpoint.startswith("nvshmem:"):
                    kw["world"] = world
                return _default_connect(endpoint, server_id, **kw)

            connect_kw["connect"] = connect_in_world
        dispatcher = Dispatcher(
            client_id,
            info.hidden_size,
            torch_dtype,
            timeout=dispatch_timeout,
            graphs=graphs,
            moe_layers=info.moe_layers,
            **connect_kw,
        )
        if failure_report_url:
            reporter = FailureReporter(failure_report_url, str(client_id), token).start()
            dispatcher.on_server_down = reporter.report
        if routing_table:
            watcher = RoutingTableWatcher(routing_table, dispatcher)
            watcher.load_now()
        if routing_table_configmap:
            from eaas.runtime.client.table_watch import ConfigMapTableWatcher

            cm_watcher = ConfigMapTableWatcher(routing_table_configmap, dispatcher)
            cm_watcher.load_now()
        model, tokenizer, info = load_attention_model(
            model_dir,
            torch_dtype,
            experts_factory=experts_factory(dispatcher),
            device=dev,
            compute_dtype=compute.compute_dtype,
        )
        if watcher is not None:
            watcher.start()
        if cm_watcher is not None:
            cm_watcher.start()

    from eaas.runtime.client.api import OpenAIServer, create_app
    from eaas.runtime.client.engine import Engine

    try:
        engine = Engine(
            model,
            tokenizer,
            client_id=str(client_id),
            max_num_seqs=max_num_seqs,
            kv_cache_memory=kv_bytes,
            max_num_batched_tokens=max_num_batched_tokens,
            double_batch_overlap=double_batch_overlap,
            prefill_tokens_while_decoding=prefill_tokens_while_decoding,
        )
    except ValueError as e:  # e.g. a KV cache smaller than one longest sequence: usage error
        import typer

        raise typer.BadParameter(str(e)) from None
    engine.start()
    kv = engine.kv_cache_usage()
    log.info(
        "device %s, KV cache %d blocks x %d tokens (%.1f MiB)",
        dev,
        kv["blocks_total"],
        kv["block_size"],
        kv["bytes"] / 2**20,
    )

    # dense weights in the compute dtype (float32 copies under the fp32 policy; routed experts
    # too in --local-experts mode)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for mod in model.modules():
        for w in getattr(mod, "hosted", {}).values():
            weight_bytes += sum(t.numel() * t.element_size() for t in (w.gate, w.up, w.down))

    def health_extra() -> dict:
        extra = {"device": str(dev), "kv_cache": engine.kv_cache_usage()}
        extra["compute"] = {**compute.as_dict(), "weight_bytes": weight_bytes}
        if double_batch_overlap:  # the runner's counters: overlapped steps, overlap achieved
            extra["double_batch_overlap"] = dict(getattr(engine.runner, "stats", {}))
        if dispatcher is None:
            return {"mode": "local-experts", **extra}
        out = {"mode": "disaggregated", **extra, **dispatcher.health()}
        if dispatcher.table is None:  # e.g. the ConfigMap does not exist yet: nothing is served
            out["uncovered_experts"] = len(info.moe_layers) * info.num_experts
            out["reason"] = "no routing table yet"
        return out

    name = served_model_name or Path(model_dir).name
    server = OpenAIServer(
        engine,
        tokenizer,
        name,
        info.max_position_embeddings,
        info.vocab_size,
        str(client_id),
        health_extra,
        **({"max_request_body": parse_memory_size(max_request_body)} if max_request_body else {}),
    )
    app = create_app(server)
    app.state.table_push = TablePush(
        dispatcher, token, str(client_id), info.num_experts, tuple(info.moe_layers)
    )

    import contextlib
    import signal

    import uvicorn

    class _Server(uvicorn.Server):
        # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown (the process then dies by
        # the signal, skipping our cleanup); we handle the signals ourselves and exit with 0.
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    sock = bind_listener(host, port, reuse_port)
    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S) + 2,
        lifespan="off",
    )
    userver = _Server(config)

    loop_box: list[asyncio.AbstractEventLoop] = []

    def _on_signal(signum, _frame) -> None:
        if userver.should_exit and signum == signal.SIGINT:
            userver.force_exit = True
        elif not userver.should_exit and loop_box:
            # Requests still running after SHUTDOWN_GRACE_S end with 503 server_shutting_down
            # (the stream gets an error event), before uvicorn's graceful timeout cuts them.
            loop = loop_box[0]
            loop.call_soon_threadsafe(loop.call_later, SHUTDOWN_GRACE_S, server.shut_down)
        userver.should_exit = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    async def main() -> None:
        loop_box.append(asyncio.get_running_loop())
        task = asyncio.create_task(userver.serve(sockets=[sock]))
        while not userver.started and not task.done():
            await asyncio.sleep(0.05)
        if userver.started:
            mode = "local experts" if dispatcher is None else f"routing table v{dispatcher.version}"
            print(
                f"attention-client {client_id} ready on http://{host}:{port} (model {name}, "
                f"{mode}, {dev})",
                flush=True,
            )
        await task

    try:
        asyncio.run(main())
    finally:
        engine.stop()
        if watcher is not None:
            watcher.stop()
        if cm_watcher is not None:
            cm_watcher.stop()
        if reporter is not None:
            reporter.close()
        if dispatcher is not None:
            dispatcher.close()
        sock.close()
