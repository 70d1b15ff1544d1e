"""A pool's NetworkPolicy (:mod:`eaas.operator.network_policy`) applied by its reconcile step,
or, with ``EAAS_OPERATOR_NETWORK_POLICIES=false``, the one the operator made deleted. Checked
again at most every ``RBAC_RECHECK_S`` per spec (a deleted or edited policy is repaired then)."""

from __future__ import annotations

import time
from typing import Any

import kopf
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from eaas.operator.crd import ExpertPoolSpec
from eaas.operator.kube import apply
from eaas.operator.names import MANAGED_BY, Owner
from eaas.operator.network_policy import pool_network_policy, server_policy_name
from eaas.operator.reconcile.load import RBAC_RECHECK_S
from eaas.operator.state import OperatorState


def ensure_network_policy(
    state: OperatorState, owner: Owner, spec: ExpertPoolSpec, logger: kopf.Logger
) -> None:
    """Apply (or, turned off, delete) the pool's NetworkPolicy.

    Raises:
        ApiException: any API error but 404 on reads and deletes.
    """
    want: dict[str, Any] | None = None
    if state.settings.network_policies:
        want = pool_network_policy(owner, spec)
    name = server_policy_name(owner.name)
    digest = want["metadata"]["annotations"] if want is not None else {"off": "1"}
    key = (owner.namespace, "NetworkPolicy", name, str(sorted(digest.items())))
    if time.monotonic() - state.applied.get(key, -1e18) < RBAC_RECHECK_S:
        return
    net = k8s.NetworkingV1Api(state.api())
    if want is not None:
        apply(
            want,
            read=lambda: net.read_namespaced_network_policy(name, owner.namespace),
            patch=lambda m, **o: net.patch_namespaced_network_policy(name, owner.namespace, m, **o),
        )
    else:
        try:
            live = net.read_namespaced_network_policy(name, owner.namespace)
            labels = (live.metadata.labels if live.metadata else None) or {}
            if labels.get("app.kubernetes.io/managed-by") == MANAGED_BY:
                net.delete_namespaced_network_policy(name, owner.namespace)
                logger.info("deleted NetworkPolicy %s (network policies turned off)", name)
        except ApiException as exc:
            if exc.status != 404:
                raise
    state.applied[key] = time.monotonic()
