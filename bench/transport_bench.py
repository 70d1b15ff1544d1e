"""Round-trip latency of the expert-server transports: shared memory (unix:) vs TCP.

One client process, one echo server process (answers every frame with its hidden states, so
the payload travels both ways, as in the paper's "(batch, 7168) bf16, send and return"
measurement; no expert compute). Reports p50 / p99 / mean in microseconds per (tokens, hidden,
dtype) payload and the TCP/shm ratio.

    python bench/transport_bench.py                       # default payloads
    python bench/transport_bench.py --iters 2000 --payload 128x7168:bfloat16 --payload 1x256:float32
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def serve(endpoint: str, hidden: int, dtype: str, spin_us: float) -> None:
    """Echo server loop (runs in the child process)."""
    import signal

    from eaas.runtime.transport.base import STATUS_OK, ResponseFrame
    from eaas.runtime.transport.factory import listen

    torch.set_num_threads(1)
    lst = listen(endpoint, hidden_size=hidden, dtype=DTYPES[dtype], spin_us=spin_us)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print(f"ready {lst.endpoint}", flush=True)
    try:
        while not stop:
            for conn, f in lst.poll(0.2):
                lst.respond(conn, ResponseFrame(f.seq, f.layer, STATUS_OK, f.hidden))
    finally:
        lst.close()


def _start(endpoint: str, hidden: int, dtype: str, spin_us: float) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve",
            endpoint,
            "--hidden",
            str(hidden),
            "--dtype",
            dtype,
            "--spin-us",
            str(spin_us),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = p.stdout.readline().split()
    if not line or line[0] != "ready":
        p.kill()
        raise RuntimeError("echo server failed to start")
    return p, line[1]


def measure(
    endpoint: str,
    tokens: int,
    hidden: int,
    dtype: torch.dtype,
    k: int,
    iters: int,
    warmup: int,
    bar,
    spin_us: float,
) -> list[float]:
    from eaas.runtime.transport.base import RequestFrame
    from eaas.runtime.transport.factory import connect

    c = connect(
        endpoint,
        "echo",
        hidden_size=hidden,
        dtype=dtype,
        max_tokens=tokens,
        max_k=k,
        spin_us=spin_us,
    )
    h = torch.randn(tokens, hidden).to(dtype)
    ex = torch.zeros(tokens, k, dtype=torch.int32)
    w = torch.ones(tokens, k)
    out = torch.empty_like(h)
    lat = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        c.send(RequestFrame(1, 0, 1, i, h, ex, w))
        r = c.recv(time.monotonic() + 10)
        out.copy_(r.output)  # a real client copies out of the transport buffer
        dt = time.perf_counter() - t0
        if i >= warmup:
            lat.append(dt)
            bar.update(1)
    c.close()
    assert torch.equal(out, h)
    return lat


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument(
        "--payload",
        action="append",
        help="TOKENSxHIDDEN:DTYPE (repeatable); default 1x256:float32, 128x7168:bfloat16",
    )
    ap.add_argument("--k", type=int, default=8, help="expert entries per token in the frame")
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument(
        "--spin-us", type=float, default=80.0, help="busy-poll before blocking (both sides)"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads in the client (copies)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.serve:
        serve(a.serve, a.hidden, a.dtype, a.spin_us)
        return

    from tqdm import tqdm

    payloads = []
    for spec in a.payload or ["1x256:float32", "128x7168:bfloat16"]:
        shape, _, dt = spec.partition(":")
        n, hdim = (int(x) for x in shape.lower().split("x"))
        payloads.append((n, hdim, dt or "bfloat16"))
    results = {}
    tmp = tempfile.mkdtemp(prefix="eaas-bench-")
    total = len(payloads) * 2 * a.iters
    with tqdm(total=total, desc="round trips", unit="rt", mininterval=1.0) as bar:
        for n, hdim, dt in payloads:
            for kind in ("shm", "tcp"):
                ep = f"unix:{tmp}/echo.sock" if kind == "shm" else "tcp://127.0.0.1:0"
                p, ep = _start(ep, hdim, dt, a.spin_us)
                try:
                    results[(n, hdim, dt, kind)] = measure(
                        ep, n, hdim, DTYPES[dt], a.k, a.iters, a.warmup, bar, a.spin_us
                    )
                finally:
                    p.terminate()
                    p.wait(10)
    os.rmdir(tmp) if not os.listdir(tmp) else None
    print()
    print(
        f"{'payload':<24}{'MB/way':>8}{'transport':>11}{'p50 us':>10}{'p99 us':>10}{'mean us':>10}"
    )
    for n, hdim, dt in payloads:
        mb = n * hdim * torch.empty((), dtype=DTYPES[dt]).element_size() / 1e6
        for kind in ("shm", "tcp"):
            lat = results[(n, hdim, dt, kind)]
            print(
                f"{f'{n}x{hdim} {dt}':<24}{mb:>8.3f}{kind:>11}{_pct(lat, 0.5) * 1e6:>10.1f}"
                f"{_pct(lat, 0.99) * 1e6:>10.1f}{sum(lat) / len(lat) * 1e6:>10.1f}"
            )
        s, t = results[(n, hdim, dt, "shm")], results[(n, hdim, dt, "tcp")]
        print(
            f"{'':<24}{'':>8}{'tcp/shm':>11}{_pct(t, 0.5) / _pct(s, 0.5):>10.2f}{_pct(t, 0.99) / _pct(s, 0.99):>10.2f}"
            f"{sum(t) / sum(s):>10.2f}"
        )


if __name__ == "__main__":
    main()
