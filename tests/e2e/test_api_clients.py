"""API behaviour of lone ``eaas attention-client`` processes: tokenizer loading of Qwen3-MoE
checkpoints (tokenizer.json wins; ids beyond the vocabulary are a 400), and many clients that
give up at once (the running and waiting gauges return to 0)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest
import torch

from helpers.api import LocalClient as _Client
from helpers.e2e import metric_sum, metric_values

pytestmark = [pytest.mark.engine, pytest.mark.api]


# ---- Qwen3-MoE checkpoints: tokenizer.json wins; ids beyond the vocabulary are a 400 -------------
def _qwen3(d: Path, tiny_dir: str, extra_token: bool) -> Path:
    from tokenizers import Tokenizer
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(1)
    cfg = Qwen3MoeConfig(
        vocab_size=922,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    Qwen3MoeForCausalLM(cfg).save_pretrained(d)
    tok = Tokenizer.from_file(str(Path(tiny_dir) / "tokenizer.json"))
    if extra_token:
        tok.add_special_tokens(["<|endoftext|>"])  # id 922 == vocab_size: no embedding row
        assert tok.token_to_id("<|endoftext|>") == 922
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def qwen3_clients(tmp_path_factory, model_dir):
    base = tmp_path_factory.mktemp("qwen3")
    only_file = _qwen3(base / "only-tokenizer-json", model_dir, extra_token=False)
    extra = _qwen3(base / "endoftext-922", model_dir, extra_token=True)
    assert sorted(p.name for p in only_file.iterdir() if p.name.startswith("tokenizer")) == [
        "tokenizer.json"
    ]
    clients = {
        "only_file": _Client(only_file, base / "a.log"),
        "extra": _Client(extra, base / "b.log"),
    }
    yield clients, only_file
    for c in clients.values():
        c.stop()


def test_tokenizer_json_wins_over_qwen_class(qwen3_clients):
    from tokenizers import Tokenizer

    clients, d = qwen3_clients
    c = clients["only_file"]
    want = Tokenizer.from_file(str(d / "tokenizer.json")).encode("1 2 3 4 5").ids
    assert len(want) == 6
    r = httpx.post(f"{c.base}/tokenize", json={"prompt": "1 2 3 4 5"}, timeout=60).json()
    assert r["tokens"] == want
    g = httpx.post(
        f"{c.base}/v1/completions", json={"prompt": "1 2 3 4 5", "max_tokens": 2}, timeout=120
    )
    assert g.status_code == 200 and g.json()["usage"]["prompt_tokens"] == 6


def test_chat_template_kwargs_without_a_template_is_400(qwen3_clients):
    """A checkpoint with only tokenizer.json has no chat template (the plain fallback renders
    chats): template variables cannot act there."""
    c = qwen3_clients[0]["only_file"]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(
        f"{c.base}/v1/chat/completions",
        json={**body, "chat_template_kwargs": {"enable_thinking": False}},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs.enable_thinking"
    assert httpx.post(f"{c.base}/v1/chat/completions", json=body, timeout=120).status_code == 200


def test_tokenizer_id_beyond_vocab_is_400(qwen3_clients):
    c = qwen3_clients[0]["extra"]
    for path, body, param in (
        ("/v1/completions", {"prompt": "Hello <|endoftext|>", "max_tokens": 2}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi <|endoftext|>"}], "max_tokens": 2},
            "messages",
        ),
    ):
        r = httpx.post(f"{c.base}{path}", json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "922" in err["message"]
        ok = httpx.post(
            f"{c.base}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=120
        )
        assert ok.status_code == 200, ok.text


# ---- many clients give up at once: the running and waiting gauges return to 0 -----------------
def _gauges(base: str) -> tuple[float, float]:
    v = metric_values(base)
    return metric_sum(v, "eaas_running_sequences"), metric_sum(v, "eaas_waiting_sequences")


def _wait_gauges(base: str, want: tuple[float, float], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := _gauges(base)) != want:
        assert time.monotonic() < deadline, (got, want)
        time.sleep(0.05)


def _open_stream(port: int, body: dict) -> socket.socket:
    """A raw HTTP/1.1 streaming request whose connection the test closes when it likes (an
    httpx stream blocks until the response head, which comes with the first token)."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def _long_stream(max_tokens: int) -> dict:
    """A greedy streamed completion that keeps decoding for ``max_tokens`` tokens."""
    return {
        "prompt": "Tell a long story",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }


def test_mass_disconnect_returns_running_and_waiting_to_zero(tmp_path, model_dir):
    """With ``--max-num-seqs 2``, 5 long streams: 2 decode and 3 wait (``eaas_running_sequences``
    and ``eaas_waiting_sequences``, as vLLM's ``num_requests_running`` / ``_waiting``); all five
    clients disconnect at once (the waiting ones before their first token), both gauges return
    to 0 and the next request succeeds."""
    c = _Client(model_dir, tmp_path / "client.log", ("--max-num-seqs", "2"))
    try:
        body = _long_stream(1500)
        socks = [_open_stream(c.port, body) for _ in range(5)]
        try:
            _wait_gauges(c.base, (2.0, 3.0))
        finally:
            for sock in socks:
                sock.close()
        _wait_gauges(c.base, (0.0, 0.0))
        r = httpx.post(
            f"{c.base}/v1/completions",
            json={"prompt": "Hello", "max_tokens": 3, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        c.stop()


def test_queued_stream_that_disconnects_leaves_the_queue(tmp_path, model_dir):
    """A stream still waiting for its first token (``--max-num-seqs 1``, another stream
    decoding) whose client disconnects leaves the waiting queue at once; it is not kept
    until a slot frees and then prefilled for nobody (vLLM aborts it likewise)."""
    c = _Client(model_dir, tmp_path / "client.log", ("--max-num-seqs", "1"))
    try:
        body = _long_stream(1900)
        running = _open_stream(c.port, body)
        try:
            _wait_gauges(c.base, (1.0, 0.0))
            queued = _open_stream(c.port, body)
            _wait_gauges(c.base, (1.0, 1.0))
            queued.close()
            # the running stream is still decoding (1900 tokens) when the queued one is gone
            _wait_gauges(c.base, (1.0, 0.0))
        finally:
            running.close()
        _wait_gauges(c.base, (0.0, 0.0))
    finally:
        c.stop()
