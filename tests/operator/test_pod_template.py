"""Model volumes, the pod template overlay, the push-token Secret and the clients' RBAC (pure)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from eaas.operator.crd import ANNOTATION_SPEC_HASH, AttentionFleetSpec, ExpertPoolSpec
from eaas.operator.desired import (
    Owner,
    ack_summary,
    client_rbac,
    compute_placement,
    desired_server_pods,
    fleet_deployment,
    new_push_token,
    placement_revision,
    push_secret,
)
from eaas.operator.overlay import OverlayError, apply_pod_template

POOL_OWNER = Owner(kind="ExpertPool", name="tiny", namespace="ns", uid="uid-1", generation=1)
FLEET_OWNER = Owner("AttentionFleet", "clients", "ns", "fu", 1)
MODEL = {"firstMoeLayer": 1, "numMoeLayers": 3, "numExperts": 32}


def pool(model: dict | None = None, **over) -> ExpertPoolSpec:
    return ExpertPoolSpec.model_validate(
        {"model": {**MODEL, **(model or {"uri": "/models/tiny"})}, "replicas": 4, **over}
    )


def fleet(model: dict | None = None, **over) -> AttentionFleetSpec:
    return AttentionFleetSpec.model_validate(
        {"expertPoolRef": {"name": "tiny"}, "model": model or {"uri": "/models/tiny"}, **over}
    )


def server_pod0(spec: ExpertPoolSpec) -> dict:
    p = compute_placement(spec)
    return desired_server_pods(POOL_OWNER, spec, p, placement_revision(spec))["tiny-0"]


def client_template(spec: AttentionFleetSpec) -> dict:
    return fleet_deployment(FLEET_OWNER, spec, None)["spec"]["template"]


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


# ---- spec.model: where the weights are -------------------------------------------------------
@pytest.mark.parametrize(
    ("source", "volume"),
    [
        ({"hostPath": "/srv/models"}, {"hostPath": {"path": "/srv/models", "type": "Directory"}}),
        (
            {"persistentVolumeClaim": "weights"},
            {"persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
        ),
    ],
)
def test_model_volume_is_mounted_and_names_the_model_path(source, volume):
    model = {"uri": "tiny", **source}
    for pod_spec, c in (
        (server_pod0(pool(model))["spec"], server_pod0(pool(model))["spec"]["containers"][0]),
        (
            client_template(fleet(model))["spec"],
            client_template(fleet(model))["spec"]["containers"][0],
        ),
    ):
        assert {"name": "model", **volume} in pod_spec["volumes"]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        assert flag(c["command"], "--model") == "/models/tiny"


def test_model_in_image_has_no_volume():
    pod = server_pod0(pool({"uri": "/opt/weights/tiny"}))
    assert "volumes" not in pod["spec"]
    assert flag(pod["spec"]["containers"][0]["command"], "--model") == "/opt/weights/tiny"
    t = client_template(fleet({"uri": "/opt/weights/tiny"}))
    assert [v["name"] for v in t["spec"]["volumes"]] == ["push-token"]


def test_model_source_fields_are_validated():
    with pytest.raises(ValidationError, match="hostPath"):
        pool({"uri": "tiny", "hostPath": "relative/dir"})


# ---- spec.podTemplate ------------------------------------------------------------------------
OVERLAY = {
    "metadata": {"labels": {"team": "ml", "eaas.io/pool": "hijack"}, "annotations": {"a": "b"}},
    "spec": {
        "serviceAccountName": "model-reader",
        "priorityClassName": "high",
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
        "imagePullSecrets": [{"name": "regcred"}],
        "nodeSelector": {"zone": "a"},
        "tolerations": [{"key": "dedicated", "operator": "Exists"}],
        "affinity": {"nodeAffinity": {"x": 1}},
        "volumes": [{"name": "cache", "emptyDir": {}}],
        "containers": [
            {
                "name": "expert-server",
                "env": [{"name": "HF_HOME", "value": "/cache"}],
                "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
                "securityContext": {"readOnlyRootFilesystem": True},
            },
            {"name": "log-shipper", "image": "fluent-bit:3"},
        ],
    },
}


def test_overlay_merges_into_server_pods():
    spec = pool(podTemplate=OVERLAY)
    pod = server_pod0(spec)
    meta, ps = pod["metadata"], pod["spec"]
    assert meta["labels"]["team"] == "ml"
    assert meta["labels"]["eaas.io/pool"] == "tiny"  # the operator's selector labels win
    assert meta["annotations"]["a"] == "b"
    assert ps["serviceAccountName"] == "model-reader"
    assert ps["priorityClassName"] == "high"
    assert ps["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000}
    assert ps["imagePullSecrets"] == [{"name": "regcred"}]
    assert ps["nodeSelector"] == {"eaas.io/rdma": "true", "zone": "a"}  # merged
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in ps[
        "tolerations"
    ]  # appended to the defaults
    assert {"key": "dedicated", "operator": "Exists"} in ps["tolerations"]
    assert ps["affinity"] == {"nodeAffinity": {"x": 1}}
    assert ps["volumes"] == [{"name": "cache", "emptyDir": {}}]
    server, sidecar = ps["containers"]
    assert server["name"] == "expert-server" and server["command"][1] == "expert-server"
    assert server["env"] == [{"name": "HF_HOME", "value": "/cache"}]
    assert server["volumeMounts"] == [{"name": "cache", "mountPath": "/cache"}]
    assert server["securityContext"] == {"readOnlyRootFilesystem": True}
    assert "livenessProbe" in server  # ours survive the merge
    assert sidecar == {"name": "log-shipper", "image": "fluent-bit:3"}
    # the overlay is part of the pod's spec hash: changing it replaces the pods
    assert (
        meta["annotations"][ANNOTATION_SPEC_HASH]
        != (server_pod0(pool())["metadata"]["annotations"][ANNOTATION_SPEC_HASH])
    )


def test_overlay_merges_lists_by_name_into_client_pods():
    spec = fleet(
        {"uri": "tiny", "hostPath": "/srv/models"},
        podTemplate={
            "spec": {
                "serviceAccountName": "own-sa",
                "volumes": [{"name": "model", "persistentVolumeClaim": {"claimName": "other"}}],
                "containers": [
                    {
                        "name": "attention-client",
                        "env": [{"name": "OMP_NUM_THREADS", "value": "4"}],
                        "volumeMounts": [
                            {"name": "model", "mountPath": "/models", "subPath": "v2"}
                        ],
                    }
                ],
            }
        },
    )
    ps = client_template(spec)["spec"]
    assert ps["serviceAccountName"] == "own-sa"
    # same name replaces ours, in place; others stay
    assert [v["name"] for v in ps["volumes"]] == ["push-token", "model"]
    assert ps["volumes"][1] == {"name": "model", "persistentVolumeClaim": {"claimName": "other"}}
    (c,) = ps["containers"]
    assert c["env"] == [  # merged by name: the operator's pod-name variable stays
        {"name": "EAAS_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "OMP_NUM_THREADS", "value": "4"},
    ]
    assert {"name": "model", "mountPath": "/models", "subPath": "v2"} in c["volumeMounts"]
    assert len([m for m in c["volumeMounts"] if m["mountPath"] == "/models"]) == 1


@pytest.mark.parametrize(
    ("overlay", "field"),
    [
        ({"spec": {"hostNetwork": True}}, "spec.podTemplate.spec.hostNetwork"),
        ({"kind": "Pod"}, "spec.podTemplate.kind"),
        ({"metadata": {"name": "x"}}, "spec.podTemplate.metadata.name"),
        (
            {"spec": {"containers": [{"name": "expert-server", "command": ["sh"]}]}},
            "spec.podTemplate.spec.containers[0].command",
        ),
        ({"spec": {"containers": [{"name": "side"}]}}, "spec.podTemplate.spec.containers[0]"),
        ({"spec": {"volumes": [{"emptyDir": {}}]}}, "spec.podTemplate.spec.volumes[0]"),
        ({"spec": {"tolerations": {"key": "x"}}}, "spec.podTemplate.spec.tolerations"),
    ],
)
def test_overlay_refuses_what_it_cannot_apply_naming_the_field(overlay, field):
    with pytest.raises(OverlayError) as exc:
        server_pod0(pool(podTemplate=overlay))
    assert str(exc.value).startswith(field)


def test_apply_pod_template_does_not_mutate_its_input():
    base = {"metadata": {"labels": {"a": "1"}}, "spec": {"containers": [{"name": "c"}]}}
    out = apply_pod_template(
        base, {"spec": {"containers": [{"name": "c", "env": [{"name": "X", "value": "1"}]}]}}
    )
    assert base == {"metadata": {"labels": {"a": "1"}}, "spec": {"containers": [{"name": "c"}]}}
    assert out["spec"]["containers"][0]["env"] == [{"name": "X", "value": "1"}]


# ---- push token, RBAC, acknowledgements ------------------------------------------------------
def test_push_secret_and_token():
    a, b = new_push_token(), new_push_token()
    assert a != b and len(a) >= 40
    s = push_secret(FLEET_OWNER, a)
    assert s["metadata"]["name"] == "clients-push-token"
    assert s["stringData"] == {"token": a}
    assert s["metadata"]["ownerReferences"][0]["uid"] == "fu"


def test_client_rbac_reads_only_the_pools_table():
    sa, role, binding = client_rbac(FLEET_OWNER, "tiny")
    assert sa["kind"] == "ServiceAccount" and sa["metadata"]["name"] == "clients-client"
    assert role["rules"] == [
        {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": ["tiny-routing-table"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    assert binding["roleRef"]["name"] == "clients-client"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "clients-client", "namespace": "ns"}
    ]


def test_ack_summary():
    assert ack_summary([], 5) == {"acknowledgedVersion": 0, "clientsAcknowledged": 0}
    assert ack_summary([5, 4, 6], 5) == {"acknowledgedVersion": 4, "clientsAcknowledged": 2}
    assert ack_summary([0, 5], 5) == {"acknowledgedVersion": 0, "clientsAcknowledged": 1}
    assert ack_summary([0], 0) == {"acknowledgedVersion": 0, "clientsAcknowledged": 0}
