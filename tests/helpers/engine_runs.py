"""Drive an attention-client :class:`~eaas.runtime.client.engine.Engine` directly: greedy
generation of several prompts at once, for tests that compare engine configurations."""

from __future__ import annotations

import threading

from eaas.runtime.client.engine import Engine, ErrorEvent, SamplingParams


def generate_greedy(
    eng: Engine, prompts: list[list[int]], max_tokens: int, wait_s: float
) -> list[list[int]]:
    """Submit every prompt (greedy, ``ignore_eos``), run the engine until all finish, stop it.

    Returns each request's output token ids, in prompt order. Fails (AssertionError) if a request
    does not finish within ``wait_s`` seconds or any request ends with an error.
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

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [eng.submit(p, params, cb(i)) for i, p in enumerate(prompts)]
    eng.start()
    try:
        for d in done:
            assert d.wait(wait_s)
    finally:
        eng.stop()
    assert not errors, errors
    return [r.output_ids for r in reqs]
