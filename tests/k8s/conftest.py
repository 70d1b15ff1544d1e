"""Fixtures for tests that need a real Kubernetes control plane (the EaaS testbed).

``testbed`` (session scope) starts etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok on loopback in a private temp state dir (so it never clashes with a
user's ``eaas testbed up``), with 4 GPU/RDMA nodes and 1 CPU node, all kwok nodes (pods turn
Ready without running; the process-node tier is ``tests/cluster``), and stops it right after
the tier's last test (:class:`helpers.tier.TierTestbed`; the components get PR_SET_PDEATHSIG,
so even a SIGKILLed pytest leaves nothing running). It sets ``KUBECONFIG`` and prepends the testbed bin dir to ``PATH`` in
``os.environ`` for the whole session, so ``kubectl``, ``helm`` and the kubernetes Python client
in tests and in subprocesses talk to the testbed. Start, stop and log keeping are
:func:`helpers.k8s.running_testbed`'s, shared with ``tests/cluster``.

The binaries come from ``KUBEBUILDER_ASSETS`` or the build cache (``eaas testbed build``; CI
runs that first, because a cold build takes longer than one test's timeout). With neither the
binaries nor a Go toolchain the k8s tests fail with the build error (never skipped: a green run
must mean the operator was tested against a real API server).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from helpers.k8s import Operator, apply_crds, kubectl
from helpers.tier import TierTestbed

_TESTBED = TierTestbed(Path(__file__).parent)


@pytest.fixture(scope="session")
def testbed(tmp_path_factory):
    tb = _TESTBED.start(tmp_path_factory, "testbed", gpu_nodes=4, cpu_nodes=1, process_nodes="none")
    try:
        yield tb
    finally:
        _TESTBED.stop()  # not stopped yet: the session ended inside the tier


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test of this tier: stop the testbed when no test of the tier follows."""
    result = yield
    _TESTBED.after_test(nextitem)
    return result


@pytest.fixture(scope="module")
def crds(testbed):
    """The EaaS CRDs applied to the testbed (once per module)."""
    apply_crds()


@pytest.fixture(scope="module")
def operator(crds, tmp_path_factory):
    """``eaas operator`` as a child process for the module's tests."""
    op = Operator(tmp_path_factory.mktemp("operator") / "operator.log")
    op.start()
    yield op
    op.stop()


@pytest.fixture
def ns(operator):
    """A fresh namespace per test, deleted (with everything in it) while the operator still runs."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    yield name
    kubectl("delete", "namespace", name, "--wait=false", check=False)
