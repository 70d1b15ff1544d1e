"""Double-batch overlap on vs off: decode throughput of the engine with its routed experts on real
expert-server processes (unix shm transport), side by side.

Starts ``--servers`` ``eaas expert-server`` processes hosting the model's experts (placement R=1),
loads the attention model with ``RemoteExperts`` (fp32, ``--threads`` intra-op threads), then
alternates ``--rounds`` times: one engine with ``double_batch_overlap=False`` and one with
``True``, each generating ``--max-tokens`` greedy tokens for ``--batch`` prompts submitted
together. Prints decode tokens/s of each (median over rounds), the ratio on/off, and whether the
greedy tokens were identical. Default: the built-in tiny DeepSeek-V3 model.

Usage::

    python bench/overlap_bench.py --batch 8 --max-tokens 32 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch


def _run(eng, prompts, max_tokens: int) -> tuple[list[list[int]], float]:
    from eaas.runtime.client.engine import ErrorEvent, SamplingParams

    done = [threading.Event() for _ in prompts]
    errors: list = []

    def cb(i):
        def f(ev):
            if isinstance(ev, ErrorEvent):
                errors.append(ev.error)
            if isinstance(ev, ErrorEvent) or ev.finish_reason is not None:
                done[i].set()

        return f

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [eng.submit(p, params, cb(i)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    eng.start()
    for d in done:
        if not d.wait(600):
            raise TimeoutError("generation did not finish in 600 s")
    dt = time.perf_counter() - t0
    eng.stop()
    if errors:
        raise errors[0]
    return [r.output_ids for r in reqs], dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: built-in tiny model)")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from transformers import AutoTokenizer

    from eaas.runtime.client.dispatch import Dispatcher
    from eaas.runtime.client.engine import Engine
    from eaas.runtime.client.moe import experts_factory
    from eaas.runtime.models.arch import read_model_info
    from eaas.runtime.models.attention import load_attention_model
    from eaas.runtime.models.tiny import default_model_dir
    from eaas.runtime.placement import place_experts
    from eaas.runtime.tables.expert_spec import format_expert_spec
    from eaas.runtime.tables.table import RoutingTable

    model_dir = a.model or str(default_model_dir())
    info = read_model_info(model_dir)
    tmp = Path(tempfile.mkdtemp(prefix="eaas-dbo-bench-"))
    placement = place_experts(info.moe_layers, info.num_experts, a.servers, 1)
    ids = [f"s{i}" for i in range(a.servers)]
    eps = [f"unix:{tmp}/s{i}.sock" for i in range(a.servers)]
    procs = []
    try:
        for i, sid in enumerate(ids):
            cmd = [sys.executable, "-m", "eaas", "expert-server", "--model", model_dir]
            cmd += ["--server-id", sid, "--listen", eps[i], "--threads", "1"]
            cmd += ["--experts", format_expert_spec(placement.servers[i])]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
        for p in procs:
            line = p.stdout.readline()
            if " ready on " not in line:
                raise RuntimeError(f"expert server did not start: {line!r}")
        d = Dispatcher(0, info.hidden_size, torch.float32, timeout=60.0)
        d.set_table(RoutingTable.from_placement(placement, ids, eps, version=1))
        model, _, _ = load_attention_model(
            model_dir, torch.float32, experts_factory=experts_factory(d)
        )
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = [
            tok(f"Prompt number {i}: experts are stateless")["input_ids"] for i in range(a.batch)
        ]
        decode_tokens = a.batch * (a.max_tokens - 1)
        rates: dict[bool, list[float]] = {False: [], True: []}
        outs: dict[bool, list] = {}
        for r in range(a.rounds):
            for overlap in (False, True):
                eng = Engine(model, tok, client_id=f"b{r}{overlap}", double_batch_overlap=overlap)
                out, dt = _run(eng, prompts, a.max_tokens)
                outs[overlap] = out
                rates[overlap].append(decode_tokens / dt)
        off, on = statistics.median(rates[False]), statistics.median(rates[True])
        print(
            f"batch {a.batch}, {a.max_tokens} tokens, {a.servers} expert servers, "
            f"{a.rounds} rounds (median)"
        )
        print("| mode | tokens/s | ratio |\n|---|---|---|")
        print(f"| overlap off | {off:.1f} | 1.00 |")
        print(f"| overlap on | {on:.1f} | {on / off:.2f} |")
        print(f"greedy tokens identical: {outs[False] == outs[True]}")
        d.close()
        return 0 if outs[False] == outs[True] else 1
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
