"""An AttentionFleet against a real API server and the operator: the Deployment of attention
clients, its push-token Secret, least-privilege Role, Service, status and scaling.
"""

from __future__ import annotations

from helpers.k8s import ROOT, converged, get, kubectl, pods, table, wait_for


def test_attention_fleet(ns, operator):
    kubectl(
        "apply",
        "-n",
        ns,
        "-f",
        str(ROOT / "deploy/examples/tiny-pool.yaml"),
        "-f",
        str(ROOT / "deploy/examples/tiny-fleet.yaml"),
    )
    pool = wait_for("pool Ready", lambda: converged(ns, "tiny"), timeout=90)
    dep = wait_for("deployment", lambda: get("deployment", "tiny-clients", ns), timeout=30)
    pod_spec = dep["spec"]["template"]["spec"]
    c = pod_spec["containers"][0]
    assert c["command"][:10] == [
        "eaas",
        "attention-client",
        "--model",
        "/models/tiny",
        "--client-id",
        "$(EAAS_POD_NAME)",  # one id per replica: the kubelet expands the pod name
        "--routing-table-configmap",
        f"{ns}/tiny-routing-table",
        "--push-token-file",
        "/etc/eaas/push-token/token",
    ]
    env = {e["name"]: e for e in c["env"]}
    assert env["EAAS_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert pod_spec["serviceAccountName"] == "tiny-clients-client"
    vol = next(v for v in pod_spec["volumes"] if v["name"] == "push-token")
    assert vol["secret"]["secretName"] == "tiny-clients-push-token"
    secret = wait_for(
        "push token", lambda: get("secret", "tiny-clients-push-token", ns), timeout=30
    )
    assert len(secret["data"]["token"]) >= 40
    role = get("role", "tiny-clients-client", ns)
    assert role["rules"][0]["resourceNames"] == ["tiny-routing-table"]
    assert get("rolebinding", "tiny-clients-client", ns)["subjects"][0]["name"] == (
        "tiny-clients-client"
    )
    assert dep["spec"]["replicas"] == 2
    svc = get("service", "tiny-clients", ns)
    assert svc["spec"]["ports"][0]["port"] == 8000
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]

    def fleet_ready():
        f = get("attentionfleet", "tiny-clients", ns)
        st = (f or {}).get("status") or {}
        ok = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", []))
        return f if ok and st.get("readyReplicas") == 2 else None

    fleet = wait_for("fleet Ready", fleet_ready, timeout=90)
    assert (
        fleet["status"]["routingTableVersion"] == table(ns, "tiny").version >= pool["table"].version
    )
    # client pods are not mistaken for expert servers
    assert len(pods(ns, "tiny")) == 4
    # scaling the fleet goes through to the Deployment
    kubectl("scale", "attentionfleet/tiny-clients", "-n", ns, "--replicas=3")
    wait_for(
        "deployment scaled",
        lambda: get("deployment", "tiny-clients", ns)["spec"]["replicas"] == 3,
        timeout=30,
    )
