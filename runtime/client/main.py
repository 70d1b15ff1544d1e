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
import contextlib
import logging
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import typer
import uvicorn

from eaas.runtime.client.api.app import create_app
from eaas.runtime.client.api.server import OpenAIServer
from eaas.runtime.client.dispatch import Dispatcher
from eaas.runtime.client.engine import Engine
from eaas.runtime.client.failure_report import FailureReporter
from eaas.runtime.client.graphs import GraphRoundTrips, check_cuda_graphs
from eaas.runtime.client.kv_cache import parse_memory_size
from eaas.runtime.client.moe import experts_factory
from eaas.runtime.common.dtypes import torch_dtype
from eaas.runtime.common.logs import configure_logging
from eaas.runtime.cuda.device import resolve_device
from eaas.runtime.models.arch import read_model_info
from eaas.runtime.models.attention import load_attention_model
from eaas.runtime.models.compute import choose_compute
from eaas.runtime.models.tiny import default_model_dir
from eaas.runtime.options import AttentionClientOptions
from eaas.runtime.tables.file_watch import RoutingTableWatcher
from eaas.runtime.tables.push import BearerToken, TablePush
from eaas.runtime.tables.watch import ConfigMapTableWatcher
from eaas.runtime.transport.factory import connect as transport_connect
from eaas.runtime.transport.nvshmem import WorldConfig, WorldSpec, open_world

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


def connect_with_options(
    spin_us: float | None,
    world: Any = None,
    connect: Callable[..., Any] = transport_connect,
) -> Callable[..., Any] | None:
    """The :class:`~eaas.runtime.client.dispatch.Dispatcher`'s ``connect``: ``connect`` with the
    client's per-transport options added, or None when there are none (the default connect).

    Args:
        spin_us: ``--spin-us`` (microseconds; None: the transport's own busy-poll): given to
            ``unix:`` and ``cudaipc:`` endpoints; 0 on ``unix:`` also turns the adaptive spin
            off (``max_spin_us=0``: block at once).
        world: the joined NVSHMEM world (:func:`~eaas.runtime.transport.nvshmem.open_world`):
            given to ``nvshmem:`` endpoints.
        connect: ``(endpoint, server_id, **kw) -> ClientConnection``.

    Both apply together: a client in an NVSHMEM world still spins on its shm / cudaipc servers.
    """
    if spin_us is None and world is None:
        return None

    def connect_endpoint(endpoint: str, server_id: str, **kw: Any) -> Any:
        if spin_us is not None and endpoint.startswith(("unix:", "cudaipc:")):
            kw["spin_us"] = spin_us
            if spin_us == 0 and endpoint.startswith("unix:"):
                kw["max_spin_us"] = 0.0  # block at once: no adaptive spin either
        if world is not None and endpoint.startswith("nvshmem:"):
            kw["world"] = world
        return connect(endpoint, server_id, **kw)

    return connect_endpoint


def run_attention_client(
    options: AttentionClientOptions, world_config: WorldConfig | None = None
) -> None:
    """Run one attention client with ``options`` until SIGINT/SIGTERM.

    Routing-table sources (any of them; newer versions win): ``options.routing_table`` (a JSON
    file, polled), ``options.routing_table_configmap`` (``NAMESPACE/NAME``, watched through the
    API: :mod:`.table_watch`) and pushes to ``PUT /routing-table`` authenticated with the token
    in ``options.push_token_file`` (:mod:`.table_push`). ``options.failure_report_url``: where
    servers marked down are reported (:mod:`.failure_report`, same token). The other options
    (device, KV-cache budget, engine, ``spin_us``) are described on
    :class:`~eaas.runtime.options.AttentionClientOptions` and by ``eaas attention-client --help``.

    Args:
        world_config: the NVSHMEM world to join before connecting (``nvshmem:PE`` endpoints use
            it; the CLI builds it from the ``--nvshmem-*`` options, claiming a client PE).

    Raises:
        ValueError: a bad ``device``, ``kv_cache_memory``, ``routing_table_configmap``, an empty
            token file; ``cuda_graphs`` without a CUDA device or expert servers.
        typer.BadParameter: a KV cache smaller than one longest sequence (exit code 2 in the CLI).
        OSError / RoutingTableError: unreadable routing table or token file at start-up, port
            in use.
    """
    o = options
    client_id = o.numeric_client_id
    configure_logging(f"client-{client_id}")
    dtype = torch_dtype(o.dtype)
    dev = resolve_device(o.device)
    if o.cuda_graphs:
        check_cuda_graphs(dev.type, o.local_experts)
    kv_mem = o.kv_cache_memory
    kv_bytes = None if kv_mem in (None, "", "auto") else parse_memory_size(kv_mem)
    if o.threads > 0:
        torch.set_num_threads(o.threads)
    model_dir = o.model if o.model is not None else str(default_model_dir())
    hidden = read_model_info(model_dir).hidden_size
    compute = choose_compute(dtype, dev, o.cpu_bf16_compute, (32, hidden, hidden))
    log.info("%s", compute.log_line())

    token = None
    if o.push_token_file:
        token = BearerToken(o.push_token_file)
        token.get()  # a missing/empty Secret fails the start, loudly
    dispatcher = watcher = cm_watcher = reporter = None
    if o.local_experts:
        model, tokenizer, info = load_attention_model(
            model_dir, dtype, device=dev, compute_dtype=compute.compute_dtype
        )
    else:
        info = read_model_info(model_dir)
        graphs = None
        if o.cuda_graphs:
            graphs = GraphRoundTrips(o.max_num_seqs, timeout_s=o.dispatch_timeout)
        world = None
        if world_config is not None:
            spec = WorldSpec(world_config.world_size, info.hidden_size, dtype)
            world = open_world(world_config, spec)
        connect = connect_with_options(o.spin_us, world)
        # None: the dispatcher's own default connect
        extra: dict[str, Any] = {"connect": connect} if connect is not None else {}
        dispatcher = Dispatcher(
            client_id,
            info.hidden_size,
            dtype,
            timeout=o.dispatch_timeout,
            graphs=graphs,
            moe_layers=info.moe_layers,
            **extra,
        )
        if o.failure_report_url:
            reporter = FailureReporter(o.failure_report_url, str(client_id), token).start()
            dispatcher.on_server_down = reporter.report
        if o.routing_table:
            watcher = RoutingTableWatcher(o.routing_table, dispatcher)
            watcher.load_now()
        if o.routing_table_configmap:
            cm_watcher = ConfigMapTableWatcher(o.routing_table_configmap, dispatcher)
            cm_watcher.load_now()
        model, tokenizer, info = load_attention_model(
            model_dir,
            dtype,
            experts_factory=experts_factory(dispatcher),
            device=dev,
            compute_dtype=compute.compute_dtype,
        )
        if watcher is not None:
            watcher.start()
        if cm_watcher is not None:
            cm_watcher.start()

    try:
        engine = Engine(
            model,
            tokenizer,
            client_id=str(client_id),
            max_num_seqs=o.max_num_seqs,
            kv_cache_memory=kv_bytes,
            max_num_batched_tokens=o.max_num_batched_tokens,
            double_batch_overlap=o.double_batch_overlap,
            prefill_tokens_while_decoding=o.prefill_tokens_while_decoding,
        )
    except ValueError as e:  # e.g. a KV cache smaller than one longest sequence: usage error
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
        if o.double_batch_overlap:  # the runner's counters: overlapped steps, overlap achieved
            extra["double_batch_overlap"] = dict(getattr(engine.runner, "stats", {}))
        if dispatcher is None:
            return {"mode": "local-experts", **extra}
        out = {"mode": "disaggregated", **extra, **dispatcher.health()}
        if dispatcher.table is None:  # e.g. the ConfigMap does not exist yet: nothing is served
            out["uncovered_experts"] = len(info.moe_layers) * info.num_experts
            out["reason"] = "no routing table yet"
        return out

    names = [n.strip() for n in (o.served_model_name or "").split(",") if n.strip()]
    name = names[0] if names else Path(model_dir).name
    body = {"max_request_body": parse_memory_size(o.max_request_body)} if o.max_request_body else {}
    server = OpenAIServer(
        engine,
        tokenizer,
        name,
        info.max_position_embeddings,
        info.vocab_size,
        str(client_id),
        health_extra,
        api_keys=o.api_key,
        aliases=tuple(names[1:]),
        **body,
    )
    app = create_app(server)
    app.state.table_push = TablePush(
        dispatcher, token, str(client_id), info.num_experts, tuple(info.moe_layers)
    )

    class ServerLink(uvicorn.Server):
        # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown (the process then dies by
        # the signal, skipping our cleanup); we handle the signals ourselves and exit with 0.
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    sock = bind_listener(o.host, o.port, o.reuse_port)
    config = uvicorn.Config(
        app,
        log_level="warning",
        log_config=None,  # uvicorn's records go through configure_logging's format
        access_log=False,
        timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S) + 2,
        lifespan="off",
    )
    userver = ServerLink(config)

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
                f"attention-client {client_id} ready on http://{o.host}:{o.port} (model {name}, "
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
