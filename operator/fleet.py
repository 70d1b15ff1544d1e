"""AttentionFleet (pure): the clients' command line, Deployment, Service and status."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from eaas.operator.crd import ANNOTATION_SPEC_HASH, AttentionFleetSpec, Condition, ExpertPoolSpec
from eaas.operator.names import (
    CLIENT_ROLE,
    MANAGED_BY,
    TABLE_KEY,
    TABLE_MOUNT_DIR,
    Owner,
    client_labels,
    content_hash,
    selector_string,
    table_configmap_name,
)
from eaas.operator.status import set_condition


# ---------------------------------------------------------------------------------------------
# attention fleet
# ---------------------------------------------------------------------------------------------
def client_command(spec: AttentionFleetSpec, pool: ExpertPoolSpec | None = None) -> list[str]:
    """The attention client's command line: serve the API on all interfaces (the Service reaches
    it through the pod IP); with the pool known, its dispatch deadline (seconds)."""
    cmd = [
        "eaas",
        "attention-client",
        "--model",
        spec.model.uri,
        "--routing-table",
        f"{TABLE_MOUNT_DIR}/{TABLE_KEY}",
        "--port",
        str(spec.port),
        "--host",
        "0.0.0.0",
    ]
    if pool is not None:
        cmd += ["--dispatch-timeout", f"{pool.failure_detection.dispatch_timeout_ms / 1000:g}"]
    return cmd


def fleet_deployment(
    owner: Owner, spec: AttentionFleetSpec, pool: ExpertPoolSpec | None
) -> dict[str, Any]:
    """Deployment of attention clients mounting the pool's routing-table ConfigMap at
    ``/etc/eaas`` (a directory mount, so ConfigMap updates reach running pods). ``pool``, when
    known, supplies the failure-detection timing as environment variables."""
    labels = client_labels(owner.name)
    env = [{"name": "EAAS_EXPERT_POOL", "value": spec.expert_pool_ref.name}]
    if pool is not None:
        env += [
            {
                "name": "EAAS_DISPATCH_TIMEOUT_MS",
                "value": str(pool.failure_detection.dispatch_timeout_ms),
            },
            {
                "name": "EAAS_SUSPECT_AFTER_MS",
                "value": str(pool.failure_detection.suspect_after_ms),
            },
        ]
    container: dict[str, Any] = {
        "name": CLIENT_ROLE,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": client_command(spec, pool),
        "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}],
        "env": env,
        "volumeMounts": [{"name": "routing-table", "mountPath": TABLE_MOUNT_DIR, "readOnly": True}],
        "readinessProbe": {"tcpSocket": {"port": spec.port}, "periodSeconds": 2},
    }
    if spec.resources:
        container["resources"] = spec.resources
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [
            {
                "name": "routing-table",
                "configMap": {
                    "name": table_configmap_name(spec.expert_pool_ref.name),
                    "items": [{"key": TABLE_KEY, "path": TABLE_KEY}],
                },
            }
        ],
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = list(spec.tolerations)
    dep_spec = {
        "replicas": spec.replicas,
        "selector": {"matchLabels": labels},
        "template": {
            "metadata": {"labels": {**labels, "app.kubernetes.io/component": CLIENT_ROLE}},
            "spec": pod_spec,
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": owner.name,
            "namespace": owner.namespace,
            "labels": {**labels, "app.kubernetes.io/managed-by": MANAGED_BY},
            "annotations": {ANNOTATION_SPEC_HASH: content_hash(dep_spec)},
            "ownerReferences": [owner.reference()],
        },
        "spec": dep_spec,
    }


def fleet_service(owner: Owner, spec: AttentionFleetSpec) -> dict[str, Any]:
    """ClusterIP Service in front of the attention clients (OpenAI-compatible API)."""
    svc_spec = {
        "selector": client_labels(owner.name),
        "ports": [{"name": "http", "port": spec.port, "targetPort": spec.port, "protocol": "TCP"}],
    }
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": owner.name,
            "namespace": owner.namespace,
            "labels": {**client_labels(owner.name), "app.kubernetes.io/managed-by": MANAGED_BY},
            "annotations": {ANNOTATION_SPEC_HASH: content_hash(svc_spec)},
            "ownerReferences": [owner.reference()],
        },
        "spec": svc_spec,
    }


def fleet_status(
    *,
    owner: Owner,
    spec: AttentionFleetSpec,
    deployment_status: Mapping[str, Any] | None,
    pool_found: bool,
    table_version: int,
    old_conditions: Sequence[Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    """The fleet's ``status``: Ready when all clients are ready and the pool's table exists;
    Degraded when the pool or its routing table is missing."""
    ds = deployment_status or {}
    ready = int(ds.get("readyReplicas") or 0)
    replicas = int(ds.get("replicas") or 0)
    updated = int(ds.get("updatedReplicas") or 0)
    gen = owner.generation
    pool = spec.expert_pool_ref.name
    if not pool_found:
        deg = Condition(
            type="Degraded",
            status="True",
            reason="ExpertPoolNotFound",
            message=f"ExpertPool {pool!r} not found",
            observed_generation=gen,
        )
    elif table_version == 0:
        deg = Condition(
            type="Degraded",
            status="True",
            reason="NoRoutingTable",
            message=f"ExpertPool {pool!r} has not published a routing table yet",
            observed_generation=gen,
        )
    else:
        deg = Condition(
            type="Degraded",
            status="False",
            reason="AsExpected",
            message=f"using routing table version {table_version} of {pool!r}",
            observed_generation=gen,
        )
    ok = ready >= spec.replicas and deg.status == "False"
    ready_c = Condition(
        type="Ready",
        status="True" if ok else "False",
        reason="AllClientsReady" if ok else "ClientsNotReady",
        message=f"{ready}/{spec.replicas} attention clients ready",
        observed_generation=gen,
    )
    busy = updated < spec.replicas or replicas != spec.replicas or ready < spec.replicas
    prog_c = Condition(
        type="Progressing",
        status="True" if busy else "False",
        reason="RollingOut" if busy else "Reconciled",
        message=f"{updated}/{spec.replicas} clients updated",
        observed_generation=gen,
    )
    return {
        "replicas": replicas,
        "readyReplicas": ready,
        "selector": selector_string(client_labels(owner.name)),
        "observedGeneration": gen,
        "routingTableVersion": table_version,
        "conditions": [set_condition(old_conditions, c, now) for c in (ready_c, prog_c, deg)],
    }
