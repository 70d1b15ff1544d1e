"""Tests of our testbed code (``eaas.testbed``) with kwok nodes: the node inventory ``up``
creates, the binaries it builds, ``up``'s idempotency and the ``eaas testbed`` CLI.

Upstream Kubernetes behaviour (scheduling, controllers, garbage collection) is not re-tested
here; process nodes are tested in ``tests/cluster``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers.k8s import get_json, kubectl


def test_nodes_inventory(testbed):
    nodes = {n["metadata"]["name"]: n for n in get_json("nodes")["items"]}
    gpu = sorted(n for n in nodes if n.startswith("gpu-node-"))
    cpu = sorted(n for n in nodes if n.startswith("cpu-node-"))
    assert gpu == [f"gpu-node-{i}" for i in range(4)]
    assert cpu == ["cpu-node-0"]
    assert len(nodes) == 5
    cidrs = {n["spec"]["podCIDR"] for n in nodes.values()}
    # 127.<net>.<node>.0/24: one net per testbed (parallel testbeds never share pod IPs)
    nets = {c.split(".")[1] for c in cidrs}
    assert len(cidrs) == 5 and len(nets) == 1
    assert all(c.startswith("127.") and c.endswith(".0/24") for c in cidrs)
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
        # the fixture asks for kwok nodes only (process_nodes="none")
        assert n["metadata"]["labels"]["eaas.io/testbed-node"] == "kwok"
        assert n["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
        ready = {x["type"]: x["status"] for x in n["status"]["conditions"]}["Ready"]
        assert ready == "True", n["metadata"]["name"]
    assert testbed.process_nodes == [] and testbed.agents == {}


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


def test_up_is_idempotent_and_env_cli_works(testbed):
    from eaas import testbed as tbmod

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


def test_node_stop_refuses_a_kwok_node(testbed):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "eaas.cli",
            "testbed",
            "node",
            "stop",
            "gpu-node-0",
            "--state-dir",
            str(testbed.state_dir),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "gpu-node-0 is not a process node" in r.stderr
