"""The elastic-membership decisions (:mod:`eaas.operator.drain`): settling a burst of replica
changes, when a leaving server has drained, which servers leave, which outdated ones are
replaced, and the pod plan holding what is not drained."""

from __future__ import annotations

import pytest

from eaas.operator.drain import (
    ElasticMemory,
    TrafficReport,
    drain_done,
    leaving_servers,
    pick_replacements,
    settled_replicas,
)
from eaas.operator.pods import ObservedPod, plan_pods
from eaas.operator.settings import ElasticSettings

pytestmark = pytest.mark.elastic


def pod(i: int, spec_hash: str = "h", live: bool = True, **kw) -> ObservedPod:
    return ObservedPod(
        name=f"p-{i}",
        uid=f"u{i}",
        index=i,
        spec_hash=spec_hash,
        ready=live,
        ip="10.0.0.1" if live else "",
        phase="Running" if live else "Pending",
        **kw,
    )


def test_a_burst_settles_on_its_last_value_only():
    m = ElasticMemory()
    assert settled_replicas(m, 4, 0.0, 5.0) == 4  # first sight: at once
    t = 100.0
    for r in (5, 6, 7, 6, 8, 5):  # one change every 3 s: never stands 5 s
        assert settled_replicas(m, r, t, 5.0) == 4
        assert m.busy()
        t += 3.0
    assert settled_replicas(m, 5, t - 3.0 + 4.9, 5.0) == 4
    assert settled_replicas(m, 5, t - 3.0 + 5.0, 5.0) == 5
    assert not m.busy()
    assert settled_replicas(m, 3, t + 10, 0.0) == 3  # settle 0: at once


def test_drain_done_by_the_servers_own_record():
    quiet, timeout = 1.0, 60.0
    assert drain_done(TrafficReport(True, 10, 0.2, 1.0), 0.5, quiet, timeout) == ""
    assert drain_done(TrafficReport(True, 10, 1.0, 1.0), 0.5, quiet, timeout) == "quiet"
    assert drain_done(TrafficReport(True, 0, None, None), 0.0, quiet, timeout) == "quiet"
    assert drain_done(TrafficReport(False), 0.0, quiet, timeout) == "unreachable"
    assert drain_done(TrafficReport(True, 10, 0.1, 1.0), 60.0, quiet, timeout) == "timeout"


def test_traffic_report_from_health():
    r = TrafficReport.from_health(
        {"traffic": {"frames": 7, "idle_s": 2.5, "last_frame_unix": 1.5, "stop_unix": None}}
    )
    assert r == TrafficReport(True, 7, 2.5, 1.5)
    assert TrafficReport.from_health({"status": "ok"}) == TrafficReport(True)


def test_leaving_servers_are_excess_or_outdated_and_out_of_every_table():
    obs = [pod(0), pod(1, spec_hash="old"), pod(2), pod(3), pod(4, live=False)]
    desired = {"p-0": "h", "p-1": "h", "p-2": "h"}
    names = [p.name for p in leaving_servers(obs, desired, in_use={"p-0", "p-2"})]
    assert names == ["p-1", "p-3"]  # p-4 is not live: the plan deletes it anyway
    assert leaving_servers(obs, desired, in_use={p.name for p in obs}) == []


def test_replacements_one_at_a_time_only_when_all_desired_are_up():
    desired = {f"p-{i}": "h" for i in range(4)}
    obs = [pod(0, "old"), pod(1, "old"), pod(2), pod(3)]
    assert pick_replacements(obs, desired, {}, redundancy=2) == {"p-0": "u0"}
    five = {f"p-{i}": "h" for i in range(5)}
    got = pick_replacements([*obs, pod(4)], five, {}, redundancy=3)
    assert got == {"p-0": "u0", "p-1": "u1"}  # redundancy - 1 at once
    assert pick_replacements(obs, desired, {}, redundancy=3) == {"p-0": "u0"}  # keep 3 members
    # one leaving: kept while it exists, no more chosen
    assert pick_replacements(obs, desired, {"p-1": "u1"}, redundancy=2) == {"p-1": "u1"}
    # its replacement (new uid) is starting: nothing more until it is up
    obs2 = [pod(0, "old"), ObservedPod(name="p-1", uid="new", index=1, spec_hash="h"), *obs[2:]]
    assert pick_replacements(obs2, desired, {"p-1": "u1"}, redundancy=2) == {}
    # never below redundancy members
    two = {f"p-{i}": "h" for i in range(2)}
    assert pick_replacements([pod(0, "old"), pod(1, "old")], two, {}, redundancy=2) == {}


def test_plan_holds_live_outdated_and_excess_pods_named_in_use():
    desired = {
        f"p-{i}": {
            "metadata": {
                "name": f"p-{i}",
                "annotations": {"eaas.io/spec-hash": "h"},
                "labels": {"eaas.io/placement-revision": "r"},
            }
        }
        for i in range(3)
    }
    obs = [
        pod(0, "old", revision="r"),
        pod(1, revision="r"),
        pod(2, revision="r"),
        pod(3, revision="r"),
    ]
    held = plan_pods(desired, obs, max_unavailable=1, in_use={"p-0", "p-3"})
    assert held.delete == [] and not held.forced
    free = plan_pods(desired, obs, max_unavailable=1, in_use=set())
    assert {n for n, _, _ in free.delete} == {"p-0", "p-3"}


def test_elastic_settings_from_env():
    s = ElasticSettings.from_env(
        {"EAAS_OPERATOR_SCALE_SETTLE_S": "0", "EAAS_OPERATOR_DRAIN_QUIET_S": "2"}
    )
    assert (s.settle_s, s.drain_quiet_s, s.drain_timeout_s) == (0.0, 2.0, 60.0)
    with pytest.raises(ValueError, match="EAAS_OPERATOR_DRAIN_TIMEOUT_S"):
        ElasticSettings.from_env({"EAAS_OPERATOR_DRAIN_TIMEOUT_S": "-1"})
    with pytest.raises(ValueError, match="EAAS_OPERATOR_SCALE_SETTLE_S"):
        ElasticSettings.from_env({"EAAS_OPERATOR_SCALE_SETTLE_S": "soon"})
