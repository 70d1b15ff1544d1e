"""``AttentionFleet.spec.apiKeySecret`` in the builder: the client container's ``EAAS_API_KEY``
comes from a ``secretKeyRef`` (no value anywhere in the Deployment); bad references are refused
naming the field (the API server enforces the same schema: tests/k8s/test_fleet_api_key.py)."""

from __future__ import annotations

import json

import pydantic
import pytest

from eaas.operator.crd import API_KEY_ENV, AttentionFleetSpec
from eaas.operator.desired import Owner, fleet_deployment

pytestmark = pytest.mark.api

OWNER = Owner("AttentionFleet", "clients", "ns", "fu", 1)
BASE = {"expertPoolRef": {"name": "tiny"}, "model": {"uri": "/models/tiny"}}


def _container(spec: dict) -> dict:
    dep = fleet_deployment(OWNER, AttentionFleetSpec.model_validate({**BASE, **spec}), None)
    [c] = dep["spec"]["template"]["spec"]["containers"]
    return c


def test_api_key_from_a_secret_key_ref():
    c = _container({"apiKeySecret": {"name": "llm-keys", "key": "keys"}})
    ref = {"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": "llm-keys", "key": "keys"}}}
    assert ref in c["env"]
    assert API_KEY_ENV == "EAAS_API_KEY"
    assert not any("api-key" in a or "api_key" in a for a in c["command"])
    c = _container({"apiKeySecret": {"name": "llm-keys"}})
    assert c["env"][-1]["valueFrom"]["secretKeyRef"] == {"name": "llm-keys", "key": "api-key"}
    assert API_KEY_ENV not in json.dumps(_container({}))


@pytest.mark.parametrize(
    "ref,loc",
    [
        ({"name": "Bad_Name"}, ("apiKeySecret", "name")),
        ({}, ("apiKeySecret", "name")),
        ({"name": "ok", "key": "a/b"}, ("apiKeySecret", "key")),
    ],
)
def test_bad_reference_names_the_field(ref, loc):
    with pytest.raises(pydantic.ValidationError) as e:
        AttentionFleetSpec.model_validate({**BASE, "apiKeySecret": ref})
    assert [err["loc"] for err in e.value.errors()] == [loc]
