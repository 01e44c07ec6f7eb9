"""Column scales: a matrix quantized as ``Q(W / s) * s``, ``s`` one float per input column.

A few input dimensions of a model's embedding table (and so of a tied LM head) can be far
larger than the rest: on the built-in model 3 of the 192 hidden dimensions have 9-42x the
median column RMS. A group of 32 weights takes its scale from its largest one, so every
group that holds such a column rounds its other 31 weights on a coarse grid. Dividing each
such column by ``s_j = (rms_j / median rms) ** alpha`` before rounding, and multiplying it
back where the matrix is used, gives those groups their resolution back (the idea of AWQ
and SmoothQuant's per-channel scales, here chosen without data).

Only outlier columns are scaled: those whose RMS is over OUTLIER (8) times the median
column's. Scaling every column by its RMS lowers the weights' squared error on SmolLM2's
embedding/head too (its widest columns have 3.5-6.3x the median RMS, evenly, not in spikes),
but there it doubled the KL divergence of a 4-bit head (0.097 -> 0.213), while on the
built-in model scaling the outliers alone does better than scaling all columns with an int8
head (KL 0.034 against 0.051) and nearly as well with a 4-bit one (0.078 against 0.069).

Where the matrix is used, the scale costs one multiply per input element, not per weight:
a linear layer multiplies its input by ``s`` (``Linear(..., xscale=s)``), and an embedding
lookup multiplies the rows it reads (``DecoderLM.embed_tokens``). Both are exact in float,
so a column-scaled matrix computes what its dequantized ``Q(W / s) * s`` would.

Whether scaling pays depends on the inputs: it moves rounding error from the other columns
onto the outlier ones, so it loses where the inputs are large in those dimensions. In a
model the residual stream carries the embedding's outlier dimensions, and the final norm
multiplies them by its weight: the built-in model, trained, has learned small norm weights
there (the log of the column RMS and of the norm weight correlate at -0.78), while a random
model with the same outlier columns keeps them large, and there scaling can lose.
So the error is weighted by 1 (its use as the embedding) plus an estimate of the head's
E[x_j^2], (norm_j * rms_j)^2, over its mean (its use as the head).

``choose`` tries a few ``alpha`` on a sample of the rows, keeps the one whose weighted
reconstruction error is smallest (0, no scale, whenever scaling does not help: a matrix
already on its grid, as the layers of a GGUF are, keeps its exact rounding) and quantizes
the whole matrix with it. With calibration statistics of the matrix's inputs (E[x x^T] or E[x^2]), the error is
weighted by E[x^2], and the scaled matrix is rounded against the statistics of the inputs it
then multiplies, s * x: E[(s x)(s x)^T] = s s^T * E[x x^T].
"""
from __future__ import annotations

import numpy as np

from coli._engine import kernels as K
from coli.quant import dequantize, quantize

FORMATS = ("int4", "int4s", "int8")  # grouped integer formats, where one large column costs its groups
ALPHAS = (0.25, 0.5)  # 0.75 and 1 measured worse on the logits even where they fit the weights better
OUTLIER = 8.0  # only columns whose RMS is over this many times the median column's are scaled
SAMPLE_ROWS = 4096  # rows the choice of alpha is made on (all of them when there are fewer)


def _ratios(w: np.ndarray) -> np.ndarray:
    """Each column's RMS over the median column RMS (1 for an all-zero matrix)."""
    rms = np.sqrt(np.mean(np.square(w, dtype=np.float64), axis=0))
    live = rms > 0
    r = np.ones(w.shape[1])
    if live.any():
        r[live] = rms[live] / np.median(rms[live])
    return r


def _scales(r: np.ndarray, alpha: float) -> np.ndarray:
    return np.where(r > OUTLIER, r ** alpha, 1.0).astype(np.float32)


def _error(w: np.ndarray, fmt: str, s: np.ndarray | None, weight: np.ndarray | None) -> float:
    if s is None:
        r = dequantize(quantize(w, fmt)) - w
    else:
        r = dequantize(quantize(np.ascontiguousarray(w / s), fmt)) * s - w
    r = np.square(r, dtype=np.float64)
    return float((r * weight).sum() if weight is not None else r.sum())


def choose(w: np.ndarray, fmt: str, stats: np.ndarray | None = None,
           norm: np.ndarray | None = None) -> tuple[K.QMatrix, np.ndarray | None]:
    """(the matrix quantized to ``fmt``, its column scales or None): ``w`` (N, K) float32;
    ``stats`` as coli.quant.quantize takes them (int4 rounds by them). ``norm``: the weight of
    the RMSNorm whose output the matrix multiplies (an LM head's final norm), for an estimate
    of its inputs' E[x^2] when there are no statistics (see the module's doc)."""
    if fmt not in FORMATS:
        return quantize(w, fmt, stats), None
    w = np.ascontiguousarray(w, dtype=np.float32)
    r = _ratios(w)
    if not (r > OUTLIER).any():
        return quantize(w, fmt, stats), None
    rows = w if len(w) <= SAMPLE_ROWS else w[np.linspace(0, len(w) - 1, SAMPLE_ROWS).astype(np.int64)]
    weight = None
    if stats is not None:
        weight = np.diagonal(stats) if np.ndim(stats) == 2 else np.asarray(stats)
        weight = np.maximum(weight.astype(np.float64), 0.0)
    elif norm is not None:  # the residual stream's dims scale like the table's columns, then the norm's weight
        head = np.square(np.asarray(norm, np.float64) * r)
        weight = 1.0 + head / max(head.mean(), 1e-30)  # the plain squared error (its embedding use) + the head's
    best, best_s = _error(rows, fmt, None, weight), None
    for a in ALPHAS:
        s = _scales(r, a)
        e = _error(rows, fmt, s, weight)
        if e < best * 0.98:  # a clear gain only: otherwise the plain rounding stays
            best, best_s = e, s
    if best_s is None:
        return quantize(w, fmt, stats), None
    if stats is not None:
        stats = stats * np.outer(best_s, best_s) if np.ndim(stats) == 2 else stats * best_s * best_s
    return quantize(np.ascontiguousarray(w / best_s), fmt, stats), best_s
