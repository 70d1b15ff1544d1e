"""A kwok pod that the node-lifecycle controller marked Ready=False turns Ready again, as a
kubelet re-posts its pods' status once its node reports again (the testbed's ``pod-ready-again``
kwok stage). Without it a kwok node that missed its lease under load -- 4,096 pods on a loaded
machine -- left its pods NotReady for good and the pool never became Ready."""

from __future__ import annotations

import json
import uuid

import pytest

from helpers.k8s import kubectl, wait_for

pytestmark = pytest.mark.scale


def _ready(ns: str, name: str) -> str | None:
    out = kubectl("get", "pod", name, "-n", ns, "-o", "json", check=False)
    if out.returncode != 0:
        return None
    conditions = json.loads(out.stdout)["status"].get("conditions") or []
    return next((c["status"] for c in conditions if c["type"] == "Ready"), None)


def test_a_kwok_pod_marked_not_ready_by_the_node_controller_is_ready_again(testbed):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", ns)
    name = "marked"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": "gpu-node-0",  # a kwok node of the testbed
            "containers": [{"name": "c", "image": "eaas:local"}],
        },
    }
    try:
        kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(pod))
        wait_for("the pod Ready", lambda: _ready(ns, name) == "True", timeout=60)
        body = json.loads(kubectl("get", "pod", name, "-n", ns, "-o", "json").stdout)
        # what MarkPodsNotReady writes: the Ready condition False, the containers untouched
        marked = [
            dict(c, status="False", reason="NodeNotReady") if c["type"] == "Ready" else c
            for c in body["status"]["conditions"]
        ]
        kubectl(
            "patch", "pod", name, "-n", ns, "--subresource=status", "--type=merge",
            "-p", json.dumps({"status": {"conditions": marked}}),
        )  # fmt: skip
        wait_for("Ready again", lambda: _ready(ns, name) == "True", timeout=60)
        after = json.loads(kubectl("get", "pod", name, "-n", ns, "-o", "json").stdout)["status"]
        assert after["phase"] == "Running" and after["podIP"] == body["status"]["podIP"]
        kinds = {c["type"] for c in after["conditions"]}
        assert kinds == {c["type"] for c in body["status"]["conditions"]}  # none dropped
    finally:
        kubectl("delete", "namespace", ns, "--wait=false", check=False)
