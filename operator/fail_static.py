"""Fail static (pure): what the API server says about a server of the routing table in force is
evidence, not proof, and a control-plane hiccup never becomes a data-plane outage.

When the API server stalls or etcd has a bad minute, the node controller's delayed NodeNotReady
marks flip live pods to Ready=False all at once, the node agents' heartbeats arrive late, and a
watch goes stale. The clients meanwhile keep serving through those servers. So the operator
sorts every server of the table in force that the API no longer shows usable by the kind of
evidence against it (:func:`classify`):

* **direct** (removed at once, as before): the pod is gone, terminating, Failed/Succeeded, has a
  new IP, or clients reported it and the operator's probe confirmed it (``confirmed_down``);
* **indirect** (Ready=False, its node NotReady, not Running): the operator probes the server
  itself (``GET /health`` on its HTTP port, :func:`eaas.operator.reconcile.fail_static.probe`)
  and the answer decides:

  * ``ok`` (200): the server serves: it stays in the table (held) while the probe keeps
    answering;
  * ``dead`` (connection refused, or an HTTP error status): confirmed: removed;
  * ``unknown`` (a timeout, no IP to probe, unreachable): unconfirmed. Unconfirmed removals
    never take away the last replica of an expert (of the table in force) and are at most
    :func:`removal_bound` servers per step (a quarter of the table, at least one); beyond
    that the servers are held.

Removing one dead server stays as fast as before: a killed process refuses the probe at once, a
single unreachable one is within the bound. A ``routing-table`` pool then re-places first and
drops second when the drop alone would uncover an expert (make-before-break,
:mod:`eaas.operator.reconcile.table_pool`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from eaas.operator.pods import ObservedPod
from eaas.runtime.tables.table import RoutingTable

#: The operator's probe of a suspected server: serving, refusing (dead), or no answer.
ProbeResult = Literal["ok", "dead", "unknown"]

Evidence = Literal["usable", "direct", "indirect"]

#: Share of the table's servers that unconfirmed evidence may remove in one step.
MAX_UNCONFIRMED_SHARE = 0.25


def removal_bound(servers: int, share: float = MAX_UNCONFIRMED_SHARE) -> int:
    """How many of ``servers`` (the table in force) unconfirmed evidence may remove at once:
    ``max(1, floor(servers * share))`` (0 for an empty table)."""
    if servers <= 0:
        return 0
    return max(1, int(servers * share))


def classify(
    endpoint: str,
    pod: ObservedPod | None,
    pod_endpoint: str,
    confirmed_down: Collection[str] = (),
) -> Evidence:
    """The evidence against one server of the table in force.

    Args:
        endpoint: its endpoint in the table.
        pod: its pod as the API shows it (None: no such pod).
        pod_endpoint: the endpoint that pod has now (``""`` without an IP).
        confirmed_down: servers clients reported and the operator's probe confirmed down.

    Returns:
        ``usable`` (the API shows it live at the same endpoint), ``direct`` or ``indirect``
        (module docstring).
    """
    if pod is None or pod.name in confirmed_down or pod.terminating or pod.finished:
        return "direct"
    if pod.ip and pod_endpoint != endpoint:
        return "direct"  # a new IP: whatever was at the old endpoint is gone
    if pod.live:
        return "usable"
    return "indirect"


@dataclass
class FailStaticDecision:
    """Which suspected servers of the table in force stay (held) and which go.

    Attributes:
        held: server name -> why it stays although the API no longer shows it usable.
        dropped: server name -> why it leaves the table.
        bound: the unconfirmed-removal bound this step applied (:func:`removal_bound`).
    """

    held: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    bound: int = 0

    def message(self) -> str:
        """One line for the status condition and the Event ("" when nothing is held)."""
        if not self.held:
            return ""
        parts = [f"{n} ({why})" for n, why in sorted(self.held.items())]
        return "routing table keeps servers the API server shows unavailable: " + ", ".join(parts)


def decide(
    table: RoutingTable,
    evidence: Mapping[str, Evidence],
    probes: Mapping[str, ProbeResult],
    share: float = MAX_UNCONFIRMED_SHARE,
) -> FailStaticDecision:
    """Apply the fail-static rule to the servers of ``table`` (the table in force).

    Args:
        table: the routing table clients use now.
        evidence: server name -> :func:`classify` (servers missing count as ``usable``).
        probes: server name -> the operator's probe of each ``indirect`` server (missing:
            ``unknown``).
        share: :data:`MAX_UNCONFIRMED_SHARE`.

    Returns:
        The decision: ``direct`` and probe-confirmed (``dead``) servers dropped, servers that
        answered their probe held, unconfirmed ones dropped only while the bound allows and
        every expert the table covers keeps a replica on a server that stays (in table order,
        so the outcome is deterministic).
    """
    out = FailStaticDecision(bound=removal_bound(len(table.servers), share))
    unconfirmed: list[str] = []
    for name in table.servers:
        kind = evidence.get(name, "usable")
        if kind == "direct":
            out.dropped[name] = "gone"
        elif kind == "indirect":
            result = probes.get(name, "unknown")
            if result == "ok":
                out.held[name] = "answers the operator's probe"
            elif result == "dead":
                out.dropped[name] = "the operator's probe confirmed it down"
            else:
                unconfirmed.append(name)
    staying = set(table.servers) - set(out.dropped)
    budget = out.bound
    for name in unconfirmed:
        rest = staying - {name}
        if budget <= 0:
            out.held[name] = f"unconfirmed; at most {out.bound} removed at once"
        elif _uncovers(table, rest):
            out.held[name] = "unconfirmed; holds the last replica of an expert"
        else:
            out.dropped[name] = "unconfirmed, within the bound"
            staying = rest
            budget -= 1
    return out


def _uncovers(table: RoutingTable, staying: Collection[str]) -> bool:
    """Whether some expert ``table`` covers has no replica among ``staying``."""
    keep = set(staying)
    return any(
        reps and not keep.intersection(reps)
        for experts in table.layers.values()
        for reps in experts
    )


def suspects(table: RoutingTable | None, evidence: Mapping[str, Evidence]) -> list[str]:
    """Servers of ``table`` to probe: those with ``indirect`` evidence, in table order."""
    if table is None:
        return []
    return [n for n in table.servers if evidence.get(n) == "indirect"]


def with_held(
    live: Sequence[ObservedPod], observed: Sequence[ObservedPod], held: Collection[str]
) -> list[ObservedPod]:
    """``live`` plus the ``held`` pods of ``observed`` counted as live (Ready on a Ready node),
    sorted by (index, name) as the reconcilers sort ``live``."""
    have = {p.name for p in live}
    extra = [
        dataclasses.replace(p, ready=True, node_ready=True, phase="Running")
        for p in observed
        if p.name in held and p.name not in have
    ]
    return sorted([*live, *extra], key=lambda p: (p.index, p.name))
