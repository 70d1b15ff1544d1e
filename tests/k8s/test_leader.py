"""Exactly one operator acts: two ``eaas operator`` processes
against the testbed's API server elect a leader through a Lease; the other one only watches.
Routing-table versions stay monotonic, no Event is posted twice, and when the leader is
SIGKILLed the standby takes over and finishes the next change."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
import uuid
from collections import Counter

import pytest

from helpers.k8s import Operator, apply, converged, get, kubectl, pool_manifest, wait_for

LEASE_NS = "default"


def lease_holder() -> str:
    lease = get("lease", "eaas-operator", LEASE_NS)
    return ((lease or {}).get("spec") or {}).get("holderIdentity") or ""


def pool_events(ns: str, pool: str) -> list[tuple[str, str]]:
    out = kubectl(
        "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={pool}", "-o", "json"
    ).stdout
    items = json.loads(out)["items"]
    return [
        (e.get("reason", ""), e.get("message", ""))
        for e in items
        for _ in range(e.get("count") or 1)
    ]


class VersionWatch:
    """Polls the pool's status and ConfigMap table versions in a thread, recording each change."""

    def __init__(self, ns: str, pool: str):
        self.ns, self.pool = ns, pool
        self.status: list[int] = []
        self.table: list[int] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            p = get("expertpool", self.pool, self.ns)
            v = int(((p or {}).get("status") or {}).get("routingTableVersion") or 0)
            if v and (not self.status or self.status[-1] != v):
                self.status.append(v)
            cm = get("configmap", f"{self.pool}-routing-table", self.ns)
            if cm:
                tv = int(cm["metadata"]["annotations"]["eaas.io/routing-table-version"])
                if not self.table or self.table[-1] != tv:
                    self.table.append(tv)
            self._stop.wait(0.1)

    def __enter__(self) -> VersionWatch:
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(timeout=30)


def test_two_operators_exactly_one_acts(testbed, crds, tmp_path):  # noqa: F811
    ports = {}
    for name in ("op-a", "op-b"):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports[name] = sock.getsockname()[1]
    ops = {
        name: Operator(
            tmp_path / f"{name}.log",
            env={
                "EAAS_OPERATOR_ID": name,
                "EAAS_OPERATOR_REPORT_LISTEN": f"127.0.0.1:{ports[name]}",
            },
        )
        for name in ("op-a", "op-b")
    }
    for op in ops.values():  # side by side: each start is mostly imports
        op.spawn()
    for op in ops.values():
        op.wait_ready()
    ns = f"t-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", ns)
    try:
        leader = wait_for("a leader", lambda: lease_holder() in ops and lease_holder(), timeout=30)
        with VersionWatch(ns, "ha") as versions:
            apply(pool_manifest("ha", replicas=4), ns)
            wait_for("pool Ready", lambda: converged(ns, "ha"), timeout=120)
            events = pool_events(ns, "ha")
            # every action once: doubled events were the symptom of two operators acting
            dupes = [e for e, n in Counter(events).items() if n > 1]
            assert not dupes, f"events posted twice: {dupes}"
            assert sum(r == "ServersCreated" for r, _ in events) >= 1
            standby = next(n for n in ops if n != leader)
            assert "acquired leadership" in ops[leader].log_path.read_text()
            assert "acquired leadership" not in ops[standby].log_path.read_text()
            # a standby does not act on failure reports: it forwards them to the leader, whose
            # answer comes back (here 401: no token) with the leader's advertised URL
            url = f"http://127.0.0.1:{ports[standby]}/v1/failure-reports/{ns}/f"
            req = urllib.request.Request(url, data=b"{}", method="POST")
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=30)
            assert err.value.code == 401
            assert err.value.headers["X-EAAS-Forwarded-To"] == f"http://127.0.0.1:{ports[leader]}"
            # with the fleet's token the leader acts on it (an unknown pod: ignored)
            kubectl(
                "create", "secret", "generic", "f-push-token", "-n", ns, "--from-literal=token=tok"
            )
            report = {"client_id": "c", "server_id": "no-such-pod", "table_version": 1}
            req = urllib.request.Request(
                url,
                data=json.dumps(report).encode(),
                method="POST",
                headers={"Authorization": "Bearer tok", "Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.headers["X-EAAS-Forwarded-To"] == f"http://127.0.0.1:{ports[leader]}"
                assert json.loads(r.read()) == {"action": "ignored", "reason": "no such pod"}
            # a report forwarded once is never forwarded again (no loops): 503
            req = urllib.request.Request(
                url, data=b"{}", method="POST", headers={"X-EAAS-Forwarded": "op-x"}
            )
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=30)
            assert err.value.code == 503

            # the leader dies: the standby takes over and acts on the next change
            ops[leader].kill()
            wait_for("standby takes the Lease", lambda: lease_holder() == standby, timeout=60)
            apply(pool_manifest("ha", replicas=5), ns)
            wait_for("pool Ready at 5", lambda: converged(ns, "ha"), timeout=120)
            # the old leader comes back as a standby: still exactly one acts
            ops[leader].start()
            apply(pool_manifest("ha", replicas=4), ns)
            wait_for("pool Ready at 4", lambda: converged(ns, "ha"), timeout=120)
            assert lease_holder() == standby
        for seq in (versions.status, versions.table):
            assert seq == sorted(seq) and len(set(seq)) == len(seq), f"not monotonic: {seq}"
        assert len(versions.table) >= 3  # 4 servers, 5 servers, 4 servers
        events = pool_events(ns, "ha")
        published = [m for r, m in events if r == "RoutingTablePublished"]
        assert len(published) == len(set(published)), f"a table published twice: {published}"
        created = [m for r, m in events if r == "ServersCreated"]
        assert len(created) == len(set(created)), f"pods created twice: {created}"
        # the restarted old leader stayed a standby
        assert ops[leader].log_path.read_text().count("acquired leadership") == 1
    finally:
        kubectl("delete", "namespace", ns, "--wait=false", check=False)
        for op in ops.values():
            op.stop()
    # a leader that shuts down deletes its Lease (nothing left behind by `helm uninstall`)
    assert get("lease", "eaas-operator", LEASE_NS) is None
