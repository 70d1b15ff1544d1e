"""Expert load counts only real tokens: padding ids (a CUDA-graph bucket's rows beyond the batch,
merged frames of different k), refused frames and health / metrics probes add nothing to
``eaas_expert_tokens_total``, which carries the server's id as a label."""

from __future__ import annotations

import os
import threading
import time
import urllib.request

import pytest
import torch
from prometheus_client import REGISTRY

from eaas.runtime.server.http import ServerHealth, ServerHTTP
from eaas.runtime.server.main import random_experts
from eaas.runtime.server.server import ExpertServer
from eaas.runtime.transport.base import (
    STATUS_NOT_HOSTED,
    STATUS_OK,
    RequestFrame,
    ResponseFrame,
    ServerListener,
)

from helpers.server import HIDDEN, INTER, SEED

pytestmark = [pytest.mark.elastic, pytest.mark.timeout(90)]


class _Answers(ServerListener):
    endpoint = "fake"

    def __init__(self):
        self.responses: list[tuple[object, ResponseFrame]] = []

    def poll(self, timeout):
        time.sleep(min(timeout, 0.05))  # nothing arrives (the serving loop's idle turn)
        return []

    def respond(self, conn, frame: ResponseFrame):
        self.responses.append((conn, frame))

    def close(self):
        pass


def _server(tmp_path, server_id: str) -> tuple[ExpertServer, _Answers]:
    hosted = random_experts([(1, e) for e in range(4)], HIDDEN, INTER, seed=SEED)
    srv = ExpertServer(f"unix:{tmp_path}/s.sock", hosted, HIDDEN, torch.float32, server_id)
    srv.listener.close()
    srv.listener = answers = _Answers()
    return srv, answers


def _counted(server_id: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for fam in REGISTRY.collect():
        if fam.name != "eaas_expert_tokens":
            continue
        for s in fam.samples:
            if s.name == "eaas_expert_tokens_total" and s.labels.get("server") == server_id:
                assert s.labels["layer"] == "1"
                out[int(s.labels["expert"])] = s.value
    return out


def _frame(experts: list[list[int]], seq: int = 0) -> RequestFrame:
    ex = torch.tensor(experts, dtype=torch.int32)
    g = torch.Generator().manual_seed(seq)
    return RequestFrame(
        1, 1, 1, seq, torch.randn(ex.shape[0], HIDDEN, generator=g), ex, torch.rand(ex.shape)
    )


def test_padding_rows_and_refused_frames_count_nothing(tmp_path):
    sid = f"load-{os.getpid()}-a"
    srv, answers = _server(tmp_path, sid)
    # a bucket of 8 rows for 3 real tokens (rows 3..7 all padding, as a graph replay sends),
    # a real token with one padding slot, and a frame of another k merged into the same batch
    bucket = _frame([[0, 1], [1, 2], [3, -1], *([[-1, -1]] * 5)], seq=1)
    other_k = _frame([[2, 3, 0]], seq=2)
    refused = _frame([[0, 9]], seq=3)  # expert 9 is not hosted: refused, nothing computed
    srv.process([("a", bucket), ("b", other_k), ("c", refused)])
    srv.flush_load_metrics()
    status = {conn: fr.status for conn, fr in answers.responses}
    assert status == {"a": STATUS_OK, "b": STATUS_OK, "c": STATUS_NOT_HOSTED}
    assert _counted(sid) == {0: 2.0, 1: 2.0, 2: 2.0, 3: 2.0}  # the 8 real (token, expert) pairs
    # a frame of padding only (an empty bucket) computes and counts nothing
    srv.process([("d", _frame([[-1, -1]] * 4, seq=4))])
    srv.flush_load_metrics()
    assert _counted(sid) == {0: 2.0, 1: 2.0, 2: 2.0, 3: 2.0}


def test_health_and_metrics_probes_count_nothing(tmp_path):
    sid = f"load-{os.getpid()}-b"
    srv, _ = _server(tmp_path, sid)
    health = ServerHealth(sid)
    http = ServerHTTP(health, 0, "127.0.0.1").start()
    health.attach(srv)
    srv.process([("a", _frame([[0, 1]], seq=5))])
    srv.flush_load_metrics()
    before = _counted(sid)
    assert before == {0: 1.0, 1: 1.0}
    loop = threading.Thread(target=srv.serve_forever, daemon=True)  # /health: 200 while it runs
    loop.start()
    try:
        for path in ("/health", "/metrics", "/healthz", "/readyz") * 3:
            with urllib.request.urlopen(f"http://127.0.0.1:{http.port}{path}", timeout=10) as r:
                assert r.status == 200
        srv.flush_load_metrics()
        assert _counted(sid) == before
        text = urllib.request.urlopen(f"http://127.0.0.1:{http.port}/metrics", timeout=10).read()
        assert f'server="{sid}"'.encode() in text  # the per-server label is exported
    finally:
        srv.stop()
        loop.join(10)
        http.close()
