"""Fail static on process nodes, under 16 streams through the official ``openai`` client (a
short form of ``bench/apiserver_stall.py``): every server's node agent frozen past the node
monitor grace period, so the real node-lifecycle controller marks the nodes NotReady and flips
every server pod Ready=False, with one server killed meanwhile. The operator holds the three
that answer its probe (``FailStatic`` True, a ``RoutingTableHeldBack`` event) and drops the killed
one: no failed request, no version with an uncovered expert, no live server dropped. Then a
frozen node agent with a killed server on it: the clients' failure reports, confirmed by the
operator's probe, take it out of the table before the node could turn NotReady (20 s here)."""

from __future__ import annotations

import time
import uuid

import openai
import pytest
from transformers import AutoTokenizer

from eaas.runtime.models.reference import reference_generate

from helpers.common import free_port
from helpers.faults import StreamLoad, apply_tiny_pool_and_fleet, serving_table
from helpers.k8s import Operator, apply_crds, client_pods, get_json, kubectl, server_pods, wait_for
from helpers.stall import frozen_agent, heartbeat_loss

pytestmark = pytest.mark.failstatic

#: The cluster tier's node monitor grace period (s).
NODE_GRACE_S = 20.0


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    apply_crds()
    port = free_port()
    op = Operator(
        tmp_path_factory.mktemp("failstatic") / "operator.log",
        env={
            "EAAS_OPERATOR_REPORT_LISTEN": f"127.0.0.1:{port}",
            "EAAS_OPERATOR_REPORT_URL": f"http://127.0.0.1:{port}",
            "EAAS_OPERATOR_LEASE_DURATION_S": "15",
        },
    )
    op.start()
    yield op
    op.stop()


def test_apiserver_stall_and_frozen_agent_under_load(cluster, operator, model_dir):
    ns = f"fs-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", ns)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [tok(t)["input_ids"] for t in ("Hello world", "Kubernetes schedules pods on nodes")]
    references = reference_generate(str(model_dir), prompts, 16)
    try:
        apply_tiny_pool_and_fleet(
            ns,
            servers=4,
            clients=2,
            pool_spec={"placement": {"assignment": "routing-table"}},
            fleet_spec={"nodeSelector": {"kubernetes.io/hostname": "cpu-node-0"}},
        )
        wait_for(
            "serving", lambda: serving_table(ns, "tiny", "clients", 4, 2), timeout=300, interval=1
        )
        a_ip = client_pods(ns, "clients")[0]["status"]["podIP"]
        model_id = (
            openai.OpenAI(base_url=f"http://{a_ip}:8000/v1", api_key="unused")
            .models.list()
            .data[0]
            .id
        )
        load = StreamLoad(f"http://{a_ip}:8000/v1", model_id, prompts, 16).start()
        try:
            time.sleep(3)
            agents = {n: pid for n, pid in cluster.agents.items() if n.startswith("gpu-")}
            lost = heartbeat_loss(ns, "tiny", "clients", agents)
            events = get_json("events", "-n", ns, "--field-selector", "involvedObject.name=tiny")
            held = [e["message"] for e in events["items"] if e["reason"] == "RoutingTableHeldBack"]
            pods = server_pods(ns, "tiny")
            victim = sorted(pods)[1]
            agent = cluster.agents[pods[victim]["spec"]["nodeName"]]
            frozen = frozen_agent(ns, "tiny", "clients", agent, victim)
        finally:
            requests = load.stop()
        bad = load.wrong(references)
        assert not bad, f"{len(bad)} of {len(requests)} requests failed or wrong: {bad[:3]}"
        assert len(requests) > 16
        # the three live servers were held while the API showed them unavailable
        assert held, "no RoutingTableHeldBack event: the nodes' NotReady marks were not seen"
        assert any("answers the operator's probe" in m for m in held), held
        for r in (lost, frozen):
            assert not r.uncovered, f"{r.kind}: versions with an uncovered expert: {r.uncovered}"
            assert not r.dropped_live, f"{r.kind}: live servers dropped: {r.dropped_live}"
        # the frozen agent's server: out via the clients' reports, before the node controller
        assert frozen.out_after_s is not None and frozen.out_after_s < NODE_GRACE_S
        events = get_json("events", "-n", ns, "--field-selector", "involvedObject.name=tiny")
        reasons = {e.get("reason") for e in events["items"]}
        assert "ServerUnreachable" in reasons  # a client's report, confirmed by the probe
    finally:
        kubectl("delete", "namespace", ns, "--wait=false", check=False)
