"""``spec`` models of ``ExpertPool`` and ``AttentionFleet``: the desired state a user writes.

Per-field ``description`` texts become the CRD's ``description`` (shown by ``kubectl explain``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field
from pydantic.json_schema import JsonValue

from eaas.operator.crd.base import (
    DNS1123_SUBDOMAIN,
    K8S_OBJECT,
    RDMA_NODE_LABEL,
    CrdModel,
    ExpertAssignment,
    PlacementPolicy,
)
from eaas.operator.crd.secret_ref import ApiKeySecretRef
from eaas.operator.crd.vllm_args import VllmEngineSpec

# ---------------------------------------------------------------------------------------------
# ExpertPool
# ---------------------------------------------------------------------------------------------

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


class ModelSource(CrdModel):
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


class PlacementSpec(CrdModel):
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
    max_moved_fraction: float = Field(
        default=0.1,
        ge=0.0,
        le=1.0,
        description="load-balanced: movement budget of a placement change with the expert load "
        "known (scale-up or -down, a server lost, a rebalance). Per MoE layer, the replicas moved "
        "beyond those the change forces (new servers filled, lost servers' replicas re-homed) are "
        "at most this fraction of the layer's replicas, spent on the moves that most lower the "
        "layer's most-loaded server; the result is never less balanced than the same change "
        "made without the load. 0: no move beyond the forced ones; 1: effectively unlimited. With "
        "assignment command-line every server whose experts change is replaced.",
    )
    rebalance_interval_seconds: int = Field(
        default=300,
        ge=1,
        le=86400,
        description="load-balanced with assignment routing-table: at most one rebalance per this "
        "many seconds.",
    )


class FailureDetectionSpec(CrdModel):
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


class NvshmemUidVolume(CrdModel):
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


class NvshmemSpec(CrdModel):
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


class TransportSpec(CrdModel):
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


class AutoscalingSpec(CrdModel):
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


class ExpertPoolSpec(CrdModel):
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
        json_schema_extra=K8S_OBJECT,
        description="Extra container resources (core/v1 ResourceRequirements); the operator adds "
        "`nvidia.com/gpu: gpusPerServer` and `<rdmaResource>: 1` to requests and limits.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=lambda: {RDMA_NODE_LABEL: "true"},
        description="Node selector of expert-server pods (default: RDMA-capable nodes).",
    )
    affinity: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra=K8S_OBJECT,
        description="core/v1 Affinity of expert-server pods.",
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=_default_tolerations,
        json_schema_extra={"items": K8S_OBJECT},
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
        json_schema_extra=K8S_OBJECT,
        description="Pod template overlay (core/v1 PodTemplateSpec subset) merged into every "
        "generated pod the way LeaderWorkerSet/KServe merge theirs: `metadata.labels`/"
        "`annotations` added; `spec.containers[]` matched by name (the operator's container is "
        "`expert-server`; other names are added as sidecars) with their `env`, `volumeMounts` (by "
        "mountPath), `envFrom` and `securityContext` merged; `spec.volumes` and "
        "`imagePullSecrets` merged by name; `tolerations` appended; `nodeSelector` merged; "
        "`affinity`, `serviceAccountName`, `priorityClassName` and `securityContext` set. Other "
        "keys are refused (status InvalidSpec).",
    )


# ---------------------------------------------------------------------------------------------
# AttentionFleet
# ---------------------------------------------------------------------------------------------
class ExpertPoolRef(CrdModel):
    """Reference to an ExpertPool in the fleet's namespace."""

    name: str = Field(min_length=1, max_length=253, description="Name of the ExpertPool.")


class FleetModelSpec(ModelSource):
    """The model the attention clients load (the same checkpoint as the pool's) and where its
    weights are."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _MODEL_SOURCE_RULES})


class AttentionFleetSpec(CrdModel):
    """Desired state of an AttentionFleet: stateful attention clients (a Deployment and a Service)
    that use the routing table of one ExpertPool."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.vllm) || self.engine == 'vllm'",
                    "message": "spec.vllm needs spec.engine vllm",
                    "fieldPath": ".vllm",
                }
            ]
        }
    )

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
        json_schema_extra=K8S_OBJECT,
        description="core/v1 ResourceRequirements of a client.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node selector of client pods."
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list,
        json_schema_extra={"items": K8S_OBJECT},
        description="Tolerations of client pods.",
    )
    port: int = Field(
        default=8000,
        ge=1,
        le=65535,
        description="OpenAI-compatible API port (container and Service).",
    )
    api_key_secret: ApiKeySecretRef | None = Field(
        default=None,
        description="Secret key holding the API key(s) of the clients' OpenAI API (the pods' "
        "EAAS_API_KEY, from a secretKeyRef). Unset: no key is asked for.",
    )
    engine: Literal["eaas", "vllm"] = Field(
        default="eaas",
        description="The attention engine of the pods. eaas: `eaas attention-client`. vllm: "
        "`vllm serve` with the eaas.vllm plugin (the image must hold vLLM and `eaas[vllm]`); "
        "the plugin watches the same routing-table ConfigMap, takes pushes and answers "
        "`/health` on port+1 (`port` must be below 65535); readiness is vLLM's `/health`. "
        "Not with a pool whose transport is nvshmem.",
    )
    vllm: VllmEngineSpec | None = Field(
        default=None,
        description="Settings of `engine: vllm` pods (only with `engine: vllm`): `args`, more "
        "`vllm serve` flags.",
    )
    pod_template: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra=K8S_OBJECT,
        description="Pod template overlay (core/v1 PodTemplateSpec subset) merged into every "
        "generated pod the way LeaderWorkerSet/KServe merge theirs: `metadata.labels`/"
        "`annotations` added; `spec.containers[]` matched by name (the operator's container is "
        "`attention-client`; other names are added as sidecars) with their `env`, `volumeMounts` (by "
        "mountPath), `envFrom` and `securityContext` merged; `spec.volumes` and "
        "`imagePullSecrets` merged by name; `tolerations` appended; `nodeSelector` merged; "
        "`affinity`, `serviceAccountName`, `priorityClassName` and `securityContext` set. Other "
        "keys are refused (status InvalidSpec).",
    )
