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
   its ``[k]`` list of ``(expert id, weight)`` padded with ``-1`` / ``0``; send to all targets,
   then wait for all of them with one deadline (``timeout`` seconds).
3. **Failover.** A server that raises :class:`PeerDeadError` / :class:`DeadlineExceeded` /
   another transport error, or answers an error status, is marked down (``eaas_server_marked_down``
   metric, a log line, connection closed); ONLY its pairs are re-assigned to other live replicas
   and sent again (``eaas_failovers_total`` += 1 per failed server batch); repeat. If some
   expert has no live replica left, :class:`NoLiveReplicaError` is raised (retryable; the API
   answers 503). A down server is retried (reconnected) after ``retry_down_s``, and immediately
   when a newer routing table lists it again.
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
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from eaas.runtime import metrics
from eaas.runtime.routing import RoutingTable, RoutingTableError
from eaas.runtime.transport.base import STATUS_OK, ClientConnection, RequestFrame

log = logging.getLogger("eaas.client.dispatch")


class NoLiveReplicaError(RuntimeError):
    """Some (layer, expert) selected by the router has no live replica. Retryable (HTTP 503).

    Attributes:
        layer: model layer index.
        expert: logical expert id.
    """

    def __init__(self, layer: int, expert: int, detail: str = ""):
        self.layer, self.expert = layer, expert
        super().__init__(
            f"no live replica of expert {expert} of layer {layer}" + (f" ({detail})" if detail else "")
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
    last_error: str = ""


Connector = Callable[..., ClientConnection]


def _default_connect(endpoint: str, server_id: str, **kw) -> ClientConnection:
    from eaas.runtime.transport.base import connect

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
        connect: connection factory (``eaas.runtime.transport.base.connect``).
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

    def health(self) -> dict:
        """JSON-able view: table version, per-server state."""
        with self._lock:
            return {
                "routing_table_version": self.version,
                "servers": {
                    s.server_id: {
                        "endpoint": s.endpoint,
                        "state": "down" if s.down else ("connected" if s.conn is not None else "idle"),
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
        s.last_error = why
        s.retry_at = time.monotonic() + self.retry_down_s
        if not s.down:
            s.down = True
            metrics.SERVER_DOWN.labels(server=s.server_id).inc()
            log.warning("client %d: expert server %s (%s) marked down: %s", self.client_id, s.server_id, s.endpoint, why)

    def _usable(self, sid: str, now: float) -> bool:
        s = self._servers.get(sid)
        if s is None:
            return False
        return not s.down or now >= s.retry_at

    def _ensure_conn(self, s: _Server) -> ClientConnection:
        if s.conn is None:
            s.conn = self._connect(s.endpoint, s.server_id, hidden_size=self.hidden_size, dtype=self.dtype, client_id=self.client_id)
            if s.down:
                log.info("client %d: reconnected to expert server %s", self.client_id, s.server_id)
            s.down = False
        return s.conn

    # ---- dispatch / combine --------------------------------------------------------------
    def _pick(self, layer: int, expert: int, load: dict[str, int], exclude: set[str], now: float) -> str:
        table = self._table
        try:
            reps = table.replicas(layer, expert)
        except (KeyError, IndexError):
            raise NoLiveReplicaError(layer, expert, f"not in routing table version {table.version}") from None
        live = [r for r in reps if r not in exclude and self._usable(r, now)]
        if not live:
            raise NoLiveReplicaError(layer, expert, f"replicas {list(reps)} all down")
        key = (layer, expert)
        start = self._rr.get(key, 0)
        self._rr[key] = start + 1
        n = len(live)
        best = min(range(n), key=lambda i: (load.get(live[(start + i) % n], 0), i))
        return live[(start + best) % n]

    def dispatch(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
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
        T, H = hidden.shape
        k = top_k_index.shape[1]
        hidden = hidden.to(self.dtype).contiguous()
        out = torch.zeros(T, H, dtype=self.dtype)
        idx_l = top_k_index.tolist()
        w_l = top_k_weights.float().tolist()
        with self._lock:
            if self._table is None:
                raise RuntimeError("no routing table loaded")
            now = time.monotonic()
            load: dict[str, int] = {}
            # server -> token -> [(expert, weight)]
            todo: dict[str, dict[int, list[tuple[int, float]]]] = {}
            for t in range(T):
                for j in range(k):
                    e = idx_l[t][j]
                    if e < 0:
                        continue
                    s = self._pick(layer, e, load, set(), now)
                    load[s] = load.get(s, 0) + 1
                    todo.setdefault(s, {}).setdefault(t, []).append((e, w_l[t][j]))
            failed_here: set[str] = set()
            while todo:
                failed = self._round(layer, hidden, k, todo, out)
                todo = {}
                for sid, toks in failed.items():
                    failed_here.add(sid)
                    metrics.FAILOVERS.inc()
                    now = time.monotonic()
                    for t, pairs in toks.items():
                        for e, w in pairs:
                            s = self._pick(layer, e, load, failed_here, now)
                            load[s] = load.get(s, 0) + 1
                            todo.setdefault(s, {}).setdefault(t, []).append((e, w))
                    log.info("client %d: layer %d: re-sent %d tokens of server %s", self.client_id, layer, len(toks), sid)
        metrics.DISPATCH_SECONDS.observe(time.perf_counter() - t0)
        return out.to(hidden.dtype)

    def _round(
        self,
        layer: int,
        hidden: torch.Tensor,
        k: int,
        todo: dict[str, dict[int, list[tuple[int, float]]]],
        out: torch.Tensor,
    ) -> dict[str, dict[int, list[tuple[int, float]]]]:
        """Send one frame per server in ``todo``, wait for all, add outputs into ``out``.

        Returns the entries of ``todo`` whose server failed (those servers are marked down).
        """
        failed: dict[str, dict[int, list[tuple[int, float]]]] = {}
        sent: list[tuple[_Server, torch.Tensor, int]] = []
        version = self._table.version
        for sid, toks in todo.items():
            s = self._servers[sid]
            rows = sorted(toks)
            ex = torch.full((len(rows), k), -1, dtype=torch.int32)
            wt = torch.zeros(len(rows), k, dtype=torch.float32)
            for i, t in enumerate(rows):
                for j, (e, w) in enumerate(toks[t]):
                    ex[i, j] = e
                    wt[i, j] = w
            rows_t = torch.tensor(rows, dtype=torch.long)
            s.seq += 1
            frame = RequestFrame(
                client_id=self.client_id,
                layer=layer,
                table_version=version,
                seq=s.seq,
                hidden=hidden.index_select(0, rows_t).contiguous(),
                experts=ex,
                weights=wt,
            )
            try:
                self._ensure_conn(s).send(frame)
            except Exception as exc:  # noqa: BLE001  (PeerDeadError, FrameError, OSError, ...)
                self._mark_down(s, f"send: {type(exc).__name__}: {exc}")
                failed[sid] = toks
                continue
            sent.append((s, rows_t, s.seq))
        deadline = time.monotonic() + self.timeout
        for s, rows_t, seq in sent:
            try:
                resp = s.conn.recv(deadline)
                if resp.seq != seq:
                    raise RuntimeError(f"response seq {resp.seq} != request seq {seq}")
                if resp.status != STATUS_OK:
                    raise RuntimeError(f"error status {resp.status}: {resp.message}")
                out.index_add_(0, rows_t, resp.output.to(out.dtype))
                s.tokens_sent += len(rows_t)
            except Exception as exc:  # noqa: BLE001
                self._mark_down(s, f"recv: {type(exc).__name__}: {exc}")
                failed[s.server_id] = todo[s.server_id]
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

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.dispatcher.dispatch(self.layer_idx, hidden_states, top_k_index, top_k_weights)

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
            log.warning("routing table %s unreadable, keeping version %d: %s", self.path, self.dispatcher.version, exc)
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
            except Exception:  # noqa: BLE001
                log.exception("routing table poll failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
