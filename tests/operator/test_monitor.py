"""The operator as monitor: failure-report parsing, the bearer check, the probe target, and the
probe itself against a real local HTTP server."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from eaas.operator.monitor import bearer_ok, health_url, parse_report, probe_health
from eaas.runtime.client.failure_report import failure_report

from helpers.common import free_port


def test_parse_report_roundtrips_the_clients_body():
    body = failure_report("0", "tiny-3", "tcp://127.1.0.7:9000", 12, "recv: PeerDeadError", 1.5)
    r = parse_report(json.dumps(body).encode())
    assert (r.client_id, r.server_id, r.endpoint, r.table_version) == (
        "0",
        "tiny-3",
        "tcp://127.1.0.7:9000",
        12,
    )
    assert r.reason.startswith("recv")


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"not json", "not JSON"),
        (b"[1]", "JSON object"),
        (b'{"table_version": 1}', "server_id"),
        (b'{"server_id": "", "table_version": 1}', "server_id"),
        (b'{"server_id": "a", "table_version": "7"}', "table_version"),
        (b'{"server_id": "a", "table_version": true}', "table_version"),
        (b" " * (64 * 1024 + 1), "larger"),
    ],
)
def test_parse_report_rejects_bad_bodies(raw, match):
    with pytest.raises(ValueError, match=match):
        parse_report(raw)


def test_bearer_ok():
    assert bearer_ok("Bearer s3cret", "s3cret")
    assert bearer_ok("bearer  s3cret ", "s3cret")
    assert not bearer_ok("Bearer wrong", "s3cret")
    assert not bearer_ok(None, "s3cret")
    assert not bearer_ok("Basic s3cret", "s3cret")
    assert not bearer_ok("Bearer ", "")  # no Secret: nothing is accepted


def server_pod(ip="127.1.0.9", port=9001, role="expert-server"):
    return {
        "metadata": {"name": "tiny-1", "labels": {"eaas.io/role": role}},
        "spec": {
            "containers": [
                {
                    "name": "expert-server",
                    "ports": [
                        {"name": "experts", "containerPort": 9000},
                        {"name": "http", "containerPort": port},
                    ],
                }
            ]
        },
        "status": {"podIP": ip},
    }


def test_health_url():
    assert health_url(server_pod()) == "http://127.1.0.9:9001/health"
    assert health_url(server_pod(ip="")) is None
    assert health_url(server_pod(role="attention-client")) is None
    no_http = server_pod()
    no_http["spec"]["containers"][0]["ports"].pop()
    assert health_url(no_http) is None


def test_probe_health_against_a_real_server():
    status = {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(status["code"])
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/health"
    try:
        assert probe_health(url, timeout_s=10)
        status["code"] = 503  # loop stale
        assert not probe_health(url, timeout_s=10)
    finally:
        srv.shutdown()
        srv.server_close()
    closed = free_port()  # nothing listens there: refused
    assert not probe_health(f"http://127.0.0.1:{closed}/health", timeout_s=10)
