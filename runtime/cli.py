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
    raise NotImplementedError


def expert_server() -> None:
    """Run one expert server (the process an expert-server pod runs)."""
    raise NotImplementedError


def attention_client() -> None:
    """Run one attention client with the OpenAI-compatible API (the process a client pod runs)."""
    raise NotImplementedError


def serve() -> None:
    """Start a whole deployment on this machine: expert servers + attention clients."""
    raise NotImplementedError
