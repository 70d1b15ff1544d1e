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
    return RoutingTable.from_placement(
        pl, ids, [f"unix:/nonexistent/{i}.sock" for i in ids], version=version
    )


def pick(
    d: Dispatcher, layer: int, expert: int, n: int, exclude=frozenset(), now: float = 0.0
) -> list[str]:
    """Servers chosen for ``n`` tokens that all selected ``expert`` (one Dispatcher call)."""
    sids = list(d._servers)
    index = {s: i for i, s in enumerate(sids)}
    assign = [[-1] for _ in range(n)]
    d._assign(
        layer,
        {expert: [(t, 0) for t in range(n)]},
        assign,
        [0] * len(sids),
        index,
        set(exclude),
        now,
    )
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


def test_uncovered_experts_and_messages():
    t = table()
    d = Dispatcher(0, 8, torch.float32, t, retry_down_s=60)
    assert d.uncovered() == [] and d.health()["uncovered_experts"] == 0
    # all replicas of (2, 3) marked down -> uncovered, and the 503 message says so
    a, b = t.replicas(2, 3)
    d._mark_down(d._servers[a], "test")
    d._mark_down(d._servers[b], "test")
    down = [u for u in d.uncovered() if u["reason"] == "all replicas down"]
    assert {"layer": 2, "expert": 3, "reason": "all replicas down", "replicas": [a, b]} in down
    assert all(set(u["replicas"]) <= {a, b} for u in down)
    h = d.health()
    assert h["uncovered_experts"] == len(down) and h["uncovered"] == down[: len(h["uncovered"])]
    with pytest.raises(NoLiveReplicaError) as ei:
        pick(d, 2, 3, 1)
    assert f"all replicas of layer 2 expert 3 are down: {[a, b]}" in str(ei.value)
    # a table without any replica of layer 1 expert 0: reported as such, not as "replicas [] all down"
    layers = dict(t.layers)
    layers[1] = ((),) + layers[1][1:]
    d2 = Dispatcher(
        0,
        8,
        torch.float32,
        RoutingTable(version=7, num_experts=t.num_experts, servers=t.servers, layers=layers),
    )
    assert d2.uncovered() == [
        {"layer": 1, "expert": 0, "reason": "no replica in routing table version 7", "replicas": []}
    ]
    with pytest.raises(NoLiveReplicaError) as ei:
        pick(d2, 1, 0, 1)
    assert "no replica of layer 1 expert 0 in routing table version 7" in str(ei.value)
    assert "[]" not in str(ei.value)


def test_reconnect_down_after_back_off():
    t = table()
    conns = []

    class FakeConn:
        def close(self):
            pass

    def connect(endpoint, server_id, **kw):
        if server_id == "s0" and not conns:
            conns.append(server_id)
            raise ConnectionRefusedError("still down")
        return FakeConn()

    d = Dispatcher(0, 8, torch.float32, t, retry_down_s=0.0, connect=connect)
    d._mark_down(d._servers["s0"], "test")
    assert d.reconnect_down() == 0  # first attempt refused: stays down, back-off grows
    assert d._servers["s0"].down and d._servers["s0"].failures == 2
    assert d.reconnect_down() == 1
    assert not d._servers["s0"].down and d.health()["servers"]["s0"]["state"] == "connected"
    # servers that are not down are left alone (no connection opened)
    assert d.health()["servers"]["s1"]["state"] == "idle"
