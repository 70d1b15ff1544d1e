"""Replica choice (pure tensor logic) and routing-table bookkeeping of the Dispatcher.

No expert server is started here; dispatch against real servers (failover, a hung server) is in
``tests/runtime/test_dispatch_servers.py``.
"""

from __future__ import annotations

import time

import pytest
import torch

from eaas.runtime.client.dispatch import (
    FIRST_CONNECT_RETRY_S,
    NO_REPLICA,
    NO_SERVER,
    Dispatcher,
    NoLiveReplicaError,
    PhaseTables,
    ReplicaMap,
    check_call,
    choose_replicas,
    reconnect_delay,
    uncovered_experts,
)
from eaas.runtime.client.dispatch.frames import server_frame
from eaas.runtime.placement import place_experts
from eaas.runtime.tables.table import RoutingTable

pytestmark = pytest.mark.engine


def table(version=1, servers=3, redundancy=2, experts=4):
    pl = place_experts([1, 2], experts, servers, redundancy)
    ids = [f"s{i}" for i in range(servers)]
    return RoutingTable.from_placement(
        pl, ids, [f"unix:/nonexistent/{i}.sock" for i in ids], version=version
    )


def reference_choice(experts, replicas, usable, start, split_pairs=1):
    """The policy written as the obvious per-pair Python loop (the oracle): an expert with ``c``
    pairs uses ``min(live, ceil(c / split_pairs))`` replicas from ``start[e]`` on and deals its
    pairs round-robin over them."""
    T, k = experts.shape
    out = [[NO_SERVER] * k for _ in range(T)]
    seen: dict[int, int] = {}
    total: dict[int, int] = {}
    for e in experts.reshape(-1).tolist():
        total[e] = total.get(e, 0) + 1
    for t in range(T):
        for j in range(k):
            e = int(experts[t, j])
            if e < 0:
                continue
            if e >= replicas.shape[0]:
                out[t][j] = NO_REPLICA
                continue
            live = [int(r) for r in replicas[e] if r >= 0 and usable[r]]
            rank = seen.get(e, 0)
            seen[e] = rank + 1
            used = min(len(live), -(-total[e] // split_pairs))
            out[t][j] = (
                live[(int(start[e]) + rank % max(used, 1)) % len(live)] if live else NO_REPLICA
            )
    return torch.tensor(out, dtype=torch.int64)


def test_replica_map_from_table():
    t = table()
    rm = ReplicaMap.from_table(t)
    assert rm.sids == ("s0", "s1", "s2")
    for layer in (1, 2):
        r = rm.replicas[layer]
        assert r.shape == (4, 2) and r.dtype == torch.int64
        for e in range(4):
            assert [rm.sids[i] for i in r[e].tolist()] == list(t.replicas(layer, e))


@pytest.mark.parametrize("seed", range(5))
def test_choose_replicas_matches_the_per_pair_policy(seed):
    g = torch.Generator().manual_seed(seed)
    E, R, S, T, k = 6, 3, 5, 37, 3
    replicas = torch.randint(0, S, (E, R), generator=g)
    replicas[torch.rand(E, R, generator=g) < 0.3] = -1  # some experts have fewer replicas
    replicas[2] = -1  # expert 2: no replica at all
    usable = torch.rand(S, generator=g) < 0.7
    start = torch.randint(0, 50, (E,), generator=g)
    experts = torch.randint(-1, E + 1, (T, k), generator=g)  # -1 pads, E = not in the table
    assign, counts = choose_replicas(experts, replicas, usable, start)
    assert torch.equal(assign, reference_choice(experts, replicas, usable, start))
    valid = (experts >= 0) & (experts < E)
    assert torch.equal(counts, torch.bincount(experts[valid], minlength=E))
    # the fast paths: every id a known expert (with repeats), and one token of distinct experts
    known = experts.clamp(0, E - 1)
    a2, _ = choose_replicas(known, replicas, usable, start)
    assert torch.equal(a2, reference_choice(known, replicas, usable, start))
    one = torch.randperm(E, generator=g)[:k].view(1, k)
    a3, _ = choose_replicas(one, replicas, usable, start)
    assert torch.equal(a3, reference_choice(one, replicas, usable, start))
    # never a server that is not usable, never one that is not a replica of the pair's expert
    for t, j in (assign >= 0).nonzero().tolist():
        s, e = int(assign[t, j]), int(experts[t, j])
        assert usable[s] and s in replicas[e].tolist()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("split_pairs", [2, 5, 1000])
def test_choose_replicas_keeps_an_expert_on_one_replica_up_to_split_pairs(seed, split_pairs):
    g = torch.Generator().manual_seed(seed)
    E, R, S, T, k = 6, 3, 5, 37, 3
    replicas = torch.randint(0, S, (E, R), generator=g)
    replicas[torch.rand(E, R, generator=g) < 0.3] = -1
    usable = torch.rand(S, generator=g) < 0.8
    start = torch.randint(0, 50, (E,), generator=g)
    for experts in (
        torch.randint(-1, E + 1, (T, k), generator=g),  # pads and unknown experts
        torch.randint(0, E, (T, k), generator=g),  # the fast path: all known
        torch.randperm(E, generator=g)[:k].view(1, k),  # one decode token
    ):
        assign, _ = choose_replicas(experts, replicas, usable, start, split_pairs=split_pairs)
        ref = reference_choice(experts, replicas, usable, start, split_pairs)
        assert torch.equal(assign, ref)
        # what matters: an expert reaches at most ceil(c / split_pairs) servers
        for e in range(E):
            sel = assign[experts == e]
            c = int(sel.numel())
            if c and int(sel[0]) >= 0:
                assert len(set(sel.tolist())) <= -(-c // split_pairs)


@pytest.mark.parametrize("seed", range(6))
def test_phase_tables_choose_as_the_policy_when_no_expert_is_split(seed):
    """The decode fast path (one look-up per pair at the layer's rotation phase) picks what
    :func:`choose_replicas` picks whenever no expert has more than ``split_pairs`` pairs."""
    g = torch.Generator().manual_seed(seed)
    E, R, S, T, k, split_pairs = 7, 3, 5, 9, 3, 27  # T * k <= split_pairs: no expert split
    replicas = torch.randint(0, S, (E, R), generator=g)
    replicas[torch.rand(E, R, generator=g) < 0.3] = -1  # live counts 0..3: phases up to 6
    usable = torch.rand(S, generator=g) < 0.8
    ph = PhaseTables.build(replicas, usable)
    nlive = ((replicas >= 0) & usable[replicas.clamp(min=0)]).sum(1)
    assert ph.complete == bool((nlive > 0).all())
    experts = torch.randint(-1, E, (T, k), generator=g)  # -1 pads, repeats allowed
    for rr in range(13):
        start = torch.full((E,), rr, dtype=torch.int64)
        want, _ = choose_replicas(experts, replicas, usable, start, split_pairs=split_pairs)
        got = ph.choose(experts, rr)
        assert got is not None and torch.equal(got, want), rr
        # every server the call reaches is among the servers reserved for its phase
        assert set(got[got >= 0].tolist()) <= set(ph.servers[rr % len(ph.servers)])
    # an id that is neither -1 nor a known expert: the caller falls back to the policy
    assert ph.choose(torch.tensor([[0, E]]), 0) is None
    assert ph.choose(torch.tensor([[-2, 0]]), 0) is None


def test_phase_tables_of_two_replicas_alternate_the_columns():
    # experts 0, 2 on servers (0, 1); experts 1, 3 on (2, 3): column {0, 2}, then {1, 3}
    replicas = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    ph = PhaseTables.build(replicas, torch.ones(4, dtype=torch.bool))
    assert ph.complete and ph.servers == ((0, 2), (1, 3))
    experts = torch.tensor([[0, 1], [2, 3]])
    assert ph.choose(experts, 0).tolist() == [[0, 2], [0, 2]]
    assert ph.choose(experts, 1).tolist() == [[1, 3], [1, 3]]
    # server 1 down: experts 0 and 2 stay on server 0 in both phases
    ph = PhaseTables.build(replicas, torch.tensor([True, False, True, True]))
    assert ph.servers == ((0, 2), (0, 3))
    assert ph.choose(experts, 1).tolist() == [[0, 3], [0, 3]]
    # servers 0 and 1 down: experts 0 and 2 have no replica
    ph = PhaseTables.build(replicas, torch.tensor([False, False, True, True]))
    assert not ph.complete
    assert ph.choose(experts, 0).tolist() == [[NO_REPLICA, 2], [NO_REPLICA, 2]]


def test_choose_replicas_splits_evenly_and_rotates():
    replicas = torch.tensor([[0, 1], [1, 2]])
    usable = torch.ones(3, dtype=torch.bool)
    experts = torch.zeros(10, 1, dtype=torch.int64)  # ten tokens choosing expert 0
    assign, counts = choose_replicas(experts, replicas, usable, torch.zeros(2, dtype=torch.int64))
    assert (assign == 0).sum() == 5 and (assign == 1).sum() == 5
    assert counts.tolist() == [10, 0]
    # one token per call (decode): a start advanced by the counts alternates the replicas
    start = torch.zeros(2, dtype=torch.int64)
    firsts = []
    for _ in range(4):
        a, c = choose_replicas(torch.tensor([[0]]), replicas, usable, start)
        start += c
        firsts.append(int(a[0, 0]))
    assert firsts == [0, 1, 0, 1]
    # a replica that is not usable is skipped; none usable -> NO_REPLICA
    a, _ = choose_replicas(
        torch.tensor([[0, 1]]), replicas, torch.tensor([False, True, False]), start
    )
    assert a.tolist() == [[1, 1]]
    a, _ = choose_replicas(torch.tensor([[1]]), replicas, torch.tensor([True, False, False]), start)
    assert a.tolist() == [[NO_REPLICA]]
    a, c = choose_replicas(torch.full((3, 2), -1), replicas, usable, start)
    assert (a == NO_SERVER).all() and c.tolist() == [0, 0]


def test_only_newer_tables_are_accepted():
    d = Dispatcher(0, 8, torch.float32, table(version=3), connect_in_background=False)
    assert d.version == 3
    assert not d.set_table(table(version=2))
    assert not d.set_table(table(version=3))
    assert d.version == 3
    t4 = table(version=3).without_servers(["s1"])
    assert d.set_table(t4) and d.version == 4
    assert "s1" not in d.health()["servers"]


def test_dispatch_without_any_live_replica_raises_fast():
    d = Dispatcher(0, 8, torch.float32, table(), timeout=30.0)
    hidden = torch.randn(3, 8)
    idx = torch.tensor([[0, 1], [1, 2], [3, 0]])
    w = torch.rand(3, 2)
    # every endpoint is a missing socket: the connector marks each server down on its first
    # attempt, and the call stops waiting for connections as soon as none is pending (long
    # before the 30 s timeout, which would fail the test through pytest's own limits)
    with pytest.raises(NoLiveReplicaError, match="are down"):
        d.dispatch(1, hidden, idx, w)
    assert all(s["state"] == "down" for s in d.health()["servers"].values())
    d.close()


def test_dispatch_of_a_layer_or_expert_not_in_the_table():
    d = Dispatcher(0, 8, torch.float32, table(), connect_in_background=False)
    with pytest.raises(NoLiveReplicaError, match="layer 7 is not in routing table version 1"):
        d.dispatch(7, torch.randn(1, 8), torch.tensor([[0]]), torch.ones(1, 1))
    with pytest.raises(NoLiveReplicaError, match="no replica of layer 1 expert 9"):
        d.dispatch(1, torch.randn(1, 8), torch.tensor([[9]]), torch.ones(1, 1))


def test_uncovered_experts_and_messages():
    t = table()
    d = Dispatcher(0, 8, torch.float32, t, retry_down_s=60, connect_in_background=False)
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
        d.dispatch(2, torch.randn(1, 8), torch.tensor([[3]]), torch.ones(1, 1))
    assert f"all replicas of layer 2 expert 3 are down: {[a, b]}" in str(ei.value)
    # a table without any replica of layer 1 expert 0: reported as such, not as "replicas [] all down"
    layers = dict(t.layers)
    layers[1] = ((),) + layers[1][1:]
    d2 = Dispatcher(
        0,
        8,
        torch.float32,
        RoutingTable(version=7, num_experts=t.num_experts, servers=t.servers, layers=layers),
        connect_in_background=False,
    )
    assert d2.uncovered() == [
        {"layer": 1, "expert": 0, "reason": "no replica in routing table version 7", "replicas": []}
    ]
    d2._mark_down(d2._servers["s0"], "test")  # nothing pending: the call does not wait
    d2._mark_down(d2._servers["s1"], "test")
    d2._mark_down(d2._servers["s2"], "test")
    with pytest.raises(NoLiveReplicaError) as ei:
        d2.dispatch(1, torch.randn(1, 8), torch.tensor([[0]]), torch.ones(1, 1))
    assert "no replica of layer 1 expert 0 in routing table version 7" in str(ei.value)
    assert "[]" not in str(ei.value)


def test_reconnect_down_after_back_off():
    t = table()
    refused = []

    class FakeConn:
        closed = False

        def close(self):
            self.closed = True

    def connect(endpoint, server_id, **kw):
        if server_id == "s0" and not refused:
            refused.append(server_id)
            raise ConnectionRefusedError("still down")
        return FakeConn()

    d = Dispatcher(
        0, 8, torch.float32, t, retry_down_s=0.0, connect=connect, connect_in_background=False
    )
    # first round connects every new server; s0 is refused and marked down
    assert d.reconnect_down() == 2
    assert d._servers["s0"].down and d._servers["s0"].failures == 1
    assert d.health()["servers"]["s1"]["state"] == "connected"
    assert d.reconnect_down() == 1  # back-off of 0 s expired: s0 comes back
    assert not d._servers["s0"].down and d.health()["servers"]["s0"]["state"] == "connected"
    assert d.reconnect_down() == 0  # connected servers are left alone
    conns = [s.conn for s in d._servers.values()]
    d.close()
    assert all(c.closed for c in conns)


def test_reconnect_delay_is_short_until_a_server_was_first_reached():
    # a server never reached is probably still starting: tried every FIRST_CONNECT_RETRY_S
    assert [reconnect_delay(n, False, 2.0) for n in (1, 2, 5, 20)] == [FIRST_CONNECT_RETRY_S] * 4
    assert reconnect_delay(3, False, 0.1) == 0.1  # a shorter retry_down_s wins
    # one that worked and failed: retry_down_s, doubling, at most 30 s
    assert [reconnect_delay(n, True, 2.0) for n in (1, 2, 3, 4, 5, 6)] == [2, 4, 8, 16, 30, 30]
    assert reconnect_delay(1, True, 60.0) == 60.0


def test_a_server_still_starting_is_retried_at_the_short_interval_then_backs_off():
    """``eaas serve`` starts clients and servers together: a client that finds a server not
    listening yet retried it after 2, 4, 8, ... 30 s, so a server that became ready during a
    long back-off stayed unused (503s after ``serving``) for up to 30 s. Until it is first
    reached it is retried every FIRST_CONNECT_RETRY_S; once it worked, a failure backs off."""
    t = table()
    up = {"s0": False}

    class FakeConn:
        closed = False

        def close(self):
            self.closed = True

    def connect(endpoint, server_id, **kw):
        if server_id == "s0" and not up["s0"]:
            raise ConnectionRefusedError("not listening yet")
        return FakeConn()

    d = Dispatcher(
        0, 8, torch.float32, t, retry_down_s=2.0, connect=connect, connect_in_background=False
    )
    s0 = d._servers["s0"]
    for failures in range(1, 7):  # the old back-off would now be 30 s
        if failures == 1:
            d.reconnect_down()  # the first attempt: refused
        else:
            d._mark_down(s0, "connect: not listening yet")  # a refused retry
        assert s0.down and s0.failures == failures
        assert s0.retry_at - time.monotonic() <= FIRST_CONNECT_RETRY_S
    up["s0"] = True
    deadline = time.monotonic() + 60
    while d.reconnect_down() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not s0.down and s0.ever_connected
    d._mark_down(s0, "recv: PeerDeadError")  # it worked once: back to the doubling back-off
    assert s0.retry_at - time.monotonic() > 1.0
    d.close()


def test_a_moe_layer_missing_from_the_table_is_uncovered():
    """A pushed table may leave out a MoE layer of the model (PUT /routing-table accepted one
    with ``"layers": {}``): every request then failed 503 while /health said ``ok`` with 0
    uncovered experts. With the model's MoE layers known, each of that layer's experts is
    uncovered, naming the layer."""
    t = table()  # layers 1 and 2
    d = Dispatcher(0, 8, torch.float32, t, moe_layers=(1, 2, 3), connect_in_background=False)
    missing = d.uncovered()
    assert [(u["layer"], u["expert"]) for u in missing] == [(3, e) for e in range(t.num_experts)]
    assert missing[0]["reason"] == "layer 3 is not in routing table version 1"
    assert missing[0]["replicas"] == []
    assert d.health()["uncovered_experts"] == t.num_experts
    # a dispatcher that does not know the model's layers reports what the table says
    d2 = Dispatcher(0, 8, torch.float32, t, connect_in_background=False)
    assert d2.uncovered() == []


def test_a_call_is_checked_by_its_shapes_and_k_not_by_its_token_count():
    """check_call: hidden [T, H], top-k ids / weights [T, k] alike, k within the frame limit;
    T itself is not limited (a call's tokens are split into frames; each frame's limit is the
    transport's)."""
    from eaas.runtime.transport.base import MAX_K_HARD, MAX_TOKENS_HARD

    T = MAX_TOKENS_HARD + 10
    check_call(torch.empty(T, 4), torch.zeros(T, 2, dtype=torch.long), torch.zeros(T, 2), 4)
    h, idx, w = torch.empty(3, 4), torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2)
    for args, match in (
        ((h[:, :3], idx, w), r"hidden must be \[T, 4\]"),
        ((h[0], idx, w), "hidden must be"),
        ((h, idx[:2], w[:2]), r"top_k_index must be \[3, k\]"),
        ((h, idx[:, 0], w[:, 0]), "top_k_index must be"),
        ((h, idx, w[:, :1]), "top_k_weights"),
        ((h, torch.zeros(3, MAX_K_HARD + 1), torch.zeros(3, MAX_K_HARD + 1)), "frame limit"),
    ):
        with pytest.raises(ValueError, match=match):
            check_call(*args, 4)


def test_uncovered_experts_is_a_function_of_the_table_and_the_down_servers():
    """The pure half of ``Dispatcher.uncovered``: no dispatcher, no connection."""
    t = table()
    assert uncovered_experts(t, None, lambda sid: False) == []
    a, b = t.replicas(2, 3)
    down = uncovered_experts(t, (1, 2), lambda sid: sid in (a, b))
    assert {"layer": 2, "expert": 3, "reason": "all replicas down", "replicas": [a, b]} in down
    assert all(u["reason"] == "all replicas down" for u in down)
    assert down == sorted(down, key=lambda u: (u["layer"], u["expert"]))
    # every server down: every expert of every layer, in (layer, expert) order
    every = uncovered_experts(t, None, lambda sid: True)
    assert [(u["layer"], u["expert"]) for u in every] == [(L, e) for L in (1, 2) for e in range(4)]
    # a MoE layer the table leaves out: all its experts, before the table's own layers
    out = uncovered_experts(t, (0, 1, 2), lambda sid: False)
    assert [(u["layer"], u["expert"]) for u in out] == [(0, e) for e in range(4)]
    assert out[0]["reason"] == "layer 0 is not in routing table version 1"


def test_server_frame_masks_the_pairs_of_other_servers():
    """A server's frame: only the tokens with a pair of its own; other servers' pairs padded
    with -1 / 0; ``rows`` None when every token is in the frame."""
    assign = torch.tensor([[0, 1], [1, 1], [0, NO_SERVER]])  # (T=3, k=2) server per pair
    idx32 = torch.tensor([[5, 6], [7, 8], [9, -1]], dtype=torch.int32)
    w32 = torch.tensor([[0.5, 0.25], [0.75, 0.125], [1.0, 0.0]])
    f0 = server_frame(assign, 0, idx32, w32)
    assert f0 is not None and f0.n == 2 and f0.rows.tolist() == [0, 2]
    assert f0.experts.tolist() == [[5, -1], [9, -1]]
    assert f0.weights.tolist() == [[0.5, 0.0], [1.0, 0.0]]
    f1 = server_frame(assign, 1, idx32, w32)
    assert f1 is not None and f1.n == 2 and f1.rows.tolist() == [0, 1]
    assert f1.experts.tolist() == [[-1, 6], [7, 8]] and f1.experts.dtype == torch.int32
    assert server_frame(assign, 2, idx32, w32) is None  # reserved, but no pair of this call
    every = server_frame(torch.zeros(3, 2, dtype=torch.int64), 0, idx32, w32)
    assert every is not None and every.rows is None and every.n == 3
    assert torch.equal(every.experts, idx32) and torch.equal(every.weights, w32)


def test_a_table_without_any_server_raises_no_live_replica():
    """Every server out of the table (all dead, none restarted): a 503-class error naming the
    expert, never an index error of the empty server list (was a 500)."""
    replicas = torch.full((4, 2), -1, dtype=torch.int64)
    assign, counts = choose_replicas(
        torch.tensor([[0, 1], [2, -1]]),
        replicas,
        torch.zeros(0, dtype=torch.bool),
        torch.zeros(4, dtype=torch.int64),
    )
    assert assign.tolist() == [[NO_REPLICA, NO_REPLICA], [NO_REPLICA, NO_SERVER]]
    t = table()
    empty = t.without_servers(set(t.servers)).with_version(2)
    assert not empty.servers
    d = Dispatcher(0, 8, torch.float32, empty, connect_in_background=False)
    with pytest.raises(NoLiveReplicaError, match="expert"):
        d.dispatch(1, torch.randn(2, 8), torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 2))
    d.close()
