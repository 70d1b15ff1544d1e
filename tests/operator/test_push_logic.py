"""Push and acknowledge, operator side: which clients get a push and what an answer means."""

from __future__ import annotations

from eaas.operator.push import (
    ObservedClient,
    PushResult,
    PushRetry,
    acknowledged,
    after_push,
    clients_to_push,
    push_all,
    push_due,
    push_retry_delay_s,
)

from helpers.common import free_port


def pod(name, uid, ip="127.1.0.5", ready=True, deleting=False):
    return {
        "metadata": {"name": name, "uid": uid, **({"deletionTimestamp": "T"} if deleting else {})},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_observed_client_from_pod():
    assert ObservedClient.from_pod(pod("a", "u1")) == ObservedClient("a", "u1", "127.1.0.5", True)
    assert not ObservedClient.from_pod(pod("a", "u1", ready=False)).ready
    assert not ObservedClient.from_pod(pod("a", "u1", deleting=True)).ready
    assert ObservedClient.from_pod({"metadata": {"name": "b"}}).ip == ""


def test_clients_to_push_skips_unready_and_acknowledged():
    clients = [
        ObservedClient("a", "u1", "127.1.0.5", True),
        ObservedClient("b", "u2", "127.1.0.6", True),
        ObservedClient("c", "u3", "127.1.0.7", False),  # not Ready
        ObservedClient("d", "u4", "", True),  # no IP yet
    ]
    acks = {"u1": 7, "u2": 6}
    assert [c.name for c in clients_to_push(clients, acks, 7)] == ["b"]
    assert [c.name for c in clients_to_push(clients, acks, 8)] == ["a", "b"]
    assert clients_to_push(clients, {}, 0) == []  # no table yet
    # a replacement pod (new uid) starts unacknowledged
    new = [ObservedClient("a", "u9", "127.1.0.9", True)]
    assert clients_to_push(new, acks, 7) == new


def test_acknowledged_reads_200_and_409():
    assert acknowledged(PushResult(200, 7, None, "")) == 7
    assert acknowledged(PushResult(409, None, 9, "stale")) == 9  # got it from the ConfigMap
    assert acknowledged(PushResult(401, None, None, "bad token")) is None
    assert acknowledged(PushResult(400, None, None, "invalid")) is None


def test_put_table_speaks_the_push_protocol():
    """The operator's push call (push_routing_table) against a local HTTP server answering as an attention client does."""
    import http.server
    import json
    import threading

    import pytest

    from eaas.runtime.tables.http import push_routing_table as put_table

    seen = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):  # noqa: N802
            seen["path"] = self.path
            seen["auth"] = self.headers["Authorization"]
            seen["body"] = self.rfile.read(int(self.headers["Content-Length"]))
            body = {"error": {"message": "stale", "code": "stale_version"}, "applied_version": 9}
            raw = json.dumps(body).encode()
            self.send_response(409)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = put_table(f"http://127.0.0.1:{srv.server_address[1]}/", '{"version": 8}', "tok", 10)
    finally:
        srv.shutdown()
        srv.server_close()
    assert r == PushResult(409, None, 9, "stale")
    assert acknowledged(r) == 9
    assert seen == {"path": "/routing-table", "auth": "Bearer tok", "body": b'{"version": 8}'}
    closed = free_port()
    with pytest.raises(OSError):
        put_table(f"http://127.0.0.1:{closed}", "{}", "tok", 10)


def test_push_retry_delay_doubles_to_a_cap():
    assert push_retry_delay_s(0) == 0.0
    assert [push_retry_delay_s(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert push_retry_delay_s(7) == 60.0  # 64 capped
    assert push_retry_delay_s(10_000) == 60.0  # no overflow
    assert push_retry_delay_s(3, base_s=0.5, cap_s=1.5) == 1.5


def test_back_off_per_client_and_new_versions_go_out_at_once():
    a, b = (
        ObservedClient("a", "u1", "127.1.0.5", True),
        ObservedClient("b", "u2", "127.1.0.6", True),
    )
    retries = {}
    r1 = after_push(None, 5, ok=False, now=100.0)
    assert r1 == PushRetry(failures=1, version=5, next_at=101.0)
    retries["u1"] = r1
    # u1 waits its delay for version 5; u2 is not affected
    assert clients_to_push([a, b], {}, 5, retries, now=100.5) == [b]
    assert clients_to_push([a, b], {}, 5, retries, now=101.0) == [a, b]
    # failures add up: the next delay doubles
    r2 = after_push(r1, 5, ok=False, now=101.0)
    assert r2 == PushRetry(2, 5, 103.0)
    assert not push_due(r2, 5, 102.9) and push_due(r2, 5, 103.0)
    # a newer version is pushed at once, but a failure keeps counting up
    assert push_due(r2, 6, 101.5)
    assert after_push(r2, 6, ok=False, now=101.5) == PushRetry(3, 6, 105.5)
    # an acknowledgement clears the back-off
    assert after_push(r2, 6, ok=True, now=102.0) is None


def test_push_all_records_back_off_for_unreachable_clients():
    import concurrent.futures

    port = free_port()  # a port with nothing listening: connection refused
    client = ObservedClient("a", "u1", "127.0.0.1", True)
    acks, retries = {}, {}
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        failures = push_all(
            [client], port, "{}", "t", acks, ex, timeout_s=10, retries=retries, version=3, now=50.0
        )
        assert "unreachable" in failures["a"]
        assert acks == {} and retries == {"u1": PushRetry(1, 3, 51.0)}
        push_all(
            [client], port, "{}", "t", acks, ex, timeout_s=10, retries=retries, version=3, now=51.0
        )
        assert retries == {"u1": PushRetry(2, 3, 53.0)}
