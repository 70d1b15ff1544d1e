"""ExpertPool specs against a real API server and the operator: invalid specs are rejected by
the CRD schema naming the field (nothing is created), and a valid ``spec.podTemplate`` overlay and
``spec.model.hostPath`` reach the real pods while an overlay key the operator cannot apply gives
status Degraded/InvalidSpec naming the field.
"""

from __future__ import annotations

import pytest

from helpers.k8s import apply, converged, get, pods, pool_manifest, wait_for


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda s: s.update(replicas=0), "spec.replicas"),
        (lambda s: s.update(replicas=-3), "spec.replicas"),
        (
            lambda s: s.update(replicas=3, redundancy=4),
            "spec.redundancy must not exceed spec.replicas",
        ),
        (lambda s: s.update(placement={"policy": "random"}), "spec.placement.policy"),
        (lambda s: s.pop("model"), "spec.model"),
        (lambda s: s["model"].pop("uri"), "spec.model.uri"),
        (
            lambda s: s["model"].update(hostPath="/srv", persistentVolumeClaim="w"),
            "give at most one of hostPath and persistentVolumeClaim",
        ),
        (
            lambda s: s["model"].update(hostPath="/srv"),
            "uri must be relative to the volume's root",
        ),
        (
            lambda s: s["model"].update(persistentVolumeClaim="Weights_Claim", uri="tiny"),
            "spec.model.persistentVolumeClaim",
        ),
        (lambda s: s.update(redundancy=0), "spec.redundancy"),
        (lambda s: s.update(port=70000), "spec.port"),
        (
            lambda s: s.update(
                autoscaling={"minReplicas": 3, "maxReplicas": 2, "targetLoadPerServer": 10}
            ),
            "spec.autoscaling.minReplicas must not exceed maxReplicas",
        ),
        (
            lambda s: s.update(
                autoscaling={"minReplicas": 1, "maxReplicas": 4, "targetLoadPerServer": 10}
            ),
            "spec.autoscaling.minReplicas must be at least spec.redundancy",
        ),
        (
            lambda s: s.update(autoscaling={"minReplicas": 2, "maxReplicas": 4}),
            "spec.autoscaling.targetLoadPerServer",
        ),
    ],
    ids=[
        "replicas0",
        "replicasNeg",
        "redundancy>replicas",
        "policy",
        "noModel",
        "noUri",
        "twoSources",
        "absoluteUriInVolume",
        "claimName",
        "redundancy0",
        "port",
        "autoscalingMin>Max",
        "autoscalingMin<redundancy",
        "autoscalingNoTarget",
    ],
)
def test_invalid_specs_rejected(ns, operator, mutate, field):
    m = pool_manifest("bad")
    mutate(m["spec"])
    r = apply(m, ns, check=False)
    assert r.returncode != 0, "API server accepted an invalid spec"
    assert field in r.stderr, r.stderr
    assert get("expertpool", "bad", ns) is None
    assert pods(ns, "bad") == []


def test_overlong_name_rejected(ns, operator):
    r = apply(pool_manifest("p" * 53), ns, check=False)
    assert r.returncode != 0 and "metadata.name must be at most 52 characters" in r.stderr, r.stderr
    assert apply(pool_manifest("p" * 52, replicas=2), ns).returncode == 0


def test_pod_template_overlay_and_model_volume(ns, operator):
    """spec.model.hostPath and spec.podTemplate reach the real pods; an overlay key
    the operator cannot apply gives status Degraded/InvalidSpec naming the field, and no pod."""
    overlay = {
        "metadata": {"labels": {"team": "ml"}},
        "spec": {
            "imagePullSecrets": [{"name": "regcred"}],
            "containers": [{"name": "expert-server", "env": [{"name": "X", "value": "1"}]}],
        },
    }
    m = pool_manifest("ovl", replicas=2, podTemplate=overlay)
    m["spec"]["model"].update(hostPath="/srv/models", uri="tiny")
    apply(m, ns)
    got = wait_for("overlay pool Ready", lambda: converged(ns, "ovl"), timeout=90)
    for p in got["pods"]:
        assert p["metadata"]["labels"]["team"] == "ml"
        assert p["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        c = p["spec"]["containers"][0]
        assert {"name": "X", "value": "1"} in c["env"]
        assert c["command"][c["command"].index("--model") + 1] == "/models/tiny"
        vol = next(v for v in p["spec"]["volumes"] if v["name"] == "model")
        assert vol["hostPath"] == {"path": "/srv/models", "type": "Directory"}
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"

    bad = pool_manifest("badovl", replicas=2, podTemplate={"spec": {"hostNetwork": True}})
    apply(bad, ns)

    def invalid():
        st = (get("expertpool", "badovl", ns) or {}).get("status") or {}
        deg = next((c for c in st.get("conditions", []) if c["type"] == "Degraded"), None)
        return deg if deg and deg["reason"] == "InvalidSpec" else None

    deg = wait_for("InvalidSpec status", invalid, timeout=60)
    assert "spec.podTemplate.spec.hostNetwork" in deg["message"]
    assert pods(ns, "badovl") == []
