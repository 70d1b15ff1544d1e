"""kopf handlers: thin I/O around :mod:`eaas.operator.desired`.

Run with ``eaas operator`` or ``kopf run -m eaas.operator.handlers --all-namespaces``.

Shape (per object, kopf's layering):

* ``ExpertPool`` — a daemon per pool runs :func:`reconcile_pool` every ``resync_s`` seconds and
  whenever woken: by the pool's create/update/resume handlers (spec changes, e.g.
  ``kubectl scale``) and by watch events of the pool's pods (readiness changes, deletions).
  One daemon per pool means reconciles of one pool never overlap.
* ``AttentionFleet`` — same pattern with :func:`reconcile_fleet`.

All in-memory state is one :class:`OperatorState` in kopf's root ``memo`` (shared by every
object's memo): the API client, the daemons' wakeup events, parse and placement caches, node
readiness, the pod-creation threads. None of it is needed for correctness: every step lists pods
by label and reads the routing-table ConfigMap, so a killed and restarted operator continues
exactly where it was
(names are deterministic; creations of an existing name fail with 409 and are ignored; the table
version continues from ``max(ConfigMap, status)``). kopf's own progress and diff-base are stored
in annotations (``eaas.io/…``), never in ``status`` (the structural schema would prune them).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import dataclasses
import datetime as _dt
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import kopf
from aiohttp import web
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from eaas.operator.crd import (
    ANNOTATION_SPEC_HASH,
    ANNOTATION_TABLE_VERSION,
    GROUP,
    LABEL_PLACEMENT_REVISION,
    LABEL_POOL,
    LABEL_ROLE,
    VERSION,
    AttentionFleetSpec,
    ExpertPoolSpec,
)
from eaas.operator.desired import (
    LOAD_KEY,
    SERVER_ROLE,
    TABLE_KEY,
    ObservedPod,
    Owner,
    ack_summary,
    client_labels,
    client_rbac,
    compute_placement,
    configmap_too_large,
    desired_server_pods,
    expert_load_configmap_name,
    fleet_deployment,
    fleet_service,
    fleet_status,
    invalid_spec_status,
    new_push_token,
    next_routing_table,
    parse_expert_load,
    placement_revision,
    plan_pods,
    pool_status,
    push_secret,
    routing_table_configmap,
    selector_string,
    server_labels,
    table_configmap_name,
)
from eaas.operator.external_metrics import (
    LABEL_MANAGED,
    hpa_differs,
    hpa_manifest,
    hpa_metrics_warning,
    hpa_name,
    read_front_proxy_auth,
)
from eaas.operator.external_metrics import start_server as start_metrics_server
from eaas.operator.leader import LeaderElector, LeaseSettings
from eaas.operator.load import LoadScraper, metrics_url, pool_rates
from eaas.operator.monitor import (
    FORWARDED_HEADER,
    MAX_REPORT_BYTES,
    bearer_ok,
    forward_report,
    health_url,
    parse_report,
    probe_health,
)
from eaas.operator.names import PUSH_TOKEN_KEY, push_secret_name
from eaas.operator.overlay import OverlayError
from eaas.operator.pods import (
    PodPlan,
    desired_table_pods,
    server_endpoint,
    server_push_secret,
    server_push_secret_name,
    table_assignment,
    table_members,
)
from eaas.operator.pool_placement import member_placement, rebalance_due, table_placement
from eaas.operator.push import ObservedClient, PushRetry, clients_to_push, push_all
from eaas.operator.resync import IDLE_RESYNC_S, idle_resync_from_env, step_due
from eaas.operator.server_push import (
    ServerTableState,
    get_server_state,
    put_server_table,
    release_server,
)
from eaas.operator.table import assignment_of, table_from_assignment, two_phase_step
from eaas.runtime.placement import LayerExpert, Placement, PlacementError, auto_slots
from eaas.runtime.routing import RoutingTable, RoutingTableError

POOLS = "expertpools"
#: A server confirmed down is re-probed (to bring it back) only after this many seconds (s).
SUSPECT_REPROBE_S = 3.0
#: How often a fleet's ServiceAccount/Role/RoleBinding are re-read to repair them (s).
RBAC_RECHECK_S = 60.0
FLEETS = "attentionfleets"

log = logging.getLogger("eaas.operator")


# ---------------------------------------------------------------------------------------------
# in-memory state (one object in kopf's root memo)
# ---------------------------------------------------------------------------------------------
@dataclass
class OperatorState:
    """Everything the operator keeps in memory; rebuilt from the cluster after a restart.

    Attributes:
        resync_s: periodic resync of every pool/fleet (seconds), on top of event wakeups
            (env ``EAAS_OPERATOR_RESYNC_S``, default 2).
        idle_resync_s: a pool nothing happened to gets a full step only this often
            (:mod:`eaas.operator.resync`; env ``EAAS_OPERATOR_IDLE_RESYNC_S``, default 120).
        wakeups: ``(kind, namespace, name)`` -> the event that wakes that object's daemon.
        tables: ``(namespace, ConfigMap name)`` -> ``(resourceVersion, parsed table)``.
        node_ready: node name -> its Ready condition is True (from the node watch).
        node_labels: node name -> its labels (from the node watch; failure domains).
        placements: bounded cache of computed placements (key: spec, pods' experts, load).
        report_base_url: the operator's failure-report address as clients reach it (env
            ``EAAS_OPERATOR_REPORT_URL``, e.g. ``http://eaas-operator.eaas-system.svc:8081``;
            empty: clients get no ``--failure-report-url``).
        tokens: ``(namespace, Secret name, owner uid)`` -> push token (a fleet's or a pool's
            server push token, from its Secret).
        acks: ``(namespace, fleet)`` -> client pod uid -> newest routing-table version it
            acknowledged (lost on restart: the next push's 409 tells it again).
        push_retries: ``(namespace, fleet)`` -> client pod uid -> push back-off state
            (:func:`eaas.operator.push.push_retry_delay_s`).
        fleet_acks: ``(namespace, pool)`` -> fleet -> acknowledged versions of its Ready
            clients (for the pool's status).
        report_listen: ``HOST:PORT`` of the failure-report endpoint (env
            ``EAAS_OPERATOR_REPORT_LISTEN``; empty: not served).
        suspects: ``(namespace, pool)`` -> pod name -> ``(pod uid, monotonic time of the
            confirming probe)`` of expert servers a client reported and the operator's own
            probe confirmed down: left out of the routing table until a probe answers again or
            the pod is replaced.
        report_tokens: ``(namespace, fleet)`` -> push token (to check failure reports).
        reported: ``(namespace, pool)`` -> messages of confirmed failure reports, posted as
            ``ServerUnreachable`` Warning events by the pool's next reconcile step.
        applied: ``(namespace, kind, name, spec hash)`` -> when the clients' RBAC object was last
            applied (re-checked every :data:`RBAC_RECHECK_S`).
        staged: ``(namespace, pool)`` -> routing-table version given to the servers and not yet
            to the clients (``routing-table`` pools; lost on restart: re-staged with a larger
            version).
        server_tables: ``(namespace, pool)`` -> ``(pod uid, restarts)`` -> the server's last
            answer (assigned / weights / released versions).
        last_rebalance: ``(namespace, pool)`` -> when the last load rebalance was staged.
        load_driven: pools whose outcome follows the measured load (``spec.autoscaling`` or the
            ``load-balanced`` policy): they keep the ``resync_s`` steps (status.load, rebalancing).
        elector: the Lease election (:mod:`eaas.operator.leader`); None: act unconditionally
            (only for tests of single steps).
        loop: kopf's event loop (to wake daemons from other threads).
        scraper: the expert-load scraper (:mod:`eaas.operator.load`; started by
            :func:`configure`), keyed by ``(namespace, pool)``.
        placement_load: ``(namespace, pool)`` -> (monotonic time, measured load) given to
            load-balanced placement, refreshed at most once per load window (a new load is a
            new placement input).
        metrics_runner: the external metrics API listener (:mod:`eaas.operator.external_metrics`).
    """

    resync_s: float = 2.0
    idle_resync_s: float = IDLE_RESYNC_S
    wakeups: dict[tuple[str, str, str], asyncio.Event] = field(default_factory=dict)
    tables: dict[tuple[str, str], tuple[str, RoutingTable]] = field(default_factory=dict)
    node_ready: dict[str, bool] = field(default_factory=dict)
    node_labels: dict[str, dict[str, str]] = field(default_factory=dict)
    placements: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    report_base_url: str = ""
    tokens: dict[tuple[str, str, str], str] = field(default_factory=dict)
    acks: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)
    push_retries: dict[tuple[str, str], dict[str, PushRetry]] = field(default_factory=dict)
    fleet_acks: dict[tuple[str, str], dict[str, list[int]]] = field(default_factory=dict)
    report_listen: str = ""
    applied: dict[tuple[str, str, str, str], float] = field(default_factory=dict)
    reported: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    suspects: dict[tuple[str, str], dict[str, tuple[str, float]]] = field(default_factory=dict)
    report_tokens: dict[tuple[str, str], str] = field(default_factory=dict)
    staged: dict[tuple[str, str], RoutingTable] = field(default_factory=dict)
    load_driven: set[tuple[str, str]] = field(default_factory=set)
    server_tables: dict[tuple[str, str], dict[tuple[str, int], ServerTableState]] = field(
        default_factory=dict
    )
    last_rebalance: dict[tuple[str, str], str] = field(default_factory=dict)
    elector: LeaderElector | None = None
    report_runner: Any = None
    loop: asyncio.AbstractEventLoop | None = None
    scraper: LoadScraper | None = None
    placement_load: dict[tuple[str, str], tuple[float, dict[LayerExpert, float]]] = field(
        default_factory=dict
    )
    metrics_runner: Any = None
    _api: k8s.ApiClient | None = None
    _pool: concurrent.futures.ThreadPoolExecutor | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> OperatorState:
        """State with settings from the environment (``EAAS_OPERATOR_RESYNC_S``,
        ``EAAS_OPERATOR_REPORT_URL``, ``EAAS_OPERATOR_REPORT_LISTEN``)."""
        return cls(
            resync_s=float(env.get("EAAS_OPERATOR_RESYNC_S", "2.0")),
            idle_resync_s=idle_resync_from_env(env),
            report_base_url=env.get("EAAS_OPERATOR_REPORT_URL", ""),
            report_listen=env.get("EAAS_OPERATOR_REPORT_LISTEN", ""),
        )

    def api(self) -> k8s.ApiClient:
        """Kubernetes ApiClient from the in-cluster config or the current kubeconfig (built on
        first use: importing this module must not need a cluster)."""
        if self._api is None:
            try:
                k8s_config.load_incluster_config()
            except k8s_config.ConfigException:
                k8s_config.load_kube_config()
            self._api = k8s.ApiClient()
        return self._api

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """Threads for concurrent pod creations (a 40-server pool: 40 POSTs)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=8, thread_name_prefix="eaas-create"
            )
        return self._pool

    def is_leader(self) -> bool:
        """Whether this process may act (holds the Lease, or runs without an election)."""
        return self.elector is None or self.elector.is_leader()

    def wake_all(self) -> None:
        """Wake every daemon (from any thread): e.g. on becoming the leader."""
        if self.loop is None:
            return
        for key in list(self.wakeups):
            self.loop.call_soon_threadsafe(self.wake, *key)

    def wake_event(self, kind: str, namespace: str, name: str) -> asyncio.Event:
        return self.wakeups.setdefault((kind, namespace, name), asyncio.Event())

    def wake(self, kind: str, namespace: str, name: str) -> None:
        """Make the daemon of that object reconcile now (from the event loop's thread)."""
        self.wake_event(kind, namespace, name).set()

    def placement(
        self,
        spec: ExpertPoolSpec,
        observed: list[ObservedPod],
        load: dict[LayerExpert, float] | None,
    ) -> Placement:
        """:func:`compute_placement`, memoized on its inputs (64 entries; a DeepSeek-V3 pool
        takes ~0.2 s of CPU and every reconcile step needs it).

        Raises:
            PlacementError: as :func:`compute_placement`.
        """
        key = (
            spec.model_dump_json(include={"model", "replicas", "redundancy", "placement"}),
            tuple(
                sorted((p.index, p.experts) for p in observed if not (p.terminating or p.finished))
            ),
            tuple(sorted(load.items())) if load else None,
        )
        hit = self.placements.get(key)
        if hit is None:
            hit = compute_placement(spec, load, observed)
            self.placements[key] = hit
            while len(self.placements) > 64:
                self.placements.popitem(last=False)
        else:
            self.placements.move_to_end(key)
        return hit


def _state(memo: Any) -> OperatorState:
    """The operator's state in kopf's memo (made by :func:`configure`)."""
    state = getattr(memo, "eaas", None)
    if state is None:
        state = memo.eaas = OperatorState.from_env()
    return state


def _namespace(namespace: str | None) -> str:
    """The namespace of a namespaced object's handler call.

    kopf types ``namespace`` as ``str | None`` (cluster-scoped objects have none); ExpertPools,
    AttentionFleets and pods are namespaced, so it is always set for them.

    Raises:
        kopf.PermanentError: ``namespace`` is None (a handler registered for a cluster-scoped
            resource by mistake).
    """
    if namespace is None:
        raise kopf.PermanentError("a namespaced resource's handler was called without a namespace")
    return namespace


def _json_object(obj: object) -> dict[str, Any]:
    """A ``CustomObjectsApi`` read result as a dict (the client types it ``object``: it returns
    the decoded JSON body, which for one object is a dict).

    Raises:
        TypeError: the body is not a JSON object.
    """
    if not isinstance(obj, dict):
        raise TypeError(f"expected a JSON object from the API, got {type(obj).__name__}")
    return obj


def _plain(state: OperatorState, obj: Any) -> Any:
    """Kubernetes model object -> camelCase dict, as the API returns it."""
    return state.api().sanitize_for_serialization(obj)


def _raw(method: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Call a kubernetes-client read/list method and return the JSON body as a dict, skipping the
    client's slow model deserialization (40 pods with long command lines: ~10x faster)."""
    resp = method(*args, _preload_content=False, **kwargs)
    return json.loads(resp.data)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pool_busy(state: OperatorState, namespace: str, name: str) -> bool:
    """Whether a pool needs a full step every ``resync_s`` rather than once per idle resync: it
    has servers under suspicion (re-probed), a routing table staged on its servers and not yet
    published (their weight confirmations are polled), or it follows the measured load."""
    key = (namespace, name)
    return bool(state.suspects.get(key)) or key in state.staged or key in state.load_driven


async def _loop(
    state: OperatorState,
    kind: str,
    namespace: str,
    name: str,
    stopped: kopf.DaemonStopped,
    step: Callable[[OperatorState, str, str, kopf.Logger], None],
    logger: kopf.Logger,
) -> None:
    event = state.wake_event(kind, namespace, name)
    woken, failed, last_step = True, False, -1e18
    try:
        while not stopped:
            # pools: full steps on events, else once per idle resync (:mod:`.resync`)
            due = kind != "pool" or step_due(
                woken,
                failed,
                _pool_busy(state, namespace, name),
                time.monotonic() - last_step,
                state.idle_resync_s,
            )
            try:
                if state.is_leader() and due:  # a standby operator watches but never acts
                    last_step, failed = time.monotonic(), True
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
                await asyncio.wait_for(event.wait(), timeout=state.resync_s)
            except asyncio.TimeoutError:
                pass
            woken = event.is_set()
            event.clear()
    finally:
        state.wakeups.pop((kind, namespace, name), None)


# ---------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------
@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    """Operator-wide kopf settings (annotation-based persistence, standalone, quick watches) and
    the operator's in-memory state in the root ``memo``."""
    state = memo.eaas = OperatorState.from_env()
    # one operator acts: our own Lease election (kopf peering freezes equal-priority peers)
    settings.peering.standalone = True
    settings.posting.level = logging.INFO  # only explicit kopf.info/warn calls post Events
    settings.watching.server_timeout = int(os.environ.get("EAAS_OPERATOR_WATCH_TIMEOUT_S", "60"))
    settings.watching.client_timeout = settings.watching.server_timeout + 10
    settings.watching.label_selectors["v1", "pods"] = LABEL_POOL
    settings.watching.label_selectors["v1", "configmaps"] = LABEL_POOL
    settings.persistence.finalizer = "eaas.io/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="eaas.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="eaas.io", key="last-handled-configuration"
    )
    settings.execution.max_workers = 32
    settings.background.cancellation_polling = 1
    state.api()
    state.loop = asyncio.get_running_loop()

    def on_change(leader: bool) -> None:
        if leader:
            state.wake_all()

    state.elector = LeaderElector(LeaseSettings.from_env(), state.api(), on_change).start()
    if state.report_listen:
        state.report_runner = await _start_report_server(state)
    state.scraper = LoadScraper.from_env(os.environ).start()
    if os.environ.get("EAAS_OPERATOR_METRICS_LISTEN"):
        state.metrics_runner = await _start_external_metrics(state)


async def _start_report_server(state: OperatorState) -> web.AppRunner:
    """Serve ``POST /v1/failure-reports/{namespace}/{fleet}`` and ``GET /metrics``
    (:func:`operator_metrics`) on ``state.report_listen``.

    Raises:
        ValueError: ``EAAS_OPERATOR_REPORT_LISTEN`` is not ``HOST:PORT``.
    """
    host, sep, port = state.report_listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(
            f"EAAS_OPERATOR_REPORT_LISTEN must be HOST:PORT, got {state.report_listen!r}"
        )
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
    log.info("failure reports served on http://%s/v1/failure-reports/NS/FLEET", state.report_listen)
    return runner


def operator_metrics(state: OperatorState) -> str:
    """Prometheus text exposition (version 0.0.4) of ``GET /metrics`` on the report listener:
    ``eaas_operator_leader`` (1 on the replica holding the Lease, else 0) and
    ``eaas_operator_routing_table_version{namespace, configmap}`` (the newest table version this
    replica has read)."""
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
    return "\n".join(lines) + "\n"


def _report_token(state: OperatorState, namespace: str, fleet: str, fresh: bool) -> str:
    """The fleet's push token ("" when its Secret does not exist); cached unless ``fresh``."""
    key = (namespace, fleet)
    if not fresh and key in state.report_tokens:
        return state.report_tokens[key]
    core = k8s.CoreV1Api(state.api())
    try:
        secret = _raw(core.read_namespaced_secret, push_secret_name(fleet), namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return ""
    token = base64.b64decode((secret.get("data") or {}).get(PUSH_TOKEN_KEY, "")).decode().strip()
    state.report_tokens[key] = token
    return token


async def failure_report(state: OperatorState, request: web.Request) -> web.Response:
    """One client's failure report (see :mod:`eaas.operator.monitor` for the answers): check the
    token, parse, find the pod, probe its ``/health``; if the probe fails too, mark it suspect
    and wake its pool (the next table leaves it out)."""
    namespace, fleet = request.match_info["namespace"], request.match_info["fleet"]
    if not state.is_leader():
        return await _forward_to_leader(state, request)
    auth = request.headers.get("Authorization")
    token = await asyncio.to_thread(_report_token, state, namespace, fleet, False)
    if not bearer_ok(auth, token):
        token = await asyncio.to_thread(_report_token, state, namespace, fleet, True)
        if not bearer_ok(auth, token):
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
        pod = await asyncio.to_thread(_raw, core.read_namespaced_pod, report.server_id, namespace)
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
    if await asyncio.to_thread(probe_health, url):
        log.info(
            "client %s of %s/%s reported %s (%s); its /health answers: kept",
            report.client_id,
            namespace,
            fleet,
            report.server_id,
            report.reason,
        )
        return web.json_response({"action": "kept"})
    state.suspects.setdefault((namespace, pool), {})[report.server_id] = (
        pod["metadata"]["uid"],
        time.monotonic(),
    )
    log.warning(
        "client %s of %s/%s reported %s (%s); confirmed by probe: leaving the routing table",
        report.client_id,
        namespace,
        fleet,
        report.server_id,
        report.reason,
    )
    state.wake("pool", namespace, pool)
    # posted by the pool's reconcile step (kopf posts Events from its handlers' context)
    state.reported.setdefault((namespace, pool), []).append(
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


@kopf.on.cleanup()
async def release_lease(memo: Any, **_: Any) -> None:
    """On shutdown, free the Lease so a standby takes over at once."""
    state = getattr(memo, "eaas", None)
    if state is not None and state.elector is not None:
        state.elector.stop(release=True)
    if state is not None and state.report_runner is not None:
        await state.report_runner.cleanup()
    if state is not None and state.metrics_runner is not None:
        await state.metrics_runner.cleanup()
    if state is not None and state.scraper is not None:
        state.scraper.stop()


# ---------------------------------------------------------------------------------------------
# ExpertPool
# ---------------------------------------------------------------------------------------------
@kopf.on.create(GROUP, VERSION, POOLS)
@kopf.on.update(GROUP, VERSION, POOLS, field="spec")
@kopf.on.resume(GROUP, VERSION, POOLS)
async def pool_spec_changed(
    body: kopf.Body, namespace: str | None, name: str, reason: str, memo: Any, **_: Any
) -> None:
    """Announce the placement inputs for the new spec (as an Event) and wake the pool's daemon.
    The placement itself is computed by the daemon, incrementally from the pods."""
    try:
        spec = ExpertPoolSpec.model_validate(dict(body["spec"]))
        if spec.redundancy > spec.replicas:
            raise PlacementError(
                f"redundancy ({spec.redundancy}) cannot exceed the number of servers "
                f"({spec.replicas})"
            )
    except (ValidationError, PlacementError) as exc:
        if _state(memo).is_leader():
            kopf.warn(body, reason="InvalidSpec", message=str(exc).splitlines()[0])
    else:
        if reason != "resume" and _state(memo).is_leader():
            slots = max(
                spec.placement.slots_per_server,
                auto_slots(spec.model.num_experts, spec.redundancy, spec.replicas),
            )
            kopf.info(
                body,
                reason="PlacementComputed",
                message=f"revision {placement_revision(spec)}: {spec.replicas} servers, redundancy "
                f"{spec.redundancy}, >= {slots} experts per server per layer "
                f"({spec.placement.policy}, incremental)",
            )
    _state(memo).wake("pool", _namespace(namespace), name)


@kopf.daemon(GROUP, VERSION, POOLS, cancellation_timeout=5)
async def pool_daemon(
    namespace: str | None,
    name: str,
    stopped: kopf.DaemonStopped,
    logger: kopf.Logger,
    memo: Any,
    **_: Any,
) -> None:
    """Reconcile the pool now, on every wakeup and every ``resync_s`` seconds."""
    await _loop(_state(memo), "pool", _namespace(namespace), name, stopped, reconcile_pool, logger)


@kopf.on.event("", "v1", "pods", labels={LABEL_POOL: kopf.PRESENT, LABEL_ROLE: SERVER_ROLE})
async def server_pod_event(namespace: str | None, labels: kopf.Labels, memo: Any, **_: Any) -> None:
    """Any change of an expert-server pod (readiness, IP, deletion) wakes its pool."""
    _state(memo).wake("pool", _namespace(namespace), labels[LABEL_POOL])


@kopf.on.event("", "v1", "configmaps", labels={LABEL_POOL: kopf.PRESENT})
async def pool_configmap_event(
    namespace: str | None, labels: kopf.Labels, memo: Any, **_: Any
) -> None:
    """A ConfigMap of a pool (its routing table: edited or deleted by hand) changed: reconcile
    the pool now rather than at its next idle resync (:mod:`eaas.operator.resync`)."""
    _state(memo).wake("pool", _namespace(namespace), labels[LABEL_POOL])


def _parse_table(state: OperatorState, namespace: str, cm: dict[str, Any]) -> RoutingTable:
    """Parse the ConfigMap's table, reusing the last parse while its resourceVersion is unchanged.

    Raises:
        RoutingTableError: the ConfigMap holds no valid table.
    """
    key = (namespace, cm["metadata"]["name"])
    hit = state.tables.get(key)
    if hit and hit[0] == cm["metadata"]["resourceVersion"]:
        return hit[1]
    table = RoutingTable.from_json((cm.get("data") or {}).get(TABLE_KEY, ""))
    state.tables[key] = (cm["metadata"]["resourceVersion"], table)
    return table


@kopf.on.event("", "v1", "nodes")
async def node_event(
    name: str,
    status: kopf.Status,
    labels: kopf.Labels,
    type: str | None,
    memo: Any,
    **_: Any,
) -> None:
    """Track node readiness. A node going NotReady (or Unknown: its kubelet stopped reporting)
    takes its expert servers out of the routing tables at once, long before their pods are
    evicted; every pool is woken when a node's readiness flips."""
    ready = type != "DELETED" and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (status.get("conditions") or [])
    )
    state = _state(memo)
    if type == "DELETED":
        state.node_labels.pop(name, None)
    else:
        state.node_labels[name] = dict(labels)
    if state.node_ready.get(name) != ready:
        state.node_ready[name] = ready
        for kind, namespace, pool in list(state.wakeups):
            if kind == "pool":
                state.wake(kind, namespace, pool)


def _event(body: dict[str, Any], reason: str, message: str, warning: bool = False) -> None:
    """Post a Kubernetes Event about the object ``body`` (a custom object read from the API)."""
    obj = kopf.Body(cast(kopf.RawBody, body))
    (kopf.warn if warning else kopf.info)(obj, reason=reason, message=message)


def _get_live(
    custom: k8s.CustomObjectsApi, namespace: str, plural: str, name: str
) -> dict[str, Any] | None:
    """The custom object, or None when it is gone or being deleted (nothing left to reconcile).

    Raises:
        ApiException: any API error but 404.
    """
    try:
        body = _json_object(
            custom.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return None if body["metadata"].get("deletionTimestamp") else body


def reconcile_pool(state: OperatorState, namespace: str, name: str, logger: kopf.Logger) -> None:
    """One reconcile step of ExpertPool ``namespace/name``.

    Reads the pool, its pods and its routing-table ConfigMap; creates/deletes/relabels pods as
    :func:`plan_pods` decides; publishes a new routing table when the live set changed; writes
    the status when it changed.

    Raises:
        ApiException: any API error but 404/409 on create/delete (the daemon logs and retries).
    """
    custom = k8s.CustomObjectsApi(state.api())
    core = k8s.CoreV1Api(state.api())
    body = _get_live(custom, namespace, POOLS, name)
    if body is None:
        return
    owner = Owner.from_body(body)
    old_status = body.get("status") or {}
    old_conditions = old_status.get("conditions") or []
    pods = _raw(
        core.list_namespaced_pod, namespace, label_selector=selector_string(server_labels(name))
    )["items"]
    observed = [ObservedPod.from_pod(p, state.node_ready) for p in pods]
    observed = [
        p for p in observed if p.owner_uid == owner.uid
    ]  # a same-named older pool's pods: GC's job
    try:
        spec = ExpertPoolSpec.model_validate(body["spec"])
        if spec.autoscaling is not None or spec.placement.policy == "load-balanced":
            state.load_driven.add((namespace, name))
        else:
            state.load_driven.discard((namespace, name))
        _track_load(state, namespace, name, pods, observed)
        if table_assignment(spec):
            _reconcile_table_pool(state, core, custom, body, owner, spec, observed, pods, logger)
            return
        load = _placement_load(state, core, body, spec, logger)
        placement = state.placement(spec, observed, load)
        revision = placement_revision(spec)
        desired = desired_server_pods(owner, spec, placement, revision)
    except (ValidationError, PlacementError, OverlayError) as exc:
        status = invalid_spec_status(
            owner, str(exc).splitlines()[0], old_conditions, _now(), old_status
        )
        _write_status(custom, namespace, name, old_status, status)
        return
    plan = plan_pods(desired, observed, max_unavailable=max(1, spec.redundancy - 1))
    _apply_pod_plan(state, core, body, plan, logger)

    deleted = {n for n, _, _ in plan.delete}
    for message in state.reported.pop((namespace, name), []):
        _event(body, "ServerUnreachable", message, warning=True)
    down = _confirmed_down(state, namespace, name, pods, logger)
    live = [p for p in observed if p.live and p.name not in deleted and p.name not in down]
    table, table_error = _publish_table(state, core, body, owner, spec, live, old_status, logger)

    status = pool_status(
        owner=owner,
        spec=spec,
        placement=placement,
        revision=revision,
        observed=observed,
        plan=plan,
        table=table,
        old_conditions=old_conditions,
        now=_now(),
        table_error=table_error,
        node_domains={
            node: value
            for node, labels in state.node_labels.items()
            if (value := labels.get(spec.placement.topology_key))
        },
    )
    client_acks = [v for acks in state.fleet_acks.get((namespace, name), {}).values() for v in acks]
    status.update(clients=len(client_acks), **ack_summary(client_acks, table.version))
    status.update(_load_status(state, namespace, name))
    _ensure_hpa(state, body, owner, spec, logger)
    _finish_status(custom, body, old_status, status)


def _finish_status(
    custom: k8s.CustomObjectsApi,
    body: dict[str, Any],
    old_status: dict[str, Any],
    status: dict[str, Any],
) -> None:
    """Write the pool's status if it changed; post PoolReady / ExpertsUncovered on transitions."""
    meta = body["metadata"]
    old_conditions = old_status.get("conditions") or []
    if _write_status(custom, meta["namespace"], meta["name"], old_status, status):
        was = {c.get("type"): c.get("status") for c in old_conditions}
        now = {c["type"]: c for c in status["conditions"]}
        if was.get("Ready") != "True" and now["Ready"]["status"] == "True":
            _event(body, "PoolReady", now["Ready"]["message"])
        was_reason = {c.get("type"): c.get("reason") for c in old_conditions}.get("Degraded")
        if (
            was_reason not in (None, "ExpertsUncovered")
            and now["Degraded"]["reason"] == "ExpertsUncovered"
        ):
            _event(body, "ExpertsUncovered", now["Degraded"]["message"], warning=True)


def _apply_pod_plan(
    state: OperatorState,
    core: k8s.CoreV1Api,
    body: dict[str, Any],
    plan: PodPlan,
    logger: kopf.Logger,
) -> None:
    """Create, delete and relabel expert-server pods as ``plan`` says (Events for each kind).

    Raises:
        ApiException: any API error but 409 on create and 404/409 on delete.
    """
    namespace = body["metadata"]["namespace"]

    def create(manifest: dict[str, Any]) -> None:
        try:
            # the client's validate_call would turn the dict into a V1Pod the same way
            core.create_namespaced_pod(namespace, k8s.V1Pod.model_validate(manifest))
            logger.info("created expert server %s", manifest["metadata"]["name"])
        except ApiException as exc:
            if exc.status != 409:  # 409: made by an earlier (killed) run
                raise

    # list() re-raises the first failure; the others were attempted anyway
    list(state.executor().map(create, plan.create))
    if plan.create:
        _event(
            body,
            "ServersCreated",
            f"created {', '.join(m['metadata']['name'] for m in plan.create)}",
        )
    for pod_name, uid, why in plan.delete:
        try:
            core.delete_namespaced_pod(
                pod_name,
                namespace,
                body=k8s.V1DeleteOptions(preconditions=k8s.V1Preconditions(uid=uid)),
            )
            logger.info("deleted expert server %s (%s)", pod_name, why)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
    if plan.delete:
        msg = "deleted " + ", ".join(f"{n} ({why})" for n, _, why in plan.delete)
        if plan.forced:
            msg += (
                "; forced: some experts lose their last live replica until replacements are Ready"
            )
        _event(
            body,
            "ServersDeleted",
            msg,
            warning=plan.forced or any(w == "failed" for _, _, w in plan.delete),
        )
    for pod_name, rev in plan.relabel:
        try:
            core.patch_namespaced_pod(
                pod_name, namespace, {"metadata": {"labels": {LABEL_PLACEMENT_REVISION: rev}}}
            )
        except ApiException as exc:
            if exc.status != 404:
                raise


# ---------------------------------------------------------------------------------------------
# ExpertPool with spec.placement.assignment: routing-table (issue 7, item 3)
# ---------------------------------------------------------------------------------------------
def _server_url(pod: ObservedPod, spec: ExpertPoolSpec) -> str:
    return f"http://{pod.ip}:{spec.health_port}"


def _ensure_token_secret(
    state: OperatorState,
    core: k8s.CoreV1Api,
    owner: Owner,
    name: str,
    manifest: Callable[[Owner, str], dict[str, Any]],
) -> str:
    """The bearer token stored under ``PUSH_TOKEN_KEY`` in Secret ``name`` (owned by ``owner``),
    creating the Secret from ``manifest(owner, new_push_token())`` when it is missing (a 409 from
    a racing create is read back). The token never changes once made, so it is cached per
    (namespace, Secret name, owner uid): a recreated owner gets a new Secret and token.

    Used for a pool's server push token (:func:`server_push_secret`) and a fleet's push token
    (:func:`push_secret`).

    Raises:
        kopf.TemporaryError: the Secret exists but has no token (retried in 5 s).
        ApiException: any other API error than 404 on read / 409 on create.
    """
    key = (owner.namespace, name, owner.uid)
    hit = state.tokens.get(key)
    if hit:
        return hit
    try:
        secret = _raw(core.read_namespaced_secret, name, owner.namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
        try:
            _raw(core.create_namespaced_secret, owner.namespace, manifest(owner, new_push_token()))
        except ApiException as exc2:
            if exc2.status != 409:
                raise
        secret = _raw(core.read_namespaced_secret, name, owner.namespace)
    token = base64.b64decode((secret.get("data") or {}).get(PUSH_TOKEN_KEY, "")).decode().strip()
    if not token:
        raise kopf.TemporaryError(f"Secret {name} has no {PUSH_TOKEN_KEY!r}", delay=5)
    state.tokens[key] = token
    return token


def _sync_servers(
    state: OperatorState,
    key: tuple[str, str],
    pods: list[ObservedPod],
    spec: ExpertPoolSpec,
    token: str,
    target: RoutingTable | None,
    release: int,
    logger: kopf.Logger,
) -> dict[str, int]:
    """Bring the live servers up to ``target`` (PUT it to those whose assigned version is
    older), raise their released version to ``release``, and poll those still loading.
    Answers are remembered per (pod uid, restarts): a restarted process is asked again.
    Returns server name -> confirmed ``weights_version``."""
    known = state.server_tables.setdefault(key, {})
    alive = {(p.uid, p.restarts) for p in pods}
    for k in set(known) - alive:
        del known[k]
    table_json = target.to_wire() if target is not None else ""

    def one(pod: ObservedPod) -> tuple[ObservedPod, ServerTableState | None, str]:
        k = (pod.uid, pod.restarts)
        st = known.get(k)
        url = _server_url(pod, spec)
        try:
            if (
                target is not None
                and pod.name in target.servers
                and (st is None or st.assigned_version < target.version)
            ):
                st = put_server_table(url, table_json, token)
                if st.status not in (202, 409):
                    return pod, None, f"push answered {st.status}: {st.message}"
            elif st is None or (target is not None and st.weights_version < st.assigned_version):
                st = get_server_state(url)
            if release and st is not None and st.released_version < release:
                st = release_server(url, release, token)
        except OSError as exc:
            return pod, None, f"{type(exc).__name__}: {exc}"
        return pod, st, ""

    confirmed: dict[str, int] = {}
    for pod, st, why in state.executor().map(one, pods):
        if st is None:
            logger.info("expert server %s: table sync failed: %s", pod.name, why)
            old = known.get((pod.uid, pod.restarts))
            if old is not None:
                confirmed[pod.name] = old.weights_version
            continue
        known[(pod.uid, pod.restarts)] = st
        confirmed[pod.name] = st.weights_version
    return confirmed


def _reconcile_table_pool(
    state: OperatorState,
    core: k8s.CoreV1Api,
    custom: k8s.CustomObjectsApi,
    body: dict[str, Any],
    owner: Owner,
    spec: ExpertPoolSpec,
    observed: list[ObservedPod],
    pods: list[dict[str, Any]],
    logger: kopf.Logger,
) -> None:
    """One reconcile step of a ``routing-table`` pool: make-before-break publishing.

    1. Pods: ``spec.replicas`` identical-but-for-the-index servers (no experts in their spec),
       so a new assignment never replaces a pod. A live excess pod is deleted only when no
       client can still use it: absent from the published and the pending table, and every
       client acknowledged the published one.
    2. Candidate: a server that died (or changed IP) first leaves the published table at once
       (a table that only takes experts away needs no loading); otherwise the placement over
       the live members is computed from the table in force (:func:`member_placement`; load
       rebalancing when :func:`rebalance_due`).
    3. :func:`two_phase_step` decides: stage (push to servers, wait for their
       ``weights_version``), publish (ConfigMap + client pushes), release (servers drop experts
       only older versions used).

    Raises:
        ApiException: as :func:`reconcile_pool`.
    """
    namespace, name = owner.namespace, owner.name
    key = (namespace, name)
    old_status = body.get("status") or {}
    revision = placement_revision(spec)
    token = _ensure_token_secret(
        state, core, owner, server_push_secret_name(owner.name), server_push_secret
    )
    cm, published, annotated = _read_table_cm(state, core, owner, logger)
    staged = state.staged.get(key)
    floor = max(
        annotated,
        int(old_status.get("routingTableVersion") or 0),
        int(old_status.get("stagedRoutingTableVersion") or 0),
    )
    for message in state.reported.pop(key, []):
        _event(body, "ServerUnreachable", message, warning=True)
    down = _confirmed_down(state, namespace, name, pods, logger)
    live = sorted(
        (p for p in observed if p.live and p.name not in down), key=lambda p: (p.index, p.name)
    )
    endpoints = {p.name: server_endpoint(spec, p.index, p.ip) for p in live}
    client_acks = [v for acks in state.fleet_acks.get(key, {}).values() for v in acks]

    # 1. pods (ObservedPod.experts from the published table: plan_pods' coverage checks)
    held = assignment_of(published)
    observed_t = [
        dataclasses.replace(p, experts=tuple(sorted(held.get(p.name, ())))) for p in observed
    ]
    pub_v = published.version if published else 0
    pending = staged if staged is not None and staged.version > pub_v else None
    in_use: set[str] = set(published.servers) if published else set()
    if pending is not None:
        in_use |= set(pending.servers)
    if client_acks and min(client_acks) < pub_v:
        in_use |= {p.name for p in observed}  # some client is on an older table: hold all
    plan = plan_pods(
        desired_table_pods(owner, spec, revision),
        observed_t,
        max_unavailable=max(1, spec.redundancy - 1),
        in_use=in_use,
    )
    _apply_pod_plan(state, core, body, plan, logger)
    deleted = {n for n, _, _ in plan.delete}
    live = [p for p in live if p.name not in deleted]
    endpoints = {n: ep for n, ep in endpoints.items() if n not in deleted}

    # 2. the candidate table
    members = table_members(spec, live)  # in an NVSHMEM world spares stand in for the missing
    if published is not None and any(endpoints.get(s) != ep for s, ep in published.servers.items()):
        survivors = {s: ep for s, ep in published.servers.items() if endpoints.get(s) == ep}
        candidate = table_from_assignment(spec, held, survivors, 0)  # failure: remove at once
        rebalanced = False
    else:
        in_force = pending or published
        load = _placement_load(state, core, body, spec, logger)
        since = _seconds_since(old_status.get("lastRebalanceTime") or "")
        due, imbalance = rebalance_due(spec, table_placement(spec, members, in_force), load, since)
        domains = [
            state.node_labels.get(p.node, {}).get(spec.placement.topology_key) or p.node or p.name
            for p in live
            if p.name in members
        ]
        memo_key = (
            "table",
            spec.model_dump_json(include={"model", "replicas", "redundancy", "placement"}),
            tuple(members),
            tuple(domains),
            in_force.version if in_force else 0,
            tuple(sorted(load.items())) if (due and load) else None,
        )
        assignment = state.placements.get(memo_key)
        if assignment is None:
            assignment = member_placement(spec, members, in_force, load, due, domains)
            state.placements[memo_key] = assignment
            while len(state.placements) > 64:
                state.placements.popitem(last=False)
        candidate = table_from_assignment(spec, assignment, {m: endpoints[m] for m in members}, 0)
        rebalanced = due
        if due:
            logger.info("pool %s/%s: imbalance %.3f: rebalancing", namespace, name, imbalance)

    # 3. two-phase step
    confirmed_now = {
        p.name: st.weights_version
        for p in live
        if (st := state.server_tables.get(key, {}).get((p.uid, p.restarts))) is not None
    }
    step = two_phase_step(candidate, published, staged, confirmed_now, client_acks, floor)
    if step.abandoned and staged is not None:
        state.staged.pop(key, None)
        _event(
            body,
            "StagedTableAbandoned",
            f"routing table version {staged.version} given up: one of its servers left",
            warning=True,
        )
    table, table_error = published, ""
    if step.stage is not None:
        state.staged[key] = step.stage
        _event(
            body,
            "RoutingTableStaged",
            f"routing table version {step.stage.version} sent to {len(step.stage.servers)} "
            f"servers first: {step.reason}",
        )
        if rebalanced:
            state.last_rebalance[key] = _now()
    target = state.staged.get(key)
    if target is None or (published is not None and target.version <= published.version):
        target = published
    if step.publish is None:
        confirmed = _sync_servers(state, key, live, spec, token, target, step.release, logger)
        if target is not None and target is not published:  # staged: confirmed by now?
            step2 = two_phase_step(
                candidate, published, state.staged.get(key), confirmed, client_acks, floor
            )
            if step2.publish is not None and step2.publish.version == target.version:
                step = step2
    if step.publish is not None:
        table, table_error = _write_table(state, core, body, owner, step.publish, cm, published)
        if not table_error:
            state.staged.pop(key, None)
            _sync_servers(state, key, live, spec, token, step.publish, step.release, logger)
    if table is None:
        table = candidate  # nothing published yet: status counts what is being staged
    staged_now = state.staged.get(key)
    status = pool_status(
        owner=owner,
        spec=spec,
        placement=table_placement(spec, [p.name for p in live], table),
        revision=revision,
        observed=observed_t,
        plan=plan,
        table=table,
        old_conditions=old_status.get("conditions") or [],
        now=_now(),
        table_error=table_error,
        node_domains={
            node: value
            for node, labels in state.node_labels.items()
            if (value := labels.get(spec.placement.topology_key))
        },
    )
    status.update(clients=len(client_acks), **ack_summary(client_acks, table.version))
    newest = staged_now or table
    known = state.server_tables.get(key, {})
    status["stagedRoutingTableVersion"] = staged_now.version if staged_now else 0
    status["serversConfirmed"] = sum(
        1
        for p in live
        if p.name in newest.servers
        and (st := known.get((p.uid, p.restarts))) is not None
        and st.weights_version >= newest.version
    )
    last = state.last_rebalance.get(key) or old_status.get("lastRebalanceTime") or ""
    if last:
        status["lastRebalanceTime"] = last
    status.update(_load_status(state, namespace, name))
    _ensure_hpa(state, body, owner, spec, logger)
    _finish_status(custom, body, old_status, status)


def _seconds_since(stamp: str) -> float | None:
    """Seconds since an RFC 3339 ``...Z`` time (None: empty or unparsable)."""
    if not stamp:
        return None
    try:
        then = _dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=_dt.timezone.utc)
    except ValueError:
        return None
    return (_dt.datetime.now(_dt.timezone.utc) - then).total_seconds()


def _confirmed_down(
    state: OperatorState,
    namespace: str,
    pool: str,
    pods: list[dict[str, Any]],
    logger: kopf.Logger,
) -> set[str]:
    """Names of the pool's pods that a client reported and the operator's probe confirmed down,
    re-probed now: a pod whose ``/health`` answers again, or that was replaced (new uid) or is
    gone, is forgotten."""
    suspects = state.suspects.get((namespace, pool))
    if not suspects:
        return set()
    by_name = {p["metadata"]["name"]: p for p in pods}
    for pod_name, (uid, confirmed_at) in list(suspects.items()):
        pod = by_name.get(pod_name)
        if pod is None or pod["metadata"].get("uid") != uid:
            del suspects[pod_name]
            continue
        if time.monotonic() - confirmed_at < SUSPECT_REPROBE_S:
            continue  # just confirmed: publish the table without it first
        url = health_url(pod)
        if url is not None and probe_health(url):
            logger.info("reported server %s answers its probe again: back in the table", pod_name)
            del suspects[pod_name]
    return set(suspects)


def _read_load(
    core: k8s.CoreV1Api, body: dict[str, Any], spec: ExpertPoolSpec, logger: kopf.Logger
) -> dict[LayerExpert, float] | None:
    """Expert load for ``load-balanced`` pools from ConfigMap ``<pool>-expert-load`` (key
    ``expert-load.json``), or None (round-robin, no ConfigMap, or an invalid one: a Warning
    event names the problem and the placement goes on without load)."""
    if spec.placement.policy != "load-balanced":
        return None
    meta = body["metadata"]
    try:
        cm = _raw(
            core.read_namespaced_config_map,
            expert_load_configmap_name(meta["name"]),
            meta["namespace"],
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    try:
        return parse_expert_load((cm.get("data") or {}).get(LOAD_KEY, ""), spec) or None
    except ValueError as exc:
        logger.warning("ignoring expert load: %s", exc)
        _event(body, "InvalidExpertLoad", str(exc), warning=True)
        return None


# ---------------------------------------------------------------------------------------------
# expert load and autoscaling (issue 7 items 2 and 4)
# ---------------------------------------------------------------------------------------------
def _track_load(
    state: OperatorState,
    namespace: str,
    pool: str,
    pods: list[dict[str, Any]],
    observed: list[ObservedPod],
) -> None:
    """Hand the pool's live server pods (uid -> name, /metrics URL) to the scraper (cheap; the
    scrapes themselves run in the scraper's thread and never block this step)."""
    if state.scraper is None:
        return
    live = {p.uid for p in observed if p.live}
    targets = {}
    for pod in pods:
        uid = pod["metadata"].get("uid", "")
        url = metrics_url(pod)
        if uid in live and url:
            targets[uid] = (pod["metadata"]["name"], url)
    state.scraper.set_targets((namespace, pool), targets)


def _placement_load(
    state: OperatorState,
    core: k8s.CoreV1Api,
    body: dict[str, Any],
    spec: ExpertPoolSpec,
    logger: kopf.Logger,
) -> dict[LayerExpert, float] | None:
    """Expert load for ``load-balanced`` placement: the ConfigMap ``<pool>-expert-load`` when it
    exists (an override, :func:`_read_load`), else the load measured from the servers, as a
    snapshot renewed at most once per load window; None for round-robin or nothing measured."""
    override = _read_load(core, body, spec, logger)
    if override is not None or spec.placement.policy != "load-balanced" or state.scraper is None:
        return override
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    held = state.placement_load.get(key)
    if held is None or time.monotonic() - held[0] >= state.scraper.window_s:
        measured = pool_rates(state.scraper.load(key).per_server)
        if measured:
            held = (time.monotonic(), measured)
            state.placement_load[key] = held
    return dict(held[1]) if held else None


def _load_status(state: OperatorState, namespace: str, pool: str) -> dict[str, Any]:
    """``{"load": <summary>}`` for the pool's status; ``{"load": None}`` (the merge patch
    removes it) while nothing is measured, so a stale summary never stays."""
    load = state.scraper.load((namespace, pool)) if state.scraper is not None else None
    return {"load": load.summary() if load is not None and load.per_server else None}


def _pool_load(state: OperatorState, namespace: str, pool: str) -> tuple[float, float] | None:
    """``(tokens/s, window s)`` of a pool for the external metrics API, or None (not measured)."""
    if state.scraper is None:
        return None
    load = state.scraper.load((namespace, pool))
    total = load.total()
    return None if total is None else (total, load.window_s)


def _ensure_hpa(
    state: OperatorState,
    body: dict[str, Any],
    owner: Owner,
    spec: ExpertPoolSpec,
    logger: kopf.Logger,
) -> None:
    """Create/patch the operator-owned HPA of a pool with ``spec.autoscaling``; delete the one
    it made (label ``eaas.io/managed-hpa``) when autoscaling is unset. A user-made HPA of the
    same name (no such label) is left alone, with a Warning event. While this operator serves no
    external metrics API, an ``AutoscalerNoMetrics`` Warning event says the HPA cannot get its
    metric (again at most every ``RBAC_RECHECK_S``)."""
    want = hpa_manifest(owner, spec)
    name = hpa_name(owner.name)
    key = (owner.namespace, "HorizontalPodAutoscaler", name, json.dumps(want, sort_keys=True))
    if time.monotonic() - state.applied.get(key, -1e18) < RBAC_RECHECK_S:
        return  # checked recently with the same spec: save a GET per pool per step
    hpa_api = k8s.AutoscalingV2Api(state.api())
    try:
        live = _raw(hpa_api.read_namespaced_horizontal_pod_autoscaler, name, owner.namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
        live = None
    managed = live is not None and (live["metadata"].get("labels") or {}).get(LABEL_MANAGED)
    if want is None:
        if managed:
            hpa_api.delete_namespaced_horizontal_pod_autoscaler(name, owner.namespace)
            logger.info("deleted HPA %s (spec.autoscaling unset)", name)
        state.applied[key] = time.monotonic()
        return
    a = spec.autoscaling
    assert a is not None  # want is None without it
    if live is None:
        hpa_api.create_namespaced_horizontal_pod_autoscaler(
            owner.namespace, k8s.V2HorizontalPodAutoscaler.model_validate(want)
        )
        _event(
            body,
            "AutoscalerCreated",
            f"HPA {name}: {a.min_replicas}-{a.max_replicas} servers, target "
            f"{a.target_load_per_server} tokens/s per server on metric eaas_expert_load",
        )
    elif not managed:
        _event(
            body,
            "AutoscalerConflict",
            f"HPA {name} exists and was not made by the operator; spec.autoscaling is not applied",
            warning=True,
        )
    elif hpa_differs(live, want):
        hpa_api.patch_namespaced_horizontal_pod_autoscaler(name, owner.namespace, want)
    if live is None or managed:  # an HPA of ours: say when nothing serves its metric
        problem = hpa_metrics_warning(owner.name, state.metrics_runner is not None)
        if problem:
            logger.warning("%s", problem)
            _event(body, "AutoscalerNoMetrics", problem, warning=True)
    state.applied[key] = time.monotonic()


async def _start_external_metrics(state: OperatorState) -> Any:
    """Serve the external metrics API (env ``EAAS_OPERATOR_METRICS_LISTEN`` = ``HOST:PORT``,
    ``EAAS_OPERATOR_METRICS_CERT_FILE`` / ``EAAS_OPERATOR_METRICS_KEY_FILE`` = its serving
    certificate), client certificates checked against the apiserver's request-header CA.

    Raises:
        ValueError: the certificate variables are unset, or the cluster has no aggregation
            layer (:func:`eaas.operator.external_metrics.read_front_proxy_auth`).
    """
    cert = os.environ.get("EAAS_OPERATOR_METRICS_CERT_FILE", "")
    key = os.environ.get("EAAS_OPERATOR_METRICS_KEY_FILE", "")
    if not cert or not key:
        raise ValueError(
            "EAAS_OPERATOR_METRICS_LISTEN needs EAAS_OPERATOR_METRICS_CERT_FILE and "
            "EAAS_OPERATOR_METRICS_KEY_FILE (the serving certificate the APIService trusts)"
        )
    ca, allowed = await asyncio.to_thread(read_front_proxy_auth, k8s.CoreV1Api(state.api()))
    return await start_metrics_server(
        os.environ["EAAS_OPERATOR_METRICS_LISTEN"],
        cert,
        key,
        ca,
        allowed,
        lambda ns, pool: _pool_load(state, ns, pool),
        state.is_leader,
    )


def _publish_table(
    state: OperatorState,
    core: k8s.CoreV1Api,
    body: dict[str, Any],
    owner: Owner,
    spec: ExpertPoolSpec,
    live: list[ObservedPod],
    old_status: dict[str, Any],
    logger: kopf.Logger,
) -> tuple[RoutingTable, str]:
    """Create or update the routing-table ConfigMap if the live set changed. Returns the table
    in force and, when the new table cannot be stored (too large), why (a Warning event says it
    too; the previous table stays in force)."""
    cm_name = table_configmap_name(owner.name)
    try:
        cm = _raw(core.read_namespaced_config_map, cm_name, owner.namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
        cm = None
    previous = None
    floor = int(old_status.get("routingTableVersion") or 0)
    if cm is not None:
        floor = max(
            floor,
            int((cm["metadata"].get("annotations") or {}).get(ANNOTATION_TABLE_VERSION, "0") or 0),
        )
        try:
            previous = _parse_table(state, owner.namespace, cm)
        except RoutingTableError:
            logger.warning("ConfigMap %s holds no valid routing table; rewriting it", cm_name)
    table, changed = next_routing_table(spec, live, previous, floor)
    if not changed and cm is not None:
        return table, ""
    return _write_table(state, core, body, owner, table, cm, previous)


def _read_table_cm(
    state: OperatorState, core: k8s.CoreV1Api, owner: Owner, logger: kopf.Logger
) -> tuple[dict[str, Any] | None, RoutingTable | None, int]:
    """The routing-table ConfigMap (None: absent), its table (None: absent or invalid) and its
    version annotation.

    Raises:
        ApiException: any API error but 404.
    """
    cm_name = table_configmap_name(owner.name)
    try:
        cm = _raw(core.read_namespaced_config_map, cm_name, owner.namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return None, None, 0
    annotated = int(
        (cm["metadata"].get("annotations") or {}).get(ANNOTATION_TABLE_VERSION, "0") or 0
    )
    try:
        return cm, _parse_table(state, owner.namespace, cm), annotated
    except RoutingTableError:
        logger.warning("ConfigMap %s holds no valid routing table; rewriting it", cm_name)
        return cm, None, annotated


def _write_table(
    state: OperatorState,
    core: k8s.CoreV1Api,
    body: dict[str, Any],
    owner: Owner,
    table: RoutingTable,
    cm: dict[str, Any] | None,
    previous: RoutingTable | None,
) -> tuple[RoutingTable, str]:
    """Write ``table`` into the pool's ConfigMap (create or optimistic replace), wake the fleets
    to push it, post RoutingTablePublished. Returns the table in force and, when it cannot be
    stored (too large), why (the previous table stays in force).

    Raises:
        ApiException: any API error (409: the ConfigMap changed meanwhile; next step retries).
    """
    cm_name = table_configmap_name(owner.name)
    manifest = routing_table_configmap(owner, table)
    too_large = configmap_too_large(manifest)
    if too_large:
        _event(body, "RoutingTableTooLarge", too_large, warning=True)
        return (previous or table), too_large
    if cm is None:
        written = _raw(core.create_namespaced_config_map, owner.namespace, manifest)
    else:
        manifest["metadata"]["resourceVersion"] = cm["metadata"][
            "resourceVersion"
        ]  # optimistic concurrency
        written = _raw(core.replace_namespaced_config_map, cm_name, owner.namespace, manifest)
    state.tables[(owner.namespace, cm_name)] = (written["metadata"]["resourceVersion"], table)
    for kind, ns, fleet in list(state.wakeups):  # push the new version to the clients now
        if kind == "fleet" and ns == owner.namespace:
            state.wake(kind, ns, fleet)
    _event(
        body,
        "RoutingTablePublished",
        f"routing table version {table.version}: {len(table.servers)} live servers, "
        f"{len(table.uncovered())} uncovered experts",
    )
    return table, ""


def _write_status(
    custom: k8s.CustomObjectsApi,
    namespace: str,
    name: str,
    old: dict[str, Any],
    new: dict[str, Any],
    plural: str = POOLS,
) -> bool:
    """Merge-patch ``status`` if it changed; True if written."""
    if all(old.get(k) == v for k, v in new.items()):
        return False
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, plural, name, {"status": new}
    )
    return True


# ---------------------------------------------------------------------------------------------
# AttentionFleet
# ---------------------------------------------------------------------------------------------
@kopf.on.create(GROUP, VERSION, FLEETS)
@kopf.on.update(GROUP, VERSION, FLEETS, field="spec")
@kopf.on.resume(GROUP, VERSION, FLEETS)
async def fleet_spec_changed(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    """Wake the fleet's daemon on spec changes."""
    _state(memo).wake("fleet", _namespace(namespace), name)


@kopf.daemon(GROUP, VERSION, FLEETS, cancellation_timeout=5)
async def fleet_daemon(
    namespace: str | None,
    name: str,
    stopped: kopf.DaemonStopped,
    logger: kopf.Logger,
    memo: Any,
    **_: Any,
) -> None:
    """Reconcile the fleet now, on every wakeup and every ``resync_s`` seconds."""
    await _loop(
        _state(memo), "fleet", _namespace(namespace), name, stopped, reconcile_fleet, logger
    )


def reconcile_fleet(state: OperatorState, namespace: str, name: str, logger: kopf.Logger) -> None:
    """One reconcile step of AttentionFleet ``namespace/name``.

    Ensures its push-token Secret (made once, random), the clients' ServiceAccount/Role/
    RoleBinding, Deployment and Service; pushes the pool's current routing table to every Ready
    client that has not acknowledged it (:mod:`eaas.operator.push`); writes the status
    (readiness, the table version, acknowledgements) and hands the acknowledgements to the
    pool's status.
    """
    custom = k8s.CustomObjectsApi(state.api())
    core = k8s.CoreV1Api(state.api())
    apps = k8s.AppsV1Api(state.api())
    rbac = k8s.RbacAuthorizationV1Api(state.api())
    body = _get_live(custom, namespace, FLEETS, name)
    if body is None:
        return
    owner = Owner.from_body(body)
    spec = AttentionFleetSpec.model_validate(body["spec"])
    pool_name = spec.expert_pool_ref.name
    try:
        pool_body = _json_object(
            custom.get_namespaced_custom_object(GROUP, VERSION, namespace, POOLS, pool_name)
        )
        pool = ExpertPoolSpec.model_validate(pool_body["spec"])
    except ApiException as exc:
        if exc.status != 404:
            raise
        pool = None
    except ValidationError:
        pool = None

    token = _ensure_token_secret(state, core, owner, push_secret_name(owner.name), push_secret)
    for manifest in client_rbac(owner, pool_name):
        kind, n = manifest["kind"], manifest["metadata"]["name"]
        key = (namespace, kind, n, manifest["metadata"]["annotations"][ANNOTATION_SPEC_HASH])
        if time.monotonic() - state.applied.get(key, -1e18) < RBAC_RECHECK_S:
            continue  # applied recently: save three GETs per fleet per resync
        if kind == "ServiceAccount":
            _apply(
                manifest,
                read=lambda n=n: core.read_namespaced_service_account(n, namespace),
                create=lambda m: core.create_namespaced_service_account(namespace, m),
                patch=lambda m, n=n: core.patch_namespaced_service_account(n, namespace, m),
            )
        elif kind == "Role":
            _apply(
                manifest,
                read=lambda n=n: rbac.read_namespaced_role(n, namespace),
                create=lambda m: rbac.create_namespaced_role(namespace, m),
                patch=lambda m, n=n: rbac.patch_namespaced_role(n, namespace, m),
            )
        else:
            _apply(
                manifest,
                read=lambda n=n: rbac.read_namespaced_role_binding(n, namespace),
                create=lambda m: rbac.create_namespaced_role_binding(namespace, m),
                patch=lambda m, n=n: rbac.patch_namespaced_role_binding(n, namespace, m),
            )
        state.applied[key] = time.monotonic()
    try:
        deployment = fleet_deployment(owner, spec, pool, state.report_base_url or None)
    except OverlayError as exc:
        _event(body, "InvalidSpec", str(exc), warning=True)
        logger.warning("fleet %s/%s: %s", namespace, name, exc)
        return
    dep = _apply(
        deployment,
        read=lambda: apps.read_namespaced_deployment(name, namespace),
        create=lambda m: apps.create_namespaced_deployment(namespace, m),
        patch=lambda m: apps.patch_namespaced_deployment(name, namespace, m),
    )
    _apply(
        fleet_service(owner, spec),
        read=lambda: core.read_namespaced_service(name, namespace),
        create=lambda m: core.create_namespaced_service(namespace, m),
        patch=lambda m: core.patch_namespaced_service(name, namespace, m),
    )
    table_version, table_json = 0, ""
    try:
        cm = _raw(core.read_namespaced_config_map, table_configmap_name(pool_name), namespace)
        annotations = cm["metadata"].get("annotations") or {}
        table_version = int(annotations.get(ANNOTATION_TABLE_VERSION, "0") or 0)
        table_json = (cm.get("data") or {}).get(TABLE_KEY, "")
    except ApiException as exc:
        if exc.status != 404:
            raise

    clients = [
        ObservedClient.from_pod(p)
        for p in _raw(
            core.list_namespaced_pod, namespace, label_selector=selector_string(client_labels(name))
        )["items"]
    ]
    acks = state.acks.setdefault((namespace, name), {})
    retries = state.push_retries.setdefault((namespace, name), {})
    for m in (acks, retries):
        for uid in set(m) - {c.uid for c in clients}:
            del m[uid]  # pod gone
    now = time.monotonic()
    todo = clients_to_push(clients, acks, table_version, retries, now) if table_json else []
    if todo:
        failures = push_all(
            todo,
            spec.port,
            table_json,
            token,
            acks,
            state.executor(),
            retries=retries,
            version=table_version,
            now=now,
        )
        for pod_name, why in failures.items():
            logger.info("push of table %d to %s not acknowledged: %s", table_version, pod_name, why)
    ready = [c for c in clients if c.ready and c.ip]
    acked = [acks.get(c.uid, 0) for c in ready]
    previous = state.fleet_acks.get((namespace, pool_name), {}).get(name)
    state.fleet_acks.setdefault((namespace, pool_name), {})[name] = acked
    if previous != acked:
        state.wake("pool", namespace, pool_name)

    old_status = body.get("status") or {}
    status = fleet_status(
        owner=owner,
        spec=spec,
        deployment_status=(_plain(state, dep) or {}).get("status") if dep else None,
        pool_found=pool is not None,
        table_version=table_version,
        old_conditions=old_status.get("conditions") or [],
        now=_now(),
        acknowledged=acked,
    )
    _write_status(custom, namespace, name, old_status, status, plural=FLEETS)


def _apply(manifest: dict[str, Any], *, read: Any, create: Any, patch: Any) -> Any:
    """Create ``manifest`` or, if the live object's ``eaas.io/spec-hash`` differs, patch it.
    Returns the live object."""
    try:
        live = read()
    except ApiException as exc:
        if exc.status != 404:
            raise
        try:
            return create(manifest)
        except ApiException as exc2:
            if exc2.status != 409:
                raise
            live = read()
    want = manifest["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
    if (live.metadata.annotations or {}).get(ANNOTATION_SPEC_HASH) != want:
        return patch(manifest)
    return live
