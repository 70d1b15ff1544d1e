"""The process-node cluster of the fault benchmarks (``bench/cluster_failover.py``,
``bench/apiserver_stall.py``, ``bench/vllm_fleet.py``): the cluster tier's testbed shape with
a local operator, in one context manager."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eaas import testbed as tbmod

from helpers.common import free_port
from helpers.k8s import Operator, apply_crds


@contextlib.contextmanager
def process_cluster(
    work: Path, operator_env: dict[str, str] | None = None
) -> Iterator[tuple[Any, Operator]]:
    """A testbed under ``work / "state"`` with 4 GPU nodes and 1 CPU node, every node running
    its pods as local processes (restart back-off 1 s; the cluster tier's shape), ``KUBECONFIG``
    and ``PATH`` pointing at it in ``os.environ``, the CRDs applied, and ``eaas operator`` as a
    local process (log ``work / "operator.log"``) with its failure-report endpoint on a free
    loopback port; ``operator_env`` adds to the operator's environment.

    Yields ``(testbed, operator)``; at exit the operator is stopped and the testbed brought
    down (its state dir stays, inside ``work``).

    Raises:
        eaas.testbed.BuildError: no testbed binaries (run ``eaas testbed build``).
    """
    tb = tbmod.up(
        state_dir=work / "state",
        gpu_nodes=4,
        cpu_nodes=1,
        attached=True,
        process_nodes="all",
        restart_backoff_s=1.0,
        echo=print,
    )
    os.environ.update({k: tb.env()[k] for k in ("KUBECONFIG", "PATH")})
    op = None
    try:
        apply_crds()
        port = free_port()
        op = Operator(
            work / "operator.log",
            env={
                "EAAS_OPERATOR_REPORT_LISTEN": f"127.0.0.1:{port}",
                "EAAS_OPERATOR_REPORT_URL": f"http://127.0.0.1:{port}",
                **(operator_env or {}),
            },
        )
        op.start()
        yield tb, op
    finally:
        if op is not None:
            op.stop()
        tbmod.down(state_dir=tb.state_dir)
