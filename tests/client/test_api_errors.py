"""The API's error answers that need no model: an unexpected exception is a JSON 500 in OpenAI's
shape, and strings holding a lone UTF-16 surrogate are found by path (pure function).

The end-to-end cases (real ``eaas serve``, each bad request followed by one that succeeds) are in
``tests/e2e/test_api.py``; this file covers what a real server cannot be made to do on purpose (a
handler that raises)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from eaas.runtime.client.api import APIError, check_no_lone_surrogates, create_app

pytestmark = pytest.mark.engine


def _raise(_body):
    raise RuntimeError("a bug")


def test_unexpected_exception_is_a_json_500_and_the_app_keeps_answering():
    """Before, anything not an ``APIError`` became uvicorn's plain-text "Internal Server Error",
    which OpenAI clients cannot parse."""
    server = SimpleNamespace(
        max_request_body=1 << 20, client_id="unit", prepare_completion=_raise, model_name="m"
    )
    with TestClient(create_app(server), raise_server_exceptions=False) as http:
        for _ in range(2):
            r = http.post("/v1/completions", json={"prompt": "Hi"})
            assert r.status_code == 500
            assert r.json() == {
                "error": {
                    "message": "internal error (RuntimeError); the server keeps serving",
                    "type": "internal_error",
                    "param": None,
                    "code": "internal_error",
                }
            }


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "a\ud800b"}, "prompt"),
        ({"prompt": ["ok", "\udfff"]}, "prompt[1]"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]},
            "messages[0].content[0].text",
        ),
        ({"logit_bias": {"\udc00": 1}}, "logit_bias"),  # a field name: its object is named
        ({"\ud800": 1}, None),
    ],
)
def test_lone_surrogates_are_named_by_path(body, param):
    with pytest.raises(APIError) as ei:
        check_no_lone_surrogates(body)
    assert ei.value.status == 400 and ei.value.param == param
    assert "surrogate" in ei.value.message


def test_surrogate_pairs_and_plain_text_pass():
    check_no_lone_surrogates(
        {"prompt": "emoji \U0001f600 ok", "stop": ["\u00e9"], "n": 2, "x": None, "t": [1.5, True]}
    )
