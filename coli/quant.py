"""Weight formats: f32, bf16, int8, int4 and int4s (group-wise), chosen once at load time.

int8: groups of 32 consecutive weights along the input dimension share one float16
scale d = max|w| / 127, q = round(w / d) in [-127, 127].
int4 (5 bits per weight): groups of 32 share a float16 scale d and a float16 min m,
w ~ d * q + m with q in [0, 15]. d and m are chosen to minimise the group's squared
error: 15 candidate scales around 15 / (max - min) are tried, each rounding followed by
the least-squares d and m for it, and the best kept; q is then rounded again against the
stored f16 d, m.
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


def _int4_fit(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d, m) float32 (n, 1) minimising sum (d * q + m - g)^2 over (n, 32) groups g, q the
    rounding of g onto the grid of one of the candidate scales (15 + c) / (max - min)."""
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    span = hi - lo
    n = np.float32(g.shape[-1])
    sx = g.sum(-1, keepdims=True)
    best_d = span / 15.0
    best_m = lo.copy()
    inv = np.divide(1.0, best_d, out=np.zeros_like(best_d), where=best_d > 0)
    q = np.clip(np.rint((g - lo) * inv), 0, 15)
    best = ((best_d * q + best_m - g) ** 2).sum(-1, keepdims=True)
    for c in INT4_CANDIDATES:
        iscale = np.divide(15.0 + c, span, out=np.zeros_like(span), where=span > 0)
        q = np.clip(np.rint((g - lo) * iscale), 0, 15)
        sl, sll, slx = q.sum(-1, keepdims=True), (q * q).sum(-1, keepdims=True), (q * g).sum(-1, keepdims=True)
        det = n * sll - sl * sl
        ok = det > 0.5  # q is not constant (det is an integer)
        det = np.where(ok, det, 1.0)
        d = np.where(ok, (n * slx - sl * sx) / det, best_d)
        m = np.where(ok, (sll * sx - sl * slx) / det, best_m)
        err = ((d * q + m - g) ** 2).sum(-1, keepdims=True)
        better = ok & (err < best)
        best_d, best_m, best = np.where(better, d, best_d), np.where(better, m, best_m), np.where(better, err, best)
    return best_d, best_m


def quantize_int4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed nibbles (N, Kp/2) uint8, scales d (N, Kp/32) f16, mins m (N, Kp/32) f16)."""
    g = _groups(w)  # (N, nb, 32)
    N, nb, _ = g.shape
    flat = g.reshape(-1, QK)
    d16 = np.empty(len(flat), np.float16)
    m16 = np.empty(len(flat), np.float16)
    q = np.empty(flat.shape, np.uint8)
    step = 1 << 16  # groups at a time: bounded scratch
    for s in range(0, len(flat), step):
        x = flat[s: s + step]
        d, m = _int4_fit(x)
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


def quantize(w: np.ndarray, fmt: str) -> K.QMatrix:
    """A (N, K) float32 weight as a QMatrix in ``fmt``."""
    N, Kdim = w.shape
    code = K.FORMATS[check_format(fmt)]
    if fmt == "f32":
        return K.QMatrix(code, np.ascontiguousarray(w, dtype=np.float32), None, N, Kdim)
    if fmt == "bf16":
        return K.QMatrix(code, to_bf16(w), None, N, Kdim)
    if fmt == "int4":
        q, d, m = quantize_int4(w)
        return K.QMatrix(code, q, d, N, Kdim, m)
    q, d = quantize_int8(w) if fmt == "int8" else quantize_int4s(w)
    return K.QMatrix(code, q, d, N, Kdim)


def dequantize(m: K.QMatrix) -> np.ndarray:
    """The float32 (rows, cols) matrix a QMatrix stands for (the NumPy twin of its format)."""
    if m.format == "f32":
        return np.asarray(m.data)
    if m.format == "bf16":
        return (m.data.astype(np.uint32) << 16).view(np.float32)
    d = m.scales.astype(np.float32)[..., None]  # (N, nb, 1)
    if m.format == "int8":
        w = m.data.reshape(m.rows, -1, QK).astype(np.float32) * d
    else:
        p = m.data.reshape(m.rows, -1, 16)
        q = np.concatenate([p & 15, p >> 4], axis=-1).astype(np.float32)  # (N, nb, 32)
        if m.format == "int4":
            w = q * d + m.mins.astype(np.float32)[..., None]
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
