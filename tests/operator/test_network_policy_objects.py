"""The pool's NetworkPolicy (rendered object, pure) and the operator's switch for it."""

from __future__ import annotations

import pytest

from eaas.operator.crd import ExpertPoolSpec
from eaas.operator.names import Owner
from eaas.operator.network_policy import OPERATOR_POD_LABELS, pool_network_policy
from eaas.operator.settings import Settings

pytestmark = pytest.mark.failstatic

OWNER = Owner(kind="ExpertPool", namespace="ml", name="tiny", uid="u-1", generation=1)


def spec(**over):
    base = {
        "model": {"uri": "/models/tiny", "firstMoeLayer": 1, "numMoeLayers": 3, "numExperts": 32},
        "replicas": 4,
        "port": 9100,
        "healthPort": 9101,
    }
    base.update(over)
    return ExpertPoolSpec.model_validate(base)


def test_servers_ports_open_to_the_pools_clients_and_the_operator_only():
    np = pool_network_policy(OWNER, spec())
    assert np is not None
    assert (np["apiVersion"], np["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    meta = np["metadata"]
    assert (meta["name"], meta["namespace"]) == ("tiny-expert-servers", "ml")
    assert meta["ownerReferences"][0]["uid"] == "u-1"  # deleted with the pool
    s = np["spec"]
    assert s["podSelector"] == {
        "matchLabels": {"eaas.io/pool": "tiny", "eaas.io/role": "expert-server"}
    }
    assert s["policyTypes"] == ["Ingress"]  # egress untouched (servers watch the API)
    clients, operator = s["ingress"]
    # clients: same namespace only (no namespaceSelector), data and HTTP ports
    assert clients["from"] == [
        {"podSelector": {"matchLabels": {"eaas.io/role": "attention-client"}}}
    ]
    assert {p["port"] for p in clients["ports"]} == {9100, 9101}
    # the operator's pods, any namespace: the HTTP port only (pushes, probes, scrapes)
    assert operator["from"] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": OPERATOR_POD_LABELS}}
    ]
    assert [p["port"] for p in operator["ports"]] == [9101]
    assert all(p["protocol"] == "TCP" for r in s["ingress"] for p in r["ports"])
    # a changed port is a changed policy (re-applied: its hash differs)
    other = pool_network_policy(OWNER, spec(port=9200))
    assert other is not None
    key = "eaas.io/spec-hash"
    assert other["metadata"]["annotations"][key] != meta["annotations"][key]


def test_no_policy_for_an_nvshmem_world():
    nv = spec(
        transport={
            "scheme": "nvshmem",
            "nvshmem": {"clients": 1, "uidVolume": {"emptyDir": {}}},
        }
    )
    assert pool_network_policy(OWNER, nv) is None


def test_switch_from_env():
    assert Settings.from_env({}).network_policies is True
    assert Settings.from_env({"EAAS_OPERATOR_NETWORK_POLICIES": "false"}).network_policies is False
    assert Settings.from_env({"EAAS_OPERATOR_NETWORK_POLICIES": "On"}).network_policies is True
    with pytest.raises(ValueError, match="EAAS_OPERATOR_NETWORK_POLICIES"):
        Settings.from_env({"EAAS_OPERATOR_NETWORK_POLICIES": "maybe"})
