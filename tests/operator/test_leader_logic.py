"""Leader election decisions and settings (pure)."""

from __future__ import annotations

import pytest

from eaas.operator.leader import LeaseSettings, lease_decision, lease_spec
from eaas.operator.settings import advertise_url


def test_lease_decision():
    assert lease_decision("me", "me", 0.0, 15) == "renew"
    assert lease_decision("", "me", 0.0, 15) == "acquire"  # released by a clean shutdown
    assert lease_decision("other", "me", 14.9, 15) == "wait"  # holder may still be alive
    assert lease_decision("other", "me", 15.0, 15) == "acquire"  # stopped renewing


def test_settings_from_env():
    s = LeaseSettings.from_env({"EAAS_OPERATOR_LEASE_DURATION_S": "3", "POD_NAMESPACE": "eaas"})
    assert s.namespace == "eaas" and s.name == "eaas-operator"
    assert s.lease_duration_s == 3 and s.renew_deadline_s == 2 and s.retry_s == pytest.approx(0.4)
    assert s.renew_deadline_s < s.lease_duration_s  # a leader gives up before a successor acts
    assert LeaseSettings.from_env({"POD_NAME": "op-7"}).identity == "op-7"
    assert LeaseSettings.from_env({"EAAS_OPERATOR_ID": "x", "POD_NAME": "y"}).identity == "x"
    a, b = LeaseSettings.from_env({}), LeaseSettings.from_env({})
    assert a.identity != b.identity and a.namespace == "default"
    with pytest.raises(ValueError, match="EAAS_OPERATOR_LEASE_DURATION_S"):
        LeaseSettings.from_env({"EAAS_OPERATOR_LEASE_DURATION_S": "0"})


def test_lease_spec_keeps_acquire_time_when_renewing():
    s = LeaseSettings(namespace="n", identity="me", lease_duration_s=3)
    first = lease_spec(s, "me", 0, None)
    again = lease_spec(s, "me", 0, first["acquire_time"])
    assert again["acquire_time"] == first["acquire_time"]
    assert again["renew_time"] >= first["renew_time"]
    assert first["lease_duration_seconds"] == 3 and first["holder_identity"] == "me"


def test_advertise_url_for_forwarded_reports():
    assert advertise_url("0.0.0.0:8081", "10.0.0.7") == "http://10.0.0.7:8081"
    assert advertise_url(":8081", "") == "http://127.0.0.1:8081"
    assert advertise_url("127.0.0.1:9000", "10.0.0.7") == "http://127.0.0.1:9000"
    assert advertise_url("[::]:8081", "fd00::5") == "http://[fd00::5]:8081"
    assert advertise_url("", "10.0.0.7") == "" and advertise_url("host", "") == ""
    env = {"EAAS_OPERATOR_REPORT_LISTEN": "0.0.0.0:8081", "POD_IP": "10.1.2.3"}
    assert LeaseSettings.from_env(env).advertise_url == "http://10.1.2.3:8081"
    env["EAAS_OPERATOR_ADVERTISE_URL"] = "http://op:1"
    assert LeaseSettings.from_env(env).advertise_url == "http://op:1"
