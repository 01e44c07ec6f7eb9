"""OLMoE: RMSNorm of q and k over the whole projection (not per head), optional clip_qkv,
every layer a softmax top-k MoE (norm_topk_prob as configured)."""
from coli.models.base import DecoderLM, MoE, act_of, check_experts, decoder_layers


def build(cfg, w):
    check_experts(cfg)
    act = act_of(cfg)
    mlp = lambda i, p: MoE(cfg, w, f"{p}.mlp", router="gate", experts="experts",  # noqa: E731
                           renormalize=cfg.norm_topk_prob, act=act)
    bias = cfg.attention_bias
    clip = cfg.raw.get("clip_qkv")
    return DecoderLM(cfg, w, decoder_layers(cfg, w, mlp, qkv_bias=bias, o_bias=bias, qk_norm="full",
                                            clip_qkv=float(clip) if clip is not None else None))
