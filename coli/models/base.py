"""The shared decoder every architecture file wires up.

A model is ``x = embed(ids); for each layer: x += attn(norm(x)); x += mlp(norm(x));
logits = lm_head(norm(x))``. What differs between families (q/k norms, biases,
which layers are MoE, how the checkpoint names tensors) is decided once, at load
time, by the architecture file; ``forward`` never branches on a checkpoint's dtype
or family. Every array operation runs in a kernel of ``coli._engine.kernels``; the
only Python loop in a step is over layers.

Buffers come from ``RunState`` (allocated once, grown in steps), and KV from the
caller's per-sequence caches (see ``coli.engine``).
"""
from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter as clock
from typing import TYPE_CHECKING

import numpy as np

from coli._engine import kernels as K
from coli.config import ModelConfig
from coli.errors import ModelLoadError

if TYPE_CHECKING:
    from coli.weights.source import Weights

ACTS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}


class RunState:
    """Every activation buffer of a step, keyed by name, sized for ``rows`` rows.

    ``get(name, rows, width)`` returns a C-contiguous (rows, width) float32 view of
    a buffer that is reallocated only when a step needs more rows than ever before
    (capacity doubles), so steady-state decoding allocates nothing. ``views`` gets
    several at once for a layer that asks for the same ones every step, and
    ``moe_scratch`` the MoE kernel's working memory."""

    def __init__(self):
        self._bufs: dict[str, np.ndarray] = {}
        self._views: dict[tuple, np.ndarray] = {}  # (name, rows, width, dtype) -> view of _bufs[name]
        self._groups: dict[tuple, tuple] = {}  # (owner, rows) -> views(owner, rows, ...)
        self._moe: dict[tuple, K.MoEScratch] = {}  # (k, experts, hidden, inter) -> the largest yet

    def get(self, name: str, rows: int, width: int, dtype=np.float32) -> np.ndarray:
        key = (name, rows, width, dtype)
        view = self._views.get(key)
        if view is not None:  # a decode step asks for the same shapes every time
            return view
        buf = self._bufs.get(name)
        need = rows * width
        if buf is None or buf.size < need or buf.dtype != dtype:
            cap = max(need, 2 * (buf.size if buf is not None and buf.dtype == dtype else 0), 64)
            buf = np.empty(cap, dtype=dtype)
            self._bufs[name] = buf
            self._views = {k: v for k, v in self._views.items() if k[0] != name}  # views of the old buffer
            self._groups.clear()
        if len(self._views) > 4096:  # many distinct prefill lengths: start over
            self._views.clear()
            self._groups.clear()
        view = self._views[key] = buf[:need].reshape(rows, width)
        return view

    def views(self, owner: object, rows: int, specs: tuple[tuple[str, int, type], ...]) -> tuple[np.ndarray, ...]:
        """``get(name, rows, width, dtype)`` for each (name, width, dtype) of specs, remembered
        under (owner, rows): one lookup for the buffers a layer asks for every step. An
        owner must pass the same specs each time (distinct names)."""
        got = self._groups.get((owner, rows))
        if got is None:
            got = tuple(self.get(name, rows, width, dtype) for name, width, dtype in specs)
            self._groups[owner, rows] = got  # after the gets: a reallocation among them clears _groups
        return got

    def moe_scratch(self, rows: int, k: int, E: int, H: int, I: int) -> K.MoEScratch:
        """Scratch for ``K.moe_experts`` of at least ``rows`` tokens, shared by the MoE layers
        of one shape; regrown (capacity doubles) when a step needs more."""
        key = (k, E, H, I)
        s = self._moe.get(key)
        if s is None or s.rows < rows:
            s = self._moe[key] = K.MoEScratch(max(rows, 2 * s.rows if s is not None else 0), k, E, H, I)
        return s

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values()) + sum(s.nbytes for s in self._moe.values())


@dataclass
class Batch:
    """The flat token batch of one step: row m is token ids[m] at position pos[m]
    of its sequence; kptr[l, m] / vptr[l, m] address that sequence's layer-l cache."""

    ids: np.ndarray  # (M,) int32
    pos: np.ndarray  # (M,) int32
    kptr: np.ndarray  # (L, M) int64
    vptr: np.ndarray  # (L, M) int64
    half: bool = False  # the caches are float16 (else float32)


class Linear:
    """y = x @ W.T (+ b), W in the format chosen at load; int8/int4 quantize x on the fly."""

    def __init__(self, mat: K.QMatrix, bias: np.ndarray | None = None, xscale: np.ndarray | None = None):
        self.mat, self.bias, self.xscale = mat, bias, xscale
        kp = K.padded(mat.cols)  # qlinear's int8 activation scratch: (M, kp), (M, kp/32) x 2
        self.scratch = (("xq", kp, np.int8), ("xqd", kp // 32, np.float32), ("xqs", kp // 32, np.int32))
        if xscale is not None:  # a column-scaled matrix (coli.colscale): x * s goes in
            self.scratch += (("xs", mat.cols, np.float32),)

    def __call__(self, x: np.ndarray, out: np.ndarray, rs: RunState) -> None:
        views = rs.views(self, len(x), self.scratch)
        if self.xscale is not None:
            x = np.multiply(x, self.xscale, out=views[3])
            views = views[:3]
        K.qlinear(x, self.mat, out, self.bias, *views)


class LinearGroup:
    """Linear layers that read the same input (q, k and v; gate and up). When they share
    a format they run as one kernel call: the input is quantized once and all their row
    blocks go to the threads together (``K.qlinear_many``); results are the same."""

    def __init__(self, *linears: Linear):
        self.linears = linears
        self.mats = tuple(l.mat for l in linears)
        self.biases = tuple(l.bias for l in linears)
        self.scratch = linears[0].scratch
        self.fused = len({(m.fmt, m.cols) for m in self.mats}) == 1

    def __call__(self, x: np.ndarray, outs: tuple[np.ndarray, ...], rs: RunState, act: int = -1) -> None:
        """``act`` (gate and up only): outs[0] becomes act(gate) * up, in the same kernel call
        when fused."""
        if not self.fused:
            for lin, out in zip(self.linears, outs):
                lin(x, out, rs)
            if act >= 0:
                K.gated_act(outs[0], outs[1], outs[0], act)
            return
        K.qlinear_many(x, self.mats, outs, self.biases, *rs.views(self, len(x), self.scratch), act)


class Attention:
    """Multi-head attention with GQA, optional q/k RMSNorm (per head or over the whole
    projection), optional biases, optional clipping, RoPE on the first rot_dim dims.

    Norms, RoPE, the cache write and the attention itself run as one kernel call
    (``K.attention_front`` with an output) unless q, k and v are clipped, which comes
    between the norms and RoPE."""

    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str, *, qkv_bias: bool, o_bias: bool,
                 qk_norm: str | None, clip_qkv: float | None = None, layer: int = 0, scale: float | None = None,
                 unit_offset: bool = False, softcap: float = 0.0):
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = w.linear(f"{prefix}.q_proj.weight", nh * hd, H, qkv_bias)  # (nh*hd, H)
        self.k_proj = w.linear(f"{prefix}.k_proj.weight", nkv * hd, H, qkv_bias)  # (nkv*hd, H)
        self.v_proj = w.linear(f"{prefix}.v_proj.weight", nkv * hd, H, qkv_bias)
        self.o_proj = w.linear(f"{prefix}.o_proj.weight", H, nh * hd, o_bias)  # (H, nh*hd)
        self.qkv = LinearGroup(self.q_proj, self.k_proj, self.v_proj)
        self.qk_norm = qk_norm
        self.q_norm = self.k_norm = None
        if qk_norm == "head":
            self.q_norm, self.k_norm = w(f"{prefix}.q_norm.weight", hd), w(f"{prefix}.k_norm.weight", hd)
        elif qk_norm == "full":
            self.q_norm = w(f"{prefix}.q_norm.weight", nh * hd)
            self.k_norm = w(f"{prefix}.k_norm.weight", nkv * hd)
        self.eps, self.unit = cfg.rms_norm_eps, unit_offset
        self.clip = clip_qkv
        self.rot_dim = int(hd * cfg.partial_rotary_factor)
        self.inv_freq, self.rope_scaling = cfg.rope_for(layer).inv_freq(self.rot_dim, cfg.max_position_embeddings)
        self.scale = hd ** -0.5 if scale is None else scale
        self.window, self.softcap = cfg.window_for(layer), softcap
        self.k_width = self.v_width = nkv * hd  # floats per token in the KV cache
        self.cache_head_dim = hd  # the widest row of one head the attention reads from the cache
        self.front = None if clip_qkv is not None else K.AttentionFront(
            nh, nkv, hd, self.rot_dim, self.inv_freq, self.rope_scaling, qk_norm, self.q_norm, self.k_norm,
            self.eps, unit_offset, self.scale, self.window, self.softcap)
        f32 = np.float32
        # q (M, nh*hd), k and v (M, nkv*hd), the attention output (M, nh*hd)
        self.bufs = (("q", nh * hd, f32), ("k", nkv * hd, f32), ("v", nkv * hd, f32), ("attn", nh * hd, f32))

    def __call__(self, x: np.ndarray, batch: Batch, layer: int, rs: RunState, out: np.ndarray) -> None:
        q, k, v, a = rs.views(self, len(x), self.bufs)
        self.qkv(x, (q, k, v), rs)
        if self.front is not None:
            K.attention_front(self.front, q, k, v, batch.pos, batch.kptr, batch.vptr, layer, a, batch.half)
        else:
            self._front_clipped(q, k, v, batch, layer)
            K.attention(q, batch.kptr[layer], batch.vptr[layer], batch.pos, a, self.nh, self.nkv, self.hd,
                        self.hd, self.scale, self.window, self.softcap, 0, batch.half)
        self.o_proj(a, out, rs)

    def _front_clipped(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, batch: Batch, layer: int) -> None:
        """attention_front's work with clip_qkv, kernel by kernel."""
        M = len(q)
        if self.qk_norm == "head":
            qh, kh = q.reshape(M * self.nh, self.hd), k.reshape(M * self.nkv, self.hd)
            K.rmsnorm(qh, self.q_norm, self.eps, qh, self.unit)
            K.rmsnorm(kh, self.k_norm, self.eps, kh, self.unit)
        elif self.qk_norm == "full":
            K.rmsnorm(q, self.q_norm, self.eps, q, self.unit)
            K.rmsnorm(k, self.k_norm, self.eps, k, self.unit)
        for t in (q, k, v):
            np.clip(t, -self.clip, self.clip, out=t)
        K.rope(q, self.nh, self.hd, self.rot_dim, batch.pos, self.inv_freq, self.rope_scaling)
        K.rope(k, self.nkv, self.hd, self.rot_dim, batch.pos, self.inv_freq, self.rope_scaling)
        K.kv_write(k, v, batch.kptr[layer], batch.vptr[layer], batch.pos, batch.half)


class GatedMLP:
    """down(act(gate(x)) * up(x))."""

    def __init__(self, w: Weights, prefix: str, hidden: int, inter: int, act: int,
                 names=("gate_proj", "up_proj", "down_proj")):
        g, u, d = names
        self.gate = w.linear(f"{prefix}.{g}.weight", inter, hidden)  # (I, H)
        self.up = w.linear(f"{prefix}.{u}.weight", inter, hidden)  # (I, H)
        self.down = w.linear(f"{prefix}.{d}.weight", hidden, inter)  # (H, I)
        self.gate_up = LinearGroup(self.gate, self.up)
        self.inter, self.act = inter, act
        self.bufs = (("mlp_g", inter, np.float32), ("mlp_u", inter, np.float32))  # (M, I) each

    def __call__(self, x: np.ndarray, rs: RunState, out: np.ndarray) -> None:
        g, u = gu = rs.views(self, len(x), self.bufs)
        self.gate_up(x, gu, rs, self.act)  # g = act(gate) * up
        self.down(g, out, rs)


class MoE:
    """Softmax-routed top-k mixture of gated-MLP experts.

    Experts are reached through an ``ExpertTable`` (one entry per expert), so the same
    kernel serves experts mapped from the checkpoint, quantized at load, or held in a
    cache of slots."""

    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str, *, router: str, experts: str,
                 names=("gate_proj", "up_proj", "down_proj"), renormalize: bool, act: int,
                 sigmoid_groups: tuple[int, int] | None = None, scale: float = 1.0, shared: GatedMLP | None = None):
        """``sigmoid_groups`` (n_group, topk_group) switches to DeepSeek-V3-style routing
        (sigmoid scores, e_score_correction_bias, group-limited top-k, weights x scale);
        ``shared`` is an always-on expert added to every token's output."""
        H, E, I = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.E, self.k, self.inter, self.H, self.act = E, cfg.num_experts_per_tok, I, H, act
        self.renormalize = renormalize
        self.router = w(f"{prefix}.{router}.weight", E, H)  # (E, H), f32
        self.groups, self.route_scale, self.shared = sigmoid_groups, scale, shared
        self.bias = w(f"{prefix}.{router}.e_score_correction_bias", E) if sigmoid_groups else None
        self._route_scratch = np.empty((64, 2 * E + 2 * sigmoid_groups[0]) if sigmoid_groups else (0, 0), np.float32)
        self.experts = w.experts(prefix, experts, names, E, H, I, self.k)
        self.table = self.experts.table
        self.next: MoE | None = None  # the next MoE layer, whose experts this one prefetches
        self.counts = self.experts.counts  # (E,) tokens routed to each expert (heat), with history if stored
        self.last = np.zeros((0, self.k), dtype=np.int32)  # experts routed in the latest step
        self.last_weights = np.zeros((0, self.k), dtype=np.float32)  # and their gate weights (coli atlas)
        self.used = 0  # distinct experts routed in the latest step
        # router logits (M, E), routed experts and their weights (M, k)
        self.bufs = (("router", E, np.float32), ("moe_idx", self.k, np.int32), ("moe_w", self.k, np.float32))

    def __call__(self, x: np.ndarray, rs: RunState, out: np.ndarray) -> None:
        M = len(x)
        logits, idx, wts = rs.views(self, M, self.bufs)
        K.linear(x, self.router, logits)
        self.route(logits, idx, wts)
        if self.next is not None and self.next.experts.streamed:
            self._prefetch_next(x, rs)
        scratch = rs.moe_scratch(M, self.k, self.E, self.H, self.inter)
        # Experts not resident are read in groups that fit the cache, the next group's reads
        # running while this one computes when both fit; the weighted sum runs once at the
        # end (same bits).
        groups = self.experts.groups(idx)
        for i, active in enumerate(groups):
            self.experts.load(active)
            if i + 1 < len(groups):
                self.experts.start(groups[i + 1], keep=active)
            self.used = K.moe_experts(x, idx, wts, self.table, out, scratch, self.counts, self.act, active,
                                      i == len(groups) - 1)
        self.last = idx.copy()
        self.last_weights = wts.copy()
        if self.shared is not None:
            extra = rs.get("shared_out", M, self.H)  # (M, H)
            self.shared(x, rs, extra)
            out += extra

    def route(self, logits: np.ndarray, idx: np.ndarray, wts: np.ndarray) -> None:
        if self.groups is None:
            K.moe_route_softmax(logits, self.k, self.renormalize, idx, wts)
        else:
            scratch = self._route_scratch[: len(logits)]
            if len(scratch) < len(logits):
                self._route_scratch = scratch = np.empty((2 * len(logits), 2 * self.E + 2 * self.groups[0]), np.float32)
            K.moe_route_sigmoid(logits, self.bias, self.k, *self.groups, self.renormalize, self.route_scale, idx, wts,
                                scratch[: len(logits)])

    def _prefetch_next(self, x: np.ndarray, rs: RunState) -> None:
        """Guess the next MoE layer's experts from this layer's input (its router applied to
        this layer's input) and start reading the likelier half of each token's guesses."""
        nxt = self.next
        logits = rs.get("router_next", len(x), nxt.E)  # (M, E')
        K.linear(x, nxt.router, logits)
        idx = rs.get("moe_idx_next", len(x), nxt.k, np.int32)
        wts = rs.get("moe_w_next", len(x), nxt.k)
        nxt.route(logits, idx, wts)
        nxt.experts.prefetch(idx[:, : max(1, nxt.k // 2)])


@dataclass
class Layer:
    """x += [out_norm](attn(input_norm(x))); x += [mlp_out_norm](mlp(post_norm(x)))."""

    input_norm: np.ndarray  # (H,)
    attn: Attention
    post_norm: np.ndarray  # (H,) the norm before the MLP
    mlp: GatedMLP | MoE
    attn_out_norm: np.ndarray | None = None  # (H,) Gemma's post_attention_layernorm
    mlp_out_norm: np.ndarray | None = None  # (H,) Gemma's post_feedforward_layernorm


class DecoderLM:
    """Embedding, pre-norm decoder layers, final norm, LM head."""

    def __init__(self, cfg: ModelConfig, w: Weights, layers: list[Layer], *, prefix: str = "model",
                 unit_offset_norm: bool = False):
        H, V = cfg.hidden_size, cfg.vocab_size
        self.cfg = cfg
        self.norm = w(f"{prefix}.norm.weight", H)
        g = self.norm + 1.0 if unit_offset_norm else self.norm  # what the final norm multiplies by
        tied = cfg.tie_word_embeddings or not w.has("lm_head.weight")
        # (V, H), and its column scales (coli.colscale) or None: the table is dequantize(embed) * s
        self.embed, self.embed_cols = w.scaled_matrix(f"{prefix}.embed_tokens.weight", V, H, w.head_quant,
                                                      g if tied else None)
        if tied:
            self.lm_head = Linear(self.embed, xscale=self.embed_cols)
        else:
            head, s = w.scaled_matrix("lm_head.weight", V, H, w.head_quant, g)  # (V, H)
            self.lm_head = Linear(head, xscale=s)
        self.layers = layers
        self.phases = dict.fromkeys(("attention", "moe", "mlp", "lm_head"), 0.0)  # cumulative seconds
        self.moe_layers: list[MoE] = [l.mlp for l in layers if isinstance(l.mlp, MoE)]
        moes = self.moe_layers
        for a, b in zip(moes, moes[1:]):
            a.next = b
        self.eps = cfg.rms_norm_eps
        self.embed_scale = 1.0
        self.unit_offset_norm = unit_offset_norm  # Gemma's RMSNorm scales by (1 + weight)
        self.final_softcap = 0.0  # logits = cap * tanh(logits / cap) when set
        H = cfg.hidden_size
        # the residual stream x, a block's normed input h and its output o: (M, H) each
        self.bufs = (("x", H, np.float32), ("h", H, np.float32), ("o", H, np.float32))

    def f16_kv_ok(self) -> bool:
        """Whether an f16 KV cache can serve every layer: the attention widens f16 heads of up
        to K.F16_HEAD_MAX values (576: MLA's 512 + 64) in a buffer on its stack."""
        return all(l.attn.cache_head_dim <= K.F16_HEAD_MAX for l in self.layers)

    def embed_tokens(self, ids: np.ndarray, x: np.ndarray) -> None:
        """x (M, H) = the embedding rows of ``ids`` (times the model's embedding scale)."""
        K.embed_rows(ids, self.embed, x, self.embed_scale)
        if self.embed_cols is not None:
            x *= self.embed_cols

    def forward(self, batch: Batch, rs: RunState, logit_rows: np.ndarray) -> np.ndarray:
        """Run one step; return the (len(logit_rows), vocab) logits of those rows
        (increasing row indices)."""
        M, H = len(batch.ids), self.cfg.hidden_size
        x, h, o = rs.views(self, M, self.bufs)
        ph = self.phases
        self.embed_tokens(batch.ids, x)
        eps, unit = self.eps, self.unit_offset_norm
        # each block's output o joins x in the kernel that norms the next block's input
        for i, layer in enumerate(self.layers):
            t0 = clock()
            if i == 0:
                K.rmsnorm(x, layer.input_norm, eps, h, unit)
            else:
                K.add_rmsnorm(x, o, layer.input_norm, eps, h, unit)
            layer.attn(h, batch, i, rs, o)
            if layer.attn_out_norm is not None:
                K.rmsnorm(o, layer.attn_out_norm, eps, o, unit)
            t1 = clock()
            K.add_rmsnorm(x, o, layer.post_norm, eps, h, unit)
            layer.mlp(h, rs, o)
            if layer.mlp_out_norm is not None:
                K.rmsnorm(o, layer.mlp_out_norm, eps, o, unit)
            ph["attention"] += t1 - t0
            ph["moe" if isinstance(layer.mlp, MoE) else "mlp"] += clock() - t1
        t0 = clock()
        R = len(logit_rows)
        hr = rs.get("h_last", R, H)  # (R, H)
        if R == M:  # every row (a decode step, or all logits)
            K.add_rmsnorm(x, o, self.norm, eps, hr, unit)
        else:
            x += o
            np.take(x, logit_rows, axis=0, out=hr)
            K.rmsnorm(hr, self.norm, eps, hr, unit)
        logits = rs.get("logits", R, self.cfg.vocab_size)  # (R, V), valid until the next step
        self.lm_head(hr, logits, rs)
        if self.final_softcap:
            np.tanh(logits / self.final_softcap, out=logits)
            logits *= self.final_softcap
        ph["lm_head"] += clock() - t0
        return logits


def decoder_layers(cfg: ModelConfig, w: Weights, make_mlp, *, prefix: str = "model.layers", attention=None,
                   **attn_options) -> list[Layer]:
    """The standard pre-norm layer stack; ``make_mlp(i, prefix)`` builds layer i's MLP,
    ``attention`` (default Attention) its attention, with ``layer=i`` and attn_options."""
    H = cfg.hidden_size
    attention = attention or Attention
    return [
        Layer(
            input_norm=w(f"{prefix}.{i}.input_layernorm.weight", H),
            attn=attention(cfg, w, f"{prefix}.{i}.self_attn", layer=i, **attn_options),
            post_norm=w(f"{prefix}.{i}.post_attention_layernorm.weight", H),
            mlp=make_mlp(i, f"{prefix}.{i}"),
        )
        for i in range(cfg.num_hidden_layers)
    ]


def sigmoid_routed_mlp(cfg: ModelConfig, w: Weights, act: int):
    """Layer MLPs of the DeepSeek-V3 / GLM-4.5 kind: dense up to first_k_dense_replace,
    then MoE with sigmoid group-limited routing, routed_scaling_factor and shared experts."""
    r, H = cfg.raw, cfg.hidden_size

    def mlp(i: int, p: str):
        if i < int(r.get("first_k_dense_replace") or 0):
            return GatedMLP(w, f"{p}.mlp", H, cfg.intermediate_size, act)
        shared = None
        if r.get("n_shared_experts"):
            shared = GatedMLP(w, f"{p}.mlp.shared_experts", H, cfg.moe_intermediate_size * int(r["n_shared_experts"]),
                              act)
        return MoE(cfg, w, f"{p}.mlp", router="gate", experts="experts", renormalize=cfg.norm_topk_prob, act=act,
                   sigmoid_groups=(int(r.get("n_group") or 1), int(r.get("topk_group") or 1)),
                   scale=float(r.get("routed_scaling_factor") or 1.0), shared=shared)

    return mlp


def check_experts(cfg: ModelConfig) -> None:
    if cfg.num_experts <= 0 or not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise ModelLoadError(
            f"config.json: a {cfg.model_type} model needs num_experts > 0 and "
            f"0 < num_experts_per_tok <= num_experts (got {cfg.num_experts}, {cfg.num_experts_per_tok})"
        )


def act_of(cfg: ModelConfig) -> int:
    if cfg.hidden_act not in ACTS:
        raise ModelLoadError(f"config.json: hidden_act {cfg.hidden_act!r} is not supported (supported: {', '.join(ACTS)})")
    return ACTS[cfg.hidden_act]
