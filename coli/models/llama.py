"""Llama (1/2/3): GQA, RoPE (incl. llama3 / linear scaling), optional attention bias."""
from coli.models.base import DecoderLM, GatedMLP, act_of, decoder_layers


def build(cfg, w):
    act = act_of(cfg)
    bias = cfg.attention_bias
    mlp = lambda i, p: GatedMLP(w, f"{p}.mlp", cfg.hidden_size, cfg.intermediate_size, act)  # noqa: E731
    return DecoderLM(cfg, w, decoder_layers(cfg, w, mlp, qkv_bias=bias, o_bias=bias, qk_norm=None))
