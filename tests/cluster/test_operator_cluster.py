"""The operator on process nodes: ``kubectl apply`` of an ExpertPool and an
AttentionFleet gives real expert servers and real attention clients that serve a completion;
the operator pushes each table version and the client acknowledges it; a failure report
evicts a server only when the operator's own probe agrees; a frozen (SIGSTOPped) server is
restarted by its liveness probe and comes back into the table; under 16 streams, a killed
container, a deleted pod (its replacement in the next table), a powered-off node and a killed
operator cost no request."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
import uuid

import openai
import pytest

from eaas.runtime.cli import client_id_of
from eaas.runtime.tables.http import push_routing_table
from eaas.runtime.tables.table import RoutingTable

from helpers.common import free_port
from helpers.e2e import greedy_token_ids
from helpers.faults import apply_tiny_pool_and_fleet, serving_table
from helpers.k8s import (
    Operator,
    apply_crds,
    client_pods,
    get,
    get_json,
    kubectl,
    pod_ready,
    routing_table,
    server_pods,
    wait_for,
    wait_namespaces_deleted,
)

# The tier's testbed (conftest) has one GPU node per expert server of the fault scenario (the
# scheduler spreads the 4 pods one per node): powering off any node leaves every expert a live
# replica. With 2 nodes the two replicas of an expert can share one (the operator reports that
# as ReplicasSpread=False but does not re-place), and a node stop would fail requests by design.


def table(ns: str) -> RoutingTable | None:
    return routing_table(ns, "tiny")


def server_pid(pod_name: str, ns: str) -> int | None:
    """Host PID of the expert-server process of ``pod_name`` (from its containerID: a scan of
    /proc by ``--server-id`` can find another testbed's server of the same name)."""
    from helpers.faults import container_pid

    pod = server_pods(ns).get(pod_name)
    return container_pid(pod, "expert-server") if pod else None


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
    apply_crds()
    port = free_port()
    op = Operator(
        tmp_path_factory.mktemp("operator") / "operator.log",
        env={
            "EAAS_OPERATOR_REPORT_LISTEN": f"127.0.0.1:{port}",
            "EAAS_OPERATOR_REPORT_URL": f"http://127.0.0.1:{port}",
        },
    )
    op.start()
    yield op, port
    wait_namespaces_deleted()  # while the operator runs: it removes the pools' finalizers
    op.stop()


def test_pool_and_fleet_serve_push_ack_and_monitor(fault_fleet, operator):
    """The fault scenario's pool and fleet (they serve the tests below too): pushed and
    acknowledged tables, wrong-token and old-version pushes refused, a failure report that the
    operator's probe does not confirm keeps the server, a frozen server's is confirmed (out of
    the table, liveness restarts it, back in the table), a deleted pod's replacement is in the
    next table."""
    from eaas.runtime.models.tiny import default_model_dir

    _, report_port = operator
    model_dir = default_model_dir()
    ns = fault_fleet[0]

    # ---- serving, pushed and acknowledged -------------------------------------------------
    def acked():
        f, p, t = get("attentionfleet", "clients", ns), get("expertpool", "tiny", ns), table(ns)
        fs, ps = (f or {}).get("status") or {}, (p or {}).get("status") or {}
        ok = (
            t is not None
            and len(t.servers) == 4
            and fs.get("readyReplicas") == 2
            and fs.get("routingTableVersion") == t.version
            and fs.get("clientsAcknowledged") == 2
            and fs.get("acknowledgedVersion") == t.version
            and ps.get("clients") == 2
            and ps.get("clientsAcknowledged") == 2
        )
        return (f, p, t) if ok else None

    _, _, t = wait_for("fleet serving and acknowledged", acked, timeout=300, interval=1)
    cpod = next(filter(pod_ready, client_pods(ns, "clients")), None)
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
        kubectl("get", "secret", "clients-push-token", "-n", ns, "-o", "jsonpath={.data}").stdout
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
    pid = wait_for("victim pid", lambda: server_pid(victim, ns), timeout=30)
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
                server_pods(ns)[victim]["status"]["containerStatuses"][0]["restartCount"] > before
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

    # (a deleted pod's replacement in the next table, under load: test_faults_under_load)
    out = api.completions.create(model=model_id, prompt="Hello", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4


# =============================================================================================
# faults under load: one pool (4 servers, redundancy 2) on the
# four GPU process nodes, one fleet of 2 attention clients on the CPU node; 16 streaming
# requests through client A while faults happen one after the other.
# =============================================================================================
FAULT_TEXTS = [
    "The expert server hosts a set of experts and",
    "Kubernetes schedules pods on nodes",
    "A routing table maps every logical expert",
    "Hello world",
]
FAULT_MAX_TOKENS = 24
CPU_NODE = "cpu-node-0"


def _endpoint(pod: dict) -> str:
    return f"tcp://{pod['status'].get('podIP')}:9000"


@pytest.fixture(scope="module")
def fault_fleet(operator):
    """Namespace with the pool and the fleet serving, both clients acknowledged; yields
    ``(ns, model id, prompts, references)``."""
    from transformers import AutoTokenizer

    from eaas.runtime.models.reference import reference_generate
    from eaas.runtime.models.tiny import default_model_dir

    model_dir = default_model_dir()
    ns = f"f-{uuid.uuid4().hex[:6]}"
    kubectl("create", "namespace", ns)
    apply_tiny_pool_and_fleet(
        ns,
        servers=4,
        clients=2,
        # the clients stay up when a GPU node is powered off
        fleet_spec={"nodeSelector": {"kubernetes.io/hostname": CPU_NODE}},
    )
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [tok(t)["input_ids"] for t in FAULT_TEXTS]
    references = reference_generate(str(model_dir), prompts, FAULT_MAX_TOKENS)
    try:
        wait_for(
            "4 servers, 2 clients acknowledged",
            lambda: serving_table(ns, "tiny", "clients", 4, 2),
            timeout=300,
        )
        ip = client_pods(ns, "clients")[0]["status"]["podIP"]
        api = openai.OpenAI(base_url=f"http://{ip}:8000/v1", api_key="unused", timeout=120)
        yield ns, api.models.list().data[0].id, prompts, references
    finally:
        kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_faults_under_load(fault_fleet, operator, cluster):
    """Under 16 streaming requests through client A: SIGKILL one expert-server process; delete
    an expert-server pod; power off the GPU node of another server and SIGKILL the operator
    during that recovery. Every request completes with the reference tokens; the table drops
    each lost server and re-adds it at its (new) pod IP; versions only grow; no pod is
    duplicated."""
    from eaas import testbed as tbmod

    from helpers.faults import StreamLoad, TableRecorder, container_pid

    ns, model_id, prompts, references = fault_fleet
    op, _ = operator
    wait_for(  # the scenario above (same pool) ends once its replacement is acknowledged
        "steady state",
        lambda: serving_table(ns, "tiny", "clients", 4, 2),
        timeout=240,
        interval=0.5,
    )
    a_ip = client_pods(ns, "clients")[0]["status"]["podIP"]
    rec = TableRecorder(ns, "tiny", "clients").start()
    load = StreamLoad(f"http://{a_ip}:8000/v1", model_id, prompts, FAULT_MAX_TOKENS).start()
    try:
        wait_for("load flowing", lambda: load.completed() >= 16, timeout=180, interval=0.5)

        # ---- 1. SIGKILL an expert-server container process: the kubelet restarts it --------
        pods = server_pods(ns)
        victim = sorted(pods)[0]
        before = pods[victim]["status"]["containerStatuses"][0]["restartCount"]
        t0 = time.monotonic()
        os.kill(container_pid(pods[victim], "expert-server"), signal.SIGKILL)
        wait_for(
            "table without the killed server",
            lambda: rec.first_table(lambda s: victim not in s, after=t0),
            timeout=60,
            interval=0.1,
        )
        wait_for(
            "killed server restarted and back in the acknowledged table",
            lambda: (
                server_pods(ns)[victim]["status"]["containerStatuses"][0]["restartCount"] > before
                and serving_table(ns, "tiny", "clients", 4, 2)
            ),
            timeout=180,
            interval=0.5,
        )
        print(
            f"\n[measure] SIGKILL -> restarted server back in the table {time.monotonic() - t0:.1f}s"
        )

        # ---- 2. delete an expert-server pod: the replacement's new IP is in the table ------
        pods = server_pods(ns)
        victim = sorted(pods)[1]
        old_uid, old_ep = pods[victim]["metadata"]["uid"], _endpoint(pods[victim])
        t0 = time.monotonic()
        kubectl("delete", "pod", victim, "-n", ns, "--wait=false")
        dropped = wait_for(
            "table without the deleted pod",
            lambda: rec.first_table(lambda s: s.get(victim) != old_ep, after=t0),
            timeout=60,
            interval=0.1,
        )

        def replaced():
            p = server_pods(ns).get(victim)
            if not p or p["metadata"]["uid"] == old_uid or not pod_ready(p):
                return None
            return serving_table(ns, "tiny", "clients", 4, 2)

        wait_for("replacement in the acknowledged table", replaced, timeout=180, interval=0.5)
        new_ep = server_pods(ns)[victim]["status"]["podIP"]
        readded = rec.first_table(lambda s: s.get(victim) == f"tcp://{new_ep}:9000", after=t0)
        assert readded is not None and readded[1] > dropped[1]
        assert f"tcp://{new_ep}:9000" != old_ep  # a new pod, a new IP
        print(f"[measure] pod delete -> replacement acknowledged {time.monotonic() - t0:.1f}s")

        # ---- 3. power off a GPU node; SIGKILL the operator during the recovery --------------
        pods = server_pods(ns)
        node = next(
            p["spec"]["nodeName"] for n, p in sorted(pods.items()) if n not in sorted(pods)[:2]
        )
        on_node = {n: _endpoint(p) for n, p in pods.items() if p["spec"]["nodeName"] == node}
        assert node != CPU_NODE and on_node
        # the precondition of a node loss that leaves every expert a replica (one server per
        # node; the operator reports it, it does not enforce it)
        spread = {c["type"]: c for c in get("expertpool", "tiny", ns)["status"]["conditions"]}
        assert len(on_node) == 1 and spread["ReplicasSpread"]["status"] == "True", (on_node, spread)
        t0 = time.monotonic()
        tbmod.node_stop(node, cluster.state_dir)
        try:
            wait_for(
                "table without the dead node's servers",
                lambda: rec.first_table(lambda s: not set(on_node) & set(s), after=t0),
                timeout=90,
                interval=0.1,
            )
            op.kill()  # the operator dies while the node is down
            wait_for(
                f"{node} NotReady (node-lifecycle controller)",
                lambda: any(
                    c["type"] == "Ready" and c["status"] != "True"
                    for c in get_json("node", node)["status"]["conditions"]
                ),
                timeout=90,
                interval=1,
            )
            op.start()
        finally:
            tbmod.node_start(node, cluster.state_dir)
        wait_for(
            "node back, all servers in the acknowledged table",
            lambda: serving_table(ns, "tiny", "clients", 4, 2),
            timeout=240,
            interval=0.5,
        )
        back = rec.first_table(lambda s: set(on_node) <= set(s), after=t0)
        assert back is not None
        print(
            f"[measure] node stop -> all servers back and acknowledged {time.monotonic() - t0:.1f}s"
        )
        wait_for("more load after the faults", lambda: load.completed() >= 48, timeout=120)
    finally:
        requests = load.stop()
        rec.stop()

    bad = load.wrong(references)
    assert not bad, f"{len(bad)} of {len(requests)} requests wrong: {bad[:5]}"
    assert len(requests) >= 48
    # versions only grow, in the ConfigMap, the pool's status and the acknowledgements
    versions = [v for _, v, _ in rec.tables]
    for seq in (versions, rec.pool_versions, rec.ack_versions):
        assert seq == sorted(seq) and len(set(seq)) == len(seq), f"not monotonic: {seq}"
    # no duplicate pods: one per server index, one Deployment's worth of clients
    pods = server_pods(ns)
    indices = [p["metadata"]["labels"]["eaas.io/server-index"] for p in pods.values()]
    assert len(pods) == 4 and len(set(indices)) == 4, sorted(pods)
    assert len(client_pods(ns, "clients")) == 2
    print(
        f"[measure] {len(requests)} requests, all with the reference tokens; "
        f"table versions {versions[0]}..{versions[-1]} ({len(versions)} seen)"
    )


def test_client_faults(fault_fleet):
    """SIGKILL attention client B: the expert servers close its connections while client A's
    16 streams go on; then B, SIGSTOPped while a new table is pushed, catches up (from its
    ConfigMap watch or a push retry) within CATCH_UP_BOUND_S of SIGCONT."""
    from helpers.faults import (
        StreamLoad,
        client_table_version,
        container_pid,
        peer_connections,
        tcp_connections,
    )

    CATCH_UP_BOUND_S = 30.0
    ns, model_id, prompts, references = fault_fleet
    wait_for(
        "steady state",
        lambda: serving_table(ns, "tiny", "clients", 4, 2),
        timeout=240,
        interval=0.5,
    )
    a, b = client_pods(ns, "clients")
    a_ip, b_ip = a["status"]["podIP"], b["status"]["podIP"]
    # each replica runs with its own client id (frames, metrics, failure reports): its pod name's
    ids = {}
    for p in (a, b):
        with urllib.request.urlopen(f"http://{p['status']['podIP']}:8000/health", timeout=30) as r:
            ids[p["metadata"]["name"]] = json.loads(r.read())["client_id"]
    assert ids == {n: str(client_id_of(n)) for n in ids} and len(set(ids.values())) == 2, ids
    load = StreamLoad(f"http://{a_ip}:8000/v1", model_id, prompts, FAULT_MAX_TOKENS).start()
    try:
        # B serves a request
        api_b = openai.OpenAI(base_url=f"http://{b_ip}:8000/v1", api_key="unused", timeout=120)
        assert greedy_token_ids(api_b, model_id, prompts[0], FAULT_MAX_TOKENS) == references[0]
        ips = {p["status"]["podIP"] for p in server_pods(ns).values()}

        # each client is connected to every server: a client opens its connections on a
        # background thread, and a request does not wait for one still opening while every
        # expert has a connected replica, so serving a request does not mean all are open yet
        def connected():
            bc = peer_connections(container_pid(b, "attention-client"), 9000)
            ac = peer_connections(container_pid(a, "attention-client"), 9000)
            return (bc, ac) if {c[0] for c in bc} == ips == {c[0] for c in ac} else None

        b_conns, a_conns = wait_for(
            "each client connected to every server", connected, timeout=60, interval=0.2
        )
        assert b_conns <= tcp_connections(9000)  # the servers' side of them

        # ---- SIGKILL B: the servers drop exactly its connections, A is unaffected ----------
        before = b["status"]["containerStatuses"][0]["restartCount"]
        os.kill(container_pid(b, "attention-client"), signal.SIGKILL)
        wait_for(
            "expert servers closed the dead client's connections",
            lambda: not b_conns & tcp_connections(9000),
            timeout=60,
            interval=0.2,
        )
        assert a_conns <= tcp_connections(9000), "client A lost connections"

        def b_back():
            p = next(
                p
                for p in client_pods(ns, "clients")
                if p["metadata"]["name"] == b["metadata"]["name"]
            )
            restarted = p["status"]["containerStatuses"][0]["restartCount"] > before
            return p if restarted and serving_table(ns, "tiny", "clients", 4, 2) else None

        b = wait_for("client B restarted and acknowledged", b_back, timeout=240, interval=0.5)

        # ---- SIGSTOP B, change the table, SIGCONT: B catches up ----------------------------
        pid = container_pid(b, "attention-client")
        os.kill(pid, signal.SIGSTOP)
        try:
            v_before = table(ns).version
            victim = sorted(server_pods(ns))[2]
            kubectl("delete", "pod", victim, "-n", ns, "--wait=false")
            wait_for(
                "the new table acknowledged by client A only",
                lambda: (
                    (st := get("attentionfleet", "clients", ns)["status"])["acknowledgedVersion"]
                    > v_before
                    and st["clientsAcknowledged"] == 1
                ),
                timeout=120,
                interval=0.2,
            )
        finally:
            os.kill(pid, signal.SIGCONT)
        t0 = time.monotonic()
        wait_for(
            "client B applied the newest table",
            lambda: client_table_version(b["status"]["podIP"]) == table(ns).version,
            timeout=CATCH_UP_BOUND_S,
            interval=0.1,
        )
        print(f"\n[measure] SIGCONT -> client B on the newest table {time.monotonic() - t0:.2f}s")
        wait_for(
            "all acknowledged again",
            lambda: serving_table(ns, "tiny", "clients", 4, 2),
            timeout=180,
            interval=0.5,
        )
    finally:
        requests = load.stop()
    bad = load.wrong(references)
    assert not bad, f"{len(bad)} of {len(requests)} requests wrong: {bad[:5]}"
