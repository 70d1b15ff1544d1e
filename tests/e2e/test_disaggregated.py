"""The disaggregated forward in-process: ``load_attention_model`` with :class:`RemoteExperts`
against real ``eaas expert-server`` subprocesses, compared with the untouched transformers model.

Tolerance: float32 logits within ``atol=1e-4`` (observed ~1e-5: only the summation order of the
per-server partial sums differs) and identical argmax.

The module degrades one deployment step by step (tests run in file order):
hung server (SIGSTOP) -> deadline + failover; SIGKILL -> failover, exact logits; the stopped server
resumes and is reconnected; a second SIGKILL leaves experts without replica ->
NoLiveReplicaError (fast, no hang).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from eaas.runtime.client.dispatch import Dispatcher, NoLiveReplicaError
from eaas.runtime.client.moe import experts_factory
from eaas.runtime.models.arch import read_model_info
from eaas.runtime.models.attention import load_attention_model
from eaas.runtime.models.reference import reference_logits
from eaas.runtime.placement import place_experts
from eaas.runtime.serve import write_table
from eaas.runtime.tables.expert_spec import format_expert_spec
from eaas.runtime.tables.file_watch import RoutingTableWatcher
from eaas.runtime.tables.table import RoutingTable

from helpers.dispatch import wait_all_connected
from helpers.e2e import free_port

ATOL = 1e-4
TEXT = "Expert servers are stateless: every routed expert is a pure function of one token"


class Servers:
    """N shm expert servers (placement N=3, R=2) + one TCP server hosting every expert."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.info = read_model_info(model_dir)
        self.dir = Path(tempfile.mkdtemp(prefix="eaas-test-"))
        self.metrics_dir = self.dir / "metrics"
        self.metrics_dir.mkdir()
        self.placement = place_experts(self.info.moe_layers, self.info.num_experts, 3, 2)
        self.ids = [f"s{i}" for i in range(3)]
        self.endpoints = [f"unix:{self.dir}/s{i}.sock" for i in range(3)]
        self.tcp_endpoint = f"tcp://127.0.0.1:{free_port()}"
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(self.metrics_dir))
        cmd = [sys.executable, "-m", "eaas", "expert-server", "--model", model_dir]
        self.procs: dict[str, subprocess.Popen] = {}
        for i, sid in enumerate(self.ids):
            spec = format_expert_spec(self.placement.servers[i])
            self.procs[sid] = subprocess.Popen(
                cmd + ["--server-id", sid, "--experts", spec, "--listen", self.endpoints[i]],
                stdout=subprocess.PIPE,
                env=env,
                text=True,
            )
        self.procs["tcp"] = subprocess.Popen(
            cmd + ["--server-id", "tcp", "--listen", self.tcp_endpoint],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for sid, p in self.procs.items():
            line = p.stdout.readline()
            assert " ready on " in line, f"{sid}: {line!r} (exit {p.poll()})"

    def table(self, version: int = 1) -> RoutingTable:
        return RoutingTable.from_placement(
            self.placement, self.ids, self.endpoints, version=version
        )

    def tcp_table(self) -> RoutingTable:
        layers = {
            l: tuple(("tcp",) for _ in range(self.info.num_experts)) for l in self.info.moe_layers
        }
        return RoutingTable(
            version=1,
            num_experts=self.info.num_experts,
            servers={"tcp": self.tcp_endpoint},
            layers=layers,
        )

    def expert_tokens(self) -> float:
        from prometheus_client import CollectorRegistry, multiprocess

        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg, path=str(self.metrics_dir))
        return sum(
            s.value
            for fam in reg.collect()
            if fam.name == "eaas_expert_tokens"
            for s in fam.samples
            if s.name.endswith("_total")
        )

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def servers(model_dir):
    s = Servers(model_dir)
    yield s
    s.close()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer(TEXT)["input_ids"]


@pytest.fixture(scope="module")
def ref_logits(model_dir, prompt_ids):
    return reference_logits(model_dir, prompt_ids)


def remote_model(model_dir, dispatcher):
    model, _, _ = load_attention_model(
        model_dir, torch.float32, experts_factory=experts_factory(dispatcher)
    )
    return model


@torch.no_grad()
def logits(model, ids) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    diff = (out - ref).abs().max().item()
    assert diff <= ATOL, f"max |logit diff| {diff:.3g} > {ATOL}"
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_logits_match_transformers_shm(servers, model_dir, prompt_ids, ref_logits):
    d = Dispatcher(0, servers.info.hidden_size, torch.float32, servers.table())
    model = remote_model(model_dir, d)
    # every first connection open: a call while one is still opening sends its pairs to the
    # other replicas alone (every expert is covered, so the plan does not wait for it)
    wait_all_connected(d.health)
    before = servers.expert_tokens()
    # two forwards: an expert's pairs stay on one replica per call and the replica rotates
    # from call to call (dispatch.choose_replicas), so two calls per layer reach every replica
    for _ in range(2):
        out = logits(model, prompt_ids)
        assert_close(out, ref_logits)
    # every (token, selected expert) pair was computed exactly once, on exactly one replica
    pairs = len(prompt_ids) * servers.info.top_k * len(servers.info.moe_layers)
    # the servers add their loads to the counter within a poll timeout of going idle
    deadline = time.monotonic() + 30
    while servers.expert_tokens() - before < 2 * pairs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert servers.expert_tokens() - before == 2 * pairs
    h = d.health()
    assert h["routing_table_version"] == 1
    assert all(s["tokens_sent"] > 0 for s in h["servers"].values())  # replicas share the load
    d.close()


def test_logits_match_transformers_tcp(servers, model_dir, prompt_ids, ref_logits):
    d = Dispatcher(1, servers.info.hidden_size, torch.float32, servers.tcp_table())
    assert_close(logits(remote_model(model_dir, d), prompt_ids), ref_logits)
    d.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_shared_expert_during_the_round_trip_is_bit_exact(servers, model_dir, transport):
    """The MoE block that sends the routed experts' frames, computes the shared expert while
    the servers work, then waits (``overlapped_moe_forward``, what the paged engine runs)
    gives bit-identical outputs to transformers' ``DeepseekV3MoE.forward`` over the same
    servers. Every expert on one server (first replica) so both calls sum the same partials."""
    from eaas.runtime.client.moe import overlapped_moe_forward

    if transport == "tcp":
        table = servers.tcp_table()
    else:
        full = servers.table()
        table = RoutingTable(
            version=1,
            num_experts=full.num_experts,
            servers=full.servers,
            layers={l: tuple(reps[:1] for reps in ex) for l, ex in full.layers.items()},
        )
    d = Dispatcher(20, servers.info.hidden_size, torch.float32, table, timeout=30.0)
    try:
        model = remote_model(model_dir, d)
        g = torch.Generator().manual_seed(7)
        assert overlapped_moe_forward(model.model.layers[0].mlp) is None  # a dense layer
        for layer in servers.info.moe_layers:
            block = model.model.layers[layer].mlp
            fwd = overlapped_moe_forward(block)
            assert fwd is not None
            for T in (1, 5, 32):
                x = torch.randn(1, T, servers.info.hidden_size, generator=g)
                with torch.no_grad():
                    got, want = fwd(x), block(x)
                assert got.shape == want.shape == x.shape
                assert torch.equal(got, want), (layer, T, (got - want).abs().max().item())
        assert all(s["failures"] == 0 for s in d.health()["servers"].values())
    finally:
        d.close()


def test_routing_table_watcher_hot_reload(servers, model_dir, prompt_ids, ref_logits):
    path = servers.dir / "routing-table.json"
    write_table(path, servers.table(version=5))
    d = Dispatcher(2, servers.info.hidden_size, torch.float32)
    w = RoutingTableWatcher(str(path), d, interval=0.05)
    assert w.load_now() and d.version == 5
    # Rejected inputs, read synchronously (the polling thread is not started yet):
    write_table(path, servers.table(version=3))  # older than the table in use
    assert not w.load_now() and d.version == 5
    path.write_text("{not json")  # malformed: ignored, the table in use stays
    assert not w.load_now() and d.version == 5
    w.start()
    try:
        # ... and the positive marker: a newer table written after them is applied by the
        # polling thread, and no version seen on the way is the rejected one.
        v6 = servers.table(version=5).without_servers(["s0"])  # version 6, s0 removed
        write_table(path, v6)
        seen = wait_for_version(d, 6)
        assert set(seen) <= {5, 6}, seen
        assert client_version_metric("2") == 6
        assert_close(logits(remote_model(model_dir, d), prompt_ids), ref_logits)
        assert "s0" not in d.health()["servers"]
    finally:
        w.stop()
        d.close()


def wait_for_version(d: Dispatcher, version: int, timeout: float = 60.0) -> list[int]:
    """Poll ``d.version`` until it is ``version``; returns every distinct version seen."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        v = d.version
        if not seen or seen[-1] != v:
            seen.append(v)
        if v == version:
            return seen
        assert time.monotonic() < deadline, f"version {version} not applied; saw {seen}"
        time.sleep(0.02)


def client_version_metric(client_id: str) -> float | None:
    return REGISTRY.get_sample_value("eaas_routing_table_version", {"client_id": client_id})


def failovers() -> float:
    return REGISTRY.get_sample_value("eaas_failovers_total") or 0.0


def test_hung_server_hits_deadline_and_fails_over(servers, model_dir, prompt_ids, ref_logits):
    # split_pairs=1: every call deals each expert's pairs over all its replicas, so the next
    # forward reaches the hung server whatever the replica rotation
    d = Dispatcher(
        3,
        servers.info.hidden_size,
        torch.float32,
        servers.table(),
        timeout=1.0,
        retry_down_s=0.5,
        split_pairs=1,
    )
    model = remote_model(model_dir, d)
    # s0 connected before it is stopped, or its pairs never reach it (nothing to wait for)
    wait_all_connected(d.health)
    assert_close(logits(model, prompt_ids), ref_logits)  # warm: all connected
    fo = failovers()
    os.kill(servers.procs["s0"].pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        out = logits(model, prompt_ids)
        elapsed = time.monotonic() - t0
    finally:
        os.kill(servers.procs["s0"].pid, signal.SIGCONT)
    assert_close(out, ref_logits)
    assert elapsed >= 1.0  # the client waited for its deadline before failing over
    assert failovers() > fo
    assert d.health()["servers"]["s0"]["state"] == "down"
    # after retry_down_s the resumed server is reconnected and used again
    deadline = time.monotonic() + 60
    while True:
        assert_close(logits(model, prompt_ids), ref_logits)
        if d.health()["servers"]["s0"]["state"] == "connected":
            break
        assert time.monotonic() < deadline, d.health()["servers"]["s0"]
        time.sleep(0.1)
    d.close()


def test_killed_server_fails_over_then_no_live_replica(servers, model_dir, prompt_ids, ref_logits):
    d = Dispatcher(4, servers.info.hidden_size, torch.float32, servers.table(), timeout=5.0)
    model = remote_model(model_dir, d)
    # s1 connected before it is killed, or its pairs never reach it (nothing to fail over)
    wait_all_connected(d.health)
    assert_close(logits(model, prompt_ids), ref_logits)
    fo = failovers()
    servers.procs["s1"].kill()
    servers.procs["s1"].wait()
    assert_close(logits(model, prompt_ids), ref_logits)
    assert failovers() > fo
    marked_down = REGISTRY.get_sample_value("eaas_server_marked_down_total", {"server": "s1"})
    assert marked_down is not None and marked_down >= 1
    servers.procs["s2"].kill()
    servers.procs["s2"].wait()
    # experts whose replicas were exactly {s1, s2} are gone: a clear, fast, retryable error
    t0 = time.monotonic()
    with pytest.raises(NoLiveReplicaError) as ei:
        logits(model, prompt_ids)
    assert time.monotonic() - t0 < 60  # an error, not a hang
    assert "no live replica" in str(ei.value)
    d.close()
