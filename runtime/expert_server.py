"""Expert server: a stateless process hosting a set of ``(layer, logical expert)`` weights.

Loop (see DESIGN.md "Data plane protocol", steps 4-5):

1. ``listener.poll`` gathers the ready frames of *all* connected attention clients (dynamic
   batching; optional ``batch_window_us`` keeps gathering for a short while after the first
   frame).
2. Frames are grouped by layer. A frame naming an expert this server does not host gets a
   ``STATUS_NOT_HOSTED`` response (message names the experts) and is left out; a malformed one
   gets ``STATUS_BAD_FRAME``. The server never crashes on a client's input.
3. Per layer, the frames' tokens are concatenated and every hosted expert of that layer that
   got tokens runs ONCE on the union of its tokens (sort-based grouping; only experts with
   tokens are touched, the CPU analog of the paper's "kernel shrinking"); on the CPU the layer's
   experts are stacked (:class:`LayerStack`) and run as two ``grouped_mm`` calls. With the weights on a
   CUDA device the native grouped kernels run instead (:mod:`eaas.runtime.gpu.grouped`: one
   launch sequence per layer, compact group metadata computed on the device).
4. The output ``[N, H]`` is split back per frame and each client gets its rows.

Hosted experts may change while serving (:meth:`ExpertServer.add_experts` /
:meth:`ExpertServer.drop_experts`, copy-on-write: each batch runs on one consistent snapshot):
with ``--push-token-file`` or ``--routing-table-configmap`` and no ``--experts`` the server
starts empty and learns its experts from the routing table (:func:`learn_from_table`,
:mod:`eaas.runtime.assignment`).

Metrics (:mod:`eaas.runtime.metrics`): ``EXPERT_TOKENS{layer,expert}`` (expert load; added at
most every ``LOAD_METRICS_FLUSH_S`` while busy and when idle, see
:meth:`ExpertServer.flush_load_metrics`),
``SERVER_BATCH_TOKENS`` (tokens per per-layer dynamic batch), ``SERVER_FRAMES``.

Run it with ``eaas expert-server`` (checkpoint weights) or, for tests and benchmarks,
``python -m eaas.runtime.expert_server --random HIDDEN:INTER:SEED ...`` (random weights).
Readiness: the process prints ``expert-server <id> ready on <endpoint> hosting <N> experts``
to stdout (flushed) once the listener accepts connections and the serving loop has started (so
``/health`` answers 200 from then on); the Unix socket file / TCP port accepting connections is
an equivalent signal for the data plane. No separate marker file.
"""

from __future__ import annotations

import functools
import gc
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from eaas.runtime.experts import ExpertWeights, expert_forward
from eaas.runtime.metrics import EXPERT_TOKENS, SERVER_BATCH_TOKENS, SERVER_FRAMES
from eaas.runtime.models.compute import ComputeChoice, decide_compute
from eaas.runtime.transport.base import (
    STATUS_BAD_FRAME,
    STATUS_NOT_HOSTED,
    RequestFrame,
    ResponseFrame,
)
from eaas.runtime.transport.factory import listen

GROUPED_MM_MAX_PAIRS = 1024  # grouped_expert_sum: grouped_mm up to this many pairs, else the loop
LOAD_METRICS_FLUSH_S = 0.05  # a busy server adds its expert loads to EXPERT_TOKENS this often


@dataclass(frozen=True)
class LayerStack:
    """One layer's hosted experts stacked for ``torch.nn.functional.grouped_mm`` (CPU).

    Each hosted :class:`ExpertWeights` of the layer is rebound to views of these tensors
    (:meth:`build`), so the stack costs no second copy of the weights.

    Attributes:
        gate_up: ``[G, 2I, H]``: hosted expert ``g``'s gate rows then up rows.
        down: ``[G, H, I]``.
        experts: ``{expert id: ExpertWeights}`` whose tensors are views of the stack.
        ids: the hosted expert ids in group order (ascending).
        group_of: ``[max hosted id + 2]`` int64: ``group_of[id + 1]`` is ``id``'s group; the
            padding id ``-1`` and ids not hosted map to ``G`` (a last group that is never run).
        gate_up_t: ``gate_up.transpose(1, 2)``, ``[G, H, 2I]`` (the ``grouped_mm`` operand).
        down_t: ``down.transpose(1, 2)``, ``[G, I, H]``.
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    experts: Mapping[int, ExpertWeights]
    ids: tuple[int, ...]
    group_of: torch.Tensor
    gate_up_t: torch.Tensor
    down_t: torch.Tensor

    @classmethod
    def build(cls, experts: Mapping[int, ExpertWeights]) -> LayerStack:
        ids = sorted(experts)
        n = int(experts[ids[0]].gate.shape[0])  # I
        gate_up = torch.stack([torch.cat([experts[e].gate, experts[e].up]) for e in ids])
        down = torch.stack([experts[e].down for e in ids])  # (G, H, I)
        group_of = torch.full((ids[-1] + 2,), len(ids), dtype=torch.int64)
        group_of[torch.tensor(ids) + 1] = torch.arange(len(ids))
        views = {
            e: ExpertWeights(gate_up[g, :n], gate_up[g, n:], down[g]) for g, e in enumerate(ids)
        }
        return cls(
            gate_up,
            down,
            views,
            tuple(ids),
            group_of,
            gate_up.transpose(1, 2),
            down.transpose(1, 2),
        )

    @functools.cached_property
    def usable(self) -> bool:
        """Whether this torch's ``grouped_mm`` takes this stack on the CPU (one row through
        both projections, tried once). It does not for every dtype and shape: torch 2.15 wants
        each row's bytes a multiple of 16 ("strides should be multiple of 16 bytes": bf16
        hidden / intermediate sizes not a multiple of 8, fp32 not of 4), and older versions
        have no CPU kernel."""
        n_i = int(self.down.shape[2])
        x = torch.zeros(1, int(self.down.shape[1]), dtype=self.down.dtype)  # (1, H)
        offs = torch.ones(int(self.gate_up.shape[0]), dtype=torch.int32)  # the row in group 0
        try:
            gu = F.grouped_mm(x, self.gate_up_t, offs=offs)  # (1, 2I)
            y = F.grouped_mm(F.silu(gu[:, :n_i]), self.down_t, offs=offs)
        except (AttributeError, RuntimeError, TypeError, NotImplementedError):
            return False
        return tuple(y.shape) == tuple(x.shape)


def grouped_expert_sum(
    hidden: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    hosted: Mapping[int, ExpertWeights],
    stack: LayerStack | None = None,
) -> tuple[torch.Tensor, dict[int, int]]:
    """Per-token weighted sum of selected experts; each expert runs once on all of its tokens.

    Same result as :func:`eaas.runtime.experts.weighted_expert_sum` (experts accumulated in
    ascending id order), but groups without Python work per token: one stable argsort of the
    pairs by expert, ``bincount`` for the group sizes, one gather of the hidden rows, each
    expert run on a contiguous slice, one weighted ``index_add_`` back. With ``stack`` and at
    most :data:`GROUPED_MM_MAX_PAIRS` pairs the experts run as two ``grouped_mm`` calls over
    all groups (gate and up in one, then down) instead of a Python loop of three matmuls per
    expert: equal up to the BLAS kernel's rounding, 15-30% less time at 16-1024 pairs on this
    CPU (torch 2.15; above ~2048 pairs its CPU grouped_mm was slower than the loop). The
    weighted sum is accumulated in float32 and rounded once (bfloat16 activations: at least as
    accurate as the per-expert reference, which rounds after every expert).

    Args:
        hidden: ``[N, H]`` float32/bfloat16 (dtype of the weights).
        experts: ``[N, k]`` int logical expert ids; ``-1`` = padding.
        weights: ``[N, k]`` float32 gate weights.
        hosted: expert id -> weights (this layer's hosted experts). Every non-negative id in
            ``experts`` must be a key (the caller checks).
        stack: ``hosted`` stacked (:class:`LayerStack`), or None for the per-expert loop (also
            taken when ``grouped_mm`` cannot run on the stack: :attr:`LayerStack.usable`).

    Returns:
        ``(out [N, H] same dtype as hidden, tokens_per_expert {expert id: token count})``.
    """
    n, k = experts.shape
    if n == 0 or k == 0:
        return torch.zeros_like(hidden), {}
    if (
        stack is not None
        # real pairs: merged frames of different k carry padding (counted only when it matters)
        and (n * k <= GROUPED_MM_MAX_PAIRS or int((experts >= 0).sum()) <= GROUPED_MM_MAX_PAIRS)
        and stack.usable
    ):
        return _stacked_expert_sum(hidden, experts, weights, stack)
    flat = experts.reshape(-1).to(torch.int64)  # (n*k,)
    pos = (flat >= 0).nonzero().squeeze(1)  # (P,) flat positions of real pairs
    if pos.numel() == 0:
        return torch.zeros_like(hidden), {}
    ev = flat.index_select(0, pos)  # (P,) expert per pair
    order = torch.argsort(ev, stable=True)  # pairs grouped by expert, token order kept
    pos = pos.index_select(0, order)  # (P,)
    counts = torch.bincount(ev)  # (E,) pairs per expert id
    tok = torch.div(pos, k, rounding_mode="floor")  # (P,) token of each grouped pair
    xs = hidden.index_select(0, tok)  # (P, H) one gather for all experts
    present = counts.nonzero().squeeze(1)
    loads = dict(zip(present.tolist(), counts.index_select(0, present).tolist(), strict=True))
    ys = torch.empty_like(xs)  # (P, H)
    start = 0
    for e, c in loads.items():  # loop over experts, contiguous slices, no per-token work
        ys[start : start + c] = expert_forward(xs[start : start + c], hosted[e])
        start += c
    return _weighted_sum(ys, weights, pos, tok, n, hidden.dtype), loads


def _weighted_sum(
    ys: torch.Tensor,
    weights: torch.Tensor,
    pairs: torch.Tensor,
    tok: torch.Tensor,
    n: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``out[t] = sum over grouped pairs p of token t: weights.flat[pairs[p]] * ys[p]``,
    accumulated in float32 (a no-op cast for float32 activations) and rounded once to ``dtype``.

    ``ys`` ``[P, H]`` expert outputs in group order (ascending expert id, token order kept);
    ``pairs`` ``[P]`` each grouped pair's flat position in ``weights`` ``[n, k]``; ``tok`` ``[P]``
    its token. ``index_add_`` walks the pairs in order: per token, experts are added in ascending
    id order. Returns ``[n, H]`` in ``dtype``."""
    acc = ys.float() if ys.dtype != torch.float32 else ys  # (P, H) float32
    acc.mul_(weights.reshape(-1).index_select(0, pairs).to(torch.float32).unsqueeze(1))
    out32 = torch.zeros((n, ys.shape[1]), dtype=torch.float32)
    out32.index_add_(0, tok, acc)
    return out32 if dtype == torch.float32 else out32.to(dtype)


def _stacked_expert_sum(
    hidden: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, stack: LayerStack
) -> tuple[torch.Tensor, dict[int, int]]:
    """:func:`grouped_expert_sum` over a usable ``stack`` with at most
    :data:`GROUPED_MM_MAX_PAIRS` pairs: the same grouping (pairs by expert in ascending id order,
    token order kept) in fewer operations, as a frame is mostly a few tokens and every torch call
    costs microseconds: one lookup of each pair's group (padding goes to a last group that is
    never run), one stable argsort, one bincount whose ``tolist`` gives the group ends and the
    loads, two ``grouped_mm`` calls, one weighted ``index_add_``. An id the stack does not
    host counts as padding here (the server checks every frame first)."""
    n, k = experts.shape
    G = len(stack.ids)
    flat = experts.reshape(-1)  # (n*k,) int32 from the wire
    g = stack.group_of.index_select(0, flat + 1)  # (n*k,) group of every pair, padding -> G
    order = torch.argsort(g, stable=True)  # (n*k,) pairs grouped, token order kept
    counts = torch.bincount(g, minlength=G + 1)  # (G+1,)
    per_group = counts.tolist()
    P = n * k - per_group[G]  # real pairs
    if P == 0:
        return torch.zeros_like(hidden), {}
    if P < n * k:
        order = order[:P]  # (P,) the padding pairs sort last
    tok = torch.div(order, k, rounding_mode="floor")  # (P,) token of each grouped pair
    offs = counts[:G].cumsum(0).to(torch.int32)  # (G,) end of each group's rows
    n_i = int(stack.down.shape[2])  # I
    gu = F.grouped_mm(hidden.index_select(0, tok), stack.gate_up_t, offs=offs)  # (P, 2I)
    act = F.silu(gu[:, :n_i])  # (P, I)
    act.mul_(gu[:, n_i:])
    ys = F.grouped_mm(act, stack.down_t, offs=offs)  # (P, H)
    loads = {e: c for e, c in zip(stack.ids, per_group[:G], strict=True) if c}
    return _weighted_sum(ys, weights, order, tok, n, hidden.dtype), loads


_NOTHING_HOSTED = torch.zeros(1, dtype=torch.bool)  # mask of a layer this server does not host


@dataclass(frozen=True)
class _Hosting:
    """One immutable snapshot of what a server hosts (swapped whole on add/drop).

    Attributes:
        pairs: ``{(layer, expert): ExpertWeights}``.
        by_layer: layer -> expert id -> weights.
        accept: layer -> ``[max hosted id + 2]`` bool, ``accept[id + 1]``: ``id`` may appear in
            a frame (hosted, or the padding id ``-1``): the check of a good frame in one lookup;
            ``accept[1:]`` is the layer's hosted mask (frame checks without Python per id).
        stacks: layer -> :class:`LayerStack` (CPU weights: ``pairs`` and ``by_layer`` hold
            views of it); empty on CUDA.
        gpu: layer -> lazily built native grouped kernel of THIS snapshot (CUDA weights only).
    """

    pairs: Mapping[tuple[int, int], ExpertWeights]
    by_layer: Mapping[int, Mapping[int, ExpertWeights]]
    accept: Mapping[int, torch.Tensor]
    stacks: Mapping[int, LayerStack] = field(default_factory=dict)
    gpu: dict[int, object] = field(default_factory=dict)

    @classmethod
    def build(
        cls, pairs: Mapping[tuple[int, int], ExpertWeights], device: torch.device | None
    ) -> _Hosting:
        by_layer: dict[int, dict[int, ExpertWeights]] = {}
        for (layer, e), w in pairs.items():
            by_layer.setdefault(layer, {})[e] = w
        accept = {}
        for layer, experts in by_layer.items():
            a = torch.zeros(max(experts) + 2, dtype=torch.bool)
            a[0] = True  # the padding id -1
            a[[e + 1 for e in experts]] = True
            accept[layer] = a
        stacks: dict[int, LayerStack] = {}
        if (device is None or device.type == "cpu") and hasattr(F, "grouped_mm"):
            # one stack per layer, the weights rebound to views of it (no second copy: the
            # previous snapshot's tensors go when its last batch is done)
            stacks = {layer: LayerStack.build(experts) for layer, experts in by_layer.items()}
            if all(st.usable for st in stacks.values()):
                by_layer = {layer: dict(st.experts) for layer, st in stacks.items()}
                pairs = {(layer, e): w for layer, ex in by_layer.items() for e, w in ex.items()}
            else:  # this torch's CPU grouped_mm refuses these dtypes / shapes: the loop
                stacks = {}
        return cls(dict(pairs), by_layer, accept, stacks)


class ExpertServer:
    """One expert server process's work loop.

    Args:
        listen_endpoint: ``unix:/path.sock`` or ``tcp://host:port``.
        hosted: ``{(layer, expert): ExpertWeights}``; weights in ``dtype``.
        hidden_size: model hidden size ``H``.
        dtype: activation/weight dtype (float32 or bfloat16).
        server_id: id used in logs and the ready line.
        num_threads: ``torch.set_num_threads`` value (default 1; ``None`` leaves torch's default).
        batch_window_us: after the first ready frame, keep gathering frames this long (µs) to
            grow the dynamic batch (default 0: take what is ready now).
        poll_timeout: seconds ``poll`` blocks per loop turn (bounds ``stop`` latency).
        device: where hosted (and later added) weights live (default: the device of the
            initial weights, else CPU).
        compute: the :class:`~eaas.runtime.models.compute.ComputeChoice` of this process
            (``--cpu-bf16-compute``; None: compute in ``dtype``). With a wider compute dtype (a
            bfloat16 server on CPU computing in float32) the hosted weights are kept as float32
            copies (exact upcasts, twice the bytes), each batch's bfloat16 rows are upcast once
            and the answer is rounded to bfloat16 once: frames stay ``dtype`` on the wire.
        listener_kw: extra options for the listener (e.g. ``spin_us``).

    Hosted experts change while serving (:meth:`add_experts`, :meth:`drop_experts`; driven by
    the routing table through :mod:`eaas.runtime.assignment`).
    """

    def __init__(
        self,
        listen_endpoint: str,
        hosted: Mapping[tuple[int, int], ExpertWeights],
        hidden_size: int,
        dtype: torch.dtype,
        server_id: str,
        *,
        num_threads: int | None = 1,
        batch_window_us: float = 0.0,
        poll_timeout: float = 0.2,
        device: str | torch.device | None = None,
        compute: ComputeChoice | None = None,
        **listener_kw,
    ):
        if num_threads:
            torch.set_num_threads(int(num_threads))
        self.server_id = server_id
        self.hidden_size = int(hidden_size)
        self.dtype = dtype
        self._lock = threading.Lock()  # serializes add/drop (the loop itself never locks)
        # what this server hosts, swapped as ONE reference (copy-on-write) so the serving loop
        # reads a consistent snapshot per batch while experts are added or dropped
        first = next(iter(hosted.values()), None)
        # CUDA weights -> the native grouped kernels (eaas.runtime.gpu.grouped), else CPU path
        if device is not None:
            self.device = torch.device(device)
        else:
            self.device = first.gate.device if first is not None else torch.device("cpu")
        if compute is None or self.device.type != "cpu":
            compute = decide_compute(dtype, self.device.type, "native")
        self.compute = compute
        self.compute_dtype = compute.compute_dtype
        self._hosting = _Hosting.build(
            {(int(layer), int(e)): self._to_compute(w) for (layer, e), w in hosted.items()},
            self.device,
        )
        self._load_metrics: dict[tuple[int, int], object] = {}
        # expert loads not yet added to EXPERT_TOKENS (see flush_load_metrics)
        self._pending_loads: dict[tuple[int, int], int] = {}
        self._loads_flushed_at = time.monotonic()
        self.batch_window_s = batch_window_us * 1e-6
        self.poll_timeout = poll_timeout
        self.listener = listen(listen_endpoint, hidden_size=hidden_size, dtype=dtype, **listener_kw)
        self.endpoint = self.listener.endpoint
        self._stop = threading.Event()
        # time.monotonic() of the loop's last turn (None: not started); read by /health
        self.last_iteration: float | None = None
        # Plain counters for tests/introspection (also exported as Prometheus metrics).
        self.stats = {
            "batches": 0,
            "frames": 0,
            "tokens": 0,
            "max_clients_per_batch": 0,
            "errors": 0,
        }

    # -- loop ---------------------------------------------------------------------------
    def serve_forever(self, on_started: Callable[[], None] | None = None) -> None:
        """Serve until :meth:`stop` (or SIGTERM/SIGINT via :meth:`install_signal_handlers`);
        closes the listener (unlinking a Unix socket path) on the way out.

        ``on_started``: called once, after the loop's first iteration stamp and before its first
        poll, so a ``/health`` probe made after it sees a started loop (:func:`run` prints the
        ready line there)."""
        try:
            while not self._stop.is_set():
                now = self.last_iteration = time.monotonic()
                if on_started is not None:
                    on_started()
                    on_started = None
                if self._pending_loads and now - self._loads_flushed_at >= LOAD_METRICS_FLUSH_S:
                    self.flush_load_metrics()
                # an idle server adds what is pending within one poll_timeout
                frames = list(self.listener.poll(self.poll_timeout))
                if frames and self.batch_window_s > 0:
                    end = time.monotonic() + self.batch_window_s
                    while time.monotonic() < end:
                        frames.extend(self.listener.poll(0))
                if frames:
                    self.process(frames)
                elif self._pending_loads:
                    self.flush_load_metrics()
        finally:
            self.flush_load_metrics()
            self.listener.close()

    def flush_load_metrics(self) -> None:
        """Add the expert loads counted since the last flush to ``EXPERT_TOKENS``. The loop calls
        it at most every :data:`LOAD_METRICS_FLUSH_S` while frames keep coming, when a poll finds
        none, and on stop: one ``inc`` per (layer, expert) and flush, instead of one per frame
        (a multiprocess counter's ``inc`` writes its mmap file: ~15 per frame cost 5-10% of a
        busy server's CPU)."""
        pending, self._pending_loads = self._pending_loads, {}
        self._loads_flushed_at = time.monotonic()
        for key, c in pending.items():
            child = self._load_metrics.get(key)
            if child is None:
                child = self._load_metrics[key] = EXPERT_TOKENS.labels(str(key[0]), str(key[1]))
            child.inc(c)  # type: ignore[attr-defined]

    def stop(self) -> None:
        """Ask the loop to end (takes effect within ``poll_timeout``). Safe from signal handlers."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM / SIGINT -> :meth:`stop` (graceful: sockets closed, path unlinked)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def process(self, frames: list[tuple[object, RequestFrame]]) -> None:
        """Compute and answer one dynamic batch of ``(conn, frame)`` pairs."""
        SERVER_FRAMES.inc(len(frames))
        self.stats["frames"] += len(frames)
        hosting = self._hosting  # one snapshot per batch: add/drop never tears a batch
        by_layer: dict[int, list[tuple[object, RequestFrame]]] = {}
        for conn, f in frames:
            err = self._check(f, hosting)
            if err is not None:
                self.stats["errors"] += 1
                self.listener.respond(conn, ResponseFrame(f.seq, f.layer, err[0], None, err[1]))
                continue
            by_layer.setdefault(f.layer, []).append((conn, f))
        for layer, group in by_layer.items():
            try:
                self._run_layer(layer, group, hosting)
            except Exception as e:  # never crash on a client's input; answer everyone
                self.stats["errors"] += 1
                for conn, f in group:
                    self.listener.respond(
                        conn,
                        ResponseFrame(
                            f.seq, f.layer, STATUS_BAD_FRAME, None, f"server error: {e!r}"
                        ),
                    )

    def _check(self, f: RequestFrame, hosting: _Hosting) -> tuple[int, str] | None:
        if (
            f.hidden.dtype != self.dtype
            or f.hidden.dim() != 2
            or f.hidden.shape[1] != self.hidden_size
        ):
            return STATUS_BAD_FRAME, f"hidden must be [n, {self.hidden_size}] {self.dtype}"
        if f.experts.shape != f.weights.shape or f.experts.shape[0] != f.hidden.shape[0]:
            return STATUS_BAD_FRAME, "experts/weights must be [n, k] matching hidden"
        ex = f.experts
        accept = hosting.accept.get(f.layer)
        if accept is not None:  # a good frame: every id hosted or -1, in one lookup
            try:
                if bool(accept.index_select(0, ex.reshape(-1) + 1).all()):
                    return None
            except (IndexError, RuntimeError):  # an id outside [-1, max hosted id], ids
                pass  # of another dtype or device: the exact check below
        hosted = _NOTHING_HOSTED if accept is None else accept[1:]  # [max hosted id + 1]
        # one pass, no Python per token: ids outside [-1, len) or not hosted are "not hosted"
        inrange = (ex >= 0) & (ex < hosted.numel())
        bad_mask = ((ex >= 0) & ~inrange) | (ex < -1)
        bad_mask |= inrange & ~hosted[ex.clamp(0, hosted.numel() - 1).to(torch.int64)]
        if bool(bad_mask.any()):
            bad = torch.unique(ex[bad_mask]).tolist()
            return STATUS_NOT_HOSTED, (
                f"expert server {self.server_id} does not host layer {f.layer} expert(s) {bad[:16]}"
            )
        return None

    def _run_layer(
        self, layer: int, group: list[tuple[object, RequestFrame]], hosting: _Hosting
    ) -> None:
        if len(group) == 1:
            hidden, experts, weights = group[0][1].hidden, group[0][1].experts, group[0][1].weights
        else:
            kmax = max(int(f.experts.shape[1]) for _, f in group)
            hidden = torch.cat([f.hidden for _, f in group])
            experts = torch.cat(
                [
                    torch.nn.functional.pad(
                        f.experts.to(torch.int32), (0, kmax - f.experts.shape[1]), value=-1
                    )
                    for _, f in group
                ]
            )
            weights = torch.cat(
                [
                    torch.nn.functional.pad(
                        f.weights.to(torch.float32), (0, kmax - f.weights.shape[1])
                    )
                    for _, f in group
                ]
            )
        if self.device.type == "cuda":  # native grouped kernel (kernel shrinking), docs/gpu.md
            out, loads = self._gpu_layer(layer, hosting)(
                hidden.to(self.device), experts.to(self.device), weights.to(self.device)
            )
        elif self.compute_dtype != self.dtype:  # e.g. bf16 frames, fp32 math (compute policy)
            out, loads = grouped_expert_sum(
                hidden.to(self.compute_dtype),
                experts,
                weights,
                hosting.by_layer[layer],
                hosting.stacks.get(layer),
            )
            out = out.to(self.dtype)  # (N, H) rounded once, back to the wire dtype
        else:
            out, loads = grouped_expert_sum(
                hidden, experts, weights, hosting.by_layer[layer], hosting.stacks.get(layer)
            )
        ntok = int(hidden.shape[0])
        SERVER_BATCH_TOKENS.observe(ntok)
        pending = self._pending_loads  # EXPERT_TOKENS, added by flush_load_metrics
        for e, c in loads.items():
            pending[(layer, e)] = pending.get((layer, e), 0) + c
        self.stats["batches"] += 1
        self.stats["tokens"] += ntok
        clients = len({f.client_id for _, f in group})
        self.stats["max_clients_per_batch"] = max(self.stats["max_clients_per_batch"], clients)
        start = 0
        for conn, f in group:
            n = f.num_tokens
            self.listener.respond_ok(conn, f, out[start : start + n])
            start += n

    def _gpu_layer(self, layer: int, hosting: _Hosting):
        g = hosting.gpu.get(layer)
        if g is None:
            from eaas.runtime.gpu.grouped import GroupedExperts

            g = hosting.gpu[layer] = GroupedExperts(dict(hosting.by_layer[layer]))
        return g

    # -- hosted experts (changed while serving) -------------------------------------------
    @property
    def num_experts(self) -> int:
        """Number of hosted ``(layer, expert)`` pairs."""
        return len(self._hosting.pairs)

    def hosted_pairs(self) -> frozenset[tuple[int, int]]:
        """The ``(layer, expert)`` pairs hosted now."""
        return frozenset(self._hosting.pairs)

    def add_experts(self, weights: Mapping[tuple[int, int], ExpertWeights]) -> None:
        """Host more experts while serving (thread safe; the loop sees them from its next batch).

        Args:
            weights: ``{(layer, expert): ExpertWeights}`` in this server's dtype (moved to the
                server's device here); an already hosted pair is replaced.
        """
        dev = self.device
        moved = {
            (int(layer), int(e)): self._to_compute(
                w
                if w.gate.device == dev
                else ExpertWeights(w.gate.to(dev), w.up.to(dev), w.down.to(dev))
            )
            for (layer, e), w in weights.items()
        }
        with self._lock:
            self._hosting = _Hosting.build({**self._hosting.pairs, **moved}, dev)

    def _to_compute(self, w: ExpertWeights) -> ExpertWeights:
        """``w`` in the compute dtype (float32 copies of bfloat16 weights under the ``fp32``
        policy: exact upcasts; the bfloat16 tensors are not kept)."""
        dt = self.compute_dtype
        if w.gate.dtype == dt:
            return w
        return ExpertWeights(w.gate.to(dt), w.up.to(dt), w.down.to(dt))

    def compute_info(self) -> dict:
        """``/health``'s ``compute``: storage (wire) and compute dtype, policy, reason, and the
        hosted weights' bytes in the compute dtype."""
        nbytes = sum(
            t.numel() * t.element_size()
            for w in self._hosting.pairs.values()
            for t in (w.gate, w.up, w.down)
        )
        return {**self.compute.as_dict(), "weight_bytes": nbytes}

    def drop_experts(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Stop hosting ``pairs`` (thread safe): later frames naming them get
        ``STATUS_NOT_HOSTED``; a batch already running finishes on its snapshot."""
        gone = {(int(layer), int(e)) for layer, e in pairs}
        with self._lock:
            keep = {k: w for k, w in self._hosting.pairs.items() if k not in gone}
            self._hosting = _Hosting.build(keep, self.device)

    def ready_line(self) -> str:
        return f"expert-server {self.server_id} ready on {self.endpoint} hosting {self.num_experts} experts"


def random_experts(
    pairs, hidden_size: int, intermediate: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> dict[tuple[int, int], ExpertWeights]:
    """Deterministic random expert weights for tests and benchmarks.

    Each ``(layer, e)`` gets weights from its own generator seeded by ``(seed, layer, e)``, so a
    server hosting a subset gets exactly the same tensors as a reference hosting all of them.
    Shapes: gate/up ``[intermediate, hidden]``, down ``[hidden, intermediate]``; scaled by
    ``1/sqrt(fan_in)``; created in float32 then cast to ``dtype``.
    """
    out = {}
    for layer, e in pairs:
        g = torch.Generator().manual_seed(seed * 1_000_003 + int(layer) * 10_007 + int(e))
        gate = torch.randn(intermediate, hidden_size, generator=g) / hidden_size**0.5
        up = torch.randn(intermediate, hidden_size, generator=g) / hidden_size**0.5
        down = torch.randn(hidden_size, intermediate, generator=g) / intermediate**0.5
        out[(int(layer), int(e))] = ExpertWeights(gate.to(dtype), up.to(dtype), down.to(dtype))
    return out


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def run(server: ExpertServer, metrics_port: int = 0, health=None) -> None:
    """Start metrics (if asked), install signal handlers, print the ready line, serve.

    ``health``: the :class:`eaas.runtime.server_http.ServerHealth` of ``--http-port`` (if any);
    it gets the server now and is marked stopping when the loop ends.
    """
    from eaas.runtime.metrics import multiprocess_dir

    if health is not None:
        health.attach(server)

    if metrics_port and not multiprocess_dir():
        from prometheus_client import start_http_server

        start_http_server(int(metrics_port))
    server.install_signal_handlers()
    # the objects of start-up (torch, weights, modules) out of the cyclic GC's reach: a full
    # collection over them paused the serve loop for ~100-300 ms (see Engine.start)
    gc.collect()
    gc.freeze()
    try:
        server.serve_forever(on_started=lambda: print(server.ready_line(), flush=True))
    finally:
        gc.unfreeze()
        if health is not None:
            health.stopping = True


def main(argv: list[str] | None = None) -> None:
    """``python -m eaas.runtime.expert_server``: random-weight server for tests/benchmarks."""
    import argparse

    from eaas.runtime.placement import parse_expert_spec

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", required=True)
    p.add_argument(
        "--experts",
        default=None,
        help="spec like '1:0-3,7;2:5' (default: none, learnt from the routing table)",
    )
    p.add_argument("--push-token-file", default=None, help="accept PUT /routing-table")
    p.add_argument("--routing-table-configmap", default=None, help="NAMESPACE/NAME to watch")
    p.add_argument("--random", required=True, help="HIDDEN:INTER:SEED random weights")
    p.add_argument("--server-id", default="s0")
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--http-port", type=int, default=None, help="/health + /metrics port")
    p.add_argument("--health-stale-s", type=float, default=5.0)
    p.add_argument("--batch-window-us", type=float, default=0.0)
    p.add_argument("--spin-us", type=float, default=None)
    p.add_argument(
        "--device", default="cpu", help="cpu, or cuda[:N]: weights there, native grouped kernels"
    )
    a = p.parse_args(argv)
    hidden, inter, seed = (int(x) for x in a.random.split(":"))
    dtype = _DTYPES[a.dtype]
    if a.experts is None and not (a.push_token_file or a.routing_table_configmap):
        p.error("--experts is required unless --push-token-file or --routing-table-configmap")
    pairs = parse_expert_spec(a.experts) if a.experts else []
    hosted = random_experts(pairs, hidden, inter, dtype, seed)
    if a.device != "cpu":
        dev = torch.device(a.device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            p.error(f"--device {a.device}: expected cpu or cuda[:N] with a visible CUDA device")
        hosted = {
            key: ExpertWeights(w.gate.to(dev), w.up.to(dev), w.down.to(dev))
            for key, w in hosted.items()
        }
    kw: dict = {} if a.spin_us is None else {"spin_us": a.spin_us}
    if a.listen.startswith("cudaipc:"):  # CUDA-payload clients only for a server on cuda
        kw["compute_device"] = a.device
    health = start_http(a.server_id, a.http_port, a.health_stale_s)
    server = ExpertServer(
        a.listen,
        hosted,
        hidden,
        dtype,
        a.server_id,
        num_threads=a.threads,
        batch_window_us=a.batch_window_us,
        device=a.device,
        **kw,
    )
    del hosted  # the server keeps its own copies (stacked per layer on the CPU)
    try:
        learn_from_table(
            server,
            health,
            lambda pairs: random_experts(pairs, hidden, inter, dtype, seed),
            push_token_file=a.push_token_file,
            routing_table_configmap=a.routing_table_configmap,
        )
    except ValueError as exc:
        p.error(str(exc))
    run(server, a.metrics_port, health)


def learn_from_table(
    server: ExpertServer,
    health,
    loader,
    *,
    push_token_file: str | None = None,
    routing_table_configmap: str | None = None,
    num_experts: int | None = None,
    moe_layers=None,
):
    """Make ``server`` learn its experts from the routing table (:mod:`eaas.runtime.assignment`):
    pushed to ``PUT /routing-table`` on the HTTP port (``push_token_file``: the bearer token's
    file) and/or watched from a ConfigMap (``routing_table_configmap``: ``NAMESPACE/NAME``;
    then the newest two versions' experts are kept, as no operator releases them).

    Returns:
        the started :class:`~eaas.runtime.assignment.ServerAssignment`, or None when neither
        source is given (experts fixed by the command line).

    Raises:
        ValueError: ``push_token_file`` without an HTTP port (``health`` None), or a malformed
            ConfigMap reference.
    """
    if not push_token_file and not routing_table_configmap:
        return None
    from eaas.runtime.assignment import ServerAssignment, TableEndpoint

    assignment = ServerAssignment(
        server,
        server.server_id,
        loader,
        auto_release=bool(routing_table_configmap) and not push_token_file,
    ).start()
    if push_token_file:
        if health is None:
            raise ValueError("--push-token-file needs --http-port (PUT /routing-table)")
        from eaas.runtime.client.table_push import BearerToken

        health.table = TableEndpoint(
            assignment, BearerToken(push_token_file), num_experts, moe_layers
        )
    elif health is not None:
        health.table = TableEndpoint(assignment, None, num_experts, moe_layers)
    if routing_table_configmap:
        from eaas.runtime.client.table_watch import ConfigMapTableWatcher

        ConfigMapTableWatcher(routing_table_configmap, assignment).start()
    return assignment


def start_http(server_id: str, http_port: int | None, stale_after_s: float, host: str = "0.0.0.0"):
    """Start ``/health`` + ``/metrics`` (:mod:`eaas.runtime.server_http`) before the weights load;
    returns its :class:`~eaas.runtime.server_http.ServerHealth` (None without ``http_port``)."""
    if http_port is None:
        return None
    from eaas.runtime.server_http import ServerHealth, ServerHTTP

    health = ServerHealth(server_id, stale_after_s)
    http = ServerHTTP(health, http_port, host).start()
    print(
        f"expert-server {server_id} http on {host}:{http.port} (/health, /metrics)",
        file=sys.stderr,
        flush=True,
    )
    return health


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
