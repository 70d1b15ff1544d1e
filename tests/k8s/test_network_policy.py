"""NetworkPolicies against the real API server: the chart's policy for the operator's pods
renders and validates (server-side dry run), the operator applies each pool's
``<pool>-expert-servers`` policy, and with ``EAAS_OPERATOR_NETWORK_POLICIES=false`` deletes the
one it made. (The testbed has no network plugin: it stores policies, nothing enforces them.)"""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest
import yaml

from helpers.k8s import Operator, apply, get, kubectl, pool_manifest, wait_for

pytestmark = pytest.mark.failstatic
CHART = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "helm", "eaas-operator")


def render(*values: str) -> list[dict]:
    out = subprocess.run(
        ["helm", "template", "eaas-operator", CHART, "-n", "eaas-system", *values],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_chart_policy_renders_and_validates(testbed):
    docs = render()
    (np,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    reports, health = np["spec"]["ingress"]
    assert [p["port"] for p in reports["ports"]] == [8081]
    assert reports["from"][0] == {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"eaas.io/role": "attention-client"}},
    }
    assert [p["port"] for p in health["ports"]] == [8080]
    env = {
        e["name"]: e.get("value")
        for d in docs
        if d["kind"] == "Deployment"
        for e in d["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["EAAS_OPERATOR_NETWORK_POLICIES"] == "true"
    rules = [r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]]
    assert any("networkpolicies" in r["resources"] for r in rules)
    kubectl("create", "namespace", "eaas-system", check=False)
    kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(np))  # the API validates it
    # with the external metrics API on, its port is open to the aggregator (no pod: any source)
    (np,) = [
        d for d in render("--set", "externalMetrics.enabled=true") if d["kind"] == "NetworkPolicy"
    ]
    assert np["spec"]["ingress"][2] == {"ports": [{"protocol": "TCP", "port": 8443}]}
    off = render("--set", "networkPolicy.enabled=false")
    assert not [d for d in off if d["kind"] == "NetworkPolicy"]
    dep = next(d for d in off if d["kind"] == "Deployment")
    env = {
        e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["EAAS_OPERATOR_NETWORK_POLICIES"] == "false"


def test_operator_applies_the_pools_policy_and_removes_it_when_off(testbed, crds, tmp_path):
    ns = f"np-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", ns)
    op = Operator(tmp_path / "op.log")
    try:
        op.start()
        apply(pool_manifest("tiny", replicas=2), ns)
        np = wait_for(
            "the pool's NetworkPolicy",
            lambda: get("networkpolicy", "tiny-expert-servers", ns),
            timeout=60,
        )
        assert np["spec"]["podSelector"]["matchLabels"] == {
            "eaas.io/pool": "tiny",
            "eaas.io/role": "expert-server",
        }
        assert np["metadata"]["ownerReferences"][0]["kind"] == "ExpertPool"
        op.stop()
        off = Operator(tmp_path / "off.log", env={"EAAS_OPERATOR_NETWORK_POLICIES": "false"})
        try:
            off.start()
            wait_for(
                "the policy deleted",
                lambda: get("networkpolicy", "tiny-expert-servers", ns) is None,
                timeout=60,
            )
        finally:
            off.stop()
    finally:
        op.stop()
        kubectl("delete", "namespace", ns, "--wait=false", check=False)
