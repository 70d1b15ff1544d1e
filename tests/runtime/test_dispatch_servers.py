"""Dispatcher against real expert-server processes: results, a hung server, reconnect.

Two forked servers host the same experts (every expert has two replicas); the Dispatcher talks
to them over the shared-memory transport. A SIGSTOPped server must not block ``health()`` (what
the attention client's GET /health returns) nor a routing-table update, its pairs must fail over
to the other replica once the deadline passes, and it must be reconnected by the connector
thread after SIGCONT without any traffic.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from prometheus_client import REGISTRY

from eaas.runtime.client.dispatch import Dispatcher
from eaas.runtime.tables.table import RoutingTable

from helpers.dispatch import wait_all_connected
from helpers.server import HIDDEN, reference, start_server, wait_until

pytestmark = pytest.mark.engine

LAYER = 1  # SPEC hosts layer 1 experts 0-3 on every server


@pytest.fixture
def two_servers(tmp_path):
    procs = {sid: start_server(f"unix:{tmp_path}/{sid}.sock") for sid in ("s0", "s1")}
    yield procs
    for p in procs.values():
        p.stop()


def make_table(procs, version=1) -> RoutingTable:
    sids = sorted(procs)
    layers = {LAYER: tuple(tuple(sids) for _ in range(4)), 2: tuple(tuple(sids) for _ in range(2))}
    return RoutingTable(
        version=version,
        num_experts=4,
        servers={sid: procs[sid].endpoint for sid in sids},
        layers=layers,
    )


def batch(T=8, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, HIDDEN, generator=g)
    idx = torch.stack([torch.randperm(4, generator=g)[:k] for _ in range(T)])
    idx[0, 1] = -1  # a padded slot
    w = torch.rand(T, k, generator=g)
    return hidden, idx, w


def failovers() -> float:
    return REGISTRY.get_sample_value("eaas_failovers_total") or 0.0


def test_dispatch_matches_reference_and_spreads_over_replicas(two_servers):
    d = Dispatcher(0, HIDDEN, torch.float32, make_table(two_servers), timeout=30.0)
    try:
        # both first connections open: a call while one is still opening goes to the other
        # replica alone (every expert is covered, so the plan does not wait for it)
        wait_all_connected(d.health)
        for seed in range(3):
            hidden, idx, w = batch(seed=seed)
            out = d.dispatch(LAYER, hidden, idx, w)
            torch.testing.assert_close(out, reference(LAYER, hidden, idx, w))
        # a bf16 caller gets bf16 back (frames travel in the dispatcher's dtype)
        out16 = d.dispatch(LAYER, hidden.bfloat16(), idx, w)
        assert out16.dtype == torch.bfloat16
        h = d.health()
        assert all(s["state"] == "connected" for s in h["servers"].values())
        assert all(s["tokens_sent"] > 0 for s in h["servers"].values())  # both replicas used
    finally:
        d.close()


def test_health_answers_while_a_server_is_hung_and_pairs_fail_over(two_servers):
    # split_pairs=1: every call deals each expert's pairs over both replicas, so a call always
    # reaches the server that is made to fail
    d = Dispatcher(
        1,
        HIDDEN,
        torch.float32,
        make_table(two_servers),
        timeout=3.0,
        retry_down_s=0.2,
        split_pairs=1,
    )
    hidden, idx, w = batch(T=16)
    ref = reference(LAYER, hidden, idx, w)
    try:
        # s0 connected before it is stopped, or its pairs never reach it (nothing to fail over)
        wait_all_connected(d.health)
        torch.testing.assert_close(d.dispatch(LAYER, hidden, idx, w), ref)  # both connected
        fo = failovers()
        pid = two_servers["s0"].pid
        os.kill(pid, signal.SIGSTOP)
        result: dict = {}

        def call():
            try:
                result["out"] = d.dispatch(LAYER, hidden, idx, w)
            except Exception as exc:  # noqa: BLE001
                result["error"] = exc

        th = threading.Thread(target=call)
        try:
            th.start()
            # health() and a table update answer while the layer call waits for the hung
            # server (it waits up to its 3 s deadline): each returns before the call ends
            answered_during_call = 0
            applied_during_call = False
            worst = 0.0
            while th.is_alive():
                t0 = time.perf_counter()
                h = d.health()
                worst = max(worst, time.perf_counter() - t0)
                if th.is_alive():
                    answered_during_call += 1
                    assert h["routing_table_version"] >= 1
                    if not applied_during_call:
                        applied_during_call = d.set_table(make_table(two_servers, version=2))
                        assert applied_during_call or not th.is_alive()
                time.sleep(0.01)
            th.join()
        finally:
            os.kill(pid, signal.SIGCONT)
        print(f"worst health() latency while a server was hung: {worst * 1e3:.2f} ms")
        assert answered_during_call > 0 and applied_during_call
        assert "error" not in result, result.get("error")
        torch.testing.assert_close(result["out"], ref)  # s0's pairs were re-sent to s1
        assert failovers() > fo
        assert d.health()["servers"]["s0"]["state"] == "down"
        assert d.version == 2
        # the connector thread reconnects the resumed server without any traffic
        assert wait_until(
            lambda: d.health()["servers"]["s0"]["state"] == "connected", timeout=60
        ), d.health()["servers"]["s0"]
        torch.testing.assert_close(d.dispatch(LAYER, hidden, idx, w), ref)
    finally:
        d.close()


def test_killed_server_fails_over_then_recovers_by_table(two_servers, tmp_path):
    # split_pairs=1: every call reaches both replicas (see above)
    d = Dispatcher(2, HIDDEN, torch.float32, make_table(two_servers), timeout=30.0, split_pairs=1)
    hidden, idx, w = batch(T=12, seed=3)
    ref = reference(LAYER, hidden, idx, w)
    try:
        # s1 connected before it is killed, or its pairs never reach it (nothing to fail over)
        wait_all_connected(d.health)
        torch.testing.assert_close(d.dispatch(LAYER, hidden, idx, w), ref)
        two_servers["s1"].kill()
        fo = failovers()
        torch.testing.assert_close(d.dispatch(LAYER, hidden, idx, w), ref)
        assert failovers() > fo  # a dead peer is noticed at once (EOF), not by the deadline
        assert d.health()["servers"]["s1"]["state"] == "down"
        # a new s1 at another path, announced by a newer table: used again
        two_servers["s1"] = start_server(f"unix:{tmp_path}/s1b.sock")
        assert d.set_table(make_table(two_servers, version=2))
        assert wait_until(lambda: d.health()["servers"]["s1"]["state"] == "connected", timeout=60)
        before = d.health()["servers"]["s1"]["tokens_sent"]
        torch.testing.assert_close(d.dispatch(LAYER, hidden, idx, w), ref)
        assert d.health()["servers"]["s1"]["tokens_sent"] > before
    finally:
        d.close()


def test_small_calls_keep_each_expert_on_one_replica_and_alternate(two_servers):
    """Below ``split_pairs`` pairs per expert a call reaches ONE replica of each expert (both
    servers host every expert here, so one server per call), the next call the other; an expert
    with more pairs than ``split_pairs`` is split over both. Results match the reference."""
    d = Dispatcher(2, HIDDEN, torch.float32, make_table(two_servers), timeout=30.0, split_pairs=4)
    try:

        def sent() -> dict[str, int]:
            return {sid: s["tokens_sent"] for sid, s in d.health()["servers"].items()}

        # both first connections open (a call while one is still opening goes to the other
        # replica alone: every expert is covered, so the plan does not wait for it)
        wait_all_connected(d.health)
        hidden, idx, w = batch(T=2, k=2, seed=5)  # 3 pairs: no expert above 4
        reached = []
        for _ in range(4):
            before = sent()
            out = d.dispatch(LAYER, hidden, idx, w)
            torch.testing.assert_close(out, reference(LAYER, hidden, idx, w))
            after = sent()
            reached.append(sorted(sid for sid in after if after[sid] > before[sid]))
        assert all(len(r) == 1 for r in reached), reached
        assert reached[0] != reached[1] and reached[0] == reached[2] and reached[1] == reached[3]
        # ten tokens of one expert (> split_pairs): both replicas get a share
        big = torch.zeros(10, 1, dtype=torch.int64)
        hb = torch.randn(10, HIDDEN)
        wb = torch.rand(10, 1)
        before = sent()
        out = d.dispatch(LAYER, hb, big, wb)
        torch.testing.assert_close(out, reference(LAYER, hb, big, wb))
        after = sent()
        assert all(after[sid] - before[sid] == 5 for sid in after), (before, after)
    finally:
        d.close()


def test_a_decode_call_sends_only_to_the_servers_its_pairs_reach(two_servers):
    """Experts 0-1 live on s0 only, 2-3 on s1 only: a small call reserves both servers (its
    column) but a server none of whose experts the call selects gets no frame at all."""
    sids = sorted(two_servers)
    layers = {LAYER: (("s0",), ("s0",), ("s1",), ("s1",)), 2: (tuple(sids), tuple(sids))}
    table = RoutingTable(
        version=1,
        num_experts=4,
        servers={sid: two_servers[sid].endpoint for sid in sids},
        layers=layers,
    )
    d = Dispatcher(3, HIDDEN, torch.float32, table, timeout=30.0)
    try:

        def sent() -> dict[str, int]:
            return {sid: s["tokens_sent"] for sid, s in d.health()["servers"].items()}

        wait_all_connected(d.health)
        g = torch.Generator().manual_seed(7)
        hidden = torch.randn(3, HIDDEN, generator=g)
        w = torch.rand(3, 2, generator=g)
        for idx, reached in (
            (torch.tensor([[0, 1], [1, 0], [0, -1]]), {"s0": 3, "s1": 0}),
            (torch.tensor([[2, 3], [3, -1], [2, 3]]), {"s0": 0, "s1": 3}),
            (torch.tensor([[0, 2], [1, -1], [3, -1]]), {"s0": 2, "s1": 2}),
        ):
            before, seq0 = sent(), {sid: s.seq for sid, s in d._servers.items()}
            out = d.dispatch(LAYER, hidden, idx, w)
            torch.testing.assert_close(out, reference(LAYER, hidden, idx, w))
            after = sent()
            assert {sid: after[sid] - before[sid] for sid in after} == reached
            # one frame per server reached, none (not even an empty one) to the other
            frames = {sid: s.seq - seq0[sid] for sid, s in d._servers.items()}
            assert frames == {sid: int(n > 0) for sid, n in reached.items()}
            # nothing reserved is left busy: the next plan sees both servers usable
            assert not any(s.busy for s in d._servers.values())
    finally:
        d.close()


def test_a_call_with_wrong_shapes_is_the_callers_error_and_no_server_goes_down(two_servers):
    """The call's tensors are checked once, before any frame (frames are then sent without a
    check of their own): wrong shapes raise ValueError naming the tensor, no server is marked
    down, nothing stays busy, and the next call is answered."""
    d = Dispatcher(4, HIDDEN, torch.float32, make_table(two_servers), timeout=30.0)
    try:
        wait_all_connected(d.health)
        hidden, idx, w = batch(T=4, seed=2)
        for bad, match in (
            ((hidden[:, :-1], idx, w), "hidden must be"),
            ((hidden, idx[:3], w[:3]), "top_k_index must be"),
            ((hidden, idx, w[:, :1]), "top_k_weights"),
            ((hidden.unsqueeze(0), idx, w), "hidden must be"),
        ):
            with pytest.raises(ValueError, match=match):
                d.dispatch(LAYER, *bad)
        assert all(s["state"] == "connected" for s in d.health()["servers"].values())
        assert not any(s.busy for s in d._servers.values())
        out = d.dispatch(LAYER, hidden, idx, w)
        torch.testing.assert_close(out, reference(LAYER, hidden, idx, w))
    finally:
        d.close()
