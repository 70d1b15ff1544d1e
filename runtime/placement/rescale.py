"""One MoE layer placed after a change with the load known (:func:`rescale_layer`): the best of
the load-aware incremental step, the load-oblivious one and a placement from scratch, each
improved within the movement budget (the package docstring states the bounds)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from .budget import improve, layer_max, layer_moves
from .layer import place_layer, replica_counts

#: Refinement swaps per layer for a placement from scratch (a cap, never reached in practice).
FRESH_SWAPS = 64
#: A placement from scratch is also tried unless the best candidate is within this factor of a
#: lower bound of what it can reach (``max(mean load, hottest load per replica)``).
FRESH_SLACK = 2e-3
#: ... and the movement allowance holds at least this share of the layer's replicas (matched to
#: the servers, a placement from scratch still moves 2/3 or more of them: measured).
FRESH_MIN_ALLOWANCE = 0.5


def rescale_layer(
    w: Sequence[float],
    n: int,
    r: int,
    budget: int | None,
    prev: Sequence[set[int]],
    dom: Sequence[int],
    num_domains: int,
    total: Sequence[int],
    changes: list[int],
    fraction: float | None,
    rebalance: bool,
) -> tuple[list[set[int]], bool]:
    """Place one layer incrementally from ``prev`` with the load ``w`` known; returns
    ``(experts per server, domain spread achieved)``.

    Candidates: the load-aware step (:func:`place_layer` without swaps: new servers filled, lost
    servers' replicas re-homed, what the change forces) improved by :func:`~.budget.improve`
    with ``floor(fraction * replicas)`` more moves; the load-oblivious step (the same with every
    expert equally loaded), improved the same way when it beats the first (skipped when the first
    reaches the layer's lower bound, where nothing can beat it); and, when every server is its
    own failure domain and the allowance ``aware step's moves + floor(fraction * replicas)``
    holds at least :data:`FRESH_MIN_ALLOWANCE` of the replicas, a placement from scratch matched
    to the servers it overlaps most (taken only within the allowance). ``fraction`` None: no
    limit. The lowest maximum server load wins, then the fewest moves: never worse than the
    load-oblivious step. With nothing to move and no ``rebalance`` the load-aware step is
    returned as it is (a placement in force is a fixed point)."""
    big_e = len(w)
    aware_changes = list(changes)
    aware, aware_ok = place_layer(w, n, r, budget, prev, dom, num_domains, total, aware_changes, 0)
    m_aware = layer_moves(prev, aware)
    if m_aware == 0 and not rebalance:
        changes[:] = aware_changes
        return aware, aware_ok
    replicas = sum(len(h) for h in aware)
    extra = None if fraction is None else math.floor(fraction * replicas)
    recount = budget is not None
    used, aware_max = improve(aware, w, r, recount, dom, extra)
    cands = [(aware_max, m_aware + used, 0, aware, aware_ok, aware_changes)]
    bound = _lower_bound(w, n, r, budget)
    if aware_max > bound * (1 + 1e-9):  # the load-oblivious step, improved when it is better
        plain_changes = list(changes)
        plain, plain_ok = place_layer(
            [1.0] * big_e, n, r, budget, prev, dom, num_domains, total, plain_changes, 0
        )
        m_plain = layer_moves(prev, plain)
        plain_max = layer_max(plain, w)
        if plain_max < aware_max:
            used, plain_max = improve(plain, w, r, recount, dom, extra)
            m_plain += used
        cands.append((plain_max, m_plain, 1, plain, plain_ok, plain_changes))
    best_max = min(c[0] for c in cands)
    allow = None if extra is None else m_aware + extra
    if (
        num_domains == n
        and (allow is None or allow >= FRESH_MIN_ALLOWANCE * replicas)
        and best_max > bound * (1 + FRESH_SLACK)
    ):
        fresh, fresh_ok = place_layer(
            w,
            n,
            r,
            budget,
            [set() for _ in range(n)],
            dom,
            num_domains,
            total,
            [0] * n,
            FRESH_SWAPS,
        )
        fresh = match_servers(prev, fresh)
        m = layer_moves(prev, fresh)
        if allow is None or m <= allow:
            cands.append((layer_max(fresh, w), m, 2, fresh, fresh_ok, list(changes)))
            best_max = min(best_max, cands[-1][0])
    near = [c for c in cands if c[0] <= best_max * (1 + 1e-9)]
    _, _, _, hold, ok, ch = min(near, key=lambda c: (c[1], c[2]))
    changes[:] = ch
    return hold, ok


def _lower_bound(w: Sequence[float], n: int, r: int, budget: int | None) -> float:
    """What no placement of the layer's slots goes below: the mean server load and the hottest
    load per replica with EPLB's replica counts (the counts that minimize it)."""
    big_e = len(w)
    if budget is None:
        cnt = [r] * big_e
    else:
        cnt = replica_counts(w, [0] * big_e, n, r, n * budget, exchange=False)
    return max(sum(w) / n, max(w[e] / cnt[e] for e in range(big_e)))


def match_servers(prev: Sequence[set[int]], fresh: Sequence[set[int]]) -> list[set[int]]:
    """``fresh``'s server contents re-assigned to the servers of ``prev`` they overlap most
    (greedy on the overlap, ties by index): a placement from scratch moved as little as a
    relabelling allows. Deterministic."""
    n = len(fresh)
    holders: dict[int, list[int]] = {}
    for s, h in enumerate(prev):
        for e in h:
            holders.setdefault(e, []).append(s)
    overlap: dict[tuple[int, int], int] = {}
    for j, t in enumerate(fresh):
        for e in t:
            for s in holders.get(e, ()):
                overlap[(j, s)] = overlap.get((j, s), 0) + 1
    out: list[set[int] | None] = [None] * n
    taken: set[int] = set()
    for (j, s), _ in sorted(overlap.items(), key=lambda kv: (-kv[1], kv[0])):
        if out[s] is None and j not in taken:
            out[s] = fresh[j]
            taken.add(j)
    rest = iter(j for j in range(n) if j not in taken)
    return [h if h is not None else fresh[next(rest)] for h in out]
