"""Fixtures for tests that need a real Kubernetes control plane (the EaaS testbed).

``testbed`` (session scope) starts etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok on loopback in a private temp state dir (so it never clashes with a
user's ``eaas testbed up``), with 4 GPU/RDMA nodes and 1 CPU node, all kwok nodes (pods turn
Ready without running; the process-node tier is ``tests/cluster``), and stops it at the end
of the session (the components get PR_SET_PDEATHSIG, so even a SIGKILLed pytest leaves
nothing running). It sets ``KUBECONFIG`` and prepends the testbed bin dir to ``PATH`` in
``os.environ`` for the whole session, so ``kubectl``, ``helm`` and the kubernetes Python client
in tests and in subprocesses talk to the testbed.

The binaries come from ``KUBEBUILDER_ASSETS`` or the build cache (``eaas testbed build``; CI
runs that first, because a cold build takes longer than one test's timeout). With neither the
binaries nor a Go toolchain the k8s tests fail with the build error (never skipped: a green run
must mean the operator was tested against a real API server).
"""

from __future__ import annotations

import os
import shutil

import pytest


@pytest.fixture(scope="session")
def testbed(tmp_path_factory):
    from eaas import testbed as tbmod

    if tbmod.find_bin_dir() is None:
        try:
            tbmod.binaries.go_binary()
        except tbmod.BuildError as e:
            pytest.fail(f"testbed binaries unavailable (run `eaas testbed build`): {e}")
    state_dir = tmp_path_factory.mktemp("testbed") / "state"
    tb = tbmod.up(
        state_dir=state_dir,
        gpu_nodes=4,
        cpu_nodes=1,
        timeout=300,
        attached=True,
        process_nodes="none",
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
        logs = state_dir / "logs"
        keep = tmp_path_factory.getbasetemp() / "testbed-logs"
        shutil.copytree(logs, keep, dirs_exist_ok=True)  # for post-mortems
        tbmod.down(state_dir=state_dir)
