"""Pure desired-state builders and decisions of the operator (no I/O, no kopf).

Everything the reconcilers (:mod:`eaas.operator.reconcile`) do is decided from plain inputs: the
parsed spec, the owner's identity, and what the API server reports (pods, the routing-table
ConfigMap, the Deployment). Each function returns manifests (plain dicts ready for the Kubernetes API) or small records.

Split by concern (this module re-exports them all):

* :mod:`eaas.operator.names` — names, labels, the owner identity;
* :mod:`eaas.operator.pool_placement` — the placement in force and the next one (incremental),
  expert load, failure-domain spread;
* :mod:`eaas.operator.pods` — expert-server pod manifests, observed pods, the pod plan;
* :mod:`eaas.operator.table` — the routing table and its ConfigMap;
* :mod:`eaas.operator.status` — ExpertPool status and conditions;
* :mod:`eaas.operator.fleet` — the AttentionFleet's Deployment, Service and status.
"""

from __future__ import annotations

from eaas.operator.fleet import (
    ack_summary,
    client_command,
    client_rbac,
    fleet_deployment,
    fleet_service,
    fleet_status,
    new_push_token,
    push_secret,
)
from eaas.operator.names import (
    CLIENT_ROLE,
    GPU_RESOURCE,
    LOAD_KEY,
    MANAGED_BY,
    SERVER_ROLE,
    Owner,
    client_labels,
    content_hash,
    selector_string,
    server_labels,
    server_name,
    table_configmap_name,
)
from eaas.operator.pods import (
    ObservedPod,
    PodPlan,
    desired_server_pods,
    plan_pods,
    server_command,
    server_pod,
    server_resources,
)
from eaas.operator.pool_placement import (
    compute_placement,
    expert_load_configmap_name,
    parse_expert_load,
    placement_revision,
    previous_placement,
    unspread_experts,
)
from eaas.operator.status import invalid_spec_status, pool_status, set_condition
from eaas.operator.table import (
    CONFIGMAP_DATA_LIMIT,
    build_routing_table,
    configmap_too_large,
    coverage,
    next_routing_table,
    routing_table_configmap,
)
from eaas.runtime.tables.watch import TABLE_KEY

__all__ = [
    "CONFIGMAP_DATA_LIMIT",
    "configmap_too_large",
    "CLIENT_ROLE",
    "GPU_RESOURCE",
    "LOAD_KEY",
    "MANAGED_BY",
    "SERVER_ROLE",
    "TABLE_KEY",
    "ObservedPod",
    "Owner",
    "PodPlan",
    "build_routing_table",
    "ack_summary",
    "client_command",
    "client_rbac",
    "new_push_token",
    "push_secret",
    "client_labels",
    "compute_placement",
    "content_hash",
    "coverage",
    "desired_server_pods",
    "expert_load_configmap_name",
    "fleet_deployment",
    "fleet_service",
    "fleet_status",
    "invalid_spec_status",
    "next_routing_table",
    "parse_expert_load",
    "placement_revision",
    "plan_pods",
    "pool_status",
    "previous_placement",
    "routing_table_configmap",
    "selector_string",
    "server_command",
    "server_labels",
    "server_name",
    "server_pod",
    "server_resources",
    "set_condition",
    "table_configmap_name",
    "unspread_experts",
]
