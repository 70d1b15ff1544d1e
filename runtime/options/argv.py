"""An options dataclass as the command line of the process it configures."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

#: The program of every command line the operator writes (the container's ``eaas`` script).
PROGRAM = "eaas"


def flag(name: str) -> str:
    """The command-line flag of an options field: ``dispatch_timeout`` -> ``--dispatch-timeout``."""
    return "--" + name.replace("_", "-")


def format_value(value: Any) -> str:
    """A field's value as its flag's argument: floats in the shortest form that reads back
    exactly (``0.5``, ``5``, ``1.2345678``), anything else as ``str``."""
    if isinstance(value, float) and math.isfinite(value):
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    return str(value)


def to_argv(options: Any, command: str, always: tuple[str, ...] = ()) -> list[str]:
    """``[command, --flag, value, ...]`` for ``options`` (a dataclass whose field names are
    the flag names with ``_`` for ``-``).

    In field order, a flag for every field whose value differs from its default (the process
    would apply that default itself) and for the fields named in ``always``; booleans are
    bare flags, given when true; ``None`` is never written.
    """
    out = [command]
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if value is None or not f.metadata.get("flag", True):
            continue
        if f.name not in always and value == f.default:
            continue
        if isinstance(value, bool):
            if value:
                out.append(flag(f.name))
            continue
        out += [flag(f.name), format_value(value)]
    return out
