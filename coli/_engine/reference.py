"""NumPy twins of the kernels in kernels.pyx: slow, obvious, and the parity oracle.

Each function computes what its namesake computes, from the same inputs, but
returns a new array instead of writing into a caller's buffer.
"""
import numpy as np


def linear(x, w, bias=None):
    y = x.astype(np.float64) @ w.astype(np.float64).T  # (M, N)
    if bias is not None:
        y += bias
    return y.astype(np.float32)


def rmsnorm(x, w, eps, unit_offset=False):
    x64 = x.astype(np.float64)
    r = 1.0 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + eps)  # (M, 1)
    return (x64 * r * (w + (1.0 if unit_offset else 0.0))).astype(np.float32)


def silu(x):
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


ACTS = {0: silu, 1: gelu_tanh}


def gated_act(g, u, act=0):
    return (ACTS[act](g.astype(np.float64)) * u).astype(np.float32)


def embed(ids, table, scale=1.0):
    return (table[ids] * scale).astype(np.float32)


def rope(x, n_heads, head_dim, rot_dim, pos, inv_freq, scaling=1.0):
    half = rot_dim // 2
    ang = pos[:, None].astype(np.float32) * inv_freq[None, :half]  # (M, half)
    c = (np.cos(ang.astype(np.float64)) * scaling)[:, None, :]  # (M, 1, half)
    s = (np.sin(ang.astype(np.float64)) * scaling)[:, None, :]
    y = x.reshape(len(x), n_heads, head_dim).astype(np.float64).copy()  # (M, nh, hd)
    x1, x2 = y[..., :half].copy(), y[..., half:rot_dim].copy()
    y[..., :half] = x1 * c - x2 * s
    y[..., half:rot_dim] = x2 * c + x1 * s
    return y.reshape(x.shape).astype(np.float32)


def attention(q, ks, vs, pos, n_heads, n_kv_heads, head_dim, v_head_dim, scale, window=0, softcap=0.0):
    """ks[m] / vs[m]: the (capacity, n_kv_heads, dim) caches row m reads."""
    M = len(q)
    group = n_heads // n_kv_heads
    out = np.zeros((M, n_heads, v_head_dim))
    qh = q.reshape(M, n_heads, head_dim).astype(np.float64)
    for m in range(M):
        start = max(0, pos[m] - window + 1) if window > 0 else 0
        k = ks[m][start : pos[m] + 1].astype(np.float64)  # (T, nkv, hd)
        v = vs[m][start : pos[m] + 1].astype(np.float64)
        for h in range(n_heads):
            s = k[:, h // group] @ qh[m, h] * scale  # (T,)
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            out[m, h] = (p / p.sum()) @ v[:, h // group]
    return out.reshape(M, n_heads * v_head_dim).astype(np.float32)


def moe_route_softmax(logits, k, renormalize):
    l64 = logits.astype(np.float64)
    p = np.exp(l64 - l64.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)  # (M, E)
    idx = np.argsort(-logits, axis=-1, kind="stable")[:, :k]  # (M, k)
    w = np.take_along_axis(p, idx, axis=-1)
    if renormalize:
        w /= w.sum(axis=-1, keepdims=True)
    return idx.astype(np.int32), w.astype(np.float32)


def moe_experts(x, idx, weights, gate, up, down, act=0):
    """gate/up: (E, inter, hidden), down: (E, hidden, inter)."""
    out = np.zeros(x.shape, dtype=np.float64)
    for m in range(len(x)):
        for j in range(idx.shape[1]):
            e = idx[m, j]
            h = ACTS[act](gate[e].astype(np.float64) @ x[m]) * (up[e] @ x[m])
            out[m] += weights[m, j] * (down[e].astype(np.float64) @ h)
    return out.astype(np.float32)


def moe_route_sigmoid(logits, bias, k, n_group, topk_group, renormalize, scale):
    M, E = logits.shape
    s = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))  # (M, E)
    choice = s + bias
    grouped = choice.reshape(M, n_group, E // n_group)
    top2 = -np.sort(-grouped, axis=-1)[..., :2].sum(-1)  # (M, n_group)
    groups = np.argsort(-top2, axis=-1, kind="stable")[:, :topk_group]
    mask = np.zeros((M, n_group), bool)
    np.put_along_axis(mask, groups, True, axis=-1)
    masked = np.where(np.repeat(mask, E // n_group, axis=-1), choice, -np.inf)
    idx = np.argsort(-masked, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(s, idx, axis=-1)
    if renormalize:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return idx.astype(np.int32), (w * scale).astype(np.float32)


def head_matmul(x, w):
    """out[m, h] = w[h] @ x[m, h]; x (M, nh*a), w (nh, b, a)."""
    nh, b, a = w.shape
    xh = x.reshape(len(x), nh, a).astype(np.float64)
    return np.einsum("hba,mha->mhb", w.astype(np.float64), xh).reshape(len(x), nh * b).astype(np.float32)


def q16_order(nb):
    """Where each value of a row of nb int16 activation groups sits in the kernels' layout
    (simd_q16.h): each pair of groups (b, b + 1) as b[0:16], b+1[0:16], b[16:32], b+1[16:32],
    an odd last group as it is. Returns pos (nb * 32,): value k of the row is stored at pos[k]."""
    k = np.arange(nb * 32)
    b, t = k // 32, k % 32
    paired = b < (nb & ~1)
    return np.where(paired, (b & ~1) * 32 + (t // 16) * 32 + (b & 1) * 16 + t % 16, k)


def quantize_activations16(x):
    """Activations to int16 groups of 32, as int8 weights take them: (q (M, Kp) int16 in the
    kernels' order, d (M, Kp/32) float32); d = max|x| / 32767, q = round(x * (32767 / max|x|))."""
    M, K = x.shape
    kp = (K + 31) // 32 * 32
    g = np.zeros((M, kp), np.float32)
    g[:, :K] = x
    g = g.reshape(M, kp // 32, 32)
    amax = np.abs(g).max(axis=-1)
    inv = np.divide(np.float32(32767.0), amax, out=np.zeros_like(amax), where=amax > 0)[..., None]
    natural = np.rint(g * inv).astype(np.int16).reshape(M, kp)
    q = np.empty_like(natural)
    q[:, q16_order(kp // 32)] = natural
    return q, (amax / np.float32(32767.0)).astype(np.float32)


def dequantize_activations16(q, d, K):
    """The float64 (M, K) activations that quantize_activations16's (q, d) stand for."""
    M, kp = q.shape
    natural = q[:, q16_order(kp // 32)].astype(np.float64)
    return (natural.reshape(M, -1, 32) * d[..., None]).reshape(M, kp)[:, :K]


def qlinear16_in_order(q, d, wq, wd):
    """int8 weights x int16 activations with the scalar tile's float operations, in its order
    (simd_q16.h; the NEON tiles give the same bits): per output, over groups b in turn,
    acc = acc + float32(exact int32 group sum) * (float32(weight scale) * activation scale).
    q, d: quantize_activations16's; wq (N, Kp) int8, wd (N, Kp/32) float16. (M, N) float32."""
    M, kp = q.shape
    nb = kp // 32
    x = q[:, q16_order(nb)].reshape(M, nb, 32).astype(np.int64)
    w = wq.reshape(len(wq), nb, 32).astype(np.int64)
    sums = np.einsum("mbk,nbk->mnb", x, w).astype(np.float32)  # (M, N, nb), exact below 2^31
    scales = wd.astype(np.float32)[None, :, :] * d[:, None, :]  # (M, N, nb)
    acc = np.zeros((M, len(wq)), np.float32)
    for b in range(nb):
        acc = acc + sums[:, :, b] * scales[:, :, b]
    return acc
