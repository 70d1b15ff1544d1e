"""Unit tests of the pure placement and routing-table logic."""

import itertools

import pytest

from eaas.runtime.placement import PlacementError, dispatch_columns, place_experts, spread_over_cpus
from eaas.runtime.tables.expert_spec import format_expert_spec, parse_expert_spec
from eaas.runtime.tables.table import RoutingTable
from eaas.runtime.tables.wire import RoutingTableError

LAYERS = (1, 2, 3)


@pytest.mark.parametrize("policy", ["round-robin", "load-balanced"])
@pytest.mark.parametrize(
    "servers,redundancy", [(2, 2), (3, 2), (4, 2), (5, 3), (7, 2), (40, 2), (33, 1)]
)
def test_every_expert_has_redundancy_replicas_on_distinct_servers(policy, servers, redundancy):
    p = place_experts(LAYERS, 32, servers, redundancy, policy=policy)
    reps = p.replicas()
    assert set(reps) == {(layer, e) for layer in LAYERS for e in range(32)}
    for pair, where in reps.items():
        assert len(where) == redundancy, pair
        assert len(set(where)) == redundancy, pair  # distinct servers
    assert p.experts_below_redundancy() == 0
    # Balance per layer: every server hosts floor or ceil of E*R/N replicas of each layer.
    for layer in LAYERS:
        counts = [sum(1 for (l, _) in hosted if l == layer) for hosted in p.servers]
        assert max(counts) - min(counts) <= 1, counts


def test_any_server_count_works_without_divisibility():
    # 40 servers, 256 experts, 58 layers: 40 does not divide 256; monolithic EP cannot use it.
    p = place_experts(range(3, 61), 256, 40, 2)
    per_server = p.experts_per_server()
    assert sum(per_server) == 58 * 256 * 2
    assert max(per_server) - min(per_server) <= 58  # at most one extra replica per layer


def test_load_balanced_beats_round_robin_under_skew():
    # Experts 0 and 4 are hot; round-robin deals both onto servers 0 and 1 (8 servers, R=2).
    load = {(1, e): (100.0 if e in (0, 4) else 1.0) for e in range(32)}

    def max_server_load(p):
        reps = p.replicas()
        server_load = [0.0] * p.num_servers
        for pair, where in reps.items():
            for s in where:
                server_load[s] += load[pair] / len(where)
        return max(server_load)

    rr = place_experts([1], 32, 8, 2, policy="round-robin", expert_load=load)
    lb = place_experts([1], 32, 8, 2, policy="load-balanced", expert_load=load)
    assert max_server_load(lb) < max_server_load(rr)


def test_dead_servers_reduce_coverage_count():
    p = place_experts([1], 8, 4, 2)
    assert p.experts_below_redundancy(alive=[0, 1, 2, 3]) == 0
    assert p.experts_below_redundancy(alive=[0, 1, 2]) > 0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_servers=0), "num_servers"),
        (dict(redundancy=3, num_servers=2), "redundancy"),
        (dict(redundancy=0), "redundancy"),
        (dict(num_experts=0), "num_experts"),
        (dict(policy="random"), "unknown placement policy"),
    ],
)
def test_invalid_requests_raise_with_field(kwargs, match):
    args = dict(layers=[1], num_experts=8, num_servers=4, redundancy=2)
    args.update(kwargs)
    with pytest.raises(PlacementError, match=match):
        place_experts(**args)


def test_expert_spec_round_trip():
    pairs = [(1, 0), (1, 1), (1, 2), (1, 7), (3, 5), (3, 6)]
    spec = format_expert_spec(pairs)
    assert spec == "1:0-2,7;3:5-6"
    assert parse_expert_spec(spec) == pairs
    for servers in range(2, 6):
        p = place_experts(LAYERS, 32, servers, 2)
        for hosted in p.servers:
            assert parse_expert_spec(format_expert_spec(hosted)) == list(hosted)


@pytest.mark.parametrize("bad", ["x:1", "1:a-b", "1:5-3", "1"])
def test_malformed_expert_spec(bad):
    with pytest.raises(ValueError, match="malformed expert spec"):
        parse_expert_spec(bad)


def _table():
    p = place_experts(LAYERS, 8, 3, 2)
    ids = [f"s{i}" for i in range(3)]
    return RoutingTable.from_placement(
        p, ids, [f"tcp://127.0.0.1:{9000 + i}" for i in range(3)], version=4
    )


def test_routing_table_json_round_trip_and_queries():
    t = _table()
    t2 = RoutingTable.from_json(t.to_json())
    assert t2 == t
    for layer, e in itertools.product(LAYERS, range(8)):
        assert len(t.replicas(layer, e)) == 2
    assert sorted(set(t.hosted_by("s0")) | set(t.hosted_by("s1")) | set(t.hosted_by("s2"))) == [
        (layer, e) for layer in LAYERS for e in range(8)
    ]


def test_without_servers_bumps_version_and_keeps_coverage_with_redundancy_2():
    t = _table()
    t2 = t.without_servers(["s1"])
    assert t2.version == t.version + 1
    assert "s1" not in t2.servers
    assert t2.uncovered() == []  # one dead server never removes the last replica when R=2
    t3 = t2.without_servers(["s0"])
    assert t3.uncovered() != []


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: d.pop("version"), "version"),
        (lambda d: d["layers"]["1"].pop(), "num_experts"),
        (lambda d: d["layers"]["1"][0].append("ghost"), "ghost"),
    ],
)
def test_routing_table_rejects_malformed(mutate, match):
    d = _table().to_dict()
    mutate(d)
    with pytest.raises(RoutingTableError, match=match):
        RoutingTable.from_dict(d)
    with pytest.raises(RoutingTableError, match="JSON"):
        RoutingTable.from_json("{not json")


def test_compact_wire_form_round_trips():
    t = _table()
    assert t.to_wire() == t.to_json()  # small tables stay plain, human-readable JSON
    wire = t.to_wire(compact_over=0)
    assert '"encoding":"zlib+base64"' in wire
    assert RoutingTable.from_json(wire) == t


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: d.update(encoding="gzip"), "unknown routing table encoding"),
        (lambda d: d.update(table="!!notbase64"), "table"),
        (lambda d: d.pop("table"), "table"),
    ],
)
def test_compact_wire_form_rejects_malformed(mutate, match):
    import json

    d = json.loads(_table().to_wire(compact_over=0))
    mutate(d)
    with pytest.raises(RoutingTableError, match=match):
        RoutingTable.from_dict(d)


def test_largest_pool_the_crd_accepts_fits_a_configmap():
    """4096 servers x redundancy 4 x 58 MoE layers x 256 experts, 63-character server names:
    the plain JSON (~4 MB) would not fit a ConfigMap (1 MiB); the compact form does."""
    import random

    from eaas.operator.desired import CONFIGMAP_DATA_LIMIT

    rng = random.Random(0)
    n, r, experts = 4096, 4, 256
    names = [f"{'p' * 52}-{i:010d}" for i in range(n)]
    assert all(len(x) == 63 for x in names)
    layers = {}
    for layer in range(3, 61):
        order = list(range(n))
        rng.shuffle(order)  # one replica per server per layer, random servers
        layers[layer] = tuple(
            tuple(names[order[e * r + k]] for k in range(r)) for e in range(experts)
        )
    t = RoutingTable(
        version=12345,
        num_experts=experts,
        servers={
            x: f"tcp://10.{i // 65536}.{i // 256 % 256}.{i % 256}:9000" for i, x in enumerate(names)
        },
        layers=layers,
    )
    plain = t.to_json()
    wire = t.to_wire()
    assert len(plain) > 1024 * 1024
    assert len(wire.encode()) < CONFIGMAP_DATA_LIMIT, len(wire)
    assert RoutingTable.from_json(wire) == t


def test_dispatch_columns_are_the_servers_a_decode_call_reaches():
    # 4 servers, R=2 (serve's default): expert e on servers {0, 1} or {2, 3}, listed ascending;
    # slot 0 of every expert is {0, 2}, slot 1 is {1, 3}
    p = place_experts(LAYERS, 32, 4, 2)
    assert p.replicas()[(1, 0)] == (0, 1) and p.replicas()[(1, 1)] == (2, 3)
    assert dispatch_columns(p) == [frozenset({0, 2}), frozenset({1, 3})]
    # R=1: every server hosts its own experts, so a call may need all of them
    assert dispatch_columns(place_experts(LAYERS, 8, 3, 1)) == [frozenset({0, 1, 2})]


@pytest.mark.parametrize("servers,redundancy", [(2, 2), (3, 2), (4, 2), (6, 2), (8, 2), (6, 3)])
@pytest.mark.parametrize("ncpu", [2, 3, 4])
def test_spread_over_cpus_puts_each_column_on_distinct_cpus_when_they_allow(
    servers, redundancy, ncpu
):
    p = place_experts(LAYERS, 32, servers, redundancy)
    cpus = [10 + 2 * c for c in range(ncpu)]  # any CPU ids, not necessarily 0..n-1
    cpu = spread_over_cpus(p, cpus)
    assert len(cpu) == servers and set(cpu) <= set(cpus)
    for col in dispatch_columns(p):
        used = [cpu[s] for s in col]
        # as many distinct CPUs as the column has servers, or every CPU
        assert len(set(used)) == min(len(col), ncpu), (col, cpu)
    # servers spread evenly over the CPUs
    counts = [cpu.count(c) for c in cpus]
    assert max(counts) - min(counts) <= 1, counts
    assert spread_over_cpus(p, cpus) == cpu  # deterministic


def test_spread_over_cpus_needs_a_cpu():
    with pytest.raises(ValueError, match="no CPUs"):
        spread_over_cpus(place_experts(LAYERS, 8, 2, 2), [])
    assert spread_over_cpus(place_experts(LAYERS, 8, 3, 2), [5]) == (5, 5, 5)
