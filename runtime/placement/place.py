"""Placement of every logical expert of every MoE layer on the expert servers
(:func:`place_experts`); the algorithm and its movement bound are in the package docstring."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .core import POLICIES, LayerExpert, Placement, PlacementError, auto_slots
from .layer import place_layer
from .rescale import FRESH_SWAPS, rescale_layer

#: Default movement budget: replicas a change may move per MoE layer beyond what it forces, as a
#: fraction of the layer's replicas (``spec.placement.maxMovedFraction``).
DEFAULT_MAX_MOVED_FRACTION = 0.1


def place_experts(
    layers: Sequence[int],
    num_experts: int,
    num_servers: int,
    redundancy: int = 2,
    policy: str = "round-robin",
    expert_load: Mapping[LayerExpert, float] | None = None,
    *,
    previous: Placement | None = None,
    slots_per_server: int | None = None,
    domains: Sequence[str] | None = None,
    max_moved_fraction: float | None = DEFAULT_MAX_MOVED_FRACTION,
    rebalance: bool = False,
) -> Placement:
    """Compute a placement of every logical expert on at least ``redundancy`` distinct servers,
    incrementally from ``previous`` when given (see the module docstring for the algorithm and
    its movement bound). Deterministic: the same inputs give the same placement.

    Args:
        layers: MoE layer indices (e.g. DeepSeek-V3: ``range(3, 61)``, 58 layers).
        num_experts: routed experts per MoE layer (DeepSeek-V3: 256).
        num_servers: expert servers (one GPU each by default); any value ``>= redundancy``.
        redundancy: minimum replicas per logical expert, on distinct servers.
        policy: one of :data:`POLICIES`.
        expert_load: tokens per ``(layer, expert)`` per interval, for ``load-balanced``.
        previous: the placement in force. Server ``s`` of the result is server ``s`` of
            ``previous`` (for ``s < previous.num_servers``); servers at indices
            ``>= num_servers`` are removed, those at ``>= previous.num_servers`` are new.
            Pairs outside ``layers``/``num_experts`` are dropped.
        slots_per_server: replicas per server per MoE layer. ``None``: no budget, exactly
            ``redundancy`` replicas per expert. ``0``: automatic, the larger of
            :func:`auto_slots` and the most any surviving server already holds in one layer
            (a budget never shrinks: a scale-up takes no replica from the survivors, a
            scale-down re-homes only what would fall below ``redundancy``).
            ``k > 0``: ``max(k, auto_slots(...))``. All slots are filled (extra replicas of
            the hottest experts); at most ``num_experts`` per server and ``num_servers`` per
            expert are used.
        domains: failure domain (e.g. node name) of each server, ``len == num_servers``;
            default: every server its own domain.
        max_moved_fraction: movement budget of a load-aware change (``previous`` given,
            ``load-balanced`` with ``expert_load``): per MoE layer, the replicas moved beyond
            those the change forces (what the load-oblivious step moves) are at most
            ``floor(max_moved_fraction * replicas of the layer)``, spent on the moves that most
            lower the layer's maximum server load. None: unlimited. 0: the best of the
            load-aware and the load-oblivious step, nothing more.
        rebalance: also spend the budget where the change forces nothing (a load shift);
            without it a layer the change does not touch keeps its placement (a placement in
            force is a fixed point).

    Returns:
        A :class:`Placement`.

    Raises:
        PlacementError: ``num_servers < 1``, ``redundancy < 1``, ``redundancy > num_servers``,
            ``num_experts < 1``, an unknown policy, a negative budget or
            ``max_moved_fraction``, or ``domains`` of the wrong length.
    """
    layers = tuple(sorted(int(x) for x in layers))
    if num_servers < 1:
        raise PlacementError(f"num_servers must be >= 1, got {num_servers}")
    if redundancy < 1:
        raise PlacementError(f"redundancy must be >= 1, got {redundancy}")
    if redundancy > num_servers:
        raise PlacementError(
            f"redundancy ({redundancy}) cannot exceed the number of servers ({num_servers}): "
            "replicas of one expert must sit on distinct servers"
        )
    if num_experts < 1:
        raise PlacementError(f"num_experts must be >= 1, got {num_experts}")
    if policy not in POLICIES:
        raise PlacementError(f"unknown placement policy {policy!r}; expected one of {POLICIES}")
    if slots_per_server is not None and slots_per_server < 0:
        raise PlacementError(f"slots_per_server must be >= 0, got {slots_per_server}")
    if domains is not None and len(domains) != num_servers:
        raise PlacementError(
            f"domains has {len(domains)} entries but there are {num_servers} servers"
        )
    if max_moved_fraction is not None and not max_moved_fraction >= 0:
        raise PlacementError(f"max_moved_fraction must be >= 0, got {max_moved_fraction}")

    n, big_e, r = num_servers, num_experts, redundancy
    dom_names = list(domains) if domains is not None else [str(s) for s in range(n)]
    dom_index = {d: i for i, d in enumerate(sorted(set(dom_names)))}
    dom = [dom_index[d] for d in dom_names]
    num_domains = len(dom_index)

    # previous hosting per layer, survivors only
    prev_layers: dict[int, list[set[int]]] = {layer: [set() for _ in range(n)] for layer in layers}
    if previous is not None:
        for s, pairs in enumerate(previous.servers[:n]):
            for layer, e in pairs:
                if layer in prev_layers and 0 <= e < big_e:
                    prev_layers[layer][s].add(e)

    budget: int | None
    if slots_per_server is None:
        budget = None
    else:
        need = auto_slots(big_e, r, n)
        budget = max(slots_per_server, need)
        if slots_per_server == 0:  # the survivors' GPUs already hold this many: keep it
            held = max((len(h) for hs in prev_layers.values() for h in hs), default=0)
            budget = max(budget, held)
        budget = min(budget, big_e)

    load_aware = policy == "load-balanced" and bool(expert_load)
    fresh = previous is None or not any(previous.servers)
    by_layer: dict[int, dict[int, float]] = {}
    for (lay, e), v in (expert_load or {}).items() if load_aware else ():
        by_layer.setdefault(lay, {})[e] = float(v)

    hosted: list[list[LayerExpert]] = [[] for _ in range(n)]
    total = [0] * n  # replicas per server over the layers placed so far (memory balance)
    changes = [0] * n  # drops per server over the layers placed so far (spread the churn)
    spread_ok = True
    for layer in layers:
        if load_aware:
            known = by_layer.get(layer, {})
            default = sum(known.values()) / len(known) if known else 1.0
            w = [max(0.0, known.get(e, default)) for e in range(big_e)]
        else:
            w = [1.0] * big_e
        prev = prev_layers[layer]
        if load_aware and not fresh:
            servers, ok = rescale_layer(
                w, n, r, budget, prev, dom, num_domains, total, changes, max_moved_fraction,
                rebalance,
            )  # fmt: skip
        else:
            swaps = FRESH_SWAPS if load_aware else 0
            servers, ok = place_layer(
                w, n, r, budget, prev, dom, num_domains, total, changes, swaps
            )
        spread_ok &= ok
        for s, experts in enumerate(servers):
            total[s] += len(experts)
            if experts:
                hosted[s] += [(layer, e) for e in experts]
    return Placement(
        layers=layers,
        num_experts=num_experts,
        redundancy=redundancy,
        servers=tuple(tuple(sorted(h)) for h in hosted),
        slots_per_server=budget or 0,
        domain_spread=spread_ok,
    )
