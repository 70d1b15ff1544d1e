"""ExpertPool status and conditions (pure)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from eaas.operator.crd import (
    Condition,
    ConditionStatus,
    ExpertPoolSpec,
    ExpertPoolStatus,
    PlacementSummary,
)
from eaas.operator.names import Owner, selector_string, server_labels, server_name
from eaas.operator.pods import ObservedPod, PodPlan
from eaas.operator.pool_placement import unspread_experts
from eaas.operator.table import coverage
from eaas.runtime.placement import Placement
from eaas.runtime.tables.table import RoutingTable


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
    table_error: str = "",
    node_domains: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The pool's ``status`` (camelCase dict) after one reconcile step.

    ``table_error``: why the newest routing table could not be stored (e.g. too large), if so.
    ``node_domains``: node name -> failure domain (its ``spec.placement.topologyKey`` label).

    Conditions:

    * ``Ready``: True iff ``spec.replicas`` up-to-date servers are live, no server beyond
      ``spec.replicas`` is left (a scale-down is done), and every logical expert has
      ``redundancy`` live replicas in the published table.
    * ``Progressing``: True while pods are created, replaced, removed or not yet Ready
      (reasons ScalingUp, ScalingDown, RePlacing, WaitingForServers); False/Reconciled when done.
    * ``Degraded``: True if some expert has no live replica (ExpertsUncovered), the routing table
      cannot be stored (RoutingTableTooLarge), fewer than ``redundancy`` (BelowRedundancy), or a
      server pod failed (ServerFailed).
    * ``ReplicasSpread``: True when every expert's live replicas span ``redundancy`` failure
      domains (values of ``spec.placement.topologyKey``; a domain failing leaves every expert a
      replica); False with TooFewDomains or SharedDomain.
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
    # servers beyond spec.replicas (a scale-down not acted on yet: the new count settles first,
    # or leaving servers draining) keep the pool from Ready, as ScalingDown
    beyond = [p for p in existing if p.name not in desired_names]
    all_ready = len(ready) == spec.replicas and below == 0 and not plan.excess and not beyond
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
            message=f"{len(ready)}/{spec.replicas} expert servers ready and up to date"
            + (f"; {len(beyond)} beyond spec.replicas still to leave" if beyond else ""),
            observed_generation=gen,
        )

    prog: tuple[ConditionStatus, str, str]  # (status, reason, message)
    if missing > 0:
        prog = ("True", "ScalingUp", f"creating {missing} expert server(s)")
    elif plan.excess or beyond:
        leaving = max(len(plan.excess), len(beyond))
        prog = ("True", "ScalingDown", f"removing {leaving} expert server(s)")
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

    deg: tuple[ConditionStatus, str, str]  # (status, reason, message)
    if uncovered:
        deg = (
            "True",
            "ExpertsUncovered",
            f"{uncovered}/{total} logical experts have no live replica",
        )
    elif table_error:
        deg = ("True", "RoutingTableTooLarge", table_error)
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

    unspread, nodes = unspread_experts(
        [p for p in existing if p.live], spec.redundancy, node_domains
    )
    key = spec.placement.topology_key
    spread: tuple[ConditionStatus, str, str]  # (status, reason, message)
    if nodes and nodes < spec.redundancy:
        spread = (
            "False",
            "TooFewDomains",
            f"live expert servers span {nodes} value(s) of {key}: one domain failing can take "
            f"every replica of an expert (redundancy {spec.redundancy} needs {spec.redundancy})",
        )
    elif unspread:
        spread = (
            "False",
            "SharedDomain",
            f"{unspread}/{total} logical experts have all live replicas in fewer than "
            f"{spec.redundancy} values of {key}",
        )
    else:
        spread = (
            "True",
            "DistinctDomains",
            f"every logical expert's live replicas span >= {min(spec.redundancy, nodes)} "
            f"values of {key}",
        )
    spread_c = Condition(
        type="ReplicasSpread",
        status=spread[0],
        reason=spread[1],
        message=spread[2],
        observed_generation=gen,
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
    status["conditions"] = [
        set_condition(old_conditions, c, now) for c in (ready_c, prog_c, deg_c, spread_c)
    ]
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
    # every condition says InvalidSpec; only Degraded is True
    kinds: tuple[tuple[str, ConditionStatus], ...] = (
        ("Ready", "False"),
        ("Progressing", "False"),
        ("Degraded", "True"),
    )
    status["conditions"] = [
        set_condition(
            old_conditions,
            Condition(
                type=ctype,
                status=cstatus,
                reason="InvalidSpec",
                message=message,
                observed_generation=owner.generation,
            ),
            now,
        )
        for ctype, cstatus in kinds
    ]
    return status
