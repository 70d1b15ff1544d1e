"""Fail static, pure logic and the operator's probe: indirect evidence (Ready=False, a NotReady
node) never removes the last replica of an expert nor more than the bound at once unless the
operator's own probe confirms the death; direct evidence and a refused probe remove at once."""

from __future__ import annotations

import http.server
import socket
import threading

import pytest

from eaas.operator.crd import ExpertPoolSpec
from eaas.operator.fail_static import classify, decide, removal_bound, suspects, with_held
from eaas.operator.pods import ObservedPod
from eaas.operator.reconcile.fail_static import add_condition, probe
from eaas.operator.table import table_from_assignment

from helpers.common import free_port

pytestmark = pytest.mark.failstatic

SPEC = ExpertPoolSpec.model_validate(
    {
        "model": {"uri": "/models/tiny", "firstMoeLayer": 1, "numMoeLayers": 1, "numExperts": 4},
        "replicas": 4,
    }
)


def table(assign: dict[str, list[int]]):
    """A one-layer table: server -> experts of layer 1."""
    return table_from_assignment(
        SPEC,
        {n: [(1, e) for e in es] for n, es in assign.items()},
        {n: f"tcp://10.0.0.{i + 1}:{SPEC.port}" for i, n in enumerate(assign)},
        3,
    )


# redundancy 2 over 4 servers: every expert on two of them
T4 = table({"s0": [0, 1], "s1": [2, 3], "s2": [0, 2], "s3": [1, 3]})


def pod(name: str, i: int, **kw) -> ObservedPod:
    base = dict(name=name, uid=f"u-{name}", index=i, ready=True, ip=f"10.0.0.{i + 1}")
    base.update(phase="Running")
    base.update(kw)
    return ObservedPod(**base)


def test_bound_is_a_quarter_at_least_one():
    assert [removal_bound(n) for n in (0, 1, 2, 4, 7, 8, 16)] == [0, 1, 1, 1, 1, 2, 4]


def test_classify_direct_and_indirect():
    ep = f"tcp://10.0.0.1:{SPEC.port}"
    live = pod("s0", 0)
    assert classify(ep, live, ep) == "usable"
    assert classify(ep, None, "") == "direct"
    assert classify(ep, pod("s0", 0, terminating=True), ep) == "direct"
    assert classify(ep, pod("s0", 0, phase="Failed", ready=False), ep) == "direct"
    assert classify(ep, live, "tcp://10.0.0.9:1") == "direct"  # new IP
    assert classify(ep, live, ep, confirmed_down={"s0"}) == "direct"
    assert classify(ep, pod("s0", 0, ready=False), ep) == "indirect"
    assert classify(ep, pod("s0", 0, node_ready=False), ep) == "indirect"


def test_stall_flips_every_pod_not_ready_the_probe_keeps_them_and_drops_the_killed_one():
    """The API-server stall: after the resume, NodeNotReady flips all four Ready=False; the one
    killed during the stall refuses the probe."""
    evidence = {n: "indirect" for n in T4.servers}
    probes = {"s0": "ok", "s1": "dead", "s2": "ok", "s3": "ok"}
    d = decide(T4, evidence, probes)
    assert d.dropped == {"s1": "the operator's probe confirmed it down"}
    assert set(d.held) == {"s0", "s2", "s3"}
    assert "s0 (answers the operator's probe)" in d.message()
    assert suspects(T4, evidence) == ["s0", "s1", "s2", "s3"]


def test_unconfirmed_removals_are_bounded_and_never_take_the_last_replica():
    evidence = {n: "indirect" for n in T4.servers}
    d = decide(T4, evidence, {})  # every probe timed out: nothing confirmed
    assert list(d.dropped) == ["s0"]  # the bound: 1 of 4, in table order
    assert set(d.held) == {"s1", "s2", "s3"}
    assert "at most 1 removed at once" in d.held["s1"]
    # s0 and s2 both hold expert 0: with s0 already down (direct), s2 is its last replica
    d = decide(T4, {"s0": "direct", "s2": "indirect"}, {"s2": "unknown"})
    assert d.dropped == {"s0": "gone"}
    assert "last replica" in d.held["s2"]


def test_one_dead_server_leaves_at_once():
    """As fast as before: one server with a refused probe, or one unconfirmed within the bound,
    or one whose pod is gone, leaves in the same step."""
    for evidence, probes in (
        ({"s2": "indirect"}, {"s2": "dead"}),
        ({"s2": "indirect"}, {"s2": "unknown"}),
        ({"s2": "direct"}, {}),
    ):
        d = decide(T4, evidence, probes)
        assert list(d.dropped) == ["s2"] and not d.held and d.message() == ""


def test_confirmed_deaths_are_not_bounded():
    """Direct evidence and refused probes remove every server they name (no bound): a dead node
    takes its servers with it."""
    d = decide(T4, {n: "indirect" for n in T4.servers}, {n: "dead" for n in T4.servers})
    assert set(d.dropped) == set(T4.servers) and not d.held


def test_with_held_counts_held_pods_live():
    observed = [pod("s0", 0), pod("s1", 1, ready=False, node_ready=False), pod("s2", 2)]
    live = [observed[0], observed[2]]
    out = with_held(live, observed, {"s1": "answers the operator's probe"})
    assert [p.name for p in out] == ["s0", "s1", "s2"]
    assert all(p.live for p in out)
    assert with_held(live, observed, {}) == live


def test_condition():
    status: dict = {"conditions": []}
    d = decide(T4, {"s1": "indirect"}, {"s1": "ok"})
    add_condition(status, d, [], "2026-01-01T00:00:00Z", 4)
    (c,) = status["conditions"]
    assert (c["type"], c["status"], c["reason"]) == ("FailStatic", "True", "ServersHeld")
    assert "s1 (answers" in c["message"] and c["observedGeneration"] == 4
    status = {"conditions": []}
    add_condition(status, decide(T4, {}, {}), [c], "2026-01-01T00:00:09Z", 4)
    (c2,) = status["conditions"]
    assert (c2["status"], c2["reason"]) == ("False", "NothingHeld")
    assert c2["lastTransitionTime"] == "2026-01-01T00:00:09Z"


class _Health(http.server.BaseHTTPRequestHandler):
    code = 200

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(self.server.code)  # type: ignore[attr-defined]
        self.end_headers()

    def log_message(self, *args):
        pass


def _serve(code: int):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    srv.code = code  # type: ignore[attr-defined]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_probe_answers_from_real_sockets():
    ok, failing = _serve(200), _serve(503)
    try:
        assert probe(f"http://127.0.0.1:{ok.server_port}/health") == "ok"
        assert probe(f"http://127.0.0.1:{failing.server_port}/health") == "dead"
    finally:
        ok.shutdown()
        failing.shutdown()
    assert probe(f"http://127.0.0.1:{free_port()}/health") == "dead"  # refused
    # accepts the connection (kernel backlog) but never answers: a frozen process
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        assert probe(f"http://127.0.0.1:{port}/health", timeout_s=0.5) == "unknown"
