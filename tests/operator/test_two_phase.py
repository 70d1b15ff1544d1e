"""Two-phase (make-before-break) publishing and table-driven placement, pure logic: a new version
reaches the servers first, the clients only once every server in it confirmed its weights;
scale-down and re-placement move experts by table; every version the clients get covers every
expert."""

from __future__ import annotations

import pytest

from eaas.operator.crd import ExpertPoolSpec
from eaas.operator.pool_placement import member_placement, rebalance_due, table_placement
from eaas.operator.table import (
    assignment_of,
    table_from_assignment,
    two_phase_step,
)

pytestmark = pytest.mark.elastic


def make_spec(**over):
    base = {
        "model": {"uri": "/models/tiny", "firstMoeLayer": 1, "numMoeLayers": 3, "numExperts": 32},
        "replicas": 5,
        "placement": {"assignment": "routing-table"},
    }
    base.update(over)
    return ExpertPoolSpec.model_validate(base)


def eps(names):
    return {n: f"tcp://10.0.0.{i + 1}:9000" for i, n in enumerate(names)}


def candidate_for(spec, members, table):
    assignment = member_placement(spec, members, table)
    return table_from_assignment(spec, assignment, {m: ENDPOINTS[m] for m in members}, 0)


ENDPOINTS = eps([f"p-{i}" for i in range(8)])


class Pool:
    """The protocol's state as the operator and the processes hold it (no I/O): servers hold
    weights and confirm versions, clients acknowledge published versions."""

    def __init__(self):
        self.published = None
        self.staged = None
        self.held: dict[str, set] = {}
        self.confirmed: dict[str, int] = {}
        self.assigned: dict[str, dict[int, frozenset]] = {}
        self.acks = [0, 0]
        self.history = []  # every published table

    def step(self, candidate, load_servers=True, clients_ack=True):
        d = two_phase_step(candidate, self.published, self.staged, self.confirmed, self.acks)
        if d.stage is not None:
            self.staged = d.stage
            for s, pairs in assignment_of(d.stage).items():
                self.assigned.setdefault(s, {})[d.stage.version] = pairs
                if load_servers:  # the server loads, keeps older experts, confirms
                    self.held.setdefault(s, set()).update(pairs)
                    self.confirmed[s] = d.stage.version
        if d.publish is not None:
            # the clients may only get weights every listed server holds
            for s, pairs in assignment_of(d.publish).items():
                assert pairs <= self.held.get(s, set()), (s, d.publish.version)
            self.published = d.publish
            self.history.append(d.publish)
            if clients_ack:
                self.acks = [d.publish.version] * len(self.acks)
        if d.release:
            for s, by_version in self.assigned.items():
                keep = set()
                newest = max(by_version)
                for v, pairs in by_version.items():
                    if v >= d.release or v == newest:
                        keep |= pairs
                self.held[s] = self.held.get(s, set()) & keep
        return d

    def converge(self, spec, members, steps=10):
        for _ in range(steps):
            d = self.step(candidate_for(spec, members, self.staged or self.published))
            if d.stage is None and d.publish is None:
                return d
        raise AssertionError("did not converge")


def test_first_table_goes_to_servers_before_clients():
    spec = make_spec()
    members = [f"p-{i}" for i in range(5)]
    pool = Pool()
    cand = candidate_for(spec, members, None)
    d = pool.step(cand, load_servers=False)
    assert d.stage is not None and d.publish is None
    assert set(d.waiting_for) == set(members)
    d = pool.step(cand, load_servers=False)  # nobody confirmed: still waiting, no new version
    assert d.stage is None and d.publish is None and len(d.waiting_for) == 5
    for s in members[:4]:
        pool.held[s] = set(assignment_of(pool.staged)[s])
        pool.confirmed[s] = pool.staged.version
    assert pool.step(cand).publish is None  # one missing
    pool.held["p-4"] = set(assignment_of(pool.staged)["p-4"])
    pool.confirmed["p-4"] = pool.staged.version
    d = pool.step(cand)
    assert d.publish is not None and d.publish.version == pool.staged.version
    assert not d.publish.uncovered()


def test_scale_down_is_make_before_break_and_every_published_table_covers_everything():
    spec = make_spec()
    five = [f"p-{i}" for i in range(5)]
    pool = Pool()
    pool.converge(spec, five)
    v_five = pool.published.version
    before = assignment_of(pool.published)
    four = five[:4]
    d = pool.step(candidate_for(spec, four, pool.published), clients_ack=False)
    # survivors must load p-4's experts first: staged, p-4 still in the clients' table
    assert d.stage is not None and "p-4" not in d.stage.servers
    assert "p-4" in pool.published.servers
    d = pool.step(candidate_for(spec, four, pool.staged), clients_ack=False)
    assert d.publish is not None and "p-4" not in d.publish.servers
    # clients have not acknowledged: nothing released, p-4 must stay (operator keeps its pod)
    assert d.release == v_five
    pool.acks = [d.publish.version, d.publish.version - 1]
    assert pool.step(candidate_for(spec, four, pool.published)).release == v_five
    pool.acks = [pool.published.version] * 2
    d = pool.step(candidate_for(spec, four, pool.published))
    assert d.release == pool.published.version and d.stage is None and d.publish is None
    for t in pool.history:
        assert not t.uncovered(), t.version
        for experts in t.layers.values():
            assert all(len(set(r)) >= spec.redundancy for r in experts)
    after = assignment_of(pool.published)
    # survivors keep what they had (they only gain p-4's share) and released extra weights
    for s in four:
        assert before[s] <= after[s] or len(before[s] - after[s]) <= 8
        assert pool.held[s] == set(after[s])


def test_dead_server_is_removed_at_once_then_its_experts_re_placed_by_table():
    spec = make_spec(redundancy=2)
    five = [f"p-{i}" for i in range(5)]
    pool = Pool()
    pool.converge(spec, five)
    v = pool.published.version
    survivors = [m for m in five if m != "p-2"]
    # the candidate without the dead server re-homes its experts; first, a table that only
    # drops it is what the clients need now: the operator publishes the failure table directly
    only_removed = table_from_assignment(
        spec, assignment_of(pool.published), {m: ENDPOINTS[m] for m in survivors}, 0
    )
    d = pool.step(only_removed)
    assert d.publish is not None and d.publish.version == v + 1 and "p-2" not in d.publish.servers
    # then the survivors load the dead server's experts (staged, confirmed, published)
    pool.converge(spec, survivors)
    assert pool.published.version > v + 1
    t = pool.published
    assert not t.uncovered()
    assert all(len(r) >= 2 for experts in t.layers.values() for r in experts)


def test_pending_version_abandoned_when_one_of_its_servers_dies():
    spec = make_spec()
    five = [f"p-{i}" for i in range(5)]
    pool = Pool()
    pool.converge(spec, five)
    six = [f"p-{i}" for i in range(6)]
    d = pool.step(candidate_for(spec, six, pool.published), load_servers=False)
    staged_v = d.stage.version
    # p-5 dies before confirming: the staged version waits for it, then is given up
    d = pool.step(candidate_for(spec, five, pool.published), load_servers=False)
    assert d.abandoned and d.publish is None and d.stage is None  # back to the published one
    assert pool.published.version < staged_v


def test_release_is_the_oldest_client_acknowledgement():
    spec = make_spec()
    five = [f"p-{i}" for i in range(5)]
    cand = candidate_for(spec, five, None)
    pub = cand.__class__(**{**cand.__dict__, "version": 7})
    d = two_phase_step(cand, pub, None, {}, [7, 5, 6])
    assert d.release == 5 and d.stage is None and d.publish is None
    assert two_phase_step(cand, pub, None, {}, []).release == 7  # no clients: all released


def test_member_placement_is_a_fixed_point_and_scale_down_keeps_survivors():
    spec = make_spec()
    five = [f"p-{i}" for i in range(5)]
    t = candidate_for(spec, five, None)
    again = candidate_for(spec, five, t)
    assert assignment_of(again) == assignment_of(t)
    four = candidate_for(spec, five[:4], t)
    moved = sum(len(assignment_of(four)[s] - assignment_of(t)[s]) for s in five[:4])
    gone = len(assignment_of(t)["p-4"])
    assert moved <= gone + 4 * 3 * 2  # the leaver's share plus a small bounded extra
    assert not four.uncovered()


def test_table_placement_reads_the_table_in_member_order():
    spec = make_spec()
    t = candidate_for(spec, ["p-0", "p-1", "p-2"], None)
    p = table_placement(spec, ["p-2", "p-0", "p-7"], t)
    a = assignment_of(t)
    assert p.servers[0] == tuple(sorted(a["p-2"])) and p.servers[2] == ()


def test_rebalance_due_needs_threshold_and_interval():
    spec = make_spec(
        placement={
            "policy": "load-balanced",
            "assignment": "routing-table",
            "rebalanceThreshold": 0.1,
            "rebalanceIntervalSeconds": 60,
        }
    )
    members = [f"p-{i}" for i in range(5)]
    current = table_placement(spec, members, candidate_for(spec, members, None))
    # Zipf-skewed load in every layer (the expert ids hot in one layer differ from the next)
    hot = {
        (layer, e): 100.0 / (1 + (e * 7 + layer * 5) % 32) for layer in (1, 2, 3) for e in range(32)
    }
    due, imbalance = rebalance_due(spec, current, hot, None)
    assert due and imbalance > 0.1
    assert not rebalance_due(spec, current, hot, 30.0)[0]  # within the interval
    assert rebalance_due(spec, current, hot, 61.0)[0]
    flat = {(layer, e): 1.0 for layer in (1, 2, 3) for e in range(32)}
    assert not rebalance_due(spec, current, flat, None)[0]  # balanced: below threshold
    rr = make_spec()
    assert not rebalance_due(rr, current, hot, None)[0]  # round-robin never rebalances
    # rebalancing with that load lowers the imbalance
    after = member_placement(spec, members, candidate_for(spec, members, None), hot, True)
    p2 = table_placement(
        spec, members, table_from_assignment(spec, after, {m: ENDPOINTS[m] for m in members}, 1)
    )
    assert rebalance_due(spec, p2, hot, None)[1] < imbalance


def test_routing_table_pods_carry_no_experts_so_a_new_assignment_restarts_nothing():
    from eaas.operator.crd import ANNOTATION_SPEC_HASH
    from eaas.operator.names import Owner
    from eaas.operator.pods import ObservedPod, desired_table_pods, plan_pods, server_pod

    owner = Owner(kind="ExpertPool", name="p", namespace="ns", uid="u", generation=1)
    spec = make_spec()
    a = server_pod(owner, spec, 1, [(1, 0), (2, 3)], "r1")
    b = server_pod(owner, spec, 1, [(3, 7)], "r1")
    assert (
        a["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
        == b["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
    )
    cmd = a["spec"]["containers"][0]["command"]
    assert "--experts" not in cmd and "--push-token-file" in cmd
    token_file = cmd[cmd.index("--push-token-file") + 1]
    mounts = a["spec"]["containers"][0]["volumeMounts"]
    assert any(token_file.startswith(m["mountPath"]) for m in mounts)
    assert any(
        v.get("secret", {}).get("secretName") == "p-server-push-token" for v in a["spec"]["volumes"]
    )
    # 5 -> 4: the leaving live pod is held while clients may use it, deleted once not
    desired = desired_table_pods(owner, make_spec(replicas=4), "r2")
    observed = [
        ObservedPod(
            name=f"p-{i}",
            uid=f"u{i}",
            index=i,
            spec_hash=desired.get(f"p-{i}", a)["metadata"]["annotations"][ANNOTATION_SPEC_HASH],
            revision="r2",
            ready=True,
            ip=f"10.0.0.{i}",
            phase="Running",
        )
        for i in range(5)
    ]
    held = plan_pods(desired, observed, max_unavailable=1, in_use={"p-4"})
    assert held.delete == [] and held.excess == ["p-4"]
    freed = plan_pods(desired, observed, max_unavailable=1, in_use=set())
    assert freed.delete == [("p-4", "u4", "excess")]
    assert not freed.create and not freed.outdated  # no survivor replaced


def test_servers_joining_one_by_one_end_at_the_desired_budget_not_all_experts():
    spec = make_spec()  # 5 replicas, 32 experts, redundancy 2: ceil(64 / 5) = 13 per layer
    names = [f"p-{i}" for i in range(5)]
    t = None
    for k in range(2, 6):  # pods turn Ready one after another
        t = candidate_for(spec, names[:k], t)
    per_layer = {
        s: max(sum(1 for (layer, _) in pairs if layer == lay) for lay in (1, 2, 3))
        for s, pairs in assignment_of(t).items()
    }
    assert max(per_layer.values()) == 13, per_layer
    assert not t.uncovered()
    # one dies: survivors take its replicas (budget rises), and drop them when it returns
    four = candidate_for(spec, names[:4], t)
    assert not four.uncovered()
    back = candidate_for(spec, names, four)
    assert max(len(p) for p in assignment_of(back).values()) <= 3 * 13
