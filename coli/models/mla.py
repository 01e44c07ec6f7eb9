"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2) with a compressed KV cache.

The cache keeps, per token and layer, only the normalised latent c_kv (kv_lora_rank
floats) and the rotated shared key k_pe (qk_rope_head_dim floats): one "KV head" of
kv_lora_rank + qk_rope_head_dim, read by every query head. The full per-head keys and
values are never formed; kv_b_proj is absorbed instead:

    score_h(j)  = q_nope_h . (W_UK_h c_j) + q_pe_h . k_pe_j = (W_UK_h^T q_nope_h) . c_j + q_pe_h . k_pe_j
    out_h       = W_UV_h (sum_j p_h(j) c_j)

so attention runs over [c | k_pe] rows with query [W_UK_h^T q_nope_h | q_pe_h] and values
the first kv_lora_rank floats of the same rows.
"""
from __future__ import annotations

import math

import numpy as np

from coli._engine import kernels as K
from coli.config import ModelConfig
from coli.models.base import Batch, RunState


def interleaved_to_halves(dim: int) -> np.ndarray:
    """Row order that turns RoPE pairs laid out (x0, x1), (x2, x3), ... into the
    rotate-half layout (x0, x2, ..., x1, x3, ...) the rope kernel expects."""
    return np.concatenate([np.arange(0, dim, 2), np.arange(1, dim, 2)])


class MLAAttention:
    def __init__(self, cfg: ModelConfig, w, prefix: str, *, layer: int = 0):
        r = cfg.raw
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        self.nh = nh
        self.nope, self.rope_dim = int(r["qk_nope_head_dim"]), int(r["qk_rope_head_dim"])
        self.lora, self.vd = int(r["kv_lora_rank"]), int(r["v_head_dim"])
        self.q_lora = r.get("q_lora_rank")
        qk = self.nope + self.rope_dim
        bias = bool(r.get("attention_bias", False))
        perm = interleaved_to_halves(self.rope_dim) if r.get("rope_interleave", True) else np.arange(self.rope_dim)
        q_rows = np.concatenate([np.concatenate([np.arange(self.nope), self.nope + perm]) + h * qk for h in range(nh)])
        if self.q_lora:
            self.q_a = w.linear(f"{prefix}.q_a_proj.weight", self.q_lora, H, bias)  # (q_lora, H)
            self.q_a_norm = w(f"{prefix}.q_a_layernorm.weight", self.q_lora)
            self.q_b = w.linear(f"{prefix}.q_b_proj.weight", nh * qk, self.q_lora, row_order=q_rows)
        else:
            self.q_proj = w.linear(f"{prefix}.q_proj.weight", nh * qk, H, row_order=q_rows)  # (nh*qk, H)
        kv_rows = np.concatenate([np.arange(self.lora), self.lora + perm])
        self.kv_a = w.linear(f"{prefix}.kv_a_proj_with_mqa.weight", self.lora + self.rope_dim, H, bias,
                             row_order=kv_rows)  # (lora + rope, H)
        self.kv_a_norm = w(f"{prefix}.kv_a_layernorm.weight", self.lora)
        kv_b = w(f"{prefix}.kv_b_proj.weight", nh * (self.nope + self.vd), self.lora)  # f32: absorbed below
        kv_b = kv_b.reshape(nh, self.nope + self.vd, self.lora)
        self.w_uk_t = np.ascontiguousarray(kv_b[:, : self.nope].transpose(0, 2, 1))  # (nh, lora, nope)
        self.w_uv = np.ascontiguousarray(kv_b[:, self.nope :])  # (nh, vd, lora)
        self.o_proj = w.linear(f"{prefix}.o_proj.weight", H, nh * self.vd, bias)  # (H, nh*vd)
        self.eps = cfg.rms_norm_eps
        rope = cfg.rope_for(layer)
        self.inv_freq, self.rope_scaling = rope.inv_freq(self.rope_dim, cfg.max_position_embeddings)
        self.scale = qk ** -0.5
        mscale_all = rope.params.get("mscale_all_dim") if rope.rope_type != "default" else 0
        if mscale_all:
            m = 0.1 * mscale_all * math.log(rope.params["factor"]) + 1.0 if rope.params["factor"] > 1 else 1.0
            self.scale *= m * m
        self.k_width, self.v_width = self.lora + self.rope_dim, 0  # the compressed cache row; values live in it
        self.cache_head_dim = self.k_width

    def __call__(self, x: np.ndarray, batch: Batch, layer: int, rs: RunState, out: np.ndarray) -> None:
        M, nh, nope, rd, lora = len(x), self.nh, self.nope, self.rope_dim, self.lora
        q = rs.get("q", M, nh * (nope + rd))  # (M, nh*(nope+rope))
        if self.q_lora:
            qa = rs.get("mla_qa", M, self.q_lora)  # (M, q_lora)
            self.q_a(x, qa, rs)
            K.rmsnorm(qa, self.q_a_norm, self.eps, qa)
            self.q_b(qa, q, rs)
        else:
            self.q_proj(x, q, rs)
        kv = rs.get("mla_kv", M, lora + rd)  # (M, lora + rope): the cache rows of these tokens
        self.kv_a(x, kv, rs)
        c = rs.get("mla_c", M, lora)  # (M, lora)
        np.copyto(c, kv[:, :lora])
        K.rmsnorm(c, self.kv_a_norm, self.eps, c)
        kv[:, :lora] = c
        kpe = rs.get("mla_kpe", M, rd)  # (M, rope)
        np.copyto(kpe, kv[:, lora:])
        K.rope(kpe, 1, rd, rd, batch.pos, self.inv_freq, self.rope_scaling)
        kv[:, lora:] = kpe
        K.kv_write(kv, rs.get("mla_v0", M, 0), batch.kptr[layer], batch.kptr[layer], batch.pos, batch.half)
        qh = q.reshape(M, nh, nope + rd)
        qn = rs.get("mla_qn", M, nh * nope)  # (M, nh*nope)
        np.copyto(qn.reshape(M, nh, nope), qh[:, :, :nope])
        qa2 = rs.get("mla_q", M, nh * (lora + rd))  # (M, nh*(lora+rope)): absorbed query
        ql = rs.get("mla_ql", M, nh * lora)  # (M, nh*lora)
        K.head_matmul(qn, self.w_uk_t, ql)
        qp = rs.get("mla_qp", M, nh * rd)  # (M, nh*rope)
        np.copyto(qp.reshape(M, nh, rd), qh[:, :, nope:])
        K.rope(qp, nh, rd, rd, batch.pos, self.inv_freq, self.rope_scaling)
        q2 = qa2.reshape(M, nh, lora + rd)
        q2[:, :, :lora] = ql.reshape(M, nh, lora)
        q2[:, :, lora:] = qp.reshape(M, nh, rd)
        ol = rs.get("mla_ol", M, nh * lora)  # (M, nh*lora): attention output in latent space
        K.attention(qa2, batch.kptr[layer], batch.kptr[layer], batch.pos, ol, nh, 1, lora + rd, lora, self.scale,
                    0, 0.0, lora + rd, batch.half)
        v = rs.get("attn", M, nh * self.vd)  # (M, nh*vd)
        K.head_matmul(ol, self.w_uv, v)
        self.o_proj(v, out, rs)

    def expanded_kv_width(self) -> int:
        """Floats per token per layer a plain (non-absorbed) K/V cache would hold."""
        return self.nh * (self.nope + self.rope_dim + self.vd)


def cache_bytes_per_token(cfg: ModelConfig, itemsize: int = 4) -> tuple[int, int]:
    """(compressed, expanded) KV bytes per token over all layers: what the MLA cache holds,
    and what a cache of full per-head keys and values would."""
    r = cfg.raw
    lora, rope = int(r["kv_lora_rank"]), int(r["qk_rope_head_dim"])
    expanded = cfg.num_attention_heads * (int(r["qk_nope_head_dim"]) + rope + int(r["v_head_dim"]))
    return (lora + rope) * cfg.num_hidden_layers * itemsize, expanded * cfg.num_hidden_layers * itemsize
