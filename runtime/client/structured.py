"""Structured outputs (guided decoding): grammars compiled with xgrammar, applied as token masks.

As vLLM's default backend (``vllm/v1/structured_output/backend_xgrammar.py``): a request's
constraint -- a JSON schema, any JSON object, a regular expression, a choice of strings or an
EBNF / Lark grammar -- is compiled once against the served checkpoint's tokenizer
(:class:`GrammarCompiler`, on the API's worker thread, so an invalid one is a 400 before the
engine sees it); each sequence then owns a :class:`GrammarState` (an ``xgrammar.GrammarMatcher``)
that gives, before every sampling step, the bitmask of the tokens that keep the output inside the
grammar (:func:`apply_grammar_masks`: ``-inf`` on the others, before the sampler, so logprobs
see the constrained distribution, as in vLLM) and takes the sampled token after it. Once the
grammar is complete only the stop tokens (the model's EOS ids) are allowed, so the sequence ends
with ``finish_reason: "stop"``; the output then parses (a schema's instance validates) whatever
the model's weights, unless ``max_tokens`` cuts it first (``"length"``).

xgrammar is imported on the first structured request (:func:`_xgr`): it loads a native library
that a server never asked for constraints does not need.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: the constraint kinds (vLLM's ``StructuredOutputsParams`` fields)
KINDS = ("json", "json_object", "regex", "choice", "grammar")


class GrammarError(ValueError):
    """A constraint that does not compile (bad schema, regex or grammar); ``param`` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _xgr():
    import xgrammar  # lazy: a native library only structured requests need (module docstring)

    return xgrammar


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint (shared by the ``n`` choices of a request; immutable).

    Attributes:
        kind: one of :data:`KINDS`.
        compiled: the ``xgrammar.CompiledGrammar``.
    """

    kind: str
    compiled: Any


def choice_as_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (vLLM's ``choice_as_grammar``)."""
    esc = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def one(s: str) -> str:
        return "".join(
            esc.get(c, f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in s
        )

    return "root ::= " + " | ".join(f'"{one(c)}"' for c in choices)


# xgrammar 0.2.9 writes a string with maxLength / minLength as repeats of this class, which
# admits raw control characters (U+0000-U+001F but CR and LF) that JSON strings may not hold
# (RFC 8259 section 7: json.loads refuses them); its unbounded strings use the right class
_LOOSE_CHAR = r"[^\"\\\r\n]"
_JSON_CHAR = r"[^\"\\\x00-\x1f]"


def _json_ebnf(schema: str, any_whitespace: bool, separators) -> str:
    """xgrammar's EBNF for a JSON schema, with its bounded-length string characters limited to
    what JSON allows unescaped (:data:`_LOOSE_CHAR`)."""
    g = _xgr().Grammar.from_json_schema(
        schema, any_whitespace=any_whitespace, separators=separators
    )
    return str(g).replace(_LOOSE_CHAR, _JSON_CHAR)


def _likely_lark(grammar: str) -> bool:
    """vLLM's ``grammar_is_likely_lark``: Lark rules use ``:``, EBNF ``::=``."""
    for line in grammar.splitlines():
        line = line.split("//", 1)[0].split("#", 1)[0].strip()
        if not line:
            continue
        if "::=" in line:
            return False
    return True


class GrammarCompiler:
    """Compiles constraints against one tokenizer (thread safe; compiled grammars are cached by
    xgrammar).

    Args:
        tokenizer: the served checkpoint's Hugging Face tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's length).
    """

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get(self):
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size
                )
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
            return self._compiler

    def compile(self, kind: str, spec: Any, param: str, any_whitespace: bool = True) -> Grammar:
        """Compile one constraint.

        Args:
            kind: one of :data:`KINDS`.
            spec: the JSON schema (dict or JSON text), regex, list of choices or grammar text
                (ignored for ``json_object``).
            param: the request field named in errors (``structured_outputs.json``).
            any_whitespace: JSON may have any whitespace between tokens (vLLM's default;
                ``disable_any_whitespace`` turns it off).

        Raises:
            GrammarError: the constraint does not compile (400 naming ``param``).
        """
        try:
            c = self._get()
        except ImportError:
            raise GrammarError(
                param, f"'{param}' needs the xgrammar package on the server (eaas[runtime])"
            ) from None
        seps = None if any_whitespace else (",", ":")
        try:
            if kind in ("json", "json_object"):
                text = '{"type": "object"}' if kind == "json_object" else spec
                text = text if isinstance(text, str) else json.dumps(text)
                json.loads(text)  # xgrammar's own message for bad JSON text is obscure
                out = c.compile_grammar(_json_ebnf(text, any_whitespace, seps))
            elif kind == "regex":
                if "\x00" in spec:
                    raise ValueError("a regex must not contain a NUL character")
                out = c.compile_regex(spec)
            elif kind == "choice":
                if not spec:
                    raise ValueError("'choice' needs at least one string")
                out = c.compile_grammar(choice_as_grammar(spec))
            elif kind == "grammar":
                out = c.compile_lark(spec) if _likely_lark(spec) else c.compile_grammar(spec)
            else:
                raise ValueError(f"unknown structured output kind {kind!r}")
        except (RuntimeError, ValueError, TypeError) as exc:
            # xgrammar's messages start with "[hh:mm:ss] /project/cpp/file.cc:94: "
            msg = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", str(exc).strip()).splitlines()
            raise GrammarError(
                param, f"'{param}' does not compile: {' '.join(msg[:3])[:400]}"
            ) from None
        return Grammar(kind, out)


class GrammarState:
    """One sequence's position in its grammar (an ``xgrammar.GrammarMatcher``).

    Args:
        grammar: the request's compiled constraint.
        stop_token_ids: the ids that may end the sequence once the grammar is complete (the
            engine's EOS ids).
    """

    def __init__(self, grammar: Grammar, stop_token_ids: Collection[int]) -> None:
        xgr = _xgr()
        self.matcher = xgr.GrammarMatcher(
            grammar.compiled, override_stop_tokens=sorted(stop_token_ids) or None
        )

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; ``False`` when the grammar refuses it (a token drawn
        from a row whose every allowed token was also masked by another stage)."""
        if self.matcher.is_terminated():
            return False
        return bool(self.matcher.accept_token(int(token_id)))

    @property
    def terminated(self) -> bool:
        """The grammar completed and a stop token was accepted."""
        return bool(self.matcher.is_terminated())


def apply_grammar_masks(
    logits: torch.Tensor, states: Sequence[GrammarState | None]
) -> torch.Tensor:
    """Logits with every token the row's grammar forbids at ``-inf``.

    Args:
        logits: ``[B, V]`` float32 CPU logits (not modified).
        states: ``B`` entries; ``None`` rows are not constrained.

    Returns:
        ``logits`` itself when no row is constrained, else a masked copy ``[B, V]``.
    """
    rows = [b for b, s in enumerate(states) if s is not None and not s.terminated]
    if not rows:
        return logits
    xgr = _xgr()
    B, V = logits.shape
    bitmask = xgr.allocate_token_bitmask(B, V)  # (B, ceil(V / 32)) int32
    for b in rows:
        st = states[b]
        assert st is not None
        st.matcher.fill_next_token_bitmask(bitmask, b)
    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=V, indices=rows)
    return out


__all__ = [
    "KINDS",
    "Grammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarState",
    "apply_grammar_masks",
    "choice_as_grammar",
]
