"""kopf declarations of the operator: each handler is a few lines calling a reconciler
(:mod:`eaas.operator.reconcile`).

Run with ``eaas operator`` or ``kopf run -m eaas.operator.handlers --all-namespaces``.

Shape (per object, kopf's layering):

* ``ExpertPool`` — a daemon per pool runs :func:`~eaas.operator.reconcile.pool.reconcile_pool`
  every ``resync_s`` seconds and whenever woken: by the pool's create/update/resume handlers
  (spec changes, e.g. ``kubectl scale``), by watch events of the pool's pods (readiness
  changes, deletions) and ConfigMaps, and by node readiness flips. One daemon per pool means
  reconciles of one pool never overlap.
* ``AttentionFleet`` — same pattern with :func:`~eaas.operator.reconcile.fleet.reconcile_fleet`;
  woken also when the pool it references publishes a routing table.

All in-memory state is one :class:`~eaas.operator.state.OperatorState` in kopf's root ``memo``
(shared by every object's memo); none of it is needed for correctness. kopf's own progress and
diff-base are stored in annotations (``eaas.io/…``), never in ``status`` (the structural schema
would prune them).
"""

from __future__ import annotations

from typing import Any

import kopf

from eaas.operator.crd import GROUP, LABEL_POOL, LABEL_ROLE, VERSION
from eaas.operator.kube import FLEETS, POOLS
from eaas.operator.names import SERVER_ROLE
from eaas.operator.pods import ObservedPod
from eaas.operator.reconcile import daemon
from eaas.operator.reconcile.fleet import reconcile_fleet
from eaas.operator.reconcile.pool import announce_spec, reconcile_pool
from eaas.operator.state import OperatorState


def _state(memo: Any) -> OperatorState:
    """The operator's state in kopf's memo (made by :func:`configure`)."""
    state = getattr(memo, "eaas", None)
    if state is None:
        state = memo.eaas = OperatorState.from_env()
    return state


def _namespace(namespace: str | None) -> str:
    """The namespace of a namespaced object's handler call.

    kopf types ``namespace`` as ``str | None`` (cluster-scoped objects have none); ExpertPools,
    AttentionFleets, pods and ConfigMaps are namespaced, so it is always set for them.

    Raises:
        kopf.PermanentError: ``namespace`` is None (a handler registered for a cluster-scoped
            resource by mistake).
    """
    if namespace is None:
        raise kopf.PermanentError("a namespaced resource's handler was called without a namespace")
    return namespace


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    """kopf's settings, the operator's state (settings read once from the environment) in the
    root ``memo``, and what runs beside the daemons (:func:`eaas.operator.reconcile.daemon.start`)."""
    state = memo.eaas = OperatorState.from_env()
    daemon.configure_kopf(settings, state)
    await daemon.start(state)


@kopf.on.cleanup()
async def release_lease(memo: Any, **_: Any) -> None:
    """On shutdown, free the Lease so a standby takes over at once; stop the listeners."""
    state = getattr(memo, "eaas", None)
    if state is not None:
        await daemon.stop(state)


@kopf.on.create(GROUP, VERSION, POOLS)
@kopf.on.update(GROUP, VERSION, POOLS, field="spec")
@kopf.on.resume(GROUP, VERSION, POOLS)
async def pool_spec_changed(
    body: kopf.Body, namespace: str | None, name: str, reason: str, memo: Any, **_: Any
) -> None:
    """Announce the placement inputs for the new spec (as an Event) and wake the pool's daemon."""
    announce_spec(body, reason, _state(memo))
    _state(memo).wake("pool", _namespace(namespace), name)


@kopf.daemon(GROUP, VERSION, POOLS, cancellation_timeout=5)
async def pool_daemon(
    namespace: str | None,
    name: str,
    stopped: kopf.DaemonStopped,
    logger: kopf.Logger,
    memo: Any,
    **kwargs: Any,
) -> None:
    """Reconcile the pool now, on every wakeup and every ``resync_s`` seconds. kopf passes the
    index of :func:`server_pods` as ``kwargs["server_pods"]``."""
    ns = _namespace(namespace)
    state = _state(memo)
    state.pod_index = kwargs.get("server_pods")  # the steps read their pods from it, no LIST
    await daemon.run_daemon(state, "pool", ns, name, stopped, reconcile_pool, logger)


@kopf.index("", "v1", "pods", labels={LABEL_POOL: kopf.PRESENT, LABEL_ROLE: SERVER_ROLE})
def server_pods(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[tuple[str, str], dict[str, Any]]:
    """Every expert-server pod by ``(namespace, pool)``, as the watch last delivered it (kopf
    keeps the index, drops deleted pods, and starts no daemon before its first LIST is in)."""
    return {(_namespace(namespace), labels[LABEL_POOL]): dict(body)}


@kopf.on.event("", "v1", "pods", labels={LABEL_POOL: kopf.PRESENT, LABEL_ROLE: SERVER_ROLE})
async def server_pod_event(
    namespace: str | None,
    name: str,
    labels: kopf.Labels,
    body: kopf.Body,
    type: str | None,
    memo: Any,
    **_: Any,
) -> None:
    """A change of an expert-server pod that the operator uses (readiness, IP, phase,
    restarts, labels and annotations, deletion: :class:`~eaas.operator.pods.ObservedPod`)
    wakes its pool; other updates of the pod cost nothing more. A pod deleted, terminating or
    finished is also noted for its pool's next step to drop from the table first
    (:meth:`~eaas.operator.state.OperatorState.note_death`)."""
    state, ns = _state(memo), _namespace(namespace)
    state.counters.add("eaas_operator_watch_events_total", resource="pods")
    observed = None if type == "DELETED" else ObservedPod.from_pod(body)
    if observed is None or observed.terminating or observed.finished:
        state.note_death(ns, labels[LABEL_POOL], name, str(body.get("metadata", {}).get("uid", "")))
    if state.note_pod(ns, name, observed):
        state.wake("pool", ns, labels[LABEL_POOL])


@kopf.on.event("", "v1", "configmaps", labels={LABEL_POOL: kopf.PRESENT})
async def pool_configmap_event(
    namespace: str | None,
    name: str,
    labels: kopf.Labels,
    meta: kopf.Meta,
    type: str | None,
    memo: Any,
    **_: Any,
) -> None:
    """A ConfigMap of a pool (its routing table: edited or deleted by hand; its expert load)
    changed: reconcile the pool now rather than at its next idle resync
    (:mod:`eaas.operator.resync`). The event of the operator's own table write wakes nothing."""
    state, ns, pool = _state(memo), _namespace(namespace), labels[LABEL_POOL]
    state.counters.add("eaas_operator_watch_events_total", resource="configmaps")
    version = str(meta.get("resourceVersion") or "")
    if state.note_configmap(ns, pool, name, version, deleted=type == "DELETED"):
        state.wake("pool", ns, pool)


@kopf.on.event("", "v1", "nodes")
async def node_event(
    name: str, status: kopf.Status, labels: kopf.Labels, type: str | None, memo: Any, **_: Any
) -> None:
    """Track node readiness. A node going NotReady (or Unknown: its kubelet stopped reporting)
    takes its expert servers out of the routing tables at once, long before their pods are
    evicted; every pool is woken when a node's readiness flips. A heartbeat (the same
    readiness) costs nothing more."""
    _state(memo).counters.add("eaas_operator_watch_events_total", resource="nodes")
    ready = type != "DELETED" and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (status.get("conditions") or [])
    )
    _state(memo).note_node(name, ready, None if type == "DELETED" else dict(labels))


@kopf.on.create(GROUP, VERSION, FLEETS)
@kopf.on.update(GROUP, VERSION, FLEETS, field="spec")
@kopf.on.resume(GROUP, VERSION, FLEETS)
async def fleet_spec_changed(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    """Wake the fleet's daemon on spec changes."""
    _state(memo).wake("fleet", _namespace(namespace), name)


@kopf.daemon(GROUP, VERSION, FLEETS, cancellation_timeout=5)
async def fleet_daemon(
    namespace: str | None,
    name: str,
    stopped: kopf.DaemonStopped,
    logger: kopf.Logger,
    memo: Any,
    **_: Any,
) -> None:
    """Reconcile the fleet now, on every wakeup and every ``resync_s`` seconds."""
    ns = _namespace(namespace)
    await daemon.run_daemon(_state(memo), "fleet", ns, name, stopped, reconcile_fleet, logger)
