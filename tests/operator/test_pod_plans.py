"""Pure pod-plan logic: what a reconcile step creates, deletes and relabels, and rescales simulated
step by step until they converge (never an uncovered routing table on the way)."""

from __future__ import annotations

import pytest

from eaas.operator.crd import (
    ANNOTATION_SPEC_HASH,
    AttentionFleetSpec,
)
from eaas.operator.desired import (
    ObservedPod,
    Owner,
    build_routing_table,
    client_command,
    compute_placement,
    coverage,
    desired_server_pods,
    fleet_deployment,
    parse_expert_load,
    placement_revision,
    plan_pods,
    server_command,
)

from helpers.desired import OWNER, desired_for, make_spec, observed_from


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


@pytest.mark.scale
def test_a_scale_down_replaces_the_servers_that_stay_in_a_few_rounds():
    """256 -> 16 servers: the 240 leaving serve while the 16 that stay are re-placed, so those
    are replaced as many at a time as coverage allows (one at a time before: 49 steps, one
    forced deletion uncovering 3 experts), and every intermediate table covers every expert."""
    tables: list = []
    old, new = (make_spec(replicas=n, model=dict(BIG_MODEL)) for n in (256, 16))
    obs = observed_from(desired_for(old)[1])
    plan = plan_pods(desired_from(new, obs), obs, max_unavailable=1)
    replaced = [n for n, _, why in plan.delete if why == "outdated"]
    assert len(replaced) > 1  # more than max_unavailable: the 240 leaving serve meanwhile
    assert len(obs) - len(plan.delete) >= 16 - 1  # never fewer live than desired - 1
    steps, gaps, forced, state = simulate(old, new, tables=tables)
    assert steps <= 16 and gaps == forced == 0
    assert all(t.uncovered() == [] for t in tables)
    assert sorted(state, key=lambda n: int(n.rsplit("-", 1)[1])) == [f"tiny-{i}" for i in range(16)]
    assert coverage(build_routing_table(new, list(state.values()), 1), 2)[1:] == (0, 0)
