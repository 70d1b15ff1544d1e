"""Replica choice and routing-table versioning of the Dispatcher (no connections are opened)."""

from __future__ import annotations

import pytest
import torch

from eaas.runtime.client.dispatch import Dispatcher, NoLiveReplicaError
from eaas.runtime.placement import place_experts
from eaas.runtime.routing import RoutingTable


def table(version=1, servers=3, redundancy=2, experts=4):
    pl = place_experts([1, 2], experts, servers, redundancy)
    ids = [f"s{i}" for i in range(servers)]
    return RoutingTable.from_placement(pl, ids, [f"unix:/nonexistent/{i}.sock" for i in ids], version=version)


def pick(d: Dispatcher, layer: int, expert: int, n: int, exclude=frozenset(), now: float = 0.0) -> list[str]:
    """Servers chosen for ``n`` tokens that all selected ``expert`` (one Dispatcher call)."""
    sids = list(d._servers)
    index = {s: i for i, s in enumerate(sids)}
    assign = [[-1] for _ in range(n)]
    d._assign(layer, {expert: [(t, 0) for t in range(n)]}, assign, [0] * len(sids), index, set(exclude), now)
    return [sids[a[0]] for a in assign]


def test_least_loaded_with_round_robin_ties():
    t = table()
    d = Dispatcher(0, 8, torch.float32, t)
    reps = t.replicas(1, 0)
    picks = pick(d, 1, 0, 10)  # ten tokens choosing the same expert
    assert set(picks) == set(reps)
    assert abs(picks.count(reps[0]) - picks.count(reps[1])) <= 1  # balanced
    # equal load -> the rotation moves the first choice between calls
    firsts = {pick(d, 1, 0, 1)[0] for _ in range(4)}
    assert firsts == set(reps)


def test_excluded_and_down_replicas_are_skipped():
    t = table()
    d = Dispatcher(0, 8, torch.float32, t, retry_down_s=60)
    a, b = t.replicas(2, 3)
    assert set(pick(d, 2, 3, 3, exclude={a})) == {b}
    d._mark_down(d._servers[b], "test")
    with pytest.raises(NoLiveReplicaError) as ei:
        pick(d, 2, 3, 1, exclude={a})
    assert ei.value.layer == 2 and ei.value.expert == 3
    # a down server becomes eligible again after retry_down_s
    assert pick(d, 2, 3, 1, exclude={a}, now=d._servers[b].retry_at + 1) == [b]


def test_only_newer_tables_are_accepted():
    d = Dispatcher(0, 8, torch.float32, table(version=3))
    assert d.version == 3
    assert not d.set_table(table(version=2))
    assert not d.set_table(table(version=3))
    assert d.version == 3
    t4 = table(version=3).without_servers(["s1"])
    assert d.set_table(t4) and d.version == 4
    assert "s1" not in d.health()["servers"]


def test_dispatch_without_any_live_replica_raises_fast():
    d = Dispatcher(0, 8, torch.float32, table(), timeout=1.0)
    hidden = torch.randn(3, 8)
    idx = torch.tensor([[0, 1], [1, 2], [3, 0]])
    w = torch.rand(3, 2)
    # every endpoint is a missing socket: each server is marked down as its send fails, its
    # pairs fail over, and finally an expert runs out of replicas
    with pytest.raises(NoLiveReplicaError):
        d.dispatch(1, hidden, idx, w)
    assert all(s["state"] == "down" for s in d.health()["servers"].values())
