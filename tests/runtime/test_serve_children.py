"""``eaas serve``'s children (:mod:`eaas.runtime.serve.children`) as real processes: each leads a
process group of its own (a terminal's Ctrl-C reaches serve alone), and what a child started is
SIGKILLed with it, whether the child exited on its own or was stopped (vLLM's EngineCore outlived
``vllm serve`` stopped during start-up before this)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from eaas.runtime.serve import Child, Children

from helpers.e2e import alive

# A child that starts a grandchild (it stays in the child's process group), writes the
# grandchild's pid to argv[1], prints a ready line and then exits or sleeps (argv[2]).
_PARENT = """
import subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(g.pid))
print("expert-server x ready on test", flush=True)
if sys.argv[2] == "sleep":
    time.sleep(600)
"""


def _start(children: Children, tmp: Path, mode: str) -> tuple[Child, int]:
    pid_file = tmp / f"grandchild-{mode}"
    child = Child("expert-x", "expert-server", [sys.executable, "-c", _PARENT, str(pid_file), mode])
    children.spawn(child, dict(os.environ))
    deadline = time.monotonic() + 60
    while not (child.ready and pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline, "the child never became ready"
        children.pump(0.2)
    return child, int(pid_file.read_text())


def _wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


def test_a_child_leads_its_own_process_group(tmp_path):
    children = Children()
    child, grandchild = _start(children, tmp_path, "sleep")
    try:
        pid = child.popen.pid
        assert os.getpgid(pid) == pid != os.getpgrp()
        assert os.getpgid(grandchild) == pid  # what it starts is in its group
    finally:
        children.kill_all()
    assert _wait_gone(grandchild)


def test_stop_kills_what_a_running_child_started(tmp_path):
    children = Children()
    child, grandchild = _start(children, tmp_path, "sleep")
    children.stop(grace=30)
    assert child.popen.poll() is not None
    assert _wait_gone(grandchild), "the grandchild outlived the stop"


def test_an_exited_childs_leftovers_are_killed_with_its_group(tmp_path):
    children = Children()
    child, grandchild = _start(children, tmp_path, "exit")
    child.popen.wait(60)
    assert alive(grandchild)  # an orphan: this is what kill_group is for
    children.kill_group(child)
    assert _wait_gone(grandchild)
    children.stop(grace=5)
