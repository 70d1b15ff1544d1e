"""Measures of a placement: replicas moved by a change, per-server load, balancedness, and the
server sets one decode call reaches (dispatch columns)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .core import LayerExpert, Placement


def moved_replicas(old: Placement, new: Placement) -> int:
    """Replicas that ``new`` puts on a server which did not host them in ``old`` (weights a
    server must load), matching servers by index."""
    moved = 0
    for s, pairs in enumerate(new.servers):
        before = set(old.servers[s]) if s < old.num_servers else set()
        moved += sum(1 for pair in pairs if pair not in before)
    return moved


def server_loads(
    placement: Placement, expert_load: Mapping[LayerExpert, float] | None
) -> dict[int, list[float]]:
    """Per MoE layer, the load of every server: an expert's load (missing: 1.0) split evenly
    over its replicas (the dispatcher spreads tokens over replicas)."""
    reps = placement.replicas()
    load = expert_load or {}
    out = {layer: [0.0] * placement.num_servers for layer in placement.layers}
    for (layer, e), where in reps.items():
        share = float(load.get((layer, e), 1.0)) / len(where)
        for s in where:
            out[layer][s] += share
    return out


def balancedness_of_loads(per_layer: Mapping[int, Sequence[float]]) -> float:
    """Balancedness of measured or modelled per-server loads: ``per_layer[layer][s]`` is server
    ``s``'s load in that MoE layer (tokens, or tokens/s; every layer lists the same servers).

    ``sum_l mean_s load[l][s] / sum_l max_s load[l][s]``: mean over max server load per layer,
    summed over layers (1.0 is perfect; layers run one after another, so every layer's slowest
    server counts). Two layers on two servers with loads (100, 200) and (200, 100) give
    ``300 / 400 = 0.75`` (the servers' totals, 300 each, would claim 1.0). Returns 1.0 without
    load.
    """
    mean = peak = 0.0
    for loads in per_layer.values():
        if len(loads):
            mean += sum(loads) / len(loads)
            peak += max(loads)
    return mean / peak if peak > 0 else 1.0


def balancedness(placement: Placement, expert_load: Mapping[LayerExpert, float] | None) -> float:
    """:func:`balancedness_of_loads` of the per-server loads a placement gives an expert load
    (:func:`server_loads`: an expert's load split evenly over its replicas). Returns 1.0 for a
    placement without load."""
    return balancedness_of_loads(server_loads(placement, expert_load))


def dispatch_columns(placement: Placement) -> list[frozenset[int]]:
    """The sets of servers one small decode call reaches: per MoE layer and replica slot ``r``,
    ``{replicas(layer, e)[r % len] for every expert e}`` (the routing table lists an expert's
    replicas in ascending server order, :meth:`~eaas.runtime.tables.table.RoutingTable.from_placement`).

    The dispatcher keeps an expert's pairs on one replica up to ``split_pairs`` of them and
    rotates every expert of a layer by one replica per call, in phase
    (:func:`eaas.runtime.client.dispatch.choose_replicas`), so a decode call of layer ``l`` sends
    its frames to the servers of one column, all at once, and waits for the slowest.
    """
    reps = placement.replicas()
    cols: set[frozenset[int]] = set()
    for layer in placement.layers:
        width = max(
            (len(reps.get((layer, e), ())) for e in range(placement.num_experts)), default=0
        )
        for r in range(width):
            col = frozenset(
                where[r % len(where)]
                for e in range(placement.num_experts)
                if (where := reps.get((layer, e)))
            )
            cols.add(col)
    return sorted(cols, key=sorted)
