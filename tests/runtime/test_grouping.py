"""Expert-server grouping of tokens by expert (tensor operations, no Python per token)."""

from __future__ import annotations

import pytest
import torch
from srv_helpers import HIDDEN, INTER

from eaas.runtime.expert_server import grouped_expert_sum, random_experts
from eaas.runtime.experts import weighted_expert_sum

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
