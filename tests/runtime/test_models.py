"""Model adapters: tiny checkpoint, ModelInfo, expert-weight loader, the experts_factory seam."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from eaas.runtime.experts import weighted_expert_sum
from eaas.runtime.models import weights as weights_mod
from eaas.runtime.models.arch import ModelInfo, model_info_from_config, read_model_info
from eaas.runtime.models.attention import LocalExperts, load_attention_model, local_experts_factory
from eaas.runtime.models.reference import reference_generate, reference_logits
from eaas.runtime.models.tiny import default_model_dir, logit_gap, write_tiny_model
from eaas.runtime.models.weights import group_by_layer, load_expert_weights


def _sha(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def qwen3(checkpoints) -> Path:
    return Path(checkpoints["qwen3_moe"])


@pytest.fixture(scope="module")
def mixtral(checkpoints) -> Path:
    return Path(checkpoints["mixtral"])


# ---- tiny checkpoint ---------------------------------------------------------------------------
def test_tiny_model_is_deterministic(tiny, tmp_path):
    again = write_tiny_model(tmp_path / "again")
    assert _sha(tiny) == _sha(again)
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= set(_sha(tiny))


def test_tiny_config_has_deepseek_routing_fields(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"
    assert (cfg["n_group"], cfg["topk_group"], cfg["num_experts_per_tok"]) == (4, 2, 4)
    assert cfg["routed_scaling_factor"] == 2.5 and cfg["norm_topk_prob"] is True
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_shared_experts"] == 1
    assert cfg["dtype"] == "float32" and cfg["max_position_embeddings"] == 2048
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]
    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert bias.shape == (32,) and bias.abs().min() > 0 and bias.abs().max() < 0.1


def test_tokenizer_round_trip(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    info = read_model_info(tiny)
    assert len(tok) == info.vocab_size
    text = 'Hello! The capital of France is Paris. ünïcødé 7168 {"a": 1}'
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.eos_token_id == json.loads((tiny / "config.json").read_text())["eos_token_id"]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.startswith(tok.bos_token) and chat.endswith("<|assistant|>\n")


def test_tiny_logits_are_peaked(tiny):
    gap = logit_gap(tiny)
    assert gap > 1.0, gap


def test_default_model_dir_builds_once_atomically(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("EAAS_CACHE_DIR", str(tmp_path / "cache"))
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(default_model_dir())) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1
    d = results[0]
    assert d.parent == tmp_path / "cache" / "models" and d.name.startswith("tiny-deepseek-v3-")
    assert _sha(d) == _sha(tiny)
    assert sorted(p.name for p in d.parent.iterdir() if p.is_dir()) == [d.name]  # no tmp dirs left


# ---- ModelInfo --------------------------------------------------------------------------------
def test_read_model_info_all_architectures(tiny, qwen3, mixtral):
    ds = read_model_info(tiny)
    assert ds == ModelInfo(
        architecture="DeepseekV3ForCausalLM",
        model_type="deepseek_v3",
        hidden_size=256,
        num_layers=4,
        moe_layers=(1, 2, 3),
        num_experts=32,
        top_k=4,
        moe_intermediate_size=128,
        vocab_size=ds.vocab_size,
        max_position_embeddings=2048,
        torch_dtype=torch.float32,
    )
    q = read_model_info(qwen3)
    assert (q.architecture, q.moe_layers, q.num_experts, q.top_k, q.moe_intermediate_size) == (
        "Qwen3MoeForCausalLM",
        (1, 2),
        8,
        2,
        32,
    )
    m = read_model_info(mixtral)
    assert (m.architecture, m.moe_layers, m.num_experts, m.top_k, m.moe_intermediate_size) == (
        "MixtralForCausalLM",
        (0, 1),
        4,
        2,
        32,
    )


def test_model_info_layer_rules_and_errors(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert model_info_from_config(
        {**cfg, "num_hidden_layers": 7, "moe_layer_freq": 2}
    ).moe_layers == (2, 4, 6)
    q = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 8,
        "num_hidden_layers": 6,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 4,
        "vocab_size": 10,
        "max_position_embeddings": 16,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    assert model_info_from_config(q).moe_layers == (1, 5)
    with pytest.raises(ValueError, match="unsupported architecture 'LlamaForCausalLM'"):
        model_info_from_config({**cfg, "architectures": ["LlamaForCausalLM"]})
    bad = dict(cfg)
    del bad["n_routed_experts"]
    with pytest.raises(ValueError, match="n_routed_experts"):
        model_info_from_config(bad)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        model_info_from_config({**cfg, "num_experts_per_tok": 64})
    with pytest.raises(FileNotFoundError):
        read_model_info(tiny / "nope")


# ---- expert weights ---------------------------------------------------------------------------
class _Recorder:
    """Wraps safetensors.safe_open and records every tensor (or slice index) read."""

    def __init__(self):
        self.read: list[tuple[str, object]] = []

    def __call__(self, path, framework="pt", device="cpu"):
        rec = self
        inner = safe_open(path, framework=framework, device=device)

        class Handle:
            def __enter__(self):
                self.f = inner.__enter__()
                return self

            def __exit__(self, *a):
                return inner.__exit__(*a)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, name):
                rec.read.append((name, None))
                return self.f.get_tensor(name)

            def get_slice(self, name):
                sl = self.f.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return sl.get_shape()

                    def __getitem__(self, idx):
                        rec.read.append((name, idx))
                        return sl[idx]

                return Slice()

        return Handle()


def test_load_expert_weights_reads_only_hosted_experts(tiny, monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(weights_mod, "safe_open", rec)
    w = load_expert_weights(tiny, [(1, 3), (3, 31), (1, 3)], progress=False)
    assert sorted(w) == [(1, 3), (3, 31)]
    assert sorted(n for n, _ in rec.read) == sorted(
        f"model.layers.{l}.mlp.experts.{e}.{p}.weight"
        for l, e in [(1, 3), (3, 31)]
        for p in ("down_proj", "gate_proj", "up_proj")
    )
    x = w[(1, 3)]
    assert x.gate.shape == (128, 256) and x.up.shape == (128, 256) and x.down.shape == (256, 128)
    assert x.gate.dtype == torch.float32


def test_load_expert_weights_fused_layout_reads_one_slice(tiny, tmp_path, monkeypatch):
    """A checkpoint in transformers' fused layout; other experts' rows are never touched."""
    per = load_expert_weights(tiny, [(2, e) for e in range(32)], progress=False)
    fused = {
        "model.layers.2.mlp.experts.gate_up_proj": torch.stack(
            [torch.cat([per[(2, e)].gate, per[(2, e)].up]) for e in range(32)]
        ),
        "model.layers.2.mlp.experts.down_proj": torch.stack([per[(2, e)].down for e in range(32)]),
    }
    save_file(fused, str(tmp_path / "model.safetensors"))
    rec = _Recorder()
    monkeypatch.setattr(weights_mod, "safe_open", rec)
    w = load_expert_weights(tmp_path, [(2, 5)], dtype=torch.bfloat16, progress=False)
    assert rec.read == [
        ("model.layers.2.mlp.experts.gate_up_proj", 5),
        ("model.layers.2.mlp.experts.down_proj", 5),
    ]
    for a, b in zip(
        (w[(2, 5)].gate, w[(2, 5)].up, w[(2, 5)].down),
        (per[(2, 5)].gate, per[(2, 5)].up, per[(2, 5)].down),
        strict=False,
    ):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b.to(torch.bfloat16))


def test_load_expert_weights_other_experts_absent_sharded(tiny, tmp_path):
    """A sharded checkpoint holding only the hosted experts (everything else absent) still loads."""
    names = [
        f"model.layers.1.mlp.experts.7.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")
    ]
    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        t = {n: f.get_tensor(n) for n in names}
    save_file({names[0]: t[names[0]]}, str(tmp_path / "a.safetensors"))
    save_file({n: t[n] for n in names[1:]}, str(tmp_path / "b.safetensors"))
    wm = {names[0]: "a.safetensors", names[1]: "b.safetensors", names[2]: "b.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": wm})
    )
    w = load_expert_weights(tmp_path, [(1, 7)], progress=False)
    assert torch.equal(w[(1, 7)].down, t[names[2]])
    with pytest.raises(KeyError, match="layer 1, expert 8"):
        load_expert_weights(tmp_path, [(1, 8)], progress=False)


def test_load_expert_weights_dequantizes_fp8_blocks(tmp_path):
    """DeepSeek-V3's released FP8 layout: float8_e4m3fn weight + per-128x128-block weight_scale_inv."""
    g = torch.Generator().manual_seed(0)
    shapes = {"gate_proj": (130, 260), "up_proj": (130, 260), "down_proj": (260, 130)}
    tensors, want = {}, {}
    for p, (r, c) in shapes.items():
        w = torch.randn(r, c, generator=g)
        scale = (
            torch.rand((r + 127) // 128, (c + 127) // 128, generator=g) + 0.5
        )  # (ceil(r/128), ceil(c/128))
        full_scale = scale.repeat_interleave(128, 0)[:r].repeat_interleave(128, 1)[:, :c]
        q = (w / full_scale).to(torch.float8_e4m3fn)
        name = f"model.layers.3.mlp.experts.0.{p}.weight"
        tensors[name], tensors[name + "_scale_inv"] = q, scale
        want[p] = q.float() * full_scale
    save_file(tensors, str(tmp_path / "model.safetensors"))
    w = load_expert_weights(tmp_path, [(3, 0)], progress=False)[(3, 0)]
    assert (
        torch.equal(w.gate, want["gate_proj"])
        and torch.equal(w.up, want["up_proj"])
        and torch.equal(w.down, want["down_proj"])
    )


def test_mixtral_expert_keys(mixtral):
    from transformers import AutoModelForCausalLM

    w = load_expert_weights(mixtral, [(1, 2)], progress=False)
    full = AutoModelForCausalLM.from_pretrained(mixtral)
    ex = full.model.layers[1].mlp.experts
    assert torch.equal(w[(1, 2)].gate_up, ex.gate_up_proj[2].detach())
    assert torch.equal(w[(1, 2)].down, ex.down_proj[2].detach())


# ---- the experts_factory seam -----------------------------------------------------------------
def _expert_params(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if ".mlp.experts." in n]


@pytest.mark.parametrize("which", ["tiny", "qwen3", "mixtral"])
def test_factory_model_matches_full_model(which, request):
    d = request.getfixturevalue(which)
    full, tok, info = load_attention_model(d, experts_implementation="eager")
    assert _expert_params(full)
    calls: list[tuple[int, tuple[int, ...], torch.dtype]] = []
    hosted = group_by_layer(
        load_expert_weights(
            d, [(l, e) for l in info.moe_layers for e in range(info.num_experts)], progress=False
        )
    )

    class Spy(LocalExperts):
        def __init__(self, layer):
            super().__init__(hosted[layer])
            self.layer = layer

        def forward(self, h, idx, w):
            calls.append((self.layer, tuple(h.shape), idx.dtype))
            return weighted_expert_sum(h, idx, w, self.hosted)

    model, tok2, info2 = load_attention_model(d, experts_factory=lambda l, i: Spy(l))
    assert info2 == info and not _expert_params(model)
    assert not [
        n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta
    ]
    ids = tok("The quick brown fox jumps over the lazy dog. Hello!", return_tensors="pt")[
        "input_ids"
    ]  # (1, T)
    with torch.no_grad():
        a = full(ids).logits
        b = model(ids).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=5e-5)
    T = ids.shape[1]
    assert [c[0] for c in calls] == list(info.moe_layers)
    assert all(c[1] == (T, info.hidden_size) and c[2] == torch.int64 for c in calls)
    if which == "tiny":
        torch.testing.assert_close(b[0], reference_logits(d, ids[0].tolist()), rtol=1e-5, atol=5e-5)


def test_factory_model_keeps_no_routed_expert_weights(tiny):
    full, _, info = load_attention_model(tiny)
    n_expert = sum(p.numel() for n, p in full.named_parameters() if ".mlp.experts." in n)
    assert (
        n_expert
        == len(info.moe_layers)
        * info.num_experts
        * 3
        * info.hidden_size
        * info.moe_intermediate_size
    )

    class Stub(nn.Module):
        def forward(self, h, idx, w):
            return torch.zeros_like(h)

    model, _, _ = load_attention_model(tiny, experts_factory=lambda l, i: Stub())
    assert not _expert_params(model)
    assert (
        sum(p.numel() for p in model.parameters())
        == sum(p.numel() for p in full.parameters()) - n_expert
    )
    # router incl. e_score_correction_bias, shared experts and lm_head are the checkpoint's
    sd_full, sd = full.state_dict(), model.state_dict()
    for k in (
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.2.mlp.shared_experts.down_proj.weight",
        "lm_head.weight",
        "model.norm.weight",
    ):
        assert torch.equal(sd[k], sd_full[k]), k
    assert sd["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0


def test_factory_must_return_module(tiny):
    with pytest.raises(TypeError, match="nn.Module"):
        load_attention_model(tiny, experts_factory=lambda l, i: None)


def test_greedy_generate_matches_reference(tiny):
    model, tok, info = load_attention_model(tiny, experts_factory=local_experts_factory(tiny))
    prompts = [tok("Hello! How are you")["input_ids"], tok("The capital of France")["input_ids"]]
    ref = reference_generate(tiny, prompts, max_new_tokens=6)
    assert all(len(r) == 6 for r in ref) and ref[0] != ref[1]
    for p, r in zip(prompts, ref, strict=False):
        x = torch.tensor([p])
        with torch.no_grad():
            y = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False
            )
        assert y[0, len(p) :].tolist() == r


def test_bfloat16_seam_dtypes(tiny):
    """bf16 model: the router stays float32 and DeepSeek's gate weights reach the module as float32."""
    seen = {}

    class Probe(nn.Module):
        def forward(self, h, idx, w):
            seen.update(h=h.dtype, idx=idx.dtype, w=w.dtype, wsum=w.sum(-1))
            return torch.zeros_like(h)

    model, tok, info = load_attention_model(
        tiny, dtype=torch.bfloat16, experts_factory=lambda l, i: Probe()
    )
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.shared_experts.up_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        model(torch.tensor([tok("Hello")["input_ids"]]))
    assert (seen["h"], seen["idx"], seen["w"]) == (torch.bfloat16, torch.int64, torch.float32)
    # normalized top-k weights scaled by routed_scaling_factor
    torch.testing.assert_close(seen["wsum"], torch.full_like(seen["wsum"], 2.5))
