"""Expert-server pods (pure): their manifests, what the operator observes of them, and the
plan that moves the observed pods toward the desired ones without uncovering an expert."""

from __future__ import annotations

import collections
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from eaas.operator.crd import (
    ANNOTATION_EXPERTS,
    ANNOTATION_SPEC_HASH,
    LABEL_PLACEMENT_REVISION,
    LABEL_SERVER_INDEX,
    NVSHMEM_UID_MOUNT_DIR,
    ExpertPoolSpec,
)
from eaas.operator.names import (
    GPU_RESOURCE,
    MANAGED_BY,
    PUSH_TOKEN_KEY,
    SERVER_ROLE,
    Owner,
    content_hash,
    server_labels,
    server_name,
)
from eaas.operator.overlay import apply_pod_template
from eaas.runtime.options import PROGRAM, ExpertServerOptions
from eaas.runtime.options.nvshmem_world import WorldLayout, world_env
from eaas.runtime.placement import LayerExpert, Placement
from eaas.runtime.tables.expert_spec import format_expert_spec, parse_expert_spec

# ---------------------------------------------------------------------------------------------
# expert-server pods
# ---------------------------------------------------------------------------------------------
#: Where an expert-server pod finds the bearer token of routing-table pushes (assignment
#: routing-table), from the pool's Secret :func:`server_push_secret_name`.
SERVER_TOKEN_MOUNT_DIR = "/etc/eaas/server-push-token"


def server_push_secret_name(pool: str) -> str:
    """Name of the pool's Secret holding the token of pushes to its expert servers."""
    return f"{pool}-server-push-token"


def table_assignment(spec: ExpertPoolSpec) -> bool:
    """Whether the pool's servers learn their experts from the routing table."""
    return spec.placement.assignment == "routing-table"


# ---------------------------------------------------------------------------------------------
# NVSHMEM world (spec.transport.scheme nvshmem; docs/gpu.md "nvshmem:PE")
# ---------------------------------------------------------------------------------------------
def world_layout(spec: ExpertPoolSpec) -> WorldLayout | None:
    """The pool's NVSHMEM world (clients, ``replicas`` servers, spares), or None (tcp)."""
    nv = spec.transport.nvshmem
    if spec.transport.scheme != "nvshmem" or nv is None:
        return None
    return WorldLayout(clients=nv.clients, servers=spec.replicas, spares=nv.spares)


def desired_server_count(spec: ExpertPoolSpec) -> int:
    """Expert-server pods of the pool: ``replicas``, plus the NVSHMEM world's spares."""
    layout = world_layout(spec)
    return spec.replicas + (layout.spares if layout is not None else 0)


def server_role(spec: ExpertPoolSpec, index: int) -> tuple[str, int]:
    """``("server", index)`` for ``index < replicas``, else ``("spare", index - replicas)``."""
    return ("server", index) if index < spec.replicas else ("spare", index - spec.replicas)


def server_pe(spec: ExpertPoolSpec, index: int) -> int:
    """The NVSHMEM PE of expert-server pod ``index`` (spares follow the servers).

    Raises:
        ValueError: the pool has no NVSHMEM world, or ``index`` is outside it.
    """
    layout = world_layout(spec)
    if layout is None:
        raise ValueError("spec.transport.scheme is not nvshmem: no PEs")
    return layout.pe(*server_role(spec, index))


def server_endpoint(spec: ExpertPoolSpec, index: int, ip: str) -> str:
    """The routing-table endpoint of server pod ``index`` at ``ip``: ``nvshmem:PE`` in an
    NVSHMEM world (its PE, whatever its IP; ``""`` for a pod outside the world, e.g. an excess
    pod of an older spec, which no table lists), else ``tcp://IP:port``."""
    layout = world_layout(spec)
    if layout is not None:
        if not 0 <= index < desired_server_count(spec):
            return ""
        return f"nvshmem:{server_pe(spec, index)}"
    return f"tcp://{ip}:{spec.port}"


def nvshmem_uid_file(pool: str, spec: ExpertPoolSpec) -> str:
    """Where the world's members exchange its unique id: one file per pool and world layout
    (a new layout is a new world, so no member ever reads an older world's id), on the
    ``uidVolume`` mounted at ``/var/run/eaas/nvshmem``.

    Raises:
        ValueError: the pool has no NVSHMEM world.
    """
    layout = world_layout(spec)
    if layout is None:
        raise ValueError("spec.transport.scheme is not nvshmem: no unique-id file")
    world = content_hash([layout.clients, layout.servers, layout.spares], 8)
    return f"{NVSHMEM_UID_MOUNT_DIR}/{pool}-{world}.uid"


def nvshmem_env(pool: str, spec: ExpertPoolSpec, role: str, index: int) -> list[dict[str, str]]:
    """core/v1 EnvVars of one world member (``role`` client | server | spare, its index in
    the role): :func:`eaas.runtime.options.nvshmem_world.world_env` (``EAAS_NVSHMEM_*``,
    ``NVSHMEM_IB_ENABLE_IBGDA``); empty without an NVSHMEM world."""
    layout = world_layout(spec)
    if layout is None or spec.transport.nvshmem is None:
        return []
    env = world_env(
        layout, role, index, nvshmem_uid_file(pool, spec), ibgda=spec.transport.nvshmem.ibgda
    )
    return [{"name": k, "value": v} for k, v in sorted(env.items())]


def table_members(spec: ExpertPoolSpec, live: Sequence[ObservedPod]) -> list[str]:
    """The servers a ``routing-table`` placement spreads experts over, in index order: the live
    pods with ``index < replicas``; in an NVSHMEM world, live spares (``index >= replicas``,
    lowest first) stand in for the missing ones -- a server that left the world cannot come
    back into it (its PE set is fixed), so its replacement is a spare (docs/gpu.md "Elastic
    membership"). ``live``: pods usable now (:attr:`ObservedPod.live`)."""
    pods = sorted(live, key=lambda p: (p.index, p.name))
    members = [p.name for p in pods if 0 <= p.index < spec.replicas]
    if world_layout(spec) is not None:
        spares = [p.name for p in pods if spec.replicas <= p.index < desired_server_count(spec)]
        members += spares[: max(0, spec.replicas - len(members))]
    return members


def server_command(
    spec: ExpertPoolSpec, pod_name: str, experts: Sequence[LayerExpert], index: int = 0
) -> list[str]:
    """The expert server's command line (flag names fixed by the runtime): the model path as the
    container sees it, the hosted experts (``assignment: command-line``) or the push token file
    (``routing-table``: no experts, they come from the pushed table), the data-plane listener
    and the HTTP port of ``/health`` and ``/metrics`` (also the table push endpoint).

    In an NVSHMEM world (``spec.transport.scheme: nvshmem``) the listener is ``nvshmem:PE``
    (pod ``index``'s PE), the server computes on the GPU (``--device cuda``) and a spare pod
    (``index >= replicas``) starts with ``--spare``; the world itself comes from the env vars
    of :func:`nvshmem_env`."""
    world = world_layout(spec) is not None
    spare = world and server_role(spec, index)[0] == "spare"
    from_table = table_assignment(spec) or spare
    # a world member listens on its PE and computes on the GPU
    listen = f"nvshmem:{server_pe(spec, index)}" if world else f"tcp://0.0.0.0:{spec.port}"
    options = ExpertServerOptions(
        model=spec.model.model_path(),
        server_id=pod_name,
        spare=spare,
        push_token_file=f"{SERVER_TOKEN_MOUNT_DIR}/{PUSH_TOKEN_KEY}" if from_table else None,
        experts=None if from_table else format_expert_spec(experts),
        http_port=spec.health_port,
        listen=listen,
        device="cuda" if world else ExpertServerOptions.device,
    )
    return [PROGRAM, *options.argv()]


def server_push_secret(owner: Owner, token: str) -> dict[str, Any]:
    """The pool's server push-token Secret (owned by the pool; ``token`` made once)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": server_push_secret_name(owner.name),
            "namespace": owner.namespace,
            "labels": {**server_labels(owner.name), "app.kubernetes.io/managed-by": MANAGED_BY},
            "ownerReferences": [owner.reference()],
        },
        "stringData": {PUSH_TOKEN_KEY: token},
    }


#: Probes of the expert server's ``GET /health`` (200 only while the serving loop iterates, see
#: ``eaas expert-server --health-stale-s``): startup allows 10 min for loading weights; then
#: readiness takes a frozen server out of Service endpoints within ~2 s and liveness has the
#: kubelet restart it after ~6 s of failures (a SIGSTOPped process keeps accepting TCP
#: connections into the kernel backlog, so a tcpSocket probe would never notice).
def server_probes(health_port: int) -> dict[str, dict[str, Any]]:
    """``startupProbe``, ``readinessProbe`` and ``livenessProbe`` of the expert-server container."""
    get = {"path": "/health", "port": health_port}
    return {
        "startupProbe": {
            "httpGet": dict(get),
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": 300,
        },
        "readinessProbe": {
            "httpGet": dict(get),
            "periodSeconds": 1,
            "timeoutSeconds": 1,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": dict(get),
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
    }


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

    With ``spec.placement.assignment: routing-table`` the pod carries no experts at all (they
    come from the pushed routing table), so its spec -- and its hash -- never changes when only
    the assignment does: scale-down, re-placement and rebalancing restart no running server.

    The model volume (``spec.model``) is mounted and ``spec.podTemplate`` merged in
    (:func:`eaas.operator.overlay.apply_pod_template`). The annotation ``eaas.io/spec-hash``
    hashes the pod spec (so also its experts): a pod whose hash differs from the desired one is
    outdated and gets replaced. ``eaas.io/experts`` repeats the ``--experts`` value so the
    routing table can be built from live pods alone.

    Raises:
        OverlayError: ``spec.podTemplate`` cannot be applied.
    """
    name = server_name(owner.name, index)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Always",
        "nodeSelector": dict(spec.node_selector),
        "tolerations": list(spec.tolerations),
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": spec.placement.topology_key,
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": server_labels(owner.name)},
            }
        ],
        "containers": [
            {
                "name": SERVER_ROLE,
                "image": spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                "command": server_command(spec, name, experts, index),
                "ports": [
                    {"name": "experts", "containerPort": spec.port, "protocol": "TCP"},
                    {"name": "http", "containerPort": spec.health_port, "protocol": "TCP"},
                ],
                "resources": server_resources(spec),
                **server_probes(spec.health_port),
            }
        ],
    }
    if spec.affinity:
        pod_spec["affinity"] = spec.affinity
    volume, mount = spec.model.volume(), spec.model.volume_mount()
    if volume is not None and mount is not None:
        pod_spec["volumes"] = [volume]
        pod_spec["containers"][0]["volumeMounts"] = [mount]
    nv = spec.transport.nvshmem if world_layout(spec) is not None else None
    if nv is not None:  # an NVSHMEM world member: its PE's env and the shared uid volume
        container = pod_spec["containers"][0]
        container["env"] = nvshmem_env(owner.name, spec, *server_role(spec, index))
        container["ports"] = [p for p in container["ports"] if p["name"] != "experts"]
        pod_spec.setdefault("volumes", []).append(nv.uid_volume.volume())
        container.setdefault("volumeMounts", []).append(nv.uid_volume.volume_mount())
    table_mode = table_assignment(spec)
    if table_mode or (nv is not None and nv.spares > 0):
        pod_spec.setdefault("volumes", []).append(
            {
                "name": "server-push-token",
                "secret": {
                    "secretName": server_push_secret_name(owner.name),
                    "items": [{"key": PUSH_TOKEN_KEY, "path": PUSH_TOKEN_KEY}],
                },
            }
        )
        pod_spec["containers"][0].setdefault("volumeMounts", []).append(
            {"name": "server-push-token", "mountPath": SERVER_TOKEN_MOUNT_DIR, "readOnly": True}
        )
    pod: dict[str, Any] = {
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
            "annotations": (
                {} if table_mode else {ANNOTATION_EXPERTS: format_expert_spec(experts)}
            ),
            "ownerReferences": [owner.reference()],
        },
        "spec": pod_spec,
    }
    pod = apply_pod_template(pod, spec.pod_template)
    pod["metadata"]["annotations"][ANNOTATION_SPEC_HASH] = content_hash(pod["spec"])
    return pod


def desired_server_pods(
    owner: Owner, spec: ExpertPoolSpec, placement: Placement, revision: str
) -> dict[str, dict[str, Any]]:
    """Pod name -> manifest for every server of ``placement`` (index order)."""
    return {
        server_name(owner.name, s): server_pod(owner, spec, s, experts, revision)
        for s, experts in enumerate(placement.servers)
    }


def desired_table_pods(
    owner: Owner, spec: ExpertPoolSpec, revision: str
) -> dict[str, dict[str, Any]]:
    """Pod name -> manifest of ``spec.replicas`` servers of a ``routing-table`` pool (no
    experts in any of them: the same manifests whatever the placement), plus an NVSHMEM
    world's spare pods (indices ``replicas ..``; never placed on until the table names them)."""
    return {
        server_name(owner.name, s): server_pod(owner, spec, s, (), revision)
        for s in range(desired_server_count(spec))
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
        restarts: sum of its containers' ``restartCount`` (a restarted server process holds
            no weights until the table is pushed to it again).
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
    restarts: int = 0

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
            restarts=sum(
                int(c.get("restartCount") or 0) for c in (status.get("containerStatuses") or [])
            ),
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


def plan_pods(
    desired: Mapping[str, Mapping[str, Any]],
    observed: Sequence[ObservedPod],
    max_unavailable: int,
    in_use: Collection[str] = (),
    surge: bool = True,
) -> PodPlan:
    """Decide creations, deletions and relabels that move ``observed`` toward ``desired``.

    Rules:

    * missing desired pods are created at once (adding a server never hurts coverage);
    * Failed/Succeeded pods are deleted at once (they serve nothing) and recreated next step;
    * outdated pods that are not live (not Ready, hung, on a dead node) are deleted at once:
      they serve nothing, so a hung pod never blocks a re-placement;
    * outdated live pods (spec hash differs, e.g. their experts changed), then excess pods (index
      beyond ``replicas``), are deleted one by one, only while fewer than ``max_unavailable``
      desired servers are unavailable -- with ``surge``, plus one for each live excess pod (on a
      scale-down the servers leaving still serve, as a Deployment's ``maxSurge``: the live
      servers never fall below ``desired - max_unavailable``) -- and only if every (layer, expert) that is live
      now stays live on the remaining Ready pods. If that blocks all progress while every desired server is
      available, one pod is deleted anyway (``forced``) so a re-placement always completes.

    Args:
        desired: pod name -> manifest (from :func:`desired_server_pods`).
        observed: the pool's existing pods.
        max_unavailable: how many desired servers may be down at once (>= 1).
        in_use: live excess or outdated pods that clients may still use (``routing-table``
            pools: named in the published or a pending routing table, not every client
            acknowledged a table without them, or not drained yet): never deleted now --
            make-before-break scale-down and re-placement (:mod:`eaas.operator.drain`).
        surge: the live excess pods serve until they are deleted (their experts are in the
            routing table: command-line pools), so each adds one to ``max_unavailable``. False
            for ``routing-table`` pools: a leaving server is taken out of the table first and
            serves nothing.
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
    held = set(in_use)
    excess_live = [p for p in excess if p.live and p.name not in held]

    removed: set[str] = {n for n, _, _ in plan.delete}
    live = [p for p in observed if p.live and p.name not in removed]
    # live replicas per (layer, expert) on the live pods not removed yet: a pod may go while
    # each of its experts has another (what is live now stays live; O(its experts), not O(pool))
    replicas: collections.Counter[LayerExpert] = collections.Counter()
    for p in live:
        replicas.update(set(p.experts))
    # the live excess servers serve until the re-placement is done: they are the surge
    budget = max(1, max_unavailable) + (len(excess_live) if surge else 0) - unavailable

    # with the surge, the excess go only while the live servers stay at desired - max_unavailable
    floor = len(desired) - max(1, max_unavailable) if surge else 0
    serving = [len(live)]

    def safe_without(pod: ObservedPod) -> bool:
        return all(replicas[pair] >= 2 for pair in set(pod.experts))

    def remove(pod: ObservedPod) -> None:
        removed.add(pod.name)
        if pod.live:
            replicas.subtract(set(pod.experts))
            serving[0] -= 1

    # replace outdated servers first while excess ones still hold their experts, then shrink
    ordered = [
        p for p in sorted(candidates, key=lambda p: p.index) if not (p.live and p.name in held)
    ] + excess_live
    for pod in ordered:
        is_excess = pod.name not in desired
        if not pod.live:  # serves nothing: replacing it costs no availability, never wait on it
            plan.delete.append((pod.name, pod.uid, "outdated"))
            remove(pod)
            continue
        if not is_excess and budget <= 0:
            continue
        if is_excess and serving[0] <= floor:
            continue
        if not safe_without(pod):
            continue
        plan.delete.append((pod.name, pod.uid, "excess" if is_excess else "outdated"))
        remove(pod)
        if not is_excess:
            budget -= 1
    if ordered and unavailable == 0 and not any(n in removed for n in (p.name for p in ordered)):
        pod = ordered[0]
        plan.delete.append((pod.name, pod.uid, "excess" if pod.name not in desired else "outdated"))
        plan.forced = True
    return plan
