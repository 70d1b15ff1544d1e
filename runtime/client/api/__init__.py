"""OpenAI-compatible HTTP API of the attention client: app, protocol, prepare, chat_template,
logprobs, responses, streaming, server (see :mod:`.app`)."""

# SHIM(issue17): moved to eaas.runtime.client.api.app; remove at merge
from eaas.runtime.client.api.app import (  # noqa: F401
    check_no_lone_surrogates,
    create_app,
    error_response,
    parse_json_body,
)
from eaas.runtime.client.api.protocol import APIError  # noqa: F401
from eaas.runtime.client.api.server import OpenAIServer  # noqa: F401
from eaas.runtime.client.api.streaming import DISCONNECT_POLL_S  # noqa: F401
