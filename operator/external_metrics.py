"""Expert load through the aggregated external metrics API, and the HPA that uses it.

The operator serves ``external.metrics.k8s.io/v1beta1`` itself (no Prometheus needed): the
kube-apiserver's aggregation layer proxies

    GET /apis/external.metrics.k8s.io/v1beta1/namespaces/<ns>/eaas_expert_load
        ?labelSelector=eaas.io/pool=<pool>

to the operator's HTTPS listener (APIService ``v1beta1.external.metrics.k8s.io``; upstream doc:
https://kubernetes.io/docs/tasks/extend-kubernetes/configure-aggregation-layer/ and the
``k8s.io/metrics`` external metrics types). The answer is an ``ExternalMetricValueList`` with one
item: the pool's expert load in tokens per second, summed over its servers
(:class:`eaas.operator.load.PoolLoad`).

``spec.autoscaling`` makes the operator own an ``autoscaling/v2`` HorizontalPodAutoscaler
(:func:`hpa_manifest`) on the pool's scale subresource with that External metric and an
``AverageValue`` target of ``targetLoadPerServer``: the HPA controller computes
``desired = ceil(pool load / targetLoadPerServer)``.

**A missing metric holds the replica count.** When the operator has no rate for the pool (fewer
than two scrapes in the window, every scrape failing, a standby operator, an unknown pool) it
answers with an empty ``items`` list (or 503 on a standby). The HPA controller then fails to
get the metric, sets ``ScalingActive=False`` (reason ``FailedGetExternalMetric``) and leaves
``spec.replicas`` unchanged — it never scales down on an absent metric. A measured load of 0
(no traffic) is a real value and scales down to ``minReplicas``.

Authentication: the listener requires the aggregator's client certificate (the kube-apiserver's
``--proxy-client-cert-file``), verified against the request-header CA and allowed names that
the apiserver publishes in ConfigMap ``kube-system/extension-apiserver-authentication``; the
kube-apiserver has authorized the user before it proxies. Pure parts: :func:`parse_selector`,
:func:`metric_answer`, :func:`hpa_manifest`, :func:`front_proxy_allowed`.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import ssl
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from eaas.operator.crd import API_VERSION, LABEL_POOL, ExpertPoolSpec
from eaas.operator.names import Owner

log = logging.getLogger("eaas.operator.external_metrics")

GROUP = "external.metrics.k8s.io"
VERSION = "v1beta1"
GROUP_VERSION = f"{GROUP}/{VERSION}"
#: The External metric: a pool's expert load (tokens/s summed over its servers).
METRIC_NAME = "eaas_expert_load"
#: Label the operator-owned HPA carries (to find and delete it when autoscaling is unset).
LABEL_MANAGED = "eaas.io/managed-hpa"
#: ConfigMap where the kube-apiserver publishes its request-header (front proxy) settings.
AUTH_CONFIGMAP = ("kube-system", "extension-apiserver-authentication")


# ---------------------------------------------------------------------------------------------
# pure: selectors, answers, the HPA
# ---------------------------------------------------------------------------------------------
def parse_selector(selector: str) -> dict[str, str]:
    """Equality-based label selector (``k=v``, ``k==v``, comma-separated) -> dict.

    Raises:
        ValueError: set-based or negative terms (``in``, ``!=``, ``!k``, bare keys).
    """
    out: dict[str, str] = {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term or " in " in term or " notin " in term or "=" not in term:
            raise ValueError(
                f"labelSelector term {term!r}: only equality terms (key=value) are supported"
            )
        key, _, value = term.partition("==") if "==" in term else term.partition("=")
        out[key.strip()] = value.strip()
    return out


def quantity(value: float) -> str:
    """A Kubernetes quantity in milli-units (``12.5`` -> ``"12500m"``)."""
    return f"{int(round(value * 1000))}m"


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def api_resource_list() -> dict[str, Any]:
    """Discovery document of ``/apis/external.metrics.k8s.io/v1beta1``."""
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": GROUP_VERSION,
        "resources": [
            {
                "name": METRIC_NAME,
                "singularName": "",
                "namespaced": True,
                "kind": "ExternalMetricValueList",
                "verbs": ["get"],
            }
        ],
    }


def api_group() -> dict[str, Any]:
    """Discovery document of ``/apis/external.metrics.k8s.io``."""
    gv = {"groupVersion": GROUP_VERSION, "version": VERSION}
    return {
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": GROUP,
        "versions": [gv],
        "preferredVersion": gv,
    }


def metric_answer(
    namespace: str,
    metric: str,
    selector: str,
    pool_load: Callable[[str, str], tuple[float, float] | None],
    now: _dt.datetime,
) -> tuple[int, dict[str, Any]]:
    """The answer to ``GET .../namespaces/<namespace>/<metric>?labelSelector=<selector>``.

    Args:
        pool_load: ``(namespace, pool) -> (tokens/s, window s)``, or None when the pool has no
            measured load.
        now: the sample's timestamp.

    Returns:
        ``(HTTP status, JSON body)``: 200 with an ``ExternalMetricValueList`` (one item, or
        none when the load is unknown: the HPA then holds the count); 404 for another metric
        name; 400 for a selector that names no ``eaas.io/pool`` or is not equality-based.
    """
    if metric != METRIC_NAME:
        return 404, _status(
            404, "NotFound", f"external metric {metric!r} not served (only {METRIC_NAME!r})"
        )
    try:
        labels = parse_selector(selector)
    except ValueError as exc:
        return 400, _status(400, "BadRequest", str(exc))
    pool = labels.get(LABEL_POOL)
    if not pool:
        return 400, _status(
            400, "BadRequest", f"labelSelector must name the pool: {LABEL_POOL}=<ExpertPool name>"
        )
    body: dict[str, Any] = {
        "kind": "ExternalMetricValueList",
        "apiVersion": GROUP_VERSION,
        "metadata": {},
        "items": [],
    }
    got = pool_load(namespace, pool)
    if got is not None:
        value, window = got
        body["items"].append(
            {
                "metricName": METRIC_NAME,
                "metricLabels": {LABEL_POOL: pool},
                "timestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
                "window": int(round(window)),
                "value": quantity(value),
            }
        )
    return 200, body


def hpa_name(pool: str) -> str:
    """The operator-owned HPA's name: the pool's."""
    return pool


def hpa_manifest(owner: Owner, spec: ExpertPoolSpec) -> dict[str, Any] | None:
    """The ``autoscaling/v2`` HorizontalPodAutoscaler of a pool with ``spec.autoscaling``, or
    None without it. Owned by the pool (garbage-collected with it), labelled
    :data:`LABEL_MANAGED`. Scale-up is immediate; scale-down waits
    ``scaleDownStabilizationSeconds``."""
    a = spec.autoscaling
    if a is None:
        return None
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {
            "name": hpa_name(owner.name),
            "namespace": owner.namespace,
            "labels": {LABEL_POOL: owner.name, LABEL_MANAGED: "true"},
            "ownerReferences": [owner.reference()],
        },
        "spec": {
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": "ExpertPool", "name": owner.name},
            "minReplicas": a.min_replicas,
            "maxReplicas": a.max_replicas,
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {
                            "name": METRIC_NAME,
                            "selector": {"matchLabels": {LABEL_POOL: owner.name}},
                        },
                        "target": {
                            "type": "AverageValue",
                            "averageValue": str(a.target_load_per_server),
                        },
                    },
                }
            ],
            "behavior": {
                "scaleDown": {"stabilizationWindowSeconds": a.scale_down_stabilization_seconds},
                "scaleUp": {"stabilizationWindowSeconds": 0},
            },
        },
    }


def hpa_metrics_warning(pool: str, metrics_served: bool) -> str | None:
    """Why the operator-owned HPA of ``pool`` cannot get its metric, or None when this operator
    serves the external metrics API (``metrics_served``: ``EAAS_OPERATOR_METRICS_LISTEN`` is set
    and the listener started). Without it the HPA's every metric fetch fails and it holds the
    pool's replica count (ScalingActive False), so the operator says so in a Warning event."""
    if metrics_served:
        return None
    return (
        f"HPA {hpa_name(pool)} cannot get metric {METRIC_NAME}: this operator does not serve the "
        "external metrics API (EAAS_OPERATOR_METRICS_LISTEN unset; Helm: "
        "externalMetrics.enabled=true), so the HPA holds the replica count"
    )


def hpa_differs(live: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    """Whether the live HPA's spec fields the operator sets differ from ``want``'s."""
    ls, ws = live.get("spec") or {}, want["spec"]
    if any(ls.get(k) != ws[k] for k in ("scaleTargetRef", "minReplicas", "maxReplicas")):
        return True
    if ls.get("metrics") != ws["metrics"]:
        return True
    lb = ls.get("behavior") or {}
    return any(
        (lb.get(k) or {}).get("stabilizationWindowSeconds")
        != ws["behavior"][k]["stabilizationWindowSeconds"]
        for k in ("scaleDown", "scaleUp")
    )


def front_proxy_allowed(subject_cn: str, allowed_names: list[str]) -> bool:
    """Whether a verified client certificate's CN may act as the front proxy: any CN when
    ``allowed_names`` is empty (the apiserver's rule), else one of them."""
    return not allowed_names or subject_cn in allowed_names


def _peer_cn(peercert: Mapping[str, Any] | None) -> str:
    for rdn in (peercert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


# ---------------------------------------------------------------------------------------------
# I/O: the HTTPS listener (aiohttp, in kopf's event loop)
# ---------------------------------------------------------------------------------------------
def server_ssl_context(cert_file: str, key_file: str, client_ca_pem: str) -> ssl.SSLContext:
    """TLS server context: our serving certificate, client certificates required and verified
    against ``client_ca_pem`` (the request-header CA).

    Raises:
        ssl.SSLError, OSError: unreadable or mismatched files, a bad CA.
    """
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_file, key_file)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(cadata=client_ca_pem)
    return ctx


def read_front_proxy_auth(core: Any) -> tuple[str, list[str]]:
    """``(request-header CA PEM, allowed names)`` from ConfigMap
    ``kube-system/extension-apiserver-authentication``.

    Raises:
        kubernetes.client.rest.ApiException: the ConfigMap cannot be read (RBAC: the operator
            needs Role ``kube-system/extension-apiserver-authentication-reader``).
        ValueError: the apiserver has no ``--requestheader-client-ca-file``.
    """
    cm = core.read_namespaced_config_map(AUTH_CONFIGMAP[1], AUTH_CONFIGMAP[0])
    data = cm.data or {}
    ca = data.get("requestheader-client-ca-file", "")
    if not ca.strip():
        raise ValueError(
            "kube-apiserver publishes no requestheader-client-ca-file: the aggregation layer is "
            "not configured (--requestheader-client-ca-file, --proxy-client-cert-file)"
        )
    names = json.loads(data.get("requestheader-allowed-names", "[]") or "[]")
    return ca, list(names)


async def start_server(
    listen: str,
    cert_file: str,
    key_file: str,
    client_ca_pem: str,
    allowed_names: list[str],
    pool_load: Callable[[str, str], tuple[float, float] | None],
    is_leader: Callable[[], bool],
) -> Any:
    """Serve the external metrics API on ``listen`` (``HOST:PORT``) over TLS; returns the
    aiohttp ``AppRunner`` (``await runner.cleanup()`` stops it).

    Raises:
        ValueError: ``listen`` is not ``HOST:PORT``.
        ssl.SSLError, OSError: as :func:`server_ssl_context`; the port is taken.
    """
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"EAAS_OPERATOR_METRICS_LISTEN must be HOST:PORT, got {listen!r}")
    ctx = server_ssl_context(cert_file, key_file, client_ca_pem)

    @web.middleware
    async def front_proxy_only(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path in ("/healthz", "/readyz", "/livez"):
            return await handler(request)
        cn = _peer_cn(request.transport.get_extra_info("peercert") if request.transport else None)
        if not front_proxy_allowed(cn, allowed_names):
            return web.json_response(
                _status(403, "Forbidden", f"client certificate CN {cn!r} is not a front proxy"),
                status=403,
            )
        return await handler(request)

    app = web.Application(middlewares=[front_proxy_only])

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def group_list(_: web.Request) -> web.Response:
        return web.json_response(
            {"kind": "APIGroupList", "apiVersion": "v1", "groups": [api_group()]}
        )

    async def group(_: web.Request) -> web.Response:
        return web.json_response(api_group())

    async def resources(_: web.Request) -> web.Response:
        return web.json_response(api_resource_list())

    async def metric(request: web.Request) -> web.Response:
        if not is_leader():
            return web.json_response(
                _status(503, "ServiceUnavailable", "standby operator: no expert load here"),
                status=503,
            )
        code, body = metric_answer(
            request.match_info["namespace"],
            request.match_info["metric"],
            request.query.get("labelSelector", ""),
            pool_load,
            _dt.datetime.now(_dt.timezone.utc),
        )
        return web.json_response(body, status=code)

    for path in ("/healthz", "/readyz", "/livez"):
        app.router.add_get(path, ok)
    app.router.add_get("/apis", group_list)
    app.router.add_get(f"/apis/{GROUP}", group)
    app.router.add_get(f"/apis/{GROUP_VERSION}", resources)
    app.router.add_get(f"/apis/{GROUP_VERSION}/namespaces/{{namespace}}/{{metric}}", metric)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host or "0.0.0.0", int(port), ssl_context=ctx).start()
    log.info("external metrics API served on https://%s/apis/%s", listen, GROUP_VERSION)
    return runner
