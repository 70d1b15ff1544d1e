"""The ExpertPool reconciler: a pool's spec announced, one reconcile step of a pool whose experts
are on the servers' command lines (a ``routing-table`` pool goes on in
:mod:`eaas.operator.reconcile.table_pool`)."""

from __future__ import annotations

import time
from typing import Any

import kopf
from kubernetes import client as k8s
from pydantic import ValidationError

from eaas.operator.crd import ExpertPoolSpec
from eaas.operator.kube import (
    POOLS,
    get_live,
    now,
    raw,
    write_status,
)
from eaas.operator.names import Owner, selector_string, server_labels
from eaas.operator.overlay import OverlayError
from eaas.operator.pods import (
    ObservedPod,
    plan_pods,
    table_assignment,
)
from eaas.operator.pool_placement import placement_revision
from eaas.operator.reconcile.death import drop_dead_at_once
from eaas.operator.reconcile.drain import acted_spec
from eaas.operator.reconcile.fail_static import add_condition, hold_back
from eaas.operator.reconcile.load import placement_load, track_load
from eaas.operator.reconcile.steps import (
    apply_pod_plan,
    finish_status,
    read_pool_table,
    take_reports,
    write_table,
)
from eaas.operator.reconcile.table_pool import reconcile_table_pool
from eaas.operator.state import LIST_RESYNC_S, OperatorState, StalePodView
from eaas.operator.status import invalid_spec_status, pool_status
from eaas.operator.table import build_routing_table, next_routing_table
from eaas.runtime.placement import PlacementError, auto_slots
from eaas.runtime.tables.table import RoutingTable


def invalid_spec(spec: dict[str, Any]) -> str | None:
    """Why a pool's ``spec`` cannot be reconciled (its first line), or None when it parses and
    its redundancy fits its servers."""
    try:
        parsed = ExpertPoolSpec.model_validate(spec)
        if parsed.redundancy > parsed.replicas:
            raise PlacementError(
                f"redundancy ({parsed.redundancy}) cannot exceed the number of servers "
                f"({parsed.replicas})"
            )
    except (ValidationError, PlacementError) as exc:
        return str(exc).splitlines()[0]
    return None


def announce_spec(body: kopf.Body, reason: str, state: OperatorState) -> None:
    """Post the placement inputs of a new pool spec as an Event (``PlacementComputed``), or why
    it is invalid (``InvalidSpec``); the leader only. The placement itself is computed by the
    pool's daemon, incrementally from the pods."""
    if not state.is_leader():
        return
    problem = invalid_spec(dict(body["spec"]))
    if problem is not None:
        kopf.warn(body, reason="InvalidSpec", message=problem)
        return
    if reason == "resume":
        return
    spec = ExpertPoolSpec.model_validate(dict(body["spec"]))
    slots = max(
        spec.placement.slots_per_server,
        auto_slots(spec.model.num_experts, spec.redundancy, spec.replicas),
    )
    kopf.info(
        body,
        reason="PlacementComputed",
        message=f"revision {placement_revision(spec)}: {spec.replicas} servers, redundancy "
        f"{spec.redundancy}, >= {slots} experts per server per layer "
        f"({spec.placement.policy}, incremental)",
    )


def reconcile_pool(state: OperatorState, namespace: str, name: str, logger: kopf.Logger) -> None:
    """One reconcile step of ExpertPool ``namespace/name``.

    Reads the pool, its pods (from the pod watch's index; a step that would then write pods
    starts again with a LIST: :class:`~eaas.operator.state.StalePodView`) and its
    routing-table ConfigMap; creates/deletes/relabels pods as :func:`plan_pods` decides;
    publishes a new routing table when the live set changed; writes the status when it
    changed. Pools with ``spec.placement.assignment: routing-table`` go to
    :func:`eaas.operator.reconcile.table_pool.reconcile_table_pool`.

    A server the pod watch saw die leaves the published table first, before anything is read
    (:func:`eaas.operator.reconcile.death.drop_dead_at_once`).

    Raises:
        ApiException: any API error but 404/409 on create/delete (the daemon logs and retries).
    """
    drop_dead_at_once(state, k8s.CoreV1Api(state.api()), namespace, name, logger)
    try:
        _reconcile_pool(state, namespace, name, logger, from_index=True)
    except StalePodView:
        _reconcile_pool(state, namespace, name, logger, from_index=False)


def pool_pods(
    state: OperatorState, core: k8s.CoreV1Api, namespace: str, name: str, from_index: bool
) -> list[dict[str, Any]]:
    """The pool's server pods: from the pod watch's index when ``from_index``, there is one
    (:meth:`OperatorState.server_pods`) and the last LIST is under
    :data:`~eaas.operator.state.LIST_RESYNC_S` old, else a LIST by label. Sets the pool's
    ``pods_from_index``.

    Raises:
        ApiException: the LIST failed.
    """
    memory = state.pool(namespace, name)
    fresh = time.monotonic() - memory.listed_at < LIST_RESYNC_S
    pods = state.server_pods(namespace, name) if from_index and fresh else None
    memory.pods_from_index = pods is not None
    if pods is None:
        memory.listed_at = time.monotonic()
        state.counters.add("eaas_operator_pod_lists_total")
        pods = raw(
            core.list_namespaced_pod, namespace, label_selector=selector_string(server_labels(name))
        )["items"]
    return pods


def _reconcile_pool(
    state: OperatorState, namespace: str, name: str, logger: kopf.Logger, from_index: bool
) -> None:
    """:func:`reconcile_pool`, its pods read as :func:`pool_pods` says.

    Raises:
        StalePodView: the pods came from the index and the plan writes pods.
        ApiException: as :func:`reconcile_pool`.
    """
    custom = k8s.CustomObjectsApi(state.api())
    core = k8s.CoreV1Api(state.api())
    body = get_live(custom, namespace, POOLS, name)
    if body is None:
        return
    owner = Owner.from_body(body)
    memory = state.pool(namespace, name)
    memory.owner = owner
    old_status = body.get("status") or {}
    old_conditions = old_status.get("conditions") or []
    pods = pool_pods(state, core, namespace, name, from_index)
    observed = state.observe(namespace, name, pods)
    # a same-named older pool's pods: the garbage collector's job
    observed = [p for p in observed if p.owner_uid == owner.uid]
    try:
        spec = ExpertPoolSpec.model_validate(body["spec"])
        memory.load_driven = (
            spec.autoscaling is not None or spec.placement.policy == "load-balanced"
        )
        track_load(state, namespace, name, pods, observed)
        memory.drops_at_once = not table_assignment(spec)
        if table_assignment(spec):
            reconcile_table_pool(state, core, custom, body, owner, spec, observed, pods, logger)
            return
        acted = acted_spec(state, memory, spec)  # a new spec.replicas once it settled
        down = take_reports(state, body, pods, logger)
        live = [p for p in observed if p.live and p.name not in down]
        _, previous, _ = read_pool_table(state, core, owner, logger)
        # fail static: servers the API only says are unavailable stay unless the probe confirms
        live, held = hold_back(state, body, acted, observed, live, previous, down, logger)
        drop_dead_servers(state, core, body, owner, acted, live, old_status, logger)
        load = placement_load(state, core, body, acted, logger)
        placement = state.placement(acted, observed, load)
        revision = placement_revision(acted)
        desired = state.desired_pods(owner, acted, placement, revision)
    except (ValidationError, PlacementError, OverlayError) as exc:
        status = invalid_spec_status(
            owner, str(exc).splitlines()[0], old_conditions, now(), old_status
        )
        write_status(custom, namespace, name, old_status, status)
        return
    plan = plan_pods(desired, observed, max_unavailable=max(1, spec.redundancy - 1))
    deleted = {n for n, _, _ in plan.delete}
    live = [p for p in live if p.name not in deleted]
    # the table before the pod writes: a pod the plan deletes leaves it before it goes
    table, table_error = publish_table(state, core, body, owner, acted, live, old_status, logger)
    apply_pod_plan(state, core, body, plan, logger)

    status = pool_status(
        owner=owner,
        spec=spec,
        placement=placement,
        revision=revision,
        observed=observed,
        plan=plan,
        table=table,
        old_conditions=old_conditions,
        now=now(),
        table_error=table_error,
        node_domains=state.node_domains(spec.placement.topology_key),
    )
    add_condition(status, held, old_conditions, now(), owner.generation)
    finish_status(state, custom, body, owner, spec, old_status, status, table.version, logger)


def drop_dead_servers(
    state: OperatorState,
    core: k8s.CoreV1Api,
    body: dict[str, Any],
    owner: Owner,
    spec: ExpertPoolSpec,
    live: list[ObservedPod],
    old_status: dict[str, Any],
    logger: kopf.Logger,
) -> None:
    """Publish at once a table without the servers of the published one that are no longer
    ``live`` (dead, deleted, on a NotReady node, confirmed down), before the step computes a
    placement and replaces them (a load-balanced placement of a large pool takes seconds).

    Raises:
        ApiException: as :func:`write_table`.
    """
    _, previous, _ = read_pool_table(state, core, owner, logger)
    if previous is not None and not set(previous.servers) <= {p.name for p in live}:
        publish_table(state, core, body, owner, spec, live, old_status, logger)


def publish_table(
    state: OperatorState,
    core: k8s.CoreV1Api,
    body: dict[str, Any],
    owner: Owner,
    spec: ExpertPoolSpec,
    live: list[ObservedPod],
    old_status: dict[str, Any],
    logger: kopf.Logger,
) -> tuple[RoutingTable, str]:
    """Create or update the routing-table ConfigMap if the live set changed. Returns the table
    in force and, when the new table cannot be stored (too large), why (a Warning event says it
    too; the previous table stays in force).

    Raises:
        ApiException: as :func:`write_table`.
    """
    cm, previous, annotated = read_pool_table(state, core, owner, logger)
    floor = max(int(old_status.get("routingTableVersion") or 0), annotated)
    key = ("table", spec.model_dump_json(), tuple((p.index, p.name, p.ip, p.experts) for p in live))
    candidate = state.memoized(key, lambda: build_routing_table(spec, live, 0))
    table, changed = next_routing_table(spec, live, previous, floor, candidate=candidate)
    if not changed and cm is not None:
        return table, ""
    return write_table(state, core, body, owner, table, cm, previous)
