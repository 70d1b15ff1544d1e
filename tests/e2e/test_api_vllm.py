"""vLLM's extensions of the OpenAI API and the chat template fields, through a lone
``eaas attention-client --local-experts`` (the API is the same code under ``eaas serve``) and
the official ``openai`` client.

The checkpoint is the tiny model with a chat template that also reads a message key of its own
(``lang``): extra keys and custom roles in messages must reach the template, as in vLLM.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from helpers.api import LocalClient

pytestmark = [pytest.mark.engine, pytest.mark.api]

PROMPT = "The expert server hosts a set of experts and"

#: the tiny model's template, plus ``[lang]`` after the role of a message that has that key
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>{% if message['lang'] is defined %}[{{ message['lang'] }}]"
    "{% endif %}\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _checkpoint(d: Path, tiny_dir: str) -> Path:
    d.mkdir()
    for f in Path(tiny_dir).iterdir():
        if f.name == "model.safetensors":
            (d / f.name).symlink_to(f)
        else:
            shutil.copy(f, d / f.name)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model_dir):
    return _checkpoint(tmp_path_factory.mktemp("vllm-ext") / "tiny-lang", model_dir)


@pytest.fixture(scope="module")
def deployment(checkpoint):
    c = LocalClient(checkpoint, checkpoint.parent / "client.log")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def model_name(checkpoint):
    return checkpoint.name


def _post(deployment, path, body):
    return httpx.post(f"{deployment.base_url}{path}", json=body, timeout=120)


def _ok(deployment, model_name):
    """A request that succeeds (the server keeps serving after a bad one)."""
    r = _post(deployment, "/v1/completions", {"model": model_name, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


# ---- bugs ----------------------------------------------------------------------------------------
def test_echo_logprobs_of_a_prompt_that_decodes_to_nothing(deployment, model_name, tokenizer):
    """Prompt ids that decode to "" (``[0] * 5``: the BOS token, skipped): ``echo`` with
    ``logprobs`` still lists every prompt token, the first ``null`` (they were dropped: 2 entries
    instead of 7, the first not null)."""
    assert tokenizer.decode([0] * 5, skip_special_tokens=True) == ""
    body = {"model": model_name, "prompt": [0] * 5, "max_tokens": 2, "echo": True, "logprobs": 1}
    for stream in (False, True):
        if not stream:
            ch = _post(deployment, "/v1/completions", {**body, "temperature": 0}).json()
            lp = ch["choices"][0]["logprobs"]
        else:
            lp = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
            with httpx.stream(
                "POST",
                f"{deployment.base_url}/v1/completions",
                json={**body, "stream": True, "temperature": 0},
                timeout=120,
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        part = json.loads(line[6:])["choices"][0]["logprobs"]
                        for k in lp:
                            lp[k] += part[k]
        assert len(lp["tokens"]) == 7, (stream, lp)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(x is not None for x in lp["token_logprobs"][1:]), lp


def test_default_max_tokens_is_clamped_to_the_room_left(deployment, model_name):
    """Without ``max_tokens`` a completion gets OpenAI's 16, but never more than the context
    leaves: a 2040-token prompt of a 2048-token context got a 400 on a field never sent."""
    body = {
        "model": model_name,
        "prompt": [5] * 2040,
        "ignore_eos": True,
        "temperature": 0,
        "return_token_ids": True,
    }
    r = _post(deployment, "/v1/completions", body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert (len(ch["token_ids"]), ch["finish_reason"]) == (8, "length")
    short = _post(deployment, "/v1/completions", {**body, "prompt": [5] * 10}).json()
    assert len(short["choices"][0]["token_ids"]) == 16
    # a batch: each prompt its own room
    both = _post(deployment, "/v1/completions", {**body, "prompt": [[5] * 2040, [5] * 10]}).json()
    assert [len(c["token_ids"]) for c in both["choices"]] == [8, 16]
    sent = _post(deployment, "/v1/completions", {**body, "max_tokens": 16})  # sent: still a 400
    assert sent.status_code == 400 and sent.json()["error"]["param"] == "max_tokens"


# ---- the keys vLLM sends, return_token_ids, prompt_logprobs --------------------------------------
def test_responses_carry_vllms_prompt_keys_as_null(oai, model_name):
    """Clients written for vLLM read ``prompt_logprobs`` / ``prompt_token_ids`` by attribute."""
    c = oai.completions.create(model=model_name, prompt="Hi", max_tokens=2)
    assert c.choices[0].prompt_logprobs is None and c.choices[0].prompt_token_ids is None
    assert "prompt_token_ids" in c.choices[0].model_dump()
    m = oai.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert m.prompt_logprobs is None and m.prompt_token_ids is None
    assert "prompt_logprobs" in m.model_dump()


def test_return_token_ids(oai, model_name, tokenizer):
    """``true``: the generated and the prompt's ids (completions: per choice; chat: on the
    response and on the first streamed chunk only); ``false`` or absent: both null (vLLM)."""
    ids = tokenizer(PROMPT)["input_ids"]
    msgs = [{"role": "user", "content": PROMPT}]
    chat_ids = _tokenize_chat(oai, model_name, msgs)
    on = {"return_token_ids": True}
    c = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, extra_body=on)
    assert c.choices[0].prompt_token_ids == ids and len(c.choices[0].token_ids) == 3
    m = oai.chat.completions.create(model=model_name, messages=msgs, max_tokens=3, extra_body=on)
    assert m.prompt_token_ids == chat_ids and len(m.choices[0].token_ids) == 3
    off = {"return_token_ids": False}
    c = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, extra_body=off)
    assert c.choices[0].token_ids is None and c.choices[0].prompt_token_ids is None
    m = oai.chat.completions.create(model=model_name, messages=msgs, max_tokens=3, extra_body=off)
    assert m.choices[0].token_ids is None and m.prompt_token_ids is None
    c = oai.completions.create(model=model_name, prompt=PROMPT, max_tokens=3)  # absent: as false
    assert c.choices[0].token_ids is None and c.choices[0].prompt_token_ids is None
    m = oai.chat.completions.create(model=model_name, messages=msgs, max_tokens=3)
    assert m.choices[0].token_ids is None and m.prompt_token_ids is None
    chunks = list(
        oai.chat.completions.create(
            model=model_name, messages=msgs, max_tokens=3, stream=True, extra_body=on
        )
    )
    assert chunks[0].prompt_token_ids == chat_ids
    assert all("prompt_token_ids" not in ch.model_dump() for ch in chunks[1:])
    chunks = list(
        oai.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=3, stream=True, extra_body=on
        )
    )
    assert chunks[0].choices[0].prompt_token_ids == ids
    assert all("prompt_token_ids" not in ch.choices[0].model_dump() for ch in chunks[1:])


def _tokenize_chat(oai, model_name, msgs) -> list[int]:
    r = httpx.post(
        f"{str(oai.base_url).removesuffix('/v1/')}/tokenize",
        json={"model": model_name, "messages": msgs},
        timeout=60,
    )
    return r.json()["tokens"]


def test_prompt_logprobs(oai, model_name, tokenizer, deployment):
    """vLLM's ``prompt_logprobs``: per prompt token after the first ``{id: {logprob, rank,
    decoded_token}}`` with the prompt token and the ``k`` most likely; the numbers equal the
    echoed prompt's logprobs of the same request (both come from its prefill forward)."""
    ids = tokenizer(PROMPT)["input_ids"]
    c = oai.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=2,
        echo=True,
        logprobs=2,
        extra_body={"prompt_logprobs": 2},
    )
    rows = c.choices[0].prompt_logprobs
    assert len(rows) == len(ids) and rows[0] is None
    echo = c.choices[0].logprobs
    for i, (tok, row) in enumerate(zip(ids[1:], rows[1:], strict=True), 1):
        assert row[str(tok)]["logprob"] == pytest.approx(echo.token_logprobs[i], abs=1e-5)
        assert row[str(tok)]["decoded_token"] == tokenizer.decode([tok])
        ranked = sorted((e["rank"], e["logprob"]) for e in row.values() if e["rank"] is not None)
        assert [r for r, _ in ranked] == [1, 2]
        assert ranked[0][1] >= ranked[1][1] >= row[str(tok)]["logprob"] - 1e-6
    m = oai.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    assert m.prompt_logprobs[0] is None and all(len(r) == 1 for r in m.prompt_logprobs[1:])
    for extra, param in (
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ):
        r = _post(deployment, "/v1/completions", {"model": model_name, "prompt": "Hi", **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- chat: echo, roles, extra keys ---------------------------------------------------------------
def test_chat_echo_with_continue_final_message(oai, model_name, deployment):
    """vLLM's chat ``echo``: the answer starts with the last message when it has the answer's
    role (without a generation prompt the answer continues that message, in its role)."""
    saying = "An apple a day, keeps"
    msgs = [
        {"role": "user", "content": "tell me a saying"},
        {"role": "assistant", "content": saying},
    ]
    body = {"continue_final_message": True, "add_generation_prompt": False}
    for echo in (True, False):
        r = oai.chat.completions.create(
            model=model_name, messages=msgs, max_tokens=3, extra_body={**body, "echo": echo}
        )
        msg = r.choices[0].message
        assert msg.role == "assistant" and msg.content.startswith(saying) is echo, msg
    chunks = list(
        oai.chat.completions.create(
            model=model_name,
            messages=msgs,
            max_tokens=3,
            stream=True,
            extra_body={**body, "echo": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith(saying) and chunks[1].choices[0].delta.content == saying
    # a generation prompt opens an assistant turn after a user message: nothing to echo
    r = oai.chat.completions.create(
        model=model_name, messages=msgs[:1], max_tokens=2, extra_body={"echo": True}
    )
    assert not r.choices[0].message.content.startswith("tell me")


def test_extra_keys_and_custom_roles_reach_the_template(deployment, model_name, tokenizer, oai):
    msgs = [
        {"role": "narrator", "content": "Once", "lang": "fr"},
        {"role": "user", "content": "Hi", "lang": "en"},
    ]
    got = _post(deployment, "/tokenize", {"model": model_name, "messages": msgs}).json()["tokens"]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert "<|narrator|>[fr]" in text and "<|user|>[en]" in text
    assert got == tokenizer(text, add_special_tokens=False)["input_ids"]
    r = oai.chat.completions.create(model=model_name, messages=msgs, max_tokens=2)
    assert r.usage.prompt_tokens == len(got)


def test_tokenize_messages_with_add_special_tokens(deployment, model_name, tokenizer):
    msgs = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    for add in (True, False):
        r = _post(
            deployment,
            "/tokenize",
            {"model": model_name, "messages": msgs, "add_special_tokens": add},
        )
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tokenizer(text, add_special_tokens=add)["input_ids"]
    plain = _post(deployment, "/tokenize", {"model": model_name, "prompt": "Hi"}).json()
    assert plain["tokens"] == tokenizer("Hi")["input_ids"]


# ---- model ids, accepted OpenAI fields -----------------------------------------------------------
def test_models_retrieve_and_an_empty_model(oai, model_name, deployment):
    m = oai.models.retrieve(model_name)
    assert (m.id, m.object) == (model_name, "model")
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-17")
    for path, body in (
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        ),
        ("/tokenize", {"prompt": "Hi"}),
    ):
        r = _post(deployment, path, {"model": "", **body})
        assert r.status_code == 200, (path, r.text)


def test_user_metadata_parallel_tool_calls_are_accepted(deployment, model_name):
    base = {"model": model_name, "max_tokens": 3, "temperature": 0}
    chat = {**base, "messages": [{"role": "user", "content": PROMPT}]}
    want = _post(deployment, "/v1/chat/completions", chat).json()["choices"][0]["token_ids"]
    extra = {"user": "u-1", "metadata": {"team": "a"}, "parallel_tool_calls": False}
    r = _post(deployment, "/v1/chat/completions", {**chat, **extra})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want, r.text
    r = _post(deployment, "/v1/completions", {**base, "prompt": PROMPT, "user": "u-1"})
    assert r.status_code == 200, r.text
    for bad, param in (({"metadata": {"team": 1}}, "metadata.team"), ({"user": 5}, "user")):
        r = _post(deployment, "/v1/chat/completions", {**chat, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    _ok(deployment, model_name)


# ---- tokenize / detokenize / version, chat template fields -----------------------------------------
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


def test_truncate_prompt_tokens(oai, model_name):
    """vLLM's ``truncate_prompt_tokens`` keeps the last k prompt ids (``truncation_side``
    ``left``, the default) or the first k (``right``)."""
    ids = list(range(5, 13))
    for side, want in (("left", ids[-4:]), ("right", ids[:4])):
        r = oai.completions.create(
            model=model_name,
            prompt=ids,
            max_tokens=1,
            extra_body={
                "return_token_ids": True,
                "truncate_prompt_tokens": 4,
                "truncation_side": side,
            },
        )
        assert r.choices[0].prompt_token_ids == want and r.usage.prompt_tokens == 4, side
    # found by the schema fuzzer: 0 left no prompt and failed in the engine (a 500)
    bad = {"model": model_name, "prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 0}
    for path, body in (
        ("/v1/completions", bad),
        (
            "/v1/chat/completions",
            {**bad, "prompt": None, "messages": [{"role": "user", "content": "Hi"}]},
        ),
    ):
        r = httpx.post(f"{str(oai.base_url).removesuffix('/v1/')}{path}", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", (
            r.text
        )


def test_tokenize_passes_tools_to_the_template(deployment, model_name, tokenizer):
    msgs = [{"role": "user", "content": "Weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    r = _post(deployment, "/tokenize", {"model": model_name, "messages": msgs, "tools": tools})
    assert r.status_code == 200, r.text
    text = tokenizer.apply_chat_template(
        msgs, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert r.json()["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
