"""The pure parts of keeping the operator's per-event work small: the work counters, kopf's
small diff-base, the quiet watch-handler logs, which pod events wake a pool, when a load-driven
pool steps. (The counted work against a real API server: tests/k8s/test_operator_scale.py.)"""

from __future__ import annotations

import logging
import time

import kopf
import pytest

from eaas.operator.counters import WorkCounters, url_resource
from eaas.operator.kopf_tuning import QuietWatchHandlers, SpecDiffBaseStorage
from eaas.operator.pods import ObservedPod
from eaas.operator.reconcile.daemon import _due
from eaas.operator.settings import ResyncSettings, Settings
from eaas.operator.state import OperatorState

pytestmark = pytest.mark.scale


@pytest.mark.parametrize(
    "url, resource",
    [
        ("https://h:6443/api/v1/namespaces/ns/pods/p-0/status", "pods"),
        ("https://h:6443/api/v1/namespaces/ns/pods?labelSelector=a", "pods"),
        ("https://h/apis/eaas.io/v1alpha1/namespaces/ns/expertpools/p", "expertpools"),
        ("https://h/apis/coordination.k8s.io/v1/namespaces/ns/leases/x", "leases"),
        ("https://h/api/v1/nodes", "nodes"),
        ("https://h/healthz", ""),
    ],
)
def test_url_resource(url, resource):
    assert url_resource(url) == resource


def test_counters_sum_over_labels_and_expose_prometheus_text():
    c = WorkCounters()
    c.add("x_total", kind="pool")
    c.add("x_total", 2, kind="fleet")
    c.add("y_total")
    assert c.get("x_total") == 3 and c.get("x_total", kind="fleet") == 2 and c.get("z") == 0
    assert c.exposition() == [
        "# TYPE x_total counter",
        'x_total{kind="fleet"} 2',
        'x_total{kind="pool"} 1',
        "# TYPE y_total counter",
        "y_total 1",
    ]


def _pod(ip: str = "10.0.0.1", ready: str = "True", heartbeat: str = "t0") -> dict:
    return {
        "metadata": {"name": "p-0", "uid": "u", "labels": {"eaas.io/server-index": "0"}},
        "spec": {"nodeName": "n"},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": ready, "lastProbeTime": heartbeat}],
        },
    }


def test_only_pod_changes_the_operator_uses_wake_the_pool():
    state = OperatorState()
    assert state.note_pod("ns", "p-0", ObservedPod.from_pod(_pod()))  # first sight
    assert not state.note_pod("ns", "p-0", ObservedPod.from_pod(_pod(heartbeat="t1")))
    assert state.note_pod("ns", "p-0", ObservedPod.from_pod(_pod(ready="False")))
    assert state.note_pod("ns", "p-0", ObservedPod.from_pod(_pod(ip="10.0.0.2", ready="False")))
    assert state.note_pod("ns", "p-0", None)  # deleted


def test_a_node_heartbeat_wakes_no_pool():
    state = OperatorState()
    event = state.wake_event("pool", "ns", "p")
    state.note_node("n", True, {"a": "b"})
    assert event.is_set()  # first sight: a flip from unknown
    event.clear()
    state.note_node("n", True, {"a": "b"})  # heartbeat
    assert not event.is_set()
    state.note_node("n", False, {"a": "b"})
    assert event.is_set()


def test_the_diff_base_of_a_custom_object_is_its_spec_labels_and_annotations():
    storage = SpecDiffBaseStorage(prefix="eaas.io", key="last-handled-configuration")
    status = {"servers": [{"name": f"p-{i}"} for i in range(1000)]}
    body = kopf.Body(
        {
            "apiVersion": "eaas.io/v1alpha1",
            "kind": "ExpertPool",
            "metadata": {
                "name": "p",
                "uid": "u",
                "resourceVersion": "7",
                "labels": {"a": "b"},
                "annotations": {"eaas.io/last-handled-configuration": "{}", "x": "y"},
            },
            "spec": {"replicas": 4},
            "status": status,
        }
    )
    essence = storage.build(body=body)
    assert essence == {
        "spec": {"replicas": 4},
        "metadata": {"labels": {"a": "b"}, "annotations": {"x": "y"}},
    }
    assert essence["spec"] is not body["spec"]  # a copy: later changes do not leak in
    pod = kopf.Body(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "status": status}
    )
    assert storage.build(body=pod) == {}


def test_watch_handler_successes_are_debug_records(caplog):
    log = logging.getLogger("test.quiet")
    log.addFilter(QuietWatchHandlers(["server_pod_event"]))
    log.setLevel(logging.INFO)
    with caplog.at_level(logging.INFO, logger="test.quiet"):
        log.info("Handler 'server_pod_event' succeeded.")
        log.info("Handler 'pool_spec_changed' succeeded.")
    assert [r.getMessage() for r in caplog.records] == ["Handler 'pool_spec_changed' succeeded."]
    log.setLevel(logging.DEBUG)
    with caplog.at_level(logging.DEBUG, logger="test.quiet"):
        caplog.clear()
        log.info("Handler 'server_pod_event' succeeded.")
    assert [r.levelname for r in caplog.records] == ["DEBUG"]


class _Scraper:
    window_s = 30.0

    def __init__(self, measured: bool) -> None:
        self.measured, self.kept = measured, []

    def load(self, key):
        from eaas.operator.load import PoolLoad

        return PoolLoad(per_server={"p-0": {(0, 0): 1.0}} if self.measured else {})

    def keep(self, key):
        self.kept.append(key)


@pytest.mark.parametrize("measured", [False, True])
def test_a_load_driven_pool_steps_once_per_window_while_load_is_measured(measured):
    state = OperatorState(settings=Settings(resync=ResyncSettings(idle_resync_s=120)))
    state.scraper = _Scraper(measured)  # type: ignore[assignment]
    state.pool("ns", "p").load_driven = True
    key = ("ns", "p")
    assert not _due(state, "pool", key, woken=False, failed=False, since_last_step_s=10)
    assert _due(state, "pool", key, woken=False, failed=False, since_last_step_s=31) is measured
    assert _due(state, "pool", key, woken=False, failed=False, since_last_step_s=121)
    assert _due(state, "pool", key, woken=True, failed=False, since_last_step_s=0)
    assert state.scraper.kept == [key] * 4  # its targets stay registered between steps


def test_a_server_whose_scrape_fails_backs_off():
    from eaas.operator.load import RETRY_MAX_S, LoadScraper

    calls: list[str] = []

    def fetch(url: str, timeout_s: float) -> str:
        calls.append(url)
        if url.endswith("down/metrics"):
            raise ConnectionRefusedError("refused")
        return 'eaas_expert_tokens_total{layer="1",expert="2"} 5\n'

    scraper = LoadScraper(interval_s=1.0, window_s=30.0, fetch=fetch)
    try:
        scraper.set_targets(
            "pool", {"a": ("p-0", "http://a/up/metrics"), "b": ("p-1", "http://b/down/metrics")}
        )
        for _ in range(3):
            scraper.scrape_once()
        # the healthy one every round, the failing one once (it waits 2 s, then 4 s, ...)
        assert calls.count("http://a/up/metrics") == 3
        assert calls.count("http://b/down/metrics") == 1
        assert scraper.load("pool").errors == {"p-1": "refused"}
        scraper._failing["b"] = (9, 0.0, "refused")  # its retry time has come
        scraper.scrape_once()
        assert calls.count("http://b/down/metrics") == 2
        fails, retry_at, _ = scraper._failing["b"]
        assert fails == 10 and retry_at - time.monotonic() <= RETRY_MAX_S
    finally:
        scraper.stop()


def test_observed_pods_are_parsed_again_only_when_their_resource_version_changes():
    state = OperatorState()
    pod = _pod()
    pod["metadata"]["resourceVersion"] = "1"
    (first,) = state.observe("ns", "p", [pod])
    (again,) = state.observe("ns", "p", [pod])
    assert again is first and first.live
    state.node_ready["n"] = False  # the node's readiness applies without a new parse
    (on_dead_node,) = state.observe("ns", "p", [pod])
    assert not on_dead_node.node_ready and not on_dead_node.live
    state.node_ready["n"] = True
    changed = _pod(ready="False")
    changed["metadata"]["resourceVersion"] = "2"
    (second,) = state.observe("ns", "p", [changed])
    assert second == ObservedPod.from_pod(changed) and not second.ready
    assert list(state.pool("ns", "p").observed) == ["u"]  # only this step's pods are kept


def test_desired_manifests_are_built_again_only_for_servers_whose_experts_changed():
    from eaas.operator.crd import ExpertPoolSpec
    from eaas.operator.names import Owner
    from eaas.operator.pods import desired_server_pods
    from eaas.runtime.placement import Placement

    from helpers.k8s import TINY

    spec = ExpertPoolSpec.model_validate(TINY["spec"])
    owner = Owner("ExpertPool", "tiny", "ns", "uid")
    state = OperatorState()
    placement = state.placement(spec, [], None)
    built = state.desired_pods(owner, spec, placement, "r1")
    assert built == desired_server_pods(owner, spec, placement, "r1")
    servers = list(placement.servers)
    j = next(j for j in range(1, len(servers)) if servers[j] != servers[0])
    servers[0], servers[j] = servers[j], servers[0]  # two servers swap their experts
    moved = Placement(**{**placement.__dict__, "servers": tuple(servers)})
    again = state.desired_pods(owner, spec, moved, "r1")
    assert again == desired_server_pods(owner, spec, moved, "r1")
    names = list(built)
    kept = [n for i, n in enumerate(names) if i not in (0, j)]
    assert kept and all(again[n] is built[n] for n in kept)
    assert again[names[0]] is not built[names[0]] and again[names[0]] != built[names[0]]
    assert state.desired_pods(owner, spec, moved, "r2")[kept[0]] is not built[kept[0]]


def test_a_wakeup_while_not_leading_waits_for_the_next_step_not_the_idle_resync():
    import asyncio

    from eaas.operator.reconcile.daemon import run_daemon

    state = OperatorState(
        settings=Settings(resync=ResyncSettings(resync_s=0.02, idle_resync_s=1e6))
    )
    leading = [True]
    state.elector = type("Elector", (), {"is_leader": lambda self: leading[0]})()  # type: ignore[assignment]
    steps: list[str] = []
    stop = type("Stop", (), {"flag": False, "__bool__": lambda self: self.flag})()

    async def main() -> None:
        task = asyncio.create_task(
            run_daemon(
                state,
                "pool",
                "ns",
                "p",
                stop,
                lambda *a: steps.append("step"),
                logging.getLogger("t"),
            )  # type: ignore[arg-type]
        )
        await asyncio.sleep(0.2)
        assert steps == ["step"]  # the first step
        leading[0] = False  # e.g. a missed Lease renewal
        state.wake("pool", "ns", "p")
        await asyncio.sleep(0.2)
        assert steps == ["step"]  # a standby never acts
        leading[0] = True
        await asyncio.sleep(0.2)
        assert steps == ["step", "step"]  # the pending wakeup, not the idle resync
        stop.flag = True
        await asyncio.wait_for(task, timeout=5)

    asyncio.run(main())
