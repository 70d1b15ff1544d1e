"""Pure decisions of an expert server's table-driven assignment."""

from __future__ import annotations

import pytest

from eaas.runtime.server.assignment import assignment_step, server_experts
from eaas.runtime.tables.table import RoutingTable

pytestmark = pytest.mark.elastic


def test_server_experts_reads_the_replica_lists():
    t = RoutingTable(
        version=4,
        num_experts=3,
        servers={"a": "tcp://x:1", "b": "tcp://y:1"},
        layers={1: (("a",), ("a", "b"), ("b",)), 3: (("b",), (), ("a",))},
    )
    assert server_experts(t, "a") == {(1, 0), (1, 1), (3, 2)}
    assert server_experts(t, "b") == {(1, 1), (1, 2), (3, 0)}
    assert server_experts(t, "gone") == frozenset()


def test_new_version_loads_only_its_missing_experts_and_drops_nothing_unreleased():
    held = {(1, 0), (1, 1)}
    assigned = {5: frozenset({(1, 0), (1, 1)}), 6: frozenset({(1, 1), (1, 2)})}
    step = assignment_step(held, assigned, released_version=5)
    assert step.load == {(1, 2)}
    assert step.drop == frozenset()  # clients may still use version 5: (1, 0) stays
    assert step.keep == {(1, 0), (1, 1), (1, 2)}


def test_release_drops_experts_only_older_versions_used():
    held = {(1, 0), (1, 1), (1, 2)}
    assigned = {5: frozenset({(1, 0), (1, 1)}), 6: frozenset({(1, 1), (1, 2)})}
    step = assignment_step(held, assigned, released_version=6)
    assert step.load == frozenset()
    assert step.drop == {(1, 0)}
    assert step.keep == {(1, 1), (1, 2)}


def test_unconfirmed_intermediate_version_is_never_loaded():
    # 7 arrived before 6's weights were loaded: only the newest version is loaded
    assigned = {5: frozenset({(1, 0)}), 6: frozenset({(1, 3)}), 7: frozenset({(1, 4)})}
    step = assignment_step({(1, 0)}, assigned, released_version=5)
    assert step.load == {(1, 4)}
    assert step.drop == frozenset()


def test_the_newest_version_is_kept_even_if_release_is_ahead():
    step = assignment_step({(2, 1)}, {3: frozenset({(2, 1)})}, released_version=9)
    assert step.drop == frozenset() and step.load == frozenset()


def test_a_server_left_out_of_the_table_drops_everything_once_released():
    held = {(1, 0), (2, 2)}
    assigned = {1: frozenset(held), 2: frozenset()}
    assert assignment_step(held, assigned, 1).drop == frozenset()
    assert assignment_step(held, assigned, 2).drop == held
