"""Same-host transport: request/response slots in shared memory, a Unix socket as doorbell.

Endpoint: ``unix:/path/to/server.sock``.

Connection set-up
-----------------
The server listens on a ``SOCK_SEQPACKET`` Unix socket (message boundaries kept, EOF on peer
death). The client creates one anonymous ``memfd`` (``os.memfd_create``) holding its request
slot and its response slot, maps it, and sends a *hello* packet carrying the fd (SCM_RIGHTS)
plus ``client_id``, ``hidden_size``, dtype and the slot capacity (tokens, k). The server maps the
same fd and answers an *ack* packet (status + message; a wrong hidden size or dtype is refused
here). No named ``/dev/shm`` object ever exists: the memory goes away when the last process
holding a mapping exits, even on SIGKILL.

Slot layout
-----------
One memfd holds the request region (header, hidden, experts, weights) and the response region
(header, message, output): :mod:`.shm_slots` (public, shared with :mod:`.cuda_ipc`). This
module is the client end (:class:`ShmClientConnection`); the server end is
:class:`~eaas.runtime.transport.shm_server.ShmServerListener`, re-exported here so that
``unix:`` names one module for both ends (the factory, ``bench/transport_bench.py --ref-shm``).

Data path
---------
Client ``send``: copy tensors into the request slot (the hidden rows once: a frame with ``rows``
is gathered straight from the caller's batch into the slot), write header fields, write the ready counter
(a fresh per-connection counter, not the caller's seq), then send one doorbell packet ``b"D"``
(``send_deferred`` leaves the doorbell to ``ring``, so a caller writes the frames of all its
servers before waking any).
Server ``poll``: spin up to ``spin_us`` reading every connection's ready counter; then block in
``select`` on all sockets (idle server: ~0 CPU). Server ``respond``: copy the output into the
response slot, write the done counter last, send a doorbell. Client ``recv``: spin (at least
``spin_us``, up to 1.5x the moving average of recent round trips, at most 2 ms; only ``spin_us``
while this process's requests in flight and the client itself outnumber its CPUs, as the spin
would take a core from a server it waits on), then block on the socket until the done counter
matches or the deadline passes.

Frames larger than the slot: ``send`` transparently grows the slot. It creates a new memfd sized
for the frame (capacity at least doubled), sends it in a *remap* packet (same format as hello),
and then writes the frame into the new slot; the server switches mappings when it reads the
remap packet, which always precedes the doorbell. So callers never chunk. Hard cap:
``MAX_TOKENS_HARD`` tokens per frame (:class:`FrameError` above it).

Doorbells only when the peer sleeps: a side about to block in ``select`` first sets its
*waiting* flag, fences, and checks the counter once more; a writer stores the counter, fences,
and sends the doorbell only if the peer's waiting flag is set (Dekker-style; the fence is an
uncontended lock, a locked instruction = full barrier on x86). A ping-pong within the spin
windows therefore costs no syscall at all.

Ordering: payload stores happen before the counter store and x86 keeps stores (and loads) in
order, so a reader that sees the new counter sees the payload. Other CPU architectures would
need explicit fences here. The blocking path goes through a syscall (full barrier) anyway.

Liveness: EOF / ECONNRESET / EPIPE on the socket means the peer is gone. The client raises
:class:`PeerDeadError`; the server drops that connection and keeps serving the others.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
import weakref

import torch

from eaas.runtime.transport.base import (
    DTYPE_CODES,
    MAX_TOKENS_HARD,
    STATUS_OK,
    DeadlineExceeded,
    FrameError,
    PeerDeadError,
    RequestFrame,
    ResponseFrame,
    check_request,
    parts_frame,
)
from eaas.runtime.transport.shm_server import ShmServerListener
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
    fence,
    fence_acquire,
    fence_release,
    new_memfd_slots,
    pack_req,
    unix_path,
)
from eaas.runtime.transport.sockets import SocketClientConnection

__all__ = ["DEFAULT_SPIN_US", "MAX_ADAPTIVE_SPIN_S", "ShmClientConnection", "ShmServerListener"]

MAX_ADAPTIVE_SPIN_S = 2e-3  # the client never spins longer than this for one response


# every open client connection of this process, for _cores_to_spin (added on the dispatcher's
# connector thread while the engine thread may walk it: both under the lock)
_LIVE_CLIENTS: weakref.WeakSet[ShmClientConnection] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()
_CORES = len(os.sched_getaffinity(0))  # CPUs this process may run on


def _register(conn: ShmClientConnection) -> None:
    """Count ``conn`` in :func:`_cores_to_spin` while it lives."""
    with _LIVE_LOCK:
        _LIVE_CLIENTS.add(conn)


def _cores_to_spin() -> bool:
    """Whether a client that spins while it waits still leaves a core to every expert server it
    waits on: this process's requests in flight (each an expert server of this host working or
    about to) plus the spinning client itself fit on the CPUs it may use. When they do not (two
    servers per MoE layer on a 2-core host), the spin takes a core from a server it waits on:
    on W2 here the adaptive spin cost ~2 s of client CPU per 6 s run and ~10% of the output
    tokens/s (``docs/serving.md``)."""
    if len(_LIVE_CLIENTS) < _CORES:
        return True
    with _LIVE_LOCK:
        return sum(1 for c in _LIVE_CLIENTS if c._outstanding) < _CORES


_yield = os.sched_yield  # spin politely: let the peer run when cores are oversubscribed
_monotonic = time.monotonic
_MAX_PLANS = 256  # validated frame shapes remembered per connection (cleared when full)


class ShmClientConnection(SocketClientConnection):
    """Client end of a shared-memory connection to one expert server.

    Args:
        endpoint: ``unix:/path.sock``.
        server_id: the server's id (kept for error messages and the dispatcher).
        hidden_size: ``H``.
        dtype: activation dtype of every frame on this connection (float32 or bfloat16).
        client_id: this attention client's id (default: pid).
        max_tokens: initial slot capacity in tokens (grown on demand, see module doc).
        max_k: initial expert entries per token capacity (grown on demand).
        spin_us: least busy-poll time before blocking in ``recv``, microseconds (longer, up to
            ``max_spin_us``, when recent round trips took longer).
        connect_timeout: seconds to connect and get the server's ack.
        max_spin_us: longest adaptive spin, microseconds (default ``MAX_ADAPTIVE_SPIN_S``);
            ``spin_us=0, max_spin_us=0`` blocks at once (no busy-poll at all).

    Raises:
        PeerDeadError: nothing listens at the path, or the server closed during the hello.
        FrameError: the server refused the hello (hidden size / dtype mismatch).
        DeadlineExceeded: no ack within ``connect_timeout``.

    One request in flight per connection: ``send`` raises :class:`FrameError` while the previous
    response has not been received. The ``output`` of a returned :class:`ResponseFrame` aliases
    the response slot: copy it before the next ``send``.
    """

    _socket_path = staticmethod(unix_path)  # endpoint -> socket path (a subclass's scheme)

    def __init__(
        self,
        endpoint: str,
        server_id: str,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        client_id: int | None = None,
        max_tokens: int = 256,
        max_k: int = 8,
        spin_us: float = DEFAULT_SPIN_US,
        connect_timeout: float = 5.0,
        max_spin_us: float | None = None,
    ):
        self._init_common(endpoint, server_id, hidden_size, dtype, client_id)
        self.spin_s = spin_us * 1e-6
        # longest adaptive spin per response; 0 with spin_us 0: block at once (oversubscribed
        # cores, where a spinning client takes CPU from the servers it waits for)
        self.max_spin_s = MAX_ADAPTIVE_SPIN_S if max_spin_us is None else max_spin_us * 1e-6
        self._rtt = 0.0  # moving average of recent round trips, seconds (adaptive spin)
        self._rt_seen: float | None = None  # the last wait's round trip, not yet in ``_rtt``
        self._sent_at = 0.0
        self._counter = 0
        self._ring_due = False  # a send_deferred frame whose doorbell is not rung yet
        self._slots: Slots | None = None
        # validated frame shapes -> slot views, for the mapping ``_plan_slots`` (see _plan)
        self._plans: dict[tuple, tuple] = {}
        self._plan_slots: Slots | None = None
        self._sent: tuple = ()  # the plan (see _plan) of the frame in flight
        self._resp_frame = ResponseFrame(0, 0, STATUS_OK, None)  # what recv returns, refilled
        path = self._socket_path(endpoint)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock = sock
        deadline = time.monotonic() + connect_timeout
        try:
            sock.settimeout(connect_timeout)
            try:
                sock.connect(path)
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError) as e:
                raise PeerDeadError(
                    f"expert server {server_id} at {endpoint}: connect failed: {e}"
                ) from None
            except TimeoutError:
                raise DeadlineExceeded(
                    f"expert server {server_id} at {endpoint}: connect timed out"
                ) from None
            self._map(max(1, int(max_tokens)), max(1, int(max_k)), KIND_HELLO)
            status, msg = self._wait_ack(deadline)
            if status != STATUS_OK:
                raise FrameError(
                    f"expert server {server_id} at {endpoint} refused the connection: {msg}"
                )
            sock.setblocking(False)
        except BaseException:
            self.close()
            raise
        _register(self)

    def _slots_now(self) -> Slots:
        if self._slots is None:
            raise PeerDeadError(f"connection to {self.server_id} is closed")
        return self._slots

    def _release_client(self) -> None:
        self._plans, self._plan_slots, self._sent = {}, None, ()  # drop views: unmap now
        self._resp_frame.output = None
        if self._slots is not None:
            self._slots.release()
            self._slots = None

    # -- set-up -------------------------------------------------------------------------
    def _map(self, cap_tokens: int, cap_k: int, kind: bytes) -> None:
        fd, slots = new_memfd_slots(self.hidden_size, self.dtype, cap_tokens, cap_k)
        try:
            pkt = HELLO.pack(
                kind, self.client_id, self.hidden_size, DTYPE_CODES[self.dtype], cap_tokens, cap_k
            )
            try:
                socket.send_fds(self._open_sock(), [pkt], [fd])
            except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError) as e:
                slots.release()
                raise PeerDeadError(
                    f"expert server {self.server_id} at {self.endpoint} is gone: {e}"
                ) from None
            except BlockingIOError:
                slots.release()
                raise PeerDeadError(
                    f"expert server {self.server_id}: socket full during remap"
                ) from None
        finally:
            os.close(fd)
        if self._slots is not None:
            self._slots.release()
        self._slots = slots

    def _wait_ack(self, deadline: float) -> tuple[int, str]:
        sock = self._open_sock()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(
                    f"expert server {self.server_id} at {self.endpoint}: no hello ack"
                )
            sock.settimeout(remaining)
            try:
                data = sock.recv(4096)
            except TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError) as e:
                raise PeerDeadError(f"expert server {self.server_id}: {e}") from None
            if not data:
                raise PeerDeadError(
                    f"expert server {self.server_id} at {self.endpoint} closed during hello"
                )
            if data[:1] == KIND_ACK:
                _, status = ACK.unpack_from(data)
                return status, data[ACK.size :].decode("utf-8", "replace")

    # -- data path ----------------------------------------------------------------------
    def send(self, frame: RequestFrame, deadline: float | None = None) -> None:
        """Write ``frame`` into the request slot and ring the doorbell (never blocks;
        ``deadline`` is accepted for interface compatibility). :meth:`send_deferred` writes
        without the doorbell, :meth:`ring` then rings it.

        Args:
            frame: ``hidden`` ``[n, H]`` (or ``[T, H]`` with ``rows`` ``[n]`` int64, gathered
                straight into the slot) in this connection's dtype; ``experts`` ``[n, k]`` int
                (any int dtype, converted to int32 by the copy into the slot); ``weights``
                ``[n, k]`` float (converted to float32 the same way).

        Raises:
            FrameError: wrong shapes/dtype, ``n`` above ``MAX_TOKENS_HARD``, or a request still
                in flight on this connection.
            PeerDeadError: the server is gone.

        Per frame this is one dictionary look-up of the frame's shapes (validated by
        :func:`~eaas.runtime.transport.base.check_request` the first time a shape is seen on
        the current slot, together with its slot views: the frame's *plan*), one copy per
        tensor into the slot, one store of the header fields and the counter store; after the
        counter store (off the round trip's critical path) the bookkeeping and a fence.
        """
        self._send(frame, True)

    def send_deferred(self, frame: RequestFrame) -> None:
        """:meth:`send` without the doorbell: the server sees the frame when it polls (it may
        be spinning or busy), else when :meth:`ring` (or :meth:`recv`) wakes it. Raises as
        :meth:`send`."""
        self._send(frame, False)

    def ring(self) -> None:
        """Ring the doorbell of a frame written by :meth:`send_deferred` if the server sleeps
        (a fence and a flag read when it does not). Raises PeerDeadError."""
        if self._ring_due:
            self._ring_due = False
            if self._sock is None or not self._sent:
                raise PeerDeadError(f"connection to {self.server_id} is closed")
            self._doorbell(self._sent[1])

    def send_parts(
        self,
        client_id: int,
        layer: int,
        table_version: int,
        seq: int,
        hidden: torch.Tensor,
        experts: torch.Tensor,
        weights: torch.Tensor,
        rows: torch.Tensor | None,
        n: int,
        k: int,
        ring: bool = True,
    ) -> None:
        """:meth:`send` (``ring``) or :meth:`send_deferred` of a frame given as its fields, for
        a caller that built the tensors to the frame's shapes (the dispatcher): the frame's
        plan is found by ``(n, k)`` (two ints, instead of three tensor shapes), and no
        :class:`RequestFrame` is built. The first frame of each ``(n, k)`` on a slot is
        validated as :meth:`send` validates every new shape; later ones are not.

        Args: as :class:`RequestFrame`, plus ``n`` (tokens: ``rows.shape[0]``, or
        ``hidden.shape[0]`` when ``rows`` is None) and ``k`` (``experts.shape[1]``). The caller
        guarantees ``hidden`` ``[T, H]`` in the connection's dtype, ``rows`` ``[n]`` int64 or
        None, ``experts`` ``[n, k]`` int32 and ``weights`` ``[n, k]`` float32, all on the CPU;
        other tensors may raise ``RuntimeError`` or be converted (or broadcast) by the copies.
        Checked for every frame: a ``rows`` frame's ``hidden`` width (a gather of another width
        would reshape the slot's cached view).

        Raises: as :meth:`send` (FrameError also when the tensors of an ``(n, k)``'s first frame
        disagree with it, see :func:`~eaas.runtime.transport.base.parts_frame`).
        """
        if self._outstanding or self._sock is None:
            self._sock_for_send()  # raises FrameError (in flight) / PeerDeadError (closed)
        plan = self._plans.get((n, k, rows is None))
        if plan is None or plan[0] is not self._slots:
            f = parts_frame(
                client_id, layer, table_version, seq, hidden, experts, weights, rows, n, k
            )
            plan = self._plan(f, (n, k, rows is None))
        elif rows is not None and hidden.shape[1] != self.hidden_size:
            # (a gather into the slot's view would reshape that view for every later frame)
            raise FrameError(f"hidden must be [T, {self.hidden_size}], got {tuple(hidden.shape)}")
        self._write(plan, hidden, experts, weights, rows, layer, table_version, seq, ring)

    def _send(self, frame: RequestFrame, ring: bool) -> None:
        """:meth:`send` (``ring``) / :meth:`send_deferred`."""
        if self._outstanding or self._sock is None:
            self._sock_for_send()  # raises FrameError (in flight) / PeerDeadError (closed)
        h = frame.hidden
        ex = frame.experts
        w = frame.weights
        rows = frame.rows
        key = (
            (h.shape, ex.shape, w.shape, h.dtype)
            if rows is None
            else (h.shape, ex.shape, w.shape, h.dtype, rows.shape, rows.dtype)
        )
        plan = self._plans.get(key)
        if plan is None or plan[0] is not self._slots:
            plan = self._plan(frame, key)
        self._write(plan, h, ex, w, rows, frame.layer, frame.table_version, frame.seq, ring)

    def _write(
        self,
        plan: tuple,
        h: torch.Tensor,
        ex: torch.Tensor,
        w: torch.Tensor,
        rows: torch.Tensor | None,
        layer: int,
        table_version: int,
        seq: int,
        ring: bool,
    ) -> None:
        """Write a frame by its plan (see :meth:`_plan`): the copies, the header, the counter
        store; then the bookkeeping and (``ring``) the doorbell."""
        _, hdr, _, n, k, vh, copy_ex, copy_w, sync, _, cid = plan
        if n:
            # the one copy of the hidden states: straight from the caller's tensor into the slot
            if rows is None:
                vh.copy_(h)
            else:
                torch.index_select(h, 0, rows, out=vh)
            copy_ex(ex)
            copy_w(w)
            if sync is not None:
                sync()  # payload before flag (a device payload; host memory needs nothing)
        # header fields [1..6] in one store (one cache-line transfer to the polling server)
        pack_req(hdr, 8, layer, table_version, n, k, cid, seq)
        self._counter = c = self._counter + 1
        hdr[0] = c  # written last: the ready flag
        # -- the server may run from here on: bookkeeping below is off the critical path --
        self._sent = plan
        self._outstanding = True
        self._sent_at = _monotonic()
        self._ring_due = not ring
        if ring:
            self._doorbell(hdr)

    def _doorbell(self, hdr: memoryview) -> None:
        """After the counter store in request header ``hdr``: wake the server if it sleeps."""
        fence_acquire()  # store-load fence between the counter store and the waiting-flag load
        fence_release()
        if not hdr[7]:
            return  # the server is spinning or busy: it will see the counter without a doorbell
        try:
            self._open_sock().send(DOORBELL)
        except BlockingIOError:
            pass  # the server has unread doorbells queued already; it will wake anyway
        except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError) as e:
            self._outstanding = False
            raise PeerDeadError(
                f"expert server {self.server_id} at {self.endpoint} is gone: {e}"
            ) from None

    def _plan(self, frame: RequestFrame, key: tuple) -> tuple:
        """Validate a frame shape not seen on the current slot, grow the slot if needed, and
        remember its plan under ``key``: ``(slots, request header, response header, n, k,
        hidden view [n, H], experts view .copy_, weights view .copy_, slots.sync or None,
        output view [n, H], client id)`` (the experts / weights views have the caller's
        shapes, ``[n, k]`` or ``[n]``). Raises FrameError (shapes / dtype / limits) or
        PeerDeadError."""
        _, rows, ex, _ = check_request(frame, hidden_size=self.hidden_size, dtype=self.dtype)
        n = int(frame.hidden.shape[0]) if rows is None else int(rows.shape[0])
        k = int(ex.shape[1])
        s = self._slots_now()
        if n > s.cap_tokens or k > s.cap_k:
            cap_t = s.cap_tokens
            while cap_t < n:
                cap_t *= 2
            self._map(min(cap_t, MAX_TOKENS_HARD), max(k, s.cap_k), KIND_REMAP)
            s = self._slots_now()
        if s is not self._plan_slots or len(self._plans) >= _MAX_PLANS:
            self._plans, self._plan_slots = {}, s  # a new mapping: the old views are stale
        vh, ve, vw = s.req_views(n, k)
        sync = None if s.sync_free else s.sync  # host memory: no call at all
        plan = (
            s,
            s.req_q,
            s.resp_q,
            n,
            k,
            vh,
            ve.view(frame.experts.shape).copy_,
            vw.view(frame.weights.shape).copy_,
            sync,
            s.resp_view(n),
            self.client_id,
        )
        self._plans[key] = plan
        return plan

    def _drain(self) -> None:
        """Read pending doorbells; raise PeerDeadError on EOF/reset."""
        sock = self._open_sock()
        while True:
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                return
            except (ConnectionResetError, BrokenPipeError) as e:
                raise PeerDeadError(
                    f"expert server {self.server_id} at {self.endpoint} died: {e}"
                ) from None
            if not data:
                raise PeerDeadError(
                    f"expert server {self.server_id} at {self.endpoint} closed the connection"
                )

    def recv(self, deadline: float) -> ResponseFrame:
        """Wait for the response to the last ``send`` until ``deadline`` (``time.monotonic()``).

        Returns:
            :class:`ResponseFrame` (the connection's own, refilled by the next ``recv``);
            ``output`` ``[n, H]`` aliases the response slot.

        Raises:
            PeerDeadError: the server died / closed (detected via socket EOF, typically < 1 ms).
            DeadlineExceeded: no response by ``deadline``; the request stays in flight (a later
                ``recv`` may still get it); ``close`` the connection to abandon it.
            FrameError: no request in flight.
        """
        if not self._outstanding or self._sock is None:
            self._sock_for_recv()  # raises FrameError (nothing in flight) / PeerDeadError
        if self._ring_due:  # a send_deferred frame nobody rang: ring now, never hang
            self.ring()
        plan = self._sent  # the in-flight frame's plan (its slots are the current ones)
        hdr = plan[2]
        if hdr[0] != self._counter:
            self._wait(deadline)  # PeerDeadError / DeadlineExceeded
        self._outstanding = False
        r = self._resp_frame  # refilled for every response: no allocation per frame
        _, r.layer, status, n, ln, r.seq, _, _ = hdr.tolist()  # one read of the header
        r.status = status
        if status == STATUS_OK:
            r.output = plan[9] if n == plan[3] else plan[0].resp_view(n)
            r.message = ""
        else:
            r.output = None
            r.message = bytes(plan[0].resp_msg[: min(ln, MSG_BYTES)]).decode("utf-8", "replace")
        return r

    def _wait(self, deadline: float) -> None:
        """Until the response header's done counter equals the request counter: spin at least
        ``spin_us`` and up to 1.5x the recent round trip (large frames take longer than
        ``spin_us`` to copy both ways; blocking then costs a doorbell and a wake-up), at most
        ``MAX_ADAPTIVE_SPIN_S``, but only ``spin_us`` when the CPUs cannot hold the spinning
        client beside the servers it waits on (:func:`_cores_to_spin`); then set the
        client-waiting flag and block on the socket.

        Raises PeerDeadError (EOF / reset, connection closed) or DeadlineExceeded."""
        sock = self._open_sock()
        hdr = self._slots_now().resp_q
        want = self._counter
        rt = self._rt_seen
        if rt is not None:  # the last wait's round trip, folded in here: off its response's path
            self._rt_seen = None
            self._rtt = 0.75 * self._rtt + 0.25 * rt
        now = _monotonic()
        spin = self.spin_s
        if self.max_spin_s > spin and _cores_to_spin():
            spin = max(spin, min(self.max_spin_s, 1.5 * self._rtt))
        spin_end = min(now + spin, deadline)
        while now < spin_end:
            if hdr[0] == want:
                # the round trip, for the next spin window (only waits measure it)
                self._rt_seen = now - self._sent_at
                return
            _yield()
            now = _monotonic()
        hdr[7] = 1  # waiting: the server rings the doorbell from now on
        try:
            while True:
                fence()
                # the counter first: after a wake-up the response is there, and its doorbell is
                # drained on the next wait (draining first would cost two recv calls here)
                if hdr[0] != want:
                    self._drain()  # PeerDeadError on EOF
                if hdr[0] == want:  # (again after the drain: a doorbell it consumed is no loss)
                    self._rt_seen = _monotonic() - self._sent_at
                    return
                remaining = deadline - _monotonic()
                if remaining <= 0:
                    raise DeadlineExceeded(
                        f"expert server {self.server_id} at {self.endpoint}: no response before the deadline"
                    )
                try:
                    select.select([sock], [], [], remaining)
                except ValueError:  # socket closed under us
                    raise PeerDeadError(f"connection to {self.server_id} is closed") from None
        finally:
            if self._slots is not None:
                self._slots.resp_q[7] = 0
