"""The node agent's container init (``testbed/podinit.py``) run as the agent runs it: a real
process in its own mount namespace (needs CAP_SYS_ADMIN, as every process node does)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

from eaas.testbed import containers


def run_container(tmp_path: Path, mounts: list[dict], script: str) -> subprocess.CompletedProcess:
    spec = {
        "argv": ["/bin/sh", "-c", script],
        "env": {"PATH": "/usr/bin:/bin"},
        "cwd": "/",
        "mounts": mounts,
        "scratch": str(tmp_path / ".scratch"),
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return subprocess.run(
        [sys.executable, "-I", containers.PODINIT, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def volume(tmp_path: Path, name: str, files: dict[str, str]) -> str:
    d = tmp_path / name
    d.mkdir()
    for k, v in files.items():
        (d / k).write_text(v)
    return str(d)


def test_two_mounts_under_one_missing_folder_both_visible(tmp_path):
    """``/etc/<new>/x/one`` and ``/etc/<new>/x/two`` (a shared parent that does not exist on the
    host): both volumes are visible in the container, and the host's /etc is untouched. Before
    the fix the second mount overlaid ``/etc/<new>/x`` and hid the first."""
    base = f"/etc/eaas-podinit-{uuid.uuid4().hex[:8]}"
    one = volume(tmp_path, "one", {"token": "secret-one"})
    two = volume(tmp_path, "two", {"token": "secret-two"})
    r = run_container(
        tmp_path,
        [
            {"src": one, "dst": f"{base}/x/one", "ro": True},
            {"src": two, "dst": f"{base}/x/two", "ro": False},
        ],
        f"cat {base}/x/one/token; echo; cat {base}/x/two/token",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["secret-one", "secret-two"]
    assert not Path(base).exists()  # created inside an overlay, not on the host


def test_nested_volume_listed_first_is_not_hidden(tmp_path):
    """A volume mounted inside another one, listed before it: mounts are made parents first, so
    the inner volume stays visible (containerd sorts mounts the same way)."""
    base = f"/etc/eaas-podinit-{uuid.uuid4().hex[:8]}"
    outer = volume(tmp_path, "outer", {"index.html": "outer"})
    inner = volume(tmp_path, "inner", {"conf": "inner"})
    r = run_container(
        tmp_path,
        [
            {"src": inner, "dst": f"{base}/www/cfg", "ro": True},
            {"src": outer, "dst": f"{base}/www", "ro": False},
        ],
        f"cat {base}/www/index.html; echo; cat {base}/www/cfg/conf",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["outer", "inner"]
    assert not Path(base).exists()
