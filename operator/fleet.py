"""AttentionFleet (pure): the clients' command line, Deployment, Service, push-token Secret,
RBAC and status."""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from eaas.operator.crd import (
    ANNOTATION_SPEC_HASH,
    API_KEY_ENV,
    VLLM_API_KEY_ENV,
    AttentionFleetSpec,
    Condition,
    ExpertPoolSpec,
)
from eaas.operator.names import (
    CLIENT_ROLE,
    GPU_RESOURCE,
    MANAGED_BY,
    PUSH_TOKEN_KEY,
    PUSH_TOKEN_MOUNT_DIR,
    Owner,
    client_account_name,
    client_labels,
    content_hash,
    failure_report_path,
    push_secret_name,
    selector_string,
    table_configmap_name,
)
from eaas.operator.overlay import OverlayError, apply_pod_template
from eaas.operator.pods import nvshmem_uid_file, world_layout
from eaas.operator.status import set_condition
from eaas.operator.vllm_fleet import vllm_container
from eaas.runtime.options import PROGRAM, AttentionClientOptions
from eaas.runtime.options.nvshmem_world import client_env

#: Env var of each attention-client container holding its pod name (downward API); the client's
#: ``--client-id $(EAAS_POD_NAME)`` makes every replica's id distinct.
POD_NAME_ENV = "EAAS_POD_NAME"


# ---------------------------------------------------------------------------------------------
# attention fleet
# ---------------------------------------------------------------------------------------------
def client_command(
    spec: AttentionFleetSpec,
    pool: ExpertPoolSpec | None = None,
    *,
    namespace: str = "default",
    failure_report_url: str | None = None,
) -> list[str]:
    """The attention client's command line.

    It serves the API on all interfaces (the Service reaches it through the pod IP), watches the
    pool's routing-table ConfigMap through the API (``--routing-table-configmap NS/NAME``: it
    converges even when it missed a push), accepts pushes with the token of the mounted Secret
    (``--push-token-file``), reports failed expert servers to ``failure_report_url`` (the
    operator's monitor endpoint; None: no reports) and, with the pool known, uses its dispatch
    deadline (seconds).
    """
    extra: dict[str, Any] = {}
    if pool is not None:
        extra["dispatch_timeout"] = pool.failure_detection.dispatch_timeout_ms / 1000
        if world_layout(pool) is not None:  # an NVSHMEM world member computes on the GPU
            extra["device"] = "cuda"
    options = AttentionClientOptions(
        model=spec.model.model_path(),
        # every replica its own id (frames, metrics, failure reports): the pod name, from the
        # downward API (fleet_deployment sets the variable; the kubelet expands $(VAR))
        client_id=f"$({POD_NAME_ENV})",
        routing_table_configmap=f"{namespace}/{table_configmap_name(spec.expert_pool_ref.name)}",
        push_token_file=f"{PUSH_TOKEN_MOUNT_DIR}/{PUSH_TOKEN_KEY}",
        port=spec.port,
        host="0.0.0.0",
        failure_report_url=failure_report_url or None,
        **extra,
    )
    return [PROGRAM, *options.argv()]


def _join_world(
    spec: AttentionFleetSpec,
    pool: ExpertPoolSpec,
    container: dict[str, Any],
    volumes: list[dict[str, Any]],
) -> None:
    """Make the client container a member of the pool's NVSHMEM world (in place): the env of
    :func:`~eaas.runtime.options.nvshmem_world.client_env` (each pod claims a free client
    PE next to the uid file: Deployment pods are identical), one GPU, the uid volume."""
    layout, nv = world_layout(pool), pool.transport.nvshmem
    assert layout is not None and nv is not None
    uid_file = nvshmem_uid_file(spec.expert_pool_ref.name, pool)
    env = client_env(layout, uid_file, ibgda=nv.ibgda)
    # appended: the pod-name entry the client id expands from stays first
    container["env"] = [
        *container.get("env", []),
        *({"name": k, "value": v} for k, v in sorted(env.items())),
    ]
    res = dict(container.get("resources") or {})
    for key in ("requests", "limits"):
        res[key] = {**(res.get(key) or {}), GPU_RESOURCE: "1"}
    container["resources"] = res
    volumes.append(nv.uid_volume.volume())
    container["volumeMounts"].append(nv.uid_volume.volume_mount())


def fleet_deployment(
    owner: Owner,
    spec: AttentionFleetSpec,
    pool: ExpertPoolSpec | None,
    report_base_url: str | None = None,
) -> dict[str, Any]:
    """Deployment of attention clients.

    Each pod runs :func:`client_command` under the ServiceAccount ``<fleet>-client`` (allowed to
    read the pool's routing-table ConfigMap, see :func:`client_rbac`), mounts the push-token
    Secret ``<fleet>-push-token`` read-only and, with ``spec.model`` naming a volume, the
    weights at ``/models``; with ``spec.apiKeySecret`` the env ``EAAS_API_KEY`` comes from that
    Secret's key (a ``secretKeyRef``: the value is in neither the pod spec nor the operator's
    hands); ``GET /health`` (open without a key) is the readiness probe (503 while some expert has no
    live replica, so the Service routes elsewhere). ``spec.podTemplate`` is merged in last.
    With a pool whose ``spec.transport.scheme`` is ``nvshmem`` every client joins the pool's
    NVSHMEM world (:func:`_join_world`: ``--device cuda``, one GPU, the uid volume, env to
    claim a client PE; strategy Recreate). The fleet's ``replicas`` must equal the pool's
    ``transport.nvshmem.clients``: a surplus client finds no free PE and exits.

    Args:
        report_base_url: the operator's monitor address as clients reach it (e.g.
            ``http://eaas-operator.eaas-system.svc:8081``), or None for no failure reports.

    Raises:
        OverlayError: ``spec.podTemplate`` cannot be applied.
    """
    labels = client_labels(owner.name)
    url = (
        report_base_url.rstrip("/") + failure_report_path(owner.namespace, owner.name)
        if report_base_url
        else None
    )
    container: dict[str, Any] = {
        "name": CLIENT_ROLE,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": client_command(spec, pool, namespace=owner.namespace, failure_report_url=url),
        "env": [{"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": "http", "containerPort": spec.port, "protocol": "TCP"}],
        "volumeMounts": [
            {"name": "push-token", "mountPath": PUSH_TOKEN_MOUNT_DIR, "readOnly": True}
        ],
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": spec.port},
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": 2,
        },
    }
    if spec.api_key_secret is not None:  # the kubelet reads the Secret; the operator never
        name = VLLM_API_KEY_ENV if spec.engine == "vllm" else API_KEY_ENV
        container["env"].append(spec.api_key_secret.env(name))
    if spec.vllm is not None and spec.engine != "vllm":  # the CRD's rule refuses it first
        raise OverlayError("spec.vllm needs spec.engine vllm")
    if spec.engine == "vllm":  # vllm serve with the eaas.vllm plugin (vllm_fleet.py)
        container["command"], env, ports = vllm_container(
            spec,
            pool,
            namespace=owner.namespace,
            client_id=f"$({POD_NAME_ENV})",
            failure_report_url=url,
        )
        container["env"] += env  # after the pod name its client id expands from
        container["ports"] += ports
    if spec.resources:
        container["resources"] = spec.resources
    volumes: list[dict[str, Any]] = [
        {
            "name": "push-token",
            "secret": {
                "secretName": push_secret_name(owner.name),
                "items": [{"key": PUSH_TOKEN_KEY, "path": PUSH_TOKEN_KEY}],
            },
        }
    ]
    volume, mount = spec.model.volume(), spec.model.volume_mount()
    if volume is not None and mount is not None:
        volumes.append(volume)
        container["volumeMounts"].append(mount)
    in_world = pool is not None and world_layout(pool) is not None
    if in_world:
        assert pool is not None
        _join_world(spec, pool, container, volumes)
    pod_spec: dict[str, Any] = {
        "serviceAccountName": client_account_name(owner.name),
        "containers": [container],
        "volumes": volumes,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = list(spec.tolerations)
    template = apply_pod_template(
        {
            "metadata": {"labels": {**labels, "app.kubernetes.io/component": CLIENT_ROLE}},
            "spec": pod_spec,
        },
        spec.pod_template,
    )
    dep_spec: dict[str, Any] = {
        "replicas": spec.replicas,
        "selector": {"matchLabels": labels},
        "template": template,
    }
    if in_world:  # a world's PEs are fixed: never run old and new clients side by side
        dep_spec["strategy"] = {"type": "Recreate"}
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


def push_secret(owner: Owner, token: str) -> dict[str, Any]:
    """The fleet's push-token Secret (owned by the fleet): the bearer token of routing-table
    pushes (operator -> clients) and of failure reports (clients -> operator). ``token``:
    random, made once (:func:`new_push_token`) and never rewritten by a reconcile."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": push_secret_name(owner.name),
            "namespace": owner.namespace,
            "labels": {**client_labels(owner.name), "app.kubernetes.io/managed-by": MANAGED_BY},
            "ownerReferences": [owner.reference()],
        },
        "stringData": {PUSH_TOKEN_KEY: token},
    }


def new_push_token() -> str:
    """A fresh random push token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def client_rbac(owner: Owner, pool: str) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding ``<fleet>-client``: the clients may ``get``,
    ``list`` and ``watch`` the pool's routing-table ConfigMap, nothing else (a watch of one
    named object is a list/watch with a ``metadata.name`` field selector, which RBAC matches
    against ``resourceNames``)."""
    name = client_account_name(owner.name)
    meta = {
        "name": name,
        "namespace": owner.namespace,
        "labels": {**client_labels(owner.name), "app.kubernetes.io/managed-by": MANAGED_BY},
        "ownerReferences": [owner.reference()],
    }
    out: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": dict(meta),
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["configmaps"],
                    "resourceNames": [table_configmap_name(pool)],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": dict(meta),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        },
    ]
    for obj in out:
        body = {k: v for k, v in obj.items() if k not in ("metadata",)}
        obj["metadata"] = {
            **obj["metadata"],
            "annotations": {ANNOTATION_SPEC_HASH: content_hash(body)},
        }
    return out


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
    acknowledged: Sequence[int] = (),
) -> dict[str, Any]:
    """The fleet's ``status``: Ready when all clients are ready and the pool's table exists;
    Degraded when the pool or its routing table is missing.

    Args:
        acknowledged: for each Ready client pod, the newest routing-table version it
            acknowledged (0: none known yet); gives ``acknowledgedVersion`` (the oldest of them)
            and ``clientsAcknowledged`` (how many hold ``table_version`` or newer).
    """
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
        **ack_summary(acknowledged, table_version),
        "conditions": [set_condition(old_conditions, c, now) for c in (ready_c, prog_c, deg)],
    }


def ack_summary(acknowledged: Sequence[int], table_version: int) -> dict[str, int]:
    """Status fields about acknowledgements: ``acknowledgedVersion`` (the oldest version any of
    the Ready clients acknowledged; 0 when there are none or one has acknowledged nothing yet)
    and ``clientsAcknowledged`` (clients holding ``table_version`` or newer).

    Args:
        acknowledged: per Ready client, the newest version it acknowledged (0: none).
        table_version: the version in the routing-table ConfigMap (0: none).
    """
    return {
        "acknowledgedVersion": min(acknowledged) if acknowledged else 0,
        "clientsAcknowledged": sum(1 for v in acknowledged if table_version and v >= table_version),
    }
