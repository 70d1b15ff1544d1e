"""Pure desired-state builders and decisions of the operator (no I/O, no kopf).

Everything the handlers do is decided here from plain inputs: the parsed spec, the owner's
identity, and what the API server reports (pods, the routing-table ConfigMap, the Deployment).
Each function returns manifests (plain dicts ready for the Kubernetes API) or small records.

Names (deterministic, so a restarted operator finds what it made before):

* expert-server pod ``<pool>-<index>``, ``0 <= index < spec.replicas``;
* routing-table ConfigMap ``<pool>-routing-table`` (key ``routing-table.json``);
* attention fleet Deployment and Service ``<fleet>``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from eaas.operator.crd import (
    ANNOTATION_EXPERTS,
    ANNOTATION_SPEC_HASH,
    ANNOTATION_TABLE_VERSION,
    API_VERSION,
    LABEL_FLEET,
    LABEL_PLACEMENT_REVISION,
    LABEL_POOL,
    LABEL_ROLE,
    LABEL_SERVER_INDEX,
    AttentionFleetSpec,
    Condition,
    ExpertPoolSpec,
    ExpertPoolStatus,
    PlacementSummary,
)
from eaas.runtime.placement import (
    LayerExpert,
    Placement,
    format_expert_spec,
    parse_expert_spec,
    place_experts,
)
from eaas.runtime.routing import RoutingTable

SERVER_ROLE = "expert-server"
CLIENT_ROLE = "attention-client"
TABLE_KEY = "routing-table.json"
TABLE_MOUNT_DIR = "/etc/eaas"
GPU_RESOURCE = "nvidia.com/gpu"
MANAGED_BY = "eaas-operator"


# ---------------------------------------------------------------------------------------------
# identity and names
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Owner:
    """The custom object that owns what we build.

    Attributes:
        kind: ``ExpertPool`` or ``AttentionFleet``.
        name, namespace, uid: from its metadata.
        generation: ``metadata.generation`` (0 if absent).
    """

    kind: str
    name: str
    namespace: str
    uid: str
    generation: int = 0

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Owner:
        meta = body["metadata"]
        return cls(
            kind=body["kind"],
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            generation=int(meta.get("generation") or 0),
        )

    def reference(self) -> dict[str, Any]:
        """ownerReference with ``controller`` and ``blockOwnerDeletion`` (GC deletes dependants)."""
        return {
            "apiVersion": API_VERSION,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def server_name(pool: str, index: int) -> str:
    """Pod name of expert server ``index`` of ``pool``."""
    return f"{pool}-{index}"


def table_configmap_name(pool: str) -> str:
    """Name of the pool's routing-table ConfigMap."""
    return f"{pool}-routing-table"


def server_labels(pool: str) -> dict[str, str]:
    """Labels shared by all expert-server pods of ``pool`` (the scale selector)."""
    return {LABEL_POOL: pool, LABEL_ROLE: SERVER_ROLE}


def client_labels(fleet: str) -> dict[str, str]:
    """Labels shared by the attention-client pods of ``fleet`` (Deployment and Service selector)."""
    return {LABEL_FLEET: fleet, LABEL_ROLE: CLIENT_ROLE}


def selector_string(labels: Mapping[str, str]) -> str:
    """Label-selector string form (``a=b,c=d``, sorted) as the ``scale`` subresource wants it."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def _hash(obj: Any, n: int = 10) -> str:
    return hashlib.sha256(
        json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()[:n]


# ---------------------------------------------------------------------------------------------
# placement
# ---------------------------------------------------------------------------------------------
def compute_placement(
    spec: ExpertPoolSpec, expert_load: Mapping[LayerExpert, float] | None = None
) -> Placement:
    """Placement of every (MoE layer, logical expert) on ``spec.replicas`` servers.

    Raises:
        eaas.runtime.placement.PlacementError: redundancy above replicas or another impossible
            request (the CRD's rules normally reject those before they reach the operator).
    """
    return place_experts(
        layers=spec.model.layers(),
        num_experts=spec.model.num_experts,
        num_servers=spec.replicas,
        redundancy=spec.redundancy,
        policy=spec.placement.policy,
        expert_load=expert_load,
    )


def placement_revision(spec: ExpertPoolSpec) -> str:
    """Short hash of the placement's inputs; changes exactly when the placement may change."""
    return _hash(
        {
            "layers": spec.model.layers(),
            "numExperts": spec.model.num_experts,
            "servers": spec.replicas,
            "redundancy": spec.redundancy,
            "policy": spec.placement.policy,
        }
    )


# ---------------------------------------------------------------------------------------------
# expert-server pods
# ---------------------------------------------------------------------------------------------
def server_command(
    spec: ExpertPoolSpec, pod_name: str, experts: Sequence[LayerExpert]
) -> list[str]:
    """The expert server's command line (flag names fixed by the runtime)."""
    return [
        "eaas",
        "expert-server",
        "--model",
        spec.model.uri,
        "--server-id",
        pod_name,
        "--experts",
        format_expert_spec(experts),
        "--listen",
        f"tcp://0.0.0.0:{spec.port}",
    ]


def server_resources(spec: ExpertPoolSpec) -> dict[str, Any]:
    """``spec.resources`` plus ``nvidia.com/gpu: gpusPerServer`` and ``<rdmaResource>: 1`` in both
    requests and limits (extended resources need requests == limits)."""
    extra = {GPU_RESOURCE: str(spec.gpus_per_server)}
    if spec.rdma_resource:
        extra[spec.rdma_resource] = "1"
    base = dict(spec.resources or {})
    requests = {**(base.get("requests") or {}), **extra}
    limits = {**(base.get("limits") or {}), **extra}
    return {**base, "requests": requests, "limits": limits}


def server_pod(
    owner: Owner, spec: ExpertPoolSpec, index: int, experts: Sequence[LayerExpert], revision: str
) -> dict[str, Any]:
    """Manifest of expert-server pod ``index`` hosting ``experts``.

    The annotation ``eaas.io/spec-hash`` hashes the pod spec (so also its experts): a pod whose
    hash differs from the desired one is outdated and gets replaced. ``eaas.io/experts`` repeats
    the ``--experts`` value so the routing table can be built from live pods alone.
    """
    name = server_name(owner.name, index)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Always",
        "nodeSelector": dict(spec.node_selector),
        "tolerations": list(spec.tolerations),
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": server_labels(owner.name)},
            }
        ],
        "containers": [
            {
                "name": SERVER_ROLE,
                "image": spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                "command": server_command(spec, name, experts),
                "ports": [{"name": "experts", "containerPort": spec.port, "protocol": "TCP"}],
                "env": [
                    {"name": "EAAS_POOL", "value": owner.name},
                    {
                        "name": "EAAS_DISPATCH_TIMEOUT_MS",
                        "value": str(spec.failure_detection.dispatch_timeout_ms),
                    },
                    {
                        "name": "EAAS_SUSPECT_AFTER_MS",
                        "value": str(spec.failure_detection.suspect_after_ms),
                    },
                ],
                "resources": server_resources(spec),
                "readinessProbe": {
                    "tcpSocket": {"port": spec.port},
                    "periodSeconds": 1,
                    "failureThreshold": 2,
                },
            }
        ],
    }
    if spec.affinity:
        pod_spec["affinity"] = spec.affinity
    spec_hash = _hash(pod_spec)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": owner.namespace,
            "labels": {
                **server_labels(owner.name),
                LABEL_SERVER_INDEX: str(index),
                LABEL_PLACEMENT_REVISION: revision,
                "app.kubernetes.io/name": "eaas",
                "app.kubernetes.io/component": SERVER_ROLE,
                "app.kubernetes.io/managed-by": MANAGED_BY,
            },
            "annotations": {
                ANNOTATION_EXPERTS: format_expert_spec(experts),
                ANNOTATION_SPEC_HASH: spec_hash,
            },
            "ownerReferences": [owner.reference()],
        },
        "spec": pod_spec,
    }


def desired_server_pods(
    owner: Owner, spec: ExpertPoolSpec, placement: Placement, revision: str
) -> dict[str, dict[str, Any]]:
    """Pod name -> manifest for every server of ``placement`` (index order)."""
    return {
        server_name(owner.name, s): server_pod(owner, spec, s, experts, revision)
        for s, experts in enumerate(placement.servers)
    }


@dataclass(frozen=True)
class ObservedPod:
    """What the operator needs to know about an existing expert-server pod.

    Attributes:
        name: pod name.
        uid: pod uid (delete preconditions).
        index: ``eaas.io/server-index`` label, or -1 if missing/malformed.
        spec_hash: ``eaas.io/spec-hash`` annotation.
        revision: ``eaas.io/placement-revision`` label.
        experts: hosted (layer, expert) pairs from the ``eaas.io/experts`` annotation.
        ready: the ``Ready`` condition is True.
        ip: pod IP, or "".
        terminating: ``deletionTimestamp`` is set.
        phase: ``status.phase`` (Pending, Running, Succeeded, Failed, Unknown).
        owner_uid: uid of its controller ownerReference, or "".
        node: ``spec.nodeName``, or "".
        node_ready: False when its node is known NotReady/Unknown (a dead node's pods still
            look Ready until the node controller evicts them, minutes later).
    """

    name: str
    uid: str = ""
    index: int = -1
    spec_hash: str = ""
    revision: str = ""
    experts: tuple[LayerExpert, ...] = ()
    ready: bool = False
    ip: str = ""
    terminating: bool = False
    phase: str = "Pending"
    owner_uid: str = ""
    node: str = ""
    node_ready: bool = True

    @property
    def finished(self) -> bool:
        """The pod's process ended for good (Failed/Succeeded): it must be replaced."""
        return self.phase in ("Failed", "Succeeded")

    @property
    def live(self) -> bool:
        """Usable by clients: Ready, has an IP, Running, not terminating, its node Ready."""
        return (
            self.ready
            and bool(self.ip)
            and not self.terminating
            and self.phase == "Running"
            and self.node_ready
        )

    @classmethod
    def from_pod(
        cls, pod: Mapping[str, Any], ready_nodes: Mapping[str, bool] | None = None
    ) -> ObservedPod:
        """Parse a pod as returned by the API (camelCase JSON dict). ``ready_nodes``: node name ->
        Ready; nodes not in it count as Ready."""
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        labels = meta.get("labels") or {}
        annotations = meta.get("annotations") or {}
        try:
            index = int(labels.get(LABEL_SERVER_INDEX, "-1"))
        except ValueError:
            index = -1
        try:
            experts = tuple(parse_expert_spec(annotations.get(ANNOTATION_EXPERTS, "")))
        except ValueError:
            experts = ()
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in (status.get("conditions") or [])
        )
        owner_uid = next(
            (r.get("uid", "") for r in (meta.get("ownerReferences") or []) if r.get("controller")),
            "",
        )
        return cls(
            name=meta.get("name", ""),
            uid=meta.get("uid", ""),
            index=index,
            spec_hash=annotations.get(ANNOTATION_SPEC_HASH, ""),
            revision=labels.get(LABEL_PLACEMENT_REVISION, ""),
            experts=experts,
            ready=ready,
            ip=status.get("podIP") or "",
            terminating=bool(meta.get("deletionTimestamp")),
            phase=status.get("phase") or "Pending",
            owner_uid=owner_uid,
            node=(pod.get("spec") or {}).get("nodeName") or "",
            node_ready=(ready_nodes or {}).get((pod.get("spec") or {}).get("nodeName") or "", True),
        )


@dataclass
class PodPlan:
    """What to do with expert-server pods in one reconcile step.

    Attributes:
        create: manifests to create (their names are free).
        delete: ``(name, uid, why)`` to delete; ``why`` is ``failed``, ``excess`` or ``outdated``.
        relabel: ``(name, revision)``: pods whose experts did not change but whose
            placement-revision label is stale.
        waiting: desired names still held by a terminating pod (created on a later step).
        outdated: names of existing pods whose spec hash differs from the desired one.
        excess: names of existing pods not in the desired set.
        forced: an outdated/excess pod was deleted although that leaves some expert without a
            live replica (only when nothing else could make progress).
    """

    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[tuple[str, str, str]] = field(default_factory=list)
    relabel: list[tuple[str, str]] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    outdated: list[str] = field(default_factory=list)
    excess: list[str] = field(default_factory=list)
    forced: bool = False

    @property
    def idle(self) -> bool:
        return not (self.create or self.delete or self.relabel or self.waiting)


def _covered(pods: Iterable[ObservedPod]) -> set[LayerExpert]:
    out: set[LayerExpert] = set()
    for p in pods:
        out.update(p.experts)
    return out


def plan_pods(
    desired: Mapping[str, Mapping[str, Any]],
    observed: Sequence[ObservedPod],
    max_unavailable: int,
) -> PodPlan:
    """Decide creations, deletions and relabels that move ``observed`` toward ``desired``.

    Rules:

    * missing desired pods are created at once (adding a server never hurts coverage);
    * Failed/Succeeded pods are deleted at once (they serve nothing) and recreated next step;
    * outdated pods (spec hash differs, e.g. their experts changed), then excess pods (index
      beyond ``replicas``), are deleted one by one, only while fewer than ``max_unavailable`` desired
      servers are unavailable, and only if every (layer, expert) that is live now stays live on
      the remaining Ready pods. If that blocks all progress while every desired server is
      available, one pod is deleted anyway (``forced``) so a re-placement always completes.

    Args:
        desired: pod name -> manifest (from :func:`desired_server_pods`).
        observed: the pool's existing pods.
        max_unavailable: how many desired servers may be down at once (>= 1).
    """
    plan = PodPlan()
    by_name = {p.name: p for p in observed}
    unavailable = 0
    candidates: list[ObservedPod] = []
    for name, manifest in desired.items():
        pod = by_name.get(name)
        want_hash = manifest["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
        want_rev = manifest["metadata"]["labels"][LABEL_PLACEMENT_REVISION]
        if pod is None:
            plan.create.append(dict(manifest))
            unavailable += 1
            continue
        if pod.terminating:
            plan.waiting.append(name)
            unavailable += 1
            continue
        if pod.finished:
            plan.delete.append((name, pod.uid, "failed"))
            unavailable += 1
            continue
        if not pod.live:
            unavailable += 1
        if pod.spec_hash != want_hash:
            plan.outdated.append(name)
            candidates.append(pod)
        elif pod.revision != want_rev:
            plan.relabel.append((name, want_rev))
    excess = sorted(
        (p for p in observed if p.name not in desired and not p.terminating), key=lambda p: -p.index
    )
    plan.excess = [p.name for p in excess]
    for p in excess:
        if not p.live:  # serves nothing: remove now
            plan.delete.append((p.name, p.uid, "excess"))
    excess_live = [p for p in excess if p.live]

    removed: set[str] = {n for n, _, _ in plan.delete}
    live = [p for p in observed if p.live and p.name not in removed]
    must_cover = _covered(live)
    budget = max(1, max_unavailable) - unavailable

    def safe_without(pod: ObservedPod) -> bool:
        rest = [p for p in live if p.name not in removed and p.name != pod.name]
        return must_cover <= _covered(rest)

    # replace outdated servers first while excess ones still hold their experts, then shrink
    ordered = sorted(candidates, key=lambda p: p.index) + excess_live
    for pod in ordered:
        is_excess = pod.name not in desired
        if not is_excess and budget <= 0:
            continue
        if not safe_without(pod):
            continue
        plan.delete.append((pod.name, pod.uid, "excess" if is_excess else "outdated"))
        removed.add(pod.name)
        if not is_excess:
            budget -= 1
    if ordered and unavailable == 0 and not any(n in removed for n in (p.name for p in ordered)):
        pod = ordered[0]
        plan.delete.append((pod.name, pod.uid, "excess" if pod.name not in desired else "outdated"))
        plan.forced = True
    return plan


# ---------------------------------------------------------------------------------------------
# routing table
# ---------------------------------------------------------------------------------------------
def build_routing_table(
    spec: ExpertPoolSpec, live: Sequence[ObservedPod], version: int
) -> RoutingTable:
    """Routing table over the ``live`` pods: each (layer, expert) of the model lists the live
    pods whose ``eaas.io/experts`` names it, in server-index order; endpoints ``tcp://IP:port``.
    Experts outside the model's range (a pod from an older spec) are ignored."""
    pods = sorted(live, key=lambda p: (p.index, p.name))
    layers = spec.model.layers()
    hosting: dict[LayerExpert, list[str]] = {}
    for p in pods:
        for pair in p.experts:
            hosting.setdefault(pair, []).append(p.name)
    return RoutingTable(
        version=version,
        num_experts=spec.model.num_experts,
        servers={p.name: f"tcp://{p.ip}:{spec.port}" for p in pods},
        layers={
            layer: tuple(tuple(hosting.get((layer, e), ())) for e in range(spec.model.num_experts))
            for layer in layers
        },
    )


def _content(table: RoutingTable) -> dict[str, Any]:
    d = table.to_dict()
    d.pop("version")
    return d


def next_routing_table(
    spec: ExpertPoolSpec,
    live: Sequence[ObservedPod],
    previous: RoutingTable | None,
    floor_version: int = 0,
) -> tuple[RoutingTable, bool]:
    """The table to publish and whether it differs from ``previous``.

    The version is strictly increasing across content changes: a changed table gets
    ``max(previous.version, floor_version) + 1`` (``floor_version``: the last version recorded
    anywhere else, e.g. the pool's status, so a lost ConfigMap never makes it go back). An
    unchanged table is returned as ``previous`` itself.
    """
    candidate = build_routing_table(spec, live, 0)
    if previous is not None and _content(previous) == _content(candidate):
        return previous, False
    version = max(previous.version if previous else 0, floor_version) + 1
    return dataclasses.replace(candidate, version=version), True


def routing_table_configmap(owner: Owner, table: RoutingTable) -> dict[str, Any]:
    """The pool's routing-table ConfigMap (owned by the pool; version also as an annotation)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": table_configmap_name(owner.name),
            "namespace": owner.namespace,
            "labels": {LABEL_POOL: owner.name, "app.kubernetes.io/managed-by": MANAGED_BY},
            "annotations": {ANNOTATION_TABLE_VERSION: str(table.version)},
            "ownerReferences": [owner.reference()],
        },
        "data": {TABLE_KEY: table.to_json()},
    }


def coverage(table: RoutingTable, redundancy: int) -> tuple[int, int, int]:
    """``(logical experts, below redundancy, uncovered)`` counted over ``table``."""
    total = below = uncovered = 0
    for experts in table.layers.values():
        for reps in experts:
            total += 1
            below += len(set(reps)) < redundancy
            uncovered += not reps
    return total, below, uncovered


# ---------------------------------------------------------------------------------------------
# status
# ---------------------------------------------------------------------------------------------
def set_condition(old: Sequence[Mapping[str, Any]], new: Condition, now: str) -> dict[str, Any]:
    """``new`` as a dict, keeping ``lastTransitionTime`` from ``old`` when the status is unchanged."""
    prev = next((c for c in old if c.get("type") == new.type), None)
    ltt = prev.get("lastTransitionTime") if prev and prev.get("status") == new.status else None
    return new.model_copy(update={"last_transition_time": ltt or now}).model_dump(
        by_alias=True, exclude_none=True
    )


def pool_status(
    *,
    owner: Owner,
    spec: ExpertPoolSpec,
    placement: Placement,
    revision: str,
    observed: Sequence[ObservedPod],
    plan: PodPlan,
    table: RoutingTable,
    old_conditions: Sequence[Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    """The pool's ``status`` (camelCase dict) after one reconcile step.

    Conditions:

    * ``Ready``: True iff ``spec.replicas`` up-to-date servers are live and every logical expert
      has ``redundancy`` live replicas in the published table.
    * ``Progressing``: True while pods are created, replaced, removed or not yet Ready
      (reasons ScalingUp, ScalingDown, RePlacing, WaitingForServers); False/Reconciled when done.
    * ``Degraded``: True if some expert has no live replica (ExpertsUncovered), fewer than
      ``redundancy`` (BelowRedundancy), or a server pod failed (ServerFailed).
    """
    deleted = {n for n, _, _ in plan.delete}
    existing = [p for p in observed if not p.terminating and p.name not in deleted]
    desired_names = {server_name(owner.name, s) for s in range(spec.replicas)}
    outdated = set(plan.outdated)
    ready = [p for p in existing if p.live and p.name in desired_names and p.name not in outdated]
    updated = [p for p in existing if p.name in desired_names and p.name not in outdated]
    total, below, uncovered = coverage(table, spec.redundancy)
    eps = placement.experts_per_server()
    failed = [n for n, _, why in plan.delete if why == "failed"]
    missing = spec.replicas - len([p for p in existing if p.name in desired_names])

    gen = owner.generation
    all_ready = len(ready) == spec.replicas and below == 0 and not plan.excess
    if all_ready:
        ready_c = Condition(
            type="Ready",
            status="True",
            reason="AllServersReady",
            message=f"{len(ready)}/{spec.replicas} expert servers ready; every expert has "
            f">= {spec.redundancy} live replicas",
            observed_generation=gen,
        )
    elif uncovered:
        ready_c = Condition(
            type="Ready",
            status="False",
            reason="ExpertsUncovered",
            message=f"{uncovered}/{total} logical experts have no live replica; "
            f"{len(ready)}/{spec.replicas} expert servers ready",
            observed_generation=gen,
        )
    else:
        ready_c = Condition(
            type="Ready",
            status="False",
            reason="ServersNotReady",
            message=f"{len(ready)}/{spec.replicas} expert servers ready and up to date",
            observed_generation=gen,
        )

    if missing > 0:
        prog = ("True", "ScalingUp", f"creating {missing} expert server(s)")
    elif plan.excess:
        prog = ("True", "ScalingDown", f"removing {len(plan.excess)} expert server(s)")
    elif plan.outdated:
        prog = (
            "True",
            "RePlacing",
            f"replacing {len(plan.outdated)} server(s) for placement revision {revision}",
        )
    elif len(ready) < spec.replicas or plan.waiting:
        prog = (
            "True",
            "WaitingForServers",
            f"{spec.replicas - len(ready)} expert server(s) not ready yet",
        )
    else:
        prog = (
            "False",
            "Reconciled",
            f"{spec.replicas} expert servers at placement revision {revision}",
        )
    prog_c = Condition(
        type="Progressing", status=prog[0], reason=prog[1], message=prog[2], observed_generation=gen
    )

    if uncovered:
        deg = (
            "True",
            "ExpertsUncovered",
            f"{uncovered}/{total} logical experts have no live replica",
        )
    elif failed:
        deg = ("True", "ServerFailed", f"expert server pod(s) failed: {', '.join(sorted(failed))}")
    elif below:
        deg = (
            "True",
            "BelowRedundancy",
            f"{below}/{total} logical experts have fewer than {spec.redundancy} live replicas",
        )
    else:
        deg = (
            "False",
            "AsExpected",
            f"every logical expert has >= {spec.redundancy} live replicas",
        )
    deg_c = Condition(
        type="Degraded", status=deg[0], reason=deg[1], message=deg[2], observed_generation=gen
    )

    status = ExpertPoolStatus(
        replicas=len(existing),
        ready_replicas=len(ready),
        updated_replicas=len(updated),
        selector=selector_string(server_labels(owner.name)),
        observed_generation=gen,
        routing_table_version=table.version,
        placement=PlacementSummary(
            experts_per_server_min=min(eps) if eps else 0,
            experts_per_server_max=max(eps) if eps else 0,
            experts_below_redundancy=below,
            uncovered_experts=uncovered,
            logical_experts=total,
        ),
        placement_revision=revision,
    ).model_dump(by_alias=True, exclude_none=True)
    status["conditions"] = [set_condition(old_conditions, c, now) for c in (ready_c, prog_c, deg_c)]
    return status


def invalid_spec_status(
    owner: Owner,
    message: str,
    old_conditions: Sequence[Mapping[str, Any]],
    now: str,
    old_status: Mapping[str, Any],
) -> dict[str, Any]:
    """Status for a spec the operator cannot act on (passes the CRD rules but e.g. fails placement)."""
    status = dict(old_status)
    status["observedGeneration"] = owner.generation
    status["conditions"] = [
        set_condition(
            old_conditions,
            Condition(
                type="Ready",
                status="False",
                reason="InvalidSpec",
                message=message,
                observed_generation=owner.generation,
            ),
            now,
        ),
        set_condition(
            old_conditions,
            Condition(
                type="Progressing",
                status="False",
                reason="InvalidSpec",
                message=message,
                observed_generation=owner.generation,
            ),
            now,
        ),
        set_condition(
            old_conditions,
            Condition(
                type="Degraded",
                status="True",
                reason="InvalidSpec",
                message=message,
                observed_generation=owner.generation,
            ),
            now,
        ),
    ]
    return status


# ---------------------------------------------------------------------------------------------
# attention fleet
# ---------------------------------------------------------------------------------------------
def client_command(spec: AttentionFleetSpec, pool: ExpertPoolSpec | None = None) -> list[str]:
    """The attention client's command line: serve the API on all interfaces (the Service reaches
    it through the pod IP); with the pool known, its dispatch deadline (seconds)."""
    cmd = [
        "eaas",
        "attention-client",
        "--model",
        spec.model.uri,
        "--routing-table",
        f"{TABLE_MOUNT_DIR}/{TABLE_KEY}",
        "--port",
        str(spec.port),
        "--host",
        "0.0.0.0",
    ]
    if pool is not None:
        cmd += ["--dispatch-timeout", f"{pool.failure_detection.dispatch_timeout_ms / 1000:g}"]
    return cmd


def fleet_deployment(
    owner: Owner, spec: AttentionFleetSpec, pool: ExpertPoolSpec | None
) -> dict[str, Any]:
    """Deployment of attention clients mounting the pool's routing-table ConfigMap at
    ``/etc/eaas`` (a directory mount, so ConfigMap updates reach running pods). ``pool``, when
    known, supplies the failure-detection timing as environment variables."""
    labels = client_labels(owner.name)
    env = [{"name": "EAAS_EXPERT_POOL", "value": spec.expert_pool_ref.name}]
    if pool is not None:
        env += [
            {
                "name": "EAAS_DISPATCH_TIMEOUT_MS",
                "value": str(pool.failure_detection.dispatch_timeout_ms),
            },
            {
                "name": "EAAS_SUSPECT_AFTER_MS",
                "value": str(pool.failure_detection.suspect_after_ms),
            },
        ]
    container: dict[str, Any] = {
        "name": CLIENT_ROLE,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": client_command(spec, pool),
        "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}],
        "env": env,
        "volumeMounts": [{"name": "routing-table", "mountPath": TABLE_MOUNT_DIR, "readOnly": True}],
        "readinessProbe": {"tcpSocket": {"port": spec.port}, "periodSeconds": 2},
    }
    if spec.resources:
        container["resources"] = spec.resources
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [
            {
                "name": "routing-table",
                "configMap": {
                    "name": table_configmap_name(spec.expert_pool_ref.name),
                    "items": [{"key": TABLE_KEY, "path": TABLE_KEY}],
                },
            }
        ],
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = list(spec.tolerations)
    dep_spec = {
        "replicas": spec.replicas,
        "selector": {"matchLabels": labels},
        "template": {
            "metadata": {"labels": {**labels, "app.kubernetes.io/component": CLIENT_ROLE}},
            "spec": pod_spec,
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": owner.name,
            "namespace": owner.namespace,
            "labels": {**labels, "app.kubernetes.io/managed-by": MANAGED_BY},
            "annotations": {ANNOTATION_SPEC_HASH: _hash(dep_spec)},
            "ownerReferences": [owner.reference()],
        },
        "spec": dep_spec,
    }


def fleet_service(owner: Owner, spec: AttentionFleetSpec) -> dict[str, Any]:
    """ClusterIP Service in front of the attention clients (OpenAI-compatible API)."""
    svc_spec = {
        "selector": client_labels(owner.name),
        "ports": [{"name": "http", "port": spec.port, "targetPort": spec.port, "protocol": "TCP"}],
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": owner.name,
            "namespace": owner.namespace,
            "labels": {**client_labels(owner.name), "app.kubernetes.io/managed-by": MANAGED_BY},
            "annotations": {ANNOTATION_SPEC_HASH: _hash(svc_spec)},
            "ownerReferences": [owner.reference()],
        },
        "spec": svc_spec,
    }


def fleet_status(
    *,
    owner: Owner,
    spec: AttentionFleetSpec,
    deployment_status: Mapping[str, Any] | None,
    pool_found: bool,
    table_version: int,
    old_conditions: Sequence[Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    """The fleet's ``status``: Ready when all clients are ready and the pool's table exists;
    Degraded when the pool or its routing table is missing."""
    ds = deployment_status or {}
    ready = int(ds.get("readyReplicas") or 0)
    replicas = int(ds.get("replicas") or 0)
    updated = int(ds.get("updatedReplicas") or 0)
    gen = owner.generation
    pool = spec.expert_pool_ref.name
    if not pool_found:
        deg = Condition(
            type="Degraded",
            status="True",
            reason="ExpertPoolNotFound",
            message=f"ExpertPool {pool!r} not found",
            observed_generation=gen,
        )
    elif table_version == 0:
        deg = Condition(
            type="Degraded",
            status="True",
            reason="NoRoutingTable",
            message=f"ExpertPool {pool!r} has not published a routing table yet",
            observed_generation=gen,
        )
    else:
        deg = Condition(
            type="Degraded",
            status="False",
            reason="AsExpected",
            message=f"using routing table version {table_version} of {pool!r}",
            observed_generation=gen,
        )
    ok = ready >= spec.replicas and deg.status == "False"
    ready_c = Condition(
        type="Ready",
        status="True" if ok else "False",
        reason="AllClientsReady" if ok else "ClientsNotReady",
        message=f"{ready}/{spec.replicas} attention clients ready",
        observed_generation=gen,
    )
    busy = updated < spec.replicas or replicas != spec.replicas or ready < spec.replicas
    prog_c = Condition(
        type="Progressing",
        status="True" if busy else "False",
        reason="RollingOut" if busy else "Reconciled",
        message=f"{updated}/{spec.replicas} clients updated",
        observed_generation=gen,
    )
    return {
        "replicas": replicas,
        "readyReplicas": ready,
        "selector": selector_string(client_labels(owner.name)),
        "observedGeneration": gen,
        "routingTableVersion": table_version,
        "conditions": [set_condition(old_conditions, c, now) for c in (ready_c, prog_c, deg)],
    }
