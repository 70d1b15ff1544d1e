"""Pure desired-state logic: pods, placement coverage, routing tables, status, fleets. Pod plans:
test_pod_plans.py."""

from __future__ import annotations

import itertools

import pytest

from eaas.operator.crd import (
    ANNOTATION_EXPERTS,
    ANNOTATION_SPEC_HASH,
    AttentionFleetSpec,
    ExpertPoolSpec,
)
from eaas.operator.desired import (
    ObservedPod,
    Owner,
    PodPlan,
    build_routing_table,
    compute_placement,
    coverage,
    fleet_deployment,
    fleet_service,
    fleet_status,
    next_routing_table,
    placement_revision,
    plan_pods,
    pool_status,
)
from eaas.runtime.tables.expert_spec import parse_expert_spec

from helpers.desired import OWNER, desired_for, make_spec, observed_from


# ---- pods --------------------------------------------------------------------------------------
def test_server_pod_shape():
    spec = make_spec(gpusPerServer=2)
    placement, pods = desired_for(spec)
    assert list(pods) == ["tiny-0", "tiny-1", "tiny-2", "tiny-3"]
    pod = pods["tiny-2"]
    meta = pod["metadata"]
    assert meta["labels"]["eaas.io/pool"] == "tiny"
    assert meta["labels"]["eaas.io/server-index"] == "2"
    assert meta["labels"]["eaas.io/role"] == "expert-server"
    assert meta["labels"]["eaas.io/placement-revision"] == placement_revision(spec)
    (ref,) = meta["ownerReferences"]
    assert ref == {
        "apiVersion": "eaas.io/v1alpha1",
        "kind": "ExpertPool",
        "name": "tiny",
        "uid": "uid-1",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    (c,) = pod["spec"]["containers"]
    cmd = c["command"]
    assert cmd[:2] == ["eaas", "expert-server"]
    flags = dict(zip(cmd[2::2], cmd[3::2], strict=False))
    assert flags == {
        "--model": "/models/tiny",
        "--server-id": "tiny-2",
        "--experts": meta["annotations"][ANNOTATION_EXPERTS],
        "--listen": "tcp://0.0.0.0:9000",
        "--http-port": "9001",
    }
    assert parse_expert_spec(flags["--experts"]) == list(placement.servers[2])
    # /health of the serving loop is the startup, readiness AND liveness probe (a SIGSTOPped
    # server keeps accepting TCP connections; only the loop's heartbeat shows it is hung)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": 9001}, probe
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 300
    assert "env" not in c  # no env var nothing reads
    assert "volumes" not in pod["spec"]  # weights in the image
    for part in ("requests", "limits"):
        assert c["resources"][part]["nvidia.com/gpu"] == "2"
        assert c["resources"][part]["rdma/ib"] == "1"
    assert pod["spec"]["nodeSelector"] == {"eaas.io/rdma": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"][
        "tolerations"
    ]


def test_server_pod_merges_user_resources_and_custom_rdma():
    spec = make_spec(
        resources={"requests": {"cpu": "2"}, "limits": {"memory": "4Gi"}},
        rdmaResource="rdma/roce",
        nodeSelector={"pool": "a"},
        affinity={"nodeAffinity": {}},
    )
    _, pods = desired_for(spec)
    c = pods["tiny-0"]["spec"]["containers"][0]
    assert c["resources"]["requests"] == {"cpu": "2", "nvidia.com/gpu": "1", "rdma/roce": "1"}
    assert c["resources"]["limits"] == {"memory": "4Gi", "nvidia.com/gpu": "1", "rdma/roce": "1"}
    assert pods["tiny-0"]["spec"]["nodeSelector"] == {"pool": "a"}
    assert pods["tiny-0"]["spec"]["affinity"] == {"nodeAffinity": {}}
    no_rdma = desired_for(make_spec(rdmaResource=""))[1]["tiny-0"]["spec"]["containers"][0][
        "resources"
    ]
    assert no_rdma["limits"] == {"nvidia.com/gpu": "1"}


def test_revision_and_hash_track_the_right_inputs():
    a = make_spec()
    assert placement_revision(a) == placement_revision(make_spec(image="other:1"))
    assert placement_revision(a) != placement_revision(make_spec(replicas=5))
    assert placement_revision(a) != placement_revision(make_spec(redundancy=3))
    assert placement_revision(a) != placement_revision(
        make_spec(placement={"policy": "load-balanced"})
    )
    assert placement_revision(a) != placement_revision(make_spec(placement={"slotsPerServer": 20}))
    h = lambda s: desired_for(s)[1]["tiny-0"]["metadata"]["annotations"][ANNOTATION_SPEC_HASH]  # noqa: E731
    assert h(a) == h(make_spec())
    assert h(a) != h(make_spec(image="other:1"))


# ---- placement coverage ----------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["round-robin", "load-balanced"])
@pytest.mark.parametrize(
    "servers,redundancy",
    [
        (s, r)
        for s, r in itertools.product([1, 2, 3, 5, 6, 7, 9, 13, 31, 33, 40], [1, 2, 3])
        if r <= s
    ],
)
def test_every_expert_on_redundancy_distinct_servers(policy, servers, redundancy):
    spec = make_spec(replicas=servers, redundancy=redundancy, placement={"policy": policy})
    placement, pods = desired_for(spec)
    live = [
        ObservedPod(
            name=n,
            index=i,
            experts=tuple(parse_expert_spec(m["metadata"]["annotations"][ANNOTATION_EXPERTS])),
            ready=True,
            ip=f"127.0.0.{i + 1}",
            phase="Running",
        )
        for i, (n, m) in enumerate(pods.items())
    ]
    table = build_routing_table(spec, live, 1)
    for layer in (1, 2, 3):
        for e in range(32):
            reps = table.replicas(layer, e)
            assert len(reps) >= redundancy and len(set(reps)) == len(reps), (layer, e, reps)
    assert coverage(table, redundancy) == (96, 0, 0)
    eps = placement.experts_per_server()
    # the automatic slot budget: every server holds ceil(E*R/N) per layer (extras for hot ones)
    slots = min(32, -(-32 * redundancy // servers))
    assert eps == [3 * slots] * servers


def test_deepseek_v3_on_40_servers():
    spec = ExpertPoolSpec.model_validate(
        {
            "model": {
                "uri": "/m",
                "firstMoeLayer": 3,
                "numMoeLayers": 58,
                "numExperts": 256,
            },
            "replicas": 40,
            "redundancy": 2,
        }
    )
    p = compute_placement(spec)
    assert p.num_servers == 40 and p.experts_below_redundancy() == 0
    assert p.experts_per_server() == [13 * 58] * 40  # ceil(256 * 2 / 40) per layer
    # any single server may die: no expert loses its last replica
    reps = p.replicas()
    for dead in range(40):
        assert all(set(v) - {dead} for v in reps.values()), dead


# ---- routing table -------------------------------------------------------------------------------
def test_routing_table_versions_strictly_increase():
    spec = make_spec()
    _, pods = desired_for(spec)
    live = observed_from(pods)
    t1, changed = next_routing_table(spec, live, None)
    assert changed and t1.version == 1
    same, changed = next_routing_table(spec, live, t1, floor_version=1)
    assert not changed and same is t1
    t2, changed = next_routing_table(spec, live[1:], t1)
    assert changed and t2.version == 2 and "tiny-0" not in t2.servers
    t3, changed = next_routing_table(spec, live, t2, floor_version=9)  # status remembered 9
    assert changed and t3.version == 10
    assert t3.servers["tiny-0"] == "tcp://127.0.0.1:9000"


def test_routing_table_ignores_unknown_layers():
    spec = make_spec()
    pod = ObservedPod(
        name="x-0", index=0, experts=((1, 0), (7, 3)), ready=True, ip="127.0.0.9", phase="Running"
    )
    t = build_routing_table(spec, [pod], 1)
    assert set(t.layers) == {1, 2, 3} and t.replicas(1, 0) == ("x-0",)


# ---- status ------------------------------------------------------------------------------------
def test_status_ready_and_transition_times():
    spec = make_spec()
    placement, pods = desired_for(spec)
    live = observed_from(pods)
    table, _ = next_routing_table(spec, live, None)
    st = pool_status(
        owner=OWNER,
        spec=spec,
        placement=placement,
        revision=placement_revision(spec),
        observed=live,
        plan=PodPlan(),
        table=table,
        old_conditions=[],
        now="T1",
    )
    cond = {c["type"]: c for c in st["conditions"]}
    assert cond["Ready"]["status"] == "True" and cond["Ready"]["lastTransitionTime"] == "T1"
    assert cond["Progressing"]["status"] == "False" and cond["Degraded"]["status"] == "False"
    assert st["readyReplicas"] == 4 and st["replicas"] == 4 and st["updatedReplicas"] == 4
    assert st["selector"] == "eaas.io/pool=tiny,eaas.io/role=expert-server"
    assert st["routingTableVersion"] == 1 and st["observedGeneration"] == 3
    assert (
        st["placement"]["expertsBelowRedundancy"] == 0 and st["placement"]["logicalExperts"] == 96
    )
    assert st["placement"]["expertsPerServerMin"] == st["placement"]["expertsPerServerMax"] == 48
    # unchanged status keeps the old transition time; a flip takes the new one
    st2 = pool_status(
        owner=OWNER,
        spec=spec,
        placement=placement,
        revision=placement_revision(spec),
        observed=live[:3],
        plan=plan_pods(pods, live[:3], 1),
        table=build_routing_table(spec, live[:3], 2),
        old_conditions=st["conditions"],
        now="T2",
    )
    c2 = {c["type"]: c for c in st2["conditions"]}
    assert c2["Ready"]["status"] == "False" and c2["Ready"]["lastTransitionTime"] == "T2"
    assert c2["Progressing"]["reason"] == "ScalingUp"
    assert c2["Degraded"]["status"] == "True" and c2["Degraded"]["reason"] == "BelowRedundancy"
    assert "spec" not in c2["Degraded"]["message"]
    assert st2["readyReplicas"] == 3 and st2["placement"]["expertsBelowRedundancy"] > 0


def test_status_uncovered_when_nothing_is_live():
    spec = make_spec()
    placement, pods = desired_for(spec)
    table, _ = next_routing_table(spec, [], None)
    st = pool_status(
        owner=OWNER,
        spec=spec,
        placement=placement,
        revision="r",
        observed=[],
        plan=plan_pods(pods, [], 1),
        table=table,
        old_conditions=[],
        now="T",
    )
    cond = {c["type"]: c for c in st["conditions"]}
    assert cond["Ready"]["reason"] == "ExpertsUncovered"
    assert cond["Degraded"]["reason"] == "ExpertsUncovered"
    assert st["placement"]["uncoveredExperts"] == 96


# ---- attention fleet ---------------------------------------------------------------------------
def test_fleet_deployment_and_service():
    owner = Owner("AttentionFleet", "clients", "ns", "fu", 1)
    spec = AttentionFleetSpec.model_validate(
        {"expertPoolRef": {"name": "tiny"}, "replicas": 3, "model": {"uri": "/models/tiny"}}
    )
    dep = fleet_deployment(owner, spec, make_spec())
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == [
        "eaas",
        "attention-client",
        "--model",
        "/models/tiny",
        "--client-id",
        "$(EAAS_POD_NAME)",
        "--routing-table-configmap",
        "ns/tiny-routing-table",
        "--push-token-file",
        "/etc/eaas/push-token/token",
        "--port",
        "8000",
        "--host",
        "0.0.0.0",
        "--dispatch-timeout",
        "0.5",
    ]
    assert c["env"] == [
        {"name": "EAAS_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    ]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    pod_spec = dep["spec"]["template"]["spec"]
    assert pod_spec["serviceAccountName"] == "clients-client"
    (vol,) = pod_spec["volumes"]  # no ConfigMap mount: the table comes through the API
    assert vol["secret"]["secretName"] == "clients-push-token"
    assert c["volumeMounts"] == [
        {
            "name": "push-token",
            "mountPath": "/etc/eaas/push-token",
            "readOnly": True,
        }
    ]
    with_reports = fleet_deployment(owner, spec, make_spec(), "http://op.eaas:8081/")
    cmd = with_reports["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--failure-report-url") + 1] == (
        "http://op.eaas:8081/v1/failure-reports/ns/clients"
    )
    assert dep["spec"]["replicas"] == 3
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "fu"
    assert (
        "eaas.io/pool" not in dep["spec"]["template"]["metadata"]["labels"]
    )  # not mistaken for servers
    svc = fleet_service(owner, spec)
    assert svc["spec"]["ports"][0]["port"] == 8000
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    st = fleet_status(
        owner=owner,
        spec=spec,
        deployment_status={"replicas": 3, "readyReplicas": 3, "updatedReplicas": 3},
        pool_found=True,
        table_version=4,
        old_conditions=[],
        now="T",
    )
    assert {c["type"]: c["status"] for c in st["conditions"]} == {
        "Ready": "True",
        "Progressing": "False",
        "Degraded": "False",
    }
    st = fleet_status(
        owner=owner,
        spec=spec,
        deployment_status=None,
        pool_found=False,
        table_version=0,
        old_conditions=[],
        now="T",
    )
    assert {c["type"]: c["reason"] for c in st["conditions"]}["Degraded"] == "ExpertPoolNotFound"


def test_pods_on_a_dead_node_leave_the_table():
    spec = make_spec()
    _, pods = desired_for(spec)
    raw = {
        "metadata": {
            "name": "tiny-0",
            "labels": {"eaas.io/server-index": "0"},
            "annotations": {
                ANNOTATION_EXPERTS: "1:0-3",
                # up to date: only the dead node makes it unusable
                ANNOTATION_SPEC_HASH: pods["tiny-0"]["metadata"]["annotations"][
                    ANNOTATION_SPEC_HASH
                ],
            },
        },
        "spec": {"nodeName": "gpu-node-1"},
        "status": {
            "phase": "Running",
            "podIP": "127.1.1.5",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    assert ObservedPod.from_pod(raw).live
    assert ObservedPod.from_pod(raw, {"gpu-node-0": False}).live
    dead = ObservedPod.from_pod(raw, {"gpu-node-1": False})
    assert dead.node == "gpu-node-1" and not dead.live
    live = [dead] + observed_from(pods)[1:]
    t = build_routing_table(spec, [p for p in live if p.live], 2)
    assert "tiny-0" not in t.servers
    plan = plan_pods(pods, live, max_unavailable=1)
    assert not plan.delete and not plan.create  # not replaced: the node may come back


def test_routing_table_too_large_is_reported():
    from eaas.operator.desired import (
        CONFIGMAP_DATA_LIMIT,
        configmap_too_large,
        routing_table_configmap,
    )

    spec = make_spec()
    placement, pods = desired_for(spec)
    live = observed_from(pods)
    table, _ = next_routing_table(spec, live, None)
    cm = routing_table_configmap(OWNER, table)
    assert configmap_too_large(cm) == ""
    huge = {**cm, "data": {"routing-table.json": "x" * (CONFIGMAP_DATA_LIMIT + 1)}}
    msg = configmap_too_large(huge)
    assert "at most" in msg and str(CONFIGMAP_DATA_LIMIT + 1) in msg
    st = pool_status(
        owner=OWNER,
        spec=spec,
        placement=placement,
        revision="r",
        observed=live,
        plan=PodPlan(),
        table=table,
        old_conditions=[],
        now="T",
        table_error=msg,
    )
    cond = {c["type"]: c for c in st["conditions"]}
    assert cond["Degraded"]["status"] == "True"
    assert cond["Degraded"]["reason"] == "RoutingTableTooLarge"
    assert cond["ReplicasSpread"]["status"] == "True"


def test_replicas_spread_over_the_topology_key():
    spec = make_spec(placement={"topologyKey": "topology.kubernetes.io/zone"})
    placement, pods = desired_for(spec)
    (tsc,) = pods["tiny-0"]["spec"]["topologySpreadConstraints"]
    assert tsc["topologyKey"] == "topology.kubernetes.io/zone"
    live = observed_from(pods)
    # four servers on four nodes, the nodes in two zones: every expert spans both zones?
    nodes = {p.name: f"node-{p.index}" for p in live}
    live = [ObservedPod(**{**p.__dict__, "node": nodes[p.name]}) for p in live]
    table, _ = next_routing_table(spec, live, None)

    def spread(domains):
        st = pool_status(
            owner=OWNER,
            spec=spec,
            placement=placement,
            revision="r",
            observed=live,
            plan=PodPlan(),
            table=table,
            old_conditions=[],
            now="T",
            node_domains=domains,
        )
        return {c["type"]: c for c in st["conditions"]}["ReplicasSpread"]

    one_zone = spread({f"node-{i}": "zone-a" for i in range(4)})
    assert one_zone["status"] == "False" and one_zone["reason"] == "TooFewDomains"
    assert "topology.kubernetes.io/zone" in one_zone["message"]
    # zones split so that servers 0 and 1 share a zone: experts whose replicas are all on
    # servers 0 and 1 (or 2 and 3) are not spread
    split = {"node-0": "a", "node-1": "a", "node-2": "b", "node-3": "b"}
    shared = sum(
        1
        for where in placement.replicas().values()
        if len({split[f"node-{s}"] for s in where}) == 1
    )
    assert shared > 0
    c = spread(split)
    assert c["status"] == "False" and c["reason"] == "SharedDomain"
    assert c["message"].startswith(f"{shared}/96 ")
    assert spread({"node-0": "a", "node-1": "b", "node-2": "a", "node-3": "b"})["status"] == (
        "True"
        if all(
            len({("a", "b", "a", "b")[s] for s in where}) == 2
            for where in placement.replicas().values()
        )
        else "False"
    )
    assert spread(None)["reason"] == "DistinctDomains"  # every node its own domain
