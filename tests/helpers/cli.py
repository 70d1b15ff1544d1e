"""Run several ``eaas`` command lines side by side (each its own interpreter), for tests of
start-up errors: most of each run is importing torch, so the cases overlap instead of queueing."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence


def run_eaas_all(argvs: Sequence[Sequence[str]], timeout: float = 240) -> list[tuple[int, str]]:
    """``[(exit code, stdout + stderr with whitespace collapsed)]``, one per argv, in order.

    Raises:
        subprocess.TimeoutExpired: a run outlived ``timeout`` seconds (all runs are killed).
    """
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "eaas", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for argv in argvs
    ]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
        return [(p.returncode, " ".join(out.split())) for p, out in zip(procs, outs, strict=True)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
