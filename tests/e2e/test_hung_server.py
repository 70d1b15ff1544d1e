"""A hung (SIGSTOPped) expert server under ``eaas serve`` (4 expert servers, 2 replicas).

While the attention client waits for the hung server (up to ``--dispatch-timeout`` 5 s), GET
/health keeps answering and still shows the server as connected; then its token-expert pairs
fail over to the other replicas, every stream completes with the reference tokens, and after
SIGCONT the connector thread reconnects the server.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from eaas.runtime.models.reference import reference_generate

from helpers.dispatch import wait_all_connected
from helpers.e2e import FAILOVER_MAX_TOKENS as MAX_TOKENS
from helpers.e2e import FAILOVER_TEXTS as TEXTS
from helpers.e2e import (
    metric_sum,
    metric_values,
    serve_fixture,
    served_model_name,
    stream_completion,
)

pytestmark = pytest.mark.engine


deployment = serve_fixture(
    "serve-hung", ["--expert-servers", "4", "--replicas", "2", "--dispatch-timeout", "5"]
)


def test_health_answers_while_a_server_is_hung_and_streams_fail_over(
    deployment, tokenizer, model_dir
):
    base = deployment.base_url
    model = served_model_name(base)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS[:2]]
    refs = reference_generate(model_dir, prompts, MAX_TOKENS)
    outs = [{} for _ in prompts]
    starts = [threading.Event() for _ in prompts]
    # expert-1 connected before it is stopped, or its pairs never reach it (no deadline, no
    # failover): the client opens connections in the background, and a layer call waits for
    # one only when an expert has no connected replica at all
    wait_all_connected(lambda: httpx.get(f"{base}/health", timeout=10).json())
    threads = [
        threading.Thread(target=stream_completion, args=(base, model, p, o, s), daemon=True)
        for p, o, s in zip(prompts, outs, starts, strict=True)
    ]
    for t in threads:
        t.start()
    for s in starts:
        assert s.wait(120), outs
    victim = deployment.pid_of("--server-id expert-1")
    http = httpx.Client(timeout=30)
    http.get(f"{base}/health")  # connection open before the stop
    os.kill(victim, signal.SIGSTOP)
    answered_while_hung, lat = 0, []
    try:
        # until the client gives up on expert-1 (its 5 s deadline), /health keeps answering
        deadline = time.monotonic() + 120
        while True:
            t0 = time.perf_counter()
            h = http.get(f"{base}/health").json()
            lat.append(time.perf_counter() - t0)
            if h["servers"]["expert-1"]["state"] == "down":
                break
            answered_while_hung += 1
            assert time.monotonic() < deadline, h
            time.sleep(0.1)
    finally:
        os.kill(victim, signal.SIGCONT)
    lat.sort()
    print(
        f"/health answered {answered_while_hung}x while expert-1 hung; latency p50 "
        f"{lat[len(lat) // 2] * 1e3:.1f} ms, max {lat[-1] * 1e3:.1f} ms"
    )
    # several answers during the stall: a /health blocked behind the layer call would have
    # answered at most once before the server was marked down
    assert answered_while_hung >= 3
    for t in threads:
        t.join(180)
        assert not t.is_alive()
    for o, ref in zip(outs, refs, strict=True):
        assert "error" not in o and "exception" not in o, o
        assert o["status"] == 200 and o["ids"] == ref
    assert metric_sum(metric_values(base), "eaas_failovers_total") > 0
    # the resumed server is reconnected in the background and serves again
    deadline = time.monotonic() + 120
    while http.get(f"{base}/health").json()["servers"]["expert-1"]["state"] != "connected":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    http.close()
