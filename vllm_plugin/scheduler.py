"""The scheduler side of per-request failure: vLLM's scheduler, ending with an error only the
requests whose tokens needed an expert without a live replica.

vLLM 0.32 has no way for a layer inside the forward pass to fail one request: an exception there
stops the engine (every request in flight fails, ``/health`` turns 500). What it does have is a
per-request channel from the worker to the scheduler that needs no change to the model runner:
with ``VLLM_COMPUTE_NANS_IN_LOGITS=1`` the model runner counts the NaNs in each request's logits
(``ModelRunnerOutput.num_nans_in_logits``, keyed by request id), and a request status
``FINISHED_ERROR`` that the API server answers with an error (HTTP 500 ``Internal server
error``; an ``error`` event in a stream). The scheduler records the requests it ends that way
(:class:`~eaas.vllm.failed.FailedRequests`), and the API server's middleware
(:mod:`eaas.vllm.middleware`, ``--middleware``) answers exactly those with HTTP 503.

So, with this scheduler (``vllm serve ... --scheduler-cls eaas.vllm.scheduler.Scheduler``):

* the plugin's layer (:meth:`eaas.vllm.client.ExpertClient.run`) computes every token whose
  selected experts have a live replica and writes NaN into the rows of the others (never a
  wrong number that would look like a token); NaN reaches only the logits of the requests those
  tokens belong to (MoE and norms are per token, attention is per request);
* :meth:`FailAffectedRequests.update_from_output` drops the tokens sampled for a request with NaN
  logits (the client never sees them), finishes it with ``FINISHED_ERROR`` through vLLM's own
  error path (the one a failed KV load takes) and evicts its KV blocks from the prefix cache
  (they hold NaN) and has vLLM zero them before their next use; every other request of the
  step keeps its token and goes on.

:class:`Scheduler` picks vLLM's ``AsyncScheduler`` or ``Scheduler`` as its base from
``scheduler_config.async_scheduling`` (vLLM's CPU build forces it off; the GPU build turns it on
by default). The plugin's layer uses the NaN path only when this scheduler is configured and
vLLM counts NaNs (:func:`fails_requests`); otherwise a missing replica raises as before.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.platforms import current_platform
from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

from eaas.runtime.options.vllm import ENV, SCHEDULER_CLS
from eaas.vllm.failed import FailedRequests

log = logging.getLogger("eaas.vllm")

#: ``--scheduler-cls`` value that turns on per-request failure (this class's qualified name)
SCHEDULER_QUALNAME = SCHEDULER_CLS
#: vLLM's variable that makes the model runner count NaNs per request (set by the plugin when
#: unset, :func:`eaas.vllm.register`)
NANS_ENV = "VLLM_COMPUTE_NANS_IN_LOGITS"
#: where the failed requests are recorded for the middleware's 503 (set by the plugin)
RECORD_ENV = ENV["failed_requests_dir"]


def fails_requests(scheduler_cls: Any, environ: Any = os.environ) -> bool:
    """Whether this vLLM ends only the affected requests (True) or stops its engine (False).

    Args:
        scheduler_cls: ``vllm_config.scheduler_config.scheduler_cls`` (a qualname, a class or
            None).
        environ: the process environment (``VLLM_COMPUTE_NANS_IN_LOGITS`` on,
            ``VLLM_RAISE_ON_LOGIT_NANS`` off).
    """
    if isinstance(scheduler_cls, type):
        ours = issubclass(scheduler_cls, FailAffectedRequests) or scheduler_cls is Scheduler
    else:
        ours = scheduler_cls == SCHEDULER_QUALNAME
    counts = environ.get(NANS_ENV, "0") not in ("", "0")
    raises = environ.get("VLLM_RAISE_ON_LOGIT_NANS", "0") not in ("", "0")
    return ours and counts and not raises


class FailAffectedRequests:
    """Mixin over vLLM's ``Scheduler``: a request whose logits hold NaN ends with
    ``FINISHED_ERROR`` (see the module docstring)."""

    # attributes of vLLM's Scheduler this mixin uses (declared for the type checker)
    requests: dict[str, Any]
    encoder_cache_mismatch_reqs: set[str]
    kv_cache_manager: Any
    needs_kv_cache_zeroing: bool
    _eaas_record: FailedRequests | None

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        nans = model_runner_output.num_nans_in_logits or {}
        failed = sorted(r for r, n in nans.items() if n and r in self.requests)
        blocks: set[int] = set()
        if failed:
            sampled = model_runner_output.sampled_token_ids
            index = model_runner_output.req_id_to_index
            for r in failed:
                i = index.get(r)
                if sampled and i is not None and i < len(sampled):
                    sampled[i] = []  # never stream a token computed from a NaN
                for group in self.kv_cache_manager.get_block_ids(r):
                    blocks.update(group)
            # vLLM's error path of this step (finish_requests(FINISHED_ERROR) and an
            # EngineCoreOutput with finish_reason ERROR per request)
            self.encoder_cache_mismatch_reqs.update(failed)
            # the API server's middleware (eaas.vllm.middleware) answers these with 503: the
            # record is written before this step's outputs leave the engine core
            self._record_failed(failed)
            log.error(
                "eaas: 503 no_live_replica: %d request(s) end with an error (an expert their "
                "tokens selected has no live replica): %s",
                len(failed),
                ", ".join(failed),
            )
        out = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if blocks:
            self._scrub(blocks)
        return out

    def _record_failed(self, failed: list[str]) -> None:
        if not hasattr(self, "_eaas_record"):
            self._eaas_record = FailedRequests.from_env(os.environ)
            if self._eaas_record is None:
                log.warning("eaas.vllm.scheduler: %s unset: these end with vLLM's 500", RECORD_ENV)
        if self._eaas_record is None:
            return
        try:
            self._eaas_record.add(failed)
        except OSError as exc:  # the 500 stays a 500; the requests still end
            log.warning("eaas.vllm.scheduler: cannot record failed requests: %s", exc)

    def _scrub(self, blocks: set[int]) -> None:
        """The failed requests' KV blocks hold NaN: those no other request uses any more leave
        the prefix cache and are zeroed before their next use (vLLM's block zeroing, the
        ``new_block_ids_to_zero`` of the next step): a stale NaN in a slot a later request does
        not write would still reach its attention (the CPU kernels read whole blocks)."""
        pool = self.kv_cache_manager.block_pool
        free = {b for b in blocks if pool.blocks[b].ref_cnt == 0}
        self.kv_cache_manager.evict_blocks(free)
        if self.needs_kv_cache_zeroing or current_platform.is_cpu():
            pending = getattr(self, "_eaas_zero", [])
            self._eaas_zero = pending + sorted(free)

    def _get_new_block_ids_to_zero(self) -> list[int] | None:
        ids = super()._get_new_block_ids_to_zero()  # type: ignore[misc]
        pending = getattr(self, "_eaas_zero", None)
        if not pending:
            return ids
        self._eaas_zero = []
        return sorted(set(ids or []) | set(pending))


class SyncScheduler(FailAffectedRequests, VllmScheduler):
    """vLLM's ``Scheduler`` with :class:`FailAffectedRequests`."""


class AsyncScheduler(FailAffectedRequests, VllmAsyncScheduler):
    """vLLM's ``AsyncScheduler`` with :class:`FailAffectedRequests`."""


class Scheduler:
    """``--scheduler-cls eaas.vllm.scheduler.Scheduler``: builds :class:`AsyncScheduler` or
    :class:`SyncScheduler` (vLLM's ``scheduler_config.async_scheduling`` decides), with vLLM's
    scheduler arguments.

    Raises:
        RuntimeError: this vLLM's scheduler lacks the error path used (not vLLM 0.32).
    """

    def __new__(cls, *args: Any, vllm_config: Any, **kwargs: Any) -> Any:
        base = AsyncScheduler if vllm_config.scheduler_config.async_scheduling else SyncScheduler
        s = base(*args, vllm_config=vllm_config, **kwargs)
        if not isinstance(getattr(s, "encoder_cache_mismatch_reqs", None), set) or not hasattr(
            s, "_get_new_block_ids_to_zero"
        ):
            raise RuntimeError(
                "eaas.vllm.scheduler: this vLLM's Scheduler has no per-step error set "
                "(encoder_cache_mismatch_reqs); supported: vLLM 0.32"
            )
        if os.environ.get(NANS_ENV, "0") in ("", "0"):
            log.warning(
                "eaas.vllm.scheduler: %s is off: a missing expert replica stops the engine",
                NANS_ENV,
            )
        log.info("eaas.vllm: %s ends only the requests a missing expert affects", base.__name__)
        return s
