"""The testbed's Node objects: GPU and CPU nodes, each a process node (run by a node agent,
:mod:`.agent`) or a kwok node (kept Ready by kwok; its pods turn Ready without running)."""

from __future__ import annotations

import subprocess
import sys

from .record import Testbed, TestbedError, api

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPU_LABELS = {"eaas.io/rdma": "true", "nvidia.com/gpu.present": "true", "eaas.io/node-kind": "gpu"}
CPU_LABELS = {"eaas.io/node-kind": "cpu"}
GPU_ALLOCATABLE = {
    "cpu": "96",
    "memory": "1Ti",
    "pods": "110",
    "nvidia.com/gpu": "8",
    "rdma/ib": "8",
    "ephemeral-storage": "1Ti",
}
CPU_ALLOCATABLE = {"cpu": "32", "memory": "128Gi", "pods": "110", "ephemeral-storage": "500Gi"}
PROCESS_LABEL = "eaas.io/testbed-node"  # "process" or "kwok"


def node_object(
    name: str, index: int, labels: dict, allocatable: dict, process: bool, net: int = 1
) -> dict:
    """The Node object of node ``index`` (``spec.podCIDR`` 127.<net>.<index>.0/24)."""
    annotations = {"node.alpha.kubernetes.io/ttl": "0"}
    if not process:
        annotations[KWOK_ANNOTATION] = "fake"  # kwok manages this node and its pods
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": annotations,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "process" if process else "kwok",
                PROCESS_LABEL: "process" if process else "kwok",
                **labels,
            },
        },
        # pod IPs come from spec.podCIDR: loopback addresses, one /24 per node.
        "spec": {"podCIDR": f"127.{net}.{index}.0/24", "podCIDRs": [f"127.{net}.{index}.0/24"]},
        "status": {"allocatable": dict(allocatable), "capacity": dict(allocatable)},
    }


def check_mount_namespaces() -> None:
    """Process nodes give each container a private mount namespace (:mod:`.podinit`).

    Raises:
        TestbedError: this process may not create one (needs root / CAP_SYS_ADMIN).
    """
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare(0x20000) != 0)"
    r = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, timeout=60)
    if r.returncode != 0:
        raise TestbedError(
            "process nodes need mount namespaces (root or CAP_SYS_ADMIN) to show pods their "
            "volumes at their mountPath; run as root, or use --process-nodes none (kwok nodes)"
        )


def process_node_names(spec: str | list | None, gpu: list[str], cpu: list[str]) -> list[str]:
    """``"all"`` (default), ``"none"``, or node names (list or comma-separated).

    Raises:
        ValueError: a name that is not one of the testbed's nodes.
    """
    if spec is None or spec == "all":
        return gpu + cpu
    if spec == "none" or spec == []:
        return []
    names = [n.strip() for n in spec.split(",")] if isinstance(spec, str) else list(spec)
    unknown = [n for n in names if n not in gpu + cpu]
    if unknown:
        raise ValueError(f"--process-nodes: unknown node(s) {unknown}; nodes are {gpu + cpu}")
    return names


def create_nodes(tb: Testbed) -> set[str]:
    """Create the Node objects of ``tb`` (kept alive by kwok or by their node agent); returns
    their names.

    Raises:
        TestbedError: the apiserver refused one.
    """
    proc = set(tb.process_nodes)
    nodes = [
        node_object(n, i, GPU_LABELS, GPU_ALLOCATABLE, n in proc, tb.pod_net)
        for i, n in enumerate(tb.gpu_nodes)
    ]
    nodes += [
        node_object(n, len(tb.gpu_nodes) + i, CPU_LABELS, CPU_ALLOCATABLE, n in proc, tb.pod_net)
        for i, n in enumerate(tb.cpu_nodes)
    ]
    for node in nodes:
        status, body = api(tb, "POST", "/api/v1/nodes", node)
        if status not in (200, 201):
            raise TestbedError(f"creating node {node['metadata']['name']} failed: {status} {body}")
    return {n["metadata"]["name"] for n in nodes}


def nodes_ready(tb: Testbed, names: set[str]) -> bool:
    """Whether every node of ``names`` is Ready and free of node-lifecycle taints."""
    status, body = api(tb, "GET", "/api/v1/nodes")
    if status != 200 or not isinstance(body, dict):
        return False
    ready = set()
    for n in body.get("items", []):
        conds = {c["type"]: c["status"] for c in n.get("status", {}).get("conditions", [])}
        taints = {t["key"] for t in n.get("spec", {}).get("taints", []) or []}
        # node lifecycle taints (not-ready / unreachable) must be gone as well
        if conds.get("Ready") == "True" and not any(
            t.startswith("node.kubernetes.io/") for t in taints
        ):
            ready.add(n["metadata"]["name"])
    return names <= ready
