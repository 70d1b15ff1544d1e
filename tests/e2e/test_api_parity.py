"""OpenAI API parity with vLLM's server, through a real ``eaas serve`` (2 expert servers) and the
official ``openai`` client; bad input found as a new user would, each followed by a request that
succeeds. Lone attention clients: ``test_api_clients.py``; vLLM's extensions and the chat
template fields: ``test_api_vllm.py``.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch

from eaas.runtime.client.sampling import SamplingParams, apply_penalties
from eaas.runtime.models.reference import reference_generate, reference_logits

from helpers.api import BAD_CHAT_FIELDS, NO_OP_FIELDS
from helpers.e2e import metric_sum, metric_values, serve_fixture, served_model_name

pytestmark = [pytest.mark.engine, pytest.mark.api]

PROMPT = "The expert server hosts a set of experts and"


deployment = serve_fixture("serve-parity", ["--expert-servers", "2", "--replicas", "1"])


@pytest.fixture(scope="module")
def model_name(deployment):
    return served_model_name(deployment.base_url)


@pytest.fixture(scope="module")
def oai(deployment):
    c = openai.OpenAI(
        base_url=f"{deployment.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )
    yield c
    c.close()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer(PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def ref(model_dir, prompt_ids):
    return reference_generate(model_dir, [prompt_ids], 12)[0]


def _ok(deployment, model_name):
    """A request that succeeds (the server keeps serving after a bad one)."""
    r = httpx.post(
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
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) >= 1


def _post(deployment, path, body):
    return httpx.post(f"{deployment.base_url}{path}", json=body, timeout=120)


# ---- n, seeds, echo ------------------------------------------------------------------------------
def test_n_choices_with_derived_seeds(oai, model_name, prompt_ids):
    kw = dict(
        model=model_name,
        prompt=prompt_ids,
        max_tokens=6,
        temperature=1.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    r = oai.completions.create(n=3, seed=11, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    ids = [c.model_extra["token_ids"] for c in r.choices]
    assert all(len(x) == 6 for x in ids)
    # choice i is the n=1 request with seed + i
    for i in range(3):
        one = oai.completions.create(seed=11 + i, **kw)
        assert one.choices[0].model_extra["token_ids"] == ids[i]
    assert len({tuple(x) for x in ids}) > 1
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == len(prompt_ids)


def test_n_greedy_chat_and_batched_prompts(oai, model_name, deployment, prompt_ids, ref):
    r = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hi"}],
        n=2,
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content
    b = oai.completions.create(
        model=model_name,
        prompt=[prompt_ids, prompt_ids[:3]],
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert len(b.choices) == 2 and b.choices[0].model_extra["token_ids"] == ref


def test_echo_prepends_the_prompt(oai, model_name, tokenizer, prompt_ids, ref):
    r = oai.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        echo=True,
        extra_body={"return_token_ids": True},
    )
    assert r.choices[0].text == PROMPT + tokenizer.decode(ref, skip_special_tokens=True)
    s = oai.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        echo=True,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    assert "".join(c.choices[0].text for c in s) == r.choices[0].text


# ---- logprobs ------------------------------------------------------------------------------------
def test_completion_logprobs_equal_the_reference(
    oai, model_name, model_dir, prompt_ids, ref, tokenizer
):
    r = oai.completions.create(
        model=model_name,
        prompt=prompt_ids,
        max_tokens=12,
        temperature=0,
        logprobs=3,
        extra_body={"return_token_ids": True},
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ref)
    logits = reference_logits(model_dir, prompt_ids + ref)  # (T, V)
    want = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], -1)  # (n, V)
    for i, t in enumerate(ref):
        assert lp.token_logprobs[i] == pytest.approx(float(want[i, t]), abs=1e-3)
        assert lp.tokens[i] == tokenizer.decode([t])
        top = lp.top_logprobs[i]
        assert top[lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])
        assert 1 <= len(top) <= 4 and max(top.values()) == pytest.approx(lp.token_logprobs[i])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_tokens_as_token_ids_keep_every_top_logprob(oai, model_name, prompt_ids, ref, tokenizer):
    """``return_tokens_as_token_ids`` (vLLM): logprobs name tokens ``token_id:<id>``, so the
    completions ``top_logprobs`` dict keeps all k entries even where texts collide (byte-level
    tokens that each decode to U+FFFD overwrote each other: 16-19 of 20 keys)."""
    k = 20
    r = oai.completions.create(
        model=model_name,
        prompt=prompt_ids,
        max_tokens=6,
        temperature=0,
        logprobs=k,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in ref[:6]]
    for top in lp.top_logprobs:
        assert len(top) == k and all(key.startswith("token_id:") for key in top)
    c = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    content, ids = c.choices[0].logprobs.content, c.choices[0].model_extra["token_ids"]
    assert len(content) == len(ids) == 3
    for tok, tid in zip(content, ids, strict=True):
        # the token is named by id; its bytes stay those of its text
        assert tok.token == f"token_id:{tid}"
        assert tok.bytes == list(tokenizer.decode([tid]).encode())
        for top in tok.top_logprobs:
            tid_top = int(top.token.removeprefix("token_id:"))
            assert top.bytes == list(tokenizer.decode([tid_top]).encode())
    with pytest.raises(openai.BadRequestError) as ei:  # nothing to name without logprobs
        oai.completions.create(
            model=model_name,
            prompt="Hi",
            extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
        )
    assert ei.value.body["param"] == "return_tokens_as_token_ids"


def _expert_tokens(base: str, settle: float = 60.0) -> float:
    """``eaas_expert_tokens`` summed over every layer and expert, once the servers' counts stop
    moving (a busy server adds its counts every 50 ms)."""
    last, deadline = None, time.monotonic() + settle
    while True:
        now = metric_sum(metric_values(base), "eaas_expert_tokens_total")
        if now == last or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(0.3)


def test_prompt_logprobs_come_from_the_same_prefill(deployment, model_name, prompt_ids):
    """vLLM's ``prompt_logprobs`` cost no second pass: the expert servers compute exactly as many
    tokens for a request with them as for the same request without (each prompt token goes
    through every MoE layer once)."""
    base = deployment.base_url
    body = {"model": model_name, "prompt": prompt_ids, "max_tokens": 3, "temperature": 0}
    work = []
    for extra in ({}, {"prompt_logprobs": 3}, {}):
        before = _expert_tokens(base)
        r = _post(deployment, "/v1/completions", {**body, **extra})
        assert r.status_code == 200, r.text
        work.append(_expert_tokens(base) - before)
        if extra:
            rows = r.json()["choices"][0]["prompt_logprobs"]
            assert len(rows) == len(prompt_ids) and rows[0] is None
    assert work[0] > 0 and work[0] == work[1] == work[2], work


def test_echo_with_logprobs_gives_prompt_logprobs(
    oai, model_name, model_dir, prompt_ids, ref, tokenizer
):
    """As vLLM: the echoed prompt tokens come first in ``logprobs``, the first one's ``null``."""
    n = 4
    r = oai.completions.create(
        model=model_name,
        prompt=prompt_ids,
        max_tokens=n,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    lp = r.choices[0].logprobs
    ids = prompt_ids + ref[:n]
    assert r.choices[0].model_extra["token_ids"] == ref[:n]
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = torch.log_softmax(reference_logits(model_dir, ids)[:-1], -1)  # (T - 1, V)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(want[i - 1, ids[i]]), abs=1e-3)
        top = lp.top_logprobs[i]
        assert top[lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])
        assert 1 <= len(top) <= 3
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # streamed: the first chunk carries the prompt's logprobs, the concatenation is the same
    s = oai.completions.create(
        model=model_name,
        prompt=prompt_ids,
        max_tokens=n,
        temperature=0,
        echo=True,
        logprobs=2,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    toks, lps, offs = [], [], []
    for c in s:
        if c.choices and c.choices[0].logprobs:
            toks += c.choices[0].logprobs.tokens
            lps += c.choices[0].logprobs.token_logprobs
            offs += c.choices[0].logprobs.text_offset
    assert toks == lp.tokens and offs == lp.text_offset
    assert lps[0] is None and lps[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    _ok_text = oai.completions.create(
        model=model_name,
        prompt="Hi",
        max_tokens=2,
        echo=True,
        extra_body={"return_token_ids": True},
    )
    assert _ok_text.choices[0].text.startswith("Hi")


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_of_a_one_token_prompt(deployment, model_name, tokenizer, stream):
    """A one-token prompt has no prompt logprob to compute: its row is null, as the first token's
    of any prompt (was a 500, and a stream that ended without an event or [DONE])."""
    body = {
        "model": model_name,
        "prompt": [[5], [6, 7]],
        "max_tokens": 2,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
        "stream": stream,
    }
    if not stream:
        r = _post(deployment, "/v1/completions", body)
        assert r.status_code == 200, r.text
        lps = [c["logprobs"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    else:
        with httpx.stream(
            "POST", f"{deployment.base_url}/v1/completions", json=body, timeout=120
        ) as r:
            assert r.status_code == 200
            events = [e for e in r.iter_lines() if e]
        assert events[-1] == "data: [DONE]"
        lps = [None, None]
        for e in events[:-1]:
            (ch,) = json.loads(e[len("data: ") :])["choices"]
            if lps[ch["index"]] is None:  # the first chunk carries the echoed prompt
                lps[ch["index"]] = ch["logprobs"]
    assert lps[0]["tokens"][0] == tokenizer.decode([5]) and lps[0]["token_logprobs"][0] is None
    assert lps[0]["top_logprobs"][0] is None
    assert lps[1]["token_logprobs"][0] is None and lps[1]["token_logprobs"][1] is not None


def test_chat_logprobs_and_top_logprobs(oai, model_name):
    r = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Name an expert."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].token == item.token  # greedy: the most likely token
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert item.bytes == list(item.token.encode())
    s = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Name an expert."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    streamed = [c.choices[0].logprobs.content[0].token for c in s if c.choices[0].logprobs]
    assert streamed == [x.token for x in content]


# ---- logits processors ---------------------------------------------------------------------------
def test_penalties_follow_the_reference_step_by_step(oai, model_name, model_dir, prompt_ids):
    p = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.8, presence_penalty=0.4)
    out: list[int] = []
    for _ in range(8):
        logits = reference_logits(model_dir, prompt_ids + out)[-1:]  # (1, V)
        out.append(int(apply_penalties(logits, [p], [prompt_ids], [out]).argmax()))
    r = oai.completions.create(
        model=model_name,
        prompt=prompt_ids,
        max_tokens=8,
        temperature=0,
        presence_penalty=0.4,
        frequency_penalty=0.8,
        extra_body={"return_token_ids": True, "repetition_penalty": 1.3, "ignore_eos": True},
    )
    assert r.choices[0].model_extra["token_ids"] == out


def test_logit_bias_top_k_min_p(oai, model_name, prompt_ids, ref):
    r = oai.completions.create(
        model=model_name,
        prompt=prompt_ids,
        max_tokens=4,
        temperature=0,
        logit_bias={"77": 100},
        extra_body={"return_token_ids": True},
    )
    assert r.choices[0].model_extra["token_ids"] == [77] * 4
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        s = oai.completions.create(
            model=model_name,
            prompt=prompt_ids,
            max_tokens=12,
            temperature=1.5,
            seed=3,
            extra_body={**extra, "return_token_ids": True},
        )
        assert s.choices[0].model_extra["token_ids"] == ref, extra  # only the top token survives


def test_stop_token_ids_and_include_stop_str(oai, model_name, prompt_ids, ref, tokenizer):
    j = 3
    stop_id = ref[j]
    j = ref.index(stop_id)
    for include in (False, True):
        r = oai.completions.create(
            model=model_name,
            prompt=prompt_ids,
            max_tokens=12,
            temperature=0,
            extra_body={
                "return_token_ids": True,
                "stop_token_ids": [stop_id],
                "include_stop_str_in_output": include,
            },
        )
        ch = r.choices[0]
        assert ch.model_extra["token_ids"] == ref[: j + 1]
        assert ch.finish_reason == "stop" and ch.model_extra["stop_reason"] == stop_id
        assert ch.text == tokenizer.decode(ref[: j + 1 if include else j], skip_special_tokens=True)
    full = tokenizer.decode(ref, skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    for include in (False, True):
        r = oai.completions.create(
            model=model_name,
            prompt=prompt_ids,
            max_tokens=12,
            temperature=0,
            stop=[stop],
            extra_body={"return_token_ids": True, "include_stop_str_in_output": include},
        )
        cut = full.index(stop) + (len(stop) if include else 0)
        assert r.choices[0].text == full[:cut]
        assert r.choices[0].model_extra["stop_reason"] == stop


def test_min_tokens_defers_stop_tokens(oai, model_name, prompt_ids, ref):
    r = oai.completions.create(
        model=model_name,
        prompt=prompt_ids,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "stop_token_ids": [ref[0]], "min_tokens": 4},
    )
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) >= 4 and ref[0] not in ids[:4]


def test_skip_special_tokens(oai, model_name, tokenizer):
    pad = tokenizer.convert_tokens_to_ids("<|pad|>")
    texts = {}
    for skip in (True, False):
        r = oai.completions.create(
            model=model_name,
            prompt="Hi",
            max_tokens=2,
            temperature=0,
            logit_bias={str(pad): 100},
            extra_body={"return_token_ids": True, "skip_special_tokens": skip, "ignore_eos": True},
        )
        assert r.choices[0].model_extra["token_ids"] == [pad, pad]
        texts[skip] = r.choices[0].text
    assert texts == {True: "", False: "<|pad|><|pad|>"}


# ---- streaming usage -----------------------------------------------------------------------------
def test_stream_include_usage(oai, model_name, deployment):
    chunks = list(
        oai.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])
    with pytest.raises(openai.BadRequestError) as ei:  # stream_options without stream
        oai.completions.create(
            model=model_name,
            prompt="Hi",
            max_tokens=2,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True},
        )
    assert ei.value.body["param"] == "stream_options"
    _ok(deployment, model_name)


# ---- tokenize / detokenize / version -------------------------------------------------------------


# ---- bad input: 400/404 naming the field, then a request that succeeds ---------------------------
BAD = BAD_CHAT_FIELDS


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_chat_field_is_rejected_by_name(deployment, model_name, case):
    extra, param, status = BAD[case]
    body = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], **extra}
    r = _post(deployment, "/v1/chat/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    if status == 404:
        assert err["code"] == "model_not_found"
    _ok(deployment, model_name)


def test_completion_only_bad_fields(deployment, model_name, oai):
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(
            model="gpt-17", prompt="Hi", max_tokens=2, extra_body={"return_token_ids": True}
        )
    with pytest.raises(openai.BadRequestError) as ei:
        oai.completions.create(
            model=model_name,
            prompt="Hi",
            max_tokens=2,
            suffix="x",
            extra_body={"return_token_ids": True},
        )
    assert ei.value.body["param"] == "suffix"
    # prompts x n is bounded: 1000 prompts x 128 was 128,000 engine requests from 10 KB
    with pytest.raises(openai.BadRequestError) as ei:
        oai.completions.create(
            model=model_name,
            prompt=[[5]] * 33,
            n=128,
            max_tokens=1,
            extra_body={"return_token_ids": True},
        )
    assert ei.value.body["param"] == "n" and "4224" in ei.value.body["message"]
    # a text far longer than any prompt of 2048 tokens is refused before it is tokenized
    with pytest.raises(openai.BadRequestError) as ei:
        oai.completions.create(
            model=model_name,
            prompt=["Hi", "Hi " * 100_000],
            max_tokens=1,
            extra_body={"return_token_ids": True},
        )
    err = ei.value.body
    assert (err["param"], err["code"]) == ("prompt[1]", "context_length_exceeded"), err
    _ok(deployment, model_name)


def test_min_tokens_hold_when_every_token_is_a_stop_token(oai, model_name, tokenizer):
    """With ``stop_token_ids`` covering the vocabulary, sampling masks every token while fewer
    than ``min_tokens`` were generated; the token drawn anyway must not end the sequence (it
    ended after 1 token). A stop list of 200,000 duplicates is taken as its set."""
    ids = list(range(len(tokenizer))) * 2
    r = oai.completions.create(
        model=model_name,
        prompt="Hi",
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "stop_token_ids": ids, "min_tokens": 5},
    )
    ch = r.choices[0]
    assert len(ch.model_extra["token_ids"]) == 6 and ch.finish_reason == "stop"
    r = oai.completions.create(
        model=model_name,
        prompt="Hi",
        max_tokens=4,
        temperature=0,
        extra_body={"return_token_ids": True, "stop_token_ids": [2] * 200_000, "ignore_eos": True},
    )
    assert r.choices[0].finish_reason in ("stop", "length")


NO_OP = NO_OP_FIELDS


@pytest.mark.parametrize("path", sorted(NO_OP))
def test_unsupported_field_with_its_no_op_value_is_accepted(deployment, model_name, path):
    base = {"model": model_name, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    base |= (
        {"prompt": PROMPT}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": PROMPT}]}
    )
    plain = _post(deployment, path, base)
    assert plain.status_code == 200, plain.text
    want = plain.json()["choices"][0]["token_ids"]
    for field, value in NO_OP[path]:
        r = _post(deployment, path, {**base, field: value})
        assert r.status_code == 200, (field, value, r.text)
        assert r.json()["choices"][0]["token_ids"] == want, (field, value)
    # the same fields with a value that would act are still refused by name
    acting = {"functions": [{"name": "f"}], "suffix": "x"}
    field = "functions" if path == "/v1/chat/completions" else "suffix"
    r = _post(deployment, path, {**base, field: acting[field]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (field, "unsupported_parameter"), err


def test_streamed_n_choices_with_usage(oai, model_name, prompt_ids, ref):
    chunks = list(
        oai.completions.create(
            model=model_name,
            prompt=prompt_ids,
            max_tokens=12,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"return_token_ids": True},
        )
    )
    ids: dict[int, list[int]] = {0: [], 1: []}
    finishes = {}
    for c in chunks[:-1]:
        (ch,) = c.choices
        ids[ch.index].extend(ch.model_extra["token_ids"])
        if ch.finish_reason is not None:
            finishes[ch.index] = ch.finish_reason
        # continuous usage stats, as vLLM: on every chunk, this choice's tokens so far
        assert c.usage is not None
        assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (
            len(prompt_ids),
            len(ids[ch.index]),
        )
    assert ids == {0: ref, 1: ref} and set(finishes) == {0, 1}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * len(ref)


def test_streamed_chat_continuous_usage_starts_at_zero(oai, model_name):
    """The role chunk carries no token yet: ``completion_tokens`` 0 there (vLLM), then each
    choice's own count."""
    chunks = list(
        oai.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=4,
            n=2,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"return_token_ids": True},
        )
    )
    seen: dict[int, int] = {0: 0, 1: 0}
    roles = 0
    for c in chunks[:-1]:
        (ch,) = c.choices
        if ch.delta.role == "assistant":
            roles += 1
            assert c.usage.completion_tokens == 0
        else:
            seen[ch.index] += len(ch.model_extra["token_ids"])
            assert c.usage.completion_tokens == seen[ch.index]
    assert roles == 2 and seen == {0: 4, 1: 4}
    assert chunks[-1].usage.completion_tokens == 8


def test_top_k_beyond_the_vocabulary_keeps_every_token(deployment, model_name):
    """``top_k`` >= the vocabulary size is the same as 0 (all tokens). A top_k of 2**63 or more
    overflowed the batch's int64 tensor and failed every request in that engine step."""
    body = {
        "model": model_name,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 3,
        "return_token_ids": True,
    }
    want = _post(deployment, "/v1/completions", {**body, "top_k": 0}).json()["choices"][0]
    for k in (10**6, 2**63, 10**40):
        r = _post(deployment, "/v1/completions", {**body, "top_k": k})
        assert r.status_code == 200, (k, r.text)
        assert r.json()["choices"][0]["token_ids"] == want["token_ids"], k


def test_temperature_below_sampling_eps_is_greedy(oai, model_name, prompt_ids, ref):
    """A temperature of 1e-40 overflowed the logits and drew token 0 every step; below vLLM's
    ``_SAMPLING_EPS`` (1e-5) it now means greedy, as in vLLM."""
    for t in (1e-40, 1e-6):
        r = oai.completions.create(
            model=model_name,
            prompt=prompt_ids,
            max_tokens=12,
            temperature=t,
            seed=7,
            extra_body={"return_token_ids": True},
        )
        assert r.choices[0].model_extra["token_ids"] == ref, t
