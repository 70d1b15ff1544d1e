"""Container init of the testbed's node agent: set up one container's view, then exec it.

Run by the agent as ``python -I podinit.py SPEC.json`` (stdlib only, no package import, so it
starts in tens of milliseconds). SPEC: ``{"argv": [...], "env": {...}, "cwd": str,
"mounts": [{"src": str, "dst": str, "ro": bool}], "scratch": str, "enter_pid": int | null}``.

1. ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the container dies with the agent thread that
   started it (the agent is the kubelet; a dead node takes its containers with it).
2. A private mount namespace (``unshare(CLONE_NEWNS)``, ``/`` made rprivate), so the pod's
   volumes appear at their ``mountPath`` for this process only, as in a real pod. A
   missing mount point is created inside an overlay of its nearest existing parent (upper
   layer on a tmpfs under ``scratch``), so the host's filesystem is untouched; a missing
   top-level folder (``/models``) cannot be overlaid without hiding ``/`` and is expected to
   have been created by the agent. Folders made inside an overlay that is already in place are
   simply created there (two mount points under one missing folder, e.g. ``/etc/eaas/a`` and
   ``/etc/eaas/b``, share the overlay of ``/etc``: a second overlay of ``/etc/eaas`` would hide
   the first mount, since overlayfs does not show the mounts under its lower folder). Mounts are
   made parents first (sorted by the depth of ``mountPath``, as containerd does), so a volume
   mounted inside another volume is not hidden by it. Read-only mounts are remounted ``ro``.
   With ``enter_pid`` (exec probes), the mount namespace of that container is joined instead.
3. ``chdir(cwd)`` and ``execvpe(argv[0], argv, env)``.

Needs CAP_SYS_ADMIN (the testbed runs as root); without it the agent reports the error in the
container's status.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None) -> None:
    _check(
        _libc.mount(
            src.encode() if src else None,
            dst.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {src} -> {dst}",
    )


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _ensure_target(
    dst: str, is_file: bool, scratch: str, overlaid: list[str], bound: list[str]
) -> None:
    """Create the mount point ``dst`` without touching the host: inside an overlay of its
    nearest existing parent, or directly when that parent already lies in one of our overlays
    (``overlaid``) and no bind mount (``bound``) lies between them."""
    if os.path.lexists(dst):
        return
    parent = os.path.dirname(dst)
    while parent != "/" and not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    parent = os.path.realpath(parent)
    writable = any(
        _inside(parent, o) and not any(_inside(b, o) and _inside(parent, b) for b in bound)
        for o in overlaid
    )
    if parent != "/" and not writable:
        if not overlaid:
            os.makedirs(scratch, exist_ok=True)
            _mount("tmpfs", scratch, "tmpfs", 0, "mode=0700")
        n = len(overlaid)
        upper, work = f"{scratch}/u{n}", f"{scratch}/w{n}"
        os.makedirs(upper)
        os.makedirs(work)
        _mount(
            "overlay", parent, "overlay", 0, f"lowerdir={parent},upperdir={upper},workdir={work}"
        )
        overlaid.append(parent)
    if is_file:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    else:
        os.makedirs(dst, exist_ok=True)


def main(spec_path: str) -> None:
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    with open(spec_path) as f:
        spec = json.load(f)
    if os.getppid() != spec.get("agent_pid", os.getppid()):
        sys.exit(137)  # the agent died before prctl took effect
    if spec.get("enter_pid"):
        fd = os.open(f"/proc/{spec['enter_pid']}/ns/mnt", os.O_RDONLY)
        _check(_libc.setns(fd, CLONE_NEWNS), "setns")
        os.close(fd)
    elif spec["mounts"]:
        _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
        overlaid: list[str] = []
        bound: list[str] = []
        mounts = sorted(spec["mounts"], key=lambda m: os.path.normpath(m["dst"]).count("/"))
        for m in mounts:
            src, dst = m["src"], os.path.normpath(m["dst"])
            _ensure_target(dst, os.path.isfile(src), spec["scratch"], overlaid, bound)
            _mount(src, dst, None, MS_BIND | MS_REC, None)
            bound.append(os.path.realpath(dst))
            if m.get("ro"):
                _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
    os.chdir(spec.get("cwd") or "/")
    argv = spec["argv"]
    try:
        os.execvpe(argv[0], argv, spec["env"])
    except OSError as e:
        print(f"testbed: cannot run {argv[0]!r}: {e}", file=sys.stderr, flush=True)
        sys.exit(127 if isinstance(e, FileNotFoundError) else 126)


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except OSError as e:
        print(f"testbed: container setup failed: {e}", file=sys.stderr, flush=True)
        sys.exit(128)
