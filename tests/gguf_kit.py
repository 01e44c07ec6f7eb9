"""Write a GGUF of a tiny Hugging Face test checkpoint the way llama.cpp's
convert_hf_to_gguf.py does: llama.cpp tensor names, Llama's q/k row permutation,
Gemma's ``1 +`` norms, stacked ``ffn_*_exps`` experts, the metadata keys llama.cpp
reads, and a byte-level BPE vocabulary of the checkpoint's word tokens. DeepSeek-V3
(``deepseek2``): MLA written as MQA over the latent, kv_b_proj split per head into
attn_k_b (transposed) and attn_v_b; GLM-4.5 (``glm4moe``): its MTP block appended after
the decoder's, counted in block_count and named by nextn_predict_layers."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from coli.weights.safetensors import Checkpoint

GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
             "olmoe": "olmoe", "gemma3_text": "gemma3", "deepseek_v3": "deepseek2", "glm4_moe": "glm4moe"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
         "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
         "mlp.shared_experts.down_proj": "ffn_down_shexp", "self_attn.q_a_proj": "attn_q_a",
         "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
         "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
         "self_attn.kv_b_proj": "attn_kv_b"}
GEMMA = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
         "post_feedforward_layernorm": "post_ffw_norm"}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: Path, out: Path, qtype: str = "F32", vocab: str = "gpt2", split_kv_b: bool = True,
               nextn: int = 0) -> Path:
    """``split_kv_b``: deepseek2's kv_b_proj as attn_k_b + attn_v_b (llama.cpp since 2025), else whole
    as attn_kv_b (older GGUFs); ``nextn``: glm4moe MTP blocks to append (random: they are skipped)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    cfg = json.loads((hf_dir / "config.json").read_text())
    mt = cfg["model_type"]
    arch = GGUF_ARCH[mt]
    ck = Checkpoint(hf_dir)
    qt = getattr(Q, qtype)
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    L, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_block_count(L + nextn)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(nh)
    if mt != "deepseek_v3":  # (deepseek2: written by sigmoid_moe_metadata)
        w.add_head_count_kv(nkv)
    if cfg.get("head_dim") and mt != "deepseek_v3":
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rp = cfg.get("rope_parameters") or {}
    if mt == "gemma3_text":
        w.add_rope_freq_base(rp["full_attention"]["rope_theta"])
        full = rp["full_attention"]
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        w.add_float32(f"{arch}.rope.local_freq_base", rp["sliding_attention"]["rope_theta"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    else:
        w.add_rope_freq_base(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        if rp.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rp["factor"])
        elif rp.get("rope_type") == "llama3":  # llama.cpp writes the factors as a tensor
            w.add_tensor("rope_freqs.weight", llama3_factors(rp, cfg.get("head_dim") or H // nh))
        elif rp.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rp["factor"])
            w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    E = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    if E:
        w.add_expert_count(E)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        if mt == "qwen3_moe":
            w.add_expert_weights_norm(bool(cfg.get("norm_topk_prob")))
    if cfg.get("clip_qkv"):
        w.add_clamp_kqv(cfg["clip_qkv"])
    if mt in ("deepseek_v3", "glm4_moe"):
        sigmoid_moe_metadata(w, cfg, arch, nextn)
    write_vocab(w, V, vocab)

    def put(name, arr, quantize=True):
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        block = gguf.GGML_QUANT_SIZES[qt][0]
        if not quantize or arr.ndim < 2 or qt == Q.F32 or arr.shape[-1] % block:  # llama.cpp keeps these unquantized
            w.add_tensor(name, arr)
        elif qt == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)

    for hf in ck.names():
        arr = ck.f32(hf)
        if hf == "model.embed_tokens.weight":
            put("token_embd.weight", arr)
            continue
        if hf == "model.norm.weight":
            put("output_norm.weight", arr + (1.0 if mt == "gemma3_text" else 0.0))
            continue
        if hf == "lm_head.weight":
            if not cfg.get("tie_word_embeddings"):
                put("output.weight", arr)
            continue
        if hf.endswith(".mlp.gate.e_score_correction_bias"):
            put(f"blk.{hf.split('.')[2]}.exp_probs_b.bias", arr)
            continue
        if hf.endswith("self_attn.kv_b_proj.weight") and split_kv_b:  # DeepseekV2Model.modify_tensors
            kv_b = arr.reshape(nh, cfg["qk_nope_head_dim"] + cfg["v_head_dim"], -1)
            k_b, v_b = kv_b[:, : cfg["qk_nope_head_dim"]], kv_b[:, cfg["qk_nope_head_dim"]:]
            put(f"blk.{hf.split('.')[2]}.attn_k_b.weight", k_b.transpose(0, 2, 1))
            put(f"blk.{hf.split('.')[2]}.attn_v_b.weight", v_b)
            continue
        parts = hf.split(".")
        i, rest, suffix = parts[2], ".".join(parts[3:-1]), parts[-1]
        if ".experts." in hf:
            continue  # stacked below
        if mt in ("llama", "mixtral") and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            arr = permute(arr, nh if rest.endswith("q_proj") else nkv)
        if mt == "gemma3_text" and rest.endswith("norm"):
            arr = arr + 1.0
        table = {**LAYER, **GEMMA} if mt == "gemma3_text" else LAYER
        if mt == "glm4_moe":
            table = {**LAYER, "post_attention_layernorm": "post_attention_norm"}
        put(f"blk.{i}.{table[rest]}.{suffix}", arr, quantize=table[rest] != "ffn_gate_inp")
    for i in range(L):
        for sub, names in (("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
                           ("block_sparse_moe.experts", ("w1", "w3", "w2"))):
            p = f"model.layers.{i}.{sub}"
            if f"{p}.0.{names[0]}.weight" in ck:
                n = sum(1 for k in ck.names() if k.startswith(f"{p}.") and k.endswith(f".{names[0]}.weight"))
                for part, hf in zip(("gate", "up", "down"), names):
                    put(f"blk.{i}.ffn_{part}_exps.weight", np.stack([ck.f32(f"{p}.{e}.{hf}.weight") for e in range(n)]))
            elif f"{p}.gate_up_proj" in ck:
                gu, dn = ck.f32(f"{p}.gate_up_proj"), ck.f32(f"{p}.down_proj")
                inter = gu.shape[1] // 2
                put(f"blk.{i}.ffn_gate_exps.weight", gu[:, :inter])
                put(f"blk.{i}.ffn_up_exps.weight", gu[:, inter:])
                put(f"blk.{i}.ffn_down_exps.weight", dn)
    rng = np.random.default_rng(7)
    for i in range(L, L + nextn):  # an MTP block: a whole layer plus its nextn tensors, never used
        for n, shape in (("attn_norm", (H,)), ("post_attention_norm", (H,)), ("nextn.enorm", (H,)),
                         ("nextn.hnorm", (H,)), ("nextn.shared_head_norm", (H,)), ("nextn.eh_proj", (H, 2 * H)),
                         ("attn_q", (nh * cfg["head_dim"], H)), ("ffn_gate_inp", (E, H))):
            put(f"blk.{i}.{n}.weight", rng.normal(size=shape).astype(np.float32), quantize=len(shape) > 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def sigmoid_moe_metadata(w, cfg: dict, arch: str, nextn: int) -> None:
    """What DeepseekV2Model / Glm4MoeModel.set_gguf_parameters add for these configs."""
    import gguf

    w.add_expert_shared_count(cfg.get("n_shared_experts") or 0)
    w.add_leading_dense_block_count(cfg.get("first_k_dense_replace") or 0)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    if arch == "deepseek2":
        lora, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        w.add_head_count_kv(1)  # MLA as MQA over the latent
        w.add_key_length(lora + rope)
        w.add_value_length(lora)
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope)
        w.add_value_length_mla(cfg["v_head_dim"])
        w.add_kv_lora_rank(lora)
        if cfg.get("q_lora_rank"):
            w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_rope_dimension_count(rope)
        rp = cfg.get("rope_parameters") or {}
        if rp.get("rope_type") == "yarn":
            w.add_rope_scaling_yarn_beta_fast(rp["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(rp["beta_slow"])
            w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])
    else:
        rp = cfg.get("rope_parameters") or {}
        w.add_rope_dimension_count(int(cfg["head_dim"] * (cfg.get("partial_rotary_factor") or rp.get("partial_rotary_factor", 0.5))))
        if nextn:
            w.add_nextn_predict_layers(nextn)


def llama3_factors(rp: dict, dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: one divisor per frequency."""
    import math

    freqs = 1.0 / (rp["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, lo, hi, old = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"], \
        rp["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def write_vocab(w, V: int, kind: str = "gpt2") -> None:
    """The test checkpoints' vocabulary (w0 .. w{V-1}) as a byte-level BPE with no merges,
    or a SentencePiece-style one."""
    import gguf

    toks = [f"w{i}" for i in range(V - 1)] + ["<|end|>"]  # the last id: an end-of-turn control token
    w.add_tokenizer_model(kind)
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([int(gguf.TokenType.NORMAL)] * (V - 1) + [int(gguf.TokenType.CONTROL)])
    w.add_eos_token_id(V - 1)
    w.add_chat_template("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")
    if kind == "gpt2":
        w.add_token_merges([])
    else:
        w.add_token_scores([0.0] * V)
    w.add_add_bos_token(False)
