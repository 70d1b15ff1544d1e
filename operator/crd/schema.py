"""The CRD manifests: pydantic JSON Schema -> Kubernetes structural OpenAPI v3 schema, printer
columns, the scale subresource, and their YAML rendering into ``deploy/``."""

from __future__ import annotations

import copy
import sys
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from eaas.operator.crd.base import GROUP, VERSION
from eaas.operator.crd.spec import AttentionFleetSpec, ExpertPoolSpec
from eaas.operator.crd.status import AttentionFleetStatus, ExpertPoolStatus


# ---------------------------------------------------------------------------------------------
# pydantic JSON Schema -> structural OpenAPI v3 schema
# ---------------------------------------------------------------------------------------------
def _structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Rewrite one pydantic JSON-Schema node into a Kubernetes structural schema node.

    Inlines ``$ref``, turns ``Optional[X]`` (``anyOf [X, null]``) into ``X``, drops ``title`` and
    ``additionalProperties: false``, keeps defaults, bounds, enums, descriptions and ``x-`` keys.

    Raises:
        ValueError: a construct that has no structural form (a non-Optional union).
    """
    node = dict(schema)
    if "$ref" in node:
        target = defs[node.pop("$ref").split("/")[-1]]
        merged = {**_structural(target, defs), **{k: v for k, v in node.items()}}
        # a field-level description wins over the class docstring
        return _structural_keys(merged, defs)
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"non-optional union has no structural schema: {schema}")
        inner = _structural(options[0], defs)
        if node.get("default", ...) is None:
            node.pop("default")
        return _structural_keys({**inner, **node}, defs)
    return _structural_keys(node, defs)


def _structural_keys(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("title", "$defs"):
            continue
        if key == "properties":
            out[key] = {k: _structural(v, defs) for k, v in value.items()}
        elif key == "items":
            out[key] = _structural(value, defs)
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out[key] = _structural(value, defs)
        else:
            out[key] = value
    if "x-kubernetes-preserve-unknown-fields" in out:
        out.pop("additionalProperties", None)
    if out.get("default", ...) is None:
        out.pop("default")
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    return out


def _model_type(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model class inside ``annotation`` (``X`` or ``Optional[X]``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
    return None


def _finish(model: type[BaseModel], node: dict[str, Any]) -> None:
    """Add what pydantic leaves out: defaults of ``default_factory`` fields (``{}`` for nested
    models, so the API server then fills their own defaults) and one-line descriptions."""
    if "description" in node:
        node["description"] = " ".join(node["description"].split())
    props = node.get("properties", {})
    for name, field in model.model_fields.items():
        prop = props[field.alias or name]
        sub = _model_type(field.annotation)
        if field.default_factory is not None:
            value = field.default_factory()  # type: ignore[call-arg]
            prop["default"] = {} if isinstance(value, BaseModel) else value
        if sub is not None:
            _finish(sub, prop)
        elif typing.get_origin(field.annotation) is list:
            item = _model_type(typing.get_args(field.annotation)[0])
            if item is not None:
                _finish(item, prop["items"])
        if "description" in prop:
            prop["description"] = " ".join(prop["description"].split())


def openapi_schema(model: type[BaseModel]) -> dict[str, Any]:
    """Structural OpenAPI v3 schema of ``model`` (camelCase property names)."""
    raw = model.model_json_schema(by_alias=True, mode="serialization")
    defs = raw.get("$defs", {})
    out = _structural(raw, defs)
    _finish(model, out)
    return out


# ---------------------------------------------------------------------------------------------
# CRD manifests
# ---------------------------------------------------------------------------------------------
def _crd(
    *,
    kind: str,
    plural: str,
    singular: str,
    short: list[str],
    spec_model: type[BaseModel],
    status_model: type[BaseModel],
    description: str,
    columns: list[dict[str, Any]],
    scale: dict[str, str] | None,
) -> dict[str, Any]:
    spec_schema = openapi_schema(spec_model)
    status_schema = openapi_schema(status_model)
    root = {
        "type": "object",
        "description": description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
        "x-kubernetes-validations": [
            {
                "rule": "size(self.metadata.name) <= 52",
                "message": "metadata.name must be at most 52 characters (pod and ConfigMap names derive from it)",
            }
        ],
    }
    subresources: dict[str, Any] = {"status": {}}
    if scale:
        subresources["scale"] = scale
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": singular,
                "shortNames": short,
                "categories": ["eaas"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": subresources,
                    "additionalPrinterColumns": columns,
                }
            ],
        },
    }


_READY_COL = {
    "name": "Status",
    "type": "string",
    "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
}
_AGE_COL = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
# scale subresource of both kinds (HPA/KEDA; selector written by the operator as a string)
_SCALE = {
    "specReplicasPath": ".spec.replicas",
    "statusReplicasPath": ".status.replicas",
    "labelSelectorPath": ".status.selector",
}


def expertpool_crd() -> dict[str, Any]:
    """The ExpertPool CRD manifest."""
    return _crd(
        kind="ExpertPool",
        plural="expertpools",
        singular="expertpool",
        # `ep` is also core Endpoints' short name, which kubectl prefers: `epool` is unambiguous
        short=["ep", "epool"],
        spec_model=ExpertPoolSpec,
        status_model=ExpertPoolStatus,
        description="A pool of stateless expert servers hosting every routed expert of one MoE model.",
        columns=[
            {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
            {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
            {"name": "Redundancy", "type": "integer", "jsonPath": ".spec.redundancy"},
            {
                "name": "Policy",
                "type": "string",
                "jsonPath": ".spec.placement.policy",
                "priority": 1,
            },
            {
                "name": "Table",
                "type": "integer",
                "jsonPath": ".status.routingTableVersion",
                "description": "Routing table version",
            },
            {
                "name": "Load",
                "type": "number",
                "jsonPath": ".status.load.totalTokensPerSecond",
                "description": "Expert load, tokens/s",
                "priority": 1,
            },
            {
                "name": "Below-Redundancy",
                "type": "integer",
                "jsonPath": ".status.placement.expertsBelowRedundancy",
                "priority": 1,
            },
            {
                "name": "Revision",
                "type": "string",
                "jsonPath": ".status.placementRevision",
                "priority": 1,
            },
            _READY_COL,
            _AGE_COL,
        ],
        scale=_SCALE,
    )


def attentionfleet_crd() -> dict[str, Any]:
    """The AttentionFleet CRD manifest."""
    return _crd(
        kind="AttentionFleet",
        plural="attentionfleets",
        singular="attentionfleet",
        short=["af"],
        spec_model=AttentionFleetSpec,
        status_model=AttentionFleetStatus,
        description="Stateful attention clients (Deployment + Service) using one ExpertPool's routing table.",
        columns=[
            {"name": "Pool", "type": "string", "jsonPath": ".spec.expertPoolRef.name"},
            {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
            {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
            {
                "name": "Table",
                "type": "integer",
                "jsonPath": ".status.routingTableVersion",
                "description": "Routing table version",
            },
            _READY_COL,
            _AGE_COL,
        ],
        scale=_SCALE,
    )


HEADER = "# Generated by `eaas crds` from operator/crd.py — do not edit by hand.\n"


def render_crds() -> dict[str, str]:
    """File name -> YAML text of every CRD (deterministic: same models, same bytes)."""
    out = {}
    for fname, crd in (
        ("expertpool.yaml", expertpool_crd()),
        ("attentionfleet.yaml", attentionfleet_crd()),
    ):
        out[fname] = HEADER + yaml.safe_dump(copy.deepcopy(crd), sort_keys=False, width=100)
    return out


def write_crds(out_dirs: list[Path]) -> list[Path]:
    """Write :func:`render_crds` into each directory (created if needed); returns written paths."""
    written = []
    for d in out_dirs:
        d.mkdir(parents=True, exist_ok=True)
        for fname, text in render_crds().items():
            p = d / fname
            p.write_text(text)
            written.append(p)
    return written


#: Where the committed copies live, relative to the repository root.
CRD_DIRS = ("deploy/crds", "deploy/helm/eaas-operator/crds")


def main(argv: list[str] | None = None) -> int:
    """``python -m eaas.operator.crd [REPO_ROOT]``: regenerate the committed CRD files."""
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0]) if argv else Path.cwd()
    for p in write_crds([root / d for d in CRD_DIRS]):
        print(p)
    return 0
