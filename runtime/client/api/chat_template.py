"""Chat messages to prompt token ids: the tokenizer's chat template, or a plain fallback.

:func:`normalize_messages` turns the request's messages (:class:`.protocol.ChatMessage`) into
``{"role", "content"[, "name"]}`` dicts (text parts joined; tool calls refused);
:func:`render_chat` renders them with the template (transformers' ``apply_chat_template``,
``chat_template_kwargs`` checked against the variables the template reads:
:func:`check_template_kwargs`) and tokenizes the text.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jinja2
import jinja2.meta
from jinja2 import TemplateError

from eaas.runtime.client.api.protocol import bad


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str] | None:
    """Names a Jinja chat template reads from its context (``None``: it does not parse here, so
    no key can be checked). Cached: a server renders with one template."""
    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:
        return None


def normalize_messages(msgs: list, param: str = "messages") -> list[dict]:
    """``[{"role", "content"[, "name"], **extra keys}]`` of the request's messages (``param``
    names them in errors; keys a message carries beyond the declared ones are kept for the
    template).

    Raises:
        APIError: 400 for a null or missing ``content`` outside assistant messages, and for tool
            calls (``unsupported_parameter``).
    """
    norm = []
    for i, m in enumerate(msgs):
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        elif content is None:
            # OpenAI allows a null/missing content only on assistant messages (tool calls)
            if m.role != "assistant":
                missing = "content" not in m.model_fields_set
                raise bad(
                    f"'{param}[{i}].content' is {'missing' if missing else 'null'}; "
                    f"{m.role} messages need a string or a list of text parts",
                    f"{param}[{i}].content",
                    "missing_required_parameter" if missing else "invalid_value",
                )
            content = ""
        if m.tool_calls or m.tool_call_id:
            raise bad(
                "tool calls are not supported by this server",
                f"{param}[{i}].tool_calls" if m.tool_calls else f"{param}[{i}].tool_call_id",
                "unsupported_parameter",
            )
        d = {"role": m.role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        d.update(m.model_extra or {})  # keys the template may read (vLLM passes them on)
        norm.append(d)
    return norm


def render_chat(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template (or a plain fallback).

    Args:
        tokenizer: the model's tokenizer (its ``chat_template``, ``bos_token``).
        messages: ``[{"role", "content"[, "name"]}]`` (:func:`normalize_messages`).
        add_generation_prompt: end with the opening of an assistant turn.
        continue_final_message: end inside the last message, which the model continues
            (transformers' ``apply_chat_template`` option of that name).
        template_kwargs: extra template variables (``chat_template_kwargs``).
        add_special_tokens: tokenize the rendered text with the tokenizer's special tokens
            (``/tokenize``'s ``add_special_tokens``; off by default: the template adds them).
        tools: tool definitions for the template (``/tokenize``'s ``tools``, as vLLM; only a
            template that reads ``tools`` renders them).

    Raises:
        APIError: 400 naming ``chat_template_kwargs.<key>`` for a key the template does not
            use or that names one of ``apply_chat_template``'s own arguments; 400 naming
            ``messages`` when the template refuses the messages (its ``raise_exception``,
            e.g. roles that do not alternate) or cannot continue the final message.
    """
    tok = tokenizer
    template = getattr(tok, "chat_template", None)
    kwargs = dict(template_kwargs or {})
    if kwargs:
        check_template_kwargs(tok, template, kwargs)
    if not template:  # plain fallback
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        if continue_final_message:
            text = text[:-1]  # no newline closing the last message
        elif add_generation_prompt:
            text += "<|assistant|>\n"
        if getattr(tok, "bos_token", None):
            text = tok.bos_token + text
        return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])
    try:
        text = tok.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **({"tools": tools} if tools is not None else {}),
            **kwargs,
        )
    except RecursionError:  # transformers copies the variables recursively
        raise bad(
            "'chat_template_kwargs' values are nested too deeply", "chat_template_kwargs"
        ) from None
    except (TemplateError, ValueError, TypeError) as exc:
        raise bad(f"the model's chat template refused these messages: {exc}", "messages") from None
    return list(tok(text, add_special_tokens=add_special_tokens)["input_ids"])


def check_template_kwargs(tokenizer, template: str | None, kwargs: dict[str, Any]) -> None:
    """``chat_template_kwargs`` must act: each key a variable the template reads, none of
    ``apply_chat_template``'s own arguments (those have request fields or are ours).

    Raises:
        APIError: 400 naming ``chat_template_kwargs.<key>``.
    """
    if not template:
        key = next(iter(kwargs))
        raise bad(
            "'chat_template_kwargs' needs a chat template; this model has none",
            f"chat_template_kwargs.{key}",
            "unsupported_parameter",
        )
    used = template_variables(template)
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) | {"messages"}
    for key in kwargs:
        if key in own:
            raise bad(
                f"'chat_template_kwargs.{key}' is an argument of the template call, not a "
                "template variable"
                + (
                    f"; use the request field '{key}'"
                    if key in ("add_generation_prompt", "continue_final_message")
                    else ""
                ),
                f"chat_template_kwargs.{key}",
            )
        if used is not None and key not in used:
            raise bad(
                f"'chat_template_kwargs.{key}' is not used by this model's chat template "
                f"(it reads: {', '.join(sorted(used)) or 'no extra variables'})",
                f"chat_template_kwargs.{key}",
                "unsupported_parameter",
            )
