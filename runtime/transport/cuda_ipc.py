"""Same-node GPU transport: payload slots in CUDA IPC device memory, flags as in ``shm``.

Endpoint: ``cudaipc:/path/to/server.sock``.

This is the ``shm`` transport's slot-and-flag protocol with the payload moved to the GPU:

* Control plane, exactly as ``shm``: a ``SOCK_SEQPACKET`` Unix socket carries the hello (with an
  anonymous memfd holding the two slot headers), the ack, remaps and one-byte doorbells; EOF on
  the socket is the liveness signal (a dead peer raises :class:`PeerDeadError` at once).
* Flags: the request header ``int64[8]`` (``[0]`` ready counter, written last, ``[1]`` layer,
  ``[2]`` table version, ``[3]`` n, ``[4]`` k, ``[5]`` client id, ``[6]`` caller seq, ``[7]``
  payload generation: the number of remaps the frame's payload buffer follows) and the
  response header (``[0]`` done counter echoing the request's, ``[1]`` layer, ``[2]`` status,
  ``[3]`` n, ``[4]`` message length, ``[5]`` caller seq) + a 1024-byte message, in the memfd.
  Host memory, so the server's host loop polls it without touching the GPU; the same words can
  be registered with ``cudaHostRegister`` for GPU-side signalling (``native/eaas_signal.cu``,
  :mod:`eaas.runtime.gpu.graphs`).
* Payload (``payload="cuda"``): one ``cudaMalloc`` buffer per connection allocated by the client
  and exported with ``cudaIpcGetMemHandle`` (64-byte handle in the hello / remap packet); the
  server opens it with ``cudaIpcOpenMemHandle``. Layout: request hidden ``[cap_tokens, H]``,
  experts ``[cap_tokens * cap_k]`` int32, weights (same) float32, response output
  ``[cap_tokens, H]``, each 256-byte aligned. Frames' tensors on the server and the response's
  ``output`` on the client are CUDA tensors aliasing this buffer: no host staging.
* ``payload="host"`` puts the same layout in a second memfd: the host emulation of this exact
  code path, which is what the protocol tests run on a machine without a GPU.

Ordering: a writer copies the payload on its CUDA stream and **synchronises that stream before
writing the counter** (payload before flag); the reader sees the counter, then reads the payload
with kernels issued after that, so they see the completed writes.

Deadlines: every wait is on the host (spin ``spin_us``, then ``select`` on the socket until the
caller's deadline) exactly as ``shm``: a dead or stopped server raises :class:`PeerDeadError` /
:class:`DeadlineExceeded`, which the dispatcher already handles (failover, server marked
suspect). No CUDA stream ever waits on a peer here. (The graph-captured round trip waits on the
device with a bounded kernel instead; see docs/gpu.md.)

Buffer life: the client owns (allocates and frees) its buffer; the server closes its import when
it drops the connection (client EOF). Growing frames re-allocate (capacity at least doubled) and
announce the new buffer with a remap packet before the header write, as ``shm`` does. Unlike
``shm`` the headers stay in place across a remap, so the request header carries the payload
generation: a server that sees a newer generation than it has mapped reads the (already
queued) remap packet before it touches the frame.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import select
import selectors
import socket
import struct
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from eaas.runtime.transport.base import (
    CODE_DTYPES,
    DTYPE_CODES,
    MAX_K_HARD,
    MAX_TOKENS_HARD,
    STATUS_BAD_FRAME,
    STATUS_OK,
    ClientConnection,
    DeadlineExceeded,
    FrameError,
    PeerDeadError,
    RequestFrame,
    ResponseFrame,
    ServerListener,
    check_request,
)

DEFAULT_SPIN_US = 80.0
PAYLOAD_HOST = 0
PAYLOAD_CUDA = 1
_PAYLOAD_NAMES = {"host": PAYLOAD_HOST, "cuda": PAYLOAD_CUDA}
_HDR_PAGE = mmap.PAGESIZE
_MSG_BYTES = 1024
_ALIGN = 256
# hello / remap: kind client_id hidden dtype cap_tokens cap_k payload device ipc_handle[64]
_HELLO = struct.Struct("<cxxxqqiiiii64s")
_ACK = struct.Struct("<ci")
_KIND_HELLO, _KIND_REMAP, _KIND_ACK, _DOORBELL = b"H", b"R", b"A", b"D"
_yield = os.sched_yield


def _align(x: int, a: int = _ALIGN) -> int:
    return (x + a - 1) // a * a


def socket_path(endpoint: str) -> str:
    """``cudaipc:/a/b.sock`` -> ``/a/b.sock``. Raises ValueError on another scheme."""
    if not endpoint.startswith("cudaipc:"):
        raise ValueError(f"not a cudaipc endpoint: {endpoint!r}")
    path = endpoint[len("cudaipc:") :]
    if path.startswith("//"):
        path = path[2:]
    if not path:
        raise ValueError(f"empty socket path in {endpoint!r}")
    return path


def payload_layout(hidden: int, dtype: torch.dtype, cap_tokens: int, cap_k: int) -> dict[str, int]:
    """Byte offsets of the payload regions and ``total`` bytes (all 256-byte aligned)."""
    esz = torch.empty((), dtype=dtype).element_size()
    h = _align(cap_tokens * hidden * esz)
    e = _align(cap_tokens * cap_k * 4)
    return {"hidden": 0, "experts": h, "weights": h + e, "out": h + 2 * e, "total": 2 * h + 2 * e}


def _cudart():
    from eaas.runtime.gpu import GpuUnavailableError

    try:
        from cuda.bindings import runtime as cudart
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


class _Headers:
    """The memfd page with both slot headers (request, response) and the message bytes."""

    def __init__(self, mm: mmap.mmap):
        self.mm = mm
        self.req = np.frombuffer(mm, dtype=np.int64, count=8, offset=0)
        self.resp = np.frombuffer(mm, dtype=np.int64, count=8, offset=64)
        self.msg = np.frombuffer(mm, dtype=np.uint8, count=_MSG_BYTES, offset=128)
        self._released = False

    def release(self) -> None:
        """Drop the views (using one afterwards raises AttributeError), then unmap the page
        (unless a returned view still aliases it). Idempotent."""
        if not self._released:
            self._released = True
            del self.req, self.resp, self.msg
        try:
            self.mm.close()
        except BufferError:
            pass


def _resolve_payload(payload: str) -> int:
    if payload not in _PAYLOAD_NAMES:
        raise ValueError(f"payload must be 'cuda' or 'host', got {payload!r}")
    kind = _PAYLOAD_NAMES[payload]
    if kind == PAYLOAD_CUDA and not torch.cuda.is_available():
        from eaas.runtime.gpu import GpuUnavailableError

        raise GpuUnavailableError(
            "cudaipc with payload='cuda' needs a CUDA device (torch.cuda.is_available() is "
            "False); payload='host' is the host emulation of the same protocol"
        )
    return kind


class CudaIpcClientConnection(ClientConnection):
    """Client end of a ``cudaipc:`` connection (one request in flight, like ``shm``).

    Args:
        endpoint: ``cudaipc:/path.sock``.
        server_id: the server's id (errors, dispatcher).
        hidden_size, dtype: frame shape and dtype (float32 / bfloat16 / float16).
        client_id: default pid.
        payload: ``"cuda"`` (default; CUDA IPC device memory) or ``"host"`` (host emulation).
        device: CUDA device index of the payload (default: torch's current device).
        max_tokens, max_k: initial slot capacity (grown on demand).
        spin_us: busy-poll before blocking in ``recv``.
        connect_timeout: seconds for connect + ack.

    Raises:
        PeerDeadError, DeadlineExceeded, FrameError (refused hello), GpuUnavailableError
        (``payload="cuda"`` without a GPU), ValueError (unknown payload).

    ``recv`` returns ``output`` aliasing the response slot (a CUDA tensor for ``payload="cuda"``):
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
        payload: str = "cuda",
        device: int | None = None,
        max_tokens: int = 256,
        max_k: int = 8,
        spin_us: float = DEFAULT_SPIN_US,
        connect_timeout: float = 5.0,
    ):
        if dtype not in DTYPE_CODES:
            raise FrameError(f"unsupported dtype {dtype}")
        self.payload_kind = _resolve_payload(payload)
        self.device = (
            (torch.cuda.current_device() if device is None else int(device))
            if self.payload_kind == PAYLOAD_CUDA
            else -1
        )
        self.endpoint, self.server_id = endpoint, server_id
        self.hidden_size, self.dtype = int(hidden_size), dtype
        self.client_id = os.getpid() if client_id is None else int(client_id)
        self.spin_s = spin_us * 1e-6
        self._counter = 0
        self._gen = 0  # payload generation (remaps sent)
        self._outstanding = False
        self._payload: _Payload | None = None
        self._hdr: _Headers | None = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock: socket.socket | None = sock  # None once closed
        deadline = time.monotonic() + connect_timeout
        try:
            sock.settimeout(connect_timeout)
            try:
                sock.connect(socket_path(endpoint))
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError) as e:
                raise PeerDeadError(
                    f"expert server {server_id} at {endpoint}: connect failed: {e}"
                ) from None
            except TimeoutError:
                raise DeadlineExceeded(
                    f"expert server {server_id} at {endpoint}: connect timed out"
                ) from None
            hfd = os.memfd_create("eaas-cudaipc-hdr", os.MFD_CLOEXEC)
            try:
                os.ftruncate(hfd, _HDR_PAGE)
                self._hdr = _Headers(
                    mmap.mmap(hfd, _HDR_PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                )
                self._map(max(1, int(max_tokens)), max(1, int(max_k)), _KIND_HELLO, hfd)
            finally:
                os.close(hfd)
            status, msg = self._wait_ack(sock, deadline)
            if status != STATUS_OK:
                raise FrameError(
                    f"expert server {server_id} at {endpoint} refused the connection: {msg}"
                )
            sock.setblocking(False)
        except BaseException:
            self.close()
            raise

    def _closed(self) -> PeerDeadError:
        return PeerDeadError(f"connection to {self.server_id} is closed")

    @property
    def headers(self) -> _Headers:
        """The shared slot headers (for GPU-side signalling, :mod:`eaas.runtime.gpu.graphs`).

        Raises:
            PeerDeadError: the connection is closed.
        """
        if self._hdr is None:
            raise self._closed()
        return self._hdr

    @property
    def payload(self) -> _Payload:
        """The current payload buffer views (request hidden/experts/weights, response out).

        Raises:
            PeerDeadError: the connection is closed.
        """
        if self._payload is None:
            raise self._closed()
        return self._payload

    def _map(self, cap_t: int, cap_k: int, kind: bytes, hdr_fd: int | None = None) -> _Payload:
        """Make a payload buffer of ``cap_t`` tokens x ``cap_k`` and send it to the server (hello
        or remap); it becomes the current payload, which it returns."""
        sock = self._sock
        if sock is None:
            raise self._closed()
        fds = [] if hdr_fd is None else [hdr_fd]
        handle = b"\0" * 64
        pfd = None
        if self.payload_kind == PAYLOAD_CUDA:
            handle, pl = _new_cuda_payload(self.device, self.hidden_size, self.dtype, cap_t, cap_k)
        else:
            pfd, pl = _new_host_payload(self.hidden_size, self.dtype, cap_t, cap_k)
            fds.append(pfd)
        pkt = _HELLO.pack(
            kind,
            self.client_id,
            self.hidden_size,
            DTYPE_CODES[self.dtype],
            cap_t,
            cap_k,
            self.payload_kind,
            self.device,
            handle,
        )
        try:
            socket.send_fds(sock, [pkt], fds)
        except (
            BrokenPipeError,
            ConnectionResetError,
            ConnectionRefusedError,
            BlockingIOError,
        ) as e:
            pl.release()
            raise PeerDeadError(
                f"expert server {self.server_id} at {self.endpoint} is gone: {e}"
            ) from None
        finally:
            if pfd is not None:
                os.close(pfd)
        if self._payload is not None:
            self._payload.release()
            self._gen += 1
        self._payload = pl
        return pl

    def _wait_ack(self, sock: socket.socket, deadline: float) -> tuple[int, str]:
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

    def send(self, frame: RequestFrame, deadline: float | None = None) -> None:
        """Copy ``frame`` into the payload slot (stream-synchronised), set the ready counter,
        ring the doorbell. Never waits on the server. Raises FrameError / PeerDeadError."""
        sock, hdr_page, p = self._sock, self._hdr, self._payload
        if sock is None or hdr_page is None or p is None:
            raise self._closed()
        if self._outstanding:
            raise FrameError(
                f"connection to {self.server_id}: a request is already in flight (one at a time)"
            )
        h, rows, ex, w = check_request(frame, hidden_size=self.hidden_size, dtype=self.dtype)
        if rows is not None:  # the frame's tokens are hidden[rows] (dispatch gathers late)
            h = h.index_select(0, rows.to(h.device))
        n, k = int(h.shape[0]), int(ex.shape[1])
        if n > p.cap_tokens or k > p.cap_k:
            cap_t = p.cap_tokens
            while cap_t < n:
                cap_t *= 2
            p = self._map(min(cap_t, MAX_TOKENS_HARD), max(k, p.cap_k), _KIND_REMAP)
        if n:
            p.req_hidden[:n].copy_(h, non_blocking=True)
            p.req_experts[: n * k].view(n, k).copy_(ex, non_blocking=True)
            p.req_weights[: n * k].view(n, k).copy_(w, non_blocking=True)
            p.sync()  # payload before flag
        hdr = hdr_page.req
        hdr[1], hdr[2], hdr[3], hdr[4] = frame.layer, frame.table_version, n, k
        hdr[5], hdr[6], hdr[7] = self.client_id, frame.seq, self._gen
        self._counter += 1
        hdr[0] = self._counter  # written last: the ready flag
        self._outstanding = True
        try:
            sock.send(_DOORBELL)
        except BlockingIOError:
            pass
        except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError) as e:
            self._outstanding = False
            raise PeerDeadError(
                f"expert server {self.server_id} at {self.endpoint} is gone: {e}"
            ) from None

    def _drain(self) -> None:
        sock = self._sock
        if sock is None:
            raise self._closed()
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

    def _response(self) -> ResponseFrame:
        hdr_page, p = self._hdr, self._payload
        if hdr_page is None or p is None:
            raise self._closed()
        hdr = hdr_page.resp
        self._outstanding = False
        status, n = int(hdr[2]), int(hdr[3])
        if status == STATUS_OK:
            return ResponseFrame(int(hdr[5]), int(hdr[1]), status, p.resp_out[:n])
        ln = min(int(hdr[4]), _MSG_BYTES)
        msg = bytes(hdr_page.msg[:ln]).decode("utf-8", "replace")
        return ResponseFrame(int(hdr[5]), int(hdr[1]), status, None, msg)

    def recv(self, deadline: float) -> ResponseFrame:
        """Wait for the response until ``deadline`` (``time.monotonic()``): spin, then block.

        Raises PeerDeadError (server gone), DeadlineExceeded (request stays in flight),
        FrameError (nothing in flight).
        """
        sock, hdr_page = self._sock, self._hdr
        if sock is None or hdr_page is None:
            raise self._closed()
        if not self._outstanding:
            raise FrameError(f"connection to {self.server_id}: recv without a request in flight")
        hdr, want = hdr_page.resp, self._counter
        spin_end = min(time.monotonic() + self.spin_s, deadline)
        while True:
            if hdr[0] == want:
                return self._response()
            if time.monotonic() >= spin_end:
                break
            _yield()
        while True:
            self._drain()
            if hdr[0] == want:
                return self._response()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(
                    f"expert server {self.server_id} at {self.endpoint}: no response before the deadline"
                )
            try:
                select.select([sock], [], [], remaining)
            except ValueError:
                raise PeerDeadError(f"connection to {self.server_id} is closed") from None

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        if self._payload is not None:
            self._payload.release()
            self._payload = None
        if self._hdr is not None:
            self._hdr.release()
            self._hdr = None
        self._outstanding = False


class _Conn:
    __slots__ = (
        "sock", "fileno", "hdr", "payload", "client_id", "last_seen", "in_flight", "ready", "gen"
    )  # fmt: skip

    def __init__(self, sock: socket.socket):
        self.sock, self.fileno = sock, sock.fileno()
        self.hdr: _Headers | None = None
        self.payload: _Payload | None = None
        self.client_id, self.last_seen = -1, 0
        self.in_flight = self.ready = False
        self.gen = 0  # payload generation mapped here


class CudaIpcServerListener(ServerListener):
    """Server end of ``cudaipc:``; accepts host-emulation and CUDA-payload clients alike.

    Args:
        endpoint: ``cudaipc:/path.sock`` (a stale socket file is replaced, a live one raises
            ``OSError(EADDRINUSE)``; unlinked by :meth:`close`).
        hidden_size, dtype: hellos with another size/dtype are refused with a message.
        spin_us: busy-poll time in ``poll`` before blocking.

    A CUDA-payload hello on a server without a GPU is refused ("no CUDA device").
    """

    def __init__(
        self,
        endpoint: str,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        spin_us: float = DEFAULT_SPIN_US,
    ):
        self.endpoint = endpoint
        self.hidden_size, self.dtype = int(hidden_size), dtype
        self.spin_s = spin_us * 1e-6
        self.path = socket_path(endpoint)
        self._conns: dict[int, _Conn] = {}
        self._sel = selectors.DefaultSelector()
        self._remove_stale(self.path)
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, exist_ok=True)
        self._lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._lsock.bind(self.path)
        self._owner_pid = os.getpid()
        self._lsock.listen(128)
        self._lsock.setblocking(False)
        self._sel.register(self._lsock, selectors.EVENT_READ, None)

    @staticmethod
    def _remove_stale(path: str) -> None:
        if not os.path.exists(path):
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.settimeout(0.5)
            probe.connect(path)
        except OSError:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return
        finally:
            probe.close()
        raise OSError(errno.EADDRINUSE, f"another expert server is listening on {path}")

    @property
    def num_connections(self) -> int:
        return sum(1 for c in self._conns.values() if c.ready)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._lsock.accept()
            except OSError:
                return
            sock.setblocking(False)
            conn = _Conn(sock)
            self._conns[conn.fileno] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _drop(self, conn: _Conn) -> None:
        if self._conns.pop(conn.fileno, None) is None:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        if conn.payload is not None:
            conn.payload.release()
            conn.payload = None
        if conn.hdr is not None:
            conn.hdr.release()
            conn.hdr = None
        conn.ready = False

    def _ack(self, conn: _Conn, status: int, msg: str) -> bool:
        try:
            conn.sock.send(_ACK.pack(_KIND_ACK, status) + msg.encode()[:2000])
            return True
        except OSError:
            return False

    def _on_map(self, conn: _Conn, data: bytes, fds: list[int]) -> None:
        try:
            try:
                if len(data) < _HELLO.size:
                    raise FrameError("short hello/remap packet")
                kind, cid, hidden, dcode, cap_t, cap_k, pkind, dev, handle = _HELLO.unpack_from(
                    data
                )
                hello = kind == _KIND_HELLO
                if (hello and conn.hdr is not None) or (not hello and not conn.ready):
                    raise FrameError("hello/remap out of order")
                want_fds = int(hello) + int(pkind == PAYLOAD_HOST)
                if len(fds) != want_fds:
                    raise FrameError(f"expected {want_fds} fds, got {len(fds)}")
                if hidden != self.hidden_size:
                    raise FrameError(f"hidden size {hidden} != server's {self.hidden_size}")
                dtype = CODE_DTYPES.get(dcode)
                if dtype != self.dtype:
                    raise FrameError(f"dtype {dtype} != server's {self.dtype}")
                if not (0 < cap_t <= MAX_TOKENS_HARD and 0 < cap_k <= MAX_K_HARD):
                    raise FrameError(f"bad slot capacity {cap_t} x {cap_k}")
                hdr = conn.hdr
                if hello:
                    if os.fstat(fds[0]).st_size < _HDR_PAGE:
                        raise FrameError("header memfd smaller than one page")
                    hdr = _Headers(
                        mmap.mmap(
                            fds[0], _HDR_PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
                        )
                    )
                total = payload_layout(hidden, dtype, cap_t, cap_k)["total"]
                if pkind == PAYLOAD_HOST:
                    if os.fstat(fds[-1]).st_size < total:
                        raise FrameError("payload memfd smaller than announced")
                    pl = _host_payload(fds[-1], total, hidden, dtype, cap_t, cap_k)
                elif pkind == PAYLOAD_CUDA:
                    if not torch.cuda.is_available():
                        raise FrameError("no CUDA device on this expert server for a cuda payload")
                    pl = _open_cuda_payload(handle, dev, hidden, dtype, cap_t, cap_k)
                else:
                    raise FrameError(f"unknown payload kind {pkind}")
            finally:
                for fd in fds:
                    os.close(fd)  # the mappings hold their own references
        except (FrameError, OSError, ValueError, struct.error, RuntimeError) as e:
            if not conn.ready:
                self._ack(conn, STATUS_BAD_FRAME, str(e))
            self._drop(conn)
            return
        if conn.payload is not None:
            conn.payload.release()
            conn.gen += 1
        conn.payload, conn.hdr, conn.client_id = pl, hdr, cid
        if hello:
            conn.ready = True
            if not self._ack(conn, STATUS_OK, ""):
                self._drop(conn)

    def _read(self, conn: _Conn) -> None:
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
                if conn.fileno not in self._conns:
                    return
                continue
            for fd in fds:
                os.close(fd)
            self._drop(conn)
            return

    def _collect(self) -> list[tuple[_Conn, RequestFrame]]:
        out: list[tuple[_Conn, RequestFrame]] = []
        for conn in list(self._conns.values()):
            hdr_page = conn.hdr
            if not conn.ready or conn.in_flight or hdr_page is None:  # ready: hdr and payload set
                continue
            hdr = hdr_page.req
            c = int(hdr[0])
            if c == conn.last_seen:
                continue
            if int(hdr[7]) != conn.gen:  # the frame is in a newer buffer: read its remap first
                self._read(conn)
                if conn.fileno not in self._conns or int(hdr[7]) != conn.gen:
                    continue
            p = conn.payload
            if p is None:
                continue
            conn.last_seen = c
            conn.in_flight = True
            n, k = int(hdr[3]), int(hdr[4])
            if not (0 <= n <= p.cap_tokens and 0 <= k <= p.cap_k):
                self.respond(
                    conn,
                    ResponseFrame(
                        int(hdr[6]),
                        int(hdr[1]),
                        STATUS_BAD_FRAME,
                        None,
                        f"bad frame size n={n} k={k}",
                    ),
                )
                continue
            frame = RequestFrame(
                client_id=int(hdr[5]),
                layer=int(hdr[1]),
                table_version=int(hdr[2]),
                seq=int(hdr[6]),
                hidden=p.req_hidden[:n],
                experts=p.req_experts[: n * k].view(n, k),
                weights=p.req_weights[: n * k].view(n, k),
            )
            out.append((conn, frame))
        return out

    def poll(self, timeout: float | None) -> Sequence[tuple[object, RequestFrame]]:
        """Ready frames of all clients (spin, then block up to ``timeout``); tensors alias the
        client's payload (CUDA tensors for CUDA-payload clients) until :meth:`respond`."""
        frames = self._collect()
        if frames:
            return frames
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_end = now + (self.spin_s if timeout is None else min(self.spin_s, timeout))
        while time.monotonic() < spin_end:
            frames = self._collect()
            if frames:
                return frames
            _yield()
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            for key, _ in self._sel.select(remaining):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
            frames = self._collect()
            if frames or (deadline is not None and time.monotonic() >= deadline):
                return frames

    def respond(self, conn: object, frame: ResponseFrame) -> None:
        """Copy the output into the client's response slot (stream-synchronised), then the done
        counter, then the doorbell. A vanished client is dropped silently."""
        assert isinstance(conn, _Conn)
        hdr_page, p = conn.hdr, conn.payload
        if conn.fileno not in self._conns or hdr_page is None or p is None:
            return
        hdr = hdr_page.resp
        hdr[1], hdr[2], hdr[5] = frame.layer, frame.status, frame.seq
        if frame.status == STATUS_OK and frame.output is not None:
            n = int(frame.output.shape[0])
            if n:
                p.resp_out[:n].copy_(frame.output, non_blocking=True)
                p.sync()  # payload before flag
            hdr[3], hdr[4] = n, 0
        else:
            msg = frame.message.encode("utf-8")[:_MSG_BYTES]
            hdr_page.msg[: len(msg)] = np.frombuffer(msg, dtype=np.uint8)
            hdr[3], hdr[4] = 0, len(msg)
        hdr[0] = conn.last_seen  # written last: done flag
        conn.in_flight = False
        try:
            conn.sock.send(_DOORBELL)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn)

    def close(self) -> None:
        for conn in list(self._conns.values()):
            self._drop(conn)
        try:
            self._sel.unregister(self._lsock)
        except (KeyError, ValueError):
            pass
        self._sel.close()
        self._lsock.close()
        if os.getpid() == self._owner_pid:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def connect(endpoint: str, server_id: str, **kw) -> CudaIpcClientConnection:
    """Factory hook of :func:`eaas.runtime.transport.factory.connect` for ``cudaipc:``."""
    return CudaIpcClientConnection(endpoint, server_id, **kw)


def listen(endpoint: str, **kw) -> CudaIpcServerListener:
    """Factory hook of :func:`eaas.runtime.transport.factory.listen` for ``cudaipc:``."""
    return CudaIpcServerListener(endpoint, **kw)
