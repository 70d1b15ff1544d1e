"""``status`` models of ``ExpertPool`` and ``AttentionFleet``: the observed state the operator
writes (kept in the CRD so the structural schema does not prune it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from eaas.operator.crd.base import CrdModel

#: ``status`` of a Kubernetes condition.
ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(CrdModel):
    """A standard Kubernetes condition."""

    type: str = Field(description="Ready, Progressing or Degraded.")
    status: ConditionStatus = Field(description="Condition status.")
    reason: str = Field(default="", description="CamelCase reason.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: str | None = Field(
        default=None, description="When status last changed (RFC 3339)."
    )
    observed_generation: int | None = Field(
        default=None, description="Generation the condition is about."
    )


class PlacementSummary(CrdModel):
    """Summary of the current placement and of live coverage."""

    experts_per_server_min: int = Field(
        default=0, description="Fewest (layer, expert) replicas on one server."
    )
    experts_per_server_max: int = Field(
        default=0, description="Most (layer, expert) replicas on one server."
    )
    experts_below_redundancy: int = Field(
        default=0,
        description="Logical experts with fewer than `redundancy` live replicas in the routing table.",
    )
    uncovered_experts: int = Field(
        default=0, description="Logical experts with no live replica at all."
    )
    logical_experts: int = Field(
        default=0, description="Logical experts in total (MoE layers x experts)."
    )


class LoadSummary(CrdModel):
    """Expert load measured from the servers' ``eaas_expert_tokens_total`` counters over a
    sliding window (the operator scrapes each Ready server's /metrics)."""

    servers: int = Field(default=0, description="Servers with a measured rate.")
    window_seconds: float = Field(default=0, description="Rate window (seconds).")
    total_tokens_per_second: float = Field(
        default=0, description="Pool load: tokens/s summed over servers (the HPA's metric)."
    )
    server_max_tokens_per_second: float = Field(
        default=0, description="Highest per-server load (tokens/s)."
    )
    server_mean_tokens_per_second: float = Field(
        default=0, description="Mean per-server load (tokens/s)."
    )
    balancedness: float = Field(
        default=1,
        description="Mean / max per-server load per MoE layer, summed over layers "
        "(sum of means / sum of maxima; 1: perfectly balanced).",
    )
    hottest_experts: list[str] = Field(
        default_factory=list,
        description="Hottest logical experts pool-wide, as `L<layer>/E<expert>: <tokens/s>`.",
    )


class ExpertPoolStatus(CrdModel):
    """Observed state of an ExpertPool."""

    replicas: int = Field(default=0, description="Expert-server pods that exist (not terminating).")
    ready_replicas: int = Field(
        default=0, description="Expert-server pods that are Ready with a pod IP."
    )
    updated_replicas: int = Field(
        default=0, description="Pods matching the current placement revision and spec."
    )
    selector: str = Field(
        default="", description="Label selector of the pool's pods (string form, for `scale`)."
    )
    observed_generation: int = Field(default=0, description="metadata.generation last acted on.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready, Progressing, Degraded."
    )
    routing_table_version: int = Field(
        default=0, description="Version of the published routing table."
    )
    placement: PlacementSummary = Field(
        default_factory=PlacementSummary, description="Placement summary."
    )
    placement_revision: str = Field(
        default="", description="Hash of the current placement's inputs."
    )
    clients: int = Field(
        default=0, description="Ready attention clients of the fleets that use this pool."
    )
    clients_acknowledged: int = Field(
        default=0,
        description="Of those, the clients that acknowledged routingTableVersion.",
    )
    acknowledged_version: int = Field(
        default=0, description="Oldest routing-table version a Ready client has acknowledged."
    )
    staged_routing_table_version: int = Field(
        default=0,
        description="assignment routing-table: version pushed to the servers and not yet to the "
        "clients (0: none pending).",
    )
    servers_confirmed: int = Field(
        default=0,
        description="assignment routing-table: servers of the newest version (staged, else "
        "published) that confirmed holding its experts' weights.",
    )
    last_rebalance_time: str | None = Field(
        default=None,
        description="When the last load rebalance was staged (RFC 3339); absent until one was.",
    )
    load: LoadSummary | None = Field(
        default=None, description="Measured expert load (absent until two scrapes)."
    )


class AttentionFleetStatus(CrdModel):
    """Observed state of an AttentionFleet."""

    replicas: int = Field(default=0, description="Client pods (from the Deployment).")
    ready_replicas: int = Field(default=0, description="Ready client pods.")
    selector: str = Field(
        default="", description="Label selector of the client pods (string form)."
    )
    observed_generation: int = Field(default=0, description="metadata.generation last acted on.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready, Progressing, Degraded."
    )
    routing_table_version: int = Field(
        default=0, description="Version of the pool's routing table (its ConfigMap)."
    )
    acknowledged_version: int = Field(
        default=0,
        description="Oldest routing-table version a Ready client has acknowledged (0: none yet).",
    )
    clients_acknowledged: int = Field(
        default=0,
        description="Ready clients that acknowledged routingTableVersion (push answer, or a "
        "409 naming it: the client got it from the ConfigMap watch).",
    )
