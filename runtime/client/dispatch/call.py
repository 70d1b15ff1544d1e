"""One MoE layer call in flight: its rounds of frames, failover and combine.

``Dispatcher.dispatch_begin`` (:mod:`.dispatcher`) returns a :class:`PendingDispatch`; its
first round is sent at once, and :meth:`PendingDispatch.wait` receives it, re-sends the pairs
of a failed or refusing server to other replicas (a new round), and returns the combined
``[T, H]``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from eaas.runtime import metrics
from eaas.runtime.client.dispatch.connections import ServerLink
from eaas.runtime.client.dispatch.frames import server_frame
from eaas.runtime.client.dispatch.staging import FrameStaging
from eaas.runtime.tables.table import RoutingTable
from eaas.runtime.transport.base import STATUS_NOT_HOSTED, STATUS_OK, PeerDeadError

if TYPE_CHECKING:  # type only: dispatcher.py imports this module to make a PendingDispatch
    from eaas.runtime.client.dispatch.dispatcher import Dispatcher

log = logging.getLogger("eaas.client.dispatch")


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
            sent, graph_out, failed = self._send_round(assign, used, servers, table)
        except BaseException:
            d._conns.release(servers, used)
            raise
        self._round = (assign, used, servers, table, sent, graph_out, failed)

    def _send_round(
        self, assign: torch.Tensor, used: list[int], servers: list[ServerLink], table: RoutingTable
    ) -> tuple[list[tuple[ServerLink, int, torch.Tensor | None, int]], dict[int, tuple], list[int]]:
        """Write one frame per server in ``used``, then wake every one. No lock held.

        A frame carries each of its tokens' hidden row once (gathered by the transport straight
        into its buffer) and the token's ``[k]`` expert ids / weights with pairs of other servers
        masked to ``-1`` / ``0``. Returns ``(sent, graph_out, failed)``: ``(server, index, rows,
        seq)`` per frame sent, the captured round trips replayed (``--cuda-graphs``), and the
        indices (into ``servers``) of servers whose send failed (marked down).
        """
        d, layer, hidden, idx64, w32 = self._d, self.layer, self._hidden, self._idx64, self._w32
        staging = FrameStaging(hidden)  # a host copy only for host connections, once
        failed: list[int] = []
        sent: list[tuple[ServerLink, int, torch.Tensor | None, int]] = []
        graph_out: dict[int, tuple] = {}  # server index -> (graph, output view) (--cuda-graphs)
        idx32 = idx64.to(torch.int32)  # (T, k) the wire's expert ids
        k = int(idx32.shape[1])
        ring = not d.ring_after_all  # else woken below, once every frame is written
        for si in used:  # loop over servers, tensor ops inside
            s = servers[si]
            frame = server_frame(assign, si, idx32, w32)
            if frame is None:
                continue  # reserved with its column, but no pair of this call is its
            ex, w, rows, n = frame.experts, frame.weights, frame.rows, frame.n
            s.seq += 1
            conn = s.conn
            h = staging.hidden_for(conn)  # (T, H) where this connection reads frames
            try:
                if conn is None:
                    raise PeerDeadError("connection closed")
                g = None
                if d.graphs is not None:  # --cuda-graphs: replay the captured round trip
                    g = d.graphs.for_connection(conn, n, k)
                if g is not None:
                    hs = h if rows is None else h.index_select(0, staging.rows_on(rows, h))
                    graph_out[si] = (g, g.run(hs, ex, w, layer=layer,
                                              table_version=table.version))  # fmt: skip
                else:  # (n, k) and the tensors' shapes agree by construction (check_call)
                    conn.send_parts(
                        d.client_id, layer, table.version, s.seq, h, ex, w, rows, n, k, ring
                    )
            except Exception as exc:  # noqa: BLE001  (PeerDeadError, FrameError, OSError, ...)
                d._conns.failed(s, f"send: {type(exc).__name__}: {exc}")
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
                d._conns.failed(s, f"send: {type(exc).__name__}: {exc}")
                failed.append(si)
                sent.remove((s, si, _rows, _seq))
        return sent, graph_out, failed

    def _recv_round(
        self,
        sent: list[tuple[ServerLink, int, torch.Tensor | None, int]],
        graph_out: dict[int, tuple],
        table: RoutingTable,
        failed: list[int],
    ) -> tuple[list[int], list[int]]:
        """Wait for every server of :meth:`_send_round` (one deadline), add into ``out``.

        Returns ``(failed, refused)``: indices (into ``servers``) of servers that failed
        (marked down; ``failed`` of the send extended) and of servers that answered
        ``STATUS_NOT_HOSTED`` (kept up; their pairs go to other replicas).
        """
        d, layer, out = self._d, self.layer, self._out
        refused: list[int] = []
        deadline = time.monotonic() + d.timeout
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
                            d.client_id,
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
                d._conns.failed(s, f"recv: {type(exc).__name__}: {exc}")
                failed.append(si)
        return failed, refused

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
                    failed, refused = self._recv_round(sent, graph_out, table, failed)
                finally:
                    d._conns.release(servers, used)
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
