"""Qwen2 / Qwen2.5: Llama with biases on q, k and v (never on o)."""
from coli.models.base import DecoderLM, GatedMLP, act_of, decoder_layers


def build(cfg, w):
    act = act_of(cfg)
    mlp = lambda i, p: GatedMLP(w, f"{p}.mlp", cfg.hidden_size, cfg.intermediate_size, act)  # noqa: E731
    return DecoderLM(cfg, w, decoder_layers(cfg, w, mlp, qkv_bias=True, o_bias=False, qk_norm=None))
