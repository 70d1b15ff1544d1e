"""One options object per process, validated once at construction: the CLI builds it from its
flags, ``eaas serve`` and the operator's pod builders turn it into the child's command line
(``argv()``). Torch-free: the operator imports this package.

- :class:`~.client.AttentionClientOptions`: ``eaas attention-client``.
- :class:`~.server.ExpertServerOptions`: ``eaas expert-server``.
- :class:`~.serve.ServeOptions`: ``eaas serve`` (a whole deployment on one machine).
"""

from eaas.runtime.options.api_key import API_KEY_ENV, api_keys_from
from eaas.runtime.options.argv import PROGRAM, format_value, to_argv
from eaas.runtime.options.client import (
    AttentionClientOptions,
    check_dispatch_timeout,
    client_id_of,
)
from eaas.runtime.options.serve import ServeOptions, parse_client_spin
from eaas.runtime.options.server import ExpertServerOptions

__all__ = [
    "API_KEY_ENV",
    "PROGRAM",
    "AttentionClientOptions",
    "ExpertServerOptions",
    "ServeOptions",
    "api_keys_from",
    "check_dispatch_timeout",
    "client_id_of",
    "format_value",
    "parse_client_spin",
    "to_argv",
]
