"""Helpers of the fault-under-load scenarios (tests/cluster/test_operator_cluster.py) and of
``bench/cluster_failover.py``: streaming load through an attention client with the official
``openai`` client, a recorder of routing-table versions, the steady state of a pool and fleet
(:func:`serving_table`), and the kernel's view of TCP connections (``/proc/net/tcp``). The
kubectl-level reads are :mod:`helpers.k8s`'."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import openai

from helpers.k8s import client_pods, get, kubectl, pod_ready, routing_table, server_pods

#: TCP states in /proc/net/tcp (include/net/tcp_states.h).
TCP_ESTABLISHED, TCP_CLOSE_WAIT = "01", "08"


@dataclass
class Request:
    """One streamed completion: prompt index, generated ids, per-token arrival times
    (``time.monotonic()`` s), and the error if it failed."""

    prompt: int
    started: float
    ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    finished: float = 0.0
    error: str = ""


class StreamLoad:
    """``concurrency`` threads, each streaming completions (greedy, ``max_tokens``) of the
    prompts in turn through ``base_url`` (an attention client's ``/v1``) until stopped.

    Every request is kept in :attr:`requests` (completed or failed); a request that raises
    (HTTP error, broken stream, timeout) records the error and the thread goes on.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        prompts: list[list[int]],
        max_tokens: int,
        concurrency: int = 16,
        timeout_s: float = 120.0,
    ) -> None:
        self.api = openai.OpenAI(
            base_url=base_url, api_key="unused", max_retries=0, timeout=timeout_s
        )
        self.model, self.prompts, self.max_tokens = model, prompts, max_tokens
        self.concurrency = concurrency
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _run(self, worker: int) -> None:
        n = worker
        while not self._stop.is_set():
            r = Request(prompt=n % len(self.prompts), started=time.monotonic())
            with self._lock:
                self.requests.append(r)
            try:
                stream = self.api.completions.create(
                    model=self.model,
                    prompt=self.prompts[r.prompt],
                    max_tokens=self.max_tokens,
                    temperature=0,
                    stream=True,
                    extra_body={"return_token_ids": True},
                )
                for chunk in stream:
                    ids = chunk.choices[0].model_extra.get("token_ids") or []
                    now = time.monotonic()
                    r.ids.extend(ids)
                    r.times.extend([now] * len(ids))
            except Exception as exc:  # recorded; the assertion on it is the test's
                r.error = f"{type(exc).__name__}: {exc}"
            r.finished = time.monotonic()
            n += self.concurrency

    def start(self) -> StreamLoad:
        for i in range(self.concurrency):
            t = threading.Thread(target=self._run, args=(i,), daemon=True, name=f"load-{i}")
            t.start()
            self._threads.append(t)
        return self

    def stop(self, timeout_s: float = 180.0) -> list[Request]:
        """Let the requests in flight finish, then return all requests."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=timeout_s)
        assert not any(t.is_alive() for t in self._threads), "a streamed request hangs"
        return list(self.requests)

    def completed(self) -> int:
        with self._lock:
            return sum(1 for r in self.requests if r.finished and not r.error)

    def wrong(self, references: list[list[int]]) -> list[str]:
        """Descriptions of finished requests that failed or differ from the reference."""
        with self._lock:
            done = [r for r in self.requests if r.finished]
        return [
            f"prompt {r.prompt}: {r.error or f'{r.ids} != {references[r.prompt]}'}"
            for r in done
            if r.error or r.ids != references[r.prompt]
        ]


class TableRecorder:
    """Polls (kubernetes client, every ``interval_s``) the pool's routing-table ConfigMap, the
    pool's status and the fleet's status; records each new table (version -> servers) and the
    sequences of status versions, to check monotonicity and drop/re-add after the fact."""

    def __init__(self, ns: str, pool: str, fleet: str, interval_s: float = 0.2) -> None:
        from kubernetes import client, config

        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # read now, not at import
        api = client.ApiClient()
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.ns, self.pool, self.fleet, self.interval_s = ns, pool, fleet, interval_s
        self.tables: list[tuple[float, int, dict[str, str]]] = []  # (time, version, servers)
        self.pool_versions: list[int] = []
        self.ack_versions: list[int] = []
        self.errors = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True, name="table-recorder")

    def _poll(self) -> None:
        from eaas.runtime.tables.table import RoutingTable

        cm = self.core.read_namespaced_config_map(f"{self.pool}-routing-table", self.ns)
        raw = (cm.data or {}).get("routing-table.json")
        if raw:
            t = RoutingTable.from_json(raw)
            if not self.tables or self.tables[-1][1] != t.version:
                self.tables.append((time.monotonic(), t.version, dict(t.servers)))
        for obj, plural, seq, key in (
            (self.pool, "expertpools", self.pool_versions, "routingTableVersion"),
            (self.fleet, "attentionfleets", self.ack_versions, "acknowledgedVersion"),
        ):
            body = self.custom.get_namespaced_custom_object(
                "eaas.io", "v1alpha1", self.ns, plural, obj
            )
            v = int((body.get("status") or {}).get(key) or 0)
            if v and (not seq or seq[-1] != v):
                seq.append(v)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._poll()
            except Exception:  # API server busy: the next poll catches up
                self.errors += 1
            self._stop.wait(self.interval_s)

    def start(self) -> TableRecorder:
        self._t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._t.join(timeout=30)

    def first_table(self, pred, after: float = 0.0) -> tuple[float, int, dict[str, str]] | None:
        """The first recorded table at or after monotonic time ``after`` for which
        ``pred(servers)`` holds."""
        for entry in list(self.tables):
            if entry[0] >= after and pred(entry[2]):
                return entry
        return None


def _addr(hex_addr: str) -> tuple[str, int]:
    ip, port = hex_addr.split(":")
    return socket.inet_ntoa(struct.pack("<I", int(ip, 16))), int(port, 16)


def _tcp_table() -> list[tuple[tuple[str, int], tuple[str, int], str, int]]:
    """``(local, remote, state, inode)`` of each IPv4 TCP socket of the host."""
    out = []
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            parts = line.split()
            out.append((_addr(parts[1]), _addr(parts[2]), parts[3], int(parts[9])))
    return out


def tcp_connections(local_port: int) -> set[tuple[str, int, str, int]]:
    """Open TCP connections (ESTABLISHED or CLOSE_WAIT: the peer is gone but this side has not
    closed) whose local port is ``local_port``: ``(local ip, local port, remote ip, remote
    port)``. The testbed has no network namespaces, so the host's table holds every pod's."""
    return {
        (*local, *remote)
        for local, remote, st, _ in _tcp_table()
        if st in (TCP_ESTABLISHED, TCP_CLOSE_WAIT) and local[1] == local_port
    }


def peer_connections(pid: int, remote_port: int) -> set[tuple[str, int, str, int]]:
    """The connections of process ``pid`` to port ``remote_port``, as the *other* side sees
    them: ``(local ip, local port, remote ip, remote port)`` of the server's socket. (Outgoing
    connections to a 127.1.x.y pod IP leave from 127.0.0.1, so the process is found by its
    sockets' inodes, not by its pod IP.)"""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return {
        (*remote, *local)
        for local, remote, st, inode in _tcp_table()
        if inode in inodes and remote[1] == remote_port and st == TCP_ESTABLISHED
    }


def container_pid(pod: dict, container: str) -> int | None:
    """Host PID of a running container of a testbed pod (from its ``containerID``,
    ``process://<uid8>-<container>-<restart>-<pid>``)."""
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == container and "running" in (cs.get("state") or {}):
            cid = cs.get("containerID") or ""
            if cid.startswith("process://"):
                return int(cid.rsplit("-", 1)[1])
    return None


def client_table_version(ip: str, port: int = 8000, timeout_s: float = 5.0) -> int | None:
    """The routing-table version an attention client applied (``GET /routing-table``); None
    when it does not answer (stopped, restarting)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{ip}:{port}/routing-table", timeout=timeout_s) as r:
            return int(json.loads(r.read())["version"])
    except (OSError, ValueError, KeyError):
        return None


def serving_table(ns: str, pool: str, fleet: str, servers: int, clients: int) -> Any:
    """The pool's routing table when it is the steady state: it holds exactly the ``servers``
    Ready server pods at their current IPs (``tcp://IP:9000``), and ``clients`` Ready clients
    acknowledged it (fleet status) and applied it (their ``GET /routing-table``); else None."""
    t = routing_table(ns, pool)
    pods = server_pods(ns, pool)
    if t is None or len(pods) != servers or not all(map(pod_ready, pods.values())):
        return None
    if t.servers != {n: f"tcp://{p['status'].get('podIP')}:9000" for n, p in pods.items()}:
        return None
    st = (get("attentionfleet", fleet, ns) or {}).get("status") or {}
    if st.get("clientsAcknowledged") != clients or st.get("acknowledgedVersion") != t.version:
        return None
    cps = [p for p in client_pods(ns, fleet) if pod_ready(p)]
    if len(cps) != clients:
        return None
    if any(client_table_version(p["status"]["podIP"]) != t.version for p in cps):
        return None
    return t


def apply_tiny_pool_and_fleet(
    ns: str,
    pool: str = "tiny",
    servers: int = 4,
    clients: int = 1,
    pool_spec: dict | None = None,
    fleet_spec: dict | None = None,
) -> None:
    """``kubectl apply`` into ``ns`` an ExpertPool ``pool`` of the built-in tiny model (its
    weights from a hostPath of the local cache; 3 MoE layers x 32 experts, redundancy 2,
    ``servers`` servers) and an AttentionFleet ``clients`` of ``clients`` attention clients
    using it; ``pool_spec`` / ``fleet_spec`` add to (override) the specs."""
    from eaas.runtime.models.tiny import default_model_dir

    model_dir = default_model_dir()
    model = {"hostPath": str(model_dir.parent), "uri": model_dir.name}
    objs = [
        {
            "apiVersion": "eaas.io/v1alpha1",
            "kind": "ExpertPool",
            "metadata": {"name": pool},
            "spec": {
                "model": {**model, "firstMoeLayer": 1, "numMoeLayers": 3, "numExperts": 32},
                "replicas": servers,
                "redundancy": 2,
                **(pool_spec or {}),
            },
        },
        {
            "apiVersion": "eaas.io/v1alpha1",
            "kind": "AttentionFleet",
            "metadata": {"name": "clients"},
            "spec": {
                "expertPoolRef": {"name": pool},
                "replicas": clients,
                "model": model,
                **(fleet_spec or {}),
            },
        },
    ]
    for obj in objs:
        kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(obj))
