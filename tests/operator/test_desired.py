"""Pure desired-state logic: pods, placement coverage, pod plans, routing tables, status."""

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
    client_command,
    compute_placement,
    coverage,
    desired_server_pods,
    fleet_deployment,
    fleet_service,
    fleet_status,
    next_routing_table,
    parse_expert_load,
    placement_revision,
    plan_pods,
    pool_status,
    server_command,
)
from eaas.runtime.tables.expert_spec import parse_expert_spec

OWNER = Owner(kind="ExpertPool", name="tiny", namespace="ns", uid="uid-1", generation=3)


def make_spec(**over):
    base = {
        "model": {
            "uri": "/models/tiny",
            "firstMoeLayer": 1,
            "numMoeLayers": 3,
            "numExperts": 32,
        },
        "replicas": 4,
    }
    base.update(over)
    return ExpertPoolSpec.model_validate(base)


def desired_for(spec, owner=OWNER):
    p = compute_placement(spec)
    return p, desired_server_pods(owner, spec, p, placement_revision(spec))


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


# ---- pod plans ---------------------------------------------------------------------------------
def observed_from(pods, live=True, **over):
    out = []
    for name, m in pods.items():
        meta = m["metadata"]
        out.append(
            ObservedPod(
                name=name,
                uid=f"u-{name}",
                index=int(meta["labels"]["eaas.io/server-index"]),
                spec_hash=meta["annotations"][ANNOTATION_SPEC_HASH],
                revision=meta["labels"]["eaas.io/placement-revision"],
                experts=tuple(parse_expert_spec(meta["annotations"][ANNOTATION_EXPERTS])),
                ready=live,
                ip=f"127.0.0.{int(meta['labels']['eaas.io/server-index']) + 1}" if live else "",
                phase="Running" if live else "Pending",
                owner_uid=OWNER.uid,
                **over,
            )
        )
    return out


def test_plan_fresh_pool_creates_everything():
    spec = make_spec()
    _, pods = desired_for(spec)
    plan = plan_pods(pods, [], max_unavailable=1)
    assert [m["metadata"]["name"] for m in plan.create] == list(pods)
    assert not plan.delete and not plan.forced


def test_plan_converged_pool_is_idle():
    _, pods = desired_for(make_spec())
    plan = plan_pods(pods, observed_from(pods), max_unavailable=1)
    assert plan.idle and not plan.outdated and not plan.excess


def test_plan_replaces_failed_and_waits_for_terminating():
    _, pods = desired_for(make_spec())
    obs = observed_from(pods)
    obs[1] = ObservedPod(**{**obs[1].__dict__, "phase": "Failed", "ready": False})
    obs[2] = ObservedPod(**{**obs[2].__dict__, "terminating": True})
    del obs[3]
    plan = plan_pods(pods, obs, max_unavailable=1)
    assert [m["metadata"]["name"] for m in plan.create] == ["tiny-3"]
    assert plan.delete == [("tiny-1", "u-tiny-1", "failed")]
    assert plan.waiting == ["tiny-2"]


def test_plan_never_waits_on_a_hung_outdated_pod():
    """A not-ready pod (hung, SIGSTOPped) must not block a re-placement. Two
    outdated pods (image change), one of them not Ready: with room for one unavailable server,
    the hung one is replaced at once and does not use up the budget of the healthy one."""
    spec = make_spec()
    _, old = desired_for(make_spec(image="old:1"))
    obs = observed_from(old)
    obs[1] = ObservedPod(**{**obs[1].__dict__, "ready": False})  # hung: Running, not Ready
    _, new = desired_for(spec)
    plan = plan_pods(new, obs, max_unavailable=1)
    deleted = {n for n, _, _ in plan.delete}
    assert "tiny-1" in deleted
    assert not plan.forced
    # the healthy outdated pods wait for the hung one's replacement (budget used by tiny-1)
    assert deleted == {"tiny-1"}


def test_plan_relabels_unchanged_pods_after_revision_change():
    spec = make_spec(replicas=4, redundancy=1)
    _, pods = desired_for(spec)
    obs = [ObservedPod(**{**p.__dict__, "revision": "old"}) for p in observed_from(pods)]
    plan = plan_pods(pods, obs, max_unavailable=1)
    assert sorted(plan.relabel) == sorted((n, placement_revision(spec)) for n in pods)
    assert not plan.delete


def desired_from(spec, observed):
    """What the operator's reconcile step computes: placement incrementally from the pods."""
    p = compute_placement(spec, None, observed)
    return desired_server_pods(OWNER, spec, p, placement_revision(spec))


def simulate(old_spec, new_spec, max_steps=200, state=None, tables=None):
    """Drive plan_pods like the operator does (desired placement recomputed from the observed
    pods every step), pods becoming live one step after creation. Returns (steps, gaps, forced,
    state): gaps counts non-forced steps that left more experts without a live replica than
    before; forced counts forced steps. ``tables`` collects every routing table published."""
    if state is None:
        _, old = desired_for(old_spec)
        state = {p.name: p for p in observed_from(old)}
    gaps = forced = prev_uncovered = 0
    for step in range(max_steps):
        obs = list(state.values())
        desired = desired_from(new_spec, obs)
        plan = plan_pods(desired, obs, max_unavailable=max(1, new_spec.redundancy - 1))
        if plan.idle and not plan.outdated and not plan.excess and all(p.live for p in obs):
            return step, gaps, forced, state
        # pods created last step become live; deleted ones vanish
        state = {
            n: (
                p
                if p.live
                else ObservedPod(
                    **{
                        **p.__dict__,
                        "ready": True,
                        "phase": "Running",
                        "ip": f"127.0.0.{p.index + 1}",
                    }
                )
            )
            for n, p in state.items()
        }
        for name, _, _ in plan.delete:
            state.pop(name, None)
        for name, rev in plan.relabel:
            state[name] = ObservedPod(**{**state[name].__dict__, "revision": rev})
        for m in plan.create:
            state[m["metadata"]["name"]] = observed_from({m["metadata"]["name"]: m}, live=False)[0]
        live = [p for p in state.values() if p.live]
        table = build_routing_table(new_spec, live, 1)
        if tables is not None:
            tables.append(table)
        uncovered = coverage(table, 1)[2]
        forced += plan.forced
        if uncovered > prev_uncovered and not plan.forced:
            gaps += 1
        prev_uncovered = uncovered
    raise AssertionError("did not converge")


@pytest.mark.parametrize(
    "old,new,r",
    [
        (4, 6, 2),
        (4, 5, 2),
        (6, 3, 2),
        (5, 7, 3),
        (7, 2, 2),
        (3, 13, 2),
        (4, 4, 1),
        (2, 3, 2),
        (3, 2, 2),
        (9, 8, 2),
        (32, 33, 2),
    ],
)
def test_rescale_converges_to_exact_placement(old, new, r):
    old_spec = make_spec(replicas=old, redundancy=min(r, old))
    new_spec = make_spec(replicas=new, redundancy=min(r, new))
    steps, gaps, forced, _ = simulate(old_spec, new_spec)
    assert (
        steps <= 4 * max(old, new) + 2
    )  # ~one delete, one create, one ready step per replaced server
    assert gaps == 0
    assert forced <= 2, "forced deletions should be rare"


def test_plan_scale_down_removes_excess_only_when_safe():
    _, old = desired_for(make_spec(replicas=6))
    spec = make_spec(replicas=6)
    _, desired = desired_for(spec)
    obs = observed_from(old)
    # pretend the desired set is only 0..4 while pod 5 is still live and up to date
    desired.pop("tiny-5")
    plan = plan_pods(desired, obs, max_unavailable=1)
    assert ("tiny-5", "u-tiny-5", "excess") in plan.delete
    assert plan.excess == ["tiny-5"]

    # unsafe: the other replicas of pod 5's experts are on pods that are not live (starting
    # after a crash); deleting pod 5 would leave those experts without a live replica
    only5 = set(obs[5].experts)
    partners = {p.name for p in obs[:5] if only5 & set(p.experts)}
    assert partners
    unsafe = [
        ObservedPod(**{**p.__dict__, "ready": False, "phase": "Pending"})
        if p.name in partners
        else p
        for p in obs
    ]
    plan = plan_pods(desired, unsafe, max_unavailable=1)
    assert plan.excess == ["tiny-5"]
    assert all(name != "tiny-5" for name, _, _ in plan.delete)
    assert not plan.forced


@pytest.mark.elastic
def test_scale_by_one_changes_only_the_new_server():
    old_spec = make_spec(replicas=8, model={**BIG_MODEL})
    _, old = desired_for(old_spec)
    obs = observed_from(old)
    new = desired_from(make_spec(replicas=9, model={**BIG_MODEL}), obs)
    assert set(new) - set(old) == {"tiny-8"}

    def hashes(pods):
        return {n: m["metadata"]["annotations"][ANNOTATION_SPEC_HASH] for n, m in pods.items()}

    assert {n for n in old if hashes(old)[n] != hashes(new)[n]} == set()
    plan = plan_pods(new, obs, max_unavailable=1)
    assert [m["metadata"]["name"] for m in plan.create] == ["tiny-8"] and not plan.delete


BIG_MODEL = {
    "uri": "/models/big",
    "firstMoeLayer": 1,
    "numMoeLayers": 3,
    "numExperts": 256,
}


@pytest.mark.elastic
def test_scale_3_7_5_never_publishes_an_uncovered_table():
    """Every intermediate routing table of a 3 -> 7 -> 5 scale of a 256-expert pool covers
    every (layer, expert) with a live replica (before the fix: 707, 849, 1273 were uncovered)."""
    spec = {n: make_spec(replicas=n, model=dict(BIG_MODEL)) for n in (3, 7, 5)}
    tables: list = []
    steps1, gaps1, forced1, state = simulate(spec[3], spec[7], tables=tables)
    steps2, gaps2, forced2, state = simulate(spec[7], spec[5], state=state, tables=tables)
    assert len(tables) == steps1 + steps2 >= 2
    for i, t in enumerate(tables):
        assert t.uncovered() == [], f"table {i} leaves {len(t.uncovered())} experts uncovered"
    assert forced1 == forced2 == 0 and gaps1 == gaps2 == 0
    assert sorted(state) == [f"tiny-{i}" for i in range(5)]
    final = build_routing_table(spec[5], list(state.values()), 1)
    assert coverage(final, 2)[1:] == (0, 0)


def test_expert_load_parsing():
    spec = make_spec(placement={"policy": "load-balanced", "slotsPerServer": 20})
    load = parse_expert_load('{"layers": {"1": ' + str([1.0] * 31 + [50]) + "}}", spec)
    assert load[(1, 31)] == 50.0 and len(load) == 32
    for bad, match in [
        ("nope", "JSON"),
        ('{"layers": {"9": []}}', "not a MoE layer"),
        ('{"layers": {"1": [1, 2]}}', "32 loads"),
        ('{"layers": {"1": ' + str([1] * 31 + [-1]) + "}}", r"layers\['1'\]\[31\]"),
        ("[]", "layers"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_expert_load(bad, spec)
    # a hot expert gets more replicas from the load
    p = compute_placement(spec, load)
    assert len(p.replicas()[(1, 31)]) > len(p.replicas()[(1, 0)])


def test_generated_command_lines_parse_with_the_real_cli():
    """The operator's server and client command lines are accepted by the real ``eaas`` CLI
    (a renamed or misspelt flag fails here, not in a pod)."""
    import typer

    from eaas.cli import app

    root = typer.main.get_command(app)
    spec = make_spec()
    placement = compute_placement(spec)
    fleet = AttentionFleetSpec.model_validate(
        {"expertPoolRef": {"name": "tiny"}, "model": {"uri": "/models/tiny"}}
    )
    cmds = [
        server_command(spec, "tiny-0", placement.servers[0]),
        client_command(fleet, spec),
        client_command(fleet, None),
    ]
    for cmd in cmds:
        assert cmd[0] == "eaas"
        ctx = root.make_context("eaas", list(cmd[1:]), resilient_parsing=False)
        sub = root.get_command(ctx, cmd[1])
        assert sub is not None, cmd[1]
        sub_ctx = sub.make_context(cmd[1], list(cmd[2:]))
        flags = [a for a in cmd[2:] if a.startswith("--")]
        assert flags and all(any(f in p.opts for p in sub.params) for f in flags), flags
        assert sub_ctx.params  # parsed values
        typo = [a.replace("--model", "--modle") for a in cmd[2:]]
        with pytest.raises(Exception, match="No such option: --modle"):
            sub.make_context(cmd[1], typo)


def test_fleet_replicas_get_distinct_client_ids():
    """Every pod of the fleet's Deployment runs with its own ``--client-id`` (frames, metrics,
    failure reports): the pod template's command, expanded as a kubelet does (downward API env,
    ``$(VAR)``), and parsed by the real CLI, gives a distinct, stable integer per pod name."""
    import typer

    from eaas.cli import app
    from eaas.runtime.cli import client_id_of
    from eaas.testbed.pod import command_line, container_env

    owner = Owner("AttentionFleet", "clients", "ns", "fu", 1)
    spec = AttentionFleetSpec.model_validate(
        {"expertPoolRef": {"name": "tiny"}, "replicas": 2, "model": {"uri": "/models/tiny"}}
    )
    template = fleet_deployment(owner, spec, make_spec())["spec"]["template"]
    root = typer.main.get_command(app)
    ids = {}
    for pod_name in ("clients-7d9f8c6b5-abcde", "clients-7d9f8c6b5-fghij"):
        pod = {"metadata": {"name": pod_name, "namespace": "ns"}, "spec": template["spec"]}
        (c,) = template["spec"]["containers"]
        env = container_env(pod, c, "127.1.0.2", "127.0.0.1", {}, lambda kind, name: None)
        cmd = command_line(c, env)
        assert pod_name in cmd
        sub = root.get_command(root.make_context("eaas", cmd[1:]), cmd[1])
        assert sub is not None
        value = sub.make_context(cmd[1], cmd[2:]).params["client_id"]
        ids[pod_name] = client_id_of(value)
    assert len(set(ids.values())) == 2, ids
    assert all(0 <= i < 2**63 for i in ids.values())
    assert client_id_of("clients-7d9f8c6b5-abcde") == ids["clients-7d9f8c6b5-abcde"]  # stable
    assert client_id_of("3") == 3  # an integer stays itself (eaas serve, tests)
    for bad in ("", "-1", str(2**63)):
        with pytest.raises(typer.BadParameter):
            client_id_of(bad)


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
