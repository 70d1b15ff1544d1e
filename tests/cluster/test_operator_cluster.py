"""The operator on process nodes (issue 6, items 2-4): ``kubectl apply`` of an ExpertPool and an
AttentionFleet gives real expert servers and a real attention client that serve a completion;
the operator pushes each table version and the client acknowledges it; a failure report
evicts a server only when the operator's own probe agrees; a frozen (SIGSTOPped) server is
restarted by its liveness probe and comes back into the table; a deleted server pod's
replacement is in the next table."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
import uuid

import openai
import pytest
from k8s_helpers import get_json, kubectl, wait_for
from test_operator import Operator

from eaas.runtime.client.table_push import push_routing_table
from eaas.runtime.routing import RoutingTable

pytestmark = pytest.mark.cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def get(kind: str, name: str, ns: str) -> dict | None:
    r = kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def table(ns: str) -> RoutingTable | None:
    cm = get("configmap", "tiny-routing-table", ns)
    return RoutingTable.from_json(cm["data"]["routing-table.json"]) if cm else None


def server_pods(ns: str) -> dict[str, dict]:
    items = get_json("pods", "-n", ns, "-l", "eaas.io/role=expert-server")["items"]
    return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}


def client_pod(ns: str) -> dict | None:
    items = get_json("pods", "-n", ns, "-l", "eaas.io/fleet=clients")["items"]
    ready = [
        p
        for p in items
        if any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p["status"].get("conditions", [])
        )
    ]
    return ready[0] if ready else None


def server_pid(pod_name: str) -> int | None:
    """PID of the expert-server process of ``pod_name`` (a child of the test's node agent)."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"expert-server" in argv and b"--server-id" in argv:
            if argv[argv.index(b"--server-id") + 1] == pod_name.encode():
                try:
                    with open(f"/proc/{d}/environ", "rb") as f:
                        env = f.read().split(b"\0")
                except OSError:
                    continue
                uids = [
                    p["metadata"]["uid"]
                    for p in get_json("pods", "-A")["items"]
                    if p["metadata"]["name"] == pod_name
                ]
                if any(b"EAAS_TESTBED_POD_UID=" + u.encode() in env for u in uids):
                    return int(d)
    return None


def post_report(port: int, ns: str, token: str, server: str, endpoint: str) -> tuple[int, dict]:
    body = {
        "client_id": "test",
        "server_id": server,
        "endpoint": endpoint,
        "table_version": 1,
        "reason": "test",
        "time": 0,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/failure-reports/{ns}/clients",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    kubectl("apply", "-f", os.path.join(ROOT, "deploy/crds"))
    for crd in ("expertpools.eaas.io", "attentionfleets.eaas.io"):
        kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    op = Operator(
        tmp_path_factory.mktemp("operator") / "operator.log",
        env={
            "EAAS_OPERATOR_REPORT_LISTEN": f"127.0.0.1:{port}",
            "EAAS_OPERATOR_REPORT_URL": f"http://127.0.0.1:{port}",
        },
    )
    op.start()
    yield op, port
    op.stop()


def test_pool_and_fleet_serve_push_ack_and_monitor(operator):
    from eaas.runtime.models.tiny import default_model_dir

    _, report_port = operator
    model_dir = default_model_dir()
    model = {"hostPath": str(model_dir.parent), "uri": model_dir.name}
    ns = f"t-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", ns)
    pool = {
        "apiVersion": "eaas.io/v1alpha1",
        "kind": "ExpertPool",
        "metadata": {"name": "tiny"},
        "spec": {
            "model": {**model, "firstMoeLayer": 1, "numMoeLayers": 3, "numExperts": 32},
            "replicas": 3,
            "redundancy": 2,
        },
    }
    fleet = {
        "apiVersion": "eaas.io/v1alpha1",
        "kind": "AttentionFleet",
        "metadata": {"name": "clients"},
        "spec": {"expertPoolRef": {"name": "tiny"}, "replicas": 1, "model": model},
    }
    for obj in (pool, fleet):
        kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(obj))
    try:
        # ---- serving, pushed and acknowledged -------------------------------------------------
        def acked():
            f, p, t = get("attentionfleet", "clients", ns), get("expertpool", "tiny", ns), table(ns)
            fs, ps = (f or {}).get("status") or {}, (p or {}).get("status") or {}
            ok = (
                t is not None
                and len(t.servers) == 3
                and fs.get("readyReplicas") == 1
                and fs.get("routingTableVersion") == t.version
                and fs.get("clientsAcknowledged") == 1
                and fs.get("acknowledgedVersion") == t.version
                and ps.get("clients") == 1
                and ps.get("clientsAcknowledged") == 1
            )
            return (f, p, t) if ok else None

        _, _, t = wait_for("fleet serving and acknowledged", acked, timeout=300, interval=1)
        cpod = client_pod(ns)
        assert cpod is not None
        ip = cpod["status"]["podIP"]
        c = cpod["spec"]["containers"][0]
        assert c["command"][c["command"].index("--model") + 1] == f"/models/{model_dir.name}"
        api = openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key="unused", timeout=120)
        model_id = api.models.list().data[0].id
        out = api.completions.create(model=model_id, prompt="Hello", max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4
        # the client's view: the acknowledged version is the one in use
        with urllib.request.urlopen(f"http://{ip}:8000/routing-table", timeout=30) as r:
            assert json.loads(r.read())["version"] == t.version

        token = json.loads(
            kubectl(
                "get", "secret", "clients-push-token", "-n", ns, "-o", "jsonpath={.data}"
            ).stdout
        )["token"]
        import base64

        token = base64.b64decode(token).decode()
        # a push with a wrong token, or of an older version, is refused
        assert push_routing_table(f"http://{ip}:8000", t.to_json(), "wrong").status == 401
        old = RoutingTable.from_json(t.to_json())
        assert push_routing_table(f"http://{ip}:8000", old.to_json(), token).status == 409

        # ---- monitor: one client's report does not evict a healthy server ---------------------
        victim = "tiny-1"
        endpoint = t.servers[victim]
        assert post_report(report_port, ns, "wrong", victim, endpoint)[0] == 401
        status, body = post_report(report_port, ns, token, victim, endpoint)
        assert (status, body) == (200, {"action": "kept"})
        assert victim in table(ns).servers

        # ---- a frozen server: the probe confirms the report; liveness restarts it ------------
        pid = wait_for("victim pid", lambda: server_pid(victim), timeout=30)
        before = server_pods(ns)[victim]["status"]["containerStatuses"][0]["restartCount"]
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            status, body = post_report(report_port, ns, token, victim, endpoint)
            assert (status, body) == (200, {"action": "removed"})
            wait_for(
                "frozen server out of the table",
                lambda: victim not in table(ns).servers,
                timeout=60,
                interval=0.05,
            )
            print(f"\n[measure] report -> table without the server {time.monotonic() - t0:.2f}s")
            wait_for(
                "ServerUnreachable event",
                lambda: any(
                    e["reason"] == "ServerUnreachable" and victim in e["message"]
                    for e in get_json(
                        "events", "-n", ns, "--field-selector", "involvedObject.name=tiny"
                    )["items"]
                ),
                timeout=60,
            )
            wait_for(
                "kubelet restarts the hung server (liveness)",
                lambda: (
                    server_pods(ns)[victim]["status"]["containerStatuses"][0]["restartCount"]
                    > before
                ),
                timeout=120,
                interval=1,
            )
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        wait_for(
            "restarted server back in the table",
            lambda: victim in table(ns).servers,
            timeout=180,
            interval=1,
        )

        # ---- a deleted pod: its replacement's IP is in the next table -------------------------
        old_uid = server_pods(ns)["tiny-2"]["metadata"]["uid"]
        t0 = time.monotonic()
        kubectl("delete", "pod", "tiny-2", "-n", ns, "--wait=false")

        def replaced():
            p = server_pods(ns).get("tiny-2")
            t2 = table(ns)
            if not p or p["metadata"]["uid"] == old_uid or not p["status"].get("podIP"):
                return None
            return t2 if t2.servers.get("tiny-2") == f"tcp://{p['status']['podIP']}:9000" else None

        t2 = wait_for("replacement in the table", replaced, timeout=180, interval=0.2)
        t_table = time.monotonic() - t0
        wait_for(
            "client acknowledged the replacement's table",
            lambda: (
                (get("attentionfleet", "clients", ns)["status"].get("acknowledgedVersion") or 0)
                >= t2.version
            ),
            timeout=60,
            interval=0.2,
        )
        print(
            f"[measure] pod deleted -> replacement's IP in the table {t_table:.2f}s, "
            f"-> acknowledged (fleet status) {time.monotonic() - t0:.2f}s"
        )
        out = api.completions.create(model=model_id, prompt="Hello", max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4
    finally:
        kubectl("delete", "namespace", ns, "--wait=false", check=False)
