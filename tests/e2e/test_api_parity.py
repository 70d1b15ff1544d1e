"""OpenAI API parity with vLLM's server, through a real ``eaas serve`` (2 expert servers) and the
official ``openai`` client; bad input found as a new user would, each followed by a request that
succeeds; tokenizer loading of Qwen3-MoE checkpoints through a real ``eaas attention-client``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from eaas.runtime.client.sampling import SamplingParams, apply_penalties
from eaas.runtime.models.reference import reference_generate, reference_logits

from helpers.e2e import (
    free_port,
    metric_sum,
    metric_values,
    serve_fixture,
    served_model_name,
    sigterm_and_wait,
)

pytestmark = pytest.mark.engine

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
        json={"model": model_name, "prompt": "Hello", "max_tokens": 2, "temperature": 0},
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
        extra_body={"ignore_eos": True},
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
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content
    b = oai.completions.create(
        model=model_name, prompt=[prompt_ids, prompt_ids[:3]], max_tokens=12, temperature=0
    )
    assert len(b.choices) == 2 and b.choices[0].model_extra["token_ids"] == ref


def test_echo_prepends_the_prompt(oai, model_name, tokenizer, prompt_ids, ref):
    r = oai.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, echo=True
    )
    assert r.choices[0].text == PROMPT + tokenizer.decode(ref, skip_special_tokens=True)
    s = oai.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in s) == r.choices[0].text


# ---- logprobs ------------------------------------------------------------------------------------
def test_completion_logprobs_equal_the_reference(
    oai, model_name, model_dir, prompt_ids, ref, tokenizer
):
    r = oai.completions.create(
        model=model_name, prompt=prompt_ids, max_tokens=12, temperature=0, logprobs=3
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
        extra_body={"return_tokens_as_token_ids": True},
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
        extra_body={"return_tokens_as_token_ids": True},
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
            model=model_name, prompt="Hi", extra_body={"return_tokens_as_token_ids": True}
        )
    assert ei.value.body["param"] == "return_tokens_as_token_ids"


def test_echo_with_logprobs_gives_prompt_logprobs(
    oai, model_name, model_dir, prompt_ids, ref, tokenizer
):
    """As vLLM: the echoed prompt tokens come first in ``logprobs``, the first one's ``null``."""
    n = 4
    r = oai.completions.create(
        model=model_name, prompt=prompt_ids, max_tokens=n, temperature=0, echo=True, logprobs=2
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
    )
    toks, lps, offs = [], [], []
    for c in s:
        if c.choices and c.choices[0].logprobs:
            toks += c.choices[0].logprobs.tokens
            lps += c.choices[0].logprobs.token_logprobs
            offs += c.choices[0].logprobs.text_offset
    assert toks == lp.tokens and offs == lp.text_offset
    assert lps[0] is None and lps[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    _ok_text = oai.completions.create(model=model_name, prompt="Hi", max_tokens=2, echo=True)
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
        extra_body={"repetition_penalty": 1.3, "ignore_eos": True},
    )
    assert r.choices[0].model_extra["token_ids"] == out


def test_logit_bias_top_k_min_p(oai, model_name, prompt_ids, ref):
    r = oai.completions.create(
        model=model_name, prompt=prompt_ids, max_tokens=4, temperature=0, logit_bias={"77": 100}
    )
    assert r.choices[0].model_extra["token_ids"] == [77] * 4
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        s = oai.completions.create(
            model=model_name,
            prompt=prompt_ids,
            max_tokens=12,
            temperature=1.5,
            seed=3,
            extra_body=extra,
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
            extra_body={"stop_token_ids": [stop_id], "include_stop_str_in_output": include},
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
            extra_body={"include_stop_str_in_output": include},
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
        extra_body={"stop_token_ids": [ref[0]], "min_tokens": 4},
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
            extra_body={"skip_special_tokens": skip, "ignore_eos": True},
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
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])
    with pytest.raises(openai.BadRequestError) as ei:  # stream_options without stream
        oai.completions.create(
            model=model_name, prompt="Hi", max_tokens=2, stream_options={"include_usage": True}
        )
    assert ei.value.body["param"] == "stream_options"
    _ok(deployment, model_name)


# ---- tokenize / detokenize / version -------------------------------------------------------------
def test_tokenize_detokenize_version(deployment, model_name, tokenizer):
    r = _post(deployment, "/tokenize", {"model": model_name, "prompt": PROMPT}).json()
    assert r["tokens"] == tokenizer(PROMPT)["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] > 0
    msgs = [{"role": "user", "content": "Hi"}]
    c = _post(deployment, "/tokenize", {"model": model_name, "messages": msgs}).json()
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert c["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    d = _post(deployment, "/detokenize", {"model": model_name, "tokens": r["tokens"]}).json()
    assert d["prompt"] == tokenizer.decode(r["tokens"])
    bad = _post(deployment, "/detokenize", {"model": model_name, "tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    v = httpx.get(f"{deployment.base_url}/version", timeout=10).json()
    assert v["version"] and v["version"] != "unknown"


def test_chat_template_fields(deployment, model_name, tokenizer, oai):
    """vLLM's chat extensions reach the template as transformers' ``apply_chat_template`` takes
    them: ``add_generation_prompt``, ``continue_final_message`` (prefill an assistant turn) and
    ``chat_template_kwargs`` (template variables; the tiny model's template reads ``bos_token``).
    A key the template does not read, or an argument of the call itself, is a 400 naming it."""
    user = {"role": "user", "content": "Hi"}
    prefill = [user, {"role": "assistant", "content": "The answer is"}]
    cases = [
        (
            {"messages": [user], "add_generation_prompt": False},
            [user],
            {"add_generation_prompt": False},
        ),
        (
            {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True},
            prefill,
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
        (
            {"messages": [user], "chat_template_kwargs": {"bos_token": "<|user|>"}},
            [user],
            {"add_generation_prompt": True, "bos_token": "<|user|>"},
        ),
    ]
    for body, msgs, kw in cases:
        got = _post(deployment, "/tokenize", {"model": model_name, **body}).json()["tokens"]
        text = tokenizer.apply_chat_template(msgs, tokenize=False, **kw)
        assert got == tokenizer(text, add_special_tokens=False)["input_ids"], body
        # the same rendering is what a chat request generates from
        r = _post(
            deployment, "/v1/chat/completions", {"model": model_name, "max_tokens": 2, **body}
        )
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(got), r.text
    assert text.startswith("<|user|>")  # the last case's variable acted
    for extra, param in (
        (
            {"chat_template_kwargs": {"enable_thinking": False}},
            "chat_template_kwargs.enable_thinking",
        ),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
        ({"continue_final_message": True}, "continue_final_message"),  # with the default True
    ):
        with pytest.raises(openai.BadRequestError) as ei:
            oai.chat.completions.create(
                model=model_name, messages=prefill, max_tokens=2, extra_body=extra
            )
        assert ei.value.body["param"] == param, ei.value.body
    _ok(deployment, model_name)


# ---- bad input: 400/404 naming the field, then a request that succeeds ---------------------------
BAD = {
    "tools": ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", 400),
    "response_format": ({"response_format": {"type": "json_object"}}, "response_format", 400),
    "suffix": ({"suffix": "end"}, "suffix", 400),
    "best_of": ({"best_of": 3}, "best_of", 400),
    "unknown_field": ({"frobnicate": 1}, "frobnicate", 400),
    "stream_options_no_stream": (
        {"stream_options": {"include_usage": True}},
        "stream_options",
        400,
    ),
    "max_tokens_0_with_max_completion_tokens": (
        {"max_tokens": 0, "max_completion_tokens": 4},
        "max_tokens",
        400,
    ),
    "max_tokens_and_max_completion_tokens_disagree": (
        {"max_tokens": 3, "max_completion_tokens": 4},
        "max_tokens",
        400,
    ),
    "top_logprobs_without_logprobs": ({"top_logprobs": 2}, "top_logprobs", 400),
    "logit_bias_out_of_vocab": ({"logit_bias": {"100000": 1}}, "logit_bias", 400),
    "logit_bias_too_big": ({"logit_bias": {"5": 101}}, "logit_bias.5", 400),
    # int() would read these as token 5 (or 50): several keys could bias one token past 100
    **{
        f"logit_bias_key_{name}": ({"logit_bias": {key: 1}}, "logit_bias", 400)
        for name, key in (("plus", "+5"), ("space", " 5"), ("zero", "05"), ("underscore", "5_0"))
    },
    "logit_bias_key_arabic_digit": ({"logit_bias": {"\u0665": 1}}, "logit_bias", 400),
    # more characters than any chat of 2048 tokens can have: refused before tokenizing
    "messages_longer_than_any_context": (
        {"messages": [{"role": "user", "content": "Hi " * 100_000}]},
        "messages",
        400,
    ),
    "stop_token_ids_out_of_vocab": ({"stop_token_ids": [100000]}, "stop_token_ids", 400),
    "min_tokens_above_max": ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", 400),
    "top_k_below_minus_one": ({"top_k": -2}, "top_k", 400),
    "stop_empty_string": ({"stop": ""}, "stop", 400),  # vLLM: stop cannot contain ""
    "stop_list_with_empty_string": ({"stop": ["x", ""]}, "stop", 400),
    "min_p_above_one": ({"min_p": 1.5}, "min_p", 400),
    "repetition_penalty_zero": ({"repetition_penalty": 0}, "repetition_penalty", 400),
    "presence_penalty_range": ({"presence_penalty": 3}, "presence_penalty", 400),
    "unknown_model": ({"model": "gpt-17"}, "model", 404),
}


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
        oai.completions.create(model="gpt-17", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as ei:
        oai.completions.create(model=model_name, prompt="Hi", max_tokens=2, suffix="x")
    assert ei.value.body["param"] == "suffix"
    # prompts x n is bounded: 1000 prompts x 128 was 128,000 engine requests from 10 KB
    with pytest.raises(openai.BadRequestError) as ei:
        oai.completions.create(model=model_name, prompt=[[5]] * 33, n=128, max_tokens=1)
    assert ei.value.body["param"] == "n" and "4224" in ei.value.body["message"]
    # a text far longer than any prompt of 2048 tokens is refused before it is tokenized
    with pytest.raises(openai.BadRequestError) as ei:
        oai.completions.create(model=model_name, prompt=["Hi", "Hi " * 100_000], max_tokens=1)
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
        extra_body={"stop_token_ids": ids, "min_tokens": 5},
    )
    ch = r.choices[0]
    assert len(ch.model_extra["token_ids"]) == 6 and ch.finish_reason == "stop"
    r = oai.completions.create(
        model=model_name,
        prompt="Hi",
        max_tokens=4,
        temperature=0,
        extra_body={"stop_token_ids": [2] * 200_000, "ignore_eos": True},
    )
    assert r.choices[0].finish_reason in ("stop", "length")


# A known-but-unsupported field sent with its no-op value (what some OpenAI clients and SDKs
# send by default) is accepted and changes nothing; any other value is a 400 naming the field.
NO_OP = {
    "/v1/chat/completions": [
        ("tools", []),
        ("tool_choice", "none"),
        ("response_format", {"type": "text"}),
        ("store", False),
        ("metadata", {}),
        ("service_tier", "auto"),
        ("modalities", ["text"]),
        ("use_beam_search", False),
        ("length_penalty", 1.0),
        ("spaces_between_special_tokens", True),
    ],
    "/v1/completions": [("suffix", ""), ("use_beam_search", False), ("bad_words", [])],
}


@pytest.mark.parametrize("path", sorted(NO_OP))
def test_unsupported_field_with_its_no_op_value_is_accepted(deployment, model_name, path):
    base = {"model": model_name, "max_tokens": 3, "temperature": 0}
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
    acting = {"tools": [{"type": "function", "function": {"name": "f"}}], "suffix": "x"}
    field = "tools" if path == "/v1/chat/completions" else "suffix"
    r = _post(deployment, path, {**base, field: acting[field]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (field, "unsupported_parameter"), err


# ---- Qwen3-MoE checkpoints: tokenizer.json wins; ids beyond the vocabulary are a 400 -------------
def _qwen3(d: Path, tiny_dir: str, extra_token: bool) -> Path:
    from tokenizers import Tokenizer
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(1)
    cfg = Qwen3MoeConfig(
        vocab_size=922,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    Qwen3MoeForCausalLM(cfg).save_pretrained(d)
    tok = Tokenizer.from_file(str(Path(tiny_dir) / "tokenizer.json"))
    if extra_token:
        tok.add_special_tokens(["<|endoftext|>"])  # id 922 == vocab_size: no embedding row
        assert tok.token_to_id("<|endoftext|>") == 922
    tok.save(str(d / "tokenizer.json"))
    return d


class _Client:
    def __init__(self, model: Path | str, log: Path, extra: tuple[str, ...] = ()):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "eaas",
                "attention-client",
                "--local-experts",
                "--model",
                str(model),
                "--port",
                str(self.port),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        line = self.proc.stdout.readline()
        assert " ready on " in line, (line, log.read_text()[-2000:])

    def stop(self) -> None:
        sigterm_and_wait(self.proc, 30)
        self.proc.stdout.close()
        self._log.close()


@pytest.fixture(scope="module")
def qwen3_clients(tmp_path_factory, model_dir):
    base = tmp_path_factory.mktemp("qwen3")
    only_file = _qwen3(base / "only-tokenizer-json", model_dir, extra_token=False)
    extra = _qwen3(base / "endoftext-922", model_dir, extra_token=True)
    assert sorted(p.name for p in only_file.iterdir() if p.name.startswith("tokenizer")) == [
        "tokenizer.json"
    ]
    clients = {
        "only_file": _Client(only_file, base / "a.log"),
        "extra": _Client(extra, base / "b.log"),
    }
    yield clients, only_file
    for c in clients.values():
        c.stop()


def test_tokenizer_json_wins_over_qwen_class(qwen3_clients):
    from tokenizers import Tokenizer

    clients, d = qwen3_clients
    c = clients["only_file"]
    want = Tokenizer.from_file(str(d / "tokenizer.json")).encode("1 2 3 4 5").ids
    assert len(want) == 6
    r = httpx.post(f"{c.base}/tokenize", json={"prompt": "1 2 3 4 5"}, timeout=60).json()
    assert r["tokens"] == want
    g = httpx.post(
        f"{c.base}/v1/completions", json={"prompt": "1 2 3 4 5", "max_tokens": 2}, timeout=120
    )
    assert g.status_code == 200 and g.json()["usage"]["prompt_tokens"] == 6


def test_chat_template_field_edges(deployment, model_name):
    """With ``prompt``, /tokenize refuses a chat template field set to a value that would act
    (its default is accepted); kwargs nested deeper than transformers can copy are a 400."""
    tok = f"{deployment.base_url}/tokenize"
    base = {"model": model_name, "prompt": "Hi"}
    for field, value in (("add_generation_prompt", True), ("continue_final_message", False)):
        assert httpx.post(tok, json={**base, field: value}, timeout=60).status_code == 200
    for field, value in (
        ("add_generation_prompt", False),
        ("continue_final_message", True),
        ("chat_template_kwargs", {"bos_token": "x"}),
    ):
        r = httpx.post(tok, json={**base, field: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    deep = "[" * 600 + "]" * 600
    head = json.dumps({"model": model_name, "messages": [{"role": "user", "content": "Hi"}]})
    raw = head[:-1] + ', "chat_template_kwargs": {"bos_token": ' + deep + "}}"
    for path in ("/tokenize", "/v1/chat/completions"):
        r = httpx.post(
            f"{deployment.base_url}{path}",
            content=raw,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "chat_template_kwargs"
    _ok(deployment, model_name)


def test_chat_template_kwargs_without_a_template_is_400(qwen3_clients):
    """A checkpoint with only tokenizer.json has no chat template (the plain fallback renders
    chats): template variables cannot act there."""
    c = qwen3_clients[0]["only_file"]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(
        f"{c.base}/v1/chat/completions",
        json={**body, "chat_template_kwargs": {"enable_thinking": False}},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs.enable_thinking"
    assert httpx.post(f"{c.base}/v1/chat/completions", json=body, timeout=120).status_code == 200


def test_tokenizer_id_beyond_vocab_is_400(qwen3_clients):
    c = qwen3_clients[0]["extra"]
    for path, body, param in (
        ("/v1/completions", {"prompt": "Hello <|endoftext|>", "max_tokens": 2}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi <|endoftext|>"}], "max_tokens": 2},
            "messages",
        ),
    ):
        r = httpx.post(f"{c.base}{path}", json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "922" in err["message"]
        ok = httpx.post(
            f"{c.base}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=120
        )
        assert ok.status_code == 200, ok.text


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
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 3}
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
            model=model_name, prompt=prompt_ids, max_tokens=12, temperature=t, seed=7
        )
        assert r.choices[0].model_extra["token_ids"] == ref, t


# ---- many clients give up at once: the running and waiting gauges return to 0 -----------------
def _gauges(base: str) -> tuple[float, float]:
    v = metric_values(base)
    return metric_sum(v, "eaas_running_sequences"), metric_sum(v, "eaas_waiting_sequences")


def _wait_gauges(base: str, want: tuple[float, float], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := _gauges(base)) != want:
        assert time.monotonic() < deadline, (got, want)
        time.sleep(0.05)


def _open_stream(port: int, body: dict) -> socket.socket:
    """A raw HTTP/1.1 streaming request whose connection the test closes when it likes (an
    httpx stream blocks until the response head, which comes with the first token)."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def _long_stream(max_tokens: int) -> dict:
    """A greedy streamed completion that keeps decoding for ``max_tokens`` tokens."""
    return {
        "prompt": "Tell a long story",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }


def test_mass_disconnect_returns_running_and_waiting_to_zero(tmp_path, model_dir):
    """With ``--max-num-seqs 2``, 5 long streams: 2 decode and 3 wait (``eaas_running_sequences``
    and ``eaas_waiting_sequences``, as vLLM's ``num_requests_running`` / ``_waiting``); all five
    clients disconnect at once (the waiting ones before their first token), both gauges return
    to 0 and the next request succeeds."""
    c = _Client(model_dir, tmp_path / "client.log", ("--max-num-seqs", "2"))
    try:
        body = _long_stream(1500)
        socks = [_open_stream(c.port, body) for _ in range(5)]
        try:
            _wait_gauges(c.base, (2.0, 3.0))
        finally:
            for sock in socks:
                sock.close()
        _wait_gauges(c.base, (0.0, 0.0))
        r = httpx.post(
            f"{c.base}/v1/completions",
            json={"prompt": "Hello", "max_tokens": 3, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        c.stop()


def test_queued_stream_that_disconnects_leaves_the_queue(tmp_path, model_dir):
    """A stream still waiting for its first token (``--max-num-seqs 1``, another stream
    decoding) whose client disconnects leaves the waiting queue at once; it is not kept
    until a slot frees and then prefilled for nobody (vLLM aborts it likewise)."""
    c = _Client(model_dir, tmp_path / "client.log", ("--max-num-seqs", "1"))
    try:
        body = _long_stream(1900)
        running = _open_stream(c.port, body)
        try:
            _wait_gauges(c.base, (1.0, 0.0))
            queued = _open_stream(c.port, body)
            _wait_gauges(c.base, (1.0, 1.0))
            queued.close()
            # the running stream is still decoding (1900 tokens) when the queued one is gone
            _wait_gauges(c.base, (1.0, 0.0))
        finally:
            running.close()
        _wait_gauges(c.base, (0.0, 0.0))
    finally:
        c.stop()
