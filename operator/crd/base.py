"""Names every CRD module shares: the API group and version, the label and annotation keys the
operator writes, and the pydantic base of the CRD models."""

from __future__ import annotations

import typing
from typing import Literal

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonDict

from eaas.runtime.placement import POLICIES

PlacementPolicy = Literal["round-robin", "load-balanced"]
ExpertAssignment = Literal["command-line", "routing-table"]
assert set(typing.get_args(PlacementPolicy)) == set(POLICIES), (
    "CRD enum out of sync with eaas.runtime.placement"
)

GROUP = "eaas.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

#: Label/annotation keys the operator writes. Pods: all labels; ConfigMap: the annotation.
LABEL_POOL = "eaas.io/pool"
LABEL_FLEET = "eaas.io/fleet"
LABEL_ROLE = "eaas.io/role"
LABEL_SERVER_INDEX = "eaas.io/server-index"
LABEL_PLACEMENT_REVISION = "eaas.io/placement-revision"
ANNOTATION_EXPERTS = "eaas.io/experts"
ANNOTATION_SPEC_HASH = "eaas.io/spec-hash"
ANNOTATION_TABLE_VERSION = "eaas.io/routing-table-version"
RDMA_NODE_LABEL = "eaas.io/rdma"

#: A Kubernetes object name (DNS-1123 subdomain), e.g. a PersistentVolumeClaim's or a Secret's.
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"

K8S_OBJECT: JsonDict = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


class CrdModel(BaseModel):
    """Base: camelCase wire names, snake_case attributes; unknown fields ignored when parsing."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
