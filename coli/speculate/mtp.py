"""Multi-token prediction (MTP): the next-token layer that DeepSeek-V3 and GLM-4.5
checkpoints carry after their decoder (``num_nextn_predict_layers``, stored as
``model.layers.{num_hidden_layers}``), run as a drafter the way vLLM's DeepSeekMTP runs it.

Entry i of the MTP layer's own sequence (RoPE position i) joins the main model's final,
normed hidden state at position i with the embedding of token i + 1:

    e = eh_proj([enorm(embed(tok[i+1])), hnorm(h[i])]);  e = block(e);  logits = head(norm(e))

and the logits of the last entry draft the token after the next one. For more drafts the
layer is chained on its own output, as DeepSeek-V3's and GLM-4.5's reference inference (and
vLLM's) reuse one MTP layer for every depth: the next entry joins the layer's output
(the residual stream before its final norm) with the embedding of the draft just made,
and its logits give the draft after that. Chained entries are scratch: their KV is
overwritten by the next step, which computes the entries of accepted tokens from the main
model's own hidden states.
The hidden states come from the engine's residual buffer right after each main step
(``capture``); an entry is computed once its position is kept in the slot and the token
after it is known (``propose``), so the MTP layer's KV cache, like the slot's, only ever
holds accepted tokens. Transformers drops these layers when it loads the checkpoints, so
there is no reference to compare with; verification keeps the output exact whatever the
drafts are.
"""
from __future__ import annotations

import time

import numpy as np

from coli._engine import kernels as K
from coli.api import common_prefix
from coli.engine import KVCache
from coli.errors import InvalidRequestError
from coli.models.base import Attention, Layer, Linear, RunState, act_of, sigmoid_routed_mlp

FAMILIES = ("deepseek_v3", "glm4_moe")


def present(cfg, weights) -> bool:
    """``cfg`` declares MTP layers, coli can build them, and ``weights`` holds them."""
    if cfg.model_type not in FAMILIES or not int(cfg.raw.get("num_nextn_predict_layers") or 0) or weights is None:
        return False
    try:
        return bool(weights.has(f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight"))
    except Exception:  # a weight source that cannot tell
        return False


def available(model) -> bool:
    """The loaded model's checkpoint has MTP layers and coli can build them."""
    return present(model.config, getattr(model, "weights", None))


class MTPLayer:
    """The first MTP layer's weights (``model.layers.{num_hidden_layers}``), asked of a
    weight source: a checkpoint, a converted directory, or ``coli convert``'s recorder
    (which is how a converted directory keeps them)."""

    def __init__(self, cfg, w, net):
        L, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
        p = f"model.layers.{L}"
        self.enorm, self.hnorm = w(f"{p}.enorm.weight", H), w(f"{p}.hnorm.weight", H)
        self.eh_proj = w.linear(f"{p}.eh_proj.weight", H, 2 * H)  # (H, 2H): [embedding, hidden]
        if cfg.model_type == "deepseek_v3":
            from coli.models.mla import MLAAttention

            attn = MLAAttention(cfg, w, f"{p}.self_attn", layer=L)
        else:
            attn = Attention(cfg, w, f"{p}.self_attn", layer=L, qkv_bias=cfg.attention_bias, o_bias=False,
                             qk_norm="head" if cfg.raw.get("use_qk_norm") else None)
        self.attn = attn
        self.block = Layer(input_norm=w(f"{p}.input_layernorm.weight", H), attn=attn,
                           post_norm=w(f"{p}.post_attention_layernorm.weight", H),
                           mlp=sigmoid_routed_mlp(cfg, w, act_of(cfg))(L, p))
        self.norm = w(f"{p}.shared_head.norm.weight", H)
        head = f"{p}.shared_head.head.weight"
        self.head = Linear(w.matrix(head, V, H, w.head_quant)) if w.has(head) else net.lm_head


class MTPSource:
    def __init__(self, model, slots: int):
        if not available(model):
            raise InvalidRequestError(
                f"speculative mode 'mtp' needs a {' or '.join(FAMILIES)} checkpoint with num_nextn_predict_layers "
                "and its MTP weights")
        cfg, w, net = model.config, model.weights, model.engine.model
        H = cfg.hidden_size
        self.net, self.engine, self.H, self.eps = net, model.engine, H, cfg.rms_norm_eps
        layer = MTPLayer(cfg, w, net)
        self.enorm, self.hnorm, self.eh_proj = layer.enorm, layer.hnorm, layer.eh_proj
        self.block, self.norm, self.head = layer.block, layer.norm, layer.head
        attn = layer.attn
        self.caches = [KVCache(1, attn.k_width, attn.v_width, dtype=self.engine.kv_cache_dtype) for _ in range(slots)]
        self.hidden: list[dict[int, np.ndarray]] = [{} for _ in range(slots)]  # slot -> position -> h (H,)
        self.rs = RunState()
        self.seconds_per_token = 0.0  # measured: one MTP forward per drafted token

    def capture(self, plan, wanted=lambda req: True) -> None:
        """Keep the normed final hidden state of every token the step just computed for the
        requests that ``wanted(request)`` says may draft with MTP (at most the context's
        worth of rows per slot: a position computed again replaces its row)."""
        M = sum(len(s.tokens) for s in plan.seqs)
        x = self.engine.run_state.views(self.net, M, self.net.bufs)[0]  # (M, H): the final residual stream
        h = np.empty((M, self.H), np.float32)
        K.rmsnorm(x, self.net.norm, self.eps, h, self.net.unit_offset_norm)
        row = 0
        for s in plan.seqs:
            if wanted(s.request):
                store = self.hidden[s.slot]
                for j in range(len(s.tokens)):
                    store[s.start + j] = h[row + j]
            row += len(s.tokens)

    def propose(self, items: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """items: (slot, the slot's kept history + the next token, k) -> a draft of up to k
        tokens each (none where a hidden state it needs is missing, e.g. a prefix restored
        from disk)."""
        entries, hs, which = [], [], []
        for n_item, (slot, ctx, k) in enumerate(items):
            cache, store = self.caches[slot], self.hidden[slot]
            target = list(ctx[1:])  # entry i's token: ctx[i + 1]
            n = min(common_prefix(cache.tokens, target), len(target) - 1)
            need = range(n, len(target))
            if any(i not in store for i in need):
                continue
            cache.truncate(n)
            cache.reserve(len(target) + max(k, 1))
            entries.append((cache, target[n:]))
            hs.append(np.stack([store[i] for i in need]))
            for i in [i for i in store if i < n or i >= len(target)]:  # used, or rows of rejected drafts
                del store[i]
            which.append(n_item)
        drafts: list[list[int]] = [[] for _ in items]
        if not entries:
            return drafts
        t0 = time.perf_counter()
        batch, rows = self.engine._batch(entries, False)
        logits = self._forward(batch, np.concatenate(hs), rows)
        kept = [len(cache.tokens) + len(toks) for cache, toks in entries]  # each cache's real entries
        for cache, toks in entries:
            cache.tokens.extend(int(t) for t in toks)
        for n_item, tok in zip(which, logits.argmax(axis=1).tolist()):
            drafts[n_item] = [int(tok)]
        made = len(which)
        prev = list(range(len(which)))  # the entries whose output rows ``out`` holds, in order
        out = self._out[rows]  # (entries, H): the layer's output at each entry's last token
        try:
            while True:  # chain the layer on its own output for the requests that want more
                live = [j for j in prev if len(drafts[which[j]]) < items[which[j]][2]]
                if not live:
                    break
                at = {j: r for r, j in enumerate(prev)}
                chain = [(entries[j][0], [drafts[which[j]][-1]]) for j in live]
                batch, rows = self.engine._batch(chain, False)
                logits = self._forward(batch, out[[at[j] for j in live]], rows)
                out, prev = self._out[rows], live
                for (cache, toks), j, tok in zip(chain, live, logits.argmax(axis=1).tolist()):
                    cache.tokens.append(toks[0])  # (so the next link's position follows)
                    drafts[which[j]].append(int(tok))
                made += len(live)
        finally:
            for (cache, _), n in zip(entries, kept):
                cache.truncate(n)  # chained entries are scratch
        per = (time.perf_counter() - t0) / max(made, 1)
        self.seconds_per_token = per if not self.seconds_per_token else 0.8 * self.seconds_per_token + 0.2 * per
        return drafts

    def _forward(self, batch, hidden: np.ndarray, rows: np.ndarray) -> np.ndarray:
        net, rs, H, eps, unit = self.net, self.rs, self.H, self.eps, self.net.unit_offset_norm
        M = len(batch.ids)
        joined = rs.get("mtp_in", M, 2 * H)  # (M, 2H)
        x, h, o = (rs.get(n, M, H) for n in ("mtp_x", "mtp_h", "mtp_o"))
        net.embed_tokens(batch.ids, x)
        K.rmsnorm(x, self.enorm, eps, h, unit)
        K.rmsnorm(np.ascontiguousarray(hidden), self.hnorm, eps, o, unit)
        joined[:, :H], joined[:, H:] = h, o
        self.eh_proj(joined, x, rs)
        b = self.block
        K.rmsnorm(x, b.input_norm, eps, h, unit)
        b.attn(h, batch, 0, rs, o)
        K.add_rmsnorm(x, o, b.post_norm, eps, h, unit)
        b.mlp(h, rs, o)
        x += o
        self._out = x  # the layer's output (before its final norm): what a chained entry starts from
        last = rs.get("mtp_last", len(rows), H)
        K.rmsnorm(np.ascontiguousarray(x[rows]), self.norm, eps, last, unit)
        logits = rs.get("mtp_logits", len(rows), net.cfg.vocab_size)
        self.head(last, logits, rs)
        return logits
