"""The vLLM plugin's settings (``EAAS_*`` variables, pure) and its no-op when not enabled."""

from __future__ import annotations

import sys

import pytest

from eaas.runtime.options.vllm import ENV, VllmPluginOptions


def test_not_enabled_without_a_routing_table_source():
    assert not VllmPluginOptions.from_env({}).enabled
    assert VllmPluginOptions.from_env({"EAAS_ROUTING_TABLE": "/t.json"}).enabled
    assert VllmPluginOptions.from_env({"EAAS_ROUTING_TABLE_CONFIGMAP": "ns/cm"}).enabled


def test_env_round_trip():
    o = VllmPluginOptions(
        routing_table_configmap="ns/cm",
        push_token_file="/s/token",
        http_port=8001,
        http_host="0.0.0.0",
        failure_report_url="http://op:8081/r",
        dispatch_timeout=2.5,
        client_id="pod-a",
        spin_us=0.0,
    )
    env = o.env()
    assert set(env) <= set(ENV.values())
    assert VllmPluginOptions.from_env(env) == o
    assert VllmPluginOptions().env() == {}  # the defaults need no variable


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"EAAS_DISPATCH_TIMEOUT": "0"}, "EAAS_DISPATCH_TIMEOUT"),
        ({"EAAS_DISPATCH_TIMEOUT": "soon"}, "EAAS_DISPATCH_TIMEOUT"),
        ({"EAAS_HTTP_PORT": "70000"}, "EAAS_HTTP_PORT"),
        ({"EAAS_FAILURE_REPORT_URL": "ftp://x"}, "EAAS_FAILURE_REPORT_URL"),
        ({"EAAS_SPIN_US": "-1"}, "EAAS_SPIN_US"),
        ({"EAAS_CLIENT_ID": "-5"}, "EAAS_CLIENT_ID"),
    ],
)
def test_bad_values_name_the_variable(env, names):
    with pytest.raises(ValueError, match=names):
        VllmPluginOptions.from_env(env)


def test_register_is_a_no_op_when_not_enabled(monkeypatch):
    """vLLM calls the entry point in every process: without a table source it imports neither
    torch's MoE layer nor vLLM (vLLM is not even installed in this venv)."""
    from eaas.vllm import register

    for name in ENV.values():
        monkeypatch.delenv(name, raising=False)
    register()
    assert "eaas.vllm.experts" not in sys.modules


def test_register_refuses_a_bad_variable(monkeypatch):
    from eaas.vllm import register

    monkeypatch.setenv("EAAS_ROUTING_TABLE", "/t.json")
    monkeypatch.setenv("EAAS_DISPATCH_TIMEOUT", "-1")
    with pytest.raises(ValueError, match="EAAS_DISPATCH_TIMEOUT"):
        register()
