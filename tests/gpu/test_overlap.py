"""Double-batch overlap: same output as overlap off, and attention of one micro-batch is issued
while the other's MoE round trip is in flight (a toy decode stack with real expert math and a
thread pool standing in for the expert servers)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from eaas.runtime.client.overlap import Op, run_decode_layers, schedule, split_batch
from eaas.runtime.server.compute import grouped_expert_sum
from eaas.runtime.server.main import random_experts

H, I, E, K, L = 32, 48, 8, 2, 3


class ToyStack:
    """Per-row 'attention' (a per-sequence state mixes in, like a KV cache), a router, experts
    computed asynchronously on a pool, combine = residual + expert sum."""

    def __init__(self, batch: int):
        g = torch.Generator().manual_seed(0)
        self.state = torch.randn(batch, H, generator=g)  # per-sequence (KV-cache stand-in)
        self.wq = [torch.randn(H, H, generator=g) / H**0.5 for _ in range(L)]
        self.gate = [torch.randn(E, H, generator=g) for _ in range(L)]
        self.experts = [
            {e: w for (_, e), w in random_experts([(l, e) for e in range(E)], H, I).items()}
            for l in range(L)
        ]
        self.pool = ThreadPoolExecutor(2)
        self.in_flight = 0
        self.attn_while_in_flight = 0
        self.lock = threading.Lock()

    def attention(self, layer, h, rows):
        with self.lock:
            if self.in_flight:
                self.attn_while_in_flight += 1
        return h + torch.tanh((h + self.state[rows]) @ self.wq[layer])

    def dispatch(self, layer, h, rows):
        scores = torch.softmax(h @ self.gate[layer].T, -1)
        w, ex = torch.topk(scores, K, -1)
        with self.lock:
            self.in_flight += 1

        def work():
            out, _ = grouped_expert_sum(h, ex.to(torch.int32), w, self.experts[layer])
            return out

        return self.pool.submit(work)

    def combine(self, layer, h, fut):
        y = fut.result(timeout=30)
        with self.lock:
            self.in_flight -= 1
        return h + y


@pytest.mark.parametrize("batch", [1, 2, 7, 64])
def test_overlap_output_identical_to_overlap_off(batch):
    x = torch.randn(batch, H, generator=torch.Generator().manual_seed(batch))
    off_stack, on_stack = ToyStack(batch), ToyStack(batch)
    off = run_decode_layers(off_stack, x, L, overlap=False)
    on = run_decode_layers(on_stack, x, L, overlap=True)
    assert on.shape == (batch, H)
    # same operations per row; only the GEMM row count differs (BLAS may block a 4-row and an
    # 8-row matmul differently), so equal up to float32 reassociation
    torch.testing.assert_close(on, off, rtol=1e-4, atol=1e-4)
    assert off_stack.attn_while_in_flight == 0
    # with two micro-batches (ping-pong), every attention but the very first runs while the
    # other micro-batch's experts are out: 2L - 1
    assert on_stack.attn_while_in_flight == (2 * L - 1 if batch > 1 else 0)


def test_schedule_interleaves_and_keeps_each_micro_batch_in_order():
    ops = schedule(2, 2)
    assert ops == [
        Op("attn", 0, 0), Op("dispatch", 0, 0), Op("attn", 1, 0), Op("dispatch", 1, 0),
        Op("combine", 0, 0), Op("attn", 0, 1), Op("dispatch", 0, 1),
        Op("combine", 1, 0), Op("attn", 1, 1), Op("dispatch", 1, 1),
        Op("combine", 0, 1), Op("combine", 1, 1),
    ]  # fmt: skip
    assert schedule(0, 2) == [] and schedule(0, 1) == []
    for m in (0, 1):
        mine = [(o.kind, o.layer) for o in ops if o.micro == m]
        assert mine == [(k, l) for l in range(2) for k in ("attn", "dispatch", "combine")]
    assert schedule(2, 1) == [
        Op(k, 0, l) for l in range(2) for k in ("attn", "dispatch", "combine")
    ]


def test_split_batch():
    assert split_batch(1) == [slice(0, 1)]
    assert split_batch(5) == [slice(0, 3), slice(3, 5)]
    with pytest.raises(ValueError):
        split_batch(0)
    with pytest.raises(ValueError):
        schedule(1, 3)


def test_micro_batch_streams_are_no_ops_on_the_cpu():
    from eaas.runtime.client.overlap import MicroBatchStreams, record_event, wait_event

    s = MicroBatchStreams(torch.device("cpu"), 2)
    x = torch.ones(3)
    assert s.streams == [] and not s.cuda
    s.start(x)
    with s.on(1):
        y = x * 2
    s.finish([y])
    assert record_event(torch.device("cpu")) is None
    wait_event(None, torch.device("cpu"), y)  # nothing to wait for
    assert y.tolist() == [2.0, 2.0, 2.0]


class _CudaStack:
    """Toy decode stack on the GPU: the MoE stand-in runs on a worker thread ordered by events
    (:func:`record_event` / :func:`wait_event`, as the engine's overlap runner does); records
    the stream each micro-batch's attention ran on."""

    def __init__(self, device):
        g = torch.Generator().manual_seed(1)
        self.dev = device
        self.wq = [(torch.randn(H, H, generator=g) / H**0.5).to(device) for _ in range(L)]
        self.wm = [(torch.randn(H, H, generator=g) / H**0.5).to(device) for _ in range(L)]
        self.pool = ThreadPoolExecutor(1)
        self.attn_streams: dict[int, set[int]] = {}

    def attention(self, layer, h, rows):
        st = torch.cuda.current_stream(self.dev)
        self.attn_streams.setdefault(rows.start, set()).add(st.cuda_stream)
        for _ in range(20):  # enough device work for a missing wait to show
            h = h + torch.tanh(h @ self.wq[layer]) * 0.05
        return h

    def dispatch(self, layer, h, rows):
        from eaas.runtime.client.overlap import record_event, wait_event

        ready = record_event(self.dev)

        def moe():
            wait_event(ready, self.dev, h)
            out = torch.relu(h @ self.wm[layer])
            return out, record_event(self.dev)

        return self.pool.submit(moe)

    def combine(self, layer, h, fut):
        from eaas.runtime.client.overlap import wait_event

        out, done = fut.result(timeout=60)
        wait_event(done, self.dev, out)
        return h + out


@pytest.mark.gpu
def test_micro_batches_run_on_their_own_cuda_streams_with_identical_output():
    dev = torch.device("cuda")
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(3)).to(dev)
    off_stack, on_stack = _CudaStack(dev), _CudaStack(dev)
    off = run_decode_layers(off_stack, x, L, overlap=False)
    on = run_decode_layers(on_stack, x, L, overlap=True)
    torch.cuda.synchronize()
    torch.testing.assert_close(on, off, rtol=1e-4, atol=1e-4)
    default = torch.cuda.default_stream(dev).cuda_stream
    a, b = on_stack.attn_streams[0], on_stack.attn_streams[32]
    assert len(a) == len(b) == 1 and a != b, (a, b)  # one stream per micro-batch
    assert default not in a | b
