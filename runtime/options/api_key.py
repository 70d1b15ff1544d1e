"""API keys of the OpenAI-compatible API (``--api-key`` / ``$EAAS_API_KEY``), torch-free.

The keys a client accepts come from the repeatable ``--api-key KEY`` flag or, when no flag is
given, from ``$EAAS_API_KEY`` (several keys separated by commas): the flag wins, as vLLM's
``--api-key`` wins over ``VLLM_API_KEY``. No key: the API is open. A key travels to a child
process (``eaas serve`` -> attention client; the operator's pods) in the environment, never on
the command line, where ``ps`` would show it (:func:`api_key_environment`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

#: The environment variable holding the API keys (comma-separated).
API_KEY_ENV = "EAAS_API_KEY"


def check_api_keys(keys: Iterable[str]) -> tuple[str, ...]:
    """``keys`` as a tuple, each checked.

    Raises:
        ValueError: an empty key, or one holding a comma or whitespace (it could not be told
            apart in ``$EAAS_API_KEY`` or an ``Authorization`` header); the message names
            ``--api-key`` and never shows the key.
    """
    out = tuple(keys)
    for i, k in enumerate(out):
        if not isinstance(k, str) or not k:
            raise ValueError(f"--api-key: key {i + 1} is empty")
        if "," in k or any(c.isspace() for c in k):
            raise ValueError(f"--api-key: key {i + 1} holds a comma or whitespace")
    return out


def api_keys_from(flag_values: Iterable[str] | None, env: Mapping[str, str]) -> tuple[str, ...]:
    """The API keys: ``flag_values`` (``--api-key``, repeated) when any is given, else
    ``env[EAAS_API_KEY]`` split at commas (blanks around each ignored; an empty variable: none).

    Raises:
        ValueError: as :func:`check_api_keys`.
    """
    given = tuple(flag_values or ())
    if given:
        return check_api_keys(given)
    raw = env.get(API_KEY_ENV, "")
    if not raw.strip():
        return ()
    return check_api_keys(k.strip() for k in raw.split(","))


def api_key_environment(base: Mapping[str, str], keys: tuple[str, ...]) -> dict[str, str]:
    """``base`` with ``$EAAS_API_KEY`` set to ``keys`` (comma-joined), or removed when there are
    none: a child sees exactly the keys its options carry, not an inherited variable."""
    env = dict(base)
    if keys:
        env[API_KEY_ENV] = ",".join(keys)
    else:
        env.pop(API_KEY_ENV, None)
    return env
