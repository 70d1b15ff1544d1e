"""Add / drop cycles on an expert server that learns its experts from pushed routing tables,
under load, real processes (the CPU :class:`~eaas.runtime.expert_server.LayerStack` path).

``s0`` hosts every expert of layer 1 (``--experts``); ``s1`` starts empty with
``--push-token-file`` and is pushed table after table: hosted ids with gaps, a single expert,
nothing; each version released at once so the older experts go. A background thread keeps
dispatching layer calls, short ones and ones of more than 1024 token-expert pairs (the per-expert
loop past ``GROUPED_MM_MAX_PAIRS``), on a table that names ``s1`` for every expert (pairs it does
not host come back ``STATUS_NOT_HOSTED`` and go to ``s0``): every result equals the local
reference, ``/health`` follows each table, and ``s1``'s memory (PSS) does not grow with the
number of cycles.
"""

from __future__ import annotations

import threading

import pytest
import torch
from srv_helpers import INTER, SEED, reference, wait_until
from test_live_assignment import LAYER, SPEC, TOKEN, _http, _table

from eaas.runtime.client.dispatch import Dispatcher

pytestmark = pytest.mark.elastic

HIDDEN_BIG = 512  # 4 experts x 3 x 512 x 48 fp32 = 1.2 MB per full set: a leak shows in PSS
ASSIGNMENTS = [(0, 2, 3), (1,), (0, 3), (), (0, 1, 2, 3), (2,)]  # gaps, one expert, none, all


def _start_big(tmp_path, sid: str, extra: list[str]):
    import subprocess
    import sys

    from srv_helpers import free_port

    sock = f"unix:{tmp_path}/{sid}.sock"
    port = free_port()
    cmd = [sys.executable, "-m", "eaas.runtime.expert_server", "--listen", sock]
    cmd += ["--random", f"{HIDDEN_BIG}:{INTER}:{SEED}", "--server-id", sid]
    cmd += ["--http-port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    assert "ready on" in line, f"{sid} did not start: {line!r}"
    return proc, sock, port


def _pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise AssertionError(f"no Pss in /proc/{pid}/smaps_rollup")


def _batch(seed: int, T: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, HIDDEN_BIG, generator=g)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(T)])  # (T, 2)
    return hidden, idx, torch.rand(T, 2, generator=g)


def test_add_drop_cycles_under_load_keep_results_health_and_memory(tmp_path):
    tok = tmp_path / "token"
    tok.write_text(TOKEN + "\n")
    procs = []
    try:
        p0, ep0, _ = _start_big(tmp_path, "s0", ["--experts", SPEC])
        procs.append(p0)
        p1, ep1, port = _start_big(tmp_path, "s1", ["--push-token-file", str(tok)])
        procs.append(p1)
        eps = {"s0": ep0, "s1": ep1}
        version = [0]

        def push(hosted_on_s1: tuple[int, ...]) -> None:
            version[0] += 1
            v = version[0]
            reps = [("s0", "s1") if e in hosted_on_s1 else ("s0",) for e in range(4)]
            code, body = _http("PUT", port, "/routing-table", _table(v, eps, reps).to_json())
            assert code == 202, body
            assert wait_until(
                lambda: _http("GET", port, "/routing-table")[1]["weights_version"] == v, 60
            )
            code, body = _http("POST", port, "/routing-table/release", {"version": v})
            assert code == 200, body
            assert wait_until(
                lambda: _http("GET", port, "/health")[1]["experts"] == len(hosted_on_s1), 60
            ), (v, hosted_on_s1, _http("GET", port, "/health")[1])

        push(())
        d = Dispatcher(0, HIDDEN_BIG, torch.float32, _table(1, eps, [("s0", "s1")] * 4), timeout=60)
        errors: list[BaseException] = []
        calls = [0]
        stop = threading.Event()

        def traffic() -> None:
            seed = 0
            while not stop.is_set():
                hidden, idx, w = _batch(seed, 600 if seed % 4 == 0 else 8)  # 1200 or 16 pairs
                try:
                    out = d.dispatch(LAYER, hidden, idx, w)
                    want = reference(LAYER, hidden, idx, w, spec=SPEC)
                    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)
                    return
                calls[0] += 1
                seed += 1

        t = threading.Thread(target=traffic, daemon=True)
        t.start()
        try:
            assert wait_until(lambda: calls[0] >= 4, 60)
            for a in ASSIGNMENTS:  # warm-up round: the allocator reaches its working set
                push(a)
            base = _pss_kib(p1.pid)
            for _ in range(4):
                for a in ASSIGNMENTS:
                    before = calls[0]
                    push(a)
                    assert wait_until(lambda b=before: calls[0] >= b + 2 or bool(errors), 120)
            grown = _pss_kib(p1.pid) - base
            assert _http("GET", port, "/health")[0] == 200
        finally:
            stop.set()
            t.join(60)
            d.close()
        assert not errors, errors[0]
        assert d.health()["servers"]["s1"]["state"] != "down"
        # 24 pushes of up to 1.2 MB of weights each: a leak of the old stacks would be ~30 MB
        assert grown < 8 * 1024, f"s1 PSS grew by {grown} KiB over 24 add/drop cycles"
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except Exception:  # noqa: BLE001
                p.kill()
