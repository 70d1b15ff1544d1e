"""CUDA-graph decode round trip: bucket choice on the CPU; capture/replay against a real expert
server process over cudaipc on a GPU."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from eaas.runtime.client.graphs import (
    check_cuda_graphs,
    choose_bucket,
    default_buckets,
    graph_eligible,
)

from helpers.server import HIDDEN, INTER, SEED, SPEC, reference, start_server


@pytest.mark.gpu_cpu
def test_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    bs = default_buckets(64)
    assert [choose_bucket(n, bs) for n in (1, 3, 4, 5, 33, 64)] == [1, 4, 4, 8, 64, 64]
    with pytest.raises(ValueError, match="exceeds the largest"):
        choose_bucket(65, bs)
    with pytest.raises(ValueError):
        choose_bucket(0, bs)


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_graph_round_trip_replays_and_times_out_on_a_stopped_server(tmp_path):
    import os
    import signal

    from eaas.runtime.client.graphs import DecodeRoundTripGraph
    from eaas.runtime.transport.base import DeadlineExceeded, RequestFrame
    from eaas.runtime.transport.factory import connect

    ep = f"cudaipc:{tmp_path}/g.sock"
    srv = subprocess.Popen(
        [sys.executable, "-m", "eaas.runtime.server.main", "--listen", ep, "--experts", SPEC,
         "--random", f"{HIDDEN}:{INTER}:{SEED}", "--device", "cuda", "--spin-us", "200000"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert "ready on" in srv.stdout.readline()
        c = connect(ep, "s", hidden_size=HIDDEN, dtype=torch.float32, payload="cuda", max_tokens=8)
        x = torch.randn(2, HIDDEN)
        c.send(RequestFrame(1, 1, 1, 0, x, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1)))
        assert c.recv(time.monotonic() + 60).status == 0  # warm: server module load
        g = DecodeRoundTripGraph(c, [1, 4, 8], k=2, timeout_ns=3_000_000_000)
        g.capture()
        for n in (3, 8, 1):
            gen = torch.Generator().manual_seed(n)
            h = torch.randn(n, HIDDEN, generator=gen)
            ex = torch.randint(0, 4, (n, 2), generator=gen, dtype=torch.int32)
            w = torch.rand(n, 2, generator=gen)
            out = g.run(h.cuda(), ex.cuda(), w.cuda())
            g.check()
            torch.testing.assert_close(out.cpu(), reference(1, h, ex, w), rtol=1e-4, atol=1e-5)
        os.kill(srv.pid, signal.SIGSTOP)
        g.run(h.cuda(), ex.cuda(), w.cuda())
        with pytest.raises(DeadlineExceeded, match="device-side wait"):
            g.check()
        os.kill(srv.pid, signal.SIGCONT)
        c.close()
    finally:
        srv.kill()
        srv.wait(20)


@pytest.mark.gpu_cpu
def test_graph_eligible():
    kw = dict(cuda_payload=True, n=4, k=2, max_bucket=64, cap_tokens=256, cap_k=8)
    assert graph_eligible(**kw)
    assert not graph_eligible(**{**kw, "cuda_payload": False})  # host payload / shm / tcp
    assert not graph_eligible(**{**kw, "n": 65})  # a prefill-sized call stays eager
    assert not graph_eligible(**{**kw, "n": 0})
    assert not graph_eligible(**{**kw, "k": 9})  # the slot would have to be remapped
    assert not graph_eligible(**{**kw, "cap_tokens": 32})


@pytest.mark.gpu_cpu
def test_check_cuda_graphs():
    check_cuda_graphs("cuda", False)
    with pytest.raises(ValueError, match="--cuda-graphs needs a CUDA device"):
        check_cuda_graphs("cpu", False)
    with pytest.raises(ValueError, match="--local-experts"):
        check_cuda_graphs("cuda", True)


@pytest.mark.gpu_cpu
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_attention_client_cuda_graphs_on_cpu_is_a_clear_error():
    """``--cuda-graphs`` on a CPU device: exit code 2, one message naming the flag, before any
    model is loaded."""
    for extra in (["--device", "cpu"], []):  # explicit cpu, and auto (= cpu here)
        r = subprocess.run(
            [sys.executable, "-m", "eaas", "attention-client", "--local-experts", "--cuda-graphs"]
            + ["--port", "1", *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )
        out = " ".join((r.stdout + r.stderr).split())
        assert r.returncode == 2, out
        assert "--cuda-graphs needs a CUDA device (--device cuda), got cpu" in out, out
        assert "Traceback" not in out, out


def _dispatcher(ep, graphs, payload):
    from eaas.runtime.client.dispatch import Dispatcher
    from eaas.runtime.tables.table import RoutingTable
    from eaas.runtime.transport.factory import connect

    table = RoutingTable(
        version=1, num_experts=4, servers={"s": ep}, layers={1: tuple(("s",) for _ in range(4))}
    )
    d = Dispatcher(
        0,
        HIDDEN,
        torch.float32,
        timeout=30.0,
        graphs=graphs,
        connect=lambda e, sid, **kw: connect(e, sid, payload=payload, **kw),
    )
    d.set_table(table)
    return d


@pytest.mark.gpu_cpu
@pytest.mark.timeout(120)
def test_dispatcher_with_graphs_keeps_eager_path_for_host_payload(tmp_path):
    """With ``graphs`` set, connections that cannot replay a graph (here cudaipc's host
    emulation) run the eager path: exact answers, no replay counted."""
    from eaas.runtime.client.graphs import GraphRoundTrips

    srv = start_server(f"cudaipc:{tmp_path}/d.sock")
    graphs = GraphRoundTrips(8, timeout_s=30.0)
    d = _dispatcher(srv.endpoint, graphs, "host")
    try:
        for n in (1, 3, 8, 20):
            g = torch.Generator().manual_seed(n)
            h = torch.randn(n, HIDDEN, generator=g)
            ex = torch.randint(0, 4, (n, 2), generator=g)
            w = torch.rand(n, 2, generator=g)
            out = d.dispatch(1, h, ex, w)
            torch.testing.assert_close(
                out, reference(1, h, ex.to(torch.int32), w), rtol=1e-5, atol=1e-6
            )
        assert graphs.replays == 0
    finally:
        d.close()
        srv.stop()


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_dispatcher_replays_graphs_over_cudaipc(tmp_path):
    """``--cuda-graphs`` in the dispatcher: decode-sized calls replay the captured round trip
    (counted), larger ones go eager, all exact, against a GPU expert server."""
    from eaas.runtime.client.graphs import GraphRoundTrips

    ep = f"cudaipc:{tmp_path}/dg.sock"
    srv = subprocess.Popen(
        [sys.executable, "-m", "eaas.runtime.server.main", "--listen", ep, "--experts", SPEC,
         "--random", f"{HIDDEN}:{INTER}:{SEED}", "--device", "cuda"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert "ready on" in srv.stdout.readline()
        graphs = GraphRoundTrips(8, timeout_s=30.0)
        d = _dispatcher(ep, graphs, "cuda")
        for n in (2, 20, 1, 8):
            g = torch.Generator().manual_seed(n)
            h = torch.randn(n, HIDDEN, generator=g)
            ex = torch.randint(0, 4, (n, 2), generator=g)
            w = torch.rand(n, 2, generator=g)
            out = d.dispatch(1, h, ex, w)
            torch.testing.assert_close(
                out.cpu(), reference(1, h, ex.to(torch.int32), w), rtol=1e-4, atol=1e-5
            )
        assert graphs.replays == 3  # n = 2, 1, 8; n = 20 > the largest bucket went eager
        d.close()
    finally:
        srv.kill()
        srv.wait(20)
