"""One operator acts per cluster, whatever namespace each runs in: an ``eaas operator`` whose
Lease is in one namespace and a second one whose Lease is in another (the Helm release's
``eaas-system`` next to a local ``eaas operator``). Only the first acts; the second holds its own
Lease, stands by naming the first, and takes over when the first stops."""

from __future__ import annotations

import json
import uuid
from collections import Counter

import pytest

from helpers.k8s import Operator, apply, converged, get, kubectl, pool_manifest, wait_for

pytestmark = pytest.mark.failstatic


def holder(ns: str) -> str:
    lease = get("lease", "eaas-operator", ns)
    return ((lease or {}).get("spec") or {}).get("holderIdentity") or ""


def reasons(ns: str, pool: str) -> list[str]:
    out = kubectl(
        "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={pool}", "-o", "json"
    ).stdout
    return [
        f"{e.get('reason')}: {e.get('message')}"
        for e in json.loads(out)["items"]
        for _ in range(e.get("count") or 1)
    ]


def test_two_operators_in_different_namespaces_exactly_one_acts(testbed, crds, tmp_path):
    tag = uuid.uuid4().hex[:6]
    lease_ns = {"op-a": f"lease-a-{tag}", "op-b": f"lease-b-{tag}"}
    ns = f"t-{tag}"
    for n in (*lease_ns.values(), ns):
        kubectl("create", "namespace", n)
    ops = {
        name: Operator(
            tmp_path / f"{name}.log",
            env={"EAAS_OPERATOR_ID": name, "EAAS_OPERATOR_LEASE_NAMESPACE": lease_ns[name]},
        )
        for name in lease_ns
    }
    try:
        ops["op-a"].start()
        wait_for("op-a leads", lambda: holder(lease_ns["op-a"]) == "op-a", timeout=30)
        ops["op-b"].start()
        # op-b wins its own namespace's Lease, and stands by for op-a
        wait_for("op-b holds its Lease", lambda: holder(lease_ns["op-b"]) == "op-b", timeout=30)
        wait_for(
            "op-b stands by naming op-a",
            lambda: (
                f"standing by: operator op-a (Lease {lease_ns['op-a']}/eaas-operator)"
                in ops["op-b"].log_path.read_text()
            ),
            timeout=30,
        )
        apply(pool_manifest("one", replicas=4), ns)
        wait_for("pool Ready", lambda: converged(ns, "one"), timeout=120)
        events = reasons(ns, "one")
        dupes = [e for e, n in Counter(events).items() if n > 1]
        assert not dupes, f"events posted twice (two operators acted): {dupes}"
        assert any(e.startswith("RoutingTablePublished") for e in events)
        a_log, b_log = (ops[n].log_path.read_text() for n in ("op-a", "op-b"))
        assert "created expert server" in a_log
        assert "created expert server" not in b_log  # the pods all came from op-a
        assert "acquired leadership" in a_log and "acquired leadership" not in b_log
        version = int(get("expertpool", "one", ns)["status"]["routingTableVersion"])

        # op-a stops (SIGKILL: its Lease stays until it is seen dead): op-b takes over
        ops["op-a"].kill()
        wait_for(
            "op-b acts",
            lambda: "acquired leadership" in ops["op-b"].log_path.read_text(),
            timeout=60,
        )
        apply(pool_manifest("one", replicas=3), ns)
        wait_for("pool Ready at 3", lambda: converged(ns, "one"), timeout=120)
        assert int(get("expertpool", "one", ns)["status"]["routingTableVersion"]) > version
        assert "deleted expert server" in ops["op-b"].log_path.read_text()
    finally:
        for op in ops.values():
            op.stop()
        for n in (*lease_ns.values(), ns):
            kubectl("delete", "namespace", n, "--wait=false", check=False)
