"""A dead server leaves the published routing table at once, at a cost that does not grow with
the pool: the first thing a pool's step does after the pod watch saw a server pod deleted,
terminating or finished (direct evidence: :mod:`eaas.operator.fail_static` removes those at
once too) is to write the table in force less that server
(:meth:`~eaas.runtime.tables.table.RoutingTable.without_servers`: its other servers' replicas
stay, an expert whose last replica it was has none, as the step's own table would say). No
read of the pool, its pods or its ConfigMap, no placement and no table built from the pods:
the step that follows re-places and replaces the server as always, and its table equals this
one until the replacement is Ready.

Only for pools whose experts are on the servers' command lines (a ``routing-table`` pool
re-places before it drops when a drop would uncover an expert: its step decides), and only
while the ConfigMap is as this operator last wrote or read it (else the step reads it).
"""

from __future__ import annotations

from typing import Any

import kopf
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from eaas.operator.crd import API_VERSION
from eaas.operator.kube import parse_table
from eaas.operator.names import Owner
from eaas.operator.pods import ObservedPod
from eaas.operator.reconcile.steps import write_table
from eaas.operator.state import OperatorState
from eaas.runtime.tables.table import RoutingTable
from eaas.runtime.tables.wire import RoutingTableError


def servers_to_drop(
    table: RoutingTable, dead: dict[str, str], seen: dict[str, ObservedPod | None]
) -> set[str]:
    """The servers of ``table`` among ``dead`` (pod name -> uid of the dead pod) whose pod the
    watch has not shown again since under another uid (``seen``: pod name -> the pod as the
    watch last delivered it, None: gone): a replacement already seen is the step's to judge."""
    out = set()
    for name, uid in dead.items():
        pod = seen.get(name)
        if name in table.servers and (pod is None or pod.uid == uid):
            out.add(name)
    return out


def owner_body(owner: Owner) -> dict[str, Any]:
    """The metadata an Event about ``owner`` needs (the pool is not read on this path)."""
    return {
        "apiVersion": API_VERSION,
        "kind": owner.kind,
        "metadata": {"name": owner.name, "namespace": owner.namespace, "uid": owner.uid},
    }


def drop_dead_at_once(
    state: OperatorState, core: k8s.CoreV1Api, namespace: str, name: str, logger: kopf.Logger
) -> bool:
    """Write the pool's table in force less the servers the pod watch saw die since its last
    step (:attr:`~eaas.operator.state.PoolMemory.dead`, consumed), when it can be done
    without reading anything (module docstring). Returns whether a table was written. An API
    error (409: the ConfigMap changed meanwhile) is logged and left to the step, which drops
    the server as well."""
    memory = state.pool(namespace, name)
    dead, memory.dead = memory.dead, {}
    owner, held, published = memory.owner, memory.table_cm, memory.published
    if not dead or owner is None or not memory.drops_at_once or held is None or published is None:
        return False
    if held["metadata"]["resourceVersion"] != published.resource_version:
        return False
    try:
        table = parse_table(state.tables, namespace, held)
    except RoutingTableError:
        return False
    seen = {n: state.pods_seen.get((namespace, n)) for n in dead}
    gone = servers_to_drop(table, dead, seen)
    if not gone:
        return False
    trimmed = table.without_servers(gone, version=max(table.version, published.version) + 1)
    try:
        write_table(state, core, owner_body(owner), owner, trimmed, held, table)
    except ApiException as exc:
        logger.debug("dropping %s at once failed (%s): the step does it", sorted(gone), exc.status)
        return False
    state.counters.add("eaas_operator_table_drops_total")
    logger.info(
        "pool %s/%s: %s left the routing table (version %d)",
        namespace,
        name,
        ", ".join(sorted(gone)),
        trimmed.version,
    )
    return True
