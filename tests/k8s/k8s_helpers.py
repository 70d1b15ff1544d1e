"""Helpers shared by the tests that drive the testbed with ``kubectl`` (resolved via PATH and
KUBECONFIG, which the session fixture ``testbed`` points at the testbed)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest


def kubectl(
    *args: str, input: str | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """Run kubectl; with ``check``, a non-zero exit fails the test with kubectl's stderr."""
    r = subprocess.run(["kubectl", *args], input=input, capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {r.stderr}")
    return r


def get_json(*args: str) -> dict:
    return json.loads(kubectl("get", *args, "-o", "json").stdout)


def wait_for(what: str, fn, timeout: float = 60.0, interval: float = 0.2):
    """Poll ``fn`` until it returns a truthy value (returned); fail with ``what`` after ``timeout`` s."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        last = fn()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last: {str(last)[:2000]}")
