"""Pure decisions of push/acknowledge and the ConfigMap watcher (no processes): bearer-token
check, pushed-table validation, version ordering, ConfigMap decoding, token rotation."""

from __future__ import annotations

import base64
import gzip

import pytest

from eaas.runtime.tables.push import (
    BearerToken,
    PushError,
    authorize,
    parse_pushed_table,
    push_decision,
)
from eaas.runtime.tables.table import RoutingTable
from eaas.runtime.tables.watch import parse_configmap_ref, table_from_configmap
from eaas.runtime.tables.wire import RoutingTableError

TABLE = RoutingTable(4, 2, {"s0": "tcp://127.0.0.1:1"}, {1: (("s0",), ("s0",))})


def test_authorize():
    assert authorize("Bearer tok", "tok")
    assert authorize("bearer  tok ", "tok")
    assert not authorize(None, "tok")
    assert not authorize("", "tok")
    assert not authorize("tok", "tok")
    assert not authorize("Basic tok", "tok")
    assert not authorize("Bearer tok2", "tok")
    assert not authorize("Bearer ", "tok")


def test_parse_pushed_table_checks_json_fields_and_model():
    t = parse_pushed_table(TABLE.to_json().encode(), num_experts=2, moe_layers=(1, 2))
    assert t == TABLE
    for raw, needle in [
        (b"\xff", "UTF-8"),
        (b"[", "not valid JSON"),
        (b'{"num_experts": 2}', "version"),
        (TABLE.to_json().replace('"version":4', '"version":0').encode(), ">= 1"),
        (
            TABLE.to_json().replace('"version":4', '"version":"4"').encode(),
            "'version' must be an integer, got '4'",
        ),
        (
            TABLE.to_json().replace('"version":4', '"version":4.0').encode(),
            "'version' must be an integer",
        ),
        (
            TABLE.to_json().replace('"version":4', '"version":true').encode(),
            "'version' must be an integer",
        ),
        (
            TABLE.to_json().replace('"num_experts":2', '"num_experts":"2"').encode(),
            "'num_experts' must be an integer",
        ),
        # beyond int64 (the CRD status fields and Kubernetes' integers): was applied, and no
        # later table of the operator could ever be newer
        (
            TABLE.to_json().replace('"version":4', f'"version":{2**63}').encode(),
            "'version' must be at most 2\\*\\*63 - 1",
        ),
        # nesting deeper than Python's recursion limit was a RecursionError (HTTP 500)
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"version": 4, "pad": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        # the wrong JSON type names the field, not a Python internal
        (b"[1, 2]", "routing table must be a JSON object, got list"),
        (b"null", "routing table must be a JSON object, got null"),
        (
            TABLE.to_json()
            .replace('"servers":{"s0":"tcp://127.0.0.1:1"}', '"servers":[1]')
            .encode(),
            "field 'servers' must be an object",
        ),
        (
            TABLE.to_json().replace('"layers":{"1":', '"layers":{"1":"xy","9":').encode(),
            r"field 'layers\[1\]' must be a list",
        ),
    ]:
        with pytest.raises(PushError, match=needle) as e:
            parse_pushed_table(raw)
        assert e.value.status == 400 and e.value.code == "invalid_routing_table"
    with pytest.raises(PushError, match="num_experts is 2 but .* 8"):
        parse_pushed_table(TABLE.to_json().encode(), num_experts=8)
    with pytest.raises(PushError, match=r"layers \[1\] are not MoE layers"):
        parse_pushed_table(TABLE.to_json().encode(), moe_layers=(2, 3))


def test_push_decision_only_strictly_newer():
    assert push_decision(5, 4) is None
    assert push_decision(1, 0) is None
    for new in (4, 3):
        err = push_decision(new, 4)
        assert err is not None and err.status == 409 and err.code == "stale_version"


def test_table_from_configmap_data_and_binary():
    text = TABLE.to_json()
    assert table_from_configmap({"routing-table.json": text}, None) == TABLE
    b64 = base64.b64encode(text.encode()).decode()
    assert table_from_configmap(None, {"routing-table.json": b64}) == TABLE
    gz = base64.b64encode(gzip.compress(text.encode())).decode()
    assert table_from_configmap({}, {"routing-table.json": gz}) == TABLE
    assert table_from_configmap({"other": text}, None) is None
    with pytest.raises(RoutingTableError):
        table_from_configmap({"routing-table.json": "{"}, None)
    with pytest.raises(RoutingTableError, match="binaryData"):
        table_from_configmap(None, {"routing-table.json": "!!notbase64"})


def test_parse_configmap_ref():
    assert parse_configmap_ref("ns/name") == ("ns", "name")
    for bad in ("name", "a/b/c", "/name", "ns/"):
        with pytest.raises(ValueError, match="NAMESPACE/NAME"):
            parse_configmap_ref(bad)


def test_bearer_token_rereads_a_rotated_file(tmp_path):
    p = tmp_path / "token"
    p.write_text("first\n")
    tok = BearerToken(str(p))
    assert tok.get() == "first"
    new = tmp_path / "token.new"
    new.write_text("second-longer")
    new.replace(p)  # a Secret rotation swaps the file
    assert tok.get() == "second-longer"
    p.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        BearerToken(str(p)).get()
    with pytest.raises(OSError):
        BearerToken(str(tmp_path / "missing")).get()
