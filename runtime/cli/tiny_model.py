"""``eaas tiny-model``: write the built-in tiny checkpoint."""

from __future__ import annotations

import typer

# The model modules (torch, transformers) are imported inside the command: `eaas --help` and
# the operator's commands must start without torch.


def tiny_model(
    out_dir: str = typer.Argument(..., help="Directory to write the checkpoint into."),
) -> None:
    """Write the built-in tiny DeepSeek-V3-architecture checkpoint (random weights) to OUT_DIR."""
    from eaas.runtime.models.arch import read_model_info
    from eaas.runtime.models.tiny import write_tiny_model

    path = write_tiny_model(out_dir)
    info = read_model_info(path)
    typer.echo(
        f"wrote {path}: {info.architecture}, {info.num_layers} layers (MoE {list(info.moe_layers)}), "
        f"{info.num_experts} experts top-{info.top_k}, hidden {info.hidden_size}, vocab {info.vocab_size}"
    )
