"""Server end of the same-host shared-memory transport (``unix:PATH``): the listener.

:class:`ShmServerListener` accepts the attention clients' ``SOCK_SEQPACKET`` connections, maps
each client's memfd (hello / remap packets, :mod:`.shm_slots`), and gathers the ready frames of
all of them in :meth:`ShmServerListener.poll` (spin up to ``spin_us`` on the ready counters,
longer while frames come within a spin, then block in ``select``: an idle server costs ~0 CPU);
:meth:`ShmServerListener.respond` / :meth:`ShmServerListener.respond_ok` copy the output into
the response slot, store the done counter last and ring the doorbell only when the client
sleeps. The protocol (set-up, data path, doorbells, ordering, liveness) is described in
:mod:`eaas.runtime.transport.shm`, the client end.
"""

from __future__ import annotations

import errno
import mmap
import os
import socket
import stat
import struct
import time
from collections.abc import Sequence

import numpy as np
import torch

from eaas.runtime.transport.base import (
    STATUS_BAD_FRAME,
    STATUS_OK,
    FrameError,
    RequestFrame,
    ResponseFrame,
)
from eaas.runtime.transport.shm_slots import (
    ACK,
    DEFAULT_SPIN_US,
    DOORBELL,
    HELLO,
    KIND_ACK,
    KIND_HELLO,
    KIND_REMAP,
    MSG_BYTES,
    Slots,
    check_hello,
    fence,
    fence_acquire,
    fence_release,
    pack_resp,
    unix_path,
)
from eaas.runtime.transport.sockets import ServerConn, SocketServerListener

MAX_SERVER_SPIN_S = 5e-4  # a server spins past spin_us, up to this, when frames come this often
SOCKET_SERVICE_S = 1e-3  # a server busy with frames still reads its sockets this often


def _server_spin_s(spin_s: float, gap: float) -> float:
    """How long a server's ``poll`` spins before it blocks, seconds: ``spin_s``, or up to 1.5x
    ``gap`` (the moving average of recent waits for a frame) when that is at most
    ``MAX_SERVER_SPIN_S``: the next frame is due within a spin, and blocking would cost the
    client a doorbell and the server a wake-up (64 x 7168 bf16 frames back to back: 494 ->
    225 us per round trip). A server whose frames come further apart (an attention client's
    layers, ms apart) keeps ``spin_s``; ``spin_s`` 0 blocks at once."""
    if spin_s <= 0 or gap > MAX_SERVER_SPIN_S:
        return spin_s
    return max(spin_s, min(MAX_SERVER_SPIN_S, 1.5 * gap))


_yield = os.sched_yield  # spin politely: let the peer run when cores are oversubscribed
_monotonic = time.monotonic


class ShmServerConn(ServerConn):
    __slots__ = ("slots", "last_seen", "owner")

    def __init__(self, sock: socket.socket, owner: ShmServerListener):
        super().__init__(sock)
        # the mapped slots (and their RequestFrames, refilled per frame); None once dropped
        self.slots: Slots | None = None
        self.last_seen = 0
        self.owner = owner  # the listener that accepted it: respond checks it is the caller


class ShmServerListener(SocketServerListener[ShmServerConn]):
    """Server end of the shared-memory transport.

    Args:
        endpoint: ``unix:/path.sock``; a stale socket file at the path is replaced, a live one
            (some process accepts on it) raises ``OSError(EADDRINUSE)``.
        hidden_size: ``H``; hellos with another size are refused.
        dtype: activation dtype; hellos with another dtype are refused.
        spin_us: busy-poll time in ``poll`` before blocking, microseconds; longer, up to 1.5x
            the moving average of how long recent polls waited for a frame, when that average is
            at most ``MAX_SERVER_SPIN_S`` (a client that sends its next frame within a copy's
            time, e.g. 64 x 7168 bf16 frames back to back, then finds the server awake); 0:
            block at once.

    The path is unlinked by :meth:`close`.
    """

    _socket_path = staticmethod(unix_path)  # endpoint -> socket path (a subclass's scheme)

    def __init__(
        self,
        endpoint: str,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        spin_us: float = DEFAULT_SPIN_US,
    ):
        self.endpoint = endpoint
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self.spin_s = spin_us * 1e-6
        # moving average of how long poll waited for the next frame, seconds (adaptive spin)
        self._gap = 0.0
        # the last poll's wait, not yet in ``_gap``: the next poll adds it before it spins
        self._wait_seen: float | None = None
        self.path = self._socket_path(endpoint)
        self._remove_stale(self.path)
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, exist_ok=True)
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            lsock.bind(self.path)
            lsock.listen(128)
        except BaseException:
            lsock.close()
            raise
        self._owner_pid = os.getpid()
        self._service_due = 0.0  # time.monotonic() by which poll reads the sockets again
        super().__init__(lsock)

    @staticmethod
    def _remove_stale(path: str) -> None:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):  # a regular file or a directory: never deleted
            raise OSError(errno.EEXIST, f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.settimeout(0.5)
            probe.connect(path)
        except (TimeoutError, ConnectionRefusedError, FileNotFoundError, OSError):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return
        finally:
            probe.close()
        raise OSError(errno.EADDRINUSE, f"another expert server is listening on {path}")

    # -- connections --------------------------------------------------------------------
    def _new_conn(self, sock: socket.socket) -> ShmServerConn:
        return ShmServerConn(sock, self)

    def _release(self, conn: ShmServerConn) -> None:
        if conn.slots is not None:  # (its frames' views alias the slot: released with it)
            conn.slots.release()
            conn.slots = None

    def _ack(self, conn: ShmServerConn, status: int, msg: str) -> bool:
        try:
            conn.sock.send(ACK.pack(KIND_ACK, status) + msg.encode()[:2000])
            return True
        except OSError:
            return False

    def _on_map(self, conn: ShmServerConn, data: bytes, fds: list[int]) -> None:
        try:
            if len(fds) != 1 or len(data) < HELLO.size:
                raise FrameError("hello/remap packet without exactly one fd")
            kind, client_id, hidden, dcode, cap_t, cap_k = HELLO.unpack_from(data)
            dtype = check_hello(
                hidden, dcode, cap_t, cap_k, hidden_size=self.hidden_size, dtype=self.dtype
            )
            _, _, total = Slots.layout(hidden, dtype, cap_t, cap_k)
            if os.fstat(fds[0]).st_size < total:
                raise FrameError("shared slot smaller than announced")
            mm = mmap.mmap(fds[0], total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            slots = Slots(mm, hidden, dtype, cap_t, cap_k)
        except (FrameError, OSError, ValueError, struct.error) as e:
            for fd in fds:
                os.close(fd)
            self._refuse(conn, e)
            return
        for fd in fds:
            os.close(fd)
        self._install(conn, slots, client_id, kind)

    def _refuse(self, conn: ShmServerConn, error: Exception) -> None:
        """A hello / remap that cannot be mapped: a hello is answered with ``error``; the
        connection is dropped either way."""
        if not conn.ready:
            self._ack(conn, STATUS_BAD_FRAME, str(error))
        self._drop(conn)

    def _install(self, conn: ShmServerConn, slots: Slots, client_id: int, kind: bytes) -> None:
        """Make ``slots`` (mapped from a hello / remap packet of ``kind``) ``conn``'s current
        slots, releasing the previous ones; a hello is acked (the connection is ready)."""
        if conn.slots is not None:
            conn.slots.release()
        conn.slots = slots
        conn.client_id = client_id
        # A fresh mapping reads 0 until the client's first frame in it (its counter is >= 1);
        # the frame may already be there, so do NOT read the current counter here.
        conn.last_seen = 0
        if kind == KIND_HELLO:
            conn.ready = True
            if not self._ack(conn, STATUS_OK, ""):
                self._drop(conn)

    def _read(self, conn: ShmServerConn) -> None:
        """Drain every pending packet of ``conn`` (doorbells, hello, remap); drop it on EOF."""
        while True:
            try:
                data, fds, _flags, _ = socket.recv_fds(conn.sock, 256, 4)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(conn)
                return
            if not data:
                for fd in fds:
                    os.close(fd)
                self._drop(conn)
                return
            kind = data[:1]
            if kind == DOORBELL and not fds:
                continue
            if kind in (KIND_HELLO, KIND_REMAP):
                self._on_map(conn, data, fds)
                if not self._is_live(conn):
                    return
                continue
            for fd in fds:
                os.close(fd)
            self._drop(conn)  # protocol violation
            return

    # -- data path ----------------------------------------------------------------------
    def _collect(self) -> list[tuple[object, RequestFrame]]:
        """Every connection's new frame (its ready counter moved) as ``(conn, frame)``."""
        out: list[tuple[object, RequestFrame]] = []
        for conn in self._conns.values():
            s = conn.slots
            if s is None or conn.in_flight or not conn.ready:
                continue
            hdr = s.req_q
            c = hdr[0]
            if c == conn.last_seen:
                continue
            conn.last_seen = c
            conn.in_flight = True
            _, layer, version, n, k, client_id, seq, _ = hdr.tolist()  # one read of the header
            f = s.req_frames.get((n, k))  # a hit: a size this slot has served before
            if f is None:
                if not (0 <= n <= s.cap_tokens and 0 <= k <= s.cap_k):
                    self.respond(
                        conn,
                        ResponseFrame(
                            seq, layer, STATUS_BAD_FRAME, None, f"bad frame size n={n} k={k}"
                        ),
                    )
                    continue
                f = s.req_frame(n, k)
            # refill the size's frame (its views are set): no allocation per frame
            f.client_id, f.layer, f.table_version, f.seq = client_id, layer, version, seq
            out.append((conn, f))
        return out

    def poll(self, timeout: float | None) -> Sequence[tuple[object, RequestFrame]]:
        """Ready frames of all clients: spin ``spin_us``, then block up to ``timeout`` seconds.

        ``timeout=0`` checks once without blocking. Returned tensors alias the client's slot and
        stay valid until :meth:`respond` on that handle (the frame object is the connection's
        own, refilled for its next frame). A connection with a frame in flight is not polled
        again until it is answered. The sockets (new connections, remaps, closed clients) are
        read whenever ``poll`` blocks and at least every ``SOCKET_SERVICE_S`` while frames keep
        coming, so a busy server never starves a connecting or remapping client.
        """
        w = self._wait_seen
        if w is not None:  # the last poll's wait, folded in here: off the last frame's path
            self._wait_seen = None
            self._note_wait(w)
        now = start = _monotonic()
        if now >= self._service_due:
            self._service_sockets(now)
        frames = self._collect()
        if frames:
            if timeout != 0:
                self._wait_seen = 0.0  # a frame was waiting
            return frames
        deadline = None if timeout is None else now + timeout
        spin = _server_spin_s(self.spin_s, self._gap)
        spin_end = now + (spin if timeout is None else min(spin, timeout))
        # spin on the ready counters alone (a frame arrives only in the current slots, and the
        # slots change only when the sockets are read, which the spin does not do)
        watch = self._watch_list()
        while watch and now < spin_end:
            for q, last in watch:
                if q[0] != last:
                    frames = self._collect()
                    if frames:
                        self._wait_seen = now - start
                        return frames
                    watch = self._watch_list()  # (a bad frame, answered at once)
                    break
            _yield()
            now = _monotonic()
        try:
            while True:
                self._set_waiting(1)  # clients ring the doorbell from now on
                fence()
                frames = self._collect()
                if frames:
                    break
                remaining = None if deadline is None else max(0.0, deadline - _monotonic())
                ready = self._select(remaining)
                # frames first: a doorbell left unread wakes the next select, which drains it
                frames = self._collect()
                if frames:
                    break
                for conn, _ in ready:
                    if self._is_live(conn):
                        self._read(conn)
                self._service_due = _monotonic() + SOCKET_SERVICE_S
                frames = self._collect()
                if frames or (deadline is not None and _monotonic() >= deadline):
                    break
        finally:
            self._set_waiting(0)
        if timeout != 0:  # (the wait for the next frame, or a timeout with none: long)
            self._wait_seen = _monotonic() - start
        return frames

    def _note_wait(self, seconds: float) -> None:
        """One ``poll``'s wait for a frame into the moving average the spin follows
        (:func:`_server_spin_s`); batch-gathering polls (``timeout=0``) are not waits. A poll
        leaves its wait in ``_wait_seen`` and the next poll adds it here before it computes its
        spin: the same average when it is used, and no call between a frame's arrival and its
        return to the caller."""
        self._gap = 0.75 * self._gap + 0.25 * seconds

    def _watch_list(self) -> list[tuple[memoryview, int]]:
        """``(request header, last seen counter)`` of every connection that may send a frame."""
        return [
            (c.slots.req_q, c.last_seen)
            for c in self._conns.values()
            if c.slots is not None and c.ready and not c.in_flight
        ]

    def _service_sockets(self, now: float) -> None:
        """Read every readable socket without blocking: accept, hello / remap, EOF, doorbells."""
        self._service_due = now + SOCKET_SERVICE_S
        for conn, _ in self._select(0):
            if self._is_live(conn):
                self._read(conn)

    def _set_waiting(self, flag: int) -> None:
        """Set the server-waiting flag in every connection's request header."""
        for conn in self._conns.values():
            if conn.slots is not None:
                conn.slots.req_q[7] = flag

    def respond(self, conn: object, frame: ResponseFrame) -> None:
        """Copy ``frame`` into ``conn``'s response slot, set the done counter, ring the doorbell.

        ``frame.output``: ``[n, H]`` in the connection dtype (ignored unless status is OK).
        A dead or vanished client is dropped silently.
        """
        if frame.status == STATUS_OK and frame.output is not None:
            self.respond_ok(conn, frame, frame.output)  # (reads .seq and .layer of either)
            return
        # TypeError (from _own) for a handle that is no connection at all
        c = conn if isinstance(conn, ShmServerConn) else self._own(conn)
        s = c.slots
        if s is None or self._conns.get(c.fileno) is not c:
            return  # dropped (dead client) or not ours
        self._answer_status(c, s, frame.layer, frame.seq, frame.status, frame.message)

    def respond_ok(
        self, conn: object, request: RequestFrame | ResponseFrame, output: torch.Tensor
    ) -> None:
        """:meth:`respond` with ``STATUS_OK`` and ``output`` ``[n, H]`` without a
        :class:`ResponseFrame` (``request``: the frame answered, or the ``ResponseFrame`` that
        :meth:`respond` got; only its ``seq`` and ``layer`` are read): copy the output into the
        response slot, store the header fields and the done counter, ring the doorbell only if
        the client waits. An output that does not fit the slot (more rows, another hidden size)
        answers ``STATUS_BAD_FRAME`` instead."""
        c = conn if isinstance(conn, ShmServerConn) else self._own(conn)
        s = c.slots
        if s is None or c.owner is not self:
            return  # dropped (a dead client's slots are released) or another listener's
        n = output.shape[0]
        if n:
            v = s.resp_views.get(n)
            if v is None:
                v = s.resp_view(n)
            try:
                v.copy_(output)
            except RuntimeError as e:  # wrong shape or more rows than the slot holds
                msg = f"server output {tuple(output.shape)} does not fit the response: {e}"
                self._answer_status(c, s, request.layer, request.seq, STATUS_BAD_FRAME, msg)
                return
            if not s.sync_free:
                s.sync()  # payload before flag (a device payload)
        hdr = s.resp_q
        # header fields [1..5] in one store (one cache-line transfer to the spinning client)
        pack_resp(hdr, 8, request.layer, STATUS_OK, n, 0, request.seq)
        hdr[0] = c.last_seen  # written last: done flag, echoes the request counter
        c.in_flight = False
        self._ring_if_waiting(c, hdr)

    def _answer_status(
        self, c: ShmServerConn, s: Slots, layer: int, seq: int, status: int, message: str
    ) -> None:
        """An answer without output rows: ``status`` and the utf-8 ``message``."""
        ln = self._message(s, message) if message else 0
        hdr = s.resp_q
        pack_resp(hdr, 8, layer, status, 0, ln, seq)
        hdr[0] = c.last_seen  # written last
        c.in_flight = False
        self._ring_if_waiting(c, hdr)

    def _ring_if_waiting(self, c: ShmServerConn, hdr: memoryview) -> None:
        """After the done counter store in response header ``hdr``: ring ``c``'s doorbell if
        its client blocks (store-load fence first); drop ``c`` if its socket is gone."""
        fence_acquire()
        fence_release()
        if not hdr[7]:
            return  # the client is spinning: no doorbell needed
        try:
            c.sock.send(DOORBELL)
        except (BlockingIOError, InterruptedError):
            pass  # client has unread doorbells; it will wake
        except OSError:
            self._drop(c)

    @staticmethod
    def _message(s: Slots, text: str) -> int:
        """Write an error message (utf-8, cut at ``MSG_BYTES``) into the response slot;
        returns its length in bytes."""
        raw = text.encode("utf-8")[:MSG_BYTES]
        s.resp_msg[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        return len(raw)

    def _after_close(self) -> None:
        if os.getpid() == self._owner_pid:  # a forked child must not unlink its parent's path
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
