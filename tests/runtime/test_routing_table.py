"""The routing table's invariants (checked at construction) and its named constructors."""

from __future__ import annotations

import json

import pytest

from eaas.runtime.placement import place_experts
from eaas.runtime.tables.push import PushError, authorize, check_push_token
from eaas.runtime.tables.table import RoutingTable
from eaas.runtime.tables.wire import RoutingTableError

SERVERS = {"a": "tcp://127.0.0.1:1", "b": "tcp://127.0.0.1:2"}


def test_fields_are_normalized_to_dicts_and_tuples():
    t = RoutingTable(3, 2, SERVERS, {1: [["a", "b"], ["b"]]})
    assert t.layers == {1: (("a", "b"), ("b",))}
    assert t == RoutingTable(3, 2, dict(SERVERS), {1: (("a", "b"), ("b",))})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"version": -1}, "'version' must be an integer >= 0"),
        ({"version": True}, "'version' must be an integer >= 0"),
        ({"version": 1.0}, "'version' must be an integer >= 0"),
        ({"num_experts": -2}, "'num_experts' must be an integer >= 0"),
        ({"layers": {-1: (("a",), ())}}, "'layers' must be an integer >= 0"),
        ({"layers": {1: (("ghost",), ())}}, r"layers\[1\]\[0\] names unknown server 'ghost'"),
        ({"layers": {1: ((), ("a", "b", "a"))}}, r"layers\[1\]\[1\] names a server twice"),
    ],
)
def test_invariants_are_checked_at_construction(kwargs, match):
    fields = {"version": 1, "num_experts": 2, "servers": SERVERS, "layers": {1: (("a",), ())}}
    fields.update(kwargs)
    with pytest.raises(RoutingTableError, match=match):
        RoutingTable(**fields)


def test_a_wire_table_breaking_an_invariant_is_refused():
    d = RoutingTable(1, 2, SERVERS, {1: (("a",), ("b",))}).to_dict()
    d["layers"]["1"][1] = ["b", "b"]
    with pytest.raises(RoutingTableError, match="twice"):
        RoutingTable.from_dict(d)
    d["layers"]["1"][1] = ["b"]
    d["version"] = -3
    with pytest.raises(RoutingTableError, match="version"):
        RoutingTable.from_json(json.dumps(d))


def test_from_assignment_orders_replicas_by_endpoints_and_ignores_pairs_outside_the_model():
    t = RoutingTable.from_assignment(
        {"b": [(1, 0), (1, 0), (2, 1)], "a": [(1, 0), (1, 5), (9, 0)], "gone": [(1, 1)]},
        {"b": SERVERS["b"], "a": SERVERS["a"]},
        7,
        num_experts=2,
        layers=[1, 2],
    )
    assert t.version == 7 and list(t.servers) == ["b", "a"]
    assert t.layers == {1: (("b", "a"), ()), 2: ((), ("b",))}
    assert t.assignment() == {"b": frozenset({(1, 0), (2, 1)}), "a": frozenset({(1, 0)})}
    assert t.hosted_by("b") == [(1, 0), (2, 1)] and t.hosted_by("gone") == []
    assert t.uncovered() == [(1, 1), (2, 0)]
    assert t.coverage(2) == (4, 3, 2)


def test_from_placement_equals_from_assignment_of_its_servers():
    p = place_experts([1, 3], 4, 3, 2)
    ids, eps = ["s0", "s1", "s2"], [f"tcp://127.0.0.1:{9000 + i}" for i in range(3)]
    t = RoutingTable.from_placement(p, ids, eps, version=2)
    assert t == RoutingTable.from_assignment(
        dict(zip(ids, p.servers, strict=True)),
        dict(zip(ids, eps, strict=True)),
        2,
        num_experts=4,
        layers=[1, 3],
    )
    for (layer, e), servers in p.replicas().items():
        assert t.replicas(layer, e) == tuple(ids[s] for s in servers)
    with pytest.raises(RoutingTableError, match="unique"):
        RoutingTable.from_placement(p, ["s0", "s0", "s2"], eps)
    with pytest.raises(RoutingTableError, match="3 servers"):
        RoutingTable.from_placement(p, ids[:2], eps[:2])


def test_version_changes_keep_the_replicas():
    t = RoutingTable(4, 2, SERVERS, {1: (("a", "b"), ("b",))})
    assert t.with_version(9).version == 9 and t.with_version(9).same_replicas(t)
    assert not t.same_replicas(None)
    t2 = t.without_servers(["b"])
    assert t2.version == 5 and t2.servers == {"a": SERVERS["a"]}
    assert t2.layers == {1: (("a",), ())} and not t2.same_replicas(t)
    assert RoutingTable.from_wire(t.to_wire(compact_over=0)) == t


def test_one_bearer_check_for_clients_servers_and_the_operator():
    assert authorize(" Bearer tok", "tok")
    assert not authorize("Bearer ", "")

    class Token:
        def __init__(self, value):
            self.value = value

        def get(self):
            if isinstance(self.value, Exception):
                raise self.value
            return self.value

    check_push_token(Token("tok"), "Bearer tok", "hint")
    for token, header, status in [
        (None, "Bearer tok", 403),
        (Token(OSError("gone")), "Bearer tok", 503),
        (Token("tok"), "Bearer nope", 401),
    ]:
        with pytest.raises(PushError) as info:
            check_push_token(token, header, "start it with --push-token-file")
        assert info.value.status == status
    status, body = info.value.answer({"applied_version": 3})
    assert status == 401 and body["error"]["code"] == "invalid_token"
    assert body["applied_version"] == 3
    assert info.value.headers == {"WWW-Authenticate": 'Bearer realm="eaas"'}
