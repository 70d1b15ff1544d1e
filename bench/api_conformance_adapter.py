"""pytest plugin that points vLLM's OpenAI entrypoint tests at a running ``eaas serve``.

Loaded by ``bench/api_conformance.py`` (``-p api_conformance_adapter``) into a pytest run of the
tests of a vLLM source tree (read from there at run time, never copied here), with vLLM's own
conftests off. It replaces ``tests.utils.RemoteOpenAIServer`` (which starts ``vllm serve``) by
:class:`EaasServer`, a handle on the one ``eaas serve`` the bench started (its URL in
``$EAAS_CONFORMANCE_URL``), and vLLM's ``get_tokenizer`` by the served checkpoint's tokenizer
(``$EAAS_CONFORMANCE_MODEL``; the tests compute expected token ids with it). The server's
``--served-model-name`` lists every test module's ``MODEL_NAME`` as an alias, so requests name
a model the server serves.

Each test that needs a server (a ``server``, ``client`` or ``server_fixture`` fixture) is
recorded in ``$EAAS_CONFORMANCE_SERVER_TESTS`` (one node id a line): the bench counts only
those, the others test vLLM's own Python classes in-process. LoRA adapters that a module's
``server`` fixture downloads only become ``vllm serve`` arguments, which do not apply here:
their download answers a placeholder directory (tests that request the adapter's model name
are not counted by the bench).
"""

from __future__ import annotations

import os
from typing import Any

import openai
import pytest

SERVER_FIXTURES = frozenset({"server", "client", "server_fixture"})
_server_tests: list[str] = []


class EaasServer:
    """What vLLM's tests use of ``RemoteOpenAIServer``, for the running ``eaas serve``."""

    DUMMY_API_KEY = os.environ.get("EAAS_CONFORMANCE_KEY", "token-abc123")

    def __init__(self, model: str = "", vllm_serve_args: Any = None, *args: Any, **kwargs: Any):
        self.model = model
        self.args = list(vllm_serve_args or [])
        url = os.environ["EAAS_CONFORMANCE_URL"].rstrip("/")
        self._url = url
        hostport = url.split("://", 1)[1]
        self.host, port = hostport.rsplit(":", 1)
        self.port = int(port)
        self.uds = None

    def __enter__(self) -> EaasServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    @property
    def url_root(self) -> str:
        return self._url

    def url_for(self, *parts: str) -> str:
        path = "/".join(part.strip("/") for part in parts if part)
        return f"{self.url_root}/{path}"

    def get_client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(
            base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs
        )

    def get_async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(
            base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs
        )


_tokenizers: dict[str, Any] = {}


def served_tokenizer(*args: Any, **kwargs: Any) -> Any:
    """vLLM's ``get_tokenizer(name, ...)``: the served checkpoint's tokenizer, whatever name."""
    from transformers import AutoTokenizer

    path = os.environ["EAAS_CONFORMANCE_MODEL"]
    if path not in _tokenizers:
        _tokenizers[path] = AutoTokenizer.from_pretrained(path)
    return _tokenizers[path]


def pytest_configure(config: pytest.Config) -> None:
    import tests.utils as vllm_test_utils

    vllm_test_utils.RemoteOpenAIServer = EaasServer  # type: ignore[misc]
    for mod in ("vllm.tokenizers", "vllm.transformers_utils.tokenizer"):
        try:
            m = __import__(mod, fromlist=["get_tokenizer"])
        except ImportError:
            continue
        if hasattr(m, "get_tokenizer"):
            m.get_tokenizer = served_tokenizer

    try:
        from vllm.transformers_utils import repo_utils
    except ImportError:
        return
    placeholder = os.environ.get("EAAS_CONFORMANCE_PLACEHOLDER", "/nonexistent-lora")

    class _NoDownload:
        def snapshot_download(self, *args: Any, **kwargs: Any) -> str:
            return placeholder

    repo_utils.hf_api = lambda *a, **k: _NoDownload()  # type: ignore[assignment]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            _server_tests.append(item.nodeid)
    out = os.environ.get("EAAS_CONFORMANCE_SERVER_TESTS")
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write("".join(f"{n}\n" for n in _server_tests))
