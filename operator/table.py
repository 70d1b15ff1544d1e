"""The pool's routing table (pure): built from the live pods, versioned, as a ConfigMap."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from eaas.operator.crd import ANNOTATION_TABLE_VERSION, LABEL_POOL, ExpertPoolSpec
from eaas.operator.names import MANAGED_BY, TABLE_KEY, Owner, table_configmap_name
from eaas.operator.pods import ObservedPod
from eaas.runtime.placement import LayerExpert
from eaas.runtime.routing import RoutingTable


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
    """``(logical experts, below redundancy, uncovered)`` counted over ``table``."""
    total = below = uncovered = 0
    for experts in table.layers.values():
        for reps in experts:
            total += 1
            below += len(set(reps)) < redundancy
            uncovered += not reps
    return total, below, uncovered
