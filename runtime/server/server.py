"""Expert server: a stateless process hosting a set of ``(layer, logical expert)`` weights.

Loop (the data-plane protocol's server side):

1. ``listener.poll`` gathers the ready frames of *all* connected attention clients (dynamic
   batching; optional ``batch_window_us`` keeps gathering for a short while after the first
   frame).
2. Frames are grouped by layer. A frame naming an expert this server does not host gets a
   ``STATUS_NOT_HOSTED`` response (message names the experts) and is left out; a malformed one
   gets ``STATUS_BAD_FRAME``. The server never crashes on a client's input.
3. Per layer, the frames' tokens are concatenated and every hosted expert of that layer that
   got tokens runs ONCE on the union of its tokens (:mod:`eaas.runtime.server.compute`:
   sort-based grouping; only experts with tokens are touched, the CPU analog of the paper's
   "kernel shrinking"); on the CPU the layer's experts are stacked
   (:class:`~eaas.runtime.server.hosting.LayerStack`) and run as two ``grouped_mm`` calls. With
   the weights on a CUDA device the native grouped kernels run instead
   (:mod:`eaas.runtime.server.grouped`: one launch sequence per layer, compact group metadata
   computed on the device).
4. The output ``[N, H]`` is split back per frame and each client gets its rows.

Hosted experts may change while serving (:meth:`ExpertServer.add_experts` /
:meth:`ExpertServer.drop_experts`, copy-on-write: each batch runs on one consistent snapshot,
:class:`~eaas.runtime.server.hosting.Hosting`): with ``--push-token-file`` or
``--routing-table-configmap`` and no ``--experts`` the server starts empty and learns its
experts from the routing table (:func:`eaas.runtime.server.main.learn_from_table`,
:mod:`eaas.runtime.server.assignment`).

Metrics (:mod:`eaas.runtime.metrics`): ``EXPERT_TOKENS{layer,expert,server}`` (expert load:
the real (token, expert) pairs computed, padding ``-1`` and refused frames excluded; added at
most every ``LOAD_METRICS_FLUSH_S`` while busy and when idle, see
:meth:`ExpertServer.flush_load_metrics`),
``SERVER_BATCH_TOKENS`` (tokens per per-layer dynamic batch), ``SERVER_FRAMES``.

Start-up, the ready line and the random-weight entry point for tests and benchmarks:
:mod:`eaas.runtime.server.main`.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping

import torch

from eaas.runtime.experts import ExpertWeights
from eaas.runtime.metrics import EXPERT_TOKENS, SERVER_BATCH_TOKENS, SERVER_FRAMES
from eaas.runtime.models.compute import ComputeChoice, decide_compute
from eaas.runtime.options.server import check_cpu_kernel
from eaas.runtime.server import cpu_fused
from eaas.runtime.server.compute import grouped_expert_sum
from eaas.runtime.server.cpu_fused import FusedLayer
from eaas.runtime.server.grouped import GroupedExperts
from eaas.runtime.server.hosting import Hosting
from eaas.runtime.server.traffic import TrafficRecord
from eaas.runtime.transport.base import (
    STATUS_BAD_FRAME,
    STATUS_NOT_HOSTED,
    RequestFrame,
    ResponseFrame,
)
from eaas.runtime.transport.factory import listen

LOAD_METRICS_FLUSH_S = 0.05  # a busy server adds its expert loads to EXPERT_TOKENS this often
#: On stop, frames already sent are still answered for at most this long (s): the final drain.
FINAL_DRAIN_S = 1.0

_NOTHING_HOSTED = torch.zeros(1, dtype=torch.bool)  # mask of a layer this server does not host
#: ``--cpu-kernel vllm``: vLLM's fused kernel up to this many real (token, expert) pairs per
#: batch, torch's grouped_mm above (bench/expert_kernel.py --host-every 2, 1 thread: at the
#: tiny and the medium model's shapes the fused path took 0.25-0.65x the time at 1-16 tokens;
#: bfloat16 break-even at ~256-512 pairs, float32 still ~0.6x at 1024; docs/vllm.md)
FUSED_MAX_PAIRS = {torch.bfloat16: 256, torch.float32: 1024}


def resolve_cpu_kernel(cpu_kernel: str, device: torch.device) -> tuple[str, str]:
    """``(kernel, why)`` of ``--cpu-kernel`` on ``device``: ``vllm`` or ``torch`` and the reason.

    Raises:
        ValueError: an unknown value, or ``vllm`` on the CPU without vLLM's kernel.
    """
    check_cpu_kernel(cpu_kernel)
    if device.type != "cpu":
        return "torch", f"not used on {device.type}"
    if cpu_kernel == "torch":
        return "torch", "--cpu-kernel torch"
    loaded, why = cpu_fused.load_kernel()
    if loaded:
        isa = cpu_fused.isa_for(torch.bfloat16)
        return "vllm", f"vLLM's cpu_fused_moe: isa {isa} for bfloat16, vec for float32"
    if cpu_kernel == "vllm":
        raise ValueError(f"--cpu-kernel vllm: vLLM's CPU MoE kernel does not load here: {why}")
    return "torch", f"auto: {why}"


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
        cpu_kernel: the CPU expert compute (``--cpu-kernel``, :data:`~eaas.runtime.options.server.CPU_KERNELS`): ``vllm``
            runs vLLM's CPU fused-MoE kernel (:mod:`eaas.runtime.server.cpu_fused`) on batches
            of at most :data:`FUSED_MAX_PAIRS` pairs and :func:`grouped_expert_sum` on larger
            ones, ``torch`` always the latter, ``auto`` (default) ``vllm`` when this Python has
            vLLM's CPU build. Ignored on CUDA.
        listener_kw: extra options for the listener (e.g. ``spin_us``).

    Raises:
        ValueError: ``cpu_kernel`` is not one of :data:`~eaas.runtime.options.server.CPU_KERNELS`, or ``vllm`` and vLLM's
            kernel does not load here (the message says why).

    Hosted experts change while serving (:meth:`add_experts`, :meth:`drop_experts`; driven by
    the routing table through :mod:`eaas.runtime.server.assignment`).
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
        cpu_kernel: str = "auto",
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
        # CUDA weights -> the native grouped kernels (eaas.runtime.server.grouped), else CPU path
        if device is not None:
            self.device = torch.device(device)
        else:
            self.device = first.gate.device if first is not None else torch.device("cpu")
        if compute is None or self.device.type != "cpu":
            compute = decide_compute(dtype, self.device.type, "native")
        self.compute = compute
        self.compute_dtype = compute.compute_dtype
        self.cpu_kernel, self.cpu_kernel_why = resolve_cpu_kernel(cpu_kernel, self.device)
        self._hosting = self._snapshot(
            {(int(layer), int(e)): self._to_compute(w) for (layer, e), w in hosted.items()}
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
        # frames answered, the last frame's time, the stop's (/health ``traffic``, exit line)
        self.traffic = TrafficRecord()
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
        poll, so a ``/health`` probe made after it sees a started loop (:func:`eaas.runtime.server.main.run` prints the
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
            self._final_drain()
        finally:
            self.flush_load_metrics()
            self.listener.close()

    def _final_drain(self) -> None:
        """After a stop: answer the frames already sent (ready now) instead of dropping them,
        until a poll finds none or :data:`FINAL_DRAIN_S` passed."""
        end = time.monotonic() + FINAL_DRAIN_S
        while time.monotonic() < end:
            frames = list(self.listener.poll(0))
            if not frames:
                return
            self.process(frames)

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
                child = self._load_metrics[key] = EXPERT_TOKENS.labels(
                    str(key[0]), str(key[1]), self.server_id
                )
            child.inc(c)  # type: ignore[attr-defined]

    def stop(self) -> None:
        """Ask the loop to end (takes effect within ``poll_timeout``; frames already sent are still
        answered, see :data:`FINAL_DRAIN_S`). Safe from signal handlers."""
        self.traffic.stopping()
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM / SIGINT -> :meth:`stop` (graceful: sockets closed, path unlinked)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def process(self, frames: list[tuple[object, RequestFrame]]) -> None:
        """Compute and answer one dynamic batch of ``(conn, frame)`` pairs."""
        SERVER_FRAMES.inc(len(frames))
        self.stats["frames"] += len(frames)
        self.traffic.saw(len(frames))
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

    def _check(self, f: RequestFrame, hosting: Hosting) -> tuple[int, str] | None:
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
        self, layer: int, group: list[tuple[object, RequestFrame]], hosting: Hosting
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
        else:
            x = hidden if self.compute_dtype == self.dtype else hidden.to(self.compute_dtype)
            fused = (
                self._fused_layer(layer, hosting, experts) if self.cpu_kernel == "vllm" else None
            )
            if fused is not None:
                out, loads = fused(x, experts, weights)
            else:
                out, loads = grouped_expert_sum(
                    x, experts, weights, hosting.by_layer[layer], hosting.stacks.get(layer)
                )
            if out.dtype != self.dtype:  # e.g. bf16 frames, fp32 math (compute policy)
                out = out.to(self.dtype)  # (N, H) rounded once, back to the wire dtype
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

    def _snapshot(self, pairs: Mapping[tuple[int, int], ExpertWeights]) -> Hosting:
        """The :class:`Hosting` of ``pairs``; with the ``vllm`` CPU kernel, every layer's
        :class:`FusedLayer` prepacked here (at start and in add/drop, off the serving loop:
        ~0.05-0.1 s per layer of 32 experts at hidden 2048), or False where it cannot run."""
        hosting = Hosting.build(pairs, self.device)
        if self.cpu_kernel == "vllm":
            for layer, stack in hosting.stacks.items():
                ok = cpu_fused.unsupported(stack) is None
                hosting.fused[layer] = FusedLayer.build(stack) if ok else False
        return hosting

    def _fused_layer(
        self, layer: int, hosting: Hosting, experts: torch.Tensor
    ) -> FusedLayer | None:
        """This snapshot's :class:`FusedLayer` of ``layer``, or None: the layer has no stack,
        the kernel cannot take it, or the batch has more than :data:`FUSED_MAX_PAIRS` real
        pairs (there torch's ``grouped_mm`` is as fast or faster)."""
        f = hosting.fused.get(layer)
        if not isinstance(f, FusedLayer):
            return None
        limit = FUSED_MAX_PAIRS.get(self.compute_dtype, 0)
        if experts.numel() > limit and int((experts >= 0).sum()) > limit:
            return None
        return f

    def _gpu_layer(self, layer: int, hosting: Hosting):
        g = hosting.gpu.get(layer)
        if g is None:
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
            (int(layer), int(e)): self._to_compute(w if w.gate.device == dev else w.to(dev))
            for (layer, e), w in weights.items()
        }
        with self._lock:
            self._hosting = self._snapshot({**self._hosting.pairs, **moved})

    def _to_compute(self, w: ExpertWeights) -> ExpertWeights:
        """``w`` in the compute dtype (float32 copies of bfloat16 weights under the ``fp32``
        policy: exact upcasts; the bfloat16 tensors are not kept)."""
        dt = self.compute_dtype
        if w.gate.dtype == dt:
            return w
        return w.to(dt)

    def compute_info(self) -> dict:
        """``/health``'s ``compute``: storage (wire) and compute dtype, policy, reason, and the
        hosted weights' bytes in the compute dtype."""
        nbytes = sum(
            t.numel() * t.element_size()
            for w in self._hosting.pairs.values()
            for t in (w.gate, w.up, w.down)
        )
        return {
            **self.compute.as_dict(),
            "weight_bytes": nbytes,
            "cpu_kernel": self.cpu_kernel,
            "cpu_kernel_reason": self.cpu_kernel_why,
        }

    def drop_experts(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Stop hosting ``pairs`` (thread safe): later frames naming them get
        ``STATUS_NOT_HOSTED``; a batch already running finishes on its snapshot."""
        gone = {(int(layer), int(e)) for layer, e in pairs}
        with self._lock:
            keep = {k: w for k, w in self._hosting.pairs.items() if k not in gone}
            self._hosting = self._snapshot(keep)

    def ready_line(self) -> str:
        """``expert-server <id> ready on <endpoint> hosting <N> experts``: printed once the
        loop has started (:func:`eaas.runtime.server.main.run`); tests and ``serve`` wait for it."""
        return f"expert-server {self.server_id} ready on {self.endpoint} hosting {self.num_experts} experts"
