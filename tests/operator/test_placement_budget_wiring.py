"""spec.placement.maxMovedFraction reaches the placement: a membership change of a routing-table
pool is placed for the measured load within that budget; the CRD bounds the field; the load
summary's balancedness is per layer, summed."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from eaas.operator.crd import ExpertPoolSpec
from eaas.operator.load import load_summary, parse_expert_tokens
from eaas.operator.pool_placement import (
    member_placement,
    members_changed,
    placement_revision,
    table_placement,
)
from eaas.operator.table import table_from_assignment
from eaas.runtime.placement import balancedness

pytestmark = pytest.mark.elastic

LAYERS = (1, 2, 3)


def make_spec(fraction: float | None = None, replicas: int = 6):
    placement = {"assignment": "routing-table", "policy": "load-balanced", "slotsPerServer": 14}
    if fraction is not None:
        placement["maxMovedFraction"] = fraction
    return ExpertPoolSpec.model_validate(
        {
            "model": {"uri": "/m", "firstMoeLayer": 1, "numMoeLayers": 3, "numExperts": 32},
            "replicas": replicas,
            "placement": placement,
        }
    )


def endpoints(members):
    return {m: f"tcp://10.0.0.{i + 1}:9000" for i, m in enumerate(members)}


# Zipf-skewed, a different hot expert per layer
HOT = {
    (layer, e): 1000.0 / (1 + (e * 7 + layer * 5) % 32) ** 1.2
    for layer in LAYERS
    for e in range(32)
}


def test_scale_up_is_placed_for_the_load_within_the_budget():
    spec = make_spec()
    assert spec.placement.max_moved_fraction == 0.1  # the default
    five = [f"p-{i}" for i in range(5)]
    table = table_from_assignment(spec, member_placement(spec, five, None, HOT), endpoints(five), 1)
    six = [*five, "p-5"]
    assert members_changed(six, table) and not members_changed(five, table)
    assert members_changed(five[:4], table)  # a server of the table left
    before = table_placement(spec, six, table)
    results = {}
    for fraction in (0.0, 0.1, 1.0):
        s = make_spec(fraction, replicas=6)
        results[fraction] = table_placement(
            s,
            six,
            table_from_assignment(s, member_placement(s, six, table, HOT), endpoints(six), 2),
        )
    # budget 0: the survivors keep everything (the new member is filled)
    assert all(results[0.0].servers[i] == before.servers[i] for i in range(5))
    # more budget: survivors change, within the budget, and the layer peaks only go down
    for fraction in (0.1, 1.0):
        moved = sum(
            len(set(results[fraction].servers[i]) - set(before.servers[i])) for i in range(5)
        )
        assert moved <= len(LAYERS) * int(fraction * 6 * 14) + 1e-9
    assert balancedness(results[0.1], HOT) >= balancedness(results[0.0], HOT) - 1e-9
    assert balancedness(results[1.0], HOT) >= balancedness(results[0.1], HOT) - 1e-9
    assert balancedness(results[1.0], HOT) > balancedness(results[0.0], HOT)
    # a placement in force with the same members is a fixed point
    t2 = table_from_assignment(
        spec, {m: results[0.1].servers[i] for i, m in enumerate(six)}, endpoints(six), 3
    )
    assert member_placement(spec, six, t2, HOT) == {
        m: results[0.1].servers[i] for i, m in enumerate(six)
    }


def test_field_bounds_and_revision():
    for bad in (-0.1, 1.5):
        with pytest.raises(ValidationError, match="maxMovedFraction|max_moved_fraction"):
            make_spec(bad)
    assert placement_revision(make_spec(0.1)) != placement_revision(make_spec(0.2))


def test_load_summary_balancedness_is_per_layer():
    # 2 layers x 2 servers, loads 100 and 200, crossed: each server totals 300 (would say 1.0)
    per_server = {"a": {(1, 0): 100.0, (2, 1): 200.0}, "b": {(1, 1): 200.0, (2, 0): 100.0}}
    assert load_summary(per_server, 30.0)["balancedness"] == 0.75


def test_parse_with_server_label_takes_the_fast_path_and_sums():
    text = (
        'eaas_expert_tokens_total{expert="0",layer="1",server="s-0"} 10.0\n'
        'eaas_expert_tokens_total{expert="0",layer="1",server="s-1"} 5.0\n'
        'eaas_expert_tokens_total{expert="2",layer="1",server="s-1"} 1.0\n'
    )
    assert parse_expert_tokens(text) == {(1, 0): 15.0, (1, 2): 1.0}
