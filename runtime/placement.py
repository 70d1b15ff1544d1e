"""Placement: which expert server hosts which (layer, logical expert).

Pure functions only; no I/O. Used by ``eaas serve`` (local mode) and by the operator.

Glossary
--------
logical expert
    Expert ``e`` of MoE layer ``l`` as the model defines it (``0 <= e < num_experts``).
physical expert / replica
    One copy of a logical expert's weights on one expert server.
redundancy
    Minimum number of replicas of every logical expert, each on a distinct server, so that
    ``redundancy - 1`` servers can die without any expert losing its last replica.
placement
    For every server index ``s`` in ``[0, num_servers)``, the sorted list of ``(layer, expert)``
    pairs it hosts. Any ``num_servers >= redundancy`` works: there is no divisibility rule
    (monolithic EP needs ``num_servers | num_experts``).
slot budget
    ``slots_per_server``: replicas one server holds *per MoE layer* (GPU memory). With a budget
    every server is filled to it, and the slots beyond ``num_experts * redundancy`` hold extra
    replicas of the hottest experts (DeepSeek's EPLB "redundant experts", arXiv:2412.19437 §3.4).
expert load
    Tokens routed to a logical expert per interval. A replica's load is its expert's load split
    evenly over the expert's replicas; a server's load is the sum over its replicas.
    Balancedness = mean server load / max server load (1.0 is perfect), summed over layers
    (layers run one after another, so each layer's slowest server counts).

Algorithm (per MoE layer; layers are independent)
--------------------------------------------------
1. **Replica counts.** Every expert gets ``redundancy`` replicas. With a slot budget ``C`` the
   ``N * C`` slots are all used: starting from the counts the previous placement already has
   (or ``redundancy`` each), one replica at a time is added to the expert with the highest load
   per replica, or removed from the expert whose load per replica stays lowest (EPLB's
   ``replicate_experts`` greedy, with ``redundancy`` as the floor instead of 1).
2. **Keep.** Every surviving server keeps what it hosted, except replicas above an expert's
   new count and replicas above the server's new target count. Drops are spread over the
   servers (the server with the fewest drops so far goes first).
3. **Place.** The missing replicas, hottest first, go to the least-loaded server with a free slot
   that does not host the expert, preferring a failure domain the expert is not in yet (greedy
   longest-processing-time, as EPLB's ``balanced_packing`` but never two replicas of one expert
   on one server).
4. **Spread** (when servers share failure domains): swap two replicas while that raises the
   number of domains an expert spans toward ``redundancy`` without taking another expert below
   it (every swap strictly improves, so a placement that cannot improve is a fixed point).
5. **Refine** (load-aware and from scratch, or when ``rebalance_swaps`` allows it): swap one
   replica of the most-loaded server with a lighter replica elsewhere while that lowers the
   layer's maximum load.

Movement bound (what a rescale costs, stated per MoE layer)
-----------------------------------------------------------
Let ``C`` be the slot budget before and after (the operator's automatic budget keeps the
survivors' budget when scaling up, see ``slots_per_server``), loads unchanged, no
``rebalance_swaps`` and no failure-domain swap needed (each such swap moves 2 more replicas).
Tested in ``tests/runtime/test_placement_incremental.py`` for 4→5, 8→9, 40→41, 41→40, 40→64 and
64→40 on the DeepSeek-V3 shape.

* ``N -> N' > N``: no surviving server changes (step 1 only adds replicas, every survivor is full,
  so all new replicas land on the new servers). Replicas moved = ``(N' - N) * C`` per layer, i.e.
  the new servers' content: a fraction ``(N' - N) / N'`` of all replicas.
* ``N -> N' < N``: the removed servers' replicas of experts that would fall below their count
  (at most ``k = (N - N') * C`` per layer) are re-homed on survivors, each into a slot freed by
  dropping a surplus replica. A surviving server changes at most ``2 * ceil(k / N') + 2``
  replicas per layer (drops spread evenly, plus one for an occasional distinctness repair).
  Replicas moved: at most ``max(k, N' * (C' - C))`` per layer (``C'``: the new budget, larger
  when the survivors must make room), about the removed servers' share ``(N - N') / N``.

Without a budget (``slots_per_server=None``, exactly ``redundancy`` replicas per expert, server
counts ``floor``/``ceil`` of ``E * R / N``) a scale-up must take the new servers' replicas from
the survivors: each survivor then drops at most ``ceil(E * R / N) - floor(E * R / N')`` per layer.

Policies
--------
``round-robin``
    Load-unaware: every expert counts as equally loaded (the layout spreads replicas evenly and
    rotates the servers that get the ``ceil`` share from layer to layer).
``load-balanced``
    Uses ``expert_load`` (missing entries count as the layer's mean, 1.0 without any load).
"""

from __future__ import annotations

import bisect
import heapq
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

POLICIES = ("round-robin", "load-balanced")

LayerExpert = tuple[int, int]

#: Refinement swaps per layer for a placement from scratch (a cap, never reached in practice).
_FRESH_SWAPS = 64


class PlacementError(ValueError):
    """Raised when no placement satisfies the request (e.g. redundancy > num_servers)."""


@dataclass(frozen=True)
class Placement:
    """Result of :func:`place_experts`.

    Attributes:
        layers: model layer indices that are MoE layers, ascending.
        num_experts: logical experts per MoE layer.
        redundancy: minimum replicas of every logical expert (some may have more).
        servers: ``servers[s]`` is the sorted tuple of ``(layer, expert)`` hosted by server ``s``.
        slots_per_server: the per-layer slot budget used (0: none, exactly ``redundancy``).
        domain_spread: True when the replicas of every expert span at least ``redundancy``
            failure domains (so ``redundancy - 1`` domains may fail). False when the pool does
            not allow it (fewer domains than ``redundancy``, or too few free slots in them);
            the placement then still uses as many domains per expert as it can.
    """

    layers: tuple[int, ...]
    num_experts: int
    redundancy: int
    servers: tuple[tuple[LayerExpert, ...], ...]
    slots_per_server: int = 0
    domain_spread: bool = True

    @property
    def num_servers(self) -> int:
        return len(self.servers)

    def replicas(self) -> dict[LayerExpert, tuple[int, ...]]:
        """Map ``(layer, expert)`` to the server indices hosting it (ascending)."""
        out: dict[LayerExpert, list[int]] = {}
        for s, pairs in enumerate(self.servers):
            for pair in pairs:
                out.setdefault(pair, []).append(s)
        return {k: tuple(v) for k, v in sorted(out.items())}

    def experts_per_server(self) -> list[int]:
        return [len(p) for p in self.servers]

    def experts_below_redundancy(self, alive: Sequence[int] | None = None) -> int:
        """Count logical experts with fewer than ``redundancy`` replicas on ``alive`` servers
        (all servers when ``alive`` is None)."""
        live = set(range(self.num_servers)) if alive is None else set(alive)
        reps = self.replicas()
        count = 0
        for layer in self.layers:
            for e in range(self.num_experts):
                n = sum(1 for s in reps.get((layer, e), ()) if s in live)
                if n < self.redundancy:
                    count += 1
        return count


def auto_slots(num_experts: int, redundancy: int, num_servers: int) -> int:
    """The smallest per-layer slot budget that fits ``redundancy`` replicas of every expert:
    ``ceil(num_experts * redundancy / num_servers)``."""
    return -(-num_experts * redundancy // num_servers)


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
    rebalance_swaps: int = 0,
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
        rebalance_swaps: refinement swaps allowed per layer when ``previous`` is given (each
            moves 2 replicas); a placement from scratch refines freely.

    Returns:
        A :class:`Placement`.

    Raises:
        PlacementError: ``num_servers < 1``, ``redundancy < 1``, ``redundancy > num_servers``,
            ``num_experts < 1``, an unknown policy, a negative budget, or ``domains`` of the
            wrong length.
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
    if rebalance_swaps < 0:
        raise PlacementError(f"rebalance_swaps must be >= 0, got {rebalance_swaps}")

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
    swaps = _FRESH_SWAPS if fresh else rebalance_swaps

    hosted: list[list[LayerExpert]] = [[] for _ in range(n)]
    total = [0] * n  # replicas per server over the layers placed so far (memory balance)
    changes = [0] * n  # drops per server over the layers placed so far (spread the churn)
    spread_ok = True
    for layer in layers:
        if load_aware:
            assert expert_load is not None
            known = [float(v) for (lay, _), v in expert_load.items() if lay == layer]
            default = sum(known) / len(known) if known else 1.0
            w = [max(0.0, float(expert_load.get((layer, e), default))) for e in range(big_e)]
        else:
            w = [1.0] * big_e
        servers, ok = _place_layer(
            w,
            n,
            r,
            budget,
            prev_layers[layer],
            dom,
            num_domains,
            total,
            changes,
            swaps if load_aware else 0,
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


# ---------------------------------------------------------------------------------------------
# one layer
# ---------------------------------------------------------------------------------------------
def _replica_counts(
    w: Sequence[float], kept: Sequence[int], n: int, r: int, slots: int, exchange: bool
) -> list[int]:
    """Replica count per expert: ``>= r``, ``<= n``, summing to ``min(slots, E * n)``, starting
    from ``kept`` and moving one replica at a time (EPLB's greedy on load per replica)."""
    big_e = len(w)
    target = min(slots, big_e * n)
    cnt = [min(max(k, r), n) for k in kept]
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
        heap = [(-w[e] / cnt[e], e) for e in range(big_e) if cnt[e] < n]
        heapq.heapify(heap)
        while tot < target:
            _, e = heapq.heappop(heap)
            cnt[e] += 1
            tot += 1
            if cnt[e] < n:
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


def _place_layer(
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
        base, extra = divmod(t_all, n)
        order = sorted(range(n), key=lambda s: (-len(hold[s]), total[s], s))
        target = [base] * n
        for s in order[:extra]:
            target[s] += 1
    else:
        cnt = _replica_counts(w, kept, n, r, n * budget, exchange=swaps > 0)
        t_all = sum(cnt)
        base, extra = divmod(t_all, n)  # == budget each unless E * n < n * budget
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
            u, s2, f = _repair(e, hold, target)
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
        _refine(hold, load, rep_load, dom_of, swaps)

    if num_domains < n:
        _fix_domains(hold, load, rep_load, dom_of, min(r, num_domains))
        e_doms = {}
        for s, h in enumerate(hold):
            for e in h:
                e_doms.setdefault(e, set()).add(dom_of[s])
        spread_ok = all(len(e_doms.get(e, ())) >= r for e in range(big_e))
    return hold, spread_ok


def _repair(e: int, hold: list[set[int]], target: Sequence[int]) -> tuple[int, int, int]:
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


def _fix_domains(
    hold: list[set[int]],
    load: list[float],
    rep_load: Sequence[float],
    dom_of: Sequence[int],
    want: int,
) -> None:
    """Swap replicas so every expert spans ``want`` failure domains where a swap allows it:
    a replica of ``e`` on ``s`` (a domain ``e`` uses twice) trades places with a replica of
    ``f`` on ``u`` (a domain ``e`` does not use) when ``f`` keeps ``want`` domains too."""
    n = len(hold)
    where: dict[int, set[int]] = {}
    for x, h in enumerate(hold):
        for e in h:
            where.setdefault(e, set()).add(x)

    def doms(e: int) -> dict[int, int]:
        out: dict[int, int] = {}
        for x in where[e]:
            out[dom_of[x]] = out.get(dom_of[x], 0) + 1
        return out

    for e in sorted(where):
        de = doms(e)
        while len(de) < want:
            done = False
            dups = sorted(x for x in where[e] if de[dom_of[x]] > 1)
            for s in dups:
                for u in range(n):
                    if dom_of[u] in de or e in hold[u]:
                        continue
                    for f in sorted(hold[u] - hold[s]):
                        df = doms(f)
                        after = dict(df)
                        after[dom_of[u]] -= 1
                        if not after[dom_of[u]]:
                            del after[dom_of[u]]
                        after[dom_of[s]] = after.get(dom_of[s], 0) + 1
                        if len(after) < min(want, len(df)):
                            continue
                        hold[s].discard(e)
                        hold[s].add(f)
                        hold[u].discard(f)
                        hold[u].add(e)
                        where[e].discard(s)
                        where[e].add(u)
                        where[f].discard(u)
                        where[f].add(s)
                        d = rep_load[e] - rep_load[f]
                        load[s] -= d
                        load[u] += d
                        done = True
                        break
                    if done:
                        break
                if done:
                    break
            if not done:
                break
            de = doms(e)


def _refine(
    hold: list[set[int]],
    load: list[float],
    rep_load: Sequence[float],
    dom_of: Sequence[int],
    swaps: int,
) -> None:
    """Swap one replica of the most-loaded server with a lighter replica on one of the 8
    least-loaded servers, the pair whose difference is closest to half the load gap, while
    that lowers the pair's maximum. Never puts two replicas of an expert on one server, nor
    into a failure domain that already has one (unless both servers share the domain)."""
    n = len(hold)
    where: dict[int, set[int]] = {}
    for s, h in enumerate(hold):
        for e in h:
            where.setdefault(e, set()).add(s)

    def domain_free(e: int, src: int, dst: int) -> bool:
        if dom_of[src] == dom_of[dst]:
            return True
        return all(dom_of[s] != dom_of[dst] for s in where[e] if s != src)

    for _ in range(swaps):
        a = max(range(n), key=lambda s: (load[s], -s))
        la = load[a]
        best = None  # (new max of the pair, x, b, y)
        for b in sorted(range(n), key=lambda s: (load[s], s))[:8]:
            gap = la - load[b]
            if b == a or gap <= 1e-12:
                continue
            ys = sorted((rep_load[y], y) for y in hold[b] if y not in hold[a])
            keys = [v for v, _ in ys]
            for x in sorted(hold[a]):
                if x in hold[b]:
                    continue
                want = rep_load[x] - gap / 2
                i = bisect.bisect_left(keys, want)
                for j in (i - 1, i):
                    if not 0 <= j < len(ys):
                        continue
                    ly, y = ys[j]
                    d = rep_load[x] - ly
                    if d <= 1e-12:
                        continue
                    new_max = max(la - d, load[b] + d)
                    if new_max < la - 1e-12 and (best is None or new_max < best[0]):
                        if domain_free(x, a, b) and domain_free(y, b, a):
                            best = (new_max, x, b, y)
        if best is None:
            return
        _, x, b, y = best
        hold[a].discard(x)
        hold[a].add(y)
        hold[b].discard(y)
        hold[b].add(x)
        where[x].discard(a)
        where[x].add(b)
        where[y].discard(b)
        where[y].add(a)
        d = rep_load[x] - rep_load[y]
        load[a] -= d
        load[b] += d


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


def balancedness(placement: Placement, expert_load: Mapping[LayerExpert, float] | None) -> float:
    """Mean over max per-server load, summed over MoE layers: ``sum_l mean_s load[l][s] /
    sum_l max_s load[l][s]`` (1.0 is perfect; layers run one after another, so every layer's
    slowest server counts). Returns 1.0 for a placement without load."""
    mean = peak = 0.0
    for loads in server_loads(placement, expert_load).values():
        mean += sum(loads) / len(loads)
        peak += max(loads)
    return mean / peak if peak > 0 else 1.0


def dispatch_columns(placement: Placement) -> list[frozenset[int]]:
    """The sets of servers one small decode call reaches: per MoE layer and replica slot ``r``,
    ``{replicas(layer, e)[r % len] for every expert e}`` (the routing table lists an expert's
    replicas in ascending server order, :meth:`~eaas.runtime.routing.RoutingTable.from_placement`).

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


#: expert servers' Linux scheduling policies (``sched(7)``; neither needs privileges):
#: ``eaas expert-server --sched-policy`` and ``eaas serve --server-sched-policy``
SCHED_POLICIES = {"other": os.SCHED_OTHER, "batch": os.SCHED_BATCH}


def spread_over_cpus(placement: Placement, cpus: Sequence[int]) -> tuple[int, ...]:
    """One CPU per server (``eaas serve --server-cpus auto``) such that the servers one decode
    call reaches (:func:`dispatch_columns`) run on different CPUs where the CPUs allow it.

    Why: a call wakes its servers together and waits for the slowest. Unpinned on a 2-core
    host, the kernel often queued both servers of a call on one CPU (the second waited ~1.2 ms,
    a whole frame) while the other CPU went idle: its idle balancing skips a CPU whose idle
    spells are short (``docs/serving.md``, "The price of disaggregation, fourth pass").

    Servers spread evenly (counts differ by at most one); then, greedy in server order, each
    goes to the CPU (with room) holding the fewest servers it shares a column with; then swaps of
    two servers' CPUs while one lowers the number of same-CPU pairs in a column. Deterministic.

    Args:
        placement: the placement the routing table is built from.
        cpus: CPU ids to use (e.g. ``sorted(os.sched_getaffinity(0))``), at least one.

    Returns:
        ``cpu[s]`` for every server ``s`` (a value of ``cpus``).

    Raises:
        ValueError: ``cpus`` is empty.
    """
    if not cpus:
        raise ValueError("no CPUs to spread the servers over")
    n, m = placement.num_servers, len(cpus)
    shared = [[0] * n for _ in range(n)]  # shared[s][t]: columns holding both s and t
    for col in dispatch_columns(placement):
        for s in col:
            for t in col:
                if s != t:
                    shared[s][t] += 1
    room = -(-n // m)  # at most this many servers per CPU
    on: list[list[int]] = [[] for _ in range(m)]  # servers on each CPU (by position)
    where = [0] * n
    for s in range(n):
        best = min(
            (c for c in range(m) if len(on[c]) < room),
            key=lambda c: (sum(shared[s][t] for t in on[c]), len(on[c]), c),
        )
        on[best].append(s)
        where[s] = best

    def cost(s: int, c: int, skip: int) -> int:  # s's column mates on CPU c, ``skip`` aside
        return sum(shared[s][t] for t in on[c] if t != skip)

    improved = True
    while improved:  # each swap lowers the total: it ends
        improved = False
        for s in range(n):
            for t in range(s + 1, n):
                a, b = where[s], where[t]
                if a == b:
                    continue
                delta = cost(s, b, t) + cost(t, a, s) - cost(s, a, s) - cost(t, b, t)
                if delta < 0:
                    on[a].remove(s)
                    on[b].remove(t)
                    on[a].append(t)
                    on[b].append(s)
                    where[s], where[t] = b, a
                    improved = True
    return tuple(int(cpus[where[s]]) for s in range(n))


def format_expert_spec(pairs: Sequence[LayerExpert]) -> str:
    """Compact text form of hosted experts for a command line: ``"1:0-3,7;2:5"``.

    Layers separated by ``;``, each ``layer:ranges`` with comma-separated ``a`` or ``a-b``.
    """
    by_layer: dict[int, list[int]] = {}
    for layer, e in sorted(pairs):
        by_layer.setdefault(layer, []).append(e)
    parts = []
    for layer, experts in by_layer.items():
        ranges = []
        start = prev = experts[0]
        for e in experts[1:]:
            if e == prev + 1:
                prev = e
                continue
            ranges.append(str(start) if start == prev else f"{start}-{prev}")
            start = prev = e
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        parts.append(f"{layer}:{','.join(ranges)}")
    return ";".join(parts)


def parse_expert_spec(spec: str) -> list[LayerExpert]:
    """Inverse of :func:`format_expert_spec`.

    Raises:
        ValueError: malformed spec (message quotes the bad part).
    """
    out: list[LayerExpert] = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        try:
            layer_s, ranges = part.split(":", 1)
            layer = int(layer_s)
            for r in filter(None, ranges.split(",")):
                if "-" in r:
                    a, b = (int(x) for x in r.split("-", 1))
                    if b < a:
                        raise ValueError
                    out.extend((layer, e) for e in range(a, b + 1))
                else:
                    out.append((layer, int(r)))
        except ValueError:
            raise ValueError(
                f"malformed expert spec part {part!r} (expected 'layer:a-b,c')"
            ) from None
    return sorted(set(out))
