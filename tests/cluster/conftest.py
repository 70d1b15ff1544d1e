"""Fixtures for the ``cluster`` tier: the testbed with *process nodes*, whose node agents run
pods as local processes (``eaas.testbed.agent``).

``cluster`` (module scope, so it is gone before the kwok-only ``testbed`` of ``tests/k8s``
starts) brings up etcd, kube-apiserver, kube-controller-manager (node monitor grace 20 s),
kube-scheduler and kwok in a private temp state dir, with 2 GPU/RDMA nodes (or the module's
``CLUSTER_GPU_NODES``) and 1 CPU node, all process nodes; crash-loop back-off base 1 s (upstream: 10 s) so restarts show within seconds.
``KUBECONFIG`` and ``PATH`` point at it for the module. Everything it started, containers
included, dies with the test process (PR_SET_PDEATHSIG) and is stopped at teardown.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

# the shared kubectl / get_json / wait_for helpers live with the k8s tier
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "k8s"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    from eaas import testbed as tbmod

    if tbmod.find_bin_dir() is None:
        try:
            tbmod.binaries.go_binary()
        except tbmod.BuildError as e:
            pytest.fail(f"testbed binaries unavailable (run `eaas testbed build`): {e}")
    state_dir = tmp_path_factory.mktemp("cluster") / "state"
    tb = tbmod.up(
        state_dir=state_dir,
        gpu_nodes=getattr(request.module, "CLUSTER_GPU_NODES", 2),
        cpu_nodes=1,
        timeout=300,
        attached=True,
        process_nodes="all",
        restart_backoff_s=1.0,
    )
    saved = {k: os.environ.get(k) for k in ("KUBECONFIG", "PATH")}
    os.environ.update({k: tb.env()[k] for k in ("KUBECONFIG", "PATH")})
    try:
        yield tb
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        agents = dict(tbmod.load(state_dir).agents)
        tbmod.down(state_dir=state_dir, remove=False)
        # nothing outlives `down`: no agent, no container process, no escaped descendant
        from eaas.testbed.cluster import STATE_MARKER, agent_alive, find_marked

        leaked = [p for p in agents.values() if agent_alive(p)]
        leaked += find_marked(STATE_MARKER, str(tb.state_dir))
        keep = tmp_path_factory.getbasetemp() / "cluster-logs"  # for post-mortems
        shutil.copytree(state_dir / "logs", keep, dirs_exist_ok=True)
        for log in (state_dir / "nodes").glob("*/pods/*/*.log"):
            dest = keep / "pods" / log.parent.name
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, dest)
        shutil.rmtree(state_dir, ignore_errors=True)
        assert not leaked, f"processes left after `eaas testbed down`: {leaked}"
