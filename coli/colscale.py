"""Column scales: a matrix quantized as ``Q(W / s) * s``, ``s`` one float per input column.

A few input dimensions of a model's embedding table (and so of a tied LM head) can be far
larger than the rest: on the built-in model 3 of the 192 hidden dimensions have 4-42x the
median column RMS. A group of 32 weights takes its scale from its largest one, so every
group that holds such a column rounds its other 31 weights on a coarse grid. Dividing each
column by ``s_j = (rms_j / median rms) ** alpha`` before rounding, and multiplying it back
where the matrix is used, gives those groups their resolution back (the idea of AWQ and
SmoothQuant's per-channel scales, here chosen without data).

Where the matrix is used, the scale costs one multiply per input element, not per weight:
a linear layer multiplies its input by ``s`` (``Linear(..., xscale=s)``), and an embedding
lookup multiplies the rows it reads (``DecoderLM.embed_tokens``). Both are exact in float,
so a column-scaled matrix computes what its dequantized ``Q(W / s) * s`` would.

``choose`` tries a few ``alpha`` on a sample of the rows, keeps the one whose reconstruction
error is smallest (0, no scale, whenever scaling does not help: a matrix already on its grid,
as the layers of a GGUF are, keeps its exact rounding) and quantizes the whole matrix with
it. With calibration statistics of the matrix's inputs (E[x x^T] or E[x^2]), the error is
weighted by E[x^2]; a matrix that gets scales is then rounded by the plain fit, not by GPTQ:
on the built-in model's tied embedding/head, GPTQ against the scaled inputs' statistics
measured worse than the plain fit of the scaled matrix (KL 0.087 against 0.057 with
calibrated layers, docs/QUANTIZATION.md).
"""
from __future__ import annotations

import numpy as np

from coli._engine import kernels as K
from coli.quant import dequantize, quantize

FORMATS = ("int4", "int4s", "int8")  # grouped integer formats, where one large column costs its groups
ALPHAS = (0.25, 0.5)  # 0.75 and 1 measured worse on the logits even where they fit the weights better
SAMPLE_ROWS = 4096  # rows the choice of alpha is made on (all of them when there are fewer)


def _scales(w: np.ndarray, alpha: float) -> np.ndarray:
    rms = np.sqrt(np.mean(np.square(w, dtype=np.float64), axis=0))
    live = rms > 0
    if not live.any():
        return np.ones(w.shape[1], np.float32)
    s = np.ones(w.shape[1])
    s[live] = (rms[live] / np.median(rms[live])) ** alpha
    return s.astype(np.float32)


def _error(w: np.ndarray, fmt: str, s: np.ndarray | None, weight: np.ndarray | None) -> float:
    if s is None:
        r = dequantize(quantize(w, fmt)) - w
    else:
        r = dequantize(quantize(np.ascontiguousarray(w / s), fmt)) * s - w
    r = np.square(r, dtype=np.float64)
    return float((r * weight).sum() if weight is not None else r.sum())


def choose(w: np.ndarray, fmt: str, stats: np.ndarray | None = None) -> tuple[K.QMatrix, np.ndarray | None]:
    """(the matrix quantized to ``fmt``, its column scales or None): ``w`` (N, K) float32;
    ``stats`` as coli.quant.quantize takes them; they round the matrix only where it gets no
    scales."""
    if fmt not in FORMATS:
        return quantize(w, fmt, stats), None
    w = np.ascontiguousarray(w, dtype=np.float32)
    rows = w if len(w) <= SAMPLE_ROWS else w[np.linspace(0, len(w) - 1, SAMPLE_ROWS).astype(np.int64)]
    weight = None
    if stats is not None:
        weight = np.diagonal(stats) if np.ndim(stats) == 2 else np.asarray(stats)
        weight = np.maximum(weight.astype(np.float64), 0.0)
    best, best_s = _error(rows, fmt, None, weight), None
    for a in ALPHAS:
        s = _scales(w, a)
        e = _error(rows, fmt, s, weight)
        if e < best * 0.98:  # a clear gain only: otherwise the plain rounding stays
            best, best_s = e, s
    if best_s is None:
        return quantize(w, fmt, stats), None
    return quantize(np.ascontiguousarray(w / best_s), fmt), best_s
