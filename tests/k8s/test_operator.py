"""An ExpertPool's life under the operator against a real API server (testbed: kube-apiserver,
etcd, controller-manager, scheduler, kwok nodes): apply, scale, replace, roll, dead nodes, an
operator killed mid-reconcile, delete. The operator runs as a real process (``eaas operator``);
the tests drive it with ``kubectl`` like a user would and check what lands in the API server.
Specs: test_pool_spec.py; fleets: test_attention_fleet.py; the chart: test_helm_render.py.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from helpers.k8s import (
    ROOT,
    apply,
    converged,
    get,
    get_json,
    kubectl,
    pods,
    pool_manifest,
    table,
    wait_for,
)


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------
def test_tiny_pool_from_examples(ns, operator):
    t0 = time.monotonic()
    kubectl("apply", "-n", ns, "-f", str(ROOT / "deploy/examples/tiny-pool.yaml"))
    got = wait_for("tiny pool Ready", lambda: converged(ns, "tiny"), timeout=90)
    elapsed = time.monotonic() - t0
    print(
        f"\n[measure] tiny pool (3 MoE layers x 32 experts, 4 servers): apply -> Ready {elapsed:.2f}s"
    )

    nodes = {
        n["metadata"]["name"]: n
        for n in json.loads(kubectl("get", "nodes", "-o", "json").stdout)["items"]
    }
    pool = got["pool"]
    # no load rebalance yet: the field is absent (no "" from the operator or a schema default)
    assert "lastRebalanceTime" not in pool["status"], pool["status"]
    for p in got["pods"]:
        node = nodes[p["spec"]["nodeName"]]
        assert node["metadata"]["labels"].get("eaas.io/rdma") == "true", (
            f"{p['metadata']['name']} on {node}"
        )
        c = p["spec"]["containers"][0]
        cmd = c["command"]
        assert cmd[:2] == ["eaas", "expert-server"]
        assert cmd[cmd.index("--model") + 1] == "/models/tiny"
        assert cmd[cmd.index("--server-id") + 1] == p["metadata"]["name"]
        assert cmd[cmd.index("--listen") + 1] == "tcp://0.0.0.0:9000"
        assert (
            c["resources"]["limits"]["nvidia.com/gpu"] == "1"
            and c["resources"]["limits"]["rdma/ib"] == "1"
        )
        (ref,) = p["metadata"]["ownerReferences"]
        assert (
            ref["uid"] == pool["metadata"]["uid"]
            and ref["controller"]
            and ref["blockOwnerDeletion"]
        )
        assert (
            p["metadata"]["labels"]["eaas.io/placement-revision"]
            == pool["status"]["placementRevision"]
        )
    # scale subresource and printer columns
    scale = json.loads(
        kubectl(
            "get", "--raw", f"/apis/eaas.io/v1alpha1/namespaces/{ns}/expertpools/tiny/scale"
        ).stdout
    )
    assert scale["spec"]["replicas"] == 4 and scale["status"]["replicas"] == 4
    assert scale["status"]["selector"] == "eaas.io/pool=tiny,eaas.io/role=expert-server"
    row = kubectl("get", "epool", "tiny", "-n", ns).stdout
    assert "REDUNDANCY" in row and "TABLE" in row
    # the routing table ConfigMap is owned by the pool; Events were posted
    cm = get("configmap", "tiny-routing-table", ns)
    assert cm["metadata"]["ownerReferences"][0]["uid"] == pool["metadata"]["uid"]
    assert cm["metadata"]["annotations"]["eaas.io/routing-table-version"] == str(
        got["table"].version
    )
    reasons = wait_for(
        "events",
        lambda: (
            {
                e["reason"]
                for e in json.loads(
                    kubectl(
                        "get",
                        "events",
                        "-n",
                        ns,
                        "--field-selector",
                        "involvedObject.kind=ExpertPool",
                        "-o",
                        "json",
                    ).stdout
                )["items"]
            }
            >= {"PlacementComputed", "ServersCreated", "RoutingTablePublished", "PoolReady"}
            or None
        ),
        timeout=30,
    )
    assert reasons


def test_no_pod_on_cpu_node(ns, operator):
    apply(pool_manifest("wide", replicas=12), ns)
    got = wait_for("12 servers Ready", lambda: converged(ns, "wide"), timeout=90)
    used = {p["spec"]["nodeName"] for p in got["pods"]}
    assert all(n.startswith("gpu-node-") for n in used), used
    assert len(used) > 1, "topology spread should use several GPU nodes"


def test_hpa_without_a_metrics_listener_gets_a_warning_event(ns, operator):
    """This operator serves no external metrics API (no ``EAAS_OPERATOR_METRICS_LISTEN``): it
    still makes the pool's HPA, and a Warning event on the pool says the HPA cannot get its
    metric."""
    auto = {"minReplicas": 2, "maxReplicas": 4, "targetLoadPerServer": 10}
    apply(pool_manifest("auto", autoscaling=auto), ns)
    hpa = wait_for("the pool's HPA", lambda: get("hpa", "auto", ns), timeout=90)
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "ExpertPool"

    def warning():
        for e in get_json("events", "-n", ns, "--field-selector", "involvedObject.kind=ExpertPool")[
            "items"
        ]:
            if e["reason"] == "AutoscalerNoMetrics":
                return e
        return None

    e = wait_for("AutoscalerNoMetrics event", warning, timeout=60)
    assert e["type"] == "Warning" and e["involvedObject"]["name"] == "auto"
    assert "EAAS_OPERATOR_METRICS_LISTEN" in e["message"] and "eaas_expert_load" in e["message"]


def test_scale_up_and_down(ns, operator):
    apply(pool_manifest("sc"), ns)
    v = wait_for("pool Ready", lambda: converged(ns, "sc"), timeout=90)["table"].version
    for k in (6, 5, 7, 3, 2):  # none of these divides 32 except 2
        kubectl("scale", "expertpool/sc", "-n", ns, f"--replicas={k}")
        got = wait_for(
            f"Ready at {k} servers",
            lambda k=k: (
                converged(ns, "sc")
                if get("expertpool", "sc", ns)["spec"]["replicas"] == k
                else None
            ),
            timeout=120,
        )
        assert len(got["pods"]) == k
        assert got["table"].version > v, "routing table version must increase on every change"
        v = got["table"].version
        st = got["pool"]["status"]
        assert {p["metadata"]["labels"]["eaas.io/placement-revision"] for p in got["pods"]} == {
            st["placementRevision"]
        }


@pytest.mark.elastic
def test_scale_by_one_keeps_running_servers(ns, operator):
    """Incremental placement end to end: 4 -> 5 -> 4 servers replaces none of the first four
    pods (the fifth holds extra replicas only), and every published table stays covered."""
    apply(pool_manifest("inc"), ns)
    got = wait_for("pool Ready", lambda: converged(ns, "inc"), timeout=90)
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in got["pods"]}
    for k in (5, 4):
        kubectl("scale", "expertpool/inc", "-n", ns, f"--replicas={k}")
        got = wait_for(
            f"Ready at {k} servers",
            lambda k=k: (
                converged(ns, "inc")
                if get("expertpool", "inc", ns)["spec"]["replicas"] == k
                else None
            ),
            timeout=120,
        )
        now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in got["pods"]}
        assert {n: now[n] for n in uids} == uids, "a running server was replaced"
        assert len(now) == k


def test_scale_below_redundancy_rejected(ns, operator):
    apply(pool_manifest("low", replicas=2, redundancy=2), ns)
    wait_for("pool Ready", lambda: converged(ns, "low"), timeout=90)
    r = kubectl("scale", "expertpool/low", "-n", ns, "--replicas=1", check=False)
    assert r.returncode != 0 and "spec.redundancy must not exceed spec.replicas" in r.stderr, (
        r.stderr
    )
    assert get("expertpool", "low", ns)["spec"]["replicas"] == 2


def test_deleted_pod_is_replaced(ns, operator):
    apply(pool_manifest("heal"), ns)
    before = wait_for("pool Ready", lambda: converged(ns, "heal"), timeout=90)
    victim = next(p for p in before["pods"] if p["metadata"]["name"] == "heal-1")
    kubectl("delete", "pod", "heal-1", "-n", ns, "--wait=false")
    after = wait_for("pool Ready again", lambda: converged(ns, "heal"), timeout=90)
    # on the way a table without the dead server was published (the replacement may come back
    # with the same IP, so the final table can equal the first one but for its version)
    v0 = before["table"].version

    def published_without_victim():
        events = json.loads(
            kubectl(
                "get",
                "events",
                "-n",
                ns,
                "--field-selector",
                "reason=RoutingTablePublished",
                "-o",
                "json",
            ).stdout
        )["items"]
        versions = [
            int(m.group(1))
            for e in events
            if (m := re.match(r"routing table version (\d+): 3 live servers", e["message"]))
        ]
        return [v for v in versions if v > v0]

    assert wait_for(
        "a published table without the deleted server", published_without_victim, timeout=30
    )
    new = next(p for p in after["pods"] if p["metadata"]["name"] == "heal-1")
    assert new["metadata"]["uid"] != victim["metadata"]["uid"]
    assert after["table"].version >= before["table"].version + 2  # removed, then re-added
    # the other servers were left alone
    old_uids = {p["metadata"]["uid"] for p in before["pods"] if p["metadata"]["name"] != "heal-1"}
    assert old_uids <= {p["metadata"]["uid"] for p in after["pods"]}


def test_image_change_rolls_servers(ns, operator):
    apply(pool_manifest("roll", replicas=5), ns)
    before = wait_for("pool Ready", lambda: converged(ns, "roll"), timeout=90)
    kubectl(
        "patch",
        "expertpool",
        "roll",
        "-n",
        ns,
        "--type=merge",
        "-p",
        '{"spec":{"image":"eaas:v2"}}',
    )
    after = wait_for(
        "rolled to eaas:v2",
        lambda: (
            (got := converged(ns, "roll"))
            and all(p["spec"]["containers"][0]["image"] == "eaas:v2" for p in got["pods"])
            and got
        ),
        timeout=120,
    )
    assert not (
        {p["metadata"]["uid"] for p in before["pods"]}
        & {p["metadata"]["uid"] for p in after["pods"]}
    )
    # same placement: the experts of every server are unchanged
    assert (
        after["pool"]["status"]["placementRevision"]
        == before["pool"]["status"]["placementRevision"]
    )
    assert after["table"].layers == before["table"].layers
    # replaced one at a time (redundancy 2 -> at most one server down): never an uncovered expert
    events = json.loads(
        kubectl(
            "get", "events", "-n", ns, "--field-selector", "reason=ServersDeleted", "-o", "json"
        ).stdout
    )["items"]
    assert events and all(e["type"] == "Normal" for e in events), [e["message"] for e in events]


def test_routing_table_configmap_recreated_with_higher_version(ns, operator):
    apply(pool_manifest("cm"), ns)
    before = wait_for("pool Ready", lambda: converged(ns, "cm"), timeout=90)
    kubectl("delete", "configmap", "cm-routing-table", "-n", ns)
    after = wait_for("table back", lambda: (t := table(ns, "cm")) and t, timeout=30)
    assert after.version > before["table"].version, (
        "a recreated table must not reuse an old version"
    )
    wait_for("pool Ready", lambda: converged(ns, "cm"), timeout=30)


def test_dead_node_leaves_the_routing_table(ns, operator):
    """A node whose kubelet stops reporting keeps its pods "Ready" in the API for minutes; the
    operator must drop them from the routing table as soon as the node is NotReady."""
    apply(pool_manifest("nodes", replicas=8), ns)
    before = wait_for("pool Ready", lambda: converged(ns, "nodes"), timeout=90)
    node_of = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in before["pods"]}

    def lost_with(node: str) -> set[tuple[int, int]]:
        """Experts whose every replica is on ``node`` (the scheduler, not the placement, decides
        which servers share a node)."""
        return {
            pair
            for s, n in node_of.items()
            if n == node
            for pair in before["table"].hosted_by(s)
            if all(node_of[r] == node for r in before["table"].replicas(*pair))
        }

    # the node whose loss uncovers the fewest experts (usually none)
    victim_node = min(sorted(set(node_of.values())), key=lambda n: len(lost_with(n)))
    expect_lost = lost_with(victim_node)
    on_node = {name for name, n in node_of.items() if n == victim_node}
    kwok_annotation = "kwok.x-k8s.io/node"
    ready = {
        "type": "Ready",
        "status": "False",
        "reason": "KubeletStopped",
        "message": "test: node lost",
        "lastHeartbeatTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        kubectl(
            "annotate", "node", victim_node, f"{kwok_annotation}-"
        )  # kwok stops heartbeating it
        kubectl(
            "patch",
            "node",
            victim_node,
            "--subresource=status",
            "--type=strategic",
            "-p",
            json.dumps({"status": {"conditions": [ready]}}),
        )
        t0 = time.monotonic()

        def held() -> set[str]:
            """Servers the pool's FailStatic condition names as held."""
            conds = (get("expertpool", "nodes", ns).get("status") or {}).get("conditions") or []
            fs = next((c for c in conds if c["type"] == "FailStatic"), {})
            return {s for s in on_node if fs.get("status") == "True" and f"{s} (" in fs["message"]}

        # fail static: the node's NotReady is indirect evidence and kwok's pods answer no probe,
        # so a server holding the last replica of an expert stays (held, named in FailStatic);
        # every other server of the node leaves
        t = wait_for(
            "servers on the dead node out of the table (or held)",
            lambda: (t := table(ns, "nodes")) and not ((on_node - held()) & set(t.servers)) and t,
            timeout=20,
        )
        kept = on_node & set(t.servers)
        if kept:
            expect_lost = set()  # held: nothing uncovered
            assert all(set(before["table"].hosted_by(s)) & lost_with(victim_node) for s in kept)
        print(
            f"\n[measure] node NotReady -> routing table without its {len(on_node)} server(s): "
            f"{time.monotonic() - t0:.2f}s"
        )
        assert t.version > before["table"].version or kept == on_node
        # exactly the experts whose every replica was on the node lost their last replica
        assert set(t.uncovered()) == expect_lost
        reason = "ExpertsUncovered" if expect_lost else "BelowRedundancy"
        cond = wait_for(
            f"status Degraded/{reason}",
            lambda: (
                (
                    c := {
                        c["type"]: c for c in get("expertpool", "nodes", ns)["status"]["conditions"]
                    }
                )
                and c["Degraded"]["status"] == "True"
                and c["Degraded"]["reason"] == reason
                and c
            ),
            timeout=30,
        )
        assert cond["Ready"]["status"] == "False"
        # the pods themselves still claim to be Ready: only the node says otherwise
        still = {p["metadata"]["name"]: p for p in pods(ns, "nodes")}
        assert all(
            any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in still[n]["status"]["conditions"]
            )
            for n in on_node
        )
    finally:
        kubectl("annotate", "node", victim_node, f"{kwok_annotation}=fake", "--overwrite")
    wait_for(
        "node Ready again",
        lambda: any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in get("node", victim_node, "")["status"]["conditions"]
        ),
        timeout=60,
    )
    after = wait_for("pool Ready again", lambda: converged(ns, "nodes"), timeout=60)
    assert on_node <= set(after["table"].servers)


def test_operator_killed_mid_reconcile(ns, operator):
    apply(pool_manifest("crash", replicas=16), ns)
    wait_for("some pods created", lambda: len(pods(ns, "crash")) > 0, timeout=30, interval=0.02)
    operator.kill()
    created_before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(ns, "crash")}
    v_before = table(ns, "crash").version if table(ns, "crash") else 0
    operator.start()
    got = wait_for("pool Ready after restart", lambda: converged(ns, "crash"), timeout=120)
    names = [p["metadata"]["name"] for p in got["pods"]]
    assert len(names) == len(set(names)) == 16
    all_pods = pods(ns, "crash")
    assert len(all_pods) == 16, "duplicates or leftovers after the restart"
    for name, uid in created_before.items():  # pods made before the kill were kept, not recreated
        assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in all_pods}[name] == uid
    assert got["table"].version >= v_before

    # kill again in the middle of a re-placement and check the version keeps rising
    v1 = got["table"].version
    kubectl("scale", "expertpool/crash", "-n", ns, "--replicas=11")
    wait_for(
        "re-placement under way",
        lambda: (
            len([p for p in pods(ns, "crash") if p["metadata"].get("deletionTimestamp")]) > 0
            or len(pods(ns, "crash")) < 16
        ),
        timeout=30,
        interval=0.02,
    )
    operator.kill()
    time.sleep(0.5)
    operator.start()
    got = wait_for("Ready at 11 after restart", lambda: converged(ns, "crash"), timeout=180)
    assert len(pods(ns, "crash")) == 11 and got["table"].version > v1


def test_delete_pool_garbage_collects(ns, operator):
    apply(pool_manifest("gc"), ns)
    wait_for("pool Ready", lambda: converged(ns, "gc"), timeout=90)
    kubectl("delete", "expertpool", "gc", "-n", ns, "--wait=false")
    wait_for("pool gone", lambda: get("expertpool", "gc", ns) is None, timeout=60)
    wait_for("pods gone", lambda: pods(ns, "gc") == [], timeout=60)
    wait_for(
        "routing table gone", lambda: get("configmap", "gc-routing-table", ns) is None, timeout=60
    )
