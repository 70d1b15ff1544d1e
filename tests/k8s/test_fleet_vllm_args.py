"""``AttentionFleet.spec.vllm.args`` against a real API server: more ``vllm serve`` flags reach
the pods' command after the operator's own; a flag the operator sets (in any spelling vLLM
would take) or ``spec.vllm`` without ``engine: vllm`` is refused at admission by the CRD's
rules, naming the field, and nothing is created.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers.k8s import ROOT, apply, get, wait_for

pytestmark = pytest.mark.vllm

VLLM_FLEET = yaml.safe_load((Path(ROOT) / "deploy/examples/tiny-fleet-vllm.yaml").read_text())


def manifest(name: str, **spec) -> dict:
    """The example vLLM fleet (deploy/examples/tiny-fleet-vllm.yaml) named ``name``."""
    m = json.loads(json.dumps(VLLM_FLEET))
    m["metadata"]["name"] = name
    m["spec"].update(spec)
    return m


@pytest.mark.parametrize(
    "spec,message",
    [
        ({"vllm": {"args": ["--port", "9"]}}, "spec.vllm.args[0]"),
        ({"vllm": {"args": ["--enforce-eager", "--host=0.0.0.0"]}}, "spec.vllm.args[1]"),
        ({"vllm": {"args": ["--scheduler_cls", "x.Y"]}}, "must not set a flag the operator"),
        ({"vllm": {"args": ["--sched", "x.Y"]}}, "must not set a flag the operator"),
        ({"vllm": {"args": ["--dtype=bfloat16"]}}, "must not set a flag the operator"),
        ({"vllm": {"args": ["--"]}}, "nor be a bare --"),
        ({"vllm": {"args": "--enforce-eager"}}, "spec.vllm.args"),
        (
            {"engine": "eaas", "vllm": {"args": ["--enforce-eager"]}},
            "spec.vllm needs spec.engine vllm",
        ),
    ],
    ids=["port", "hostEq", "underscore", "abbrev", "dtype", "bareDashes", "notAList", "engineEaas"],
)
def test_owned_flags_and_other_engines_are_refused(ns, spec, message):
    r = apply(manifest("bad", **spec), ns, check=False)
    assert r.returncode != 0, "the API server accepted an invalid spec"
    assert message in r.stderr, r.stderr
    assert get("attentionfleet", "bad", ns) is None


def test_args_follow_the_operators_flags_in_the_pods_command(ns, operator):
    args = ["--max-model-len", "256", "--enable-prefix-caching", "--model-impl=vllm"]
    apply(manifest("extra", vllm={"args": args}), ns)
    dep = wait_for("deployment", lambda: get("deployment", "extra", ns), timeout=60)
    [c] = dep["spec"]["template"]["spec"]["containers"]
    assert c["command"][:2] == ["vllm", "serve"]
    assert c["command"][-len(args) :] == args, c["command"]
    assert "--scheduler-cls" in c["command"] and "--middleware" in c["command"]
