"""Load generator: replay a ShareGPT-shaped workload at fixed concurrency against EaaS and a
single-process baseline in the same run, and report throughput, TTFT and ITL side by side.

Workload (ShareGPT-shaped, synthetic, deterministic from ``--seed``)
--------------------------------------------------------------------
Request lengths follow log-normal fits to the ShareGPT V3 conversations that vLLM's and the
EaaS paper's serving benchmarks replay (first user turn as prompt, first answer as output):

* prompt tokens ~ LogNormal(mu = ln 110, sigma = 1.0), clipped to [4, 1024]
  (median 110, mean ~180; long tail of pasted documents);
* output tokens ~ LogNormal(mu = ln 130, sigma = 0.9), clipped to [1, 768]
  (768 = the paper's output cap).

``--length-scale s`` multiplies both (after sampling, before clipping to >= 1) so a CPU run of the
tiny default model finishes in minutes; the distribution's shape is unchanged. Prompts are
random words drawn from a fixed list, so the token count is approximate (byte-level BPE). Every
request sets ``ignore_eos`` (a vLLM-compatible extension EaaS honours) so the output length is
the sampled one.

Metrics
-------
* output tokens/s: sum of completion tokens / wall time of the whole run;
* TTFT: request start -> first streamed token; ITL: gaps between streamed tokens;
  p50 and p99 of each over all requests.

Load client: ``aiohttp`` (:func:`load_session`), as vLLM's serving benchmark uses, not ``httpx``:
the load client shares the CPUs with the system it measures, and on a W2 run (96 requests at
concurrency 16, 2-core machine) ``httpx``'s streaming took 0.74-0.89 s of CPU against
aiohttp's 0.26-0.30 s (2026-11-30, docs/serving.md).

Usage::

    python bench/loadgen.py --requests 64 --concurrency 8 --length-scale 0.1

runs, one after the other on the same machine and workload: (a) ``eaas serve`` (disaggregated:
expert servers + attention client, shared-memory transport) and (b) ``eaas attention-client
--local-experts`` (the same model served in one process by transformers, no expert servers),
then prints a table with the ratios and writes ``bench/results/loadgen-<time>.json`` and a PNG.
``--url`` benchmarks an already running server instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = None

PROMPT_MU, PROMPT_SIGMA, PROMPT_MAX = math.log(110), 1.0, 1024
OUTPUT_MU, OUTPUT_SIGMA, OUTPUT_MAX = math.log(130), 0.9, 768

_WORDS = (
    "the expert server batches tokens from every attention client and returns weighted sums "
    "mixture of experts routing table replica failover gate top k shared expert decode prefill "
    "latency throughput kubernetes operator placement redundancy graph kernel memory network "
    "model layer hidden state token sequence cache request response stream queue scale"
).split()


@dataclass
class RequestSpec:
    prompt: str
    prompt_words: int
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    #: gaps between streamed chunks that carry a token (a choice), empty text included
    itls: list[float] = field(default_factory=list)
    #: gaps between chunks with non-empty text only (a byte-level BPE token that ends inside a
    #: UTF-8 character streams as an empty text delta: its gap merges into the next one here)
    text_itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    latency: float = 0.0
    error: str = ""


def make_workload(n: int, seed: int, length_scale: float, max_context: int) -> list[RequestSpec]:
    """Sample ``n`` requests; ``prompt_words + max_tokens`` stays under ``max_context`` tokens
    with a 2x margin for the word -> token expansion of the byte-level tokenizer."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = min(PROMPT_MAX, max(4, int(rng.lognormvariate(PROMPT_MU, PROMPT_SIGMA))))
        o = min(OUTPUT_MAX, max(1, int(rng.lognormvariate(OUTPUT_MU, OUTPUT_SIGMA))))
        p = max(1, int(p * length_scale))
        o = max(1, int(o * length_scale))
        p = min(p, max(1, (max_context - o) // 3))
        words = " ".join(rng.choice(_WORDS) for _ in range(p))
        out.append(RequestSpec(prompt=words, prompt_words=p, max_tokens=o))
    return out


def reword(specs: list[RequestSpec], seed: int) -> list[RequestSpec]:
    """The same requests (prompt and output lengths) with fresh prompt words drawn with
    ``seed``: another round of one workload that no prefix cache has seen."""
    rng = random.Random(seed)
    return [
        RequestSpec(
            prompt=" ".join(rng.choice(_WORDS) for _ in range(s.prompt_words)),
            prompt_words=s.prompt_words,
            max_tokens=s.max_tokens,
        )
        for s in specs
    ]


def require_bench_extra() -> None:
    """Exit with a clear message when the ``bench`` extra (matplotlib for the plots) is not
    installed, before any server is started."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            "the benchmarks need the bench extra (matplotlib for the plots): "
            "pip install -e '.[bench]'"
        ) from None


def load_session(concurrency: int) -> aiohttp.ClientSession:
    """The load client's HTTP session: up to ``concurrency + 4`` connections, 10 s to connect,
    600 s per request. Use as ``async with load_session(c) as session``."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=600.0, connect=10.0),
        connector=aiohttp.TCPConnector(limit=concurrency + 4),
    )


async def run_one(
    session: aiohttp.ClientSession, url: str, model: str, spec: RequestSpec
) -> RequestResult:
    """One streamed ``/v1/completions`` request; its TTFT, gaps and token count."""
    body = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    last = last_text = None
    res = RequestResult(ok=False)
    tokens = 0
    usage_tokens = None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return res
            async for raw in resp.content:  # one SSE line at a time
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                choices = chunk.get("choices") or []
                if not choices:  # the usage chunk
                    continue
                # every chunk with a choice is a token delivered (as vLLM's serving benchmark
                # counts them), also when its text is empty (held back bytes of a character)
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itls.append(now - last)
                last = now
                tokens += 1
                if choices[0].get("text"):
                    if last_text is not None:
                        res.text_itls.append(now - last_text)
                    last_text = now
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:  # ValueError: JSON
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.ok = True
    res.output_tokens = usage_tokens if usage_tokens is not None else tokens
    res.latency = time.perf_counter() - t0
    return res


async def run_load(
    url: str, model: str, workload: list[RequestSpec], concurrency: int, label: str
) -> dict:
    """One run of ``workload`` at ``concurrency``, summarized (:func:`summarize`)."""
    results, wall = await run_load_raw(url, model, workload, concurrency, label)
    return summarize(label, results, wall, concurrency)


async def run_load_raw(
    url: str, model: str, workload: list[RequestSpec], concurrency: int, label: str
) -> tuple[list[RequestResult], float]:
    """Stream ``workload`` at ``concurrency`` through :func:`run_one` (a tqdm bar labelled
    ``label``); returns the per-request results and the wall time (s)."""
    queue: asyncio.Queue[RequestSpec] = asyncio.Queue()
    for spec in workload:
        queue.put_nowait(spec)
    results: list[RequestResult] = []
    bar = tqdm(total=len(workload), desc=f"{label} (c={concurrency})", unit="req") if tqdm else None

    async def worker(session: aiohttp.ClientSession) -> None:
        while True:
            try:
                spec = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await run_one(session, url, model, spec))
            if bar:
                bar.update(1)

    t0 = time.perf_counter()
    async with load_session(concurrency) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    if bar:
        bar.close()
    return results, wall


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(math.ceil(q / 100.0 * len(xs))) - 1))
    return xs[k]


def summarize(label: str, results: list[RequestResult], wall: float, concurrency: int) -> dict:
    ok = [r for r in results if r.ok]
    itls = [x for r in ok for x in r.itls]
    text_itls = [x for r in ok for x in r.text_itls]
    ttfts = [r.ttft for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "label": label,
        "concurrency": concurrency,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall if wall > 0 else 0.0,
        "ttft_p50_ms": 1e3 * _pct(ttfts, 50),
        "ttft_p99_ms": 1e3 * _pct(ttfts, 99),
        "itl_p50_ms": 1e3 * _pct(itls, 50),
        "itl_p99_ms": 1e3 * _pct(itls, 99),
        "itl_mean_ms": 1e3 * statistics.fmean(itls) if itls else float("nan"),
        "text_itl_p50_ms": 1e3 * _pct(text_itls, 50),
        "text_itl_p99_ms": 1e3 * _pct(text_itls, 99),
        "ttfts": ttfts,
        "itls": itls,
    }


# ---- server lifecycle ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> str:
    """Poll GET /v1/models until it answers; return the served model id."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before becoming ready")
        try:
            r = httpx.get(f"{url}/v1/models", timeout=2.0)
            if r.status_code == 200:
                return r.json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_server(
    cmd: list[str], port: int, workload, concurrency: int, label: str, warmup: int
) -> dict:
    url = f"http://127.0.0.1:{port}"
    print(f"[{label}] $ {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        model = wait_ready(url, proc)
        if warmup:
            asyncio.run(
                run_load(url, model, workload[:warmup], min(concurrency, warmup), f"{label} warmup")
            )
        return asyncio.run(run_load(url, model, workload, concurrency, label))
    finally:
        stop(proc)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    labels = [r["label"] for r in results]
    axes[0].bar(
        labels,
        [r["output_tokens_per_s"] for r in results],
        color=["tab:blue", "tab:gray"][: len(results)],
    )
    axes[0].set_title("output tokens/s (higher is better)")
    for ax, key, title in ((axes[1], "ttfts", "TTFT CDF"), (axes[2], "itls", "ITL CDF")):
        for r in results:
            xs = sorted(1e3 * x for x in r[key])
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["label"])
        ax.set_xscale("log")
        ax.set_xlabel("ms")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"EaaS vs single-process baseline, concurrency {results[0]['concurrency']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument(
        "--length-scale", type=float, default=0.1, help="multiply sampled lengths (1.0 = ShareGPT)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2, help="requests sent before measuring")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: built-in tiny model)")
    ap.add_argument("--expert-servers", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--url", default=None, help="benchmark a running server only (no baseline)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    require_bench_extra()

    workload = make_workload(args.requests, args.seed, args.length_scale, args.max_context)
    print(
        f"workload: {len(workload)} requests, prompt words p50 {statistics.median(w.prompt_words for w in workload):.0f}, "
        f"max_tokens p50 {statistics.median(w.max_tokens for w in workload):.0f} "
        f"(sum {sum(w.max_tokens for w in workload)})",
        flush=True,
    )
    results = []
    if args.url:
        model = httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
        results.append(asyncio.run(run_load(args.url, model, workload, args.concurrency, "server")))
    else:
        eaas = [sys.executable, "-m", "eaas"]
        model_args = ["--model", args.model] if args.model else []
        port = free_port()
        results.append(
            run_server(
                eaas
                + [
                    "serve",
                    "--port",
                    str(port),
                    "--expert-servers",
                    str(args.expert_servers),
                    "--replicas",
                    str(args.replicas),
                    "--transport",
                    args.transport,
                ]
                + model_args,
                port,
                workload,
                args.concurrency,
                "eaas",
                args.warmup,
            )
        )
        port = free_port()
        results.append(
            run_server(
                eaas + ["attention-client", "--local-experts", "--port", str(port)] + model_args,
                port,
                workload,
                args.concurrency,
                "baseline",
                args.warmup,
            )
        )

    keys = [
        "output_tokens_per_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "failed",
    ]
    print()
    print(
        f"{'metric':<22}"
        + "".join(f"{r['label']:>14}" for r in results)
        + ("   ratio eaas/baseline" if len(results) == 2 else "")
    )
    for k in keys:
        row = f"{k:<22}" + "".join(f"{r[k]:>14.1f}" for r in results)
        if len(results) == 2 and results[1][k]:
            row += f"   {results[0][k] / results[1][k]:>8.2f}x"
        print(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    meta = {"args": vars(args), "results": results, "cpu_count": os.cpu_count()}
    (out / f"loadgen-{stamp}.json").write_text(json.dumps(meta, indent=1))
    png = out / f"loadgen-{stamp}.png"
    plot(results, png)
    print(f"\nwrote {out / f'loadgen-{stamp}.json'} and {png}")
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
