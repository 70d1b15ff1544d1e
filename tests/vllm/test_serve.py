"""``vllm serve`` with the eaas.vllm plugin behaves like our own attention clients.

One vLLM server (tiny Qwen3-MoE, fp32, ``--enforce-eager``) shared by the module, its routed
experts on 4 expert servers with 2 replicas each; the plugin's port (``EAAS_HTTP_PORT``) with
a push token; failure reports to a receiver in this process. In order: health and the table
in use, the authenticated push endpoint and its acknowledgement, 16 concurrent streams through
a SIGKILL of one expert server (every stream completes with the reference text; failover,
marked-down and failure-report evidence), then a routing table without the dead server, and
last an expert without any live replica: only the requests that need it fail, with HTTP 503
(vLLM's scheduler with the plugin's per-request failure and its API-server middleware,
``--scheduler-cls eaas.vllm.scheduler.Scheduler --middleware
eaas.vllm.middleware.NoLiveReplica503``).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from openai import OpenAI

from eaas.runtime.options.vllm import plugin_vllm_args

from helpers.common import free_port, wait_until
from helpers.e2e import metric_sum, metric_values
from helpers.vllm import ExpertFleet, VllmServer, plugin_env

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]  # vLLM's start: minutes when busy

TOKEN = "s3cret-push-token"
#: one-token prompts (1 token in, 1 out): each selects 2 experts per MoE layer, so some avoid
#: an uncovered expert
SHORT = [[(37 * i) % 1000 + 3] for i in range(32)]
#: the 16 streams' texts with every expert covered (the first test that needs them runs them)
REFERENCE: list[dict] = []
STREAMS = 16
MAX_TOKENS = 40


class Reports:
    """An HTTP receiver of failure reports (the operator's role): POST bodies and their
    ``Authorization`` headers."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str | None, dict]] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("content-length", "0"))
                outer.bodies.append(
                    (self.headers.get("authorization"), json.loads(self.rfile.read(n)))
                )
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/failure-report"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def stack(vllm_python, vllm_models, tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-serve")
    token_file = work / "push-token"
    token_file.write_text(TOKEN + "\n")
    reports = Reports()
    fleet = ExpertFleet(vllm_models["qwen3_moe"], work / "fleet", servers=4, replicas=2)
    http_port = free_port()
    env = plugin_env(
        fleet,
        EAAS_HTTP_PORT=str(http_port),
        EAAS_PUSH_TOKEN_FILE=str(token_file),
        EAAS_FAILURE_REPORT_URL=reports.url,
        EAAS_CLIENT_ID="vllm-test",
        EAAS_DISPATCH_TIMEOUT="10",
    )
    server = VllmServer(
        vllm_python,
        vllm_models["qwen3_moe"],
        work / "vllm.log",
        env,
        extra_args=tuple(plugin_vllm_args()),
    )
    try:
        server.wait_ready()
        yield server, fleet, f"http://127.0.0.1:{http_port}", reports
    finally:
        server.stop()
        fleet.stop()
        reports.close()


def _prompts() -> list[list[int]]:
    return [[(7 * i + j * 13) % 1000 + 3 for j in range(4 + i % 5)] for i in range(STREAMS)]


def test_health_names_the_table_and_every_server(stack):
    server, fleet, side, _ = stack
    server.greedy_ids([1, 2, 3], 4)  # every server gets some tokens
    r = httpx.get(f"{side}/health", timeout=10)
    assert r.status_code == 200, r.text
    h = r.json()
    assert h["status"] == "ok" and h["engine"] == "vllm"
    assert h["routing_table_version"] == 1
    assert h["moe_layers"] == [1, 2]
    assert set(h["servers"]) == set(fleet.procs)
    assert all(s["state"] == "connected" for s in h["servers"].values())
    assert h["routed_expert_bytes_not_loaded"] > 0
    m = metric_values(side)
    assert metric_sum(m, "eaas_routing_table_version", client_id=str(_cid())) == 1
    assert metric_sum(m, "eaas_dispatch_seconds_count") > 0


def _cid() -> int:
    from eaas.runtime.options.client import client_id_of

    return client_id_of("vllm-test")


def test_push_is_authenticated_acknowledged_and_refuses_older(stack):
    server, fleet, side, _ = stack
    body = fleet.table.with_version(2).to_json()
    assert httpx.put(f"{side}/routing-table", content=body, timeout=10).status_code == 401
    bad = {"Authorization": "Bearer wrong"}
    assert (
        httpx.put(f"{side}/routing-table", content=body, headers=bad, timeout=10).status_code == 401
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.put(f"{side}/routing-table", content=body, headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["acknowledged_version"] == 2 and r.json()["previous_version"] == 1
    r = httpx.put(f"{side}/routing-table", content=fleet.table.to_json(), headers=auth, timeout=30)
    assert r.status_code == 409 and r.json()["applied_version"] == 2
    assert httpx.get(f"{side}/routing-table", timeout=10).json()["version"] == 2
    assert server.greedy_ids([1, 2, 3], 4)  # still serving


def _stream(client: OpenAI, prompt: list[int], out: dict) -> None:
    try:
        text = []
        stream = client.completions.create(
            model="m",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            text.append(chunk.choices[0].text)
            out["chunks"] = out.get("chunks", 0) + 1
        out["text"] = "".join(text)
    except Exception as exc:  # noqa: BLE001  (the test reports it)
        out["error"] = repr(exc)
        out["error_body"] = getattr(exc, "body", None)  # the error event's object


def _run_streams(server: VllmServer, on_started=None) -> list[dict]:
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="x", timeout=300, max_retries=0)
    outs: list[dict] = [{} for _ in range(STREAMS)]
    threads = [
        threading.Thread(target=_stream, args=(client, p, o))
        for p, o in zip(_prompts(), outs, strict=True)
    ]
    for t in threads:
        t.start()
    if on_started is not None:
        assert wait_until(lambda: all(o.get("chunks", 0) >= 3 for o in outs), 300, 0.05)
        on_started()
    for t in threads:
        t.join(400)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    return outs


def test_sigkill_of_an_expert_server_under_16_streams(stack):
    server, fleet, side, reports = stack
    reference = _reference(server)
    failovers0 = metric_sum(metric_values(side), "eaas_failovers_total")
    t_kill: list[float] = []

    def kill() -> None:
        t_kill.append(time.monotonic())
        fleet.kill("expert-1")

    outs = _run_streams(server, kill)
    errors = [o.get("error") for o in outs if "error" in o]
    assert not errors, errors
    wrong = [
        i for i, (o, r) in enumerate(zip(outs, reference, strict=True)) if o["text"] != r["text"]
    ]
    assert not wrong, f"streams {wrong} differ from the reference"
    m = metric_values(side)
    assert metric_sum(m, "eaas_failovers_total") > failovers0
    assert metric_sum(m, "eaas_server_marked_down_total", server="expert-1") >= 1
    h = httpx.get(f"{side}/health", timeout=10).json()
    assert h["servers"]["expert-1"]["state"] != "connected"
    assert h["uncovered_experts"] == 0 and h["status"] == "ok"  # redundancy 2: all covered
    assert wait_until(lambda: any(b["server_id"] == "expert-1" for _, b in reports.bodies), 30, 0.1)
    auth, body = next((a, b) for a, b in reports.bodies if b["server_id"] == "expert-1")
    assert auth == f"Bearer {TOKEN}"
    assert body["client_id"] == "vllm-test" and body["table_version"] == 2


def test_table_without_the_dead_server_is_applied_from_the_file(stack):
    server, fleet, side, _ = stack
    fleet.publish(fleet.table.without_servers(["expert-1"]).with_version(3))
    assert wait_until(
        lambda: httpx.get(f"{side}/health", timeout=10).json()["routing_table_version"] == 3,
        30,
        0.2,
    )
    h = httpx.get(f"{side}/health", timeout=10).json()
    assert "expert-1" not in h["servers"] and h["uncovered_experts"] == 0
    assert server.greedy_ids([1, 2, 3], 4)


def _uncover(fleet: ExpertFleet) -> list[str]:
    """SIGKILL every live server holding a replica of one expert (the first expert of the
    first MoE layer whose replicas are fewest) and publish the table without them (the
    monitor's part): that expert has no live replica left. Returns the servers killed."""
    t = fleet.table
    reps = min((r for per in t.layers.values() for r in per), key=len)
    victims = sorted(set(reps))
    for sid in victims:
        fleet.kill(sid)
    fleet.publish(t.without_servers(victims).with_version(t.version + 1))
    return victims


def _restart(fleet: ExpertFleet, sid: str) -> None:
    """Start server ``sid`` again with its first command line (same socket, same experts)."""
    old = fleet.procs[sid]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    log = fleet.workdir / f"{sid}.log"
    with open(log, "ab") as f:
        fleet.procs[sid] = subprocess.Popen(
            old.args, stdout=f, stderr=subprocess.STDOUT, env=env, cwd="/"
        )


def _reference(server: VllmServer) -> list[dict]:
    if not REFERENCE:
        REFERENCE.extend(_run_streams(server))
    assert all("text" in o for o in REFERENCE), REFERENCE
    return REFERENCE


def _short_round(server: VllmServer) -> list[object]:
    """The :data:`SHORT` prompts at once, 1 greedy token each (the prompt's only token and
    nothing else goes through the MoE layers): its token ids, or ``(HTTP status, JSON body)``
    it failed with."""

    def one(p: list[int]) -> object:
        try:
            return server.greedy_ids(p, 1)
        except httpx.HTTPStatusError as exc:
            return exc.response.status_code, exc.response.json()

    with ThreadPoolExecutor(len(SHORT)) as ex:
        return list(ex.map(one, SHORT))


def test_no_live_replica_fails_only_the_affected_requests(stack):
    """Last: with redundancy 1 for some expert (every server holding it SIGKILLed, the table
    without them), 32 one-token requests at once: those whose token selects that expert end
    with HTTP 503 and an OpenAI-style ``ServiceUnavailableError`` body naming the cause, the
    others complete with the reference token; 16 concurrent streams: the requests whose tokens
    select that expert end with the same error as the stream's error event (never a hang),
    vLLM does not stop (its engine and /health stay up, the plugin's /health is 503 with the
    expert uncovered); once the servers are back in a table every stream completes with the
    reference text again."""
    server, fleet, side, _ = stack
    reference = _reference(server)
    short_ref = _short_round(server)
    assert all(isinstance(r, list) for r in short_ref), short_ref
    before = fleet.table
    victims = _uncover(fleet)
    assert wait_until(
        lambda: httpx.get(f"{side}/health", timeout=10).status_code == 503, 60, 0.2
    ), "the plugin's /health did not turn 503 with an expert uncovered"
    h = httpx.get(f"{side}/health", timeout=10).json()
    assert h["status"] == "degraded" and h["uncovered_experts"] > 0 and h["fails_requests"]
    # one-token requests in one batch: those whose token selects the uncovered expert fail
    # (503, the middleware's answer to what the scheduler recorded), the others in the same
    # steps complete with the reference token
    short = _short_round(server)
    failed = [i for i, r in enumerate(short) if not isinstance(r, list)]
    print(f"one-token requests: {len(failed)} of {len(SHORT)} failed")
    assert failed and len(failed) < len(SHORT), short
    for i in failed:
        status, body = short[i]  # type: ignore[misc]
        assert status == 503, short[i]
        assert body["error"]["type"] == "ServiceUnavailableError", body
        assert body["error"]["code"] == 503 and "no_live_replica" in body["error"]["message"]
    assert all(r == short_ref[i] for i, r in enumerate(short) if i not in failed)
    outs = _run_streams(server)  # a hang fails here (threads joined with a timeout)
    errors = [o["error"] for o in outs if "error" in o]
    print(f"streams of {MAX_TOKENS} tokens: {len(errors)} of {STREAMS} failed")
    assert errors, "no request needed the uncovered expert"
    bodies = [o.get("error_body") for o in outs if "error" in o]
    assert all(
        isinstance(b, dict)
        and b.get("code") == 503
        and b.get("type") == "ServiceUnavailableError"
        and "no_live_replica" in b.get("message", "")
        for b in bodies
    ), errors
    wrong = [
        i
        for i, (o, r) in enumerate(zip(outs, reference, strict=True))
        if "text" in o and o["text"] != r["text"]
    ]
    assert not wrong, f"streams {wrong} completed with other text than the reference"
    assert server.proc.poll() is None, server.tail()
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
    log = server.log.read_text(errors="replace")
    assert "eaas: 503 no_live_replica" in log and "EngineDeadError" not in log
    assert httpx.get(f"{side}/health", timeout=10).json()["failed_token_rows"] > 0

    for sid in victims:  # back: vLLM serves every request again, exactly
        _restart(fleet, sid)
    fleet.wait_ready()
    fleet.publish(before.with_version(fleet.table.version + 1))
    assert wait_until(
        lambda: httpx.get(f"{side}/health", timeout=10).status_code == 200, 90, 0.5
    ), httpx.get(f"{side}/health", timeout=10).text
    outs = _run_streams(server)
    assert not [o["error"] for o in outs if "error" in o]
    assert [o["text"] for o in outs] == [r["text"] for r in reference]
