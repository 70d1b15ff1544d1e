"""OpenAI API parity with vLLM's server, logprobs: completion, chat, prompt and echoed-prompt
logprobs equal the reference model's, through the ``eaas serve`` of ``test_api_parity.py``
(``parity_deployment``, ``prompt_ids``, ``ref``: ``tests/e2e/conftest.py``) and the
official ``openai`` client.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch

from eaas.runtime.models.reference import reference_logits

from helpers.api import PARITY_PROMPT as PROMPT
from helpers.e2e import metric_sum, metric_values

pytestmark = [pytest.mark.engine, pytest.mark.api]


@pytest.fixture(scope="module")
def deployment(parity_deployment):
    return parity_deployment


def _post(deployment, path, body):
    return httpx.post(f"{deployment.base_url}{path}", json=body, timeout=120)


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
