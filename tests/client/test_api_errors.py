"""The API's error answers that need no model: an unexpected exception is a JSON 500 in OpenAI's
shape on a connection that stays open, and request bodies are strict UTF-8 JSON whose lone UTF-16
surrogates are found by path (pure functions).

The end-to-end cases (real ``eaas serve``, each bad request followed by one that succeeds) are in
``tests/e2e/test_api.py``; this file covers what a real server cannot be made to do on purpose (a
handler that raises), with a real uvicorn on a real socket."""

from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import uvicorn

from eaas.runtime.client.api.app import check_no_lone_surrogates, create_app, parse_json_body
from eaas.runtime.client.api.protocol import APIError

pytestmark = pytest.mark.engine


def _raise(_body):
    raise RuntimeError("a bug")


@pytest.fixture
def buggy_server():
    """uvicorn serving the app around a server whose completions handler raises."""
    server = SimpleNamespace(
        max_request_body=1 << 20, client_id="unit", prepare_completion=_raise, model_name="m"
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(create_app(server), log_level="critical", lifespan="off")
    srv = uvicorn.Server(config)
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.05)
    yield sock.getsockname()[1]
    srv.should_exit = True
    t.join(30)


def _read_response(f) -> tuple[str, dict[str, str], bytes]:
    status = f.readline().decode().strip()
    assert status, "connection closed instead of an answer"
    headers = {}
    while (line := f.readline().decode().strip()) != "":
        k, v = line.split(":", 1)
        headers[k.strip().lower()] = v.strip()
    return status, headers, f.read(int(headers["content-length"]))


def test_unexpected_exception_is_a_json_500_on_a_connection_that_stays_open(buggy_server):
    """Before, anything not an ``APIError`` became Starlette's plain-text "Internal Server Error",
    re-raised, and uvicorn closed the keep-alive connection: OpenAI clients could not parse the
    answer and the next request on that connection failed."""
    body = json.dumps({"prompt": "Hi"}).encode()
    req = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    with socket.create_connection(("127.0.0.1", buggy_server), timeout=60) as s:
        f = s.makefile("rb")
        for _ in range(2):  # the same connection answers again
            s.sendall(req)
            status, headers, content = _read_response(f)
            assert status == "HTTP/1.1 500 Internal Server Error"
            assert headers.get("connection") != "close"
            assert json.loads(content) == {
                "error": {
                    "message": "internal error (RuntimeError); the server keeps serving",
                    "type": "internal_error",
                    "param": None,
                    "code": "internal_error",
                }
            }


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "a\ud800b"}, "prompt"),
        ({"prompt": ["ok", "\udfff"]}, "prompt[1]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
            "messages[0].content[0].text",
        ),
        ({"logit_bias": {"\udc00": 1}}, "logit_bias"),  # a field name: its object is named
        ({"\ud800": 1}, None),
    ],
)
def test_lone_surrogates_are_named_by_path(body, param):
    with pytest.raises(APIError) as ei:
        check_no_lone_surrogates(body)
    assert ei.value.status == 400 and ei.value.param == param
    assert "surrogate" in ei.value.message
    # the same through the body parser, escaped as json.dumps writes it
    with pytest.raises(APIError) as ei:
        parse_json_body(json.dumps(body).encode())
    assert ei.value.param == param


def test_surrogate_pairs_and_plain_text_pass():
    body = {
        "prompt": "emoji \U0001f600 ok",
        "stop": ["\u00e9"],
        "n": 2,
        "x": None,
        "t": [1.5, True],
    }
    check_no_lone_surrogates(body)
    assert parse_json_body(json.dumps(body).encode()) == body  # escaped pair (ensure_ascii)
    assert parse_json_body(json.dumps(body, ensure_ascii=False).encode()) == body  # raw UTF-8


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "a\xed\xa0\x80"}',  # a surrogate encoded as bytes (not UTF-8; json took it)
        '{"prompt": "a"}'.encode("utf-16"),  # JSON must be UTF-8 (RFC 8259 section 8.1)
        '{"prompt": "a"}'.encode("utf-32-le"),
        b'{"seed": ' + b"1" * 5000 + b"}",  # Python's int digit limit (a ValueError)
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ],
)
def test_bodies_that_are_not_utf8_json_are_400(raw):
    with pytest.raises(APIError) as ei:
        parse_json_body(raw)
    assert (ei.value.status, ei.value.code, ei.value.param) == (400, "invalid_json", None)


@pytest.mark.parametrize("n", [0, 1, 5])
def test_array_encoded_in_parts_equals_one_encoding(n):
    """Large answers are encoded one array element (or run) per ``json.dumps`` call, so the event
    loop runs in between; the bytes equal one call's, key order included."""
    from eaas.runtime.client.api.responses import json_bytes, json_bytes_with_array

    items = [{"index": i, "text": 'é\u0000"x', "lp": [-0.5, None]} for i in range(n)]
    full = {"id": "c", "choices": items, "usage": {"total_tokens": 3}, "model": "m\u2028"}
    parts = (json_bytes(x) for x in items)
    assert json_bytes_with_array(full, "choices", parts) == json_bytes(full)
    toks = list(range(10))
    runs = (json_bytes(toks[i : i + 3])[1:-1] for i in range(0, len(toks), 3))
    assert json_bytes_with_array({"tokens": toks}, "tokens", runs) == json_bytes({"tokens": toks})
