"""Fixtures for the ``cluster`` tier: the testbed with *process nodes*, whose node agents run
pods as local processes (``eaas.testbed.agent``).

``cluster`` brings up etcd, kube-apiserver, kube-controller-manager (node monitor grace 20 s),
kube-scheduler and kwok in a private temp state dir, with 4 GPU/RDMA nodes (one per expert
server of the fault scenario, so powering off one node leaves every expert a replica) and 1 CPU
node, all process nodes; crash-loop back-off base 1 s (upstream: 10 s) so restarts show within
seconds. ``KUBECONFIG`` and ``PATH`` point at it while the tier runs.

One testbed serves the whole tier (starting one takes 10-20 s on a 2-core machine): the
fixture is session-scoped, and :func:`pytest_runtest_teardown` stops it right after the tier's
last test (:class:`helpers.tier.TierTestbed`). The kwok-only ``testbed`` of ``tests/k8s`` may run
beside it on the other pytest-xdist worker (its own state dir, ports and pod network). Each module
works in its own namespaces and starts (and stops) its own operator. Everything it started,
containers included, dies with the test process (PR_SET_PDEATHSIG); a process left after
teardown fails the test (:func:`helpers.k8s.running_testbed`, shared with ``tests/k8s``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.tier import TierTestbed

_TESTBED = TierTestbed(Path(__file__).parent)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    tb = _TESTBED.start(
        tmp_path_factory,
        "cluster",
        gpu_nodes=4,
        cpu_nodes=1,
        process_nodes="all",
        restart_backoff_s=1.0,
    )
    try:
        yield tb
    finally:
        _TESTBED.stop()  # not stopped yet: the session ended inside the tier (-x, -k, interrupt)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test of this tier (hooks of this conftest run only for its items): once the
    module-scoped fixtures are torn down, stop the testbed when no test of the tier follows."""
    result = yield
    _TESTBED.after_test(nextitem)
    return result
