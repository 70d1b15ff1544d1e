"""Budgets of the attention client's engine: KV-cache memory and prefill tokens per step.

Pure arithmetic, no torch: the ``--prefill-tokens-while-decoding`` value
(:func:`parse_prefill_cap`), the constants of its ``auto`` mode (the step cost model of
:class:`~eaas.runtime.client.scheduler.StepCostModel` and the burst steps of
:class:`~eaas.runtime.client.scheduler.Scheduler`), and the default ``--kv-cache-memory``
(:func:`default_kv_cache_memory`). The engine (:class:`~eaas.runtime.client.engine.Engine`)
applies them; the command lines validate the option with :func:`parse_prefill_cap` before
loading a model.
"""

from __future__ import annotations

#: ``--prefill-tokens-while-decoding auto``: a step that decodes and prefills costs at most this
#: many plain decode steps of the whole batch (the target ITL p99 <= 3x ITL p50, with
#: room for the noise of a shared machine: at 3 the mixed steps themselves sat at 3-5x)
AUTO_PREFILL_RATIO = 2.0
#: ``auto``: share of the live sequences' gaps between tokens that burst steps may stretch
#: (the decodes held while a burst of prompts is prefilled at full speed); half of
#: the 1% an ITL p99 allows
AUTO_BURST_TAIL_SHARE = 0.005
#: ``auto``: a mixed step at the decode steps' 90th-percentile noise costs about this many mean
#: decode steps (the ratio goes from 2 down to 1.25 on a noisy machine; 3 x 0.85 margin)
AUTO_NOISE_BUDGET = 2.55


def parse_prefill_cap(value: int | str | None) -> int | str | None:
    """``--prefill-tokens-while-decoding`` value: ``"auto"``, ``None`` (from ``"off"`` /
    ``None``) or a token count >= 1.

    Raises:
        ValueError: anything else (the message names the option).
    """
    if value is None or value == "off":
        return None
    if value == "auto":
        return "auto"
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or (isinstance(value, str) and not value.strip().isdigit()):
        raise ValueError(
            f"--prefill-tokens-while-decoding must be auto, off or a token count >= 1, "
            f"got {value!r}"
        )
    return n


DEFAULT_KV_CACHE_CAP = 4 * 2**30  # bytes: default cache budget at most (vLLM CPU's default space)


def default_kv_cache_memory(bytes_per_token: int, max_model_len: int, max_num_seqs: int) -> int:
    """Default KV-cache budget: ``max_num_seqs`` sequences of ``max_model_len`` tokens, capped at
    :data:`DEFAULT_KV_CACHE_CAP` bytes but never below one sequence of ``max_model_len``."""
    one = bytes_per_token * max_model_len
    return max(one, min(one * max_num_seqs, DEFAULT_KV_CACHE_CAP))
