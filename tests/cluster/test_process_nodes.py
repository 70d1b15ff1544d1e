"""Process nodes: the testbed's node agent runs pods as real local processes.

Each test creates plain pods with ``kubectl`` and checks what a kubelet must do: run the
command on the pod IP with env, downward API and volumes; probes drive readiness and
restarts; crash-loop back-off; deletion with SIGTERM; node heartbeats through the real
node-lifecycle controller; and a real ``eaas expert-server`` in a pod.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest

from helpers.e2e import alive
from helpers.k8s import get_json, kubectl, wait_for

PY = sys.executable


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def apply(obj: dict) -> None:
    kubectl("apply", "-f", "-", input=json.dumps(obj))


def pod(name: str, containers: list[dict], **spec) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", **spec.pop("metadata", {})},
        "spec": {"containers": containers, "terminationGracePeriodSeconds": 10, **spec},
    }


def conditions(p: dict) -> dict[str, str]:
    return {c["type"]: c["status"] for c in (p.get("status") or {}).get("conditions", [])}


def get_pod(name: str) -> dict | None:
    r = kubectl("get", "pod", name, "-o", "json", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def wait_ready(name: str, timeout: float = 90) -> dict:
    def ready():
        p = get_pod(name)
        return p if p and conditions(p).get("Ready") == "True" else None

    return wait_for(f"pod {name} Ready", ready, timeout=timeout)


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def ctr_status(p: dict, name: str | None = None) -> dict:
    sts = p["status"]["containerStatuses"]
    return sts[0] if name is None else next(s for s in sts if s["name"] == name)


def test_http_server_pod_env_volumes_probes(cluster):
    """A web server pod on a GPU process node: Running+Ready through startup (tcpSocket) and
    readiness (httpGet) probes, reachable on its pod IP only, with env (value, $(VAR),
    fieldRef, configMapKeyRef), GPU indices, the service-account token and a configMap volume
    that follows an update after the (per-pod) sync delay."""
    name, cm = unique("web"), unique("web-cm")
    apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": cm, "namespace": "default"},
            "data": {"greeting": "hello-1", "color": "blue"},
        }
    )
    script = (
        'printf "%s|%s|%s|%s|%s|%s" "$POD_NAME" "$POD_IP" "$GREETING" "$COLOR" '
        '"$CUDA_VISIBLE_DEVICES" "$(cat /var/run/secrets/kubernetes.io/serviceaccount/namespace)"'
        " > /srv/www/env.txt && "
        "test -s /var/run/secrets/kubernetes.io/serviceaccount/token && "
        f"exec {PY} -m http.server 28080 --directory /srv/www"
    )
    apply(
        pod(
            name,
            [
                {
                    "name": "web",
                    "image": "eaas:local",
                    "command": ["sh", "-c", script],
                    "ports": [{"name": "http", "containerPort": 28080}],
                    "env": [
                        {
                            "name": "POD_NAME",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                        },
                        {
                            "name": "POD_IP",
                            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                        },
                        {"name": "GREETING", "value": "hi-$(POD_NAME)"},
                        {
                            "name": "COLOR",
                            "valueFrom": {"configMapKeyRef": {"name": cm, "key": "color"}},
                        },
                    ],
                    "resources": {"limits": {"nvidia.com/gpu": "2"}},
                    "volumeMounts": [
                        {"name": "www", "mountPath": "/srv/www"},
                        {"name": "cfg", "mountPath": "/srv/www/cfg"},
                    ],
                    "startupProbe": {"tcpSocket": {"port": 28080}, "periodSeconds": 1},
                    "readinessProbe": {
                        "httpGet": {"path": "/env.txt", "port": "http"},
                        "periodSeconds": 1,
                    },
                }
            ],
            volumes=[
                {"name": "www", "emptyDir": {}},
                {"name": "cfg", "configMap": {"name": cm}},
            ],
            metadata={"annotations": {"testbed.eaas.io/volume-sync-seconds": "1"}},
        )
    )
    try:
        p = wait_ready(name)
        assert p["status"]["phase"] == "Running"
        node = get_json("node", p["spec"]["nodeName"])
        assert node["metadata"]["labels"]["eaas.io/testbed-node"] == "process"
        ip = p["status"]["podIP"]
        assert ip.startswith(node["spec"]["podCIDR"].rsplit(".", 1)[0] + "."), ip
        st = ctr_status(p)
        assert st["ready"] and st["started"] and st["restartCount"] == 0
        assert "running" in st["state"]

        env = http_get(f"http://{ip}:28080/env.txt").split("|")
        assert env == [name, ip, f"hi-{name}", "blue", "0,1", "default"]
        # bound to the pod IP (the wildcard bind was given the pod IP), not to the host
        with pytest.raises(urllib.error.URLError):
            http_get("http://127.0.0.1:28080/env.txt")
        assert http_get(f"http://{ip}:28080/cfg/greeting") == "hello-1"
        kubectl("patch", "configmap", cm, "-p", json.dumps({"data": {"greeting": "hello-2"}}))
        wait_for(
            "configMap volume refreshed",
            lambda: http_get(f"http://{ip}:28080/cfg/greeting") == "hello-2",
            timeout=60,
        )
    finally:
        kubectl("delete", "pod", name, "--wait=false", check=False)
        kubectl("delete", "configmap", cm, check=False)


def test_crashing_container_restarts_with_back_off(cluster):
    name = unique("crash")
    apply(pod(name, [{"name": "c", "image": "eaas:local", "command": ["sh", "-c", "exit 3"]}]))
    try:

        def restarted_twice():
            p = get_pod(name)
            sts = (p or {}).get("status", {}).get("containerStatuses") or []
            return p if sts and sts[0]["restartCount"] >= 2 else None

        p = wait_for("restartCount >= 2", restarted_twice, timeout=60)
        st = ctr_status(p)
        assert st["lastState"]["terminated"]["exitCode"] == 3
        assert st["lastState"]["terminated"]["reason"] == "Error"
        assert not st["ready"]
        assert conditions(p)["Ready"] == "False"
        counts = [st["restartCount"]]
        wait_for(
            "restartCount to keep rising",
            lambda: ctr_status(get_pod(name))["restartCount"] > counts[0],
            timeout=60,
        )
    finally:
        kubectl("delete", "pod", name, "--wait=false", check=False)


def test_failing_liveness_probe_restarts_container(cluster):
    """An exec liveness probe (run inside the container's mount namespace) fails once the
    container removes its health file: the agent kills it (SIGTERM) and starts it again."""
    name = unique("live")
    script = "touch /data/healthy && sleep 3 && rm /data/healthy && exec sleep 600"
    apply(
        pod(
            name,
            [
                {
                    "name": "c",
                    "image": "eaas:local",
                    "command": ["sh", "-c", script],
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                    "livenessProbe": {
                        "exec": {"command": ["cat", "/data/healthy"]},
                        "periodSeconds": 1,
                        "failureThreshold": 2,
                    },
                }
            ],
            volumes=[{"name": "data", "emptyDir": {}}],
            terminationGracePeriodSeconds=2,
        )
    )
    try:
        p = wait_ready(name)
        assert ctr_status(p)["restartCount"] == 0

        def restarted():
            p = get_pod(name)
            st = ctr_status(p)
            return p if st["restartCount"] >= 1 and st["lastState"].get("terminated") else None

        p = wait_for("liveness restart", restarted, timeout=60)
        # killed by SIGTERM (128 + 15), not exited by itself
        assert ctr_status(p)["lastState"]["terminated"]["exitCode"] == 143
        events = kubectl(
            "get", "events", "--field-selector", f"involvedObject.name={name}", "-o", "json"
        ).stdout
        reasons = {e["reason"] for e in json.loads(events)["items"]}
        assert {"Unhealthy", "Killing", "Started"} <= reasons, reasons
    finally:
        kubectl("delete", "pod", name, "--wait=false", check=False)


def test_pod_delete_sends_sigterm_and_removes_pod(cluster, tmp_path):
    name = unique("term")
    out = tmp_path / "term"
    script = (
        "import os, signal, subprocess, sys, time\n"
        "open('/out/pid', 'w').write(str(os.getpid()))\n"
        # a descendant that leaves the container's process group (a kubelet's cgroup kill
        # would still get it)
        "escapee = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
        "open('/out/escapee', 'w').write(str(escapee.pid))\n"
        "def bye(sig, frame):\n"
        "    open('/out/signal', 'w').write(signal.Signals(sig).name)\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "open('/out/ready', 'w').write('1')\n"
        "while True:\n"
        "    time.sleep(1)\n"
    )
    apply(
        pod(
            name,
            [
                {
                    "name": "c",
                    "image": "eaas:local",
                    "command": ["python", "-c", script],
                    "volumeMounts": [{"name": "out", "mountPath": "/out"}],
                    "readinessProbe": {
                        "exec": {"command": ["test", "-f", "/out/ready"]},
                        "periodSeconds": 1,
                    },
                }
            ],
            volumes=[{"name": "out", "hostPath": {"path": str(out), "type": "DirectoryOrCreate"}}],
        )
    )
    wait_ready(name)
    pid = int((out / "pid").read_text())
    assert alive(pid)
    kubectl("delete", "pod", name, "--wait=false")
    wait_for(f"pod {name} gone", lambda: get_pod(name) is None, timeout=60)
    assert (out / "signal").read_text() == "SIGTERM"
    escapee = int((out / "escapee").read_text())
    for p in (pid, escapee):
        wait_for(f"pid {p} gone", lambda p=p: not alive(p), timeout=30)


def test_node_stop_makes_node_not_ready_and_start_recovers(cluster, tmp_path):
    node = "gpu-node-1"
    name = unique("onnode")
    out = tmp_path / "pid"
    apply(
        pod(
            name,
            [
                {
                    "name": "c",
                    "image": "eaas:local",
                    # "$$$$": Kubernetes turns "$$" into "$"; the shell's "$$" is its pid
                    "command": ["sh", "-c", "echo $$$$ > /out/pid && exec sleep 600"],
                    "volumeMounts": [{"name": "out", "mountPath": "/out"}],
                }
            ],
            nodeName=node,
            volumes=[{"name": "out", "hostPath": {"path": str(out), "type": "DirectoryOrCreate"}}],
        )
    )
    cli = [PY, "-m", "eaas.cli", "testbed", "node"]
    state = ["--state-dir", str(cluster.state_dir)]
    try:
        wait_ready(name)
        # Ready comes when the container starts; the shell writes its pid a moment later
        wait_for(
            "pid file written",
            lambda: (out / "pid").is_file() and (out / "pid").read_text().strip(),
            timeout=60,
        )
        pid = int((out / "pid").read_text())
        r = subprocess.run([*cli, "stop", node, *state], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        # power-off: the container went with the agent
        wait_for(f"pid {pid} gone", lambda: not alive(pid), timeout=30)

        # the real node-lifecycle controller notices the missing Lease renewals
        wait_for(
            f"{node} NotReady",
            lambda: conditions(get_json("node", node))["Ready"] == "Unknown",
            timeout=90,
        )
        wait_for(
            f"{node} tainted unreachable",
            lambda: (
                "node.kubernetes.io/unreachable"
                in {t["key"] for t in get_json("node", node)["spec"].get("taints") or []}
            ),
            timeout=30,
        )
        # a kwok or unknown node cannot be stopped; a running one cannot be started twice
        bad = subprocess.run(
            [*cli, "stop", "no-such-node", *state], capture_output=True, text=True, timeout=60
        )
        assert bad.returncode == 1 and "not a process node" in bad.stderr

        r = subprocess.run(
            [*cli, "start", node, *state], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stderr
        wait_for(
            f"{node} Ready again",
            lambda: conditions(get_json("node", node))["Ready"] == "True",
            timeout=90,
        )
        again = subprocess.run(
            [*cli, "start", node, *state], capture_output=True, text=True, timeout=60
        )
        assert again.returncode == 1 and "already running" in again.stderr
        # the pod's container runs again on the restarted node, counted as a restart
        p = wait_ready(name)
        assert ctr_status(p)["restartCount"] >= 1
        # the restarted container writes its own pid (a moment after it starts)
        wait_for(
            "new container's pid written",
            lambda: (t := (out / "pid").read_text().strip()) and int(t) != pid,
            timeout=60,
        )
    finally:
        kubectl("delete", "pod", name, "--wait=false", check=False)


def test_expert_server_runs_in_a_pod(cluster):
    """``eaas expert-server`` on the tiny model (hostPath volume at /models/tiny) in a pod on a
    GPU process node: Ready through an httpGet probe of its ``/health`` (weights loaded, listener
    bound, serving loop running) on its pod IP, serving Prometheus metrics there."""
    from eaas.runtime.models.tiny import default_model_dir

    model = str(default_model_dir())
    name = unique("expert")
    apply(
        pod(
            name,
            [
                {
                    "name": "expert-server",
                    "image": "eaas:local",
                    "command": ["eaas", "expert-server"],
                    "args": [
                        "--model",
                        "/models/tiny",
                        "--server-id",
                        "$(POD_NAME)",
                        "--listen",
                        "tcp://0.0.0.0:9000",
                        "--http-port",
                        "9100",
                    ],
                    "env": [
                        {
                            "name": "POD_NAME",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                        }
                    ],
                    "resources": {"limits": {"nvidia.com/gpu": "1", "rdma/ib": "1"}},
                    "volumeMounts": [
                        {"name": "model", "mountPath": "/models/tiny", "readOnly": True}
                    ],
                    "readinessProbe": {
                        "httpGet": {"path": "/health", "port": 9100},
                        "periodSeconds": 1,
                    },
                }
            ],
            nodeSelector={"eaas.io/rdma": "true"},
            volumes=[{"name": "model", "hostPath": {"path": model, "type": "Directory"}}],
        )
    )
    try:
        p = wait_ready(name, timeout=180)
        ip = p["status"]["podIP"]
        assert p["spec"]["nodeName"].startswith("gpu-node-")
        metrics = http_get(f"http://{ip}:9100/metrics")
        assert "eaas_" in metrics
        assert ctr_status(p)["restartCount"] == 0
    finally:
        kubectl("delete", "pod", name, "--wait=false", check=False)


def test_in_cluster_client_authenticates_as_the_pod_service_account(cluster, tmp_path):
    """The service-account token volume, ``kube-root-ca.crt`` and ``KUBERNETES_SERVICE_*``
    make the kubernetes client's in-cluster config work from a pod (as kopf in a pod needs);
    a ``restartPolicy: Never`` pod that exits 0 ends ``Succeeded``."""
    name = unique("incluster")
    out = tmp_path / "whoami"
    script = (
        "from kubernetes import client, config\n"
        "config.load_incluster_config()\n"
        "r = client.AuthenticationV1Api().create_self_subject_review(\n"
        "    {'apiVersion': 'authentication.k8s.io/v1', 'kind': 'SelfSubjectReview'})\n"
        "open('/out/user', 'w').write(r.status.user_info.username)\n"
    )
    apply(
        pod(
            name,
            [
                {
                    "name": "c",
                    "image": "eaas:local",
                    "command": ["python", "-c", script],
                    "volumeMounts": [{"name": "out", "mountPath": "/out"}],
                }
            ],
            restartPolicy="Never",
            nodeSelector={"eaas.io/node-kind": "cpu"},
            volumes=[{"name": "out", "hostPath": {"path": str(out), "type": "DirectoryOrCreate"}}],
        )
    )
    try:
        p = wait_for(
            f"pod {name} Succeeded",
            lambda: (
                (p := get_pod(name)) and p["status"].get("phase") in ("Succeeded", "Failed") and p
            ),
            timeout=90,
        )
        assert p["status"]["phase"] == "Succeeded", ctr_status(p)
        assert ctr_status(p)["state"]["terminated"]["exitCode"] == 0
        assert (out / "user").read_text() == "system:serviceaccount:default:default"
    finally:
        kubectl("delete", "pod", name, "--wait=false", check=False)


def test_init_container_secret_and_downward_api_volumes(cluster, tmp_path):
    """An init container runs to completion before the main one; secret and downwardAPI
    volumes appear as files."""
    name, secret = unique("init"), unique("sec")
    out = tmp_path / "init"
    kubectl("create", "secret", "generic", secret, "--from-literal=password=s3cret")
    main = "cat /work/init.txt /sec/password /info/labels > /out/result && exec sleep 600"
    apply(
        pod(
            name,
            [
                {
                    "name": "main",
                    "image": "eaas:local",
                    "command": ["sh", "-c", main],
                    "volumeMounts": [
                        {"name": "work", "mountPath": "/work"},
                        {"name": "sec", "mountPath": "/sec"},
                        {"name": "info", "mountPath": "/info"},
                        {"name": "out", "mountPath": "/out"},
                    ],
                }
            ],
            metadata={"labels": {"app": "init-demo"}},
            initContainers=[
                {
                    "name": "prepare",
                    "image": "eaas:local",
                    "command": ["sh", "-c", "echo prepared > /work/init.txt"],
                    "volumeMounts": [{"name": "work", "mountPath": "/work"}],
                }
            ],
            volumes=[
                {"name": "work", "emptyDir": {}},
                {"name": "sec", "secret": {"secretName": secret}},
                {
                    "name": "info",
                    "downwardAPI": {
                        "items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]
                    },
                },
                {"name": "out", "hostPath": {"path": str(out), "type": "DirectoryOrCreate"}},
            ],
        )
    )
    try:
        p = wait_ready(name)
        (init,) = p["status"]["initContainerStatuses"]
        assert init["state"]["terminated"]["exitCode"] == 0
        assert init["state"]["terminated"]["reason"] == "Completed"
        assert conditions(p)["Initialized"] == "True"
        wait_for("result file", lambda: (out / "result").exists(), timeout=30)
        assert (out / "result").read_text() == 'prepared\ns3cretapp="init-demo"\n'
    finally:
        kubectl("delete", "pod", name, "--wait=false", check=False)
        kubectl("delete", "secret", secret, check=False)


def test_unsupported_volume_gets_a_clear_container_error(cluster):
    name = unique("nfs")
    apply(
        pod(
            name,
            [
                {
                    "name": "c",
                    "image": "eaas:local",
                    "command": ["sleep", "600"],
                    "volumeMounts": [{"name": "shared", "mountPath": "/shared"}],
                }
            ],
            volumes=[{"name": "shared", "nfs": {"server": "nfs.invalid", "path": "/export"}}],
        )
    )
    try:

        def config_error():
            p = get_pod(name)
            sts = (p or {}).get("status", {}).get("containerStatuses") or []
            waiting = sts[0]["state"].get("waiting", {}) if sts else {}
            return waiting if waiting.get("reason") == "CreateContainerConfigError" else None

        waiting = wait_for("CreateContainerConfigError", config_error, timeout=60)
        assert "volume 'shared'" in waiting["message"] and "nfs" in waiting["message"]
        assert get_pod(name)["status"]["phase"] == "Pending"
    finally:
        kubectl("delete", "pod", name, "--wait=false", check=False)


@pytest.mark.failstatic
def test_agent_reasserts_ready_after_someone_else_clears_it(cluster):
    """The node-lifecycle controller marks a NotReady node's pods Ready=False and never back; a
    kubelet writes the status it observes again. Here another writer clears Ready of a running,
    ready pod; the agent re-asserts Ready=True and the container's ready within its bound
    (``REASSERT_MIN_S`` after the watch delivers the overwrite)."""
    name = unique("reassert")
    apply(pod(name, [{"name": "c", "image": "eaas:local", "command": ["sleep", "600"]}]))
    try:
        p = wait_ready(name)
        st = dict(ctr_status(p), ready=False)
        conds = [
            dict(c, status="False", reason="NodeNotReady") if c["type"] == "Ready" else c
            for c in p["status"]["conditions"]
        ]
        kubectl(
            "patch", "pod", name, "--subresource=status", "--type=merge",
            "-p", json.dumps({"status": {"conditions": conds, "containerStatuses": [st]}}),
        )  # fmt: skip
        t0 = time.monotonic()

        def back():
            q = get_pod(name)
            ok = q and conditions(q).get("Ready") == "True" and ctr_status(q)["ready"]
            return q if ok else None

        wait_for("Ready re-asserted", back, timeout=30)
        took = time.monotonic() - t0
        # the bound plus kubectl's own round trips on a loaded machine
        assert took < 15, f"re-asserted after {took:.1f} s"
    finally:
        kubectl("delete", "pod", name, "--wait=false", check=False)
