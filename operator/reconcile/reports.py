"""The failure-report endpoint: ``POST /v1/failure-reports/{namespace}/{fleet}`` (a client could
not reach an expert server; the operator probes it and, when the probe fails too, takes it out
of the routing table), forwarded by a standby to the leader; and ``GET /metrics`` with the
operator's own gauges (:func:`operator_metrics`)."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from eaas.operator.crd import LABEL_POOL
from eaas.operator.kube import raw, read_token
from eaas.operator.monitor import (
    FORWARDED_HEADER,
    MAX_REPORT_BYTES,
    bearer_ok,
    forward_report,
    health_url,
    parse_report,
    probe_health,
)
from eaas.operator.names import push_secret_name
from eaas.operator.state import OperatorState

log = logging.getLogger("eaas.operator")


async def start_report_server(state: OperatorState) -> web.AppRunner:
    """Serve ``POST /v1/failure-reports/{namespace}/{fleet}`` and ``GET /metrics``
    (:func:`operator_metrics`) on ``settings.reports.listen``. Returns the listener.

    Raises:
        ValueError: ``EAAS_OPERATOR_REPORT_LISTEN`` is not ``HOST:PORT``.
        OSError: the port is taken.
    """
    listen = state.settings.reports.listen
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"EAAS_OPERATOR_REPORT_LISTEN must be HOST:PORT, got {listen!r}")
    app = web.Application(client_max_size=MAX_REPORT_BYTES)

    async def handle(request: web.Request) -> web.Response:
        return await failure_report(state, request)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=operator_metrics(state), content_type="text/plain")

    app.router.add_post("/v1/failure-reports/{namespace}/{fleet}", handle)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host or "0.0.0.0", int(port)).start()
    log.info("failure reports served on http://%s/v1/failure-reports/NS/FLEET", listen)
    return runner


def operator_metrics(state: OperatorState) -> str:
    """Prometheus text exposition (version 0.0.4) of ``GET /metrics`` on the report listener:
    ``eaas_operator_leader`` (1 on the replica holding the Lease, else 0) and
    ``eaas_operator_routing_table_version{namespace, configmap}`` (the newest table version this
    replica has read), and the work counters (:mod:`eaas.operator.counters`)."""
    lines = [
        "# HELP eaas_operator_leader 1 if this replica holds the leader Lease and acts, else 0.",
        "# TYPE eaas_operator_leader gauge",
        f"eaas_operator_leader {int(state.is_leader())}",
        "# HELP eaas_operator_routing_table_version Newest routing-table version read.",
        "# TYPE eaas_operator_routing_table_version gauge",
    ]
    for (ns, cm), (_, table) in sorted(state.tables.items()):
        lines.append(
            f'eaas_operator_routing_table_version{{namespace="{ns}",configmap="{cm}"}} '
            f"{table.version}"
        )
    lines += state.counters.exposition()
    return "\n".join(lines) + "\n"


def report_token(state: OperatorState, namespace: str, fleet: str, fresh: bool) -> str:
    """The fleet's push token ("" when its Secret does not exist); cached unless ``fresh``.

    Raises:
        ApiException: any API error but 404.
    """
    memory = state.fleet(namespace, fleet)
    if not fresh and memory.report_token is not None:
        return memory.report_token
    token = read_token(k8s.CoreV1Api(state.api()), namespace, push_secret_name(fleet))
    if token is None:
        return ""
    memory.report_token = token
    return token


async def _authorized(
    state: OperatorState, request: web.Request, namespace: str, fleet: str
) -> bool:
    """Whether the request carries the fleet's push token (re-read once when it does not match:
    the Secret may have been recreated)."""
    auth = request.headers.get("Authorization")
    for fresh in (False, True):
        token = await asyncio.to_thread(report_token, state, namespace, fleet, fresh)
        if bearer_ok(auth, token):
            return True
    return False


async def failure_report(state: OperatorState, request: web.Request) -> web.Response:
    """One client's failure report (see :mod:`eaas.operator.monitor` for the answers): check the
    token, parse, find the pod, probe its ``/health``; if the probe fails too, mark it suspect
    and wake its pool (the next table leaves it out)."""
    namespace, fleet = request.match_info["namespace"], request.match_info["fleet"]
    if not state.is_leader():
        return await _forward_to_leader(state, request)
    if not await _authorized(state, request, namespace, fleet):
        return web.json_response(
            {"error": "missing or wrong bearer token"},
            status=401,
            headers={"WWW-Authenticate": 'Bearer realm="eaas"'},
        )
    try:
        report = parse_report(await request.read())
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    core = k8s.CoreV1Api(state.api())
    try:
        pod = await asyncio.to_thread(raw, core.read_namespaced_pod, report.server_id, namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return web.json_response({"action": "ignored", "reason": "no such pod"})
    url = health_url(pod)
    pool = ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_POOL, "")
    if url is None or not pool:
        return web.json_response(
            {"action": "ignored", "reason": "not an expert server with an IP and an http port"}
        )
    who = (report.client_id, namespace, fleet, report.server_id, report.reason)
    if await asyncio.to_thread(probe_health, url):
        log.info("client %s of %s/%s reported %s (%s); its /health answers: kept", *who)
        return web.json_response({"action": "kept"})
    memory = state.pool(namespace, pool)
    memory.suspects[report.server_id] = (pod["metadata"]["uid"], time.monotonic())
    log.warning(
        "client %s of %s/%s reported %s (%s); confirmed by probe: leaving the routing table", *who
    )
    state.wake("pool", namespace, pool)
    # posted by the pool's reconcile step (kopf posts Events from its handlers' context)
    memory.reported.append(
        f"{report.server_id}: reported by client {report.client_id} of {fleet} "
        f"({report.reason}); its /health probe failed too: leaving the routing table"
    )
    return web.json_response({"action": "removed"})


async def _forward_to_leader(state: OperatorState, request: web.Request) -> web.Response:
    """A standby's answer to a failure report: the leader's answer to the same report
    (:func:`eaas.operator.monitor.forward_report`), or 503 when there is no leader to ask."""
    url = state.elector.leader_url if state.elector is not None else ""
    if request.headers.get(FORWARDED_HEADER) or not url:
        return web.json_response(
            {"error": "standby operator and no leader known yet; retry later"}, status=503
        )
    identity = state.elector.settings.identity if state.elector is not None else ""
    body = await request.read()
    try:
        status, answer = await asyncio.to_thread(
            forward_report,
            url,
            request.path_qs,
            body,
            request.headers.get("Authorization"),
            identity,
        )
    except OSError as exc:
        return web.json_response(
            {"error": f"standby operator; leader at {url} unreachable ({exc}); retry later"},
            status=503,
        )
    return web.Response(
        status=status,
        body=answer,
        content_type="application/json",
        headers={"X-EAAS-Forwarded-To": url},
    )
