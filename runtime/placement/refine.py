"""Swaps within one MoE layer's placement: spread an expert's replicas over failure domains
(:func:`fix_domains`) and lower the most-loaded server's load (:func:`refine`)."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence


def fix_domains(
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
                        swap(hold, where, load, rep_load, s, e, u, f)
                        done = True
                        break
                    if done:
                        break
                if done:
                    break
            if not done:
                break
            de = doms(e)


def refine(
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
        swap(hold, where, load, rep_load, a, x, b, y)


def swap(
    hold: list[set[int]],
    where: Mapping[int, set[int]],
    load: list[float],
    rep_load: Sequence[float],
    a: int,
    x: int,
    b: int,
    y: int,
) -> None:
    """Swap replica ``x`` of server ``a`` with replica ``y`` of server ``b``: ``hold`` (experts
    per server), ``where`` (servers per expert) and ``load`` (per server) follow."""
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
