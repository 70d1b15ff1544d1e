"""Expert server process: start the HTTP side port, learn experts from the routing table, serve.

:func:`run` starts metrics, installs the signal handlers, prints the ready line and runs the
serving loop of an :class:`~eaas.runtime.server.server.ExpertServer`; :func:`start_http` starts
``/health`` + ``/metrics`` (:mod:`eaas.runtime.server.http`) before the weights load;
:func:`learn_from_table` makes a server learn its experts from the routing table.

Run it with ``eaas expert-server`` (checkpoint weights) or, for tests and benchmarks,
``python -m eaas.runtime.server.main --random HIDDEN:INTER:SEED ...`` (random weights,
:func:`random_experts`). Readiness: the process prints ``expert-server <id> ready on <endpoint>
hosting <N> experts`` to stdout (flushed) once the listener accepts connections and the serving
loop has started (so ``/health`` answers 200 from then on); the Unix socket file / TCP port
accepting connections is an equivalent signal for the data plane. No separate marker file.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch
from prometheus_client import start_http_server

from eaas.runtime.common.dtypes import SERVING_DTYPES, torch_dtype
from eaas.runtime.experts import ExpertWeights
from eaas.runtime.metrics import multiprocess_dir
from eaas.runtime.server.assignment import ServerAssignment, TableEndpoint
from eaas.runtime.server.http import ServerHealth, ServerHTTP
from eaas.runtime.server.server import ExpertServer
from eaas.runtime.tables.expert_spec import parse_expert_spec
from eaas.runtime.tables.push import BearerToken
from eaas.runtime.tables.watch import ConfigMapTableWatcher


def random_experts(
    pairs, hidden_size: int, intermediate: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> dict[tuple[int, int], ExpertWeights]:
    """Deterministic random expert weights for tests and benchmarks.

    Each ``(layer, e)`` gets weights from its own generator seeded by ``(seed, layer, e)``, so a
    server hosting a subset gets exactly the same tensors as a reference hosting all of them.
    Shapes: gate/up ``[intermediate, hidden]``, down ``[hidden, intermediate]``; scaled by
    ``1/sqrt(fan_in)``; created in float32 then cast to ``dtype``.
    """
    out = {}
    for layer, e in pairs:
        g = torch.Generator().manual_seed(seed * 1_000_003 + int(layer) * 10_007 + int(e))
        gate = torch.randn(intermediate, hidden_size, generator=g) / hidden_size**0.5
        up = torch.randn(intermediate, hidden_size, generator=g) / hidden_size**0.5
        down = torch.randn(hidden_size, intermediate, generator=g) / intermediate**0.5
        out[(int(layer), int(e))] = ExpertWeights(gate.to(dtype), up.to(dtype), down.to(dtype))
    return out


def run(server: ExpertServer, metrics_port: int = 0, health=None) -> None:
    """Start metrics (if asked), install signal handlers, print the ready line, serve.

    ``health``: the :class:`eaas.runtime.server.http.ServerHealth` of ``--http-port`` (if any);
    it gets the server now and is marked stopping when the loop ends.
    """
    if health is not None:
        health.attach(server)

    if metrics_port and not multiprocess_dir():
        start_http_server(int(metrics_port))
    server.install_signal_handlers()
    # the objects of start-up (torch, weights, modules) out of the cyclic GC's reach: a full
    # collection over them paused the serve loop for ~100-300 ms (see Engine.start)
    gc.collect()
    gc.freeze()
    try:
        server.serve_forever(on_started=lambda: print(server.ready_line(), flush=True))
    finally:
        gc.unfreeze()
        if health is not None:
            health.stopping = True
        print(server.traffic.exit_line(server.server_id), flush=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m eaas.runtime.server.main``: random-weight server for tests/benchmarks."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", required=True)
    p.add_argument(
        "--experts",
        default=None,
        help="spec like '1:0-3,7;2:5' (default: none, learnt from the routing table)",
    )
    p.add_argument("--push-token-file", default=None, help="accept PUT /routing-table")
    p.add_argument("--routing-table-configmap", default=None, help="NAMESPACE/NAME to watch")
    p.add_argument("--random", required=True, help="HIDDEN:INTER:SEED random weights")
    p.add_argument("--server-id", default="s0")
    p.add_argument("--dtype", default="float32", choices=SERVING_DTYPES)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--http-port", type=int, default=None, help="/health + /metrics port")
    p.add_argument("--health-stale-s", type=float, default=5.0)
    p.add_argument("--batch-window-us", type=float, default=0.0)
    p.add_argument("--spin-us", type=float, default=None)
    p.add_argument(
        "--device", default="cpu", help="cpu, or cuda[:N]: weights there, native grouped kernels"
    )
    a = p.parse_args(argv)
    hidden, inter, seed = (int(x) for x in a.random.split(":"))
    dtype = torch_dtype(a.dtype)
    if a.experts is None and not (a.push_token_file or a.routing_table_configmap):
        p.error("--experts is required unless --push-token-file or --routing-table-configmap")
    pairs = parse_expert_spec(a.experts) if a.experts else []
    hosted = random_experts(pairs, hidden, inter, dtype, seed)
    if a.device != "cpu":
        dev = torch.device(a.device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            p.error(f"--device {a.device}: expected cpu or cuda[:N] with a visible CUDA device")
        hosted = {key: w.to(dev) for key, w in hosted.items()}
    kw: dict = {} if a.spin_us is None else {"spin_us": a.spin_us}
    if a.listen.startswith("cudaipc:"):  # CUDA-payload clients only for a server on cuda
        kw["compute_device"] = a.device
    health = start_http(a.server_id, a.http_port, a.health_stale_s)
    server = ExpertServer(
        a.listen,
        hosted,
        hidden,
        dtype,
        a.server_id,
        num_threads=a.threads,
        batch_window_us=a.batch_window_us,
        device=a.device,
        **kw,
    )
    del hosted  # the server keeps its own copies (stacked per layer on the CPU)
    try:
        learn_from_table(
            server,
            health,
            lambda pairs: random_experts(pairs, hidden, inter, dtype, seed),
            push_token_file=a.push_token_file,
            routing_table_configmap=a.routing_table_configmap,
        )
    except ValueError as exc:
        p.error(str(exc))
    run(server, a.metrics_port, health)


def learn_from_table(
    server: ExpertServer,
    health,
    loader,
    *,
    push_token_file: str | None = None,
    routing_table_configmap: str | None = None,
    num_experts: int | None = None,
    moe_layers=None,
):
    """Make ``server`` learn its experts from the routing table (:mod:`eaas.runtime.server.assignment`):
    pushed to ``PUT /routing-table`` on the HTTP port (``push_token_file``: the bearer token's
    file) and/or watched from a ConfigMap (``routing_table_configmap``: ``NAMESPACE/NAME``;
    then the newest two versions' experts are kept, as no operator releases them).

    Returns:
        the started :class:`~eaas.runtime.server.assignment.ServerAssignment`, or None when neither
        source is given (experts fixed by the command line).

    Raises:
        ValueError: ``push_token_file`` without an HTTP port (``health`` None), or a malformed
            ConfigMap reference.
    """
    if not push_token_file and not routing_table_configmap:
        return None
    assignment = ServerAssignment(
        server,
        server.server_id,
        loader,
        auto_release=bool(routing_table_configmap) and not push_token_file,
    ).start()
    if push_token_file:
        if health is None:
            raise ValueError("--push-token-file needs --http-port (PUT /routing-table)")

        health.table = TableEndpoint(
            assignment, BearerToken(push_token_file), num_experts, moe_layers
        )
    elif health is not None:
        health.table = TableEndpoint(assignment, None, num_experts, moe_layers)
    if routing_table_configmap:
        ConfigMapTableWatcher(routing_table_configmap, assignment).start()
    return assignment


def start_http(server_id: str, http_port: int | None, stale_after_s: float, host: str = "0.0.0.0"):
    """Start ``/health`` + ``/metrics`` (:mod:`eaas.runtime.server.http`) before the weights load;
    returns its :class:`~eaas.runtime.server.http.ServerHealth` (None without ``http_port``)."""
    if http_port is None:
        return None
    health = ServerHealth(server_id, stale_after_s)
    http = ServerHTTP(health, http_port, host).start()
    print(
        f"expert-server {server_id} http on {host}:{http.port} (/health, /metrics)",
        file=sys.stderr,
        flush=True,
    )
    return health


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
