"""Expert load and autoscaling on it, on process nodes.

One pool (tiny model, 2 servers, ``spec.autoscaling`` 2-3 servers at 1 token/s per server, no
scale-down stabilization) and one attention client, with the operator run as a local process
that serves ``external.metrics.k8s.io`` through the testbed's aggregation layer
(:mod:`eaas.testbed.metrics_api`). In order:

1. the measured load is served: the operator-owned HPA reports AbleToScale and ScalingActive
   True (at 0 tokens/s it stays at minReplicas);
2. completions: ``status.load`` shows tokens/s, per-server max/mean and the hottest experts;
   the real HPA controller scales the pool up to 3 and the third server turns Ready;
3. a missing metric holds the count: with the operator stopped (API unavailable) and then
   restarted with a long scrape interval (15 s: the API answers an empty list for about 30 s),
   the HPA fails to get the metric on several syncs (kube-controller-manager's own counter of
   failed metric computations) and ``spec.replicas`` stays 3; once the (idle) load is measured
   again, the HPA scales down to 2 — the hold came from the missing metric, not from idleness;
4. ``spec.autoscaling`` removed: the operator deletes its HPA; ``kubectl autoscale
   expertpool/tiny`` makes one that reads the pool's scale subresource (AbleToScale).
"""

from __future__ import annotations

import json
import re
import ssl
import threading
import time
import urllib.request
import uuid

import openai
import pytest

from eaas.testbed.metrics_api import APISERVICE, register_external_metrics

from helpers.common import free_port
from helpers.faults import apply_tiny_pool_and_fleet
from helpers.k8s import (
    Operator,
    apply_crds,
    get,
    get_json,
    kubectl,
    wait_for,
    wait_namespaces_deleted,
)

pytestmark = pytest.mark.elastic

FAST = {"EAAS_OPERATOR_LOAD_SCRAPE_S": "2", "EAAS_OPERATOR_LOAD_WINDOW_S": "10"}
# first rate only after two scrape rounds that have the pool's servers as targets, 15 s apart
# (the round at start has none yet): about 30 s after the restart. The metric is missing (an
# empty list) meanwhile; the checks below need about 15 s of it (the HPA, syncing every 3 s on
# the testbed, sees the empty list, then fails to get the metric on 3 more syncs).
SLOW = {"EAAS_OPERATOR_LOAD_SCRAPE_S": "15", "EAAS_OPERATOR_LOAD_WINDOW_S": "30"}


def hpa_conditions(ns: str) -> dict[str, dict]:
    hpa = get("hpa", "tiny", ns) or {}
    return {c["type"]: c for c in (hpa.get("status") or {}).get("conditions") or []}


def failed_metric_fetches(tb) -> float:
    """Failed External metric computations of the HPA controller: kube-controller-manager's own
    counter ``horizontal_pod_autoscaler_controller_metric_computation_total{action="none",
    error="internal",metric_type="External"}`` (one per HPA sync that could not get the metric;
    Events are no count: the recorder's spam filter drops them after a burst)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the controller-manager's self-signed serving cert
    pki = tb.state_dir / "pki"
    ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    url = f"https://127.0.0.1:{tb.ports['controller_manager']}/metrics"
    with urllib.request.urlopen(url, context=ctx, timeout=30) as r:
        text = r.read().decode()
    m = re.search(
        r'^horizontal_pod_autoscaler_controller_metric_computation_total\{action="none",'
        r'error="internal",metric_type="External"\} (\S+)$',
        text,
        re.M,
    )
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def setup(cluster, tmp_path_factory):
    apply_crds()
    port = free_port()
    env = register_external_metrics(cluster, "127.0.0.1", port)
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    op = Operator(log, env={**env, **FAST})
    op.start()
    state = {"op": op, "env": env, "log": log, "tb": cluster}
    yield state
    wait_namespaces_deleted()  # while the operator runs: it removes the pools' finalizers
    state["op"].stop()  # the test replaces the operator (step 3): stop the one running now
    # the tier's next modules share the testbed: an APIService whose backend is gone makes API
    # discovery (kubectl, helm) report errors
    kubectl("delete", "apiservice", APISERVICE, "--ignore-not-found")


def test_load_status_and_hpa_scale_up_then_missing_metric_holds(setup):
    ns = f"t-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", ns)
    apply_tiny_pool_and_fleet(
        ns,
        servers=2,
        pool_spec={
            "autoscaling": {
                "minReplicas": 2,
                "maxReplicas": 3,
                "targetLoadPerServer": 1,
                "scaleDownStabilizationSeconds": 0,
            }
        },
    )
    stop = threading.Event()
    failures: list[str] = []
    try:
        # ---- 1. the metric is served; the HPA is active and holds minReplicas at no load ------
        wait_for(
            "fleet serving",
            lambda: (
                ((get("attentionfleet", "clients", ns) or {}).get("status") or {}).get(
                    "clientsAcknowledged"
                )
                == 1
            ),
            timeout=300,
            interval=1,
        )
        hpa = get("hpa", "tiny", ns)
        assert hpa is not None, "operator-owned HPA missing"
        assert hpa["metadata"]["ownerReferences"][0]["kind"] == "ExpertPool"
        # this operator serves the metric: the event of the HPA's creation, and no warning
        # (AutoscalerNoMetrics would be posted by the same step that made the HPA)
        reasons = wait_for(
            "AutoscalerCreated event",
            lambda: (
                (
                    r := {
                        e["reason"]
                        for e in get_json(
                            "events", "-n", ns, "--field-selector", "involvedObject.kind=ExpertPool"
                        )["items"]
                    }
                )
                and "AutoscalerCreated" in r
                and r
            ),
            timeout=60,
        )
        assert "AutoscalerNoMetrics" not in reasons, reasons
        raw = wait_for(
            "external metric served",
            lambda: (
                (
                    r := kubectl(
                        "get",
                        "--raw",
                        f"/apis/external.metrics.k8s.io/v1beta1/namespaces/{ns}/eaas_expert_load"
                        "?labelSelector=eaas.io%2Fpool%3Dtiny",
                        check=False,
                    )
                ).returncode
                == 0
                and json.loads(r.stdout)["items"]
                and json.loads(r.stdout)
            ),
            timeout=120,
            interval=1,
        )
        assert raw["items"][0]["metricLabels"] == {"eaas.io/pool": "tiny"}
        conds = wait_for(
            "HPA AbleToScale and ScalingActive",
            lambda: (
                (c := hpa_conditions(ns)).get("AbleToScale", {}).get("status") == "True"
                and c.get("ScalingActive", {}).get("status") == "True"
                and c
            ),
            timeout=120,
            interval=1,
        )
        print(f"\n[measure] HPA conditions: { {k: v['reason'] for k, v in conds.items()} }")
        assert get("expertpool", "tiny", ns)["spec"]["replicas"] == 2

        # ---- 2. load: status shows it; the real HPA controller scales up ----------------------
        ip = wait_for(
            "client pod IP",
            lambda: next(
                (
                    p["status"].get("podIP")
                    for p in get_json("pods", "-n", ns, "-l", "eaas.io/fleet=clients")["items"]
                    if p["status"].get("podIP")
                ),
                None,
            ),
            timeout=60,
        )
        api = openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key="unused", timeout=120)
        model_id = api.models.list().data[0].id

        def traffic() -> None:
            while not stop.is_set():
                try:
                    out = api.completions.create(
                        model=model_id, prompt="Hello there", max_tokens=16, temperature=0
                    )
                    if out.usage.completion_tokens != 16:
                        failures.append(f"short completion: {out.usage}")
                except Exception as exc:  # every failure is reported by the assertion below
                    failures.append(repr(exc))

        threads = [threading.Thread(target=traffic, daemon=True) for _ in range(2)]
        t_traffic = time.monotonic()
        for t in threads:
            t.start()

        def loaded():
            st = (get("expertpool", "tiny", ns) or {}).get("status") or {}
            load = st.get("load") or {}
            return load if load.get("totalTokensPerSecond", 0) > 0 else None

        load = wait_for("status.load with tokens/s", loaded, timeout=120, interval=1)
        print(f"[measure] status.load under traffic: {load}")
        assert load["servers"] >= 2 and load["windowSeconds"] == 10
        assert 0 < load["serverMeanTokensPerSecond"] <= load["serverMaxTokensPerSecond"]
        assert load["hottestExperts"] and load["hottestExperts"][0].startswith("L")
        assert 0 < load["balancedness"] <= 1
        wait_for(
            "HPA scales the pool up to 3",
            lambda: get("expertpool", "tiny", ns)["spec"]["replicas"] == 3,
            timeout=120,
            interval=1,
        )
        t_up = time.monotonic() - t_traffic
        wait_for(
            "3 Ready servers",
            lambda: (get("expertpool", "tiny", ns).get("status") or {}).get("readyReplicas") == 3,
            timeout=180,
            interval=1,
        )
        print(
            f"[measure] traffic -> HPA sets 3 replicas {t_up:.1f}s, -> 3 Ready servers "
            f"{time.monotonic() - t_traffic:.1f}s"
        )

        # ---- 3. a missing metric holds the count ----------------------------------------------
        t_hold = time.monotonic()
        setup["op"].stop()  # the external metrics API is unavailable
        stop.set()
        for t in threads:
            t.join(timeout=150)
        assert not failures, failures[:5]
        tb = setup["tb"]
        before = failed_metric_fetches(tb)
        wait_for(
            "3 failed metric fetches with the API down",
            lambda: failed_metric_fetches(tb) >= before + 3,
            timeout=120,
            interval=1,
        )
        assert get("expertpool", "tiny", ns)["spec"]["replicas"] == 3
        conds = hpa_conditions(ns)
        assert conds["ScalingActive"]["status"] == "False", conds
        assert conds["ScalingActive"]["reason"] == "FailedGetExternalMetric", conds

        op = Operator(setup["log"], env={**setup["env"], **SLOW})
        setup["op"] = op
        op.start()  # serves, but has no rate for ~30 s: an empty list
        wait_for(
            "HPA sees an empty metric list",
            lambda: (
                "no metrics returned"
                in hpa_conditions(ns).get("ScalingActive", {}).get("message", "")
            ),
            timeout=60,
            interval=0.5,
        )
        before = failed_metric_fetches(tb)
        wait_for(
            "3 more failed metric fetches (empty answers)",
            lambda: failed_metric_fetches(tb) >= before + 3,
            timeout=60,
            interval=1,
        )
        assert get("expertpool", "tiny", ns)["spec"]["replicas"] == 3
        held = time.monotonic() - t_hold
        wait_for(
            "idle load measured again: HPA scales down to minReplicas",
            lambda: get("expertpool", "tiny", ns)["spec"]["replicas"] == 2,
            timeout=180,
            interval=1,
        )
        print(
            f"[measure] metric missing: count held at 3 for >= {held:.1f}s; idle load measured "
            f"-> scaled to 2 after {time.monotonic() - t_hold:.1f}s"
        )

        # ---- 4. autoscaling unset: the operator deletes its HPA; `kubectl autoscale` works -----
        kubectl(
            "patch",
            "expertpool",
            "tiny",
            "-n",
            ns,
            "--type=json",
            "-p",
            '[{"op": "remove", "path": "/spec/autoscaling"}]',
        )
        wait_for("operator deletes its HPA", lambda: get("hpa", "tiny", ns) is None, timeout=90)
        kubectl("autoscale", "expertpool/tiny", "-n", ns, "--min=2", "--max=3", "--cpu=50%")
        user_hpa = get("hpa", "tiny", ns)
        assert user_hpa["spec"]["scaleTargetRef"]["kind"] == "ExpertPool"
        wait_for(
            "a kubectl-autoscale HPA can read the pool's scale subresource",
            lambda: hpa_conditions(ns).get("AbleToScale", {}).get("status") == "True",
            timeout=60,
            interval=1,
        )
        assert "eaas.io/managed-hpa" not in (user_hpa["metadata"].get("labels") or {})
    finally:
        stop.set()
        kubectl("delete", "namespace", ns, "--wait=false", check=False)
