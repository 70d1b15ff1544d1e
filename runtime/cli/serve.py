"""``eaas serve``: a whole deployment on this machine (expert servers + attention clients)."""

from __future__ import annotations

import os
import sys

import typer

from eaas.runtime.cli.common import CPU_BF16_HELP
from eaas.runtime.options import check_dispatch_timeout
from eaas.runtime.placement import PlacementError

# The deployment's module (it imports torch to check options up front) is imported inside the
# command: `eaas --help` and the operator's commands must start without torch.


def serve(
    expert_servers: int = typer.Option(
        4, "--expert-servers", help="Expert server processes (any count >= replicas)."
    ),
    replicas: int = typer.Option(
        2, "--replicas", help="Replicas of every logical expert, on distinct servers."
    ),
    attention_clients: int = typer.Option(
        1, "--attention-clients", help="Attention client processes sharing the API port."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="API listen address."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="API port."),
    model: str = typer.Option(
        None,
        "--model",
        help="Checkpoint directory (default: built-in tiny model, built on first use).",
    ),
    transport: str = typer.Option(
        "shm", "--transport", help="shm (same-host shared memory) or tcp."
    ),
    dispatch_timeout: float = typer.Option(
        5.0, "--dispatch-timeout", help="Clients' deadline per MoE layer round (s, > 0)."
    ),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    cpu_bf16_compute: str = typer.Option(
        "auto",
        "--cpu-bf16-compute",
        help="Every process's --cpu-bf16-compute (auto, native, fp32): " + CPU_BF16_HELP,
    ),
    client_threads: int = typer.Option(
        1, "--client-threads", min=0, help="torch threads per attention client (0: torch default)."
    ),
    server_threads: int = typer.Option(
        1, "--server-threads", min=0, help="torch threads per expert server (0: torch default)."
    ),
    kv_cache_memory: str = typer.Option(
        None, "--kv-cache-memory", help="Each attention client's KV cache, e.g. 512MiB."
    ),
    max_num_batched_tokens: int = typer.Option(
        512, "--max-num-batched-tokens", min=1, help="Each attention client's tokens per forward."
    ),
    client_device: str = typer.Option(
        "auto", "--client-device", help="Attention clients' device: auto, cpu, cuda, cuda:N."
    ),
    double_batch_overlap: bool = typer.Option(
        False,
        "--double-batch-overlap",
        help="Attention clients' --double-batch-overlap (decode as two overlapped micro-batches).",
    ),
    server_device: str = typer.Option(
        "cpu",
        "--server-device",
        help="Expert servers' --device: cpu (default), auto, cuda or cuda:N (cuda: the native "
        "grouped kernels; frames still travel through host shared memory or TCP).",
    ),
    prefill_tokens_while_decoding: str = typer.Option(
        "auto",
        "--prefill-tokens-while-decoding",
        help="Attention clients' --prefill-tokens-while-decoding (auto, off or a token count).",
    ),
    client_spin_us: str = typer.Option(
        "default",
        "--client-spin-us",
        help="Attention clients' --spin-us (shm): default (the transport's busy-poll) or "
        "microseconds; 0 blocks at once (docs/serving.md: better only under heavy load).",
    ),
    server_sched_policy: str = typer.Option(
        "batch",
        "--server-sched-policy",
        help="Expert servers' --sched-policy: batch (default: a woken server does not preempt "
        "the attention client that woke it) or other.",
    ),
    server_cpus: str = typer.Option(
        "auto",
        "--server-cpus",
        help="auto: pin each expert server to one CPU (its --cpus), the servers one decode call "
        "reaches on different CPUs (with >= 2 servers and CPUs and --server-threads 1); "
        "none: not pinned.",
    ),
) -> None:
    """Start a whole deployment on this machine: expert servers + attention clients."""
    try:
        check_dispatch_timeout(dispatch_timeout)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    from eaas.runtime.serve import serve as run_serve

    try:
        code = run_serve(
            model_dir=model,
            expert_servers=expert_servers,
            replicas=replicas,
            attention_clients=attention_clients,
            host=host,
            port=port,
            transport=transport,
            dispatch_timeout=dispatch_timeout,
            dtype=dtype,
            cpu_bf16_compute=cpu_bf16_compute,
            client_threads=client_threads,
            server_threads=server_threads,
            kv_cache_memory=kv_cache_memory,
            max_num_batched_tokens=max_num_batched_tokens,
            client_device=client_device,
            server_device=server_device,
            double_batch_overlap=double_batch_overlap,
            prefill_tokens_while_decoding=prefill_tokens_while_decoding,
            client_spin_us=client_spin_us,
            server_cpus=server_cpus,
            server_sched_policy=server_sched_policy,
        )
    except (PlacementError, ValueError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc)) from None
    # Every child is stopped and the run directory removed: skip the seconds of interpreter
    # teardown (serve imported torch to check the port), as the children do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
