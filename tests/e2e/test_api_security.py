"""The API's locks and its contract, against a real ``eaas serve`` started with
``$EAAS_API_KEY`` (two keys): the key never on a child's command line; no key, a wrong key and
the right key give 401, 401, 200 with the official ``openai`` client; a browser-style cross-site
POST (``text/plain``) is refused before it reaches the engine; ``/openapi.json`` is a valid
OpenAPI document; and schemathesis, generating requests from that document, finds no 5xx, no
answer outside the documented statuses, content types and schemas, and no hang.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from openapi_spec_validator import validate
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from helpers.e2e import ServeProcess, descendants, free_port, metric_sum, metric_values

pytestmark = pytest.mark.api

KEYS = ("sk-eaas-test-one", "sk-eaas-test-two")
#: the fuzzed generation requests are bounded so that every answer comes within the timeout
FUZZ_MAX_TOKENS, FUZZ_MAX_N, FUZZ_TIMEOUT_S = 4, 2, 120
FUZZ_EXAMPLES = 30  # per operation


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-keys") / "serve.log"
    sp = ServeProcess(["--expert-servers", "2", "--replicas", "1"], log, free_port())
    old = os.environ.get("EAAS_API_KEY")
    os.environ["EAAS_API_KEY"] = ",".join(KEYS)  # serve's environment, not its flags
    try:
        sp.start()
    finally:
        if old is None:
            os.environ.pop("EAAS_API_KEY")
        else:
            os.environ["EAAS_API_KEY"] = old
    yield sp
    sp.stop(check=True)


def _auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def model_name(deployment):
    r = httpx.get(f"{deployment.base_url}/v1/models", headers=_auth(), timeout=30)
    return r.json()["data"][0]["id"]


def test_the_key_reaches_the_clients_in_their_environment_only_and_no_server(deployment):
    kids = descendants(deployment.proc.pid)
    clients = [pid for pid, cmd in kids.items() if "attention-client" in cmd]
    assert clients and len(kids) >= 3, kids
    for cmd in kids.values():
        assert not any(k in cmd for k in KEYS), cmd  # ps shows no key
    servers = [pid for pid, cmd in kids.items() if "expert-server" in cmd]
    assert len(servers) == 2, kids
    for pid in clients + servers:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        keys = [v for v in env if v.startswith(b"EAAS_API_KEY=")]
        # least privilege: an expert server answers no API request and gets no key
        want = [f"EAAS_API_KEY={','.join(KEYS)}".encode()] if pid in clients else []
        assert keys == want, (kids[pid], keys)


def test_no_key_wrong_key_right_key(deployment, model_name):
    base = f"{deployment.base_url}/v1"
    statuses = []
    for key in (None, "sk-wrong", KEYS[1]):
        c = openai.OpenAI(base_url=base, api_key=key or "x", max_retries=0, timeout=120)
        omit = {"Authorization": openai.Omit()} if key is None else None
        try:
            r = c.completions.with_raw_response.create(
                model=model_name, prompt="Hi", max_tokens=2, extra_headers=omit
            )
            statuses.append(r.status_code)
            assert len(r.parse().choices[0].text) >= 0
        except openai.AuthenticationError as exc:
            statuses.append(exc.status_code)
            assert exc.body["code"] == "invalid_api_key"
        finally:
            c.close()
    assert statuses == [401, 401, 200]
    # probes and scrapers stay open
    for path in ("/health", "/metrics", "/openapi.json"):
        assert httpx.get(f"{deployment.base_url}{path}", timeout=30).status_code == 200, path


def test_a_cross_site_text_plain_post_is_refused(deployment, model_name):
    """What a web page's ``fetch(url, {method: "POST", mode: "no-cors", body})`` sends: a JSON
    text as ``text/plain`` (no CORS preflight for it). Refused with 415 before the body is read,
    even with the right key; it starts no generation."""
    base = deployment.base_url
    before = metric_sum(metric_values(base), "eaas_requests_total", status="200")
    body = json.dumps({"model": model_name, "prompt": "Hi", "max_tokens": 2})
    for ctype in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded"):
        r = httpx.post(
            f"{base}/v1/completions",
            content=body,
            headers={**_auth(), "Content-Type": ctype, "Origin": "https://evil.example"},
            timeout=60,
        )
        assert r.status_code == 415, r.text
        assert r.json()["error"]["param"] == "Content-Type"
        assert "access-control-allow-origin" not in r.headers
    assert metric_sum(metric_values(base), "eaas_requests_total", status="200") == before
    ok = httpx.post(
        f"{base}/v1/completions",
        content=body,
        headers={**_auth(), "Content-Type": "application/json"},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


@pytest.fixture(scope="module")
def openapi_doc(deployment):
    doc = httpx.get(f"{deployment.base_url}/openapi.json", timeout=30).json()
    validate(doc)
    return doc


def test_the_served_openapi_document_is_valid(openapi_doc):
    ids = [op["operationId"] for item in openapi_doc["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids))
    assert "requestBody" in openapi_doc["paths"]["/v1/chat/completions"]["post"]


def _bounded(case) -> None:
    """Keep a generated generation request small (a ``max_tokens`` of 10**9, or ``n`` 128 with
    2000 tokens each, is valid input, but minutes of decoding on this tiny CPU setup)."""
    body = case.body
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and body[key] > FUZZ_MAX_TOKENS:
            body[key] = FUZZ_MAX_TOKENS
    if case.path in ("/v1/completions", "/v1/chat/completions") and "max_tokens" not in body:
        body["max_tokens"] = FUZZ_MAX_TOKENS
    if isinstance(body.get("n"), int) and body["n"] > FUZZ_MAX_N:
        body["n"] = FUZZ_MAX_N
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 8:
        body["prompt"] = body["prompt"][:8]  # prompts x n choices


def _count(calls: dict[str, int], label: str) -> None:
    calls[label] += 1


def _fuzzer(op, base_url: str, checks: list, called):
    """A hypothesis test of ``op``: each generated case bounded, sent, and its answer checked."""

    @settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    @given(case=op.as_strategy())
    def run(case) -> None:
        _bounded(case)
        called()
        case.call_and_validate(
            base_url=base_url,
            headers=_auth(),
            timeout=FUZZ_TIMEOUT_S,  # no hang: every answer within it
            checks=checks,
        )

    return run


def test_schemathesis_finds_no_5xx_and_no_schema_violation(deployment, openapi_doc):
    """Every operation of ``/openapi.json``, positive and negative examples (a bounded number,
    derandomized: the same cases every run), each answer checked: not a 5xx, a documented
    status, content type and schema, within ``FUZZ_TIMEOUT_S``."""
    schema = schemathesis.openapi.from_dict(openapi_doc)
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
    failures: dict[str, str] = {}
    calls: dict[str, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        label = f"{op.method.upper()} {op.path}"
        calls[label] = 0

        run = _fuzzer(op, deployment.base_url, checks, lambda label=label: _count(calls, label))
        try:
            run()
        except Exception as exc:  # noqa: BLE001  (collect every operation's, then fail)
            failures[label] = f"{type(exc).__name__}: {str(exc)[:1500]}"
    assert not failures, json.dumps(failures, indent=1)
    assert len(calls) >= 12 and all(calls.values()), calls
