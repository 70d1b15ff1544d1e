"""A dead server leaves the published table before its pool's step reads anything
(eaas.operator.reconcile.death), and an idle resync step whose inputs did not change is skipped
(eaas.operator.reconcile.daemon._due). The same against a real API server:
tests/k8s/test_operator_scale.py."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from eaas.operator.names import Owner
from eaas.operator.pods import ObservedPod
from eaas.operator.reconcile import death, steps
from eaas.operator.reconcile.daemon import _due
from eaas.operator.settings import ResyncSettings, Settings
from eaas.operator.state import LIST_RESYNC_S, OperatorState, PublishedTable
from eaas.operator.table import routing_table_configmap
from eaas.runtime.tables.table import RoutingTable
from eaas.runtime.tables.watch import TABLE_KEY

pytestmark = pytest.mark.scale

LOG = logging.getLogger("test.death")
OWNER = Owner(kind="ExpertPool", name="p", namespace="ns", uid="pool-uid")


def _table(version: int = 4) -> RoutingTable:
    # p-2 is the last replica of (1, 2); (1, 0) and (1, 1) have two replicas
    return RoutingTable.from_assignment(
        {"p-0": [(1, 0), (1, 1)], "p-1": [(1, 0), (1, 1)], "p-2": [(1, 2)]},
        {"p-0": "tcp://10.0.0.1:9000", "p-1": "tcp://10.0.0.2:9000", "p-2": "tcp://10.0.0.3:9000"},
        version,
        num_experts=3,
        layers=[1],
    )


def test_without_servers_keeps_the_other_replicas_and_takes_the_version_given():
    t = _table()
    out = t.without_servers(["p-1", "not-a-server"], version=9)
    assert out.version == 9 and set(out.servers) == {"p-0", "p-2"}
    assert out.layers == {1: (("p-0",), ("p-0",), ("p-2",))}
    assert t.without_servers(["p-2"]).replicas(1, 2) == ()  # its last replica: uncovered
    assert t.without_servers(["p-2"]).version == 5
    # the same table as one built from the surviving assignment
    rebuilt = RoutingTable.from_assignment(
        {"p-0": [(1, 0), (1, 1)], "p-2": [(1, 2)]},
        {"p-0": "tcp://10.0.0.1:9000", "p-2": "tcp://10.0.0.3:9000"},
        9,
        num_experts=3,
        layers=[1],
    )
    assert out.same_replicas(rebuilt)
    assert t.servers["p-1"] and t.replicas(1, 0) == ("p-0", "p-1")  # the original unchanged


def test_a_replacement_already_seen_is_not_dropped():
    t = _table()
    dead = {"p-0": "u0", "p-1": "u1", "gone": "ux"}
    seen = {"p-0": None, "p-1": ObservedPod(name="p-1", uid="u1-new"), "gone": None}
    assert death.servers_to_drop(t, dead, seen) == {"p-0"}
    seen["p-1"] = ObservedPod(name="p-1", uid="u1", terminating=True)
    assert death.servers_to_drop(t, dead, seen) == {"p-0", "p-1"}


class _Core:
    """The ConfigMap replace the death path makes (the only API call on it)."""

    def __init__(self) -> None:
        self.replaced: list[dict] = []

    def replace_namespaced_config_map(self, name, namespace, manifest, _preload_content=False):
        written = json.loads(json.dumps(manifest))
        written["metadata"]["resourceVersion"] = str(
            int(manifest["metadata"]["resourceVersion"]) + 1
        )
        self.replaced.append(written)
        return SimpleNamespace(data=json.dumps(written).encode())


def _stepped_pool(state: OperatorState, table: RoutingTable, drops_at_once: bool = True) -> None:
    """A pool's memory as after a step that wrote ``table`` (resourceVersion 10)."""
    cm = routing_table_configmap(OWNER, table)
    cm["metadata"]["resourceVersion"] = "10"
    memory = state.pool("ns", "p")
    memory.owner, memory.drops_at_once, memory.table_cm = OWNER, drops_at_once, cm
    memory.published = PublishedTable("10", table.version, cm["data"][TABLE_KEY])
    state.tables[("ns", cm["metadata"]["name"])] = ("10", table)


@pytest.fixture
def events(monkeypatch):
    posted: list[tuple[str, str]] = []
    monkeypatch.setattr(
        steps, "event", lambda body, reason, msg, warning=False: posted.append((reason, msg))
    )
    return posted


def test_a_dead_server_leaves_the_table_in_one_write(events):
    state, core = OperatorState(), _Core()
    _stepped_pool(state, _table())
    state.note_death("ns", "p", "p-2", "u2")  # the watch: DELETED (pods_seen has no p-2)
    assert death.drop_dead_at_once(state, core, "ns", "p", LOG)  # type: ignore[arg-type]
    (written,) = core.replaced
    table = RoutingTable.from_json(written["data"][TABLE_KEY])
    assert table.version == 5 and set(table.servers) == {"p-0", "p-1"}
    assert table.layers == {1: (("p-0", "p-1"), ("p-0", "p-1"), ())}  # as the step's rule says
    assert written["metadata"]["annotations"]["eaas.io/routing-table-version"] == "5"
    assert written["metadata"]["ownerReferences"][0]["uid"] == "pool-uid"
    memory = state.pool("ns", "p")
    assert memory.dead == {} and memory.published.resource_version == "11"
    assert state.counters.get("eaas_operator_table_drops_total") == 1
    assert [r for r, _ in events] == ["RoutingTablePublished"]
    # the next death drops from the table just written, one version on
    state.note_death("ns", "p", "p-1", "u1")
    assert death.drop_dead_at_once(state, core, "ns", "p", LOG)  # type: ignore[arg-type]
    last = RoutingTable.from_json(core.replaced[-1]["data"][TABLE_KEY])
    assert last.version == 6 and set(last.servers) == {"p-0"}


@pytest.mark.parametrize("case", ["table-pool", "foreign-write", "not-stepped", "not-in-table"])
def test_the_step_decides_when_the_table_in_force_is_not_known(case, events):
    state, core = OperatorState(), _Core()
    if case != "not-stepped":
        _stepped_pool(state, _table(), drops_at_once=case != "table-pool")
    if case == "foreign-write":
        state.pool("ns", "p").table_cm["metadata"]["resourceVersion"] = "12"
    state.pool("ns", "p")
    state.note_death("ns", "p", "p-9" if case == "not-in-table" else "p-2", "u")
    assert not death.drop_dead_at_once(state, core, "ns", "p", LOG)  # type: ignore[arg-type]
    assert core.replaced == [] and events == [] and state.pool("ns", "p").dead == {}


class _Index:
    def __init__(self, pods: list[dict]) -> None:
        self.pods = pods

    def get(self, key, default=()):
        return self.pods if key == ("ns", "p") else default


def _pod(i: int, rv: str) -> dict:
    return {"metadata": {"name": f"p-{i}", "uid": f"u{i}", "resourceVersion": rv}}


def test_an_idle_resync_step_runs_only_when_its_inputs_changed(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("eaas.operator.reconcile.daemon.time.monotonic", lambda: clock[0])
    state = OperatorState(settings=Settings(resync=ResyncSettings(idle_resync_s=120)))
    state.pod_index = _Index([_pod(i, "1") for i in range(4)])
    key = ("ns", "p")

    def due(since: float, woken: bool = False) -> bool:
        return _due(state, "pool", key, woken=woken, failed=False, since_last_step_s=since)

    assert due(0, woken=True)  # a step: its inputs taken
    clock[0] += 121
    assert not due(121)  # nothing changed: skipped
    assert state.counters.get("eaas_operator_idle_steps_skipped_total") == 1
    clock[0] += 2
    assert not due(123)  # compared already in this idle period: not even compared
    assert state.counters.get("eaas_operator_idle_steps_skipped_total") == 1
    state.pod_index.pods[2] = _pod(2, "2")  # an update the pod filter did not wake for
    clock[0] += 120
    assert due(243)
    clock[0] += 121
    state.note_node("n-1", False, {"zone": "a"})  # nodes are inputs too
    assert due(121)
    clock[0] += 121
    assert not due(121)
    clock[0] += LIST_RESYNC_S
    assert due(LIST_RESYNC_S)  # the safety net: a step (and its LIST) at least this often
    state.settings = Settings(resync=ResyncSettings(idle_resync_s=0))
    assert due(2)  # 0: a step every resync_s, as before
