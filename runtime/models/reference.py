"""Ground truth for end-to-end tests: the untouched transformers model, one process, float32.

Greedy decoding, one prompt at a time (no padding), transformers' eager routed-experts kernel.
Models are cached per ``(model_dir)`` within the process.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

# transformers is imported inside the loader: importing it costs seconds, paid only by the
# callers of the reference model (tests, the tiny model's checks).


@lru_cache(maxsize=4)
def _load(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, experts_implementation="eager"
    )
    return model.eval()


@torch.no_grad()
def reference_generate(
    model_dir: str | Path, prompt_token_ids: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy continuation of each prompt with transformers ``generate``.

    Args:
        model_dir: Hugging Face model directory.
        prompt_token_ids: one list of token ids per prompt (non-empty).
        max_new_tokens: maximum tokens generated per prompt.

    Returns:
        per prompt, the generated token ids only (prompt excluded); shorter than
        ``max_new_tokens`` when the model emits its EOS token (the EOS id is included).

    Raises:
        ValueError: an empty prompt.
    """
    model = _load(str(Path(model_dir).resolve()))
    eos = model.generation_config.eos_token_id
    out: list[list[int]] = []
    for ids in prompt_token_ids:
        if not ids:
            raise ValueError("empty prompt")
        x = torch.tensor([ids], dtype=torch.long)  # (1, S)
        y = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos if isinstance(eos, int) else None,
        )  # (1, S + n)
        out.append(y[0, len(ids) :].tolist())
    return out


@torch.no_grad()
def reference_logits(model_dir: str | Path, token_ids: list[int]) -> torch.Tensor:
    """Logits of one sequence in a single forward pass.

    Args:
        token_ids: ``T`` token ids.

    Returns:
        ``(T, vocab)`` float32 logits; row ``t`` predicts token ``t + 1``.
    """
    model = _load(str(Path(model_dir).resolve()))
    x = torch.tensor([token_ids], dtype=torch.long)  # (1, T)
    return model(x).logits[0].float()  # (T, V)
