"""What the operator keeps in memory: one :class:`OperatorState` in kopf's root ``memo``, with a
:class:`PoolMemory` per ExpertPool and a :class:`FleetMemory` per AttentionFleet.

None of it is needed for correctness: every step lists pods by label and reads the
routing-table ConfigMap, so a killed and restarted operator continues exactly where it was
(names are deterministic; creations of an existing name fail with 409 and are ignored; the table
version continues from ``max(ConfigMap, status)``). What is lost on a restart is re-learned:
acknowledgements from the next push's 409, a staged table by staging again with a larger
version, suspects from the next failure report.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kubernetes import client as k8s
from kubernetes import config as k8s_config

from eaas.operator.counters import CountingApiClient, WorkCounters
from eaas.operator.crd import ExpertPoolSpec
from eaas.operator.drain import ElasticMemory
from eaas.operator.leader import LeaderElector
from eaas.operator.load import LoadScraper
from eaas.operator.names import Owner, server_name, table_configmap_name
from eaas.operator.pods import ObservedPod, server_pod
from eaas.operator.pool_placement import compute_placement
from eaas.operator.push import PushRetry
from eaas.operator.server_push import ServerTableState
from eaas.operator.settings import Settings
from eaas.runtime.placement import LayerExpert, Placement
from eaas.runtime.tables.table import RoutingTable

#: A pool's step LISTs its pods at least this often (s), else it reads the pod index: the
#: safety net of a watch that missed an event (as client-go's informer resync).
LIST_RESYNC_S = 600.0
#: Computed placements kept (a DeepSeek-V3 pool takes ~0.2 s of CPU per placement).
PLACEMENT_CACHE = 64

T = TypeVar("T")


@dataclass(frozen=True)
class PublishedTable:
    """A routing table as this operator wrote it into the pool's ConfigMap.

    Attributes:
        resource_version: the ConfigMap's ``metadata.resourceVersion`` after the write.
        version: the table version (the ConfigMap's version annotation).
        wire: the ConfigMap's table text (what clients are pushed).
    """

    resource_version: str
    version: int
    wire: str


@dataclass
class PoolMemory:
    """One ExpertPool's memory (key ``(namespace, name)`` in :attr:`OperatorState.pools`).

    Attributes:
        suspects: pod name -> ``(pod uid, monotonic time of the confirming probe)`` of expert
            servers a client reported and the operator's own probe confirmed down: left out of
            the routing table until a probe answers again or the pod is replaced.
        reported: messages of confirmed failure reports, posted as ``ServerUnreachable`` Warning
            events by the pool's next reconcile step.
        staged: routing table given to the servers and not yet to the clients
            (``routing-table`` pools).
        server_tables: ``(pod uid, restarts)`` -> the server's last answer (assigned / weights /
            released versions).
        last_rebalance: when the last load rebalance was staged (RFC 3339; "" : none).
        placement_load: ``(monotonic time, measured load)`` given to load-balanced placement,
            refreshed at most once per load window (a new load is a new placement input).
        load_driven: the pool's outcome follows the measured load (``spec.autoscaling`` or the
            ``load-balanced`` policy): while load is measured it gets a step once per load
            window (:func:`eaas.operator.reconcile.daemon.run_daemon`).
        observed: pod uid -> ``(resourceVersion, ObservedPod)`` of the last step's pods (a pod
            the API server did not change is not parsed again; :meth:`OperatorState.observe`).
        manifests: ``(spec key, server index, experts)`` -> desired pod manifest of the last
            step (a server whose experts did not change is not built again;
            :meth:`OperatorState.desired_pods`).
        listed_at: monotonic time of the pool's last pod LIST (the index is trusted for
            :data:`LIST_RESYNC_S` after it: a watch that missed an event is repaired then).
        table_cm: the routing-table ConfigMap as this operator last wrote or read it (read
            again only when the ConfigMap watch shows another change: ``published`` dropped).
        pods_from_index: the running step reads the pods from the pod watch's index, not a
            LIST (a step that would write pods starts again with a LIST:
            :class:`StalePodView`).
        fleet_acks: fleet name -> acknowledged table versions of its Ready clients.
        published: the table this operator last wrote into the ConfigMap, handed to the
            fleets that use the pool (None: read the ConfigMap; dropped when the ConfigMap
            watch shows a version this operator did not write, and on leadership changes).
        elastic: replica changes being settled and servers leaving (:mod:`eaas.operator.drain`).
        held: server name -> why fail static keeps it in the routing table although the API
            server shows it unavailable (:mod:`eaas.operator.fail_static`; re-probed each step).
        dead: pod name -> uid of servers the pod watch saw deleted, terminating or finished
            (direct evidence) since the pool's last step began: the next step first drops them
            from the published table (:mod:`eaas.operator.reconcile.death`).
        owner: the pool as its last step read it (None: not stepped yet).
        drops_at_once: the pool's table may be trimmed of a dead server before its step (the
            experts are on the servers' command lines; a ``routing-table`` pool re-places
            first when a drop would uncover an expert). Set by each step.
        step_inputs: what the last step read that the watches keep (:meth:`OperatorState.
            step_inputs`, as the step began): an idle resync step is skipped while it is the same.
        inputs_checked_at: monotonic time :attr:`step_inputs` was last compared or taken.
    """

    suspects: dict[str, tuple[str, float]] = field(default_factory=dict)
    reported: list[str] = field(default_factory=list)
    staged: RoutingTable | None = None
    server_tables: dict[tuple[str, int], ServerTableState] = field(default_factory=dict)
    last_rebalance: str = ""
    placement_load: tuple[float, dict[LayerExpert, float]] | None = None
    load_driven: bool = False
    fleet_acks: dict[str, list[int]] = field(default_factory=dict)
    published: PublishedTable | None = None
    elastic: ElasticMemory = field(default_factory=ElasticMemory)
    held: dict[str, str] = field(default_factory=dict)
    pods_from_index: bool = False
    listed_at: float = -1e18
    table_cm: dict[str, Any] | None = None
    observed: dict[str, tuple[str, ObservedPod]] = field(default_factory=dict)
    manifests: dict[tuple[Hashable, int, tuple[LayerExpert, ...]], dict[str, Any]] = field(
        default_factory=dict
    )
    dead: dict[str, str] = field(default_factory=dict)
    owner: Owner | None = None
    drops_at_once: bool = False
    step_inputs: Hashable = None
    inputs_checked_at: float = -1e18

    def busy(self) -> bool:
        """Whether the pool needs a full step every ``resync_s`` rather than once per idle
        resync: servers under suspicion or held by fail static (re-probed), a staged table (the
        servers' weight confirmations are polled), a replica change settling or a server
        draining. A load-driven pool steps once per load window while load is measured (not
        here: it needs the scraper)."""
        return bool(self.suspects or self.held) or self.staged is not None or self.elastic.busy()

    def client_acks(self) -> list[int]:
        """Acknowledged table versions of the Ready clients of every fleet using the pool."""
        return [v for acks in self.fleet_acks.values() for v in acks]


class StalePodView(Exception):
    """A step that read its pods from the watch's index wants to create, delete or relabel
    pods: it starts again with a LIST (writes act on what the API server has now, never on a
    view that may lag behind the operator's own last writes)."""


@dataclass
class FleetMemory:
    """One AttentionFleet's memory (key ``(namespace, name)`` in :attr:`OperatorState.fleets`).

    Attributes:
        pool: the ExpertPool its spec references (None: not reconciled yet).
        acks: client pod uid -> newest routing-table version it acknowledged (lost on restart:
            the next push's 409 tells it again).
        push_retries: client pod uid -> push back-off state
            (:func:`eaas.operator.push.push_retry_delay_s`).
        report_token: its push token, checking its clients' failure reports (None: not read).
    """

    pool: str | None = None
    acks: dict[str, int] = field(default_factory=dict)
    push_retries: dict[str, PushRetry] = field(default_factory=dict)
    report_token: str | None = None


@dataclass
class OperatorState:
    """Everything the operator keeps in memory; rebuilt from the cluster after a restart.

    Attributes:
        settings: read once from the environment at start-up (:mod:`eaas.operator.settings`).
        wakeups: ``(kind, namespace, name)`` -> the event that wakes that object's daemon
            (kind ``"pool"`` or ``"fleet"``).
        tables: ``(namespace, ConfigMap name)`` -> ``(resourceVersion, parsed table)``.
        node_ready: node name -> its Ready condition is True (from the node watch).
        node_labels: node name -> its labels (from the node watch; failure domains).
        placements: bounded cache of computed placements and assignments.
        tokens: ``(namespace, Secret name, owner uid)`` -> push token (a fleet's or a pool's
            server push token, from its Secret).
        applied: ``(namespace, kind, name, spec hash)`` -> when that object (the clients'
            RBAC, an HPA) was last applied (re-checked every ``RBAC_RECHECK_S``).
        pools: ``(namespace, name)`` -> :class:`PoolMemory`.
        fleets: ``(namespace, name)`` -> :class:`FleetMemory`.
        elector: the Lease election (:mod:`eaas.operator.leader`); None: act unconditionally
            (only for tests of single steps).
        report_runner: the failure-report listener (aiohttp ``AppRunner``; None: not served).
        loop: kopf's event loop (to wake daemons from other threads).
        scraper: the expert-load scraper (:mod:`eaas.operator.load`), keyed by
            ``(namespace, pool)``.
        metrics_runner: the external metrics API listener (None: not served).
        counters: the work counters served on ``GET /metrics`` (:mod:`eaas.operator.counters`).
        pods_seen: ``(namespace, pod name)`` -> the server pod as the watch last delivered it
            (what the operator uses of it; a watch event that changes none of it wakes
            nothing).
        pod_index: kopf's index of expert-server pods, ``(namespace, pool)`` -> their bodies
            (set by the pool daemons; None: steps LIST their pods).
    """

    settings: Settings = field(default_factory=Settings)
    wakeups: dict[tuple[str, str, str], asyncio.Event] = field(default_factory=dict)
    tables: dict[tuple[str, str], tuple[str, RoutingTable]] = field(default_factory=dict)
    node_ready: dict[str, bool] = field(default_factory=dict)
    node_labels: dict[str, dict[str, str]] = field(default_factory=dict)
    placements: collections.OrderedDict[Hashable, Any] = field(
        default_factory=collections.OrderedDict
    )
    tokens: dict[tuple[str, str, str], str] = field(default_factory=dict)
    applied: dict[tuple[str, str, str, str], float] = field(default_factory=dict)
    pools: dict[tuple[str, str], PoolMemory] = field(default_factory=dict)
    fleets: dict[tuple[str, str], FleetMemory] = field(default_factory=dict)
    elector: LeaderElector | None = None
    report_runner: Any = None
    loop: asyncio.AbstractEventLoop | None = None
    scraper: LoadScraper | None = None
    metrics_runner: Any = None
    counters: WorkCounters = field(default_factory=WorkCounters)
    pod_index: Any = None
    pods_seen: dict[tuple[str, str], ObservedPod] = field(default_factory=dict)
    _api: k8s.ApiClient | None = None
    _pool: concurrent.futures.ThreadPoolExecutor | None = None

    @classmethod
    def from_env(cls) -> OperatorState:
        """State with :meth:`Settings.from_env` (the process's environment, read once).

        Raises:
            ValueError: a malformed setting.
        """
        return cls(settings=Settings.from_env())

    def pool(self, namespace: str, name: str) -> PoolMemory:
        """The memory of pool ``namespace/name`` (made empty on first use)."""
        return self.pools.setdefault((namespace, name), PoolMemory())

    def fleet(self, namespace: str, name: str) -> FleetMemory:
        """The memory of fleet ``namespace/name`` (made empty on first use)."""
        return self.fleets.setdefault((namespace, name), FleetMemory())

    def api(self) -> k8s.ApiClient:
        """Kubernetes ApiClient from the in-cluster config or the current kubeconfig (built on
        first use: importing the operator must not need a cluster)."""
        if self._api is None:
            try:
                k8s_config.load_incluster_config()
            except k8s_config.ConfigException:
                k8s_config.load_kube_config()
            self._api = CountingApiClient(self.counters)
        return self._api

    def server_pods(self, namespace: str, pool: str) -> list[dict[str, Any]] | None:
        """The server pods of pool ``namespace/pool`` as the pod watch last delivered them
        (kopf's index, copied on kopf's event loop: it changes there), or None when there is
        no index yet (the caller LISTs). Call it from a worker thread, not the loop.

        Raises:
            TimeoutError: the event loop did not answer within 60 s.
        """
        index, loop = self.pod_index, self.loop
        if index is None or loop is None or not loop.is_running():
            return None

        async def snapshot() -> list[dict[str, Any]]:
            return [dict(body) for body in index.get((namespace, pool), ())]

        return asyncio.run_coroutine_threadsafe(snapshot(), loop).result(timeout=60)

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """Threads for concurrent pod creations and server calls (a 40-server pool: 40 POSTs)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=8, thread_name_prefix="eaas-create"
            )
        return self._pool

    def is_leader(self) -> bool:
        """Whether this process may act (holds the Lease, or runs without an election)."""
        return self.elector is None or self.elector.is_leader()

    def leadership_changed(self, leader: bool) -> None:
        """Called by the election (from its thread): forget the tables handed to fleets (another
        operator may have written since) and, on becoming the leader, wake every daemon."""
        for memory in list(self.pools.values()):
            memory.published = None
        if leader:
            self.wake_all()

    def wake_all(self) -> None:
        """Wake every daemon (from any thread): e.g. on becoming the leader."""
        if self.loop is None:
            return
        for key in list(self.wakeups):
            self.loop.call_soon_threadsafe(self.wake, *key)

    def wake_event(self, kind: str, namespace: str, name: str) -> asyncio.Event:
        """The event that wakes the daemon of that object (made on first use)."""
        return self.wakeups.setdefault((kind, namespace, name), asyncio.Event())

    def wake(self, kind: str, namespace: str, name: str) -> None:
        """Make the daemon of that object reconcile now (from the event loop's thread)."""
        self.wake_event(kind, namespace, name).set()

    def wake_pools(self) -> None:
        """Wake every pool's daemon (a node's readiness flipped)."""
        for kind, namespace, name in list(self.wakeups):
            if kind == "pool":
                self.wake(kind, namespace, name)

    def wake_fleets_of(self, namespace: str, pool: str) -> None:
        """Wake the daemons of the fleets whose spec references pool ``namespace/pool`` (and of
        those not reconciled yet, whose reference is not known)."""
        for kind, ns, name in list(self.wakeups):
            if kind != "fleet" or ns != namespace:
                continue
            ref = self.fleets.get((ns, name))
            if ref is None or ref.pool is None or ref.pool == pool:
                self.wake(kind, ns, name)

    def note_node(self, name: str, ready: bool, labels: dict[str, str] | None) -> None:
        """Record a node's readiness and labels (``labels`` None: deleted); a readiness flip
        wakes every pool (its servers on that node leave or rejoin the routing tables)."""
        if labels is None:
            self.node_labels.pop(name, None)
        elif self.node_labels.get(name) != labels:
            self.node_labels[name] = labels
        if self.node_ready.get(name) != ready:
            self.node_ready[name] = ready
            self.wake_pools()

    def note_pod(self, namespace: str, name: str, observed: ObservedPod | None) -> bool:
        """Record what the operator uses of a server pod (``observed`` None: deleted); True
        when that differs from what the pod watch delivered before (its pool must step)."""
        key = (namespace, name)
        if observed is None:
            self.pods_seen.pop(key, None)
            return True
        if self.pods_seen.get(key) == observed:
            return False
        self.pods_seen[key] = observed
        return True

    def note_death(self, namespace: str, pool: str, name: str, uid: str) -> None:
        """A server pod of pool ``namespace/pool`` was deleted, is terminating or finished (the
        pod watch): its pool's next step drops it from the published table first
        (:attr:`PoolMemory.dead`). A pool not stepped yet has no table to trim."""
        memory = self.pools.get((namespace, pool))
        if memory is not None:
            memory.dead[name] = uid

    def step_inputs(self, namespace: str, pool: str) -> Hashable:
        """What a step of pool ``namespace/pool`` reads that the watches and the operator's own
        writes keep: its pods' ``(uid, resourceVersion)`` in the pod index, the nodes'
        readiness and labels, the table as last written or read, the clients'
        acknowledgements, the measured load and pending failure reports. Call it on the event
        loop (the index changes there). None without a pod index (no step is skipped then).

        Costs one pass over the index: ~2 ms for 4,096 pods, against ~0.3 CPU-s for a step."""
        index = self.pod_index
        if index is None:
            return None
        memory = self.pool(namespace, pool)
        pods = frozenset(
            (
                (body.get("metadata") or {}).get("uid"),
                (body.get("metadata") or {}).get("resourceVersion"),
            )
            for body in index.get((namespace, pool), ())
        )
        load = self.scraper.load((namespace, pool)) if self.scraper is not None else None
        return (
            pods,
            frozenset(self.node_ready.items()),
            frozenset((n, frozenset(labels.items())) for n, labels in self.node_labels.items()),
            memory.published,
            tuple(memory.client_acks()),
            repr(load.summary()) if load is not None and load.per_server else None,
            len(memory.reported),
        )

    def note_configmap(
        self, namespace: str, pool: str, name: str, resource_version: str, deleted: bool
    ) -> bool:
        """A ConfigMap of pool ``namespace/pool`` changed (from the ConfigMap watch): when it is
        the routing-table ConfigMap and not as the pool's reconciler last wrote or read it, the
        fleets read the ConfigMap again until the pool's next step. Returns whether the pool
        must step: False only for the routing-table ConfigMap as the pool last wrote or read
        it (the watch echoing the operator's own write)."""
        memory = self.pools.get((namespace, pool))
        if memory is None or memory.published is None or name != table_configmap_name(pool):
            return True
        if deleted or resource_version != memory.published.resource_version:
            memory.published = None
            return True
        return False

    def node_domains(self, topology_key: str) -> dict[str, str]:
        """Node name -> its value of label ``topology_key`` (nodes without it are left out)."""
        return {
            node: value
            for node, labels in self.node_labels.items()
            if (value := labels.get(topology_key))
        }

    def memoized(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()``, memoized on ``key`` in :attr:`placements` (the newest
        :data:`PLACEMENT_CACHE` entries)."""
        if key in self.placements:
            self.placements.move_to_end(key)
            return self.placements[key]
        value = compute()
        self.placements[key] = value
        while len(self.placements) > PLACEMENT_CACHE:
            self.placements.popitem(last=False)
        return value

    def observe(self, namespace: str, pool: str, pods: list[dict[str, Any]]) -> list[ObservedPod]:
        """:meth:`ObservedPod.from_pod` of each pod with :attr:`node_ready`, parsed again only
        when the pod's ``resourceVersion`` changed (the pool's memory keeps this step's)."""
        memory = self.pool(namespace, pool)
        held, memory.observed = memory.observed, {}
        out = []
        for pod in pods:
            meta = pod.get("metadata") or {}
            uid, version = meta.get("uid", ""), meta.get("resourceVersion", "")
            hit = held.get(uid)
            if hit is not None and version and hit[0] == version:
                observed = hit[1]
            else:
                observed = ObservedPod.from_pod(pod)
            memory.observed[uid] = (version, observed)
            node_ready = self.node_ready.get(observed.node, True)
            if observed.node_ready != node_ready:
                observed = dataclasses.replace(observed, node_ready=node_ready)
            out.append(observed)
        return out

    def desired_pods(
        self, owner: Owner, spec: ExpertPoolSpec, placement: Placement, revision: str
    ) -> dict[str, dict[str, Any]]:
        """:func:`desired_server_pods`, each server's manifest built again only when its
        experts (or the spec, owner or revision) changed (the pool's memory keeps this step's).
        The manifests are shared with the next step: read them, never change them."""
        memory = self.pool(owner.namespace, owner.name)
        spec_key = (owner, spec.model_dump_json(), revision)
        held, memory.manifests = memory.manifests, {}
        out = {}
        for s, experts in enumerate(placement.servers):
            key = (spec_key, s, experts)
            manifest = held.get(key)
            if manifest is None:
                manifest = server_pod(owner, spec, s, experts, revision)
            memory.manifests[key] = out[server_name(owner.name, s)] = manifest
        return out

    def placement(
        self,
        spec: ExpertPoolSpec,
        observed: list[ObservedPod],
        load: dict[LayerExpert, float] | None,
    ) -> Placement:
        """:func:`compute_placement`, memoized on its inputs (every reconcile step needs it).

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
        return self.memoized(key, lambda: compute_placement(spec, load, observed))
