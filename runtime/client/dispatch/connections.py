"""The attention client's connections to its expert servers: per-server state, connect and
reconnect with back-off, mark down.

Connections are opened only by the connector thread (:meth:`ServerConnections.start`), never
on the request path: at once for a new server, every
:data:`~eaas.runtime.client.dispatch.policy.FIRST_CONNECT_RETRY_S` for one never reached yet
(it is probably still starting), for a down one after ``retry_down_s``, doubling per
consecutive failure up to 30 s (:func:`~eaas.runtime.client.dispatch.policy.reconnect_delay`;
connect timeout at most 2 s), and immediately when a newer routing table lists it again. The
state lock is never held across network I/O, so ``/health`` answers while a layer call waits
for a hung (e.g. SIGSTOPped) server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from eaas.runtime import metrics
from eaas.runtime.client.dispatch.policy import reconnect_delay
from eaas.runtime.transport.base import ClientConnection
from eaas.runtime.transport.factory import connect as transport_connect

log = logging.getLogger("eaas.client.dispatch")

Connector = Callable[..., ClientConnection]


@dataclass
class ServerLink:
    """One expert server as the dispatcher sees it: its connection, whether it is marked down
    and when to retry it, the frame sequence number."""

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

    def state(self) -> str:
        """``down``, ``connected`` or ``idle`` (listed, no connection yet)."""
        if self.down:
            return "down"
        return "connected" if self.conn is not None else "idle"


def default_connect(endpoint: str, server_id: str, **kw) -> ClientConnection:
    """:func:`eaas.runtime.transport.factory.connect`: the dispatcher's default connector."""
    return transport_connect(endpoint, server_id, **kw)


class ServerConnections:
    """One attention client's expert servers: their connections and bookkeeping.

    ``lock`` guards every :class:`ServerLink` (and the dispatcher's own state: it shares the lock);
    the methods named "callers hold the lock" below expect it held, the others take it.

    Args:
        client_id: this attention client's id (frames' ``client_id``, log lines).
        hidden_size: ``H`` of the model (passed to ``connect``).
        dtype: activation dtype of the frames (passed to ``connect``).
        timeout: the dispatch timeout in seconds; a connect waits at most ``min(timeout, 2)``.
        retry_down_s: seconds before a down server is tried again (see
            :func:`~eaas.runtime.client.dispatch.policy.reconnect_delay`).
        connect: connection factory ``(endpoint, server_id, **kw) -> ClientConnection``.
        background: run the connector thread (False: only explicit :meth:`reconnect_down`).
        on_down: called as ``(server, why)`` under the lock when a server is newly marked down;
            must not block.
    """

    def __init__(
        self,
        client_id: int,
        hidden_size: int,
        dtype: torch.dtype,
        *,
        timeout: float,
        retry_down_s: float,
        connect: Connector,
        background: bool,
        on_down: Callable[[ServerLink, str], None],
    ) -> None:
        self.client_id, self.hidden_size, self.dtype = client_id, hidden_size, dtype
        self.timeout, self.retry_down_s = timeout, retry_down_s
        self._connect = connect
        self.background = background
        self._on_down = on_down
        self.lock = threading.RLock()  # never held over I/O
        self.changed = threading.Condition(self.lock)  # a connection attempt finished
        self.servers: dict[str, ServerLink] = {}
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the set of servers (callers hold the lock) ---------------------------------------
    def replace(self, endpoints: Mapping[str, str]) -> None:
        """Switch to the servers ``endpoints`` (server id -> endpoint) of a newer routing table.

        A server still listed with the same endpoint and up keeps its connection; one no longer
        listed, or whose endpoint changed, or that is down, is disconnected (a connection in use
        by a layer call is closed when that call is done with it) and listed again as new, so
        the connector (re)connects it at once. Callers hold the lock.
        """
        old = self.servers
        new: dict[str, ServerLink] = {}
        for sid, ep in endpoints.items():
            prev = old.get(sid)
            if prev is not None and prev.endpoint == ep and not prev.down:
                new[sid] = prev
            else:
                if prev is not None:
                    self.retire(prev)
                new[sid] = ServerLink(sid, ep)
        for sid, prev in old.items():
            if sid not in new:
                self.retire(prev)
        self.servers = new

    @staticmethod
    def close_conn(s: ServerLink) -> None:
        """Close ``s``'s connection now (errors ignored). Callers hold the lock."""
        if s.conn is not None:
            try:
                s.conn.close()
            except Exception:  # noqa: BLE001
                pass
            s.conn = None

    def retire(self, s: ServerLink) -> None:
        """Close ``s``'s connection now, or when the layer call using it is done. Callers hold
        the lock."""
        if s.busy:
            s.retired = True
        else:
            self.close_conn(s)

    def mark_down(self, s: ServerLink, why: str) -> None:
        """Close ``s``'s connection and schedule the next attempt (back-off); the first time,
        count it (``eaas_server_marked_down``), log it and call ``on_down``. Callers hold the
        lock."""
        self.close_conn(s)
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
            # a server never reached yet is most likely still starting (a healthy start):
            # info, not a warning, until this client has had a connection to it
            log.log(
                logging.WARNING if s.ever_connected else logging.INFO,
                "client %d: expert server %s (%s) marked down: %s",
                self.client_id,
                s.server_id,
                s.endpoint,
                why if s.ever_connected else f"{why} (not reached yet; still starting?)",
            )
            self._on_down(s, why)
        self._wake.set()

    # ---- used by layer calls (take the lock) ----------------------------------------------
    def failed(self, s: ServerLink, why: str) -> None:
        """A layer call's send or receive on ``s`` failed: mark it down (closing it now)."""
        with self.lock:
            s.busy = False  # mark_down closes the connection now
            s.retired = False
            self.mark_down(s, why)

    def release(self, servers: list[ServerLink], used: list[int]) -> None:
        """A layer call is done with ``servers[i]`` for ``i`` in ``used``; close retired ones."""
        with self.lock:
            for si in used:
                s = servers[si]
                s.busy = False
                if s.retired:
                    s.retired = False
                    self.close_conn(s)

    def wait_for_connect(self, until: float) -> None:
        """Wake the connector and wait (releasing the lock) until a connection attempt ends or
        ``until`` (``time.monotonic()``) passes. Callers hold the lock."""
        self._wake.set()
        self.changed.wait(max(0.0, until - time.monotonic()))

    def health(self) -> dict[str, dict]:
        """Per server: ``endpoint``, ``state`` (:meth:`ServerLink.state`), ``tokens_sent``,
        ``failures`` and ``last_error`` when there is one."""
        with self.lock:
            return {
                s.server_id: {
                    "endpoint": s.endpoint,
                    "state": s.state(),
                    "tokens_sent": s.tokens_sent,
                    "failures": s.failures,
                    **({"last_error": s.last_error} if s.last_error else {}),
                }
                for s in self.servers.values()
            }

    # ---- the connector (its own thread; never the request path) --------------------------
    def start(self) -> None:
        """Wake the connector thread, starting it the first time (when ``background``)."""
        self._wake.set()
        if self.background and self._thread is None and not self._closed.is_set():
            self._thread = threading.Thread(
                target=self._run, name=f"eaas-connect-{self.client_id}", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
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
        happens outside the lock, so layer calls and ``health`` never wait on it.
        """
        connect_timeout = min(self.timeout, 2.0)
        with self.lock:
            now = time.monotonic()
            due = [
                s
                for s in self.servers.values()
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
                with self.lock:
                    s.connecting = False
                    if self.servers.get(s.server_id) is s:
                        self.mark_down(s, f"connect: {type(exc).__name__}: {exc}")
                    self.changed.notify_all()
                continue
            with self.lock:
                s.connecting = False
                if (
                    self.servers.get(s.server_id) is s
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
                self.changed.notify_all()
            if conn is not None:  # the table changed meanwhile, or we are closing
                conn.close()
        return back

    def close(self) -> None:
        """Stop the connector thread and close every connection (idle ones at once, one in use
        by a layer call when that call finishes)."""
        self._closed.set()
        self._wake.set()
        with self.lock:
            for s in self.servers.values():
                self.retire(s)
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(5.0)
