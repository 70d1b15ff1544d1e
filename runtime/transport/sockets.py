"""The socket skeleton every transport shares: connection bookkeeping on both ends.

Both the shared-memory transport (:mod:`.shm`, a Unix ``SOCK_SEQPACKET`` socket as doorbell and
liveness signal) and the TCP transport (:mod:`.tcp`, the socket carries the data too) keep one
socket per attention-client connection. What they share lives here:

* :class:`SocketClientConnection` (client end): the common attributes, the "connection closed" /
  "request already in flight" / "recv without a request" checks and ``close``.
* :class:`SocketServerListener` (server end): a non-blocking listening socket in a
  ``selectors`` selector, accept, drop (unregister, close, release the transport's per-connection
  resources), the live-connection check behind ``respond``, and ``close``.

A transport fills in only its own data path: how a frame travels (:meth:`ClientConnection.send`,
:meth:`ClientConnection.recv`, :meth:`ServerListener.poll`, :meth:`ServerListener.respond`) and
the hooks ``_new_conn`` / ``_read`` / ``_release`` / ``_release_client``.
"""

from __future__ import annotations

import abc
import os
import selectors
import socket
from typing import Generic, TypeVar

import torch

from eaas.runtime.transport.base import (
    DTYPE_CODES,
    ClientConnection,
    FrameError,
    PeerDeadError,
    ServerListener,
)


class SocketClientConnection(ClientConnection):
    """Client end over one socket: shared state and protocol checks.

    Subclasses call :meth:`_init_common` first in their constructor, set ``self._sock`` once
    connected, and may override :meth:`_release_client` to free transport resources on close.

    Raises (from :meth:`_init_common`): :class:`FrameError` for a dtype outside
    :data:`~eaas.runtime.transport.base.DTYPE_CODES`.
    """

    _sock: socket.socket | None = None
    _outstanding: bool = False

    def _init_common(
        self,
        endpoint: str,
        server_id: str,
        hidden_size: int,
        dtype: torch.dtype,
        client_id: int | None,
    ) -> None:
        if dtype not in DTYPE_CODES:
            raise FrameError(f"unsupported dtype {dtype}")
        self.endpoint = endpoint
        self.server_id = server_id
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self.client_id = os.getpid() if client_id is None else int(client_id)
        self._outstanding = False

    def _where(self) -> str:
        return f"expert server {self.server_id} at {self.endpoint}"

    @property
    def in_flight(self) -> bool:
        """True between a ``send`` and the ``recv`` that returns its response."""
        return self._outstanding

    def _open_sock(self) -> socket.socket:
        """The socket, or :class:`PeerDeadError` when the connection was closed."""
        if self._sock is None:
            raise PeerDeadError(f"connection to {self.server_id} is closed")
        return self._sock

    def _sock_for_send(self) -> socket.socket:
        """Checks before a ``send``: open, and no request in flight (one at a time)."""
        sock = self._open_sock()
        if self._outstanding:
            raise FrameError(
                f"connection to {self.server_id}: a request is already in flight (one at a time)"
            )
        return sock

    def _sock_for_recv(self) -> socket.socket:
        """Checks before a ``recv``: open, and a request in flight."""
        sock = self._open_sock()
        if not self._outstanding:
            raise FrameError(f"connection to {self.server_id}: recv without a request in flight")
        return sock

    def _release_client(self) -> None:
        """Free transport resources after the socket is closed (default: nothing)."""

    def close(self) -> None:
        """Close the socket and free the connection's resources; idempotent."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        self._release_client()
        self._outstanding = False


class ServerConn:
    """Server-side state of one client connection (a transport subclasses it for its own)."""

    __slots__ = ("sock", "fileno", "client_id", "ready", "in_flight")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.fileno = sock.fileno()
        self.client_id = -1
        self.ready = False  # hello accepted
        self.in_flight = False  # a frame was returned by poll and not yet answered


C = TypeVar("C", bound=ServerConn)


class SocketServerListener(ServerListener, Generic[C]):
    """Server end over a listening socket: accept, drop, live checks, close.

    Args:
        lsock: a bound, listening socket; it is made non-blocking and registered with the
            selector (``key.data is None`` marks it).

    Subclasses implement :meth:`_new_conn` (wrap an accepted socket), :meth:`_read` (handle a
    readable connection), and optionally :meth:`_configure` (socket options on accept),
    :meth:`_release` (per-connection resources on drop) and :meth:`_after_close`.
    """

    def __init__(self, lsock: socket.socket):
        self._lsock = lsock
        self._lsock.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._lsock, selectors.EVENT_READ, None)
        self._conns: dict[int, C] = {}

    @property
    def num_connections(self) -> int:
        """Connections whose hello was accepted."""
        return sum(1 for c in self._conns.values() if c.ready)

    # -- hooks -------------------------------------------------------------------------
    @abc.abstractmethod
    def _new_conn(self, sock: socket.socket) -> C:
        """Wrap a freshly accepted (already non-blocking) socket."""

    @abc.abstractmethod
    def _read(self, conn: C) -> None:
        """Handle a readable connection (drop it on EOF or a protocol violation)."""

    def _configure(self, sock: socket.socket) -> None:
        """Socket options for an accepted socket (default: none)."""

    def _release(self, conn: C) -> None:
        """Free a dropped connection's transport resources (default: nothing)."""

    def _after_close(self) -> None:
        """Clean-up after :meth:`close` closed every socket (default: nothing)."""

    # -- shared logic ------------------------------------------------------------------
    def _accept(self) -> None:
        """Accept every pending connection without blocking."""
        while True:
            try:
                sock, _ = self._lsock.accept()
            except OSError:  # BlockingIOError (none left), InterruptedError, or a dead socket
                return
            self._configure(sock)
            sock.setblocking(False)
            conn = self._new_conn(sock)
            self._conns[conn.fileno] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _drop(self, conn: C) -> None:
        """Forget ``conn``: unregister, close its socket, release its resources; idempotent."""
        if self._conns.get(conn.fileno) is not conn:
            return
        del self._conns[conn.fileno]
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        conn.ready = False
        self._release(conn)

    def _is_live(self, conn: C) -> bool:
        """Whether ``conn`` is still connected (not dropped)."""
        return self._conns.get(conn.fileno) is conn

    def _own(self, conn: object) -> C:
        """``conn`` as this listener's connection type (``respond``'s handle check).

        Raises:
            TypeError: a handle that did not come from this listener's ``poll``.
        """
        if not isinstance(conn, ServerConn):
            raise TypeError(f"not a connection handle of this listener: {conn!r}")
        return conn  # type: ignore[return-value]  # C is the only ServerConn kind we register

    def _select(self, timeout: float | None) -> list[tuple[C, int]]:
        """Wait up to ``timeout`` s (None: forever) for socket events; accept new connections.

        Returns ``(conn, events)`` for every live connection with events.
        """
        ready = []
        for key, events in self._sel.select(timeout):
            if key.data is None:
                self._accept()
            else:
                ready.append((key.data, events))
        return ready

    def close(self) -> None:
        """Drop every connection and close the listening socket."""
        for conn in list(self._conns.values()):
            self._drop(conn)
        try:
            self._sel.unregister(self._lsock)
        except (KeyError, ValueError):
            pass
        self._sel.close()
        self._lsock.close()
        self._after_close()
