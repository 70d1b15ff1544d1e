"""Structured outputs, tool calls by schema, ``allowed_token_ids`` and beam search (vLLM's
extensions that steer decoding) through a real ``eaas serve`` (2 expert servers, the tiny random
model) and the official ``openai`` client: the mask alone makes the answers parse, whatever the
random weights say."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import torch

from eaas.runtime.models.reference import reference_logits

#: the ``oai`` client's read timeout (tests/e2e/conftest.py): answers of up to 200 constrained tokens
OAI_TIMEOUT_S = 180.0

pytestmark = [pytest.mark.engine, pytest.mark.api]

MESSAGES = [{"role": "user", "content": "Pick one and answer in JSON"}]
IP = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def deployment(parity_deployment):  # the API parity modules' eaas serve (tests/e2e/conftest.py)
    return parity_deployment


def _chat(oai, model_name, **kw):
    kw.setdefault("max_completion_tokens", 200)
    return oai.chat.completions.create(model=model_name, messages=MESSAGES, seed=7, **kw)


def test_choice_and_regex_answers_match_and_stop(oai, model_name):
    choices = ["Python", "C++", "C#", "Rust"]
    r = _chat(oai, model_name, n=4, extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices and c.finish_reason == "stop" for c in r.choices)
    r = _chat(oai, model_name, n=2, extra_body={"structured_outputs": {"regex": IP}})
    for c in r.choices:
        assert re.fullmatch(IP, c.message.content) and c.finish_reason == "stop", c


def test_json_schema_answer_validates(oai, model_name):
    schema = WEATHER["function"]["parameters"]
    r = _chat(
        oai,
        model_name,
        n=2,
        extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
    )
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), schema)
    r = _chat(
        oai,
        model_name,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
        max_completion_tokens=400,
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_streamed_chat_and_completions_are_constrained(oai, model_name):
    choices = ["yes", "no"]
    s = _chat(oai, model_name, stream=True, extra_body={"structured_outputs": {"choice": choices}})
    assert "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) in choices
    r = oai.completions.create(
        model=model_name,
        prompt="Answer:",
        max_tokens=20,
        seed=3,
        extra_body={"structured_outputs": {"regex": "[a-c]{3}"}},
    )
    assert re.fullmatch("[a-c]{3}", r.choices[0].text), r.choices[0]


def test_named_and_required_tool_choice_give_tool_calls(oai, model_name):
    r = _chat(
        oai,
        model_name,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body={"return_token_ids": True},
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    r = _chat(
        oai,
        model_name,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_completion_tokens=400,
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "", ch
    (call,) = ch.message.tool_calls  # parallel_tool_calls false: one call
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)


def test_allowed_token_ids_restrict_every_token(oai, model_name):
    r = oai.completions.create(
        model=model_name,
        prompt="Hello",
        max_tokens=6,
        n=2,
        seed=1,
        extra_body={"allowed_token_ids": [40, 41, 42], "return_token_ids": True},
    )
    for c in r.choices:
        assert set(c.model_extra["token_ids"]) <= {40, 41, 42}, c


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"structured_outputs": {"regex": "[.*"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json": {"properties": {"a": 1}}}}, "structured_outputs.json"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
        ({"tools": [WEATHER]}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice.function.name"),
        ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_naming_the_field(oai, model_name, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(oai, model_name, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body
    assert _chat(oai, model_name, max_completion_tokens=2).choices  # still serving


def _reference_beams(model_dir, prompt, width, steps, eos):
    """vLLM's online beam search over transformers' logits (the oracle): ``(tokens, cum)``."""
    live, done = [([], 0.0)], []
    for _ in range(steps):
        cands = []
        for toks, cum in live:
            lp = torch.log_softmax(reference_logits(model_dir, prompt + toks)[-1], -1)
            v, i = torch.topk(lp, 2 * width)
            for t, x in zip(i.tolist(), v.tolist(), strict=True):
                (done if t == eos else cands).append((toks + ([] if t == eos else [t]), cum + x))
        live = sorted(cands, key=lambda c: -c[1])[:width]
    ranked = sorted(done + live, key=lambda b: -b[1] / (len(prompt) + len(b[0])))
    return [b[0] for b in ranked[:width]]


def test_beam_search_returns_the_reference_beams(oai, model_name, model_dir, tokenizer):
    prompts = [tokenizer("Hello, my name is")["input_ids"], [5, 6, 7]]
    r = oai.completions.create(
        model=model_name,
        prompt=prompts,
        n=2,
        max_tokens=3,
        temperature=0,
        extra_body={"use_beam_search": True, "return_token_ids": True},
    )
    got = [c.model_extra["token_ids"] for c in sorted(r.choices, key=lambda c: c.index)]
    want = [
        b for p in prompts for b in _reference_beams(model_dir, p, 2, 3, tokenizer.eos_token_id)
    ]
    assert got == want and got[0] != got[1]
    assert r.choices[0].text == tokenizer.decode(got[0], skip_special_tokens=True)
    for extra, param in (({"stream": True}, "stream"), ({"logprobs": 1}, "logprobs")):
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(
                model=model_name, prompt="Hi", extra_body={"use_beam_search": True, **extra}
            )
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model_name, prompt="Hi", extra_body={"length_penalty": 2.0})
    assert e.value.body["param"] == "length_penalty"


@pytest.mark.parametrize("stream", [False, True])
def test_logprob_token_ids_with_allowed_token_ids(oai, model_name, stream):
    """vLLM's own test with ids of the tiny vocabulary: the listed ids' logprobs (and the sampled
    token's) in place of the top 5; the only allowed token is the one sampled."""
    r = oai.completions.create(
        model=model_name,
        prompt="Hello",
        max_tokens=1,
        temperature=0,
        logprobs=5,
        stream=stream,
        extra_body={
            "logprob_token_ids": [500],
            "allowed_token_ids": [42],
            "return_tokens_as_token_ids": True,
        },
    )
    lp = (list(r)[0] if stream else r).choices[0].logprobs
    assert lp.tokens == ["token_id:42"]
    assert set(lp.top_logprobs[0]) == {"token_id:42", "token_id:500"}
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(
            model=model_name, prompt="Hi", extra_body={"logprob_token_ids": [500]}
        )
    assert e.value.body["param"] == "logprob_token_ids"
