"""``AttentionFleet.spec.apiKeySecret`` against a real API server: the client pods get
``EAAS_API_KEY`` from the Secret through a ``secretKeyRef`` (the key's value is in no pod spec,
argument or Deployment, and the operator never reads the Secret), and a bad reference is
refused by the API server naming the field.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from helpers.k8s import FLEET, ROOT, apply, get, kubectl, wait_for

pytestmark = pytest.mark.api

KEY_VALUE = "sk-test-0f9e8d7c6b5a"  # what must never show up outside the Secret


def fleet_manifest(name: str, **spec) -> dict:
    """The example fleet (deploy/examples/tiny-fleet.yaml) named ``name``, ``spec`` fields set."""
    m = json.loads(json.dumps(FLEET))
    m["metadata"]["name"] = name
    m["spec"].update(spec)
    return m


def test_fleet_pods_take_the_api_key_from_the_secret(ns, operator):
    kubectl("create", "secret", "generic", "llm-keys", "-n", ns, f"--from-literal=keys={KEY_VALUE}")
    apply(fleet_manifest("keyed", apiKeySecret={"name": "llm-keys", "key": "keys"}), ns)
    ref = {
        "name": "EAAS_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "llm-keys", "key": "keys"}},
    }
    dep = wait_for("deployment", lambda: get("deployment", "keyed", ns), timeout=60)
    [container] = dep["spec"]["template"]["spec"]["containers"]
    assert ref in container["env"], container["env"]
    assert "--api-key" not in container["command"]

    def client_pods():
        r = kubectl("get", "pods", "-n", ns, "-l", "eaas.io/fleet=keyed", "-o", "json")
        items = json.loads(r.stdout)["items"]
        return items if len(items) == FLEET["spec"]["replicas"] else None

    pods = wait_for("the fleet's pods", client_pods, timeout=90)
    for pod in pods:  # what the ReplicaSet controller built from the template
        [c] = [c for c in pod["spec"]["containers"] if c["name"] == "attention-client"]
        assert ref in c["env"], c["env"]
    # the value travels only in the Secret: not in the Deployment, the pods or their args
    everything = json.dumps(dep) + json.dumps(pods)
    assert KEY_VALUE not in everything
    # the key's default name is api-key
    apply(fleet_manifest("keyed-default", apiKeySecret={"name": "llm-keys"}), ns)
    dep = wait_for("deployment", lambda: get("deployment", "keyed-default", ns), timeout=60)
    env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {
        "name": "EAAS_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "llm-keys", "key": "api-key"}},
    } in env, env
    # without apiKeySecret: no EAAS_API_KEY at all
    apply(fleet_manifest("open"), ns)
    dep = wait_for("deployment", lambda: get("deployment", "open", ns), timeout=60)
    names = [e["name"] for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert "EAAS_API_KEY" not in names


def test_operator_rbac_does_not_read_secrets(testbed):
    """The Helm chart's ClusterRole (rendered by helm): Secrets get/create only (the fleets'
    push tokens it makes); nothing was added for API keys (the kubelet reads them)."""
    chart = str(ROOT / "deploy/helm/eaas-operator")
    r = subprocess.run(
        ["helm", "template", "eaas", chart, "--namespace", "eaas-system", "--skip-tests"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    roles = [d for d in yaml.safe_load_all(r.stdout) if d and d["kind"] in ("ClusterRole", "Role")]
    rules = [rule for d in roles for rule in d["rules"] if "secrets" in rule.get("resources", [])]
    assert [sorted(rule["verbs"]) for rule in rules] == [["create", "get"]], rules


@pytest.mark.parametrize(
    "ref,field",
    [
        ({"name": "Bad_Name"}, "spec.apiKeySecret.name"),
        ({"name": ""}, "spec.apiKeySecret.name"),
        ({"key": "api-key"}, "spec.apiKeySecret.name"),
        ({"name": "llm-keys", "key": "a/b"}, "spec.apiKeySecret.key"),
        ("llm-keys", "spec.apiKeySecret"),
    ],
    ids=["badName", "emptyName", "noName", "badKey", "notAnObject"],
)
def test_bad_api_key_secret_rejected_naming_the_field(ns, operator, ref, field):
    r = apply(fleet_manifest("bad", apiKeySecret=ref), ns, check=False)
    assert r.returncode != 0, "API server accepted a bad apiKeySecret"
    assert field in r.stderr, r.stderr
    assert get("attentionfleet", "bad", ns) is None
