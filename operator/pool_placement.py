"""Placement decisions of the operator (pure): the placement in force read back from the
pods, the next placement computed incrementally from it, expert load, failure-domain spread."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence

from eaas.operator.crd import ExpertPoolSpec
from eaas.operator.names import content_hash
from eaas.operator.pods import ObservedPod
from eaas.runtime.placement import (
    LayerExpert,
    Placement,
    auto_slots,
    balancedness,
    place_experts,
)
from eaas.runtime.tables.table import RoutingTable


# ---------------------------------------------------------------------------------------------
# placement
# ---------------------------------------------------------------------------------------------
def previous_placement(spec: ExpertPoolSpec, observed: Sequence[ObservedPod]) -> Placement | None:
    """The placement in force, read back from the pods' ``eaas.io/experts`` annotations:
    server ``i`` is pod ``<pool>-i``. Terminating and finished pods count as empty (their
    replacement is placed afresh); pods without a valid index are ignored. None when no pod
    hosts anything (a new pool: place from scratch)."""
    by_index: dict[int, tuple[LayerExpert, ...]] = {}
    for p in observed:
        if p.index < 0 or p.terminating or p.finished:
            continue
        by_index[p.index] = p.experts
    if not any(by_index.values()):
        return None
    width = max(by_index) + 1
    return Placement(
        layers=tuple(spec.model.layers()),
        num_experts=spec.model.num_experts,
        redundancy=spec.redundancy,
        servers=tuple(tuple(sorted(by_index.get(i, ()))) for i in range(width)),
    )


def compute_placement(
    spec: ExpertPoolSpec,
    expert_load: Mapping[LayerExpert, float] | None = None,
    observed: Sequence[ObservedPod] = (),
) -> Placement:
    """Placement of every (MoE layer, logical expert) on ``spec.replicas`` servers, computed
    incrementally from what the ``observed`` pods host (:func:`previous_placement`): a rescale
    fills the new servers (scale-up) or re-homes what the removed servers held (scale-down),
    and with ``load-balanced`` and the load known moves at most
    ``spec.placement.maxMovedFraction`` of each layer's replicas more to lower its most-loaded
    server; see :mod:`eaas.runtime.placement` for the bounds. A converged pool is a fixed point
    (the same pods give the same placement).

    Args:
        spec: the pool's spec (model shape, replicas, redundancy, placement policy and
            ``slotsPerServer``).
        expert_load: tokens per (layer, expert) per interval, for ``load-balanced``.
        observed: the pool's existing pods.

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
        previous=previous_placement(spec, observed),
        slots_per_server=spec.placement.slots_per_server,
        max_moved_fraction=spec.placement.max_moved_fraction,
    )


def parse_expert_load(text: str, spec: ExpertPoolSpec) -> dict[LayerExpert, float]:
    """Parse the pool's expert-load document (ConfigMap ``<pool>-expert-load``, key
    ``expert-load.json``): ``{"layers": {"<layer>": [tokens of expert 0, 1, ...], ...}}``,
    tokens per expert over any fixed interval (only ratios matter).

    Raises:
        ValueError: not JSON, a layer outside the model, a row whose length is not
            ``numExperts``, or a negative / non-numeric load (the message names the field).
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"expert load is not valid JSON: {exc}") from None
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, dict):
        raise ValueError("expert load needs an object field 'layers'")
    valid = set(spec.model.layers())
    out: dict[LayerExpert, float] = {}
    for key, row in layers.items():
        try:
            layer = int(key)
        except ValueError:
            raise ValueError(f"layers[{key!r}]: not a layer index") from None
        if layer not in valid:
            raise ValueError(f"layers[{key!r}]: not a MoE layer of the model")
        if not isinstance(row, list) or len(row) != spec.model.num_experts:
            raise ValueError(f"layers[{key!r}]: expected a list of {spec.model.num_experts} loads")
        for e, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"layers[{key!r}][{e}]: load must be a number >= 0, got {v!r}")
            out[(layer, e)] = float(v)
    return out


def expert_load_configmap_name(pool: str) -> str:
    """Name of the ConfigMap the operator reads expert load from (written by a collector)."""
    return f"{pool}-expert-load"


def unspread_experts(
    live: Sequence[ObservedPod],
    redundancy: int,
    node_domains: Mapping[str, str] | None = None,
) -> tuple[int, int]:
    """``(experts, domains)``: logical experts whose live replicas span fewer failure domains
    than ``min(redundancy, domains with live servers)``, and the number of such domains.

    ``node_domains``: node name -> its value of the pool's topology key; a node not in it is
    its own domain, a pod with no node too. Memoized on the servers' domains and experts: every
    step's status needs it, and an idle step of a 1,024-server pool spent ~45% of its CPU here
    (py-spy)."""
    domains = node_domains or {}
    members = tuple((domains.get(p.node) or p.node or f"pod/{p.name}", p.experts) for p in live)
    return _unspread(members, redundancy)


@functools.lru_cache(maxsize=8)
def _unspread(
    members: tuple[tuple[str, tuple[LayerExpert, ...]], ...], redundancy: int
) -> tuple[int, int]:
    """:func:`unspread_experts` of ``(domain, experts)`` per live server."""
    hosting: dict[LayerExpert, set[str]] = {}
    nodes: set[str] = set()
    for node, experts in members:
        nodes.add(node)
        for pair in experts:
            hosting.setdefault(pair, set()).add(node)
    want = min(redundancy, len(nodes))
    return sum(1 for ns in hosting.values() if len(ns) < want), len(nodes)


def placement_revision(spec: ExpertPoolSpec) -> str:
    """Short hash of the placement's inputs; changes exactly when the placement may change."""
    return content_hash(
        {
            "layers": spec.model.layers(),
            "numExperts": spec.model.num_experts,
            "servers": spec.replicas,
            "redundancy": spec.redundancy,
            "policy": spec.placement.policy,
            "slotsPerServer": spec.placement.slots_per_server,
            "maxMovedFraction": spec.placement.max_moved_fraction,
        }
    )


# ---------------------------------------------------------------------------------------------
# placement from the routing table (spec.placement.assignment: routing-table)
# ---------------------------------------------------------------------------------------------
def table_placement(
    spec: ExpertPoolSpec, members: Sequence[str], table: RoutingTable | None
) -> Placement:
    """The placement in force over ``members`` (server ids, in placement order), read from the
    routing table (the single source of truth): member ``i`` hosts what ``table`` assigns it
    (nothing when absent)."""
    hosting = table.assignment() if table is not None else {}
    return Placement(
        layers=tuple(spec.model.layers()),
        num_experts=spec.model.num_experts,
        redundancy=spec.redundancy,
        servers=tuple(tuple(sorted(hosting.get(m, ()))) for m in members),
    )


def rebalance_due(
    spec: ExpertPoolSpec,
    current: Placement,
    expert_load: Mapping[LayerExpert, float] | None,
    seconds_since_last: float | None,
) -> tuple[bool, float]:
    """Whether a ``load-balanced`` pool rebalances now, and the imbalance that decided it.

    Imbalance = ``1 - balancedness(current, expert_load)`` (:func:`balancedness`: mean / max
    per-server load, summed over MoE layers). Due when the policy is ``load-balanced``, load is
    known, the imbalance exceeds ``spec.placement.rebalanceThreshold`` and the last rebalance
    is at least ``rebalanceIntervalSeconds`` ago (``seconds_since_last`` None: never).
    """
    if spec.placement.policy != "load-balanced" or not expert_load or not any(current.servers):
        return False, 0.0
    imbalance = 1.0 - balancedness(current, expert_load)
    if imbalance <= spec.placement.rebalance_threshold:
        return False, imbalance
    if seconds_since_last is not None and seconds_since_last < (
        spec.placement.rebalance_interval_seconds
    ):
        return False, imbalance
    return True, imbalance


def member_placement(
    spec: ExpertPoolSpec,
    members: Sequence[str],
    table: RoutingTable | None,
    expert_load: Mapping[LayerExpert, float] | None = None,
    rebalance: bool = False,
    domains: Sequence[str] | None = None,
) -> dict[str, tuple[LayerExpert, ...]]:
    """The assignment the operator wants over the live ``members`` (server id -> pairs),
    computed incrementally from what ``table`` assigns them (:func:`table_placement`): a server
    that died or left is simply not a member, so its experts are re-homed on the survivors by
    the table (they load them) instead of waiting for a replacement pod; a new member starts
    empty and is filled (scale-up moves nothing off a running server).

    ``expert_load`` is used for a pool placed from scratch, when the members changed (a new
    member, or a server of ``table`` that is no longer one: the change is then placed for the
    load, moving at most ``spec.placement.maxMovedFraction`` of each layer's replicas beyond
    what it forces) and when ``rebalance`` (the same budget, spent where nothing is forced);
    otherwise the placement in force is a fixed point. Fewer members than ``redundancy``: the
    assignment in force is kept (nothing to re-place onto).

    Slot budget: ``spec.placement.slotsPerServer``, or with 0 the budget of the desired size
    ``ceil(numExperts * redundancy / replicas)`` (not the ratchet of :func:`compute_placement`:
    moving replicas costs no restart here). While fewer members are live the budget rises as
    far as needed to hold ``redundancy`` replicas of every expert, and falls back when the
    missing servers return (survivors then drop their surplus after the release).

    Raises:
        PlacementError: an impossible request (see :func:`place_experts`).
    """
    previous = table_placement(spec, members, table)
    if len(members) < spec.redundancy or not members:
        return dict(zip(members, previous.servers, strict=True))
    fresh = not any(previous.servers)
    use_load = expert_load if (fresh or rebalance or members_changed(members, table)) else None
    placement = place_experts(
        layers=spec.model.layers(),
        num_experts=spec.model.num_experts,
        num_servers=len(members),
        redundancy=spec.redundancy,
        policy=spec.placement.policy,
        expert_load=use_load,
        previous=None if fresh else previous,
        slots_per_server=spec.placement.slots_per_server
        or auto_slots(spec.model.num_experts, spec.redundancy, spec.replicas),
        domains=domains,
        max_moved_fraction=spec.placement.max_moved_fraction,
        rebalance=rebalance,
    )
    return dict(zip(members, placement.servers, strict=True))


def members_changed(members: Sequence[str], table: RoutingTable | None) -> bool:
    """Whether ``members`` differ from the servers ``table`` assigns experts to (a member
    without experts joined, or a server with experts is no longer a member)."""
    hosting = table.assignment() if table is not None else {}
    held = {m for m, pairs in hosting.items() if pairs}
    return held != set(members)
