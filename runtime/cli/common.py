"""What the runtime commands share: the NVSHMEM world options, help texts, the world's
configuration from those options, and the fast exit after a graceful stop."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Annotated, Any, TypeVar

import typer

from eaas.runtime.options.api_key import API_KEY_ENV, api_keys_from
from eaas.runtime.options.nvshmem_world import WorldConfig, check_listen_pe

# The torch-side modules (transport.nvshmem here) are imported inside the functions, in every
# module of this package: `eaas --help` and the operator's commands must start without torch.

# The NVSHMEM world options, declared once: `eaas expert-server` and `eaas attention-client`
# both join a world with them (docs/gpu.md "nvshmem:PE").
NvshmemWorldOption = Annotated[
    int | None,
    typer.Option(
        "--nvshmem-world",
        envvar="EAAS_NVSHMEM_WORLD_SIZE",
        help="Join an NVSHMEM world of this many PEs (clients + servers + spares; docs/gpu.md); "
        "needs nvshmem4py, a GPU and --device cuda.",
    ),
]
NvshmemPeOption = Annotated[
    int | None,
    typer.Option("--nvshmem-pe", envvar="EAAS_NVSHMEM_PE", help="This process's PE in the world."),
]
NvshmemUidFileOption = Annotated[
    str | None,
    typer.Option(
        "--nvshmem-uid-file",
        envvar="EAAS_NVSHMEM_UID_FILE",
        help="PE 0 writes the world's unique id here; the other PEs read it (shared storage).",
    ),
]
CPU_BF16_HELP = (
    "With --dtype bfloat16 on CPU: fp32 computes in float32 with float32 copies of the "
    "bf16-rounded weights (KV cache and expert frames stay bfloat16), native in bfloat16, auto "
    "(default) times one linear layer both ways at load and takes the faster (docs/serving.md "
    "'bf16 on CPU'). No effect on cuda or with float32."
)

DEVICE_HELP = "auto (cuda when available, else cpu), cpu, cuda or cuda:N."

# The options both `eaas expert-server` and `eaas attention-client` take, declared once.
ModelOption = Annotated[
    str | None,
    typer.Option("--model", help="Checkpoint directory (default: the built-in tiny model)."),
]
DtypeOption = Annotated[str, typer.Option("--dtype", help="float32 or bfloat16.")]
CpuBf16Option = Annotated[str, typer.Option("--cpu-bf16-compute", help=CPU_BF16_HELP)]
ThreadsOption = Annotated[
    int, typer.Option("--threads", min=0, help="torch intra-op threads (0: torch default).")
]

#: ``--api-key`` of ``eaas attention-client`` and ``eaas serve`` (``options_from`` falls back to
#: ``$EAAS_API_KEY`` when no flag is given: :func:`eaas.runtime.options.api_keys_from`).
ApiKeyOption = Annotated[
    list[str] | None,
    typer.Option(
        "--api-key",
        help="Require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (401 "
        "otherwise; /health, /metrics, /version stay open). Repeat for several keys. Without "
        f"the flag: ${API_KEY_ENV} (comma-separated keys). Prefer the variable: a flag shows "
        "in ps.",
        show_default=False,
    ),
]

T = TypeVar("T")


def options_from(cls: type[T], ctx: typer.Context) -> T:
    """The options dataclass ``cls`` built from the command's parsed flags (each field is the
    parameter of the same name: ``--dispatch-timeout`` -> ``dispatch_timeout``).

    Raises:
        typer.BadParameter: the options' validation failed (the message names the flag).
    """
    values: dict[str, Any] = ctx.params
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    try:
        if "api_key" in names:  # the flag, else the environment variable (the flag wins)
            values = {**values, "api_key": api_keys_from(values.get("api_key"), os.environ)}
        return cls(**{n: values[n] for n in names})
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def nvshmem_world_config(
    world_size: int | None, pe: int | None, uid_file: str | None, listen: str | None = None
) -> WorldConfig | None:
    """The NVSHMEM world options as a ``WorldConfig`` (None when not given), checked before
    anything loads.

    Raises:
        typer.BadParameter: partial or bad options, ``--listen nvshmem:PE`` without the world or
            with another PE, or no nvshmem4py / GPU here (the message says which).
    """
    try:
        cfg = WorldConfig.from_options(world_size, pe, uid_file)
        if listen is not None:
            check_listen_pe(listen, cfg)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if cfg is not None:
        from eaas.runtime.transport.nvshmem import nvshmem_unavailable_reason

        reason = nvshmem_unavailable_reason()
        if reason is not None:
            raise typer.BadParameter(f"--nvshmem-world: {reason}")
    return cfg


def exit_now(what: str) -> None:
    """Leave at once after a graceful stop (sockets closed, socket path unlinked).

    Interpreter teardown of a torch process (unloading its libraries, collecting every
    module) costs seconds of CPU; on a busy machine with several servers stopping together
    that made Ctrl-C of ``eaas serve`` take 5-20 s. Nothing is left to flush but stdio:
    metrics files are memory-mapped and already written.
    """
    print(f"{what} stopped", flush=True)
    sys.stderr.flush()
    os._exit(0)
