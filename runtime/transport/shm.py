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

Slot layout (one memfd, both regions page aligned, all little-endian / native x86)
----------------------------------------------------------------------------------
request region::

    header   int64[8]   [0] ready counter (written LAST)  [1] layer  [2] table_version
                        [3] n tokens  [4] k  [5] client_id  [6] caller seq
                        [7] server waiting (1 while the server blocks in select)
    hidden   [cap_tokens, H]  dtype (float32 | bfloat16)  -- first n*H used
    experts  [cap_tokens * cap_k] int32                   -- first n*k used, [n, k] row major
    weights  [cap_tokens * cap_k] float32                 -- same

response region::

    header   int64[8]   [0] done counter (written LAST) [1] layer [2] status [3] n [4] msg len
                        [5] caller seq  [7] client waiting (1 while the client blocks in select)
    message  1024 bytes utf-8 (error text)
    output   [cap_tokens, H] dtype

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

import errno
import mmap
import os
import select
import socket
import stat
import struct
import threading
import time
import weakref
from collections.abc import Sequence

import numpy as np
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
    parts_frame,
)
from eaas.runtime.transport.sockets import ServerConn, SocketClientConnection, SocketServerListener

DEFAULT_SPIN_US = 80.0
MAX_ADAPTIVE_SPIN_S = 2e-3  # the client never spins longer than this for one response
MAX_SERVER_SPIN_S = 5e-4  # a server spins past spin_us, up to this, when frames come this often
SOCKET_SERVICE_S = 1e-3  # a server busy with frames still reads its sockets this often
_PAGE = mmap.PAGESIZE
_HDR_BYTES = 64
_MSG_BYTES = 1024

# hello / remap packet: kind(1s) client_id hidden dtype cap_tokens cap_k
_HELLO = struct.Struct("<cxxxqqiii")
_ACK = struct.Struct("<ci")  # kind b"A", status; followed by utf-8 message
_KIND_HELLO = b"H"
_KIND_REMAP = b"R"
_KIND_ACK = b"A"
_DOORBELL = b"D"


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
_FENCE = threading.Lock()
_fence_acquire = _FENCE.acquire
_fence_release = _FENCE.release
_pack_req = struct.Struct("<6q").pack_into  # request header [1..6] at byte offset 8
_pack_resp = struct.Struct("<5q").pack_into  # response header [1..5] at byte offset 8
_MAX_PLANS = 256  # validated frame shapes remembered per connection (cleared when full)


def _fence() -> None:
    """Full memory barrier (store-load order) between a flag store and a counter load: an
    uncontended lock acquire is a locked instruction on x86. (The data path inlines the two
    calls.)"""
    _fence_acquire()
    _fence_release()


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def unix_path(endpoint: str) -> str:
    """``unix:/a/b.sock`` -> ``/a/b.sock``. Raises ValueError on another scheme."""
    if not endpoint.startswith("unix:"):
        raise ValueError(f"not a unix endpoint: {endpoint!r}")
    path = endpoint[len("unix:") :]
    if path.startswith("//"):  # tolerate unix:///abs/path
        path = path[2:]
    if not path:
        raise ValueError(f"empty unix socket path in {endpoint!r}")
    return path


class _Slots:
    """Tensor views over one mapped memfd (request + response regions).

    Args:
        mm: the mapping (``mmap.mmap``), at least :meth:`nbytes` long.
        hidden: hidden size ``H``.
        dtype: activation dtype.
        cap_tokens: maximum tokens per frame.
        cap_k: maximum expert entries per token.
    """

    # True where :meth:`sync` is this class's no-op (host memory): the data path skips the call;
    # a subclass that overrides ``sync`` (a device payload, :mod:`.cuda_ipc`) gets False
    sync_free = True

    def __init_subclass__(cls, **kw: object) -> None:
        super().__init_subclass__(**kw)
        cls.sync_free = cls.sync is _Slots.sync

    @staticmethod
    def layout(
        hidden: int, dtype: torch.dtype, cap_tokens: int, cap_k: int
    ) -> tuple[int, int, int]:
        """Returns ``(request_bytes, response_offset, total_bytes)``."""
        esz = torch.empty((), dtype=dtype).element_size()
        req = (
            _HDR_BYTES
            + _align(cap_tokens * hidden * esz, 64)
            + 2 * _align(cap_tokens * cap_k * 4, 64)
        )
        resp_off = _align(req, _PAGE)
        resp = _HDR_BYTES + _MSG_BYTES + cap_tokens * hidden * esz
        return req, resp_off, _align(resp_off + resp, _PAGE)

    def __init__(self, mm: mmap.mmap, hidden: int, dtype: torch.dtype, cap_tokens: int, cap_k: int):
        self.mm = mm
        self.hidden_size = hidden
        self.dtype = dtype
        self.cap_tokens = cap_tokens
        self.cap_k = cap_k
        esz = torch.empty((), dtype=dtype).element_size()
        _, resp_off, total = self.layout(hidden, dtype, cap_tokens, cap_k)
        if len(mm) < total:
            raise FrameError(f"shared slot too small: {len(mm)} bytes < {total}")
        off = 0
        self.req_hdr = np.frombuffer(mm, dtype=np.int64, count=8, offset=off)
        # the data path reads and writes header fields through int64 memoryviews: a field
        # access costs ~50 ns there against ~150 ns for a numpy scalar
        self._mv = memoryview(mm)
        self.req_q = self._mv[off : off + _HDR_BYTES].cast("q")
        off += _HDR_BYTES
        self.req_hidden = torch.frombuffer(
            mm, dtype=dtype, count=cap_tokens * hidden, offset=off
        ).view(cap_tokens, hidden)
        off += _align(cap_tokens * hidden * esz, 64)
        self.req_experts = torch.frombuffer(
            mm, dtype=torch.int32, count=cap_tokens * cap_k, offset=off
        )
        off += _align(cap_tokens * cap_k * 4, 64)
        self.req_weights = torch.frombuffer(
            mm, dtype=torch.float32, count=cap_tokens * cap_k, offset=off
        )
        off = resp_off
        self.resp_hdr = np.frombuffer(mm, dtype=np.int64, count=8, offset=off)
        self.resp_q = self._mv[off : off + _HDR_BYTES].cast("q")
        off += _HDR_BYTES
        self.resp_msg = np.frombuffer(mm, dtype=np.uint8, count=_MSG_BYTES, offset=off)
        off += _MSG_BYTES
        self.resp_out = torch.frombuffer(
            mm, dtype=dtype, count=cap_tokens * hidden, offset=off
        ).view(cap_tokens, hidden)
        self._new_caches()

    def _new_caches(self) -> None:
        """Empty the per-shape caches of views (and the server's frames) over this mapping."""
        self._req_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._req_frames: dict[tuple[int, int], RequestFrame] = {}  # the server's, per size
        self._resp_views: dict[int, torch.Tensor] = {}

    def req_views(self, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(hidden [n, H], experts [n, k] int32, weights [n, k] float32)`` views of the request
        region, cached per shape (slicing a tensor costs microseconds; a frame reuses them)."""
        v = self._req_views.get((n, k))
        if v is None:
            if len(self._req_views) > 64:
                self._req_views.clear()
            v = (
                self.req_hidden[:n],
                self.req_experts[: n * k].view(n, k),
                self.req_weights[: n * k].view(n, k),
            )
            self._req_views[(n, k)] = v
        return v

    def req_frame(self, n: int, k: int) -> RequestFrame:
        """The server's :class:`RequestFrame` for frames of ``n`` tokens x ``k`` over this
        request region (its tensors are :meth:`req_views`), cached per shape; the caller
        refills the header fields (client id, layer, table version, seq) for every frame."""
        f = self._req_frames.get((n, k))
        if f is None:
            if len(self._req_frames) > 64:
                self._req_frames.clear()
            f = self._req_frames[(n, k)] = RequestFrame(0, 0, 0, 0, *self.req_views(n, k))
        return f

    def resp_view(self, n: int) -> torch.Tensor:
        """``[n, H]`` view of the response output region, cached per ``n``."""
        v = self._resp_views.get(n)
        if v is None:
            if len(self._resp_views) > 64:
                self._resp_views.clear()
            v = self._resp_views[n] = self.resp_out[:n]
        return v

    def sync(self) -> None:
        """Payload writes are visible to the peer before the counter store: a no-op for host
        memory (x86 keeps stores in order); a device payload synchronises its stream
        (:mod:`.cuda_ipc`)."""

    def release(self) -> None:
        """Drop our views and unmap if no caller still holds a view (else unmapped on GC)."""
        mm = self.mm
        self.req_hdr = self.req_hidden = self.req_experts = self.req_weights = None  # type: ignore
        self.resp_hdr = self.resp_msg = self.resp_out = None  # type: ignore
        for v in (self.req_q, self.resp_q, self._mv):
            v.release()
        self._new_caches()
        self.mm = None  # type: ignore
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a returned tensor still aliases it; the mapping dies with that tensor


def _new_memfd_slots(
    hidden: int, dtype: torch.dtype, cap_tokens: int, cap_k: int
) -> tuple[int, _Slots]:
    _, _, total = _Slots.layout(hidden, dtype, cap_tokens, cap_k)
    fd = os.memfd_create("eaas-slot", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, total)
        mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd, _Slots(mm, hidden, dtype, cap_tokens, cap_k)


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
        self._slots: _Slots | None = None
        # validated frame shapes -> slot views, for the mapping ``_plan_slots`` (see _plan)
        self._plans: dict[tuple, tuple] = {}
        self._plan_slots: _Slots | None = None
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
            self._map(max(1, int(max_tokens)), max(1, int(max_k)), _KIND_HELLO)
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

    def _slots_now(self) -> _Slots:
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
        fd, slots = _new_memfd_slots(self.hidden_size, self.dtype, cap_tokens, cap_k)
        try:
            pkt = _HELLO.pack(
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
            if data[:1] == _KIND_ACK:
                _, status = _ACK.unpack_from(data)
                return status, data[_ACK.size :].decode("utf-8", "replace")

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
        _pack_req(hdr, 8, layer, table_version, n, k, cid, seq)
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
        _fence_acquire()  # store-load fence between the counter store and the waiting-flag load
        _fence_release()
        if not hdr[7]:
            return  # the server is spinning or busy: it will see the counter without a doorbell
        try:
            self._open_sock().send(_DOORBELL)
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
            self._map(min(cap_t, MAX_TOKENS_HARD), max(k, s.cap_k), _KIND_REMAP)
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
            r.message = bytes(plan[0].resp_msg[: min(ln, _MSG_BYTES)]).decode("utf-8", "replace")
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
                _fence()
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


class _ServerConn(ServerConn):
    __slots__ = ("slots", "last_seen", "owner")

    def __init__(self, sock: socket.socket, owner: ShmServerListener):
        super().__init__(sock)
        # the mapped slots (and their RequestFrames, refilled per frame); None once dropped
        self.slots: _Slots | None = None
        self.last_seen = 0
        self.owner = owner  # the listener that accepted it: respond checks it is the caller


class ShmServerListener(SocketServerListener[_ServerConn]):
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
    def _new_conn(self, sock: socket.socket) -> _ServerConn:
        return _ServerConn(sock, self)

    def _release(self, conn: _ServerConn) -> None:
        if conn.slots is not None:  # (its frames' views alias the slot: released with it)
            conn.slots.release()
            conn.slots = None

    def _ack(self, conn: _ServerConn, status: int, msg: str) -> bool:
        try:
            conn.sock.send(_ACK.pack(_KIND_ACK, status) + msg.encode()[:2000])
            return True
        except OSError:
            return False

    def _on_map(self, conn: _ServerConn, data: bytes, fds: list[int]) -> None:
        try:
            if len(fds) != 1 or len(data) < _HELLO.size:
                raise FrameError("hello/remap packet without exactly one fd")
            kind, client_id, hidden, dcode, cap_t, cap_k = _HELLO.unpack_from(data)
            if hidden != self.hidden_size:
                raise FrameError(f"hidden size {hidden} != server's {self.hidden_size}")
            dtype = CODE_DTYPES.get(dcode)
            if dtype != self.dtype:
                raise FrameError(f"dtype {dtype} != server's {self.dtype}")
            if not (0 < cap_t <= MAX_TOKENS_HARD and 0 < cap_k <= MAX_K_HARD):
                raise FrameError(f"bad slot capacity {cap_t} x {cap_k}")
            _, _, total = _Slots.layout(hidden, dtype, cap_t, cap_k)
            if os.fstat(fds[0]).st_size < total:
                raise FrameError("shared slot smaller than announced")
            mm = mmap.mmap(fds[0], total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            slots = _Slots(mm, hidden, dtype, cap_t, cap_k)
        except (FrameError, OSError, ValueError, struct.error) as e:
            for fd in fds:
                os.close(fd)
            if not conn.ready:
                self._ack(conn, STATUS_BAD_FRAME, str(e))
            self._drop(conn)
            return
        for fd in fds:
            os.close(fd)
        if conn.slots is not None:
            conn.slots.release()
        conn.slots = slots
        conn.client_id = client_id
        # A fresh memfd reads 0 until the client's first frame in it (its counter is >= 1); the
        # frame may already be there, so do NOT read the current counter here.
        conn.last_seen = 0
        if kind == _KIND_HELLO:
            conn.ready = True
            if not self._ack(conn, STATUS_OK, ""):
                self._drop(conn)

    def _read(self, conn: _ServerConn) -> None:
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
            if kind == _DOORBELL and not fds:
                continue
            if kind in (_KIND_HELLO, _KIND_REMAP):
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
            f = s._req_frames.get((n, k))  # a hit: a size this slot has served before
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
                _fence()
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
        c = conn if isinstance(conn, _ServerConn) else self._own(conn)
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
        c = conn if isinstance(conn, _ServerConn) else self._own(conn)
        s = c.slots
        if s is None or c.owner is not self:
            return  # dropped (a dead client's slots are released) or another listener's
        n = output.shape[0]
        if n:
            v = s._resp_views.get(n)
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
        _pack_resp(hdr, 8, request.layer, STATUS_OK, n, 0, request.seq)
        hdr[0] = c.last_seen  # written last: done flag, echoes the request counter
        c.in_flight = False
        self._ring_if_waiting(c, hdr)

    def _answer_status(
        self, c: _ServerConn, s: _Slots, layer: int, seq: int, status: int, message: str
    ) -> None:
        """An answer without output rows: ``status`` and the utf-8 ``message``."""
        ln = self._message(s, message) if message else 0
        hdr = s.resp_q
        _pack_resp(hdr, 8, layer, status, 0, ln, seq)
        hdr[0] = c.last_seen  # written last
        c.in_flight = False
        self._ring_if_waiting(c, hdr)

    def _ring_if_waiting(self, c: _ServerConn, hdr: memoryview) -> None:
        """After the done counter store in response header ``hdr``: ring ``c``'s doorbell if
        its client blocks (store-load fence first); drop ``c`` if its socket is gone."""
        _fence_acquire()
        _fence_release()
        if not hdr[7]:
            return  # the client is spinning: no doorbell needed
        try:
            c.sock.send(_DOORBELL)
        except (BlockingIOError, InterruptedError):
            pass  # client has unread doorbells; it will wake
        except OSError:
            self._drop(c)

    @staticmethod
    def _message(s: _Slots, text: str) -> int:
        """Write an error message (utf-8, cut at ``_MSG_BYTES``) into the response slot;
        returns its length in bytes."""
        raw = text.encode("utf-8")[:_MSG_BYTES]
        s.resp_msg[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        return len(raw)

    def _after_close(self) -> None:
        if os.getpid() == self._owner_pid:  # a forked child must not unlink its parent's path
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
