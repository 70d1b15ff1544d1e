"""Smoke tests of the local Kubernetes testbed (real control plane + kwok nodes).

Each test checks one thing the operator's tests rely on: the node inventory, real scheduling
of extended resources (``nvidia.com/gpu``, ``rdma/ib``), kwok making pods Ready with loopback
pod IPs, the controller-manager (Deployments, garbage collection), and the CLIs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest
from k8s_helpers import get_json, kubectl, wait_for

pytestmark = pytest.mark.k8s


def apply(obj: dict) -> None:
    kubectl("apply", "-f", "-", input=json.dumps(obj))


def pod(name: str, requests: dict, node_selector: dict | None = None) -> dict:
    spec = {
        "containers": [
            {
                "name": "main",
                "image": "registry.invalid/eaas/expert:test",
                "resources": {"requests": requests, "limits": requests},
            }
        ]
    }
    if node_selector:
        spec["nodeSelector"] = node_selector
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def test_nodes_inventory(testbed):
    nodes = {n["metadata"]["name"]: n for n in get_json("nodes")["items"]}
    gpu = sorted(n for n in nodes if n.startswith("gpu-node-"))
    cpu = sorted(n for n in nodes if n.startswith("cpu-node-"))
    assert gpu == [f"gpu-node-{i}" for i in range(4)]
    assert cpu == ["cpu-node-0"]
    assert len(nodes) == 5
    for name in gpu:
        n = nodes[name]
        alloc = n["status"]["allocatable"]
        assert alloc["nvidia.com/gpu"] == "8"
        assert alloc["rdma/ib"] == "8"
        assert n["metadata"]["labels"]["eaas.io/rdma"] == "true"
        assert n["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
    c = nodes["cpu-node-0"]
    assert "nvidia.com/gpu" not in c["status"]["allocatable"]
    assert "rdma/ib" not in c["status"]["allocatable"]
    assert "eaas.io/rdma" not in c["metadata"]["labels"]
    for n in nodes.values():
        ready = {x["type"]: x["status"] for x in n["status"]["conditions"]}["Ready"]
        assert ready == "True", n["metadata"]["name"]


def test_gpu_rdma_pod_scheduled_and_ready_with_loopback_ip(testbed):
    name = unique("expert")
    apply(
        pod(
            name,
            {"nvidia.com/gpu": "1", "rdma/ib": "1", "cpu": "1", "memory": "1Gi"},
            {"eaas.io/rdma": "true"},
        )
    )
    try:

        def ready():
            p = get_json("pod", name)
            conds = {c["type"]: c["status"] for c in p["status"].get("conditions", [])}
            return p if conds.get("Ready") == "True" and p["status"].get("podIP") else None

        p = wait_for(f"pod {name} Ready", ready)
        assert p["spec"]["nodeName"].startswith("gpu-node-")
        assert p["status"]["phase"] == "Running"
        assert p["status"]["podIP"].startswith("127.")
        node = get_json("node", p["spec"]["nodeName"])
        assert p["status"]["podIP"].startswith(node["spec"]["podCIDR"].rsplit(".", 1)[0] + ".")
    finally:
        kubectl("delete", "pod", name, "--wait=false", check=False)


def test_rdma_pod_never_lands_on_cpu_node(testbed):
    # 5 pods x 2 rdma/ib: scheduler spreads them but must never pick the CPU node.
    names = [unique("rdma") for _ in range(5)]
    for n in names:
        apply(pod(n, {"rdma/ib": "2"}))
    try:

        def all_bound():
            nodes = [get_json("pod", n)["spec"].get("nodeName") for n in names]
            return nodes if all(nodes) else None

        nodes = wait_for("rdma pods bound", all_bound)
        assert all(n.startswith("gpu-node-") for n in nodes), nodes
    finally:
        kubectl("delete", "pod", *names, "--wait=false", check=False)


def test_pod_asking_more_gpus_than_any_node_stays_pending(testbed):
    name = unique("toobig")
    apply(pod(name, {"nvidia.com/gpu": "9"}))
    try:

        def unschedulable():
            p = get_json("pod", name)
            conds = {c["type"]: c for c in p["status"].get("conditions", [])}
            c = conds.get("PodScheduled")
            return (
                p if c and c["status"] == "False" and c.get("reason") == "Unschedulable" else None
            )

        p = wait_for(f"scheduler to mark {name} Unschedulable", unschedulable)
        assert p["status"]["phase"] == "Pending"
        assert "nodeName" not in p["spec"]
        msg = {c["type"]: c for c in p["status"]["conditions"]}["PodScheduled"]["message"]
        assert "nvidia.com/gpu" in msg
        time.sleep(2)
        assert "nodeName" not in get_json("pod", name)["spec"]
    finally:
        kubectl("delete", "pod", name, "--wait=false", check=False)


def test_kubectl_and_helm_run(testbed):
    out = kubectl("version", "-o", "json").stdout
    v = json.loads(out)
    assert v["serverVersion"]["gitVersion"].startswith("v1.")
    assert v["clientVersion"]["gitVersion"] == v["serverVersion"]["gitVersion"]
    helm = subprocess.run(
        ["helm", "version", "--short"], capture_output=True, text=True, check=True, timeout=60
    )
    assert helm.stdout.startswith("v3."), helm.stdout
    # helm reaches the apiserver through KUBECONFIG
    ls = subprocess.run(
        ["helm", "list", "-A", "-o", "json"], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(ls.stdout) == []


def test_deployment_creates_ready_pods(testbed):
    name = unique("deploy")
    apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {"containers": [{"name": "c", "image": "registry.invalid/x"}]},
                },
            },
        }
    )
    try:

        def available():
            d = get_json("deployment", name)
            return d if d.get("status", {}).get("availableReplicas") == 3 else None

        wait_for(f"deployment {name} 3/3 available", available, timeout=90)
        pods = get_json("pods", "-l", f"app={name}")["items"]
        assert len(pods) == 3
        assert all(p["status"]["podIP"].startswith("127.") for p in pods)
    finally:
        kubectl("delete", "deployment", name, "--wait=false", check=False)


def test_garbage_collector_deletes_owned_configmap(testbed):
    owner, owned = unique("owner"), unique("owned")
    apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": owner}, "data": {}})
    uid = get_json("configmap", owner)["metadata"]["uid"]
    apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": owned,
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "ConfigMap", "name": owner, "uid": uid}
                ],
            },
            "data": {"k": "v"},
        }
    )
    assert kubectl("get", "configmap", owned, check=False).returncode == 0
    kubectl("delete", "configmap", owner)
    wait_for(
        f"GC to delete {owned}",
        lambda: kubectl("get", "configmap", owned, check=False).returncode != 0,
        timeout=60,
    )


def test_python_client_sees_nodes(testbed):
    # The operator (kopf) uses the kubernetes Python client with the same kubeconfig.
    from kubernetes import client, config

    api = client.CoreV1Api(config.new_client_from_config(config_file=str(testbed.kubeconfig)))
    names = {n.metadata.name for n in api.list_node().items}
    assert {"gpu-node-0", "cpu-node-0"} <= names


def test_up_is_idempotent_and_env_cli_works(testbed):
    from eaas.operator import testbed as tbmod

    again = tbmod.up(state_dir=testbed.state_dir)
    assert again.pids == testbed.pids
    env = subprocess.run(
        [sys.executable, "-m", "eaas.cli", "testbed", "env", "--state-dir", str(testbed.state_dir)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert f"export KUBECONFIG={testbed.kubeconfig}" in env
    # A shell that knows nothing of the testbed: no KUBECONFIG, PATH without the bin dir.
    clean = {"HOME": os.environ.get("HOME", "/tmp"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        ["bash", "-c", env + "kubectl get nodes -o name"],
        env=clean,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert "node/gpu-node-0" in out
