"""Transport interface between attention clients and expert servers.

One MoE layer call from a client to one expert server is a :class:`RequestFrame`; the server
answers with a :class:`ResponseFrame` holding the per-token weighted partial sums of the experts
it was asked to run. Implementations:

* ``unix:PATH`` -> :mod:`eaas.runtime.transport.shm` (same host): request/response slots in
  shared memory (memfd passed over the Unix socket, so nothing can leak in /dev/shm), ready
  flags in the slot header, the socket used only as a doorbell (adaptive wait: spin briefly on
  the flag, then block on the socket) and as the liveness signal (EOF = peer died).
* ``tcp://HOST:PORT`` -> :mod:`eaas.runtime.transport.tcp` (cross host): the same frame, header
  then raw tensor bytes, no pickling.
* ``cudaipc:PATH`` -> :mod:`eaas.runtime.transport.cuda_ipc` (same node, GPU payload in CUDA IPC
  memory, the shm flags) and ``nvshmem:PE`` -> :mod:`eaas.runtime.transport.nvshmem` (across
  nodes); see docs/gpu.md.

Opening a connection by endpoint: :func:`eaas.runtime.transport.factory.connect` /
:func:`~eaas.runtime.transport.factory.listen`. Shared socket bookkeeping (accept, drop, close,
in-flight checks): :mod:`eaas.runtime.transport.sockets`.

Protocol per connection: at most ``slots`` requests in flight (default 1); responses come back
with the request's ``seq``. A dead or broken peer raises :class:`PeerDeadError` promptly; a
missed deadline raises :class:`DeadlineExceeded`. Neither ever hangs the caller.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class TransportError(RuntimeError):
    """Base class of transport failures."""


class PeerDeadError(TransportError):
    """The peer closed the connection or died (EOF, reset, refused)."""


class DeadlineExceeded(TransportError):
    """No response before the caller's deadline."""


class FrameError(TransportError):
    """A frame that violates the protocol (size limits, dtype, shapes)."""


# Wire dtype codes and hard frame limits (shared by every transport).
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
MAX_TOKENS_HARD = 1 << 16
MAX_K_HARD = 1024

# Response status codes.
STATUS_OK = 0
STATUS_NOT_HOSTED = 1  # an expert in the frame is not hosted by this server
STATUS_BAD_FRAME = 2


@dataclass(slots=True)
class RequestFrame:
    """Tokens of one MoE layer sent by one attention client to one expert server.

    Attributes:
        client_id: ``int``, unique per attention client process.
        layer: ``int``, model layer index of the MoE layer.
        table_version: ``int``, routing table version the client used to pick this server.
        seq: ``int``, per-connection sequence number, echoed in the response.
        hidden: ``[n, hidden]`` float32 or bfloat16, contiguous: the tokens' hidden states
            (after the post-attention norm, i.e. the MoE block's input).
        experts: ``[n, k]`` int32 logical expert ids this server must run per token; ``-1`` pads.
        weights: ``[n, k]`` float32 gate weights matching ``experts`` (already scaled by the
            model's routed scaling factor where the model does so); ignored where expert is -1.
        rows: optional ``[n]`` int64 row indices into ``hidden``. When given, ``hidden`` is the
            caller's whole ``[T, hidden]`` batch and the frame's tokens are ``hidden[rows]``: the
            transport gathers them straight into its send buffer (one copy, no intermediate
            tensor). ``None`` (default): the frame's tokens are all of ``hidden``.
    """

    client_id: int
    layer: int
    table_version: int
    seq: int
    hidden: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor
    rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.hidden.shape[0] if self.rows is None else self.rows.shape[0])

    def token_hidden(self) -> torch.Tensor:
        """``[n, hidden]`` hidden states of the frame's tokens (gathers ``hidden[rows]``)."""
        return self.hidden if self.rows is None else self.hidden.index_select(0, self.rows)


@dataclass(slots=True)
class ResponseFrame:
    """Answer to one :class:`RequestFrame`.

    Attributes:
        seq: the request's ``seq``.
        layer: the request's ``layer``.
        status: ``STATUS_OK`` or an error code; ``message`` explains errors.
        output: ``[n, hidden]``, same dtype as the request's hidden: per token
            ``sum_j weights[t, j] * E_{experts[t, j]}(hidden[t])`` over non-padding ``j``.
    """

    seq: int
    layer: int
    status: int
    output: torch.Tensor | None
    message: str = ""


def check_request(
    frame: RequestFrame, *, hidden_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Validate a request frame's tensors and bring experts / weights to wire form.

    Checks shapes and dtypes only (a few attribute reads, no pass over the data).

    Args:
        frame: ``hidden`` ``[n, hidden_size]`` (or ``[T, hidden_size]`` with ``rows`` ``[n]``
            int64) in ``dtype``; ``experts`` and ``weights`` ``[n, k]`` (or ``[n]`` for k = 1),
            any int / float dtype.
        hidden_size, dtype: what the connection was opened with.

    Returns:
        ``(hidden, rows, experts [n, k] int32, weights [n, k] float32)``: ``hidden`` and
        ``rows`` as given (``hidden[rows]``, or all of ``hidden`` when ``rows`` is None, are the
        frame's tokens).

    Raises:
        FrameError: wrong shapes or dtype, or ``n``/``k`` above ``MAX_TOKENS_HARD``/``MAX_K_HARD``.
    """
    h, ex, w, rows = frame.hidden, frame.experts, frame.weights, frame.rows
    if h.dim() != 2 or h.shape[1] != hidden_size:
        raise FrameError(f"hidden must be [n, {hidden_size}], got {tuple(h.shape)}")
    if h.dtype != dtype:
        raise FrameError(f"hidden dtype {h.dtype} != connection dtype {dtype}")
    if rows is None:
        n = int(h.shape[0])
    else:
        if rows.dim() != 1 or rows.dtype != torch.int64:
            raise FrameError(f"rows must be [n] int64, got {tuple(rows.shape)} {rows.dtype}")
        n = int(rows.shape[0])
    if ex.dim() == 1:
        ex = ex.unsqueeze(1)
    if w.dim() == 1:
        w = w.unsqueeze(1)
    if ex.shape[0] != n or w.shape != ex.shape:
        raise FrameError(
            f"experts {tuple(ex.shape)} / weights {tuple(w.shape)} must both be [{n}, k]"
        )
    k = int(ex.shape[1])
    if n > MAX_TOKENS_HARD or k > MAX_K_HARD:
        raise FrameError(
            f"frame of {n} tokens x k={k} exceeds the limit {MAX_TOKENS_HARD} x {MAX_K_HARD}"
        )
    if ex.dtype != torch.int32:
        ex = ex.to(torch.int32)
    if w.dtype != torch.float32:
        w = w.to(torch.float32)
    return h, rows, ex, w


def parts_frame(
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
) -> RequestFrame:
    """The :class:`RequestFrame` of :meth:`ClientConnection.send_parts`'s arguments, checked
    against its ``(n, k)``: ``experts`` and ``weights`` 2-D with ``k`` columns, ``n`` tokens.
    The frame's own checks (:func:`check_request`) are the transport's ``send``'s.

    Raises:
        FrameError: the tensors disagree with ``(n, k)``.
    """
    frame = RequestFrame(client_id, layer, table_version, seq, hidden, experts, weights, rows)
    if experts.dim() != 2 or weights.dim() != 2:
        raise FrameError(
            f"send_parts takes experts / weights [n, k], got {tuple(experts.shape)} / "
            f"{tuple(weights.shape)}"
        )
    if frame.num_tokens != n or experts.shape[1] != k:
        raise FrameError(f"n={n}, k={k} do not match the frame's tensors")
    return frame


class ClientConnection(abc.ABC):
    """Client end of one connection to one expert server."""

    server_id: str
    endpoint: str

    @abc.abstractmethod
    def send(self, frame: RequestFrame, deadline: float | None = None) -> None:
        """Write ``frame`` to the server.

        One request in flight per connection: call :meth:`recv` before the next ``send``.
        ``deadline`` (``time.monotonic()`` seconds, optional) bounds a write that blocks on a
        full socket buffer (TCP); the shm transport never blocks on the data path.

        Raises :class:`PeerDeadError`, :class:`FrameError` (shapes/dtype/limits, or a request
        already in flight) or :class:`DeadlineExceeded` (peer not reading).
        """

    def send_deferred(self, frame: RequestFrame) -> None:
        """Write ``frame`` like :meth:`send` but do not wake the server yet: :meth:`ring` does.

        A caller with frames for several servers writes all of them first and then rings every
        server, so a woken server cannot take the caller's CPU before the last frame is written
        (on an oversubscribed host the wake-up preempts the writer). :meth:`recv` rings a
        frame that was never rung, so a forgotten :meth:`ring` costs latency, never a hang.
        Default: plain :meth:`send` (transports whose send is the wake-up, e.g. TCP).

        Raises: as :meth:`send`.
        """
        self.send(frame)

    def ring(self) -> None:
        """Wake the server for the frame written by :meth:`send_deferred` (no-op when there is
        none, or when the transport's send already woke it). Raises :class:`PeerDeadError`."""
        return None

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
        """:meth:`send` (``ring``) or :meth:`send_deferred` of the frame with these fields (as
        :class:`RequestFrame`), for a caller that built them to the frame's shapes: ``n``
        tokens (``rows.shape[0]``, or ``hidden.shape[0]`` when ``rows`` is None) x ``k``, with
        ``experts`` / ``weights`` ``[n, k]`` (2-D, also for k = 1). A transport may skip
        per-frame work with them (the shared-memory transport finds the frame's plan by
        ``(n, k)`` and builds no frame object). Default: build the frame, check it against
        ``(n, k)`` (:func:`parts_frame`) and send it, validated.

        Raises: as :meth:`send`; FrameError also when the tensors disagree with ``(n, k)``
        (checked for every frame here, for the first frame of each ``(n, k)`` where a
        transport skips the per-frame work)."""
        frame = parts_frame(
            client_id, layer, table_version, seq, hidden, experts, weights, rows, n, k
        )
        if ring:
            self.send(frame)
        else:
            self.send_deferred(frame)

    @abc.abstractmethod
    def recv(self, deadline: float) -> ResponseFrame:
        """Wait for the next response until ``deadline`` (``time.monotonic()`` seconds).

        The returned ``output`` may alias transport buffers: copy it before the next ``send``.
        The frame object itself may be reused by the connection's next ``recv`` (the shared-memory
        transport does: no allocation per frame): read its fields before then.
        Raises :class:`PeerDeadError` or :class:`DeadlineExceeded`.
        """

    @abc.abstractmethod
    def close(self) -> None: ...


class ServerListener(abc.ABC):
    """Server end: accepts client connections and yields their ready frames."""

    endpoint: str

    @abc.abstractmethod
    def poll(self, timeout: float | None) -> Sequence[tuple[object, RequestFrame]]:
        """Return every ready frame of every connected client as ``(conn_handle, frame)``.

        Spins briefly, then blocks up to ``timeout`` seconds (``None`` = forever) without
        burning CPU. Accepts new connections and drops dead ones as a side effect. The frame's
        tensors may alias transport buffers and stay valid until ``respond`` on that handle; the
        frame object may be reused for that connection's next frame (after ``respond``).
        """

    @abc.abstractmethod
    def respond(self, conn: object, frame: ResponseFrame) -> None:
        """Send ``frame`` back on ``conn``; a dead client is dropped silently."""

    def respond_ok(self, conn: object, request: RequestFrame, output: torch.Tensor) -> None:
        """Answer ``request`` (a frame :meth:`poll` returned with ``conn``) with ``output``
        ``[n, H]`` (the request's dtype) and ``STATUS_OK``: the same as ``respond(conn,
        ResponseFrame(request.seq, request.layer, STATUS_OK, output))``, which a transport may do
        without building the frame (the expert server's answer path). Reads only ``request.seq``
        and ``request.layer``."""
        self.respond(conn, ResponseFrame(request.seq, request.layer, STATUS_OK, output))

    @abc.abstractmethod
    def close(self) -> None: ...
