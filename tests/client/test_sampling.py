"""Sampling (logits processors over the batch) and incremental detokenization: pure logic."""

from __future__ import annotations

import pytest
import torch

from eaas.runtime.client.detokenizer import IncrementalDetokenizer
from eaas.runtime.client.sampling import SamplingParams, apply_penalties, make_generator, sample

pytestmark = pytest.mark.engine

V = 12


def _one(logits, p, prompt=(1,), out=(), gen=None, eos=()):
    return sample(logits.unsqueeze(0), [p], [list(prompt)], [list(out)], [gen], eos)


def test_penalties_match_their_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits.clone(), [p], prompt_ids=[[0]], output_ids=[[1, 2, 2]])
    # token 0: in prompt only -> 2/2; token 1: output once -> -2*2 - 0.5 - 0.25;
    # token 2: output twice -> 1/2 - 1.0 - 0.25; tokens 3, 4 untouched
    assert out.tolist() == [[1.0, -4.75, -0.75, 0.5, 3.0]]


def test_neutral_rows_are_unchanged_in_a_mixed_batch():
    logits = torch.randn(2, V)
    ps = [SamplingParams(), SamplingParams(frequency_penalty=1.0)]
    out = apply_penalties(logits.clone(), ps, [[1], [1]], [[3, 3], [3, 3]])
    assert torch.equal(out[0], logits[0])
    assert out[1, 3] == pytest.approx(float(logits[1, 3]) - 2.0)


def test_greedy_is_argmax_and_logit_bias_moves_it():
    logits = torch.arange(V, dtype=torch.float32)
    assert _one(logits, SamplingParams(temperature=0)).token_ids == [V - 1]
    biased = SamplingParams(temperature=0, logit_bias={3: 100.0})
    assert _one(logits, biased).token_ids == [3]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(V)
    logits[5], logits[6], logits[7] = 10.0, 9.0, 8.0  # eos 5, stop token 6
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[6])
    assert _one(logits, p, out=[1], eos=[5]).token_ids == [7]
    assert _one(logits, p, out=[1, 1], eos=[5]).token_ids == [5]
    # ignore_eos leaves EOS unmasked by min_tokens, stop token ids stay masked
    p2 = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[6], ignore_eos=True)
    assert _one(logits, p2, out=[1], eos=[5]).token_ids == [5]


@pytest.mark.parametrize(
    "p, allowed",
    [
        (SamplingParams(temperature=1.0, top_k=2), {10, 11}),
        (SamplingParams(temperature=1.0, top_p=0.4), {11}),
        (SamplingParams(temperature=1.0, min_p=0.3), {10, 11}),
        (SamplingParams(temperature=1.0, top_k=3, top_p=0.6), {10, 11}),
    ],
)
def test_filters_restrict_the_support(p, allowed):
    logits = torch.zeros(V)
    logits[11], logits[10], logits[9] = 3.0, 2.5, 1.0  # probs ~ .46 .28 .06, 9 x .02
    g = make_generator(0)
    seen = {_one(logits, p, gen=g).token_ids[0] for _ in range(300)}
    assert seen == allowed


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    g = make_generator(1)
    draws = [
        sample(logits.unsqueeze(0), [SamplingParams(temperature=1.0)], [[0]], [[]], [g]).token_ids[
            0
        ]
        for _ in range(3000)
    ]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04), freq


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, seed=42)
    alone = [
        sample(logits[1:2], [p], [[0]], [[]], [make_generator(42)]).token_ids[0] for _ in range(1)
    ]
    gens = [None, make_generator(42), make_generator(7)]
    ps = [SamplingParams(temperature=0.8), p, SamplingParams(temperature=1.0, seed=7)]
    batched = sample(logits, ps, [[0]] * 3, [[]] * 3, gens).token_ids
    assert batched[1] == alone[0]
    # the same seed twice gives the same sequence of draws
    g1, g2 = make_generator(42), make_generator(42)
    a = [sample(logits[1:2], [p], [[0]], [[]], [g1]).token_ids[0] for _ in range(20)]
    b = [sample(logits[1:2], [p], [[0]], [[]], [g2]).token_ids[0] for _ in range(20)]
    assert a == b and len(set(a)) > 1


def test_logprobs_are_raw_log_softmax_with_top_k():
    torch.manual_seed(1)
    logits = torch.randn(2, V)
    ps = [SamplingParams(temperature=0, logprobs=3, logit_bias={0: 50.0}), SamplingParams()]
    out = sample(logits, ps, [[1], [1]], [[], []], [None, None])
    raw = torch.log_softmax(logits[0], -1)
    assert out.token_ids[0] == 0  # the bias picked it...
    assert out.logprobs[0] == pytest.approx(float(raw[0]))  # ...but logprobs are raw
    top = torch.topk(raw, 3)
    assert [t for t, _ in out.top_logprobs[0]] == top.indices.tolist()
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(top.values.tolist())
    assert out.logprobs[1] is None and out.top_logprobs[1] is None


def test_sample_checks_lengths():
    with pytest.raises(ValueError):
        sample(torch.zeros(2, V), [SamplingParams()], [[1]], [[]], [None])


# ---- incremental detokenization ---------------------------------------------------------------
class _CountingTokenizer:
    """The real tokenizer, counting calls of the full ``decode``."""

    def __init__(self, tok):
        self.tok = tok
        self.backend_tokenizer = tok.backend_tokenizer
        self.decode_calls = 0

    def decode(self, ids, **kw):
        self.decode_calls += 1
        return self.tok.decode(ids, **kw)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    """The tiny checkpoint's tokenizer as the attention client loads it (``load_tokenizer``)."""
    from eaas.runtime.models.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


TEXT = "héllo wörld, 你好 🙂 déjà vu — naïve café; def f(x): return x * 2"


def test_byte_level_splits_are_reassembled_without_full_decodes(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    # characters split over several tokens exist in this text (else the test shows nothing)
    assert len(ids) > len(tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(TEXT))
    counting = _CountingTokenizer(tokenizer)
    d = IncrementalDetokenizer(counting)
    deltas = [d.step(t, final=i == len(ids) - 1)[0] for i, t in enumerate(ids)]
    assert "".join(deltas) == TEXT == d.text
    assert "" in deltas[:-1]  # some token completed no character by itself
    assert all("\ufffd" not in x for x in deltas)
    assert counting.decode_calls == 0  # never re-decoded the output


def test_slow_path_without_backend_matches(tokenizer):
    class Slow:
        def decode(self, ids, **kw):
            return tokenizer.decode(ids, **kw)

    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(Slow())
    text = "".join(d.step(t, final=i == len(ids) - 1)[0] for i, t in enumerate(ids))
    assert text == TEXT


def test_incomplete_bytes_at_the_end_are_flushed_as_a_full_decode_would(tokenizer):
    ids = tokenizer("ab 🙂", add_special_tokens=False)["input_ids"]
    cut = ids[:-1]  # the emoji's last byte token missing
    d = IncrementalDetokenizer(tokenizer)
    text = "".join(d.step(t, final=i == len(cut) - 1)[0] for i, t in enumerate(cut))
    assert text == tokenizer.decode(cut)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_is_held_back_and_cut(tokenizer, include):
    text = "one two three four five"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tokenizer, stop=["three f"], include_stop_str_in_output=include)
    deltas, matched = [], None
    for t in ids:
        delta, matched = d.step(t)
        deltas.append(delta)
        assert "three" not in "".join(deltas) or include
        if matched:
            break
    assert matched == "three f"
    assert "".join(deltas) == ("one two three f" if include else "one two ")


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer("ab ab ab", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tokenizer, stop=["ab"], min_tokens=len(ids))
    out = [d.step(t) for t in ids]
    assert [m for _, m in out[:-1]] == [None] * (len(ids) - 1)
    assert out[-1][1] == "ab"


def test_stop_token_text_is_left_out_unless_included(tokenizer):
    ids = tokenizer("hi there", add_special_tokens=False)["input_ids"]
    for include, want in ((False, "hi"), (True, "hi there")):
        d = IncrementalDetokenizer(tokenizer, include_stop_str_in_output=include)
        text = "".join(d.step(t, stop_token=(i == len(ids) - 1))[0] for i, t in enumerate(ids))
        assert text == (want if include else tokenizer.decode(ids[:-1]))
