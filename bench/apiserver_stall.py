"""Fail static on the testbed: a control-plane outage never becomes a data-plane outage.

Starts a private testbed (4 GPU + 1 CPU process nodes), ``eaas operator`` (failure reports on
loopback), and per run a fresh namespace with the tiny pool (4 expert servers, redundancy 2)
and a fleet of 2 attention clients; 16 concurrent greedy streams (official ``openai`` client)
run through client A the whole time. Then:

* **API-server stall** (``--runs`` times in each assignment mode, ``command-line`` and
  ``routing-table``): SIGSTOP of kube-apiserver for ``--stall-s`` (45), SIGKILL of one expert
  server's container ``--kill-at-s`` (10) into it, SIGCONT. Right after the resume the
  node-lifecycle controller marks every node NotReady (their heartbeats are older than its
  grace period) and flips every pod to Ready=False; the operator must hold the table
  (fail static), drop the killed server only, and never publish a version with an uncovered
  expert;
* **heartbeat loss** (``--heartbeat-loss N`` runs per mode): SIGSTOP of every GPU node's agent
  until the node-lifecycle controller has marked every node NotReady (and every server pod
  Ready=False), SIGKILL of one server 3 s in, SIGCONT: the operator's probe keeps the three
  live servers in the table and confirms the killed one;
* **frozen node agent** (once per mode with ``--frozen-agent``): SIGSTOP of the victim's node
  agent, SIGKILL of its server: the API keeps showing the pod Ready; the clients' failure
  reports, confirmed by the operator's probe, take it out of the table.

Per run: failed requests (must be 0), versions with an uncovered expert (must be none), live
servers some version dropped (must be none), and when the killed server left the table (from
the resume; heartbeat loss and frozen agent: from the kill). Every completed request is checked against
transformers' greedy reference. Exit status 1 when any run breaks a rule.

Usage::

    python bench/apiserver_stall.py [--runs 5] [--modes command-line,routing-table]
        [--stall-s 45] [--kill-at-s 10] [--heartbeat-loss N] [--frozen-agent] [--no-stall]
        [--json FILE]

Needs root (process nodes) and the testbed binaries (``eaas testbed build``). About 3 minutes
per stall run on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from helpers.bench_cluster import process_cluster  # noqa: E402
from helpers.faults import StreamLoad, apply_tiny_pool_and_fleet, serving_table  # noqa: E402
from helpers.k8s import client_pods, kubectl, wait_for  # noqa: E402
from helpers.stall import (  # noqa: E402
    FaultResult,
    apiserver_stall,
    frozen_agent,
    heartbeat_loss,
)

TEXTS = [
    "The expert server hosts a set of experts and",
    "Kubernetes schedules pods on nodes",
    "A routing table maps every logical expert",
    "Hello world",
]
MAX_TOKENS = 24
CPU_NODE = "cpu-node-0"


def one_run(tb, mode: str, i: int, kind: str, args, prompts, references) -> dict:
    """One fault in a fresh namespace under 16 streams; returns its row."""
    import openai

    ns = f"stall-{mode[:3]}-{kind[:3]}-{i}"
    kubectl("create", "namespace", ns)
    try:
        apply_tiny_pool_and_fleet(
            ns,
            servers=4,
            clients=2,
            pool_spec={"placement": {"assignment": mode}},
            fleet_spec={"nodeSelector": {"kubernetes.io/hostname": CPU_NODE}},
        )
        wait_for(
            "pool and fleet serving",
            lambda: serving_table(ns, "tiny", "clients", 4, 2),
            timeout=300,
            interval=1,
        )
        a_ip = client_pods(ns, "clients")[0]["status"]["podIP"]
        api = openai.OpenAI(base_url=f"http://{a_ip}:8000/v1", api_key="unused")
        model_id = api.models.list().data[0].id
        load = StreamLoad(f"http://{a_ip}:8000/v1", model_id, prompts, MAX_TOKENS).start()
        try:
            time.sleep(5)
            if kind == "heartbeat":
                agents = {n: tb.agents[n] for n in tb.agents if n != CPU_NODE}
                r = heartbeat_loss(ns, "tiny", "clients", agents)
            elif kind == "stall":
                r: FaultResult = apiserver_stall(
                    ns, "tiny", "clients", tb.pids["kube-apiserver"], args.stall_s, args.kill_at_s
                )
            else:
                from helpers.k8s import server_pods

                pods = server_pods(ns, "tiny")
                victim = sorted(pods)[1]
                agent = tb.agents[pods[victim]["spec"]["nodeName"]]
                r = frozen_agent(ns, "tiny", "clients", agent, victim)
            time.sleep(3)
        finally:
            requests = load.stop()
        bad = load.wrong(references)
        row = {
            "mode": mode,
            "fault": r.kind,
            "run": i,
            "requests": len(requests),
            "failed": len(bad),
            "out_after_s": r.out_after_s,
            "versions": [(v.version, len(v.servers), v.uncovered) for v in r.versions],
            "uncovered_versions": r.uncovered,
            "dropped_live": sorted(r.dropped_live),
            "examples": bad[:3],
        }
        out = "never (restarted first)" if r.out_after_s is None else f"{r.out_after_s:.2f} s"
        print(
            f"{mode:13s} {r.kind:15s} run {i}: {len(requests)} requests, {len(bad)} failed; "
            f"victim out after {out}; versions {row['versions']}; uncovered {r.uncovered}; "
            f"live dropped {row['dropped_live']}",
            flush=True,
        )
        return row
    finally:
        kubectl("delete", "namespace", ns, "--wait=false", check=False)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=5, help="stall runs per mode (default 5)")
    ap.add_argument("--modes", default="command-line,routing-table")
    ap.add_argument("--stall-s", type=float, default=45.0)
    ap.add_argument("--kill-at-s", type=float, default=10.0)
    ap.add_argument("--frozen-agent", action="store_true", help="also one frozen-agent run/mode")
    ap.add_argument(
        "--heartbeat-loss", type=int, default=0, help="heartbeat-loss runs per mode (default 0)"
    )
    ap.add_argument("--no-stall", action="store_true", help="skip the API-server stall runs")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here too")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from eaas.runtime.models.reference import reference_generate
    from eaas.runtime.models.tiny import default_model_dir

    model_dir = default_model_dir()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    references = reference_generate(str(model_dir), prompts, MAX_TOKENS)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="eaas-stall-", dir=ROOT / ".cache") as tmp:
        try:
            with process_cluster(
                Path(tmp), operator_env={"EAAS_OPERATOR_LEASE_DURATION_S": "15"}
            ) as (tb, _op):
                for mode in args.modes.split(","):
                    kinds = (
                        ([] if args.no_stall else ["stall"] * args.runs)
                        + ["heartbeat"] * args.heartbeat_loss
                        + (["frozen"] if args.frozen_agent else [])
                    )
                    for i, kind in enumerate(kinds):
                        rows.append(one_run(tb, mode, i, kind, args, prompts, references))
        finally:  # the operator's log, kept for post-mortems
            log = Path(tmp) / "operator.log"
            if log.exists():
                (ROOT / ".cache" / "apiserver_stall_operator.log").write_bytes(log.read_bytes())
    print(
        "\n| mode | fault | runs | failed requests | uncovered versions | live dropped | "
        "victim out after (s): median / max |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        for fault in ("apiserver-stall", "heartbeat-loss", "frozen-agent"):
            rs = [r for r in rows if r["mode"] == mode and r["fault"] == fault]
            if not rs:
                continue
            outs = [r["out_after_s"] for r in rs if r["out_after_s"] is not None]
            stat = f"{statistics.median(outs):.2f} / {max(outs):.2f}" if outs else "-"
            never = sum(r["out_after_s"] is None for r in rs)
            print(
                f"| {mode} | {fault} | {len(rs)} | {sum(r['failed'] for r in rs)} of "
                f"{sum(r['requests'] for r in rs)} | {sum(len(r['uncovered_versions']) for r in rs)} "
                f"| {sum(len(r['dropped_live']) for r in rs)} | {stat}"
                + (f" ({never} restarted before leaving)" if never else "")
                + " |"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    ok = all(
        not r["failed"] and not r["uncovered_versions"] and not r["dropped_live"] for r in rows
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
