"""Control-plane faults under load (``bench/apiserver_stall.py`` and
``tests/cluster/test_fail_static_cluster.py``): the kube-apiserver stopped (SIGSTOP) for a while
with one expert server killed during the stall, and a frozen node agent with a killed server on
its node. Each records every routing-table version the operator writes (a watch on the pool's
ConfigMap) and measures when the killed server left the table. ``heartbeat-loss`` freezes every
server's node agent past the node monitor grace period, so the node controller really marks
the nodes NotReady and every server pod Ready=False."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

from helpers.faults import container_pid, serving_table
from helpers.k8s import server_pods, wait_for


@dataclass
class Version:
    """One routing-table version as the watch saw it (``at``: ``time.monotonic()``)."""

    at: float
    version: int
    servers: frozenset[str]
    uncovered: int


class TableLog:
    """Every version of ``<pool>-routing-table`` in ``ns``, from a watch (a version written and
    replaced within one poll would be missed by polling; a watch delivers each write)."""

    def __init__(self, ns: str, pool: str) -> None:
        self.ns, self.pool = ns, pool
        self.versions: list[Version] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="table-log")

    def _run(self) -> None:
        from kubernetes import client, config, watch

        from eaas.runtime.tables.table import RoutingTable

        api = config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"))
        core = client.CoreV1Api(api)
        while not self._stop.is_set():
            try:
                for ev in watch.Watch().stream(
                    core.list_namespaced_config_map,
                    self.ns,
                    field_selector=f"metadata.name={self.pool}-routing-table",
                    timeout_seconds=5,
                    _request_timeout=10,
                ):
                    raw = (ev["object"].data or {}).get("routing-table.json")
                    if raw:
                        t = RoutingTable.from_json(raw)
                        if not self.versions or self.versions[-1].version != t.version:
                            self.versions.append(
                                Version(
                                    time.monotonic(),
                                    t.version,
                                    frozenset(t.servers),
                                    len(t.uncovered()),
                                )
                            )
                    if self._stop.is_set():
                        break
            except Exception:  # the API server stopped: watch again
                self._stop.wait(0.2)

    def start(self) -> TableLog:
        self._t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._t.join(timeout=20)

    def first_without(self, server: str, after: float) -> Version | None:
        return next((v for v in self.versions if v.at >= after and server not in v.servers), None)


@dataclass
class FaultResult:
    """What one fault run measured.

    Attributes:
        kind: ``apiserver-stall``, ``frozen-agent`` or ``heartbeat-loss``.
        victim: the killed server.
        versions: every table version written from the fault's start to the end of recovery.
        out_after_s: seconds from the reference point (the API server's resume; for a frozen
            agent, the kill) to the first version without the victim (None: it never left:
            its restarted process served again first).
        dropped_live: servers other than the victim that some version left out.
        uncovered: versions with an uncovered expert.
    """

    kind: str
    victim: str
    versions: list[Version] = field(default_factory=list)
    out_after_s: float | None = None
    dropped_live: set[str] = field(default_factory=set)
    uncovered: list[int] = field(default_factory=list)


def _judge(result: FaultResult, log: TableLog, since: float, ref: float, servers: set[str]) -> None:
    result.versions = [v for v in log.versions if v.at >= since]
    out = log.first_without(result.victim, since)
    result.out_after_s = (out.at - ref) if out is not None else None
    for v in result.versions:
        result.dropped_live |= servers - {result.victim} - v.servers
        if v.uncovered:
            result.uncovered.append(v.version)


def _recovered(ns: str, pool: str, fleet: str, servers: int, not_before: float) -> None:
    """Wait until the pool and fleet serve again (:func:`helpers.faults.serving_table`: every
    server Ready in the table every client applied) and ``time.monotonic() >= not_before``."""
    wait_for(
        "every server back in a table every client applied",
        lambda: time.monotonic() >= not_before and serving_table(ns, pool, fleet, servers, 2),
        timeout=300,
        interval=0.5,
    )


def apiserver_stall(
    ns: str,
    pool: str,
    fleet: str,
    apiserver_pid: int,
    stall_s: float = 45.0,
    kill_at_s: float = 10.0,
    settle_s: float = 30.0,
) -> FaultResult:
    """SIGSTOP the kube-apiserver for ``stall_s``, SIGKILL the first server's container
    ``kill_at_s`` into it, SIGCONT; wait until the table holds every server again (the victim's
    restarted process Ready, every client on that table) and at least ``settle_s`` after the
    resume (the node controller's NotReady marks come right after it). ``out_after_s`` is
    measured from the resume (None: the victim's restarted process answered before any version
    left it out)."""
    pods = server_pods(ns, pool)
    names = sorted(pods)
    victim = names[0]
    pid = container_pid(pods[victim], "expert-server")
    assert pid is not None, f"{victim} has no running expert-server container"
    log = TableLog(ns, pool).start()
    try:
        time.sleep(1)
        t0 = time.monotonic()
        os.kill(apiserver_pid, signal.SIGSTOP)
        try:
            time.sleep(kill_at_s)
            os.kill(pid, signal.SIGKILL)
            time.sleep(stall_s - kill_at_s)
        finally:
            os.kill(apiserver_pid, signal.SIGCONT)
        resumed = time.monotonic()
        result = FaultResult("apiserver-stall", victim)
        _recovered(ns, pool, fleet, len(names), resumed + settle_s)
    finally:
        log.stop()
    _judge(result, log, t0, resumed, set(names))
    return result


def frozen_agent(ns: str, pool: str, fleet: str, agent_pid: int, victim: str) -> FaultResult:
    """SIGSTOP the node agent of ``victim``'s node, SIGKILL ``victim``'s container (the API
    still shows it Ready: nobody reports), wait until a table without it is written (only the
    clients' failure reports, confirmed by the operator's probe, can do that before the node
    turns NotReady), SIGCONT the agent and wait for every server in the table again.
    ``out_after_s`` is measured from the kill."""
    pods = server_pods(ns, pool)
    names = set(pods)
    pid = container_pid(pods[victim], "expert-server")
    assert pid is not None, f"{victim} has no running expert-server container"
    log = TableLog(ns, pool).start()
    result = FaultResult("frozen-agent", victim)
    try:
        time.sleep(1)
        os.kill(agent_pid, signal.SIGSTOP)
        try:
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            wait_for(
                "the victim out of the table",
                lambda: log.first_without(victim, killed) is not None,
                timeout=90,
                interval=0.1,
            )
        finally:
            os.kill(agent_pid, signal.SIGCONT)
        _recovered(ns, pool, fleet, len(names), time.monotonic())
    finally:
        log.stop()
    _judge(result, log, killed, killed, names)
    return result


def nodes_not_ready(names: set[str]) -> bool:
    """Whether every node in ``names`` shows ``Ready`` other than True."""
    from helpers.k8s import get_json

    items = get_json("nodes")["items"]
    state = {
        n["metadata"]["name"]: next(
            (c["status"] for c in n["status"].get("conditions", []) if c["type"] == "Ready"), ""
        )
        for n in items
    }
    return all(state.get(n) != "True" for n in names)


def heartbeat_loss(
    ns: str,
    pool: str,
    fleet: str,
    agent_pids: dict[str, int],
    kill_at_s: float = 3.0,
    settle_s: float = 15.0,
) -> FaultResult:
    """Missed heartbeats: SIGSTOP the node agents of every server's node (the real
    node-lifecycle controller marks the nodes NotReady after its grace period and flips every
    pod on them to Ready=False), SIGKILL the first server's container ``kill_at_s`` in, wait
    until every node is NotReady and a few seconds more, SIGCONT the agents (they re-assert
    Ready) and wait for recovery. ``out_after_s`` is measured from the kill; the servers the
    API showed Ready=False but the operator's probe reached must never leave the table."""
    pods = server_pods(ns, pool)
    names = sorted(pods)
    victim = names[0]
    nodes = {pods[n]["spec"]["nodeName"] for n in names}
    pid = container_pid(pods[victim], "expert-server")
    assert pid is not None, f"{victim} has no running expert-server container"
    log = TableLog(ns, pool).start()
    result = FaultResult("heartbeat-loss", victim)
    try:
        time.sleep(1)
        t0 = time.monotonic()
        for node in nodes:
            os.kill(agent_pids[node], signal.SIGSTOP)
        try:
            time.sleep(kill_at_s)
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            wait_for("every server's node NotReady", lambda: nodes_not_ready(nodes), timeout=90)
            time.sleep(5)  # the operator's steps see every pod Ready=False
        finally:
            for node in nodes:
                os.kill(agent_pids[node], signal.SIGCONT)
        _recovered(ns, pool, fleet, len(names), time.monotonic() + settle_s)
    finally:
        log.stop()
    _judge(result, log, t0, killed, set(names))
    return result
