"""Local Kubernetes testbed (test infrastructure, not part of the operator or the runtime):
real etcd, kube-apiserver, kube-controller-manager, kube-scheduler on loopback, process nodes
whose node agent runs pods as local processes, and kwok-simulated nodes for scale.

Entry points: ``eaas testbed build|up|down|env|node`` (:mod:`.cli`, over :mod:`.cluster` and
:mod:`.binaries`), the node agent ``python -m eaas.testbed.agent`` (:mod:`.agent`), and the
``testbed`` pytest fixtures in ``tests/k8s/conftest.py`` and ``tests/cluster/conftest.py``.
"""

from .agents import node_start, node_stop
from .binaries import BINARIES, BuildError, build, find_bin_dir
from .cluster import down, up
from .record import Testbed, TestbedError, default_state_dir, env_lines, load

__all__ = [
    "BINARIES",
    "BuildError",
    "Testbed",
    "TestbedError",
    "build",
    "default_state_dir",
    "down",
    "env_lines",
    "find_bin_dir",
    "load",
    "node_start",
    "node_stop",
    "up",
]
