"""Qwen3-MoE (Qwen3-30B-A3B, ...): Qwen3 attention; MoE on every decoder_sparse_step-th
layer not in mlp_only_layers, a dense MLP elsewhere; norm_topk_prob as configured."""
from coli.models.base import DecoderLM, GatedMLP, MoE, act_of, check_experts, decoder_layers


def build(cfg, w):
    check_experts(cfg)
    act = act_of(cfg)

    def mlp(i, p):
        if i not in cfg.mlp_only_layers and (i + 1) % cfg.decoder_sparse_step == 0:
            return MoE(cfg, w, f"{p}.mlp", router="gate", experts="experts", renormalize=cfg.norm_topk_prob, act=act)
        return GatedMLP(w, f"{p}.mlp", cfg.hidden_size, cfg.intermediate_size, act)

    bias = cfg.attention_bias
    return DecoderLM(cfg, w, decoder_layers(cfg, w, mlp, qkv_bias=bias, o_bias=bias, qk_norm="head"))
