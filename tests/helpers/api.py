"""What the API tests share: a lone ``eaas attention-client --local-experts`` process and the
tables of bad requests (each case: what is sent, the field its 400 names)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.e2e import free_port, sigterm_and_wait

#: the prompt of the API parity modules (tests/e2e/test_api_parity.py, test_api_logprobs.py)
PARITY_PROMPT = "The expert server hosts a set of experts and"


class LocalClient:
    """``python -m eaas attention-client --local-experts --model MODEL`` on a free port; its
    stderr goes to ``log``. ``base`` / ``base_url``: its HTTP address."""

    def __init__(
        self,
        model: Path | str,
        log: Path,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ):
        self.port = free_port()
        self.base = self.base_url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "eaas",
                "attention-client",
                "--local-experts",
                "--model",
                str(model),
                "--port",
                str(self.port),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
        )
        line = self.proc.stdout.readline()
        assert " ready on " in line, (line, log.read_text()[-2000:])

    def stop(self) -> None:
        sigterm_and_wait(self.proc, 30)
        self.proc.stdout.close()
        self._log.close()


# ---- /v1/completions and /v1/chat/completions: (path, body, the param its 400 names) --------
BAD_REQUESTS = {
    "empty_prompt": ("/v1/completions", {"prompt": "", "max_tokens": 4}, "prompt"),
    "empty_messages": ("/v1/chat/completions", {"messages": [], "max_tokens": 4}, "messages"),
    "beyond_context": (
        "/v1/completions",
        {"prompt": "Hello world", "max_tokens": 2048},
        "max_tokens",
    ),
    # a list mixing strings and token-id lists: named as such (was "prompt[0]: not an int")
    "mixed_prompt_kinds": ("/v1/completions", {"prompt": ["Hi", [5, 6]]}, "prompt"),
    # the second of a batch of prompts is longer than the context: named by its index
    "batched_prompt_beyond_context": (
        "/v1/completions",
        {"prompt": [[5, 6], [5] * 2049], "max_tokens": 1},
        "prompt[1]",
    ),
    "max_tokens_zero": ("/v1/completions", {"prompt": "Hello", "max_tokens": 0}, "max_tokens"),
    "max_tokens_negative": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": -3},
        "max_tokens",
    ),
    "max_tokens_string": (
        "/v1/completions",
        {"prompt": "Hello", "max_tokens": "ten"},
        "max_tokens",
    ),
    "messages_not_list": (
        "/v1/chat/completions",
        {"messages": "hello", "max_tokens": 4},
        "messages",
    ),
    # unknown model: 404 model_not_found as OpenAI answers (tests/e2e/test_api_parity.py)
    "malformed_json": ("/v1/completions", '{"prompt": "Hello", "max_tokens": 4', None),
    # deeper than Python's recursion limit: json.loads raised RecursionError (was a plain 500)
    "deeply_nested_json": (
        "/v1/completions",
        '{"prompt": "Hello", "max_tokens": 4, "stop": ' + "[" * 100_000 + "]" * 100_000 + "}",
        None,
    ),
    "missing_prompt": ("/v1/completions", {"max_tokens": 4}, "prompt"),
    "temperature_type": (
        "/v1/completions",
        {"prompt": "Hello", "temperature": "hot"},
        "temperature",
    ),
    # seeds outside the signed 64-bit range are refused, as vLLM (was 500 past torch's range)
    "seed_too_big": (
        "/v1/completions",
        {"prompt": "Hello", "temperature": 1, "seed": 99999999999999999999999},
        "seed",
    ),
    "seed_2_pow_64": (
        "/v1/completions",
        {"prompt": "Hello", "temperature": 1, "seed": 2**64},
        "seed",
    ),
    "seed_2_pow_63": (
        "/v1/completions",
        {"prompt": "Hello", "temperature": 1, "seed": 2**63},
        "seed",
    ),
    "seed_too_negative": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "temperature": 1, "seed": -(2**63) - 1},
        "seed",
    ),
    # Python's json (and json.dumps below) speaks NaN / Infinity; they must be 400, not 500
    "temperature_nan": (
        "/v1/completions",
        {"prompt": "Hello", "temperature": float("nan")},
        "temperature",
    ),
    "temperature_inf": (
        "/v1/completions",
        {"prompt": "Hello", "temperature": float("inf")},
        "temperature",
    ),
    "top_p_nan": (
        "/v1/completions",
        {"prompt": "Hello", "temperature": 1, "top_p": float("nan")},
        "top_p",
    ),
    "top_p_neg_inf": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_p": float("-inf")},
        "top_p",
    ),
    # a lone UTF-16 surrogate escape is valid JSON but not text: tokenizers and JSON answers
    # fail on it (was a plain-text 500 that closed the keep-alive connection)
    "lone_surrogate_prompt": ("/v1/completions", {"prompt": "Hi \ud800"}, "prompt"),
    "lone_surrogate_model": ("/v1/completions", {"model": "m\udfff", "prompt": "Hi"}, "model"),
    "lone_surrogate_stop": (
        "/v1/completions",
        {"prompt": "Hi", "stop": ["a", "\udc00"]},
        "stop[1]",
    ),
    "lone_surrogate_chat_content": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
        "messages[0].content[0].text",
    ),
    "lone_surrogate_field_name": ("/v1/completions", {"prompt": "Hi", "\ud800": 1}, None),
    "lone_surrogate_tokenize": ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    # Python's json refuses ints of more than 4300 digits with a ValueError (was a plain 500)
    "int_of_5000_digits": ("/v1/completions", '{"prompt": "Hi", "seed": ' + "1" * 5000 + "}", None),
    # system/user messages need content (OpenAI allows null only for assistant tool calls)
    "user_content_missing": (
        "/v1/chat/completions",
        {"messages": [{"role": "user"}], "max_tokens": 4},
        "messages[0].content",
    ),
    "user_content_null": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": None}], "max_tokens": 4},
        "messages[0].content",
    ),
    "system_content_null": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "system", "content": None}, {"role": "user", "content": "x"}],
            "max_tokens": 4,
        },
        "messages[0].content",
    ),
    "second_user_content_missing": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "system", "content": "Be terse."}, {"role": "user"}],
            "max_tokens": 4,
        },
        "messages[1].content",
    ),
}
# expected error code per case (others: any code)
BAD_REQUEST_CODES = {
    "beyond_context": "context_length_exceeded",
    "deeply_nested_json": "invalid_json",
    "int_of_5000_digits": "invalid_json",
    "batched_prompt_beyond_context": "context_length_exceeded",
    **{
        c: "invalid_value"
        for c in BAD_REQUESTS
        if c.startswith(("seed_", "temperature_nan", "temperature_inf", "top_p_"))
    },
}


# ---- chat fields: (extra body, the param named, status) ----------------------------------------
BAD_CHAT_FIELDS = {
    # tools default to tool_choice "auto", which needs a tool-call parser (vLLM refuses it too)
    "tools_with_auto_tool_choice": (
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        "tool_choice",
        400,
    ),
    "response_format_json_schema_without_schema": (
        {"response_format": {"type": "json_schema"}},
        "response_format.json_schema",
        400,
    ),
    "suffix": ({"suffix": "end"}, "suffix", 400),
    "best_of": ({"best_of": 3}, "best_of", 400),
    "unknown_field": ({"frobnicate": 1}, "frobnicate", 400),
    "stream_options_no_stream": (
        {"stream_options": {"include_usage": True}},
        "stream_options",
        400,
    ),
    "max_tokens_0_with_max_completion_tokens": (
        {"max_tokens": 0, "max_completion_tokens": 4},
        "max_tokens",
        400,
    ),
    "max_tokens_and_max_completion_tokens_disagree": (
        {"max_tokens": 3, "max_completion_tokens": 4},
        "max_tokens",
        400,
    ),
    "top_logprobs_without_logprobs": ({"top_logprobs": 2}, "top_logprobs", 400),
    "logit_bias_out_of_vocab": ({"logit_bias": {"100000": 1}}, "logit_bias", 400),
    "logit_bias_too_big": ({"logit_bias": {"5": 101}}, "logit_bias.5", 400),
    # int() would read these as token 5 (or 50): several keys could bias one token past 100
    **{
        f"logit_bias_key_{name}": ({"logit_bias": {key: 1}}, "logit_bias", 400)
        for name, key in (("plus", "+5"), ("space", " 5"), ("zero", "05"), ("underscore", "5_0"))
    },
    "logit_bias_key_arabic_digit": ({"logit_bias": {"\u0665": 1}}, "logit_bias", 400),
    # more characters than any chat of 2048 tokens can have: refused before tokenizing
    "messages_longer_than_any_context": (
        {"messages": [{"role": "user", "content": "Hi " * 100_000}]},
        "messages",
        400,
    ),
    "stop_token_ids_out_of_vocab": ({"stop_token_ids": [100000]}, "stop_token_ids", 400),
    "min_tokens_above_max": ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", 400),
    "top_k_below_minus_one": ({"top_k": -2}, "top_k", 400),
    "stop_empty_string": ({"stop": ""}, "stop", 400),  # vLLM: stop cannot contain ""
    "stop_list_with_empty_string": ({"stop": ["x", ""]}, "stop", 400),
    "min_p_above_one": ({"min_p": 1.5}, "min_p", 400),
    "repetition_penalty_zero": ({"repetition_penalty": 0}, "repetition_penalty", 400),
    "presence_penalty_range": ({"presence_penalty": 3}, "presence_penalty", 400),
    "unknown_model": ({"model": "gpt-17"}, "model", 404),
}


# A known-but-unsupported field sent with its no-op value (what some OpenAI clients and SDKs
# send by default) is accepted and changes nothing; any other value is a 400 naming the field.
NO_OP_FIELDS = {
    "/v1/chat/completions": [
        ("tools", []),
        ("tool_choice", "none"),
        ("response_format", {"type": "text"}),
        ("store", False),
        ("metadata", {}),
        ("service_tier", "auto"),
        ("modalities", ["text"]),
        ("use_beam_search", False),
        ("length_penalty", 1.0),
        ("spaces_between_special_tokens", True),
    ],
    "/v1/completions": [("suffix", ""), ("use_beam_search", False), ("bad_words", [])],
}
