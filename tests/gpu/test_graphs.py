"""CUDA-graph decode round trip: bucket choice on the CPU; capture/replay against a real expert
server process over cudaipc on a GPU."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eaas.runtime.gpu.graphs import choose_bucket, default_buckets

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from srv_helpers import HIDDEN, INTER, SEED, SPEC, reference  # noqa: E402


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

    from eaas.runtime.gpu.graphs import DecodeRoundTripGraph
    from eaas.runtime.transport.base import DeadlineExceeded, RequestFrame
    from eaas.runtime.transport.factory import connect

    ep = f"cudaipc:{tmp_path}/g.sock"
    srv = subprocess.Popen(
        [sys.executable, "-m", "eaas.runtime.expert_server", "--listen", ep, "--experts", SPEC,
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
