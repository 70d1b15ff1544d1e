"""The I/O of a ``routing-table`` pool's elastic membership (decisions in
:mod:`eaas.operator.drain`): the replica count to act on, and which leaving servers have
drained -- asked of the servers themselves (``GET /health``, its ``traffic`` record).

Hooks of :mod:`eaas.operator.reconcile.table_pool`: :func:`acted_spec` at the start of a step,
:func:`hold_undrained` when the pod plan is made.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence

import kopf

from eaas.operator.crd import ExpertPoolSpec
from eaas.operator.drain import (
    TrafficReport,
    drain_done,
    leaving_servers,
    pick_replacements,
    settled_replicas,
)
from eaas.operator.kube import event
from eaas.operator.pods import ObservedPod
from eaas.operator.state import OperatorState, PoolMemory
from eaas.runtime.tables.http import json_call

#: Connect + read timeout of one ``/health`` call to a leaving server (s).
HEALTH_TIMEOUT_S = 3.0


def acted_spec(state: OperatorState, memory: PoolMemory, spec: ExpertPoolSpec) -> ExpertPoolSpec:
    """``spec`` with the replica count to act on now (:func:`settled_replicas`): the pods,
    placement and table follow it; the status keeps judging against ``spec.replicas``."""
    replicas = settled_replicas(
        memory.elastic, spec.replicas, time.monotonic(), state.settings.elastic.settle_s
    )
    if replicas == spec.replicas:
        return spec
    return spec.model_copy(update={"replicas": replicas})


def replacements(
    memory: PoolMemory,
    observed: Sequence[ObservedPod],
    desired_hash: Mapping[str, str],
    redundancy: int,
) -> set[str]:
    """Outdated live servers leaving the table to be replaced (:func:`pick_replacements`,
    remembered); the candidate table is computed without them."""
    memory.elastic.replacing = pick_replacements(
        observed, desired_hash, memory.elastic.replacing, redundancy
    )
    return set(memory.elastic.replacing)


def _traffic(pod: ObservedPod, health_port: int) -> TrafficReport:
    try:
        _, doc, _ = json_call(
            "GET", f"http://{pod.ip}:{health_port}/health", None, None, HEALTH_TIMEOUT_S
        )
    except OSError:
        return TrafficReport(reachable=False)
    return TrafficReport.from_health(doc)


def hold_undrained(
    state: OperatorState,
    body: dict[str, object],
    memory: PoolMemory,
    observed: Sequence[ObservedPod],
    desired_hash: Mapping[str, str],
    in_use: Collection[str],
    health_port: int,
    logger: kopf.Logger,
) -> set[str]:
    """The live pods the pod plan must not delete now: every live pod but the leaving ones
    (:func:`leaving_servers`) that drained (:func:`drain_done`; a ``ServerDrained`` Event
    names the server, why and its last frame's time, a Warning on a timeout). Drains of pods
    that no longer leave are forgotten."""
    settings = state.settings.elastic
    leaving = leaving_servers(observed, desired_hash, in_use)
    drains = memory.elastic.drains
    for uid in set(drains) - {p.uid for p in leaving}:
        del drains[uid]
    now = time.monotonic()
    for p in leaving:
        drains.setdefault(p.uid, now)
    reports = list(
        state.executor().map(lambda p: _traffic(p, health_port), leaving) if leaving else []
    )
    drained: set[str] = set()
    for pod, report in zip(leaving, reports, strict=True):
        why = drain_done(
            report, now - drains[pod.uid], settings.drain_quiet_s, settings.drain_timeout_s
        )
        if not why:
            continue
        drained.add(pod.name)
        last = "never" if report.last_frame_unix is None else f"unix {report.last_frame_unix:.3f}"
        msg = (
            f"expert server {pod.name} drained ({why}): {report.frames} frames, last frame "
            f"{last}, out of every client's table"
        )
        logger.info("%s", msg)
        event(dict(body), "ServerDrained", msg, warning=why == "timeout")
    return {p.name for p in observed if p.live} - drained
