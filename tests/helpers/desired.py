"""Shared builders for the operator's pure desired-state tests (tests/operator): an owner, a
validated ``ExpertPoolSpec`` with overrides, its placement and desired pods, and the
``ObservedPod`` list a reconcile would read back for those pods."""

from __future__ import annotations

from eaas.operator.crd import ANNOTATION_EXPERTS, ANNOTATION_SPEC_HASH, ExpertPoolSpec
from eaas.operator.desired import (
    ObservedPod,
    Owner,
    compute_placement,
    desired_server_pods,
    placement_revision,
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
