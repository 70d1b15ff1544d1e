"""Where one decode step of the attention client's engine goes: previous engine vs paged engine.

Loads a model with local experts (default: the built-in tiny DeepSeek-V3 model, fp32, 1 thread),
puts ``--batch`` sequences with ``--prompt-tokens``-token prompts into decode, then runs
``--steps`` decode steps of each engine under ``cProfile`` on this thread and prints a table of
milliseconds per step by part (cumulative time of the functions named below), side by side:

* attention: the attention module (previous: transformers' ``*Attention.forward`` incl. its
  projections; paged: ``PagedModelRunner._mla`` / ``_gqa`` incl. projections), of which
  ``expand_kv`` (previous, MLA: ``kv_b_proj`` over every cached latent) and SDPA;
* MoE / MLP block: the model's ``mlp`` modules (router, shared expert, routed experts);
* sampling, events (detokenization, stops), and the rest (Python glue, cache bookkeeping, masks,
  embeddings, norms, lm_head).

Usage::

    python bench/decode_profile.py --batch 16 --prompt-tokens 220 --steps 20
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import pstats
import sys
import time

import torch


def _key_of(fn) -> tuple[str, int, str]:
    fn = inspect.unwrap(fn)
    return (inspect.getsourcefile(fn), inspect.getsourcelines(fn)[1], fn.__name__)


def _ct(stats: pstats.Stats, fns) -> float:
    """Cumulative seconds of the given functions (matched by file, first line, name)."""
    keys = {_key_of(f) for f in fns}
    total = 0.0
    for (file, line, name), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():
        if (file, line, name) in keys:
            total += ct
    return total


def _sdpa_ct(stats: pstats.Stats) -> float:
    return sum(
        v[3]
        for (file, _line, name), v in stats.stats.items()
        if file == "~" and "scaled_dot_product_attention" in name
    )


def profile_engine(kind: str, model, tok, args) -> dict:
    from eaas.runtime.client.engine import Engine, SamplingParams
    from eaas.runtime.client.reference_engine import ReferenceEngine

    eng = (
        Engine(model, tok, client_id=kind)
        if kind == "paged"
        else ReferenceEngine(model, tok, client_id=kind)
    )
    base = tok(" ".join(["expert server routing table"] * args.prompt_tokens))["input_ids"]
    reqs = [
        eng.submit(
            base[i : i + args.prompt_tokens],
            SamplingParams(max_tokens=10_000, ignore_eos=True),
            lambda ev: None,
        )
        for i in range(args.batch)
    ]
    with torch.inference_mode():
        while not all(r.output_ids for r in reqs):  # prefill everything
            eng._step()
        for _ in range(2):  # warm-up decode steps
            eng._step()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(args.steps):
            eng._step()
        prof.disable()
        wall = time.perf_counter() - t0
    st = pstats.Stats(prof)
    layer = model.model.layers[-1]
    attn_fns = [type(layer.self_attn).forward]
    if kind == "paged":
        attn_fns = [type(eng.runner)._mla, type(eng.runner)._gqa]
    mlp_types = {type(lyr.mlp) for lyr in model.model.layers}
    out = {
        "step_ms": 1000 * wall / args.steps,
        "attention": _ct(st, attn_fns),
        "expand_kv": _ct(st, [type(layer.self_attn).expand_kv])
        if hasattr(layer.self_attn, "expand_kv")
        else 0.0,
        "sdpa": _sdpa_ct(st),
        "moe_mlp": _ct(st, [t.forward for t in mlp_types]),
        "sampling": _ct(st, [type(eng)._sample]),
        "events": _ct(st, [type(eng)._emit]),
    }
    total = sum(_ct(st, [type(eng)._step]) for _ in [0])  # cumulative time of all profiled steps
    out["profiled_s"] = total
    for k in ("attention", "expand_kv", "sdpa", "moe_mlp", "sampling", "events"):
        out[k] = 1000 * out[k] / args.steps
    out["rest"] = (
        1000 * total / args.steps
        - out["attention"]
        - out["moe_mlp"]
        - out["sampling"]
        - out["events"]
    )
    for r in reqs:
        r.cancel()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: built-in tiny model)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=220)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from eaas.runtime.models.attention import load_attention_model
    from eaas.runtime.models.tiny import default_model_dir

    model, tok, _ = load_attention_model(args.model or default_model_dir(), torch.float32)
    res = {k: profile_engine(k, model, tok, args) for k in ("previous", "paged")}
    rows = [
        ("decode step (wall, ms)", "step_ms"),
        ("attention (ms)", "attention"),
        ("  of which expand_kv", "expand_kv"),
        ("  of which torch SDPA", "sdpa"),
        ("MoE / MLP blocks", "moe_mlp"),
        ("sampling", "sampling"),
        ("events (detokenize, stops)", "events"),
        ("rest (glue, cache, norms, lm_head)", "rest"),
    ]
    print(
        f"batch {args.batch}, prompt {args.prompt_tokens} tokens, {args.steps} decode steps "
        "(cProfile: times include profiling overhead)"
    )
    print(f"{'part':36s} {'previous':>10s} {'paged':>10s} {'ratio':>8s}")
    for label, k in rows:
        a, b = res["previous"][k], res["paged"][k]
        ratio = f"{a / b:.1f}x" if b > 1e-9 else "-"
        print(f"{label:36s} {a:10.2f} {b:10.2f} {ratio:>8s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
