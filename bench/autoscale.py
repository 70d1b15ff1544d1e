"""Autoscaling on expert load, end to end on the testbed with process nodes.

What runs: the testbed (real kube-apiserver with the aggregation layer, kube-controller-manager
with the real HPA controller, process nodes), the operator as a local process serving
``external.metrics.k8s.io``, one ExpertPool of the tiny model with ``spec.autoscaling``
(``placement.assignment: routing-table`` by default: survivors load experts by table and a
leaving server drains before its pod is deleted) and one AttentionFleet. Traffic (streaming
completions at a concurrency that changes per phase, requests from :mod:`bench.loadgen`'s
ShareGPT-shaped workload) drives the expert load; the HPA scales the pool.

Traces (``--trace``):

* ``diurnal`` (default): a day shape -- night trough, morning peak, midday dip, evening peak,
  night trough -- over ``--sim-minutes`` simulated minutes (default 32), one concurrency level
  per simulated minute between ``--trough`` and ``--peak``, replayed ``--compression`` times
  faster than real time (default 4: 32 simulated minutes in 8 minutes of wall time).
* ``ramp``: ``--ramp`` levels of ``--phase-s`` seconds each.

Reported (stdout, ``bench/results/autoscale-<time>.json``, and ``docs/bench-autoscale.png``):

* GPU-seconds used (existing server pods x ``gpusPerServer``, integrated over the run) against a
  pool fixed at the peak size for the same time (the paper reports up to 37.5 % saved), in wall
  and in simulated seconds;
* failed requests (goal 0);
* ITL p50/p99 overall, and the p99 within ``--event-window-s`` of each scale event (a change of
  ``spec.replicas``), per event and over all of them;
* a PNG: load (tokens/s) and concurrency, servers (spec / ready), ITL over time.

Usage::

    python bench/autoscale.py                       # diurnal, ~12 minutes in all
    python bench/autoscale.py --trace ramp --phase-s 40 --ramp 1,2,4,4,2,1,0

(the default tiny model on CPU). ``--target`` is the HPA's target load per server (tokens/s);
pick it from a first run's measured load so the trace crosses it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from loadgen import load_session, make_workload, run_one  # noqa: E402


def kubectl(tb, *args: str, input: str | None = None, check: bool = True) -> str:
    return tb.kubectl(*args, input=input, check=check).stdout


def get(tb, kind: str, name: str, ns: str) -> dict:
    out = tb.kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def wait(what: str, fn, timeout: float, interval: float = 1.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = fn()
        if got:
            return got
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(math.ceil(q / 100 * len(xs))) - 1))]


def start_operator(env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "eaas.cli", "operator"],
        stdout=open(log, "a"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
    )


async def drive(
    url: str, model: str, ramp: list[int], phase_s: float, seed: int, length_scale: float
) -> tuple[list[dict], list[tuple[float, int]]]:
    """Run the ramp; returns per-request records (absolute times) and (time, concurrency)."""
    t0 = time.time()
    end = t0 + phase_s * len(ramp)
    rng = random.Random(seed)
    workload = make_workload(4096, seed, length_scale, 512)
    records: list[dict] = []
    conc_log: list[tuple[float, int]] = []

    def concurrency_now() -> int:
        i = int((time.time() - t0) // phase_s)
        return ramp[i] if i < len(ramp) else 0

    async def worker(k: int, client) -> None:  # an aiohttp session (loadgen.load_session)
        while time.time() < end:
            if k >= concurrency_now():
                await asyncio.sleep(0.2)
                continue
            spec = workload[rng.randrange(len(workload))]
            start = time.time()
            res = await run_one(client, url, model, spec)
            token_times = []
            if res.ok:
                t = start + res.ttft
                token_times.append(t)
                for gap in res.itls:
                    t += gap
                    token_times.append(t)
            records.append(
                {
                    "start": start,
                    "end": time.time(),
                    "ok": res.ok,
                    "error": res.error,
                    "itls": res.itls,
                    "token_times": token_times,
                }
            )

    async def log_concurrency() -> None:
        while time.time() < end:
            conc_log.append((time.time(), concurrency_now()))
            await asyncio.sleep(1.0)

    async with load_session(max(ramp) or 1) as client:
        await asyncio.gather(log_concurrency(), *(worker(k, client) for k in range(max(ramp) or 1)))
    return records, conc_log


def diurnal_levels(minutes: int, trough: int, peak: int) -> list[int]:
    """One concurrency level per simulated minute of a day shape: trough at night (both ends),
    a morning peak (at 35 % of the day, ``peak``), a midday dip and an evening peak (at 75 %,
    90 % of ``peak``)."""
    out = []
    for m in range(minutes):
        x = (m + 0.5) / minutes
        shape = (
            math.exp(-(((x - 0.35) / 0.11) ** 2))
            + 0.9 * math.exp(-(((x - 0.75) / 0.1) ** 2))
            + 0.35 * math.exp(-(((x - 0.55) / 0.12) ** 2))
        )
        out.append(int(round(trough + (peak - trough) * min(1.0, shape))))
    return out


def plot(samples: list[dict], records: list[dict], conc: list[tuple[float, int]], path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = samples[0]["t"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    ts = [s["t"] - t0 for s in samples]
    axes[0].plot(ts, [s["load"] for s in samples], label="expert load (tokens/s, status.load)")
    ax2 = axes[0].twinx()
    ax2.step([c[0] - t0 for c in conc], [c[1] for c in conc], "k--", where="post", alpha=0.5)
    ax2.set_ylabel("concurrency (dashed)")
    axes[0].set_ylabel("tokens/s")
    axes[0].legend(loc="upper left")
    axes[1].step(ts, [s["spec"] for s in samples], where="post", label="spec.replicas (HPA)")
    axes[1].step(ts, [s["ready"] for s in samples], where="post", label="ready servers")
    axes[1].set_ylabel("expert servers")
    axes[1].legend(loc="upper left")
    pts = [
        (tt - t0, gap * 1000)
        for r in records
        for tt, gap in zip(r["token_times"][1:], r["itls"], strict=True)
    ]
    if pts:
        axes[2].scatter([p[0] for p in pts], [p[1] for p in pts], s=2, alpha=0.4)
    axes[2].set_ylabel("ITL (ms)")
    axes[2].set_xlabel("wall time (s)")
    fig.suptitle("EaaS autoscaling on expert load (testbed, process nodes, tiny model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", choices=("diurnal", "ramp"), default="diurnal")
    ap.add_argument("--sim-minutes", type=int, default=32, help="diurnal: simulated minutes")
    ap.add_argument("--compression", type=float, default=4.0, help="diurnal: time compression")
    ap.add_argument("--trough", type=int, default=1, help="diurnal: concurrency at night")
    ap.add_argument("--peak", type=int, default=6, help="diurnal: concurrency at the peak")
    ap.add_argument("--ramp", default="1,2,4,4,2,1,0", help="ramp: concurrency per phase")
    ap.add_argument("--phase-s", type=float, default=40.0, help="ramp: seconds per phase")
    ap.add_argument("--min", type=int, default=2, dest="min_replicas")
    ap.add_argument("--max", type=int, default=5, dest="max_replicas")
    ap.add_argument("--target", type=int, default=600, help="target tokens/s per server")
    ap.add_argument("--scale-down-s", type=int, default=15, help="scale-down stabilization (s)")
    ap.add_argument(
        "--assignment",
        choices=("routing-table", "command-line"),
        default="routing-table",
        help="the pool's placement.assignment",
    )
    ap.add_argument("--length-scale", type=float, default=0.1)
    ap.add_argument("--event-window-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--png", default=str(ROOT / "docs" / "bench-autoscale.png"))
    args = ap.parse_args(argv)
    if args.trace == "diurnal":
        if args.sim_minutes < 1 or args.compression <= 0 or not 0 <= args.trough <= args.peak:
            ap.error("--sim-minutes >= 1, --compression > 0 and 0 <= --trough <= --peak")
        ramp = diurnal_levels(args.sim_minutes, args.trough, args.peak)
        args.phase_s = 60.0 / args.compression
    else:
        ramp = [int(x) for x in args.ramp.split(",")]
    compression = args.compression if args.trace == "diurnal" else 1.0

    from eaas import testbed as tbmod
    from eaas.runtime.models.tiny import default_model_dir
    from eaas.testbed.metrics_api import register_external_metrics

    work = Path(tempfile.mkdtemp(prefix="eaas-autoscale-"))
    print(f"testbed in {work}")
    tb = tbmod.up(state_dir=work / "state", gpu_nodes=3, cpu_nodes=1, attached=True)
    op = None
    try:
        kubectl(tb, "apply", "-f", str(ROOT / "deploy" / "crds"))
        kubectl(tb, "wait", "--for=condition=Established", "crd/expertpools.eaas.io")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = register_external_metrics(tb, "127.0.0.1", port)
        env.update(
            KUBECONFIG=str(tb.kubeconfig),
            EAAS_OPERATOR_RESYNC_S="1",
            EAAS_OPERATOR_LOAD_SCRAPE_S="2",
            EAAS_OPERATOR_LOAD_WINDOW_S="10",
        )
        op = start_operator(env, work / "operator.log")
        model_dir = default_model_dir()
        model = {"hostPath": str(model_dir.parent), "uri": model_dir.name}
        ns = "bench"
        kubectl(tb, "create", "namespace", ns)
        pool = {
            "apiVersion": "eaas.io/v1alpha1",
            "kind": "ExpertPool",
            "metadata": {"name": "tiny", "namespace": ns},
            "spec": {
                "model": {**model, "firstMoeLayer": 1, "numMoeLayers": 3, "numExperts": 32},
                "replicas": args.min_replicas,
                "redundancy": 2,
                "placement": {"assignment": args.assignment},
                "autoscaling": {
                    "minReplicas": args.min_replicas,
                    "maxReplicas": args.max_replicas,
                    "targetLoadPerServer": args.target,
                    "scaleDownStabilizationSeconds": args.scale_down_s,
                },
            },
        }
        fleet = {
            "apiVersion": "eaas.io/v1alpha1",
            "kind": "AttentionFleet",
            "metadata": {"name": "clients", "namespace": ns},
            "spec": {"expertPoolRef": {"name": "tiny"}, "replicas": 1, "model": model},
        }
        for obj in (pool, fleet):
            kubectl(tb, "apply", "-f", "-", input=json.dumps(obj))
        print("waiting for the fleet to serve ...")
        wait(
            "fleet acknowledged",
            lambda: (
                (get(tb, "attentionfleet", "clients", ns).get("status") or {}).get(
                    "clientsAcknowledged"
                )
                == 1
            ),
            600,
        )
        pods = json.loads(
            kubectl(tb, "get", "pods", "-n", ns, "-l", "eaas.io/fleet=clients", "-o", "json")
        )["items"]
        ip = next(p["status"]["podIP"] for p in pods if p["status"].get("podIP"))
        url = f"http://{ip}:8000"
        model_id = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]

        samples: list[dict] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                p = get(tb, "expertpool", "tiny", ns)
                st = p.get("status") or {}
                samples.append(
                    {
                        "t": time.time(),
                        "spec": (p.get("spec") or {}).get("replicas", 0),
                        "existing": st.get("replicas", 0),
                        "ready": st.get("readyReplicas", 0),
                        "load": (st.get("load") or {}).get("totalTokensPerSecond", 0.0),
                    }
                )
                done.wait(1.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        print(f"ramp {ramp} x {args.phase_s:.0f}s against {url}")
        records, conc = asyncio.run(
            drive(url, model_id, ramp, args.phase_s, args.seed, args.length_scale)
        )
        done.set()
        sampler.join()
    finally:
        if op is not None:
            op.terminate()
            op.wait(timeout=30)
        tbmod.down(state_dir=work / "state")

    # ---- figures ------------------------------------------------------------------------------
    t_start, t_end = samples[0]["t"], samples[-1]["t"]
    used = sum(
        a["existing"] * (b["t"] - a["t"]) for a, b in zip(samples[:-1], samples[1:], strict=True)
    )
    peak = max(s["spec"] for s in samples)
    fixed = peak * (t_end - t_start)
    events = [
        b["t"] for a, b in zip(samples[:-1], samples[1:], strict=True) if a["spec"] != b["spec"]
    ]
    all_itl = [g for r in records for g in r["itls"]]
    near = [
        g
        for r in records
        for tt, g in zip(r["token_times"][1:], r["itls"], strict=True)
        if any(abs(tt - e) <= args.event_window_s for e in events)
    ]
    per_event = []
    for e in events:
        gaps = [
            g
            for r in records
            for tt, g in zip(r["token_times"][1:], r["itls"], strict=True)
            if abs(tt - e) <= args.event_window_s
        ]
        spec_after = next(s["spec"] for s in samples if s["t"] >= e)
        per_event.append(
            {
                "t_s": round(e - t_start, 1),
                "t_sim_min": round((e - t_start) * compression / 60, 1),
                "replicas": spec_after,
                "itl_p99_ms": round(pct(gaps, 99) * 1000, 2) if gaps else None,
                "tokens": len(gaps),
            }
        )
    failed = [r for r in records if not r["ok"]]
    gpus = 1  # gpusPerServer of the bench's pool (the CRD default)
    result = {
        "trace": args.trace,
        "levels": ramp,
        "phase_s": args.phase_s,
        "compression": compression,
        "simulated_minutes": round((t_end - t_start) * compression / 60, 1),
        "assignment": args.assignment,
        "target_tokens_per_s_per_server": args.target,
        "requests": len(records),
        "failed_requests": len(failed),
        "failures": [r["error"] for r in failed][:10],
        "gpu_seconds_used": round(used * gpus, 1),
        "gpu_seconds_fixed_at_peak": round(fixed * gpus, 1),
        "simulated_gpu_seconds_used": round(used * gpus * compression, 1),
        "simulated_gpu_seconds_fixed_at_peak": round(fixed * gpus * compression, 1),
        "saved_fraction": round(1 - used / fixed, 4) if fixed else 0.0,
        "peak_servers": peak,
        "scale_events": len(events),
        "replicas_timeline": [
            (round(b["t"] - t_start, 1), b["spec"])
            for a, b in zip(samples[:-1], samples[1:], strict=True)
            if a["spec"] != b["spec"]
        ],
        "itl_p50_ms": round(pct(all_itl, 50) * 1000, 2),
        "itl_p99_ms": round(pct(all_itl, 99) * 1000, 2),
        "itl_p99_near_scale_events_ms": round(pct(near, 99) * 1000, 2) if near else None,
        "scale_event_itl": per_event,
        "max_load_tokens_per_s": max(s["load"] for s in samples),
    }
    print(json.dumps(result, indent=2))
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out_dir / f"autoscale-{stamp}.json").write_text(
        json.dumps({**result, "samples": samples, "concurrency": conc}, indent=1)
    )
    plot(samples, records, conc, Path(args.png))
    print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
