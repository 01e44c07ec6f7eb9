# cython: language_level=3
"""fp32 kernels of the colibri engine.

Every kernel is a ``cdef ... noexcept nogil`` loop over caller-provided buffers
(nothing is allocated here) with a thin ``def`` wrapper that the engine and the
parity tests call. Shapes are checked once in the wrapper; the loops run with
bounds checks off (``COLI_CYTHON_DEBUG=1`` at build time turns them back on where
they index memoryviews). Each kernel has a NumPy twin in
``coli/_engine/reference.py``, except the fused ones (add_rmsnorm,
attention_front), which are tested bit for bit against the kernels they fuse.

Threading: ``set_num_threads`` fixes the OpenMP team used by every ``prange``.
Work is split so that each output element is written by one thread and summed
in a fixed order: results do not depend on the thread count.

Arguments: most wrappers take typed memoryviews. The kernels a decode step calls
per layer take plain ndarrays checked by ``_arr`` instead: acquiring a memoryview
costs ~150 ns per argument, and a step passes hundreds (see "cheap array
arguments" below).
"""
cimport numpy as cnp
import numpy as np
from cython.parallel cimport parallel, prange, threadid
from libc.math cimport cos, exp, sin, sqrt, tanhf, INFINITY
from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint16_t, uintptr_t
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy, memset

cdef extern from *:
    """
    /* OpenMP when the build has it (setup.py probes the compiler); otherwise prange runs as a
     * plain loop and these do nothing. COLI_SIMD_PATH: the path setup.py compiled this module
     * for. */
    #ifdef _OPENMP
    #include <omp.h>
    #define COLI_OPENMP 1
    static void coli_omp_set_threads(int n) { omp_set_num_threads(n); }
    static int coli_omp_release(void) { return omp_pause_resource_all(omp_pause_soft); }
    #else
    #define COLI_OPENMP 0
    static void coli_omp_set_threads(int n) { (void)n; }
    static int coli_omp_release(void) { return 0; }
    #endif
    #ifndef COLI_SIMD_PATH
    #define COLI_SIMD_PATH "unknown"
    #endif
    """
    void coli_omp_set_threads(int n) nogil
    int coli_omp_release() nogil
    int COLI_OPENMP
    const char *COLI_SIMD_PATH

cdef extern from "simd.h" nogil:
    float coli_dot(const float *a, const float *b, int K)
    void coli_scale_add(float *y, float a, const float *x, float b, int n)
    void coli_attend_part(const float *q, const void *Kg, long ks, const void *Vg, long vs, int h0, int nb,
                          int c0, int c1, int hd, int vd, float scale, float softcap, int half, float *oc,
                          long ldo, float *ml, long lds)
    void coli_attend_seq(const float *q, const void *Kg, long ks, const void *Vg, long vs, int h0, int nb,
                         int j0, int j1, int hd, int vd, float scale, float softcap, int half, float *o,
                         float *tmp)
    void coli_attend_rows(const float *q, long ldq, const void *Kg, long ks, const void *Vg, long vs, int h0, int nb,
                          const int *j0, const int *j1, int nr, int hd, int vd, float scale, float softcap, int half,
                          float *o, long ldo, float *tmp, float *wide)
    long COLI_ATT_WIDE(int hd, int vd)
    int coli_att_prefetch
    int coli_stream_prefetch
    void coli_set_stream_prefetch(int mode)
    void coli_attend_prefetch(const void *Kg, long ks, const void *Vg, long vs, int j0, int j1, int hd, int vd,
                              int half)
    void coli_kv_put(void *cache, long pos, const float *x, int w, int half)
    void coli_to_f16_row(const float *x, int d, uint16_t *h)
    void coli_f16_row(const uint16_t *h, long d, float *o)
    const void *COLI_KV_AT(const void *p, long i, int half)
    void coli_attend_join(float *o, const float *oc, const float *ml, int nc, int vd)
    int coli_attend_wide_fits(int hd, int vd, int half)
    long COLI_ATT_WIDE_WORK(int nh)
    void coli_attend_wide(const float *q, const void *K, long ks, const void *V, long vs, int nkv, int group, int c0,
                          int c1, int hd, int vd, float scale, float softcap, int half, float *oc, long ldo, float *ml,
                          long lds, float *work)
    void coli_gemm_nt(const float *X, long ldx, int M, const float *W, long ldw, int N, int K,
                      float *Y, long ldy)
    void coli_gated_act_row(const float *g, const float *u, float *out, int n, int act)
    void coli_pack_tokens(const float *X, long ldx, int M, int K, float *P)
    void coli_gemm_tokens(const float *P, int M, const float *W, long ldw, int nb, int K, float *Y, long ldy)
    enum:
        COLI_NP
        COLI_ATT_CH
        COLI_ATT_HB
        COLI_ATT_ROWS
        COLI_STAGE_LD

cdef extern from "simd_q.h" nogil:
    ctypedef struct coli_mat:
        int fmt
        const void *w
        const uint16_t *d
        const uint16_t *m
        long ldw
        long ldd
        const uint8_t *pk
        long pks
    ctypedef struct coli_act:
        const float *x
        const int8_t *q
        const float *qd
        const int32_t *qs
        long ldx
        long ldq
        long ldb
        const int8_t *xe
        long lde
    enum:
        COLI_F32
        COLI_BF16
        COLI_Q8
        COLI_Q4
        COLI_Q4A
    void coli_quantize_row_q8(const float *x, int K, int8_t *q, float *d, int32_t *s)
    void coli_dequant_row(const coli_mat *W, int r, int K, float *out)
    void coli_gemm_any(const coli_act *a, int M, const coli_mat *W, int n0, int nb, int K, float *Y, long ldy)
    void coli_gemm_any_of(const coli_act *a, int M, int Mcall, const coli_mat *W, int n0, int nb, int K, float *Y,
                          long ldy)
    void coli_gemm_tokens_any(const float *P, int M, const coli_mat *W, int n0, int nb, int K, float *Y, long ldy)

cdef extern from "simd_qx.h" nogil:  # (included by simd_q.h; named here so a change rebuilds)
    long coli_xe_ld(int fmt, int M, int K)
    void coli_expand_act(const coli_act *a, int M, int K, int fmt, int8_t *xe, long lde)
    long coli_q4x_xe_ld(int M, int K)
    long coli_q4x_tile_bytes(int fmt, int K)
    void coli_q4x_pack(const coli_mat *W, int N, int K, uint8_t *pk)
    void coli_q4x_unpack(const uint8_t *pk, int fmt, int N, int K, uint8_t *wq, long ldw, uint16_t *wd,
                         uint16_t *wm, long ldd)
    long coli_q8x_tile_bytes(int K)
    void coli_q8x_pack(const coli_mat *W, int N, int K, uint8_t *pk)
    void coli_q8x_unpack(const uint8_t *pk, int N, int K, int8_t *wq, long ldw, uint16_t *wd, long ldd)
    enum:
        COLI_Q4X_TILES

cdef enum:
    ROW_BLOCK = 16      # weight rows per parallel work item
    ACT_SILU = 0
    ACT_GELU_TANH = 1
    QK = 32             # quantization group

cnp.import_array()

cdef int _nthreads = 1
cdef long SMALL_WORK = 1 << 15  # below this many inner-loop steps a kernel runs on the calling thread
cdef float *_panels = NULL   # packed token panels of the current GEMM, grown as needed
cdef size_t _panels_cap = 0
cdef int PANEL_MIN_ROWS = 48  # from this many tokens on, f32 matmuls pack the tokens into panels


def set_panel_min_rows(int rows):
    """Tune where f32 linear layers switch from dot-product tiles to token panels."""
    global PANEL_MIN_ROWS
    PANEL_MIN_ROWS = rows


cdef char *_xe_raw = NULL   # the multi-token quantized tiles' arranged activations, grown as needed
cdef size_t _xe_cap = 0
cdef long XE_MAX_BYTES = 16 << 20  # calls whose arranged activations would take more (long prefill
                                   # chunks) use the plain tiles, so the scratch stays small


cdef int XE_CHUNK_MIN = 16
cdef long XE_CHUNK_BYTES = 128 << 10  # a call whose activations, as its tiles re-read them for every
                                     # 4 rows, take more runs in chunks of tokens (long prompts):
                                     # each chunk's stay in L2 while every row block reads them


def set_xe_chunk_bytes(long n):
    """Tune the activation bytes (as the multi-token quantized tiles read them) above which a
    quantized call of many tokens runs in chunks of tokens (0: never). Each chunk takes the
    tiles the whole call would, so a row gets the bits it has in one piece; only int4 rows
    (AVX-512 VNNI) past set_xe_max_bytes, which in one piece take the plain tiles, get the
    arranged tiles' bits in chunks (each token's bits alone)."""
    global XE_CHUNK_BYTES
    XE_CHUNK_BYTES = n


def set_xe_max_bytes(long n):
    """Tune the largest arranged-activation scratch a multi-token quantized call may use
    (0: never arrange; every call on matrices in rows then takes the plain tiles, and a
    packed matrix, which needs them, gets them 8 tokens at a time)."""
    global XE_MAX_BYTES
    XE_MAX_BYTES = n


cdef int8_t *_xe_scratch(size_t need) except NULL:
    """``need`` bytes on a 64-byte boundary for coli_expand_act (grown, never shrunk; called
    with the GIL; like the panels, one kernel call uses it at a time)."""
    global _xe_raw, _xe_cap
    cdef char *p
    if need > _xe_cap:
        p = <char *>realloc(_xe_raw, need + 64)
        if p == NULL:
            raise MemoryError()
        _xe_raw, _xe_cap = p, need
    return <int8_t *>(_xe_raw + (-(<size_t>_xe_raw) & 63))


cdef float *_grown(float **buf, size_t *cap, size_t need) except NULL:
    """``*buf`` with room for ``need`` floats (grown, never shrunk; called with the GIL)."""
    cdef float *p
    if need > cap[0]:
        p = <float *>realloc(buf[0], need * sizeof(float))
        if p == NULL:
            raise MemoryError()
        buf[0], cap[0] = p, need
    return buf[0]


cdef float *_panel_scratch(size_t need) except NULL:
    """Room for ``need`` floats of token panels."""
    return _grown(&_panels, &_panels_cap, need)


cdef inline int _team(long work) noexcept nogil:
    """Threads for a loop of ``work`` inner steps: small loops (a decode step's norms,
    RoPE, routing, activation quantization) stay on the calling thread, because waking
    the OpenMP team costs more than the loop itself. Either way each output element is
    written by one thread in the same order, so results do not change.

    The hot kernels then run a plain loop, outside any OpenMP region (entering even a
    one-thread ``prange`` costs ~0.5 us, more than a decode step's norm of a row): they
    write the loop body once, as a row or block function called from both a ``range``
    and a ``prange``."""
    return 1 if work < SMALL_WORK else _nthreads


def set_small_work(long n):
    """Tune the size under which elementwise kernels run single-threaded (0: never)."""
    global SMALL_WORK
    SMALL_WORK = n


def set_num_threads(int n):
    """Use ``n`` OpenMP threads in every kernel from now on."""
    global _nthreads
    _nthreads = n if n > 0 else 1
    coli_omp_set_threads(_nthreads)


def get_num_threads():
    return _nthreads


def simd_name():
    """The SIMD path of this module: avx512vnni, avx512, avx2vnni, avx2, scalar (or native for a
    COLI_NATIVE=1 build); see coli/_engine/dispatch.py."""
    return COLI_SIMD_PATH.decode()


def has_openmp():
    """Whether this build runs its parallel loops on OpenMP threads (else single-threaded)."""
    return bool(COLI_OPENMP)


# ---------------------------------------------------------------- cheap array arguments

cdef inline void *_arr(object a, int typenum, int ndim, bint writable, str what) except? NULL:
    """The data of ``a``, which must be an aligned, C-contiguous, native-order ndarray of
    this dtype and rank (and writable, for an output): ValueError otherwise, like a
    mismatched typed memoryview. Callers then check the shape with _dim."""
    cdef cnp.ndarray arr
    if not cnp.PyArray_Check(a):
        raise TypeError(f"{what} must be a numpy array, not {type(a).__name__}")
    arr = <cnp.ndarray>a
    if (cnp.PyArray_TYPE(arr) != typenum or cnp.PyArray_NDIM(arr) != ndim or not cnp.PyArray_ISCARRAY_RO(arr)
            or not cnp.PyArray_ISNOTSWAPPED(arr) or (writable and not cnp.PyArray_ISWRITEABLE(arr))):
        raise ValueError(f"{what} must be a C-contiguous{' writable' if writable else ''} {ndim}-D "
                         f"{cnp.PyArray_DescrFromType(typenum)} array, got {a.dtype} {a.shape}")
    return cnp.PyArray_DATA(arr)


cdef inline Py_ssize_t _dim(object a, int i) noexcept:
    """Dimension i of an array that _arr accepted."""
    return cnp.PyArray_DIM(<cnp.ndarray>a, i)


# ---------------------------------------------------------------- linear layers

cdef inline void _linear_block(int b, int block, const float *X, long ldx, int M, const float *W, int N, int K,
                               float *Y, long ldy, const float *bias, const float *panels) noexcept nogil:
    """Weight rows [b*block, b*block + block) of _linear."""
    cdef int n0 = b * block, m, n
    cdef int nb = N - n0 if N - n0 < block else block
    if panels != NULL:
        coli_gemm_tokens(panels, M, W + <long>n0 * K, K, nb, K, Y + n0, ldy)
    else:
        coli_gemm_nt(X, ldx, M, W + <long>n0 * K, K, nb, K, Y + n0, ldy)
    if bias != NULL:
        for m in range(M):
            for n in range(nb):
                Y[m * ldy + n0 + n] += bias[n0 + n]


cdef void _linear(const float *X, long ldx, int M, const float *W, int N, int K,
                  float *Y, long ldy, const float *bias, float *panels) noexcept nogil:
    """panels: scratch for X packed into token panels (see _panel_scratch), or NULL for
    the dot-product tiles."""
    cdef int block = 2 * ROW_BLOCK if panels != NULL else ROW_BLOCK
    cdef int nblocks = (N + block - 1) // block
    cdef int b
    cdef int nt = _team(<long>M * N * K // 4)
    if panels != NULL:
        coli_pack_tokens(X, ldx, M, K, panels)
    if nt == 1:
        for b in range(nblocks):
            _linear_block(b, block, X, ldx, M, W, N, K, Y, ldy, bias, panels)
    else:
        for b in prange(nblocks, num_threads=nt, schedule='static'):
            _linear_block(b, block, X, ldx, M, W, N, K, Y, ldy, bias, panels)


cdef inline size_t _panel_floats(int M, int K) noexcept nogil:
    return <size_t>((M + COLI_NP - 1) // COLI_NP) * COLI_NP * K


def linear(x, w, out, bias=None):
    """out[M, N] = x[M, K] @ w[N, K].T (+ bias[N]); float32 ndarrays."""
    cdef const float *xp = <const float *>_arr(x, cnp.NPY_FLOAT32, 2, False, "linear: x")
    cdef const float *wp = <const float *>_arr(w, cnp.NPY_FLOAT32, 2, False, "linear: w")
    cdef float *op = <float *>_arr(out, cnp.NPY_FLOAT32, 2, True, "linear: out")
    cdef int M = _dim(x, 0), K = _dim(x, 1), N = _dim(w, 0)
    if _dim(w, 1) != K or _dim(out, 0) != M or _dim(out, 1) != N:
        raise ValueError(f"linear: shapes x({M}, {K}) w({N}, {_dim(w, 1)}) out({_dim(out, 0)}, {_dim(out, 1)})")
    cdef const float *bp = NULL
    if bias is not None:
        bp = <const float *>_arr(bias, cnp.NPY_FLOAT32, 1, False, "linear: bias")
        if _dim(bias, 0) != N:
            raise ValueError("linear: bias length != out features")
    if M == 0 or N == 0:
        return
    cdef float *panels = _panel_scratch(_panel_floats(M, K)) if M >= PANEL_MIN_ROWS else NULL
    with nogil:
        _linear(xp, K, M, wp, N, K, op, N, bp, panels)


# ---------------------------------------------------------------- norms, activations

cdef inline void _scale_row(const float *x, int H, double ss, float eps, const float *w, float off,
                            float *out) noexcept nogil:
    """out = rmsnorm of the row x (out may be x), given ss, the sum of its squares."""
    cdef float r = <float>(1.0 / sqrt(ss / H + eps))
    cdef int i
    for i in range(H):
        out[i] = (x[i] * r) * (w[i] + off)


cdef inline void _rmsnorm_row(float *x, const float *add, const float *w, int H, float eps, float off,
                              float *out) noexcept nogil:
    """One row of rmsnorm; with ``add``, x += add first (x is only written then)."""
    cdef double ss = 0
    cdef int i
    if add != NULL:
        for i in range(H):
            x[i] = x[i] + add[i]
            ss = ss + <double>x[i] * x[i]
    else:
        for i in range(H):
            ss = ss + <double>x[i] * x[i]
    _scale_row(x, H, ss, eps, w, off, out)


cdef int _rmsnorm_rows(x, add, w, float eps, out, bint unit_offset, str name) except -1:
    """rmsnorm (add None) and add_rmsnorm."""
    cdef float *xp = <float *>_arr(x, cnp.NPY_FLOAT32, 2, add is not None, name)
    cdef const float *wp = <const float *>_arr(w, cnp.NPY_FLOAT32, 1, False, name)
    cdef float *op = <float *>_arr(out, cnp.NPY_FLOAT32, 2, True, name)
    cdef const float *ap = NULL
    cdef int M = _dim(x, 0), H = _dim(x, 1), m
    if add is not None:
        ap = <const float *>_arr(add, cnp.NPY_FLOAT32, 2, False, name)
        if _dim(add, 0) != M or _dim(add, 1) != H:
            raise ValueError(f"{name}: shape mismatch")
    if _dim(w, 0) != H or _dim(out, 0) != M or _dim(out, 1) != H:
        raise ValueError(f"{name}: shape mismatch")
    cdef float off = 1.0 if unit_offset else 0.0
    cdef int nt = _team(<long>M * H)
    with nogil:
        if nt == 1:
            for m in range(M):
                _rmsnorm_row(xp + <long>m * H, ap + <long>m * H if ap != NULL else NULL, wp, H, eps, off,
                             op + <long>m * H)
        else:
            for m in prange(M, num_threads=nt, schedule='static'):
                _rmsnorm_row(xp + <long>m * H, ap + <long>m * H if ap != NULL else NULL, wp, H, eps, off,
                             op + <long>m * H)
    return 0


def rmsnorm(x, w, float eps, out, bint unit_offset=False):
    """out = x / sqrt(mean(x**2) + eps) * (w or 1 + w), row by row; out may be x.
    x, out (M, H) float32 ndarrays, w (H,)."""
    _rmsnorm_rows(x, None, w, eps, out, unit_offset, "rmsnorm")


def add_rmsnorm(x, add, w, float eps, out, bint unit_offset=False):
    """x += add, then out = rmsnorm(x, w, eps) (see rmsnorm) in the same pass over each
    row: a block's output joins the residual stream x and the next block's input is
    normed. Bit-identical to ``x += add`` followed by rmsnorm. add (M, H) like x."""
    _rmsnorm_rows(x, add, w, eps, out, unit_offset, "add_rmsnorm")


def gated_act(const float[:, ::1] g, const float[:, ::1] u, float[:, ::1] out, int act=ACT_SILU):
    """out = act(g) * u elementwise (act: 0 silu, 1 gelu_tanh); out may alias g."""
    cdef int M = g.shape[0], N = g.shape[1], m, i
    if u.shape[0] != M or u.shape[1] != N or out.shape[0] != M or out.shape[1] != N:
        raise ValueError("gated_act: shape mismatch")
    if M == 0 or N == 0:
        return
    for m in prange(M, nogil=True, num_threads=_team(<long>M * N), schedule='static'):
        coli_gated_act_row(&g[m, 0], &u[m, 0], &out[m, 0], N, act)


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

cdef enum:
    QK_NORM_NONE = 0
    QK_NORM_HEAD = 1    # q_norm / k_norm over each head
    QK_NORM_FULL = 2    # over the whole q / k projection

cdef struct qk_front:
    int nh, nkv, hd, half, norm
    float scaling, eps, off
    const float *inv_freq
    const float *qw
    const float *kw


cdef class AttentionFront:
    """One attention layer's constants for attention_front: head counts and size, RoPE
    on the first rot_dim dims of each head (inv_freq, scaling; see rope), and the
    optional q/k RMSNorm. Checked once, here, rather than at every call.

    norm: None; "head" (q_norm, k_norm (head_dim,) applied to every head); or "full"
    (q_norm (n_heads*head_dim,), k_norm (n_kv_heads*head_dim,) over the whole row).
    eps and unit_offset as in rmsnorm. scale (default head_dim ** -0.5), window and softcap:
    the attention that attention_front runs after the front when given an output (see
    attention)."""
    cdef qk_front f
    cdef readonly int n_heads, n_kv_heads, head_dim, rot_dim, window
    cdef readonly float scale, softcap
    cdef readonly object norm, inv_freq, q_norm, k_norm

    def __init__(self, int n_heads, int n_kv_heads, int head_dim, int rot_dim, inv_freq, float scaling=1.0,
                 norm=None, q_norm=None, k_norm=None, float eps=1e-6, bint unit_offset=False, scale=None,
                 int window=0, float softcap=0.0):
        widths = {None: (0, 0), "head": (head_dim, head_dim), "full": (n_heads * head_dim, n_kv_heads * head_dim)}
        if n_heads <= 0 or n_kv_heads <= 0 or head_dim <= 0 or not 0 <= rot_dim <= head_dim:
            raise ValueError(f"AttentionFront: bad geometry ({n_heads}, {n_kv_heads}, {head_dim}, {rot_dim})")
        if norm not in widths:
            raise ValueError(f"AttentionFront: norm must be None, 'head' or 'full', not {norm!r}")
        self.f.inv_freq = <const float *>_arr(inv_freq, cnp.NPY_FLOAT32, 1, False, "AttentionFront: inv_freq")
        if _dim(inv_freq, 0) < rot_dim // 2:
            raise ValueError("AttentionFront: fewer inv_freq than rot_dim / 2")
        self.f.qw = self.f.kw = NULL
        if norm is not None:
            self.f.qw = <const float *>_arr(q_norm, cnp.NPY_FLOAT32, 1, False, "AttentionFront: q_norm")
            self.f.kw = <const float *>_arr(k_norm, cnp.NPY_FLOAT32, 1, False, "AttentionFront: k_norm")
            if (_dim(q_norm, 0), _dim(k_norm, 0)) != widths[norm]:
                raise ValueError(f"AttentionFront: {norm} norm weights must be {widths[norm]} long")
        self.f.nh, self.f.nkv, self.f.hd, self.f.half = n_heads, n_kv_heads, head_dim, rot_dim // 2
        self.f.norm = QK_NORM_NONE if norm is None else QK_NORM_HEAD if norm == "head" else QK_NORM_FULL
        self.f.scaling, self.f.eps, self.f.off = scaling, eps, 1.0 if unit_offset else 0.0
        self.n_heads, self.n_kv_heads, self.head_dim, self.rot_dim = n_heads, n_kv_heads, head_dim, rot_dim
        self.norm, self.inv_freq, self.q_norm, self.k_norm = norm, inv_freq, q_norm, k_norm
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window, self.softcap = window, softcap


cdef inline void _sumsq4(float **rows, int L, double *ss) noexcept nogil:
    """ss[r] += rows[r][i]**2 for i in order, in double (rmsnorm's sum), for four rows at
    once: four independent dependency chains instead of one after another."""
    cdef const float *a = rows[0]
    cdef const float *b = rows[1]
    cdef const float *c = rows[2]
    cdef const float *d = rows[3]
    cdef double s0 = ss[0], s1 = ss[1], s2 = ss[2], s3 = ss[3]
    cdef int i
    for i in range(L):
        s0 = s0 + <double>a[i] * a[i]
        s1 = s1 + <double>b[i] * b[i]
        s2 = s2 + <double>c[i] * c[i]
        s3 = s3 + <double>d[i] * d[i]
    ss[0], ss[1], ss[2], ss[3] = s0, s1, s2, s3


cdef void _front_row(const qk_front *f, float *q, float *k, const float *v, int pos, void *kc, void *vc,
                     int kw, int vw, int half) noexcept nogil:
    """attention_front for one row: q (nh*hd), k (kw = nkv*hd), v (vw) floats."""
    cdef double ss[4]
    cdef float *rows[4]
    cdef int n = f.nh + f.nkv, qw = f.nh * f.hd, j, i, h
    if f.norm == QK_NORM_HEAD:  # n rows of hd floats (q's heads, then k's), four at a time
        for j in range(0, n, 4):
            for i in range(4):
                h = j + i if j + i < n else n - 1  # past the end: the last row again, not scaled twice
                rows[i] = q + h * f.hd if h < f.nh else k + (h - f.nh) * f.hd
                ss[i] = 0
            _sumsq4(rows, f.hd, ss)
            for i in range(n - j if n - j < 4 else 4):
                _scale_row(rows[i], f.hd, ss[i], f.eps, f.qw if j + i < f.nh else f.kw, f.off, rows[i])
    elif f.norm == QK_NORM_FULL:  # q and k as one row each: their sums run side by side
        rows[0], rows[1], rows[2], rows[3] = q, k, q, k
        ss[0] = ss[1] = ss[2] = ss[3] = 0
        _sumsq4(rows, qw if qw < kw else kw, ss)
        for i in range(kw, qw):
            ss[0] = ss[0] + <double>q[i] * q[i]
        for i in range(qw, kw):
            ss[1] = ss[1] + <double>k[i] * k[i]
        _scale_row(q, qw, ss[0], f.eps, f.qw, f.off, q)
        _scale_row(k, kw, ss[1], f.eps, f.kw, f.off, k)
    _rope_row(q, f.nh, k, f.nkv, f.hd, f.half, pos, f.inv_freq, f.scaling)
    coli_kv_put(kc, pos, k, kw, half)  # kv_write
    if vw > 0:
        coli_kv_put(vc, pos, v, vw, half)


def attention_front(AttentionFront front, q, k, v, pos, kptr, vptr, int layer, out=None, bint half=False):
    """Everything attention does to a step's new q, k, v before the scores, one row m at a
    time: the RMSNorm of q[m] and k[m] that ``front`` names, RoPE at position pos[m] (both
    in place), then k[m] and v[m] written into the layer's caches at kptr[layer, m] /
    vptr[layer, m] (see kv_write). Bit-identical to rmsnorm, rope and kv_write in turn.
    With ``out`` (M, n_heads*head_dim) float32, the attention itself follows in the same
    call, with the front's scale, window and softcap and values of head_dim floats:
    bit-identical to ``attention(q, kptr[layer], vptr[layer], pos, out, ...)`` after it (one
    call per layer instead of two).

    q (M, n_heads*head_dim), k (M, n_kv_heads*head_dim), v (M, any width) float32;
    pos (M,) int32; kptr, vptr (L, M) int64 (a Batch's), 0 <= layer < L; half: the caches
    are f16 (see kv_write)."""
    cdef float *qp = <float *>_arr(q, cnp.NPY_FLOAT32, 2, True, "attention_front: q")
    cdef float *kp = <float *>_arr(k, cnp.NPY_FLOAT32, 2, True, "attention_front: k")
    cdef const float *vp = <const float *>_arr(v, cnp.NPY_FLOAT32, 2, False, "attention_front: v")
    cdef const int32_t *pp = <const int32_t *>_arr(pos, cnp.NPY_INT32, 1, False, "attention_front: pos")
    cdef const int64_t *kc = <const int64_t *>_arr(kptr, cnp.NPY_INT64, 2, False, "attention_front: kptr")
    cdef const int64_t *vc = <const int64_t *>_arr(vptr, cnp.NPY_INT64, 2, False, "attention_front: vptr")
    cdef const qk_front *f = &front.f
    cdef int M = _dim(q, 0), kw = _dim(k, 1), vw = _dim(v, 1), m
    if (_dim(q, 1) != f.nh * f.hd or _dim(k, 0) != M or kw != f.nkv * f.hd or _dim(v, 0) != M
            or _dim(pos, 0) != M or _dim(kptr, 1) != M or _dim(vptr, 0) != _dim(kptr, 0) or _dim(vptr, 1) != M):
        raise ValueError("attention_front: shape mismatch")
    if not 0 <= layer < _dim(kptr, 0):
        raise ValueError(f"attention_front: layer {layer} of {_dim(kptr, 0)}")
    kc += <long>layer * M
    vc += <long>layer * M
    cdef att_call a
    if out is not None:
        a.out = <float *>_arr(out, cnp.NPY_FLOAT32, 2, True, "attention_front: out")
        if _dim(out, 0) != M or _dim(out, 1) != f.nh * f.hd or vw != kw:
            raise ValueError("attention_front: out must be (M, n_heads*head_dim) and v as wide as k")
        if half and f.hd > COLI_STAGE_LD:
            raise ValueError(f"attention: an f16 cache needs head dims <= {COLI_STAGE_LD}")
    cdef int nt = _team(<long>M * (f.nh + f.nkv) * f.hd * 2)
    with nogil:
        if nt == 1:
            for m in range(M):
                _front_row(f, qp + <long>m * f.nh * f.hd, kp + <long>m * kw, vp + <long>m * vw, pp[m],
                           <void *>kc[m], <void *>vc[m], kw, vw, half)
        else:
            for m in prange(M, num_threads=nt, schedule='static'):
                _front_row(f, qp + <long>m * f.nh * f.hd, kp + <long>m * kw, vp + <long>m * vw, pp[m],
                           <void *>kc[m], <void *>vc[m], kw, vw, half)
    if out is None:
        return
    a.q, a.kptr, a.vptr, a.pos = qp, kc, vc, pp
    a.nh, a.nkv, a.hd, a.vd, a.window = f.nh, f.nkv, f.hd, f.hd, front.window
    a.vs = kw
    a.scale, a.softcap, a.half = front.scale, front.softcap, half
    _attend(&a, M)


def rope(float[:, ::1] x, int n_heads, int head_dim, int rot_dim, const int32_t[::1] pos,
         const float[::1] inv_freq, float scaling=1.0):
    """Rotate the first rot_dim dims of every head of x (M, n_heads*head_dim) in place,
    GPT-NeoX style (rotate_half): pairs (i, i + rot_dim/2)."""
    cdef int M = x.shape[0], half = rot_dim // 2, m
    if x.shape[1] != n_heads * head_dim or inv_freq.shape[0] < half or pos.shape[0] != M:
        raise ValueError("rope: shape mismatch")
    cdef const float *freq = &inv_freq[0] if half > 0 else NULL
    for m in prange(M, nogil=True, num_threads=_team(<long>M * half * (n_heads + 8)), schedule='static'):
        _rope_row(&x[m, 0], n_heads, NULL, 0, head_dim, half, pos[m], freq, scaling)


cdef inline void _rope_row(float *q, int nq, float *k, int nk, int hd, int half, int pos, const float *inv_freq,
                           float scaling) noexcept nogil:
    """RoPE of one row: the nq heads of q, then the nk heads of k (hd floats apart), with
    each angle's cos / sin computed once for all of them."""
    cdef int i, h
    cdef float ang, c, s, x1, x2
    cdef float *x
    for i in range(half):
        ang = <float>pos * inv_freq[i]  # float32 product, as transformers computes it
        c = <float>cos(ang) * scaling
        s = <float>sin(ang) * scaling
        for h in range(nq + nk):
            x = q + h * hd if h < nq else k + (h - nq) * hd
            x1 = x[i]
            x2 = x[i + half]
            x[i] = x1 * c - x2 * s
            x[i + half] = x2 * c + x1 * s


def kv_write(const float[:, ::1] k, const float[:, ::1] v, const int64_t[::1] kptr,
             const int64_t[::1] vptr, const int32_t[::1] pos, bint half=False):
    """Copy row m of k / v into its sequence's cache at position pos[m].

    kptr[m] / vptr[m] are the addresses of that sequence's (capacity, width) cache of the
    current layer: float32, or with ``half`` f16, the rows rounded to nearest even (NumPy's
    ``astype(np.float16)``); the caller guarantees pos[m] < capacity."""
    cdef int M = k.shape[0], kw = k.shape[1], vw = v.shape[1], m
    if v.shape[0] != M or kptr.shape[0] != M or vptr.shape[0] != M or pos.shape[0] != M:
        raise ValueError("kv_write: shape mismatch")
    with nogil:
        for m in range(M):
            coli_kv_put(<void *>kptr[m], pos[m], &k[m, 0], kw, half)
            if vw > 0:  # MLA keeps its values inside the key rows
                coli_kv_put(<void *>vptr[m], pos[m], &v[m, 0], vw, half)


cdef struct att_call:
    const float *q
    const int64_t *kptr
    const int64_t *vptr
    const int32_t *pos
    float *out
    int nh, nkv, group, nsb, hd, vd, window, maxch
    int whole, parts  # wide items (_attend_wide): the first ``whole`` chunks whole, the rest in ``parts`` head parts
    long ks, vs
    float scale, softcap
    int half        # the caches are f16 (else float32)
    const int32_t *tiles    # tile t holds rows [tiles[t], tiles[t + 1]) (one sequence's, see _tile)
    float *slots    # split calls: chunk outputs (M, nh, maxch, vd), then their max and sum (M, nh, maxch, 2)
    float *ml


cdef inline int _att_start(const att_call *a, int m) noexcept nogil:
    """The first key row m attends (its window's start)."""
    if a.window > 0 and a.pos[m] - a.window + 1 > 0:
        return a.pos[m] - a.window + 1
    return 0


cdef inline int _att_keys(const att_call *a, int m) noexcept nogil:
    """How many keys row m attends."""
    return a.pos[m] + 1 - _att_start(a, m)


cdef inline int _att_chunks(const att_call *a, int m) noexcept nogil:
    """How many COLI_ATT_CH-key chunks row m's keys make."""
    return (_att_keys(a, m) + COLI_ATT_CH - 1) // COLI_ATT_CH


cdef inline int _att_heads(const att_call *a, int u, int *nb) noexcept nogil:
    """Work unit u of a row: the first head of its run of heads (nb of them, one KV group's)."""
    cdef int g = u // a.nsb, sb = u - g * a.nsb
    nb[0] = a.group - sb * COLI_ATT_HB if a.group - sb * COLI_ATT_HB < COLI_ATT_HB else COLI_ATT_HB
    return g * a.group + sb * COLI_ATT_HB


cdef void _att_tile(const att_call *a, long idx, float *tmp, float *wide) noexcept nogil:
    """Item idx = t * units + u: unit u of tile t's rows over all their keys (coli_attend_rows:
    each row's bits are those it has alone); tmp, wide: the thread's scratch."""
    cdef int units = a.nkv * a.nsb, nb, r
    cdef int t = idx // units, h0 = _att_heads(a, idx - <long>t * units, &nb), g = h0 // a.group
    cdef int m = a.tiles[t], nr = a.tiles[t + 1] - m
    cdef int j0[COLI_ATT_ROWS]
    cdef int j1[COLI_ATT_ROWS]
    for r in range(nr):
        j0[r], j1[r] = _att_start(a, m + r), a.pos[m + r] + 1
    coli_attend_rows(a.q + <long>m * a.nh * a.hd, <long>a.nh * a.hd,
                     COLI_KV_AT(<const void *>a.kptr[m], <long>g * a.hd, a.half), a.ks,
                     COLI_KV_AT(<const void *>a.vptr[m], <long>g * a.vd, a.half), a.vs, h0, nb, j0, j1, nr,
                     a.hd, a.vd, a.scale, a.softcap, a.half, a.out + <long>m * a.nh * a.vd, <long>a.nh * a.vd, tmp,
                     wide)


cdef void _att_part(const att_call *a, long idx) noexcept nogil:
    """Item idx = (m * maxch + c) * units + u: chunk c of unit u of row m, into its slots.
    Chunk-major, so a thread's share is a stretch of positions whose rows it reads whole, one
    KV head's slice after another, rather than one KV head's slice of every row; each item
    asks for its slice of the thread's next chunk (see coli_att_prefetch)."""
    cdef int units = a.nkv * a.nsb, nb
    cdef long mc = idx // units
    cdef int m = mc // a.maxch
    cdef int c = mc - <long>m * a.maxch
    cdef int h0 = _att_heads(a, idx - mc * units, &nb), g = h0 // a.group
    cdef int j0 = _att_start(a, m) + c * COLI_ATT_CH, j1 = a.pos[m] + 1, p1
    if j0 >= j1:  # a shorter row than the longest
        return
    if j1 - j0 > COLI_ATT_CH:
        j1 = j0 + COLI_ATT_CH
    cdef const void *Kg = COLI_KV_AT(<const void *>a.kptr[m], <long>g * a.hd, a.half)
    cdef const void *Vg = COLI_KV_AT(<const void *>a.vptr[m], <long>g * a.vd, a.half)
    if coli_att_prefetch > 0:
        p1 = min(j1 + coli_att_prefetch * COLI_ATT_CH, a.pos[m] + 1)
        if p1 > j1 + (coli_att_prefetch - 1) * COLI_ATT_CH:
            coli_attend_prefetch(Kg, a.ks, Vg, a.vs, j1 + (coli_att_prefetch - 1) * COLI_ATT_CH, p1, a.hd, a.vd, a.half)
    cdef long slot = (<long>m * a.nh + h0) * a.maxch + c
    coli_attend_part(a.q + <long>m * a.nh * a.hd, Kg, a.ks, Vg, a.vs, h0, nb, j0, j1, a.hd, a.vd,
                     a.scale, a.softcap, a.half, a.slots + slot * a.vd, <long>a.maxch * a.vd, a.ml + 2 * slot, 2 * a.maxch)


cdef void _att_wide(const att_call *a, long idx, float *work) noexcept nogil:
    """Item idx = m * maxch + c: chunk c of row m, all its heads (coli_attend_wide), into its
    slots; or, with a.parts > 1 (one row), past a.whole: part p of chunk c, idx = a.whole + (c -
    a.whole) * a.parts + p, the p-th of a.parts runs of whole KV groups (a.parts <= a.nkv, so
    none is empty). work: the thread's scratch."""
    cdef int m = 0, c = idx, g0 = 0, g1 = a.nkv, p
    if a.parts == 1:
        m = idx // a.maxch
        c = idx - <long>m * a.maxch
    elif idx >= a.whole:
        c = a.whole + (idx - a.whole) // a.parts
        p = (idx - a.whole) % a.parts
        g0, g1 = p * a.nkv // a.parts, (p + 1) * a.nkv // a.parts
    cdef int j0 = _att_start(a, m) + c * COLI_ATT_CH, j1 = a.pos[m] + 1
    if j0 >= j1:  # a shorter row than the longest
        return
    if j1 - j0 > COLI_ATT_CH:
        j1 = j0 + COLI_ATT_CH
    cdef int h0 = g0 * a.group
    cdef long slot = (<long>m * a.nh + h0) * a.maxch + c
    coli_attend_wide(a.q + (<long>m * a.nh + h0) * a.hd, COLI_KV_AT(<const void *>a.kptr[m], <long>g0 * a.hd, a.half),
                     a.ks, COLI_KV_AT(<const void *>a.vptr[m], <long>g0 * a.vd, a.half), a.vs, g1 - g0, a.group,
                     j0, j1, a.hd, a.vd, a.scale, a.softcap, a.half, a.slots + slot * a.vd, <long>a.maxch * a.vd,
                     a.ml + 2 * slot, 2 * a.maxch, work)


cdef void _att_join(const att_call *a, long idx) noexcept nogil:
    """Item idx = m * nh + h: head h of row m, its chunks merged in order."""
    cdef int m = idx // a.nh
    coli_attend_join(a.out + idx * a.vd, a.slots + idx * a.maxch * a.vd, a.ml + 2 * idx * a.maxch,
                     _att_chunks(a, m), a.vd)


def set_att_prefetch(int chunks):
    """Ask for attention's keys and values this many 64-key chunks ahead into L2 (default 1;
    0: no such prefetch). For measurements: results do not depend on it."""
    global coli_att_prefetch
    coli_att_prefetch = chunks if chunks > 0 else 0


def get_att_prefetch():
    return coli_att_prefetch


def set_stream_prefetch(int mode):
    """Which prefetches a packed int4 tile of one token issues while it streams a matrix
    (simd_qx.h, COLI_STREAM_PREFETCH5): 2 lines 4 KB ahead into L2 and 1 KB ahead into L1, 1
    only the L1 ones, 0 none; tiles of several tokens, and AVX2's packed int8 tiles, always
    issue both. The default is the CPU's (dispatch.stream_prefetch). For measurements: results do
    not depend on it."""
    coli_set_stream_prefetch(mode)


def get_stream_prefetch():
    return coli_stream_prefetch


cdef int _att_wide_mode = 2
# Under GQA the default takes wide rows up to this many chunks of keys (384): whole decode steps
# of SmolLM2-135M int4 (9 heads, 3 KV heads) were 2-6% faster wide at 128-192 positions, even at
# 400-432, and 4-9% slower at 700-1032, where the runs of heads (each KV head's slice read once
# for its group, over long stretches of keys) win (BENCHMARKS.md).
cdef int ATT_WIDE_GQA_CHUNKS = 6


def set_att_wide(int mode):
    """How one-token rows that are alone in their sequence attend: 0 by runs of heads of a KV
    group; 1 every head of a chunk at once, reading whole cache rows (coli_attend_wide), wherever
    the head dims fit; 2 (the default) so where every query head has its own KV head (olmoe's
    shape: 1.35-1.6x faster from a cold cache) and, under GQA, for rows of up to 384 keys; longer
    GQA rows go by runs of heads, which read each KV head's slice once for its group over long
    stretches of keys (SmolLM2's shape: a whole step 4-9% faster so at 700-1000 positions). For
    tests and measurements: results do not depend on it."""
    global _att_wide_mode
    if mode not in (0, 1, 2):
        raise ValueError("set_att_wide: mode is 0, 1 or 2")
    _att_wide_mode = mode


def get_att_wide():
    return _att_wide_mode


cdef int _att_wide_split = 1


def set_att_wide_split(bint on):
    """Whether a lone one-token row's chunks that do not go round the threads evenly are cut
    into parts of their heads, one a thread (default on; see _attend_wide). For tests and
    measurements: results do not depend on it."""
    global _att_wide_split
    _att_wide_split = on


# How many attention calls went each way since the last reset (attention_ways): by tiles of
# rows, by split chunks of runs of heads, by wide chunks, and how many of those wide calls cut
# chunks into head parts. For tests and measurements (which way ran is invisible in the bits).
cdef long _att_ways[4]


def attention_ways(bint reset=False):
    """The attention calls that went each way since the last reset: a dict of ``tiles``,
    ``split``, ``wide`` and ``wide_parts`` (wide calls whose leftover chunks were cut into parts
    of their heads). ``reset`` zeroes the counts after reading them."""
    d = dict(tiles=_att_ways[0], split=_att_ways[1], wide=_att_ways[2], wide_parts=_att_ways[3])
    if reset:
        for i in range(4):
            _att_ways[i] = 0
    return d


cdef float *_att_buf = NULL  # attention's scratch (split chunk outputs, per-thread merge rows), grown
cdef size_t _att_cap = 0
cdef long ATT_SPLIT_MAX = 1 << 20  # floats of chunk outputs a split call may hold (4 MB)


cdef float *_att_scratch(size_t need) except NULL:
    return _grown(&_att_buf, &_att_cap, need)


F16_HEAD_MAX = COLI_STAGE_LD  # the widest head (values) attention reads from an f16 cache


cdef inline int _run_end(const att_call *a, int m, int M) noexcept nogil:
    """The end of the run of rows from m that share m's caches."""
    cdef int e = m
    while e < M and a.kptr[e] == a.kptr[m] and a.vptr[e] == a.vptr[m]:
        e += 1
    return e


def attention(q, kptr, vptr, pos, out, int n_heads, int n_kv_heads, int head_dim, int v_head_dim, float scale,
              int window=0, float softcap=0.0, int v_stride=0, bint half=False):
    """Causal attention of each query row over its own sequence's cache.

    q: (M, n_heads*head_dim) float32; kptr, vptr (M,) int64, pos (M,) int32; out (M,
    n_heads*v_head_dim) float32 (ndarrays). The cache behind kptr[m] is (capacity, n_kv_heads,
    head_dim), behind vptr[m] (capacity, n_kv_heads, v_head_dim) — or, with v_stride,
    positions v_stride elements apart (MLA reads its values from the leading part of its key
    rows); row m attends positions [pos[m] - window + 1, pos[m]] (all of [0, pos[m]] when
    window <= 0). The caches are float32, or f16 with ``half`` (head dims up to COLI_STAGE_LD,
    576): keys and values are widened exactly, in registers as they are read (each key vector
    once for all the heads of a KV group) where a tile fits the head dims, else block by block
    into a small buffer the block's heads share, so the output is the bits of a float32 cache
    holding the same values.

    A row's keys are taken in fixed chunks of COLI_ATT_CH (64) counted from its first key, its
    heads in runs of up to COLI_ATT_HB (4) of one KV group (which share every K / V row they
    read); a chunk's softmax is local (its own max and sum) and the chunks merge in order
    (flash-decoding's split-K). Work items are (tile, run of heads): a tile is up to
    COLI_ATT_ROWS (16) consecutive rows of one sequence (a prompt's, in prefill), which walk
    their chunks together, so each chunk of keys and values is read from memory once for the
    tile (and, from an f16 cache, widened once for it), and a thread takes all of a tile's runs
    when there are tiles enough to go round and none holds more keys than a thread's share;
    or, when there are too few items to
    keep the threads busy (one-token decode), (row, chunk, run), so that each thread reads a
    stretch of whole cache rows, merged after a barrier in the same order. Either way a thread
    asks for the rows of the chunk it will read next into L2 while it computes one
    (set_att_prefetch). Every row's arithmetic is the same either way, so results do not depend
    on the thread count or on which rows share the call. Rows alone in their sequence (one-token
    decode) whose heads each have their own KV head, or under GQA of up to 384 keys, take items
    (row, chunk) instead, every head at once, reading whole cache rows in address order
    (coli_attend_wide, set_att_wide): the same arithmetic and bits, 1.5x faster from a cold
    cache on olmoe's shape; a row's chunks
    that do not go round the threads evenly are cut into parts of their heads, one a thread
    (set_att_wide_split: 1.1-1.4x faster from a warm cache, the same from a cold one).
    attention_ways counts which way the calls went. Nothing is
    allocated in the steady state (a
    scratch buffer grows to the largest call: a few KB a thread and a table of tiles)."""
    cdef att_call a
    a.q = <const float *>_arr(q, cnp.NPY_FLOAT32, 2, False, "attention: q")
    a.kptr = <const int64_t *>_arr(kptr, cnp.NPY_INT64, 1, False, "attention: kptr")
    a.vptr = <const int64_t *>_arr(vptr, cnp.NPY_INT64, 1, False, "attention: vptr")
    a.pos = <const int32_t *>_arr(pos, cnp.NPY_INT32, 1, False, "attention: pos")
    a.out = <float *>_arr(out, cnp.NPY_FLOAT32, 2, True, "attention: out")
    cdef int M = _dim(q, 0)
    if n_kv_heads <= 0 or n_heads % n_kv_heads != 0:
        raise ValueError("attention: n_heads must be a multiple of n_kv_heads")
    if head_dim <= 0 or v_head_dim <= 0:
        raise ValueError("attention: head dims must be positive")
    if _dim(q, 1) != n_heads * head_dim or _dim(out, 0) != M or _dim(out, 1) != n_heads * v_head_dim:
        raise ValueError("attention: shape mismatch")
    if _dim(kptr, 0) != M or _dim(vptr, 0) != M or _dim(pos, 0) != M:
        raise ValueError("attention: shape mismatch")
    a.nh, a.nkv, a.hd, a.vd, a.window = n_heads, n_kv_heads, head_dim, v_head_dim, window
    a.vs = v_stride if v_stride > 0 else <long>n_kv_heads * v_head_dim
    a.scale, a.softcap, a.half = scale, softcap, half
    if half and (head_dim > COLI_STAGE_LD or v_head_dim > COLI_STAGE_LD):
        raise ValueError(f"attention: an f16 cache needs head dims <= {COLI_STAGE_LD}")
    _attend(&a, M)


cdef int _attend(att_call *a, int M) except -1:
    """Run the attention that ``a`` describes (its pointers, geometry, vs, scale, window and
    softcap set) for M rows: choose the work items and threads, then release the GIL."""
    cdef int m, units, nt
    cdef long idx, keys = 0, nitems
    if M == 0:
        return 0
    a.group = a.nh // a.nkv
    a.nsb = (a.group + COLI_ATT_HB - 1) // COLI_ATT_HB
    a.ks = <long>a.nkv * a.hd
    a.maxch = 1
    for m in range(M):
        if a.pos[m] < 0:
            raise ValueError("attention: negative position")
        keys += _att_keys(a, m)
        a.maxch = max(a.maxch, _att_chunks(a, m))
    units = a.nkv * a.nsb
    nt = _team(keys * a.nh * (a.hd + a.vd) // 2)
    if (_att_wide_mode == 1 or _att_wide_mode == 2 and (a.group == 1 or a.maxch <= ATT_WIDE_GQA_CHUNKS)) \
            and coli_attend_wide_fits(a.hd, a.vd, a.half) \
            and _att_lone_rows(a, M) and \
            <long>M * a.nh * a.maxch * (a.vd + 2) <= ATT_SPLIT_MAX:
        _attend_wide(a, M, nt)
        return 0
    if nt > 1 and a.maxch > 1 and <long>M * units < 4 * nt and <long>M * a.nh * a.maxch * (a.vd + 2) <= ATT_SPLIT_MAX:
        a.slots = _att_scratch(<size_t>M * a.nh * a.maxch * (a.vd + 2))
        a.ml = a.slots + <long>M * a.nh * a.maxch * a.vd
        nitems = <long>M * units * a.maxch
        _att_ways[1] += 1
        with nogil, parallel(num_threads=nt):
            for idx in prange(nitems, schedule='static'):
                _att_part(a, idx)
            for idx in prange(<long>M * a.nh, schedule='static'):
                _att_join(a, idx)
        return 0
    # per thread: the merge rows, then (f16) a tile's widened chunk; then the tile table
    cdef long tw = (COLI_ATT_HB * a.vd + 15) // 16 * 16, ww = COLI_ATT_WIDE(a.hd, a.vd) if a.half else 0
    cdef float *base = _att_scratch(<size_t>(nt * (tw + ww) + M + 1 + 16))
    base += (16 - (<uintptr_t>base // sizeof(float)) % 16) % 16  # 64-byte aligned
    cdef int32_t *tiles = <int32_t *>(base + nt * (tw + ww))
    a.tiles = tiles
    cdef int ntiles = _tile(a, M, max(1, min(COLI_ATT_ROWS, <long>M * units // (4 * nt))), tiles)
    nitems = <long>ntiles * units
    # Tiles go to the threads in turn (a prompt's later rows have more keys than its first),
    # each with all its runs of heads: those read the other KV heads' parts of the same cache
    # rows, which the run before pulled in (the hardware fetches whole neighbouring lines).
    # With few tiles, or one tile holding more keys than a thread's share (a long
    # conversation's row beside short ones), that would leave a thread idle: then the items
    # go one by one.
    cdef long most = 0, tk
    cdef int t
    for t in range(ntiles):
        tk = 0
        for m in range(tiles[t], tiles[t + 1]):
            tk += _att_keys(a, m)
        most = max(most, tk)
    cdef int per = units if (ntiles >= 2 * nt or ntiles % nt == 0) and most * nt <= keys else 1
    _att_ways[0] += 1
    with nogil:
        if nt == 1:
            for idx in range(nitems):
                _att_tile(a, idx, base, base + tw if ww else NULL)
        else:
            for idx in prange(nitems, num_threads=nt, schedule='static', chunksize=per):
                _att_tile(a, idx, base + threadid() * (tw + ww), base + threadid() * (tw + ww) + tw if ww else NULL)
    return 0


cdef bint _att_lone_rows(const att_call *a, int M) noexcept nogil:
    """Whether no two neighbouring rows read the same caches (one-token decode rows, each its
    own sequence's; a prompt's or a draft's rows share theirs and go by tiles)."""
    cdef int m
    for m in range(M - 1):
        if _run_end(a, m, M) > m + 1:
            return False
    return True


cdef int _attend_wide(att_call *a, int M, int nt) except -1:
    """Rows that are alone in their sequence: items (row, chunk), every head at once, reading
    whole cache rows in order (coli_attend_wide), each thread a stretch of chunks; the heads'
    chunks merge after a barrier in chunk order (coli_attend_join), as the split items do."""
    cdef long nslot = <long>M * a.nh * a.maxch, nitems = <long>M * a.maxch, idx
    cdef long work = (COLI_ATT_WIDE_WORK(a.nh) + 15) // 16 * 16
    # One row: its chunks go whole to the threads in turn as far as they go round evenly, and
    # each chunk left over (the short last one among them) in nt parts of its heads, thread t
    # taking part t of each: so every thread reads as many keys (in row stretches of 1 / nt of
    # a row), where whole chunks alone leave one thread a whole chunk more than the others.
    a.whole, a.parts = a.maxch, 1
    if M == 1 and nt > 1 and a.nkv >= nt and _att_wide_split:
        a.whole = (_att_keys(a, 0) // COLI_ATT_CH) // nt * nt
        if a.whole < a.maxch:
            a.parts = nt
            nitems = a.whole + <long>(a.maxch - a.whole) * nt
            _att_ways[3] += 1
    _att_ways[2] += 1
    nt = max(1, min(nt, nitems))
    cdef float *base = _att_scratch(<size_t>(nslot * (a.vd + 2) + nt * work + 32))
    base += (16 - (<uintptr_t>base // sizeof(float)) % 16) % 16  # 64-byte aligned
    a.slots = base
    a.ml = base + nslot * a.vd
    cdef float *w = a.ml + 2 * nslot
    w += (16 - (<uintptr_t>w // sizeof(float)) % 16) % 16  # 64-byte aligned
    with nogil:
        if nt == 1:
            for idx in range(nitems):
                _att_wide(a, idx, w)
            for idx in range(<long>M * a.nh):
                _att_join(a, idx)
        else:
            with parallel(num_threads=nt):
                for idx in prange(nitems, schedule='static', chunksize=1):
                    _att_wide(a, idx, w + threadid() * work)
                for idx in prange(<long>M * a.nh, schedule='static'):
                    _att_join(a, idx)
    return 0


cdef int _tile(const att_call *a, int M, int rows, int32_t *tiles) noexcept nogil:
    """Cut the M rows into tiles of up to ``rows`` consecutive rows that read the same caches
    (one sequence's: a prompt in prefill, a speculative step's draft rows); tile t is rows
    [tiles[t], tiles[t + 1]). Returns the number of tiles."""
    cdef int m = 0, e, t = 0
    while m < M:
        e = _run_end(a, m, M)
        while m < e:
            tiles[t] = m
            t += 1
            m = min(m + rows, e)
    tiles[t] = M
    return t


# ---------------------------------------------------------------- mixture of experts

cdef void _route_softmax_row(const float *logits, int E, int k, bint renormalize, int32_t *idx,
                             float *weights) noexcept nogil:
    cdef int j, e, best
    cdef double mx, total, sel
    cdef float bv
    mx = logits[0]
    for e in range(1, E):
        if logits[e] > mx:
            mx = logits[e]
    total = 0
    for e in range(E):
        total = total + exp(logits[e] - mx)
    sel = 0
    for j in range(k):
        best = -1
        bv = -INFINITY
        for e in range(E):
            if (best < 0 or logits[e] > bv) and not _taken(idx, j, e):
                best = e
                bv = logits[e]
        idx[j] = best
        weights[j] = <float>(exp(bv - mx) / total)
        sel = sel + weights[j]
    if renormalize:
        for j in range(k):
            weights[j] = <float>(weights[j] / sel)


def moe_route_softmax(logits, int k, bint renormalize, idx, weights):
    """softmax over experts, then top-k (ties: lowest index first), optionally renormalised.
    logits (M, E) float32; idx (M, k) int32 and weights (M, k) float32 are written."""
    cdef const float *lp = <const float *>_arr(logits, cnp.NPY_FLOAT32, 2, False, "moe_route_softmax: logits")
    cdef int32_t *ip = <int32_t *>_arr(idx, cnp.NPY_INT32, 2, True, "moe_route_softmax: idx")
    cdef float *wp = <float *>_arr(weights, cnp.NPY_FLOAT32, 2, True, "moe_route_softmax: weights")
    cdef int M = _dim(logits, 0), E = _dim(logits, 1), m
    if not 0 < k <= E or _dim(idx, 0) != M or _dim(idx, 1) != k or _dim(weights, 0) != M or _dim(weights, 1) != k:
        raise ValueError("moe_route_softmax: shape mismatch")
    cdef int nt = _team(<long>M * E * (k + 4))
    with nogil:
        if nt == 1:
            for m in range(M):
                _route_softmax_row(lp + <long>m * E, E, k, renormalize, ip + <long>m * k, wp + <long>m * k)
        else:
            for m in prange(M, num_threads=nt, schedule='static'):
                _route_softmax_row(lp + <long>m * E, E, k, renormalize, ip + <long>m * k, wp + <long>m * k)


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


def release_threads():
    """Retire the OpenMP worker threads the calling thread started (OpenMP 5's
    omp_pause_resource_all). Call it before another thread takes over the kernels (the
    runner's): libgomp counts the idle workers of every thread that ever ran a parallel
    region, and once it counts more threads than cores, all of them stop spin-waiting
    between regions, which halves a decode step on a small machine. The next parallel
    region of the calling thread starts fresh workers. Returns 0 on success."""
    return coli_omp_release()
