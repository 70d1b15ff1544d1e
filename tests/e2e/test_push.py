"""Push and acknowledge, and failure reports, on a real attention client.

One deployment for the module (tests run in file order): two ``eaas expert-server`` processes
(``a`` and ``b``, each hosting every expert of the tiny model, TCP), a small HTTP receiver in this
process standing in for the operator's failure-report endpoint, and one ``eaas attention-client``
started with routing table version 1 (every expert on ``a`` only), ``--push-token-file`` and
``--failure-report-url``. Completions go through the official ``openai`` client.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest

from eaas.runtime.models.arch import read_model_info
from eaas.runtime.tables.http import push_routing_table
from eaas.runtime.tables.table import RoutingTable

from helpers.dispatch import wait_all_connected
from helpers.e2e import free_port

TOKEN = "s3cret-push-token"
CLIENT_ID = 3
PROMPT = "Expert servers are stateless"


class Receiver:
    """POST receiver on loopback: keeps ``(path, Authorization header, JSON body)``."""

    def __init__(self):
        self.got: list[tuple[str, str | None, dict]] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                n = int(self.headers.get("Content-Length", 0))
                outer.got.append(
                    (self.path, self.headers.get("Authorization"), json.loads(self.rfile.read(n)))
                )
                self.send_response(204)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/failure-reports"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def table(info, version: int, servers: dict[str, str]) -> RoutingTable:
    ids = tuple(sorted(servers))
    layers = {layer: tuple(ids for _ in range(info.num_experts)) for layer in info.moe_layers}
    return RoutingTable(version, info.num_experts, servers, layers)


@pytest.fixture(scope="module")
def deployment(model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("push")
    info = read_model_info(model_dir)
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    endpoints = {s: f"tcp://127.0.0.1:{free_port()}" for s in ("a", "b")}
    procs: dict[str, subprocess.Popen] = {}
    for sid, ep in endpoints.items():
        procs[sid] = subprocess.Popen(
            [sys.executable, "-m", "eaas", "expert-server", "--model", model_dir]
            + ["--server-id", sid, "--listen", ep],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
    (d / "token").write_text(TOKEN + "\n")
    (d / "rt.json").write_text(table(info, 1, {"a": endpoints["a"]}).to_json())
    receiver = Receiver()
    port = free_port()
    log = open(d / "client.log", "w+")
    client = subprocess.Popen(
        [sys.executable, "-m", "eaas", "attention-client", "--model", model_dir]
        + ["--client-id", str(CLIENT_ID), "--port", str(port), "--served-model-name", "tiny"]
        + ["--routing-table", str(d / "rt.json"), "--failure-report-url", receiver.url]
        # only a real death marks a server down here (a loaded machine may miss 5 s deadlines)
        + ["--dispatch-timeout", "120"],
        stdout=subprocess.PIPE,
        stderr=log,
        env=dict(env, EAAS_PUSH_TOKEN_FILE=str(d / "token")),  # the env form of --push-token-file
        text=True,
    )
    procs["client"] = client
    try:
        for sid in ("a", "b"):
            line = procs[sid].stdout.readline()
            assert " ready on " in line, f"{sid}: {line!r}"
        line = client.stdout.readline()
        log.seek(0)
        assert "ready on http://" in line, f"client: {line!r}\n{log.read()[-3000:]}"
        yield {
            "url": f"http://127.0.0.1:{port}",
            "info": info,
            "endpoints": endpoints,
            "procs": procs,
            "receiver": receiver,
            "log_tail": lambda: (d / "client.log").read_text()[-3000:],
        }
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        receiver.httpd.shutdown()
        log.close()


def put(dep, body: str | bytes, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.put(f"{dep['url']}/routing-table", content=body, headers=headers, timeout=60)


def complete(dep) -> list[int]:
    c = openai.OpenAI(base_url=f"{dep['url']}/v1", api_key="unused", timeout=120, max_retries=0)
    r = c.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) == 6
    return ids


def test_version_1_in_use(deployment):
    r = httpx.get(f"{deployment['url']}/routing-table", timeout=30).json()
    assert r["version"] == 1 and r["client_id"] == str(CLIENT_ID)
    assert r["servers"] == {"a": deployment["endpoints"]["a"]}
    deployment["reference"] = complete(deployment)


def test_push_refusals_keep_the_table(deployment):
    info, eps = deployment["info"], deployment["endpoints"]
    good = table(info, 2, eps).to_json()
    r = put(deployment, good, token=None)
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert r.json()["error"]["code"] == "invalid_token"
    assert put(deployment, good, token="wrong").status_code == 401
    r = httpx.put(  # right token, wrong scheme
        f"{deployment['url']}/routing-table", content=good, headers={"Authorization": TOKEN}
    )
    assert r.status_code == 401

    r = put(deployment, b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = put(deployment, "[" * 100_000 + "]" * 100_000)  # was a RecursionError: HTTP 500
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text
    r = put(deployment, "[1, 2]")
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"]
    for version in ("5", 5.0, True):  # not a JSON integer: refused naming the field
        r = put(deployment, json.dumps({**table(info, 5, eps).to_dict(), "version": version}))
        assert r.status_code == 400, r.text
        assert "'version' must be an integer" in r.json()["error"]["message"], r.text
    r = put(deployment, json.dumps({"version": 5}))
    assert r.status_code == 400 and "num_experts" in r.json()["error"]["message"]
    bad = table(info, 5, eps).to_dict()
    bad["layers"]["1"][0] = ["zz"]
    r = put(deployment, json.dumps(bad))
    assert r.status_code == 400 and "unknown server 'zz'" in r.json()["error"]["message"]
    wrong_n = RoutingTable(5, info.num_experts - 1, eps, {1: ((("a",),) * (info.num_experts - 1))})
    r = put(deployment, wrong_n.to_json())
    assert r.status_code == 400 and "num_experts" in r.json()["error"]["message"]
    not_moe = table(info, 5, eps).to_dict()
    not_moe["layers"]["0"] = not_moe["layers"]["1"]
    r = put(deployment, json.dumps(not_moe))
    assert r.status_code == 400 and "not MoE layers" in r.json()["error"]["message"]

    r = put(deployment, table(info, 1, eps).to_json())  # the version in use: not newer
    assert r.status_code == 409
    assert r.json()["applied_version"] == 1 and r.json()["error"]["code"] == "stale_version"

    assert httpx.get(f"{deployment['url']}/routing-table", timeout=30).json()["version"] == 1
    assert complete(deployment) == deployment["reference"]  # still serving, same tokens


def test_an_oversized_push_is_refused_before_its_body_is_read(deployment):
    """PUT /routing-table read the whole body into memory before the 64 MiB check (a peer
    without a token could make the client buffer any size): a declared length over the limit is
    refused at once (here the body never comes, so reading it would wait until the socket
    timeout), and a chunked body stops being read at the limit."""
    import socket

    port = int(deployment["url"].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(
            b"PUT /routing-table HTTP/1.1\r\nHost: x\r\n"
            + f"Content-Length: {100 * 10**9}\r\n\r\n{{}}".encode()
        )
        status = s.recv(4096).split(b"\r\n", 1)[0]
    assert b" 413 " in status, status

    def chunks():
        for _ in range(80):
            yield b" " * (1 << 20)

    r = httpx.put(f"{deployment['url']}/routing-table", content=chunks(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "invalid_routing_table", r.text
    assert httpx.get(f"{deployment['url']}/routing-table", timeout=30).json()["version"] == 1


def test_push_applies_and_acknowledges(deployment):
    info, eps = deployment["info"], deployment["endpoints"]
    r = put(deployment, table(info, 3, eps).to_json())
    assert r.status_code == 200, r.text
    assert r.json() == {
        "acknowledged_version": 3,
        "previous_version": 1,
        "client_id": str(CLIENT_ID),
    }
    got = httpx.get(f"{deployment['url']}/routing-table", timeout=30).json()
    assert got["version"] == 3 and got["servers"] == eps and got["uncovered_experts"] == 0
    h = httpx.get(f"{deployment['url']}/health", timeout=30).json()
    assert h["routing_table_version"] == 3 and set(h["servers"]) == {"a", "b"}

    # the pusher's helper (what the operator calls): older than the one in use -> 409
    res = push_routing_table(deployment["url"], table(info, 2, eps).to_json(), TOKEN)
    assert (res.status, res.applied_version, res.acknowledged_version) == (409, 3, None)
    assert "not newer" in res.message
    assert push_routing_table(deployment["url"], "{}", "wrong").status == 401
    # b's first connection opens in the background after the push: a call while it is still
    # opening goes to a alone (every expert is covered, so the call does not wait for b)
    wait_all_connected(lambda: httpx.get(f"{deployment['url']}/health", timeout=30).json())
    assert complete(deployment) == deployment["reference"]
    h = httpx.get(f"{deployment['url']}/health", timeout=30).json()
    assert all(s["tokens_sent"] > 0 for s in h["servers"].values()), h["servers"]


def test_failure_report_after_sigkill(deployment):
    """SIGKILL ``b``: the request fails over to ``a`` and the client reports ``b`` (with the
    bearer token, the endpoint and the table version in use) to the receiver."""
    procs, receiver = deployment["procs"], deployment["receiver"]
    # only reports about this module's servers, sent after the kill: the suite runs on two
    # workers, and another module's client may POST to a loopback port it got from free_port()
    # that this receiver bound since (seen once: a report about another test's server "a"); and
    # on a loaded machine the client's first connect to "a" (2 s deadline) may have failed at
    # start-up, a report that is true but not this test's subject
    before = len(receiver.got)
    mine = set(deployment["endpoints"].values())
    os.kill(procs["b"].pid, signal.SIGKILL)
    procs["b"].wait(30)
    assert complete(deployment) == deployment["reference"]

    def ours() -> list[tuple[str, str | None, dict]]:
        return [r for r in receiver.got[before:] if r[2].get("endpoint") in mine]

    end = time.monotonic() + 60
    while not ours() and time.monotonic() < end:
        time.sleep(0.1)
    assert ours(), "no failure report within 60 s"
    path, auth, body = ours()[0]
    assert path == "/v1/failure-reports" and auth == f"Bearer {TOKEN}"
    assert body["server_id"] == "b" and body["endpoint"] == deployment["endpoints"]["b"], (
        body,
        receiver.got,
        deployment["log_tail"](),
    )
    assert body["table_version"] == 3 and body["client_id"] == str(CLIENT_ID)
    assert body["reason"] and isinstance(body["time"], float)
    assert all(b["server_id"] == "b" for _, _, b in ours())  # a was not reported
    m = httpx.get(f"{deployment['url']}/metrics", timeout=30).text
    assert 'eaas_failure_reports_total{outcome="sent"}' in m


def test_failure_reporter_never_blocks_and_drops_on_overflow():
    """A monitor that accepts connections but never answers: reports queue up to the bound, the
    rest are dropped and counted, and ``report`` returns at once every time (it only enqueues)."""
    import socket

    from eaas.runtime.client.failure_report import FailureReporter

    with socket.socket() as hung:  # listens, never accepts: requests sit in the backlog
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)
        url = f"http://127.0.0.1:{hung.getsockname()[1]}/report"
        reporter = FailureReporter(url, "9", timeout_s=30, queue_size=4).start()
        queued = [
            reporter.report(f"s{i}", "tcp://x:1", 7, "recv: PeerDeadError") for i in range(50)
        ]
        assert sum(queued) <= 5  # 4 in the queue + at most 1 taken by the sender thread
        assert reporter.dropped == 50 - sum(queued)
        assert reporter.sent == 0
    with pytest.raises(ValueError, match="http"):
        FailureReporter("ftp://x", "9")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--routing-table-configmap", "nons"], "NAMESPACE/NAME"),
        (["--routing-table-configmap", "a/b/c"], "NAMESPACE/NAME"),
        (["--routing-table", "x.json", "--failure-report-url", "ftp://x"], "http://"),
        ([], "--routing-table-configmap"),
    ],
)
def test_cli_rejects_bad_flags(args, needle):
    r = subprocess.run(
        [sys.executable, "-m", "eaas", "attention-client", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and needle in r.stderr, r.stderr
