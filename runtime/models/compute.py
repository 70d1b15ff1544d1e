"""CPU compute policy for bfloat16 checkpoints (``--cpu-bf16-compute {auto,native,fp32}``).

A bfloat16 deployment keeps bfloat16 where its bytes matter: the weights as rounded on load,
the KV cache, and the frames between attention clients and expert servers (the wire). On a CPU,
though, torch's bfloat16 kernels cost a fixed overhead per call (oneDNN) that dominates a small
model's decode step: measured on the 2-core development machine (AVX-512 with AVX512_BF16,
1 thread), ``F.linear`` of ``(32, 64) -> 32`` takes 4.1 µs in float32 and 25 µs in bfloat16,
and elementwise ops, copies and gathers are 1.5-4x slower in bfloat16 too (docs/serving.md,
"bf16 on CPU"). So the ``fp32`` policy computes the whole forward in float32:

* the weights are rounded to bfloat16 first (the checkpoint as a bfloat16 deployment sees it)
  and then upcast to float32, which is exact: the float32 model computes with the same weight
  values as the native bfloat16 one, at twice the weight memory (the bfloat16 copy is dropped);
* activations stay float32 between ops (no rounding after each op: at least as accurate);
* the KV cache stays bfloat16 (rounded on write, upcast on read) and frames to and from expert
  servers stay bfloat16 (rounded before the send; an expert server upcasts, computes in float32
  with its float32 weight copies and rounds its answer once).

``native`` computes in bfloat16 throughout (torch's own kernels). ``auto`` times one
representative linear layer both ways at load (:func:`calibrate_linear`, a few ms) and takes
the faster. CUDA devices always compute natively (bfloat16 tensor cores); a float32 checkpoint
computes in float32 whatever the policy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CPU_BF16_COMPUTE_POLICIES = ("auto", "native", "fp32")


@dataclass(frozen=True)
class ComputeChoice:
    """What a process computes in.

    Attributes:
        storage_dtype: dtype of the weights as loaded, the KV cache and the wire (``--dtype``).
        compute_dtype: dtype the forward / expert math runs in.
        policy: the ``--cpu-bf16-compute`` value asked for.
        reason: one line saying why (for logs and ``/health``).
        native_us / fp32_us: the calibration's time of one linear layer (µs), when it ran.
    """

    storage_dtype: torch.dtype
    compute_dtype: torch.dtype
    policy: str
    reason: str
    native_us: float | None = None
    fp32_us: float | None = None

    @property
    def upcast(self) -> bool:
        """True when computing in a wider dtype than stored (float32 weight copies)."""
        return self.compute_dtype != self.storage_dtype

    def as_dict(self) -> dict:
        """JSON-able summary (``/health``'s ``compute``)."""
        out: dict[str, object] = {
            "dtype": _name(self.storage_dtype),
            "compute_dtype": _name(self.compute_dtype),
            "cpu_bf16_compute": self.policy,
            "reason": self.reason,
        }
        if self.native_us is not None:
            out["calibration_us"] = {"native": self.native_us, "fp32": self.fp32_us}
        return out

    def log_line(self) -> str:
        """``compute: bfloat16 storage, float32 compute (--cpu-bf16-compute auto: ...)``."""
        return (
            f"compute: {_name(self.storage_dtype)} storage, {_name(self.compute_dtype)} compute "
            f"(--cpu-bf16-compute {self.policy}: {self.reason})"
        )


def _name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def check_policy(policy: str) -> str:
    """Return ``policy`` if it is one of :data:`CPU_BF16_COMPUTE_POLICIES`.

    Raises:
        ValueError: naming ``--cpu-bf16-compute`` and the allowed values.
    """
    if policy not in CPU_BF16_COMPUTE_POLICIES:
        raise ValueError(
            f"--cpu-bf16-compute must be one of {', '.join(CPU_BF16_COMPUTE_POLICIES)}, "
            f"got {policy!r}"
        )
    return policy


def decide_compute(
    storage_dtype: torch.dtype,
    device_type: str,
    policy: str,
    native_us: float | None = None,
    fp32_us: float | None = None,
) -> ComputeChoice:
    """The compute dtype for a process (pure: no timing, no tensors).

    Args:
        storage_dtype: ``torch.float32`` or ``torch.bfloat16`` (``--dtype``).
        device_type: ``"cpu"`` or ``"cuda"``.
        policy: ``"auto"``, ``"native"`` or ``"fp32"``.
        native_us / fp32_us: calibration times of one linear layer (µs); required for ``auto``
            with a bfloat16 checkpoint on CPU.

    Returns:
        the :class:`ComputeChoice`; ``auto`` picks float32 when its linear is faster.

    Raises:
        ValueError: an unknown policy, or ``auto`` on a CPU bfloat16 checkpoint without timings.
    """
    check_policy(policy)
    if storage_dtype != torch.bfloat16:
        return ComputeChoice(storage_dtype, storage_dtype, policy, "not a bfloat16 deployment")
    if device_type != "cpu":
        return ComputeChoice(storage_dtype, storage_dtype, policy, f"{device_type}: native bf16")
    if policy == "native":
        return ComputeChoice(storage_dtype, storage_dtype, policy, "asked")
    if policy == "fp32":
        return ComputeChoice(storage_dtype, torch.float32, policy, "asked")
    if native_us is None or fp32_us is None:
        raise ValueError("--cpu-bf16-compute auto needs the calibration's timings")
    faster = fp32_us < native_us
    reason = (
        f"one linear layer {native_us:.1f} us in bf16, {fp32_us:.1f} us in fp32: "
        f"{'fp32' if faster else 'bf16'} is faster"
    )
    return ComputeChoice(
        storage_dtype,
        torch.float32 if faster else storage_dtype,
        policy,
        reason,
        round(native_us, 2),
        round(fp32_us, 2),
    )


def calibrate_linear(
    tokens: int, in_features: int, out_features: int, reps: int = 30, budget_s: float = 0.2
) -> tuple[float, float]:
    """Time ``F.linear`` of ``(tokens, in_features) -> out_features`` on CPU in bfloat16 and in
    float32 (this process's torch threads), interleaved so that the machine's load hits both
    alike; the minimum over ``reps`` calls each, fewer (at least 3) once ``budget_s`` seconds
    are spent (a few ms for a small model; a DeepSeek-V3-sized expert needs the budget).

    Returns:
        ``(native_us, fp32_us)``: µs per call in bfloat16 and in float32.
    """
    g = torch.Generator().manual_seed(0)
    x32 = torch.randn(tokens, in_features, generator=g)  # (T, in)
    w32 = torch.randn(out_features, in_features, generator=g)  # (out, in)
    xb, wb = x32.bfloat16(), w32.bfloat16()
    for _ in range(2):  # first calls pick kernels / allocate
        F.linear(xb, wb)
        F.linear(x32, w32)
    best = [float("inf"), float("inf")]
    end = time.perf_counter() + budget_s
    for r in range(reps):
        if r >= 3 and time.perf_counter() > end:
            break
        for i, (x, w) in enumerate(((xb, wb), (x32, w32))):
            t0 = time.perf_counter()
            F.linear(x, w)
            best[i] = min(best[i], time.perf_counter() - t0)
    return 1e6 * best[0], 1e6 * best[1]


def choose_compute(
    storage_dtype: torch.dtype,
    device: str | torch.device,
    policy: str,
    shape: tuple[int, int, int],
) -> ComputeChoice:
    """:func:`decide_compute`, calibrating when the policy is ``auto`` on a CPU bfloat16 run.

    Args:
        shape: ``(tokens, in_features, out_features)`` of the representative linear layer (the
            attention client: a decode batch through a hidden -> hidden projection; an expert
            server: through an expert's gate projection).

    Raises:
        ValueError: an unknown policy.
    """
    check_policy(policy)
    dev = torch.device(device)
    if policy == "auto" and storage_dtype == torch.bfloat16 and dev.type == "cpu":
        native_us, fp32_us = calibrate_linear(*shape)
        return decide_compute(storage_dtype, dev.type, policy, native_us, fp32_us)
    return decide_compute(storage_dtype, dev.type, policy)


__all__ = [
    "CPU_BF16_COMPUTE_POLICIES",
    "ComputeChoice",
    "calibrate_linear",
    "check_policy",
    "choose_compute",
    "decide_compute",
]
