"""Moves under a movement budget: lower one MoE layer's maximum server load with at most a given
number of moved replicas (:func:`improve`), and count what a layer's placement moved
(:func:`layer_moves`).

Two kinds of move, both keeping every server's replica count:

* **swap** (2 moved replicas): replica ``x`` of the most-loaded server ``a`` trades places with
  replica ``y`` of a light server ``b`` (``x`` not on ``b``, ``y`` not on ``a``);
* **re-replicate** (1 moved replica, only with a slot budget): a server ``b`` without ``h``
  (the hottest replica of ``a``) drops a replica of an expert ``y`` that keeps ``>= redundancy``
  replicas and loads one more replica of ``h`` instead; every server hosting ``h`` gets lighter
  (its load is split over one more replica), those hosting ``y`` heavier.

Each step takes the move whose affected servers end lowest, accepted only when all of them end
below ``a``'s load before the move (so the layer's maximum never rises, and the move is checked
on the recomputed loads). It stops when no move lowers ``a`` or the budget is spent.
Vectorized over experts with numpy (one ``[servers, experts]`` 0/1 matrix per layer).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

#: Light servers tried as the partner of the most-loaded one per step.
PARTNERS = 6
#: Experts with a spare replica (above ``redundancy``) considered per step as the one that
#: gives a replica up (the cheapest to lose one).
RECOUNT_DONORS = 64
_EPS = 1e-9


def layer_moves(prev: Sequence[set[int]], hold: Sequence[set[int]]) -> int:
    """Replicas ``hold`` puts on a server that did not host them in ``prev`` (same indices;
    ``prev`` may be shorter: servers beyond it are new)."""
    return sum(len(h - prev[s]) if s < len(prev) else len(h) for s, h in enumerate(hold))


def layer_max(hold: Sequence[set[int]], w: Sequence[float]) -> float:
    """The most-loaded server's load: an expert's load ``w[e]`` split evenly over its replicas."""
    cnt: dict[int, int] = {}
    for h in hold:
        for e in h:
            cnt[e] = cnt.get(e, 0) + 1
    return max((sum(w[e] / cnt[e] for e in h) for h in hold), default=0.0)


class _Layer:
    """One layer's hosting as numpy arrays: ``H [n, E]`` 0/1, ``cnt [E]``, ``q [E]`` (load
    per replica), ``L [n]`` (server load)."""

    def __init__(self, hold: Sequence[set[int]], w: Sequence[float]) -> None:
        n, big_e = len(hold), len(w)
        self.H = np.zeros((n, big_e))
        rows = np.repeat(np.arange(n), [len(h) for h in hold])
        cols = np.fromiter(itertools.chain.from_iterable(hold), dtype=np.int64, count=rows.size)
        self.H[rows, cols] = 1.0
        self.holders: list[set[int]] = [set() for _ in range(big_e)]  # servers of each expert
        for s, h in enumerate(hold):
            for e in h:
                self.holders[e].add(s)
        self.w = np.asarray(w, dtype=np.float64)
        self.mean = float(self.w.sum()) / n
        self.refresh()

    def refresh(self) -> None:
        self.cnt = self.H.sum(0)
        self.q = np.divide(self.w, self.cnt, out=np.zeros_like(self.w), where=self.cnt > 0)
        self.L = self.H @ self.q

    def apply(self, kind: str, a: int, x: int, b: int, y: int) -> np.ndarray:
        """Apply a move (``swap``: ``x`` from ``a`` to ``b``, ``y`` from ``b`` to ``a``;
        ``recount``: ``b`` drops ``y`` and loads ``x``); returns the servers whose load changed
        (``recount`` then undoes with ``apply("recount", a, y, b, x)``)."""
        H, L, q = self.H, self.L, self.q
        if kind == "swap":
            H[a, x], H[a, y], H[b, y], H[b, x] = 0.0, 1.0, 0.0, 1.0
            for e, src, dst in ((x, a, b), (y, b, a)):
                self.holders[e].discard(src)
                self.holders[e].add(dst)
            d = q[x] - q[y]
            L[a] -= d
            L[b] += d
            return np.array([a, b])
        H[b, y], H[b, x] = 0.0, 1.0
        self.holders[y].discard(b)
        self.holders[x].add(b)
        L[b] += q[x] - q[y]  # at the old shares, then every holder's share changes
        touched = []
        for e, step in ((x, 1.0), (y, -1.0)):
            self.cnt[e] += step
            new_q = self.w[e] / self.cnt[e]
            col = H[:, e]
            L += col * (new_q - q[e])
            q[e] = new_q
            touched.append(np.flatnonzero(col))
        return np.concatenate(touched)


def improve(
    hold: list[set[int]],
    w: Sequence[float],
    r: int,
    recount: bool,
    dom_of: Sequence[int],
    budget: int | None,
) -> tuple[int, float]:
    """Lower the layer's maximum server load in place with at most ``budget`` moved replicas
    (None: until no move helps; capped at 4 x the layer's replicas). ``recount``: replica
    counts may change (a slot budget is in force), else only swaps. Never puts two replicas of
    an expert on one server, never takes an expert below ``r`` replicas, and with shared
    failure domains (``dom_of``) never lowers the number of domains an expert spans below
    ``min(r, domains)``. Returns ``(replicas moved, the layer's maximum server load after)``."""
    n = len(hold)
    if n < 2 or not any(hold):
        return 0, layer_max(hold, w)
    lay = _Layer(hold, w)
    shared = len(set(dom_of)) < n
    want = min(r, len(set(dom_of)))
    total = int(lay.H.sum())
    left = 4 * total if budget is None else budget
    used = 0
    banned: set[tuple[str, int, int, int, int]] = set()
    while left > 0 and len(banned) < 16:
        move = _best_move(lay, r, recount, left >= 2, n, dom_of, shared, want, banned)
        if move is None:
            break
        kind, a, x, b, y = move
        la = float(lay.L[a])
        touched = lay.apply(kind, a, x, b, y)
        if float(lay.L[touched].max()) >= la - _EPS:  # the estimate was wrong: undo it
            lay.apply(kind, a, y, b, x)
            banned.add(move)
            continue
        cost = 2 if kind == "swap" else 1
        left -= cost
        used += cost
        if kind == "swap":
            hold[a].discard(x)
            hold[a].add(y)
            hold[b].discard(y)
            hold[b].add(x)
        else:
            hold[b].discard(y)
            hold[b].add(x)
    return used, float(lay.L.max())


def _best_move(
    lay: _Layer,
    r: int,
    recount: bool,
    swaps: bool,
    n: int,
    dom_of: Sequence[int],
    shared: bool,
    want: int,
    banned: set[tuple[str, int, int, int, int]],
) -> tuple[str, int, int, int, int] | None:
    """The move that ends its affected servers lowest below the most-loaded server's load:
    ``(kind, a, x, b, y)`` or None. Evaluated for all partners at once (``[x, b, y]`` arrays)."""
    L, H, q, cnt, w = lay.L, lay.H, lay.q, lay.cnt, lay.w
    a = int(np.argmax(L))
    la = float(L[a])
    if la <= lay.mean + _EPS:
        return None
    k = min(PARTNERS, n - 1)
    light = np.argpartition(L, k)[: k + 1] if k + 1 < n else np.arange(n)
    light = light[light != a]
    light = light[np.argsort(L[light], kind="stable")][:k]  # (k,) lightest first
    lb = L[light]  # (k,)
    ok_b = lb < la - _EPS
    light, lb = light[ok_b], lb[ok_b]
    if light.size == 0:
        return None
    on_a = H[a] > 0  # (E,)
    on_b = H[light] > 0  # (k, E)
    found: list[tuple[float, int, tuple[str, int, int, int, int]]] = []
    if swaps:
        xs = np.flatnonzero(on_a)  # (C,)
        ymask = on_b & ~on_a  # (k, E): what b could give a
        width = int(ymask.sum(1).max())
        if xs.size and width:
            ys = np.argsort(~ymask, axis=1, kind="stable")[:, :width]  # (k, W) expert ids
            yok = np.take_along_axis(ymask, ys, 1)  # (k, W)
            # d[x, b, y] = q[x] - q[y] for x of a not on b, y of b not on a
            valid = (~on_b[:, xs]).T[:, :, None] & yok[None, :, :]  # (C, k, W)
            d = q[xs][:, None, None] - q[ys][None, :, :]
            new_max = np.maximum(la - d, lb[None, :, None] + d)
            new_max = np.where(valid & (d > _EPS), new_max, np.inf).ravel()
            for t in _smallest(new_max, shared or bool(banned)):
                if new_max[t] >= la - _EPS:
                    break
                i, j, u = np.unravel_index(t, valid.shape)
                x, b, y = int(xs[i]), int(light[j]), int(ys[j, u])
                if shared and not (
                    _domain_ok(H, x, a, b, dom_of, want) and _domain_ok(H, y, b, a, dom_of, want)
                ):
                    continue
                if ("swap", a, x, b, y) in banned:
                    continue
                found.append((float(new_max[t]), 2, ("swap", a, x, b, y)))
                break
    if recount:
        hs = np.flatnonzero(on_a & (cnt < n))
        surplus = np.flatnonzero(cnt > r)  # experts that can give up a replica
        if hs.size and surplus.size:
            h = int(hs[np.argmax(q[hs])])
            surplus = surplus[surplus != h]
            if surplus.size > RECOUNT_DONORS:  # the cheapest to take a replica from
                cost = w[surplus] / (cnt[surplus] - 1)
                surplus = surplus[np.argsort(cost, kind="stable")[:RECOUNT_DONORS]]
        if hs.size and surplus.size:
            qh_new = w[h] / (cnt[h] + 1)
            a_new = la - (q[h] - qh_new)
            rise = w[surplus] / (cnt[surplus] - 1) - q[surplus]  # (m,) on y's other holders
            # the holders of each donor y, as (y, server) entries sorted by y then server
            held = [sorted(lay.holders[int(y)]) for y in surplus]
            ci = np.repeat(np.arange(surplus.size), [len(x) for x in held])  # (P,)
            bi = np.fromiter(itertools.chain.from_iterable(held), dtype=np.int64, count=ci.size)
            starts = np.flatnonzero(np.r_[True, ci[1:] != ci[:-1]])  # every y has >= 2
            lb_ = L[bi]  # (P,)
            m1 = np.maximum.reduceat(lb_, starts)  # (m,) the most-loaded holder's load
            pos = np.arange(ci.size)
            first = np.minimum.reduceat(np.where(lb_ == m1[ci], pos, ci.size), starts)
            lb2 = lb_.copy()
            lb2[first] = -np.inf
            m2 = np.maximum.reduceat(lb2, starts)  # (m,) the next one
            other = np.where(pos == first[ci], m2[ci], m1[ci])  # the other holders' max
            b_new = lb_ - q[surplus][ci] + qh_new  # b drops y, loads h
            res = np.maximum(np.maximum(other + rise[ci], b_new), a_new)
            res = np.where(H[bi, h] == 0, res, np.inf)
            key = bi * surplus.size + ci  # ties: lowest server, then donor
            for t in np.lexsort((key, res))[: 8 if (shared or banned) else 1]:
                if res[t] >= la - _EPS:
                    break
                b, y = int(bi[t]), int(surplus[ci[t]])
                if shared and not _domain_ok(H, y, b, -1, dom_of, want):
                    continue
                if ("recount", a, h, b, y) in banned:
                    continue
                found.append((float(res[t]), 1, ("recount", a, h, b, y)))
                break
    return min(found)[2] if found else None


def _smallest(v: np.ndarray, several: bool) -> list[int]:
    """Indices of the smallest entries of ``v``: the 8 smallest (ascending) or just the first."""
    if not several:
        return [int(v.argmin())]
    k = min(8, v.size)
    part = np.argpartition(v, k - 1)[:k] if k < v.size else np.arange(v.size)
    return [int(i) for i in part[np.lexsort((part, v[part]))]]


def _domain_ok(H: np.ndarray, e: int, src: int, dst: int, dom_of: Sequence[int], want: int) -> bool:
    """Whether moving ``e``'s replica off ``src`` (onto ``dst``; -1: dropped) keeps it spanning
    at least ``min(want, domains before)`` failure domains."""
    holders = [int(s) for s in np.flatnonzero(H[:, e] > 0)]
    before = {dom_of[s] for s in holders}
    after = {dom_of[s] for s in holders if s != src}
    if dst >= 0:
        after.add(dom_of[dst])
    return len(after) >= min(want, len(before))
