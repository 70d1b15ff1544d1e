"""Pod networks of parallel testbeds (``testbed/cluster.py``): each live testbed claims its own
second octet of 127.<net>.<node>.<n>, so two test runs on one machine never hand out the same
pod IP (they did: an expert server of one run held 127.1.0.2:9000 and the other run's server
on the same IP crash-looped with EADDRINUSE)."""

from __future__ import annotations

import subprocess
import sys

from eaas.testbed import cluster as C
from eaas.testbed.pod_net import pod_net_dir


def test_claims_are_distinct_and_released(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    na = C.claim_pod_net(a)
    nb = C.claim_pod_net(b)
    try:
        assert na != nb and 1 <= na <= 254 and 1 <= nb <= 254
        assert C.claim_pod_net(a) == na  # the same state dir keeps its net
    finally:
        for state, net in ((a, na), (b, nb)):
            C.release_pod_net(C.Testbed(state, tmp_path, tmp_path, "", pod_net=net))
    assert not (pod_net_dir() / str(na)).exists()


def test_a_dead_claimer_frees_its_net(tmp_path):
    """A claim whose process exited and whose testbed is not running is taken over."""
    code = (
        "import sys; from pathlib import Path; from eaas.testbed import cluster as C; "
        f"print(C.claim_pod_net(Path({str(tmp_path / 'gone')!r})))"
    )
    net = int(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
    )
    mine = C.claim_pod_net(tmp_path / "mine")
    try:
        assert mine == net  # the dead claim is free again (the lowest free net wins)
    finally:
        C.release_pod_net(C.Testbed(tmp_path / "mine", tmp_path, tmp_path, "", pod_net=mine))
