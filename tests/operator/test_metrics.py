"""``GET /metrics`` of the operator (:func:`eaas.operator.handlers.operator_metrics`): pure
rendering of the Prometheus text from the operator's state."""

from __future__ import annotations

from eaas.operator.handlers import OperatorState
from eaas.operator.reconcile.reports import operator_metrics
from eaas.runtime.tables.table import RoutingTable


class _Elector:
    """Stands in for the Lease election (pure-logic unit test): only ``is_leader`` is read."""

    def __init__(self, leader: bool) -> None:
        self.leader = leader

    def is_leader(self) -> bool:
        return self.leader


def test_metrics_say_who_leads_and_the_table_versions():
    state = OperatorState()
    state.tables[("ns-b", "p-routing-table")] = ("12", RoutingTable(7, 4, {"p-0": "tcp://a:1"}))
    state.tables[("ns-a", "q-routing-table")] = ("13", RoutingTable(3, 4, {"q-0": "tcp://b:1"}))
    state.elector = _Elector(True)  # type: ignore[assignment]
    text = operator_metrics(state)
    assert "\neaas_operator_leader 1\n" in text
    lines = [ln for ln in text.splitlines() if ln.startswith("eaas_operator_routing_table_version")]
    assert lines == [
        'eaas_operator_routing_table_version{namespace="ns-a",configmap="q-routing-table"} 3',
        'eaas_operator_routing_table_version{namespace="ns-b",configmap="p-routing-table"} 7',
    ]
    assert "# TYPE eaas_operator_leader gauge" in text and text.endswith("\n")

    state.elector = _Elector(False)  # type: ignore[assignment]
    assert "\neaas_operator_leader 0\n" in operator_metrics(state)
