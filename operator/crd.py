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

import copy
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonDict, JsonValue

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

_K8S_OBJECT: JsonDict = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


class _Model(BaseModel):
    """Base: camelCase wire names, snake_case attributes; unknown fields ignored when parsing."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


# ---------------------------------------------------------------------------------------------
# ExpertPool
# ---------------------------------------------------------------------------------------------
#: A Kubernetes object name (DNS-1123 subdomain), e.g. a PersistentVolumeClaim's.
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"

#: The two volume sources a pool's spec can name (the model's weights, the NVSHMEM unique-id
#: directory): one field model each, the description given where it is used.
HostPathField = Annotated[
    str | None, Field(default=None, min_length=1, max_length=4096, pattern="^/")
]
ClaimNameField = Annotated[
    str | None, Field(default=None, min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN)
]


def volume_from_source(
    name: str,
    host_path: str | None,
    claim: str | None,
    *,
    host_path_type: str,
    read_only_claim: bool,
) -> dict[str, Any] | None:
    """A core/v1 Volume ``name`` of a ``hostPath`` (of ``host_path_type``) or a
    ``persistentVolumeClaim`` (``readOnly`` with ``read_only_claim``), or None with neither."""
    if host_path:
        return {"name": name, "hostPath": {"path": host_path, "type": host_path_type}}
    if claim:
        pvc: dict[str, Any] = {"claimName": claim}
        if read_only_claim:
            pvc["readOnly"] = True
        return {"name": name, "persistentVolumeClaim": pvc}
    return None


#: Where a model volume (``hostPath`` or ``persistentVolumeClaim``) is mounted in pods (read-only).
MODEL_MOUNT_DIR = "/models"
MODEL_VOLUME = "model"

_MODEL_SOURCE_RULES: list[JsonValue] = [
    {
        "rule": "!(has(self.hostPath) && has(self.persistentVolumeClaim))",
        "message": "give at most one of hostPath and persistentVolumeClaim",
    },
    {
        "rule": "(has(self.hostPath) || has(self.persistentVolumeClaim)) "
        "? !self.uri.startsWith('/') : self.uri.startsWith('/')",
        "message": "uri must be relative to the volume's root with hostPath or "
        "persistentVolumeClaim, and an absolute path inside the image without them",
        "fieldPath": ".uri",
    },
]


class ModelSource(_Model):
    """Where the weights are: a directory on the node (``hostPath``), a PersistentVolumeClaim,
    or, with neither, baked into the container image. A volume is mounted read-only at
    ``/models`` and ``uri`` is the checkpoint's path inside it."""

    uri: str = Field(
        min_length=1,
        max_length=1024,
        description="Checkpoint directory: relative to the volume's root (mounted read-only at "
        "/models) with hostPath or persistentVolumeClaim, else an absolute path inside the "
        "container image. The pods get `--model /models/<uri>` (or `--model <uri>`).",
    )
    host_path: HostPathField = Field(
        description="Absolute directory on the node holding the weights (a hostPath volume of "
        "type Directory).",
    )
    persistent_volume_claim: ClaimNameField = Field(
        description="Name of a PersistentVolumeClaim in the pool's namespace holding the weights "
        "(mounted read-only; use a ReadOnlyMany claim for pods on several nodes).",
    )

    def model_path(self) -> str:
        """The ``--model`` path as the container sees it."""
        if self.host_path or self.persistent_volume_claim:
            return f"{MODEL_MOUNT_DIR}/{self.uri.lstrip('/')}"
        return self.uri

    def volume(self) -> dict[str, Any] | None:
        """The core/v1 Volume named ``model``, or None (weights in the image)."""
        return volume_from_source(
            MODEL_VOLUME,
            self.host_path,
            self.persistent_volume_claim,
            host_path_type="Directory",
            read_only_claim=True,
        )

    def volume_mount(self) -> dict[str, Any] | None:
        """The container's read-only mount of the ``model`` volume, or None."""
        if self.volume() is None:
            return None
        return {"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT_DIR, "readOnly": True}


class ModelSpec(ModelSource):
    """The MoE model whose routed experts the pool serves, and where its weights are. The
    operator does not open the checkpoint: give the layout facts the placement needs (for a
    Hugging Face DeepSeek-V3 checkpoint they are in config.json: firstMoeLayer =
    first_k_dense_replace, numMoeLayers = num_hidden_layers - first_k_dense_replace, numExperts
    = n_routed_experts)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _MODEL_SOURCE_RULES})

    first_moe_layer: int = Field(
        default=0,
        ge=0,
        le=1024,
        description="Index of the first MoE layer (layers before it are dense).",
    )
    num_moe_layers: int = Field(
        ge=1, le=1024, description="Number of consecutive MoE layers starting at firstMoeLayer."
    )
    num_experts: int = Field(ge=1, le=65536, description="Routed (logical) experts per MoE layer.")

    def layers(self) -> list[int]:
        """MoE layer indices, ascending."""
        return list(range(self.first_moe_layer, self.first_moe_layer + self.num_moe_layers))


class PlacementSpec(_Model):
    """How logical experts are spread over expert servers."""

    policy: PlacementPolicy = Field(
        default="round-robin",
        description="round-robin: every expert counts as equally loaded; load-balanced: hot "
        "experts get more replicas and replicas are packed to balance per-server load, using "
        "the per-(layer, expert) load measured from the servers' token counters (status.load), "
        "or the load in the ConfigMap `<pool>-expert-load` (key `expert-load.json`) when it "
        "exists (an override). Either way placement is incremental: a rescale "
        "keeps what the servers already host.",
    )
    topology_key: str = Field(
        default="kubernetes.io/hostname",
        min_length=1,
        max_length=316,
        description="Node label whose value is a failure domain: expert-server pods are spread "
        "over its values (topologySpreadConstraints) and the ReplicasSpread condition reports "
        "experts whose live replicas span fewer than `redundancy` domains.",
    )
    slots_per_server: int = Field(
        default=0,
        ge=0,
        le=65536,
        description="Replicas one server holds per MoE layer (GPU memory budget); all slots are "
        "filled, the ones beyond `numExperts * redundancy` with extra replicas of hot experts. "
        "0: automatic, ceil(numExperts * redundancy / replicas), never less than what the "
        "servers already hold (so scaling up never moves a replica off a running server).",
    )
    assignment: ExpertAssignment = Field(
        default="command-line",
        description="How expert servers learn their experts. command-line: each pod's "
        "`--experts` (a changed assignment replaces the pod). routing-table: pods start without "
        "experts and learn them from the routing table, pushed by the operator in two phases "
        "(servers load the new experts while serving and confirm; then clients get the version; "
        "servers drop experts only after every client acknowledged a version without them), so "
        "scale-down, re-placement and rebalancing restart no running server. Needs servers that "
        "run (not kwok nodes).",
    )
    rebalance_threshold: float = Field(
        default=0.2,
        ge=0.0,
        le=1.0,
        description="load-balanced with assignment routing-table: rebalance (re-place replicas "
        "for the measured expert load) when the imbalance 1 - balancedness of the placement in "
        "force exceeds this (balancedness = mean / max per-server load, summed over MoE "
        "layers). 1: never.",
    )
    rebalance_interval_seconds: int = Field(
        default=300,
        ge=1,
        le=86400,
        description="load-balanced with assignment routing-table: at most one rebalance per this "
        "many seconds.",
    )


class FailureDetectionSpec(_Model):
    """Timing of the data plane's failure detection."""

    dispatch_timeout_ms: int = Field(
        default=500,
        ge=1,
        le=600000,
        description="Deadline for an expert server's answer before the client re-sends the tokens "
        "to another replica (milliseconds); the clients' `--dispatch-timeout`.",
    )


#: Where an NVSHMEM world's members mount ``spec.transport.nvshmem.uidVolume`` (read-write).
NVSHMEM_UID_MOUNT_DIR = "/var/run/eaas/nvshmem"
NVSHMEM_UID_VOLUME = "nvshmem-uid"

TransportScheme = Literal["tcp", "nvshmem"]


class NvshmemUidVolume(_Model):
    """Storage every member of the world mounts read-write at ``/var/run/eaas/nvshmem``: PE 0
    writes the world's unique id there and the other PEs read it (docs/gpu.md "nvshmem:PE").
    Give exactly one source."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.hostPath) != has(self.persistentVolumeClaim)",
                    "message": "give exactly one of hostPath and persistentVolumeClaim",
                }
            ]
        }
    )

    persistent_volume_claim: ClaimNameField = Field(
        description="Name of a ReadWriteMany PersistentVolumeClaim in the pool's namespace "
        "(members on several nodes).",
    )
    host_path: HostPathField = Field(
        description="Absolute directory on the node (a hostPath volume of type "
        "DirectoryOrCreate): only for a world whose members share one node.",
    )

    def volume(self) -> dict[str, Any]:
        """The core/v1 Volume named ``nvshmem-uid``.

        Raises:
            ValueError: neither source given (the CRD's rule refuses that at the API server).
        """
        vol = volume_from_source(
            NVSHMEM_UID_VOLUME,
            self.host_path,
            self.persistent_volume_claim,
            host_path_type="DirectoryOrCreate",
            read_only_claim=False,
        )
        if vol is None:  # parsed without the API server's validation
            raise ValueError("uidVolume: give exactly one of hostPath and persistentVolumeClaim")
        return vol

    def volume_mount(self) -> dict[str, Any]:
        """The container's read-write mount of the ``nvshmem-uid`` volume."""
        return {"name": NVSHMEM_UID_VOLUME, "mountPath": NVSHMEM_UID_MOUNT_DIR}


class NvshmemSpec(_Model):
    """One NVSHMEM world per pool (docs/gpu.md "Elastic membership"): PEs ``0 .. clients-1``
    are the attention clients, ``clients .. clients+replicas-1`` the expert servers (pod index
    order), then ``spares`` spare expert servers (pods ``<pool>-<replicas>`` on, started with
    `--spare`: in the world, hosting nothing until the routing table assigns experts). The PE
    set is fixed at start-up: a change of ``replicas``, ``clients`` or ``spares`` starts a new
    world (new pods, new unique-id file)."""

    clients: int = Field(
        ge=1,
        le=4096,
        description="Attention-client PEs of the world (the replicas of the AttentionFleet "
        "using this pool).",
    )
    spares: int = Field(
        default=0,
        ge=0,
        le=4096,
        description="Spare expert servers: pods in the world without experts (`--spare`), "
        "given experts later by the routing table; needs placement.assignment routing-table.",
    )
    uid_volume: NvshmemUidVolume = Field(
        description="Shared storage for the world's unique-id file (every member mounts it)."
    )
    ibgda: bool = Field(
        default=True,
        description="GPU-initiated RDMA (NVSHMEM_IB_ENABLE_IBGDA=1) where the NIC supports it.",
    )


class TransportSpec(_Model):
    """The data plane between attention clients and expert servers."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "(has(self.scheme) && self.scheme == 'nvshmem') == has(self.nvshmem)",
                    "message": "spec.transport.nvshmem is required with scheme nvshmem and only "
                    "allowed with it",
                    "fieldPath": ".nvshmem",
                }
            ]
        }
    )

    scheme: TransportScheme = Field(
        default="tcp",
        description="tcp: `tcp://IP:port` (any pods); nvshmem: an NVSHMEM world "
        "(`--listen nvshmem:PE`, GPU-initiated put-with-signal; servers and clients on GPUs "
        "with `--device cuda`). The same-node transports (shm, cudaipc) are for `eaas serve`, "
        "not pods.",
    )
    nvshmem: NvshmemSpec | None = Field(
        default=None, description="The NVSHMEM world (scheme nvshmem only)."
    )


class AutoscalingSpec(_Model):
    """Autoscaling on expert load: the operator owns an ``autoscaling/v2``
    HorizontalPodAutoscaler named like the pool that targets the pool's ``scale`` subresource
    with the External metric ``eaas_expert_load`` (the pool's expert load, tokens/s, served by
    the operator through ``external.metrics.k8s.io``). The HPA controller sets ``spec.replicas``
    to ``ceil(pool load / targetLoadPerServer)`` within [minReplicas, maxReplicas]. A missing
    metric (no load measured yet, scrapes failing) holds the replica count."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.minReplicas <= self.maxReplicas",
                    "message": "spec.autoscaling.minReplicas must not exceed maxReplicas",
                    "fieldPath": ".minReplicas",
                }
            ]
        }
    )

    min_replicas: int = Field(
        ge=1,
        le=4096,
        description="Fewest expert servers the HPA may scale to (at least spec.redundancy).",
    )
    max_replicas: int = Field(
        ge=1, le=4096, description="Most expert servers the HPA may scale to."
    )
    target_load_per_server: int = Field(
        ge=1,
        le=1_000_000_000,
        description="Target expert load per server in tokens per second (summed over the "
        "(layer, expert) replicas a server hosts): the HPA's AverageValue target.",
    )
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=3600,
        description="The HPA's behavior.scaleDown.stabilizationWindowSeconds: it scales down "
        "only to the highest recommendation of this many past seconds.",
    )


def _default_tolerations() -> list[dict[str, Any]]:
    return [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


class ExpertPoolSpec(_Model):
    """Desired state of an ExpertPool: `replicas` stateless expert servers (one pod each) that
    together host every logical expert `redundancy` times, on distinct servers."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.redundancy <= self.replicas",
                    "message": "spec.redundancy must not exceed spec.replicas",
                    "fieldPath": ".redundancy",
                },
                {
                    "rule": "!has(self.autoscaling) || self.redundancy <= self.autoscaling.minReplicas",
                    "message": "spec.autoscaling.minReplicas must be at least spec.redundancy",
                    "fieldPath": ".autoscaling.minReplicas",
                },
                {
                    "rule": "!has(self.transport) || !has(self.transport.nvshmem) || "
                    "self.transport.nvshmem.spares == 0 || "
                    "self.placement.assignment == 'routing-table'",
                    "message": "spec.transport.nvshmem.spares needs spec.placement.assignment "
                    "routing-table (spares get their experts from the routing table)",
                    "fieldPath": ".transport.nvshmem.spares",
                },
                {
                    "rule": "!has(self.transport) || !has(self.transport.nvshmem) || "
                    "!has(self.autoscaling)",
                    "message": "spec.autoscaling is not supported with spec.transport.scheme "
                    "nvshmem (an NVSHMEM world has a fixed set of PEs: use "
                    "transport.nvshmem.spares)",
                    "fieldPath": ".autoscaling",
                },
            ]
        }
    )

    model: ModelSpec = Field(description="The MoE model served by the pool.")
    replicas: int = Field(
        ge=1,
        le=4096,
        description="Number of expert servers (one pod each). Any value >= redundancy.",
    )
    gpus_per_server: int = Field(default=1, ge=1, le=16, description="GPUs per expert-server pod.")
    redundancy: int = Field(
        default=2,
        ge=1,
        le=64,
        description="Replicas of every logical expert, each on a distinct server; redundancy - 1 "
        "servers may die without any expert losing its last replica.",
    )
    placement: PlacementSpec = Field(default_factory=PlacementSpec, description="Placement policy.")
    image: str = Field(
        default="eaas:latest", min_length=1, description="Container image with the `eaas` CLI."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy of the expert-server container."
    )
    resources: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra=_K8S_OBJECT,
        description="Extra container resources (core/v1 ResourceRequirements); the operator adds "
        "`nvidia.com/gpu: gpusPerServer` and `<rdmaResource>: 1` to requests and limits.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=lambda: {RDMA_NODE_LABEL: "true"},
        description="Node selector of expert-server pods (default: RDMA-capable nodes).",
    )
    affinity: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra=_K8S_OBJECT,
        description="core/v1 Affinity of expert-server pods.",
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=_default_tolerations,
        json_schema_extra={"items": _K8S_OBJECT},
        description="core/v1 Tolerations of expert-server pods (default: tolerate the GPU taint).",
    )
    rdma_resource: str = Field(
        default="rdma/ib",
        max_length=253,
        description="Extended resource naming one RDMA device; each server requests 1. Empty: none.",
    )
    port: int = Field(
        default=9000, ge=1, le=65535, description="Port the expert server listens on."
    )
    health_port: int = Field(
        default=9001,
        ge=1,
        le=65535,
        description="HTTP port of the expert server's GET /health (readiness, liveness and "
        "startup probe: 200 only while the serving loop runs) and GET /metrics; "
        "`--http-port`.",
    )
    failure_detection: FailureDetectionSpec = Field(
        default_factory=FailureDetectionSpec, description="Failure-detection timing."
    )
    transport: TransportSpec = Field(
        default_factory=TransportSpec,
        description="Data plane: tcp (default) or an NVSHMEM world (docs/gpu.md).",
    )
    autoscaling: AutoscalingSpec | None = Field(
        default=None,
        description="Autoscale the pool on expert load (an operator-owned HPA). Unset: the "
        "operator owns no HPA (and deletes the one it made); a user-made HPA (e.g. `kubectl "
        "autoscale expertpool/NAME`) may still drive the scale subresource.",
    )
    pod_template: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra=_K8S_OBJECT,
        description="Pod template overlay (core/v1 PodTemplateSpec subset) merged into every "
        "generated pod the way LeaderWorkerSet/KServe merge theirs: `metadata.labels`/"
        "`annotations` added; `spec.containers[]` matched by name (the operator's container is "
        "`expert-server`; other names are added as sidecars) with their `env`, `volumeMounts` (by "
        "mountPath), `envFrom` and `securityContext` merged; `spec.volumes` and "
        "`imagePullSecrets` merged by name; `tolerations` appended; `nodeSelector` merged; "
        "`affinity`, `serviceAccountName`, `priorityClassName` and `securityContext` set. Other "
        "keys are refused (status InvalidSpec).",
    )


#: ``status`` of a Kubernetes condition.
ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(_Model):
    """A standard Kubernetes condition."""

    type: str = Field(description="Ready, Progressing or Degraded.")
    status: ConditionStatus = Field(description="Condition status.")
    reason: str = Field(default="", description="CamelCase reason.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str | None = Field(
        default=None, description="When status last changed (RFC 3339)."
    )
    observed_generation: int | None = Field(
        default=None, description="Generation the condition is about."
    )


class PlacementSummary(_Model):
    """Summary of the current placement and of live coverage."""

    experts_per_server_min: int = Field(
        default=0, description="Fewest (layer, expert) replicas on one server."
    )
    experts_per_server_max: int = Field(
        default=0, description="Most (layer, expert) replicas on one server."
    )
    experts_below_redundancy: int = Field(
        default=0,
        description="Logical experts with fewer than `redundancy` live replicas in the routing table.",
    )
    uncovered_experts: int = Field(
        default=0, description="Logical experts with no live replica at all."
    )
    logical_experts: int = Field(
        default=0, description="Logical experts in total (MoE layers x experts)."
    )


class LoadSummary(_Model):
    """Expert load measured from the servers' ``eaas_expert_tokens_total`` counters over a
    sliding window (the operator scrapes each Ready server's /metrics)."""

    servers: int = Field(default=0, description="Servers with a measured rate.")
    window_seconds: float = Field(default=0, description="Rate window (seconds).")
    total_tokens_per_second: float = Field(
        default=0, description="Pool load: tokens/s summed over servers (the HPA's metric)."
    )
    server_max_tokens_per_second: float = Field(
        default=0, description="Highest per-server load (tokens/s)."
    )
    server_mean_tokens_per_second: float = Field(
        default=0, description="Mean per-server load (tokens/s)."
    )
    balancedness: float = Field(
        default=1, description="Mean / max per-server load (1: perfectly balanced)."
    )
    hottest_experts: list[str] = Field(
        default_factory=list,
        description="Hottest logical experts pool-wide, as `L<layer>/E<expert>: <tokens/s>`.",
    )


class ExpertPoolStatus(_Model):
    """Observed state of an ExpertPool."""

    replicas: int = Field(default=0, description="Expert-server pods that exist (not terminating).")
    ready_replicas: int = Field(
        default=0, description="Expert-server pods that are Ready with a pod IP."
    )
    updated_replicas: int = Field(
        default=0, description="Pods matching the current placement revision and spec."
    )
    selector: str = Field(
        default="", description="Label selector of the pool's pods (string form, for `scale`)."
    )
    observed_generation: int = Field(default=0, description="metadata.generation last acted on.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready, Progressing, Degraded."
    )
    routing_table_version: int = Field(
        default=0, description="Version of the published routing table."
    )
    placement: PlacementSummary = Field(
        default_factory=PlacementSummary, description="Placement summary."
    )
    placement_revision: str = Field(
        default="", description="Hash of the current placement's inputs."
    )
    clients: int = Field(
        default=0, description="Ready attention clients of the fleets that use this pool."
    )
    clients_acknowledged: int = Field(
        default=0,
        description="Of those, the clients that acknowledged routingTableVersion.",
    )
    acknowledged_version: int = Field(
        default=0, description="Oldest routing-table version a Ready client has acknowledged."
    )
    staged_routing_table_version: int = Field(
        default=0,
        description="assignment routing-table: version pushed to the servers and not yet to the "
        "clients (0: none pending).",
    )
    servers_confirmed: int = Field(
        default=0,
        description="assignment routing-table: servers of the newest version (staged, else "
        "published) that confirmed holding its experts' weights.",
    )
    last_rebalance_time: str | None = Field(
        default=None,
        description="When the last load rebalance was staged (RFC 3339); absent until one was.",
    )
    load: LoadSummary | None = Field(
        default=None, description="Measured expert load (absent until two scrapes)."
    )


# ---------------------------------------------------------------------------------------------
# AttentionFleet
# ---------------------------------------------------------------------------------------------
class ExpertPoolRef(_Model):
    """Reference to an ExpertPool in the fleet's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Name of the ExpertPool.")


class FleetModelSpec(ModelSource):
    """The model the attention clients load (the same checkpoint as the pool's) and where its
    weights are."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _MODEL_SOURCE_RULES})


class AttentionFleetSpec(_Model):
    """Desired state of an AttentionFleet: stateful attention clients (a Deployment and a Service)
    that use the routing table of one ExpertPool."""

    expert_pool_ref: ExpertPoolRef = Field(
        description="The ExpertPool whose routing table the clients use."
    )
    replicas: int = Field(default=1, ge=0, le=4096, description="Number of attention-client pods.")
    model: FleetModelSpec = Field(description="The model the clients load.")
    image: str = Field(
        default="eaas:latest", min_length=1, description="Container image with the `eaas` CLI."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy of the client container."
    )
    resources: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra=_K8S_OBJECT,
        description="core/v1 ResourceRequirements of a client.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node selector of client pods."
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list,
        json_schema_extra={"items": _K8S_OBJECT},
        description="Tolerations of client pods.",
    )
    port: int = Field(
        default=8000,
        ge=1,
        le=65535,
        description="OpenAI-compatible API port (container and Service).",
    )
    pod_template: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra=_K8S_OBJECT,
        description="Pod template overlay (core/v1 PodTemplateSpec subset) merged into every "
        "generated pod the way LeaderWorkerSet/KServe merge theirs: `metadata.labels`/"
        "`annotations` added; `spec.containers[]` matched by name (the operator's container is "
        "`attention-client`; other names are added as sidecars) with their `env`, `volumeMounts` (by "
        "mountPath), `envFrom` and `securityContext` merged; `spec.volumes` and "
        "`imagePullSecrets` merged by name; `tolerations` appended; `nodeSelector` merged; "
        "`affinity`, `serviceAccountName`, `priorityClassName` and `securityContext` set. Other "
        "keys are refused (status InvalidSpec).",
    )


class AttentionFleetStatus(_Model):
    """Observed state of an AttentionFleet."""

    replicas: int = Field(default=0, description="Client pods (from the Deployment).")
    ready_replicas: int = Field(default=0, description="Ready client pods.")
    selector: str = Field(
        default="", description="Label selector of the client pods (string form)."
    )
    observed_generation: int = Field(default=0, description="metadata.generation last acted on.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready, Progressing, Degraded."
    )
    routing_table_version: int = Field(
        default=0, description="Version of the pool's routing table (its ConfigMap)."
    )
    acknowledged_version: int = Field(
        default=0,
        description="Oldest routing-table version a Ready client has acknowledged (0: none yet).",
    )
    clients_acknowledged: int = Field(
        default=0,
        description="Ready clients that acknowledged routingTableVersion (push answer, or a "
        "409 naming it: the client got it from the ConfigMap watch).",
    )


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


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
