"""GLM-4.5 / 4.6 / 4.7 (Glm4MoeForCausalLM): partial rotary, biases on q/k/v, optional
per-head q/k norm; dense layers up to first_k_dense_replace, then MoE with sigmoid,
bias-corrected routing and shared experts."""
from coli.models.base import DecoderLM, act_of, check_experts, decoder_layers, sigmoid_routed_mlp


def build(cfg, w):
    check_experts(cfg)
    mlp = sigmoid_routed_mlp(cfg, w, act_of(cfg))
    qk_norm = "head" if cfg.raw.get("use_qk_norm") else None
    return DecoderLM(cfg, w, decoder_layers(cfg, w, mlp, qkv_bias=cfg.attention_bias, o_bias=False, qk_norm=qk_norm))
