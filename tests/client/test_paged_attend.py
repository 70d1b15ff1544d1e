"""The paged engine's prefill attention in its fused-kernel form (v zero-padded to q's head dim
for MLA, ``is_causal`` for a whole prompt) equals plain masked softmax attention."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eaas.runtime.client.model_runner import PagedModelRunner

pytestmark = pytest.mark.engine


def reference(q, k, v, mask, scale):
    # q (1, H, n, dk), k (1, H, L, dk), v (1, H, L, dv), mask (n, L) -> (1, H, n, dv)
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, -1), v.double()).float()


def visible(start: int, n: int, window: int | None) -> torch.Tensor:
    q_pos = torch.arange(start, start + n)[:, None]
    k_pos = torch.arange(start + n)[None, :]
    m = k_pos <= q_pos
    if window:
        m = m & (q_pos - k_pos < window)
    return m  # (n, L)


@pytest.mark.parametrize(
    "start,n,dk,dv,window",
    [
        (0, 37, 48, 32, None),  # a whole prompt, MLA head dims (v padded, is_causal)
        (0, 37, 32, 32, None),  # a whole prompt, equal head dims
        (20, 17, 48, 32, None),  # a chunk after a cached prefix: the mask is needed
        (0, 37, 32, 32, 8),  # a sliding window that cuts the prompt: the mask is needed
        (0, 7, 32, 32, 8),  # a window longer than the prompt: plain causal
    ],
)
def test_prefill_attention_matches_masked_softmax(start, n, dk, dv, window):
    g = torch.Generator().manual_seed(start + n + dk + (window or 0))
    H, L = 3, start + n
    q = torch.randn(1, H, n, dk, generator=g)
    k = torch.randn(1, H, L, dk, generator=g)
    v = torch.randn(1, H, L, dv, generator=g)
    mask = visible(start, n, window)
    runner = SimpleNamespace(sliding_window=window)
    got = PagedModelRunner._attend(runner, q, k, v, mask[None, None], 0.3, False)  # type: ignore[arg-type]
    assert got.shape == (1, H, n, dv)
    torch.testing.assert_close(got, reference(q, k, v, mask, 0.3), atol=2e-5, rtol=1e-4)
