"""Structured outputs (xgrammar masks) and ``allowed_token_ids`` in the engine: the tiny model's
weights are random, so every guarantee below comes from the mask alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from eaas.runtime.client.engine import Engine, SamplingParams
from eaas.runtime.client.sampling import sample
from eaas.runtime.client.structured import (
    GrammarCompiler,
    GrammarError,
    GrammarState,
    apply_grammar_masks,
)
from eaas.runtime.models.attention import load_attention_model

pytestmark = [pytest.mark.engine, pytest.mark.api]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 2},
    },
    "required": ["name", "age", "skills"],
}
IP = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"


@pytest.fixture(scope="module")
def loaded(model_dir):
    torch.set_num_threads(1)
    model, tok, _ = load_attention_model(model_dir, torch.float32)
    return model, tok


@pytest.fixture(scope="module")
def engine(loaded):
    model, tok = loaded
    eng = Engine(model, tok, client_id="test-structured")
    eng.start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def compiler(loaded):
    model, tok = loaded
    return GrammarCompiler(tok, model.config.vocab_size)


def _run(engine, tok, grammar, max_tokens=400, temperature=1.0, seed=0, n=3):
    prompt = tok("Answer:")["input_ids"]
    out = []
    for i in range(n):
        p = SamplingParams(
            max_tokens=max_tokens, temperature=temperature, seed=seed + i, grammar=grammar
        )
        out.append(engine.generate(prompt, p, timeout=240))
    return out


@pytest.mark.parametrize(
    "kind, spec, check",
    [
        ("json", SCHEMA, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        ("regex", IP, lambda t: re.fullmatch(IP, t) or 1 / 0),
        ("choice", ["Python", "C++", "C#"], lambda t: t in ("Python", "C++", "C#") or 1 / 0),
        ("grammar", 'root ::= "SELECT " ("a" | "b") " FROM t"', lambda t: t in
         ("SELECT a FROM t", "SELECT b FROM t") or 1 / 0),
    ],
)  # fmt: skip
def test_sampled_output_satisfies_the_constraint_and_stops(
    engine, loaded, compiler, kind, spec, check
):
    _, tok = loaded
    # no free whitespace: a random model would pad JSON with whitespace tokens for ever
    g = compiler.compile(kind, spec, "structured_outputs", any_whitespace=False)
    for req in _run(engine, tok, g):
        assert req.finish_reason == "stop", (kind, req.text, len(req.output_ids))
        check(req.text)


def test_json_object_allows_only_an_object_to_start(loaded, compiler):
    model, tok = loaded
    g = compiler.compile("json_object", None, "response_format", any_whitespace=False)
    V = model.config.vocab_size
    masked = apply_grammar_masks(torch.zeros(1, V), [GrammarState(g, {tok.eos_token_id})])
    allowed = torch.nonzero(masked[0] == 0).flatten().tolist()
    assert allowed and all(tok.decode([t]).startswith("{") for t in allowed)


def test_greedy_output_is_constrained_too(engine, loaded, compiler):
    _, tok = loaded
    g = compiler.compile("choice", ["yes", "no"], "structured_outputs.choice")
    (req,) = _run(engine, tok, g, temperature=0.0, n=1)
    assert req.text in ("yes", "no") and req.finish_reason == "stop"


@pytest.mark.parametrize(
    "kind, spec",
    [
        ("regex", "[.*"),
        ("grammar", "root ::= undefined_rule"),
        ("json", {"type": "object", "properties": {"foo": "bar"}}),
        ("json", "{not json"),
        ("choice", []),
    ],
)
def test_a_constraint_that_does_not_compile_names_its_field(compiler, kind, spec):
    with pytest.raises(GrammarError) as e:
        compiler.compile(kind, spec, f"structured_outputs.{kind}")
    assert e.value.param == f"structured_outputs.{kind}"
    assert "/project/cpp" not in str(e.value)  # xgrammar's source locations are cut


def test_allowed_token_ids_mask_the_sampled_token_not_the_raw_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    allowed = [7, 11]
    ps = [SamplingParams(temperature=1.0, allowed_token_ids=allowed, logprobs=3)] * 2
    ps[1] = SamplingParams(temperature=0.0, allowed_token_ids=allowed, logprobs=3)
    for _ in range(20):
        out = sample(logits, ps, [[1], [1]], [[], []], [None, None])
        assert set(out.token_ids) <= set(allowed)
    # raw logprobs (vLLM's default): the top entries are the unmasked model's
    assert out.top_logprobs[0][0][0] == int(torch.argmax(logits[0]))
    assert out.token_ids[1] == max(allowed, key=lambda t: float(logits[1, t]))
