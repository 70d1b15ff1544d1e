"""CRD generation: committed YAML is fresh, schemas are structural, rules name their fields."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from eaas.operator.crd import (
    CRD_DIRS,
    AttentionFleetSpec,
    ExpertPoolSpec,
    attentionfleet_crd,
    expertpool_crd,
    render_crds,
)
from eaas.runtime.placement import POLICIES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("out_dir", CRD_DIRS)
def test_committed_crds_are_fresh(out_dir):
    for fname, text in render_crds().items():
        path = ROOT / out_dir / fname
        assert path.exists(), f"{path} missing: run `eaas crds`"
        assert path.read_text() == text, f"{path} is stale: run `eaas crds` and commit the result"


def _walk(node, path="$"):
    yield path, node
    for k, v in (node.get("properties") or {}).items():
        yield from _walk(v, f"{path}.{k}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("crd", [expertpool_crd(), attentionfleet_crd()], ids=["ep", "af"])
def test_schema_is_structural(crd):
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "type" in node, f"{path} has no type"
        for bad in ("$ref", "anyOf", "oneOf", "allOf", "title", "$defs"):
            assert bad not in node, f"{path} has {bad}"
        if node.get("additionalProperties") is False:
            pytest.fail(f"{path}: additionalProperties false is not structural")
        if "properties" in node:
            assert "additionalProperties" not in node, path
        for req in node.get("required", []):
            assert req in node["properties"], f"{path} requires unknown {req}"


def _prop(crd, dotted):
    node = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for part in dotted.split("."):
        node = node["properties"][part]
    return node


def test_expertpool_defaults_bounds_enums():
    crd = expertpool_crd()
    assert crd["spec"]["names"]["shortNames"][0] == "ep"
    assert crd["spec"]["group"] == "eaas.io"
    assert _prop(crd, "spec.replicas")["minimum"] == 1
    assert "default" not in _prop(crd, "spec.replicas")
    assert _prop(crd, "spec.gpusPerServer")["default"] == 1
    assert (
        _prop(crd, "spec.redundancy")["default"] == 2
        and _prop(crd, "spec.redundancy")["minimum"] == 1
    )
    assert _prop(crd, "spec.placement")["default"] == {}
    assert _prop(crd, "spec.placement.policy")["enum"] == list(POLICIES)
    assert _prop(crd, "spec.placement.policy")["default"] == "round-robin"
    assert _prop(crd, "spec.nodeSelector")["default"] == {"eaas.io/rdma": "true"}
    assert _prop(crd, "spec.rdmaResource")["default"] == "rdma/ib"
    assert _prop(crd, "spec.port")["default"] == 9000
    assert _prop(crd, "spec.failureDetection")["default"] == {}
    assert _prop(crd, "spec.failureDetection.dispatchTimeoutMs")["default"] > 0
    assert _prop(crd, "spec.resources")["x-kubernetes-preserve-unknown-fields"] is True
    assert set(_prop(crd, "spec")["required"]) == {"model", "replicas"}
    assert set(_prop(crd, "spec.model")["required"]) == {"uri", "numMoeLayers", "numExperts"}
    # fields nothing reads are gone
    assert not {"topK", "hiddenSize"} & set(_prop(crd, "spec.model")["properties"])
    assert set(_prop(crd, "spec.failureDetection")["properties"]) == {"dispatchTimeoutMs"}
    assert _prop(crd, "spec.healthPort")["default"] == 9001
    assert _prop(crd, "spec.podTemplate")["x-kubernetes-preserve-unknown-fields"] is True
    assert _prop(crd, "spec.model.uri")["description"]


def test_cel_rules_name_their_fields():
    crd = expertpool_crd()
    rules = _prop(crd, "spec")["x-kubernetes-validations"]
    assert {
        "rule": "self.redundancy <= self.replicas",
        "message": "spec.redundancy must not exceed spec.replicas",
        "fieldPath": ".redundancy",
    } in rules
    for crd in (expertpool_crd(), attentionfleet_crd()):
        model_rules = _prop(crd, "spec.model")["x-kubernetes-validations"]
        assert any("hostPath and persistentVolumeClaim" in r["message"] for r in model_rules)
        assert any(r.get("fieldPath") == ".uri" for r in model_rules)
        assert _prop(crd, "spec.model.hostPath")["pattern"] == "^/"


def test_subresources_and_columns():
    for crd in (expertpool_crd(), attentionfleet_crd()):
        version = crd["spec"]["versions"][0]
        assert version["subresources"]["status"] == {}
        assert version["subresources"]["scale"] == {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        }
        status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
        assert status["selector"]["type"] == "string"
        assert "routingTableVersion" in status and "conditions" in status
    cols = {
        c["name"]: c["jsonPath"]
        for c in expertpool_crd()["spec"]["versions"][0]["additionalPrinterColumns"]
    }
    assert cols["Replicas"] == ".spec.replicas"
    assert cols["Ready"] == ".status.readyReplicas"
    assert cols["Redundancy"] == ".spec.redundancy"
    assert cols["Table"] == ".status.routingTableVersion"
    assert cols["Age"] == ".metadata.creationTimestamp"
    assert attentionfleet_crd()["spec"]["names"]["shortNames"] == ["af"]


def test_status_schema_holds_everything_the_operator_writes():
    """A status field missing from the schema would be pruned silently by the API server."""
    from eaas.operator.desired import (
        Owner,
        PodPlan,
        compute_placement,
        placement_revision,
        pool_status,
    )
    from eaas.runtime.tables.table import RoutingTable

    spec = ExpertPoolSpec.model_validate(
        yaml.safe_load((ROOT / "deploy/examples/tiny-pool.yaml").read_text())["spec"]
    )
    p = compute_placement(spec)
    st = pool_status(
        owner=Owner("ExpertPool", "tiny", "ns", "u", 1),
        spec=spec,
        placement=p,
        revision=placement_revision(spec),
        observed=[],
        plan=PodPlan(),
        table=RoutingTable(1, 32, {}, {1: ((),) * 32}),
        old_conditions=[],
        now="t",
    )
    schema = _prop(expertpool_crd(), "status")

    def check(value, node, path):
        if isinstance(value, dict):
            for k, v in value.items():
                assert k in node["properties"], f"{path}.{k} not in the status schema"
                check(v, node["properties"][k], f"{path}.{k}")
        elif isinstance(value, list):
            for v in value:
                check(v, node["items"], f"{path}[]")

    check(st, schema, "status")
    # unknown until a load rebalance was staged: absent, not "" (which no RFC 3339 reader parses)
    assert "lastRebalanceTime" not in st
    # and no schema default, which the API server would fill in on every status write
    assert "default" not in schema["properties"]["lastRebalanceTime"]


def test_examples_parse():
    docs = {}
    for f in sorted((ROOT / "deploy/examples").glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            docs[(d["kind"], d["metadata"]["name"])] = d
    assert ("ExpertPool", "tiny") in docs and ("AttentionFleet", "tiny-clients") in docs
    tiny = ExpertPoolSpec.model_validate(docs[("ExpertPool", "tiny")]["spec"])
    assert (
        tiny.model.layers() == [1, 2, 3]
        and tiny.model.num_experts == 32
        and tiny.model.model_path() == "/models/tiny"
    )
    ds = ExpertPoolSpec.model_validate(docs[("ExpertPool", "deepseek-v3")]["spec"])
    assert ds.model.layers() == list(range(3, 61)) and ds.model.num_experts == 256
    assert ds.replicas == 40 and 256 % ds.replicas != 0
    fleet = AttentionFleetSpec.model_validate(docs[("AttentionFleet", "tiny-clients")]["spec"])
    assert fleet.expert_pool_ref.name == "tiny" and fleet.port == 8000


def test_model_and_nvshmem_uid_volumes_share_one_source_model():
    """The model volume (read-only; hostPath type Directory) and the NVSHMEM uid volume
    (read-write; DirectoryOrCreate) come from the same two fields with the same bounds."""
    from eaas.operator.crd import ModelSource, NvshmemUidVolume

    host = ModelSource(uri="m", hostPath="/w").volume()
    assert host == {"name": "model", "hostPath": {"path": "/w", "type": "Directory"}}
    pvc = ModelSource(uri="m", persistentVolumeClaim="weights").volume()
    assert pvc == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
    }
    assert ModelSource(uri="/in/image").volume() is None
    uid = NvshmemUidVolume(hostPath="/u").volume()
    assert uid == {"name": "nvshmem-uid", "hostPath": {"path": "/u", "type": "DirectoryOrCreate"}}
    uid = NvshmemUidVolume(persistentVolumeClaim="uid").volume()
    assert uid == {"name": "nvshmem-uid", "persistentVolumeClaim": {"claimName": "uid"}}
    with pytest.raises(ValueError, match="hostPath and persistentVolumeClaim"):
        NvshmemUidVolume().volume()
    schemas = [m.model_json_schema()["properties"] for m in (ModelSource, NvshmemUidVolume)]
    for field in ("hostPath", "persistentVolumeClaim"):
        bounds = [
            {k: v for k, v in s[field].items() if k not in ("description", "title")}
            for s in schemas
        ]
        assert bounds[0] == bounds[1], (field, bounds)
