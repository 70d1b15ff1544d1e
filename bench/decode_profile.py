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

``--experts-compare``: the paged engine with local experts (single-process mode) vs the same
engine with its routed experts on ``--servers`` real expert-server processes (``eaas
expert-server``, every expert on ``--replicas`` of them, shm transport; what ``eaas serve`` runs),
side by side in one run: ``--rounds`` alternating blocks of ``--steps`` decode steps each (so the
shared machine's load hits both alike). Per decode step: wall time, the client process's CPU
time, the expert servers' CPU time (``/proc/PID/stat``), and the ratio remote / local; then one
cProfile pass of each (where the client's time goes: attention, MoE block, of which the
dispatcher's plan / send / wait / combine, sampling, events, rest).

``--variants 00 11b ...``: more clients of the same servers with other data paths, measured in
the same alternating blocks (``R O [b]``: R=1 every frame of a layer call written before any
doorbell, O=1 the shared expert computed during the round trip, ``b`` the client blocks at once
instead of busy-polling; the main ``remote`` client is ``11`` with the transport's default
spin; ``00`` is the data path before). ``--slice-us US``: the remote engine once more, with a
short scheduler slice (``set_sched_slice``) on the client and the servers during its blocks.
``--dtypes-compare``: the paged engine in float32, in bfloat16 computing natively and in
bfloat16 computing in float32 (``--cpu-bf16-compute fp32``: float32 weight copies, bfloat16 KV
cache and frames), each in the single-process mode and with its routed experts on ``--servers``
expert servers of the same dtype and policy (0: single process only); alternating blocks of
``--steps`` decode steps (wall, client CPU, servers' CPU per step), then a ``torch.profiler``
table of the single-process steps by kind of aten op and the top ops (where bf16 loses).

Usage::

    python bench/decode_profile.py --batch 16 --prompt-tokens 220 --steps 20
    python bench/decode_profile.py --experts-compare --batch 32 --steps 20 --rounds 3
    python bench/decode_profile.py --experts-compare --batch 32 --rounds 6 --variants 00 11b
    python bench/decode_profile.py --dtypes-compare --batch 32 --steps 10 --rounds 3
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_servers import (  # noqa: E402  (bench/decode_servers.py)
    decode_engine,
    into_decode,
    set_sched_slice,
    start_servers,
    timed_steps,
)


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
    from eaas.runtime.client.engine import Engine
    from eaas.runtime.client.reference_engine import ReferenceEngine

    eng = (
        Engine(model, tok, client_id=kind)
        if kind == "paged"
        else ReferenceEngine(model, tok, client_id=kind)
    )
    reqs = into_decode(eng, tok, args)
    with torch.inference_mode():
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


# ---- --experts-compare: local experts vs expert-server processes ----------------------------


def _profile_parts(eng, steps: int, dispatcher) -> dict:
    """cProfile of ``steps`` decode steps: ms per step by part."""
    prof = cProfile.Profile()
    with torch.inference_mode():
        prof.enable()
        for _ in range(steps):
            eng._step()
        prof.disable()
    st = pstats.Stats(prof)
    model = eng.model
    runner = getattr(eng.runner, "runner", eng.runner)  # PagedOverlapRunner wraps one
    mlp_fns = {type(lyr.mlp).forward for lyr in model.model.layers}
    mlp_fns |= {f for f in runner.mlp_forwards if inspect.isfunction(f)}  # overlapped forwards
    parts = {
        "step": _ct(st, [type(eng)._step]),
        "attention": _ct(st, [type(runner)._mla, type(runner)._gqa]),
        "moe_mlp": _ct(st, list(mlp_fns)),
        "sampling": _ct(st, [type(eng)._sample]),
        "events": _ct(st, [type(eng)._emit]),
        "schedule": _ct(st, [type(eng.scheduler).schedule]),
    }
    if dispatcher is not None:
        from eaas.runtime.client.dispatch import Dispatcher

        conn = next(s.conn for s in dispatcher._servers.values() if s.conn is not None)
        from eaas.runtime.client.dispatch import PendingDispatch

        c = type(conn)
        parts["dispatch"] = _ct(st, [Dispatcher.dispatch_begin, PendingDispatch.wait])
        parts["  plan (replica choice)"] = _ct(st, [Dispatcher._plan])
        parts["  send (frames into slots)"] = _ct(st, [c.send, c.send_deferred, c.ring])
        parts["  recv (wait + read)"] = _ct(st, [c.recv])
    out = {k: 1000 * v / steps for k, v in parts.items()}
    out["rest"] = out["step"] - sum(
        out[k] for k in ("attention", "moe_mlp", "sampling", "events", "schedule")
    )
    return out


def experts_compare(args) -> int:
    """Local experts vs expert servers, side by side (see the module docstring)."""
    import tempfile

    from eaas.runtime.client.dispatch import Dispatcher
    from eaas.runtime.client.moe import experts_factory
    from eaas.runtime.models.attention import load_attention_model
    from eaas.runtime.models.tiny import default_model_dir

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    dt = dtypes[args.dtype]
    model_dir = str(args.model or default_model_dir())
    run_dir = Path(tempfile.mkdtemp(prefix="eaas-decode-profile-"))
    procs, table = start_servers(
        model_dir,
        args.servers,
        args.replicas,
        args.dtype,
        args.server_threads,
        run_dir,
        profile=args.server_profile,
        spin_us=args.server_spin_us,
    )
    pids = [p.pid for p in procs]
    try:
        from eaas.runtime.models.arch import read_model_info

        info = read_model_info(model_dir)
        from eaas.runtime.client.dispatch.connections import default_connect

        kw = {}
        if args.client_spin_us is not None:

            def connect(endpoint, server_id, **ckw):
                return default_connect(endpoint, server_id, spin_us=args.client_spin_us, **ckw)

            kw["connect"] = connect
        disp = Dispatcher(0, info.hidden_size, dt, table, **kw)
        remote, tok, _ = load_attention_model(model_dir, dt, experts_factory=experts_factory(disp))
        variants = {}  # label -> (model, dispatcher, shared expert overlapped)
        for j, v in enumerate(args.variants or []):
            # another client of the same servers: doorbells rung after all frames (r1) or per
            # frame as written (r0), shared expert during the round trip (o1) or after it (o0)
            ring, ovl = v[0] == "1", v[1] == "1"
            vkw = dict(kw)
            if len(v) > 2:  # b: the client blocks at once (spin 0), no busy-poll

                def connect(endpoint, server_id, **ckw):
                    return default_connect(endpoint, server_id, spin_us=0, max_spin_us=0, **ckw)

                vkw["connect"] = connect
            dv = Dispatcher(10 + j, info.hidden_size, dt, table, ring_after_all=ring, **vkw)
            mv, _, _ = load_attention_model(model_dir, dt, experts_factory=experts_factory(dv))
            variants[f"r{v[0]}o{v[1]}{v[2:]}"] = (mv, dv, ovl)
        if args.split_pairs is not None:  # a second client: the same servers, another policy
            disp2 = Dispatcher(1, info.hidden_size, dt, table, split_pairs=args.split_pairs, **kw)
            remote2, _, _ = load_attention_model(
                model_dir, dt, experts_factory=experts_factory(disp2)
            )
        local, _, _ = load_attention_model(model_dir, dt)
        engines = {
            "local": (decode_engine(local, tok, args, "local"), None),
            "remote": (decode_engine(remote, tok, args, "remote"), disp),
        }
        for label, (mv, dv, ovl) in variants.items():
            ev = decode_engine(mv, tok, args, f"remote-{label}")
            if not ovl:
                getattr(ev.runner, "runner", ev.runner).mlp_forwards = [
                    lyr.mlp for lyr in mv.model.layers
                ]
            engines[label] = (ev, dv)
        if args.split_pairs is not None:
            engines[f"split={args.split_pairs}"] = (
                decode_engine(remote2, tok, args, "remote-split"),
                disp2,
            )
        if args.double_batch_overlap:
            engines["remote+dbo"] = (
                decode_engine(remote, tok, args, "remote-dbo", overlap=True),
                disp,
            )
        if args.server_profile:  # profile the servers' decode steps only
            import signal

            for p in procs:
                p.send_signal(signal.SIGUSR1)
        if args.slice_us is not None:  # the remote engine again, with short slices
            engines[f"slice{args.slice_us:g}"] = engines["remote"]
        sums = {k: [0.0, 0.0, 0.0] for k in engines}
        for _ in range(args.rounds):  # alternate blocks: load hits both alike
            for k, (eng, _d) in engines.items():
                if args.slice_us is not None:
                    us = args.slice_us if k.startswith("slice") else 0
                    for pid in [0, *pids]:  # this client and every expert server
                        set_sched_slice(pid, us)
                w, c, s = timed_steps(eng, args.steps, pids if k != "local" else [])
                for i, v in enumerate((w, c, s)):
                    sums[k][i] += v
        n = args.rounds * args.steps
        print(
            f"{args.dtype}, batch {args.batch}, context ~{args.prompt_tokens} tokens, "
            f"{args.servers} servers (R={args.replicas}), {n} decode steps each, "
            f"{args.rounds} alternating rounds, load average {os.getloadavg()[0]:.2f}"
        )
        others = [k for k in engines if k != "local"]
        print(
            f"{'ms per decode step':34s} {'local':>9s} "
            + " ".join(f"{k:>10s} {'ratio':>6s}" for k in others)
        )
        for i, label in enumerate(("wall", "client CPU", "expert servers' CPU (sum)")):
            a = 1000 * sums["local"][i] / n
            cells = []
            for k in others:
                b = 1000 * sums[k][i] / n
                cells.append(f"{b:10.2f} " + (f"{b / a:5.2f}x" if a > 1e-9 else f"{'-':>6s}"))
            print(f"{label:34s} {a:9.2f} " + " ".join(cells))
        if args.slice_us is not None:
            for pid in [0, *pids]:
                set_sched_slice(pid, 0)
        prof = {k: _profile_parts(eng, args.steps, d) for k, (eng, d) in engines.items()}
        print("\ncProfile, ms per decode step (incl. profiling overhead)")
        print(f"{'part':34s} " + " ".join(f"{k:>10s}" for k in engines))
        for key in prof["remote"]:
            cells = [prof[k].get(key) for k in engines]
            print(
                f"{key:34s} " + " ".join(f"{'':>10s}" if c is None else f"{c:10.2f}" for c in cells)
            )
        for eng, _d in engines.values():
            for s in list(eng.scheduler.running):
                s.request.cancel()
        disp.close()
        for _mv, dv, _o in variants.values():
            dv.close()
        if args.split_pairs is not None:
            disp2.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        if args.server_profile:
            st = pstats.Stats(str(run_dir / "expert-0.prof"))
            print("\nexpert-0 under cProfile (its decode steps), top 25 by own time:")
            st.sort_stats("tottime").print_stats(25)
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


# ---- --dtypes-compare: fp32 vs bf16 native vs bf16 with fp32 compute -------------------------

_VARIANTS = (  # label, --dtype, --cpu-bf16-compute
    ("fp32", "float32", "native"),
    ("bf16 native", "bfloat16", "native"),
    ("bf16 fp32-compute", "bfloat16", "fp32"),
)


def _op_table(eng, steps: int) -> dict[str, float]:
    """torch.profiler over ``steps`` decode steps: self CPU ms per step by aten op."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng._step()
    return {e.key: e.self_cpu_time_total / 1000 / steps for e in prof.key_averages()}


_OP_CLASSES = (  # (label, aten ops): where a step's self CPU time goes, by kind of op
    (
        "matmul (mm, bmm, addmm, grouped_mm)",
        ("aten::mm", "aten::bmm", "aten::addmm", "aten::_grouped_mm"),
    ),
    ("dtype conversions / copies", ("aten::copy_", "aten::_to_copy")),
    (
        "gathers / scatters",
        (
            "aten::index",
            "aten::index_select",
            "aten::index_copy_",
            "aten::index_add_",
            "aten::_index_put_impl_",
        ),
    ),
    (
        "elementwise (mul, add, silu, pow, ...)",
        (
            "aten::mul",
            "aten::add",
            "aten::silu",
            "aten::pow",
            "aten::div_",
            "aten::rsqrt",
            "aten::mean",
            "aten::sigmoid",
            "aten::neg",
            "aten::sub",
            "aten::masked_fill_",
            "aten::where",
        ),
    ),
    (
        "softmax / top-k / sort / argmax",
        ("aten::_softmax", "aten::topk", "aten::sort", "aten::argmax"),
    ),
)


def dtypes_compare(args) -> int:
    """fp32 vs bf16 native vs bf16 fp32-compute, side by side in one run (module docstring)."""
    import tempfile

    from eaas.runtime.client.dispatch import Dispatcher
    from eaas.runtime.client.moe import experts_factory
    from eaas.runtime.models.arch import read_model_info
    from eaas.runtime.models.attention import load_attention_model
    from eaas.runtime.models.tiny import default_model_dir

    dts = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    model_dir = str(args.model or default_model_dir())
    info = read_model_info(model_dir)
    run_dir = Path(tempfile.mkdtemp(prefix="eaas-decode-dtypes-"))
    engines: dict[str, tuple] = {}  # label -> (engine, server pids)
    procs: list = []
    disps: list = []
    try:
        for label, dtype, policy in _VARIANTS:
            compute = torch.float32 if policy == "fp32" else None
            model, tok, _ = load_attention_model(model_dir, dts[dtype], compute_dtype=compute)
            engines[f"{label} (single)"] = (decode_engine(model, tok, args, label), [])
            if args.servers > 0:
                sub = run_dir / label.replace(" ", "-")
                sub.mkdir()
                ps, table = start_servers(
                    model_dir,
                    args.servers,
                    args.replicas,
                    dtype,
                    args.server_threads,
                    sub,
                    compute=policy,
                )
                procs += ps
                disp = Dispatcher(len(disps), info.hidden_size, dts[dtype], table)
                disps.append(disp)
                remote, _, _ = load_attention_model(
                    model_dir,
                    dts[dtype],
                    experts_factory=experts_factory(disp),
                    compute_dtype=compute,
                )
                engines[f"{label} ({args.servers} servers)"] = (
                    decode_engine(remote, tok, args, label + " remote"),
                    [p.pid for p in ps],
                )
        sums = {k: [0.0, 0.0, 0.0] for k in engines}
        for _ in range(args.rounds):  # alternate blocks: the machine's load hits all alike
            for k, (eng, pids) in engines.items():
                for i, v in enumerate(timed_steps(eng, args.steps, pids)):
                    sums[k][i] += v
        n = args.rounds * args.steps
        print(
            f"batch {args.batch}, context ~{args.prompt_tokens} tokens, {n} decode steps each in "
            f"{args.rounds} alternating rounds, 1 torch thread per process, load average "
            f"{os.getloadavg()[0]:.2f}"
        )
        base = {k.split(" (")[1]: 1000 * v[0] / n for k, v in sums.items() if k.startswith("fp32")}
        print(
            f"{'ms per decode step':30s} {'wall':>8s} {'vs fp32':>8s} {'client CPU':>11s} {'servers CPU':>12s}"
        )
        for k, (w, c, sv) in sums.items():
            wall = 1000 * w / n
            ref = base[k.split(" (")[1]]
            print(
                f"{k:30s} {wall:8.2f} {wall / ref:7.2f}x {1000 * c / n:11.2f} "
                + (f"{1000 * sv / n:12.2f}" if engines[k][1] else f"{'-':>12s}")
            )
        singles = [k for k in engines if k.endswith("(single)")]
        ops: dict[str, dict[str, float]] = {k: {} for k in singles}
        for _ in range(args.rounds):  # alternating too: the load hits every variant alike
            for k in singles:
                for o, ms in _op_table(engines[k][0], args.steps).items():
                    ops[k][o] = ops[k].get(o, 0.0) + ms / args.rounds
        print(
            "\ntorch.profiler, single process, self CPU ms per decode step (with profiling "
            "overhead; alternating rounds)"
        )
        print(f"{'op class':40s} " + " ".join(f"{k.split(' (')[0]:>18s}" for k in singles))
        for label, names in _OP_CLASSES:
            print(
                f"{label:40s} "
                + " ".join(f"{sum(ops[k].get(o, 0.0) for o in names):18.2f}" for k in singles)
            )
        print(f"{'all ops':40s} " + " ".join(f"{sum(ops[k].values()):18.2f}" for k in singles))
        top = sorted(
            {o for k in singles for o in ops[k]},
            key=lambda o: -max(ops[k].get(o, 0.0) for k in singles),
        )[: args.top_ops]
        print(f"\ntop {args.top_ops} aten ops")
        for o in top:
            print(f"{o:40s} " + " ".join(f"{ops[k].get(o, 0.0):18.2f}" for k in singles))
        for eng, _p in engines.values():
            for sq in list(eng.scheduler.running):
                sq.request.cancel()
        for d in disps:
            d.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: built-in tiny model)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=220)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--experts-compare",
        action="store_true",
        help="paged engine: local experts vs --servers expert-server processes",
    )
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--server-threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--double-batch-overlap",
        action="store_true",
        help="--experts-compare: also the remote engine with double-batch overlap",
    )
    ap.add_argument(
        "--split-pairs",
        type=int,
        default=None,
        help="--experts-compare: also a client whose dispatcher uses this split_pairs "
        "(1: every expert's pairs split over all its replicas, the policy before "
        "column dispatch)",
    )
    ap.add_argument(
        "--variants",
        nargs="*",
        choices=("00", "01", "10", "11", "00b", "01b", "10b", "11b"),
        help="--experts-compare: also clients of the same servers with these data paths, "
        "RO: R=1 all frames of a layer call written before any doorbell (R=0: each frame's "
        "doorbell as it is written, the path before), O=1 the shared expert computed during the "
        "round trip (O=0: after it); a trailing b: the client blocks at once while waiting "
        "(shm spin 0, no adaptive spin); 00 = the data path before both",
    )
    ap.add_argument(
        "--slice-us",
        type=float,
        default=None,
        help="--experts-compare: also the remote engine with this scheduler slice "
        "(set_sched_slice) on the client and the expert servers",
    )
    ap.add_argument("--client-spin-us", type=float, default=None, help="shm client spin_us")

    ap.add_argument("--server-spin-us", type=float, default=None, help="shm server spin_us")
    ap.add_argument(
        "--server-profile",
        action="store_true",
        help="run the expert servers under cProfile; print expert-0's top functions",
    )
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument(
        "--dtypes-compare",
        action="store_true",
        help="fp32 vs bf16 native vs bf16 fp32-compute (--cpu-bf16-compute), single process and "
        "with --servers expert servers (0: single process only), plus a torch.profiler op table",
    )
    ap.add_argument("--top-ops", type=int, default=12)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.experts_compare:
        return experts_compare(args)
    if args.dtypes_compare:
        return dtypes_compare(args)
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
