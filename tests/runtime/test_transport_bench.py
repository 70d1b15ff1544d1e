"""bench/transport_bench.py's own parts: the side-by-side ratio summary behind its verdict (pure
logic on made-up latencies) and a short real run (echo server processes, the prototype, an old
copy of shm.py as the reference kind) that must echo every payload and print a verdict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import transport_bench

ROOT = Path(__file__).resolve().parents[2]

BENCH = ROOT / "bench" / "transport_bench.py"


def test_ratio_summary_pools_latencies_and_reports_per_block_quartiles():
    # 4 blocks of 100 round trips: the prototype at 10 us, the kind at 11, 12, 13, 14 us
    base = [[10e-6] * 100 for _ in range(4)]
    kind = [[v * 1e-6] * 100 for v in (11, 12, 13, 14)]
    r = transport_bench.ratio_summary(kind, base)
    assert r["p50"] == pytest.approx(1.3)  # pooled median of 400 values: the third block's 13
    assert r["mean"] == pytest.approx(1.25)
    assert r["blk_p50_lo"] == pytest.approx(1.2)  # sorted per-block ratios 1.1 1.2 1.3 1.4
    assert r["blk_p50_med"] == pytest.approx(1.3)
    assert r["blk_p50_hi"] == pytest.approx(1.4)
    # a rare slow round trip in one block shows in that block's p99, not in the medians
    kind[0] = [11e-6] * 97 + [5e-3] * 3
    r = transport_bench.ratio_summary(kind, base)
    assert r["blk_p50_lo"] == pytest.approx(1.2)
    assert r["blk_p99_hi"] == pytest.approx(500.0)
    assert r["p99"] == pytest.approx(1.4)  # 3 of 400 pooled round trips are below 1%


def test_ratio_summary_needs_as_many_blocks_as_the_prototype():
    with pytest.raises(ValueError):
        transport_bench.ratio_summary([[1.0]], [[1.0], [1.0]])


def test_short_run_echoes_every_kind_and_prints_a_verdict(tmp_path):
    ref = tmp_path / "shm_ref.py"
    ref.write_text((ROOT / "runtime" / "transport" / "shm.py").read_text())
    p = subprocess.run(
        [sys.executable, str(BENCH), "--payload", "2x64:float32", "--iters", "60"]
        + ["--blocks", "3", "--warmup", "5", "--cpus", "none", "--ref-shm", str(ref)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    for kind in ("proto", "shm", "ref"):
        assert "2x64 float32" in out and f" {kind} " in out.replace("\n", " "), out
    assert "shm/proto" in out and "ref/proto" in out
    assert "verdict" in out and "2x64 float32: shm/proto p50" in out
    assert ("met" in out.split("verdict")[1]) or ("missed" in out.split("verdict")[1])


@pytest.mark.parametrize(
    "args, names",
    [
        (["--payload", "1x64:float64"], "--payload"),
        (["--iters", "5", "--blocks", "10"], "--iters"),
        (["--ref-shm", "/nonexistent/shm.py"], "--ref-shm"),
    ],
)
def test_bad_options_exit_naming_the_option(args, names):
    p = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120
    )
    assert p.returncode != 0
    assert names in p.stderr, p.stderr


def test_profile_times_every_step_of_every_kind(tmp_path):
    ref_path = tmp_path / "shm_ref.py"
    ref_path.write_text((ROOT / "runtime" / "transport" / "shm.py").read_text())
    ref = transport_bench._load_module(str(ref_path))
    res = transport_bench.profile_segments(2, 64, 4, transport_bench.torch.float32, 2, ref)
    assert set(res) == {"proto", "shm", "ref"}
    for kind in ("shm", "ref"):
        for seg in transport_bench.SEGMENTS:
            assert len(res[kind][seg]) == 200 and min(res[kind][seg]) > 0, (kind, seg)
    # the prototype has no frame objects: only its copies and stores are timed
    assert res["proto"]["frame"] == [] and len(res["proto"]["send"]) == 200


def test_send_parts_is_measured_only_where_the_class_has_its_own():
    """``shm`` through its own ``send_parts`` (as the dispatcher sends); tcp, and an older
    ``shm.py`` whose class only inherits the base default (which builds a frame and calls
    ``send``), through ``send``."""
    from eaas.runtime.transport.shm import ShmClientConnection
    from eaas.runtime.transport.tcp import TcpClientConnection

    assert transport_bench._own_send_parts(object.__new__(ShmClientConnection))
    assert not transport_bench._own_send_parts(object.__new__(TcpClientConnection))

    class OldShm(ShmClientConnection):  # as a shm.py before send_parts: the base default
        from eaas.runtime.transport.base import ClientConnection

        send_parts = ClientConnection.send_parts

    assert not transport_bench._own_send_parts(object.__new__(OldShm))
