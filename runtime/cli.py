"""Runtime commands: ``serve``, ``expert-server``, ``attention-client``, ``tiny-model``.

Each command is a thin shell: it parses options and calls the module that does the work.
"""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    app.command("tiny-model")(tiny_model)
    app.command("expert-server")(expert_server)
    app.command("attention-client")(attention_client)
    app.command("serve")(serve)


def tiny_model(out_dir: str = typer.Argument(..., help="Directory to write the checkpoint into.")) -> None:
    """Write the built-in tiny DeepSeek-V3-architecture checkpoint (random weights) to OUT_DIR."""
    from eaas.runtime.models.arch import read_model_info
    from eaas.runtime.models.tiny import write_tiny_model

    path = write_tiny_model(out_dir)
    info = read_model_info(path)
    typer.echo(
        f"wrote {path}: {info.architecture}, {info.num_layers} layers (MoE {list(info.moe_layers)}), "
        f"{info.num_experts} experts top-{info.top_k}, hidden {info.hidden_size}, vocab {info.vocab_size}"
    )


def expert_server(
    model: str = typer.Option(None, "--model", help="Checkpoint directory (default: the built-in tiny model)."),
    server_id: str = typer.Option("expert-server-0", "--server-id", help="Id of this server (routing table, logs)."),
    experts: str = typer.Option(
        None, "--experts", help="Hosted experts, e.g. '1:0-3,7;2:5' (layer:experts; default: all of the model)."
    ),
    listen: str = typer.Option(..., "--listen", help="unix:/path.sock (same host, shared memory) or tcp://host:port."),
    metrics_port: int = typer.Option(0, "--metrics-port", help="Serve Prometheus /metrics on this port (0: none)."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16."),
    threads: int = typer.Option(1, "--threads", help="torch intra-op threads (default 1)."),
    batch_window_us: float = typer.Option(0.0, "--batch-window-us", help="Extra gather time per dynamic batch."),
) -> None:
    """Run one expert server (the process an expert-server pod runs).

    Loads only the hosted experts' weights, then prints
    ``expert-server <id> ready on <endpoint> hosting <N> experts`` (stdout, flushed) once the
    socket accepts connections. SIGTERM/SIGINT stop it gracefully (Unix socket path unlinked).
    In multiprocess metrics mode (``PROMETHEUS_MULTIPROC_DIR`` set) no port is opened: the
    process only writes its metric files.
    """
    import torch

    from eaas.runtime.expert_server import ExpertServer, run
    from eaas.runtime.placement import parse_expert_spec

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise typer.BadParameter(f"--dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    if model is None:
        from eaas.runtime.models.tiny import default_model_dir

        model = str(default_model_dir())
    from eaas.runtime.models.arch import read_model_info
    from eaas.runtime.models.weights import load_expert_weights

    info = read_model_info(model)
    if experts:
        try:
            pairs = parse_expert_spec(experts)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        bad = [(l, e) for l, e in pairs if l not in info.moe_layers or not 0 <= e < info.num_experts]
        if bad:
            raise typer.BadParameter(
                f"--experts names {bad[:8]} outside the model (MoE layers {list(info.moe_layers)}, "
                f"{info.num_experts} experts per layer)"
            )
    else:
        pairs = [(l, e) for l in info.moe_layers for e in range(info.num_experts)]
    hosted = load_expert_weights(model, pairs, dtypes[dtype], progress=False)
    server = ExpertServer(
        listen, hosted, info.hidden_size, dtypes[dtype], server_id, num_threads=threads,
        batch_window_us=batch_window_us,
    )
    run(server, metrics_port)


def attention_client() -> None:
    """Run one attention client with the OpenAI-compatible API (the process a client pod runs)."""
    raise NotImplementedError


def serve() -> None:
    """Start a whole deployment on this machine: expert servers + attention clients."""
    raise NotImplementedError
