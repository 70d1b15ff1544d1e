"""Slot layout of the shared-memory transports (public: :mod:`.shm`, :mod:`.shm_server` and
:mod:`.cuda_ipc` share it): header fields, packets, memory fences and the tensor views.

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

The hello / remap packet (:data:`HELLO`) carries ``kind client_id hidden dtype cap_tokens
cap_k`` with the memfd attached (SCM_RIGHTS); the ack (:data:`ACK`) a status and a utf-8
message; a doorbell is the one byte :data:`DOORBELL`.

Doorbells only when the peer sleeps (:func:`fence` between a flag store and a counter load)
and the x86 store order the data path relies on: :mod:`.shm`.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading

import numpy as np
import torch

from eaas.runtime.transport.base import (
    CODE_DTYPES,
    MAX_K_HARD,
    MAX_TOKENS_HARD,
    FrameError,
    RequestFrame,
)

DEFAULT_SPIN_US = 80.0  # least busy-poll before blocking, both ends (microseconds)
PAGE = mmap.PAGESIZE
HDR_BYTES = 64
MSG_BYTES = 1024

# hello / remap packet: kind(1s) client_id hidden dtype cap_tokens cap_k
HELLO = struct.Struct("<cxxxqqiii")
ACK = struct.Struct("<ci")  # kind b"A", status; followed by utf-8 message
KIND_HELLO = b"H"
KIND_REMAP = b"R"
KIND_ACK = b"A"
DOORBELL = b"D"
FENCE = threading.Lock()
fence_acquire = FENCE.acquire
fence_release = FENCE.release
pack_req = struct.Struct("<6q").pack_into  # request header [1..6] at byte offset 8
pack_resp = struct.Struct("<5q").pack_into  # response header [1..5] at byte offset 8


def fence() -> None:
    """Full memory barrier (store-load order) between a flag store and a counter load: an
    uncontended lock acquire is a locked instruction on x86. (The data path inlines the two
    calls.)"""
    fence_acquire()
    fence_release()


def align(x: int, a: int) -> int:
    """``x`` rounded up to a multiple of ``a`` (bytes)."""
    return (x + a - 1) // a * a


def endpoint_path(endpoint: str, scheme: str) -> str:
    """The socket path of a ``SCHEME:PATH`` endpoint: ``("unix:/a/b.sock", "unix:")`` ->
    ``/a/b.sock`` (``SCHEME:///abs/path`` tolerated).

    Raises:
        ValueError: another scheme, or an empty path.
    """
    name = scheme.rstrip(":")
    if not endpoint.startswith(scheme):
        raise ValueError(f"not a {name} endpoint: {endpoint!r}")
    path = endpoint[len(scheme) :]
    if path.startswith("//"):  # tolerate unix:///abs/path
        path = path[2:]
    if not path:
        raise ValueError(f"empty {name} socket path in {endpoint!r}")
    return path


def unix_path(endpoint: str) -> str:
    """``unix:/a/b.sock`` -> ``/a/b.sock``. Raises ValueError on another scheme."""
    return endpoint_path(endpoint, "unix:")


def check_hello(
    hidden: int, dcode: int, cap_t: int, cap_k: int, *, hidden_size: int, dtype: torch.dtype
) -> torch.dtype:
    """A hello / remap packet's fields against the listener's (both shared-memory listeners).

    Returns:
        the frames' dtype (``dcode`` decoded).

    Raises:
        FrameError: another hidden size or dtype, or a slot capacity outside
            ``(0, MAX_TOKENS_HARD] x (0, MAX_K_HARD]``.
    """
    if hidden != hidden_size:
        raise FrameError(f"hidden size {hidden} != server's {hidden_size}")
    got = CODE_DTYPES.get(dcode)
    if got != dtype:
        raise FrameError(f"dtype {got} != server's {dtype}")
    if not (0 < cap_t <= MAX_TOKENS_HARD and 0 < cap_k <= MAX_K_HARD):
        raise FrameError(f"bad slot capacity {cap_t} x {cap_k}")
    return got


class Slots:
    """Tensor views over one mapped memfd (request + response regions).

    Args:
        mm: the mapping (``mmap.mmap``), at least the ``total_bytes`` of :meth:`layout` long.
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
        cls.sync_free = cls.sync is Slots.sync

    @staticmethod
    def layout(
        hidden: int, dtype: torch.dtype, cap_tokens: int, cap_k: int
    ) -> tuple[int, int, int]:
        """Returns ``(request_bytes, response_offset, total_bytes)``."""
        esz = torch.empty((), dtype=dtype).element_size()
        req = (
            HDR_BYTES + align(cap_tokens * hidden * esz, 64) + 2 * align(cap_tokens * cap_k * 4, 64)
        )
        resp_off = align(req, PAGE)
        resp = HDR_BYTES + MSG_BYTES + cap_tokens * hidden * esz
        return req, resp_off, align(resp_off + resp, PAGE)

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
        self.req_q = self._mv[off : off + HDR_BYTES].cast("q")
        off += HDR_BYTES
        self.req_hidden = torch.frombuffer(
            mm, dtype=dtype, count=cap_tokens * hidden, offset=off
        ).view(cap_tokens, hidden)
        off += align(cap_tokens * hidden * esz, 64)
        self.req_experts = torch.frombuffer(
            mm, dtype=torch.int32, count=cap_tokens * cap_k, offset=off
        )
        off += align(cap_tokens * cap_k * 4, 64)
        self.req_weights = torch.frombuffer(
            mm, dtype=torch.float32, count=cap_tokens * cap_k, offset=off
        )
        off = resp_off
        self.resp_hdr = np.frombuffer(mm, dtype=np.int64, count=8, offset=off)
        self.resp_q = self._mv[off : off + HDR_BYTES].cast("q")
        off += HDR_BYTES
        self.resp_msg = np.frombuffer(mm, dtype=np.uint8, count=MSG_BYTES, offset=off)
        off += MSG_BYTES
        self.resp_out = torch.frombuffer(
            mm, dtype=dtype, count=cap_tokens * hidden, offset=off
        ).view(cap_tokens, hidden)
        self.reset_caches()

    def reset_caches(self) -> None:
        """Empty the per-shape caches of views (and the server's frames) over this mapping."""
        self._req_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.req_frames: dict[tuple[int, int], RequestFrame] = {}  # the server's, per size
        self.resp_views: dict[int, torch.Tensor] = {}

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
        f = self.req_frames.get((n, k))
        if f is None:
            if len(self.req_frames) > 64:
                self.req_frames.clear()
            f = self.req_frames[(n, k)] = RequestFrame(0, 0, 0, 0, *self.req_views(n, k))
        return f

    def resp_view(self, n: int) -> torch.Tensor:
        """``[n, H]`` view of the response output region, cached per ``n``."""
        v = self.resp_views.get(n)
        if v is None:
            if len(self.resp_views) > 64:
                self.resp_views.clear()
            v = self.resp_views[n] = self.resp_out[:n]
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
        self.reset_caches()
        self.mm = None  # type: ignore
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a returned tensor still aliases it; the mapping dies with that tensor


def new_memfd_slots(
    hidden: int, dtype: torch.dtype, cap_tokens: int, cap_k: int
) -> tuple[int, Slots]:
    _, _, total = Slots.layout(hidden, dtype, cap_tokens, cap_k)
    fd = os.memfd_create("eaas-slot", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, total)
        mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd, Slots(mm, hidden, dtype, cap_tokens, cap_k)
