"""Local Kubernetes testbed: real etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, plus kwok-simulated GPU/RDMA nodes, all on loopback.

Entry points: ``eaas testbed build|up|down|env`` (see :mod:`.cluster` and :mod:`.build`) and the
``testbed`` pytest fixture in ``tests/k8s/conftest.py``.
"""

from .binaries import BINARIES, BuildError, build, find_bin_dir
from .cluster import Testbed, TestbedError, default_state_dir, down, env_lines, load, up

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
    "up",
]
