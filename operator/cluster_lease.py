"""One operator acts per cluster, whatever namespace each runs in.

Leases are namespaced: an ``eaas operator`` run in ``default`` and a Helm release in
``eaas-system`` each win their own Lease and would both act on the same pools. So every
operator's Lease carries the label ``eaas.io/operator-lease: "true"`` and the holder of one,
after each renewal, lists those Leases in every namespace
(``list_lease_for_all_namespaces``, label selector; RBAC: ``get``/``list`` on ``leases``
cluster-wide) and acts only if its own is the **oldest live** one (:func:`cluster_winner`):

* live: held (``holderIdentity`` set) and its resourceVersion changed within the lease duration
  of this process's own clock (no comparison of two hosts' clocks, as in
  :func:`eaas.operator.leader.lease_decision`); a Lease first seen counts as live;
* oldest: earliest ``metadata.creationTimestamp`` (the API server's clock), ties broken by
  namespace. A leader that shuts down deletes its Lease, so a restarted operator is the
  youngest and stands by for the one that kept running.

The others stand by (they keep their own Lease, so their namespace's replicas keep waiting
behind them), log once which operator acts (identity and Lease), and forward failure reports to
its advertised URL. When that one stops renewing, the next oldest takes over after the lease
duration. An operator that cannot list the Leases (missing RBAC) stands by and says so.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

#: Label every operator Lease carries (the selector of the cluster-wide list).
LABEL_OPERATOR_LEASE = "eaas.io/operator-lease"


@dataclass(frozen=True)
class LeaseView:
    """One operator Lease as listed.

    Attributes:
        namespace: its namespace.
        name: its name.
        holder: ``spec.holderIdentity`` ("" when free).
        created: ``metadata.creationTimestamp`` (RFC 3339, or "" when unknown: sorts first).
        resource_version: ``metadata.resourceVersion``.
        url: the holder's advertised failure-report URL (annotation ``eaas.io/leader-url``).
    """

    namespace: str
    name: str
    holder: str
    created: str
    resource_version: str
    url: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name


class LiveLeases:
    """Which listed Leases are live, by this process's monotonic clock: a Lease whose
    resourceVersion has not changed for ``lease_duration_s`` is dead (its holder stopped)."""

    def __init__(self, lease_duration_s: float) -> None:
        self.lease_duration_s = lease_duration_s
        self._seen: dict[tuple[str, str], tuple[str, float]] = {}

    def observe(self, leases: Iterable[LeaseView], now: float) -> list[LeaseView]:
        """Record ``leases`` (one full list) at monotonic time ``now``; return the live ones."""
        out: list[LeaseView] = []
        seen: dict[tuple[str, str], tuple[str, float]] = {}
        for lease in leases:
            rv, at = self._seen.get(lease.key, ("", now))
            if rv != lease.resource_version:
                at = now
            seen[lease.key] = (lease.resource_version, at)
            if lease.holder and now - at < self.lease_duration_s:
                out.append(lease)
        self._seen = seen
        return out


def cluster_winner(live: Iterable[LeaseView]) -> LeaseView | None:
    """The Lease whose holder acts for the cluster: the oldest live one (earliest creation,
    then namespace, then name), or None when there is none."""
    return min(live, key=lambda v: (v.created, v.namespace, v.name), default=None)
