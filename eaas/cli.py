"""``eaas`` command line. Each command's options live next to the code it runs:
runtime commands in :mod:`eaas.runtime.cli`, operator commands in :mod:`eaas.operator.cli`, the
local Kubernetes testbed (test infrastructure) in :mod:`eaas.testbed.cli`.
Heavy imports (torch, transformers, kubernetes) happen inside the commands, so ``eaas --help``,
``eaas --version`` and the operator's commands never import torch.

A command whose extra is not installed (``pip install 'eaas[runtime]'`` for serving,
``'eaas[operator]'`` for the operator) stops with one line saying which extra to install.
"""

from __future__ import annotations

import sys

import typer

from eaas import __version__
from eaas.operator.cli import register as _register_operator
from eaas.runtime.cli import register as _register_runtime
from eaas.testbed.cli import register as _register_testbed

HELP = """Expert-as-a-Service: serve MoE LLMs with every expert as a stateless service.

\b
Example: a whole deployment on this machine, then (from a second terminal) a completion:
  eaas serve
  curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
       -d '{"model": "tiny-deepseek-v3-v1", "prompt": "Hello", "max_tokens": 16}'

Without --model, serve uses the built-in tiny DeepSeek-V3-architecture model. Its weights
are RANDOM: it writes gibberish and exists to exercise every code path. serve writes it on
first use to ~/.cache/eaas/models/ ($EAAS_CACHE_DIR/models/ when set). --model DIR takes a
Hugging Face checkpoint directory (DeepSeek-V3, Qwen3-MoE, Mixtral).
"""

app = typer.Typer(
    name="eaas",
    help=HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"eaas {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_version,
        is_eager=True,
        help="Print the version and exit.",
    ),
) -> None:
    """Expert-as-a-Service (see the help text above)."""


_register_runtime(app)
_register_operator(app)
_register_testbed(app)

# module (top-level name) -> the extra that installs it
EXTRAS = {
    "torch": "runtime",
    "transformers": "runtime",
    "safetensors": "runtime",
    "tokenizers": "runtime",
    "numpy": "runtime",
    "fastapi": "runtime",
    "uvicorn": "runtime",
    "tqdm": "runtime",
    "kopf": "operator",
    "kubernetes": "operator",
    "pydantic": "runtime] or eaas[operator",
    "prometheus_client": "runtime] or eaas[operator",
}


def missing_extra_message(exc: ModuleNotFoundError) -> str | None:
    """The one-line hint for a module that one of the extras installs, else None.

    Args:
        exc: the error of a failed import; ``exc.name`` is the missing module.
    """
    top = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    return f"error: this command needs {top!r}, which is not installed: pip install 'eaas[{extra}]'"


def main() -> None:
    """The ``eaas`` entry point: the typer app, with a clear line for a missing extra."""
    try:
        app()
    except ModuleNotFoundError as exc:
        msg = missing_extra_message(exc)
        if msg is None:
            raise
        print(msg, file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
