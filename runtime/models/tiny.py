"""The built-in tiny DeepSeek-V3-architecture checkpoint (random weights), generated, never committed.

It has the real model's structure at toy size so every code path of the runtime is exercised:
MLA attention, a first dense layer then MoE layers, 32 routed experts with grouped top-k routing
(``noaux_tc``: sigmoid scores + ``e_score_correction_bias``, 4 groups, top-2 groups, top-4
experts, normalized, scaled by ``routed_scaling_factor`` 2.5; arXiv:2412.19437 section 2.1.2) and
one shared expert.

Determinism: every tensor is drawn from its own ``torch.Generator`` seeded from the tensor name, the
tokenizer is a byte-level BPE trained offline on text embedded here, and all JSON is written with
sorted keys, so :func:`write_tiny_model` produces the same bytes on every run (same library versions).

Weights are float32 and drawn with a larger standard deviation than transformers' default
(``initializer_range`` 0.02) so the next-token logits are peaked: with the default init a tiny random
model has a top-1 vs top-2 logit gap of ~0.02-0.12 and greedy output flips between numerically
different (but correct) kernels. See :func:`logit_gap` for the measurement.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from eaas.runtime.models.reference import reference_logits

# tokenizers, transformers and safetensors are imported inside the functions that write the
# checkpoint: `eaas serve` with a built model reads it without paying their import.

VERSION = "v1"
NAME = f"tiny-deepseek-v3-{VERSION}"

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TOKENIZER_VOCAB = 1024

# Model shape (DeepseekV3Config fields).
CONFIG: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=512,  # dense layer 0
    moe_intermediate_size=128,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=32,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=2048,
    num_nextn_predict_layers=0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=0.1,
)
# Standard deviations of the random weights (see module docstring).
INIT_STD = 0.1
EMBED_STD = 1.0
LM_HEAD_STD = 0.5  # logits ~ N(0, 0.5^2 * hidden) = N(0, 8^2): decisive greedy choices
BIAS_STD = 0.01  # e_score_correction_bias: small, nonzero

CORPUS = """\
Expert-as-a-Service serves mixture-of-experts language models by running every expert as a
stateless service, apart from the stateful attention part of the model. An expert is a pure
function of a token's hidden state, so experts can be replicated, moved and scaled one GPU at a time
without changing the results. The attention client keeps the key-value cache, computes the router
scores and the top-k experts of every token, and sends each token to the expert servers that host
its experts. The expert server batches the pending work of all connected clients, runs each hosted
expert once on the union of its tokens, and returns the weighted partial sums.

The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single
step. To be, or not to be, that is the question. All happy families are alike; each unhappy family
is unhappy in its own way. It was the best of times, it was the worst of times, it was the age of
wisdom, it was the age of foolishness. Call me Ishmael. In the beginning was the word.

Hello! How are you today? I am fine, thank you. What is the capital of France? The capital of
France is Paris. What is two plus two? Two plus two is four. Please write a short poem about the
sea. The sea is wide and deep and blue; the waves come in, the waves go out. Tell me a story about
a robot who learns to paint. Once upon a time there was a small robot named Pix who loved colors.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 2048 4096 7168.
Code: def main(): print("hello, world") return 0. for i in range(10): x = x + i * 2.
import torch; y = torch.matmul(a, b); if y.sum() > 0: raise ValueError("bad input")
JSON: {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}

Routing: the gate computes a sigmoid affinity score for each routed expert, adds a per-expert bias
used only for selection, keeps the best groups of experts, picks the top-k experts within them,
normalizes their scores and scales them by the routed scaling factor. The shared expert sees every
token. Load balance is kept without an auxiliary loss by adjusting the bias during training.
Kubernetes runs one expert-server pod per GPU; the operator watches pods and nodes, publishes a
new routing table version when membership changes, and scales the pool when expert load grows.
"""


def train_tokenizer():
    """Train the byte-level BPE tokenizer on :data:`CORPUS` (offline, deterministic).

    Returns:
        a ``tokenizers.Tokenizer`` with :data:`SPECIAL_TOKENS` as ids 0, 1, 2 and a post-processor
        that prepends ``BOS``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # repeat each paragraph so merge counts are well separated (stable tie-breaking)
    paragraphs = [p for p in CORPUS.split("\n\n") if p.strip()]
    tok.train_from_iterator(
        [p for i, p in enumerate(paragraphs) for _ in range(i + 1)], trainer=trainer
    )
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{NAME}/{name}".encode()).digest()[:8], "little") & (
        (1 << 63) - 1
    )


def _randn(name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(_seed(name))
    return torch.randn(shape, generator=g, dtype=torch.float32) * std


def build_state_dict(config) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights for ``config``, with per-expert on-disk key names.

    Norm weights are 1; ``e_score_correction_bias`` ~ N(0, BIAS_STD); embeddings ~ N(0, EMBED_STD);
    ``lm_head`` ~ N(0, LM_HEAD_STD); every other matrix ``W [out, in]`` ~ N(0, INIT_STD).
    """
    from transformers import DeepseekV3ForCausalLM

    with torch.device("meta"):
        meta = DeepseekV3ForCausalLM(config)
    shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    sd: dict[str, torch.Tensor] = {}
    for key, shape in sorted(shapes.items()):
        if key.endswith(".experts.gate_up_proj"):
            base = key[: -len("gate_up_proj")]
            n_exp, two_i, _ = shape
            for e in range(n_exp):
                for p in ("gate_proj", "up_proj"):
                    k = f"{base}{e}.{p}.weight"
                    sd[k] = _randn(k, (two_i // 2, shape[2]), INIT_STD)
        elif key.endswith(".experts.down_proj"):
            base = key[: -len("down_proj")]
            for e in range(shape[0]):
                k = f"{base}{e}.down_proj.weight"
                sd[k] = _randn(k, shape[1:], INIT_STD)
        elif key.endswith("norm.weight"):
            sd[key] = torch.ones(shape, dtype=torch.float32)
        elif key.endswith("e_score_correction_bias"):
            sd[key] = _randn(key, shape, BIAS_STD)
        elif key == "model.embed_tokens.weight":
            sd[key] = _randn(key, shape, EMBED_STD)
        elif key == "lm_head.weight":
            sd[key] = _randn(key, shape, LM_HEAD_STD)
        elif key.endswith(".weight") and len(shape) == 2:
            sd[key] = _randn(key, shape, INIT_STD)
        else:
            raise ValueError(f"tiny model: no init rule for {key} {shape}")
    return sd


def _json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_tiny_model(out_dir: str | Path, progress: Callable[[str], None] | None = None) -> Path:
    """Write the tiny DeepSeek-V3-architecture checkpoint into ``out_dir`` (created if needed).

    ``progress``, when given, is called with one line per stage (tokenizer, weights, files).

    Files: ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32,
    per-expert keys ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``),
    ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``.

    Returns:
        ``Path(out_dir)``. Same bytes on every call (for the same torch/tokenizers versions).
    """
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config

    say = progress or (lambda _msg: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say("training the byte-level BPE tokenizer (1/3)")
    tok = train_tokenizer()
    vocab = tok.get_vocab_size()
    bos_id, eos_id, pad_id = (tok.token_to_id(t) for t in SPECIAL_TOKENS)

    config = DeepseekV3Config(
        vocab_size=vocab, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, **CONFIG
    )
    cfg = config.to_dict()
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg["dtype"] = "float32"
    cfg.pop("transformers_version", None)  # keep bytes independent of the installed version
    _json(out / "config.json", cfg)
    _json(
        out / "generation_config.json",
        {
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "pad_token_id": pad_id,
            "do_sample": False,
        },
    )
    say("drawing the random weights (2/3)")
    state = build_state_dict(config)
    say("writing model.safetensors and the tokenizer files (3/3)")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    tok.save(str(out / "tokenizer.json"))
    _json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "add_bos_token": True,
            "model_max_length": CONFIG["max_position_embeddings"],
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _json(out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
    for f in out.iterdir():
        os.chmod(f, 0o644)  # save_file creates 0600
    return out


def cache_root() -> Path:
    """``$EAAS_CACHE_DIR`` if set, else ``~/.cache/eaas``."""
    env = os.environ.get("EAAS_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "eaas"


def default_model_dir() -> Path:
    """``<cache_root>/models/tiny-deepseek-v3-<VERSION>``, written on first use.

    Writing takes about 10 s on a small machine; it says so on stderr, one line per stage, so a
    first ``eaas serve`` is not silent.

    Safe for concurrent callers (threads or processes): an exclusive ``fcntl`` lock on
    ``<dir>.lock`` serializes writers, the checkpoint is written into a temporary sibling directory
    and renamed into place, so readers never see a partial checkpoint.
    """
    final = cache_root() / "models" / NAME
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f"{NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if (final / "config.json").is_file():
                return final
            tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}.", dir=final.parent))
            t0 = time.monotonic()

            def say(msg: str) -> None:
                print(
                    f"[eaas] tiny model: {msg} ... {time.monotonic() - t0:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )

            print(
                f"[eaas] first use: writing the built-in tiny model (RANDOM weights) to {final}",
                file=sys.stderr,
                flush=True,
            )
            try:
                write_tiny_model(tmp, progress=say)
                os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
                if final.exists():  # a broken earlier attempt
                    shutil.rmtree(final)
                os.rename(tmp, final)
                say("done")
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


@torch.no_grad()
def logit_gap(model_dir: str | Path, text: str | None = None) -> float:
    """Median over positions of (top-1 logit - top-2 logit) of the full model on ``text``.

    Measures how decisive greedy decoding is; the tiny model targets > 1.0.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(text or CORPUS[:400])["input_ids"][:64]
    logits = reference_logits(model_dir, ids)  # (T, V)
    top2 = logits.topk(2, dim=-1).values  # (T, 2)
    return float(statistics.median((top2[:, 0] - top2[:, 1]).tolist()))
