"""Dispatch and combine: the attention client's side of one MoE layer call.

:class:`RemoteExperts` replaces a model's routed-experts module (``experts_factory`` of
:func:`eaas.runtime.models.load_attention_model`); the model's own router and shared expert stay
local, so the MoE block computes ``shared(x) + RemoteExperts(x, top_k_index, top_k_weights)``.

:class:`Dispatcher` (one per attention client process) holds the routing table and one transport
connection per expert server. Per MoE layer call (:meth:`Dispatcher.dispatch`):

1. **Pick replicas.** For every ``(token, selected expert, weight)`` pair it picks ONE live replica
   of ``(layer, expert)``: the one with the fewest tokens already assigned to it in this call,
   ties broken round-robin (a rotating start per ``(layer, expert)``). A pair is never sent to two
   servers.
2. **Dispatch.** One :class:`RequestFrame` per target server: each token's hidden row once, plus
   its ``[k]`` expert ids / weights in which the pairs assigned to other servers are padded with
   ``-1`` / ``0``; send to all targets, then wait for all of them with one deadline
   (``timeout`` seconds).
3. **Failover.** A server that raises :class:`PeerDeadError` / :class:`DeadlineExceeded` /
   another transport error, or answers an error status, is marked down (``eaas_server_marked_down``
   metric, a log line, connection closed); ONLY its pairs are re-assigned to other live replicas
   and sent again (``eaas_failovers_total`` += 1 per failed server batch); repeat. If some
   expert has no live replica left, :class:`NoLiveReplicaError` is raised (retryable; the API
   answers 503). A down server is retried (reconnected, with a connect timeout of at most 2 s)
   after ``retry_down_s``, doubling per consecutive failure up to 30 s (on the next dispatch
   that needs it, or by :class:`RoutingTableWatcher` calling :meth:`Dispatcher.reconnect_down`,
   so it also happens without traffic), and immediately when a newer routing table lists it
   again. :meth:`Dispatcher.uncovered` lists the experts without a live replica (GET /health
   answers 503 while there are any).
4. **Combine.** The per-server partial sums are added into one ``[T, H]`` tensor.

Routing table updates: :meth:`Dispatcher.set_table` (thread safe; waits for a layer call in
progress) accepts only strictly newer versions; :class:`RoutingTableWatcher` polls a JSON file
(e.g. a Kubernetes ConfigMap mount) by mtime/size/inode and feeds it in. The version in use is
published in the ``eaas_routing_table_version{client_id}`` gauge and by :meth:`Dispatcher.health`
(GET /health) -- that is the client's acknowledgement.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from eaas.runtime import metrics
from eaas.runtime.routing import RoutingTable, RoutingTableError
from eaas.runtime.transport.base import STATUS_OK, ClientConnection, RequestFrame

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
    last_error: str = ""


Connector = Callable[..., ClientConnection]


def _default_connect(endpoint: str, server_id: str, **kw) -> ClientConnection:
    from eaas.runtime.transport.factory import connect

    return connect(endpoint, server_id, **kw)


class Dispatcher:
    """Per-client dispatch/combine over the expert servers of the current routing table.

    Args:
        client_id: this attention client's id (frames' ``client_id``, metric label).
        hidden_size: ``H`` of the model.
        dtype: activation dtype sent to servers (the model's dtype).
        table: initial routing table (may be ``None`` until :meth:`set_table`).
        timeout: seconds to wait for all servers of one dispatch round.
        retry_down_s: seconds before a down server is tried again.
        connect: connection factory (``eaas.runtime.transport.factory.connect``).
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
    ) -> None:
        self.client_id = int(client_id)
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self.timeout = float(timeout)
        self.retry_down_s = float(retry_down_s)
        self._connect = connect
        self._lock = threading.RLock()
        self._table: RoutingTable | None = None
        self._servers: dict[str, _Server] = {}
        self._rr: dict[tuple[int, int], int] = {}
        self._version_gauge = metrics.ROUTING_TABLE_VERSION.labels(client_id=str(self.client_id))
        # called as (server_id, endpoint, table_version, reason) when a server is marked down,
        # under the lock: must not block (failure_report.FailureReporter.report only enqueues)
        self.on_server_down: Callable[[str, str, int, str], object] | None = None
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

        Servers no longer listed (or whose endpoint changed) are disconnected; every listed
        server starts as up (a server that re-appears is reconnected on its next use).

        Returns:
            True if applied, False if rejected as older/equal.
        """
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
                        self._close(prev)
                    new[sid] = _Server(sid, ep)
            for sid, prev in old.items():
                if sid not in new:
                    self._close(prev)
            self._servers = new
            self._table = table
            self._version_gauge.set(table.version)
            uncovered = table.uncovered()
            log.info(
                "client %d: routing table version %d in use (%d servers%s)",
                self.client_id,
                table.version,
                len(new),
                f", {len(uncovered)} experts without replica" if uncovered else "",
            )
            return True

    def uncovered(self) -> list[dict]:
        """``(layer, expert)`` pairs without a live replica: none in the routing table, or all of
        its replicas marked down. Items: ``{"layer", "expert", "reason", "replicas"}``."""
        with self._lock:
            table = self._table
            if table is None:
                return []
            out = []
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
            return out

    def reconnect_down(self) -> int:
        """Try to reconnect every down server whose back-off has expired (without this, a client
        that gets no traffic -- e.g. taken out of a Service by its readiness probe -- would never
        notice a recovered server). Returns how many came back.

        Connecting (up to ``min(timeout, 2 s)`` against a dead pod IP) happens outside the
        dispatch lock, so MoE layer calls never wait on it.
        """
        connect_timeout = min(self.timeout, 2.0)
        with self._lock:
            now = time.monotonic()
            due = [s for s in self._servers.values() if s.down and now >= s.retry_at]
            for s in due:  # keep the dispatch path off these servers while we try them
                s.retry_at = now + connect_timeout + 1.0
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
                    if self._servers.get(s.server_id) is s and s.down:
                        self._mark_down(s, f"reconnect: {type(exc).__name__}: {exc}")
                continue
            with self._lock:
                if self._servers.get(s.server_id) is s and s.down and s.conn is None:
                    s.conn, s.down = conn, False
                    log.info(
                        "client %d: reconnected to expert server %s", self.client_id, s.server_id
                    )
                    back += 1
                    conn = None
            if (
                conn is not None
            ):  # the table changed meanwhile, or the dispatch path got there first
                conn.close()
        return back

    def health(self) -> dict:
        """JSON-able view: table version, per-server state, experts without a live replica
        (``uncovered_experts`` = how many, ``uncovered`` = the first :data:`HEALTH_MAX_UNCOVERED`)."""
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
        with self._lock:
            for s in self._servers.values():
                self._close(s)

    # ---- connection state ----------------------------------------------------------------
    @staticmethod
    def _close(s: _Server) -> None:
        if s.conn is not None:
            try:
                s.conn.close()
            except Exception:  # noqa: BLE001
                pass
            s.conn = None

    def _mark_down(self, s: _Server, why: str) -> None:
        self._close(s)
        s.failures += 1
        s.consecutive += 1
        s.last_error = why
        # exponential back-off between reconnect attempts: retry_down_s, 2x, 4x, ... (max 30 s)
        s.retry_at = time.monotonic() + min(
            self.retry_down_s * 2 ** (s.consecutive - 1), max(30.0, self.retry_down_s)
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

    def _usable(self, sid: str, now: float) -> bool:
        s = self._servers.get(sid)
        if s is None:
            return False
        return not s.down or now >= s.retry_at

    def _ensure_conn(self, s: _Server) -> ClientConnection:
        if s.conn is None:
            s.conn = self._connect(
                s.endpoint,
                s.server_id,
                hidden_size=self.hidden_size,
                dtype=self.dtype,
                client_id=self.client_id,
                connect_timeout=min(self.timeout, 2.0),  # a hung server must not stall us long
            )
            if s.down:
                log.info("client %d: reconnected to expert server %s", self.client_id, s.server_id)
            s.down = False
        return s.conn

    # ---- dispatch / combine --------------------------------------------------------------
    def _assign(
        self,
        layer: int,
        groups: dict[int, list[tuple[int, int]]],
        assign: list[list[int]],
        load: list[int],
        index: dict[str, int],
        exclude: set[str],
        now: float,
    ) -> None:
        """Pick one live replica per ``(token, slot)`` pair; writes server indices into ``assign``.

        ``groups``: expert id -> its ``(t, j)`` positions in ``top_k_index``. Least outstanding
        tokens in this call (``load``, indexed like ``index``) wins; ties go to the replica that
        comes first in a per-``(layer, expert)`` rotation advanced once per call (round-robin).

        Raises:
            NoLiveReplicaError: an expert with no usable replica outside ``exclude``.
            RuntimeError: no routing table yet.
        """
        table = self._table
        if table is None:
            raise RuntimeError("no routing table loaded")
        for e, pairs in groups.items():
            try:
                reps = table.replicas(layer, e)
            except (KeyError, IndexError):
                reps = ()
            if not reps:
                raise NoLiveReplicaError(
                    layer,
                    e,
                    f"no replica of layer {layer} expert {e} in routing table version {table.version}",
                )
            live = [index[r] for r in reps if r not in exclude and self._usable(r, now)]
            if not live:
                raise NoLiveReplicaError(
                    layer, e, f"all replicas of layer {layer} expert {e} are down: {list(reps)}"
                )
            key = (layer, e)
            start = self._rr.get(key, 0)
            self._rr[key] = start + 1
            m = len(live)
            order = [live[(start + i) % m] for i in range(m)]
            for t, j in pairs:
                best = min(order, key=load.__getitem__)  # first minimum = rotation order on ties
                load[best] += 1
                assign[t][j] = best

    def dispatch(
        self,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Run the routed experts of one MoE layer on the expert servers.

        Args:
            layer: model layer index (a MoE layer of the routing table).
            hidden: ``[T, H]`` MoE-block input (after the post-attention norm), model dtype.
            top_k_index: ``[T, k]`` int64 selected logical experts (``-1`` = none).
            top_k_weights: ``[T, k]`` gate weights (already scaled by the model).

        Returns:
            ``[T, H]`` in ``hidden.dtype``: ``sum_j w[t, j] * E_{idx[t, j]}(hidden[t])``.

        Raises:
            NoLiveReplicaError: a selected expert has no live replica (after failover).
            RuntimeError: no routing table yet.
        """
        t0 = time.perf_counter()
        in_dtype = hidden.dtype
        T, H = hidden.shape
        k = int(top_k_index.shape[1])
        hidden = hidden.to(self.dtype).contiguous()
        idx64 = top_k_index.to(torch.int64)
        w32 = top_k_weights.to(torch.float32)
        out = torch.zeros(T, H, dtype=self.dtype)
        idx_l = idx64.tolist()
        with self._lock:
            if self._table is None:
                raise RuntimeError("no routing table loaded")
            sids = list(self._servers)
            index = {s: i for i, s in enumerate(sids)}
            load = [0] * len(sids)
            assign = [[-1] * k for _ in range(T)]
            groups: dict[int, list[tuple[int, int]]] = {}
            for t, row in enumerate(idx_l):
                for j, e in enumerate(row):
                    if e >= 0:
                        groups.setdefault(e, []).append((t, j))
            self._assign(layer, groups, assign, load, index, set(), time.monotonic())
            A = torch.tensor(assign, dtype=torch.int64).view(
                T, k
            )  # server index per pair, -1 = none
            pending = A >= 0
            failed_here: set[str] = set()
            while bool(pending.any()):
                failed = self._round(layer, hidden, idx64, w32, A, pending, sids, out)
                if not failed:
                    break
                redo = torch.zeros_like(pending)
                for si in failed:
                    redo |= pending & (A == si)
                    failed_here.add(sids[si])
                    metrics.FAILOVERS.inc()
                groups = {}
                for t, j in redo.nonzero().tolist():
                    groups.setdefault(idx_l[t][j], []).append((t, j))
                self._assign(layer, groups, assign, load, index, failed_here, time.monotonic())
                A = torch.tensor(assign, dtype=torch.int64).view(T, k)
                pending = redo
                log.info(
                    "client %d: layer %d: re-sent %d token-expert pairs of server(s) %s",
                    self.client_id,
                    layer,
                    int(redo.sum()),
                    ", ".join(sids[si] for si in failed),
                )
        metrics.DISPATCH_SECONDS.observe(time.perf_counter() - t0)
        return out.to(in_dtype)

    def _round(
        self,
        layer: int,
        hidden: torch.Tensor,
        idx64: torch.Tensor,
        w32: torch.Tensor,
        A: torch.Tensor,
        pending: torch.Tensor,
        sids: list[str],
        out: torch.Tensor,
    ) -> list[int]:
        """Send one frame per server holding ``pending`` pairs, wait for all, add into ``out``.

        A frame carries each of its tokens' hidden row once and the token's ``[k]`` expert ids /
        weights with pairs of other servers masked to ``-1`` / ``0``. Returns the indices (into
        ``sids``) of servers that failed; they are marked down.
        """
        failed: list[int] = []
        sent: list[tuple[_Server, ClientConnection, int, torch.Tensor, int]] = []
        if self._table is None:
            raise RuntimeError("no routing table loaded")
        version = self._table.version
        for si in torch.unique(A[pending]).tolist():
            s = self._servers[sids[si]]
            m = pending & (A == si)  # [T, k]
            rows = m.any(dim=1).nonzero().squeeze(1)  # [n]
            s.seq += 1
            frame = RequestFrame(
                client_id=self.client_id,
                layer=layer,
                table_version=version,
                seq=s.seq,
                hidden=hidden.index_select(0, rows),
                experts=torch.where(m, idx64, -1).index_select(0, rows).to(torch.int32),
                weights=torch.where(m, w32, 0.0).index_select(0, rows),
            )
            try:
                conn = self._ensure_conn(s)
                conn.send(frame)
            except Exception as exc:  # noqa: BLE001  (PeerDeadError, FrameError, OSError, ...)
                self._mark_down(s, f"send: {type(exc).__name__}: {exc}")
                failed.append(si)
                continue
            sent.append((s, conn, si, rows, s.seq))
        deadline = time.monotonic() + self.timeout
        for s, conn, si, rows, seq in sent:
            try:
                resp = conn.recv(deadline)
                if resp.seq != seq:
                    raise RuntimeError(f"response seq {resp.seq} != request seq {seq}")
                if resp.status != STATUS_OK:
                    raise RuntimeError(f"error status {resp.status}: {resp.message}")
                if resp.output is None:
                    raise RuntimeError("OK response without output")
                out.index_add_(0, rows, resp.output.to(out.dtype))
                s.tokens_sent += int(rows.numel())
                s.consecutive = 0
            except Exception as exc:  # noqa: BLE001
                self._mark_down(s, f"recv: {type(exc).__name__}: {exc}")
                failed.append(si)
        return failed


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
        out = self.dispatcher.dispatch(self.layer_idx, hidden_states, top_k_index, top_k_weights)
        return out.to(hidden_states.device)  # the combine buffer is host memory

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, client_id={self.dispatcher.client_id}"


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
