"""Steps every ExpertPool reconcile shares: the pod plan applied, failure-confirmed servers
left out, the routing table written and handed to the fleets that use the pool, the status
written with its Events."""

from __future__ import annotations

import time
from typing import Any

import kopf
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from eaas.operator.crd import LABEL_PLACEMENT_REVISION, ExpertPoolSpec
from eaas.operator.fleet import ack_summary
from eaas.operator.kube import (
    event,
    parse_table,
    read_table_cm,
    table_version_of,
    write_status,
    write_table_cm,
)
from eaas.operator.monitor import health_url, probe_health
from eaas.operator.names import Owner
from eaas.operator.pods import PodPlan
from eaas.operator.reconcile.load import ensure_hpa, load_status
from eaas.operator.reconcile.network_policy import ensure_network_policy
from eaas.operator.state import OperatorState, PublishedTable, StalePodView
from eaas.operator.table import configmap_too_large, routing_table_configmap
from eaas.runtime.tables.table import RoutingTable
from eaas.runtime.tables.watch import TABLE_KEY
from eaas.runtime.tables.wire import RoutingTableError

#: A server confirmed down is re-probed (to bring it back) only after this many seconds (s).
SUSPECT_REPROBE_S = 3.0


def finish_status(
    state: OperatorState,
    custom: k8s.CustomObjectsApi,
    body: dict[str, Any],
    owner: Owner,
    spec: ExpertPoolSpec,
    old_status: dict[str, Any],
    status: dict[str, Any],
    table_version: int,
    logger: kopf.Logger,
    client_acks: list[int] | None = None,
) -> None:
    """The last part of every pool step: the clients' acknowledgements and the measured load
    into ``status``, the HPA ensured, ``status`` written if it changed, and PoolReady /
    ExpertsUncovered posted on transitions. ``client_acks``: the clients' acknowledgements as
    the step saw them (default: as they are now).

    Raises:
        ApiException: as the writes.
    """
    if client_acks is None:
        client_acks = state.pool(owner.namespace, owner.name).client_acks()
    status.update(clients=len(client_acks), **ack_summary(client_acks, table_version))
    status.update(load_status(state, owner.namespace, owner.name))
    ensure_hpa(state, body, owner, spec, logger)
    ensure_network_policy(state, owner, spec, logger)
    old_conditions = old_status.get("conditions") or []
    if not write_status(custom, owner.namespace, owner.name, old_status, status):
        return
    was = {c.get("type"): c.get("status") for c in old_conditions}
    conditions = {c["type"]: c for c in status["conditions"]}
    if was.get("Ready") != "True" and conditions["Ready"]["status"] == "True":
        event(body, "PoolReady", conditions["Ready"]["message"])
    was_reason = {c.get("type"): c.get("reason") for c in old_conditions}.get("Degraded")
    if (
        was_reason not in (None, "ExpertsUncovered")
        and conditions["Degraded"]["reason"] == "ExpertsUncovered"
    ):
        event(body, "ExpertsUncovered", conditions["Degraded"]["message"], warning=True)


def apply_pod_plan(
    state: OperatorState,
    core: k8s.CoreV1Api,
    body: dict[str, Any],
    plan: PodPlan,
    logger: kopf.Logger,
) -> None:
    """Create, delete and relabel expert-server pods as ``plan`` says (Events for each kind).

    Raises:
        StalePodView: the step read its pods from the watch's index and the plan writes pods
            (the step starts again with a LIST).
        ApiException: any API error but 409 on create and 404/409 on delete.
    """
    namespace = body["metadata"]["namespace"]
    if (plan.create or plan.delete or plan.relabel) and state.pool(
        namespace, body["metadata"]["name"]
    ).pods_from_index:
        raise StalePodView(f"pod writes planned for {namespace}/{body['metadata']['name']}")

    def create(manifest: dict[str, Any]) -> None:
        try:
            # the client's validate_call would turn the dict into a V1Pod the same way
            core.create_namespaced_pod(namespace, k8s.V1Pod.model_validate(manifest))
            logger.info("created expert server %s", manifest["metadata"]["name"])
        except ApiException as exc:
            if exc.status != 409:  # 409: made by an earlier (killed) run
                raise

    # list() re-raises the first failure; the others were attempted anyway
    list(state.executor().map(create, plan.create))
    if plan.create:
        names = ", ".join(m["metadata"]["name"] for m in plan.create)
        event(body, "ServersCreated", f"created {names}")
    for pod_name, uid, why in plan.delete:
        try:
            core.delete_namespaced_pod(
                pod_name,
                namespace,
                body=k8s.V1DeleteOptions(preconditions=k8s.V1Preconditions(uid=uid)),
            )
            logger.info("deleted expert server %s (%s)", pod_name, why)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
    if plan.delete:
        msg = "deleted " + ", ".join(f"{n} ({why})" for n, _, why in plan.delete)
        if plan.forced:
            msg += (
                "; forced: some experts lose their last live replica until replacements are Ready"
            )
        warning = plan.forced or any(w == "failed" for _, _, w in plan.delete)
        event(body, "ServersDeleted", msg, warning=warning)
    for pod_name, rev in plan.relabel:
        try:
            core.patch_namespaced_pod(
                pod_name, namespace, {"metadata": {"labels": {LABEL_PLACEMENT_REVISION: rev}}}
            )
        except ApiException as exc:
            if exc.status != 404:
                raise


def take_reports(
    state: OperatorState, body: dict[str, Any], pods: list[dict[str, Any]], logger: kopf.Logger
) -> set[str]:
    """Post the pool's confirmed failure reports as ``ServerUnreachable`` Warning events and
    return the servers still confirmed down (:func:`confirmed_down`)."""
    meta = body["metadata"]
    memory = state.pool(meta["namespace"], meta["name"])
    reported, memory.reported = memory.reported, []
    for message in reported:
        event(body, "ServerUnreachable", message, warning=True)
    return confirmed_down(state, meta["namespace"], meta["name"], pods, logger)


def confirmed_down(
    state: OperatorState,
    namespace: str,
    pool: str,
    pods: list[dict[str, Any]],
    logger: kopf.Logger,
) -> set[str]:
    """Names of the pool's pods that a client reported and the operator's probe confirmed down,
    re-probed now: a pod whose ``/health`` answers again, or that was replaced (new uid) or is
    gone, is forgotten."""
    suspects = state.pool(namespace, pool).suspects
    if not suspects:
        return set()
    by_name = {p["metadata"]["name"]: p for p in pods}
    for pod_name, (uid, confirmed_at) in list(suspects.items()):
        pod = by_name.get(pod_name)
        if pod is None or pod["metadata"].get("uid") != uid:
            del suspects[pod_name]
            continue
        if time.monotonic() - confirmed_at < SUSPECT_REPROBE_S:
            continue  # just confirmed: publish the table without it first
        url = health_url(pod)
        if url is not None and probe_health(url):
            logger.info("reported server %s answers its probe again: back in the table", pod_name)
            del suspects[pod_name]
    return set(suspects)


def write_table(
    state: OperatorState,
    core: k8s.CoreV1Api,
    body: dict[str, Any],
    owner: Owner,
    table: RoutingTable,
    cm: dict[str, Any] | None,
    previous: RoutingTable | None,
) -> tuple[RoutingTable, str]:
    """Write ``table`` into the pool's ConfigMap (create or optimistic replace), hand it to the
    fleets that use the pool and wake them to push it, post RoutingTablePublished. Returns the
    table in force and, when it cannot be stored (too large), why (the previous table stays in
    force).

    Raises:
        ApiException: any API error (409: the ConfigMap changed meanwhile; next step retries).
    """
    manifest = routing_table_configmap(owner, table)
    too_large = configmap_too_large(manifest)
    if too_large:
        event(body, "RoutingTableTooLarge", too_large, warning=True)
        return (previous or table), too_large
    written = write_table_cm(core, state.tables, manifest, table, cm)
    state.counters.add("eaas_operator_table_writes_total")
    state.pool(owner.namespace, owner.name).table_cm = written
    state.pool(owner.namespace, owner.name).published = PublishedTable(
        resource_version=written["metadata"]["resourceVersion"],
        version=table.version,
        wire=manifest["data"][TABLE_KEY],
    )
    state.wake_fleets_of(owner.namespace, owner.name)  # push the new version to the clients now
    event(
        body,
        "RoutingTablePublished",
        f"routing table version {table.version}: {len(table.servers)} live servers, "
        f"{len(table.uncovered())} uncovered experts",
    )
    return table, ""


def read_pool_table(
    state: OperatorState, core: k8s.CoreV1Api, owner: Owner, logger: kopf.Logger
) -> tuple[dict[str, Any] | None, RoutingTable | None, int]:
    """:func:`eaas.operator.kube.read_table_cm` of the pool, and the ConfigMap as read handed to
    the fleets that use the pool (they are woken when it differs from what they were handed:
    the ConfigMap was written by someone else).

    No GET while the ConfigMap is as this operator last wrote or read it (the ConfigMap watch
    drops :attr:`PoolMemory.published` on any other change: :meth:`OperatorState.note_configmap`);
    a change the watch has not delivered yet makes the next write fail with 409 (optimistic
    concurrency), and the step after it reads the ConfigMap again."""
    memory = state.pool(owner.namespace, owner.name)
    held = memory.table_cm
    if (
        memory.published is not None
        and held is not None
        and held["metadata"]["resourceVersion"] == memory.published.resource_version
    ):
        try:
            return held, parse_table(state.tables, owner.namespace, held), table_version_of(held)
        except RoutingTableError:
            pass  # cannot be (this operator wrote it): read it again
    cm, table, annotated = read_table_cm(core, state.tables, owner, logger)
    memory.table_cm = cm
    if cm is None or table is None:
        memory.published = None
        return cm, table, annotated
    seen = PublishedTable(
        resource_version=cm["metadata"]["resourceVersion"],
        version=table_version_of(cm),
        wire=(cm.get("data") or {}).get(TABLE_KEY, ""),
    )
    if memory.published is not None and memory.published != seen:
        state.wake_fleets_of(owner.namespace, owner.name)
    memory.published = seen
    return cm, table, annotated
