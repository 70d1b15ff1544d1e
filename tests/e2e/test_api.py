"""End to end through ``eaas serve`` (4 expert servers, 2 replicas, 2 attention clients sharing
the servers and the API port) with the official ``openai`` client.

Exactness: greedy tokens from the live deployment must equal transformers' ``generate`` on the
same checkpoint (:func:`reference_generate`). Responses carry the generated ids in the
non-standard ``token_ids`` field of each choice.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from eaas.runtime.models.reference import reference_generate
from eaas.runtime.serve import write_table
from eaas.runtime.tables.table import RoutingTable

from helpers.api import BAD_REQUEST_CODES, BAD_REQUESTS
from helpers.e2e import metric_sum, metric_values, serve_fixture

pytestmark = pytest.mark.api

TEXTS = [
    "Hello world",
    "The expert server hosts a set of experts and",
    "Kubernetes schedules pods on nodes",
    "def main(): print",
    "A routing table maps every logical expert to its live replicas",
    "Mixture of experts models route each token",
]
MAX_TOKENS = 16


deployment = serve_fixture(
    "serve-api", ["--expert-servers", "4", "--replicas", "2", "--attention-clients", "2"]
)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def references(model_dir, prompts):
    return reference_generate(model_dir, prompts, MAX_TOKENS)


def client(deployment, **kw) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{deployment.base_url}/v1", api_key="unused", max_retries=0, timeout=120, **kw
    )


def complete_ids(deployment, model_name, prompt_ids, max_tokens=MAX_TOKENS):
    c = client(deployment)
    try:
        r = c.completions.create(
            model=model_name,
            prompt=prompt_ids,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
    finally:
        c.close()
    return r


def test_models_and_health(deployment, model_dir):
    models = httpx.get(f"{deployment.base_url}/v1/models", timeout=10).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [model_dir.rstrip("/").split("/")[-1]]
    h = httpx.get(f"{deployment.base_url}/health", timeout=10).json()
    assert h["status"] == "ok" and h["mode"] == "disaggregated"
    head = httpx.head(f"{deployment.base_url}/health", timeout=10)  # probes that send HEAD
    assert head.status_code == 200 and head.content == b""
    assert h["routing_table_version"] == 1
    assert sorted(h["servers"]) == [f"expert-{i}" for i in range(4)]


def test_greedy_tokens_match_reference(deployment, model_name, prompts, references, tokenizer):
    with ThreadPoolExecutor(len(prompts)) as ex:
        results = list(ex.map(lambda p: complete_ids(deployment, model_name, p), prompts))
    for r, ref in zip(results, references, strict=False):
        ch = r.choices[0]
        assert ch.model_extra["token_ids"] == ref
        assert ch.text == tokenizer.decode(ref, skip_special_tokens=True)
        assert ch.finish_reason == ("length" if len(ref) == MAX_TOKENS else "stop")
        assert r.usage.completion_tokens == len(ref)


def test_two_clients_share_the_servers(deployment, model_name, prompts, references):
    """Many concurrent requests, each on its own connection: both attention clients serve some
    (``eaas_requests_total{client_id}``), all answers exact, every expert server was used."""
    before = metric_values(deployment.base_url)
    jobs = [i % len(prompts) for i in range(16)]
    with ThreadPoolExecutor(8) as ex:  # a fresh openai client (new TCP connection) per request
        results = list(ex.map(lambda i: complete_ids(deployment, model_name, prompts[i]), jobs))
    for i, r in zip(jobs, results, strict=False):
        assert r.choices[0].model_extra["token_ids"] == references[i]
    after = metric_values(deployment.base_url)
    served = {
        c: metric_sum(after, "eaas_requests_total", client_id=c, status="200")
        - metric_sum(before, "eaas_requests_total", client_id=c, status="200")
        for c in ("0", "1")
    }
    assert served["0"] + served["1"] == len(jobs)
    assert served["0"] > 0 and served["1"] > 0, served
    tokens = metric_sum(after, "eaas_expert_tokens_total") - metric_sum(
        before, "eaas_expert_tokens_total"
    )
    assert tokens > 0
    assert metric_sum(after, "eaas_failovers_total") == 0


def test_openai_completion_text_prompt(deployment, model_name, tokenizer, model_dir):
    c = client(deployment)
    r = c.completions.create(
        model=model_name,
        prompt="Hello world",
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    ref = reference_generate(model_dir, [tokenizer("Hello world")["input_ids"]], 8)[0]
    assert r.object == "text_completion"
    assert r.choices[0].model_extra["token_ids"] == ref
    assert r.choices[0].text == tokenizer.decode(ref, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(tokenizer("Hello world")["input_ids"])


def _chat_prompt_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_openai_chat(deployment, model_name, tokenizer, model_dir):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name an expert."},
    ]
    c = client(deployment)
    r = c.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    pids = _chat_prompt_ids(tokenizer, messages)
    ref = reference_generate(model_dir, [pids], 10)[0]
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant"
    assert r.choices[0].model_extra["token_ids"] == ref
    assert msg.content == tokenizer.decode(ref, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(pids)


def test_streaming_completion(deployment, model_name, prompts, references, tokenizer):
    c = client(deployment)
    stream = c.completions.create(
        model=model_name,
        prompt=prompts[1],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    texts, ids, finishes = [], [], []
    for chunk in stream:
        ch = chunk.choices[0]
        texts.append(ch.text)
        ids.extend(ch.model_extra["token_ids"])
        finishes.append(ch.finish_reason)
    assert ids == references[1]
    assert "".join(texts) == tokenizer.decode(references[1], skip_special_tokens=True)
    assert finishes[-1] in ("length", "stop") and all(f is None for f in finishes[:-1])
    assert len(texts) == len(references[1])  # one chunk per token: really streamed


def test_streaming_chat(deployment, model_name, tokenizer, model_dir):
    messages = [{"role": "user", "content": "Stream me some tokens"}]
    ref = reference_generate(model_dir, [_chat_prompt_ids(tokenizer, messages)], 12)[0]
    c = client(deployment)
    stream = c.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    ids = [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]]
    assert ids == ref
    assert content == tokenizer.decode(ref, skip_special_tokens=True)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_sse_wire_format_ends_with_done(deployment, model_name):
    with httpx.stream(
        "POST",
        f"{deployment.base_url}/v1/completions",
        json={
            "model": model_name,
            "prompt": "Hi",
            "max_tokens": 3,
            "temperature": 0,
            "stream": True,
        },
        timeout=60,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


# ---- bad requests: OpenAI-style 400 and the server keeps serving --------------------------
BAD, BAD_CODES = BAD_REQUESTS, BAD_REQUEST_CODES


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_is_400_and_server_keeps_serving(deployment, model_name, case):
    path, body, param = BAD[case]
    if isinstance(body, dict):
        body = {"model": model_name, **body}
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        f"{deployment.base_url}{path}",
        content=content,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["message"]
    assert err["param"] == param
    if case in BAD_CODES:
        assert err["code"] == BAD_CODES[case], err
    if case == "beyond_context":
        assert "2048" in err["message"]
    # the server keeps serving
    ok = httpx.post(
        f"{deployment.base_url}/v1/completions",
        json={
            "model": model_name,
            "prompt": "Hello",
            "max_tokens": 2,
            "temperature": 0,
            "return_token_ids": True,
        },
        timeout=60,
    )
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) >= 1


@pytest.mark.parametrize("seed", [0, -1, -(2**63), 2**63 - 1])
def test_seed_edges_of_the_signed_64_bit_range_are_accepted(deployment, model_name, seed):
    body = {
        "model": model_name,
        "prompt": "Hello",
        "max_tokens": 2,
        "temperature": 1,
        "seed": seed,
        "return_token_ids": True,
    }
    r = [
        httpx.post(f"{deployment.base_url}/v1/completions", json=body, timeout=60) for _ in range(2)
    ]
    assert r[0].status_code == 200, r[0].text
    assert (
        r[0].json()["choices"][0]["token_ids"] == r[1].json()["choices"][0]["token_ids"]
    )  # seeded = reproducible


def test_assistant_message_without_content_is_accepted(deployment, model_name):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "Again"},
    ]
    r = httpx.post(
        f"{deployment.base_url}/v1/chat/completions",
        json={"model": model_name, "messages": messages, "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def test_assistant_reply_sent_back_with_model_dump_is_accepted(deployment, model_name):
    """The common chat loop: append ``reply.choices[0].message.model_dump()`` to the history. It
    carries ``refusal``, ``annotations``, ``audio``, ``function_call`` and ``tool_calls`` as null
    (was a 400 on ``refusal``); a non-null refusal is refused by name."""
    c = client(deployment)
    user = {"role": "user", "content": "Hi"}
    reply = c.chat.completions.create(model=model_name, messages=[user], max_tokens=2)
    dumped = reply.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(dumped)
    again = c.chat.completions.create(
        model=model_name,
        messages=[user, dumped, {"role": "user", "content": "Again"}],
        max_tokens=2,
    )
    assert again.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(
            model=model_name, messages=[user, {**dumped, "refusal": "no"}, user], max_tokens=2
        )
    err = ei.value.body
    assert err["param"] == "messages[1].refusal" and err["code"] == "unsupported_parameter"
    ok = {**dumped, "annotations": []}  # an empty list is no annotation
    c.chat.completions.create(model=model_name, messages=[user, ok, user], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(
            model=model_name,
            messages=[user, {**dumped, "annotations": [{"type": "url_citation"}]}, user],
            max_tokens=2,
        )
    err = ei.value.body
    assert err["param"] == "messages[1].annotations" and err["code"] == "unsupported_parameter"


def test_refused_requests_are_counted_by_status(deployment, model_name):
    """``eaas_requests_total{status}`` counts completions refused before generation (400, 404)
    beside the answered ones."""
    base = deployment.base_url
    before = metric_values(base)
    bad = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 0}, timeout=30)
    unknown = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
        timeout=30,
    )
    assert (bad.status_code, unknown.status_code) == (400, 404)
    after = metric_values(base)
    for status in ("400", "404"):
        grew = metric_sum(after, "eaas_requests_total", status=status) - metric_sum(
            before, "eaas_requests_total", status=status
        )
        assert grew == 1, (status, grew)


def test_openai_client_raises_bad_request(deployment, model_name):
    c = client(deployment)
    with pytest.raises(openai.BadRequestError) as ei:
        c.completions.create(model=model_name, prompt="Hello", max_tokens=0)
    assert ei.value.status_code == 400


MAX_TOKENS_LONG = 1500  # far more than the client waits for; ignore_eos: only a cancel ends early


def _running(base_url: str) -> float:
    return metric_sum(metric_values(base_url), "eaas_running_sequences")


def _decoded_tokens(base_url: str) -> float:
    """Tokens decoded so far by all clients: one TTFT sample per first token, one ITL sample
    per later token."""
    v = metric_values(base_url)
    return metric_sum(v, "eaas_ttft_seconds_count") + metric_sum(v, "eaas_itl_seconds_count")


def _wait_idle(base_url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while _running(base_url) != 0:
        assert time.monotonic() < deadline, metric_values(base_url)
        time.sleep(0.05)


def test_stream_disconnect_cancels_decode(deployment, model_name):
    """Closing a stream takes its sequence out of the decode batch: it ends long before its
    ``max_tokens`` (with ``ignore_eos`` nothing else can end it early)."""
    _wait_idle(deployment.base_url)
    before = _decoded_tokens(deployment.base_url)
    with httpx.stream(
        "POST",
        f"{deployment.base_url}/v1/completions",
        json={
            "model": model_name,
            "prompt": "Tell a long story",
            "max_tokens": MAX_TOKENS_LONG,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        },
        timeout=60,
    ) as r:
        assert r.status_code == 200, r.read()
        # Pull lines from one iterator without `break`: leaving an httpx line iterator closes the
        # response, which would be the disconnect already.
        lines = r.iter_lines()
        n = 0
        while n < 3:
            n += next(lines).startswith("data: ")
        assert _running(deployment.base_url) == 1, metric_values(deployment.base_url)
        at_disconnect = _decoded_tokens(deployment.base_url) - before
    # leaving the block closed the connection
    _wait_idle(deployment.base_url)
    decoded = _decoded_tokens(deployment.base_url) - before
    assert 3 <= at_disconnect <= decoded < MAX_TOKENS_LONG, (at_disconnect, decoded)
    # cancelled within the first half of what was left, not near the end
    assert decoded - at_disconnect < (MAX_TOKENS_LONG - at_disconnect) / 2, (at_disconnect, decoded)


def test_non_streaming_disconnect_cancels_decode(deployment, model_name):
    """A non-streaming client that gives up (read timeout) cancels its sequence like a stream."""
    _wait_idle(deployment.base_url)
    before = _decoded_tokens(deployment.base_url)
    body = {
        "model": model_name,
        "prompt": "Tell a long story",
        "max_tokens": MAX_TOKENS_LONG,
        "temperature": 0,
        "ignore_eos": True,
    }
    outcome: list[BaseException] = []

    def post() -> None:
        try:
            httpx.post(
                f"{deployment.base_url}/v1/completions",
                json=body,
                timeout=httpx.Timeout(30, read=5.0),
            )
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    t = threading.Thread(target=post)
    t.start()
    seen_running = False
    while t.is_alive():  # the sequence decodes while the client still waits
        seen_running = seen_running or _running(deployment.base_url) == 1
        time.sleep(0.05)
    t.join()
    assert len(outcome) == 1 and isinstance(outcome[0], httpx.ReadTimeout), outcome
    assert seen_running, "the request should be decoding before the client gives up"
    at_disconnect = _decoded_tokens(deployment.base_url) - before
    _wait_idle(deployment.base_url)
    decoded = _decoded_tokens(deployment.base_url) - before
    assert 1 <= at_disconnect <= decoded < MAX_TOKENS_LONG, (at_disconnect, decoded)
    assert decoded - at_disconnect < (MAX_TOKENS_LONG - at_disconnect) / 2, (at_disconnect, decoded)


def test_routing_table_hot_reload_and_ack(deployment, model_name, prompts, references):
    """A newer table is picked up and acknowledged by both clients; an older one is rejected."""
    path = deployment.run_dir / "routing-table.json"
    t1 = RoutingTable.from_json(path.read_text())
    assert t1.version == 1
    t2 = RoutingTable(version=2, num_experts=t1.num_experts, servers=t1.servers, layers=t1.layers)
    write_table(path, t2)

    def versions() -> dict[str, float]:
        v = metric_values(deployment.base_url)
        return {c: metric_sum(v, "eaas_routing_table_version", client_id=c) for c in ("0", "1")}

    def wait_versions(want: dict[str, float]) -> list[dict[str, float]]:
        """Poll until both clients report ``want``; returns every distinct state seen."""
        seen: list[dict[str, float]] = []
        deadline = time.monotonic() + 60
        while True:
            v = versions()
            if not seen or seen[-1] != v:
                seen.append(v)
            if v == want:
                return seen
            assert time.monotonic() < deadline, seen
            time.sleep(0.1)

    wait_versions({"0": 2, "1": 2})
    # An older table must be rejected: each client says so in the log ...
    rejected = "rejecting routing table version 1: older than version 2 in use"
    n0 = deployment.log().count(rejected)
    write_table(path, t1)
    deadline = time.monotonic() + 60
    while deployment.log().count(rejected) < n0 + 2:
        assert time.monotonic() < deadline, deployment.log()[-3000:]
        time.sleep(0.1)
    # ... and a newer table written after it is applied, with version 1 never in use on the way.
    t3 = RoutingTable(version=3, num_experts=t1.num_experts, servers=t1.servers, layers=t1.layers)
    write_table(path, t3)
    seen = wait_versions({"0": 3, "1": 3})
    assert all(set(v.values()) <= {2, 3} for v in seen), seen
    assert (
        httpx.get(f"{deployment.base_url}/health", timeout=10).json()["routing_table_version"] == 3
    )
    r = complete_ids(deployment, model_name, prompts[0])
    assert r.choices[0].model_extra["token_ids"] == references[0]


def test_health_is_503_while_an_expert_has_no_replica(deployment, model_name, prompts, references):
    """A table leaving every expert of one MoE layer without replica: /health answers 503
    ``degraded`` naming them (readiness probes stop routing here), requests get the 503
    ``no_live_replica`` error; a newer complete table brings back 200 and exact answers."""
    path = deployment.run_dir / "routing-table.json"
    cur = RoutingTable.from_json(path.read_text())  # may be older than the version in use
    in_use = httpx.get(f"{deployment.base_url}/health", timeout=10).json()["routing_table_version"]
    layer = min(cur.layers)
    holes = RoutingTable(
        version=max(cur.version, in_use) + 1,
        num_experts=cur.num_experts,
        servers=cur.servers,
        layers={**cur.layers, layer: tuple(() for _ in range(cur.num_experts))},
    )

    def health_until(pred):
        deadline = time.monotonic() + 60
        while True:  # both clients answer on the port: wait until several answers agree
            hs = [httpx.get(f"{deployment.base_url}/health", timeout=10) for _ in range(6)]
            if all(pred(h) for h in hs) or time.monotonic() > deadline:
                return hs
            time.sleep(0.1)

    write_table(path, holes)
    hs = health_until(lambda h: h.json()["routing_table_version"] == holes.version)
    for h in hs:
        assert h.status_code == 503, h.text
        body = h.json()
        assert body["status"] == "degraded"
        assert body["uncovered_experts"] == cur.num_experts
        assert body["uncovered"][0] == {
            "layer": layer,
            "expert": 0,
            "reason": f"no replica in routing table version {holes.version}",
            "replicas": [],
        }
        assert (
            body["client_id"] in ("0", "1")
            and body["routing_table_version"] == holes.version
            and "running" in body
        )
    r = httpx.post(
        f"{deployment.base_url}/v1/completions",
        json={"model": model_name, "prompt": prompts[0], "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "no_live_replica"
    assert (
        f"no replica of layer {layer} expert" in err["message"]
        and f"in routing table version {holes.version}" in err["message"]
    )
    assert "[]" not in err["message"]

    fixed = RoutingTable(
        version=holes.version + 1,
        num_experts=cur.num_experts,
        servers=cur.servers,
        layers=cur.layers,
    )
    write_table(path, fixed)
    hs = health_until(lambda h: h.json()["routing_table_version"] == fixed.version)
    for h in hs:
        assert h.status_code == 200, h.text
        assert h.json()["status"] == "ok" and h.json()["uncovered_experts"] == 0
    r = complete_ids(deployment, model_name, prompts[0])
    assert r.choices[0].model_extra["token_ids"] == references[0]
