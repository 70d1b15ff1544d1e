"""The processes and engines of bench/decode_profile.py's comparisons: expert-server processes
(optionally under cProfile: ``python bench/decode_servers.py --_profiled-server ...``), the
paged engine over them or over local experts, per-step wall and CPU timing (``/proc/PID/stat``),
and ``set_sched_slice`` (the EEVDF scheduler slice of a process).
"""

from __future__ import annotations

import cProfile
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import torch

_NR_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}
_SCHED_ATTR = struct.Struct("IIQiIQQQII")  # struct sched_attr, SCHED_ATTR_SIZE_VER1 (56 bytes)


def set_sched_slice(pid: int, slice_us: float) -> None:
    """Set the scheduler time slice of every thread of process ``pid`` (0: this process).

    Linux >= 6.12 (EEVDF): a SCHED_OTHER task's ``sched_attr.sched_runtime`` is its slice
    (clamped by the kernel to 0.1-100 ms); a shorter slice gives a woken task an earlier
    virtual deadline, so it preempts a task with a longer slice sooner (``sched_setattr(2)``,
    kernel ``Documentation/scheduler/sched-eevdf.rst``). ``slice_us`` 0: the default slice.

    Raises:
        OSError: the kernel refused, or an architecture without a known syscall number.
    """
    import ctypes
    import errno
    import platform

    nr = _NR_SCHED_SETATTR.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"sched_setattr: no syscall number for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    pid = pid or os.getpid()
    for tid in (int(t) for t in os.listdir(f"/proc/{pid}/task")):
        nice = os.getpriority(os.PRIO_PROCESS, tid)
        attr = _SCHED_ATTR.pack(_SCHED_ATTR.size, 0, 0, nice, 0, int(slice_us * 1000), 0, 0, 0, 0)
        if libc.syscall(nr, tid, ctypes.create_string_buffer(attr), 0) != 0:
            err = ctypes.get_errno()
            if err != errno.ESRCH:  # (a thread that ended meanwhile)
                raise OSError(err, f"sched_setattr(thread {tid}): {os.strerror(err)}")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _profiled_server(argv: list[str]) -> None:
    """``--_profiled-server OUT MODEL ID SPEC ENDPOINT DTYPE THREADS SPIN_US [COMPUTE]``: an
    expert server (as ``eaas expert-server``) under cProfile (OUT ``-``: without); SIGTERM stops
    it and writes the stats to OUT. SPIN_US ``-``: the listener's default spin; COMPUTE its
    ``--cpu-bf16-compute`` (default auto)."""
    import signal

    from eaas.runtime.models.arch import read_model_info
    from eaas.runtime.models.compute import choose_compute
    from eaas.runtime.models.weights import load_expert_weights
    from eaas.runtime.server.server import ExpertServer
    from eaas.runtime.tables.expert_spec import parse_expert_spec

    out, model_dir, sid, spec, ep, dtype, threads, spin = argv[:8]
    policy = argv[8] if len(argv) > 8 else "auto"
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    info = read_model_info(model_dir)
    hosted = load_expert_weights(model_dir, parse_expert_spec(spec), dt, progress=False)
    kw = {} if spin == "-" else {"spin_us": float(spin)}
    torch.set_num_threads(int(threads))
    compute = choose_compute(dt, "cpu", policy, (32, info.hidden_size, info.moe_intermediate_size))
    server = ExpertServer(
        ep, hosted, info.hidden_size, dt, sid, num_threads=int(threads), compute=compute, **kw
    )
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    prof = cProfile.Profile(time.process_time)  # CPU time: where the server's CPU goes
    # SIGUSR1 starts the profile (the harness sends it once the prompts are prefilled)
    signal.signal(signal.SIGUSR1, lambda *_: prof.enable() if out != "-" else None)
    print(server.ready_line(), flush=True)
    server.serve_forever()
    if out != "-":
        prof.disable()
        prof.dump_stats(out)


def start_servers(
    model_dir: str,
    n: int,
    r: int,
    dtype: str,
    threads: int,
    run_dir: Path,
    profile: bool = False,
    spin_us: float | None = None,
    compute: str = "auto",
):
    """Start ``n`` ``eaas expert-server`` processes (placement as ``eaas serve``: every expert on
    ``r`` of them, shm endpoints in ``run_dir``, ``--cpu-bf16-compute compute``); wait for their
    ready lines.

    Returns:
        ``(procs, table)``: the processes and routing table version 1.
    """
    from eaas.runtime.models.arch import read_model_info
    from eaas.runtime.placement import place_experts
    from eaas.runtime.tables.expert_spec import format_expert_spec
    from eaas.runtime.tables.table import RoutingTable

    info = read_model_info(model_dir)
    placement = place_experts(info.moe_layers, info.num_experts, n, r)
    ids = [f"expert-{i}" for i in range(n)]
    endpoints = [f"unix:{run_dir / f'{sid}.sock'}" for sid in ids]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = []
    for s, (sid, ep) in enumerate(zip(ids, endpoints, strict=True)):
        spec = format_expert_spec(placement.servers[s])
        if profile or spin_us is not None:
            out = str(run_dir / f"{sid}.prof") if profile else "-"
            argv = [sys.executable, __file__, "--_profiled-server", out]
            argv += [model_dir, sid, spec, ep, dtype, str(threads)]
            argv += ["-" if spin_us is None else str(spin_us), compute]
        else:
            argv = [sys.executable, "-m", "eaas", "expert-server", "--model", model_dir]
            argv += ["--server-id", sid, "--experts", spec]
            argv += ["--listen", ep, "--dtype", dtype, "--threads", str(threads)]
            argv += ["--cpu-bf16-compute", compute]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, env=env, text=True))
    for p in procs:
        assert p.stdout is not None
        for line in p.stdout:
            if " ready on " in line:
                break
        else:
            raise RuntimeError(f"expert server exited with code {p.wait()}")
    return procs, RoutingTable.from_placement(placement, ids, endpoints, version=1)


def decode_engine(model, tok, args, label: str, overlap: bool = False):
    """An engine with ``--batch`` sequences prefilled and two warm-up decode steps done."""
    from eaas.runtime.client.engine import Engine

    eng = Engine(
        model,
        tok,
        client_id=label,
        max_num_batched_tokens=args.max_num_batched_tokens,
        double_batch_overlap=overlap,
    )
    into_decode(eng, tok, args)
    return eng


def into_decode(eng, tok, args) -> list:
    """Put ``--batch`` sequences of ``--prompt-tokens`` tokens into ``eng`` (any engine with
    ``submit`` / ``_step``), prefill them all and run two warm-up decode steps; returns the
    requests (cancel them to end the sequences)."""
    from eaas.runtime.client.engine import SamplingParams

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
    return reqs


def timed_steps(eng, steps: int, server_pids: list[int]) -> tuple[float, float, float]:
    """``(wall, client CPU, servers CPU)`` seconds of ``steps`` decode steps."""
    s0 = sum(cpu_seconds(p) for p in server_pids)
    c0, t0 = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        for _ in range(steps):
            eng._step()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu, sum(cpu_seconds(p) for p in server_pids) - s0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--_profiled-server"]:
        _profiled_server(sys.argv[2:])
    else:
        sys.exit("usage: decode_servers.py --_profiled-server OUT MODEL ID SPEC ENDPOINT ...")
