"""OpenAI API parity with vLLM's server, through a real ``eaas serve`` (2 expert servers) and the
official ``openai`` client; bad input found as a new user would, each followed by a request that
succeeds (the deployment and ``prompt_ids`` / ``ref``, PROMPT's ids and 12 greedy reference
tokens, are ``tests/e2e/conftest.py``'s). Logprobs: ``test_api_logprobs.py``; lone attention clients:
``test_api_clients.py``; vLLM's extensions and the chat template fields: ``test_api_vllm.py``.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from eaas.runtime.client.sampling import SamplingParams, apply_penalties
from eaas.runtime.models.reference import reference_logits

from helpers.api import BAD_CHAT_FIELDS, NO_OP_FIELDS
from helpers.api import PARITY_PROMPT as PROMPT

pytestmark = [pytest.mark.engine, pytest.mark.api]


@pytest.fixture(scope="module")
def deployment(parity_deployment):
    return parity_deployment


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
