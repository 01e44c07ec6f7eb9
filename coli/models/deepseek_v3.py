"""DeepSeek-V3 / R1 and the Kimi-K2 family: Multi-head Latent Attention with a compressed
KV cache (coli/models/mla.py); the first first_k_dense_replace layers dense, the rest MoE
with sigmoid, bias-corrected, group-limited routing and shared experts."""
from coli.models.base import DecoderLM, act_of, check_experts, decoder_layers, sigmoid_routed_mlp
from coli.models.mla import MLAAttention


def build(cfg, w):
    check_experts(cfg)
    mlp = sigmoid_routed_mlp(cfg, w, act_of(cfg))
    return DecoderLM(cfg, w, decoder_layers(cfg, w, mlp, attention=MLAAttention))
