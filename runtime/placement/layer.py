"""One MoE layer's placement: replica counts, keep, place, then the swaps of
:mod:`.refine` (steps 1-5 of the package docstring)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from .core import PlacementError
from .refine import fix_domains, refine


def replica_counts(
    w: Sequence[float],
    kept: Sequence[int],
    n: int,
    r: int,
    slots: int,
    exchange: bool,
    cap: Sequence[int] | None = None,
) -> list[int]:
    """Replica count per expert: ``>= r``, ``<= n``, summing to ``min(slots, E * n)``, starting
    from ``kept`` and moving one replica at a time (EPLB's greedy on load per replica).
    ``cap``: when adding, no expert above ``cap[e]`` (the replicas the free slots can take
    without a survivor making room), unless the caps cannot reach the total."""
    big_e = len(w)
    target = min(slots, big_e * n)
    cnt = [min(max(k, r), n) for k in kept]
    if cap is not None and sum(max(c, min(x, n)) for c, x in zip(cnt, cap, strict=True)) >= target:
        n_of = [max(c, min(x, n)) for c, x in zip(cnt, cap, strict=True)]
    else:
        n_of = [n] * big_e
    tot = sum(cnt)
    if tot > target:  # remove from the expert whose load per replica stays lowest
        heap = [(w[e] / (cnt[e] - 1), -e) for e in range(big_e) if cnt[e] > r]
        heapq.heapify(heap)
        while tot > target:
            _, ne = heapq.heappop(heap)
            e = -ne
            cnt[e] -= 1
            tot -= 1
            if cnt[e] > r:
                heapq.heappush(heap, (w[e] / (cnt[e] - 1), ne))
    elif tot < target:  # add to the expert with the highest load per replica
        heap = [(-w[e] / cnt[e], e) for e in range(big_e) if cnt[e] < n_of[e]]
        heapq.heapify(heap)
        while tot < target:
            _, e = heapq.heappop(heap)
            cnt[e] += 1
            tot += 1
            if cnt[e] < n_of[e]:
                heapq.heappush(heap, (-w[e] / cnt[e], e))
    # exchange: move a replica from a cold expert to a hot one while that lowers the maximum
    # load per replica (only acts when loads changed since the kept counts were made)
    for _ in range(big_e * 4 if exchange else 0):
        hot = max(
            (e for e in range(big_e) if cnt[e] < n), key=lambda e: (w[e] / cnt[e], -e), default=None
        )
        cold = min(
            (e for e in range(big_e) if cnt[e] > r),
            key=lambda e: (w[e] / (cnt[e] - 1), e),
            default=None,
        )
        if hot is None or cold is None or hot == cold:
            break
        if w[hot] / cnt[hot] <= (w[cold] / (cnt[cold] - 1)) * 1.05:
            break
        cnt[hot] += 1
        cnt[cold] -= 1
    return cnt


def place_layer(
    w: Sequence[float],
    n: int,
    r: int,
    budget: int | None,
    prev: Sequence[set[int]],
    dom: Sequence[int],
    num_domains: int,
    total: Sequence[int],
    changes: list[int],
    swaps: int,
) -> tuple[list[set[int]], bool]:
    """Place one layer; returns (experts per server, domain spread achieved)."""
    big_e = len(w)
    hold = [set(p) for p in prev]
    kept = [0] * big_e
    for h in hold:
        for e in h:
            kept[e] += 1

    # 1. replica counts and per-server targets
    if budget is None:
        cnt = [r] * big_e
        t_all = big_e * r
    else:
        # room: replicas of e the servers with a free slot can take (a scale-up then never
        # makes a survivor hand a slot over, step 3's repair)
        free = [s for s in range(n) if len(hold[s]) < budget]
        room = list(kept)
        if len(free) < n:
            for e in range(big_e):
                room[e] += len(free)
            for s in free:
                for e in hold[s]:
                    room[e] -= 1
        cnt = replica_counts(
            w, kept, n, r, n * budget, exchange=swaps > 0, cap=room if len(free) < n else None
        )
        t_all = sum(cnt)
    base, extra = divmod(t_all, n)  # with a budget: == budget each unless E * n < n * budget
    order = sorted(range(n), key=lambda s: (-len(hold[s]), total[s], s))
    target = [base] * n
    for s in order[:extra]:
        target[s] += 1

    drops = [0] * n  # drops in this layer

    def drop_key(s: int) -> tuple:
        return (drops[s], changes[s], -len(hold[s]) + target[s], s)

    # 2a. surplus replicas of an expert (count went down): drop, spreading over servers
    where: dict[int, list[int]] = {}
    for s, h in enumerate(hold):
        for e in h:
            where.setdefault(e, []).append(s)
    for e in sorted(where):
        surplus = len(where[e]) - cnt[e]
        for _ in range(surplus):
            full = [s for s in where[e] if len(hold[s]) > target[s]]
            pool = full or where[e]
            s = min(pool, key=drop_key)
            hold[s].discard(e)
            where[e].remove(s)
            drops[s] += 1
    # 2b. servers above their target: drop their replicas of the best-covered, coldest experts
    rep_load = [w[e] / cnt[e] if cnt[e] else 0.0 for e in range(big_e)]
    for s in range(n):
        over = len(hold[s]) - target[s]
        if over > 0:
            for e in sorted(hold[s], key=lambda e: (-len(where[e]), rep_load[e], e))[:over]:
                hold[s].discard(e)
                where[e].remove(s)
                drops[s] += 1
    for s, d in enumerate(drops):
        if d:
            changes[s] += d

    # 3. place missing replicas, hottest first, LPT over servers with a free slot
    load = [sum(rep_load[e] for e in h) for h in hold]
    missing = [e for e in range(big_e) for _ in range(cnt[e] - len(where.get(e, ())))]
    missing.sort(key=lambda e: (-rep_load[e], e))
    heap = [(load[s], len(hold[s]), total[s], s) for s in range(n) if len(hold[s]) < target[s]]
    heapq.heapify(heap)
    dom_of = [dom[s] for s in range(n)]
    e_doms: dict[int, set[int]] = {e: {dom_of[s] for s in ss} for e, ss in where.items()}
    spread_ok = True
    for e in missing:
        used = e_doms.setdefault(e, set())
        skipped = []
        chosen = None
        fallback = None
        while heap:
            item = heapq.heappop(heap)
            s = item[3]
            if e in hold[s]:
                skipped.append(item)
                continue
            if dom_of[s] in used and len(used) < num_domains:
                skipped.append(item)
                if fallback is None:
                    fallback = item
                continue
            chosen = item
            break
        if chosen is None and fallback is not None:
            chosen = fallback
            skipped.remove(fallback)
        for item in skipped:
            heapq.heappush(heap, item)
        repaired = chosen is None
        if chosen is None:
            # every server with a free slot already hosts e: hand a slot over (rare)
            u, s2, f = repair(e, hold, target)
            where[f].remove(u)
            where[f].append(s2)
            e_doms[f] = {dom_of[x] for x in where[f]}
            load[u] -= rep_load[f]
            load[s2] += rep_load[f]
            chosen = (load[u], len(hold[u]), total[u], u)
        s = chosen[3]
        hold[s].add(e)
        where.setdefault(e, []).append(s)
        used.add(dom_of[s])
        load[s] += rep_load[e]
        if repaired:
            heap = [
                (load[x], len(hold[x]), total[x], x) for x in range(n) if len(hold[x]) < target[x]
            ]
            heapq.heapify(heap)
        elif len(hold[s]) < target[s]:
            heapq.heappush(heap, (load[s], len(hold[s]), total[s], s))

    # 4. refine: swap a replica of the most loaded server with a lighter one elsewhere
    if swaps:
        refine(hold, load, rep_load, dom_of, swaps)

    if num_domains < n:
        fix_domains(hold, load, rep_load, dom_of, min(r, num_domains))
        e_doms = {}
        for s, h in enumerate(hold):
            for e in h:
                e_doms.setdefault(e, set()).add(dom_of[s])
        spread_ok = all(len(e_doms.get(e, ())) >= r for e in range(big_e))
    return hold, spread_ok


def repair(e: int, hold: list[set[int]], target: Sequence[int]) -> tuple[int, int, int]:
    """Every server with a free slot already hosts ``e``. Find a full server ``u`` without
    ``e`` and a free server ``s`` that lacks some ``f`` of ``u``; move ``f`` from ``u`` to ``s``
    (so ``u`` has a slot for ``e``). Returns ``(u, s, f)``.

    Raises:
        PlacementError: no such pair (cannot happen while ``cnt[e] <= num_servers``).
    """
    free = [s for s in range(len(hold)) if len(hold[s]) < target[s]]
    for u in range(len(hold)):
        if e in hold[u] or len(hold[u]) < target[u]:
            continue
        for s in free:
            movable = sorted(hold[u] - hold[s])
            if movable:
                f = movable[0]
                hold[u].discard(f)
                hold[s].add(f)
                return u, s, f
    raise PlacementError("no placement keeps every replica of an expert on distinct servers")
