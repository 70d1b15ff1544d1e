"""Expert-server grouping of tokens by expert (tensor operations, no Python per token)."""

from __future__ import annotations

import pytest
import torch

from eaas.runtime.experts import weighted_expert_sum
from eaas.runtime.server.compute import grouped_expert_sum
from eaas.runtime.server.main import random_experts

from helpers.server import HIDDEN, INTER

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(1, 1), (1, 8), (64, 8), (300, 2)])
def test_grouped_sum_equals_the_per_expert_reference(dtype, n, k):
    E = 9
    hosted = {
        e: w
        for (_, e), w in random_experts([(1, e) for e in range(E)], HIDDEN, INTER, dtype).items()
    }
    g = torch.Generator().manual_seed(n * 31 + k)
    h = torch.randn(n, HIDDEN, generator=g).to(dtype)
    ex = torch.randint(-1, E, (n, k), generator=g, dtype=torch.int32)
    w = torch.rand(n, k, generator=g)
    out, loads = grouped_expert_sum(h, ex, w, hosted)
    ref = weighted_expert_sum(h, ex, w, hosted)
    assert out.dtype == dtype and out.shape == (n, HIDDEN)
    if dtype == torch.float32:
        # same experts, same weights, accumulated per token in the same (ascending id) order
        assert torch.equal(out, ref), (out - ref).abs().max()
    else:
        # bf16: accumulated in float32 and rounded once, so at least as close to the float32
        # result (same bf16 weights and inputs) as the reference that rounds per expert
        f32 = {e: type(x)(*(t.float() for t in (x.gate, x.up, x.down))) for e, x in hosted.items()}
        truth = weighted_expert_sum(h.float(), ex, w, f32)
        err, ref_err = (out.float() - truth).abs().max(), (ref.float() - truth).abs().max()
        assert err <= ref_err * 1.01 + 1e-6, (err, ref_err)
        torch.testing.assert_close(out.float(), truth, rtol=2e-2, atol=2e-2)
    assert loads == {e: int((ex == e).sum()) for e in range(E) if (ex == e).any()}


def test_all_padding_gives_zeros_and_no_load():
    hosted = {0: random_experts([(1, 0)], HIDDEN, INTER)[(1, 0)]}
    out, loads = grouped_expert_sum(
        torch.randn(5, HIDDEN), torch.full((5, 3), -1), torch.rand(5, 3), hosted
    )
    assert torch.equal(out, torch.zeros(5, HIDDEN)) and loads == {}


def assert_stack_equals_loop(stack, hosted, h, ex, w) -> None:
    """``grouped_expert_sum`` over ``stack`` gives the per-expert loop's loads and outputs: one
    (n, 2I) matmul for gate and up instead of two (n, I) ones, so equal up to the BLAS kernel's
    rounding (the last bit at larger row counts)."""
    got, got_loads = grouped_expert_sum(h, ex, w, stack.experts, stack)
    want, want_loads = grouped_expert_sum(h, ex, w, hosted)
    assert got_loads == want_loads
    tol = 1e-5 if h.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(1, 1), (16, 4), (300, 2), (600, 4)])  # (600, 4): the loop
def test_grouped_mm_over_a_layer_stack_equals_the_per_expert_loop(dtype, n, k):
    """``LayerStack`` + ``grouped_mm``: the same matmuls on the same slices as the loop (gate and
    up in one), so the same result (hosted ids with gaps; experts without tokens are empty
    groups)."""
    from eaas.runtime.server.hosting import LayerStack

    ids = [0, 3, 4, 9, 10]
    hosted = {
        e: w for (_, e), w in random_experts([(1, e) for e in ids], HIDDEN, INTER, dtype).items()
    }
    stack = LayerStack.build(hosted)
    assert stack.gate_up.shape == (len(ids), 2 * INTER, HIDDEN)
    assert stack.down.shape == (len(ids), HIDDEN, INTER)
    for g, e in enumerate(ids):  # views of the stack, equal to the originals: no second copy
        v = stack.experts[e]
        assert v.gate.data_ptr() == stack.gate_up[g].data_ptr()
        assert v.down.data_ptr() == stack.down[g].data_ptr()
        assert torch.equal(v.gate, hosted[e].gate) and torch.equal(v.up, hosted[e].up)
        assert torch.equal(v.down, hosted[e].down)
    g = torch.Generator().manual_seed(n + k)
    h = torch.randn(n, HIDDEN, generator=g).to(dtype)
    ex = torch.tensor(ids + [-1])[torch.randint(0, len(ids) + 1, (n, k), generator=g)]
    w = torch.rand(n, k, generator=g)
    assert_stack_equals_loop(stack, hosted, h, ex, w)
    assert_stack_equals_loop(stack, hosted, h, ex.to(torch.int32), w)  # the wire's id dtype
    pad = torch.full((n, k), -1, dtype=torch.int32)  # padding only: zeros, no load
    out, loads = grouped_expert_sum(h, pad, w, stack.experts, stack)
    assert torch.equal(out, torch.zeros_like(h)) and loads == {}


def test_a_cpu_expert_server_computes_on_layer_stacks(tmp_path):
    """Hosting on the CPU (initial and after add / drop) is stacked per layer, and every hosted
    expert's weights are views of its layer's stack."""
    from eaas.runtime.server.server import ExpertServer

    server = ExpertServer(
        f"unix:{tmp_path / 's.sock'}",
        random_experts([(1, 0), (1, 1), (2, 5)], HIDDEN, INTER, torch.float32),
        HIDDEN,
        torch.float32,
        "s",
    )
    try:
        server.add_experts(random_experts([(1, 2)], HIDDEN, INTER, torch.float32))
        server.drop_experts([(1, 0)])
        assert server.hosted_pairs() == frozenset({(1, 1), (1, 2), (2, 5)})
        hosting = server._hosting
        assert sorted(hosting.stacks) == [1, 2]
        assert hosting.stacks[1].gate_up.shape[0] == 2
        for (layer, e), w in hosting.pairs.items():
            st = hosting.stacks[layer]
            g = int(st.group_of[e + 1])
            assert w.gate.data_ptr() == st.gate_up[g].data_ptr(), (layer, e)
    finally:
        server.listener.close()


def test_shapes_grouped_mm_refuses_keep_the_loop(tmp_path):
    """torch's CPU grouped_mm refuses rows whose bytes are not a multiple of 16 (hidden 6 in
    float32): that server keeps the per-expert loop (no stacks) and still answers right."""
    from eaas.runtime.server.hosting import LayerStack
    from eaas.runtime.server.server import ExpertServer

    hidden, inter = 6, 4
    weights = random_experts([(1, 0), (1, 1)], hidden, inter, torch.float32)
    assert not LayerStack.build({e: w for (_, e), w in weights.items()}).usable
    server = ExpertServer(f"unix:{tmp_path / 's.sock'}", weights, hidden, torch.float32, "s")
    try:
        hosting = server._hosting
        assert hosting.stacks == {}
        h = torch.randn(5, hidden, generator=torch.Generator().manual_seed(1))
        ex = torch.tensor([[0, 1]] * 5, dtype=torch.int32)
        w = torch.rand(5, 2, generator=torch.Generator().manual_seed(2))
        out, _ = grouped_expert_sum(h, ex, w, hosting.by_layer[1], hosting.stacks.get(1))
        # the loop runs each expert once on all of its rows, the reference row by row: equal
        # up to the BLAS kernel's float32 rounding (bit-equal on some CPUs, not on others)
        torch.testing.assert_close(out, weighted_expert_sum(h, ex, w, hosting.by_layer[1]))
    finally:
        server.listener.close()


@pytest.mark.parametrize(
    "dtype,hidden,inter",
    [
        (torch.float32, 7, 3),
        (torch.float32, 40, 6),
        (torch.bfloat16, 12, 20),
        (torch.bfloat16, 64, 4),
    ],
)
def test_a_layer_stack_whose_rows_are_not_16_byte_aligned_still_computes(dtype, hidden, inter):
    """torch's CPU ``grouped_mm`` needs every row stride to be a multiple of 16 bytes
    ("strides should be multiple of 16 bytes"): a model whose hidden or intermediate size is
    not (bf16: not a multiple of 8; fp32: of 4) must still be served (the per-expert loop),
    with the same result."""
    from eaas.runtime.server.hosting import LayerStack

    ids = [1, 4, 6]
    hosted = {
        e: w for (_, e), w in random_experts([(0, e) for e in ids], hidden, inter, dtype).items()
    }
    stack = LayerStack.build(hosted)
    g = torch.Generator().manual_seed(hidden + inter)
    h = torch.randn(50, hidden, generator=g).to(dtype)
    ex = torch.tensor(ids)[torch.randint(0, len(ids), (50, 2), generator=g)]
    w = torch.rand(50, 2, generator=g)
    assert_stack_equals_loop(stack, hosted, h, ex, w)


def test_a_bf16_expert_server_with_an_unaligned_hidden_size_answers_frames(tmp_path):
    """A real expert-server process with bfloat16 weights and hidden size 12 (24-byte rows):
    was ``error status 2: server error: RuntimeError('strides should be multiple of 16
    bytes')`` on every frame (the client marked every server down: 503 for every request)."""
    from eaas.runtime.client.dispatch import Dispatcher
    from eaas.runtime.tables.table import RoutingTable

    from helpers.server import SPEC, reference, start_server

    hidden = 12
    srv = start_server(f"unix:{tmp_path}/s.sock", dtype=torch.bfloat16, hidden=hidden)
    table = RoutingTable(
        version=1, num_experts=4, servers={"s": srv.endpoint}, layers={1: (("s",),) * 4}
    )
    d = Dispatcher(0, hidden, torch.bfloat16, table, timeout=60.0)
    try:
        g = torch.Generator().manual_seed(3)
        h = torch.randn(40, hidden, generator=g).to(torch.bfloat16)
        ex = torch.randint(0, 4, (40, 2), generator=g)
        w = torch.rand(40, 2, generator=g)
        out = d.dispatch(1, h, ex, w)
        want = reference(1, h, ex, w, spec=SPEC, dtype=torch.bfloat16)
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    finally:
        d.close()
        srv.stop()
