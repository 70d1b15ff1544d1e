"""Runtime commands: ``serve``, ``expert-server``, ``attention-client``, ``tiny-model``, one
module each. Each command is a thin shell: it turns its flags into the process's options
object (:mod:`eaas.runtime.options`) and calls the module that does the work.

Imports of torch and of the serving modules stand inside the commands' functions (lazy):
every ``eaas`` command, ``eaas --help`` included, shares one process's start-up, and torch
alone takes seconds to import.
"""

from __future__ import annotations

import typer

from eaas.runtime.cli import attention_client, expert_server, serve, tiny_model
from eaas.runtime.cli.attention_client import client_id_of
from eaas.runtime.cli.expert_server import parse_cpu_list

__all__ = ["client_id_of", "parse_cpu_list", "register"]


def register(app: typer.Typer) -> None:
    """Add the runtime commands to the ``eaas`` app."""
    app.command("tiny-model")(tiny_model.tiny_model)
    app.command("expert-server")(expert_server.expert_server)
    app.command("attention-client")(attention_client.attention_client)
    app.command("serve")(serve.serve)
