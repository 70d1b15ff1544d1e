"""Dispatch and combine: the attention client's side of one MoE layer call.

:class:`RemoteExperts` replaces a model's routed-experts module (``experts_factory`` of
:func:`eaas.runtime.models.load_attention_model`); the model's own router and shared expert stay
local, so the MoE block computes ``shared(x) + RemoteExperts(x, top_k_index, top_k_weights)``.

:class:`Dispatcher` (one per attention client process) holds the routing table and one transport
connection per expert server. Per MoE layer call (:meth:`Dispatcher.dispatch`):

1. **Pick replicas** (:func:`choose_replicas`, tensor operations, no Python work per token).
   For every ``(token, selected expert, weight)`` pair ONE connected replica of
   ``(layer, expert)``: an expert's pairs stay on one replica (the expert runs once per call)
   until it has more than ``split_pairs`` of them, then they are dealt round-robin over more of
   its usable replicas; the replica rotates by one per call for every expert of the layer (in
   phase, so a decode call reaches one "column" of the placement, e.g. 2 of 4 servers at R=2,
   and the next call the other), so an expert's load splits evenly over calls. A pair is never
   sent to two servers.
2. **Dispatch.** One :class:`RequestFrame` per target server (a loop over servers, not tokens):
   each token's hidden row once -- gathered by the transport straight from the ``[T, H]`` batch
   into its send buffer (``RequestFrame.rows``), the only copy -- plus its ``[k]`` expert ids /
   weights in which the pairs assigned to other servers are padded with ``-1`` / ``0``; send to
   all targets, then wait for all of them with one deadline (``timeout`` seconds).
3. **Failover.** A server that raises :class:`PeerDeadError` / :class:`DeadlineExceeded` /
   another transport error, or answers an error status, is marked down (``eaas_server_marked_down``
   metric, a log line, connection closed); ONLY its pairs are re-assigned to other connected
   replicas and sent again (``eaas_failovers_total`` += 1 per failed server batch); repeat. If
   some expert has no live replica left, :class:`NoLiveReplicaError` is raised (retryable; the
   API answers 503). A server that answers ``STATUS_NOT_HOSTED`` (it no longer hosts an expert
   of the frame: its assignment changed with a newer routing table, see
   :mod:`eaas.runtime.assignment`) is NOT marked down: it is healthy. The frame's pairs are
   re-sent to other replicas, that server left out for the rest of this call
   (:attr:`Dispatcher.not_hosted_resends` counts such frames). If
   :meth:`Dispatcher.uncovered` lists the experts without a live replica
   (GET /health answers 503 while there are any).
4. **Combine.** The per-server partial sums are added (``index_add_``) into one ``[T, H]``
   tensor, returned on the caller's device. Hidden states on a GPU stay there for connections
   whose payload is on the GPU (``cudaipc`` with a CUDA payload, ``nvshmem``); host
   connections get one host copy per call (:mod:`eaas.runtime.gpu.staging`).

Connections are opened only by the dispatcher's connector thread, never on the request path: at
once for a new server, every :data:`FIRST_CONNECT_RETRY_S` for one never reached yet (it is
probably still starting), for a down one after ``retry_down_s``, doubling per consecutive
failure up to 30 s (connect timeout at most 2 s), and immediately when a newer routing table
lists it again. The state lock is never held across network I/O, so ``/health`` answers while a
layer call waits for a hung (e.g. SIGSTOPped) server.

Routing table updates: :meth:`Dispatcher.set_table` (thread safe; never waits for a layer call)
accepts only strictly newer versions; :class:`RoutingTableWatcher` polls a JSON file
(e.g. a Kubernetes ConfigMap mount) by mtime/size/inode and feeds it in. The version in use is
published in the ``eaas_routing_table_version{client_id}`` gauge and by :meth:`Dispatcher.health`
(GET /health) -- that is the client's acknowledgement.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn

from eaas.runtime import metrics
from eaas.runtime.gpu.staging import FrameStaging, staging_device
from eaas.runtime.routing import RoutingTable, RoutingTableError
from eaas.runtime.transport.base import (
    MAX_K_HARD,
    STATUS_NOT_HOSTED,
    STATUS_OK,
    ClientConnection,
    PeerDeadError,
)

log = logging.getLogger("eaas.client.dispatch")


HEALTH_MAX_UNCOVERED = 32  # uncovered (layer, expert) pairs listed in health()


class NoLiveReplicaError(RuntimeError):
    """Some (layer, expert) selected by the router has no live replica. Retryable (HTTP 503).

    Attributes:
        layer: model layer index.
        expert: logical expert id.
    """

    def __init__(self, layer: int, expert: int, detail: str = ""):
        self.layer, self.expert = layer, expert
        super().__init__(
            f"no live replica of expert {expert} of layer {layer}"
            + (f" ({detail})" if detail else "")
        )


@dataclass
class _Server:
    server_id: str
    endpoint: str
    conn: ClientConnection | None = None
    down: bool = False
    retry_at: float = 0.0
    seq: int = 0
    tokens_sent: int = 0
    failures: int = 0
    consecutive: int = 0  # failures since the last successful response (reconnect back-off)
    ever_connected: bool = False  # this client has had a connection to it (back-off applies)
    last_error: str = ""
    connecting: bool = False  # the connector is opening a connection right now
    busy: bool = False  # a dispatch call is using ``conn`` outside the lock
    retired: bool = False  # dropped by a newer table while busy: the dispatch call closes it


Connector = Callable[..., ClientConnection]

#: Seconds between connection attempts to a server this client has never reached. At start-up
#: (``eaas serve``, a new pod) clients and servers start together and a server may listen only
#: after its weights are loaded: the doubling back-off would leave it unused for up to 30 s after
#: it is ready.
FIRST_CONNECT_RETRY_S = 0.25


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


def check_call(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, hidden_size: int
) -> None:
    """Validate one MoE layer call's tensors once, before any frame: every frame is then built
    to its shapes (``[n, k]`` expert ids / weights, rows of ``[T, H]`` hidden states) and sent
    with :meth:`~eaas.runtime.transport.base.ClientConnection.send_parts`, which does not
    validate each frame again. A wrong call is the caller's error, never a server marked down.

    Args:
        hidden: ``[T, H]``, ``H == hidden_size``.
        top_k_index: ``[T, k]``.
        top_k_weights: ``[T, k]``.

    Raises:
        ValueError: other shapes, or ``k`` above the frame limit ``MAX_K_HARD`` (``T`` is not
            limited here: a call's tokens are split over servers; a frame above
            ``MAX_TOKENS_HARD`` is refused by the transport).
    """
    if hidden.dim() != 2 or hidden.shape[1] != hidden_size:
        raise ValueError(f"hidden must be [T, {hidden_size}], got {tuple(hidden.shape)}")
    T = hidden.shape[0]
    if top_k_index.dim() != 2 or top_k_index.shape[0] != T:
        raise ValueError(f"top_k_index must be [{T}, k], got {tuple(top_k_index.shape)}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"top_k_weights {tuple(top_k_weights.shape)} must match top_k_index "
            f"{tuple(top_k_index.shape)}"
        )
    if top_k_index.shape[1] > MAX_K_HARD:
        raise ValueError(f"k={top_k_index.shape[1]} exceeds the frame limit {MAX_K_HARD}")


def _default_connect(endpoint: str, server_id: str, **kw) -> ClientConnection:
    from eaas.runtime.transport.factory import connect

    return connect(endpoint, server_id, **kw)


#: an expert's pairs in one layer call stay on one replica up to this many (then they are split
#: over more replicas): see :func:`choose_replicas`
DEFAULT_SPLIT_PAIRS = 256

NO_SERVER = -1  # pair not selected (``top_k_index`` -1)
NO_REPLICA = -2  # pair whose expert has no usable replica


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
        sids = tuple(table.servers)
        index = {s: i for i, s in enumerate(sids)}
        reps: dict[int, torch.Tensor] = {}
        for layer, experts in table.layers.items():
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
        ``live_reps[e]`` are ``e``'s usable replicas.
    """
    live = (replicas >= 0) & usable[replicas.clamp(min=0)]  # (E, R)
    order = torch.argsort((~live).to(torch.int8), dim=1, stable=True)  # (E, R)
    return replicas.gather(1, order), live.sum(1)


#: rotation phases a :class:`PhaseTables` holds at most (the lcm of the experts' live replica
#: counts: 2 for R=2); a layer whose count is larger uses :func:`choose_replicas` for every call
MAX_PHASES = 64


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


class Dispatcher:
    """Per-client dispatch/combine over the expert servers of the current routing table.

    Threads: :meth:`dispatch` calls are serialized among themselves; the state lock is held only
    for bookkeeping (never across a send, a receive or a connect), so :meth:`health`,
    :meth:`uncovered` and :meth:`set_table` answer at once even while a layer call waits for a
    hung server. Connections are opened by a background connector thread (started with the
    first table, stopped by :meth:`close`), never on the request path: a layer call uses only
    connected servers, and waits (up to ``timeout``) only while the first connection attempts
    of the servers it needs are still in progress.

    Args:
        client_id: this attention client's id (frames' ``client_id``, metric label).
        hidden_size: ``H`` of the model.
        dtype: activation dtype sent to servers (the model's dtype).
        table: initial routing table (may be ``None`` until :meth:`set_table`).
        timeout: seconds to wait for all servers of one dispatch round.
        retry_down_s: seconds before a down server is tried again (doubling per consecutive
            failure, at most 30 s); a server never reached is tried every
            ``min(retry_down_s, FIRST_CONNECT_RETRY_S)`` (:func:`reconnect_delay`).
        connect: connection factory (``eaas.runtime.transport.factory.connect``).
        connect_in_background: run the connector thread (default True). False leaves connecting
            to explicit :meth:`reconnect_down` calls (unit tests of the bookkeeping).
        graphs: ``--cuda-graphs``: a :class:`~eaas.runtime.gpu.graphs.GraphRoundTrips`; decode
            calls on ``cudaipc`` connections with a CUDA payload replay a captured round trip
            instead of ``send``/``recv`` (same failover on a timed-out wait).
        split_pairs: an expert's pairs in one call stay on one replica up to this many
            (:func:`choose_replicas`); the rotation advances by one replica per call for every
            expert of the layer, so successive calls alternate over an expert's replicas.
        ring_after_all: write every frame of a layer call before waking any server (one
            :meth:`~eaas.runtime.transport.base.ClientConnection.ring` per server afterwards;
            default). False: each frame's ``send`` wakes its server at once (the behaviour
            before; kept for side-by-side measurements, bench/decode_profile.py).
        moe_layers: the model's MoE layer indices; a table that leaves one out has every expert
            of it uncovered (:meth:`uncovered`, ``/health`` 503). None: only what the table
            lists is checked.
    """

    def __init__(
        self,
        client_id: int,
        hidden_size: int,
        dtype: torch.dtype,
        table: RoutingTable | None = None,
        *,
        timeout: float = 5.0,
        retry_down_s: float = 2.0,
        connect: Connector = _default_connect,
        connect_in_background: bool = True,
        graphs=None,
        split_pairs: int = DEFAULT_SPLIT_PAIRS,
        ring_after_all: bool = True,
        moe_layers: Collection[int] | None = None,
    ) -> None:
        if split_pairs < 1:
            raise ValueError(f"split_pairs must be >= 1, got {split_pairs}")
        self.split_pairs = int(split_pairs)
        # the model's MoE layers: one that a table leaves out is uncovered (None: not known)
        self.moe_layers = tuple(sorted(moe_layers)) if moe_layers is not None else None
        self.ring_after_all = bool(ring_after_all)
        self.client_id = int(client_id)
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self.timeout = float(timeout)
        self.retry_down_s = float(retry_down_s)
        self._connect = connect
        self._background = bool(connect_in_background)
        self.graphs = graphs  # GraphRoundTrips | None (--cuda-graphs)
        self._lock = threading.RLock()  # state: table, servers, rotation (never held over I/O)
        self._changed = threading.Condition(self._lock)  # a connection attempt finished
        self._call_lock = threading.Lock()  # serializes dispatch calls (they share connections)
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._table: RoutingTable | None = None
        self._map: ReplicaMap | None = None
        # (layer, usable servers) -> PhaseTables (usable, live_replicas) of the table in use
        self._phases: dict[tuple[int, tuple[bool, ...]], PhaseTables] = {}
        self._servers: dict[str, _Server] = {}
        # layer -> rotation offset of all its experts (planned rounds so far)
        self._rr: dict[int, int] = {}
        self._version_gauge = metrics.ROUTING_TABLE_VERSION.labels(client_id=str(self.client_id))
        # called as (server_id, endpoint, table_version, reason) when a server is marked down,
        # under the lock: must not block (failure_report.FailureReporter.report only enqueues)
        self.on_server_down: Callable[[str, str, int, str], object] | None = None
        # frames answered STATUS_NOT_HOSTED whose pairs were re-sent to other replicas
        self.not_hosted_resends = 0
        if table is not None:
            self.set_table(table)

    # ---- routing table -------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Version of the routing table in use (0 = none yet)."""
        t = self._table
        return t.version if t is not None else 0

    @property
    def table(self) -> RoutingTable | None:
        return self._table

    def set_table(self, table: RoutingTable) -> bool:
        """Switch to ``table`` if it is strictly newer than the one in use.

        Servers no longer listed (or whose endpoint changed) are disconnected (a connection in
        use by a layer call is closed when that call is done with it); every listed server that
        was down or is new is (re)connected by the connector thread at once. Never waits for a
        layer call in progress.

        Returns:
            True if applied, False if rejected as older/equal.
        """
        rmap = ReplicaMap.from_table(table)
        with self._lock:
            if self._table is not None and table.version <= self._table.version:
                if table.version < self._table.version:
                    log.warning(
                        "rejecting routing table version %d: older than version %d in use",
                        table.version,
                        self._table.version,
                    )
                return False
            old = self._servers
            new: dict[str, _Server] = {}
            for sid, ep in table.servers.items():
                prev = old.get(sid)
                if prev is not None and prev.endpoint == ep and not prev.down:
                    new[sid] = prev
                else:
                    if prev is not None:
                        self._retire(prev)
                    new[sid] = _Server(sid, ep)
            for sid, prev in old.items():
                if sid not in new:
                    self._retire(prev)
            self._servers = new
            self._table = table
            self._map = rmap
            self._phases = {}
            self._rr = dict.fromkeys(rmap.replicas, 0)
            self._version_gauge.set(table.version)
            uncovered = table.uncovered()
            log.info(
                "client %d: routing table version %d in use (%d servers%s)",
                self.client_id,
                table.version,
                len(new),
                f", {len(uncovered)} experts without replica" if uncovered else "",
            )
            self._start_connector()
            return True

    def uncovered(self) -> list[dict]:
        """``(layer, expert)`` pairs without a live replica: none in the routing table (a MoE
        layer of ``moe_layers`` the table leaves out included), or all of its replicas marked
        down. Items: ``{"layer", "expert", "reason", "replicas"}``."""
        with self._lock:
            table = self._table
            if table is None:
                return []
            out: list[dict] = []
            for layer in self.moe_layers or ():
                if layer not in table.layers:
                    out.extend(
                        {
                            "layer": layer,
                            "expert": e,
                            "reason": f"layer {layer} is not in routing table version "
                            f"{table.version}",
                            "replicas": [],
                        }
                        for e in range(table.num_experts)
                    )
            for layer, experts in sorted(table.layers.items()):
                for e, reps in enumerate(experts):
                    if not reps:
                        out.append(
                            {
                                "layer": layer,
                                "expert": e,
                                "reason": f"no replica in routing table version {table.version}",
                                "replicas": [],
                            }
                        )
                    elif all(self._servers.get(r) is None or self._servers[r].down for r in reps):
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

    # ---- connections (connector thread; never the request path) --------------------------
    def _start_connector(self) -> None:
        self._wake.set()
        if self._background and self._thread is None and not self._closed.is_set():
            self._thread = threading.Thread(
                target=self._connector, name=f"eaas-connect-{self.client_id}", daemon=True
            )
            self._thread.start()

    def _connector(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(0.1)
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                self.reconnect_down()
            except Exception:  # noqa: BLE001
                log.exception("client %d: connector failed", self.client_id)

    def reconnect_down(self) -> int:
        """Connect every server that has no connection yet and every down server whose back-off
        has expired. Returns how many got a connection.

        Runs in the connector thread (and may be called from another, e.g. the routing table
        watcher); each connect (at most ``min(timeout, 2 s)`` against a hung or dead peer)
        happens outside the state lock, so layer calls and :meth:`health` never wait on it.
        """
        connect_timeout = min(self.timeout, 2.0)
        with self._lock:
            now = time.monotonic()
            due = [
                s
                for s in self._servers.values()
                if not s.connecting
                and s.conn is None
                and (not s.down or now >= s.retry_at)
                and not self._closed.is_set()
            ]
            for s in due:
                s.connecting = True
        back = 0
        for s in due:
            conn: ClientConnection | None
            try:
                conn = self._connect(
                    s.endpoint,
                    s.server_id,
                    hidden_size=self.hidden_size,
                    dtype=self.dtype,
                    client_id=self.client_id,
                    connect_timeout=connect_timeout,
                )
            except Exception as exc:  # noqa: BLE001
                with self._lock:
                    s.connecting = False
                    if self._servers.get(s.server_id) is s:
                        self._mark_down(s, f"connect: {type(exc).__name__}: {exc}")
                    self._changed.notify_all()
                continue
            with self._lock:
                s.connecting = False
                if (
                    self._servers.get(s.server_id) is s
                    and s.conn is None
                    and not self._closed.is_set()
                ):
                    if s.down:
                        log.info(
                            "client %d: reconnected to expert server %s",
                            self.client_id,
                            s.server_id,
                        )
                    s.conn, s.down, s.ever_connected = conn, False, True
                    back += 1
                    conn = None
                self._changed.notify_all()
            if conn is not None:  # the table changed meanwhile, or we are closing
                conn.close()
        return back

    def health(self) -> dict:
        """JSON-able view: table version, per-server state, experts without a live replica
        (``uncovered_experts`` = how many, ``uncovered`` = the first :data:`HEALTH_MAX_UNCOVERED`).
        Never waits for network I/O."""
        with self._lock:
            uncovered = self.uncovered()
            return {
                "uncovered_experts": len(uncovered),
                "uncovered": uncovered[:HEALTH_MAX_UNCOVERED],
                "routing_table_version": self.version,
                "servers": {
                    s.server_id: {
                        "endpoint": s.endpoint,
                        "state": "down"
                        if s.down
                        else ("connected" if s.conn is not None else "idle"),
                        "tokens_sent": s.tokens_sent,
                        "failures": s.failures,
                        **({"last_error": s.last_error} if s.last_error else {}),
                    }
                    for s in self._servers.values()
                },
            }

    def close(self) -> None:
        """Stop the connector thread and close every connection (idle ones at once, one in use
        by a layer call when that call finishes)."""
        self._closed.set()
        self._wake.set()
        with self._lock:
            for s in self._servers.values():
                self._retire(s)
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(5.0)

    # ---- connection state (callers hold self._lock) ----------------------------------------
    @staticmethod
    def _close(s: _Server) -> None:
        if s.conn is not None:
            try:
                s.conn.close()
            except Exception:  # noqa: BLE001
                pass
            s.conn = None

    def _retire(self, s: _Server) -> None:
        """Close ``s``'s connection now, or when the layer call using it is done."""
        if s.busy:
            s.retired = True
        else:
            self._close(s)

    def _mark_down(self, s: _Server, why: str) -> None:
        self._close(s)
        s.failures += 1
        s.consecutive += 1
        s.last_error = why
        # back-off between reconnect attempts: retry_down_s, 2x, 4x, ... (max 30 s) once it
        # worked; every FIRST_CONNECT_RETRY_S while it was never reached (still starting)
        s.retry_at = time.monotonic() + reconnect_delay(
            s.consecutive, s.ever_connected, self.retry_down_s
        )
        if not s.down:
            s.down = True
            metrics.SERVER_DOWN.labels(server=s.server_id).inc()
            log.warning(
                "client %d: expert server %s (%s) marked down: %s",
                self.client_id,
                s.server_id,
                s.endpoint,
                why,
            )
            if self.on_server_down is not None:
                try:
                    self.on_server_down(s.server_id, s.endpoint, self.version, why)
                except Exception:  # noqa: BLE001
                    log.exception("on_server_down hook failed")

        self._wake.set()

    # ---- dispatch / combine --------------------------------------------------------------
    def _plan(
        self, layer: int, idx64: torch.Tensor, exclude: set[str]
    ) -> tuple[torch.Tensor, list[int], list[_Server], RoutingTable]:
        """Under the state lock: choose servers for every pair; reserve their connections.

        Waits (releasing the lock) while servers this call needs have their first connection
        attempt in progress, at most ``timeout`` seconds.

        Returns:
            ``(assign [T, k] int64 server index per pair or NO_SERVER, indices of the servers
            reserved (every server ``assign`` holds, and for a decode call possibly another of
            the same column with no pair; ``_send_round`` skips it), servers by index, table)``.

        Raises:
            NoLiveReplicaError: some selected expert has no usable replica.
            RuntimeError: no routing table yet.
        """
        wait_until = time.monotonic() + self.timeout
        used: tuple[int, ...] | list[int] | None = None
        with self._lock:
            while True:
                table, rmap = self._table, self._map
                if table is None or rmap is None:
                    raise RuntimeError("no routing table loaded")
                servers = [self._servers[sid] for sid in rmap.sids]
                ukey = tuple(
                    s.conn is not None and not s.busy and s.server_id not in exclude
                    for s in servers
                )
                replicas = rmap.replicas.get(layer)
                if replicas is None:
                    e = int(idx64.max()) if idx64.numel() else 0
                    raise NoLiveReplicaError(
                        layer, e, f"layer {layer} is not in routing table version {table.version}"
                    )
                rr = self._rr[layer]
                ph = self._phases.get((layer, ukey))
                if ph is None:  # usable set changed: recompute once (few per table)
                    if len(self._phases) > 256:
                        self._phases.clear()
                    ph = PhaseTables.build(replicas, torch.tensor(ukey, dtype=torch.bool))
                    self._phases[(layer, ukey)] = ph
                # no expert above split_pairs pairs (a decode step): one look-up per pair
                few = self.split_pairs > 1 and idx64.numel() <= self.split_pairs
                assign = ph.choose(idx64, rr) if few else None
                used = None
                if assign is not None:
                    used = ph.servers[rr % len(ph.servers)]  # (may include a server with no pair)
                    if ph.complete:
                        break
                else:
                    start = torch.full((int(replicas.shape[0]),), rr, dtype=torch.int64)
                    assign, _ = choose_replicas(
                        idx64,
                        replicas,
                        ph.usable,
                        start,
                        live=ph.live,
                        split_pairs=self.split_pairs,
                    )
                missing = assign == NO_REPLICA
                if not bool(missing.any()):
                    break
                e = int(idx64[missing][0])
                # wait only for first connections that could cover a missing expert
                pending = torch.tensor(
                    [s.conn is None and not s.down and s.server_id not in exclude for s in servers]
                )
                mexp = torch.unique(idx64[missing])
                mexp = mexp[mexp < int(replicas.shape[0])]
                cand = replicas.index_select(0, mexp).reshape(-1)
                could = bool(pending[cand[cand >= 0]].any())
                if self._background and could and time.monotonic() < wait_until:
                    self._wake.set()  # first connections still being opened: wait for them
                    self._changed.wait(max(0.0, wait_until - time.monotonic()))
                    continue
                reps = table.replicas(layer, e) if 0 <= e < int(replicas.shape[0]) else ()
                if not reps:
                    raise NoLiveReplicaError(
                        layer,
                        e,
                        f"no replica of layer {layer} expert {e} in routing table version {table.version}",
                    )
                raise NoLiveReplicaError(
                    layer, e, f"all replicas of layer {layer} expert {e} are down: {list(reps)}"
                )
            # one rotation step per call for every expert of the layer: the experts' replica
            # choices stay in phase, so a call whose experts all stay on one replica reaches the
            # servers of one "column" of the placement, and the next call the next column
            self._rr[layer] = rr + 1
            if used is None:
                used = torch.unique(assign[assign >= 0]).tolist()
            for si in used:  # loop over servers
                servers[si].busy = True
            return assign, list(used), servers, table

    def _release(self, servers: list[_Server], used: list[int]) -> None:
        with self._lock:
            for si in used:
                s = servers[si]
                s.busy = False
                if s.retired:
                    s.retired = False
                    self._close(s)

    def dispatch(
        self,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Run the routed experts of one MoE layer on the expert servers.

        Same as ``dispatch_begin(...).wait()``.

        Args:
            layer: model layer index (a MoE layer of the routing table).
            hidden: ``[T, H]`` MoE-block input (after the post-attention norm), model dtype.
            top_k_index: ``[T, k]`` int64 selected logical experts (``-1`` = none).
            top_k_weights: ``[T, k]`` gate weights (already scaled by the model).

        Returns:
            ``[T, H]`` in ``hidden.dtype`` on ``hidden.device``:
            ``sum_j w[t, j] * E_{idx[t, j]}(hidden[t])``.

        Raises:
            NoLiveReplicaError: a selected expert has no live replica (after failover).
            RuntimeError: no routing table yet.
        """
        return self.dispatch_begin(layer, hidden, top_k_index, top_k_weights).wait()

    def dispatch_begin(
        self,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> PendingDispatch:
        """Send one MoE layer call's frames and return at once; :meth:`PendingDispatch.wait`
        waits for the answers (with failover) and combines them.

        The caller computes what does not depend on the routed experts in between (the shared
        expert, see :func:`overlapped_moe_forward`) while the expert servers compute. Every
        frame is written before any server is woken (:meth:`ClientConnection.send_deferred`,
        then :meth:`ClientConnection.ring` per server), so a woken server cannot preempt this
        thread between two frames on an oversubscribed host. Until ``wait`` returns, other
        dispatch calls wait (they share connections): ``wait`` must be called, also when the
        work in between raised.

        Args / Raises: as :meth:`dispatch` (``NoLiveReplicaError`` already here when the
        first replica choice finds none; later failover errors from ``wait``).
        """
        t0 = time.perf_counter()
        in_dtype, device = hidden.dtype, hidden.device
        check_call(hidden, top_k_index, top_k_weights, self.hidden_size)
        T, H = hidden.shape
        # frames travel from host memory, or stay on the GPU when some connection's payload is
        # there (cudaipc with a CUDA payload, nvshmem): (T, H) in the wire dtype, contiguous
        stage = staging_device(device, [s.conn for s in list(self._servers.values())])
        hidden = hidden.to(device=stage, dtype=self.dtype).contiguous()
        idx64 = top_k_index.to(device="cpu", dtype=torch.int64)
        w32 = top_k_weights.to(device="cpu", dtype=torch.float32)
        out = torch.zeros(T, H, dtype=self.dtype, device=stage)
        p = PendingDispatch(self, layer, hidden, idx64, w32, out, in_dtype, device, t0)
        self._call_lock.acquire()
        try:
            if bool((idx64 >= 0).any()):  # else nothing to send: wait returns zeros
                p._start(idx64)
        except BaseException:
            self._call_lock.release()
            raise
        return p

    def _send_round(
        self,
        layer: int,
        hidden: torch.Tensor,
        idx64: torch.Tensor,
        w32: torch.Tensor,
        assign: torch.Tensor,
        used: list[int],
        servers: list[_Server],
        table: RoutingTable,
    ) -> tuple[list[tuple[_Server, int, torch.Tensor | None, int]], dict[int, tuple], list[int]]:
        """Write one frame per server in ``used``, then wake every one. No lock held.

        A frame carries each of its tokens' hidden row once (gathered by the transport straight
        into its buffer) and the token's ``[k]`` expert ids / weights with pairs of other servers
        masked to ``-1`` / ``0``. Returns ``(sent, graph_out, failed)``: ``(server, index, rows,
        seq)`` per frame sent, the captured round trips replayed (``--cuda-graphs``), and the
        indices (into ``servers``) of servers whose send failed (marked down).
        """
        T = int(hidden.shape[0])
        staging = FrameStaging(hidden)  # a host copy only for host connections, once
        failed: list[int] = []
        sent: list[tuple[_Server, int, torch.Tensor | None, int]] = []
        graph_out: dict[int, tuple] = {}  # server index -> (graph, output view) (--cuda-graphs)
        idx32 = idx64.to(torch.int32)  # (T, k) the wire's expert ids
        k = int(idx32.shape[1])
        ring = not self.ring_after_all  # else woken below, once every frame is written
        for si in used:  # loop over servers, tensor ops inside
            s = servers[si]
            m = assign == si  # (T, k)
            nz = m.any(dim=1).nonzero()  # (n, 1)
            n = int(nz.shape[0])
            if n == 0:
                continue  # reserved with its column, but no pair of this call is its
            ex = torch.where(m, idx32, -1)
            w = torch.where(m, w32, 0.0)
            rows: torch.Tensor | None = None  # every token: the hidden batch as is
            if n != T:
                rows = nz.squeeze(1)  # (n,)
                ex, w = ex.index_select(0, rows), w.index_select(0, rows)
            s.seq += 1
            conn = s.conn
            h = staging.hidden_for(conn)  # (T, H) where this connection reads frames
            try:
                if conn is None:
                    raise PeerDeadError("connection closed")
                g = None
                if self.graphs is not None:  # --cuda-graphs: replay the captured round trip
                    g = self.graphs.for_connection(conn, n, k)
                if g is not None:
                    hs = h if rows is None else h.index_select(0, staging.rows_on(rows, h))
                    graph_out[si] = (g, g.run(hs, ex, w, layer=layer,
                                              table_version=table.version))  # fmt: skip
                else:  # (n, k) and the tensors' shapes agree by construction (check_call)
                    conn.send_parts(
                        self.client_id, layer, table.version, s.seq, h, ex, w, rows, n, k, ring
                    )
            except Exception as exc:  # noqa: BLE001  (PeerDeadError, FrameError, OSError, ...)
                self._failed(s, f"send: {type(exc).__name__}: {exc}")
                failed.append(si)
                continue
            sent.append((s, si, rows, s.seq))
        for s, si, _rows, _seq in list(sent):  # one doorbell per server, after all frames
            if si in graph_out:
                continue
            try:
                assert s.conn is not None
                s.conn.ring()
            except Exception as exc:  # noqa: BLE001
                self._failed(s, f"send: {type(exc).__name__}: {exc}")
                failed.append(si)
                sent.remove((s, si, _rows, _seq))
        return sent, graph_out, failed

    def _recv_round(
        self,
        layer: int,
        sent: list[tuple[_Server, int, torch.Tensor | None, int]],
        graph_out: dict[int, tuple],
        table: RoutingTable,
        out: torch.Tensor,
        failed: list[int],
    ) -> tuple[list[int], list[int]]:
        """Wait for every server of :meth:`_send_round` (one deadline), add into ``out``.

        Returns ``(failed, refused)``: indices (into ``servers``) of servers that failed
        (marked down; ``failed`` of the send extended) and of servers that answered
        ``STATUS_NOT_HOSTED`` (kept up; their pairs go to other replicas).
        """
        refused: list[int] = []
        deadline = time.monotonic() + self.timeout
        for s, si, rows, seq in sent:
            try:
                assert s.conn is not None
                if si in graph_out:
                    g, output = graph_out.pop(si)
                    g.check()  # DeadlineExceeded when the device-side wait timed out
                    output = output.to(out.device)
                else:
                    resp = s.conn.recv(deadline)
                    if resp.seq != seq:
                        raise RuntimeError(f"response seq {resp.seq} != request seq {seq}")
                    if resp.status == STATUS_NOT_HOSTED:
                        log.info(
                            "client %d: expert server %s refused layer %d (table version %d): %s",
                            self.client_id,
                            s.server_id,
                            layer,
                            table.version,
                            resp.message,
                        )
                        refused.append(si)
                        continue
                    if resp.status != STATUS_OK or resp.output is None:
                        raise RuntimeError(f"error status {resp.status}: {resp.message}")
                    output = resp.output.to(out.device)  # a no-op unless devices differ
                if rows is None:
                    out.add_(output)
                else:
                    out.index_add_(0, rows.to(out.device), output)
                s.tokens_sent += int(output.shape[0])
                s.consecutive = 0
            except Exception as exc:  # noqa: BLE001
                self._failed(s, f"recv: {type(exc).__name__}: {exc}")
                failed.append(si)
        return failed, refused

    def _failed(self, s: _Server, why: str) -> None:
        with self._lock:
            s.busy = False  # _mark_down closes the connection now
            s.retired = False
            self._mark_down(s, why)


class PendingDispatch:
    """One MoE layer call in flight (:meth:`Dispatcher.dispatch_begin`); :meth:`wait` ends it.

    Holds the dispatcher's call lock from ``dispatch_begin`` until :meth:`wait` returns.
    """

    def __init__(
        self,
        d: Dispatcher,
        layer: int,
        hidden: torch.Tensor,
        idx64: torch.Tensor,
        w32: torch.Tensor,
        out: torch.Tensor,
        in_dtype: torch.dtype,
        device: torch.device,
        t0: float,
    ) -> None:
        self._d, self.layer = d, layer
        self._hidden, self._idx64, self._w32, self._out = hidden, idx64, w32, out
        self._in_dtype, self._device, self._t0 = in_dtype, device, t0
        self._exclude: set[str] = set()  # servers that failed during this call
        self._round: tuple | None = None  # (assign, used, servers, table, sent, graph_out, failed)
        self._done = False

    def _start(self, sel: torch.Tensor) -> None:
        """Plan and send one round for the pairs of ``sel`` (``[T, k]``, -1 = not this round)."""
        d = self._d
        assign, used, servers, table = d._plan(self.layer, sel, self._exclude)
        try:
            sent, graph_out, failed = d._send_round(
                self.layer, self._hidden, self._idx64, self._w32, assign, used, servers, table
            )
        except BaseException:
            d._release(servers, used)
            raise
        self._round = (assign, used, servers, table, sent, graph_out, failed)

    def wait(self) -> torch.Tensor:
        """Wait for the servers (re-sending a failed or refusing server's pairs to other
        replicas) and combine.

        Returns:
            ``[T, H]`` in the input's dtype on its device (see :meth:`Dispatcher.dispatch`).

        Raises:
            NoLiveReplicaError: a selected expert has no live replica left (after failover).
            RuntimeError: called twice.
        """
        if self._done:
            raise RuntimeError("PendingDispatch.wait called twice")
        d = self._d
        try:
            while self._round is not None:
                assign, used, servers, table, sent, graph_out, failed = self._round
                self._round = None
                try:
                    failed, refused = d._recv_round(
                        self.layer, sent, graph_out, table, self._out, failed
                    )
                finally:
                    d._release(servers, used)
                if not failed and not refused:
                    break
                redo = torch.zeros_like(self._idx64, dtype=torch.bool)
                for si in failed:
                    redo |= assign == si
                    self._exclude.add(servers[si].server_id)
                    metrics.FAILOVERS.inc()
                for si in refused:  # healthy, but no longer hosts an expert: others compute it
                    redo |= assign == si
                    self._exclude.add(servers[si].server_id)
                    d.not_hosted_resends += 1
                log.info(
                    "client %d: layer %d: re-sent %d token-expert pairs of server(s) %s",
                    d.client_id,
                    self.layer,
                    int(redo.sum()),
                    ", ".join(servers[si].server_id for si in failed + refused),
                )
                if not bool(redo.any()):
                    break
                self._start(torch.where(redo, self._idx64, -1))
        finally:
            self._done = True
            d._call_lock.release()
        metrics.DISPATCH_SECONDS.observe(time.perf_counter() - self._t0)
        return self._out.to(device=self._device, dtype=self._in_dtype)


class RemoteExperts(nn.Module):
    """Drop-in replacement of a model's routed-experts module that runs them on expert servers.

    ``forward(hidden [T, H], top_k_index [T, k] int64, top_k_weights [T, k]) -> [T, H]`` (same
    signature as transformers' ``*Experts`` modules); holds no weights.
    """

    def __init__(self, dispatcher: Dispatcher, layer_idx: int):
        super().__init__()
        self.dispatcher = dispatcher
        self.layer_idx = int(layer_idx)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.dispatcher.dispatch(self.layer_idx, hidden_states, top_k_index, top_k_weights)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, client_id={self.dispatcher.client_id}"


def overlapped_moe_forward(block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A forward for ``block`` that computes its shared expert while the routed experts run on
    the expert servers, or None when ``block`` is not a DeepSeek-V3 MoE block with
    :class:`RemoteExperts`.

    transformers' ``DeepseekV3MoE.forward`` computes ``gate -> experts -> + shared_experts``;
    this one does ``gate -> send frames (dispatch_begin) -> shared_experts -> wait -> routed +
    shared``: the same operations on the same tensors in the same order of addition, so the
    result is bit-identical, but the attention client's shared-expert work no longer waits for
    the round trip (DESIGN.md "MoE layer math": y = shared(x) + sum g_i E_i(x)). Qwen3-MoE and
    Mixtral blocks have no shared expert and keep their own forward.

    Returns:
        ``fn(hidden [B, S, H]) -> [B, S, H]`` (the block's output, as its ``forward``), or None.
    """
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    experts = getattr(block, "experts", None)
    if type(block) is not DeepseekV3MoE or not isinstance(experts, RemoteExperts):
        return None
    if type(block).forward is not DeepseekV3MoE.forward:  # pragma: no cover (patched class)
        return None
    gate, shared, dispatcher, layer = (
        block.gate,
        block.shared_experts,
        experts.dispatcher,
        experts.layer_idx,
    )

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        orig_shape = hidden_states.shape  # (B, S, H)
        _, topk_weights, topk_indices = gate(hidden_states)  # (T, k), (T, k)
        flat = hidden_states.view(-1, hidden_states.shape[-1])  # (T, H)
        pending = dispatcher.dispatch_begin(layer, flat, topk_indices, topk_weights)
        try:
            shared_out = shared(hidden_states)  # (B, S, H), while the servers compute
        finally:
            routed = pending.wait()  # (T, H); always waited: the dispatcher's lock
        return routed.view(*orig_shape) + shared_out

    return forward


def experts_factory(dispatcher: Dispatcher) -> Callable[[int, object], RemoteExperts]:
    """``experts_factory`` for ``load_attention_model``: ``(layer_idx, info) -> RemoteExperts``."""

    def make(layer_idx: int, info: object = None) -> RemoteExperts:
        return RemoteExperts(dispatcher, layer_idx)

    return make


class RoutingTableWatcher:
    """Polls a routing-table JSON file and hands newer versions to a :class:`Dispatcher`.

    Changes are detected by ``(mtime_ns, size, inode)`` of the path (a Kubernetes ConfigMap mount
    swaps a symlink, which changes the inode). Malformed files are logged and ignored (the table
    in use stays).

    Args:
        path: JSON file (see :mod:`eaas.runtime.routing`).
        dispatcher: receiver.
        interval: poll period in seconds.
    """

    def __init__(self, path: str, dispatcher: Dispatcher, interval: float = 0.5):
        self.path = path
        self.dispatcher = dispatcher
        self.interval = interval
        self._sig: tuple | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def load_now(self) -> bool:
        """Read the file once; returns True if a new table was applied.

        Raises:
            OSError / RoutingTableError: only if no table is in use yet (startup must fail loudly).
        """
        try:
            st = os.stat(self.path)
            sig = (st.st_mtime_ns, st.st_size, st.st_ino)
            if sig == self._sig:
                return False
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
            table = RoutingTable.from_json(text)
        except (OSError, RoutingTableError) as exc:
            if self.dispatcher.table is None:
                raise
            log.warning(
                "routing table %s unreadable, keeping version %d: %s",
                self.path,
                self.dispatcher.version,
                exc,
            )
            return False
        self._sig = sig
        return self.dispatcher.set_table(table)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="eaas-routing-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.load_now()
                self.dispatcher.reconnect_down()
            except Exception:  # noqa: BLE001
                log.exception("routing table poll failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
