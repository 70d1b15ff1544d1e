"""The options of one ``eaas serve`` process (a whole deployment on this machine).

Built once by the CLI from its flags and validated at construction, before any process starts;
:class:`~eaas.runtime.serve.Deployment` derives every child's
:class:`~.server.ExpertServerOptions` / :class:`~.client.AttentionClientOptions` from it.
Torch-free.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field

from eaas.runtime.common.dtypes import check_serving_dtype
from eaas.runtime.options.api_key import check_api_keys
from eaas.runtime.options.client import check_dispatch_timeout, check_served_model_name
from eaas.runtime.options.server import check_cpu_kernel
from eaas.runtime.options.vllm import SERVE_OWNED_VLLM_FLAGS, vllm_flag_in


def parse_client_spin(value: str | float | None) -> float | None:
    """``--client-spin-us``: None / ``"default"`` (the transport's own busy-poll) or a number of
    microseconds >= 0 (0: block at once).

    Raises:
        ValueError: anything else, naming ``--client-spin-us``.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() == "default"):
        return None
    try:
        us = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"--client-spin-us must be default or microseconds >= 0, got {value!r}"
        ) from None
    if not us >= 0 or math.isinf(us):
        raise ValueError(f"--client-spin-us must be default or microseconds >= 0, got {value!r}")
    return us


@dataclass(kw_only=True)
class ServeOptions:
    """Everything ``eaas serve`` is started with (field ``x_y`` is flag ``--x-y``; the flags'
    help in :mod:`eaas.runtime.cli.serve` says what each does).

    Attributes:
        model: checkpoint directory (None: the built-in tiny model, built on first use).
        expert_servers: ``N`` (>= replicas); replicas: ``R`` per logical expert, on distinct
            servers; attention_clients: ``M``, sharing the API port ``host:port``.
        transport: ``"shm"`` (Unix socket + memfd shared memory) or ``"tcp"``.
        dispatch_timeout: the clients' deadline per MoE layer round, seconds.
        dtype, cpu_bf16_compute: every process's ``--dtype`` / ``--cpu-bf16-compute``.
        client_threads / server_threads: torch intra-op threads per process (0: torch default).
        client_device / server_device: the clients' / servers' ``--device``.
        kv_cache_memory, max_num_batched_tokens, double_batch_overlap,
        prefill_tokens_while_decoding: the attention clients' flags of those names.
        client_spin_us: the clients' ``--spin-us`` (shm only): None / ``"default"`` or
            microseconds >= 0; :attr:`spin_us` is the parsed value.
        server_sched_policy: the expert servers' ``--sched-policy`` (``batch`` or ``other``).
        server_cpu_kernel: the expert servers' ``--cpu-kernel`` (``auto``, ``torch``, ``vllm``).
        server_cpus: ``"auto"`` (pin each expert server to one CPU) or ``"none"``.
        restart_expert_servers: start an exited expert server again (with back-off) and put it
            back into the routing table once it serves.
        restart_attention_clients: start an exited attention client (or ``vllm serve``) again
            with the same back-off; without it, serve exits once no client is left.
        engine: ``"eaas"`` (the attention clients of this repository) or ``"vllm"`` (one
            ``vllm serve`` with the eaas.vllm plugin instead of them: docs/vllm.md).
        vllm: the ``vllm`` command ``--engine vllm`` runs (a path or a name on ``PATH``).
        vllm_args: more ``vllm serve`` arguments (one string, split like a shell does).
        served_model_name: the clients' ``--served-model-name`` (the model id in the API).
        api_key: the attention clients' API keys (``--api-key`` / ``$EAAS_API_KEY``), handed
            to them in their environment, never on their command line.

    Raises (at construction):
        ValueError: a bad ``--expert-servers``, ``--replicas`` (also more than
            ``--expert-servers``), ``--transport``, ``--attention-clients``, ``--server-cpus``,
            ``--dtype``, ``--port``, ``--client-device``, ``--max-num-batched-tokens``,
            ``--dispatch-timeout`` or ``--client-spin-us`` (also with ``--transport tcp``); the
            message names the flag. What needs torch or this machine (devices, sizes, the
            port being free, the placement) :class:`~eaas.runtime.serve.Deployment` checks.
    """

    model: str | None = None
    expert_servers: int = 4
    replicas: int = 2
    attention_clients: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    transport: str = "shm"
    dispatch_timeout: float = 5.0
    dtype: str = "float32"
    cpu_bf16_compute: str = "auto"
    client_threads: int = 1
    server_threads: int = 1
    kv_cache_memory: str | None = None
    max_num_batched_tokens: int = 512
    client_device: str = "auto"
    double_batch_overlap: bool = False
    server_device: str = "cpu"
    server_cpu_kernel: str = "auto"
    prefill_tokens_while_decoding: str = "auto"
    client_spin_us: str | float | None = "default"
    server_sched_policy: str = "batch"
    server_cpus: str = "auto"
    restart_expert_servers: bool = True
    restart_attention_clients: bool = True
    engine: str = "eaas"
    vllm: str = "vllm"
    vllm_args: str = ""
    served_model_name: str | None = None
    api_key: tuple[str, ...] = field(default=(), metadata={"flag": False}, repr=False)

    def __post_init__(self) -> None:
        self.api_key = check_api_keys(self.api_key)
        check_dispatch_timeout(self.dispatch_timeout)
        if self.transport not in ("shm", "tcp"):
            raise ValueError(f"--transport must be shm or tcp, got {self.transport!r}")
        if self.expert_servers < 1:
            raise ValueError(f"--expert-servers must be >= 1, got {self.expert_servers}")
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        if self.replicas > self.expert_servers:
            raise ValueError(
                f"--replicas ({self.replicas}) cannot exceed --expert-servers "
                f"({self.expert_servers}): the replicas of one expert run on distinct servers"
            )
        if self.attention_clients < 1:
            raise ValueError("--attention-clients must be >= 1")
        check_cpu_kernel(self.server_cpu_kernel, "--server-cpu-kernel")
        if self.server_cpus not in ("auto", "none"):
            raise ValueError(f"--server-cpus must be auto or none, got {self.server_cpus!r}")
        check_serving_dtype(self.dtype)
        check_served_model_name(self.served_model_name)
        if not 1 <= self.port <= 65535:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.client_device):
            raise ValueError(
                f"--client-device must be auto, cpu, cuda or cuda:N, got {self.client_device!r}"
            )
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.spin_us is not None and self.transport != "shm":  # spin_us: ValueError if bad
            raise ValueError("--client-spin-us acts on --transport shm only")
        if self.engine not in ("eaas", "vllm"):
            raise ValueError(f"--engine must be eaas or vllm, got {self.engine!r}")
        try:
            vllm_args = shlex.split(self.vllm_args)
        except ValueError as exc:
            raise ValueError(f"--vllm-args: {exc}") from None
        for arg in vllm_args:
            owned = vllm_flag_in(arg, SERVE_OWNED_VLLM_FLAGS)
            if owned == "--":
                raise ValueError("--vllm-args: a bare -- would end vllm serve's flags")
            if owned:
                raise ValueError(
                    f"--vllm-args: {arg!r} sets vllm serve's {owned}, which serve sets itself "
                    f"(use serve's own {owned})"
                )
        if self.vllm_args and self.engine != "vllm":
            raise ValueError("--vllm-args acts with --engine vllm only")
        if self.engine == "vllm" and (self.attention_clients != 1 or self.double_batch_overlap):
            raise ValueError(
                "--engine vllm runs one vllm serve: --attention-clients must be 1 and "
                "--double-batch-overlap is the eaas engine's"
            )

    @property
    def spin_us(self) -> float | None:
        """:func:`parse_client_spin` of ``client_spin_us`` (None: the transport's default)."""
        return parse_client_spin(self.client_spin_us)
