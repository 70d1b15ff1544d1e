"""The API's guards and its OpenAPI document, on a real uvicorn socket around the real app: API
keys (401 without / with a wrong key, the official ``openai`` client), the Content-Type check
(a browser's cross-site ``text/plain`` POST is a 415 before any handler runs), the document
(valid per ``openapi-spec-validator``, unique operation ids, request bodies); the key options
(never on a child's command line) and the engine callback once the event loop is closed.

The handlers' side is a stand-in that records what reaches it: these tests are about what
happens before a body is read. The same checks against ``eaas serve``:
``tests/e2e/test_api_security.py``."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from openapi_spec_validator import validate

from eaas.runtime.client.api.app import create_app
from eaas.runtime.client.api.guard import JSON_ROUTES, key_accepted, needs_key
from eaas.runtime.client.api.openapi import REQUEST_BODIES
from eaas.runtime.client.api.protocol import bad
from eaas.runtime.client.api.server import event_callback
from eaas.runtime.client.api.streaming import EventMailbox
from eaas.runtime.client.request import GenerationRequest
from eaas.runtime.client.sampling import SamplingParams
from eaas.runtime.options import API_KEY_ENV, AttentionClientOptions, ServeOptions, api_keys_from

pytestmark = [pytest.mark.engine, pytest.mark.api]

KEYS = ("key-one", "key-two")


class _Preparer:
    def check_model(self, model):
        if model and model != "m":
            raise bad(f"no model {model}", "model", "model_not_found")


def _stand_in(keys: tuple[str, ...], seen: list) -> SimpleNamespace:
    def prepare(body):  # reached only past the guard: record, then refuse (no engine here)
        seen.append(body)
        raise bad("stand-in handler", "prompt")

    return SimpleNamespace(
        max_request_body=1 << 20,
        client_id="unit",
        model_name="m",
        created=0,
        max_context=64,
        api_keys=keys,
        health_extra=None,
        engine=SimpleNamespace(num_running=0, num_waiting=0),
        requests=_Preparer(),
        prepare_completion=prepare,
        prepare_chat=prepare,
        tokenize=prepare,
        detokenize=prepare,
    )


def _serve(server) -> tuple[str, uvicorn.Server, threading.Thread]:
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
    return f"http://127.0.0.1:{sock.getsockname()[1]}", srv, t


@pytest.fixture
def keyed():
    seen: list = []
    base, srv, t = _serve(_stand_in(KEYS, seen))
    yield base, seen
    srv.should_exit = True
    t.join(30)


@pytest.fixture
def open_api():
    seen: list = []
    base, srv, t = _serve(_stand_in((), seen))
    yield base, seen
    srv.should_exit = True
    t.join(30)


def test_no_key_wrong_key_right_key_with_the_openai_client(keyed):
    base, _ = keyed
    for key, ok in ((None, False), ("key-three", False), ("key-one", True), ("key-two", True)):
        c = openai.OpenAI(base_url=f"{base}/v1", api_key=key or "x", max_retries=0, timeout=30)
        # no key: the request's Authorization header omitted (the client cannot start keyless)
        omit = {"Authorization": openai.Omit()} if key is None else None
        try:
            if ok:
                assert [m.id for m in c.models.list().data] == ["m"]
                assert c.models.retrieve("m").id == "m"
            else:
                with pytest.raises(openai.AuthenticationError) as ei:
                    c.models.list(extra_headers=omit)
                assert ei.value.status_code == 401
                assert ei.value.body["code"] == "invalid_api_key", ei.value.body
        finally:
            c.close()
    r = httpx.get(f"{base}/v1/models", timeout=30)  # no Authorization header at all
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")


def test_which_paths_need_the_key(keyed):
    base, seen = keyed
    for path in ("/health", "/metrics", "/version", "/openapi.json"):
        assert httpx.get(f"{base}{path}", timeout=30).status_code == 200, path
    assert httpx.head(f"{base}/health", timeout=30).status_code == 200
    for path in sorted(JSON_ROUTES):
        r = httpx.post(f"{base}{path}", json={"prompt": "x"}, timeout=30)
        assert r.status_code == 401, (path, r.text)
        r = httpx.post(
            f"{base}{path}", json={"prompt": "x"}, headers={"authorization": "bearer key-two"}
        )
        assert r.status_code == 400 and r.json()["error"]["message"] == "stand-in handler"
    assert len(seen) == len(JSON_ROUTES)  # only the requests with the key reached a handler
    assert httpx.get(f"{base}/v1/nothing-here", timeout=30).status_code == 401
    assert needs_key("/v1") and needs_key("/tokenize") and not needs_key("/v1x")


@pytest.mark.parametrize(
    "ctype",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonp",
        None,
    ],
)
def test_a_body_that_is_not_declared_json_is_a_415_before_any_handler(open_api, ctype):
    """What a web page can make a browser send cross-site without a CORS preflight (text/plain,
    a form) must not start a generation: the JSON body ran and answered 200 before."""
    base, seen = open_api
    body = json.dumps({"prompt": "Hi", "max_tokens": 4})
    for path in sorted(JSON_ROUTES):
        headers = {} if ctype is None else {"content-type": ctype}
        r = httpx.post(f"{base}{path}", content=body, headers=headers, timeout=30)
        assert r.status_code == 415, (path, ctype, r.text)
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("Content-Type", "unsupported_media_type")
        assert "application/json" in err["message"]
    assert seen == []


def test_json_with_a_charset_passes_the_guard(open_api):
    base, seen = open_api
    for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        r = httpx.post(
            f"{base}/v1/completions", content=b'{"prompt": "Hi"}', headers={"content-type": ctype}
        )
        assert r.status_code == 400 and r.json()["error"]["message"] == "stand-in handler"
    assert seen == [{"prompt": "Hi"}] * 3


def test_the_openapi_document_is_valid_with_bodies_and_unique_ids(open_api):
    base, _ = open_api
    doc = httpx.get(f"{base}/openapi.json", timeout=30).json()
    validate(doc)  # raises on an invalid OpenAPI document
    ops = [(p, m, op) for p, item in doc["paths"].items() for m, op in item.items()]
    ids = [op["operationId"] for _, _, op in ops]
    assert len(ids) == len(set(ids)), ids
    assert {"health", "health_head", "retrieve_model"} <= set(ids)
    schemas = doc["components"]["schemas"]
    for path, model in REQUEST_BODIES.items():
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith(f"/{model.__name__}") and model.__name__ in schemas
        for status in ("400", "401", "415", "500"):
            err = op["responses"][status]["content"]["application/json"]["schema"]
            assert err["$ref"].endswith("/ErrorResponse"), (path, status)
    props = schemas["CompletionRequest"]["properties"]
    assert {"prompt", "prompt_logprobs", "return_token_ids", "echo"} <= set(props)
    assert schemas["CompletionRequest"]["additionalProperties"] is False
    ok = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(ok) == {"application/json", "text/event-stream"}


def test_model_aliases_are_accepted():
    from eaas.runtime.client.api.prepare import RequestPreparer

    rp = RequestPreparer(None, "tiny", 64, 10, aliases=("org/other",))
    for name in ("tiny", "org/other", "", None):
        rp.check_model(name)
    with pytest.raises(Exception) as ei:
        rp.check_model("gpt-17")
    assert getattr(ei.value, "status", None) == 404


def test_api_keys_from_the_flag_or_the_environment():
    assert api_keys_from(["a", "b"], {API_KEY_ENV: "c"}) == ("a", "b")  # the flag wins
    assert api_keys_from(None, {API_KEY_ENV: " c , d "}) == ("c", "d")
    assert api_keys_from([], {API_KEY_ENV: " "}) == () and api_keys_from(None, {}) == ()
    for keys in (["a b"], ["a,b"], [""]):
        with pytest.raises(ValueError, match="--api-key") as ei:
            api_keys_from(keys, {})
        assert "a b" not in str(ei.value)  # the message never shows a key
    assert key_accepted("Bearer b", ("a", "b")) and not key_accepted("Bearer c", ("a", "b"))
    assert not key_accepted(None, ("a",)) and not key_accepted("Basic a", ("a",))


def test_a_key_travels_in_the_environment_never_on_the_command_line():
    o = AttentionClientOptions(routing_table="t.json", api_key=KEYS)
    assert not any(k in arg for k in KEYS for arg in o.argv())
    assert "key-one" not in repr(o)
    env = o.environment({"PATH": "/bin", API_KEY_ENV: "inherited"})
    assert env == {"PATH": "/bin", API_KEY_ENV: "key-one,key-two"}
    bare = AttentionClientOptions(routing_table="t.json").environment({API_KEY_ENV: "inherited"})
    assert API_KEY_ENV not in bare  # a child sees exactly its options' keys
    assert ServeOptions(api_key=("k",)).api_key == ("k",)
    with pytest.raises(ValueError, match="--api-key"):
        ServeOptions(api_key=("",))


def test_an_event_after_the_loop_closed_cancels_the_choice_quietly():
    """Ctrl-C during a stream: the loop ends while the engine thread still emits. The callback
    raised ``RuntimeError: Event loop is closed`` into the engine, which logged a traceback for
    every token left; now the choice is cancelled and the event dropped."""
    loop = asyncio.new_event_loop()
    q: asyncio.Queue = asyncio.Queue()
    box = EventMailbox(loop)
    req = GenerationRequest(prompt_ids=[1], params=SamplingParams(), on_event=lambda ev: None)
    cb = event_callback(box, q, 0, lambda: req)
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        box.post(q, (0, "ev"))  # what the engine's callback met before
    cb("ev")  # no exception
    assert req.cancelled
    live = asyncio.new_event_loop()
    try:
        q2: asyncio.Queue = asyncio.Queue()
        event_callback(EventMailbox(live), q2, 3, lambda: req)("tok")
        live.run_until_complete(asyncio.sleep(0))
        assert q2.get_nowait() == (3, "tok")
    finally:
        live.close()
