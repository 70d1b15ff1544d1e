"""A pool scaled down is not Ready while servers beyond ``spec.replicas`` still run: a new
``spec.replicas`` is acted on once it settled (:mod:`eaas.operator.drain`), and in that window
the step's plan still wants every old server. (The scale bench's ``scale -> 64`` read Ready
within 2 s with all 256 servers still running.)"""

from __future__ import annotations

import pytest

from eaas.operator.crd import ANNOTATION_EXPERTS, ANNOTATION_SPEC_HASH, ExpertPoolSpec
from eaas.operator.desired import (
    ObservedPod,
    Owner,
    compute_placement,
    desired_server_pods,
    next_routing_table,
    placement_revision,
    plan_pods,
    pool_status,
)
from eaas.runtime.tables.expert_spec import parse_expert_spec

pytestmark = pytest.mark.scale

OWNER = Owner(kind="ExpertPool", name="tiny", namespace="ns", uid="uid-1", generation=4)


def _spec(replicas: int) -> ExpertPoolSpec:
    model = {"uri": "/models/tiny", "firstMoeLayer": 1, "numMoeLayers": 3, "numExperts": 32}
    return ExpertPoolSpec.model_validate({"model": model, "replicas": replicas})


def _live(pods: dict) -> list[ObservedPod]:
    out = []
    for name, m in pods.items():
        meta = m["metadata"]
        index = int(meta["labels"]["eaas.io/server-index"])
        out.append(
            ObservedPod(
                name=name,
                uid=f"u-{name}",
                index=index,
                spec_hash=meta["annotations"][ANNOTATION_SPEC_HASH],
                revision=meta["labels"]["eaas.io/placement-revision"],
                experts=tuple(parse_expert_spec(meta["annotations"][ANNOTATION_EXPERTS])),
                ready=True,
                ip=f"127.0.0.{index + 1}",
                phase="Running",
                owner_uid=OWNER.uid,
            )
        )
    return out


def _status(wanted: ExpertPoolSpec, acted: ExpertPoolSpec, observed: list[ObservedPod]) -> dict:
    placement = compute_placement(acted)
    desired = desired_server_pods(OWNER, acted, placement, placement_revision(acted))
    table, _ = next_routing_table(acted, observed, None)
    return pool_status(
        owner=OWNER,
        spec=wanted,
        placement=placement,
        revision=placement_revision(acted),
        observed=observed,
        plan=plan_pods(desired, observed, max_unavailable=1),
        table=table,
        old_conditions=[],
        now="T",
    )


def test_a_scale_down_not_acted_on_yet_is_not_ready():
    before = _spec(4)
    pods = desired_server_pods(OWNER, before, compute_placement(before), placement_revision(before))
    observed = _live(pods)
    # spec.replicas 4 -> 2, still settling: the step acts on 4, the status judges against 2
    st = _status(_spec(2), before, observed)
    cond = {c["type"]: c for c in st["conditions"]}
    assert cond["Ready"]["status"] == "False", cond["Ready"]
    assert "2 beyond spec.replicas" in cond["Ready"]["message"]
    assert cond["Progressing"]["reason"] == "ScalingDown"
    assert st["replicas"] == 4
    # the same servers at the old count: Ready (nothing beyond spec.replicas)
    st = _status(before, before, observed)
    assert {c["type"]: c["status"] for c in st["conditions"]}["Ready"] == "True"
