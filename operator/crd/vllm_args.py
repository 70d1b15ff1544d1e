"""``AttentionFleet.spec.vllm``: settings of the ``vllm serve`` of ``engine: vllm`` pods, and
the flags the operator owns there (refused in ``spec.vllm.args`` by the CRD's rule, here in CEL,
and by the operator, :func:`owned_vllm_flag`: one list)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from eaas.operator.crd.base import CrdModel
from eaas.runtime.options.vllm import vllm_flag_in

#: ``vllm serve`` flags the operator sets on an ``engine: vllm`` pod (operator/vllm_fleet.py,
#: with the plugin's ``--scheduler-cls`` / ``--middleware`` from runtime/options/vllm.py) or owns
#: through another field (``--model``: ``spec.model``; ``--api-key``: ``spec.apiKeySecret``):
#: ``spec.vllm.args`` may not set them
VLLM_OWNED_FLAGS = (
    "--host",
    "--port",
    "--model",
    "--served-model-name",
    "--dtype",
    "--scheduler-cls",
    "--middleware",
    "--api-key",
)
_OWNED_CEL = "[" + ", ".join(f"'{f}'" for f in VLLM_OWNED_FLAGS) + "]"


def owned_vllm_flag(arg: str) -> str | None:
    """The operator-owned flag that ``arg`` (one ``spec.vllm.args`` item) would set, read as
    vLLM reads it (the name before ``=``, ``_`` as ``-``, an abbreviation: a prefix of a flag
    name), ``"--"`` for a bare ``--``; None for any other item (a value, another flag)."""
    return vllm_flag_in(arg, VLLM_OWNED_FLAGS)


VllmArg = Annotated[
    str,
    Field(
        min_length=1,
        max_length=1024,
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    # owned_vllm_flag, in CEL (the same list)
                    "rule": "!self.startsWith('--') || (size(self.split('=')[0]) > 2 && "
                    f"!{_OWNED_CEL}.exists(f, f.startsWith(self.split('=')[0].replace('_', '-'))))",
                    "message": "spec.vllm.args must not set a flag the operator sets ("
                    + ", ".join(VLLM_OWNED_FLAGS)
                    + "; abbreviations and _ spellings included) nor be a bare --",
                }
            ]
        },
    ),
]


class VllmEngineSpec(CrdModel):
    """Settings of the ``vllm serve`` of ``engine: vllm`` pods."""

    args: list[VllmArg] = Field(
        default_factory=list,
        max_length=128,
        description="More `vllm serve` flags, appended to the operator's command line, e.g. "
        "`[--max-model-len, '8192', --enable-prefix-caching]` (one flag or value per item). "
        "Flags the operator sets are refused: "
        + ", ".join(f"`{f}`" for f in VLLM_OWNED_FLAGS)
        + ".",
    )
