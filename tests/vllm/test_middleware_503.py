"""The plugin's API-server middleware (``eaas.vllm.middleware``) over a stand-in ASGI app: a 500
(or a stream's 500 error event) of a request the scheduler recorded becomes a 503 with an
OpenAI-style body; every other response, other 500s included, passes unchanged; the request id
is the one vLLM uses (header, else body ``request_id``, else one the middleware adds). The
real ``vllm serve`` path is ``tests/vllm/test_serve.py``; this file needs no vLLM.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import httpx
import pytest

import eaas.vllm
from eaas.vllm.failed import FailedRequests
from eaas.vllm.middleware import NoLiveReplica503

pytestmark = pytest.mark.vllm

ERROR_500 = {"error": {"message": "Internal server error", "type": "InternalServerError",
                       "param": None, "code": 500}}  # fmt: skip


class StandIn:
    """An ASGI app shaped like vLLM's: records the request it got; answers 500 (JSON), a stream
    with one token event and then a 500 error event, or 200."""

    def __init__(self, mode: str):
        self.mode = mode
        self.seen: dict = {}

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        self.seen = {"headers": dict(scope["headers"]), "body": body}
        if self.mode == "500":
            data = json.dumps(ERROR_500).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"x-request-id", b"echo"),
                                    (b"content-length", str(len(data)).encode())]})  # fmt: skip
            await send({"type": "http.response.body", "body": data})
        elif self.mode == "stream":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})  # fmt: skip
            for chunk in (b'data: {"choices": [{"text": "a"}]}\n\n',
                          b"data: " + json.dumps(ERROR_500).encode() + b"\n\n",
                          b": keep-alive\n\n",
                          b'data: {"choices": [{"text": "500"}]}\n\n'
                          b"data: " + json.dumps(ERROR_500).encode() + b"\n\n",
                          b"data: [DONE]\n\n"):  # fmt: skip
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        else:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})


def _call(
    app: StandIn,
    record: FailedRequests | None,
    path: str,
    body: dict,
    headers: dict | None = None,
) -> httpx.Response:
    mw = NoLiveReplica503(app, record)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=mw)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post(path, json=body, headers=headers or {})

    return asyncio.run(go())


@pytest.fixture
def record(tmp_path):
    return FailedRequests(tmp_path / "record")


def test_a_recorded_request_gets_503_and_another_500_stays(record):
    record.add(["cmpl-abc-0-0123abcd", "chatcmpl-chat1-89abcdef"])
    app = StandIn("500")
    r = _call(app, record, "/v1/completions", {"prompt": "x"}, {"X-Request-Id": "abc"})
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["type"] == "ServiceUnavailableError" and err["code"] == 503
    assert "no_live_replica" in err["message"]
    assert r.headers["x-request-id"] == "echo"  # the 500's other headers stay
    assert int(r.headers["content-length"]) == len(r.content)
    r = _call(app, record, "/root/v1/completions", {"prompt": "x"}, {"X-Request-Id": "abc"})
    assert r.status_code == 503  # under vLLM's --root-path
    r = _call(app, record, "/v1/chat/completions", {"messages": []}, {"X-Request-Id": "chat1"})
    assert r.status_code == 503
    # not recorded (another id, a prefix of a recorded one, the other route): vLLM's 500 as is
    for path, rid in [("/v1/completions", "other"), ("/v1/completions", "ab"),
                      ("/v1/chat/completions", "abc"), ("/v1/completions", "chat1")]:  # fmt: skip
        r = _call(app, record, path, {"prompt": "x"}, {"X-Request-Id": rid})
        assert r.status_code == 500 and r.json() == ERROR_500, (path, rid)


def test_the_body_request_id_is_used_else_one_is_added(record):
    record.add(["cmpl-from-body-0-0123abcd"])
    app = StandIn("500")
    body = {"prompt": "x" * 100_000, "request_id": "from-body"}
    r = _call(app, record, "/v1/completions", body)
    assert r.status_code == 503
    assert json.loads(app.seen["body"]) == body  # the app got the whole body
    assert b"x-request-id" not in app.seen["headers"]  # vLLM takes the body's id itself
    r = _call(app, record, "/v1/completions", {"prompt": "x"})
    assert r.status_code == 500  # nothing recorded under the id it added
    added = app.seen["headers"][b"x-request-id"].decode()
    assert len(added) == 16 and int(added, 16) >= 0
    record.add([f"cmpl-{added}-0-0123abcd"])
    assert record.holds(added, chat=False)


def test_a_streams_error_event_becomes_the_503_event(record):
    record.add(["1_cmpl-s1-0-0123abcd"])  # a child of an n > 1 request
    app = StandIn("stream")
    r = _call(
        app, record, "/v1/completions", {"prompt": "x", "stream": True}, {"X-Request-Id": "s1"}
    )
    assert r.status_code == 200
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    assert events[0] == {"choices": [{"text": "a"}]}
    assert events[1]["error"]["code"] == 503
    assert events[1]["error"]["type"] == "ServiceUnavailableError"
    # an error event in a chunk with another event: only the error event is replaced
    assert events[2] == {"choices": [{"text": "500"}]} and events[3] == events[1]
    assert ": keep-alive" in r.text and r.text.endswith("data: [DONE]\n\n")
    r = _call(
        app, record, "/v1/completions", {"prompt": "x", "stream": True}, {"X-Request-Id": "s2"}
    )
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    assert events[1] == events[3] == ERROR_500 and events[2] == {"choices": [{"text": "500"}]}


def test_other_paths_and_successes_pass_through(record):
    record.add(["cmpl-abc-0-0123abcd"])
    app = StandIn("500")
    r = _call(app, record, "/v1/embeddings", {"input": "x"}, {"X-Request-Id": "abc"})
    assert r.status_code == 500
    assert b"x-request-id" in app.seen["headers"]
    app.mode = "200"
    r = _call(app, record, "/v1/completions", {"prompt": "x"}, {"X-Request-Id": "abc"})
    assert r.status_code == 200 and r.json() == {}


def test_no_record_leaves_500(tmp_path, monkeypatch):
    monkeypatch.delenv("EAAS_FAILED_REQUESTS_DIR", raising=False)
    app = StandIn("500")
    r = _call(app, None, "/v1/completions", {"prompt": "x"}, {"X-Request-Id": "a"})
    assert r.status_code == 500  # the plugin is off (no record named): vLLM's 500
    record = FailedRequests.from_env({"EAAS_FAILED_REQUESTS_DIR": str(tmp_path / "none")})
    assert record is not None and record.ids() == []
    r = _call(app, record, "/v1/completions", {"prompt": "x"}, {"X-Request-Id": "a"})
    assert r.status_code == 500  # named, but nothing recorded yet


def test_the_plugin_names_one_record_for_all_of_vllms_processes(tmp_path, monkeypatch):
    """register() sets the directory in vLLM's first process; its children inherit it."""
    monkeypatch.delenv("EAAS_FAILED_REQUESTS_DIR", raising=False)
    monkeypatch.delenv("VLLM_COMPUTE_NANS_IN_LOGITS", raising=False)
    monkeypatch.setenv("EAAS_ROUTING_TABLE", str(tmp_path / "table.json"))
    monkeypatch.setitem(sys.modules, "eaas.vllm.experts", SimpleExperts)
    eaas.vllm.register()
    d = os.environ["EAAS_FAILED_REQUESTS_DIR"]
    assert str(os.getpid()) in d
    eaas.vllm.register()  # again (vLLM loads plugins in every process): the same directory
    assert os.environ["EAAS_FAILED_REQUESTS_DIR"] == d
    rec = FailedRequests.from_env(os.environ)
    assert rec is not None and rec.path.parent == Path(d)


class SimpleExperts:
    """Stands in for eaas.vllm.experts (torch and vLLM) in register()'s lazy import."""

    @staticmethod
    def install() -> None:
        pass


def test_the_record_rotates(record, monkeypatch):
    import eaas.vllm.failed as failed

    monkeypatch.setattr(failed, "ROTATE_BYTES", 100)
    for i in range(40):
        record.add([f"cmpl-r{i}-0-0123abcd"])
    assert record.holds("r39", chat=False)
    assert not record.holds("r0", chat=False)  # two generations kept: the oldest dropped
    assert record.path.with_name(record.path.name + ".1").exists()
