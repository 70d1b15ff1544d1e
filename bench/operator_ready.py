"""Time from ``kubectl apply`` of an ExpertPool to its ``Ready`` condition.

Measures two pools against a running control plane (``eaas testbed up --process-nodes none``
and ``eval "$(eaas testbed env)"``, or any cluster in ``KUBECONFIG``; ``--up`` starts a private
kwok-node testbed for the run and stops it afterwards):

* ``deploy/examples/tiny-pool.yaml`` — tiny DeepSeek-V3-architecture model, 3 MoE layers x 32
  experts, 4 servers;
* ``deploy/examples/deepseek-v3-pool.yaml`` — 58 MoE layers x 256 experts, 40 servers
  (29,696 expert replicas; a routing table of 0.53 MB, 529,292 bytes of today's JSON,
  measured with ``RoutingTable.from_placement(...).to_json()`` and pod names ``deepseek-v3-<i>``).

Ready means: every server pod Running and Ready, the routing-table ConfigMap lists all of them and
covers every expert ``redundancy`` times, ``status.conditions[Ready]`` True. The testbed has 4 GPU
nodes x 8 GPUs = 32; for the 40-server pool the script adds kwok GPU nodes (removed afterwards).

Usage::

    python bench/operator_ready.py [--up] [--start-operator] [--namespace bench-operator]

(This was ``tests/k8s/test_operator.py::test_ready_times``; a timing is a benchmark, not a test.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def kubectl(
    *args: str, input: str | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["kubectl", *args], input=input, capture_output=True, text=True, check=check, timeout=120
    )


def load_example(name: str) -> dict:
    return yaml.safe_load((ROOT / "deploy/examples" / name).read_text())


def gpu_capacity() -> int:
    nodes = json.loads(kubectl("get", "nodes", "-l", "eaas.io/rdma=true", "-o", "json").stdout)[
        "items"
    ]
    return sum(int(n["status"].get("allocatable", {}).get("nvidia.com/gpu", "0")) for n in nodes)


def add_gpu_nodes(count: int, first_index: int = 200) -> list[str]:
    """Add ``count`` kwok-managed GPU/RDMA nodes (8 GPUs each), labelled ``eaas.io/bench=true``."""
    from eaas.testbed.nodes import GPU_ALLOCATABLE, GPU_LABELS, KWOK_ANNOTATION, PROCESS_LABEL

    names = []
    for i in range(count):
        idx = first_index + i
        name = f"bench-gpu-node-{idx}"
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "kubernetes.io/hostname": name,
                    "type": "kwok",
                    "eaas.io/bench": "true",
                    PROCESS_LABEL: "kwok",
                    **GPU_LABELS,
                },
            },
            "spec": {"podCIDR": f"127.1.{idx}.0/24", "podCIDRs": [f"127.1.{idx}.0/24"]},
            "status": {"allocatable": dict(GPU_ALLOCATABLE), "capacity": dict(GPU_ALLOCATABLE)},
        }
        kubectl("apply", "-f", "-", input=json.dumps(node))
        names.append(name)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        out = kubectl(
            "get",
            "nodes",
            "-l",
            "eaas.io/bench=true",
            "-o",
            'jsonpath={range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\\n"}{end}',
        ).stdout
        if out.split().count("True") >= count:
            return names
        time.sleep(0.5)
    raise RuntimeError("extra kwok GPU nodes did not become Ready")


def remove_bench_nodes() -> None:
    kubectl("delete", "nodes", "-l", "eaas.io/bench=true", "--wait=false", check=False)


def pool_ready(namespace: str, name: str) -> dict | None:
    """The pool if it is fully Ready (status and routing table agree), else None."""
    r = kubectl("get", "expertpool", name, "-n", namespace, "-o", "json", check=False)
    if r.returncode != 0:
        return None
    pool = json.loads(r.stdout)
    st = pool.get("status") or {}
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", []))
    if (
        ready
        and st.get("readyReplicas") == pool["spec"]["replicas"]
        and st.get("observedGeneration") == pool["metadata"]["generation"]
    ):
        return pool
    return None


def time_to_ready(manifest: dict, namespace: str, timeout: float = 300.0) -> float:
    """Apply ``manifest`` with kubectl and return seconds until the pool is Ready.

    Raises:
        TimeoutError: not Ready within ``timeout`` seconds.
    """
    name = manifest["metadata"]["name"]
    t0 = time.monotonic()
    kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(manifest))
    while time.monotonic() - t0 < timeout:
        if pool_ready(namespace, name):
            return time.monotonic() - t0
        time.sleep(0.1)
    raise TimeoutError(f"ExpertPool {namespace}/{name} not Ready after {timeout}s")


def measure(namespace: str, out=print) -> dict[str, float]:
    """Measure the tiny pool and the 40-server DeepSeek-V3 pool; returns name -> seconds."""
    kubectl("create", "namespace", namespace, check=False)
    results: dict[str, float] = {}
    added: list[str] = []
    try:
        tiny = load_example("tiny-pool.yaml")
        tiny["metadata"]["name"] = "bench-tiny"
        results["tiny (3x32 experts, 4 servers)"] = time_to_ready(tiny, namespace)
        ds = load_example("deepseek-v3-pool.yaml")
        ds["metadata"]["name"] = "bench-dsv3"
        need = ds["spec"]["replicas"] * ds["spec"].get("gpusPerServer", 1)
        have = gpu_capacity()
        # the tiny pool keeps its 4 GPUs while the big one comes up
        missing = need + tiny["spec"]["replicas"] - have
        if missing > 0:
            added = add_gpu_nodes(-(-missing // 8))
            out(f"added {len(added)} kwok GPU node(s) for {need} GPUs")
        results["deepseek-v3 (58x256 experts, 40 servers)"] = time_to_ready(ds, namespace)
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        if added:
            # nodes go once the namespace's pods are gone
            deadline = time.monotonic() + 60
            while (
                time.monotonic() < deadline
                and kubectl(
                    "get", "pods", "-n", namespace, "-o", "name", check=False
                ).stdout.strip()
            ):
                time.sleep(0.5)
            remove_bench_nodes()
    for k, v in results.items():
        out(f"apply -> Ready  {k:45s} {v:7.2f} s")
    return results


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--namespace", default="bench-operator")
    ap.add_argument(
        "--start-operator", action="store_true", help="run `eaas operator` for the duration"
    )
    ap.add_argument(
        "--up",
        action="store_true",
        help="start a private testbed (kwok nodes) for the run; implies --start-operator",
    )
    args = ap.parse_args()
    if args.up:
        import tempfile

        from eaas import testbed as tbmod

        with tempfile.TemporaryDirectory(prefix="eaas-bench-") as tmp:
            tb = tbmod.up(
                state_dir=Path(tmp) / "state", process_nodes="none", attached=True, echo=print
            )
            os.environ.update({k: tb.env()[k] for k in ("KUBECONFIG", "PATH")})
            try:
                return run(args.namespace, start_operator=True)
            finally:
                tbmod.down(state_dir=tb.state_dir)
    return run(args.namespace, start_operator=args.start_operator)


def run(namespace: str, start_operator: bool) -> int:
    """Install the CRDs, optionally run ``eaas operator``, and measure."""
    kubectl("apply", "-f", str(ROOT / "deploy/crds"))
    kubectl("wait", "--for=condition=Established", "crd/expertpools.eaas.io", "--timeout=60s")
    op = None
    if start_operator:
        op = subprocess.Popen(
            [sys.executable, "-m", "eaas.cli", "operator"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=os.environ.copy(),
        )
    try:
        measure(namespace)
    finally:
        if op is not None:
            op.terminate()
            op.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
