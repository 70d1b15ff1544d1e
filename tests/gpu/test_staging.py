"""The dispatcher's staging of hidden states (:mod:`eaas.runtime.client.dispatch.staging`).

Hidden states on a GPU stay on the GPU for connections whose payload is there (``cudaipc`` with
a CUDA payload, ``nvshmem``); host connections get ONE host copy per call. On the CPU the same
dispatcher code path runs with host staging (real servers over ``unix`` and the ``cudaipc``
host emulation); the device path itself runs only on a GPU (``gpu``).
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import eaas.runtime.client.dispatch.call as dispatch_mod
from eaas.runtime.client.dispatch import Dispatcher
from eaas.runtime.client.dispatch.staging import FrameStaging, device_frames, staging_device
from eaas.runtime.tables.table import RoutingTable
from eaas.runtime.transport.factory import connect

from helpers.dispatch import wait_all_connected
from helpers.server import HIDDEN, INTER, SEED, SPEC, reference, start_server

pytestmark = pytest.mark.timeout(180)

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.gpu_cpu
def test_staging_decisions():
    dev_conn = SimpleNamespace(device_payload=True)  # stands in for a CUDA-payload connection
    host_conn = SimpleNamespace()
    assert device_frames(dev_conn) and not device_frames(host_conn) and not device_frames(None)
    # the host path unless the hidden states are on a GPU AND some connection takes them there
    assert staging_device(CUDA, [host_conn, None, dev_conn]) == CUDA
    assert staging_device(CUDA, [host_conn, None]) == CPU
    assert staging_device(CUDA, []) == CPU
    assert staging_device(CPU, [dev_conn]) == CPU
    h = torch.randn(4, 8)
    st = FrameStaging(h)
    assert st.hidden_for(host_conn) is h and st.hidden_for(dev_conn) is h
    assert st.host_copies == 0
    rows = torch.tensor([2, 0])
    assert FrameStaging.rows_on(rows, h) is rows


def _table(servers: dict[str, str]) -> RoutingTable:
    sids = sorted(servers)
    return RoutingTable(
        version=1,
        num_experts=4,
        servers=servers,
        layers={1: tuple(tuple(sids) for _ in range(4)), 2: tuple(tuple(sids) for _ in range(2))},
    )


def _batch(seed: int, n: int = 12, k: int = 2):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, HIDDEN, generator=g)
    ex = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(n)])
    return h, ex, torch.rand(n, k, generator=g)


@pytest.mark.gpu_cpu
def test_host_staging_over_unix_and_cudaipc_host_emulation(tmp_path):
    """CPU hidden states, one ``unix`` and one ``cudaipc`` (host payload) server: the staging
    code path with host connections; every call exact, both servers used."""
    a = start_server(f"unix:{tmp_path}/a.sock")
    b = start_server(f"cudaipc:{tmp_path}/b.sock")
    d = Dispatcher(
        0,
        HIDDEN,
        torch.float32,
        timeout=30.0,
        connect=lambda e, sid, **kw: connect(
            e, sid, **({"payload": "host"} if e.startswith("cudaipc:") else {}), **kw
        ),
    )
    try:
        d.set_table(_table({"a": a.endpoint, "b": b.endpoint}))
        # both first connections open: a call while one is still opening goes to the other
        # replica alone (every expert is covered, so the plan does not wait for it)
        wait_all_connected(d.health)
        for seed in range(6):
            h, ex, w = _batch(seed)
            out = d.dispatch(1, h, ex, w)
            assert out.device == CPU
            torch.testing.assert_close(out, reference(1, h, ex, w))
        servers = d.health()["servers"]
        assert servers["a"]["tokens_sent"] > 0 and servers["b"]["tokens_sent"] > 0
        c = connect(b.endpoint, "b", hidden_size=HIDDEN, dtype=torch.float32, payload="host")
        assert not device_frames(c)  # the host emulation stages through host memory
        c.close()
    finally:
        d.close()
        a.stop()
        b.stop()


@pytest.mark.gpu
def test_device_hidden_states_skip_the_host_for_cuda_payload_servers(tmp_path, monkeypatch):
    """Hidden states on the GPU: a ``cudaipc`` CUDA-payload server gets them without a host
    copy; adding a ``unix`` server costs exactly one host copy per call; outputs exact."""
    made: list[FrameStaging] = []

    class Counting(FrameStaging):
        def __init__(self, hidden):
            super().__init__(hidden)
            made.append(self)

    monkeypatch.setattr(dispatch_mod, "FrameStaging", Counting)
    ep = f"cudaipc:{tmp_path}/g.sock"
    gpu = subprocess.Popen(
        [sys.executable, "-m", "eaas.runtime.server.main", "--listen", ep, "--experts", SPEC,
         "--random", f"{HIDDEN}:{INTER}:{SEED}", "--device", "cuda"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    host = start_server(f"unix:{tmp_path}/h.sock")
    try:
        assert "ready on" in (gpu.stdout.readline() if gpu.stdout else "")
        for servers, copies in (({"g": ep}, 0), ({"g": ep, "h": host.endpoint}, 1)):
            # split_pairs=1: every expert's pairs (~6 per call) are dealt over both replicas, so
            # each call reaches both servers (the default keeps a small call's experts on one
            # replica and alternates g, h, g, h: host copies [0, 1, 0, 1])
            d = Dispatcher(0, HIDDEN, torch.float32, timeout=30.0, split_pairs=1)
            d.set_table(_table(servers))
            # every first connection open: a call while h's is still opening would go to g
            # alone (no host copy), as every expert is covered
            wait_all_connected(d.health)
            made.clear()
            for seed in range(4):
                h, ex, w = _batch(seed)
                out = d.dispatch(1, h.to(CUDA), ex.to(CUDA), w.to(CUDA))
                assert out.device.type == "cuda"
                torch.testing.assert_close(out.cpu(), reference(1, h, ex, w), rtol=1e-4, atol=1e-5)
            assert made and all(s.hidden.device.type == "cuda" for s in made)
            assert [s.host_copies for s in made] == [copies] * len(made), servers
            d.close()
    finally:
        gpu.kill()
        gpu.wait(20)
        host.stop()
