"""Operator cost at scale: CPU-seconds of the operator process and wall time per phase, for pools
of 256, 1,024 and 4,096 expert servers on kwok nodes (pods turn Ready without running).

Per size, on a fresh private testbed (``--up``) with kwok GPU nodes of 32 GPUs each, ``eaas
operator`` (resync 2 s, idle resync 120 s: the defaults) and an ExpertPool of the DeepSeek-V3
shape (58 MoE layers x 256 experts, redundancy 2, ``load-balanced``):

1. ``apply -> Ready``: ``kubectl apply`` until ``status`` is Ready with every server.
2. ``idle``: nothing changes for ``--idle-s`` seconds, ``--idle-runs`` times (after a 15 s
   settle): CPU-seconds per minute and percent of one core.
3. ``kill``: one server pod deleted at once (grace 0). The bench watches the pod and the
   routing-table ConfigMap itself and reports the time from the pod's ``DELETED`` event to the
   first table without it (``table_s``: "leaves the table"), then until the replacement is
   Ready and back in a table of every server (the phase's wall time).
4. ``scale -> 64`` and ``scale 64 -> N``: ``spec.replicas`` patched, until Ready again.

CPU is utime + stime of the operator process (``/proc/<pid>/stat``), threads included. The
operator's work counters (``GET /metrics``: reconcile steps, pod LISTs, table writes, API calls,
watch events; :mod:`eaas.operator.counters`) are read around each phase.

Usage::

    python bench/operator_scale.py --up [--sizes 256,1024,4096] [--idle-s 60] [--idle-runs 2]
        [--json out.json] [--png docs/measurements/operator-scale.png]
    python bench/operator_scale.py --render a.json,b.json --png docs/measurements/operator-scale.png
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from operator_idle import cpu_seconds  # noqa: E402
from operator_ready import kubectl, load_example  # noqa: E402

GPUS_PER_NODE = 32
SMALL = 64
POOL = "scale"
PHASES = ("ready", "idle", "kill", "scale")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_nodes(core: Any, count: int) -> None:
    """``count`` kwok GPU/RDMA nodes of :data:`GPUS_PER_NODE` GPUs, waited Ready."""
    from eaas.testbed.nodes import GPU_ALLOCATABLE, GPU_LABELS, KWOK_ANNOTATION, PROCESS_LABEL

    alloc = {**GPU_ALLOCATABLE, "nvidia.com/gpu": str(GPUS_PER_NODE), "rdma/ib": str(GPUS_PER_NODE)}
    for i in range(count):
        idx = 8 + i  # podCIDR 127.1.<idx>.0/24; the testbed's own nodes use the first ones
        name = f"scale-gpu-node-{idx}"
        core.create_node(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                    "labels": {
                        "kubernetes.io/hostname": name,
                        "type": "kwok",
                        PROCESS_LABEL: "kwok",
                        **GPU_LABELS,
                    },
                },
                "spec": {"podCIDR": f"127.1.{idx}.0/24", "podCIDRs": [f"127.1.{idx}.0/24"]},
                "status": {"allocatable": alloc, "capacity": alloc},
            }
        )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        nodes = core.list_node(label_selector="type=kwok").items
        ready = [
            n
            for n in nodes
            if n.metadata.name.startswith("scale-")
            and any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
        ]
        if len(ready) >= count:
            return
        time.sleep(1)
    raise RuntimeError(f"{count} kwok GPU nodes not Ready after 300 s")


def counters(port: int) -> dict[str, int]:
    """The operator's work counters: name (labels summed, API calls split by resource)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("#") or "_total" not in line:
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0].removeprefix("eaas_operator_").removesuffix("_total")
        if name == "api_calls" and 'resource="' in name_labels:
            resource = name_labels.split('resource="', 1)[1].split('"', 1)[0]
            name = f"api_calls[{resource}]"
        if name == "load_scrapes" and 'result="' in name_labels:
            result = name_labels.split('result="', 1)[1].split('"', 1)[0]
            name = f"load_scrapes[{result}]"
        out[name] = out.get(name, 0) + int(float(value))
    return out


def delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {
        k: b.get(k, 0) - a.get(k, 0) for k in sorted(set(a) | set(b)) if b.get(k, 0) != a.get(k, 0)
    }


class Phase:
    """Operator CPU-seconds, wall seconds and counter deltas of one phase."""

    def __init__(self, op: subprocess.Popen, port: int) -> None:
        self.op, self.port = op, port

    def __enter__(self) -> Phase:
        self.c0, self.w0, self.k0 = cpu_seconds(self.op.pid), time.monotonic(), counters(self.port)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cpu_s = cpu_seconds(self.op.pid) - self.c0
        self.wall_s = time.monotonic() - self.w0
        self.work = delta(self.k0, counters(self.port))
        self.load = os.getloadavg()[0]  # the machine's 1-minute load average at the phase's end

    def row(self) -> dict[str, Any]:
        """The phase as a result row: CPU-s, wall s, work counters, load average."""
        return {"cpu_s": self.cpu_s, "wall_s": self.wall_s, "work": self.work, "load": self.load}


def ready(custom: Any, namespace: str, replicas: int) -> bool:
    from kubernetes.client.rest import ApiException

    try:
        pool = custom.get_namespaced_custom_object(
            "eaas.io", "v1alpha1", namespace, "expertpools", POOL
        )
    except ApiException:
        return False
    st = pool.get("status") or {}
    return (
        any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", []))
        and st.get("readyReplicas") == replicas
        and st.get("replicas") == replicas  # a scale-down is done: no server beyond them left
        and st.get("observedGeneration") == pool["metadata"]["generation"]
        and pool["spec"]["replicas"] == replicas
    )


def wait(what: str, fn: Any, op: subprocess.Popen, timeout: float = 1800.0) -> None:
    t0 = time.monotonic()
    while not fn():
        if op.poll() is not None:
            raise RuntimeError("the operator exited")
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: not after {timeout:.0f} s")
        time.sleep(0.5)


def table_servers(core: Any, namespace: str) -> set[str]:
    from eaas.runtime.tables.table import RoutingTable

    cm = core.read_namespaced_config_map(f"{POOL}-routing-table", namespace)
    return set(RoutingTable.from_json(cm.data["routing-table.json"]).servers)


def raw_watch(list_fn: Any, namespace: str, name: str, on_event: Any) -> None:
    """Watch object ``name`` with ``list_fn`` (a kubernetes-client list method) from its current
    resourceVersion, without the client's model deserialization: ``on_event(arrival monotonic
    time, event dict)`` per event line; stops when it returns True or after 120 s."""
    first = list_fn(namespace, field_selector=f"metadata.name={name}", _preload_content=False)
    rv = json.loads(first.data)["metadata"]["resourceVersion"]
    resp = list_fn(
        namespace,
        field_selector=f"metadata.name={name}",
        resource_version=rv,
        watch=True,
        timeout_seconds=120,
        _preload_content=False,
    )
    buf = b""
    try:
        for chunk in resp.stream(1 << 16):
            at = time.monotonic()
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip() and on_event(at, json.loads(line)):
                    return
    finally:
        resp.release_conn()


def kill_one(core: Any, custom: Any, namespace: str, servers: int, op: Any, port: int) -> dict:
    """Delete one server pod (grace 0); the table latency from the bench's own watches (each
    event timestamped when its bytes arrive)."""
    from eaas.runtime.tables.table import RoutingTable

    victim = f"{POOL}-{servers // 2}"
    seen: dict[str, float] = {}

    def on_pod(at: float, ev: dict) -> bool:
        if ev["type"] == "DELETED":
            seen.setdefault("deleted", at)
            return True
        return False

    def on_table(at: float, ev: dict) -> bool:
        data = ev["object"].get("data") or {}
        if "routing-table.json" in data:
            if victim not in RoutingTable.from_json(data["routing-table.json"]).servers:
                seen.setdefault("left", at)
                return True
        return False

    def watch_pod() -> None:
        raw_watch(core.list_namespaced_pod, namespace, victim, on_pod)

    def watch_table() -> None:
        raw_watch(core.list_namespaced_config_map, namespace, f"{POOL}-routing-table", on_table)

    threads = [threading.Thread(target=f, daemon=True) for f in (watch_pod, watch_table)]
    for t in threads:
        t.start()
    time.sleep(2)  # both watches open
    with Phase(op, port) as phase:
        t_call = time.monotonic()
        core.delete_namespaced_pod(victim, namespace, grace_period_seconds=0)
        wait("the killed server out of the table", lambda: "left" in seen, op, timeout=120)
        left = Phase(op, port)
        left.cpu_s = cpu_seconds(op.pid) - phase.c0
        wait(
            "a replacement Ready and in the table",
            lambda: ready(custom, namespace, servers) and victim in table_servers(core, namespace),
            op,
            timeout=600,
        )
    return {
        "cpu_s": phase.cpu_s,
        "wall_s": phase.wall_s,
        "table_s": seen["left"] - seen.get("deleted", t_call),
        "table_from_call_s": seen["left"] - t_call,
        "cpu_to_table_s": left.cpu_s,
        "work": phase.work,
        "load": phase.load,
    }


def run_size(
    servers: int,
    idle_s: float,
    idle_runs: int,
    log: Path | None,
    policy: str = "load-balanced",
    phases: tuple[str, ...] = PHASES,
) -> dict:
    from kubernetes import client as k8s
    from kubernetes import config as k8s_config

    k8s_config.load_kube_config(config_file=os.environ["KUBECONFIG"])
    core, custom = k8s.CoreV1Api(), k8s.CustomObjectsApi()
    kubectl("apply", "-f", str(ROOT / "deploy/crds"))
    kubectl("wait", "--for=condition=Established", "crd/expertpools.eaas.io", "--timeout=60s")
    add_nodes(core, -(-servers // GPUS_PER_NODE))
    port = free_port()
    env = {
        **os.environ,
        "EAAS_OPERATOR_RESYNC_S": "2",
        "EAAS_OPERATOR_REPORT_LISTEN": f"127.0.0.1:{port}",
    }
    sink = open(log, "a") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    op = subprocess.Popen(
        [sys.executable, "-m", "eaas.cli", "operator"],
        stdout=sink,
        stderr=subprocess.STDOUT,
        env=env,
    )
    namespace = "bench-scale"
    kubectl("create", "namespace", namespace, check=False)
    result: dict[str, Any] = {"servers": servers}
    try:
        wait("the operator's /metrics", lambda: _serves(port), op, timeout=120)
        pool = load_example("deepseek-v3-pool.yaml")
        pool["metadata"]["name"] = POOL
        pool["spec"]["replicas"] = servers
        pool["spec"]["model"].pop("persistentVolumeClaim", None)
        pool["spec"]["model"]["uri"] = "/models/DeepSeek-V3"
        pool["spec"]["resources"] = {"requests": {"cpu": "1", "memory": "1Gi"}}
        pool["spec"]["placement"]["policy"] = policy
        result["policy"] = policy
        with Phase(op, port) as p:
            kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pool))
            wait("apply -> Ready", lambda: ready(custom, namespace, servers), op)
        result["ready"] = p.row()
        print(f"[{servers}] apply -> Ready {p.wall_s:.1f} s, {p.cpu_s:.1f} CPU-s", flush=True)
        time.sleep(15)
        result["idle"] = []
        for _ in range(idle_runs if "idle" in phases else 0):
            with Phase(op, port) as p:
                time.sleep(idle_s)
            share = p.cpu_s / p.wall_s
            result["idle"].append({**p.row(), "share": share})
            print(
                f"[{servers}] idle {share * 100:.2f}% of a core over {p.wall_s:.0f} s {p.work}",
                flush=True,
            )
        if "kill" in phases:
            result["kill"] = kill_one(core, custom, namespace, servers, op, port)
            k = result["kill"]
            print(
                f"[{servers}] kill: out of the table {k['table_s'] * 1000:.0f} ms after DELETED, "
                f"back {k['wall_s']:.1f} s, {k['cpu_s']:.2f} CPU-s {k['work']}",
                flush=True,
            )
        for name, replicas in ((f"scale -> {SMALL}", SMALL), (f"scale {SMALL} ->", servers)):
            if "scale" not in phases:
                break
            with Phase(op, port) as p:
                custom.patch_namespaced_custom_object(
                    "eaas.io",
                    "v1alpha1",
                    namespace,
                    "expertpools",
                    POOL,
                    {"spec": {"replicas": replicas}},
                )
                wait(name, lambda r=replicas: ready(custom, namespace, r), op)
            result[name] = p.row()
            print(f"[{servers}] {name}: {p.wall_s:.1f} s, {p.cpu_s:.1f} CPU-s {p.work}", flush=True)
    finally:
        op.send_signal(2)
        try:
            op.wait(timeout=60)
        except subprocess.TimeoutExpired:
            op.kill()
    return result


def _serves(port: int) -> bool:
    try:
        counters(port)
        return True
    except OSError:
        return False


def markdown(results: list[dict]) -> str:
    """The results as a Markdown table (work: reconcile steps / pod LISTs / table writes)."""

    def work(phase: dict) -> str:
        w = phase.get("work") or {}
        return (
            f"{w.get('reconcile_steps', 0)} / {w.get('pod_lists', 0)} / {w.get('table_writes', 0)}"
        )

    def skipped(phase: dict) -> str:
        n = (phase.get("work") or {}).get("idle_steps_skipped", 0)
        return f", {n} idle step{'s' * (n != 1)} skipped" if n else ""

    def load(phase: dict) -> str:
        return f"{phase['load']:.1f}" if "load" in phase else ""

    rows = [
        "| servers | phase | wall s | operator CPU-s | steps / LISTs / table writes | load avg "
        "| note |",
        "|---:|---|---:|---:|---|---:|---|",
    ]
    for r in results:
        n = f"{r['servers']} ({r.get('policy', 'load-balanced')})"
        ready = r["ready"]
        rows.append(
            f"| {n} | apply -> Ready | {ready['wall_s']:.1f} | {ready['cpu_s']:.1f} | {work(ready)} | "
            f"{load(ready)} | |"
        )
        for i, idle in enumerate(r["idle"]):
            rows.append(
                f"| {n} | idle run {i + 1} | {idle['wall_s']:.0f} | {idle['cpu_s']:.2f} | "
                f"{work(idle)} | {load(idle)} | {idle['share'] * 100:.2f}% of a core"
                f"{skipped(idle)} |"
            )
        k = r.get("kill")
        if k is not None:
            rows.append(
                f"| {n} | one server killed | {k['wall_s']:.1f} | {k['cpu_s']:.2f} | {work(k)} | "
                f"{load(k)} | out of the table {k['table_s'] * 1000:.0f} ms after DELETED "
                f"({k['cpu_to_table_s']:.2f} CPU-s"
                f"{', dropped before the step' if (k.get('work') or {}).get('table_drops') else ''}) |"
            )
        for name, label in (
            (f"scale -> {SMALL}", f"scale N -> {SMALL}"),
            (f"scale {SMALL} ->", f"scale {SMALL} -> N"),
        ):
            ph = r.get(name)
            if ph is None:
                continue
            rows.append(
                f"| {n} | {label} | {ph['wall_s']:.1f} | {ph['cpu_s']:.1f} | {work(ph)} | {load(ph)} | |"
            )
    return "\n".join(rows)


def plot(results: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ["ready", "kill", f"scale -> {SMALL}", f"scale {SMALL} ->"]
    labels = ["apply->Ready", "kill one", f"N->{SMALL}", f"{SMALL}->N"]
    sizes = [r["servers"] for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=80)
    width = 0.8 / len(phases)
    for i, (ph, lab) in enumerate(zip(phases, labels, strict=True)):
        a.bar(
            [x + i * width for x in range(len(sizes))],
            [r[ph]["cpu_s"] if ph in r else float("nan") for r in results],
            width,
            label=lab,
        )
    a.set_xticks([x + 0.4 - width / 2 for x in range(len(sizes))], [str(s) for s in sizes])
    a.set_xlabel("servers")
    a.set_ylabel("operator CPU-s")
    a.set_yscale("log")
    a.legend(fontsize=8)
    a.set_title("per phase")
    for j in range(max(len(r["idle"]) for r in results)):
        have = [r for r in results if len(r["idle"]) > j]
        b.plot(
            [r["servers"] for r in have],
            [r["idle"][j]["share"] * 100 for r in have],
            "o-",
            label=f"idle run {j + 1}",
        )
    b.axhline(1.0, color="grey", ls="--", lw=1, label="1% of a core")
    b.set_xscale("log", base=2)
    b.set_xlabel("servers")
    b.set_ylabel("% of one core")
    b.set_ylim(0, max([1.2] + [i["share"] * 115 for r in results for i in r["idle"]]))
    b.legend(fontsize=8)
    b.set_title("idle")
    fig.tight_layout()
    fig.savefig(png)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="256,1024,4096")
    ap.add_argument("--idle-s", type=float, default=60.0)
    ap.add_argument("--idle-runs", type=int, default=2)
    ap.add_argument("--up", action="store_true", help="a fresh private kwok-node testbed per size")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--png", type=Path, help="plot the results here")
    ap.add_argument("--log", type=Path, help="append the operator's log to this file")
    ap.add_argument("--policy", default="load-balanced", help="the pool's placement policy")
    ap.add_argument(
        "--phases", default=",".join(PHASES), help="of ready,idle,kill,scale (ready always)"
    )
    ap.add_argument(
        "--render",
        help="no run: the table (and --png) of these result files (comma-separated), merged by "
        "pool size (a phase from the first file that has it)",
    )
    args = ap.parse_args()
    if args.render:
        merged: dict[int, dict] = {}
        for f in args.render.split(","):
            for r in json.loads(Path(f).read_text()):
                held = merged.setdefault(r["servers"], {"idle": []})
                for key, value in r.items():
                    if key not in held or (key == "idle" and not held["idle"]):
                        held[key] = value
        rendered = [merged[n] for n in sorted(merged)]
        print(markdown(rendered))
        if args.png:
            plot(rendered, args.png)
        return 0
    results = []
    phases = tuple(args.phases.split(","))
    for servers in [int(s) for s in args.sizes.split(",")]:
        if not args.up:
            results.append(
                run_size(servers, args.idle_s, args.idle_runs, args.log, args.policy, phases)
            )
            continue
        from eaas import testbed as tbmod

        with tempfile.TemporaryDirectory(prefix="eaas-scale-") as tmp:
            tb = tbmod.up(state_dir=Path(tmp) / "state", process_nodes="none", attached=True)
            os.environ.update({k: tb.env()[k] for k in ("KUBECONFIG", "PATH")})
            try:
                results.append(
                    run_size(servers, args.idle_s, args.idle_runs, args.log, args.policy, phases)
                )
            finally:
                tbmod.down(state_dir=tb.state_dir)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    print(markdown(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.png:
        plot(results, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
