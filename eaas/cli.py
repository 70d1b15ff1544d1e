"""``eaas`` command line. Each command's options live next to the code it runs:
runtime commands in :mod:`eaas.runtime.cli`, operator commands in :mod:`eaas.operator.cli`, the
local Kubernetes testbed (test infrastructure) in :mod:`eaas.testbed.cli`.
Heavy imports (torch, transformers, kubernetes) happen inside the commands, so ``eaas --help``
and ``eaas testbed env`` stay fast.
"""

from __future__ import annotations

import typer

from eaas.operator.cli import register as _register_operator
from eaas.runtime.cli import register as _register_runtime
from eaas.testbed.cli import register as _register_testbed

app = typer.Typer(
    name="eaas",
    help="Expert-as-a-Service: serve MoE LLMs with every expert as a stateless service.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
_register_runtime(app)
_register_operator(app)
_register_testbed(app)

if __name__ == "__main__":  # pragma: no cover
    app()
