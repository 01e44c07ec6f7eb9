# cython: language_level=3
"""fp32 kernels of the colibri engine.

Every kernel is a ``cdef ... noexcept nogil`` loop over caller-provided buffers
(nothing is allocated here) with a thin ``def`` wrapper that the engine and the
parity tests call. Shapes are checked once in the wrapper; the loops run with
bounds checks off (``COLI_CYTHON_DEBUG=1`` at build time turns them back on).
Each kernel has a NumPy twin in ``coli/_engine/reference.py``.

Threading: ``set_num_threads`` fixes the OpenMP team used by every ``prange``.
Work is split so that each output element is written by one thread and summed
in a fixed order: results do not depend on the thread count.
"""
cimport openmp
import numpy as np
from cython.parallel cimport parallel, prange, threadid
from libc.math cimport cos, exp, sin, sqrt, tanhf, INFINITY
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy, memset

cdef extern from "simd.h" nogil:
    const char *coli_simd_name()
    float coli_dot(const float *a, const float *b, int K)
    void coli_scale_add(float *y, float a, const float *x, float b, int n)
    void coli_attend(const float *q, const float *K, long ks, const float *V, long vs, int h0, int h1,
                     int group, int j0, int j1, int hd, int vd, float scale, float softcap, float *o)
    void coli_gemm_nt(const float *X, long ldx, int M, const float *W, long ldw, int N, int K,
                      float *Y, long ldy)
    float coli_silu(float x)
    float coli_gelu_tanh(float x)
    void coli_pack_tokens(const float *X, long ldx, int M, int K, float *P)
    void coli_gemm_tokens(const float *P, int M, const float *W, long ldw, int nb, int K, float *Y, long ldy)
    enum:
        COLI_NP

cdef extern from "simd_q.h" nogil:
    ctypedef struct coli_mat:
        int fmt
        const void *w
        const uint16_t *d
        long ldw
        long ldd
    ctypedef struct coli_act:
        const float *x
        const int8_t *q
        const float *qd
        const int32_t *qs
        long ldx
        long ldq
        long ldb
    enum:
        COLI_F32
        COLI_BF16
        COLI_Q8
        COLI_Q4
    void coli_quantize_row_q8(const float *x, int K, int8_t *q, float *d, int32_t *s)
    void coli_dequant_row(const coli_mat *W, int r, int K, float *out)
    void coli_gemm_any(const coli_act *a, int M, const coli_mat *W, int n0, int nb, int K, float *Y, long ldy)

cdef enum:
    ROW_BLOCK = 16      # weight rows per parallel work item
    ACT_SILU = 0
    ACT_GELU_TANH = 1
    QK = 32             # quantization group

cdef int _nthreads = 1
cdef long SMALL_WORK = 1 << 15  # below this many inner-loop steps a kernel runs on the calling thread
cdef float *_panels = NULL   # packed token panels of the current GEMM, grown as needed
cdef size_t _panels_cap = 0
cdef int PANEL_MIN_ROWS = 48  # from this many tokens on, f32 matmuls pack the tokens into panels


def set_panel_min_rows(int rows):
    """Tune where f32 linear layers switch from dot-product tiles to token panels."""
    global PANEL_MIN_ROWS
    PANEL_MIN_ROWS = rows


cdef float *_panel_scratch(size_t need) except NULL:
    """Room for ``need`` floats of token panels (grown, never shrunk; called with the GIL)."""
    global _panels, _panels_cap
    cdef float *p
    if need > _panels_cap:
        p = <float *>realloc(_panels, need * sizeof(float))
        if p == NULL:
            raise MemoryError()
        _panels, _panels_cap = p, need
    return _panels


cdef inline int _team(long work) noexcept nogil:
    """Threads for a loop of ``work`` inner steps: small loops (a decode step's norms,
    RoPE, routing, activation quantization) stay on the calling thread, because waking
    the OpenMP team costs more than the loop itself. Either way each output element is
    written by one thread in the same order, so results do not change."""
    return 1 if work < SMALL_WORK else _nthreads


def set_small_work(long n):
    """Tune the size under which elementwise kernels run single-threaded (0: never)."""
    global SMALL_WORK
    SMALL_WORK = n


def set_num_threads(int n):
    """Use ``n`` OpenMP threads in every kernel from now on."""
    global _nthreads
    _nthreads = n if n > 0 else 1
    openmp.omp_set_num_threads(_nthreads)


def get_num_threads():
    return _nthreads


def simd_name():
    """The SIMD path this build was compiled for: avx512, avx2 or scalar."""
    return coli_simd_name().decode()


cdef inline float _act(float x, int act) noexcept nogil:
    if act == ACT_GELU_TANH:
        return coli_gelu_tanh(x)
    return coli_silu(x)


# ---------------------------------------------------------------- linear layers

cdef void _linear(const float *X, long ldx, int M, const float *W, int N, int K,
                  float *Y, long ldy, const float *bias, float *panels) noexcept nogil:
    """panels: scratch for X packed into token panels (see _panel_scratch), or NULL for
    the dot-product tiles."""
    cdef int block = 2 * ROW_BLOCK if panels != NULL else ROW_BLOCK
    cdef int nblocks = (N + block - 1) // block
    cdef int b, n0, nb, m, n
    cdef int nt = _team(<long>M * N * K // 4)
    if panels != NULL:
        coli_pack_tokens(X, ldx, M, K, panels)
    for b in prange(nblocks, num_threads=nt, schedule='static'):
        n0 = b * block
        nb = N - n0 if N - n0 < block else block
        if panels != NULL:
            coli_gemm_tokens(panels, M, W + <long>n0 * K, K, nb, K, Y + n0, ldy)
        else:
            coli_gemm_nt(X, ldx, M, W + <long>n0 * K, K, nb, K, Y + n0, ldy)
        if bias != NULL:
            for m in range(M):
                for n in range(nb):
                    Y[m * ldy + n0 + n] += bias[n0 + n]


cdef inline size_t _panel_floats(int M, int K) noexcept nogil:
    return <size_t>((M + COLI_NP - 1) // COLI_NP) * COLI_NP * K


def linear(const float[:, ::1] x, const float[:, ::1] w, float[:, ::1] out, const float[::1] bias=None):
    """out[M, N] = x[M, K] @ w[N, K].T (+ bias[N])."""
    cdef int M = x.shape[0], K = x.shape[1], N = w.shape[0]
    if w.shape[1] != K or out.shape[0] != M or out.shape[1] != N:
        raise ValueError(f"linear: shapes x({M}, {K}) w({N}, {w.shape[1]}) out({out.shape[0]}, {out.shape[1]})")
    if bias is not None and bias.shape[0] != N:
        raise ValueError("linear: bias length != out features")
    if M == 0 or N == 0:
        return
    cdef const float *bp = &bias[0] if bias is not None else NULL
    cdef float *panels = _panel_scratch(_panel_floats(M, K)) if M >= PANEL_MIN_ROWS else NULL
    with nogil:
        _linear(&x[0, 0], K, M, &w[0, 0], N, K, &out[0, 0], N, bp, panels)


# ---------------------------------------------------------------- norms, activations

def rmsnorm(const float[:, ::1] x, const float[::1] w, float eps, float[:, ::1] out, bint unit_offset=False):
    """out = x / sqrt(mean(x**2) + eps) * (w or 1 + w), row by row; out may be x."""
    cdef int M = x.shape[0], H = x.shape[1], m, i
    cdef double ss
    cdef float r, g
    if w.shape[0] != H or out.shape[0] != M or out.shape[1] != H:
        raise ValueError("rmsnorm: shape mismatch")
    cdef float off = 1.0 if unit_offset else 0.0
    for m in prange(M, nogil=True, num_threads=_team(<long>M * H), schedule='static'):
        ss = 0
        for i in range(H):
            ss = ss + <double>x[m, i] * x[m, i]
        r = <float>(1.0 / sqrt(ss / H + eps))
        for i in range(H):
            g = w[i] + off
            out[m, i] = (x[m, i] * r) * g


def gated_act(const float[:, ::1] g, const float[:, ::1] u, float[:, ::1] out, int act=ACT_SILU):
    """out = act(g) * u elementwise (act: 0 silu, 1 gelu_tanh); out may alias g."""
    cdef int M = g.shape[0], N = g.shape[1], m, i
    if u.shape[0] != M or u.shape[1] != N or out.shape[0] != M or out.shape[1] != N:
        raise ValueError("gated_act: shape mismatch")
    for m in prange(M, nogil=True, num_threads=_team(<long>M * N * 4), schedule='static'):
        for i in range(N):
            out[m, i] = _act(g[m, i], act) * u[m, i]


def embed(const int32_t[::1] ids, const float[:, ::1] table, float[:, ::1] out, float scale=1.0):
    """out[m] = table[ids[m]] * scale; ids must already be checked against the vocabulary."""
    cdef int M = ids.shape[0], H = table.shape[1], m, i
    if out.shape[0] != M or out.shape[1] != H:
        raise ValueError("embed: shape mismatch")
    for m in prange(M, nogil=True, num_threads=_team(<long>M * H), schedule='static'):
        memcpy(&out[m, 0], &table[ids[m], 0], H * sizeof(float))
        if scale != 1.0:
            for i in range(H):
                out[m, i] = out[m, i] * scale


# ---------------------------------------------------------------- attention

def rope(float[:, ::1] x, int n_heads, int head_dim, int rot_dim, const int32_t[::1] pos,
         const float[::1] inv_freq, float scaling=1.0):
    """Rotate the first rot_dim dims of every head of x (M, n_heads*head_dim) in place,
    GPT-NeoX style (rotate_half): pairs (i, i + rot_dim/2)."""
    cdef int M = x.shape[0], half = rot_dim // 2, m, h, i
    cdef float ang, c, s, x1, x2
    cdef long base
    if x.shape[1] != n_heads * head_dim or inv_freq.shape[0] < half or pos.shape[0] != M:
        raise ValueError("rope: shape mismatch")
    for m in prange(M, nogil=True, num_threads=_team(<long>M * half * (n_heads + 8)), schedule='static'):
        for i in range(half):
            ang = <float>pos[m] * inv_freq[i]          # float32 product, as transformers computes it
            c = <float>cos(ang) * scaling
            s = <float>sin(ang) * scaling
            for h in range(n_heads):
                base = h * head_dim
                x1 = x[m, base + i]
                x2 = x[m, base + i + half]
                x[m, base + i] = x1 * c - x2 * s
                x[m, base + i + half] = x2 * c + x1 * s


def kv_write(const float[:, ::1] k, const float[:, ::1] v, const int64_t[::1] kptr,
             const int64_t[::1] vptr, const int32_t[::1] pos):
    """Copy row m of k / v into its sequence's cache at position pos[m].

    kptr[m] / vptr[m] are the addresses of that sequence's (capacity, width) float32
    cache of the current layer; the caller guarantees pos[m] < capacity."""
    cdef int M = k.shape[0], kw = k.shape[1], vw = v.shape[1], m
    if v.shape[0] != M or kptr.shape[0] != M or vptr.shape[0] != M or pos.shape[0] != M:
        raise ValueError("kv_write: shape mismatch")
    with nogil:
        for m in range(M):
            memcpy(<float *>kptr[m] + <long>pos[m] * kw, &k[m, 0], kw * sizeof(float))
            if vw > 0:  # MLA keeps its values inside the key rows
                memcpy(<float *>vptr[m] + <long>pos[m] * vw, &v[m, 0], vw * sizeof(float))


def attention(const float[:, ::1] q, const int64_t[::1] kptr, const int64_t[::1] vptr,
              const int32_t[::1] pos, float[:, ::1] out, int n_heads, int n_kv_heads,
              int head_dim, int v_head_dim, float scale, int window=0, float softcap=0.0,
              int v_stride=0):
    """Causal attention of each query row over its own sequence's cache.

    q: (M, n_heads*head_dim); the cache behind kptr[m] is (capacity, n_kv_heads, head_dim),
    behind vptr[m] (capacity, n_kv_heads, v_head_dim) — or, with v_stride, positions
    v_stride floats apart (MLA reads its values from the leading part of its key rows);
    row m attends positions
    [pos[m] - window + 1, pos[m]] (all of [0, pos[m]] when window <= 0).

    Work items are (row, range of heads): coli_attend walks the keys in blocks, each block
    across all heads of the range, so the cache rows are read front to back and a GQA group's
    heads share them in L1. A row is split into as many head ranges as balance the threads
    (t / gcd(M, t) of them: one range per row once M is a multiple of t), at KV-group
    boundaries when the groups divide evenly. Each head's arithmetic is the same however heads
    are split, so results do not depend on the thread count. Online softmax: nothing allocated."""
    cdef int M = q.shape[0], group, nr, a, b, idx, m, i, h0, h1, start
    cdef const float *K
    cdef const float *V
    if n_kv_heads <= 0 or n_heads % n_kv_heads != 0:
        raise ValueError("attention: n_heads must be a multiple of n_kv_heads")
    if q.shape[1] != n_heads * head_dim or out.shape[0] != M or out.shape[1] != n_heads * v_head_dim:
        raise ValueError("attention: shape mismatch")
    if kptr.shape[0] != M or vptr.shape[0] != M or pos.shape[0] != M:
        raise ValueError("attention: shape mismatch")
    if M == 0:
        return
    group = n_heads // n_kv_heads
    a, b = _nthreads, M  # head ranges per row: threads / gcd(M, threads)
    while b:
        a, b = b, a % b
    nr = min(_nthreads // a, n_heads)
    cdef long vs = v_stride if v_stride > 0 else n_kv_heads * v_head_dim
    for idx in prange(M * nr, nogil=True, num_threads=_nthreads, schedule='static'):
        m = idx // nr
        i = idx - m * nr
        if n_kv_heads % nr == 0:  # whole KV groups per range
            h0 = (n_kv_heads * i // nr) * group
            h1 = (n_kv_heads * (i + 1) // nr) * group
        else:
            h0 = n_heads * i // nr
            h1 = n_heads * (i + 1) // nr
        K = <const float *>kptr[m]
        V = <const float *>vptr[m]
        start = 0
        if window > 0 and pos[m] - window + 1 > 0:
            start = pos[m] - window + 1
        coli_attend(&q[m, 0], K, n_kv_heads * head_dim, V, vs, h0, h1, group, start, pos[m] + 1,
                    head_dim, v_head_dim, scale, softcap, &out[m, 0])


# ---------------------------------------------------------------- mixture of experts

def moe_route_softmax(const float[:, ::1] logits, int k, bint renormalize, int32_t[:, ::1] idx,
                      float[:, ::1] weights):
    """softmax over experts, then top-k (ties: lowest index first), optionally renormalised."""
    cdef int M = logits.shape[0], E = logits.shape[1], m, j, e, best
    cdef double mx, total, sel
    cdef float bv
    if k > E or idx.shape[0] != M or idx.shape[1] != k or weights.shape[0] != M or weights.shape[1] != k:
        raise ValueError("moe_route_softmax: shape mismatch")
    for m in prange(M, nogil=True, num_threads=_team(<long>M * E * (k + 4)), schedule='static'):
        mx = logits[m, 0]
        for e in range(1, E):
            if logits[m, e] > mx:
                mx = logits[m, e]
        total = 0
        for e in range(E):
            total = total + exp(logits[m, e] - mx)
        sel = 0
        for j in range(k):
            best = -1
            bv = -INFINITY
            for e in range(E):
                if (best < 0 or logits[m, e] > bv) and not _taken(&idx[m, 0], j, e):
                    best = e
                    bv = logits[m, e]
            idx[m, j] = best
            weights[m, j] = <float>(exp(bv - mx) / total)
            sel = sel + weights[m, j]
        if renormalize:
            for j in range(k):
                weights[m, j] = <float>(weights[m, j] / sel)


def moe_route_sigmoid(const float[:, ::1] logits, const float[::1] bias, int k, int n_group, int topk_group,
                      bint renormalize, float scale, int32_t[:, ::1] idx, float[:, ::1] weights,
                      float[:, ::1] scratch=None):
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid scores; experts chosen by score + bias within
    the topk_group groups whose two best biased scores sum highest; weights are the
    unbiased scores of the chosen experts, renormalised if asked, times scale."""
    cdef int M = logits.shape[0], E = logits.shape[1], m, j, e, g, best, gs = E // n_group, r
    cdef double sel
    cdef float bv, a1, a2, v
    if n_group < 1 or E % n_group != 0 or not 0 < topk_group <= n_group or k > E or bias.shape[0] != E:
        raise ValueError("moe_route_sigmoid: bad grouping")
    if idx.shape[0] != M or idx.shape[1] != k or weights.shape[0] != M or weights.shape[1] != k:
        raise ValueError("moe_route_sigmoid: shape mismatch")
    if scratch is None:
        scratch = np.empty((M, 2 * E + 2 * n_group), dtype=np.float32)
    if scratch.shape[0] < M or scratch.shape[1] < 2 * E + 2 * n_group:
        raise ValueError("moe_route_sigmoid: scratch must be (M, 2*E + 2*n_group)")
    cdef float[:, :] sc = scratch[:, :E]                    # sigmoid scores
    cdef float[:, :] ch = scratch[:, E:2 * E]               # scores for choice
    cdef float[:, :] gsum = scratch[:, 2 * E:2 * E + n_group]
    cdef float[:, :] gpick = scratch[:, 2 * E + n_group:2 * E + 2 * n_group]
    for m in prange(M, nogil=True, num_threads=_team(<long>M * E * (k + 8)), schedule='static'):
        for e in range(E):
            sc[m, e] = <float>(1.0 / (1.0 + exp(-logits[m, e])))
            ch[m, e] = sc[m, e] + bias[e]
        for g in range(n_group):
            a1 = -INFINITY
            a2 = -INFINITY
            for e in range(g * gs, (g + 1) * gs):
                v = ch[m, e]
                if v > a1:
                    a2 = a1
                    a1 = v
                elif v > a2:
                    a2 = v
            gsum[m, g] = a1 + (a2 if gs > 1 else 0)
            gpick[m, g] = 0
        for r in range(topk_group):
            best = -1
            bv = -INFINITY
            for g in range(n_group):
                if gpick[m, g] == 0 and (best < 0 or gsum[m, g] > bv):
                    best = g
                    bv = gsum[m, g]
            gpick[m, best] = 1
        sel = 0
        for j in range(k):
            best = -1
            bv = -INFINITY
            for e in range(E):
                if gpick[m, e // gs] and (best < 0 or ch[m, e] > bv) and not _taken(&idx[m, 0], j, e):
                    best = e
                    bv = ch[m, e]
            idx[m, j] = best
            weights[m, j] = sc[m, best]
            sel = sel + sc[m, best]
        for j in range(k):
            if renormalize:
                weights[m, j] = <float>(weights[m, j] / (sel + 1e-20))
            weights[m, j] = weights[m, j] * scale


def head_matmul(const float[:, ::1] x, const float[:, :, ::1] w, float[:, ::1] out):
    """out[m, h*b:(h+1)*b] = w[h] @ x[m, h*a:(h+1)*a] for every head h; w: (heads, b, a)."""
    cdef int M = x.shape[0], nh = w.shape[0], b = w.shape[1], a = w.shape[2], h
    if x.shape[1] != nh * a or out.shape[0] != M or out.shape[1] != nh * b:
        raise ValueError("head_matmul: shape mismatch")
    if M == 0:
        return
    for h in prange(nh, nogil=True, num_threads=_nthreads, schedule='static'):
        coli_gemm_nt(&x[0, h * a], nh * a, M, &w[h, 0, 0], a, b, a, &out[0, h * b], nh * b)


cdef inline bint _taken(const int32_t *chosen, int n, int e) noexcept nogil:
    cdef int i
    for i in range(n):
        if chosen[i] == e:
            return True
    return False


include "quant.pxi"


def read_bytes(const int64_t[::1] buf):
    """Read every word of buf across the threads (a memory-bandwidth probe); returns their sum."""
    cdef Py_ssize_t i, n = buf.shape[0]
    cdef int64_t total = 0
    for i in prange(n, nogil=True, num_threads=_nthreads, schedule='static'):
        total += buf[i]
    return total
