"""CRDs ``ExpertPool`` and ``AttentionFleet`` (group ``eaas.io``, version ``v1alpha1``).

One source of truth: the pydantic models below. They serve twice:

* :func:`render_crds` turns them into CustomResourceDefinition manifests (structural OpenAPI v3
  schemas with defaults, bounds, enums and CEL rules) — ``eaas crds --out deploy/crds`` writes them
  to ``deploy/crds/*.yaml`` and into the Helm chart's ``crds/`` folder.
* The operator parses ``spec`` with :meth:`ExpertPoolSpec.model_validate` (the API server has
  already applied the defaults and validated the rules; parsing gives typed access).

Per-field ``description`` texts become the CRD's ``description`` (shown by ``kubectl explain``).
"""

from __future__ import annotations

from eaas.operator.crd.base import (
    ANNOTATION_EXPERTS,
    ANNOTATION_SPEC_HASH,
    ANNOTATION_TABLE_VERSION,
    API_VERSION,
    GROUP,
    K8S_OBJECT,
    LABEL_FLEET,
    LABEL_PLACEMENT_REVISION,
    LABEL_POOL,
    LABEL_ROLE,
    LABEL_SERVER_INDEX,
    RDMA_NODE_LABEL,
    VERSION,
    CrdModel,
    ExpertAssignment,
    PlacementPolicy,
)
from eaas.operator.crd.schema import (
    CRD_DIRS,
    HEADER,
    attentionfleet_crd,
    expertpool_crd,
    main,
    openapi_schema,
    render_crds,
    write_crds,
)
from eaas.operator.crd.secret_ref import API_KEY_ENV, VLLM_API_KEY_ENV, ApiKeySecretRef
from eaas.operator.crd.spec import (
    DNS1123_SUBDOMAIN,
    MODEL_MOUNT_DIR,
    MODEL_VOLUME,
    NVSHMEM_UID_MOUNT_DIR,
    NVSHMEM_UID_VOLUME,
    AttentionFleetSpec,
    AutoscalingSpec,
    ClaimNameField,
    ExpertPoolRef,
    ExpertPoolSpec,
    FailureDetectionSpec,
    FleetModelSpec,
    HostPathField,
    ModelSource,
    ModelSpec,
    NvshmemSpec,
    NvshmemUidVolume,
    PlacementSpec,
    TransportScheme,
    TransportSpec,
    volume_from_source,
)
from eaas.operator.crd.status import (
    AttentionFleetStatus,
    Condition,
    ConditionStatus,
    ExpertPoolStatus,
    LoadSummary,
    PlacementSummary,
)
from eaas.operator.crd.vllm_args import VLLM_OWNED_FLAGS, VllmEngineSpec, owned_vllm_flag

__all__ = [
    "VLLM_OWNED_FLAGS",
    "VllmEngineSpec",
    "owned_vllm_flag",
    "API_KEY_ENV",
    "VLLM_API_KEY_ENV",
    "ApiKeySecretRef",
    "CrdModel",
    "K8S_OBJECT",
    "ANNOTATION_EXPERTS",
    "ANNOTATION_SPEC_HASH",
    "ANNOTATION_TABLE_VERSION",
    "API_VERSION",
    "AttentionFleetSpec",
    "AttentionFleetStatus",
    "AutoscalingSpec",
    "CRD_DIRS",
    "ClaimNameField",
    "Condition",
    "ConditionStatus",
    "DNS1123_SUBDOMAIN",
    "ExpertAssignment",
    "ExpertPoolRef",
    "ExpertPoolSpec",
    "ExpertPoolStatus",
    "FailureDetectionSpec",
    "FleetModelSpec",
    "GROUP",
    "HEADER",
    "HostPathField",
    "LABEL_FLEET",
    "LABEL_PLACEMENT_REVISION",
    "LABEL_POOL",
    "LABEL_ROLE",
    "LABEL_SERVER_INDEX",
    "LoadSummary",
    "MODEL_MOUNT_DIR",
    "MODEL_VOLUME",
    "ModelSource",
    "ModelSpec",
    "NVSHMEM_UID_MOUNT_DIR",
    "NVSHMEM_UID_VOLUME",
    "NvshmemSpec",
    "NvshmemUidVolume",
    "PlacementPolicy",
    "PlacementSpec",
    "PlacementSummary",
    "RDMA_NODE_LABEL",
    "TransportScheme",
    "TransportSpec",
    "VERSION",
    "attentionfleet_crd",
    "expertpool_crd",
    "main",
    "openapi_schema",
    "render_crds",
    "volume_from_source",
    "write_crds",
]
