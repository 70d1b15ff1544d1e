"""One reconcile step of an ExpertPool with ``spec.placement.assignment: routing-table``:
make-before-break publishing of the routing table.

1. Pods (:func:`_plan_pods`): ``spec.replicas`` identical-but-for-the-index servers (no experts
   in their spec), so a new assignment never replaces a pod; a new ``spec.replicas`` is acted on
   once it settled (:mod:`eaas.operator.drain`). A live excess or outdated pod is deleted only
   when no client can still use it and it drained: absent from the published and the pending
   table, every client acknowledged the published one, and the server reports no frame for a
   quiet period (:mod:`eaas.operator.reconcile.drain`).
2. Candidate (:func:`_candidate`): the servers fail static holds count as live
   (:mod:`eaas.operator.reconcile.fail_static`); a server that died (or changed IP) first
   leaves the published table at once (a table that only takes experts away needs no loading)
   unless that uncovers an expert (then its experts are re-placed first); otherwise the
   placement over the live members is computed from the table in force
   (:func:`member_placement`; load rebalancing when :func:`rebalance_due`).
3. :func:`two_phase_step` decides (:func:`_two_phase`): stage (push to servers, wait for their
   ``weights_version``), publish (ConfigMap + client pushes), release (servers drop experts only
   older versions used).
4. The pod plan of step 1 is applied last: a server that died leaves the published table
   before the step LISTs the pods to create its replacement (a step that read the pod index
   and plans pod writes starts again with a LIST: :class:`~eaas.operator.state.StalePodView`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import kopf
from kubernetes import client as k8s

from eaas.operator.crd import ANNOTATION_SPEC_HASH, ExpertPoolSpec
from eaas.operator.kube import ensure_token_secret, event, now, seconds_since
from eaas.operator.names import Owner
from eaas.operator.pods import (
    ObservedPod,
    PodPlan,
    desired_table_pods,
    plan_pods,
    server_endpoint,
    server_push_secret,
    server_push_secret_name,
    table_members,
)
from eaas.operator.pool_placement import (
    member_placement,
    placement_revision,
    rebalance_due,
    table_placement,
)
from eaas.operator.reconcile.drain import acted_spec, hold_undrained, replacements
from eaas.operator.reconcile.fail_static import add_condition, hold_back
from eaas.operator.reconcile.load import placement_load
from eaas.operator.reconcile.steps import (
    apply_pod_plan,
    finish_status,
    read_pool_table,
    take_reports,
    write_table,
)
from eaas.operator.server_push import (
    ServerTableState,
    get_server_state,
    put_server_table,
    release_server,
)
from eaas.operator.state import OperatorState, PoolMemory
from eaas.operator.status import pool_status
from eaas.operator.table import assignment_of, table_from_assignment, two_phase_step
from eaas.runtime.tables.table import RoutingTable


@dataclass
class _Step:
    """What every part of one step reads: the pool, its memory and its API clients."""

    state: OperatorState
    core: k8s.CoreV1Api
    body: dict[str, Any]
    owner: Owner
    spec: ExpertPoolSpec
    memory: PoolMemory
    logger: kopf.Logger
    client_acks: list[int]


def reconcile_table_pool(
    state: OperatorState,
    core: k8s.CoreV1Api,
    custom: k8s.CustomObjectsApi,
    body: dict[str, Any],
    owner: Owner,
    spec: ExpertPoolSpec,
    observed: list[ObservedPod],
    pods: list[dict[str, Any]],
    logger: kopf.Logger,
) -> None:
    """One reconcile step of a ``routing-table`` pool (module docstring: pods, candidate,
    two-phase step), then its status.

    Raises:
        ApiException: as :func:`eaas.operator.reconcile.pool.reconcile_pool`.
    """
    memory = state.pool(owner.namespace, owner.name)
    wanted = spec  # the status judges against spec.replicas; the step acts on a settled count
    spec = acted_spec(state, memory, spec)
    s = _Step(state, core, body, owner, spec, memory, logger, memory.client_acks())
    old_status = body.get("status") or {}
    token = ensure_token_secret(
        core, state.tokens, owner, server_push_secret_name(owner.name), server_push_secret
    )
    cm, published, annotated = read_pool_table(state, core, owner, logger)
    floor = max(
        annotated,
        int(old_status.get("routingTableVersion") or 0),
        int(old_status.get("stagedRoutingTableVersion") or 0),
    )
    down = take_reports(state, body, pods, logger)
    live = sorted(
        (p for p in observed if p.live and p.name not in down), key=lambda p: (p.index, p.name)
    )
    plan, observed_t, held, leaving = _plan_pods(s, observed, published)
    deleted = {n for n, _, _ in plan.delete}
    live = [p for p in live if p.name not in deleted]
    live, fs = hold_back(state, body, spec, observed, live, published, down | deleted, logger)
    candidate, rebalanced = _candidate(s, live, published, held, old_status, leaving)
    table, table_error = _two_phase(s, live, token, candidate, published, cm, floor, rebalanced)
    # the pod writes after the table: a dead server leaves it before its replacement's LIST
    apply_pod_plan(state, core, body, plan, logger)
    table = table or candidate  # nothing published yet: status counts what is being staged
    status = _status(
        dataclasses.replace(s, spec=wanted), live, observed_t, plan, table, table_error, old_status
    )
    add_condition(status, fs, old_status.get("conditions") or [], now(), owner.generation)
    finish_status(
        state, custom, body, owner, spec, old_status, status, table.version, logger, s.client_acks
    )


def _pending(memory: PoolMemory, published: RoutingTable | None) -> RoutingTable | None:
    """The staged table when it is newer than the published one (else None)."""
    staged = memory.staged
    pub_v = published.version if published else 0
    return staged if staged is not None and staged.version > pub_v else None


def _plan_pods(
    s: _Step, observed: list[ObservedPod], published: RoutingTable | None
) -> tuple[PodPlan, list[ObservedPod], dict[str, Any], set[str]]:
    """Step 1: the pod plan (applied after the table: :func:`reconcile_table_pool`). Pods
    carry the experts the published table gives them (:func:`plan_pods`' coverage checks); those a client may still use, and leaving ones not
    drained yet (:func:`hold_undrained`), are held. Returns the plan, the observed pods with
    their experts, the published assignment and the outdated live servers leaving the table to
    be replaced (:func:`replacements`)."""
    held = assignment_of(published)
    observed_t = [
        dataclasses.replace(p, experts=tuple(sorted(held.get(p.name, ())))) for p in observed
    ]
    pending = _pending(s.memory, published)
    in_use: set[str] = set(published.servers) if published else set()
    if pending is not None:
        in_use |= set(pending.servers)
    client_acks = s.client_acks
    if client_acks and min(client_acks) < (published.version if published else 0):
        in_use |= {p.name for p in observed}  # some client is on an older table: hold all
    revision = placement_revision(s.spec)
    desired = s.state.memoized(  # the same manifests whatever the placement: build them once
        ("table-pods", s.owner, s.spec.model_dump_json(), revision),
        lambda: desired_table_pods(s.owner, s.spec, revision),
    )
    hashes = {n: m["metadata"]["annotations"][ANNOTATION_SPEC_HASH] for n, m in desired.items()}
    leaving = replacements(s.memory, observed_t, hashes, s.spec.redundancy)
    held_pods = hold_undrained(
        s.state, s.body, s.memory, observed_t, hashes, in_use, s.spec.health_port, s.logger
    )
    plan = plan_pods(
        desired,
        observed_t,
        max_unavailable=max(1, s.spec.redundancy - 1),
        in_use=in_use | held_pods,
        surge=False,  # a leaving server left the table first: it serves nothing
    )
    return plan, observed_t, held, leaving


def _candidate(
    s: _Step,
    live: list[ObservedPod],
    published: RoutingTable | None,
    held: dict[str, Any],
    old_status: dict[str, Any],
    leaving: set[str],
) -> tuple[RoutingTable, bool]:
    """Step 2: the candidate table and whether it is a load rebalance. A server of the published
    table that left (or changed address) is removed at once, nothing else changing, unless
    that alone would leave an expert without a replica: then its experts are re-placed onto
    the live members first (make-before-break: staged, confirmed, then published). ``leaving``
    servers (live, to be replaced) are left out of the placement (their experts re-placed on
    the others, make-before-break)."""
    endpoints = {p.name: server_endpoint(s.spec, p.index, p.ip) for p in live}
    if published is not None and any(endpoints.get(n) != ep for n, ep in published.servers.items()):
        survivors = {n: ep for n, ep in published.servers.items() if endpoints.get(n) == ep}
        drop_only = table_from_assignment(s.spec, held, survivors, 0)
        if len(drop_only.uncovered()) <= len(published.uncovered()):
            return drop_only, False
    # in an NVSHMEM world spares stand in for the missing
    members = table_members(s.spec, [p for p in live if p.name not in leaving])
    in_force = _pending(s.memory, published) or published
    load = placement_load(s.state, s.core, s.body, s.spec, s.logger)
    since = seconds_since(old_status.get("lastRebalanceTime") or "")
    due, imbalance = rebalance_due(s.spec, table_placement(s.spec, members, in_force), load, since)
    topology_key = s.spec.placement.topology_key
    domains = [
        s.state.node_labels.get(p.node, {}).get(topology_key) or p.node or p.name
        for p in live
        if p.name in members
    ]
    memo_key = (
        "table",
        s.spec.model_dump_json(include={"model", "replicas", "redundancy", "placement"}),
        tuple(members),
        tuple(domains),
        in_force.version if in_force else 0,
        tuple(sorted(load.items())) if (due and load) else None,
    )
    assignment = s.state.memoized(
        memo_key, lambda: member_placement(s.spec, members, in_force, load, due, domains)
    )
    if due:
        o = s.owner
        s.logger.info("pool %s/%s: imbalance %.3f: rebalancing", o.namespace, o.name, imbalance)
    return table_from_assignment(s.spec, assignment, {m: endpoints[m] for m in members}, 0), due


def _two_phase(
    s: _Step,
    live: list[ObservedPod],
    token: str,
    candidate: RoutingTable,
    published: RoutingTable | None,
    cm: dict[str, Any] | None,
    floor: int,
    rebalanced: bool,
) -> tuple[RoutingTable | None, str]:
    """Step 3: stage, confirm, publish, release. Returns the table in force (None: nothing
    published yet) and why a new one could not be stored ("" : it could)."""
    memory, client_acks = s.memory, s.client_acks
    confirmed_now = {
        p.name: st.weights_version
        for p in live
        if (st := memory.server_tables.get((p.uid, p.restarts))) is not None
    }
    step = two_phase_step(candidate, published, memory.staged, confirmed_now, client_acks, floor)
    if step.abandoned and memory.staged is not None:
        version, memory.staged = memory.staged.version, None
        event(
            s.body,
            "StagedTableAbandoned",
            f"routing table version {version} given up: one of its servers left",
            warning=True,
        )
    if step.stage is not None:
        memory.staged = step.stage
        event(
            s.body,
            "RoutingTableStaged",
            f"routing table version {step.stage.version} sent to {len(step.stage.servers)} "
            f"servers first: {step.reason}",
        )
        if rebalanced:
            memory.last_rebalance = now()
    target = memory.staged
    if target is None or (published is not None and target.version <= published.version):
        target = published
    if step.publish is None:
        confirmed = sync_servers(s, live, token, target, step.release)
        if target is not None and target is not published:  # staged: confirmed by now?
            again = two_phase_step(
                candidate, published, memory.staged, confirmed, client_acks, floor
            )
            if again.publish is not None and again.publish.version == target.version:
                step = again
    if step.publish is None:
        return published, ""
    table, table_error = write_table(s.state, s.core, s.body, s.owner, step.publish, cm, published)
    if not table_error:
        memory.staged = None
        sync_servers(s, live, token, step.publish, step.release)
    return table, table_error


def _status(
    s: _Step,
    live: list[ObservedPod],
    observed_t: list[ObservedPod],
    plan: PodPlan,
    table: RoutingTable,
    table_error: str,
    old_status: dict[str, Any],
) -> dict[str, Any]:
    """The pool's status for this step: :func:`pool_status` of the table in force, plus the
    staged version, the servers that confirmed the newest table's weights and the time of the
    last rebalance."""
    memory = s.memory
    status = pool_status(
        owner=s.owner,
        spec=s.spec,
        placement=table_placement(s.spec, [p.name for p in live], table),
        revision=placement_revision(s.spec),
        observed=observed_t,
        plan=plan,
        table=table,
        old_conditions=old_status.get("conditions") or [],
        now=now(),
        table_error=table_error,
        node_domains=s.state.node_domains(s.spec.placement.topology_key),
    )
    newest = memory.staged or table
    status["stagedRoutingTableVersion"] = memory.staged.version if memory.staged else 0
    status["serversConfirmed"] = sum(
        1
        for p in live
        if p.name in newest.servers
        and (st := memory.server_tables.get((p.uid, p.restarts))) is not None
        and st.weights_version >= newest.version
    )
    last = memory.last_rebalance or old_status.get("lastRebalanceTime") or ""
    if last:
        status["lastRebalanceTime"] = last
    return status


def sync_servers(
    s: _Step,
    pods: list[ObservedPod],
    token: str,
    target: RoutingTable | None,
    release: int,
) -> dict[str, int]:
    """Bring the live servers up to ``target`` (PUT it to those whose assigned version is
    older), raise their released version to ``release``, and poll those still loading.
    Answers are remembered per (pod uid, restarts): a restarted process is asked again.
    Returns server name -> confirmed ``weights_version``."""
    known = s.memory.server_tables
    alive = {(p.uid, p.restarts) for p in pods}
    for k in set(known) - alive:
        del known[k]
    table_json = target.to_wire() if target is not None else ""

    def one(pod: ObservedPod) -> tuple[ObservedPod, ServerTableState | None, str]:
        st = known.get((pod.uid, pod.restarts))
        url = f"http://{pod.ip}:{s.spec.health_port}"
        try:
            if (
                target is not None
                and pod.name in target.servers
                and (st is None or st.assigned_version < target.version)
            ):
                st = put_server_table(url, table_json, token)
                if st.status not in (202, 409):
                    return pod, None, f"push answered {st.status}: {st.message}"
            elif st is None or (target is not None and st.weights_version < st.assigned_version):
                st = get_server_state(url)
            if release and st is not None and st.released_version < release:
                st = release_server(url, release, token)
        except OSError as exc:
            return pod, None, f"{type(exc).__name__}: {exc}"
        return pod, st, ""

    confirmed: dict[str, int] = {}
    for pod, st, why in s.state.executor().map(one, pods):
        if st is None:
            s.logger.info("expert server %s: table sync failed: %s", pod.name, why)
            old = known.get((pod.uid, pod.restarts))
            if old is not None:
                confirmed[pod.name] = old.weights_version
            continue
        known[(pod.uid, pod.restarts)] = st
        confirmed[pod.name] = st.weights_version
    return confirmed
