"""The NetworkPolicy of a pool's expert servers (pure): their ports closed to strangers.

An expert server's data port (``spec.port``) takes frames from anyone who connects, and its HTTP
port (``spec.healthPort``) takes routing-table pushes (bearer token) and answers ``/health`` and
``/metrics``. The policy ``<pool>-expert-servers`` (owned by the pool) admits, to the pool's
server pods:

* the data and HTTP ports from the attention clients of the pool's namespace (pods labelled
  ``eaas.io/role: attention-client``: an AttentionFleet uses a pool of its own namespace);
* the HTTP port from the operator's pods in any namespace (``app.kubernetes.io/name:
  eaas-operator``: the Helm chart's pods): pushes, its probe, the expert-load scrape.

Everything else is refused where the cluster's network plugin enforces NetworkPolicies (the
kubelet's probes come from the node and are allowed by every common plugin). A Prometheus that
scrapes the servers' ``/metrics`` needs a policy of its own next to this one (policies add up).
The operator applies it while ``EAAS_OPERATOR_NETWORK_POLICIES`` is on (the default; the chart's
``networkPolicy.enabled``). Not made for an NVSHMEM world (its bootstrap and transport use
ports of their own). The testbed stores NetworkPolicies but has no network plugin to enforce
them.
"""

from __future__ import annotations

from typing import Any

from eaas.operator.crd import ANNOTATION_SPEC_HASH, LABEL_POOL, LABEL_ROLE, ExpertPoolSpec
from eaas.operator.names import CLIENT_ROLE, MANAGED_BY, Owner, content_hash, server_labels
from eaas.operator.pods import world_layout

#: Label of the operator's own pods (the Helm chart's ``app.kubernetes.io/name``).
OPERATOR_POD_LABELS = {
    "app.kubernetes.io/name": "eaas-operator",
    "app.kubernetes.io/component": "operator",
}


def server_policy_name(pool: str) -> str:
    """Name of the pool's NetworkPolicy."""
    return f"{pool}-expert-servers"


def pool_network_policy(owner: Owner, spec: ExpertPoolSpec) -> dict[str, Any] | None:
    """The ``networking.k8s.io/v1`` NetworkPolicy of pool ``owner``'s expert servers (module
    docstring), or None for an NVSHMEM world."""
    if world_layout(spec) is not None:
        return None

    def tcp(port: int) -> dict[str, Any]:
        return {"protocol": "TCP", "port": port}

    policy_spec = {
        "podSelector": {"matchLabels": server_labels(owner.name)},
        "policyTypes": ["Ingress"],
        "ingress": [
            {
                "from": [{"podSelector": {"matchLabels": {LABEL_ROLE: CLIENT_ROLE}}}],
                "ports": [tcp(spec.port), tcp(spec.health_port)],
            },
            {
                "from": [
                    {"namespaceSelector": {}, "podSelector": {"matchLabels": OPERATOR_POD_LABELS}}
                ],
                "ports": [tcp(spec.health_port)],
            },
        ],
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": server_policy_name(owner.name),
            "namespace": owner.namespace,
            "labels": {LABEL_POOL: owner.name, "app.kubernetes.io/managed-by": MANAGED_BY},
            "annotations": {ANNOTATION_SPEC_HASH: content_hash(policy_spec)},
            "ownerReferences": [owner.reference()],
        },
        "spec": policy_spec,
    }
