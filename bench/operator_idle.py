"""Operator CPU while idle with one large pool (target: well
under 1% of a core).

Starts a private kwok-node testbed (``--up``; pods turn Ready without running), adds kwok GPU
nodes for ``--servers`` GPUs, runs ``eaas operator`` (resync 2 s, the default), applies an
ExpertPool of ``--servers`` expert servers (the DeepSeek-V3 shape: 58 MoE layers x 256 experts,
redundancy 2) and waits until it is Ready. Then nothing changes for ``--idle-s`` seconds and the
operator's CPU time (utime + stime of the process, ``/proc/<pid>/stat``) over that window is the
idle cost, reported as CPU-seconds per minute and percent of one core.

With ``--profile`` the operator runs under cProfile for the run and the top functions by
cumulative time are printed (the profile covers start-up and the idle window both).

Usage::

    python bench/operator_idle.py --up [--servers 1024] [--idle-s 60] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from operator_ready import add_gpu_nodes, kubectl, load_example, pool_ready  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (s), threads included."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def print_collapsed(path: Path, top: int = 25) -> None:
    """The functions of py-spy's collapsed stacks (``-f raw``) with the most samples, inclusive
    (each function once per stack) and where the stacks end (self)."""
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n, frames = int(count), stack.split(";")
        total += n
        for f in set(frames):
            inclusive[f] = inclusive.get(f, 0) + n
        own[frames[-1]] = own.get(frames[-1], 0) + n
    for title, table in (("inclusive", inclusive), ("self", own)):
        print(f"py-spy, idle window, {total} samples, top by {title}:")
        for f, n in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {100 * n / max(total, 1):5.1f}%  {f}")


def run(
    servers: int,
    idle_s: float,
    profile: Path | None,
    log: Path | None = None,
    py_spy: Path | None = None,
    namespace: str = "bench-idle",
) -> int:
    kubectl("apply", "-f", str(ROOT / "deploy/crds"))
    kubectl("wait", "--for=condition=Established", "crd/expertpools.eaas.io", "--timeout=60s")
    nodes = add_gpu_nodes(-(-servers // 8), first_index=8)  # podCIDR 127.1.<i>: i <= 255
    print(f"added {len(nodes)} kwok GPU nodes ({len(nodes) * 8} GPUs)")
    cmd = [sys.executable]
    if profile is not None:
        cmd += ["-m", "cProfile", "-o", str(profile)]
    cmd += ["-m", "eaas.cli", "operator"]
    env = {**os.environ, "EAAS_OPERATOR_RESYNC_S": "2"}
    sink = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    op = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
    kubectl("create", "namespace", namespace, check=False)
    try:
        pool = load_example("deepseek-v3-pool.yaml")
        pool["metadata"]["name"] = "idle"
        pool["spec"]["replicas"] = servers
        pool["spec"]["model"].pop("persistentVolumeClaim", None)
        pool["spec"]["model"]["uri"] = "/models/DeepSeek-V3"  # baked into the image
        pool["spec"]["resources"] = {"requests": {"cpu": "1", "memory": "1Gi"}}
        t0 = time.monotonic()
        r = kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pool), check=False)
        if r.returncode != 0:
            raise RuntimeError(f"kubectl apply of the pool failed: {r.stderr}")
        while not pool_ready(namespace, "idle"):
            if op.poll() is not None:
                raise RuntimeError("the operator exited")
            if time.monotonic() - t0 > 900:
                raise TimeoutError("pool not Ready after 900 s")
            time.sleep(2)
        print(f"pool of {servers} servers Ready in {time.monotonic() - t0:.0f}s; settling 10 s")
        time.sleep(10)
        print(f"idle window from {time.strftime('%H:%M:%S')}", flush=True)
        c0, w0 = cpu_seconds(op.pid), time.monotonic()
        spy = None
        if py_spy is not None:  # samples the idle window, every thread (not in the CPU figure)
            spy = subprocess.Popen(
                [
                    str(Path(sys.executable).with_name("py-spy")),
                    "record",
                    "--nonblocking",
                    "-r",
                    "20",
                    "-d",
                    str(int(idle_s)),
                ]
                + ["-f", "raw", "-o", str(py_spy), "-p", str(op.pid)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        time.sleep(idle_s)
        c1, w1 = cpu_seconds(op.pid), time.monotonic()
        if spy is not None:
            spy.wait(timeout=60)
            print_collapsed(py_spy)
        share = (c1 - c0) / (w1 - w0)
        print(
            f"operator idle with one {servers}-server pool: {share * 60:.2f} CPU-s per minute "
            f"= {share * 100:.2f}% of one core (over {w1 - w0:.0f} s)"
        )
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        op.send_signal(2)  # SIGINT: cProfile writes its file
        try:
            op.wait(timeout=60)
        except subprocess.TimeoutExpired:
            op.kill()
    if profile is not None and profile.exists():
        import pstats

        pstats.Stats(str(profile)).sort_stats("cumulative").print_stats(40)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--servers", type=int, default=1024)
    ap.add_argument("--idle-s", type=float, default=60.0)
    ap.add_argument("--profile", action="store_true", help="run the operator under cProfile")
    ap.add_argument("--up", action="store_true", help="start a private kwok-node testbed")
    ap.add_argument("--log", type=Path, help="write the operator's log to this file")
    ap.add_argument(
        "--py-spy", type=Path, help="sample the idle window with py-spy into this file (raw)"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="eaas-idle-") as tmp:
        profile = Path(tmp) / "operator.prof" if args.profile else None
        if not args.up:
            return run(args.servers, args.idle_s, profile, args.log, args.py_spy)
        from eaas import testbed as tbmod

        tb = tbmod.up(state_dir=Path(tmp) / "state", process_nodes="none", attached=True)
        os.environ.update({k: tb.env()[k] for k in ("KUBECONFIG", "PATH")})
        try:
            return run(args.servers, args.idle_s, profile, args.log, args.py_spy)
        finally:
            tbmod.down(state_dir=tb.state_dir)


if __name__ == "__main__":
    raise SystemExit(main())
