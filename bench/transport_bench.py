"""Round trip of the expert-server transports against a minimal shared-memory prototype.

One client (this process) and one echo server process per transport: the server answers every
frame with its hidden states, so the payload travels both ways, as in the paper's
"(batch, 7168) bf16, send and return" measurement; no expert compute. Measured side by side in
one run, interleaved in blocks (so machine load hits every kind alike; the order alternates
from block to block), with the client pinned to one CPU and every server to another (``--cpus``;
the same placement for every kind: unpinned, the scheduler sometimes puts both ends on one CPU
and a round trip then costs context switches, which swamps what is measured here):

* ``proto``: the floor -- two processes (the server a fork of the client), one shared buffer
  holding what a frame holds (``[n, H]`` rows, ``[n, k]`` int32 experts and float32 weights,
  the ``[n, H]`` response) and two header lines laid out as shm's (a counter, the header fields
  and a waiting flag each way). The same wait policy as shm: the client spins at least
  ``--spin-us`` and up to 1.5x its recent round trip (at most 2 ms) with ``sched_yield``, the
  server spins ``--spin-us`` (longer, up to 0.5 ms, while its frames come that often); then a side sets its waiting flag, fences and blocks on a
  doorbell socket, and the other rings it only when that flag is set. Per round trip the client
  copies its three tensors in and stores the request header (one ``pack_into``) and counter,
  the server reads the header (one ``tolist``), copies the rows to the response and stores the
  response header and counter, the client reads that header and copies the rows out; each copy
  a ``Tensor.copy_`` as in shm. Nothing else: no validation, no frame objects, no liveness
  checks.
* ``shm``: :mod:`eaas.runtime.transport.shm` through its public interface as the attention
  client's dispatcher uses it (``send_parts`` with the frame's fields and ``(n, k)``, ``recv``,
  the echo server's ``poll`` / ``respond_ok``, as the expert server answers; output copied out).
* ``shm-frame``: the same connection through ``send`` with a new :class:`RequestFrame` per
  round trip (whose three tensor shapes ``send`` reads to find the frame's plan).
* ``ref`` (``--ref-shm FILE``): another copy of ``shm.py`` (an older version) in the same run,
  through its own ``send_parts`` where it has one, else ``send``.
* ``tcp``: :mod:`eaas.runtime.transport.tcp` over loopback (``--tcp``), through ``send``.

Reports p50 / p99 / mean in microseconds, each transport's ratio to ``proto``, the spread
(quartiles) of the per-block p50 and p99 ratios, and a verdict: the median of the per-block p50
ratios of ``shm`` against ``--target`` (1.2, at 1 and 64 tokens), with
``shm-frame``'s beside it. ``--profile ROUNDS``
instead times each step of a round trip in one process (where the time goes).

    python bench/transport_bench.py                         # 1x7168 and 64x7168 bf16
    git show main:runtime/transport/shm.py > /tmp/shm_main.py
    python bench/transport_bench.py --ref-shm /tmp/shm_main.py   # old and new side by side
    python bench/transport_bench.py --profile 60 --payload 1x7168:bfloat16
    python bench/transport_bench.py --iters 3000 --tcp --payload 128x7168:bfloat16

Measured 2026-11-30 10:42-10:48 UTC on the shared 2-core dev machine at load 7.7-13 (four runs,
the code before this session as ``ref``; tables in docs/serving.md, "Transport round trip"):
one token 1.21-1.39x (shm 13.8-19.6 us, prototype 11.3-15.6 us; ``ref`` within 0.04x of shm in
every run), 64 tokens 1.01-1.35x. In one process shm adds ~3.8 us to the prototype's ~5.9 us of
copies and stores, and even a copy of shm stripped of its guards, liveness and fences keeps
~2.8 us (shape reads, frame objects, headers, hand-off): about 1.24x at one token, so 1.2x
there needs fewer frames or a compiled data path, not more trimming of per-frame Python.
At 17:55 UTC (load 1.2-1.6), with the adaptive server spin in both kinds: one token 1.25-1.26x,
64 tokens 1.02-1.03x (shm 203-213 us, 494 us before the adaptive spin).
At 23:35 UTC (load 1.1), shm as the dispatcher sends (``send_parts``: no frame object, the plan
found by ``(n, k)``): one token 1.12x (``shm-frame`` 1.19x), 64 tokens 1.09x (1.13x).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transport_proto import (  # noqa: E402  (bench/transport_proto.py)
    ProtoBuffer,
    ProtoClient,
    pack_request,
    pack_response,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---- the real transports ----------------------------------------------------------------------
def _load_module(path: str):
    """Import a copy of :mod:`eaas.runtime.transport.shm` from a file (``--ref-shm``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("eaas_ref_shm", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--ref-shm {path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def serve(
    endpoint: str, hidden: int, dtype: str, spin_us: float, cpu: int | None, module: str | None
) -> None:
    """Echo server loop (runs in the child process), pinned to ``cpu`` unless None; the shm
    listener of the file ``module`` instead of the installed transport when given."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    from eaas.runtime.transport.factory import listen

    torch.set_num_threads(1)
    if module:
        lst = _load_module(module).ShmServerListener(
            endpoint, hidden_size=hidden, dtype=DTYPES[dtype], spin_us=spin_us
        )
    else:
        lst = listen(endpoint, hidden_size=hidden, dtype=DTYPES[dtype], spin_us=spin_us)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print(f"ready {lst.endpoint}", flush=True)
    try:
        while not stop:
            for conn, f in lst.poll(0.2):
                lst.respond_ok(conn, f, f.hidden)  # as the expert server answers
    finally:
        lst.close()


def _start(
    endpoint: str, hidden: int, dtype: str, spin_us: float, cpu: int | None, module: str | None
) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen(
        [sys.executable, __file__, "--serve", endpoint, "--hidden", str(hidden)]
        + ["--dtype", dtype, "--spin-us", str(spin_us)]
        + ([] if cpu is None else ["--server-cpu", str(cpu)])
        + ([] if module is None else ["--ref-shm", module]),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline().split()
    if not line or line[0] != "ready":
        p.kill()
        raise RuntimeError("echo server failed to start")
    return p, line[1]


def measure_transport(
    conn, h: torch.Tensor, ex: torch.Tensor, w: torch.Tensor, iters: int, bar, parts: bool = False
) -> list[float]:
    """``iters`` round trips through a transport's public interface; latencies in seconds.

    ``parts``: send as the dispatcher does, ``send_parts`` with the frame's fields and its
    ``(n, k)``; else ``send`` with a new :class:`RequestFrame` per round trip (each new shape
    validated)."""
    from eaas.runtime.transport.base import RequestFrame

    out = torch.empty_like(h)
    lat = []
    n, k = ex.shape
    for i in range(iters):
        t0 = time.perf_counter()
        if parts:
            conn.send_parts(1, 0, 1, i, h, ex, w, None, n, k)
        else:
            conn.send(RequestFrame(1, 0, 1, i, h, ex, w))
        r = conn.recv(time.monotonic() + 10)
        out.copy_(r.output)  # a real client copies out of the transport buffer
        lat.append(time.perf_counter() - t0)
        bar.update(1)
    assert torch.equal(out, h)
    return lat


def _own_send_parts(conn) -> bool:
    """Whether ``conn``'s class has a ``send_parts`` of its own, not the base class's default
    (which builds a frame and calls ``send``: tcp, or an older ``shm.py`` given as
    ``--ref-shm``)."""
    from eaas.runtime.transport.base import ClientConnection

    default = ClientConnection.send_parts
    return getattr(type(conn), "send_parts", default) is not default


def _run(proto, conns, h, ex, w, bar, kind: str, iters: int) -> list[float]:
    """``iters`` round trips of ``kind`` ("proto", "shm-frame" (the shm connection through
    ``send``) or a transport in ``conns`` (through ``send_parts`` where its class has one of
    its own, else ``send``))."""
    if kind == "proto":
        return proto.round_trips(h, ex, w, iters, bar)
    if kind == "shm-frame":
        return measure_transport(conns["shm"], h, ex, w, iters, bar)
    conn = conns[kind]
    return measure_transport(conn, h, ex, w, iters, bar, parts=_own_send_parts(conn))


SEGMENTS = ("frame", "send", "poll", "resp frame", "respond", "recv", "copy out")


def profile_segments(
    n: int, hidden: int, k: int, dtype: torch.dtype, rounds: int, ref_module=None
) -> dict[str, dict[str, list[int]]]:
    """Where a round trip's time goes, in one process (no waiting, no cross-CPU traffic): each
    step of a round trip timed with ``perf_counter_ns`` around it, for the prototype's steps
    (its three copies and counter store as "send", the server's copy and stores as "respond",
    the copy out) and shm's (the caller's ``RequestFrame``: none where the connection has
    ``send_parts``, which is then timed as "send", as the dispatcher sends; ``send``,
    ``poll(0)``, "resp frame"
    (nothing since the echo answers with ``respond_ok``, as the expert server; kept so older
    tables compare), ``respond_ok``, ``recv``, the copy out); ``rounds`` rounds of 100 round
    trips, the kinds interleaved round by round.

    Returns:
        kind -> segment name (:data:`SEGMENTS`) -> per-call nanoseconds (``rounds * 100``).
    """

    from eaas.runtime.transport import shm
    from eaas.runtime.transport.base import RequestFrame

    mods = {"shm": shm} | ({"ref": ref_module} if ref_module is not None else {})
    h = torch.randn(n, hidden).to(dtype)
    ex = torch.randint(0, 256, (n, k), dtype=torch.int32)
    w = torch.rand(n, k)
    out = torch.empty_like(h)
    pc = time.perf_counter_ns
    pairs, tmp = {}, tempfile.mkdtemp(prefix="eaas-prof-")
    for name, mod in mods.items():
        lst = mod.ShmServerListener(
            f"unix:{tmp}/{name}.sock", hidden_size=hidden, dtype=dtype, spin_us=0
        )
        box: list = []
        t = threading.Thread(
            target=lambda m=mod, e=lst.endpoint, b=box: b.append(
                m.ShmClientConnection(
                    e, "p", hidden_size=hidden, dtype=dtype, max_tokens=n, max_k=k, spin_us=0
                )
            )
        )
        t.start()
        while t.is_alive():
            lst.poll(0.01)  # answers the hello
        pairs[name] = (box[0], lst)
    proto = ProtoBuffer(n, hidden, k, dtype)
    flags = proto.flags

    def run_proto(acc: dict[str, list[int]], iters: int) -> None:
        for i in range(iters):
            t0 = pc()
            proto.req.copy_(h)
            proto.experts.copy_(ex)
            proto.weights.copy_(w)
            pack_request(flags, 8, 0, 1, n, k, 1, i)
            flags[0] = i
            t1 = pc()
            c, layer, _v, n_, _k, _cid, seq, _ = proto.req_hdr.tolist()
            t2 = pc()
            proto.resp.copy_(proto.req)
            pack_response(flags, 72, layer, 0, n_, 0, seq)
            flags[8] = c
            t3 = pc()
            _, _layer, status, _n, _ln, _seq, _, _ = proto.resp_hdr.tolist()
            t4 = pc()
            out.copy_(proto.resp)
            t5 = pc()
            for name, a, b in (
                ("send", t0, t1),
                ("poll", t1, t2),
                ("respond", t2, t3),
                ("recv", t3, t4),
                ("copy out", t4, t5),
            ):
                acc[name].append(b - a)

    def run_shm(c, lst, acc: dict[str, list[int]], iters: int) -> None:
        mono = time.monotonic
        parts = _own_send_parts(c)  # as the dispatcher sends (no frame object)
        for i in range(iters):
            t0 = pc()
            f = None if parts else RequestFrame(1, 0, 1, i, h, ex, w)
            t1 = pc()
            if f is None:
                c.send_parts(1, 0, 1, i, h, ex, w, None, n, k)
            else:
                c.send(f)
            t2 = pc()
            ((conn, g),) = lst.poll(0)
            t3 = pc()
            t4 = pc()  # no ResponseFrame: the echo answers as the expert server does
            lst.respond_ok(conn, g, g.hidden)
            t5 = pc()
            r = c.recv(mono() + 10)
            t6 = pc()
            out.copy_(r.output)
            t7 = pc()
            for name, a, b in zip(
                SEGMENTS, (t0, t1, t2, t3, t4, t5, t6), (t1, t2, t3, t4, t5, t6, t7), strict=True
            ):
                acc[name].append(b - a)

    res: dict[str, dict[str, list[int]]] = {
        kind: {s: [] for s in SEGMENTS} for kind in ["proto", *pairs]
    }
    try:
        for _ in range(rounds):
            run_proto(res["proto"], 100)
            for name, (c, lst) in pairs.items():
                run_shm(c, lst, res[name], 100)
    finally:
        for c, lst in pairs.values():
            c.close()
            lst.close()
        proto.client_sock.close()
        proto.server_sock.close()
        if not os.listdir(tmp):
            os.rmdir(tmp)
    return res


def _print_profile(res: dict[str, dict[str, list[int]]], label: str) -> None:
    """Per-call p10 / p50 of every segment in microseconds (p10: the cost without preemptions
    by other work), and their sum."""
    print(f"\nin-process steps of one round trip, {label} (us; proto: copies and stores only)")
    print(f"{'kind':<12}" + "".join(f"{s:>11}" for s in SEGMENTS) + f"{'sum':>9}")
    for q in (0.1, 0.5):
        for kind, segs in res.items():
            v = [(_pct(segs[s], q) if segs[s] else 0) / 1000 for s in SEGMENTS]
            print(
                f"{kind + f' p{int(q * 100)}':<12}"
                + "".join(f"{x:>11.2f}" for x in v)
                + f"{sum(v):>9.2f}"
            )


def _cpus(spec: str) -> tuple[int | None, int | None]:
    """``--cpus`` -> ``(client CPU, server CPU)``; ``(None, None)`` for no pinning.

    Raises:
        SystemExit: a malformed value or a CPU this process may not use.
    """
    allowed = sorted(os.sched_getaffinity(0))
    if spec == "none" or (spec == "auto" and len(allowed) < 2):
        return None, None
    if spec == "auto":
        return allowed[0], allowed[1]
    try:
        c, srv = (int(x) for x in spec.split(","))
    except ValueError:
        raise SystemExit(f"--cpus must be CLIENT,SERVER, 'auto' or 'none', got {spec!r}") from None
    if c not in allowed or srv not in allowed:
        raise SystemExit(f"--cpus {spec}: this process may use CPUs {allowed}")
    return c, srv


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def ratio_summary(blocks: list[list[float]], base_blocks: list[list[float]]) -> dict[str, float]:
    """Side-by-side ratios of one kind to the prototype, from interleaved blocks.

    Args:
        blocks, base_blocks: per block the round-trip latencies (seconds) of the kind and of the
            prototype, block ``i`` of both measured back to back.

    Returns:
        ``p50`` / ``p99`` / ``mean``: ratios of the pooled latencies; ``blk_p50_lo`` /
        ``blk_p50_med`` / ``blk_p50_hi``: quartiles of the per-block p50 ratio (how stable the
        median is from block to block); ``blk_p99_lo`` / ``blk_p99_hi``: the same for p99.
    """
    x = [v for b in blocks for v in b]
    base = [v for b in base_blocks for v in b]
    p50s = sorted(_pct(b, 0.5) / _pct(p, 0.5) for b, p in zip(blocks, base_blocks, strict=True))
    p99s = sorted(_pct(b, 0.99) / _pct(p, 0.99) for b, p in zip(blocks, base_blocks, strict=True))
    q = len(p50s)
    return {
        "p50": _pct(x, 0.5) / _pct(base, 0.5),
        "p99": _pct(x, 0.99) / _pct(base, 0.99),
        "mean": sum(x) / len(x) / (sum(base) / len(base)),
        "blk_p50_lo": p50s[q // 4],
        "blk_p50_med": p50s[q // 2],
        "blk_p50_hi": p50s[(3 * q) // 4],
        "blk_p99_lo": p99s[q // 4],
        "blk_p99_hi": p99s[(3 * q) // 4],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, default=7168, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    ap.add_argument(
        "--payload",
        action="append",
        help="TOKENSxHIDDEN:DTYPE (repeatable); default 1x7168:bfloat16 and 64x7168:bfloat16",
    )
    ap.add_argument("--k", type=int, default=8, help="expert entries per token in the frame")
    ap.add_argument("--iters", type=int, default=4000, help="round trips per payload and kind")
    ap.add_argument("--blocks", type=int, default=20, help="interleaved blocks per payload")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument(
        "--spin-us", type=float, default=80.0, help="busy-poll before blocking (both kinds)"
    )
    ap.add_argument("--tcp", action="store_true", help="also measure the tcp transport")
    ap.add_argument(
        "--ref-shm",
        metavar="FILE",
        help="also measure a copy of runtime/transport/shm.py from FILE as kind 'ref' (for "
        "example `git show main:runtime/transport/shm.py > /tmp/shm_main.py`): old and new "
        "side by side in one run",
    )
    ap.add_argument(
        "--target", type=float, default=1.2, help="the verdict's limit on shm's p50 ratio"
    )
    ap.add_argument(
        "--profile",
        type=int,
        metavar="ROUNDS",
        default=0,
        help="instead of the round trips: time each step of a round trip in one process "
        "(ROUNDS rounds of 100, the kinds interleaved) and print per-step p10 / p50",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads in the client (copies)")
    ap.add_argument(
        "--cpus",
        default="auto",
        help="CLIENT,SERVER: pin the client and every server process to these CPUs (the same "
        "placement for each kind; unpinned, the scheduler sometimes puts both ends on one CPU "
        "and a round trip then costs context switches); 'auto': the first two CPUs this "
        "process may use, 'none': no pinning",
    )
    ap.add_argument("--server-cpu", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.ref_shm and not os.path.isfile(a.ref_shm):
        raise SystemExit(f"--ref-shm {a.ref_shm}: no such file")
    if a.serve:
        serve(a.serve, a.hidden, a.dtype, a.spin_us, a.server_cpu, a.ref_shm)
        return
    if a.iters < a.blocks or a.blocks < 1:
        raise SystemExit(f"--iters ({a.iters}) must be at least --blocks ({a.blocks}) >= 1")
    client_cpu, server_cpu = _cpus(a.cpus)
    if client_cpu is not None:
        os.sched_setaffinity(0, {client_cpu})

    from tqdm import tqdm

    from eaas.runtime.transport.factory import connect

    ref = _load_module(a.ref_shm) if a.ref_shm else None
    payloads = []
    for spec in a.payload or ["1x7168:bfloat16", "64x7168:bfloat16"]:
        shape, _, dt = spec.partition(":")
        try:
            n, hdim = (int(x) for x in shape.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--payload must be TOKENSxHIDDEN[:DTYPE], got {spec!r}") from None
        if (dt or "bfloat16") not in DTYPES:
            raise SystemExit(f"--payload {spec!r}: dtype must be one of {sorted(DTYPES)}")
        payloads.append((n, hdim, dt or "bfloat16"))
    if a.profile > 0:
        for n, hdim, dt in payloads:
            res = profile_segments(n, hdim, a.k, DTYPES[dt], a.profile, ref)
            _print_profile(res, f"{n}x{hdim} {dt}, k={a.k}, {a.profile * 100} round trips")
        print(f"load average {os.getloadavg()[0]:.1f}")
        return
    kinds = ["proto", "shm", "shm-frame"] + (["ref"] if ref else []) + (["tcp"] if a.tcp else [])
    per_block = max(1, a.iters // a.blocks)
    # (payload, kind) -> one list of latencies (seconds) per block
    results: dict[tuple, list[list[float]]] = {}
    tmp = tempfile.mkdtemp(prefix="eaas-bench-")
    total = len(payloads) * len(kinds) * (per_block * a.blocks + a.warmup)
    with tqdm(total=total, desc="round trips", unit="rt", mininterval=1.0) as bar:
        for n, hdim, dt in payloads:
            dtype = DTYPES[dt]
            h = torch.randn(n, hdim).to(dtype)
            ex = torch.randint(0, 256, (n, a.k), dtype=torch.int32)
            w = torch.rand(n, a.k)
            procs, conns = [], {}
            proto = ProtoClient(n, hdim, a.k, dtype, a.spin_us * 1e-6, server_cpu)
            try:
                for kind in [k for k in kinds[1:] if k != "shm-frame"]:  # (shm's connection)
                    ep = f"unix:{tmp}/{kind}.sock" if kind != "tcp" else "tcp://127.0.0.1:0"
                    module = a.ref_shm if kind == "ref" else None
                    p, ep = _start(ep, hdim, dt, a.spin_us, server_cpu, module)
                    procs.append(p)
                    kw = dict(hidden_size=hdim, dtype=dtype, max_tokens=n, max_k=a.k)
                    if kind == "ref":
                        assert ref is not None
                        conns[kind] = ref.ShmClientConnection(ep, "echo", spin_us=a.spin_us, **kw)
                    else:
                        conns[kind] = connect(ep, "echo", spin_us=a.spin_us, **kw)

                run = functools.partial(_run, proto, conns, h, ex, w, bar)
                for kind in kinds:  # warm-up, not recorded
                    run(kind, a.warmup)
                for b in range(a.blocks):
                    # alternate the order inside a block, so neither kind always runs first
                    for kind in kinds if b % 2 == 0 else kinds[::-1]:
                        results.setdefault((n, hdim, dt, kind), []).append(run(kind, per_block))
            finally:
                proto.close()
                for c in conns.values():
                    c.close()
                for p in procs:
                    p.terminate()
                    p.wait(10)
    if not os.listdir(tmp):
        os.rmdir(tmp)
    print(
        f"\n{a.blocks} interleaved blocks x {per_block} round trips per kind and payload, "
        f"k={a.k}, spin {a.spin_us:g} us, load average {os.getloadavg()[0]:.1f}, "
        f"CPUs client/server {client_cpu}/{server_cpu}"
    )
    print(f"{'payload':<20}{'MB/way':>8}{'kind':>10}{'p50 us':>10}{'p99 us':>10}{'mean us':>10}")
    verdicts = []
    for n, hdim, dt in payloads:
        mb = n * hdim * torch.empty((), dtype=DTYPES[dt]).element_size() / 1e6
        for kind in kinds:
            lat = [x for blk in results[(n, hdim, dt, kind)] for x in blk]
            print(
                f"{f'{n}x{hdim} {dt}':<20}{mb:>8.3f}{kind:>10}{_pct(lat, 0.5) * 1e6:>10.1f}"
                f"{_pct(lat, 0.99) * 1e6:>10.1f}{sum(lat) / len(lat) * 1e6:>10.1f}"
            )
        base_blocks = results[(n, hdim, dt, "proto")]
        ratios = {}
        for kind in kinds[1:]:
            r = ratios[kind] = ratio_summary(results[(n, hdim, dt, kind)], base_blocks)
            print(
                f"{'':<20}{'':>8}{kind + '/proto':>16} {r['p50']:>4.2f}x p50"
                f"{r['p99']:>7.2f}x p99{r['mean']:>7.2f}x mean   per-block p50 ratio "
                f"{r['blk_p50_lo']:.2f}-{r['blk_p50_hi']:.2f}, p99 ratio "
                f"{r['blk_p99_lo']:.2f}-{r['blk_p99_hi']:.2f} (quartiles)"
            )
        r, rf = ratios["shm"], ratios["shm-frame"]
        ok = r["blk_p50_med"] <= a.target
        verdicts.append(
            f"{n}x{hdim} {dt}: shm/proto p50 {r['blk_p50_med']:.2f}x (median of "
            f"{a.blocks} blocks, quartiles {r['blk_p50_lo']:.2f}-{r['blk_p50_hi']:.2f}) "
            f"{'<=' if ok else '>'} {a.target:g}x: {'met' if ok else 'missed'}; through "
            f"send(RequestFrame) {rf['blk_p50_med']:.2f}x"
        )
    print(
        "\nverdict (target: shm p50 within the limit of the prototype's, sent as the "
        "dispatcher sends)"
    )
    for v in verdicts:
        print("  " + v)


if __name__ == "__main__":
    main()
