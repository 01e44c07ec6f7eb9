"""Shared fixtures: tiny seeded checkpoints written by transformers, never downloaded."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest


def write_tokenizer(model_dir: Path, vocab_size: int, eos: int | None = None) -> None:
    """A word-level tokenizer over 'w0'..'w{n}' so any id sequence round-trips."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(model_dir / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "w0"}
    if eos is not None:
        cfg["eos_token"] = f"w{eos}"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))


BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=160, max_position_embeddings=256, rms_norm_eps=1e-6)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=48)
DSV3 = dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8, num_key_value_heads=4,
            n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, num_hidden_layers=3)

# name -> (model_type, config overrides); one line per architecture or variant.
ARCHS = {
    "llama": ("llama", dict(attention_bias=True)),
    "llama-rope-llama3": ("llama", dict(rope_parameters=dict(rope_type="llama3", rope_theta=50000.0, factor=8.0,
                                                             low_freq_factor=1.0, high_freq_factor=4.0,
                                                             original_max_position_embeddings=32))),
    "llama-rope-linear": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "qwen2": ("qwen2", dict()),
    "qwen2-rope-yarn": ("qwen2", dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                           original_max_position_embeddings=64))),
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": ("olmoe", dict(num_experts=6, num_experts_per_tok=3, clip_qkv=8.0, intermediate_size=48)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, **MOE, norm_topk_prob=True, num_hidden_layers=3,
                                    mlp_only_layers=[1], head_dim=16)),
    "qwen3_moe-sparse-step": ("qwen3_moe", dict(num_experts=4, **MOE, decoder_sparse_step=2)),
    "deepseek_v3": ("deepseek_v3", dict(DSV3, q_lora_rank=32, n_group=4, topk_group=2, first_k_dense_replace=1,
                                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                             original_max_position_embeddings=64, mscale=1.0,
                                                             mscale_all_dim=1.0, beta_fast=32, beta_slow=1))),
    "deepseek_v3-no-q-lora": ("deepseek_v3", dict(DSV3, q_lora_rank=None, n_group=2, topk_group=1,
                                                  first_k_dense_replace=2, num_hidden_layers=3)),
    "glm4_moe": ("glm4_moe", dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
                                  topk_group=1, first_k_dense_replace=1, n_shared_experts=1, attention_bias=True,
                                  use_qk_norm=True, head_dim=32, routed_scaling_factor=1.5, num_hidden_layers=3,
                                  rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                       partial_rotary_factor=0.5))),
    "gemma3_text": ("gemma3_text", dict(head_dim=32, sliding_window=6, query_pre_attn_scalar=24,
                                        num_hidden_layers=4, final_logit_softcapping=30.0,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                     "full_attention"],
                                        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                                         "full_attention": dict(rope_type="linear", rope_theta=1000000.0,
                                                                                factor=4.0)})),
}


@pytest.fixture(autouse=True, scope="session")
def _private_coli_home(tmp_path_factory):
    """Tests never write into the user's $COLI_HOME (the GGUFs `coli list` remembers, servers'
    runtime files, converted models)."""
    old = os.environ.get("COLI_HOME")
    os.environ["COLI_HOME"] = str(tmp_path_factory.mktemp("coli-home"))
    yield
    if old is None:
        os.environ.pop("COLI_HOME", None)
    else:
        os.environ["COLI_HOME"] = old


def make_hf_model(model_type: str, out: Path, seed: int = 0, dtype=None, max_shard_size=None, **overrides):
    """Build a seeded random transformers model, save it (and a tokenizer) to ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kw = {**BASE, **overrides}
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg.eos_token_id = None
    cfg.bos_token_id = None
    cfg.pad_token_id = None
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # default init is small: widen it so logits have structure worth comparing
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)
            else:
                p.normal_(0.0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero at init: make the biased choice matter
                b.normal_(0.0, 0.3)
    if dtype is not None:
        model = model.to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    write_tokenizer(out, cfg.vocab_size)
    return model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """Lazily built {name: directory} of the ARCHS checkpoints."""
    root = tmp_path_factory.mktemp("hf")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            mt, ov = ARCHS[name]
            make_hf_model(mt, root / name, **ov)
            built[name] = root / name
        return built[name]

    return get


def prompt_ids(n: int = 16, vocab: int = 160, seed: int = 1) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, size=n)]


def require_path(path: str) -> None:
    """Skip (with how to enable it) unless this build has SIMD path ``path`` and the CPU can run it."""
    from coli._engine import dispatch

    if path not in dispatch.built():
        pytest.skip(f"this build has no {path} kernels (see COLI_SIMD_TARGETS in setup.py)")
    missing = sorted(dispatch.NEEDS[path] - dispatch.cpu_features())
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}: the {path} path cannot run here")
