"""Every kernel against its NumPy twin (coli/_engine/reference.py), over odd sizes
that exercise the SIMD tails and the register-tile edges."""
from __future__ import annotations

import time

import numpy as np
import pytest

from coli._engine import kernels as K
from coli._engine import reference as R
from coli.quant import dequantize, quantize, reference_qlinear

RNG = np.random.default_rng(1234)
TOL = dict(atol=2e-5, rtol=2e-5)


def rand(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _own_rand(seed):
    """rand() on a generator of the test's own, leaving the module's RNG (which later tests'
    data comes from) where it was."""
    rng = np.random.default_rng(seed)
    return lambda *shape, scale=1.0: (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"], autouse=True)
def threads(request):
    K.set_num_threads(request.param)
    K.set_small_work(0)  # with 2 threads, even the tiny test shapes take the parallel path
    yield request.param
    K.set_num_threads(2)
    K.set_small_work(1 << 15)


def test_simd_path_is_known():
    from coli._engine import dispatch

    assert K.simd_name() in dispatch.PATHS + ("native",)
    assert K.__name__ == f"coli._engine._kernels_{K.simd_name()}"


@pytest.mark.parametrize("M,N,K_", [(1, 1, 1), (1, 7, 33), (3, 17, 15), (5, 31, 47), (9, 64, 128), (4, 4, 16),
                                    (13, 129, 257)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear(M, N, K_, bias):
    x, w = rand(M, K_), rand(N, K_)
    b = rand(N) if bias else None
    out = np.empty((M, N), np.float32)
    K.linear(x, w, out, b)
    np.testing.assert_allclose(out, R.linear(x, w, b), **TOL)


def test_linear_rejects_bad_shapes():
    with pytest.raises(ValueError):
        K.linear(rand(2, 3), rand(4, 5), np.empty((2, 4), np.float32))


@pytest.mark.parametrize("M,H", [(1, 1), (3, 17), (7, 64), (2, 1001)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rmsnorm(M, H, unit_offset):
    x, w = rand(M, H), rand(H)
    out = np.empty_like(x)
    K.rmsnorm(x, w, 1e-6, out, unit_offset)
    np.testing.assert_allclose(out, R.rmsnorm(x, w, 1e-6, unit_offset), **TOL)
    K.rmsnorm(x, w, 1e-6, x, unit_offset)  # in place
    np.testing.assert_allclose(x, out, **TOL)


@pytest.mark.parametrize("M,H", [(1, 64), (3, 17), (40, 1024)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_rmsnorm_equals_add_then_rmsnorm(M, H, unit_offset):
    x, add, w = rand(M, H), rand(M, H), rand(H)
    want_x = x + add
    want = np.empty_like(x)
    K.rmsnorm(want_x, w, 1e-6, want, unit_offset)
    out = np.empty_like(x)
    K.add_rmsnorm(x, add, w, 1e-6, out, unit_offset)
    np.testing.assert_array_equal(x, want_x)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("bad", ["dtype", "shape", "strided", "readonly", "list"])
def test_array_arguments_are_checked(bad):
    """The kernels that take plain ndarrays reject what a typed memoryview would."""
    x, w, out = rand(3, 8), rand(8), np.empty((3, 8), np.float32)
    if bad == "dtype":
        out = out.astype(np.float64)
    elif bad == "shape":
        w = rand(9)
    elif bad == "strided":
        x = rand(3, 16)[:, ::2]
    elif bad == "readonly":
        out.flags.writeable = False
    else:
        x = x.tolist()
    with pytest.raises(TypeError if bad == "list" else ValueError):
        K.rmsnorm(x, w, 1e-6, out)


@pytest.mark.parametrize("norm", [None, "head", "full"])
@pytest.mark.parametrize("nh,nkv,hd,rot", [(4, 2, 16, 16), (3, 3, 10, 4), (8, 1, 32, 16)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_attention_front_equals_norm_rope_kv_write(norm, nh, nkv, hd, rot, unit_offset):
    """Bit-identical to the kernels it replaces, for rows of two sequences in one batch."""
    M, L, layer, cap = 5, 3, 1, 12
    q, k, v = rand(M, nh * hd), rand(M, nkv * hd), rand(M, nkv * hd)
    qn, kn = {None: (None, None), "head": (rand(hd), rand(hd)), "full": (rand(nh * hd), rand(nkv * hd))}[norm]
    inv = (1.0 / 10000 ** (np.arange(0, rot, 2) / rot)).astype(np.float32)
    pos = np.array([3, 4, 0, 1, 11], np.int32)
    seq = np.array([0, 0, 1, 1, 1])
    caches = [[np.zeros((L, cap, nkv * hd), np.float32) for _ in range(2)] for _ in range(2)]  # [k, v] per sequence
    kptr = np.array([[c[0].ctypes.data + l * c[0].strides[0] for c in (caches[s] for s in seq)] for l in range(L)])
    vptr = np.array([[c[1].ctypes.data + l * c[1].strides[0] for c in (caches[s] for s in seq)] for l in range(L)])
    want_q, want_k = q.copy(), k.copy()
    if norm == "head":
        for t, wt in ((want_q.reshape(-1, hd), qn), (want_k.reshape(-1, hd), kn)):
            K.rmsnorm(t, wt, 1e-5, t, unit_offset)
    elif norm == "full":
        K.rmsnorm(want_q, qn, 1e-5, want_q, unit_offset)
        K.rmsnorm(want_k, kn, 1e-5, want_k, unit_offset)
    K.rope(want_q, nh, hd, rot, pos, inv, 0.75)
    K.rope(want_k, nkv, hd, rot, pos, inv, 0.75)
    front = K.AttentionFront(nh, nkv, hd, rot, inv, 0.75, norm, qn, kn, 1e-5, unit_offset)
    K.attention_front(front, q, k, v, pos, kptr, vptr, layer)
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(k, want_k)
    for m in range(M):
        np.testing.assert_array_equal(caches[seq[m]][0][layer, pos[m]], want_k[m])
        np.testing.assert_array_equal(caches[seq[m]][1][layer, pos[m]], v[m])
    assert not any(c[i][l].any() for c in caches for i in range(2) for l in range(L) if l != layer)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (0, 4.0)])
@pytest.mark.parametrize("norm", [None, "head"])
def test_attention_front_with_out_equals_front_then_attention(window, softcap, norm):
    """Given an output, attention_front also runs the attention (one call per layer): the
    bits of attention_front and then attention, rows of two sequences, one chunk or several."""
    rand = _own_rand(11)
    nh, nkv, hd, L, layer, cap = 6, 2, 32, 2, 1, 150
    inv = (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    qn, kn = (rand(hd), rand(hd)) if norm else (None, None)
    pos = np.array([3, 70, 149, 0], np.int32)
    seq = np.array([0, 0, 0, 1])
    history = [rand(L, cap, nkv * hd) for _ in range(4)]  # k, v of two sequences
    q, k, v = rand(4, nh * hd), rand(4, nkv * hd), rand(4, nkv * hd)
    outs, caches = [], []
    for fused in (False, True):
        c = [h.copy() for h in history]
        kptr = np.array([[c[2 * s].ctypes.data + l * c[0].strides[0] for s in seq] for l in range(L)])
        vptr = np.array([[c[2 * s + 1].ctypes.data + l * c[0].strides[0] for s in seq] for l in range(L)])
        front = K.AttentionFront(nh, nkv, hd, hd, inv, 1.0, norm, qn, kn, 1e-5, False, 0.2, window, softcap)
        qq, kk, out = q.copy(), k.copy(), np.empty((4, nh * hd), np.float32)
        if fused:
            K.attention_front(front, qq, kk, v, pos, kptr, vptr, layer, out)
        else:
            K.attention_front(front, qq, kk, v, pos, kptr, vptr, layer)
            K.attention(qq, kptr[layer], vptr[layer], pos, out, nh, nkv, hd, hd, 0.2, window, softcap)
        outs.append(out)
        caches.append(c)
    np.testing.assert_array_equal(outs[1], outs[0])
    for a, b in zip(*caches):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="out must be"):
        K.attention_front(front, q.copy(), k.copy(), v, pos, kptr, vptr, layer, np.empty((4, nh * hd - 1), np.float32))


def test_attention_front_rejects_bad_shapes():
    inv = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="norm weights"):
        K.AttentionFront(4, 2, 8, 8, inv, 1.0, "full", rand(32), rand(8))
    front = K.AttentionFront(4, 2, 8, 8, inv)
    q, k, v, pos = rand(2, 32), rand(2, 16), rand(2, 16), np.zeros(2, np.int32)
    ptr = np.zeros((3, 2), np.int64)
    with pytest.raises(ValueError, match="shape"):
        K.attention_front(front, rand(2, 24), k, v, pos, ptr, ptr, 0)
    with pytest.raises(ValueError, match="shape"):
        K.attention_front(front, q, k, v, pos, np.zeros((3, 1), np.int64), ptr, 0)
    with pytest.raises(ValueError, match="layer"):
        K.attention_front(front, q, k, v, pos, ptr, ptr, 3)


@pytest.mark.parametrize("act", [0, 1])
@pytest.mark.parametrize("N", [1, 7, 8, 15, 16, 17, 37, 1536])
def test_gated_act(act, N):
    g, u = rand(5, N, scale=3), rand(5, N)
    out = np.empty_like(g)
    K.gated_act(g, u, out, act)
    np.testing.assert_allclose(out, R.gated_act(g, u, act), **TOL)
    K.gated_act(g, u, g, act)  # in place (the MLP writes act(g) * u over g)
    np.testing.assert_array_equal(g, out)


@pytest.mark.parametrize("act", [0, 1])
def test_gated_act_extremes(act):
    """Far into both tails the vector exp saturates: results stay finite and near the twin's."""
    g = np.array([[-200, -100, -88, -45, -20, -9, -1e-3, 0, 1e-3, 9, 20, 45, 88, 100, 200, 3e4, -3e4]], np.float32)
    u = np.full_like(g, 1.5)
    out = np.empty_like(g)
    K.gated_act(g, u, out, act)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, R.gated_act(g, u, act), **TOL)
    # each element alone, at another lane, gives the same bits (no dependence on position)
    for j in (0, 5, 16):
        one = np.empty((1, 1), np.float32)
        K.gated_act(g[:, j:j + 1], u[:, j:j + 1], one, act)
        assert one[0, 0] == out[0, j]


def test_embed():
    table, ids = rand(50, 19), np.array([3, 0, 49, 3], np.int32)
    out = np.empty((4, 19), np.float32)
    K.embed(ids, table, out, 1.5)
    np.testing.assert_allclose(out, R.embed(ids, table, 1.5), **TOL)


@pytest.mark.parametrize("nh,hd,rot", [(3, 8, 8), (2, 34, 34), (4, 16, 8)])
def test_rope(nh, hd, rot):
    M = 6
    x = rand(M, nh * hd)
    pos = np.array([0, 1, 5, 77, 1000, 4095], np.int32)
    inv = (1.0 / 10000 ** (np.arange(0, rot, 2) / rot)).astype(np.float32)
    ref = R.rope(x, nh, hd, rot, pos, inv, 0.9)
    K.rope(x, nh, hd, rot, pos, inv, 0.9)
    np.testing.assert_allclose(x, ref, atol=1e-4, rtol=1e-4)


def at_offset(shape, off):
    """A float32 array whose data starts off floats past a 64-byte boundary (the attention
    kernel reads misaligned cache rows differently from aligned ones)."""
    n = int(np.prod(shape))
    raw = np.empty(n + 32, np.float32)
    start = (off - raw.ctypes.data // 4) % 16
    return raw[start : start + n].reshape(shape)


# head dims around the SIMD widths (8 / 16 floats) and the 8-vector register chunks (128)
ATT_DIMS = [(4, 2, 8, 8), (3, 3, 17, 17), (6, 1, 33, 20), (4, 2, 72, 72), (2, 1, 80, 80), (8, 2, 96, 96),
            (3, 1, 200, 200), (4, 4, 128, 128), (8, 2, 136, 264), (2, 1, 256, 256)]


@pytest.mark.parametrize("nh,nkv,hd,vd", ATT_DIMS)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (3, 0.0), (20, 0.0), (0, 5.0)])
def test_attention_and_kv_write(nh, nkv, hd, vd, window, softcap):
    """Rows from two sequences of different lengths, each attending its own cache; contexts
    on both sides of the key-block boundaries (blocks of 8 or 16 keys). One cache is 64-byte
    aligned, the other not."""
    caps = [9, 301]
    kc = [at_offset((c, nkv * hd), off) for c, off in zip(caps, (0, 4))]  # (cap, nkv*hd) per sequence
    vc = [at_offset((c, nkv * vd), off) for c, off in zip(caps, (0, 12))]
    seq = np.array([0, 0, 1, 1, 1, 1, 1, 1, 1], np.int64)
    pos = np.array([7, 8, 0, 14, 15, 16, 32, 5, 300], np.int32)
    for c in range(2):  # fill the history the new rows attend to
        kc[c][:] = rand(caps[c], nkv * hd)
        vc[c][:] = rand(caps[c], nkv * vd)
    M = len(pos)
    kptr = np.array([kc[s].ctypes.data for s in seq], np.int64)
    vptr = np.array([vc[s].ctypes.data for s in seq], np.int64)
    k_new, v_new = rand(M, nkv * hd), rand(M, nkv * vd)
    K.kv_write(k_new, v_new, kptr, vptr, pos)
    for m in range(M):
        np.testing.assert_array_equal(kc[seq[m]][pos[m]], k_new[m])
        np.testing.assert_array_equal(vc[seq[m]][pos[m]], v_new[m])
    q = rand(M, nh * hd)
    out = np.empty((M, nh * vd), np.float32)
    K.attention(q, kptr, vptr, pos, out, nh, nkv, hd, vd, hd ** -0.5, window, softcap)
    ks = [kc[s].reshape(-1, nkv, hd) for s in seq]
    vs = [vc[s].reshape(-1, nkv, vd) for s in seq]
    np.testing.assert_allclose(out, R.attention(q, ks, vs, pos, nh, nkv, hd, vd, hd ** -0.5, window, softcap), **TOL)


@pytest.mark.parametrize("nh,nkv,hd", [(4, 4, 64), (8, 2, 128), (6, 1, 40)])
def test_attention_wide_score_range(nh, nkv, hd):
    """Scores spread over hundreds: most probabilities underflow to 0 (the vectorized exp
    flushes below ~1e-38), the running maximum jumps between blocks, nothing gives NaN. Small
    integer q and k make every score exact in float32, so only the exp and the sums differ
    from the float64 reference."""
    cap = 200
    kc = RNG.integers(-3, 4, (cap, nkv * hd)).astype(np.float32)
    kc[::7] *= 2.0  # a few keys far above / below the rest
    vc = rand(cap, nkv * hd)
    pos = np.array([0, 15, 16, 99, 199], np.int32)
    M = len(pos)
    kptr = np.full(M, kc.ctypes.data, np.int64)
    vptr = np.full(M, vc.ctypes.data, np.int64)
    q = RNG.integers(-3, 4, (M, nh * hd)).astype(np.float32)
    out = np.empty((M, nh * hd), np.float32)
    K.attention(q, kptr, vptr, pos, out, nh, nkv, hd, hd, 1.0)
    ks = [kc.reshape(cap, nkv, hd)] * M
    vs = [vc.reshape(cap, nkv, hd)] * M
    s = np.einsum("mhd,jhd->mhj", q.reshape(M, nkv, -1, hd)[:, :, 0], kc.reshape(cap, nkv, hd))
    assert np.ptp(s) > 200  # the test does cover a wide range
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, R.attention(q, ks, vs, pos, nh, nkv, hd, hd, 1.0), **TOL)


@pytest.mark.parametrize("nh,nkv,hd,vd,v_stride", [(4, 1, 64, 64, 0), (8, 2, 72, 72, 0), (8, 2, 128, 96, 0),
                                                   (6, 1, 48, 32, 48), (8, 1, 576, 512, 576)])
def test_attention_does_not_depend_on_alignment(nh, nkv, hd, vd, v_stride):
    """The same cache at every float offset from a 64-byte boundary gives bit-identical results
    (misaligned rows shared by several heads are realigned before use)."""
    cap, pos = 40, np.array([0, 17, 39], np.int32)
    kw = v_stride if v_stride else nkv * hd
    k0, v0 = rand(cap, kw), rand(cap, nkv * vd)
    q = rand(len(pos), nh * hd)
    outs = []
    for off in range(16):
        kc = at_offset(k0.shape, off)
        kc[:] = k0
        vc = kc if v_stride else at_offset(v0.shape, (off * 7) % 16)
        if not v_stride:
            vc[:] = v0
        kptr = np.full(len(pos), kc.ctypes.data, np.int64)
        vptr = np.full(len(pos), vc.ctypes.data, np.int64)
        out = np.empty((len(pos), nh * vd), np.float32)
        K.attention(q, kptr, vptr, pos, out, nh, nkv, hd, vd, 0.1, 0, 0.0, v_stride)
        outs.append(out)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    ks = [k0[:, : nkv * hd].reshape(cap, nkv, hd)] * len(pos)
    vs = [(k0[:, :vd] if v_stride else v0).reshape(cap, nkv, vd)] * len(pos)
    np.testing.assert_allclose(outs[0], R.attention(q, ks, vs, pos, nh, nkv, hd, vd, 0.1), **TOL)


# ---- the f16 KV cache: rounding on write, exact widening on read


def _f16_hard_values(n, rand):
    """Floats that exercise f32 -> f16 rounding: ordinary values, exact ties at several
    exponents, values past the largest half (65504) that round to it or overflow, the
    smallest normals and the subnormals and what underflows to 0, signed zeros and infinities."""
    x = rand(n, scale=3.0)
    ulp = np.float32(2.0 ** -10)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65519.99, 65520, 70000, -65520, 2 ** -14, 2 ** -24,
                         2 ** -25, 2 ** -25 * 1.0001, 3 * 2 ** -25, 2 ** -26, 1e-9, 6.1e-5, -6.0e-8,
                         1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), 1024 + 0.5, 1025 + 0.5, 2 ** -14 * (1 + ulp / 2)],
                        np.float32)
    both = np.concatenate([specials, specials * np.float32(1.5)])[:n]
    x[: len(both)] = both
    return x


def _as_half_cache(a):
    """A float16 copy of a float32 array at the same element offset from 64 bytes."""
    h = np.empty(a.shape, np.float16)
    h[:] = a
    return h


@pytest.mark.parametrize("w", [1, 7, 8, 16, 33, 64, 200])
def test_kv_write_half_rounds_like_numpy(w):
    """An f16 cache gets each row rounded to nearest even, as NumPy's astype(float16), bit for
    bit: ties, overflow to inf, half subnormals and underflow included (the SIMD conversion
    and its scalar tail alike)."""
    M, cap = 6, 10
    rand = _own_rand(w)
    k, v = _f16_hard_values(M * w, rand).reshape(M, w), rand(M, w)
    kc, vc = np.zeros((cap, w), np.float16), np.zeros((cap, w), np.float16)
    pos = np.array([0, 3, 9, 1, 2, 5], np.int32)
    K.kv_write(k, v, np.full(M, kc.ctypes.data, np.int64), np.full(M, vc.ctypes.data, np.int64), pos, True)
    with np.errstate(over="ignore"):  # the values past 65520 are meant to overflow to inf
        want = k.astype(np.float16)
    np.testing.assert_array_equal(kc[pos].view(np.uint16), want.view(np.uint16))
    np.testing.assert_array_equal(vc[pos].view(np.uint16), v.astype(np.float16).view(np.uint16))
    assert not kc[[4, 6, 7, 8]].any()


# Shapes whose f16 keys / values are widened in registers on some path (head dims of 1, 2, 4, 8
# or, for groups of two or more, 16 vectors of 16, 8, 4 or 1 floats; groups of 1 to 5 heads, 5
# splitting into items of 4 + 1): SmolLM2's (9, 3, 64), Llama's (8, 2, 128) group of 4, values
# narrower than keys, and head dims that are a multiple of the vector width on AVX2 or NEON
# only. ATT_DIMS' odd widths take the staging buffer instead.
HALF_DIRECT_DIMS = [(9, 3, 64, 64), (4, 1, 32, 32), (2, 2, 16, 16), (6, 2, 64, 48), (5, 1, 128, 128),
                    (8, 2, 128, 128), (4, 2, 24, 40), (3, 3, 8, 8)]


@pytest.mark.parametrize("nh,nkv,hd,vd", ATT_DIMS + HALF_DIRECT_DIMS)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (20, 0.0), (0, 5.0)])
def test_attention_half_is_float32_of_the_rounded_values(nh, nkv, hd, vd, window, softcap):
    """Attention over f16 caches gives the very bits of attention over float32 caches that
    hold the same rounded values (keys and values are widened exactly, in registers or through
    the staging buffer, then the float32 arithmetic runs), for rows of two sequences at block
    and chunk boundaries."""
    rand = _own_rand(hd * 7 + vd + window)
    caps = [9, 301]
    seq = np.array([0, 0, 1, 1, 1, 1, 1, 1, 1], np.int64)
    pos = np.array([7, 8, 0, 14, 15, 16, 64, 65, 300], np.int32)
    k16 = [rand(c, nkv * hd).astype(np.float16) for c in caps]
    v16 = [rand(c, nkv * vd).astype(np.float16) for c in caps]
    k32 = [at_offset(a.shape, 3) for a in k16]
    v32 = [at_offset(a.shape, 0) for a in v16]
    for a, b in zip(k32 + v32, k16 + v16):
        a[:] = b
    M = len(pos)
    q = rand(M, nh * hd)
    outs = []
    for ks, vs, half in ((k32, v32, False), (k16, v16, True)):
        out = np.empty((M, nh * vd), np.float32)
        K.attention(q, np.array([ks[s].ctypes.data for s in seq]), np.array([vs[s].ctypes.data for s in seq]), pos,
                    out, nh, nkv, hd, vd, hd ** -0.5, window, softcap, 0, half)
        outs.append(out)
    np.testing.assert_array_equal(outs[1], outs[0])
    ref = R.attention(q, [k32[s].reshape(-1, nkv, hd) for s in seq], [v32[s].reshape(-1, nkv, vd) for s in seq], pos,
                      nh, nkv, hd, vd, hd ** -0.5, window, softcap)
    np.testing.assert_allclose(outs[1], ref, **TOL)


@pytest.mark.parametrize("nh,nkv,hd,vd,v_stride", [(9, 3, 64, 64, 0), (4, 2, 72, 40, 0), (8, 1, 576, 512, 576)])
@pytest.mark.parametrize("window", [0, 11])
def test_attention_half_prefill_tiles_widen_each_chunk_once(nh, nkv, hd, vd, v_stride, window):
    """A prefill's rows of one sequence (tiles of up to 16) read each chunk of their f16 cache
    widened once for the tile: the same bits as float32 caches of the rounded values, beside a
    sequence of three scattered rows (whose chunks, with a window, do not fit one widened span
    and are read block by block) and a second run on another cache."""
    rand = _own_rand(hd + vd + window)
    caps = [40, 30, 25]
    kw = v_stride if v_stride else nkv * hd
    k16 = [rand(c, kw).astype(np.float16) for c in caps]
    v16 = k16 if v_stride else [rand(c, nkv * vd).astype(np.float16) for c in caps]
    k32 = [a.astype(np.float32) for a in k16]
    v32 = k32 if v_stride else [a.astype(np.float32) for a in v16]
    seq = np.array([0] * 20 + [1] * 3 + [2] * 17)
    pos = np.concatenate([np.arange(5, 25), [3, 17, 29], np.arange(8, 25)]).astype(np.int32)
    q = rand(len(pos), nh * hd)
    outs = []
    for ks, vs, half in ((k32, v32, False), (k16, v16, True)):
        out = np.empty((len(pos), nh * vd), np.float32)
        K.attention(q, np.array([ks[s].ctypes.data for s in seq]), np.array([vs[s].ctypes.data for s in seq]), pos,
                    out, nh, nkv, hd, vd, 0.1, window, 0.0, v_stride, half)
        outs.append(out)
    np.testing.assert_array_equal(outs[1], outs[0])


@pytest.mark.parametrize("nh,hd,vd", [(4, 72, 64), (8, 576, 512)])
def test_attention_half_values_inside_key_rows(nh, hd, vd):
    """MLA's layout in an f16 cache: one cache, values the leading vd halves of each key row."""
    rand = _own_rand(hd)
    cap, pos = 70, np.array([0, 31, 69], np.int32)
    c16 = rand(cap, hd).astype(np.float16)
    c32 = c16.astype(np.float32)
    q = rand(len(pos), nh * hd)
    outs = []
    for c, half in ((c32, False), (c16, True)):
        out = np.empty((len(pos), nh * vd), np.float32)
        ptr = np.full(len(pos), c.ctypes.data, np.int64)
        K.attention(q, ptr, ptr, pos, out, nh, 1, hd, vd, 0.05, 0, 0.0, hd, half)
        outs.append(out)
    np.testing.assert_array_equal(outs[1], outs[0])


def test_attention_front_half_writes_rounded_rows_and_attends_them():
    """attention_front on f16 caches: the rows it writes are the float32 front's rows rounded,
    and its fused attention is attention over those f16 caches."""
    rand = _own_rand(5)
    nh, nkv, hd, L, layer, cap = 6, 2, 32, 2, 1, 140
    inv = (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    pos = np.array([3, 70, 139], np.int32)
    hist = [rand(L, cap, nkv * hd).astype(np.float16) for _ in range(2)]
    q, k, v = rand(3, nh * hd), rand(3, nkv * hd), rand(3, nkv * hd)
    front = K.AttentionFront(nh, nkv, hd, hd, inv, 1.0, None, None, None, 1e-5, False, 0.2)
    got = []
    for fused in (False, True):
        c = [h.copy() for h in hist]
        kptr = np.array([[c[0].ctypes.data + l * c[0].strides[0]] * 3 for l in range(L)])
        vptr = np.array([[c[1].ctypes.data + l * c[1].strides[0]] * 3 for l in range(L)])
        qq, kk, out = q.copy(), k.copy(), np.empty((3, nh * hd), np.float32)
        if fused:
            K.attention_front(front, qq, kk, v, pos, kptr, vptr, layer, out, True)
        else:
            K.attention_front(front, qq, kk, v, pos, kptr, vptr, layer, None, True)
            np.testing.assert_array_equal(c[0][layer, pos].view(np.uint16), kk.astype(np.float16).view(np.uint16))
            np.testing.assert_array_equal(c[1][layer, pos].view(np.uint16), v.astype(np.float16).view(np.uint16))
            K.attention(qq, kptr[layer], vptr[layer], pos, out, nh, nkv, hd, hd, 0.2, 0, 0.0, 0, True)
        got.append((out, c))
    np.testing.assert_array_equal(got[1][0], got[0][0])
    for a, b in zip(got[0][1], got[1][1]):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def test_attention_half_refuses_heads_wider_than_the_buffer():
    c = np.zeros((4, 640), np.float16)
    ptr = np.full(1, c.ctypes.data, np.int64)
    with pytest.raises(ValueError, match="f16 cache needs head dims <= 576"):
        K.attention(np.zeros((1, 640), np.float32), ptr, ptr, np.zeros(1, np.int32), np.empty((1, 640), np.float32), 1, 1, 640, 640,
                    0.1, 0, 0.0, 0, True)


@pytest.mark.parametrize("M,E,k", [(1, 4, 1), (7, 8, 2), (5, 33, 4)])
@pytest.mark.parametrize("renorm", [False, True])
def test_moe_route_softmax(M, E, k, renorm):
    logits = rand(M, E, scale=2)
    idx, w = np.empty((M, k), np.int32), np.empty((M, k), np.float32)
    K.moe_route_softmax(logits, k, renorm, idx, w)
    ridx, rw = R.moe_route_softmax(logits, k, renorm)
    np.testing.assert_array_equal(idx, ridx)
    np.testing.assert_allclose(w, rw, **TOL)


@pytest.mark.parametrize("M,E,k,H,I", [(1, 4, 2, 16, 8), (6, 5, 2, 33, 17), (11, 8, 3, 40, 23), (3, 4, 2, 64, 96)])
@pytest.mark.parametrize("act", [0, 1])
@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "int4", "int4s"])
def test_moe_experts(M, E, k, H, I, act, fmt):
    x = rand(M, H)
    gate, up, down = rand(E, I, H, scale=0.3), rand(E, I, H, scale=0.3), rand(E, H, I, scale=0.3)
    idx = np.stack([RNG.choice(E, size=k, replace=False) for _ in range(M)]).astype(np.int32)
    w = RNG.random((M, k)).astype(np.float32)
    table = K.ExpertTable(E, H, I, K.FORMATS[fmt])
    mats = [[quantize(a[e], fmt) for a in (gate, up, down)] for e in range(E)]
    for e in range(E):
        table.set(e, *mats[e])
    out = np.full((M, H), np.nan, np.float32)  # the kernel overwrites out
    counts = np.zeros(E, np.int64)
    used = K.moe_experts(x, idx, w, table, out, K.MoEScratch(M, k, E, H, I), counts, act)
    assert used == len(np.unique(idx))
    deq = [np.stack([dequantize(mats[e][j]) for e in range(E)]) for j in range(3)]
    if fmt in ("f32", "bf16"):
        ref = R.moe_experts(x, idx, w, *deq, act)
    else:  # the twin quantizes activations the way the kernel does, at both matmuls
        ref = np.zeros((M, H), np.float64)
        for m in range(M):
            for j in range(k):
                e = idx[m, j]
                xm = x[m : m + 1]
                h = R.ACTS[act](reference_qlinear(xm, mats[e][0]).astype(np.float64)) * reference_qlinear(xm, mats[e][1])
                ref[m] += w[m, j] * reference_qlinear(h.astype(np.float32), mats[e][2])[0]
    # the hidden activations are requantized: where the kernel's float32 act(gate) * up and
    # the twin's differ by an ulp, a value can round to the next step (int16 steps for int8:
    # max|h| / 32767, ~1e-4 at the output; int8 steps for int4)
    tol = TOL if fmt in ("f32", "bf16") else dict(atol=5e-4, rtol=2e-4) if fmt == "int8" else dict(atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out, ref, **tol)
    np.testing.assert_array_equal(counts, np.bincount(idx.ravel(), minlength=E))


def test_moe_experts_checks_its_scratch():
    E, H, I = 4, 16, 8
    table = K.ExpertTable(E, H, I, K.FORMATS["f32"])
    for e in range(E):
        table.set(e, *(quantize(rand(r, c), "f32") for r, c in ((I, H), (I, H), (H, I))))
    x, out, counts = rand(3, H), np.empty((3, H), np.float32), np.zeros(E, np.int64)
    idx, w = np.array([[0, 1], [2, 3], [1, 2]], np.int32), rand(3, 2)
    for scratch in (K.MoEScratch(2, 2, E, H, I), K.MoEScratch(3, 1, E, H, I), K.MoEScratch(3, 2, E, H, I + 1)):
        with pytest.raises(ValueError, match="scratch"):
            K.moe_experts(x, idx, w, table, out, scratch, counts, 0)
    with pytest.raises(ValueError, match="out of range"):
        K.moe_experts(x, idx + 1, w, table, out, K.MoEScratch(3, 2, E, H, I), counts, 0)
    assert not counts.any()


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "int4", "int4s"])
@pytest.mark.parametrize("M,N,K_", [(1, 5, 32), (3, 17, 64), (2, 9, 80), (5, 33, 100), (9, 20, 1024), (4, 8, 7), (6, 7, 160), (5, 6, 608), (2, 5, 1055), (1, 4, 128), (1, 6, 704), (3, 11, 736)])
def test_qlinear(fmt, M, N, K_):
    """Every format against its NumPy twin: same quantized operands, float64 accumulation."""
    x, w, b = rand(M, K_), rand(N, K_, scale=0.2), rand(N)
    m = quantize(w, fmt)
    kp = K.padded(K_)
    out = np.empty((M, N), np.float32)
    K.qlinear(x, m, out, b, np.empty((M, kp), np.int8), np.empty((M, kp // 32), np.float32),
              np.empty((M, kp // 32), np.int32))
    np.testing.assert_allclose(out, reference_qlinear(x, m) + b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4s"])
def test_quantization_error_is_bounded(fmt):
    """Dequantized weights stay within half a step of the originals (int4: one step, since
    the positive side of a group whose extreme is negative is clipped at +7 steps)."""
    w = rand(16, 96)
    m = quantize(w, fmt)
    err = np.abs(dequantize(m) - w).reshape(16, 3, 32).max(axis=-1)
    step = np.abs(m.scales.astype(np.float32)[:, :3])
    assert np.all(err <= step * (0.5 if fmt == "int8" else 1.0) + 1e-3 * np.abs(w).max())


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "int4", "int4s"])
def test_embed_rows(fmt):
    table = quantize(rand(40, 45), fmt)
    ids = np.array([0, 39, 7, 7], np.int32)
    out = np.empty((4, 45), np.float32)
    K.embed_rows(ids, table, out, 2.0)
    np.testing.assert_allclose(out, dequantize(table)[ids] * 2.0, atol=1e-6)


@pytest.mark.parametrize("M,K_", [(3, 70), (2, 256), (1, 1000)])
def test_quantize_rows_matches_twin(M, K_):
    """Whole groups (the SIMD path) and a partial last group; ties round to even; an
    all-zero group quantizes to zeros with scale 0."""
    from coli.quant import quantize_activations
    x = rand(M, K_, scale=4)
    x[0, :32] = np.concatenate([[-127.0], np.arange(31) - 14.5])  # scale 1: every other value is a tie
    x[-1, 32:64] = 0.0
    kp = K.padded(K_)
    q, d, s = np.empty((M, kp), np.int8), np.empty((M, kp // 32), np.float32), np.empty((M, kp // 32), np.int32)
    K.quantize_rows(x, q, d, s)
    rq, rd, rs = quantize_activations(x)
    np.testing.assert_array_equal(q, rq)
    np.testing.assert_array_equal(d, rd)
    np.testing.assert_array_equal(s, rs)


@pytest.mark.parametrize("M,E,k,ng,tg", [(1, 8, 2, 1, 1), (5, 16, 4, 4, 2), (7, 32, 6, 8, 3)])
@pytest.mark.parametrize("renorm", [False, True])
def test_moe_route_sigmoid(M, E, k, ng, tg, renorm):
    logits, bias = rand(M, E, scale=2), rand(E, scale=0.3)
    idx, w = np.empty((M, k), np.int32), np.empty((M, k), np.float32)
    K.moe_route_sigmoid(logits, bias, k, ng, tg, renorm, 2.5, idx, w)
    ridx, rw = R.moe_route_sigmoid(logits, bias, k, ng, tg, renorm, 2.5)
    np.testing.assert_array_equal(idx, ridx)
    np.testing.assert_allclose(w, rw, **TOL)
    gs = E // ng
    assert all(len({int(e) // gs for e in row}) <= tg for row in idx)  # only topk_group groups used


@pytest.mark.parametrize("M,nh,a,b", [(1, 3, 16, 8), (5, 4, 33, 17), (2, 2, 64, 128)])
def test_head_matmul(M, nh, a, b):
    x, w = rand(M, nh * a), rand(nh, b, a)
    out = np.empty((M, nh * b), np.float32)
    K.head_matmul(x, w, out)
    np.testing.assert_allclose(out, R.head_matmul(x, w), **TOL)


@pytest.mark.parametrize("nh,nkv,hd", [(2, 1, 64), (8, 2, 128), (6, 3, 72), (5, 5, 40)])
@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
def test_attention_threads_bit_identical(nh, nkv, hd, half):
    """One row of three 64-key chunks, computed apart and merged (2 threads) or in turn (1
    thread): the same bits, whether a misaligned KV group is read directly (a lone head) or
    realigned first (several heads), and from an f16 cache."""
    rnd = _own_rand(nh * hd) if half else rand  # (the f32 cases draw what they always drew)
    cap, pos = 150, np.array([149], np.int32)
    kc, vc = at_offset((cap, nkv * hd), 4), at_offset((cap, nkv * hd), 8)
    kc[:], vc[:] = rnd(cap, nkv * hd), rnd(cap, nkv * hd)
    if half:
        kc, vc = kc.astype(np.float16), vc.astype(np.float16)
    kptr, vptr = np.array([kc.ctypes.data], np.int64), np.array([vc.ctypes.data], np.int64)
    q = rnd(1, nh * hd)
    outs = []
    for t in (1, 2):
        K.set_num_threads(t)
        out = np.empty((1, nh * hd), np.float32)
        K.attention(q, kptr, vptr, pos, out, nh, nkv, hd, hd, 0.2, 0, 0.0, 0, half)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("nh,nkv,hd,vd,v_stride", [(9, 3, 64, 64, 0), (10, 2, 40, 40, 0), (16, 2, 72, 72, 0),
                                                   (4, 4, 64, 48, 0), (3, 1, 20, 36, 0), (8, 1, 576, 512, 576)])
@pytest.mark.parametrize("window", [0, 70])
def test_attention_alone_or_in_a_batch(nh, nkv, hd, vd, v_stride, window):
    """Rows on both sides of the 64-key chunk boundaries, each alone (at 2 threads its chunks
    are computed apart, then merged after a barrier) and all in one call (one work item per
    run of heads, walking its chunks in turn): the same bits, and the reference's values.
    KV groups of 5 and 8 heads run as 4 + 1 and 4 + 4; both caches sit off a 64-byte
    boundary (several heads realign the rows they share)."""
    rand = _own_rand(12)
    cap = 334
    pos = np.array([63, 64, 65, 127, 128, 200, 333], np.int32)
    kw = v_stride if v_stride else nkv * hd
    kc = at_offset((cap, kw), 4)
    kc[:] = rand(cap, kw)
    vc = kc if v_stride else at_offset((cap, nkv * vd), 8)
    if not v_stride:
        vc[:] = rand(cap, nkv * vd)
    M = len(pos)
    kptr, vptr = np.full(M, kc.ctypes.data, np.int64), np.full(M, vc.ctypes.data, np.int64)
    q = rand(M, nh * hd)
    batch = np.empty((M, nh * vd), np.float32)
    K.attention(q, kptr, vptr, pos, batch, nh, nkv, hd, vd, 0.15, window, 0.0, v_stride)
    for m in range(M):
        alone = np.empty((1, nh * vd), np.float32)
        K.attention(q[m : m + 1], kptr[:1], vptr[:1], pos[m : m + 1], alone, nh, nkv, hd, vd, 0.15, window, 0.0,
                    v_stride)
        np.testing.assert_array_equal(alone[0], batch[m], err_msg=f"row at position {pos[m]}")
    ks = [kc[:, : nkv * hd].reshape(cap, nkv, hd)] * M
    vs = [(kc[:, :vd] if v_stride else vc).reshape(cap, nkv, vd)] * M
    np.testing.assert_allclose(batch, R.attention(q, ks, vs, pos, nh, nkv, hd, vd, 0.15, window), **TOL)


@pytest.mark.parametrize("M", [2, 3, 4, 5, 9])
@pytest.mark.parametrize("lengths", ["spread", "one long"])
@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
def test_attention_decode_rows_of_many_sequences(M, lengths, half, threads):
    """One decode row of each of M sequences (the 4-stream step of `coli serve`): whichever way
    the rows' work items go to the threads (chunks computed apart, one item at a time, or each
    thread all of a row's KV heads; a long conversation beside short ones goes item by item),
    every row keeps the bits it has alone."""
    rnd = _own_rand(M * 7 + threads + len(lengths))
    nh, nkv, hd, cap = 9, 3, 64, 200
    dt = np.float16 if half else np.float32
    caches = [(rnd(cap, nkv * hd).astype(dt), rnd(cap, nkv * hd).astype(dt)) for _ in range(M)]
    if lengths == "spread":
        pos = np.array([40 + 37 * m for m in range(M)], np.int32) % cap
    else:
        pos = np.array([190] + [3 + m for m in range(1, M)], np.int32)
    kptr = np.array([kc.ctypes.data for kc, _ in caches], np.int64)
    vptr = np.array([vc.ctypes.data for _, vc in caches], np.int64)
    q = rnd(M, nh * hd)
    batch = np.empty((M, nh * hd), np.float32)
    K.attention(q, kptr, vptr, pos, batch, nh, nkv, hd, hd, 0.125, 0, 0.0, 0, half)
    for m in range(M):
        alone = np.empty((1, nh * hd), np.float32)
        K.attention(q[m : m + 1], kptr[m : m + 1], vptr[m : m + 1], pos[m : m + 1], alone, nh, nkv, hd, hd, 0.125,
                    0, 0.0, 0, half)
        np.testing.assert_array_equal(alone[0], batch[m], err_msg=f"row {m} at position {pos[m]} ({threads} threads)")
    ks = [kc.astype(np.float32).reshape(cap, nkv, hd) for kc, _ in caches]
    vs = [vc.astype(np.float32).reshape(cap, nkv, hd) for _, vc in caches]
    np.testing.assert_allclose(batch, R.attention(q, ks, vs, pos, nh, nkv, hd, hd, 0.125, 0), **TOL)


@pytest.mark.parametrize("nh,nkv,hd,vd,v_stride", [(9, 3, 64, 64, 0), (10, 2, 40, 40, 0), (3, 1, 20, 36, 0),
                                                   (8, 1, 72, 48, 72)])
@pytest.mark.parametrize("window", [0, 45])
@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
def test_attention_prefill_tiles_are_rows_alone(nh, nkv, hd, vd, v_stride, window, half, threads):
    """A prompt's rows in one call are cut into tiles of consecutive rows of one sequence, which
    walk their keys chunk by chunk together: every row keeps the bits it has alone. Two prompts
    (one long enough for its f16 cache to be widened once, one not) and a decode row of a third
    sequence share the call; a tile boundary falls where the caches change."""
    rnd = _own_rand(nh * hd + window + threads)
    cap = 180
    kw = v_stride if v_stride else nkv * hd
    dt = np.float16 if half else np.float32
    seqs = []
    for rows in ((0, 150), (17, 29), (90, 91)):  # positions each sequence's rows take
        kc = rnd(cap, kw).astype(dt)
        vc = kc if v_stride else rnd(cap, nkv * vd).astype(dt)
        seqs.append((kc, vc, range(*rows)))
    pos = np.array([p for _, _, r in seqs for p in r], np.int32)
    kptr = np.array([kc.ctypes.data for kc, _, r in seqs for _ in r], np.int64)
    vptr = np.array([vc.ctypes.data for _, vc, r in seqs for _ in r], np.int64)
    M = len(pos)
    q = rnd(M, nh * hd)
    batch = np.empty((M, nh * vd), np.float32)
    K.attention(q, kptr, vptr, pos, batch, nh, nkv, hd, vd, 0.15, window, 0.0, v_stride, half)
    for m in range(M):
        alone = np.empty((1, nh * vd), np.float32)
        K.attention(q[m : m + 1], kptr[m : m + 1], vptr[m : m + 1], pos[m : m + 1], alone, nh, nkv, hd, vd, 0.15,
                    window, 0.0, v_stride, half)
        np.testing.assert_array_equal(alone[0], batch[m], err_msg=f"row {m} at position {pos[m]} ({threads} threads)")
    ks, vs = _as_reference_caches([(kc, vc) for kc, vc, r in seqs for _ in r], cap, nkv, hd, vd, v_stride)
    np.testing.assert_allclose(batch, R.attention(q, ks, vs, pos, nh, nkv, hd, vd, 0.15, window), **TOL)


def _as_reference_caches(pairs, cap, nkv, hd, vd, v_stride):
    """Each (key cache, value cache) pair as the reference's float32 (cap, nkv, hd) keys and
    (cap, nkv, vd) values (MLA, v_stride: the values lead the key rows)."""
    ks, vs = [], []
    for kc, vc in pairs:
        k32 = kc.astype(np.float32)
        ks.append(k32[:, : nkv * hd].reshape(cap, nkv, hd))
        vs.append((k32[:, :vd] if v_stride else vc.astype(np.float32)).reshape(cap, nkv, vd))
    return ks, vs


@pytest.mark.parametrize("nh,nkv,hd,vd,v_stride", [(9, 3, 64, 64, 0), (4, 4, 40, 24, 0), (8, 1, 72, 48, 72)])
@pytest.mark.parametrize("rows", ["one long row", "four sequences", "a prompt"])
@pytest.mark.parametrize("window", [0, 150])
@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
def test_attention_prefetch_changes_no_bits(nh, nkv, hd, vd, v_stride, rows, window, half, threads):
    """Attention asks for the next chunk's keys and values ahead (set_att_prefetch): none, one
    or three chunks ahead give the same bits, on each way the work goes to the threads (a long
    decode row's chunks computed apart, several sequences' rows, a prompt's tiles), windows,
    values inside the key rows, f32 and f16 caches, and the reference's values."""
    rnd = _own_rand(nh * hd + window + threads + len(rows))
    cap = 420
    kw = v_stride if v_stride else nkv * hd
    dt = np.float16 if half else np.float32
    nseq = 4 if rows == "four sequences" else 1
    caches = []
    for _ in range(nseq):
        kc = rnd(cap, kw).astype(dt)
        caches.append((kc, kc if v_stride else rnd(cap, nkv * vd).astype(dt)))
    if rows == "one long row":
        pos, which = np.array([419], np.int32), [0]
    elif rows == "four sequences":
        pos, which = np.array([419, 300, 65, 200], np.int32), [0, 1, 2, 3]
    else:
        pos, which = np.arange(380, 420, dtype=np.int32), [0] * 40
    kptr = np.array([caches[i][0].ctypes.data for i in which], np.int64)
    vptr = np.array([caches[i][1].ctypes.data for i in which], np.int64)
    q = rnd(len(pos), nh * hd)
    outs, before = [], K.get_att_prefetch()
    try:
        for ahead in (0, 1, 3):
            K.set_att_prefetch(ahead)
            out = np.empty((len(pos), nh * vd), np.float32)
            K.attention(q, kptr, vptr, pos, out, nh, nkv, hd, vd, 0.15, window, 0.0, v_stride, half)
            outs.append(out)
    finally:
        K.set_att_prefetch(before)
    for ahead, out in zip((1, 3), outs[1:]):
        np.testing.assert_array_equal(outs[0], out, err_msg=f"{ahead} chunk(s) ahead, {threads} threads")
    ks, vs = _as_reference_caches([caches[i] for i in which], cap, nkv, hd, vd, v_stride)
    np.testing.assert_allclose(outs[1], R.attention(q, ks, vs, pos, nh, nkv, hd, vd, 0.15, window), **TOL)


@pytest.mark.parametrize("nh,hd,vd", [(4, 24, 16), (16, 40, 32), (5, 576, 512)])
def test_attention_values_inside_key_rows(nh, hd, vd):
    """MLA: one shared latent head; values are the first v dims of each key row (v_stride)."""
    cap = 40
    cache = at_offset((cap, hd), 4)  # (cap, 1 kv head, hd)
    cache[:] = rand(cap, hd)
    pos = np.array([3, 9, 16, 39], np.int32)
    ptr = np.array([cache.ctypes.data] * len(pos), np.int64)
    q = rand(len(pos), nh * hd)
    out = np.empty((len(pos), nh * vd), np.float32)
    K.attention(q, ptr, ptr, pos, out, nh, 1, hd, vd, 0.3, 0, 0.0, hd)
    ks = [cache.reshape(cap, 1, hd)] * len(pos)
    vs = [cache[:, :vd].reshape(cap, 1, vd)] * len(pos)
    np.testing.assert_allclose(out, R.attention(q, ks, vs, pos, nh, 1, hd, vd, 0.3), **TOL)


def _scratch(M, K_):
    kp = K.padded(K_)
    return np.empty((M, kp), np.int8), np.empty((M, kp // 32), np.float32), np.empty((M, kp // 32), np.int32)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "int4", "int4s"])
@pytest.mark.parametrize("M,K_", [(1, 64), (3, 100), (4, 1024), (64, 96)])
def test_qlinear_many_equals_one_call_per_matrix(fmt, M, K_):
    """q, k, v (or gate, up) in one call: bit-identical to three qlinear calls, biases or not."""
    x = rand(M, K_)
    mats = [quantize(rand(n, K_, scale=0.2), fmt) for n in (40, 16, 23)]
    biases = (rand(40), None, rand(23))
    outs = tuple(np.full((M, m.rows), np.nan, np.float32) for m in mats)
    K.qlinear_many(x, tuple(mats), outs, biases, *_scratch(M, K_))
    for m, b, out in zip(mats, biases, outs):
        one = np.empty((M, m.rows), np.float32)
        K.qlinear(x, m, one, b, *_scratch(M, K_))
        np.testing.assert_array_equal(out, one)
        ref = reference_qlinear(x, m) + (0 if b is None else b)
        np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "int4", "int4s"])
@pytest.mark.parametrize("M,K_,N", [(1, 64, 40), (3, 100, 23), (1, 576, 1536), (64, 96, 50)])
@pytest.mark.parametrize("act", [0, 1])
def test_qlinear_many_gated_equals_gate_up_then_gated_act(fmt, M, K_, N, act):
    """gate, up and act(gate) * up in one call (work items pairing a block of gate rows with
    the same block of up rows): the same bits as qlinear_many followed by gated_act, biases or
    not, for row counts that end in a partial block."""
    x = rand(M, K_)
    mats = tuple(quantize(rand(N, K_, scale=0.2), fmt) for _ in range(2))
    biases = (rand(N), None)
    want = tuple(np.empty((M, N), np.float32) for _ in range(2))
    K.qlinear_many(x, mats, want, biases, *_scratch(M, K_))
    K.gated_act(want[0], want[1], want[0], act)
    got = tuple(np.full((M, N), np.nan, np.float32) for _ in range(2))
    K.qlinear_many(x, mats, got, biases, *_scratch(M, K_), act)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    with pytest.raises(ValueError, match="act needs two"):
        K.qlinear_many(x, mats[:1], got[:1], biases[:1], *_scratch(M, K_), act)


def test_qlinear_many_rejects_mixed_formats_and_shapes():
    x = rand(2, 64)
    a, b = quantize(rand(8, 64), "int8"), quantize(rand(8, 64), "int4")
    outs = (np.empty((2, 8), np.float32), np.empty((2, 8), np.float32))
    with pytest.raises(ValueError, match="matrix 1"):
        K.qlinear_many(x, (a, b), outs, (None, None), *_scratch(2, 64))
    with pytest.raises(ValueError, match="matrix 0"):
        K.qlinear_many(x, (a,), (np.empty((2, 9), np.float32),), (None,), *_scratch(2, 64))
    with pytest.raises(ValueError, match="1 to 8"):
        K.qlinear_many(x, (), (), (), *_scratch(2, 64))


@pytest.mark.parametrize("min_rows", [1, 48, 10**6])  # packed panels always, by default, never
@pytest.mark.parametrize("M,N,K_", [(64, 33, 100), (130, 70, 257), (7, 40, 64)])
def test_linear_panel_path(min_rows, M, N, K_):
    x, w, b = rand(M, K_), rand(N, K_), rand(N)
    out = np.empty((M, N), np.float32)
    K.set_panel_min_rows(min_rows)
    try:
        K.linear(x, w, out, b)
        np.testing.assert_allclose(out, R.linear(x, w, b), **TOL)
        m = quantize(w, "f32")
        kp = K.padded(K_)
        out2 = np.empty((M, N), np.float32)
        K.qlinear(x, m, out2, b, np.empty((M, kp), np.int8), np.empty((M, kp // 32), np.float32),
                  np.empty((M, kp // 32), np.int32))
        np.testing.assert_allclose(out2, out, **TOL)
    finally:
        K.set_panel_min_rows(48)


@pytest.mark.parametrize("M,N,K_", [(300, 13, 600), (64, 7, 31), (49, 70, 257), (5, 9, 1000)])
@pytest.mark.parametrize("min_rows", [1, 10**6])  # token panels, dot-product tiles
def test_bf16_equals_f32_on_the_widened_weights(M, N, K_, min_rows):
    """bf16 weights are widened in registers (tiles) or per L1 block (panels; K over one
    block, more token panels than share one block): bit for bit the f32 kernels' results on
    the widened weights, on every SIMD path."""
    x, w, b = rand(M, K_), rand(N, K_, scale=0.2), rand(N)
    kp = K.padded(K_)
    scratch = (np.empty((M, kp), np.int8), np.empty((M, kp // 32), np.float32), np.empty((M, kp // 32), np.int32))
    mb = quantize(w, "bf16")
    mf = quantize(dequantize(mb), "f32")
    outs = [np.empty((M, N), np.float32) for _ in range(2)]
    K.set_panel_min_rows(min_rows)
    try:
        K.qlinear(x, mb, outs[0], b, *scratch)
        K.qlinear(x, mf, outs[1], b, *scratch)
    finally:
        K.set_panel_min_rows(48)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0], reference_qlinear(x, mb) + b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["f32", "bf16"])
@pytest.mark.parametrize("min_rows", [1, 10**6])
def test_moe_experts_f32_many_tokens(min_rows, fmt):
    """Experts with many tokens go through packed panels; same numbers as the twin."""
    M, E, k, H, I = 100, 4, 2, 40, 300
    x = rand(M, H)
    gate, up, down = rand(E, I, H, scale=0.3), rand(E, I, H, scale=0.3), rand(E, H, I, scale=0.3)
    idx = np.stack([RNG.choice(E, size=k, replace=False) for _ in range(M)]).astype(np.int32)
    w = RNG.random((M, k)).astype(np.float32)
    table = K.ExpertTable(E, H, I, K.FORMATS[fmt])
    for e in range(E):
        mats = [quantize(a[e], fmt) for a in (gate, up, down)]
        table.set(e, *mats)
        gate[e], up[e], down[e] = (dequantize(q) for q in mats)
    out = np.empty((M, H), np.float32)
    K.set_panel_min_rows(min_rows)
    try:
        K.moe_experts(x, idx, w, table, out, K.MoEScratch(M, k, E, H, I), np.zeros(E, np.int64), 0)
    finally:
        K.set_panel_min_rows(48)
    np.testing.assert_allclose(out, R.moe_experts(x, idx, w, gate, up, down, 0), **TOL)


def test_release_threads_retires_the_calling_threads_workers():
    """The runner calls it before its thread takes over the kernels (see Runner.__init__)."""
    import os

    def tasks():
        return len(os.listdir("/proc/self/task"))

    if not K.has_openmp():
        pytest.skip("this build has no OpenMP (single-threaded kernels)")

    K.set_num_threads(2)
    buf = np.ones(1 << 20, np.int64)
    assert K.read_bytes(buf) == buf.size  # a parallel region: this thread's worker exists
    before = tasks()
    assert K.release_threads() == 0
    # the worker leaves libgomp's pool before release_threads returns, but its thread ends
    # (and leaves /proc/self/task) a moment later: on a loaded machine, after the first look
    deadline = time.monotonic() + 5.0
    while tasks() > before - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tasks() == before - 1
    assert K.read_bytes(buf) == buf.size  # the next region starts a fresh worker
    assert tasks() == before


@pytest.mark.parametrize("nh,nkv,hd,vd,v_stride", [(16, 16, 64, 64, 0), (9, 3, 64, 64, 0), (8, 2, 128, 128, 0),
                                                   (6, 6, 16, 16, 0), (4, 1, 64, 32, 64), (4, 4, 40, 24, 0),
                                                   (10, 2, 32, 32, 0), (16, 2, 64, 64, 0)])
@pytest.mark.parametrize("pos", [[0], [2], [63], [64], [160], [419, 300, 65, 5]])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (150, 0.0), (0, 20.0)])
@pytest.mark.parametrize("half", [False, True], ids=["f32", "f16"])
def test_attention_wide_rows_give_the_heads_bits(nh, nkv, hd, vd, v_stride, pos, window, softcap, half, threads):
    """One-token rows, each its own sequence's, attend every head of a chunk at once reading
    whole cache rows (set_att_wide): the bits the runs of heads give, at chunk boundaries and
    inside them, for several sequences, GQA (groups of 3, 4, 5 and 8: the wide kernel widens a
    KV head's vectors once for up to 4 of its heads), fewer keys than the value pass's blocks of
    4, values inside the key rows, windows, soft-capping, f32 and f16 caches, on each thread
    count; head dims that are not whole vectors take the runs of heads either way. And the
    reference's values."""
    rnd = _own_rand(nh * hd + len(pos) + window + threads)
    cap = max(pos) + 1
    kw = v_stride if v_stride else nkv * hd
    dt = np.float16 if half else np.float32
    caches = []
    for _ in pos:
        kc = rnd(cap, kw).astype(dt)
        caches.append((kc, kc if v_stride else rnd(cap, nkv * vd).astype(dt)))
    p = np.array(pos, np.int32)
    kptr = np.array([kc.ctypes.data for kc, _ in caches], np.int64)
    vptr = np.array([vc.ctypes.data for _, vc in caches], np.int64)
    q = rnd(len(pos), nh * hd)
    outs, before = [], K.get_att_wide()
    try:
        for mode, split in ((0, True), (1, True), (2, True), (1, False)):
            K.set_att_wide(mode)
            K.set_att_wide_split(split)
            out = np.empty((len(pos), nh * vd), np.float32)
            K.attention(q, kptr, vptr, p, out, nh, nkv, hd, vd, 0.15, window, softcap, v_stride, half)
            outs.append(out)
    finally:
        K.set_att_wide(before)
        K.set_att_wide_split(True)
    np.testing.assert_array_equal(outs[0], outs[1], err_msg=f"wide rows vs runs of heads, {threads} threads")
    np.testing.assert_array_equal(outs[0], outs[2], err_msg=f"the default vs runs of heads, {threads} threads")
    np.testing.assert_array_equal(outs[0], outs[3], err_msg=f"whole chunks vs head parts, {threads} threads")
    if softcap:
        return
    ks, vs = _as_reference_caches(caches, cap, nkv, hd, vd, v_stride)
    np.testing.assert_allclose(outs[1], R.attention(q, ks, vs, p, nh, nkv, hd, vd, 0.15, window), **TOL)


@pytest.mark.parametrize("nh,nkv", [(16, 16), (9, 3), (4, 1)])
def test_attention_takes_the_way_its_rows_call_for(nh, nkv, threads):
    """Which way attention went (attention_ways): a one-token row alone in its sequence goes
    wide where every head has its own KV head, and under GQA up to 384 keys (past them by
    split runs of heads), a prompt's rows by tiles, and with wide rows off never wide; with two threads a
    row whose chunks do not go round evenly (160 keys: two whole chunks and a short one, or
    one short chunk) has its leftover chunks cut into head parts, one a thread, unless that
    is switched off (set_att_wide_split) or the heads are too few to cut."""
    rnd = _own_rand(nh + threads)
    hd, cap = 64, 500
    kc, vc = rnd(cap, nkv * hd).astype(np.float16), rnd(cap, nkv * hd).astype(np.float16)
    kp, vp = np.array([kc.ctypes.data], np.int64), np.array([vc.ctypes.data], np.int64)

    def ways(pos, rows=1, mode=2, split=True):
        K.set_att_wide(mode)
        K.set_att_wide_split(split)
        out = np.empty((rows, nh * hd), np.float32)
        K.attention_ways(reset=True)
        K.attention(rnd(rows, nh * hd), np.repeat(kp, rows), np.repeat(vp, rows),
                    np.arange(pos - rows + 1, pos + 1, dtype=np.int32), out, nh, nkv, hd, hd, 0.125, half=True)
        return {k: v for k, v in K.attention_ways().items() if v}

    before = K.get_att_wide()
    try:
        alone = {"wide": 1, "wide_parts": 1} if threads == 2 else {"wide": 1}
        if nkv == nh:
            assert ways(159) == alone  # 160 keys: 64 + 64 + 32
            assert ways(40) == alone  # one short chunk
            assert ways(127) == {"wide": 1}  # two whole chunks go round two threads
            assert ways(159, split=False) == {"wide": 1}
            assert ways(159, mode=0) == {"tiles": 1}  # 16 runs of heads keep two threads busy
        else:
            assert ways(159) == (alone if nkv >= 2 else {"wide": 1})  # GQA, up to 384 keys: wide
            assert ways(299) == (alone if nkv >= 2 else {"wide": 1})  # 300 keys, 5 chunks: still wide
            runs = {"split": 1} if threads == 2 else {"tiles": 1}  # runs of heads: split with 2 threads
            assert ways(449) == runs  # 450 keys: by runs of heads, which share each KV head's slice
            assert ways(159, mode=0) == runs
        assert ways(159, rows=20) == {"tiles": 1}  # a prompt's rows share their cache
        assert K.attention_ways() == {"tiles": 1, "split": 0, "wide": 0, "wide_parts": 0}
        K.attention_ways(reset=True)
        assert K.attention_ways() == {"tiles": 0, "split": 0, "wide": 0, "wide_parts": 0}
    finally:
        K.set_att_wide(before)
        K.set_att_wide_split(True)


def test_attention_wide_rows_read_no_position_past_the_row():
    """Either way a decode row's result does not depend on cache rows past its position
    (overwritten with huge values between the two ways, the results are equal and finite), and
    a mode outside 0-2 is refused."""
    rnd = _own_rand(7)
    nh = nkv = 16
    hd = 64
    k = rnd(200, nkv * hd).astype(np.float16)
    v = rnd(200, nkv * hd).astype(np.float16)
    q = rnd(1, nh * hd)
    kp, vp, p = np.array([k.ctypes.data]), np.array([v.ctypes.data]), np.array([150], np.int32)
    before = K.get_att_wide()
    try:
        res = []
        for mode in (1, 0):
            K.set_att_wide(mode)
            assert K.get_att_wide() == mode
            out = np.full((1, nh * hd), np.nan, np.float32)
            K.attention(q, kp.astype(np.int64), vp.astype(np.int64), p, out, nh, nkv, hd, hd, 0.125, half=True)
            k[151:] = np.float16(1e4)  # beyond the row: never read
            res.append(out.copy())
        np.testing.assert_array_equal(res[0], res[1])
        assert np.isfinite(res[0]).all()
        with pytest.raises(ValueError, match="mode is 0, 1 or 2"):
            K.set_att_wide(3)
    finally:
        K.set_att_wide(before)
