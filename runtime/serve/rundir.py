"""The run directory of one ``eaas serve`` (Unix sockets, routing table, metrics files) and
the removal of the ones SIGKILLed serve processes left behind.

A run directory (``<tmp>/eaas-serve-*``) holds an owner file with its serve's pid and start
time; a later serve removes the directories whose owner is gone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

RUN_DIR_PREFIX = "eaas-serve-"
OWNER_FILE = "owner"  # in a run dir: "<pid> <start time in clock ticks since boot>" of its serve


def proc_start_ticks(pid: int) -> int | None:
    """The process's start time (``/proc/PID/stat`` field 22, clock ticks since boot), or None
    when it cannot be read (no such process, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may itself hold spaces or ')'
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def _owner_alive(pid: int, start_ticks: int | None) -> bool:
    """Whether the process that wrote an owner file still runs: ``pid`` exists and, when both
    are known, has the recorded start time (a reused pid is another process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    now = proc_start_ticks(pid)
    return start_ticks is None or now is None or now == start_ticks


def stale_run_dirs(tmp: Path) -> list[Path]:
    """Run directories (``<tmp>/eaas-serve-*``) of ``eaas serve`` processes that are gone (a
    SIGKILLed serve cannot remove its own): those whose owner file names a dead process.

    A directory without a readable owner file is never listed (a serve between creating its
    directory and writing the file, or one of another tool); neither is another user's.
    """
    stale = []
    for d in sorted(tmp.glob(f"{RUN_DIR_PREFIX}*")):
        try:
            if not d.is_dir() or d.is_symlink() or d.stat().st_uid != os.getuid():
                continue
            fields = (d / OWNER_FILE).read_text().split()
            pid, ticks = int(fields[0]), (int(fields[1]) if len(fields) > 1 else None)
        except (OSError, ValueError, IndexError):
            continue
        if not _owner_alive(pid, ticks):
            stale.append(d)
    return stale


def remove_stale_run_dirs(tmp: Path | None = None) -> list[Path]:
    """Remove :func:`stale_run_dirs` of ``tmp`` (default: ``tempfile.gettempdir()``); returns
    the removed directories."""
    removed = []
    for d in stale_run_dirs(Path(tmp or tempfile.gettempdir())):
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            removed.append(d)
    return removed


def create_run_dir() -> Path:
    """A fresh run directory under ``tempfile.gettempdir()`` with this process's owner file
    (pid, start time) and an empty ``metrics/`` folder."""
    run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))
    pid = os.getpid()
    (run_dir / OWNER_FILE).write_text(f"{pid} {proc_start_ticks(pid) or ''}".strip() + "\n")
    (run_dir / "metrics").mkdir()
    return run_dir
