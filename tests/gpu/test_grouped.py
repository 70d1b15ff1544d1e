"""Grouped expert GEMM with kernel shrinking: metadata logic on the CPU, kernels on a GPU.

Reference: ``grouped_expert_sum`` (the expert server's CPU path).
"""

from __future__ import annotations

import pytest
import torch

from eaas.runtime.server.compute import grouped_expert_sum
from eaas.runtime.server.grouped import (
    BM,
    compact_groups,
    grouped_swiglu_reference,
    max_tiles,
    stack_weights,
)
from eaas.runtime.server.main import random_experts

H, I = 64, 40


def _case(n, k, ids, n_logical, dtype=torch.float32, seed=0, active=None):
    g = torch.Generator().manual_seed(seed)
    hosted = {e: w for (_, e), w in random_experts([(1, e) for e in ids], H, I, dtype, 3).items()}
    pool = torch.tensor(active if active is not None else ids)
    ex = pool[torch.randint(len(pool), (n, k), generator=g)].to(torch.int32)
    if n and k > 1:
        ex[0, -1] = -1
        ex[n // 2, 0] = -1
    w = torch.rand(n, k, generator=g)
    x = torch.randn(n, H, generator=g).to(dtype)
    local_of = torch.full((n_logical,), -1, dtype=torch.int32)
    local_of[torch.tensor(sorted(ids))] = torch.arange(len(ids), dtype=torch.int32)
    return x, ex, w, hosted, local_of


@pytest.mark.gpu_cpu
def test_compact_groups_lists_only_experts_with_tokens():
    # 256 logical experts, 32 hosted, tokens only on 3 of them: the kernel-shrinking case
    ids = list(range(0, 256, 8))
    x, ex, w, hosted, local_of = _case(70, 4, ids, 256, active=[8, 64, 248])
    meta = compact_groups(ex, local_of, len(ids))
    assert meta.active.tolist() == [1, 8, 31] and not meta.not_hosted
    flat = ex.flatten()
    for l, e in enumerate(ids):
        assert int(meta.counts[l]) == int((flat == e).sum())
    assert meta.offsets.tolist()[-1] == int((flat >= 0).sum())
    # tiles: ceil(count / BM) per active expert, none for the 29 idle ones
    want = sum(-(-int(meta.counts[l]) // BM) for l in meta.active.tolist())
    assert meta.num_tiles == want <= max_tiles(flat.numel(), len(ids))
    assert set(meta.tile_expert.tolist()) == {1, 8, 31}
    # every non-padding pair has one row; the row belongs to its expert's group
    for i, e in enumerate(flat.tolist()):
        r = int(meta.pos[i])
        if e < 0:
            assert r == -1
            continue
        l = ids.index(e)
        assert meta.offsets[l] <= r < meta.offsets[l + 1] and int(meta.row_pair[r]) == i


@pytest.mark.gpu_cpu
def test_compact_groups_flags_not_hosted():
    _, ex, _, _, local_of = _case(5, 2, [0, 1, 2], 8)
    ex[2, 1] = 5  # in range, not hosted
    assert compact_groups(ex, local_of, 3).not_hosted
    ex[2, 1] = 99  # out of the table's range
    assert compact_groups(ex, local_of, 3).not_hosted


@pytest.mark.gpu_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 2), (100, 8), (0, 4)])
def test_kernel_algorithm_matches_grouped_expert_sum(n, k, dtype):
    ids = [0, 3, 5, 6, 9]
    x, ex, w, hosted, local_of = _case(n, k, ids, 12, dtype, seed=n + k)
    _, gu, dn = stack_weights(hosted)
    out, meta = grouped_swiglu_reference(x, ex, w, gu, dn, local_of)
    ref, loads = grouped_expert_sum(x, ex, w, hosted)
    assert out.dtype == dtype and out.shape == (n, H)
    assert {ids[l]: int(meta.counts[l]) for l in meta.active.tolist()} == loads
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "n,k,active", [(1, 1, None), (37, 8, None), (256, 8, [0, 9]), (0, 2, None)]
)
def test_gpu_grouped_kernel_matches_reference(n, k, active, dtype):
    from eaas.runtime.server.grouped import GroupedExperts

    ids = [0, 3, 5, 6, 9, 11, 17, 30]
    x, ex, w, hosted, local_of = _case(n, k, ids, 32, dtype, seed=n, active=active)
    ref, loads = grouped_expert_sum(x, ex, w, hosted)
    dev = {e: type(v)(v.gate.cuda(), v.up.cuda(), v.down.cuda()) for e, v in hosted.items()}
    ge = GroupedExperts(dev, num_logical=32)
    out, got = ge(x.cuda(), ex.cuda(), w.cuda())
    assert got == loads
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.cpu().float(), ref.float(), **tol)
    ex2 = ex.clone()
    if n:
        ex2[0, 0] = 1  # not hosted
        with pytest.raises(KeyError, match="not hosted"):
            ge(x.cuda(), ex2.cuda(), w.cuda())


@pytest.mark.gpu
def test_gpu_grouped_kernel_is_graph_capturable():
    """Captured once, replayed with another routing: the counts are read on the device."""
    from eaas.runtime.server.grouped import GroupedExperts

    ids = list(range(16))
    x, ex, w, hosted, _ = _case(64, 4, ids, 16, seed=1)
    dev = {e: type(v)(v.gate.cuda(), v.up.cuda(), v.down.cuda()) for e, v in hosted.items()}
    ge = GroupedExperts(dev)
    xs, exs, ws = x.cuda(), ex.cuda(), w.cuda()
    out = torch.empty(64, H, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ge.forward_async(xs, exs, ws, out)  # warm-up (module load, scratch) outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ge.forward_async(xs, exs, ws, out)
    for seed in (2, 3):
        x2, ex2, w2, _, _ = _case(64, 4, ids, 16, seed=seed, active=[seed, 7])
        xs.copy_(x2), exs.copy_(ex2), ws.copy_(w2)
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = grouped_expert_sum(x2, ex2, w2, hosted)
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
