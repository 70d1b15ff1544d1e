"""The dispatcher: the attention client's side of one MoE layer call (dispatch and combine).

:class:`Dispatcher` (one per attention client process) holds the routing table and one transport
connection per expert server (:mod:`.connections`). Per MoE layer call
(:meth:`Dispatcher.dispatch`):

1. **Pick replicas** (:mod:`.policy`): one connected replica of ``(layer, expert)`` for every
   ``(token, selected expert, weight)`` pair.
2. **Dispatch.** One frame per target server (:mod:`.frames`; a loop over servers, not tokens);
   send to all targets, then wait for all of them with one deadline (``timeout`` seconds).
3. **Failover.** A server that raises :class:`PeerDeadError` / :class:`DeadlineExceeded` /
   another transport error, or answers an error status, is marked down (``eaas_server_marked_down``
   metric, a log line, connection closed); ONLY its pairs are re-assigned to other connected
   replicas and sent again (``eaas_failovers_total`` += 1 per failed server batch); repeat. If
   some expert has no live replica left, :class:`NoLiveReplicaError` is raised (retryable; the
   API answers 503). A server that answers ``STATUS_NOT_HOSTED`` (it no longer hosts an expert
   of the frame: its assignment changed with a newer routing table, see
   :mod:`eaas.runtime.server.assignment`) is NOT marked down: it is healthy. The frame's pairs are
   re-sent to other replicas, that server left out for the rest of this call
   (:attr:`Dispatcher.not_hosted_resends` counts such frames). :meth:`Dispatcher.uncovered`
   lists the experts without a live replica (GET /health answers 503 while there are any).
4. **Combine.** The per-server partial sums are added (``index_add_``) into one ``[T, H]``
   tensor, returned on the caller's device. Hidden states on a GPU stay there for connections
   whose payload is on the GPU (``cudaipc`` with a CUDA payload, ``nvshmem``); host
   connections get one host copy per call (:mod:`.staging`).

Routing table updates: :meth:`Dispatcher.set_table` (thread safe; never waits for a layer call)
accepts only strictly newer versions. The version in use is published in the
``eaas_routing_table_version{client_id}`` gauge and by :meth:`Dispatcher.health` (GET /health)
-- that is the client's acknowledgement.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection

import torch

from eaas.runtime import metrics
from eaas.runtime.client.dispatch.call import PendingDispatch
from eaas.runtime.client.dispatch.connections import (
    Connector,
    ServerConnections,
    ServerLink,
    default_connect,
)
from eaas.runtime.client.dispatch.frames import check_call
from eaas.runtime.client.dispatch.policy import (
    DEFAULT_SPLIT_PAIRS,
    NO_REPLICA,
    PhaseTables,
    ReplicaMap,
    choose_replicas,
    uncovered_experts,
)
from eaas.runtime.client.dispatch.staging import staging_device
from eaas.runtime.tables.table import RoutingTable

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
            ``min(retry_down_s, FIRST_CONNECT_RETRY_S)`` (:func:`.policy.reconnect_delay`).
        connect: connection factory (``eaas.runtime.transport.factory.connect``).
        connect_in_background: run the connector thread (default True). False leaves connecting
            to explicit :meth:`reconnect_down` calls (unit tests of the bookkeeping).
        graphs: ``--cuda-graphs``: a :class:`~eaas.runtime.client.graphs.GraphRoundTrips`; decode
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
        connect: Connector = default_connect,
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
        self.graphs = graphs  # GraphRoundTrips | None (--cuda-graphs)
        self._conns = ServerConnections(
            self.client_id,
            self.hidden_size,
            dtype,
            timeout=self.timeout,
            retry_down_s=self.retry_down_s,
            connect=connect,
            background=bool(connect_in_background),
            on_down=self._server_down,
        )
        # state: table, servers, rotation (never held over I/O); shared with the connections
        self._lock = self._conns.lock
        self._call_lock = threading.Lock()  # serializes dispatch calls (they share connections)
        self._table: RoutingTable | None = None
        self._map: ReplicaMap | None = None
        # (layer, usable servers) -> PhaseTables (usable, live_replicas) of the table in use
        self._phases: dict[tuple[int, tuple[bool, ...]], PhaseTables] = {}
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
            self._conns.replace(table.servers)
            self._table = table
            self._map = rmap
            self._phases = {}
            self._rr = dict.fromkeys(rmap.replicas, 0)
            self._version_gauge.set(table.version)
            uncovered = table.uncovered()
            log.info(
                "client %d: routing table version %d in use (%d server%s%s)",
                self.client_id,
                table.version,
                len(self._servers),
                "" if len(self._servers) == 1 else "s",
                f", {len(uncovered)} experts without replica" if uncovered else "",
            )
            self._conns.start()
            return True

    def uncovered(self) -> list[dict]:
        """``(layer, expert)`` pairs without a live replica: none in the routing table (a MoE
        layer of ``moe_layers`` the table leaves out included), or all of its replicas marked
        down. Items: ``{"layer", "expert", "reason", "replicas"}``."""
        with self._lock:
            table = self._table
            if table is None:
                return []
            servers = self._servers
            return uncovered_experts(
                table, self.moe_layers, lambda r: r not in servers or servers[r].down
            )

    # ---- connections (:mod:`.connections`) ----------------------------------------------
    @property
    def _servers(self) -> dict[str, ServerLink]:
        """Server id -> connection state of the table in use."""
        return self._conns.servers

    def reconnect_down(self) -> int:
        """Connect every server that has no connection yet and every down server whose back-off
        has expired (:meth:`ServerConnections.reconnect_down`). Returns how many got a
        connection. Never holds the state lock across a connect."""
        return self._conns.reconnect_down()

    def _mark_down(self, s: ServerLink, why: str) -> None:
        """Mark ``s`` down (callers hold the state lock): :meth:`ServerConnections.mark_down`."""
        self._conns.mark_down(s, why)

    def _server_down(self, s: ServerLink, why: str) -> None:
        """``on_down`` of the connections: hand a newly down server to :attr:`on_server_down`."""
        if self.on_server_down is not None:
            try:
                self.on_server_down(s.server_id, s.endpoint, self.version, why)
            except Exception:  # noqa: BLE001
                log.exception("on_server_down hook failed")

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
                "servers": self._conns.health(),
            }

    def close(self) -> None:
        """Stop the connector thread and close every connection (idle ones at once, one in use
        by a layer call when that call finishes)."""
        self._conns.close()

    # ---- dispatch / combine --------------------------------------------------------------
    def _plan(
        self, layer: int, idx64: torch.Tensor, exclude: set[str]
    ) -> tuple[torch.Tensor, list[int], list[ServerLink], RoutingTable]:
        """Under the state lock: choose servers for every pair; reserve their connections.

        Waits (releasing the lock) while servers this call needs have their first connection
        attempt in progress, at most ``timeout`` seconds.

        Returns:
            ``(assign [T, k] int64 server index per pair or NO_SERVER, indices of the servers
            reserved (every server ``assign`` holds, and for a decode call possibly another of
            the same column with no pair; ``PendingDispatch`` skips it), servers by index, table)``.

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
                if self._conns.background and could and time.monotonic() < wait_until:
                    # first connections still being opened: wait for them
                    self._conns.wait_for_connect(wait_until)
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
        expert, see :func:`~eaas.runtime.client.moe.overlapped_moe_forward`) while the expert
        servers compute. Every frame is written before any server is woken
        (:meth:`ClientConnection.send_deferred`, then :meth:`ClientConnection.ring` per server),
        so a woken server cannot preempt this thread between two frames on an oversubscribed
        host. Until ``wait`` returns, other
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
