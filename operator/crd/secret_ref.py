"""``AttentionFleet.spec.apiKeySecret``: the Secret whose key holds the API keys of the fleet's
OpenAI API. The operator never reads it: the client pods get the value from the kubelet
(``env[].valueFrom.secretKeyRef``), so neither the key nor any read access to Secrets is in the
operator's hands.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from eaas.operator.crd.base import DNS1123_SUBDOMAIN, CrdModel

#: The env var the attention clients read their API keys from (comma-separated; the same as
#: ``eaas attention-client --api-key``).
API_KEY_ENV = "EAAS_API_KEY"
#: The env var ``vllm serve`` reads its API key from (``engine: vllm`` fleets; one key).
VLLM_API_KEY_ENV = "VLLM_API_KEY"
#: A Secret's data key (core/v1 validation: letters, digits, ``-``, ``_``, ``.``).
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"


class ApiKeySecretRef(CrdModel):
    """A key of a Secret in the fleet's namespace whose value is the API key (several:
    comma-separated). Every attention-client pod gets it as ``EAAS_API_KEY`` (a
    ``secretKeyRef``, never the value in the pod spec); requests to ``/v1/*``, ``/tokenize``
    and ``/detokenize`` then need ``Authorization: Bearer <key>``. A missing Secret or key
    keeps the pods from starting (``CreateContainerConfigError``) instead of serving without
    a key."""

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS1123_SUBDOMAIN,
        description="Name of the Secret (in the fleet's namespace).",
    )
    key: str = Field(
        default="api-key",
        min_length=1,
        max_length=253,
        pattern=SECRET_KEY_PATTERN,
        description="Key in the Secret's data holding the API key(s), comma-separated.",
    )

    def env(self, name: str = API_KEY_ENV) -> dict[str, Any]:
        """The container's core/v1 EnvVar ``name`` (``EAAS_API_KEY``; ``VLLM_API_KEY`` for
        ``engine: vllm``, where vLLM takes one key) from the Secret's key."""
        return {
            "name": name,
            "valueFrom": {"secretKeyRef": {"name": self.name, "key": self.key}},
        }
