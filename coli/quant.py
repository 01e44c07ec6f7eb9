"""Weight formats: f32, bf16, int8, int4 and int4s (group-wise), chosen once at load time.

int8: groups of 32 consecutive weights along the input dimension share one float16
scale d = max|w| / 127, q = round(w / d) in [-127, 127].
int4 (5 bits per weight): groups of 32 share a float16 scale d and a float16 min m,
w ~ d * q + m with q in [0, 15]. d and m are chosen to minimise the group's squared
error: 15 candidate scales around 15 / (max - min) are tried, each rounding followed by
the least-squares d and m for it, and the best kept; q is then rounded again against the
stored f16 d, m. With calibration statistics of a matrix's inputs (coli.calibration;
`coli convert --calibration`), int4 is rounded by GPTQ instead (gptq_int4): same format,
lower output error.
int4s (4.5 bits per weight; llama.cpp's Q4_0 scheme): groups of 32 share one float16
scale d = w_max / -8 where w_max is the weight of largest magnitude (sign kept),
q = clamp(round(w / d) + 8, 0, 15), w ~ d * (q - 8).
int4 and int4s pack two weights per byte: byte i of a group holds element i (low nibble)
and i + 16 (high).
The input dimension is zero-padded to a multiple of 32. Activations are quantized on the
fly by the kernels: to int16 groups of 32 for int8 weights (coli/_engine/simd_q16.h), to
int8 groups of 32 for int4 and int4s (coli/_engine/simd_q.h).
"""
from __future__ import annotations

import numpy as np

from coli._engine import kernels as K
from coli._engine import reference as R
from coli.errors import InvalidRequestError

FORMATS = ("f32", "bf16", "int8", "int4", "int4s")
QK = 32


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise InvalidRequestError(f"unknown quantization {fmt!r}; choose one of: {', '.join(FORMATS)}")
    return fmt


def _groups(w: np.ndarray) -> np.ndarray:
    """(N, K) -> (N, Kp/32, 32) float32, zero-padded along K."""
    N, Kdim = w.shape
    kp = K.padded(Kdim)
    if kp != Kdim:
        w = np.concatenate([w, np.zeros((N, kp - Kdim), np.float32)], axis=1)
    return np.asarray(w, dtype=np.float32).reshape(N, kp // QK, QK)


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    g = _groups(w)  # (N, nb, 32)
    d = (np.abs(g).max(axis=-1) / 127.0).astype(np.float16)  # (N, nb)
    df = d.astype(np.float32)[..., None]
    inv = np.divide(1.0, df, out=np.zeros_like(df), where=df != 0)
    q = np.clip(np.rint(g * inv), -127, 127).astype(np.int8)
    return q.reshape(len(w), -1), d


def quantize_int4s(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    g = _groups(w)  # (N, nb, 32)
    at = np.abs(g).argmax(axis=-1)[..., None]
    wmax = np.take_along_axis(g, at, axis=-1)  # (N, nb, 1) signed
    d = (wmax[..., 0] / -8.0).astype(np.float16)  # (N, nb)
    df = d.astype(np.float32)[..., None]
    inv = np.divide(1.0, df, out=np.zeros_like(df), where=df != 0)
    q = np.clip(np.rint(g * inv) + 8, 0, 15).astype(np.uint8)  # (N, nb, 32)
    packed = q[..., :16] | (q[..., 16:] << 4)  # (N, nb, 16)
    return packed.reshape(len(w), -1), d


INT4_CANDIDATES = np.linspace(-1.4, 1.4, 15, dtype=np.float32)  # added to 15: the candidate ranges
INT4_REFITS = 4  # GPTQ's group fits: rounds of "round q against (d, m), refit (d, m) to q" after the search


def _int4_lsq(g, a, q, sa, sx):
    """Weighted least-squares (d, m, ok) for grid q: minimise sum a (d q + m - g)^2 per group;
    ok is False where q is constant (no unique fit)."""
    aq = a * q
    sl, sll, slx = aq.sum(-1, keepdims=True), (aq * q).sum(-1, keepdims=True), (aq * g).sum(-1, keepdims=True)
    det = sa * sll - sl * sl
    ok = det > 1e-6 * sa * sa  # q not constant where a > 0 (det = sa^2 var_a(q))
    det = np.where(ok, det, 1.0)
    return (sa * slx - sl * sx) / det, (sll * sx - sl * slx) / det, ok


def _int4_fit(g: np.ndarray, a: np.ndarray | None = None, refits: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(d, m) float32 (n, 1) minimising sum a (d * q + m - g)^2 over (n, 32) groups g with
    weights a (n, 32) or (1, 32) (None: all 1), q = clamp(round((g - m) / d), 0, 15).

    Candidate grids: (max - min) / 15 from the min, and 15 scales (15 + c) / (max - min);
    each rounding is followed by the weighted least-squares d, m for it and the best kept.
    Then ``refits`` rounds of re-rounding against the best (d, m) and refitting, each kept
    only where it lowers the error. Never worse than the plain min/max grid; the refits
    lower the squared error by about 1% more (0 by default: on the built-in model they did
    not move the KL divergence, docs/QUANTIZATION.md)."""
    a = np.ones_like(g) if a is None else np.broadcast_to(np.asarray(a, np.float32), g.shape)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    span = hi - lo
    sa = a.sum(-1, keepdims=True)
    sx = (a * g).sum(-1, keepdims=True)
    best_d = span / 15.0
    best_m = lo.copy()
    inv = np.divide(1.0, best_d, out=np.zeros_like(best_d), where=best_d > 0)
    q = np.clip(np.rint((g - lo) * inv), 0, 15)
    best = (a * (best_d * q + best_m - g) ** 2).sum(-1, keepdims=True)

    def consider(q):
        nonlocal best_d, best_m, best
        d, m, ok = _int4_lsq(g, a, q, sa, sx)
        d, m = np.where(ok, d, best_d), np.where(ok, m, best_m)
        err = (a * (d * q + m - g) ** 2).sum(-1, keepdims=True)
        better = ok & (err < best)
        best_d, best_m, best = np.where(better, d, best_d), np.where(better, m, best_m), np.where(better, err, best)

    for c in INT4_CANDIDATES:
        iscale = np.divide(15.0 + c, span, out=np.zeros_like(span), where=span > 0)
        consider(np.clip(np.rint((g - lo) * iscale), 0, 15))
    for _ in range(refits):
        inv = np.divide(1.0, best_d, out=np.zeros_like(best_d), where=best_d != 0)
        consider(np.clip(np.rint((g - best_m) * inv), 0, 15))
    return best_d, best_m


def quantize_int4(w: np.ndarray, importance: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed nibbles (N, Kp/2) uint8, scales d (N, Kp/32) f16, mins m (N, Kp/32) f16).

    ``importance`` (K,): a weight per input column (e.g. the mean square of the activations
    it meets, coli.calibration), so each group minimises sum importance (w - q)^2 instead of
    the plain squared error."""
    g = _groups(w)  # (N, nb, 32)
    N, nb, _ = g.shape
    flat = g.reshape(-1, QK)
    a = None
    if importance is not None:
        imp = np.asarray(importance, np.float32)
        if imp.shape != (w.shape[1],):
            raise ValueError(f"importance has shape {imp.shape}, the matrix {w.shape}")
        a = np.broadcast_to(_groups(imp[None, :]), (N, nb, QK)).reshape(-1, QK)  # (N*nb, 32)
    d16 = np.empty(len(flat), np.float16)
    m16 = np.empty(len(flat), np.float16)
    q = np.empty(flat.shape, np.uint8)
    step = 1 << 16  # groups at a time: bounded scratch
    for s in range(0, len(flat), step):
        x = flat[s: s + step]
        d, m = _int4_fit(x, None if a is None else a[s: s + step])
        d16[s: s + step], m16[s: s + step] = d[:, 0].astype(np.float16), m[:, 0].astype(np.float16)
        df, mf = d16[s: s + step].astype(np.float32)[:, None], m16[s: s + step].astype(np.float32)[:, None]
        inv = np.divide(1.0, df, out=np.zeros_like(df), where=df != 0)
        q[s: s + step] = np.clip(np.rint((x - mf) * inv), 0, 15).astype(np.uint8)
    q = q.reshape(N, nb, QK)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return packed.reshape(N, -1), d16.reshape(N, nb), m16.reshape(N, nb)


def to_bf16(w: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (exact for weights that were bf16)."""
    bits = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def quantize(w: np.ndarray, fmt: str, stats: np.ndarray | None = None) -> K.QMatrix:
    """A (N, K) float32 weight as a QMatrix in ``fmt``. ``stats``: calibration statistics of
    the matrix's inputs x (coli.calibration), used by int4 only (the other formats ignore
    them): (K, K) E[x x^T] rounds by GPTQ (``gptq_int4``), (K,) E[x^2] weights each group's
    fit by column (``quantize_int4``'s importance)."""
    N, Kdim = w.shape
    code = K.FORMATS[check_format(fmt)]
    if fmt == "f32":
        return K.QMatrix(code, np.ascontiguousarray(w, dtype=np.float32), None, N, Kdim)
    if fmt == "bf16":
        return K.QMatrix(code, to_bf16(w), None, N, Kdim)
    if fmt == "int4":
        if stats is not None and np.ndim(stats) == 2:
            q, d, m = gptq_int4(w, stats)
        else:
            q, d, m = quantize_int4(w, stats)
        return K.QMatrix(code, q, d, N, Kdim, m)
    q, d = quantize_int8(w) if fmt == "int8" else quantize_int4s(w)
    return K.QMatrix(code, q, d, N, Kdim)


def dequantize(m: K.QMatrix) -> np.ndarray:
    """The float32 (rows, cols) matrix a QMatrix stands for (the NumPy twin of its format)."""
    data, scales, mins = m.arrays()  # (a packed matrix unpacks once)
    if m.format == "f32":
        return np.asarray(data)
    if m.format == "bf16":
        return (data.astype(np.uint32) << 16).view(np.float32)
    d = scales.astype(np.float32)[..., None]  # (N, nb, 1)
    if m.format == "int8":
        w = data.reshape(m.rows, -1, QK).astype(np.float32) * d
    else:
        p = data.reshape(m.rows, -1, 16)
        q = np.concatenate([p & 15, p >> 4], axis=-1).astype(np.float32)  # (N, nb, 32)
        if m.format == "int4":
            w = q * d + mins.astype(np.float32)[..., None]
        else:
            w = (q - 8) * d
    return w.reshape(m.rows, -1)[:, : m.cols]


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy twin of the kernels' activation quantizer: (q int8 (M, Kp), d (M, nb), sums (M, nb))."""
    g = _groups(x).astype(np.float32)  # (M, nb, 32)
    amax = np.abs(g).max(axis=-1)
    d = (amax / np.float32(127.0)).astype(np.float32)
    inv = np.divide(np.float32(127.0), amax, out=np.zeros_like(amax), where=amax > 0)[..., None]
    q = np.rint(g * inv).astype(np.int8)
    return q.reshape(len(x), -1), d, q.astype(np.int32).sum(axis=-1)


def reference_qlinear(x: np.ndarray, m: K.QMatrix) -> np.ndarray:
    """What K.qlinear computes, in float64: for int8/int4 the activations are quantized
    exactly as the kernel does (int16 groups for int8 weights, int8 groups for int4 and
    int4s), so only accumulation order differs."""
    w = dequantize(m).astype(np.float64)
    if m.format in ("f32", "bf16"):
        return (x.astype(np.float64) @ w.T).astype(np.float32)
    if m.format == "int8":
        return (R.dequantize_activations16(*R.quantize_activations16(x), m.cols) @ w.T).astype(np.float32)
    q, d, _ = quantize_activations(x)
    xd = (q.reshape(len(x), -1, QK).astype(np.float64) * d[..., None]).reshape(len(x), -1)[:, : m.cols]
    return (xd @ w.T).astype(np.float32)


def gptq_int4(w: np.ndarray, hessian: np.ndarray, damp: float = 0.01, refits: int = INT4_REFITS):
    """int4 by GPTQ (Frantar et al. 2022): columns are rounded in order and each one's error,
    spread by the inverse of ``hessian`` = E[x x^T] (K, K), is taken up by the columns not yet
    rounded, so that the output error (w - q)^T H (w - q) of each row, not the weights' own,
    is made small. A group's (d, m) is fitted (``_int4_fit``) to its columns as updated when
    its first column is reached, and the error is carried between groups in one update per
    group (GPTQ's lazy batch). ``damp`` x mean(diag H) is added to the diagonal; a column
    that never saw an input (diag 0) is rounded as it stands and carries nothing (it is not
    zeroed: other inputs may reach it). With H = I nothing is carried and the
    result is quantize_int4's with ``refits``, bit for bit. Same layout as quantize_int4."""
    N, Kdim = w.shape
    if np.shape(hessian) != (Kdim, Kdim):
        raise ValueError(f"hessian has shape {np.shape(hessian)}, expected ({Kdim}, {Kdim})")
    kp = K.padded(Kdim)
    W = np.zeros((N, kp), np.float64)
    W[:, :Kdim] = w
    H = np.eye(kp)
    H[:Kdim, :Kdim] = hessian
    dead = np.diag(H) <= 0  # columns that never saw an input: rounded as they are, nothing carried
    H[dead, dead] = 1.0
    H += damp * np.mean(np.diag(H)) * np.eye(kp)
    U = np.linalg.cholesky(np.linalg.inv(H)).T  # upper: H^-1 = U^T U, row i holds U[i, i:]
    nb = kp // QK
    q = np.empty((N, kp), np.uint8)
    d16 = np.empty((N, nb), np.float16)
    m16 = np.empty((N, nb), np.float16)
    for b in range(nb):
        c0, c1 = b * QK, (b + 1) * QK
        d, m = _int4_fit(W[:, c0:c1].astype(np.float32), refits=refits)
        d16[:, b], m16[:, b] = d[:, 0], m[:, 0]
        df, mf = d16[:, b].astype(np.float32), m16[:, b].astype(np.float32)
        inv = np.divide(1.0, df, out=np.zeros_like(df), where=df != 0)
        E = np.zeros((N, QK))
        for j in range(c0, c1):
            qj = np.clip(np.rint((W[:, j].astype(np.float32) - mf) * inv), 0, 15)  # as quantize_int4 rounds
            q[:, j] = qj
            e = (W[:, j] - (df.astype(np.float64) * qj + mf)) / U[j, j]
            W[:, j + 1: c1] -= np.outer(e, U[j, j + 1: c1])
            E[:, j - c0] = e
        W[:, c1:] -= np.einsum("ng,gk->nk", E, U[c0:c1, c1:])  # not BLAS: its threads cost more than this saves
    qg = q.reshape(N, nb, QK)
    packed = qg[..., :16] | (qg[..., 16:] << 4)
    return packed.reshape(N, -1), d16, m16
