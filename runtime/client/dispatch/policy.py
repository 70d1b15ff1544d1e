"""The attention client's replica policy, pure: which replica of an expert gets which pair.

No sockets and no transport here: everything is a function of a routing table (its
:meth:`~eaas.runtime.tables.table.RoutingTable.replicas` and
:attr:`~eaas.runtime.tables.table.RoutingTable.servers`), the set of usable servers and a rotation
offset, so the policy is tested without expert servers.

* :class:`ReplicaMap`: a routing table as ``[E, R]`` server-index tensors, one per MoE layer.
* :func:`choose_replicas`: for every ``(token, selected expert, weight)`` pair ONE usable
  replica: an expert's pairs stay on one replica (the expert runs once per call) until it has
  more than ``split_pairs`` of them, then they are dealt round-robin over more of its usable
  replicas; the replica rotates by one per call for every expert of the layer (in phase, so a
  decode call reaches one "column" of the placement, e.g. 2 of 4 servers at R=2, and the next
  call the other), so an expert's load splits evenly over calls. A pair is never sent to two
  servers. Tensor operations, no Python work per token.
* :class:`PhaseTables`: the same choice precomputed per rotation phase for calls in which no
  expert's pairs are split (a decode step): one look-up per pair.
* :func:`uncovered_experts`: the ``(layer, expert)`` pairs without a live replica.
* :func:`reconnect_delay`: the back-off before a down expert server is tried again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from eaas.runtime.tables.table import RoutingTable

#: Seconds between connection attempts to a server this client has never reached. At start-up
#: (``eaas serve``, a new pod) clients and servers start together and a server may listen only
#: after its weights are loaded: the doubling back-off would leave it unused for up to 30 s after
#: it is ready.
FIRST_CONNECT_RETRY_S = 0.25

#: an expert's pairs in one layer call stay on one replica up to this many (then they are split
#: over more replicas): see :func:`choose_replicas`
DEFAULT_SPLIT_PAIRS = 256

NO_SERVER = -1  # pair not selected (``top_k_index`` -1)
NO_REPLICA = -2  # pair whose expert has no usable replica

#: rotation phases a :class:`PhaseTables` holds at most (the lcm of the experts' live replica
#: counts: 2 for R=2); a layer whose count is larger uses :func:`choose_replicas` for every call
MAX_PHASES = 64


def reconnect_delay(consecutive: int, ever_connected: bool, retry_down_s: float) -> float:
    """Seconds before a down server is tried again.

    Args:
        consecutive: failures since its last successful response (>= 1).
        ever_connected: whether this client ever had a connection to it.
        retry_down_s: the dispatcher's ``retry_down_s``.

    Returns:
        ``min(retry_down_s, FIRST_CONNECT_RETRY_S)`` for a server never reached (it is probably
        still starting), else ``retry_down_s * 2 ** (consecutive - 1)``, at most
        ``max(30, retry_down_s)`` (a server that failed after working).
    """
    if not ever_connected:
        return min(retry_down_s, FIRST_CONNECT_RETRY_S)
    return min(retry_down_s * 2 ** (consecutive - 1), max(30.0, retry_down_s))


@dataclass(frozen=True)
class ReplicaMap:
    """A routing table as tensors, for :func:`choose_replicas`.

    Attributes:
        sids: server ids; a server's index in this list is its number in ``replicas``.
        replicas: ``{layer: [E, R] int64}`` server index of each replica of each logical expert,
            ``-1`` padding (``R`` = the most replicas any expert of the layer has).
    """

    sids: tuple[str, ...]
    replicas: dict[int, torch.Tensor]

    @classmethod
    def from_table(cls, table: RoutingTable) -> ReplicaMap:
        """The tensors of ``table``, from its :attr:`~RoutingTable.servers` (server order) and
        :meth:`~RoutingTable.replicas` of every ``(layer, expert)``; built once per table."""
        sids = tuple(table.servers)
        index = {s: i for i, s in enumerate(sids)}
        reps: dict[int, torch.Tensor] = {}
        for layer in table.layers:
            # experts of this layer: today's RoutingTable does not check at construction that
            # every layer lists num_experts of them, so they are counted per layer
            experts = [table.replicas(layer, e) for e in range(len(table.layers[layer]))]
            r = max((len(x) for x in experts), default=0)
            m = torch.full((len(experts), max(r, 1)), -1, dtype=torch.int64)
            for e, x in enumerate(experts):  # once per table, not per call
                if x:
                    m[e, : len(x)] = torch.tensor([index[s] for s in x], dtype=torch.int64)
            reps[int(layer)] = m
        return cls(sids, reps)


def choose_replicas(
    experts: torch.Tensor,
    replicas: torch.Tensor,
    usable: torch.Tensor,
    start: torch.Tensor,
    *,
    live: tuple[torch.Tensor, torch.Tensor] | None = None,
    split_pairs: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one usable replica per ``(token, selected expert)`` pair, as tensor operations.

    Policy: an expert with ``c`` pairs in this call uses ``u = min(live replicas,
    ceil(c / split_pairs))`` of its usable replicas (in routing table order, beginning at
    ``start[e]``), and its pairs are dealt round-robin over those ``u`` (counts differ by at most
    one). ``split_pairs=1`` splits every expert's pairs over all its replicas; a larger value
    keeps an expert's pairs on ONE replica until it has more than ``split_pairs`` of them, so
    each expert runs once per call (one expert GEMM, not one per replica) and a small batch
    reaches fewer servers. No Python work per token.

    Args:
        experts: ``[T, k]`` int64 logical expert ids; ``-1`` = no expert.
        replicas: ``[E, R]`` int64 server index per replica, ``-1`` padding
            (:attr:`ReplicaMap.replicas` of one layer).
        usable: ``[S]`` bool, whether each server may receive pairs now.
        start: ``[E]`` int64 rotation offset per expert (the caller advances it between calls).
        live: ``live_replicas(replicas, usable)`` when the caller has it cached.
        split_pairs: pairs per replica before an expert's pairs are split (>= 1).

    Returns:
        ``(assign [T, k] int64, counts [E] int64)``: ``assign`` holds the chosen server index per
        pair, :data:`NO_SERVER` where ``experts`` is -1, :data:`NO_REPLICA` where the expert has
        no usable replica (or is not in ``replicas``); ``counts`` = pairs per expert.
    """
    T, k = experts.shape
    E, R = int(replicas.shape[0]), int(replicas.shape[1])
    flat = experts.reshape(-1)  # (T*k,)
    if flat.numel() == 0:
        return flat.view(T, k).clone(), torch.zeros(E, dtype=torch.int64)
    lo, hi = torch.aminmax(flat)
    if int(lo) >= 0 and int(hi) < E:  # common case: every pair is a real, known expert
        pos, ev = None, flat  # (P,) = (T*k,)
        assign = None
    else:
        assign = torch.full_like(flat, NO_SERVER)
        valid = flat >= 0
        inrange = valid & (flat < E)
        assign[valid & ~inrange] = NO_REPLICA
        pos = inrange.nonzero().squeeze(1)  # (P,) flat positions of real pairs
        ev = flat.index_select(0, pos)  # (P,) expert per pair
    counts = torch.bincount(ev, minlength=E)  # (E,)
    if ev.numel() == 0:
        assert assign is not None
        return assign.view(T, k), counts
    live_reps, nlive = live if live is not None else live_replicas(replicas, usable)
    m = nlive.index_select(0, ev)  # (P,) usable replicas of each pair's expert
    slot = start.index_select(0, ev)  # (P,)
    cmax = int(counts.max())
    if cmax > 1 and (split_pairs <= 1 or cmax > split_pairs):
        # rank of each pair among the pairs of its expert (stable: token order)
        srt = torch.argsort(ev, stable=True)  # (P,)
        group_start = torch.cumsum(counts, 0) - counts  # (E,)
        rank = torch.empty_like(ev)
        rank[srt] = torch.arange(ev.numel()) - group_start.index_select(0, ev.index_select(0, srt))
        if split_pairs > 1:  # replicas used per expert: ceil(c / split_pairs), at most nlive
            used = torch.minimum(nlive, (counts + split_pairs - 1) // split_pairs)  # (E,)
            rank = rank % used.index_select(0, ev).clamp(min=1)
        slot = slot + rank
    # else: every expert at most once, or none above split_pairs: every rank is 0
    slot = slot % m.clamp(min=1)
    chosen = live_reps.view(-1).index_select(0, ev * R + slot)  # (P,)
    chosen = torch.where(m > 0, chosen, NO_REPLICA)
    if assign is None:
        return chosen.view(T, k), counts
    assign[pos] = chosen
    return assign.view(T, k), counts


def live_replicas(
    replicas: torch.Tensor, usable: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Usable replicas of every expert moved to the front, table order kept.

    Args:
        replicas: ``[E, R]`` int64 server index per replica, ``-1`` padding.
        usable: ``[S]`` bool per server.

    Returns:
        ``(live_reps [E, R] int64, nlive [E] int64)``: the first ``nlive[e]`` entries of
        ``live_reps[e]`` are ``e``'s usable replicas (none when ``S`` is 0: a table without
        servers, every expert then has ``nlive`` 0).
    """
    live = replicas >= 0  # (E, R)
    live = live & usable[replicas.clamp(min=0)] if usable.numel() else torch.zeros_like(live)
    order = torch.argsort((~live).to(torch.int8), dim=1, stable=True)  # (E, R)
    return replicas.gather(1, order), live.sum(1)


@dataclass(frozen=True)
class PhaseTables:
    """:func:`choose_replicas` precomputed for calls in which no expert's pairs are split.

    When every expert has at most ``split_pairs`` pairs in a call (always so when the call has
    at most ``split_pairs`` pairs in all, as a decode step has), each pair goes to replica
    ``start % nlive`` of its expert, and ``start`` is the same for every expert of a layer
    (the dispatcher advances all of them by one per call). The choice then depends only on the
    expert and on the *phase* ``start % P`` (``P`` = the least common multiple of the live
    replica counts), so one look-up per pair replaces the policy's tensor work.

    Attributes:
        usable: ``[S]`` bool, the usable servers these tables were built for.
        live: ``live_replicas(replicas, usable)``.
        luts: ``P`` tensors ``[E + 1]`` int64, one per phase: ``luts[p][e + 1]`` is the server
            index chosen for expert ``e`` at phase ``p`` (:data:`NO_REPLICA` when ``e`` has no
            usable replica) and ``luts[p][0]`` is :data:`NO_SERVER` (expert id -1); empty when
            ``P > MAX_PHASES``.
        servers: per phase, the sorted server indices ``luts[p]`` holds (a superset of the servers
            one call reaches).
        complete: every expert has a usable replica (no :data:`NO_REPLICA` in ``luts``).
    """

    usable: torch.Tensor
    live: tuple[torch.Tensor, torch.Tensor]
    luts: tuple[torch.Tensor, ...]
    servers: tuple[tuple[int, ...], ...]
    complete: bool

    @classmethod
    def build(cls, replicas: torch.Tensor, usable: torch.Tensor) -> PhaseTables:
        """Tables for ``replicas`` ``[E, R]`` (server index per replica, -1 padding) and
        ``usable`` ``[S]`` bool."""
        live_reps, nlive = live = live_replicas(replicas, usable)
        counts = sorted({int(c) for c in nlive.tolist() if c > 0})  # once per table and set
        phases = math.lcm(*counts) if counts else 1
        complete = bool((nlive > 0).all())
        if phases > MAX_PHASES:
            return cls(usable, live, (), (), complete)
        p = torch.arange(phases).unsqueeze(1)  # (P, 1)
        slot = p % nlive.clamp(min=1).unsqueeze(0)  # (P, E)
        chosen = live_reps.gather(1, slot.t()).t()  # (P, E): live_reps[e, p % nlive[e]]
        chosen = torch.where(nlive.unsqueeze(0) > 0, chosen, NO_REPLICA)
        luts = torch.cat([torch.full((phases, 1), NO_SERVER, dtype=torch.int64), chosen], 1)
        servers = tuple(tuple(sorted({s for s in row if s >= 0})) for row in chosen.tolist())
        return cls(usable, live, tuple(luts.unbind(0)), servers, complete)

    def choose(self, experts: torch.Tensor, start: int) -> torch.Tensor | None:
        """``choose_replicas(experts, replicas, usable, full(start), split_pairs=...)[0]`` for a
        call in which no expert has more than ``split_pairs`` pairs.

        Args:
            experts: ``[T, k]`` int64 logical expert ids, -1 = none.
            start: the layer's rotation offset (the same for every expert).

        Returns:
            ``[T, k]`` int64 ``assign``, or None when there are no tables or some id is neither
            -1 nor a known expert (the caller then uses :func:`choose_replicas`).
        """
        luts = self.luts
        if not luts:
            return None
        lut = luts[start % len(luts)]  # (E + 1,)
        try:
            return lut.index_select(0, experts.reshape(-1) + 1).view(experts.shape)
        except IndexError:  # an id < -1 or >= E: the caller's choose_replicas handles it
            return None


def uncovered_experts(
    table: RoutingTable, moe_layers: Collection[int] | None, is_down: Callable[[str], bool]
) -> list[dict]:
    """``(layer, expert)`` pairs of ``table`` without a live replica, in ``(layer, expert)`` order.

    Args:
        table: the routing table in use.
        moe_layers: the model's MoE layer indices (every expert of one the table leaves out is
            uncovered), or None (only what the table lists is checked).
        is_down: whether a server id has no live connection (unknown ids count as down).

    Returns:
        Items ``{"layer", "expert", "reason", "replicas"}``: a MoE layer not in the table, an
        expert with no replica in the table, or one whose replicas are all down (``replicas``
        lists them).
    """
    out: list[dict] = []
    for layer in moe_layers or ():
        if layer not in table.layers:
            out.extend(
                {
                    "layer": layer,
                    "expert": e,
                    "reason": f"layer {layer} is not in routing table version {table.version}",
                    "replicas": [],
                }
                for e in range(table.num_experts)
            )
    for layer in sorted(table.layers):
        for e in range(len(table.layers[layer])):  # (as ReplicaMap.from_table counts them)
            reps = table.replicas(layer, e)
            if not reps:
                out.append(
                    {
                        "layer": layer,
                        "expert": e,
                        "reason": f"no replica in routing table version {table.version}",
                        "replicas": [],
                    }
                )
            elif all(is_down(r) for r in reps):
                out.append(
                    {
                        "layer": layer,
                        "expert": e,
                        "reason": "all replicas down",
                        "replicas": list(reps),
                    }
                )
    out.sort(key=lambda u: (u["layer"], u["expert"]))
    return out
