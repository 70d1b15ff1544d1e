"""Expert server: grouped compute, dynamic batching across clients, errors, metrics, CLI."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch

from eaas.runtime.experts import weighted_expert_sum
from eaas.runtime.server.compute import grouped_expert_sum
from eaas.runtime.server.main import random_experts
from eaas.runtime.server.server import ExpertServer
from eaas.runtime.transport.base import (
    STATUS_NOT_HOSTED,
    STATUS_OK,
    RequestFrame,
    ResponseFrame,
    ServerListener,
)
from eaas.runtime.transport.factory import connect

from helpers.server import (
    HIDDEN,
    INTER,
    SEED,
    cpu_seconds,
    free_port,
    reference,
    start_server,
    wait_until,
)

pytestmark = pytest.mark.timeout(90)


def _req(n, k, layer=1, n_exp=4, seed=0, client_id=1, seq=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, HIDDEN, generator=g).to(dtype)
    ex = torch.randint(0, n_exp, (n, k), generator=g, dtype=torch.int32)
    w = torch.rand(n, k, generator=g)
    return RequestFrame(client_id, layer, 1, seq, h, ex, w)


def test_grouped_expert_sum_matches_reference():
    hosted = {
        e: w
        for (_, e), w in random_experts([(1, e) for e in range(5)], HIDDEN, INTER, seed=3).items()
    }
    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, HIDDEN, generator=g)
    ex = torch.randint(-1, 5, (40, 3), generator=g)
    w = torch.rand(40, 3, generator=g)
    out, loads = grouped_expert_sum(h, ex, w, hosted)
    torch.testing.assert_close(out, weighted_expert_sum(h, ex, w, hosted), rtol=1e-6, atol=1e-6)
    assert loads == {e: int((ex == e).sum()) for e in range(5) if (ex == e).any()}
    empty, none = grouped_expert_sum(h[:0], ex[:0], w[:0], hosted)
    assert empty.shape == (0, HIDDEN) and none == {}


class _FakeListener(ServerListener):
    """Records answers; ``respond_ok`` is the base class's (a ResponseFrame via ``respond``)."""

    endpoint = "fake"

    def __init__(self):
        self.responses = []

    def poll(self, timeout):
        return []

    def respond(self, conn, frame: ResponseFrame):
        self.responses.append((conn, frame))

    def close(self):
        pass


def test_process_batches_mixed_layers_k_and_errors(tmp_path):
    spec = {(1, e) for e in range(4)} | {(2, 0), (2, 1)}
    hosted = random_experts(sorted(spec), HIDDEN, INTER, seed=SEED)
    srv = ExpertServer(f"unix:{tmp_path}/p.sock", hosted, HIDDEN, torch.float32, "p")
    srv.listener.close()
    srv.listener = fake = _FakeListener()
    frames = [
        ("a", _req(3, 2, layer=1, seed=1, client_id=1)),
        ("b", _req(5, 4, layer=1, seed=2, client_id=2)),  # different k in the same layer batch
        ("c", _req(2, 1, layer=2, n_exp=2, seed=3)),
        ("d", _req(2, 1, layer=1, n_exp=9, seed=4)),  # names experts 4..8: not hosted
        ("e", _req(1, 1, layer=7, seed=5)),  # layer not hosted at all
        ("f", _req(2, 2, layer=1, seed=6)),  # an id below the padding id -1
        ("g", _req(1, 1, layer=2, seed=7)),  # past the layer's largest hosted id
    ]
    frames[3][1].experts[1, 0] = 7
    frames[5][1].experts[1, 1] = -2
    frames[6][1].experts[0, 0] = 2**31 - 1  # id + 1 overflows int32
    srv.process(frames)
    got = {conn: fr for conn, fr in fake.responses}
    assert set(got) == {"a", "b", "c", "d", "e", "f", "g"}
    for conn in "abc":
        f = dict(frames)[conn]
        assert got[conn].status == STATUS_OK
        torch.testing.assert_close(
            got[conn].output,
            reference(f.layer, f.hidden, f.experts, f.weights),
            rtol=1e-5,
            atol=1e-6,
        )
    assert got["d"].status == STATUS_NOT_HOSTED and "layer 1" in got["d"].message
    assert got["e"].status == STATUS_NOT_HOSTED and "layer 7" in got["e"].message
    assert got["f"].status == STATUS_NOT_HOSTED and "[-2]" in got["f"].message
    assert got["g"].status == STATUS_NOT_HOSTED and str(2**31 - 1) in got["g"].message
    # the loads of the answered frames reach the counter on the next flush
    before = _expert_tokens_total()
    srv.flush_load_metrics()
    ok_pairs = sum(
        int((dict(frames)[c].experts >= 0).sum()) for c in "abc"
    )  # every real pair of a, b, c
    assert _expert_tokens_total() - before == ok_pairs
    assert srv.stats["max_clients_per_batch"] == 2 and srv.stats["batches"] == 2


def _expert_tokens_total() -> float:
    from prometheus_client import REGISTRY

    return sum(
        s.value
        for fam in REGISTRY.collect()
        if fam.name == "eaas_expert_tokens"
        for s in fam.samples
        if s.name == "eaas_expert_tokens_total"
    )


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_two_clients_are_batched_together(kind, tmp_path):
    from prometheus_client import REGISTRY

    # The forked server starts from this process's counter values: compare deltas.
    frames0 = REGISTRY.get_sample_value("eaas_expert_server_frames_total") or 0.0
    tokens0 = sum(
        REGISTRY.get_sample_value(
            "eaas_expert_tokens_total", {"layer": "1", "expert": str(e), "server": "s-test"}
        )
        or 0.0
        for e in range(4)
    )
    b4 = REGISTRY.get_sample_value("eaas_expert_server_batch_tokens_bucket", {"le": "4.0"}) or 0.0
    b2 = REGISTRY.get_sample_value("eaas_expert_server_batch_tokens_bucket", {"le": "2.0"}) or 0.0
    port = free_port()
    ep = f"unix:{tmp_path}/b.sock" if kind == "unix" else "tcp://127.0.0.1:0"
    srv = start_server(ep, metrics_port=port, window_us=3000)
    errors = []
    barrier = threading.Barrier(2)

    def client(cid, n):
        try:
            c = connect(
                srv.endpoint, "s-test", hidden_size=HIDDEN, dtype=torch.float32, client_id=cid
            )
            for i in range(15):
                f = _req(n, 2, seed=100 * cid + i, client_id=cid, seq=i)
                barrier.wait(5)
                c.send(f)
                r = c.recv(time.monotonic() + 5)
                assert r.status == STATUS_OK and r.seq == i
                torch.testing.assert_close(
                    r.output, reference(1, f.hidden, f.experts, f.weights), rtol=1e-5, atol=1e-6
                )
            c.close()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
            barrier.abort()

    ts = [
        threading.Thread(target=client, args=(1, 1)),
        threading.Thread(target=client, args=(2, 2)),
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)

    def per_expert(text: str) -> float:
        return sum(
            float(v)
            for v in re.findall(
                r'^eaas_expert_tokens_total\{expert="\d+",layer="1",server="s-test"\} (\S+)$',
                text,
                re.M,
            )
        )

    # the loads reach the counter within a poll timeout of the server going idle
    want = tokens0 + 15 * (1 + 2) * 2  # tokens x k, counted per expert
    assert wait_until(lambda: per_expert(_scrape(port)) >= want, 30)
    text = _scrape(port)
    stats = srv.stop()
    assert not errors, errors
    assert stats["max_clients_per_batch"] == 2, stats
    # client 1 sends 1 token, client 2 sends 2: a 3-token batch holds frames of both.
    bucket = "eaas_expert_server_batch_tokens_bucket"
    both = _metric(text, bucket, '{le="4.0"}') - _metric(text, bucket, '{le="2.0"}') - (b4 - b2)
    assert both >= 1, text
    assert _metric(text, "eaas_expert_server_frames_total") - frames0 == 30
    assert per_expert(text) == want, text


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_not_hosted_error_and_server_keeps_serving(kind, tmp_path):
    srv = start_server(f"unix:{tmp_path}/n.sock" if kind == "unix" else "tcp://127.0.0.1:0")
    try:
        c = connect(srv.endpoint, "s-test", hidden_size=HIDDEN, dtype=torch.float32)
        bad = _req(3, 2, seed=4, seq=1)
        bad.experts[2, 1] = 7
        c.send(bad)
        r = c.recv(time.monotonic() + 5)
        assert r.status == STATUS_NOT_HOSTED and r.output is None and "does not host" in r.message
        c.send(_req(3, 2, seed=5, seq=2))
        r = c.recv(time.monotonic() + 5)
        assert r.status == STATUS_OK and r.seq == 2
        c.close()
    finally:
        stats = srv.stop()
    assert stats["errors"] == 1


def test_idle_server_uses_no_cpu(tmp_path):
    srv = start_server(f"unix:{tmp_path}/i.sock")
    try:
        c = connect(srv.endpoint, "s-test", hidden_size=HIDDEN, dtype=torch.float32)
        c.send(_req(2, 1))
        assert c.recv(time.monotonic() + 5).status == STATUS_OK
        time.sleep(0.2)
        t0 = cpu_seconds(srv.pid)
        time.sleep(1.0)
        used = cpu_seconds(srv.pid) - t0
        assert used < 0.05, f"idle server burned {used:.3f} CPU s in 1 s"
        c.close()
    finally:
        srv.stop()


def test_sigterm_is_graceful(tmp_path):
    srv = start_server(f"unix:{tmp_path}/t.sock")
    path = f"{tmp_path}/t.sock"
    assert os.path.exists(path)
    stats = srv.stop()
    assert stats is not None and srv.proc.exitcode == 0
    assert not os.path.exists(path)


def test_cli_expert_server_with_tiny_model(tmp_path, model_dir):
    """``eaas expert-server`` on the built-in tiny model: ready line, exact results, metrics, SIGTERM."""
    from eaas.runtime.models import arch, weights

    model = model_dir
    info = arch.read_model_info(model)
    layer = info.moe_layers[0]
    sock = f"{tmp_path}/cli.sock"
    port = free_port()
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eaas",
            "expert-server",
            "--model",
            str(model),
            "--server-id",
            "cli-0",
            "--experts",
            f"{layer}:0-3",
            "--listen",
            f"unix:{sock}",
            "--metrics-port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"},
    )
    try:
        line = p.stdout.readline().strip()
        assert line == f"expert-server cli-0 ready on unix:{sock} hosting 4 experts"
        H = info.hidden_size
        c = connect(f"unix:{sock}", "cli-0", hidden_size=H, dtype=torch.float32)
        g = torch.Generator().manual_seed(0)
        h = torch.randn(6, H, generator=g)
        ex = torch.randint(0, 4, (6, 2), generator=g, dtype=torch.int32)
        w = torch.rand(6, 2, generator=g)
        c.send(RequestFrame(9, layer, 1, 0, h, ex, w))
        r = c.recv(time.monotonic() + 10)
        assert r.status == STATUS_OK, r.message
        ref_w = weights.load_expert_weights(
            model, [(layer, e) for e in range(4)], torch.float32, progress=False
        )
        ref = weighted_expert_sum(h, ex, w, {e: ref_w[(layer, e)] for e in range(4)})
        torch.testing.assert_close(r.output, ref, rtol=1e-5, atol=1e-6)
        c.close()
        assert wait_until(lambda: "eaas_expert_tokens_total" in _scrape(port), 5)
        assert _metric(_scrape(port), "eaas_expert_server_frames_total") == 1
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
        assert not os.path.exists(sock)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


class _QueueListener(_FakeListener):
    """Hands out frames put in ``ready`` (all at the next poll)."""

    def __init__(self):
        super().__init__()
        self.ready: list = []

    def poll(self, timeout):
        out, self.ready = self.ready, []
        return out


@pytest.mark.elastic
def test_a_stopped_server_answers_what_was_sent_and_records_its_traffic(tmp_path):
    hosted = random_experts([(1, e) for e in range(4)], HIDDEN, INTER, seed=SEED)
    srv = ExpertServer(f"unix:{tmp_path}/d.sock", hosted, HIDDEN, torch.float32, "d")
    srv.listener.close()
    srv.listener = fake = _QueueListener()
    assert srv.traffic.describe() == {
        "frames": 0,
        "last_frame_unix": None,
        "idle_s": None,
        "stop_unix": None,
    }
    before = time.time()
    srv.process([("a", _req(2, 1, seed=1))])
    assert srv.traffic.frames == 1 and srv.traffic.last_frame_unix >= before
    srv.stop()  # SIGTERM's handler: frames already sent still get their answers
    fake.ready = [("b", _req(3, 2, seed=2, seq=1)), ("c", _req(1, 1, seed=3, seq=2))]
    srv.serve_forever()
    assert sorted(c for c, _ in fake.responses) == ["a", "b", "c"]
    assert all(r.status == STATUS_OK for _, r in fake.responses)
    t = srv.traffic
    assert t.frames == 3 and t.frames_after_stop == 2 and t.stop_unix is not None
    assert t.last_frame_unix >= t.stop_unix
    line = t.exit_line("d")
    m = re.fullmatch(
        r"expert-server d stopped: frames=3 last_frame_unix=([\d.]+) \(\S+\) "
        r"stop_unix=([\d.]+) frames_after_stop=2",
        line,
    )
    assert m and abs(float(m.group(1)) - t.last_frame_unix) < 1e-3, line
