"""The operator's settings read once from the environment (:mod:`eaas.operator.settings`) and
its typed memory (:mod:`eaas.operator.state`): which fleets a pool's new table wakes, when the
table handed to the fleets is dropped, when a pool is busy. Pure: no cluster."""

from __future__ import annotations

import asyncio

import pytest

from eaas.operator.reconcile.fleet import pool_table
from eaas.operator.settings import LoadSettings, Settings
from eaas.operator.state import OperatorState, PublishedTable
from eaas.runtime.tables.table import RoutingTable


def test_settings_from_env_reads_every_variable():
    s = Settings.from_env(
        {
            "EAAS_OPERATOR_RESYNC_S": "1",
            "EAAS_OPERATOR_IDLE_RESYNC_S": "0",
            "EAAS_OPERATOR_WATCH_TIMEOUT_S": "30",
            "EAAS_OPERATOR_REPORT_LISTEN": "0.0.0.0:8081",
            "EAAS_OPERATOR_REPORT_URL": "http://op:8081",
            "EAAS_OPERATOR_LEASE_DURATION_S": "3",
            "POD_NAMESPACE": "eaas",
            "POD_IP": "10.0.0.7",
            "EAAS_OPERATOR_LOAD_WINDOW_S": "12",
            "EAAS_OPERATOR_METRICS_LISTEN": "0.0.0.0:6443",
            "EAAS_OPERATOR_METRICS_CERT_FILE": "/c.pem",
            "EAAS_OPERATOR_METRICS_KEY_FILE": "/k.pem",
        }
    )
    assert (s.resync.resync_s, s.resync.idle_resync_s, s.resync.watch_timeout_s) == (1.0, 0.0, 30)
    assert (s.reports.listen, s.reports.base_url) == ("0.0.0.0:8081", "http://op:8081")
    assert s.lease.namespace == "eaas" and s.lease.lease_duration_s == 3.0
    assert s.lease.advertise_url == "http://10.0.0.7:8081"
    assert s.load == LoadSettings(window_s=12.0)
    assert (s.metrics_api.listen, s.metrics_api.cert_file, s.metrics_api.key_file) == (
        "0.0.0.0:6443",
        "/c.pem",
        "/k.pem",
    )
    d = Settings.from_env({})
    assert d.resync.resync_s == 2.0 and d.reports.listen == "" and d.metrics_api.listen == ""
    with pytest.raises(ValueError, match="EAAS_OPERATOR_RESYNC_S"):
        Settings.from_env({"EAAS_OPERATOR_RESYNC_S": "soon"})


def test_a_pools_new_table_wakes_only_the_fleets_that_reference_it():
    async def run() -> set[str]:
        state = OperatorState()
        for fleet in ("a", "b", "c"):
            state.wake_event("fleet", "ns", fleet)
        state.wake_event("fleet", "other", "d")
        state.fleet("ns", "a").pool = "p"
        state.fleet("ns", "b").pool = "q"  # c: not reconciled yet, its pool is not known
        state.wake_fleets_of("ns", "p")
        return {name for (kind, _, name), ev in state.wakeups.items() if ev.is_set()}

    assert asyncio.run(run()) == {"a", "c"}


def test_the_table_handed_to_fleets_is_dropped_on_a_foreign_write():
    state = OperatorState()
    memory = state.pool("ns", "p")
    memory.published = PublishedTable(resource_version="10", version=3, wire="{}")
    assert not state.note_configmap("ns", "p", "p-routing-table", "10", deleted=False)  # ours
    assert memory.published is not None
    assert state.note_configmap("ns", "p", "p-expert-load", "11", deleted=False)  # another
    assert memory.published is not None
    assert state.note_configmap("ns", "p", "p-routing-table", "11", deleted=False)  # not ours
    assert memory.published is None
    memory.published = PublishedTable(resource_version="12", version=4, wire="{}")
    state.note_configmap("ns", "p", "p-routing-table", "12", deleted=True)
    assert memory.published is None
    memory.published = PublishedTable(resource_version="13", version=5, wire="{}")
    state.leadership_changed(False)
    assert memory.published is None


def test_a_pool_is_busy_while_suspects_or_a_staged_table_drive_it():
    state = OperatorState()
    memory = state.pool("ns", "p")
    assert not memory.busy()
    memory.suspects["p-0"] = ("uid", 0.0)
    assert memory.busy()
    memory.suspects.clear()
    memory.staged = RoutingTable(2, 4, {"p-0": "tcp://a:1"})
    assert memory.busy()
    memory.staged, memory.load_driven = None, True
    assert not memory.busy()  # load: once per window while measured (daemon._due)
    memory.fleet_acks.update(f1=[1, 2], f2=[3])
    assert sorted(memory.client_acks()) == [1, 2, 3]


class _NoApi:
    """A CoreV1Api stand-in that fails on any call: the fleet must not read the ConfigMap."""

    def __getattr__(self, name: str):
        raise AssertionError(f"unexpected API call {name}")


def test_a_fleet_takes_the_table_its_pool_handed_over_without_reading_the_configmap():
    state = OperatorState()
    state.pool("ns", "p").published = PublishedTable(resource_version="7", version=4, wire="W")
    assert pool_table(state, _NoApi(), "ns", "p") == (4, "W")  # type: ignore[arg-type]
