"""``eaas attention-client``: one attention client process (what an attention-client pod runs)."""

from __future__ import annotations

import os
import socket

import typer

from eaas.runtime.cli.common import (
    DEVICE_HELP,
    ApiKeyOption,
    CpuBf16Option,
    DtypeOption,
    ModelOption,
    NvshmemPeOption,
    NvshmemUidFileOption,
    NvshmemWorldOption,
    ThreadsOption,
    exit_now,
    nvshmem_world_config,
    options_from,
)
from eaas.runtime.options import AttentionClientOptions
from eaas.runtime.options import client_id_of as _client_id_of
from eaas.runtime.options.nvshmem_world import MembershipError, WorldConfig, claim_client_pe
from eaas.runtime.tables.table import RoutingTable
from eaas.runtime.tables.watch import parse_configmap_ref

# torch and the attention client's modules are imported inside the functions: `eaas --help`
# and the operator's commands must start without torch.


#: The flags' defaults are the options object's (one source of truth).
DEFAULT = AttentionClientOptions


def attention_client(
    ctx: typer.Context,
    model: ModelOption = None,
    routing_table: str = typer.Option(
        None,
        "--routing-table",
        help="Routing table JSON file; re-read when it changes (ConfigMap mount).",
    ),
    client_id: str = typer.Option(
        DEFAULT.client_id,
        "--client-id",
        help="Id of this attention client (frames, metrics, failure reports): an integer, or a "
        "name such as the pod name (the operator passes $(EAAS_POD_NAME)), mapped to a stable "
        "63-bit integer, so every replica of a fleet has its own id.",
    ),
    host: str = typer.Option(DEFAULT.host, "--host", help="API listen address."),
    port: int = typer.Option(DEFAULT.port, "--port", min=1, max=65535, help="API port."),
    reuse_port: bool = typer.Option(
        DEFAULT.reuse_port,
        "--reuse-port",
        help="Bind the API port with SO_REUSEPORT so several clients share it (eaas serve sets it).",
    ),
    dispatch_timeout: float = typer.Option(
        DEFAULT.dispatch_timeout,
        "--dispatch-timeout",
        help="Seconds (> 0) to wait for expert servers per MoE layer round.",
    ),
    local_experts: bool = typer.Option(
        DEFAULT.local_experts,
        "--local-experts",
        help="No expert servers: run the untouched model in-process (single-process baseline).",
    ),
    dtype: DtypeOption = DEFAULT.dtype,
    cpu_bf16_compute: CpuBf16Option = DEFAULT.cpu_bf16_compute,
    threads: ThreadsOption = DEFAULT.threads,
    served_model_name: str = typer.Option(
        None,
        "--served-model-name",
        help="Model id in the API (default: directory name); several ids separated by commas "
        "are aliases (the first is the one answers carry), as vLLM's list of names.",
    ),
    max_num_seqs: int = typer.Option(
        DEFAULT.max_num_seqs, "--max-num-seqs", help="Running sequences at most."
    ),
    routing_table_configmap: str = typer.Option(
        None,
        "--routing-table-configmap",
        help="NAMESPACE/NAME of the routing-table ConfigMap to watch through the Kubernetes API "
        "(in-cluster credentials or KUBECONFIG); newer versions are applied.",
    ),
    push_token_file: str = typer.Option(
        None,
        "--push-token-file",
        envvar="EAAS_PUSH_TOKEN_FILE",
        help="File with the bearer token (a mounted Secret) that PUT /routing-table requires and "
        "failure reports carry; without it pushes are refused (403).",
    ),
    failure_report_url: str = typer.Option(
        None,
        "--failure-report-url",
        help="POST a JSON report here when an expert server is marked down (background, bounded "
        "queue, dropped on overflow).",
    ),
    max_num_batched_tokens: int = typer.Option(
        DEFAULT.max_num_batched_tokens,
        "--max-num-batched-tokens",
        min=1,
        help="Tokens per forward (decode tokens + prefill chunks); longer prompts are chunked.",
    ),
    kv_cache_memory: str = typer.Option(
        None,
        "--kv-cache-memory",
        help="Preallocated paged KV cache, e.g. 512MiB or 2GiB (default: max-num-seqs full-length "
        "sequences, at most 4GiB; at least one full-length sequence).",
    ),
    device: str = typer.Option(DEFAULT.device, "--device", help=DEVICE_HELP),
    max_request_body: str = typer.Option(
        DEFAULT.max_request_body,
        "--max-request-body",
        help="Largest API request body; larger ones get 413 request_too_large.",
    ),
    prefill_tokens_while_decoding: str = typer.Option(
        DEFAULT.prefill_tokens_while_decoding,
        "--prefill-tokens-while-decoding",
        help="Prefill tokens at most in a step that also decodes: auto (a mixed step costs "
        "~2 decode steps, less on a noisy machine, from measured step times; a burst of prompts "
        "may hold the decodes within 0.5% of the gaps), off, or a token count.",
    ),
    double_batch_overlap: bool = typer.Option(
        DEFAULT.double_batch_overlap,
        "--double-batch-overlap",
        help="Decode steps of 2+ sequences run as two micro-batches: one's attention while the "
        "other's MoE round trip is in flight (same greedy tokens; docs/gpu.md).",
    ),
    cuda_graphs: bool = typer.Option(
        DEFAULT.cuda_graphs,
        "--cuda-graphs",
        help="Decode MoE round trips to cudaipc expert servers replay captured CUDA graphs "
        "(needs --device cuda and expert servers; docs/gpu.md).",
    ),
    spin_us: float = typer.Option(
        None,
        "--spin-us",
        min=0,
        help="shm / cudaipc: busy-poll for an expert server's answer at least this many "
        "microseconds before blocking (default 80; longer, up to 2 ms, when recent round trips "
        "took longer and the client and the servers it waits on fit on the CPUs). 0: block at "
        "once, never busy-poll (shm; cudaipc keeps its adaptive spin while a core is free for "
        "it) (pays on cores oversubscribed by other work; docs/serving.md).",
    ),
    api_key: ApiKeyOption = None,
    nvshmem_world: NvshmemWorldOption = None,
    nvshmem_pe: NvshmemPeOption = None,
    nvshmem_uid_file: NvshmemUidFileOption = None,
    nvshmem_client_pes: int = typer.Option(
        None,
        "--nvshmem-client-pes",
        envvar="EAAS_NVSHMEM_CLIENT_PES",
        help="Instead of --nvshmem-pe: claim a free client PE 0..N-1 next to the uid file "
        "(identical pods of a Deployment; a restarted pod gets its PE back).",
    ),
) -> None:
    """Run one attention client with the OpenAI-compatible API (the process a client pod runs).

    Prints ``attention-client <id> ready on http://HOST:PORT ...`` once serving.
    """
    options = options_from(AttentionClientOptions, ctx)
    world_cfg = _check_environment(options)
    cid = options.numeric_client_id
    if str(cid) != options.client_id.strip():
        given = options.client_id
        typer.echo(f"attention-client: --client-id {given!r} is client id {cid}", err=True)
    from eaas.runtime.client.main import run_attention_client

    run_attention_client(options, world_cfg)
    exit_now(f"attention-client {cid}")


def client_id_of(value: str) -> int:
    """:func:`eaas.runtime.options.client_id_of` with a bad value as a usage error.

    Raises:
        typer.BadParameter: ``value`` is empty or an integer outside ``[0, 2**63)`` (exit 2).
    """
    try:
        return _client_id_of(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _check_environment(o: AttentionClientOptions) -> WorldConfig | None:
    """What :class:`AttentionClientOptions` cannot check without this machine and the heavy
    modules, before any weight loads: the NVSHMEM world (claiming a client PE), the
    routing-table ConfigMap reference and file, the sizes, the prefill cap, the CPU bf16
    policy, the device. Returns the NVSHMEM world to join (None: none).

    Raises:
        typer.BadParameter: naming the flag (exit code 2).
    """
    pe = o.nvshmem_pe
    if o.nvshmem_client_pes is not None:
        pe = _claim_client_pe(o.nvshmem_world, pe, o.nvshmem_uid_file, o.nvshmem_client_pes)
    world_cfg = nvshmem_world_config(o.nvshmem_world, pe, o.nvshmem_uid_file)
    if world_cfg is not None and o.local_experts:
        raise typer.BadParameter(
            "--nvshmem-world connects to expert servers; not with --local-experts"
        )
    if o.routing_table_configmap:
        try:
            parse_configmap_ref(o.routing_table_configmap)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
    if o.routing_table:
        _check_routing_table_file(o.routing_table)
    from eaas.runtime.client.budgets import parse_prefill_cap
    from eaas.runtime.client.graphs import check_cuda_graphs
    from eaas.runtime.client.kv_cache import parse_memory_size
    from eaas.runtime.cuda.device import check_world_device, resolve_device
    from eaas.runtime.models.compute import check_policy

    try:
        if o.kv_cache_memory is not None:
            parse_memory_size(o.kv_cache_memory)
        try:
            parse_memory_size(o.max_request_body)
        except ValueError as e:
            raise ValueError(f"--max-request-body: {e}") from None
        parse_prefill_cap(o.prefill_tokens_while_decoding)
        check_policy(o.cpu_bf16_compute)
        dev = resolve_device(o.device)
        if world_cfg is not None:
            check_world_device(dev.type)
        if o.cuda_graphs:
            check_cuda_graphs(dev.type, o.local_experts)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    return world_cfg


def _claim_client_pe(world_size, pe, uid_file, client_pes: int) -> int:
    """``--nvshmem-client-pes``: this client's PE, claimed next to the uid file
    (:func:`eaas.runtime.options.nvshmem_world.claim_client_pe`, holder = ``HOSTNAME``).
    Nothing is claimed where the world cannot be joined.

    Raises:
        typer.BadParameter: with ``--nvshmem-pe``, without the world size / uid file, a count
            outside ``1 .. world-1``, no nvshmem4py / GPU here, or no free client PE.
    """
    from eaas.runtime.transport.nvshmem import nvshmem_unavailable_reason

    if pe is not None:
        raise typer.BadParameter("give --nvshmem-pe or --nvshmem-client-pes, not both")
    if world_size is None or not uid_file:
        raise typer.BadParameter(
            "--nvshmem-client-pes needs --nvshmem-world and --nvshmem-uid-file"
        )
    if not 1 <= client_pes < world_size:
        raise typer.BadParameter(
            f"--nvshmem-client-pes must be in 1..{world_size - 1} (--nvshmem-world "
            f"{world_size}), got {client_pes}"
        )
    reason = nvshmem_unavailable_reason()
    if reason is not None:
        raise typer.BadParameter(f"--nvshmem-world: {reason}")
    holder = os.environ.get("HOSTNAME") or socket.gethostname()
    try:
        return claim_client_pe(uid_file, client_pes, holder)
    except (ValueError, MembershipError, OSError) as e:
        raise typer.BadParameter(f"--nvshmem-client-pes: {e}") from None


def _check_routing_table_file(path: str) -> None:
    """Read and parse ``--routing-table`` once at start-up.

    Raises:
        typer.BadParameter: the file cannot be read or is not a valid routing table (exit 2).
    """
    try:
        with open(path, encoding="utf-8") as f:
            RoutingTable.from_json(f.read())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise typer.BadParameter(f"--routing-table {path}: {e}") from None
