"""Logprobs in the OpenAI API's shapes, from the engine's token events.

Completions: ``{"text_offset", "token_logprobs", "tokens", "top_logprobs"}`` with the top
logprobs as ``{token text: logprob}`` (:meth:`LogprobFormatter.completion_logprobs`; with
``echo``, the prompt tokens' first, as vLLM: :meth:`LogprobFormatter.echo_logprobs`). Chat:
``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``
(:meth:`LogprobFormatter.chat_logprobs`). A token is named by its text, or ``"token_id:<id>"``
with vLLM's ``return_tokens_as_token_ids``. vLLM's ``prompt_logprobs`` (both routes):
:meth:`LogprobFormatter.prompt_logprobs`.
"""

from __future__ import annotations

from eaas.runtime.client.api.bodies import (
    ChatLogProbs,
    ChatTokenLogprob,
    CompletionLogProbs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from eaas.runtime.client.api.prepare import Prepared
from eaas.runtime.client.request import TokenEvent


class LogprobFormatter:
    """Names tokens and lays out logprobs; caches each token id's text.

    Args:
        tokenizer: the model's tokenizer (``decode([token_id])`` names a token).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_strs: dict[int, str] = {}

    def token_str(self, token_id: int) -> str:
        """The text of one token (cached: at most 1,000,000 ids)."""
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id])
            if len(self._token_strs) < 1_000_000:
                self._token_strs[token_id] = s
        return s

    def token_name(self, token_id: int, as_id: bool) -> str:
        """How logprobs name a token: its text, or ``"token_id:<id>"`` (vLLM's
        ``return_tokens_as_token_ids``: unique, where texts collide, e.g. partial UTF-8 bytes)."""
        return f"token_id:{token_id}" if as_id else self.token_str(token_id)

    def completion_logprobs(
        self, events: list[TokenEvent], offset: int, k: int, as_ids: bool = False
    ) -> CompletionLogProbs:
        """Completions ``logprobs`` of generated tokens: ``k`` top logprobs each, text offsets
        from ``offset`` (characters)."""
        out = CompletionLogProbs()
        for ev in events:
            s = self.token_name(ev.token_id, as_ids)
            out.text_offset.append(offset)
            offset += len(s)
            out.tokens.append(s)
            out.token_logprobs.append(ev.logprob)
            top: dict[str, float] = {}
            if ev.logprob is not None:
                top[s] = ev.logprob
            for t, lp in (ev.top_logprobs or [])[:k]:
                # tokens that decode alike (e.g. partial UTF-8 bytes) share a key: keep the first
                top.setdefault(self.token_name(t, as_ids), lp)
            out.top_logprobs.append(top)
        return out

    def echo_logprobs(
        self,
        prompt_ids: list[int],
        rows: list[tuple[float, list[tuple[int, float]]] | None] | None,
        k: int,
        as_ids: bool = False,
    ) -> CompletionLogProbs:
        """Completions ``logprobs`` of the echoed prompt tokens (as vLLM's ``echo`` with
        ``logprobs``): the first token's logprob and top logprobs are ``null``; offsets from 0.

        Raises:
            RuntimeError: the engine delivered no prompt logprobs for a requested echo.
        """
        if rows is None or len(rows) != len(prompt_ids):
            raise RuntimeError("the engine returned no prompt logprobs for 'echo' with 'logprobs'")
        out = CompletionLogProbs()
        offset = 0
        for i, t in enumerate(prompt_ids):
            s = self.token_name(t, as_ids)
            out.text_offset.append(offset)
            offset += len(s)
            out.tokens.append(s)
            row = rows[i]
            if i == 0 or row is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            lp, tops = row
            out.token_logprobs.append(lp)
            top = {s: lp}
            for tt, tlp in tops[:k]:
                top.setdefault(self.token_name(tt, as_ids), tlp)
            out.top_logprobs.append(top)
        return out

    def choice_logprobs(
        self, prep: Prepared, prompt: int, events: list[TokenEvent], offset: int, first: bool
    ) -> tuple[CompletionLogProbs, int]:
        """Completions ``logprobs`` of ``events`` of a choice of prompt ``prompt`` and the text
        offset after them. With ``echo``, on the choice's first chunk the prompt tokens' come
        first and offsets count from 0 over the token strings (as vLLM: ``offset`` is then
        ignored)."""
        assert prep.logprobs is not None
        # ``prep.echo``, not the echoed text: ids such as [0, 0, 0] decode to "" and their rows
        # were dropped (2 entries instead of 7 for a 5-token prompt and 2 generated)
        if not (first and prep.echo and prep.params[0].prompt_logprobs is not None):
            gen = self.completion_logprobs(events, offset, prep.logprobs, prep.tokens_as_ids)
            return gen, offset + sum(len(t) for t in gen.tokens)
        head = self.echo_logprobs(
            prep.prompts[prompt],
            events[0].prompt_logprobs if events else None,
            prep.logprobs,
            prep.tokens_as_ids,
        )
        offset = sum(len(t) for t in head.tokens)
        gen = self.completion_logprobs(events, offset, prep.logprobs, prep.tokens_as_ids)
        return CompletionLogProbs(
            text_offset=head.text_offset + gen.text_offset,
            token_logprobs=head.token_logprobs + gen.token_logprobs,
            tokens=head.tokens + gen.tokens,
            top_logprobs=head.top_logprobs + gen.top_logprobs,
        ), offset + sum(len(t) for t in gen.tokens)

    def prompt_logprobs(
        self,
        prompt_ids: list[int],
        rows: list[tuple[float, list[tuple[int, float]]] | None] | None,
        k: int,
    ) -> PromptLogprobs:
        """vLLM's ``prompt_logprobs`` of a prompt: ``None`` for the first token, else
        ``{str(token id): {logprob, rank, decoded_token}}`` with the prompt token and the ``k``
        most likely (``rank`` from the top-``k`` list; ``None`` for a prompt token outside it).

        Raises:
            RuntimeError: the engine delivered no prompt logprobs although they were asked for.
        """
        if rows is None or len(rows) != len(prompt_ids):
            raise RuntimeError("the engine returned no prompt logprobs for 'prompt_logprobs'")
        out: PromptLogprobs = []
        for i, t in enumerate(prompt_ids):
            row = rows[i]
            if i == 0 or row is None:
                out.append(None)
                continue
            lp, tops = row
            ranks = {tt: r for r, (tt, _) in enumerate(tops[:k], 1)}
            entry = {
                str(t): PromptLogprob(
                    logprob=lp, rank=ranks.get(t), decoded_token=self.token_str(t)
                )
            }
            for tt, tlp in tops[:k]:
                entry.setdefault(
                    str(tt),
                    PromptLogprob(logprob=tlp, rank=ranks[tt], decoded_token=self.token_str(tt)),
                )
            out.append(entry)
        return out

    def chat_logprobs(self, events: list[TokenEvent], as_ids: bool = False) -> ChatLogProbs:
        """Chat ``logprobs`` of ``events`` (each with its top logprobs).

        Raises:
            RuntimeError: an event without the logprob the request asked for.
        """
        content = []
        for ev in events:
            if ev.logprob is None:  # the engine gives every token one when logprobs were asked
                raise RuntimeError(f"token {ev.token_id} came without the requested logprob")
            # ``bytes`` stay the UTF-8 of the token's text (OpenAI: the token's bytes) when
            # ``token`` names it by id
            tops = [
                TopLogprob(
                    token=self.token_name(t, as_ids),
                    logprob=lp,
                    bytes=list(self.token_str(t).encode()),
                )
                for t, lp in ev.top_logprobs or []
            ]
            content.append(
                ChatTokenLogprob(
                    token=self.token_name(ev.token_id, as_ids),
                    logprob=ev.logprob,
                    bytes=list(self.token_str(ev.token_id).encode()),
                    top_logprobs=tops,
                )
            )
        return ChatLogProbs(content=content)
