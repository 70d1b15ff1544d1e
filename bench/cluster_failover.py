"""Failover on the testbed with process nodes: how fast a fault reaches the clients, and what it
costs the token stream.

Starts a private testbed (4 GPU + 1 CPU process nodes, one per expert server, ``eaas.testbed``), ``eaas operator``, the
tiny pool (4 expert servers, redundancy 2, on the GPU nodes) and a fleet of 2 attention clients
(on the CPU node); 16 concurrent streaming completions (greedy, official ``openai`` client)
run through client A the whole time. Then, one at a time, each waiting for full recovery (all 4
servers Ready in a table every client applied):

* ``--kills`` times: SIGKILL of one expert-server container process (victims in turn);
* once: ``kubectl delete pod`` of one expert server (the replacement has a new IP);
* once: ``eaas testbed node stop`` of a GPU node (its servers die with it; NotReady after the
  node monitor grace period), ``node start`` once the table no longer holds its servers.

Measured per fault (wall clock, ms precision: the clients' log lines carry ``asctime``):

* **death -> first client failover**: the first ``marked down`` line of a client for a victim;
* **death -> new table version written**: a watch on the routing-table ConfigMap;
* **death -> all clients acknowledged**: the last client's ``routing table version N in use``
  line for that version.

And the throughput timeline: tokens per 100 ms (all 16 streams) over the run, as a PNG with
each fault marked (and a 1 s rolling mean); the dip of a fault is the mean rate over the 2 s
after it against the mean rate over the 10 s before it (its steady state). The noise floor is
the spread (standard deviation / mean) of 2 s window means in the 10 s before the first fault:
a dip below it cannot be told apart from the machine's own jitter.

Every completed request is checked against transformers' greedy reference; a wrong or failed
request is reported (and makes the exit status 1).

Usage::

    python bench/cluster_failover.py [--kills 5] [--png docs/cluster_failover.png]

Needs root (process nodes) and the testbed binaries (``eaas testbed build``). About 4 minutes
on a 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the testbed helpers are the tests' (tests/helpers)
sys.path.insert(0, str(ROOT / "tests"))

from helpers.bench_cluster import process_cluster  # noqa: E402
from helpers.faults import (  # noqa: E402
    StreamLoad,
    apply_tiny_pool_and_fleet,
    container_pid,
    serving_table,
)
from helpers.k8s import (  # noqa: E402
    client_pods,
    kubectl,
    routing_table,
    server_pods,
    wait_for,
)

TEXTS = [
    "The expert server hosts a set of experts and",
    "Kubernetes schedules pods on nodes",
    "A routing table maps every logical expert",
    "Hello world",
]
MAX_TOKENS = 24
CPU_NODE = "cpu-node-0"
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


class Cluster:
    """The namespace with the pool (``tiny``, 4 servers) and the fleet (``clients``, 2)."""

    def __init__(self, ns: str, state_dir: Path) -> None:
        self.ns, self.state_dir = ns, state_dir

    def servers(self) -> dict[str, dict]:
        return server_pods(self.ns, "tiny")

    def clients(self) -> list[dict]:
        return client_pods(self.ns, "clients")

    def table(self) -> tuple[int, dict[str, str]]:
        """(version, servers) of the routing-table ConfigMap; (0, {}) before there is one."""
        t = routing_table(self.ns, "tiny")
        return (t.version, dict(t.servers)) if t is not None else (0, {})

    def steady(self) -> int | None:
        """The table version when all 4 servers are Ready in it and both clients applied it."""
        t = serving_table(self.ns, "tiny", "clients", 4, 2)
        return t.version if t is not None else None

    def client_logs(self) -> list[Path]:
        return sorted((self.state_dir / "nodes").glob(f"{CPU_NODE}/pods/{self.ns}_clients-*/*.log"))


class TableWatch:
    """Wall time at which each routing-table version appeared (a watch on the ConfigMap)."""

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from kubernetes import client, config, watch

        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # read now, not at import
        core = client.CoreV1Api()
        while not self._stop.is_set():
            w = watch.Watch()
            try:
                for ev in w.stream(
                    core.list_namespaced_config_map,
                    self.ns,
                    field_selector="metadata.name=tiny-routing-table",
                    timeout_seconds=5,
                ):
                    ann = ev["object"].metadata.annotations or {}
                    v = int(ann.get("eaas.io/routing-table-version", "0") or 0)
                    self.seen.setdefault(v, time.time())
                    if self._stop.is_set():
                        break
            except Exception:
                time.sleep(0.2)

    def start(self) -> TableWatch:
        self._t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._t.join(timeout=10)


def log_times(paths: list[Path], pattern: re.Pattern) -> list[tuple[float, re.Match, str]]:
    """(wall time, match, pod folder) of each client log line matching ``pattern``."""
    out = []
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            m, ts = pattern.search(line), LOG_TIME.match(line)
            if m and ts:
                t = dt.datetime.strptime(ts.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                out.append((t, m, path.parent.name))
    return out


def measure_fault(
    c: Cluster, watch: TableWatch, kind: str, victims: list[str], t_fault: float
) -> dict[str, float]:
    """Times (s) from ``t_fault`` (wall) to the first failover, the first table without the
    victims and the last client's apply of that table."""
    logs = c.client_logs()
    down = [
        t
        for t, m, _ in log_times(logs, re.compile(r"expert server (\S+) \(\S+\) marked down"))
        if t >= t_fault - 0.01 and m.group(1) in victims
    ]
    version = min((v for v, t in watch.seen.items() if t >= t_fault), default=None)
    applied: dict[str, float] = {}
    if version is not None:
        pat = re.compile(rf"routing table version {version} in use")
        for t, _, pod in log_times(logs, pat):
            applied.setdefault(pod, t)
    return {
        "kind": kind,
        "failover_s": (min(down) - t_fault) if down else float("nan"),
        "table_s": (watch.seen[version] - t_fault) if version is not None else float("nan"),
        "acked_s": (max(applied.values()) - t_fault) if len(applied) >= 2 else float("nan"),
    }


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def throughput(load: StreamLoad, t0: float, t1: float, bin_s: float = 0.1) -> list[int]:
    """Tokens per ``bin_s`` bin (all streams) between monotonic times t0 and t1."""
    bins = [0] * max(1, int((t1 - t0) / bin_s))
    for r in list(load.requests):
        for t in list(r.times):
            i = int((t - t0) / bin_s)
            if 0 <= i < len(bins):
                bins[i] += 1
    return bins


def plot(bins: list[int], faults: list[tuple[float, str]], steady: float, path: Path) -> None:
    """Tokens per 100 ms, their 1 s rolling mean, the steady state and the faults, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [i * 0.1 for i in range(len(bins))]
    rolling = [statistics.mean(bins[max(0, i - 9) : i + 1]) for i in range(len(bins))]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    ax.plot(xs, bins, lw=0.5, color="tab:blue", alpha=0.45, label="tokens per 100 ms")
    ax.plot(xs, rolling, lw=1.4, color="tab:blue", label="1 s rolling mean")
    ax.axhline(steady, color="gray", ls="--", lw=0.8, label=f"steady state {steady:.1f}")
    top = max(bins) * 1.05 + 1
    for t, label in faults:
        ax.axvline(t, color="tab:red", lw=0.9)
        ax.text(t + 0.4, top * 0.98, label, rotation=90, va="top", ha="left", fontsize=7)
    ax.set_xlabel("time since the load started (s)")
    ax.set_ylabel("tokens / 100 ms (16 streams)")
    ax.set_title(
        "Throughput across faults (testbed: tiny pool, 4 expert servers, redundancy 2)", pad=10
    )
    ax.set_ylim(0, top)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--kills", type=int, default=5, help="SIGKILL runs (default 5)")
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "cluster_failover.png")
    ap.add_argument("--json", type=Path, default=None, help="write the numbers here too")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from eaas.runtime.models.reference import reference_generate
    from eaas.runtime.models.tiny import default_model_dir

    model_dir = default_model_dir()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    references = reference_generate(str(model_dir), prompts, MAX_TOKENS)

    with tempfile.TemporaryDirectory(prefix="eaas-failover-") as tmp:
        with process_cluster(Path(tmp)) as (tb, _op):
            return run(tb, args, prompts, references, model_dir)


def run(tb, args, prompts, references, model_dir) -> int:
    from eaas import testbed as tbmod

    ns = "failover"
    kubectl("create", "namespace", ns)
    apply_tiny_pool_and_fleet(
        ns, servers=4, clients=2, fleet_spec={"nodeSelector": {"kubernetes.io/hostname": CPU_NODE}}
    )
    c = Cluster(ns, tb.state_dir)
    t_setup = time.monotonic()
    wait_for("pool and fleet serving", c.steady, timeout=300, interval=1)
    print(f"pool + fleet serving and acknowledged in {time.monotonic() - t_setup:.1f}s")
    a_ip = c.clients()[0]["status"]["podIP"]
    import openai

    model_id = (
        openai.OpenAI(base_url=f"http://{a_ip}:8000/v1", api_key="unused").models.list().data[0].id
    )
    watch = TableWatch(ns).start()
    load = StreamLoad(f"http://{a_ip}:8000/v1", model_id, prompts, MAX_TOKENS).start()
    t_load = time.monotonic()
    results: list[dict] = []
    marks: list[tuple[float, str]] = []  # (monotonic, label)
    try:
        time.sleep(12)  # steady state before the first fault
        for i in range(args.kills + 2):
            wait_for("steady state", c.steady, timeout=240, interval=0.3)
            time.sleep(3)  # let the throughput settle
            pods = c.servers()
            names = sorted(pods)
            if i < args.kills:
                kind, victim = "SIGKILL server", names[i % len(names)]
                victims = [victim]
                t_mono, t_wall = time.monotonic(), time.time()
                os.kill(container_pid(pods[victim], "expert-server"), signal.SIGKILL)
            elif i == args.kills:
                kind, victim = "delete pod", names[1]
                victims = [victim]
                t_mono, t_wall = time.monotonic(), time.time()
                kubectl("delete", "pod", victim, "-n", ns, "--wait=false")
            else:
                node = pods[names[0]]["spec"]["nodeName"]
                kind = f"node stop {node}"
                victims = [n for n, p in pods.items() if p["spec"]["nodeName"] == node]
                t_mono, t_wall = time.monotonic(), time.time()
                tbmod.node_stop(node, tb.state_dir)
                wait_for(
                    "table without the node's servers",
                    lambda victims=victims: not set(victims) & set(c.table()[1]),
                    timeout=120,
                )
                tbmod.node_start(node, tb.state_dir)
            marks.append((t_mono - t_load, kind))
            wait_for("recovery", c.steady, timeout=300, interval=0.3)
            m = measure_fault(c, watch, kind, victims, t_wall)
            results.append(m)
            print(
                f"{kind:28s} failover {m['failover_s'] * 1e3:7.0f} ms  table "
                f"{m['table_s'] * 1e3:7.0f} ms  all acked {m['acked_s'] * 1e3:7.0f} ms"
            )
        time.sleep(5)
    finally:
        requests = load.stop()
        watch.stop()
    t_end = max((r.finished for r in requests), default=time.monotonic())
    bins = throughput(load, t_load, t_end)
    first = int(marks[0][0] / 0.1) if marks else len(bins)
    steady_bins = bins[max(0, first - 100) : first]
    steady = statistics.mean(steady_bins) if steady_bins else float("nan")
    windows = [statistics.mean(steady_bins[k : k + 20]) for k in range(0, len(steady_bins), 20)]
    noise = statistics.pstdev(windows) / steady if len(windows) > 1 and steady else float("nan")
    dips = []
    for t, kind in marks:
        i = int(t / 0.1)
        before, after = bins[max(0, i - 100) : i], bins[i : i + 20]
        base = statistics.mean(before) if before else steady
        dips.append((kind, 1 - statistics.mean(after) / base if after and base else float("nan")))
    plot(bins, marks, steady, args.png)

    kills = [r for r in results if r["kind"] == "SIGKILL server"]
    print("\n| fault | death -> first failover | -> new table written | -> all clients acked |")
    print("|---|---|---|---|")
    for label, rows in (("SIGKILL server (p50)", kills),):
        for q in (50, 99):
            print(
                f"| SIGKILL server p{q} (n={len(rows)}) | "
                f"{percentile([r['failover_s'] for r in rows], q) * 1e3:.0f} ms | "
                f"{percentile([r['table_s'] for r in rows], q) * 1e3:.0f} ms | "
                f"{percentile([r['acked_s'] for r in rows], q) * 1e3:.0f} ms |"
            )
        del label
    for r in results[len(kills) :]:
        print(
            f"| {r['kind']} | {r['failover_s'] * 1e3:.0f} ms | {r['table_s'] * 1e3:.0f} ms | "
            f"{r['acked_s'] * 1e3:.0f} ms |"
        )
    print(
        f"\nsteady state {steady * 10:.0f} tokens/s ({steady:.1f} per 100 ms); noise floor of "
        f"a 2 s window: +-{noise * 100:.1f}%"
    )
    for kind, d in dips:
        print(f"dip over the 2 s after {kind}: {d * 100:+.1f}% (vs. the 10 s before it)")
    kill_dips = [d for k, d in dips if k == "SIGKILL server"]
    if kill_dips:
        print(f"SIGKILL server: mean dip {statistics.mean(kill_dips) * 100:+.1f}%")
    bad = load.wrong(references)
    print(
        f"{len(requests)} requests, {sum(1 for r in requests if r.finished and not r.error)} "
        f"completed, {len(bad)} wrong or failed; plot: {args.png}"
    )
    for b in bad[:5]:
        print("  ", b)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"faults": results, "steady_per_100ms": steady, "noise": noise, "dips": dips},
                indent=1,
            )
        )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
