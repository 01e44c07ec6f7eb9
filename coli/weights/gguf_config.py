"""A GGUF's metadata as a Hugging Face config.json dict (what ``GGUFModel.config()`` builds
the ModelConfig from, and what ``coli convert model.gguf`` writes): the ``{arch}.*`` keys
llama.cpp's converter writes, mapped back per architecture (docs/MODELS.md)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from coli.errors import ModelLoadError

if TYPE_CHECKING:
    from coli.weights.gguf import GGUFModel

# llama.cpp architecture -> coli model_type (llama with experts is Mixtral)
ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "olmoe": "olmoe",
         "deepseek2": "deepseek_v3", "glm4moe": "glm4_moe", "gemma3": "gemma3_text"}


def hf_config(g: GGUFModel) -> dict:
    """The GGUF metadata as a Hugging Face config.json dict."""

    def need(key):
        v = g.get(key)
        if v is None:
            raise ModelLoadError(f"{g.path}: metadata {g.arch + key if key.startswith('.') else key} is missing")
        return v

    T = g.tensors
    hidden = int(need(".embedding_length"))
    heads = int(need(".attention.head_count"))
    kv = g.get(".attention.head_count_kv", heads)
    if isinstance(kv, list):
        kv = kv[0]
    if "token_embd.weight" not in T:
        raise ModelLoadError(f"{g.path}: tensor 'token_embd.weight' is missing")
    vocab = int(T["token_embd.weight"].shape[-1])  # ggml shape: (cols, rows)
    # GLM-4.5's GGUF counts its MTP (nextn) blocks in block_count, after the decoder's; they are skipped
    n_layers = int(need(".block_count")) - int(g.get(".nextn_predict_layers") or 0)
    raw = {
        "model_type": ARCHS[g.arch], "hidden_size": hidden, "num_hidden_layers": n_layers,
        "num_attention_heads": heads, "num_key_value_heads": int(kv), "vocab_size": vocab,
        "intermediate_size": int(g.get(".feed_forward_length") or 0),
        "rms_norm_eps": float(g.get(".attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(g.get(".context_length") or 4096),
        "tie_word_embeddings": "output.weight" not in T,
        "attention_bias": "blk.0.attn_q.bias" in T, "hidden_act": "silu",
        "rope_theta": float(g.get(".rope.freq_base", 10000.0)),
    }
    if isinstance(raw["intermediate_size"], list):
        raw["intermediate_size"] = raw["intermediate_size"][0]
    if g.get(".attention.key_length"):
        raw["head_dim"] = int(g.get(".attention.key_length"))
    rope = _rope_scaling(g)
    if rope:
        raw["rope_scaling"] = rope
    if g.get("tokenizer.ggml.eos_token_id") is not None:
        raw["eos_token_id"] = int(g.get("tokenizer.ggml.eos_token_id"))
    experts = int(g.get(".expert_count") or 0)
    if experts:
        raw.update(num_experts=experts, num_experts_per_tok=int(need(".expert_used_count")),
                   moe_intermediate_size=int(g.get(".expert_feed_forward_length") or raw["intermediate_size"]))
        raw["mlp_only_layers"] = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in T]
    if g.arch == "llama" and experts:
        raw["model_type"] = "mixtral"
        raw["num_local_experts"] = raw.pop("num_experts")
    elif g.arch == "qwen3moe":
        raw["norm_topk_prob"] = bool(g.get(".expert_weights_norm", True))
    elif g.arch == "olmoe":
        raw["norm_topk_prob"] = bool(g.get(".expert_weights_norm", False))
        if g.get(".attention.clamp_kqv"):
            raw["clip_qkv"] = float(g.get(".attention.clamp_kqv"))
    elif g.arch == "gemma3":
        _gemma3(g, raw)
    elif g.arch in ("deepseek2", "glm4moe"):
        _sigmoid_moe(g, raw)
        if g.arch == "deepseek2":
            _deepseek2(g, raw, need)
        else:
            _glm4moe(g, raw)
    return raw


def _sigmoid_moe(g: GGUFModel, raw: dict) -> None:
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid scores with a selection bias (exp_probs_b),
    group-limited top-k, weights x expert_weights_scale; leading dense layers; shared experts."""
    gating = g.get(".expert_gating_func")
    if g.arch == "deepseek2" and gating != 2:  # llama.cpp reads a missing key as softmax (DeepSeek-V2)
        raise ModelLoadError(f"{g.path}: a deepseek2 GGUF with softmax expert gating (DeepSeek-V2 / V2.5) is not "
                             "supported; coli runs DeepSeek-V3-style sigmoid routing (expert_gating_func 2)")
    if g.arch == "glm4moe" and gating not in (None, 2):
        raise ModelLoadError(f"{g.path}: expert_gating_func {gating} is not supported for glm4moe (sigmoid only)")
    raw.update(n_routed_experts=raw.pop("num_experts", 0), first_k_dense_replace=int(g.get(".leading_dense_block_count") or 0),
               n_shared_experts=int(g.get(".expert_shared_count") or 0),
               routed_scaling_factor=float(g.get(".expert_weights_scale") or 1.0),
               norm_topk_prob=bool(g.get(".expert_weights_norm", False)),
               n_group=int(g.get(".expert_group_count") or 1), topk_group=int(g.get(".expert_group_used_count") or 1))
    raw.pop("mlp_only_layers", None)


def _deepseek2(g: GGUFModel, raw: dict, need) -> None:
    """Multi-head latent attention. llama.cpp writes it as MQA over the latent: head_count_kv 1,
    key_length kv_lora_rank + rope, value_length kv_lora_rank, and the per-head sizes as
    key_length_mla / value_length_mla (GGUFs older than that: key_length / value_length)."""
    rope = int(need(".rope.dimension_count"))
    qk = g.get(".attention.key_length_mla") or need(".attention.key_length")
    vd = g.get(".attention.value_length_mla") or need(".attention.value_length")
    raw.update(kv_lora_rank=int(need(".attention.kv_lora_rank")), q_lora_rank=g.get(".attention.q_lora_rank") or None,
               qk_rope_head_dim=rope, qk_nope_head_dim=int(qk) - rope, v_head_dim=int(vd), head_dim=rope,
               num_key_value_heads=raw["num_attention_heads"], attention_bias=False)
    rs = raw.get("rope_scaling")
    if rs and rs.get("rope_type") == "yarn" and g.get(".rope.scaling.yarn_log_multiplier"):
        # llama.cpp stores 0.1 * mscale_all_dim; DeepSeek's configs give mscale == mscale_all_dim
        m = round(float(g.get(".rope.scaling.yarn_log_multiplier")) / 0.1, 6)
        rs.update(mscale=m, mscale_all_dim=m)


def _glm4moe(g: GGUFModel, raw: dict) -> None:
    hd = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    rot = int(g.get(".rope.dimension_count") or hd // 2)
    raw.update(head_dim=hd, partial_rotary_factor=rot / hd, use_qk_norm="blk.0.attn_q_norm.weight" in g.tensors,
               num_nextn_predict_layers=int(g.get(".nextn_predict_layers") or 0))


def _rope_scaling(g: GGUFModel) -> dict | None:
    kind = g.get(".rope.scaling.type")
    factor = g.get(".rope.scaling.factor")
    if "rope_freqs.weight" in g.tensors:  # Llama 3.1-style scaling, as per-frequency divisors
        t = g.tensors["rope_freqs.weight"]
        return {"rope_type": "default", "freq_factors": [float(x) for x in np.asarray(t.data, np.float32).ravel()]}
    if not kind or kind == "none" or not factor:
        return None
    out = {"rope_type": kind, "factor": float(factor)}
    orig = g.get(".rope.scaling.original_context_length")
    if orig:
        out["original_max_position_embeddings"] = int(orig)
    for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                    ("yarn_attn_factor", "attention_factor")):
        if g.get(".rope.scaling." + key) is not None:
            out[hf] = float(g.get(".rope.scaling." + key))
    return out


def _gemma3(g: GGUFModel, raw: dict) -> None:
    raw["hidden_act"] = "gelu_pytorch_tanh"
    raw["sliding_window"] = int(g.get(".attention.sliding_window") or 4096)
    pattern = g.get(".attention.sliding_window_pattern")
    n = raw["num_hidden_layers"]
    if isinstance(pattern, list) and len(pattern) == n:  # per layer: true = sliding
        raw["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        raw["sliding_window_pattern"] = int(pattern or 6)
    raw["rope_local_base_freq"] = float(g.get(".rope.local_freq_base") or 10000.0)
    # llama.cpp's gemma3: 1/sqrt(head_dim), except 1/sqrt(hidden/heads) for the 62-layer 27B
    hd = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    raw["query_pre_attn_scalar"] = raw["hidden_size"] // raw["num_attention_heads"] if n == 62 else hd
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if g.get("." + key):
            raw[key] = float(g.get("." + key))
