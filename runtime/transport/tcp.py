"""Cross-host transport: fixed little-endian header + raw tensor bytes over TCP.

Endpoint: ``tcp://HOST:PORT`` (the server may bind ``0.0.0.0``; port 0 picks a free port, see
:attr:`TcpServerListener.endpoint`).

Wire format (no pickling). Every message is one 64-byte header :data:`HDR` then a payload::

    HDR = "<4sIqqqiiiiiI" : magic b"EAAS", kind, client_id, table_version, seq, layer, n,
                             k_or_status, hidden, dtype code, payload bytes

    kind 1 HELLO  client -> server  (n unused, hidden = H, dtype code); no payload
    kind 2 ACK    server -> client  k_or_status = status; payload = utf-8 message
    kind 3 REQ    client -> server  payload = hidden [n, H] dtype bytes
                                            + experts [n, k] int32 + weights [n, k] float32
    kind 4 RESP   server -> client  k_or_status = status; payload = output [n, H] dtype bytes
                                     (status OK) or utf-8 message (error)

Tensors are written straight from their storage (``tensor.view(torch.uint8).numpy()``, works for
bfloat16 too) and read with ``recv_into`` into a preallocated, grow-on-demand buffer. Both ends
set ``TCP_NODELAY``. The server multiplexes all clients with ``selectors``; reads are incremental
(non-blocking), so a slow client never blocks the others. Responses are written with a bounded
non-blocking writes: what the socket does not take at once is queued and flushed from
``poll`` when the socket turns writable, so a stopped or slow client never stalls the server
loop; a client whose queued response is not drained within ``send_timeout`` is dropped.

Liveness: EOF / reset = peer gone (:class:`PeerDeadError` on the client; dropped on the server).
A SIGSTOPped peer keeps the connection open, so the client's ``recv`` deadline catches it.
"""

from __future__ import annotations

import select
import selectors
import socket
import struct
import time
from collections.abc import Sequence

import torch

from eaas.runtime.transport.base import (
    CODE_DTYPES,
    DTYPE_CODES,
    MAX_K_HARD,
    MAX_TOKENS_HARD,
    STATUS_BAD_FRAME,
    STATUS_OK,
    DeadlineExceeded,
    FrameError,
    PeerDeadError,
    RequestFrame,
    ResponseFrame,
    check_request,
)
from eaas.runtime.transport.sockets import ServerConn, SocketClientConnection, SocketServerListener

MAGIC = b"EAAS"
HDR = struct.Struct("<4sIqqqiiiiiI")
KIND_HELLO, KIND_ACK, KIND_REQ, KIND_RESP = 1, 2, 3, 4
MAX_PAYLOAD = 1 << 31
_Bytes = bytes | bytearray | memoryview  # what sendmsg takes (typing.Buffer is 3.12+)


def parse_tcp(endpoint: str) -> tuple[str, int]:
    """``tcp://host:port`` -> ``(host, port)``. Raises ValueError."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"not a tcp endpoint: {endpoint!r}")
    rest = endpoint[len("tcp://") :].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"tcp endpoint needs host:port, got {endpoint!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _as_bytes(t: torch.Tensor) -> memoryview:
    """Raw bytes of a tensor's contiguous storage (any dtype, bfloat16 included)."""
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def _sendall_vec(sock: socket.socket, bufs: Sequence[_Bytes], deadline: float | None) -> None:
    """Write all buffers with ``sendmsg`` (gathered, partial writes handled) before ``deadline``.

    Raises:
        PeerDeadError: reset / broken pipe.
        DeadlineExceeded: the peer does not read fast enough.
    """
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    while views:
        try:
            sent = sock.sendmsg(views)
        except (BlockingIOError, InterruptedError):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded("peer is not reading (send timed out)") from None
            select.select([], [sock], [], remaining)
            continue
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, OSError) as e:
            raise PeerDeadError(f"send failed: {e}") from None
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


class _Reader:
    """Incremental, non-blocking reader of one message (header + payload) from a socket."""

    def __init__(self) -> None:
        self.hdr = bytearray(HDR.size)
        self.hdr_got = 0
        self.fields: tuple | None = None
        self.buf = torch.empty(1 << 16, dtype=torch.uint8)
        self.view = memoryview(self.buf.numpy())  # type: ignore[arg-type]
        self.need = 0
        self.got = 0

    def _ensure(self, n: int) -> None:
        if self.buf.numel() < n:
            size = max(n, 2 * self.buf.numel())
            self.buf = torch.empty(size, dtype=torch.uint8)
            self.view = memoryview(self.buf.numpy())  # type: ignore[arg-type]

    def feed(self, sock: socket.socket) -> tuple | None:
        """Read what is available. Returns ``(fields, payload_tensor_uint8)`` when a message is
        complete (payload aliases the reader's buffer until the next ``feed``), else None.

        Raises:
            PeerDeadError: EOF or reset.
            FrameError: bad magic or oversize payload.
        """
        while True:
            try:
                if self.fields is None:
                    r = sock.recv_into(memoryview(self.hdr)[self.hdr_got :])
                else:
                    if self.got >= self.need:
                        return self._done()
                    r = sock.recv_into(self.view[self.got : self.need])
            except (TimeoutError, BlockingIOError, InterruptedError):
                return None
            except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError, OSError) as e:
                raise PeerDeadError(f"connection lost: {e}") from None
            if r == 0:
                raise PeerDeadError("connection closed by peer")
            if self.fields is None:
                self.hdr_got += r
                if self.hdr_got == HDR.size:
                    f = HDR.unpack(self.hdr)
                    if f[0] != MAGIC:
                        raise FrameError(f"bad magic {f[0]!r}")
                    if f[10] > MAX_PAYLOAD:
                        raise FrameError(f"payload of {f[10]} bytes is too large")
                    self.fields = f
                    self.need = f[10]
                    self.got = 0
                    self._ensure(self.need)
                    if self.need == 0:
                        return self._done()
            else:
                self.got += r
                if self.got >= self.need:
                    return self._done()

    def _done(self) -> tuple:
        f = self.fields
        self.fields = None
        self.hdr_got = 0
        return f, self.buf[: self.need]


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class TcpClientConnection(SocketClientConnection):
    """Client end of a TCP connection to one expert server.

    Args:
        endpoint: ``tcp://host:port``.
        server_id: the server's id.
        hidden_size: ``H``.
        dtype: activation dtype of every frame (float32 or bfloat16).
        client_id: this attention client's id (default: pid).
        connect_timeout: seconds to connect and receive the hello ack.
        send_timeout: seconds a ``send`` may block on a full socket buffer.
        max_tokens, max_k, spin_us: accepted for signature compatibility with shm; unused.

    Raises (constructor): :class:`PeerDeadError` (refused/unreachable),
    :class:`DeadlineExceeded` (timeout), :class:`FrameError` (hello refused).

    One request in flight per connection. ``output`` of a response aliases the receive buffer:
    copy it before the next ``send``.
    """

    def __init__(
        self,
        endpoint: str,
        server_id: str,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        client_id: int | None = None,
        connect_timeout: float = 5.0,
        send_timeout: float = 5.0,
        max_tokens: int = 0,
        max_k: int = 0,
        spin_us: float = 0.0,
    ):
        self._init_common(endpoint, server_id, hidden_size, dtype, client_id)
        self.send_timeout = send_timeout
        self._reader = _Reader()
        host, port = parse_tcp(endpoint)
        if host == "0.0.0.0":
            host = "127.0.0.1"
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
        except TimeoutError:
            raise DeadlineExceeded(
                f"expert server {server_id} at {endpoint}: connect timed out"
            ) from None
        except OSError as e:
            raise PeerDeadError(
                f"expert server {server_id} at {endpoint}: connect failed: {e}"
            ) from None
        self._sock = sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            deadline = time.monotonic() + connect_timeout
            hello = HDR.pack(
                MAGIC,
                KIND_HELLO,
                self.client_id,
                0,
                0,
                0,
                0,
                0,
                self.hidden_size,
                DTYPE_CODES[dtype],
                0,
            )
            _sendall_vec(sock, [hello], deadline)
            f, payload = self._wait(deadline)
            if f[1] != KIND_ACK:
                raise FrameError(f"expert server {server_id}: expected hello ack, got kind {f[1]}")
            if f[7] != STATUS_OK:
                msg = bytes(payload.numpy()).decode("utf-8", "replace")
                raise FrameError(
                    f"expert server {server_id} at {endpoint} refused the connection: {msg}"
                )
        except BaseException:
            self.close()
            raise

    def _wait(self, deadline: float) -> tuple:
        sock = self._open_sock()
        while True:
            try:
                msg = self._reader.feed(sock)
            except PeerDeadError as e:
                raise PeerDeadError(f"{self._where()}: {e}") from None
            if msg is not None:
                return msg
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(f"{self._where()}: no response before the deadline")
            select.select([sock], [], [], remaining)

    def send(self, frame: RequestFrame, deadline: float | None = None) -> None:
        """Write ``frame`` (header + raw bytes).

        Args:
            frame: ``hidden`` ``[n, H]`` (or ``[T, H]`` with ``rows`` ``[n]``) in the connection
                dtype; ``experts``/``weights`` ``[n, k]`` (converted to int32 / float32).
            deadline: optional ``time.monotonic()`` bound for a blocked write (default now +
                ``send_timeout``).

        Raises:
            FrameError: bad shapes/dtype, too large, or a request already in flight.
            PeerDeadError: the server is gone.
            DeadlineExceeded: the server does not read (e.g. SIGSTOPped with full buffers).
        """
        sock = self._sock_for_send()
        h, rows, ex, w = check_request(frame, hidden_size=self.hidden_size, dtype=self.dtype)
        if rows is not None:
            h = h.index_select(0, rows)  # the one copy: gathered rows, sent from here
        n, k = int(h.shape[0]), int(ex.shape[1])
        payload = [_as_bytes(h), _as_bytes(ex), _as_bytes(w)]
        nbytes = sum(len(p) for p in payload)
        hdr = HDR.pack(
            MAGIC,
            KIND_REQ,
            self.client_id,
            frame.table_version,
            frame.seq,
            frame.layer,
            n,
            k,
            self.hidden_size,
            DTYPE_CODES[self.dtype],
            nbytes,
        )
        if deadline is None:
            deadline = time.monotonic() + self.send_timeout
        try:
            _sendall_vec(sock, [hdr, *payload], deadline)
        except PeerDeadError as e:
            raise PeerDeadError(f"{self._where()}: {e}") from None
        except DeadlineExceeded as e:
            raise DeadlineExceeded(f"{self._where()}: {e}") from None
        self._outstanding = True

    def recv(self, deadline: float) -> ResponseFrame:
        """Wait for the response until ``deadline`` (``time.monotonic()`` seconds).

        Returns:
            :class:`ResponseFrame`; ``output`` ``[n, H]`` aliases the receive buffer.

        Raises:
            PeerDeadError: EOF/reset. DeadlineExceeded: nothing complete by the deadline (partial
            data is kept; a later ``recv`` resumes). FrameError: no request in flight.
        """
        self._sock_for_recv()
        f, payload = self._wait(deadline)
        if f[1] != KIND_RESP:
            raise FrameError(f"expert server {self.server_id}: unexpected message kind {f[1]}")
        self._outstanding = False
        _, _, _, _, seq, layer, n, status, hidden, _, _ = f
        if status == STATUS_OK:
            out = payload[: n * hidden * _esize(self.dtype)].view(self.dtype).view(n, hidden)
            return ResponseFrame(seq=seq, layer=layer, status=status, output=out)
        msg = bytes(payload.numpy()).decode("utf-8", "replace")
        return ResponseFrame(seq=seq, layer=layer, status=status, output=None, message=msg)


class _TcpConn(ServerConn):
    __slots__ = ("reader", "pending", "outq", "out_deadline")

    def __init__(self, sock: socket.socket):
        super().__init__(sock)
        self.reader = _Reader()
        self.pending: tuple | None = None  # complete REQ not yet returned by poll
        self.outq: list[memoryview] = []  # response bytes the socket has not taken yet
        self.out_deadline = 0.0


class TcpServerListener(SocketServerListener[_TcpConn]):
    """Server end of the TCP transport.

    Args:
        endpoint: ``tcp://host:port``; port 0 binds a free port and :attr:`endpoint` is updated
            to the bound one.
        hidden_size, dtype: hellos with other values are refused.
        send_timeout: seconds a response write may take before the client is dropped.
        spin_us: accepted for compatibility; unused (blocking ``select`` only).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        send_timeout: float = 5.0,
        spin_us: float = 0.0,
    ):
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self.send_timeout = send_timeout
        host, port = parse_tcp(endpoint)
        lsock = socket.socket(
            socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM
        )
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind((host, port))
            lsock.listen(128)
        except BaseException:
            lsock.close()
            raise
        self.endpoint = f"tcp://{host}:{lsock.getsockname()[1]}"
        super().__init__(lsock)

    def _new_conn(self, sock: socket.socket) -> _TcpConn:
        return _TcpConn(sock)

    def _configure(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _send(self, conn: _TcpConn, bufs: Sequence[_Bytes]) -> bool:
        """Queue ``bufs`` and write what the socket takes now; the rest is flushed from ``poll``.
        Returns False (and drops ``conn``) when the client is gone."""
        was_empty = not conn.outq
        conn.outq.extend(memoryview(b).cast("B") for b in bufs if len(b))
        if was_empty:
            conn.out_deadline = time.monotonic() + self.send_timeout
        if not self._flush(conn):
            return False
        if conn.outq and was_empty:
            self._sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        return True

    def _flush(self, conn: _TcpConn) -> bool:
        q = conn.outq
        while q:
            try:
                sent = conn.sock.sendmsg(q)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                self._drop(conn)
                return False
            while sent and q:
                if sent >= len(q[0]):
                    sent -= len(q[0])
                    q.pop(0)
                else:
                    q[0] = q[0][sent:]
                    sent = 0
        return True

    def _on_writable(self, conn: _TcpConn) -> None:
        if self._flush(conn) and not conn.outq:
            self._sel.modify(conn.sock, selectors.EVENT_READ, conn)

    def _expire_writes(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if c.outq and now > c.out_deadline]:
            self._drop(conn)  # the client does not read its responses (stopped or wedged)

    def _read(self, conn: _TcpConn) -> None:
        if conn.in_flight or conn.pending is not None or conn.outq:
            return  # one request at a time; do not overwrite the buffer a frame/response aliases
        try:
            msg = conn.reader.feed(conn.sock)
        except (PeerDeadError, FrameError):
            self._drop(conn)
            return
        if msg is None:
            return
        f, payload = msg
        kind = f[1]
        if kind == KIND_HELLO and not conn.ready:
            conn.client_id = f[2]
            err = ""
            if f[8] != self.hidden_size:
                err = f"hidden size {f[8]} != server's {self.hidden_size}"
            elif CODE_DTYPES.get(f[9]) != self.dtype:
                err = f"dtype {CODE_DTYPES.get(f[9])} != server's {self.dtype}"
            m = err.encode()
            ack = HDR.pack(
                MAGIC, KIND_ACK, 0, 0, 0, 0, 0, STATUS_BAD_FRAME if err else STATUS_OK, 0, 0, len(m)
            )
            if self._send(conn, [ack, m]) and not err:
                conn.ready = True
            elif err:
                self._drop(conn)
            return
        if kind == KIND_REQ and conn.ready:
            conn.pending = msg
            return
        self._drop(conn)  # protocol violation

    def _collect(self) -> list[tuple[object, RequestFrame]]:
        out: list[tuple[object, RequestFrame]] = []
        for conn in list(self._conns.values()):
            if conn.pending is None:
                continue
            f, payload = conn.pending
            conn.pending = None
            conn.in_flight = True
            _, _, client_id, version, seq, layer, n, k, hidden, dcode, nbytes = f
            esz = _esize(self.dtype)
            hb = n * hidden * esz
            if (
                hidden != self.hidden_size
                or not (0 <= n <= MAX_TOKENS_HARD and 0 <= k <= MAX_K_HARD)
                or nbytes != hb + 8 * n * k
            ):
                self.respond(
                    conn,
                    ResponseFrame(seq, layer, STATUS_BAD_FRAME, None, f"bad frame n={n} k={k}"),
                )
                continue
            frame = RequestFrame(
                client_id=client_id,
                layer=layer,
                table_version=version,
                seq=seq,
                hidden=payload[:hb].view(self.dtype).view(n, hidden),
                experts=payload[hb : hb + 4 * n * k].view(torch.int32).view(n, k),
                weights=payload[hb + 4 * n * k : hb + 8 * n * k].view(torch.float32).view(n, k),
            )
            out.append((conn, frame))
        return out

    def poll(self, timeout: float | None) -> Sequence[tuple[object, RequestFrame]]:
        """Ready frames of all clients; blocks in ``select`` up to ``timeout`` s (None = forever).

        Tensors alias the connection's receive buffer until :meth:`respond` on that handle.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if any(c.outq for c in self._conns.values()):
                remaining = (
                    self.send_timeout if remaining is None else min(remaining, self.send_timeout)
                )
            for conn, events in self._select(remaining):
                if events & selectors.EVENT_WRITE and self._is_live(conn):
                    self._on_writable(conn)
                if events & selectors.EVENT_READ and self._is_live(conn):
                    self._read(conn)
            self._expire_writes()
            frames = self._collect()
            if frames or (deadline is not None and time.monotonic() >= deadline):
                return frames

    def respond(self, conn: object, frame: ResponseFrame) -> None:
        """Send ``frame`` on ``conn`` without blocking (unsent bytes are queued and flushed by
        ``poll``); a dead client is dropped. The output bytes are referenced, not copied, until
        sent: do not modify ``frame.output`` afterwards."""
        conn = self._own(conn)
        conn.in_flight = False
        if not self._is_live(conn):
            return
        if frame.status == STATUS_OK and frame.output is not None:
            out = frame.output
            if out.dtype != self.dtype:
                out = out.to(self.dtype)
            n, body = int(out.shape[0]), _as_bytes(out)
        else:
            n, body = 0, memoryview(frame.message.encode("utf-8"))
        hdr = HDR.pack(
            MAGIC,
            KIND_RESP,
            conn.client_id,
            0,
            frame.seq,
            frame.layer,
            n,
            frame.status,
            self.hidden_size,
            DTYPE_CODES[self.dtype],
            len(body),
        )
        self._send(conn, [hdr, body])
