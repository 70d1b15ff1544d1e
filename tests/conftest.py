"""Suite-wide settings: which tests share one pytest-xdist worker.

The README's test command runs the suite on two pytest-xdist workers (``-n 2`` in
pyproject.toml's ``addopts``): most tests wait on processes and control-plane state, not on the
CPU, so two workers cut the wall time on a 2-core machine. :class:`ModuleScheduling` decides who
runs what:

* the two control-plane tiers (``tests/k8s``: kube-apiserver + etcd + kwok; ``tests/cluster``:
  the testbed with process nodes) are ONE unit, run in collection order on one worker, exactly
  as without xdist: their session-scoped testbeds are started and stopped one after the other
  (the cluster tier stops its own after its last test), never two at once;
* every other module is a unit of its own: it runs whole on one worker, in its order, with its
  module-scoped fixtures (an ``eaas serve`` shared by a module's tests) set up once.

``pytest -n 0`` runs the whole suite in one process. (xdist's ``--dist loadgroup`` would express
this with ``xdist_group`` marks, but with pytest 9 the group suffix it adds to a test's node id
does not reach the scheduler, so the units are defined here instead.)
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

_CONTROL_PLANE = ("tests/k8s/", "tests/cluster/")


class ModuleScheduling(LoadScopeScheduling):
    """xdist's load-by-scope scheduler with the units above: ``"control-plane"`` for both
    control-plane tiers, the module's path for any other test (node ids are relative to the
    repository root, e.g. ``tests/e2e/test_push.py::test_version_1_in_use``)."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return "control-plane" if path.startswith(_CONTROL_PLANE) else path


def pytest_xdist_make_scheduler(config, log):
    return ModuleScheduling(config, log)
