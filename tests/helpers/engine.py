"""Drive an attention-client :class:`~eaas.runtime.client.engine.Engine` directly: several
requests submitted before the engine starts and run to the end, for tests that compare engine
configurations or check an engine against a reference."""

from __future__ import annotations

import threading
from typing import Any

from eaas.runtime.client.engine import Engine, ErrorEvent, SamplingParams

#: prompts of the engine tests (tests/client/test_engine.py, test_engine_paged.py)
ENGINE_TEXTS = [
    "Hello world",
    "The expert server hosts a set of experts and",
    "Kubernetes",
    "def main(): print",
    "A routing table maps every logical expert to its live replicas, so the client",
]


def run_requests(
    eng: Any, prompts: list[list[int]], params_list: list[SamplingParams], wait_s: float
) -> list[Any]:
    """Submit every prompt with its params before the engine starts, run it until all finish,
    stop it.

    Args:
        eng: an :class:`Engine` (or anything with its ``submit``/``start``/``stop``, such as
            :class:`~eaas.runtime.client.reference_engine.ReferenceEngine`).
        prompts: token ids per request.
        params_list: one :class:`SamplingParams` per prompt.
        wait_s: how long each request may take (s).

    Returns the engine's request objects, in prompt order (``output_ids`` etc.). Fails
    (AssertionError) if a request does not finish within ``wait_s`` seconds or any request ends
    with an error.
    """
    done = [threading.Event() for _ in prompts]
    errors: list[BaseException] = []

    def cb(i):
        def f(ev):
            if isinstance(ev, ErrorEvent):
                errors.append(ev.error)
                done[i].set()
            elif ev.finish_reason is not None:
                done[i].set()

        return f

    reqs = [
        eng.submit(p, sp, cb(i)) for i, (p, sp) in enumerate(zip(prompts, params_list, strict=True))
    ]
    eng.start()
    try:
        for d in done:
            assert d.wait(wait_s)
    finally:
        eng.stop()
    assert not errors, errors
    return reqs


def generate_greedy(
    eng: Engine, prompts: list[list[int]], max_tokens: int, wait_s: float
) -> list[list[int]]:
    """Greedy (``ignore_eos``) :func:`run_requests` of every prompt; returns each request's
    output token ids, in prompt order."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = run_requests(eng, prompts, [params] * len(prompts), wait_s)
    return [r.output_ids for r in reqs]
