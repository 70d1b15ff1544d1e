"""Incremental detokenization with stop strings, one instance per generated sequence.

Each generated token is decoded once: with a fast tokenizer through ``tokenizers``'
:class:`~tokenizers.decoders.DecodeStream` (which keeps a short prefix window and buffers a token
whose bytes do not yet form valid UTF-8, e.g. a byte-level BPE character split over two tokens);
otherwise with the prefix/read-offset window of vLLM's ``detokenize_incrementally``. The whole
output is never re-decoded per token, so a step costs the same at token 10 and token 10 000.

Stop strings (``stop``) are searched only in the tail that the new text can complete. While a
sequence runs, text that could still become the start of a stop string is held back, so streamed
deltas never show a stop string that is later cut. Semantics follow vLLM
(``vllm/v1/engine/detokenizer.py``): the matched stop string, and the text of a stop token (EOS
or ``stop_token_ids``), are left out unless ``include_stop_str_in_output``; stop strings count
only once ``min_tokens`` tokens were generated.
"""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    """Text of one sequence, token by token.

    Args:
        tokenizer: a transformers tokenizer; fast ones (``backend_tokenizer``) use
            ``DecodeStream``.
        skip_special_tokens: leave special tokens out of the text.
        stop: stop strings (empty strings are ignored).
        include_stop_str_in_output: keep the matched stop string / stop token text.
        min_tokens: stop strings do not count before this many tokens.

    Attributes:
        text: the text delivered so far (the concatenation of the returned deltas).
    """

    def __init__(
        self,
        tokenizer,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if self._backend is not None:
            # lazy: only a fast tokenizer has a backend, and then the tokenizers package is there
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []  # decoded token ids (slow path window; pending bookkeeping)
        self._pending: list[int] = []  # ids whose bytes are not yet valid UTF-8 text
        self._prefix_offset = 0
        self._read_offset = 0
        self._full = ""  # decoded text, stop strings cut
        self.text = ""
        self.num_tokens = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def _step_text(self, token_id: int) -> str:
        """Text that ``token_id`` completes ("" while its bytes are incomplete)."""
        self._pending.append(token_id)
        if self._stream is not None and self._backend is not None:
            out = self._stream.step(self._backend, token_id)
            if out is None:
                return ""
            self._pending.clear()
            return out
        # vLLM's offset window: decode only ids[prefix_offset:], compare with the read prefix
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new = self._decode(self._ids[self._prefix_offset :])
        if len(new) > len(prefix) and not new.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._pending.clear()
            return new[len(prefix) :]
        return ""

    def step(self, token_id: int, *, stop_token: bool = False, final: bool = False):
        """Add one generated token.

        Args:
            token_id: the token.
            stop_token: the token ends the sequence (EOS or a stop token id); its text is left
                out unless ``include_stop_str_in_output``.
            final: the sequence ends with this token for another reason (length): flush the
                held-back text and incomplete bytes (shown as U+FFFD, as a full decode would).

        Returns:
            ``(delta, stop_str)``: the text to append to :attr:`text`, and the matched stop
            string (``None`` if none matched; the sequence must then end).
        """
        self.num_tokens += 1
        prev_len = len(self._full)
        if stop_token and not self.include_stop:
            new = ""
        else:
            new = self._step_text(token_id)
        end = final or stop_token
        if end and self._pending:
            # bytes still incomplete at the end: decoded as a full decode would (U+FFFD)
            new += self._decode(self._pending)
            self._pending.clear()
        self._full += new

        matched = None
        if self.stop and self.num_tokens >= self.min_tokens and new:
            start = max(0, prev_len - self._max_stop + 1)
            best = None
            for s in self.stop:
                i = self._full.find(s, start)
                if i >= 0 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                i, matched = best
                self._full = self._full[: i + len(matched) if self.include_stop else i]
                end = True

        visible = self._full
        if not end:
            visible = self._hold_back(visible)
        delta = visible[len(self.text) :] if visible.startswith(self.text) else ""
        self.text += delta
        return delta, matched

    def _hold_back(self, text: str) -> str:
        """``text`` without a suffix that could still grow into a stop string."""
        if not self.stop or self.include_stop:
            return text
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return text[: len(text) - hold]


__all__ = ["IncrementalDetokenizer"]
