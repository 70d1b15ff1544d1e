"""External metrics API answers and the operator-owned HPA, pure parts."""

from __future__ import annotations

import datetime as dt

import pytest

from eaas.operator.crd import ExpertPoolSpec, expertpool_crd
from eaas.operator.external_metrics import (
    METRIC_NAME,
    api_resource_list,
    front_proxy_allowed,
    hpa_differs,
    hpa_manifest,
    hpa_metrics_warning,
    metric_answer,
    parse_selector,
    quantity,
)
from eaas.operator.names import Owner

from helpers.common import free_port

pytestmark = pytest.mark.elastic

NOW = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
OWNER = Owner(kind="ExpertPool", name="tiny", namespace="ns", uid="u-1", generation=3)


def loads(table):
    return lambda ns, pool: table.get((ns, pool))


def test_metric_value_is_the_pools_load_in_milli_units():
    code, body = metric_answer(
        "ns", METRIC_NAME, "eaas.io/pool=tiny", loads({("ns", "tiny"): (123.4567, 30.0)}), NOW
    )
    assert code == 200
    assert body["kind"] == "ExternalMetricValueList"
    assert body["apiVersion"] == "external.metrics.k8s.io/v1beta1"
    assert body["items"] == [
        {
            "metricName": METRIC_NAME,
            "metricLabels": {"eaas.io/pool": "tiny"},
            "timestamp": "2026-01-02T03:04:05Z",
            "window": 30,
            "value": "123457m",
        }
    ]


def test_unknown_load_is_an_empty_list_so_the_hpa_holds():
    # the HPA controller gets "no metrics returned" -> ScalingActive=False, replicas unchanged
    code, body = metric_answer("ns", METRIC_NAME, "eaas.io/pool=tiny", loads({}), NOW)
    assert code == 200 and body["items"] == []
    # another namespace's pool of the same name is not this one
    code, body = metric_answer(
        "other", METRIC_NAME, "eaas.io/pool=tiny", loads({("ns", "tiny"): (1.0, 30.0)}), NOW
    )
    assert body["items"] == []


def test_bad_requests_are_clear():
    code, body = metric_answer("ns", "cpu", "eaas.io/pool=tiny", loads({}), NOW)
    assert code == 404 and body["kind"] == "Status" and METRIC_NAME in body["message"]
    code, body = metric_answer("ns", METRIC_NAME, "", loads({}), NOW)
    assert code == 400 and "eaas.io/pool" in body["message"]
    code, body = metric_answer("ns", METRIC_NAME, "eaas.io/pool in (a,b)", loads({}), NOW)
    assert code == 400 and "equality" in body["message"]


def test_parse_selector_and_quantity():
    assert parse_selector("eaas.io/pool=tiny, a==b") == {"eaas.io/pool": "tiny", "a": "b"}
    assert parse_selector("") == {}
    for bad in ("a!=b", "!a", "a"):
        with pytest.raises(ValueError):
            parse_selector(bad)
    assert quantity(0) == "0m" and quantity(1.5) == "1500m"


def test_discovery_lists_the_metric():
    (res,) = api_resource_list()["resources"]
    assert res["name"] == METRIC_NAME and res["namespaced"] and res["verbs"] == ["get"]


def spec(**autoscaling):
    body = {"model": {"uri": "/m", "numMoeLayers": 2, "numExperts": 8}, "replicas": 2}
    if autoscaling:
        body["autoscaling"] = autoscaling
    return ExpertPoolSpec.model_validate(body)


def test_hpa_targets_the_scale_subresource_with_the_external_metric():
    assert hpa_manifest(OWNER, spec()) is None
    hpa = hpa_manifest(
        OWNER,
        spec(
            minReplicas=2,
            maxReplicas=6,
            targetLoadPerServer=400,
            scaleDownStabilizationSeconds=15,
        ),
    )
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert hpa["metadata"]["labels"]["eaas.io/managed-hpa"] == "true"
    s = hpa["spec"]
    assert s["scaleTargetRef"] == {
        "apiVersion": "eaas.io/v1alpha1",
        "kind": "ExpertPool",
        "name": "tiny",
    }
    assert (s["minReplicas"], s["maxReplicas"]) == (2, 6)
    (m,) = s["metrics"]
    assert m["type"] == "External"
    assert m["external"]["metric"] == {
        "name": METRIC_NAME,
        "selector": {"matchLabels": {"eaas.io/pool": "tiny"}},
    }
    assert m["external"]["target"] == {"type": "AverageValue", "averageValue": "400"}
    assert s["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 15


def test_hpa_without_a_metrics_listener_gets_a_warning():
    assert hpa_metrics_warning("tiny", metrics_served=True) is None
    msg = hpa_metrics_warning("tiny", metrics_served=False)
    assert msg is not None
    for part in ("HPA tiny", METRIC_NAME, "EAAS_OPERATOR_METRICS_LISTEN", "externalMetrics"):
        assert part in msg, (part, msg)


def test_hpa_differs_only_on_fields_the_operator_sets():
    want = hpa_manifest(OWNER, spec(minReplicas=2, maxReplicas=6, targetLoadPerServer=400))
    # the API server adds defaults (policies, selectPolicy) and status: not a difference
    live = {
        "metadata": {},
        "spec": {
            **want["spec"],
            "behavior": {
                "scaleDown": {"stabilizationWindowSeconds": 300, "selectPolicy": "Max"},
                "scaleUp": {"stabilizationWindowSeconds": 0, "policies": []},
            },
        },
        "status": {"currentReplicas": 3},
    }
    assert not hpa_differs(live, want)
    assert hpa_differs({**live, "spec": {**live["spec"], "maxReplicas": 9}}, want)


def test_front_proxy_names():
    assert front_proxy_allowed("front-proxy-client", ["front-proxy-client"])
    assert not front_proxy_allowed("someone", ["front-proxy-client"])
    assert front_proxy_allowed("anyone", [])


def test_crd_autoscaling_schema_and_rules():
    root = expertpool_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    auto = root["properties"]["spec"]["properties"]["autoscaling"]
    assert set(auto["required"]) == {"minReplicas", "maxReplicas", "targetLoadPerServer"}
    assert auto["properties"]["scaleDownStabilizationSeconds"]["default"] == 300
    rules = [r["rule"] for r in auto["x-kubernetes-validations"]]
    assert "self.minReplicas <= self.maxReplicas" in rules
    pool_rules = [r["rule"] for r in root["properties"]["spec"]["x-kubernetes-validations"]]
    assert any("autoscaling.minReplicas" in r for r in pool_rules)
    status = root["properties"]["status"]["properties"]
    assert "hottestExperts" in status["load"]["properties"]


def test_listener_serves_tls_and_accepts_only_the_front_proxy(tmp_path):
    """The real listener: TLS with our serving certificate; the aggregator's client certificate
    (signed by the request-header CA, CN in the allowed names) gets the metric; no client
    certificate fails the handshake; another CN gets 403; a standby answers 503."""
    import asyncio
    import json
    import ssl
    import threading
    import urllib.error
    import urllib.request

    from eaas.operator.external_metrics import start_server
    from eaas.testbed import pki

    paths = pki.make_pki(tmp_path, "10.96.0.1")  # CA, apiserver (serving), admin, front proxy
    ca_pem = paths["ca_crt"].read_text()
    port = free_port()
    leader = {"yes": True}
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    runner = asyncio.run_coroutine_threadsafe(
        start_server(
            f"127.0.0.1:{port}",
            str(paths["apiserver_crt"]),
            str(paths["apiserver_key"]),
            ca_pem,
            ["front-proxy-client"],
            loads({("ns", "tiny"): (42.0, 30.0)}),
            lambda: leader["yes"],
        ),
        loop,
    ).result(timeout=60)
    url = (
        f"https://127.0.0.1:{port}/apis/external.metrics.k8s.io/v1beta1/namespaces/ns/"
        f"{METRIC_NAME}?labelSelector=eaas.io%2Fpool%3Dtiny"
    )

    def client(cert: str | None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(paths["ca_crt"]))
        if cert:
            ctx.load_cert_chain(str(paths[f"{cert}_crt"]), str(paths[f"{cert}_key"]))
        return ctx

    def get(cert: str | None, u: str = url) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(u, context=client(cert), timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    try:
        code, body = get("front_proxy_client")
        assert code == 200 and body["items"][0]["value"] == "42000m"
        code, body = get("front_proxy_client", url.split("/namespaces")[0])
        assert code == 200 and body["resources"][0]["name"] == METRIC_NAME
        code, body = get("admin")  # signed by the CA, but not the front proxy
        assert code == 403 and "front proxy" in body["message"]
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            get(None)
        leader["yes"] = False
        code, body = get("front_proxy_client")
        assert code == 503 and "standby" in body["message"]
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
