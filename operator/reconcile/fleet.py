"""The AttentionFleet reconciler: the fleet's push-token Secret, the clients' RBAC, Deployment
and Service; the pool's current routing table pushed to every Ready client that has not
acknowledged it (:mod:`eaas.operator.push`); the fleet's status, and the acknowledgements
handed to the pool's status."""

from __future__ import annotations

import time
from typing import Any

import kopf
from kubernetes import client as k8s
from pydantic import ValidationError

from eaas.operator.crd import ANNOTATION_SPEC_HASH, AttentionFleetSpec, ExpertPoolSpec
from eaas.operator.fleet import (
    client_rbac,
    fleet_deployment,
    fleet_service,
    fleet_status,
    push_secret,
)
from eaas.operator.kube import (
    FLEETS,
    POOLS,
    apply,
    ensure_token_secret,
    event,
    get_custom,
    get_live,
    now,
    plain,
    raw,
    raw_or_none,
    table_version_of,
    write_status,
)
from eaas.operator.names import (
    Owner,
    client_labels,
    push_secret_name,
    selector_string,
    table_configmap_name,
)
from eaas.operator.overlay import OverlayError
from eaas.operator.push import ObservedClient, clients_to_push, push_all
from eaas.operator.reconcile.load import RBAC_RECHECK_S
from eaas.operator.state import FleetMemory, OperatorState
from eaas.operator.vllm_fleet import push_port
from eaas.runtime.tables.watch import TABLE_KEY


def reconcile_fleet(state: OperatorState, namespace: str, name: str, logger: kopf.Logger) -> None:
    """One reconcile step of AttentionFleet ``namespace/name``.

    Ensures its push-token Secret (made once, random), the clients' ServiceAccount/Role/
    RoleBinding, Deployment and Service; pushes the pool's current routing table to every Ready
    client that has not acknowledged it; writes the status (readiness, the table version,
    acknowledgements) and hands the acknowledgements to the pool's status.

    Raises:
        ApiException: any API error but 404 on reads (the daemon logs and retries).
    """
    custom = k8s.CustomObjectsApi(state.api())
    core = k8s.CoreV1Api(state.api())
    body = get_live(custom, namespace, FLEETS, name)
    if body is None:
        return
    owner = Owner.from_body(body)
    spec = AttentionFleetSpec.model_validate(body["spec"])
    pool_name = spec.expert_pool_ref.name
    memory = state.fleet(namespace, name)
    memory.pool = pool_name  # the pool's new tables wake this fleet from now on
    pool = _pool_spec(custom, namespace, pool_name)

    token = ensure_token_secret(core, state.tokens, owner, push_secret_name(name), push_secret)
    _ensure_rbac(state, owner, pool_name)
    try:
        deployment = fleet_deployment(owner, spec, pool, state.settings.reports.base_url or None)
    except OverlayError as exc:
        event(body, "InvalidSpec", str(exc), warning=True)
        logger.warning("fleet %s/%s: %s", namespace, name, exc)
        return
    apps = k8s.AppsV1Api(state.api())
    dep = apply(
        deployment,
        read=lambda: apps.read_namespaced_deployment(name, namespace),
        patch=lambda m, **o: apps.patch_namespaced_deployment(name, namespace, m, **o),
    )
    apply(
        fleet_service(owner, spec),
        read=lambda: core.read_namespaced_service(name, namespace),
        patch=lambda m, **o: core.patch_namespaced_service(name, namespace, m, **o),
    )
    table_version, table_json = pool_table(state, core, namespace, pool_name)
    acked = _push(state, core, owner, spec, memory, token, table_version, table_json, logger)
    acks_of_pool = state.pool(namespace, pool_name).fleet_acks
    previous = acks_of_pool.get(name)
    acks_of_pool[name] = acked
    if previous != acked:
        state.wake("pool", namespace, pool_name)

    old_status = body.get("status") or {}
    status = fleet_status(
        owner=owner,
        spec=spec,
        deployment_status=(plain(state.api(), dep) or {}).get("status") if dep else None,
        pool_found=pool is not None,
        table_version=table_version,
        old_conditions=old_status.get("conditions") or [],
        now=now(),
        acknowledged=acked,
    )
    write_status(custom, namespace, name, old_status, status, plural=FLEETS)


def _pool_spec(custom: k8s.CustomObjectsApi, namespace: str, name: str) -> ExpertPoolSpec | None:
    """The referenced pool's spec (None: no such pool, or an invalid spec)."""
    body = get_custom(custom, namespace, POOLS, name)
    if body is None:
        return None
    try:
        return ExpertPoolSpec.model_validate(body["spec"])
    except ValidationError:
        return None


def pool_table(
    state: OperatorState, core: k8s.CoreV1Api, namespace: str, pool: str
) -> tuple[int, str]:
    """``(version, wire text)`` of pool ``pool``'s routing table (``(0, "")``: none): the one
    the pool's reconciler handed over (the ConfigMap as it last wrote or read it), else the
    ConfigMap read now.

    Raises:
        ApiException: any API error but 404.
    """
    memory = state.pools.get((namespace, pool))
    if memory is not None and memory.published is not None:
        return memory.published.version, memory.published.wire
    cm = raw_or_none(core.read_namespaced_config_map, table_configmap_name(pool), namespace)
    if cm is None:
        return 0, ""
    return table_version_of(cm), (cm.get("data") or {}).get(TABLE_KEY, "")


def _ensure_rbac(state: OperatorState, owner: Owner, pool_name: str) -> None:
    """Apply the clients' ServiceAccount, Role and RoleBinding (each re-read at most every
    :data:`RBAC_RECHECK_S` while its spec is unchanged)."""
    core = k8s.CoreV1Api(state.api())
    rbac = k8s.RbacAuthorizationV1Api(state.api())
    ns = owner.namespace
    methods: dict[str, tuple[Any, Any]] = {  # kind -> (read, patch)
        "ServiceAccount": (
            core.read_namespaced_service_account,
            core.patch_namespaced_service_account,
        ),
        "Role": (rbac.read_namespaced_role, rbac.patch_namespaced_role),
        "RoleBinding": (rbac.read_namespaced_role_binding, rbac.patch_namespaced_role_binding),
    }
    for manifest in client_rbac(owner, pool_name):
        kind, n = manifest["kind"], manifest["metadata"]["name"]
        key = (ns, kind, n, manifest["metadata"]["annotations"][ANNOTATION_SPEC_HASH])
        if time.monotonic() - state.applied.get(key, -1e18) < RBAC_RECHECK_S:
            continue  # applied recently: save three GETs per fleet per resync
        read, patch = methods[kind]
        apply(
            manifest,
            read=lambda read=read, n=n: read(n, ns),
            patch=lambda m, patch=patch, n=n, **o: patch(n, ns, m, **o),
        )
        state.applied[key] = time.monotonic()


def _push(
    state: OperatorState,
    core: k8s.CoreV1Api,
    owner: Owner,
    spec: AttentionFleetSpec,
    memory: FleetMemory,
    token: str,
    table_version: int,
    table_json: str,
    logger: Any,
) -> list[int]:
    """Push the table to the fleet's Ready clients that have not acknowledged it (with back-off
    per client). Returns the acknowledged versions of the Ready clients."""
    pods = raw(
        core.list_namespaced_pod,
        owner.namespace,
        label_selector=selector_string(client_labels(owner.name)),
    )["items"]
    clients = [ObservedClient.from_pod(p) for p in pods]
    acks, retries = memory.acks, memory.push_retries
    for m in (acks, retries):
        for uid in set(m) - {c.uid for c in clients}:
            del m[uid]  # pod gone
    t = time.monotonic()
    todo = clients_to_push(clients, acks, table_version, retries, t) if table_json else []
    if todo:
        failures = push_all(
            todo,
            push_port(spec),  # the API port, or the vLLM plugin's (engine: vllm)
            table_json,
            token,
            acks,
            state.executor(),
            retries=retries,
            version=table_version,
            now=t,
        )
        for pod_name, why in failures.items():
            logger.info("push of table %d to %s not acknowledged: %s", table_version, pod_name, why)
    return [acks.get(c.uid, 0) for c in clients if c.ready and c.ip]
