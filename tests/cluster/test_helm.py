"""Helm for real: ``helm install`` of ``deploy/helm/eaas-operator`` on the
testbed runs the operator as two pods on the CPU process node (the local ``eaas operator``;
exactly one holds the Lease and acts), with a Service, least-privilege RBAC (``kubectl auth
can-i`` as its ServiceAccount), a values schema that rejects a bad value naming it, and a
``helm test`` hook that GETs every replica's ``/healthz``. With that operator, ``kubectl apply``
of ``deploy/examples/tiny-pool.yaml`` (its model as a hostPath of the tiny model) turns Ready;
the example AttentionFleet then serves a completion through its pod IP equal to transformers'
greedy reference, and with one server's node agent frozen and the server killed, the client's
failure report reaches the operator by its Service name and the table drops the server;
``helm upgrade`` changes the Deployment; ``helm uninstall`` leaves nothing of the release
(the CRDs stay: Helm never deletes ``crds/``)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import urllib.request

import openai
import pytest
import yaml

from helpers.e2e import greedy_token_ids
from helpers.k8s import get_json, kubectl, pod_ready, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHART = os.path.join(ROOT, "deploy", "helm", "eaas-operator")
NS = "eaas-system"
RELEASE = "eaas-operator"  # release name containing the chart name: objects are named eaas-operator
SA = f"system:serviceaccount:{NS}:{RELEASE}"
CPU_NODE = "cpu-node-0"


def helm(*args: str, check: bool = True, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run the testbed's helm (PATH/KUBECONFIG from the ``cluster`` fixture)."""
    r = subprocess.run(["helm", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed: {r.stderr}{r.stdout}")
    return r


def operator_pods() -> list[dict]:
    items = get_json("pods", "-n", NS, "-l", f"app.kubernetes.io/instance={RELEASE}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def can_i(verb: str, resource: str, ns: str | None = None) -> bool:
    """``kubectl auth can-i`` as the operator's ServiceAccount; ``resource`` may name a
    subresource (``pods/exec``: kubectl itself would read ``exec`` as an object name)."""
    resource, _, sub = resource.partition("/")
    args = ["auth", "can-i", verb, resource, f"--as={SA}"]
    args += [f"--subresource={sub}"] if sub else []
    args += ["-n", ns] if ns else ["--all-namespaces"]
    r = kubectl(*args, check=False)
    assert r.stdout.strip() in ("yes", "no"), r.stderr
    return r.stdout.strip() == "yes"


@pytest.fixture(scope="module")
def release(cluster):
    r = helm(
        "install",
        RELEASE,
        CHART,
        "-n",
        NS,
        "--create-namespace",
        "--set-string",
        f"nodeSelector.kubernetes\\.io/hostname={CPU_NODE}",
        "--set",
        "leaseDurationSeconds=5",
        "--wait",
        "--timeout",
        "3m",
    )
    yield cluster, r.stdout
    # the tier's next modules share the testbed: an operator release left by a failed test
    # would act on their pools next to their own operator
    if RELEASE in helm("list", "-n", NS, "-q").stdout.split():
        helm("uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "2m", check=False)


def test_schema_rejects_a_bad_value(cluster):
    for cmd in ("template", "install"):
        r = helm(cmd, "bad", CHART, "-n", NS, "--set", "replicas=0", check=False)
        assert r.returncode != 0
        assert "/replicas" in r.stderr and "minimum" in r.stderr, r.stderr
    r = helm("template", "bad", CHART, "--set", "replica=2", check=False)
    assert r.returncode != 0 and "replica" in r.stderr and "not allowed" in r.stderr, r.stderr
    assert "bad" not in helm("list", "-A", "-q").stdout.split()


def test_install_two_replicas_on_the_cpu_node_one_leader(release):
    tb, notes = release
    assert "helm test eaas-operator" in notes and "crds/" in notes  # NOTES.txt rendered

    pods = wait_for(
        "2 Ready operator pods",
        lambda: (ps := operator_pods()) and len(ps) == 2 and all(map(pod_ready, ps)) and ps,
        timeout=120,
        interval=1,
    )
    for p in pods:
        assert p["spec"]["nodeName"] == CPU_NODE
        assert p["spec"]["serviceAccountName"] == RELEASE
        assert p["spec"]["containers"][0]["command"][:2] == ["eaas", "operator"]
    names = {p["metadata"]["name"] for p in pods}

    def leader():
        r = kubectl("get", "lease", "eaas-operator", "-n", NS, "-o", "json", check=False)
        spec = json.loads(r.stdout).get("spec", {}) if r.returncode == 0 else {}
        return spec.get("holderIdentity") in names and spec["holderIdentity"]

    holder = wait_for("a Lease holder among the pods", leader, timeout=60, interval=1)
    lease = get_json("lease", "eaas-operator", "-n", NS)
    (owner,) = lease["metadata"]["ownerReferences"]
    dep = get_json("deployment", RELEASE, "-n", NS)
    assert (owner["kind"], owner["uid"]) == ("Deployment", dep["metadata"]["uid"])
    # a standby forwards failure reports to the leader at its advertised pod IP
    holder_ip = next(p for p in pods if p["metadata"]["name"] == holder)["status"]["podIP"]
    assert lease["metadata"]["annotations"]["eaas.io/leader-url"] == f"http://{holder_ip}:8081"

    # exactly one pod logged "acquired leadership": the holder
    def acquirers():
        got = set()
        for p in pods:
            uid8 = p["metadata"]["uid"][:8]
            pattern = (
                f"{tb.state_dir}/nodes/{CPU_NODE}/pods/{NS}_{p['metadata']['name']}_{uid8}/*.log"
            )
            for log in glob.glob(pattern):
                if "acquired leadership" in open(log, errors="replace").read():
                    got.add(p["metadata"]["name"])
        return got or None

    assert wait_for("leader log", acquirers, timeout=30, interval=1) == {holder}

    svc = get_json("service", RELEASE, "-n", NS)
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"health": 8080, "http": 8081}

    # each pod's GET /metrics: never two say they lead; one does, the Lease holder. With a 5 s
    # Lease the renew deadline is 3.3 s, which a starved holder may miss on a loaded machine:
    # then it stops acting (and says 0) until its next renewal, so the test waits for the state
    # instead of asserting the first sample.
    samples: list[dict[str, bool]] = []

    def leaders():
        got = {}
        for p in pods:
            url = f"http://{p['status']['podIP']}:8081/metrics"
            try:
                with urllib.request.urlopen(url, timeout=10) as r:
                    text = r.read().decode()
            except OSError:
                return None
            got[p["metadata"]["name"]] = "\neaas_operator_leader 1\n" in text
        samples.append(got)
        return [name for name, lead in got.items() if lead] == [holder] and got

    try:
        wait_for("/metrics: the Lease holder alone leads", leaders, timeout=60, interval=1)
    finally:
        print("last /metrics samples (pod: leads):", samples[-5:])  # shown when the test fails
    assert all(sum(s.values()) <= 1 for s in samples), samples

    # the hook pod is deleted once it succeeds (hook-delete-policy); there is no `kubectl logs`
    # on the testbed, so its output is read from the node agent's log of it
    r = helm("test", RELEASE, "-n", NS, "--timeout", "2m")
    assert "Phase:          Succeeded" in r.stdout and "Failed" not in r.stdout, r.stdout
    logs = glob.glob(f"{tb.state_dir}/nodes/{CPU_NODE}/pods/{NS}_{RELEASE}-test_*/*.log")
    out = "".join(open(f).read() for f in logs)
    assert out.count(":8080/healthz") == 2 and "operator healthy" in out, out


def test_rbac_is_least_privilege(release):
    may = [
        ("watch", "expertpools.eaas.io", None),
        ("patch", "expertpools.eaas.io/status", "default"),
        ("patch", "attentionfleets.eaas.io", "default"),
        ("create", "pods", "default"),
        ("delete", "pods", "default"),
        ("update", "configmaps", "default"),
        ("create", "events", "default"),
        ("create", "deployments.apps", "default"),
        ("create", "secrets", "default"),
        ("list", "nodes", None),
        ("update", "leases.coordination.k8s.io", NS),
        ("create", "leases.coordination.k8s.io", NS),
        ("list", "leases.coordination.k8s.io", None),  # one operator per cluster
        ("create", "networkpolicies.networking.k8s.io", "default"),
    ]
    # the Lease eaas-operator only: deleted by a leader that shuts down
    r = kubectl(
        "auth",
        "can-i",
        "delete",
        "leases.coordination.k8s.io/eaas-operator",
        f"--as={SA}",
        "-n",
        NS,
    )
    assert r.stdout.strip() == "yes"
    may_not = [
        ("delete", "nodes", None),
        ("create", "clusterroles.rbac.authorization.k8s.io", None),
        ("create", "clusterrolebindings.rbac.authorization.k8s.io", None),
        ("list", "secrets", "kube-system"),
        ("delete", "secrets", "default"),
        ("update", "leases.coordination.k8s.io", "kube-node-lease"),
        ("delete", "leases.coordination.k8s.io", NS),  # any other Lease
        ("delete", "namespaces", None),
        ("create", "pods/exec", "default"),
        ("delete", "customresourcedefinitions.apiextensions.k8s.io", None),
        ("delete", "expertpools.eaas.io", "default"),
        ("delete", "deployments.apps", "default"),
        ("create", "persistentvolumes", None),
        ("patch", "nodes/status", None),
        ("create", "serviceaccounts/token", "default"),
    ]
    got_may = {(v, r, n): can_i(v, r, n) for v, r, n in may}
    got_may_not = {(v, r, n): can_i(v, r, n) for v, r, n in may_not}
    assert all(got_may.values()), [k for k, v in got_may.items() if not v]
    assert not any(got_may_not.values()), [k for k, v in got_may_not.items() if v]


def test_tiny_pool_example_turns_ready(release):
    from eaas.runtime.models.tiny import default_model_dir

    pool = yaml.safe_load(open(os.path.join(ROOT, "deploy", "examples", "tiny-pool.yaml")))
    # the example's weights are baked into the image at /models/tiny; the testbed's single image
    # is the local install, so the same model comes from a hostPath of the tiny model dir
    model_dir = default_model_dir()
    pool["spec"]["model"].update(hostPath=str(model_dir.parent), uri=model_dir.name)
    # the example fleet (one client here, weights from the same hostPath), applied with the
    # pool so that the client starts while the servers do
    fleet = yaml.safe_load(open(os.path.join(ROOT, "deploy", "examples", "tiny-fleet.yaml")))
    fleet["spec"]["replicas"] = 1
    fleet["spec"]["model"] = {"hostPath": str(model_dir.parent), "uri": model_dir.name}
    ns = "helm-pool"
    kubectl("create", "namespace", ns)
    kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(pool))
    kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(fleet))

    def pool_ready():
        st = get_json("expertpool", "tiny", "-n", ns).get("status") or {}
        conds = {c["type"]: c for c in st.get("conditions", [])}
        ok = conds.get("Ready", {}).get("status") == "True"
        return st if ok else None

    st = wait_for("ExpertPool tiny Ready", pool_ready, timeout=240, interval=0.5)
    assert st["readyReplicas"] == pool["spec"]["replicas"]
    # the leader's /metrics shows the pool's routing-table version
    holder = get_json("lease", "eaas-operator", "-n", NS)["spec"]["holderIdentity"]
    ip = get_json("pod", holder, "-n", NS)["status"]["podIP"]
    series = (
        f'eaas_operator_routing_table_version{{namespace="{ns}",configmap="tiny-routing-table"}}'
    )

    def version_shown():
        with urllib.request.urlopen(f"http://{ip}:8081/metrics", timeout=10) as r:
            text = r.read().decode()
        version = get_json("expertpool", "tiny", "-n", ns)["status"]["routingTableVersion"]
        return f"{series} {version}\n" in text or None

    wait_for("the leader's /metrics shows the table version", version_shown, timeout=60)

    # the fleet: a completion through its client's pod IP gives transformers' greedy tokens

    def client_acked():
        st = get_json("attentionfleet", "tiny-clients", "-n", ns).get("status") or {}
        if st.get("clientsAcknowledged") != 1:
            return None
        pods = get_json("pods", "-n", ns, "-l", "eaas.io/fleet=tiny-clients")["items"]
        return next((p for p in pods if pod_ready(p)), None)

    cpod = wait_for("fleet client Ready and acknowledged", client_acked, timeout=240, interval=0.5)
    from transformers import AutoTokenizer

    from eaas.runtime.models.reference import reference_generate

    prompt = AutoTokenizer.from_pretrained(str(model_dir))("Hello world")["input_ids"]
    ref = reference_generate(str(model_dir), [prompt], 8)[0]
    api = openai.OpenAI(
        base_url=f"http://{cpod['status']['podIP']}:8000/v1", api_key="unused", timeout=120
    )
    model_id = api.models.list().data[0].id
    assert greedy_token_ids(api, model_id, prompt, 8) == ref
    reports_reach_the_operator(release[0], ns, api, model_id, prompt, ref)
    kubectl("delete", "attentionfleet", "tiny-clients", "-n", ns, "--timeout=120s")
    # delete it while the operator runs (its finalizer needs the operator)
    kubectl("delete", "expertpool", "tiny", "-n", ns, "--timeout=120s")
    kubectl("delete", "namespace", ns, "--wait=false")


def reports_reach_the_operator(tb, ns, api, model_id, prompt, ref) -> None:
    """The clients' failure reports reach the Helm-installed operator through its Service name
    (``eaas-operator.eaas-system.svc``, which the testbed resolves for pods): with one server's
    node agent frozen (the API keeps showing the pod Ready) and the server killed, a
    completion still gives the reference tokens, the client reports the server, the operator's
    probe confirms it (``ServerUnreachable``) and the table drops it before the node could turn
    NotReady."""
    import signal
    import time

    from helpers.faults import container_pid
    from helpers.k8s import routing_table, server_pods

    pods = server_pods(ns, "tiny")
    victim = sorted(pods)[0]
    agent = tb.agents[pods[victim]["spec"]["nodeName"]]
    pid = container_pid(pods[victim], "expert-server")
    assert pid is not None
    os.kill(agent, signal.SIGSTOP)
    try:
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for _ in range(3):  # each request may pick the dead server's replicas: it is reported
            assert greedy_token_ids(api, model_id, prompt, 8) == ref

        def reported():
            events = get_json("events", "-n", ns, "--field-selector", "involvedObject.name=tiny")
            return any(
                e.get("reason") == "ServerUnreachable" and victim in e.get("message", "")
                for e in events["items"]
            )

        wait_for("a confirmed failure report", reported, timeout=60, interval=0.5)
        wait_for(
            "the table without the killed server",
            lambda: victim not in routing_table(ns, "tiny").servers,
            timeout=30,
        )
        # the node monitor grace is 20 s: the reports, not the node controller, removed it
        assert time.monotonic() - killed < 20
    finally:
        os.kill(agent, signal.SIGCONT)
    wait_for(
        "the restarted server back in the table",
        lambda: victim in routing_table(ns, "tiny").servers,
        timeout=120,
    )


def test_upgrade_then_uninstall_leaves_nothing(release):
    helm(
        "upgrade",
        RELEASE,
        CHART,
        "-n",
        NS,
        "--reuse-values",
        "--set",
        "verbose=true",
        "--set",
        "replicas=1",
        "--wait",
        "--timeout",
        "3m",
    )
    dep = get_json("deployment", RELEASE, "-n", NS)
    assert dep["spec"]["replicas"] == 1
    assert "--verbose" in dep["spec"]["template"]["spec"]["containers"][0]["command"]
    wait_for(
        "1 operator pod after upgrade",
        lambda: len(operator_pods()) == 1 and pod_ready(operator_pods()[0]),
        timeout=120,
        interval=1,
    )
    assert json.loads(helm("history", RELEASE, "-n", NS, "-o", "json").stdout)[-1]["revision"] == 2

    # the one pod left holds the Lease (taken over within leaseDurationSeconds if the deleted
    # replica was the leader) and its helm test passes
    (pod,) = operator_pods()

    def holder():
        r = kubectl("get", "lease", "eaas-operator", "-n", NS, "-o", "json", check=False)
        spec = json.loads(r.stdout).get("spec", {}) if r.returncode == 0 else {}
        return spec.get("holderIdentity") == pod["metadata"]["name"]

    wait_for("the remaining replica leads", holder, timeout=60, interval=1)
    r = helm("test", RELEASE, "-n", NS, "--timeout", "2m")
    assert "Phase:          Succeeded" in r.stdout and "Failed" not in r.stdout, r.stdout

    helm("uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "2m")
    sel = f"app.kubernetes.io/instance={RELEASE}"
    kinds = "deployments,replicasets,pods,services,serviceaccounts,roles,rolebindings,configmaps,secrets"

    def gone():
        left = get_json(kinds, "-n", NS, "-l", sel)["items"]
        left += get_json("clusterroles,clusterrolebindings", "-l", sel)["items"]
        left += [p for p in get_json("pods", "-n", NS)["items"]]  # hook pods, unlabelled strays
        return not left or None

    wait_for("no object of the release left", gone, timeout=120, interval=1)
    # nor the leader-election Lease: deleted by the last leader or, owned by the Deployment,
    # by the garbage collector
    wait_for(
        "the Lease is gone",
        lambda: kubectl("get", "lease", "eaas-operator", "-n", NS, check=False).returncode != 0,
        timeout=60,
        interval=1,
    )
    for kind in ("clusterrole", "clusterrolebinding"):
        assert kubectl("get", kind, RELEASE, check=False).returncode != 0
    assert helm("list", "-n", NS, "-q").stdout.strip() == ""
    # by Helm's design the CRDs of crds/ stay (deleting them would delete every pool)
    for crd in ("expertpools.eaas.io", "attentionfleets.eaas.io"):
        kubectl("get", "crd", crd)
