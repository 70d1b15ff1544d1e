"""Cross-node GPU transport over NVSHMEM (nvshmem4py): put-with-signal into symmetric slots.

Endpoint: ``nvshmem:PE`` (the server's processing element number in the NVSHMEM world).

Slots (same protocol as ``shm`` / ``cudaipc``, symmetric memory instead of a memfd)
-------------------------------------------------------------------------------
Every PE allocates the same symmetric objects at start-up (collective), sized by
:class:`WorldSpec`: for each of ``max_pes`` peers one request slot and one response slot, each
``[header int64[8] | hidden [cap_tokens, H] | experts int32 | weights float32]`` (response:
``[header | output [cap_tokens, H]]``) as ONE contiguous byte region, plus one 8-byte signal
word per slot (``req_sig[peer]``, ``resp_sig[peer]``). The client writes the frame (header
first, same fields as ``shm``) into a local staging copy, then one
``nvshmem.core.put_signal(dst=server.req_slot[my_pe], src=staging, signal_var=req_sig[my_pe],
signal_val=counter, SIGNAL_SET, remote_pe=server, stream)``: payload and flag in one
GPU-initiated operation (IBGDA when ``NVSHMEM_IB_ENABLE_IBGDA=1`` and the NIC supports it,
set by :func:`ibgda_env`). The server answers the same way into the client's response slot.

Deadlines: waits never use ``signal_wait`` on a stream (it has no timeout). The host polls the
local signal word (``signal_fetch``) until the caller's deadline, raising
:class:`DeadlineExceeded` exactly like ``shm``; a graph-captured round trip uses the bounded
``eaas_wait_flag`` kernel (``native/eaas_signal.cu``) on the signal's local address instead.
A timed-out server is therefore reported to the dispatcher as today. What NVSHMEM cannot give
is a prompt :class:`PeerDeadError`: there is no socket EOF, and a put to a dead PE may abort the
job at the transport level. See docs/gpu.md "Elastic membership".

Elastic membership (the choice, implemented by :class:`PeMembership`)
--------------------------------------------------------------------
NVSHMEM's PE set is fixed at ``nvshmem.core.init``. EaaS starts the world with **spare PEs**:
``max_pes`` = clients + servers + spares, every spare an idle expert-server process already in
the world. A server *joins* by taking a spare PE (the operator assigns it experts; the routing
table then lists ``nvshmem:PE``); a server *leaves* by being removed from the routing table
(make-before-break, as today) and its PE returning to the spare pool; a dead PE is retired
(never reused in this world). When the spares run out, the operator starts a **new world** (a
re-init: new UID, new processes) and moves clients to it by routing-table version, again make
before break. Teams per connection group were rejected: teams are subsets of an existing world,
so they cannot add a PE either.

Who creates the world: every member process (attention clients, expert servers, spares) gets
``--nvshmem-world SIZE --nvshmem-pe PE --nvshmem-uid-file PATH`` (or the env vars of
:func:`world_env`; PE numbers from :class:`WorldLayout`: clients, then servers, then spares);
PE 0 makes the unique id and writes it to the file, the others read it (:func:`exchange_uid`),
then each calls :func:`open_world`. ``eaas expert-server --listen nvshmem:PE`` and
``eaas attention-client`` build the world before their listener / dispatcher.

Nothing in this module has run on a GPU yet (no task had one); :class:`PeMembership`,
:class:`WorldLayout`, :class:`WorldConfig`, :func:`world_env` and :func:`exchange_uid` are tested
on the CPU. Importing the module needs neither nvshmem4py nor a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from eaas.runtime.cuda import GpuUnavailableError
from eaas.runtime.options.nvshmem_world import (  # noqa: F401  (re-exported: pure side)
    ENV_PE,
    ENV_UID_FILE,
    ENV_WORLD_SIZE,
    MembershipError,
    PeMembership,
    WorldConfig,
    WorldLayout,
    check_listen_pe,
    ibgda_env,
    parse_endpoint,
    world_env,
)
from eaas.runtime.transport.base import (
    DTYPE_CODES,
    STATUS_OK,
    ClientConnection,
    DeadlineExceeded,
    FrameError,
    RequestFrame,
    ResponseFrame,
    ServerListener,
    check_request,
)


def nvshmem_unavailable_reason() -> str | None:
    """Why an NVSHMEM world cannot be created here (None when it can): nvshmem4py not
    installed, or no CUDA device. Imports nothing heavy beyond ``importlib.util``."""
    try:
        found = importlib.util.find_spec("nvshmem.core") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return (
            "the NVSHMEM world needs nvshmem4py (pip install 'eaas[gpu]'), which is not installed"
        )
    if not torch.cuda.is_available():
        return "the NVSHMEM world needs a CUDA device (torch.cuda.is_available() is False)"
    return None


def exchange_uid(config: WorldConfig, make_uid, *, timeout: float = 300.0) -> bytes:
    """The world's unique id as bytes: PE 0 makes it (``make_uid() -> bytes``) and writes
    ``config.uid_file`` atomically (temp file + rename); the others wait for the file.

    Raises:
        TimeoutError: the file did not appear within ``timeout`` seconds.
    """
    path = config.uid_file
    if config.pe == 0:
        uid = bytes(make_uid())
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(uid)
        os.replace(tmp, path)
        return uid
    end = time.monotonic() + timeout
    while True:
        try:
            with open(path, "rb") as f:
                data = f.read()
            if data:
                return data
        except FileNotFoundError:
            pass
        if time.monotonic() >= end:
            raise TimeoutError(f"NVSHMEM unique id file {path} did not appear in {timeout:.0f} s")
        time.sleep(0.05)


def open_world(config: WorldConfig, spec: WorldSpec) -> NvshmemWorld:
    """Join the world: exchange the unique id through ``config.uid_file``, ``nvshmem.core.init``
    with this PE, allocate the symmetric slots of ``spec``.

    Raises:
        GpuUnavailableError: no nvshmem4py or no GPU (:func:`nvshmem_unavailable_reason`).
        TimeoutError: PE 0 never wrote the unique id.
    """
    reason = nvshmem_unavailable_reason()
    if reason is not None:
        raise GpuUnavailableError(reason)
    if spec.max_pes != config.world_size:
        raise MembershipError(f"spec.max_pes {spec.max_pes} != world size {config.world_size}")
    nvs = _nvshmem()
    # nvshmem4py's UID example: get_unique_id() on one rank, get_unique_id(empty=True) on the
    # others, the bytes of ``uid._data`` moved by the launcher (here: the uid file)
    made = []

    def make() -> bytes:
        made.append(nvs.get_unique_id())
        return made[0]._data.view(np.uint8).tobytes()

    raw = exchange_uid(config, make)
    if made:  # PE 0: the id it wrote
        uid = made[0]
    else:
        uid = nvs.get_unique_id(empty=True)
        uid._data.view(np.uint8)[:] = np.frombuffer(raw, dtype=np.uint8)
    return NvshmemWorld(spec, config.pe, config.world_size, uid)


@dataclass(frozen=True)
class WorldSpec:
    """Sizes of the symmetric slots every PE allocates (identical on all PEs)."""

    max_pes: int
    hidden_size: int
    dtype: torch.dtype
    cap_tokens: int = 256
    cap_k: int = 8

    def request_bytes(self) -> int:
        esz = torch.empty((), dtype=self.dtype).element_size()
        return 64 + self.cap_tokens * self.hidden_size * esz + 2 * self.cap_tokens * self.cap_k * 4

    def response_bytes(self) -> int:
        esz = torch.empty((), dtype=self.dtype).element_size()
        return 64 + 1024 + self.cap_tokens * self.hidden_size * esz


def _nvshmem():
    try:
        import nvshmem.core as nvs  # optional dependency (nvshmem4py): only an NVSHMEM world
    except ImportError as e:
        raise GpuUnavailableError(
            f"nvshmem transport needs nvshmem4py ({e}): pip install 'eaas[gpu]'"
        ) from None
    if not torch.cuda.is_available():
        raise GpuUnavailableError("nvshmem transport needs a CUDA device")
    return nvs


class NvshmemWorld:
    """This process's PE in an initialised NVSHMEM world and its symmetric slots.

    Args:
        spec: slot sizes (same on every PE).
        rank, nranks: this PE and the world size (``nranks == spec.max_pes``).
        uid: the world's ``nvshmem.core.UniqueID`` (made by rank 0, distributed out of band by
            the operator / launcher).

    Raises GpuUnavailableError without nvshmem4py or a GPU.
    """

    def __init__(self, spec: WorldSpec, rank: int, nranks: int, uid) -> None:
        nvs = _nvshmem()
        from cuda.core.experimental import Device  # optional (cuda-python): a GPU world only

        if nranks != spec.max_pes:
            raise MembershipError(f"nranks {nranks} != spec.max_pes {spec.max_pes}")
        dev = Device(torch.cuda.current_device())
        dev.set_current()
        nvs.init(device=dev, uid=uid, rank=rank, nranks=nranks, initializer_method="uid")
        self.nvs, self.spec, self.rank = nvs, spec, rank
        P = spec.max_pes
        self.req = nvs.tensor((P, spec.request_bytes()), dtype=torch.uint8)
        self.resp = nvs.tensor((P, spec.response_bytes()), dtype=torch.uint8)
        self.req_sig = [nvs.buffer(8) for _ in range(P)]
        self.resp_sig = [nvs.buffer(8) for _ in range(P)]
        self.stream = dev.create_stream()

    def put_signal(self, dst_row: torch.Tensor, src: torch.Tensor, sig, value: int, pe: int):
        """Copy ``src`` into ``dst_row`` on PE ``pe`` and set its signal to ``value`` (one op)."""
        self.nvs.put_signal(dst_row, src, sig, value, self.nvs.SignalOp.SIGNAL_SET, pe, self.stream)

    def wait_signal(self, sig, want: int, deadline: float, what: str) -> None:
        """Host-poll a local signal word until it equals ``want`` or ``deadline`` passes."""
        while self.nvs.signal_fetch(sig) != want:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"{what}: no signal before the deadline")
            os.sched_yield()

    def finalize(self) -> None:
        self.nvs.finalize()


class NvshmemClientConnection(ClientConnection):
    """Client end of ``nvshmem:PE`` inside an :class:`NvshmemWorld` (``world=`` keyword)."""

    def __init__(self, endpoint: str, server_id: str, *, hidden_size: int, dtype, world=None, **_):
        if world is None:
            raise FrameError("nvshmem endpoints need world=NvshmemWorld(...) (docs/gpu.md)")
        if dtype not in DTYPE_CODES or dtype != world.spec.dtype:
            raise FrameError(f"dtype {dtype} != the world's {world.spec.dtype}")
        self.endpoint, self.server_id, self.world = endpoint, server_id, world
        self.pe = parse_endpoint(endpoint)
        self.hidden_size, self.dtype = int(hidden_size), dtype
        self._counter, self._outstanding = 0, False
        self._staging = torch.zeros(world.spec.request_bytes(), dtype=torch.uint8, device="cuda")

    #: frames are staged in GPU memory: the dispatcher keeps hidden states on the GPU
    #: (:mod:`eaas.runtime.client.dispatch.staging`)
    device_payload = True

    def send(self, frame: RequestFrame, deadline: float | None = None) -> None:
        if self._outstanding:
            raise FrameError(f"connection to {self.server_id}: a request is already in flight")
        h, rows, ex, w = check_request(frame, hidden_size=self.hidden_size, dtype=self.dtype)
        if rows is not None:  # the frame's tokens are hidden[rows] (dispatch gathers late)
            h = h.index_select(0, rows.to(h.device))
        n, k = int(h.shape[0]), int(ex.shape[1])
        spec = self.world.spec
        if n > spec.cap_tokens or k > spec.cap_k:
            raise FrameError(
                f"frame {n} x {k} exceeds the world's slot {spec.cap_tokens} x {spec.cap_k}"
            )
        self._counter += 1
        hdr = torch.tensor(
            [self._counter, frame.layer, frame.table_version, n, k, self.world.rank, frame.seq, 0]
        )
        st = self._staging
        esz = h.element_size()
        st[:64].view(torch.int64).copy_(hdr)
        off = 64
        st[off : off + n * self.hidden_size * esz].view(self.dtype).view(n, -1).copy_(h)
        off += spec.cap_tokens * self.hidden_size * esz
        st[off : off + n * k * 4].view(torch.int32).copy_(ex.reshape(-1))
        off += spec.cap_tokens * spec.cap_k * 4
        st[off : off + n * k * 4].view(torch.float32).copy_(w.reshape(-1))
        torch.cuda.current_stream().synchronize()
        me = self.world.rank
        self.world.put_signal(
            self.world.req[me], st, self.world.req_sig[me], self._counter, self.pe
        )
        self._outstanding = True

    def recv(self, deadline: float) -> ResponseFrame:
        if not self._outstanding:
            raise FrameError(f"connection to {self.server_id}: recv without a request in flight")
        wd = self.world
        wd.wait_signal(
            wd.resp_sig[self.pe], self._counter, deadline, f"expert server {self.server_id}"
        )
        self._outstanding = False
        row = wd.resp[self.pe]
        hdr = row[:64].view(torch.int64).tolist()
        status, n = int(hdr[2]), int(hdr[3])
        if status != STATUS_OK:
            msg = bytes(row[64 : 64 + int(hdr[4])].tolist()).decode("utf-8", "replace")
            return ResponseFrame(int(hdr[5]), int(hdr[1]), status, None, msg)
        esz = torch.empty((), dtype=self.dtype).element_size()
        out = row[1088 : 1088 + n * self.hidden_size * esz].view(self.dtype).view(n, -1)
        return ResponseFrame(int(hdr[5]), int(hdr[1]), status, out)

    def close(self) -> None:
        self._outstanding = False


def connect(endpoint: str, server_id: str, **kw) -> NvshmemClientConnection:
    """Factory hook of :func:`eaas.runtime.transport.factory.connect` for ``nvshmem:``."""
    parse_endpoint(endpoint)
    return NvshmemClientConnection(endpoint, server_id, **kw)


#: A request's connection handle: (client PE, the value of its request signal).
_Handle = tuple[int, int]


class NvshmemServerListener(ServerListener):
    """Server end of ``nvshmem:PE``: polls the request signal of every peer PE of the world.

    Args:
        endpoint: ``nvshmem:PE`` with this process's PE (must equal ``world.rank``).
        world: this process's :class:`NvshmemWorld`.
        hidden_size, dtype: must match the world's :class:`WorldSpec`.
        spin_us: busy-poll time before backing off to short sleeps (no socket to block on).

    ``poll`` reads each peer's local signal word (``signal_fetch``); a new value means a frame
    in that peer's request row. ``respond`` stages the answer and put-with-signals it into the
    client's response row for this PE.
    """

    def __init__(
        self, endpoint: str, *, hidden_size: int, dtype, world=None, spin_us: float = 80.0
    ):
        if world is None:
            raise FrameError("nvshmem endpoints need world=NvshmemWorld(...) (docs/gpu.md)")
        if parse_endpoint(endpoint) != world.rank:
            raise FrameError(f"{endpoint} is not this process's PE {world.rank}")
        if dtype != world.spec.dtype or int(hidden_size) != world.spec.hidden_size:
            raise FrameError("hidden size / dtype differ from the world's slots")
        self.endpoint, self.world, self.dtype = endpoint, world, dtype
        self.hidden_size = int(hidden_size)
        self.spin_s = spin_us * 1e-6
        self.last_seen = [0] * world.spec.max_pes
        self.in_flight = [False] * world.spec.max_pes
        self._staging = torch.zeros(world.spec.response_bytes(), dtype=torch.uint8, device="cuda")

    def _collect(self) -> list[tuple[_Handle, RequestFrame]]:
        wd, spec = self.world, self.world.spec
        out: list[tuple[_Handle, RequestFrame]] = []
        esz = torch.empty((), dtype=self.dtype).element_size()
        for pe in range(spec.max_pes):
            if pe == wd.rank or self.in_flight[pe]:
                continue
            c = wd.nvs.signal_fetch(wd.req_sig[pe])
            if c == self.last_seen[pe]:
                continue
            self.last_seen[pe], self.in_flight[pe] = c, True
            row = wd.req[pe]
            hdr = row[:64].view(torch.int64).tolist()
            n, k = int(hdr[3]), int(hdr[4])
            off = 64
            hidden = row[off : off + n * self.hidden_size * esz].view(self.dtype).view(n, -1)
            off += spec.cap_tokens * self.hidden_size * esz
            experts = row[off : off + n * k * 4].view(torch.int32).view(n, k)
            off += spec.cap_tokens * spec.cap_k * 4
            weights = row[off : off + n * k * 4].view(torch.float32).view(n, k)
            frame = RequestFrame(int(hdr[5]), int(hdr[1]), int(hdr[2]), int(hdr[6]), hidden,
                                 experts, weights)  # fmt: skip
            out.append(((pe, c), frame))
        return out

    def poll(self, timeout: float | None) -> Sequence[tuple[object, RequestFrame]]:
        """Ready frames of all peers: spin ``spin_us``, then poll every 50 us until ``timeout``."""
        end = None if timeout is None else time.monotonic() + timeout
        spin_end = time.monotonic() + self.spin_s
        while True:
            frames = self._collect()
            if frames or (end is not None and time.monotonic() >= end):
                return frames
            if time.monotonic() < spin_end:
                os.sched_yield()
            else:
                time.sleep(50e-6)

    def respond(self, conn: object, frame: ResponseFrame) -> None:
        """Stage ``[header | message | output]`` and put-with-signal it to the client PE."""
        pe, counter = cast(_Handle, conn)  # made by _collect
        st = self._staging
        msg = frame.message.encode("utf-8")[:1024]
        output = frame.output if frame.status == STATUS_OK else None
        n = int(output.shape[0]) if output is not None else 0
        hdr = torch.tensor([counter, frame.layer, frame.status, n, len(msg), frame.seq, 0, 0])
        st[:64].view(torch.int64).copy_(hdr)
        if msg:
            st[64 : 64 + len(msg)].copy_(torch.frombuffer(bytearray(msg), dtype=torch.uint8))
        if output is not None and n:
            esz = output.element_size()
            st[1088 : 1088 + n * self.hidden_size * esz].view(self.dtype).view(n, -1).copy_(output)
        torch.cuda.current_stream().synchronize()
        wd = self.world
        wd.put_signal(wd.resp[wd.rank], st, wd.resp_sig[wd.rank], counter, pe)
        self.in_flight[pe] = False

    def close(self) -> None:
        self.in_flight = [False] * len(self.in_flight)


def listen(endpoint: str, **kw) -> NvshmemServerListener:
    """Factory hook of :func:`eaas.runtime.transport.factory.listen` for ``nvshmem:``."""
    parse_endpoint(endpoint)
    return NvshmemServerListener(endpoint, **kw)
