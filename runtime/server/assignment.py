"""An expert server learns its experts from the routing table (the table's life cycle: the
servers get each new version before the clients, make-before-break).

The routing table is the single source of truth for both sides: the experts of server ``S`` in
table version ``V`` are the ``(layer, expert)`` pairs whose replica list names ``S``
(:func:`server_experts`). A server receives tables the way attention clients do -- pushed by the
operator (``PUT /routing-table`` on its HTTP port, bearer token, older versions refused; see
:class:`TableEndpoint`) or watched from the pool's ConfigMap
(:class:`eaas.runtime.tables.watch.ConfigMapTableWatcher`, the same machinery as the
clients') -- and :class:`ServerAssignment` loads the newly assigned experts in a background
thread while the serving loop keeps serving, then reports the version whose weights it holds
(``weights_version``: the server's acknowledgement, in the PUT answer, ``GET /routing-table``
and ``GET /health``).

Make-before-break (two-phase publish): a new version reaches the servers first; only after
every server of it reports ``weights_version >= V`` does the operator give it to the clients.
A server keeps the experts of every version that clients may still use: the ones at or above
the *released* version, which the operator raises (``POST /routing-table/release``) once every
client acknowledged a newer table (:func:`assignment_step`). Without an operator
(``auto_release``, the ConfigMap path: servers and clients see a version at the same time) a
server keeps the newest two versions' experts.

A frame that names an expert the server does not hold (a client on an older table, a race) gets
``STATUS_NOT_HOSTED``; the dispatcher re-sends those pairs to another replica
(:mod:`eaas.runtime.client.dispatch`), so nothing is computed wrongly and no request fails.

The decisions (:func:`server_experts`, :func:`assignment_step`) are pure; the classes do I/O.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from eaas.runtime.placement import LayerExpert
from eaas.runtime.tables.push import (
    MAX_TABLE_BYTES,
    BearerToken,
    PushError,
    check_push_token,
    parse_pushed_table,
    push_decision,
    too_large,
)
from eaas.runtime.tables.table import RoutingTable

log = logging.getLogger("eaas.expert_server.assignment")

#: Loader of expert weights: ``pairs -> {(layer, expert): ExpertWeights}`` (checkpoint or random).
Loader = Callable[[list[LayerExpert]], Mapping[LayerExpert, Any]]


def server_experts(table: RoutingTable, server_id: str) -> frozenset[LayerExpert]:
    """The ``(layer, expert)`` pairs ``table`` assigns to ``server_id`` (empty if it is absent)."""
    return frozenset(table.hosted_by(server_id))


@dataclass(frozen=True)
class AssignmentStep:
    """What a server does next: ``load`` these pairs, then ``drop`` those; ``keep`` is what it
    must hold afterwards (the union of the experts of every version not yet released)."""

    load: frozenset[LayerExpert]
    drop: frozenset[LayerExpert]
    keep: frozenset[LayerExpert]


def assignment_step(
    held: Collection[LayerExpert],
    assigned: Mapping[int, frozenset[LayerExpert]],
    released_version: int,
) -> AssignmentStep:
    """Decide loads and drops of one server (pure).

    Args:
        held: pairs whose weights the server holds now.
        assigned: table version -> this server's pairs in it (the versions it received).
        released_version: every client acknowledged a version ``>= released_version``, so
            versions below it are no longer used by anyone (0: none released).

    Returns:
        :class:`AssignmentStep`: ``load`` = the newest version's pairs not held (older
        unconfirmed versions are never loaded: no client will get them); ``keep`` = union of
        the pairs of every version ``>= released_version`` (the newest always counts);
        ``drop`` = held pairs outside ``keep``.
    """
    held_set = frozenset(held)
    if not assigned:
        return AssignmentStep(frozenset(), frozenset(), held_set)
    newest = max(assigned)
    keep: set[LayerExpert] = set(assigned[newest])
    for version, pairs in assigned.items():
        if version >= released_version:
            keep |= pairs
    keep_f = frozenset(keep)
    return AssignmentStep(assigned[newest] - held_set, held_set - keep_f, keep_f)


class ServerAssignment:
    """The routing-table receiver of one expert server (same interface as the clients'
    :class:`~eaas.runtime.client.dispatch.Dispatcher` for the push and ConfigMap-watch code:
    :attr:`version`, :meth:`set_table`, :meth:`reconnect_down`).

    Args:
        server: the :class:`~eaas.runtime.server.server.ExpertServer` (``add_experts``,
            ``drop_experts``, ``hosted_pairs``).
        server_id: this server's id in the routing table.
        loader: loads weights of the given pairs (called on the background thread).
        auto_release: release every version below the previous newest on each new table
            (keep two versions; for the ConfigMap path without an operator).
        retry_s: seconds before a failed load is retried.
    """

    def __init__(
        self,
        server: Any,
        server_id: str,
        loader: Loader,
        *,
        auto_release: bool = False,
        retry_s: float = 2.0,
    ) -> None:
        self.server = server
        self.server_id = server_id
        self.loader = loader
        self.auto_release = auto_release
        self.retry_s = float(retry_s)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._assigned: dict[int, frozenset[LayerExpert]] = {}
        self._version = 0
        self.weights_version = 0
        self.released_version = 0
        self.error = ""
        self.loaded_total = 0
        self.dropped_total = 0
        self._thread: threading.Thread | None = None

    # ---- receiver interface (push / ConfigMap watch) ---------------------------------------
    @property
    def version(self) -> int:
        """Newest routing-table version received (0: none)."""
        return self._version

    def set_table(self, table: RoutingTable) -> bool:
        """Accept ``table`` if strictly newer; its experts load in the background. Returns
        whether it was accepted."""
        with self._lock:
            if table.version <= self._version:
                return False
            previous = self._version
            self._version = table.version
            self._assigned[table.version] = server_experts(table, self.server_id)
            if self.auto_release and previous:
                self.released_version = max(self.released_version, previous)
            self._prune()
        log.info(
            "expert server %s: routing table version %d assigns %d experts",
            self.server_id,
            table.version,
            len(self._assigned[table.version]),
        )
        self._wake.set()
        return True

    def release(self, version: int) -> int:
        """Every client acknowledged ``version`` (or newer): experts used only by older versions
        may go. Returns the released version in force (never decreases)."""
        with self._lock:
            self.released_version = max(self.released_version, int(version))
            self._prune()
        self._wake.set()
        return self.released_version

    def reconnect_down(self) -> int:
        """Nothing to reconnect on a server (interface of the ConfigMap watcher)."""
        return 0

    def _prune(self) -> None:  # caller holds the lock
        newest = max(self._assigned, default=0)
        for v in [v for v in self._assigned if v < self.released_version and v != newest]:
            del self._assigned[v]

    # ---- background loading ----------------------------------------------------------------
    def start(self) -> ServerAssignment:
        self._thread = threading.Thread(target=self._run, name="eaas-assignment", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.retry_s if self.error else None)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001  (bad checkpoint, OOM: report, retry)
                self.error = f"{type(exc).__name__}: {exc}"
                log.exception("expert server %s: loading experts failed", self.server_id)

    def step(self) -> AssignmentStep:
        """Load what the newest version needs, then drop what no unreleased version uses
        (blocking; the background thread calls it; tests may too)."""
        with self._lock:
            assigned, released = dict(self._assigned), self.released_version
        if not assigned:
            return AssignmentStep(frozenset(), frozenset(), frozenset())
        newest = max(assigned)
        plan = assignment_step(self.server.hosted_pairs(), assigned, released)
        if plan.load:
            weights = self.loader(sorted(plan.load))
            self.server.add_experts(weights)
            self.loaded_total += len(plan.load)
        if plan.drop:
            self.server.drop_experts(plan.drop)
            self.dropped_total += len(plan.drop)
        self.error = ""
        if assigned[newest] <= self.server.hosted_pairs():
            self.weights_version = max(self.weights_version, newest)
        if plan.load or plan.drop:
            log.info(
                "expert server %s: version %d: loaded %d, dropped %d, hosting %d experts",
                self.server_id,
                newest,
                len(plan.load),
                len(plan.drop),
                self.server.num_experts,
            )
        return plan

    def describe(self) -> dict[str, Any]:
        """Body of ``GET /routing-table`` (and part of ``/health``)."""
        return {
            "server_id": self.server_id,
            "assigned_version": self._version,
            "weights_version": self.weights_version,
            "released_version": self.released_version,
            "experts": self.server.num_experts,
            "loading": self.weights_version < self._version,
            "load_error": self.error,
        }


class TableEndpoint:
    """The HTTP routes of an expert server's table push (served by
    :mod:`eaas.runtime.server.http`), the clients' protocol (:mod:`eaas.runtime.tables.push`)
    with the server's acknowledgement:

    ``PUT /routing-table`` (bearer token): ``202`` ``{"server_id", "assigned_version",
    "weights_version", ...}``: accepted, experts loading (poll ``GET /routing-table`` until
    ``weights_version`` reaches it); ``409`` ``stale_version`` (not newer; the body has the
    versions too); ``400`` invalid table or one that does not fit the model; ``401`` wrong or no
    token; ``403`` pushes disabled (no token file).

    ``POST /routing-table/release`` (bearer token), body ``{"version": R}``: every client
    acknowledged ``R``; experts only older versions used are dropped. ``200`` with the state;
    ``400`` when ``version`` is not an integer >= 0.

    Args:
        assignment: the receiver.
        token: the push token (None: pushes disabled).
        num_experts / moe_layers: the model's, to refuse a table for another model.
    """

    def __init__(
        self,
        assignment: ServerAssignment,
        token: BearerToken | None,
        num_experts: int | None = None,
        moe_layers: Iterable[int] | None = None,
    ) -> None:
        self.assignment = assignment
        self.token = token
        self.num_experts = num_experts
        self.moe_layers = None if moe_layers is None else list(moe_layers)

    def _authorize(self, authorization: str | None) -> None:
        check_push_token(self.token, authorization, "start the server with --push-token-file")

    def put(self, authorization: str | None, raw: bytes) -> tuple[int, dict[str, Any]]:
        """Handle ``PUT /routing-table``: ``(status, JSON body)``."""
        try:
            self._authorize(authorization)
            if len(raw) > MAX_TABLE_BYTES:
                raise too_large()
            table = parse_pushed_table(
                raw, num_experts=self.num_experts, moe_layers=self.moe_layers
            )
            refused = push_decision(table.version, self.assignment.version)
            if refused is None and not self.assignment.set_table(table):
                refused = push_decision(table.version, self.assignment.version)
            if refused is not None:
                raise refused
        except PushError as exc:
            return exc.answer(self.assignment.describe())
        return 202, self.assignment.describe()

    def release(self, authorization: str | None, raw: bytes) -> tuple[int, dict[str, Any]]:
        """Handle ``POST /routing-table/release``: ``(status, JSON body)``."""
        try:
            self._authorize(authorization)
            try:
                version = json.loads(raw or b"{}").get("version")
            except (ValueError, AttributeError, RecursionError):
                version = None
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise PushError(400, 'body must be {"version": <integer >= 0>}', "invalid_release")
        except PushError as exc:
            return exc.answer(self.assignment.describe())
        self.assignment.release(version)
        return 200, self.assignment.describe()
