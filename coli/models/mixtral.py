"""Mixtral: Llama attention; every layer a softmax top-k MoE over w1 (gate), w3 (up), w2 (down),
with the top-k weights always renormalised."""
from coli.models.base import DecoderLM, MoE, act_of, check_experts, decoder_layers


def build(cfg, w):
    check_experts(cfg)
    act = act_of(cfg)
    mlp = lambda i, p: MoE(cfg, w, f"{p}.block_sparse_moe", router="gate", experts="experts",  # noqa: E731
                           names=("w1", "w3", "w2"), renormalize=True, act=act)
    return DecoderLM(cfg, w, decoder_layers(cfg, w, mlp, qkv_bias=False, o_bias=False, qk_norm=None))
