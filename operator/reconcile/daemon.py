"""The per-object daemon loop (one reconcile step at a time per pool or fleet, on every wakeup
and every ``resync_s``) and the operator's start-up and shutdown: kopf's settings, the
election, the report and metrics listeners, the load scraper."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import kopf
from kubernetes.client.rest import ApiException

from eaas.operator.crd import LABEL_POOL
from eaas.operator.kopf_tuning import QuietWatchHandlers, SpecDiffBaseStorage
from eaas.operator.leader import LeaderElector
from eaas.operator.load import LoadScraper
from eaas.operator.reconcile.load import start_external_metrics
from eaas.operator.reconcile.reports import start_report_server
from eaas.operator.resync import step_due
from eaas.operator.state import LIST_RESYNC_S, OperatorState

Step = Callable[[OperatorState, str, str, kopf.Logger], None]

#: The watch-event handlers (:mod:`eaas.operator.handlers`): one call per pod, ConfigMap or
#: node event, logged at DEBUG only.
WATCH_HANDLERS = ("server_pod_event", "pool_configmap_event", "node_event", "server_pods")


def _due(
    state: OperatorState,
    kind: str,
    key: tuple[str, str],
    woken: bool,
    failed: bool,
    since_last_step_s: float,
) -> bool:
    """Whether the daemon runs a full step now: fleets always; pools on events, else once per
    idle resync (:mod:`eaas.operator.resync`), more often while busy: servers under suspicion,
    a staged table, or (a load-driven pool) measured load, once per load window. An idle
    resync step is skipped when nothing it reads changed since the last step began
    (:meth:`OperatorState.step_inputs`), but not for :data:`LIST_RESYNC_S` in a row (that step
    LISTs the pods: the safety net of a watch that missed an event)."""
    if kind != "pool":
        return True
    memory = state.pools.get(key)
    scraper = state.scraper
    busy = memory is not None and (
        memory.busy()
        or (
            memory.load_driven
            and scraper is not None
            and since_last_step_s >= scraper.window_s
            and bool(scraper.load(key).per_server)
        )
    )
    if scraper is not None:
        scraper.keep(key)  # an idle pool's servers stay scraped between its rare steps
    idle_resync_s = state.settings.resync.idle_resync_s
    due = step_due(woken, failed, busy, since_last_step_s, idle_resync_s)
    if not due:
        return False
    if memory is None or woken or failed or busy or idle_resync_s <= 0:
        return take_inputs(state, key)
    # an idle resync: skipped while nothing the step reads changed, at most LIST_RESYNC_S
    if since_last_step_s >= LIST_RESYNC_S:
        return take_inputs(state, key)
    if time.monotonic() - memory.inputs_checked_at < idle_resync_s:
        return False  # compared already in this idle period
    memory.inputs_checked_at = time.monotonic()
    if memory.step_inputs is not None and state.step_inputs(*key) == memory.step_inputs:
        state.counters.add("eaas_operator_idle_steps_skipped_total")
        return False
    return take_inputs(state, key)


def take_inputs(state: OperatorState, key: tuple[str, str]) -> bool:
    """Remember what a step of pool ``key`` that begins now reads
    (:meth:`OperatorState.step_inputs`); returns True (the step runs)."""
    memory = state.pool(*key)
    memory.step_inputs = state.step_inputs(*key)
    memory.inputs_checked_at = time.monotonic()
    return True


async def run_daemon(
    state: OperatorState,
    kind: str,
    namespace: str,
    name: str,
    stopped: kopf.DaemonStopped,
    step: Step,
    logger: kopf.Logger,
) -> None:
    """Run ``step`` for the object until ``stopped``: now, on every wakeup and every
    ``resync_s`` seconds (pools: see :func:`_due`), only while this operator leads. API errors
    and bugs are logged and retried on the next step; they never end the daemon."""
    event = state.wake_event(kind, namespace, name)
    woken, failed, last_step = True, False, -1e18
    try:
        while not stopped:
            try:
                due = _due(
                    state, kind, (namespace, name), woken, failed, time.monotonic() - last_step
                )
                if state.is_leader() and due:  # a standby operator watches but never acts
                    # a wakeup is consumed by a step only (not while this replica cannot act)
                    last_step, failed, woken = time.monotonic(), True, False
                    state.counters.add("eaas_operator_reconcile_steps_total", kind=kind)
                    await asyncio.to_thread(step, state, namespace, name, logger)
                    failed = False
            except ApiException as exc:
                if exc.status == 409:
                    logger.debug("conflict during reconcile of %s/%s; retrying", namespace, name)
                else:
                    logger.warning(
                        "API error during reconcile of %s/%s: %s %s",
                        namespace,
                        name,
                        exc.status,
                        exc.reason,
                    )
            except Exception:  # a bug must not kill the daemon: log it and retry on the next step
                logger.exception("reconcile of %s/%s failed", namespace, name)
            try:
                await asyncio.wait_for(event.wait(), timeout=state.settings.resync.resync_s)
            except asyncio.TimeoutError:
                pass
            woken = woken or event.is_set()
            event.clear()
    finally:
        state.wakeups.pop((kind, namespace, name), None)


def configure_kopf(settings: kopf.OperatorSettings, state: OperatorState) -> None:
    """kopf's settings: annotation-based persistence with a small diff-base (spec, labels and
    annotations of the custom objects only: :mod:`eaas.operator.kopf_tuning`), standalone (our
    own Lease election; kopf peering freezes equal-priority peers), quick watches of labelled
    pods and ConfigMaps, no INFO line per watch event."""
    settings.peering.standalone = True
    settings.posting.level = logging.INFO  # only explicit kopf.info/warn calls post Events
    settings.watching.server_timeout = state.settings.resync.watch_timeout_s
    settings.watching.client_timeout = settings.watching.server_timeout + 10
    settings.watching.label_selectors["v1", "pods"] = LABEL_POOL
    settings.watching.label_selectors["v1", "configmaps"] = LABEL_POOL
    settings.persistence.finalizer = "eaas.io/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="eaas.io")
    # kopf's default diff-base deep-copies every watched body (status included) per event
    settings.persistence.diffbase_storage = SpecDiffBaseStorage(
        prefix="eaas.io", key="last-handled-configuration"
    )
    quiet = QuietWatchHandlers(WATCH_HANDLERS)
    if not any(
        isinstance(f, QuietWatchHandlers) for f in logging.getLogger("kopf.objects").filters
    ):
        logging.getLogger("kopf.objects").addFilter(quiet)
    settings.execution.max_workers = 32
    settings.background.cancellation_polling = 1


async def start(state: OperatorState) -> None:
    """Start what runs beside the daemons: the API client, the Lease election, the
    failure-report listener (when configured), the load scraper, the external metrics API
    (when configured).

    Raises:
        ValueError: a malformed listen address or missing certificate settings.
    """
    state.api()
    state.loop = asyncio.get_running_loop()
    state.elector = LeaderElector(
        state.settings.lease, state.api(), state.leadership_changed
    ).start()
    if state.settings.reports.listen:
        state.report_runner = await start_report_server(state)
    state.scraper = LoadScraper.from_settings(state.settings.load, state.counters).start()
    if state.settings.metrics_api.listen:
        state.metrics_runner = await start_external_metrics(state)


async def stop(state: OperatorState) -> None:
    """On shutdown: free the Lease (a standby takes over at once), stop the listeners and the
    scraper."""
    if state.elector is not None:
        state.elector.stop(release=True)
    if state.report_runner is not None:
        await state.report_runner.cleanup()
    if state.metrics_runner is not None:
        await state.metrics_runner.cleanup()
    if state.scraper is not None:
        state.scraper.stop()
