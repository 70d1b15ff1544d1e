"""When a pool's daemon runs a full reconcile step (eaas.operator.resync)."""

from __future__ import annotations

import pytest

from eaas.operator.resync import step_due
from eaas.operator.settings import IDLE_RESYNC_S, idle_resync_from_env


def test_step_due_on_events_failures_suspects_and_idle_period():
    idle = 120.0
    assert step_due(True, False, False, 0.5, idle)  # woken by an event
    assert step_due(False, True, False, 0.5, idle)  # the last step failed: retry
    assert step_due(False, False, True, 0.5, idle)  # suspected servers: re-probe
    assert not step_due(False, False, False, 119.9, idle)  # idle: nothing to do
    assert step_due(False, False, False, 120.0, idle)  # the safety-net resync
    assert step_due(False, False, False, 0.0, 0.0)  # 0: every resync, as before


def test_idle_resync_from_env():
    assert idle_resync_from_env({}) == IDLE_RESYNC_S
    assert idle_resync_from_env({"EAAS_OPERATOR_IDLE_RESYNC_S": "0"}) == 0.0
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(ValueError, match="EAAS_OPERATOR_IDLE_RESYNC_S"):
            idle_resync_from_env({"EAAS_OPERATOR_IDLE_RESYNC_S": bad})
