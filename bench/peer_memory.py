"""bench/peer.py's process measurements: the process tree of a system, PSS of each process
(``Pss`` of ``/proc/PID/smaps_rollup``), a PSS sampler thread, CPU time of a tree and the wait
until idle systems are quiet."""

from __future__ import annotations

import os
import threading
import time

# ---- memory ----------------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    return kids


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (pids alive now)."""
    kids = _children()
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def pss_kib(pid: int) -> int | None:
    """PSS of ``pid`` in KiB from ``/proc/PID/smaps_rollup``; ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def proc_name(pid: int) -> str:
    """A short label: the eaas role / vLLM process title / executable name."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    if any(a.endswith("/vllm") for a in argv[:2]) and "serve" in argv:
        return "vllm serve (API server)"
    if "multiprocessing.resource_tracker" in " ".join(argv):
        return "multiprocessing resource tracker"
    for role in ("expert-server", "attention-client", "serve", "monitor"):
        if role in argv:
            i = argv.index(role)
            extra = ""
            if role == "expert-server" and "--server-id" in argv:
                extra = " " + argv[argv.index("--server-id") + 1]
            if role == "attention-client" and "--local-experts" in argv[i:]:
                extra = " (local experts)"
            return role + extra
    return os.path.basename(argv[0])[:40] + (" " + argv[1][:40] if len(argv) > 1 else "")


def pss_snapshot(root: int) -> dict[int, tuple[str, int]]:
    """``{pid: (name, PSS KiB)}`` over the process tree of ``root``."""
    snap = {}
    for pid in process_tree(root):
        kib = pss_kib(pid)
        if kib is not None:
            snap[pid] = (proc_name(pid), kib)
    return snap


class PssSampler:
    """Samples the PSS of a process tree every ``interval`` s on a thread; keeps the snapshot
    with the largest total."""

    def __init__(self, root: int, interval: float):
        self.root, self.interval = root, interval
        self.peak: dict[int, tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            snap = pss_snapshot(self.root)
            if sum(v[1] for v in snap.values()) > sum(v[1] for v in self.peak.values()):
                self.peak = snap
            self._stop.wait(self.interval)

    def __enter__(self) -> PssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _by_name(snap: dict[int, tuple[str, int]]) -> list[tuple[str, float]]:
    """``[(name, MiB)]`` sorted by name (pid order within a name)."""
    return [
        (name, kib / 1024)
        for _pid, (name, kib) in sorted(snap.items(), key=lambda kv: (kv[1][0], kv[0]))
    ]


def tree_cpu_s(root: int) -> float:
    """CPU time (user + system, s) used so far by the live processes of ``root``'s tree."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def wait_quiet(roots: list[int], window: float, timeout: float) -> tuple[float, bool]:
    """Wait until the process trees of ``roots`` together use under 5% of one CPU over a
    ``window``-second window (a server that polls for a while after its load ended, as vLLM's
    engine does, has stopped), at most ``timeout`` s. Returns ``(seconds waited, quiet)``."""
    t0 = time.monotonic()
    if not roots:
        return 0.0, True
    last = sum(tree_cpu_s(r) for r in roots)
    while True:
        time.sleep(window)
        now = sum(tree_cpu_s(r) for r in roots)
        if now - last < 0.05 * window:
            return time.monotonic() - t0, True
        if time.monotonic() - t0 >= timeout:
            return time.monotonic() - t0, False
        last = now
