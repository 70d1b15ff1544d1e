"""Expert load and autoscaling: the load a placement follows (an override ConfigMap or the
servers' measured token rates), the scraper's targets, ``status.load``, the operator-owned
HorizontalPodAutoscaler, and the external metrics API that serves the HPA its metric."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import kopf
from kubernetes import client as k8s

from eaas.operator.crd import ExpertPoolSpec
from eaas.operator.external_metrics import (
    LABEL_MANAGED,
    hpa_differs,
    hpa_manifest,
    hpa_metrics_warning,
    hpa_name,
    read_front_proxy_auth,
)
from eaas.operator.external_metrics import start_server as start_metrics_server
from eaas.operator.kube import event, raw_or_none
from eaas.operator.load import metrics_url, pool_rates
from eaas.operator.names import LOAD_KEY, Owner
from eaas.operator.pods import ObservedPod
from eaas.operator.pool_placement import expert_load_configmap_name, parse_expert_load
from eaas.operator.state import OperatorState
from eaas.runtime.placement import LayerExpert

#: How often an applied object (the clients' RBAC, an HPA) is re-read to repair it (s).
RBAC_RECHECK_S = 60.0


def track_load(
    state: OperatorState,
    namespace: str,
    pool: str,
    pods: list[dict[str, Any]],
    observed: list[ObservedPod],
) -> None:
    """Hand the pool's live server pods (uid -> name, /metrics URL) to the scraper (cheap; the
    scrapes themselves run in the scraper's thread and never block this step)."""
    if state.scraper is None:
        return
    live = {p.uid for p in observed if p.live}
    targets = {}
    for pod in pods:
        uid = pod["metadata"].get("uid", "")
        url = metrics_url(pod)
        if uid in live and url:
            targets[uid] = (pod["metadata"]["name"], url)
    state.scraper.set_targets((namespace, pool), targets)


def read_load(
    core: k8s.CoreV1Api, body: dict[str, Any], spec: ExpertPoolSpec, logger: kopf.Logger
) -> dict[LayerExpert, float] | None:
    """Expert load for ``load-balanced`` pools from ConfigMap ``<pool>-expert-load`` (key
    ``expert-load.json``), or None (round-robin, no ConfigMap, or an invalid one: a Warning
    event names the problem and the placement goes on without load).

    Raises:
        ApiException: any API error but 404.
    """
    if spec.placement.policy != "load-balanced":
        return None
    meta = body["metadata"]
    cm = raw_or_none(
        core.read_namespaced_config_map, expert_load_configmap_name(meta["name"]), meta["namespace"]
    )
    if cm is None:
        return None
    try:
        return parse_expert_load((cm.get("data") or {}).get(LOAD_KEY, ""), spec) or None
    except ValueError as exc:
        logger.warning("ignoring expert load: %s", exc)
        event(body, "InvalidExpertLoad", str(exc), warning=True)
        return None


def placement_load(
    state: OperatorState,
    core: k8s.CoreV1Api,
    body: dict[str, Any],
    spec: ExpertPoolSpec,
    logger: kopf.Logger,
) -> dict[LayerExpert, float] | None:
    """Expert load for ``load-balanced`` placement: the ConfigMap ``<pool>-expert-load`` when it
    exists (an override, :func:`read_load`), else the load measured from the servers, as a
    snapshot renewed at most once per load window; None for round-robin or nothing measured."""
    override = read_load(core, body, spec, logger)
    if override is not None or spec.placement.policy != "load-balanced" or state.scraper is None:
        return override
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    memory = state.pool(*key)
    held = memory.placement_load
    if held is None or time.monotonic() - held[0] >= state.scraper.window_s:
        measured = pool_rates(state.scraper.load(key).per_server)
        if measured:
            held = memory.placement_load = (time.monotonic(), measured)
    return dict(held[1]) if held else None


def load_status(state: OperatorState, namespace: str, pool: str) -> dict[str, Any]:
    """``{"load": <summary>}`` for the pool's status; ``{"load": None}`` (the merge patch
    removes it) while nothing is measured, so a stale summary never stays."""
    load = state.scraper.load((namespace, pool)) if state.scraper is not None else None
    return {"load": load.summary() if load is not None and load.per_server else None}


def pool_load(state: OperatorState, namespace: str, pool: str) -> tuple[float, float] | None:
    """``(tokens/s, window s)`` of a pool for the external metrics API, or None (not measured)."""
    if state.scraper is None:
        return None
    load = state.scraper.load((namespace, pool))
    total = load.total()
    return None if total is None else (total, load.window_s)


def ensure_hpa(
    state: OperatorState,
    body: dict[str, Any],
    owner: Owner,
    spec: ExpertPoolSpec,
    logger: kopf.Logger,
) -> None:
    """Create/patch the operator-owned HPA of a pool with ``spec.autoscaling``; delete the one
    it made (label ``eaas.io/managed-hpa``) when autoscaling is unset. A user-made HPA of the
    same name (no such label) is left alone, with a Warning event. While this operator serves no
    external metrics API, an ``AutoscalerNoMetrics`` Warning event says the HPA cannot get its
    metric (again at most every :data:`RBAC_RECHECK_S`).

    Raises:
        ApiException: any API error but 404 on the read.
    """
    want = hpa_manifest(owner, spec)
    name = hpa_name(owner.name)
    key = (owner.namespace, "HorizontalPodAutoscaler", name, json.dumps(want, sort_keys=True))
    if time.monotonic() - state.applied.get(key, -1e18) < RBAC_RECHECK_S:
        return  # checked recently with the same spec: save a GET per pool per step
    hpa_api = k8s.AutoscalingV2Api(state.api())
    live = raw_or_none(hpa_api.read_namespaced_horizontal_pod_autoscaler, name, owner.namespace)
    managed = live is not None and (live["metadata"].get("labels") or {}).get(LABEL_MANAGED)
    if want is None:
        if managed:
            hpa_api.delete_namespaced_horizontal_pod_autoscaler(name, owner.namespace)
            logger.info("deleted HPA %s (spec.autoscaling unset)", name)
        state.applied[key] = time.monotonic()
        return
    a = spec.autoscaling
    assert a is not None  # want is None without it
    if live is None:
        hpa_api.create_namespaced_horizontal_pod_autoscaler(
            owner.namespace, k8s.V2HorizontalPodAutoscaler.model_validate(want)
        )
        event(
            body,
            "AutoscalerCreated",
            f"HPA {name}: {a.min_replicas}-{a.max_replicas} servers, target "
            f"{a.target_load_per_server} tokens/s per server on metric eaas_expert_load",
        )
    elif not managed:
        event(
            body,
            "AutoscalerConflict",
            f"HPA {name} exists and was not made by the operator; spec.autoscaling is not applied",
            warning=True,
        )
    elif hpa_differs(live, want):
        hpa_api.patch_namespaced_horizontal_pod_autoscaler(name, owner.namespace, want)
    if live is None or managed:  # an HPA of ours: say when nothing serves its metric
        problem = hpa_metrics_warning(owner.name, state.metrics_runner is not None)
        if problem:
            logger.warning("%s", problem)
            event(body, "AutoscalerNoMetrics", problem, warning=True)
    state.applied[key] = time.monotonic()


async def start_external_metrics(state: OperatorState) -> Any:
    """Serve the external metrics API on ``settings.metrics_api.listen`` with its serving
    certificate (``cert_file`` / ``key_file``), client certificates checked against the
    apiserver's request-header CA. Returns the listener (aiohttp ``AppRunner``).

    Raises:
        ValueError: the certificate settings are unset, or the cluster has no aggregation
            layer (:func:`eaas.operator.external_metrics.read_front_proxy_auth`).
    """
    s = state.settings.metrics_api
    if not s.cert_file or not s.key_file:
        raise ValueError(
            "EAAS_OPERATOR_METRICS_LISTEN needs EAAS_OPERATOR_METRICS_CERT_FILE and "
            "EAAS_OPERATOR_METRICS_KEY_FILE (the serving certificate the APIService trusts)"
        )
    ca, allowed = await asyncio.to_thread(read_front_proxy_auth, k8s.CoreV1Api(state.api()))
    return await start_metrics_server(
        s.listen,
        s.cert_file,
        s.key_file,
        ca,
        allowed,
        lambda ns, pool: pool_load(state, ns, pool),
        state.is_leader,
    )
