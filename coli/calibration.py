"""Calibration statistics for quantization: E[x x^T] of the inputs each weight matrix meets.

A matrix W (N, K) meets inputs x (K,); rounding it to Q moves its output by (W - Q) x,
whose expected square is, per row, (w - q)^T E[x x^T] (w - q). With that matrix (the
"Hessian" of the layer's output error) the int4 quantizer (coli.quant.gptq_int4) rounds
by GPTQ (Frantar et al. 2022): the columns are rounded in order and the error of each is
compensated by the columns not yet rounded. Its diagonal alone, E[x_k^2] per input
column, is llama.cpp's importance matrix (imatrix): coli.quant.quantize_int4's
``importance``.

``collect`` runs a Hugging Face model in f32 over calibration texts and returns, per
weight matrix name (the checkpoint's: ``model.layers.0.self_attn.q_proj.weight``; an
expert's ``{prefix}.{experts}.{e}.{gate|up|down}.weight``), the mean of x x^T (K, K) over
the tokens that reached it: every token for a dense matrix, the tokens routed to it for an
expert. Where K^2 would pass ``full_max`` the entry is the diagonal (K,) only. An expert no
calibration token reached gets no entry.

A tied embedding/head table is one matrix with two uses: as the head its error costs
(w - q)^T E[h h^T] (w - q), as the embedding, whose rows are added to the residual stream,
about the plain squared error. Its entry is the sum, E[h h^T] + TIED_BLEND * mean(diag) * I
(measured on the built-in model, docs/QUANTIZATION.md: the head's statistics alone, or the
plain fit, do worse). An untied head gets no entry (its GPTQ measured worse than its plain
fit there), nor does an untied embedding (no matrix product reads it).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from coli.errors import InvalidRequestError

MAX_TOKENS = 512  # tokens per calibration sequence (a longer text is cut into pieces)


def read_texts(path: str | os.PathLike) -> list[str]:
    """Calibration texts from ``path``: a .jsonl file (one {"text": ...} per line, as
    coli/atlas/default_corpus.jsonl) or any other text file, taken whole."""
    p = Path(path)
    if not p.is_file():
        raise InvalidRequestError(f"calibration file {p} does not exist")
    try:
        raw = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise InvalidRequestError(f"calibration file {p} is not UTF-8 text") from None
    if p.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                t = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError):
                raise InvalidRequestError(f"calibration file {p}, line {n}: expected a JSON object with a \"text\" "
                                          "string") from None
            if not isinstance(t, str):
                raise InvalidRequestError(f"calibration file {p}, line {n}: \"text\" is not a string")
            texts.append(t)
    else:
        texts = [raw]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise InvalidRequestError(f"calibration file {p} holds no text")
    return texts


def default_texts() -> list[str]:
    """The packaged corpus of `coli atlas` (coli/atlas/default_corpus.jsonl)."""
    return read_texts(Path(__file__).parent / "atlas" / "default_corpus.jsonl")


TIED_BLEND = 0.3  # the embedding's plain squared error, against the head's E[h h^T] (per unit of its mean diagonal)
FULL_MAX = 4096  # input width up to which E[x x^T] is kept whole (K^2 float64: 128 MiB at 4096)


class _Sums:
    """Running sum of x x^T (K, K) (or of x^2 (K,) past full_max) and the row count, per name.
    Rows are buffered and summed FLUSH_ROWS at a time: one matrix product per flush instead
    of one per step (a step is often a handful of tokens)."""

    FLUSH_ROWS = 2048

    def __init__(self, full_max: int = FULL_MAX):
        self.sq: dict[str, np.ndarray] = {}
        self.n: dict[str, int] = {}
        self.buf: dict[str, list[np.ndarray]] = {}
        self.rows: dict[str, int] = {}
        self.full_max = full_max

    def add(self, name: str, x: np.ndarray) -> None:
        self.buf.setdefault(name, []).append(np.array(x, dtype=np.float32))  # a copy: x is a reused buffer
        self.rows[name] = self.rows.get(name, 0) + len(x)
        if self.rows[name] >= self.FLUSH_ROWS:
            self._flush(name)

    def _flush(self, name: str) -> None:
        x = np.concatenate(self.buf.pop(name))  # (rows, K)
        self.rows[name] = 0
        if x.shape[1] <= self.full_max:
            s = (x.T @ x).astype(np.float64)  # (K, K)
        else:
            s = np.einsum("mk,mk->k", x, x, dtype=np.float64)  # (K,)
        if name in self.sq:
            self.sq[name] += s
        else:
            self.sq[name] = s
        self.n[name] = self.n.get(name, 0) + len(x)

    def means(self) -> dict[str, np.ndarray]:
        for name in list(self.buf):
            self._flush(name)
        return {k: v / self.n[k] for k, v in self.sq.items() if self.n[k]}


def _taps(net, names: dict[int, str], experts: dict[int, tuple], sums: _Sums) -> None:
    """Make every Linear and MoE of ``net`` record their inputs into ``sums``, the LM head only
    when it is the embedding table (by class swap: the recorded model is built for
    calibration only)."""
    from coli.models.base import Linear, LinearGroup, MoE

    class TapLinear(Linear):
        def __call__(self, x, out, rs):
            sums.add(names[id(self.mat)], x)
            super().__call__(x, out, rs)

    class TapMoE(MoE):
        def __call__(self, x, rs, out):
            super().__call__(x, rs, out)
            prefix, sub, (g, u, d) = experts[id(self.table)]
            for e in np.unique(self.last):
                xe = x[(self.last == e).any(axis=1)]  # (T_e, H) the tokens routed to e
                gm, um, _ = (np.asarray(m.data) for m in self.table.get(int(e)))  # f32 (I, H) each
                a, b = xe @ gm.T, xe @ um.T  # (T_e, I)
                if self.act == 0:
                    h = a / (1.0 + np.exp(-a)) * b  # silu(gate) * up
                else:
                    h = 0.5 * a * (1.0 + np.tanh(0.7978845608 * (a + 0.044715 * a ** 3))) * b
                sums.add(f"{prefix}.{sub}.{e}.{g}.weight", xe)
                sums.add(f"{prefix}.{sub}.{e}.{u}.weight", xe)
                sums.add(f"{prefix}.{sub}.{e}.{d}.weight", h)

    seen: set[int] = set() if net.lm_head.mat is net.embed else {id(net.lm_head)}

    def visit(obj, depth=0):
        if id(obj) in seen or depth > 6:
            return
        seen.add(id(obj))
        if isinstance(obj, Linear):
            if id(obj.mat) in names:
                obj.__class__ = TapLinear
            return
        if isinstance(obj, LinearGroup):
            obj.fused = False  # each member then runs (and records) on its own
        if isinstance(obj, MoE) and obj.table is not None and id(obj.table) in experts:
            obj.__class__ = TapMoE
        if isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v, depth + 1)
        elif type(obj).__module__.startswith("coli.models"):
            for v in vars(obj).values():
                visit(v, depth + 1)

    visit(net)


def collect(model_dir: str | os.PathLike, texts: list[str], *, threads: int | None = None,
            max_tokens: int = MAX_TOKENS, full_max: int = FULL_MAX, progress=None) -> dict[str, np.ndarray]:
    """E[x x^T] (K, K) float64 of the inputs of every weight matrix of the Hugging Face model
    in ``model_dir`` (but its head and embedding), over ``texts`` run through it in f32, each
    text cut into pieces of at most ``max_tokens`` tokens; (K,) E[x^2] where K > ``full_max``.
    ``progress(done, total)`` is called after each piece."""
    from coli.api import Model
    from coli.config import ModelConfig
    from coli.engine import Engine
    from coli.models import build_model
    from coli.tokenizer import Tokenizer
    from coli.weights.safetensors import Checkpoint
    from coli.weights.source import HFWeights

    names: dict[int, str] = {}
    experts: dict[int, tuple] = {}

    class NamingWeights(HFWeights):
        def matrix(self, name, rows, cols, fmt=None, row_order=None):
            m = super().matrix(name, rows, cols, fmt, row_order)
            names[id(m)] = name
            return m

        def experts(self, prefix, sub, names_, E, H, I, k):
            r = super().experts(prefix, sub, names_, E, H, I, k)
            experts[id(r.table)] = (prefix, sub, names_)
            return r

    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    w = NamingWeights(Checkpoint(model_dir), "f32")
    net = build_model(cfg, w)
    w.finish()
    model = Model(model_dir, cfg, tok, Engine(net, threads=threads, weights=w), w)
    sums = _Sums(full_max)
    _taps(net, names, experts, sums)
    pieces = []
    for t in texts:
        ids = tok.encode(t)
        pieces += [ids[i: i + max_tokens] for i in range(0, len(ids), max_tokens)]
    pieces = [p for p in pieces if p]
    if not pieces:
        raise InvalidRequestError("the calibration texts hold no tokens")
    try:
        for i, p in enumerate(pieces):
            model.forward(p)
            if progress is not None:
                progress(i + 1, len(pieces))
    finally:
        w.close()
    out = sums.means()
    tied = names.get(id(net.embed))
    if net.lm_head.mat is net.embed and tied in out and out[tied].ndim == 2:
        h = out[tied]
        out[tied] = h + TIED_BLEND * np.mean(np.diag(h)) * np.eye(len(h))
    return out
