"""GLM-4.5 / 4.6 / 4.7 (Glm4MoeForCausalLM): partial rotary, biases on q/k/v, optional
per-head q/k norm; dense layers up to first_k_dense_replace, then MoE with sigmoid,
bias-corrected routing and shared experts."""
from coli.models.base import DecoderLM, GatedMLP, MoE, act_of, check_experts, decoder_layers


def build(cfg, w):
    check_experts(cfg)
    act, r, H = act_of(cfg), cfg.raw, cfg.hidden_size

    def mlp(i, p):
        if i < int(r.get("first_k_dense_replace") or 0):
            return GatedMLP(w, f"{p}.mlp", H, cfg.intermediate_size, act)
        shared = None
        if r.get("n_shared_experts"):
            shared = GatedMLP(w, f"{p}.mlp.shared_experts", H, cfg.moe_intermediate_size * int(r["n_shared_experts"]),
                              act)
        return MoE(cfg, w, f"{p}.mlp", router="gate", experts="experts", renormalize=cfg.norm_topk_prob, act=act,
                   sigmoid_groups=(int(r.get("n_group") or 1), int(r.get("topk_group") or 1)),
                   scale=float(r.get("routed_scaling_factor") or 1.0), shared=shared)

    qk_norm = "head" if r.get("use_qk_norm") else None
    return DecoderLM(cfg, w, decoder_layers(cfg, w, mlp, qkv_bias=cfg.attention_bias, o_bias=False, qk_norm=qk_norm))
