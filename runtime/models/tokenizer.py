"""Tokenizer loading: a checkpoint's ``tokenizer.json`` wins over a model-specific class.

transformers' ``AutoTokenizer`` picks a tokenizer class from the model type (for example
``Qwen2Tokenizer`` for ``qwen3_moe``) and, in transformers 5, such a class rebuilds its own
normalizer and pre-tokenizer in code and adds its own special tokens. For a checkpoint whose
``tokenizer.json`` says otherwise, that tokenizes differently from the file (measured: ``"1 2 3 4
5"`` gives 10 tokens instead of the file's 6, and an extra ``<|endoftext|>`` appears at id
``vocab_size``). The file is the checkpoint's own statement of its tokenization, so when it exists
it is loaded as it is (``PreTrainedTokenizerFast``: the file's pipeline, plus special tokens and
chat template from ``tokenizer_config.json`` when present); other checkpoints go through
``AutoTokenizer``.
"""

from __future__ import annotations

from pathlib import Path

# transformers is imported inside load_tokenizer: importing it costs seconds, paid only by
# the processes that tokenize (the attention client).


def load_tokenizer(model_dir: str | Path):
    """The tokenizer of the checkpoint in ``model_dir``.

    Returns:
        ``PreTrainedTokenizerFast`` over ``tokenizer.json`` when the file exists, else
        ``AutoTokenizer.from_pretrained(model_dir)``.

    Raises:
        OSError / ValueError: no loadable tokenizer files (from transformers).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    return AutoTokenizer.from_pretrained(model_dir)


__all__ = ["load_tokenizer"]
