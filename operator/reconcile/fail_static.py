"""Fail static in a pool's reconcile step: the operator's own probe of the servers the API server
no longer shows usable, the rule of :mod:`eaas.operator.fail_static` applied to the table in
force, the held servers counted as live, and the ``FailStatic`` condition and
``RoutingTableHeldBack`` Event when a table is held back for this reason."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import kopf

from eaas.operator.crd import Condition, ExpertPoolSpec
from eaas.operator.fail_static import (
    FailStaticDecision,
    ProbeResult,
    classify,
    decide,
    suspects,
    with_held,
)
from eaas.operator.kube import event
from eaas.operator.pods import ObservedPod, server_endpoint
from eaas.operator.state import OperatorState
from eaas.operator.status import set_condition
from eaas.runtime.tables.table import RoutingTable

#: Timeout of the operator's probe of a suspected server (s): longer than the server's
#: readiness probe's (1 s), so a loaded but serving server still answers in time.
PROBE_TIMEOUT_S = 2.0

#: The condition posted on every pool status.
CONDITION = "FailStatic"


def probe(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> ProbeResult:
    """The operator's own probe: ``GET url``. ``ok`` on 200; ``dead`` when the connection is
    refused or the server answers an error status (it is there and says it cannot serve);
    ``unknown`` on a timeout or any other network error (the operator's own network may be at
    fault)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return "ok" if resp.status == 200 else "dead"
    except urllib.error.HTTPError:
        return "dead"
    except urllib.error.URLError as exc:
        return "dead" if isinstance(exc.reason, ConnectionRefusedError) else "unknown"
    except ConnectionRefusedError:
        return "dead"
    except OSError:  # a timeout, unreachable
        return "unknown"


def hold_back(
    state: OperatorState,
    body: dict[str, Any],
    spec: ExpertPoolSpec,
    observed: Sequence[ObservedPod],
    live: Sequence[ObservedPod],
    table: RoutingTable | None,
    confirmed_down: Collection[str],
    logger: kopf.Logger,
) -> tuple[list[ObservedPod], FailStaticDecision]:
    """``live`` (the pods the API shows usable, less those confirmed down) plus the servers of
    ``table`` (the table in force) that fail static holds, counted as live; and the decision.
    Probes each server with indirect evidence only (in parallel, :data:`PROBE_TIMEOUT_S`).
    Posts ``RoutingTableHeldBack`` (Warning) when a server starts being held."""
    meta = body["metadata"]
    memory = state.pool(meta["namespace"], meta["name"])
    if table is None:
        memory.held = {}
        return list(live), FailStaticDecision()
    by_name = {p.name: p for p in observed}
    evidence = {
        name: classify(
            endpoint,
            by_name.get(name),
            _endpoint(spec, by_name.get(name)),
            confirmed_down,
        )
        for name, endpoint in table.servers.items()
    }
    names = suspects(table, evidence)
    urls = [f"http://{by_name[n].ip}:{spec.health_port}/health" for n in names]

    def one(url: str) -> ProbeResult:
        return probe(url) if "//:" not in url else "unknown"

    results = dict(zip(names, state.executor().map(one, urls), strict=True)) if names else {}
    decision = decide(table, evidence, results)
    new = sorted(set(decision.held) - set(memory.held))
    if new:
        event(body, "RoutingTableHeldBack", decision.message(), warning=True)
        logger.info("pool %s/%s: %s", *_pair(meta), decision.message())
    for name, why in decision.dropped.items():
        if evidence.get(name) == "indirect":
            logger.info("pool %s/%s: server %s leaves the table: %s", *_pair(meta), name, why)
    memory.held = dict(decision.held)
    return with_held(live, observed, decision.held), decision


def _pair(meta: Mapping[str, Any]) -> tuple[str, str]:
    return meta["namespace"], meta["name"]


def _endpoint(spec: ExpertPoolSpec, pod: ObservedPod | None) -> str:
    if pod is None or not pod.ip:
        return ""
    return server_endpoint(spec, pod.index, pod.ip)


def add_condition(
    status: dict[str, Any],
    decision: FailStaticDecision,
    old_conditions: Sequence[Mapping[str, Any]],
    now: str,
    generation: int | None,
) -> None:
    """Append the ``FailStatic`` condition to ``status["conditions"]``: True/ServersHeld with
    :meth:`FailStaticDecision.message` while servers are held, else False/NothingHeld."""
    held = bool(decision.held)
    cond = Condition(
        type=CONDITION,
        status="True" if held else "False",
        reason="ServersHeld" if held else "NothingHeld",
        message=decision.message()
        or "every server of the routing table is usable as the API server shows it",
        observed_generation=generation,
    )
    status.setdefault("conditions", []).append(set_condition(old_conditions, cond, now))
