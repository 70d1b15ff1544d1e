"""Same-node GPU transport: the ``shm`` transport with its payload in CUDA IPC device memory.

Endpoint: ``cudaipc:/path/to/server.sock``.

:class:`CudaIpcClientConnection` and :class:`CudaIpcServerListener` subclass
:class:`~eaas.runtime.transport.shm.ShmClientConnection` and
:class:`~eaas.runtime.transport.shm_server.ShmServerListener`: the control plane (``SOCK_SEQPACKET``
Unix socket, hello/ack/remap packets, doorbells only when the peer sleeps, EOF = peer dead), the
slot headers, the data path (spin then block, deadlines, adaptive spin, one request in flight)
and the server's poll/respond loop are the shm code itself. Only the **payload mapping** differs:

* headers: one memfd page per mapping: request header ``int64[8]`` at 0, response header at 64,
  the 1024-byte message at 128 (same fields as ``shm``). Host memory, so the server's host loop
  polls it without touching the GPU; the same words can be registered with
  ``cudaHostRegister`` for GPU-side signalling (``native/eaas_signal.cu``,
  :mod:`eaas.runtime.client.graphs`).
* payload (``payload="cuda"``): one ``cudaMalloc`` buffer per mapping, allocated by the client
  and exported with ``cudaIpcGetMemHandle`` (64-byte handle in the hello / remap packet); the
  server opens it with ``cudaIpcOpenMemHandle``. Layout (:func:`payload_layout`): request hidden
  ``[cap_tokens, H]``, experts ``[cap_tokens * cap_k]`` int32, weights (same) float32, response
  output ``[cap_tokens, H]``, each 256-byte aligned. Frames on the server and the response's
  ``output`` on the client are CUDA tensors aliasing it: no host staging.
* ``payload="host"`` puts the same layout in a second memfd: the host emulation of this exact
  code path, which is what the protocol tests run on a machine without a GPU.

Hello / remap packet: ``kind client_id hidden dtype cap_tokens cap_k payload_kind device
ipc_handle[64]`` with the header memfd (and, for a host payload, the payload memfd) attached.
A remap (frame larger than the slot) sends a new header page and a new payload, like ``shm``'s
new memfd.

Ordering: the writer copies the payload on its CUDA stream and **synchronises that stream before
writing the counter** (``Slots.sync``: payload before flag); the reader sees the counter, then
reads the payload with kernels issued after that.

Deadlines: every wait is on the host exactly as ``shm`` (a dead or stopped server raises
:class:`PeerDeadError` / :class:`DeadlineExceeded`; the dispatcher's failover is unchanged). No
CUDA stream ever waits on a peer here. (The graph-captured round trip waits on the device with
a bounded kernel instead; see docs/gpu.md.)

Buffer life: the client owns (allocates and frees) its buffer; the server closes its import when
it drops the connection (client EOF) or switches to a remapped one.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import socket
import struct
from collections.abc import Callable
from types import MethodType

import numpy as np
import torch

from eaas.runtime.cuda import GpuUnavailableError
from eaas.runtime.cuda.device import CPU_SERVER_CUDA_PAYLOAD
from eaas.runtime.transport.base import (
    DTYPE_CODES,
    ClientConnection,
    FrameError,
    PeerDeadError,
    RequestFrame,
)
from eaas.runtime.transport.shm import ShmClientConnection
from eaas.runtime.transport.shm_server import ShmServerConn, ShmServerListener
from eaas.runtime.transport.shm_slots import (
    DEFAULT_SPIN_US,
    HDR_BYTES,
    KIND_HELLO,
    MSG_BYTES,
    Slots,
    align,
    check_hello,
    endpoint_path,
)

PAYLOAD_HOST = 0
PAYLOAD_CUDA = 1
_PAYLOAD_NAMES = {"host": PAYLOAD_HOST, "cuda": PAYLOAD_CUDA}
_HDR_PAGE = mmap.PAGESIZE
_ALIGN = 256  # bytes: every payload region starts at a multiple of this
# hello / remap: kind client_id hidden dtype cap_tokens cap_k payload device ipc_handle[64]
_HELLO = struct.Struct("<cxxxqqiiiii64s")


def socket_path(endpoint: str) -> str:
    """``cudaipc:/a/b.sock`` -> ``/a/b.sock``. Raises ValueError on another scheme."""
    return endpoint_path(endpoint, "cudaipc:")


def payload_layout(hidden: int, dtype: torch.dtype, cap_tokens: int, cap_k: int) -> dict[str, int]:
    """Byte offsets of the payload regions and ``total`` bytes (all 256-byte aligned)."""
    esz = torch.empty((), dtype=dtype).element_size()
    h = align(cap_tokens * hidden * esz, _ALIGN)
    e = align(cap_tokens * cap_k * 4, _ALIGN)
    return {"hidden": 0, "experts": h, "weights": h + e, "out": h + 2 * e, "total": 2 * h + 2 * e}


def _cudart():
    try:
        from cuda.bindings import runtime as cudart  # optional (cuda-python): a CUDA payload
    except ImportError as e:
        raise GpuUnavailableError(f"cudaipc needs cuda-python ({e})") from None
    return cudart


def _rt(res, what: str):
    """Unwrap a ``cuda.bindings.runtime`` result; RuntimeError naming the call on an error."""
    err, *rest = res if isinstance(res, tuple) else (res,)
    if int(err) != 0:
        raise RuntimeError(f"{what}: CUDA error {err!r}")
    return rest[0] if len(rest) == 1 else None


class _CudaArray:
    """``__cuda_array_interface__`` of raw device bytes, so torch can alias them."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "stream": None,
        }


class _Payload:
    """One payload buffer (host memfd or CUDA memory) and typed tensor views over it."""

    def __init__(self, raw: torch.Tensor, hidden: int, dtype, cap_tokens: int, cap_k: int):
        lay = payload_layout(hidden, dtype, cap_tokens, cap_k)
        self.cap_tokens, self.cap_k = cap_tokens, cap_k
        self.raw = raw  # uint8 [total]

        def view(off, count, dt):
            return raw[off : off + count * torch.empty((), dtype=dt).element_size()].view(dt)

        self.req_hidden = view(lay["hidden"], cap_tokens * hidden, dtype).view(cap_tokens, hidden)
        self.req_experts = view(lay["experts"], cap_tokens * cap_k, torch.int32)
        self.req_weights = view(lay["weights"], cap_tokens * cap_k, torch.float32)
        self.resp_out = view(lay["out"], cap_tokens * hidden, dtype).view(cap_tokens, hidden)
        self.is_cuda = raw.is_cuda
        self._close: Callable[[], None] | None = None  # releases the memory
        self._released = False

    def sync(self) -> None:
        """Payload writes issued on this device's current stream are complete."""
        if self.is_cuda:
            torch.cuda.current_stream(self.raw.device).synchronize()

    def release(self) -> None:
        """Drop the views (using one afterwards raises AttributeError), then free the memory.
        Idempotent."""
        if self._released:
            return
        self._released = True
        del self.req_hidden, self.req_experts, self.req_weights, self.resp_out, self.raw
        close, self._close = self._close, None
        if close is not None:
            close()


def _host_payload(fd: int, total: int, hidden, dtype, cap_t, cap_k) -> _Payload:
    mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    p = _Payload(torch.frombuffer(mm, dtype=torch.uint8, count=total), hidden, dtype, cap_t, cap_k)

    def close():
        try:
            mm.close()
        except BufferError:
            pass  # a returned tensor still aliases it; unmapped when that tensor dies

    p._close = close
    return p


def _new_host_payload(hidden, dtype, cap_t, cap_k) -> tuple[int, _Payload]:
    total = payload_layout(hidden, dtype, cap_t, cap_k)["total"]
    fd = os.memfd_create("eaas-cudaipc-host", os.MFD_CLOEXEC)
    os.ftruncate(fd, total)
    return fd, _host_payload(fd, total, hidden, dtype, cap_t, cap_k)


def _new_cuda_payload(device: int, hidden, dtype, cap_t, cap_k) -> tuple[bytes, _Payload]:
    cudart = _cudart()
    total = payload_layout(hidden, dtype, cap_t, cap_k)["total"]
    with torch.cuda.device(device):
        torch.cuda.init()
        ptr = int(_rt(cudart.cudaMalloc(total), "cudaMalloc"))
        h = _rt(cudart.cudaIpcGetMemHandle(ptr), "cudaIpcGetMemHandle")
        handle = ctypes.string_at(h.getPtr(), 64)
        raw = torch.as_tensor(_CudaArray(ptr, total), device=f"cuda:{device}")
    p = _Payload(raw, hidden, dtype, cap_t, cap_k)

    def close():
        torch.cuda.synchronize(device)
        cudart.cudaFree(ptr)

    p._close = close
    return handle, p


def _open_cuda_payload(handle: bytes, device: int, hidden, dtype, cap_t, cap_k) -> _Payload:
    cudart = _cudart()
    total = payload_layout(hidden, dtype, cap_t, cap_k)["total"]
    h = cudart.cudaIpcMemHandle_t()
    ctypes.memmove(h.getPtr(), handle, 64)
    with torch.cuda.device(device):
        torch.cuda.init()
        ptr = int(
            _rt(
                cudart.cudaIpcOpenMemHandle(h, cudart.cudaIpcMemLazyEnablePeerAccess),
                "cudaIpcOpenMemHandle",
            )
        )
        raw = torch.as_tensor(_CudaArray(ptr, total), device=f"cuda:{device}")
    p = _Payload(raw, hidden, dtype, cap_t, cap_k)

    def close():
        torch.cuda.synchronize(device)
        cudart.cudaIpcCloseMemHandle(ptr)

    p._close = close
    return p


class _IpcSlots(Slots):
    """shm's slot views over a header page (memfd) and a separate payload (host memfd or CUDA).

    Same attributes as :class:`~eaas.runtime.transport.shm._Slots` (``req_hdr``, ``resp_hdr``,
    ``req_q``, ``resp_q``,
    ``resp_msg``, ``req_hidden``, ``req_experts``, ``req_weights``, ``resp_out``, ``cap_tokens``,
    ``cap_k``, ``req_views``, ``resp_view``), so the shm data path runs on it unchanged; plus
    ``payload`` (the :class:`_Payload`), ``is_cuda`` and ``raw`` (the payload's bytes).
    """

    def __init__(self, hdr_mm: mmap.mmap, payload: _Payload, hidden: int, dtype: torch.dtype):
        self.mm = hdr_mm
        self.hidden_size, self.dtype = hidden, dtype
        self.cap_tokens, self.cap_k = payload.cap_tokens, payload.cap_k
        self.req_hdr = np.frombuffer(hdr_mm, dtype=np.int64, count=8, offset=0)
        self.resp_hdr = np.frombuffer(hdr_mm, dtype=np.int64, count=8, offset=64)
        self._mv = memoryview(hdr_mm)  # shm's data path uses these int64 views of the headers
        self.req_q = self._mv[0:HDR_BYTES].cast("q")
        self.resp_q = self._mv[64 : 64 + HDR_BYTES].cast("q")
        self.resp_msg = np.frombuffer(hdr_mm, dtype=np.uint8, count=MSG_BYTES, offset=128)
        self.req_hidden = payload.req_hidden  # (cap_tokens, H)
        self.req_experts = payload.req_experts  # (cap_tokens * cap_k,) int32
        self.req_weights = payload.req_weights  # (cap_tokens * cap_k,) float32
        self.resp_out = payload.resp_out  # (cap_tokens, H)
        self.payload: _Payload | None = payload
        self.is_cuda = payload.is_cuda
        self.raw = payload.raw
        self.reset_caches()

    def sync(self) -> None:
        if self.payload is not None:
            self.payload.sync()

    def release(self) -> None:
        payload, self.payload = self.payload, None
        self.raw = None  # type: ignore[assignment]
        super().release()  # drops the views, unmaps the header page
        if payload is not None:
            payload.release()


def _header_page(fd: int) -> mmap.mmap:
    return mmap.mmap(fd, _HDR_PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def _resolve_payload(payload: str) -> int:
    if payload not in _PAYLOAD_NAMES:
        raise ValueError(f"payload must be 'cuda' or 'host', got {payload!r}")
    kind = _PAYLOAD_NAMES[payload]
    if kind == PAYLOAD_CUDA and not torch.cuda.is_available():
        raise GpuUnavailableError(
            "cudaipc with payload='cuda' needs a CUDA device (torch.cuda.is_available() is "
            "False); payload='host' is the host emulation of the same protocol"
        )
    return kind


class CudaIpcClientConnection(ShmClientConnection):
    """Client end of a ``cudaipc:`` connection: :class:`ShmClientConnection` with the payload in
    CUDA IPC memory (or, ``payload="host"``, in a memfd: the host emulation).

    Args:
        endpoint: ``cudaipc:/path.sock``.
        server_id: the server's id (errors, dispatcher).
        hidden_size, dtype: frame shape and dtype (float32 / bfloat16).
        client_id: default pid.
        payload: ``"cuda"`` (default; CUDA IPC device memory) or ``"host"`` (host emulation).
        device: CUDA device index of the payload (default: torch's current device).
        max_tokens, max_k: initial slot capacity (grown on demand).
        spin_us: least busy-poll time before blocking in ``recv`` (adaptive, as shm).
        connect_timeout: seconds for connect + ack.

    Raises:
        PeerDeadError, DeadlineExceeded, FrameError (refused hello, bad dtype),
        GpuUnavailableError (``payload="cuda"`` without a GPU), ValueError (unknown payload).

    ``recv`` returns ``output`` aliasing the response slot (a CUDA tensor for ``payload="cuda"``):
    copy it before the next ``send``.
    """

    _socket_path = staticmethod(socket_path)
    _slots: Slots | None

    def __init__(
        self,
        endpoint: str,
        server_id: str,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        client_id: int | None = None,
        payload: str = "cuda",
        device: int | None = None,
        max_tokens: int = 256,
        max_k: int = 8,
        spin_us: float = DEFAULT_SPIN_US,
        connect_timeout: float = 5.0,
    ):
        self.payload_kind = _resolve_payload(payload)
        self.device = (
            (torch.cuda.current_device() if device is None else int(device))
            if self.payload_kind == PAYLOAD_CUDA
            else -1
        )
        super().__init__(
            endpoint,
            server_id,
            hidden_size=hidden_size,
            dtype=dtype,
            client_id=client_id,
            max_tokens=max_tokens,
            max_k=max_k,
            spin_us=spin_us,
            connect_timeout=connect_timeout,
        )
        if self.payload_kind == PAYLOAD_CUDA:
            # a CUDA payload takes the frame path, whose tensors may be on either device (see
            # _send): the interface's send_parts builds the frame and sends it through _send;
            # a host payload keeps shm's send_parts (the frame's plan by (n, k), no frame)
            self.send_parts = MethodType(ClientConnection.send_parts, self)  # type: ignore[method-assign]

    @property
    def slots(self) -> _IpcSlots:
        """The current slots: headers (``req_hdr``, ``resp_hdr``) and payload views (for
        GPU-side signalling, :mod:`eaas.runtime.client.graphs`).

        Raises:
            PeerDeadError: the connection is closed.
        """
        s = self._slots_now()
        assert isinstance(s, _IpcSlots)
        return s

    def _map(self, cap_tokens: int, cap_k: int, kind: bytes) -> None:
        """New header page + payload of ``cap_tokens x cap_k``, sent to the server in a hello
        or remap packet; they become the current slots (shm's ``_map`` contract)."""
        sock = self._open_sock()
        hfd = os.memfd_create("eaas-cudaipc-hdr", os.MFD_CLOEXEC)
        pfd = None
        pl: _Payload | None = None
        try:
            os.ftruncate(hfd, _HDR_PAGE)
            hmm = _header_page(hfd)
            handle = b"\0" * 64
            if self.payload_kind == PAYLOAD_CUDA:
                handle, pl = _new_cuda_payload(
                    self.device, self.hidden_size, self.dtype, cap_tokens, cap_k
                )
            else:
                pfd, pl = _new_host_payload(self.hidden_size, self.dtype, cap_tokens, cap_k)
            slots = _IpcSlots(hmm, pl, self.hidden_size, self.dtype)
            pkt = _HELLO.pack(
                kind,
                self.client_id,
                self.hidden_size,
                DTYPE_CODES[self.dtype],
                cap_tokens,
                cap_k,
                self.payload_kind,
                self.device,
                handle,
            )
            try:
                socket.send_fds(sock, [pkt], [hfd] if pfd is None else [hfd, pfd])
            except (
                BrokenPipeError,
                ConnectionResetError,
                ConnectionRefusedError,
                BlockingIOError,
            ) as e:
                slots.release()
                raise PeerDeadError(
                    f"expert server {self.server_id} at {self.endpoint} is gone: {e}"
                ) from None
        finally:
            os.close(hfd)
            if pfd is not None:
                os.close(pfd)
        if self._slots is not None:
            self._slots.release()
        self._slots = slots

    @property
    def device_payload(self) -> bool:
        """True with a CUDA payload: frames are taken from GPU memory as they are (the
        dispatcher then keeps hidden states on the GPU, :mod:`eaas.runtime.client.dispatch.staging`)."""
        return self.payload_kind == PAYLOAD_CUDA

    def _send(self, frame: RequestFrame, ring: bool) -> None:
        """shm's ``send`` / ``send_deferred``; with a CUDA payload a frame's ``rows`` are
        gathered on the host first for host hidden states (``index_select`` cannot write across
        devices), and moved to the device for device hidden states (device-to-device gather
        straight into the IPC buffer). Raises FrameError / PeerDeadError."""
        rows = frame.rows
        if rows is not None and self.payload_kind == PAYLOAD_CUDA:
            dev = frame.hidden.device
            if dev.type != "cuda":
                frame = dataclasses.replace(
                    frame, hidden=frame.hidden.index_select(0, rows.to(dev)), rows=None
                )
            elif rows.device != dev:
                frame = dataclasses.replace(frame, rows=rows.to(dev))
        super()._send(frame, ring)


class CudaIpcServerListener(ShmServerListener):
    """Server end of ``cudaipc:``: :class:`ShmServerListener` mapping cudaipc hellos; accepts
    host-emulation and CUDA-payload clients alike.

    Args:
        endpoint: ``cudaipc:/path.sock`` (a stale socket file is replaced, a live one raises
            ``OSError(EADDRINUSE)``; unlinked by :meth:`close`).
        hidden_size, dtype: hellos with another size/dtype are refused with a message.
        spin_us: busy-poll time in ``poll`` before blocking.
        compute_device: where the expert server computes (``"cpu"``, ``"cuda"``, ``"cuda:N"``;
            default ``"cpu"``). A CUDA-payload hello is refused unless it is a CUDA device
            (:data:`eaas.runtime.cuda.device.CPU_SERVER_CUDA_PAYLOAD`): frames would arrive as
            CUDA tensors that a CPU server cannot compute with.

    A CUDA-payload hello on a server without a GPU is refused ("no CUDA device").
    """

    _socket_path = staticmethod(socket_path)

    def __init__(self, endpoint: str, *, compute_device: str | None = None, **kw):
        self.compute_device = torch.device(compute_device or "cpu")
        super().__init__(endpoint, **kw)

    def _on_map(self, conn: ShmServerConn, data: bytes, fds: list[int]) -> None:
        hello = data[:1] == KIND_HELLO
        try:
            try:
                if len(data) < _HELLO.size:
                    raise FrameError("short hello/remap packet")
                kind, cid, hidden, dcode, cap_t, cap_k, pkind, dev, handle = _HELLO.unpack_from(
                    data
                )
                if (hello and conn.ready) or (not hello and not conn.ready):
                    raise FrameError("hello/remap out of order")
                want_fds = 1 + int(pkind == PAYLOAD_HOST)
                if len(fds) != want_fds:
                    raise FrameError(f"expected {want_fds} fds, got {len(fds)}")
                dtype = check_hello(
                    hidden, dcode, cap_t, cap_k, hidden_size=self.hidden_size, dtype=self.dtype
                )
                if os.fstat(fds[0]).st_size < _HDR_PAGE:
                    raise FrameError("header memfd smaller than one page")
                total = payload_layout(hidden, dtype, cap_t, cap_k)["total"]
                if pkind == PAYLOAD_HOST:
                    if os.fstat(fds[1]).st_size < total:
                        raise FrameError("payload memfd smaller than announced")
                    pl = _host_payload(fds[1], total, hidden, dtype, cap_t, cap_k)
                elif pkind == PAYLOAD_CUDA:
                    if self.compute_device.type != "cuda":
                        raise FrameError(CPU_SERVER_CUDA_PAYLOAD)
                    if not torch.cuda.is_available():
                        raise FrameError("no CUDA device on this expert server for a cuda payload")
                    pl = _open_cuda_payload(handle, dev, hidden, dtype, cap_t, cap_k)
                else:
                    raise FrameError(f"unknown payload kind {pkind}")
                slots = _IpcSlots(_header_page(fds[0]), pl, hidden, dtype)
            finally:
                for fd in fds:
                    os.close(fd)  # the mappings hold their own references
        except (FrameError, OSError, ValueError, struct.error, RuntimeError) as e:
            self._refuse(conn, e)
            return
        self._install(conn, slots, cid, kind)


def connect(endpoint: str, server_id: str, **kw) -> CudaIpcClientConnection:
    """Factory hook of :func:`eaas.runtime.transport.factory.connect` for ``cudaipc:``."""
    return CudaIpcClientConnection(endpoint, server_id, **kw)


def listen(endpoint: str, **kw) -> CudaIpcServerListener:
    """Factory hook of :func:`eaas.runtime.transport.factory.listen` for ``cudaipc:``."""
    return CudaIpcServerListener(endpoint, **kw)
