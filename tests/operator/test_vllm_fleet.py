"""AttentionFleet ``spec.engine: vllm`` (pure): the client pods run ``vllm serve`` with the
eaas.vllm plugin configured by its ``EAAS_*`` variables and the plugin's scheduler and
middleware flags; pushes go to the plugin's port; ``spec.vllm.args`` are appended, never a flag
the operator sets."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from eaas.operator.crd import (
    VLLM_OWNED_FLAGS,
    AttentionFleetSpec,
    ExpertPoolSpec,
    owned_vllm_flag,
)
from eaas.operator.desired import Owner, fleet_deployment
from eaas.operator.overlay import OverlayError
from eaas.operator.vllm_fleet import push_port
from eaas.runtime.options.vllm import VllmPluginOptions

OWNER = Owner("AttentionFleet", "clients", "ns", "fu", 1)
MODEL = {"firstMoeLayer": 1, "numMoeLayers": 3, "numExperts": 32}


def fleet(**over) -> AttentionFleetSpec:
    return AttentionFleetSpec.model_validate(
        {"expertPoolRef": {"name": "tiny"}, "model": {"uri": "/models/tiny"}, **over}
    )


def pool(**over) -> ExpertPoolSpec:
    return ExpertPoolSpec.model_validate(
        {"model": {**MODEL, "uri": "/models/tiny"}, "replicas": 4, **over}
    )


def container(spec: AttentionFleetSpec, p: ExpertPoolSpec | None = None) -> dict:
    dep = fleet_deployment(OWNER, spec, p, "http://op.eaas-system.svc:8081")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def test_engine_defaults_to_eaas_and_refuses_others():
    assert fleet().engine == "eaas"
    assert container(fleet())["command"][1] == "attention-client"
    with pytest.raises(ValidationError, match="engine"):
        fleet(engine="sglang")


def test_vllm_pods_run_vllm_serve_with_the_plugin_env():
    spec = fleet(engine="vllm", port=9000)
    c = container(spec, pool(failureDetection={"dispatchTimeoutMs": 2500}))
    assert c["name"] == "attention-client"  # the overlay's container name stays
    assert c["command"][:3] == ["vllm", "serve", "/models/tiny"]
    assert c["command"][c["command"].index("--port") + 1] == "9000"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert [e["name"] for e in c["env"]][0] == "EAAS_POD_NAME"  # expanded into the client id
    opts = VllmPluginOptions.from_env({k: v for k, v in env.items() if v is not None})
    assert opts.enabled
    assert opts.routing_table_configmap == "ns/tiny-routing-table"
    assert opts.push_token_file and opts.push_token_file.startswith("/")
    assert opts.http_port == 9001 == push_port(spec)
    assert opts.http_host == "0.0.0.0"
    assert opts.dispatch_timeout == 2.5
    assert opts.client_id == "$(EAAS_POD_NAME)"
    assert opts.failure_report_url == "http://op.eaas-system.svc:8081/v1/failure-reports/ns/clients"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 9000, "eaas": 9001}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 9000}  # vLLM's


def test_push_port_is_the_api_port_for_eaas():
    assert push_port(fleet(port=8000)) == 8000
    assert push_port(fleet(engine="vllm", port=8000)) == 8001


def test_vllm_engine_refuses_what_it_cannot_run():
    with pytest.raises(OverlayError, match="port"):
        container(fleet(engine="vllm", port=65535))


def test_the_example_fleet_is_a_vllm_fleet():
    from pathlib import Path

    import yaml

    doc = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "deploy/examples/tiny-fleet-vllm.yaml").read_text()
    )
    spec = AttentionFleetSpec.model_validate(doc["spec"])
    c = container(spec)
    assert spec.engine == "vllm" and c["command"][:2] == ["vllm", "serve"]
    assert {"name": "VLLM_MLA_DISABLE", "value": "1"} in c["env"]  # the overlay merged in
    assert spec.vllm is not None and c["command"][-len(spec.vllm.args) :] == spec.vllm.args


def test_vllm_args_follow_the_operators_flags():
    args = ["--max-model-len", "8192", "--enable-prefix-caching", "--model-impl=vllm"]
    c = container(fleet(engine="vllm", vllm={"args": args}))
    assert c["command"][-len(args) :] == args
    assert c["command"][: -len(args)] == container(fleet(engine="vllm"))["command"]
    assert fleet(engine="vllm").vllm is None  # no field: the operator's flags alone


def test_every_flag_the_operator_sets_is_owned():
    spec = fleet(engine="vllm", apiKeySecret={"name": "keys"})
    flags = [a for a in container(spec)["command"] if a.startswith("--")]
    assert flags and set(flags) <= set(VLLM_OWNED_FLAGS), set(flags) - set(VLLM_OWNED_FLAGS)
    assert {"--model", "--api-key"} <= set(VLLM_OWNED_FLAGS)  # spec.model, spec.apiKeySecret


@pytest.mark.parametrize(
    "arg,flag",
    [
        ("--port", "--port"),
        ("--port=9", "--port"),
        ("--host", "--host"),
        ("--scheduler_cls", "--scheduler-cls"),  # vLLM reads _ as -
        ("--sched", "--scheduler-cls"),  # an abbreviation argparse would take
        ("--dtype=bfloat16", "--dtype"),
        ("--served-model-name", "--served-model-name"),
        ("--middleware", "--middleware"),
        ("--api-key=k", "--api-key"),
        ("--model", "--model"),
        ("--", "--"),
    ],
)
def test_owned_flags_are_refused_naming_the_field(arg, flag):
    assert owned_vllm_flag(arg) == flag
    with pytest.raises(OverlayError, match=r"spec\.vllm\.args: .* sets " + flag):
        container(fleet(engine="vllm", vllm={"args": ["--enforce-eager", arg]}))


@pytest.mark.parametrize("arg", ["8192", "--max-model-len", "--model-impl", "--hf-token", "-O3"])
def test_other_flags_and_values_are_not_owned(arg):
    assert owned_vllm_flag(arg) is None


def test_vllm_settings_need_engine_vllm():
    with pytest.raises(OverlayError, match="spec.vllm needs spec.engine vllm"):
        container(fleet(vllm={"args": ["--enforce-eager"]}))
    with pytest.raises(ValidationError, match="args"):
        fleet(engine="vllm", vllm={"args": "--enforce-eager"})  # a list, not a string


def test_the_crd_rules_name_the_fields():
    from eaas.operator.crd import attentionfleet_crd

    spec = attentionfleet_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = spec["properties"]["spec"]
    assert {
        "rule": "!has(self.vllm) || self.engine == 'vllm'",
        "message": "spec.vllm needs spec.engine vllm",
        "fieldPath": ".vllm",
    } in spec["x-kubernetes-validations"]
    item = spec["properties"]["vllm"]["properties"]["args"]["items"]
    (rule,) = item["x-kubernetes-validations"]
    assert rule["message"].startswith("spec.vllm.args must not set a flag the operator sets")
    assert all(f"'{f}'" in rule["rule"] for f in VLLM_OWNED_FLAGS)
    assert item["maxLength"] and spec["properties"]["vllm"]["properties"]["args"]["maxItems"]
