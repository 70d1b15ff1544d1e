"""The pool's routing table (pure): built from the live pods, versioned, as a ConfigMap."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eaas.operator.crd import ANNOTATION_TABLE_VERSION, LABEL_POOL, ExpertPoolSpec
from eaas.operator.names import MANAGED_BY, Owner, table_configmap_name
from eaas.operator.pods import ObservedPod, server_endpoint
from eaas.runtime.placement import LayerExpert
from eaas.runtime.tables.table import RoutingTable
from eaas.runtime.tables.watch import TABLE_KEY


# ---------------------------------------------------------------------------------------------
# routing table
# ---------------------------------------------------------------------------------------------
def build_routing_table(
    spec: ExpertPoolSpec, live: Sequence[ObservedPod], version: int
) -> RoutingTable:
    """Routing table over the ``live`` pods: each (layer, expert) of the model lists the live
    pods whose ``eaas.io/experts`` names it, in server-index order; endpoints ``tcp://IP:port``
    (``nvshmem:PE`` in an NVSHMEM world, :func:`eaas.operator.pods.server_endpoint`).
    Experts outside the model's range (a pod from an older spec) are ignored
    (:meth:`RoutingTable.from_assignment`)."""
    pods = sorted(live, key=lambda p: (p.index, p.name))
    return table_from_assignment(
        spec,
        {p.name: p.experts for p in pods},
        {p.name: server_endpoint(spec, p.index, p.ip) for p in pods},
        version,
    )


def next_routing_table(
    spec: ExpertPoolSpec,
    live: Sequence[ObservedPod],
    previous: RoutingTable | None,
    floor_version: int = 0,
    candidate: RoutingTable | None = None,
) -> tuple[RoutingTable, bool]:
    """The table to publish and whether it differs from ``previous``. ``candidate``:
    :func:`build_routing_table` of ``live`` when the caller has it already (memoized).

    The version is strictly increasing across content changes: a changed table gets
    ``max(previous.version, floor_version) + 1`` (``floor_version``: the last version recorded
    anywhere else, e.g. the pool's status, so a lost ConfigMap never makes it go back). An
    unchanged table is returned as ``previous`` itself.
    """
    if candidate is None:
        candidate = build_routing_table(spec, live, 0)
    if previous is not None and previous.same_replicas(candidate):
        return previous, False
    version = max(previous.version if previous else 0, floor_version) + 1
    return _with_version(candidate, version), True


def _with_version(table: RoutingTable, version: int) -> RoutingTable:
    """``table`` under ``version`` (>= 1), without validating its replicas again:
    :meth:`RoutingTable.with_version` runs the table's invariant checks once more (a
    1,024-server DeepSeek-V3 table: ~0.1 CPU-s, on the path of a dead server leaving it)."""
    out = copy.copy(table)  # a frozen dataclass of immutable fields: no __post_init__ again
    object.__setattr__(out, "version", int(version))
    return out


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
        "data": {TABLE_KEY: table.to_wire()},
    }


#: Bytes of ConfigMap data the operator writes at most: the API server's 1 MiB object limit
#: less room for metadata.
CONFIGMAP_DATA_LIMIT = 1024 * 1024 - 32 * 1024


def configmap_too_large(manifest: dict[str, Any]) -> str:
    """A message when the ConfigMap's data exceeds :data:`CONFIGMAP_DATA_LIMIT`, else ``""``."""
    size = sum(len(v.encode()) for v in (manifest.get("data") or {}).values())
    if size <= CONFIGMAP_DATA_LIMIT:
        return ""
    return (
        f"routing table is {size} bytes even in compact form; a ConfigMap holds at most "
        f"{CONFIGMAP_DATA_LIMIT} bytes of data: the previous table stays in force"
    )


def coverage(table: RoutingTable, redundancy: int) -> tuple[int, int, int]:
    """``(logical experts, below redundancy, uncovered)`` counted over ``table``
    (:meth:`RoutingTable.coverage`)."""
    return table.coverage(redundancy)


# ---------------------------------------------------------------------------------------------
# two-phase publish (spec.placement.assignment: routing-table)
# ---------------------------------------------------------------------------------------------
def assignment_of(table: RoutingTable | None) -> dict[str, frozenset[LayerExpert]]:
    """Server id -> the ``(layer, expert)`` pairs ``table`` assigns to it (every listed server,
    also those hosting nothing; :meth:`RoutingTable.assignment`)."""
    return {} if table is None else table.assignment()


def table_from_assignment(
    spec: ExpertPoolSpec,
    assignment: Mapping[str, Iterable[LayerExpert]],
    endpoints: Mapping[str, str],
    version: int,
) -> RoutingTable:
    """Routing table of ``assignment`` (server id -> pairs) over the servers of ``endpoints``
    (server id -> ``tcp://IP:port`` or ``nvshmem:PE``; their order is the replica order). Pairs
    outside the model are ignored; servers not in ``endpoints`` are left out
    (:meth:`RoutingTable.from_assignment`)."""
    return RoutingTable.from_assignment(
        assignment,
        endpoints,
        version,
        num_experts=spec.model.num_experts,
        layers=spec.model.layers(),
    )


@dataclass(frozen=True)
class TwoPhaseStep:
    """One decision of the two-phase publish (:func:`two_phase_step`).

    Attributes:
        stage: a new version for the servers only (push it to every server in it; write it as
            the staged copy); clients get it once every server in it confirmed.
        publish: the version to give to the clients now (write the ConfigMap, push).
        release: every client acknowledged this version: servers may drop experts that only
            older versions use (0: nothing to release).
        waiting_for: servers of the staged version that have not confirmed its weights yet.
        abandoned: a pending staged version was given up (one of its servers left).
        reason: a short explanation (events, logs).
    """

    abandoned: bool = False
    stage: RoutingTable | None = None
    publish: RoutingTable | None = None
    release: int = 0
    waiting_for: tuple[str, ...] = ()
    reason: str = ""


def two_phase_step(
    candidate: RoutingTable,
    published: RoutingTable | None,
    staged: RoutingTable | None,
    confirmed: Mapping[str, int],
    client_acks: Sequence[int],
    floor_version: int = 0,
) -> TwoPhaseStep:
    """Decide the next step of make-before-break publishing (pure): servers get a version
    first, clients once every server of it holds its weights.

    Args:
        candidate: the table the operator wants in force (its version is ignored), over live
            servers only.
        published: the table the clients were given (the ConfigMap), or None.
        staged: the last version given to the servers only, or None.
        confirmed: server id -> newest version whose weights that server reported holding
            (``weights_version``).
        client_acks: acknowledged versions of the Ready clients (empty: no clients).
        floor_version: the last version recorded anywhere else (status): versions never reuse it.

    Rules:

    * A staged version newer than the published one is *pending*. When every server in it
      confirmed (``confirmed[s] >= staged.version``) it is published. While some have not, it
      waits -- unless one of its servers left the candidate (died, or its endpoint changed): then
      it is abandoned and the candidate is decided afresh.
    * Without a pending version: a candidate equal (but for the version) to the published table
      changes nothing. A candidate that only takes experts away from servers (each server's
      experts a subset of what it has in the published table, e.g. a dead server removed) is
      published at once: every server in it already holds those weights. Any other candidate
      (a server gets an expert it does not hold: scale-up, scale-down re-homing, rebalancing,
      the first table) is staged with version ``max(published, staged, floor) + 1``.
    * ``release``: the smallest acknowledged version among the clients, at most the published
      version (all of it when there are no clients).
    """
    pub_v = published.version if published else 0
    release = min([pub_v, *client_acks]) if published else 0
    pending = staged if staged is not None and staged.version > pub_v else None
    abandoned = False
    if pending is not None:
        alive = all(candidate.servers.get(s) == ep for s, ep in pending.servers.items())
        if alive:
            waiting = tuple(
                sorted(s for s in pending.servers if confirmed.get(s, 0) < pending.version)
            )
            if not waiting:
                return TwoPhaseStep(
                    publish=pending,
                    release=release,
                    reason=f"all {len(pending.servers)} servers confirmed version "
                    f"{pending.version}",
                )
            return TwoPhaseStep(
                release=release,
                waiting_for=waiting,
                reason=f"version {pending.version}: waiting for {len(waiting)} server(s)",
            )
        abandoned = True
    if published is not None and published.same_replicas(candidate):
        return TwoPhaseStep(abandoned=abandoned, release=release, reason="unchanged")
    version = max(pub_v, staged.version if staged else 0, floor_version) + 1
    table = candidate.with_version(version)
    if published is not None:
        held = published.assignment()
        if all(
            published.servers.get(s) == table.servers[s] and pairs <= held.get(s, frozenset())
            for s, pairs in table.assignment().items()
        ):
            return TwoPhaseStep(
                abandoned=abandoned,
                publish=table,
                release=release,
                reason="servers removed or experts dropped only",
            )
    return TwoPhaseStep(
        abandoned=abandoned,
        stage=table,
        release=release,
        waiting_for=tuple(sorted(table.servers)),
        reason=f"version {version}: servers load new experts first",
    )
