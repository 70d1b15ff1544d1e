"""Fault tolerance through ``eaas serve`` (4 expert servers, 2 replicas, 1 attention client).

Order matters inside this module (one deployment, degraded step by step; serve runs with
``--no-restart-expert-servers``, so a killed server stays dead):
1. SIGKILL one expert server while several requests stream: every request completes with the
   reference tokens, failovers are counted, serve keeps running and publishes a routing table
   without the dead server (acknowledged by the client).
2. Kill a second server so that some experts have no replica left: requests fail fast with an
   OpenAI-style 503 (never hang), and the client keeps answering /health (503 "degraded").
3. SIGTERM to serve: no child process survives, no /dev/shm/eaas* files, run dir removed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx

from eaas.runtime.models.reference import reference_generate
from eaas.runtime.tables.table import RoutingTable

from helpers.dispatch import wait_all_connected
from helpers.e2e import FAILOVER_MAX_TOKENS as MAX_TOKENS
from helpers.e2e import FAILOVER_TEXTS as TEXTS
from helpers.e2e import (
    metric_sum,
    metric_values,
    serve_fixture,
    stream_completion,
)

deployment = serve_fixture(
    "serve-fault",
    ["--expert-servers", "4", "--replicas", "2", "--dispatch-timeout", "5"]
    + ["--no-restart-expert-servers"],  # the servers killed here stay dead (503 when none is left)
)


def test_kill_expert_server_while_streaming(deployment, model_name, tokenizer, model_dir):
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    refs = reference_generate(model_dir, prompts, MAX_TOKENS)
    outs = [{} for _ in prompts]
    starts = [threading.Event() for _ in prompts]
    # expert-1 connected before it is killed, or its pairs never reach it (nothing to fail
    # over): the client opens connections in the background, and a layer call waits for one
    # only when an expert has no connected replica at all
    wait_all_connected(lambda: httpx.get(f"{deployment.base_url}/health", timeout=10).json())
    threads = [
        threading.Thread(
            target=stream_completion, args=(deployment.base_url, model_name, p, o, s), daemon=True
        )
        for p, o, s in zip(prompts, outs, starts, strict=False)
    ]
    for t in threads:
        t.start()
    for s in starts:
        assert s.wait(120), outs
    victim = deployment.pid_of("--server-id expert-1")
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(180)
        assert not t.is_alive()
    for o, ref in zip(outs, refs, strict=False):
        assert "error" not in o and "exception" not in o, o
        assert o["status"] == 200
        assert o["ids"] == ref
        assert o["finish"] == ("length" if len(ref) == MAX_TOKENS else "stop")
    # the kill really happened mid-stream
    assert any(any(t > killed_at for t in o["times"]) for o in outs)
    m = metric_values(deployment.base_url)
    assert metric_sum(m, "eaas_failovers_total") > 0
    assert metric_sum(m, "eaas_server_marked_down_total", server="expert-1") >= 1
    # serve (the local monitor) published a table without expert-1; the client acknowledges it
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        h = httpx.get(f"{deployment.base_url}/health", timeout=10).json()
        if h["routing_table_version"] == 2:
            break
        time.sleep(0.1)
    assert h["routing_table_version"] == 2 and "expert-1" not in h["servers"]
    assert "expert server expert-1" in deployment.log() and "exited" in deployment.log()
    assert "not restarted (--no-restart-expert-servers)" in deployment.log()
    # a fresh request after the failure is still exact
    r = httpx.post(
        f"{deployment.base_url}/v1/completions",
        json={
            "model": model_name,
            "prompt": prompts[3],
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
        },
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == refs[3][:8]


def test_no_live_replica_is_503_not_a_hang(deployment, model_name):
    table = RoutingTable.from_json((deployment.run_dir / "routing-table.json").read_text())
    # expert-0 now holds the last replica of some experts (their other replica was on expert-1)
    orphaned = [
        (l, e) for l, e in table.hosted_by("expert-0") if table.replicas(l, e) == ("expert-0",)
    ]
    assert orphaned
    os.kill(deployment.pid_of("--server-id expert-0"), signal.SIGKILL)
    body = {
        "model": model_name,
        "prompt": "Mixture of experts models route each token to a few experts",
        "max_tokens": 8,
        "temperature": 0,
    }
    t0 = time.monotonic()
    r = httpx.post(f"{deployment.base_url}/v1/completions", json=body, timeout=60)
    assert time.monotonic() - t0 < 15
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and "no live replica" in err["message"]
    # streaming requests get the same answer (the error comes before the first token)
    with httpx.stream(
        "POST", f"{deployment.base_url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as rs:
        assert rs.status_code == 503
        assert json.loads(rs.read())["error"]["type"] == "service_unavailable"
    # the client itself keeps answering /health, but as not ready: 503 "degraded", naming the
    # experts without a live replica (all replicas down, or none left in the routing table)
    h = httpx.get(f"{deployment.base_url}/health", timeout=10)
    assert h.status_code == 503, h.text
    body = h.json()
    assert body["status"] == "degraded" and body["client_id"] == "0"
    assert body["uncovered_experts"] >= len(orphaned)
    assert {(u["layer"], u["expert"]) for u in body["uncovered"]} & set(orphaned)


def test_sigterm_cleans_up(deployment):
    # asserts exit code 0, no orphans, no /dev/shm/eaas*, run dir removed
    deployment.stop(check=True)
    log = deployment.log()
    # serve says what it stops (the servers killed earlier in this module are not counted)
    assert re.search(r"stopping 1 attention client and \d+ expert servers? \(SIGTERM", log), log[
        -2000:
    ]
    assert re.search(r"all processes stopped in [0-9.]+ s", log), log[-2000:]
    assert "did not exit within" not in log  # nobody needed SIGKILL
