"""Gemma 3 (text): interleaved sliding-window and global layers with their own RoPE bases,
per-head q/k norm, (1 + weight) RMSNorm, norms both before and after attention and MLP,
embeddings scaled by sqrt(hidden_size), gelu_pytorch_tanh, optional logit softcapping."""
import numpy as np

from coli.models.base import DecoderLM, GatedMLP, act_of, decoder_layers


def build(cfg, w):
    act, r, H = act_of(cfg), cfg.raw, cfg.hidden_size
    mlp = lambda i, p: GatedMLP(w, f"{p}.mlp", H, cfg.intermediate_size, act)  # noqa: E731
    scale = float(r.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5
    layers = decoder_layers(cfg, w, mlp, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm="head",
                            scale=scale, unit_offset=True, softcap=float(r.get("attn_logit_softcapping") or 0.0))
    for i, layer in enumerate(layers):  # Gemma names: post_attention = after attention, pre_feedforward = before MLP
        p = f"model.layers.{i}"
        layer.attn_out_norm = layer.post_norm
        layer.post_norm = w(f"{p}.pre_feedforward_layernorm.weight", H)
        layer.mlp_out_norm = w(f"{p}.post_feedforward_layernorm.weight", H)
    model = DecoderLM(cfg, w, layers, unit_offset_norm=True)
    model.embed_scale = float(np.float32(H ** 0.5))
    model.final_softcap = float(r.get("final_logit_softcapping") or 0.0)
    return model
