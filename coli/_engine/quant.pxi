# Included by kernels.pyx: weight matrices in any format (f32, bf16, q8, q4), the
# quantized linear layer, and the mixture-of-experts kernel built on them.

from libc.stdint cimport int16_t, uint8_t

cdef extern from "simd_q16.h" nogil:
    ctypedef struct coli_act16:
        const int16_t *q
        const float *qd
        long ldq
        long ldb
        const uint8_t *xe
        long lde
    void coli_quantize_row_q16(const float *x, int K, int16_t *q, float *d)
    long coli_q16_xe_ld(int M, int K)
    void coli_q16_arrange(const coli_act16 *a, int M, int K, uint8_t *xe, long lde)
    int coli_q16_xe_used(int M)
    void coli_gemm_q16(const coli_act16 *a, int M, const coli_mat *W, int n0, int nb, int K, float *Y, long ldy)
    enum:
        COLI_Q8X_TILES

cdef int16_t *_q16 = NULL   # int16 activations of the current int8 GEMM, grown as needed
cdef size_t _q16_cap = 0


cdef int16_t *_q16_scratch(size_t need) except NULL:
    """Room for ``need`` int16 activations (grown, never shrunk; called with the GIL). int8
    weights take int16 activations (simd_q16.h); the callers' int8 scratch (xq) is for int4."""
    global _q16, _q16_cap
    cdef int16_t *p
    if need > _q16_cap:
        p = <int16_t *>realloc(_q16, need * sizeof(int16_t))
        if p == NULL:
            raise MemoryError()
        _q16, _q16_cap = p, need
    return _q16

FORMATS = {"f32": COLI_F32, "bf16": COLI_BF16, "int8": COLI_Q8, "int4": COLI_Q4A, "int4s": COLI_Q4}
FORMAT_NAMES = {v: k for k, v in FORMATS.items()}


def padded(int K):
    """K rounded up to the quantization group (32)."""
    return (K + QK - 1) // QK * QK


cdef class QMatrix:
    """A (rows, cols) weight matrix in one format; holds its arrays alive.

    f32: data float32 (rows, cols). bf16: data uint16 (rows, cols).
    int8: data int8 (rows, Kp), scales float16 (rows, Kp/32).
    int4s: data uint8 (rows, Kp/2), scales float16 (rows, Kp/32).
    int4: as int4s, plus mins float16 (rows, Kp/32). Kp = padded(cols).

    ``pack()`` rearranges an int4 / int4s or int8 matrix (AVX-512 VNNI, AVX2) into the
    4-row tiles this SIMD path computes on fastest (simd_qx.h), in place of its row arrays;
    ``data``, ``scales`` and ``mins`` then unpack a copy on each read (the same values)."""
    cdef coli_mat m
    cdef readonly int fmt, rows, cols
    cdef object _data, _scales, _mins
    cdef object _packed  # uint8 buffer holding m.pk, or None
    cdef public bint in_table  # an ExpertTable points at its rows (then it is never packed)

    def __init__(self, int fmt, data, scales, int rows, int cols, mins=None):
        cdef int kp = padded(cols)
        want = {COLI_F32: (np.float32, (rows, cols)), COLI_BF16: (np.uint16, (rows, cols)),
                COLI_Q8: (np.int8, (rows, kp)), COLI_Q4: (np.uint8, (rows, kp // 2)),
                COLI_Q4A: (np.uint8, (rows, kp // 2))}
        if fmt not in want:
            raise ValueError(f"QMatrix: unknown format {fmt}")
        dt, shape = want[fmt]
        if data.dtype != dt or tuple(data.shape) != shape or not data.flags.c_contiguous:
            raise ValueError(f"QMatrix: {FORMAT_NAMES[fmt]} data must be C-contiguous {np.dtype(dt)} {shape}, "
                             f"got {data.dtype} {tuple(data.shape)}")
        if fmt in (COLI_Q8, COLI_Q4, COLI_Q4A):
            if (scales is None or scales.dtype != np.float16 or tuple(scales.shape) != (rows, kp // QK)
                    or not scales.flags.c_contiguous):
                raise ValueError(f"QMatrix: {FORMAT_NAMES[fmt]} scales must be C-contiguous float16 ({rows}, {kp // QK})")
        if fmt == COLI_Q4A:
            if (mins is None or mins.dtype != np.float16 or tuple(mins.shape) != (rows, kp // QK)
                    or not mins.flags.c_contiguous):
                raise ValueError(f"QMatrix: int4 mins must be C-contiguous float16 ({rows}, {kp // QK})")
        else:
            mins = None
        self.fmt, self.rows, self.cols, self._data, self._scales, self._mins = fmt, rows, cols, data, scales, mins
        self._packed = None
        self.in_table = False
        self.m.fmt = fmt
        self.m.w = <const void *><size_t>data.ctypes.data
        self.m.d = <const uint16_t *><size_t>scales.ctypes.data if scales is not None else NULL
        self.m.m = <const uint16_t *><size_t>mins.ctypes.data if mins is not None else NULL
        self.m.ldw = shape[1]
        self.m.ldd = kp // QK
        self.m.pk, self.m.pks = NULL, 0

    @property
    def format(self):
        return FORMAT_NAMES[self.fmt]

    @property
    def packed(self):
        """Whether the matrix is held in this path's 4-row tiles (``pack``)."""
        return self._packed is not None

    @property
    def packed_bytes(self):
        """Bytes ``pack`` would hold the matrix in (0: it keeps its rows on this path)."""
        if self._packed is not None:
            return 0
        if COLI_Q4X_TILES and self.fmt in (COLI_Q4, COLI_Q4A):
            return (self.rows + 3) // 4 * coli_q4x_tile_bytes(self.fmt, self.cols)
        if COLI_Q8X_TILES and self.fmt == COLI_Q8:
            return (self.rows + 3) // 4 * coli_q8x_tile_bytes(self.cols)
        return 0

    def pack(self, out=None):
        """Hold an int4 / int4s or int8 matrix (AVX-512 VNNI, AVX2) in the 4-row tiles of this
        SIMD path's fastest tiles (AVX-512 VNNI int4 and int8, AVX2 int8: the same bits as the
        multi-token tiles on the rows), in
        ``out`` (a uint8 array of ``packed_bytes`` on a 64-byte boundary, which the matrix then
        keeps alive) or a buffer of its own, dropping the row arrays. Returns whether it did:
        other formats, other paths and packed matrices stay as they are."""
        cdef long size = self.packed_bytes
        if size == 0:
            return False
        if self.in_table:  # the table holds a copy of the row pointers this would free
            raise ValueError("QMatrix.pack: the matrix is an expert of an ExpertTable, which reads its rows")
        if out is None:
            raw = np.empty(size + 64, np.uint8)
            out = raw[-raw.ctypes.data % 64:][:size]
        if (not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.nbytes != size
                or not out.flags.c_contiguous or out.ctypes.data % 64):
            raise ValueError(f"QMatrix.pack: out must be {size} contiguous uint8 bytes on a 64-byte boundary")
        cdef uint8_t *pk = <uint8_t *><size_t>out.ctypes.data
        cdef bint q8 = self.fmt == COLI_Q8
        with nogil:
            if q8:
                coli_q8x_pack(&self.m, self.rows, self.cols, pk)
            else:
                coli_q4x_pack(&self.m, self.rows, self.cols, pk)
        self._packed = out
        self._data = self._scales = self._mins = None
        self.m.w, self.m.d, self.m.m = NULL, NULL, NULL
        self.m.pk = pk
        self.m.pks = coli_q8x_tile_bytes(self.cols) if q8 else coli_q4x_tile_bytes(self.fmt, self.cols)
        return True

    @property
    def rows_bytes(self):
        """Bytes ``move_rows`` needs: each row array on a 64-byte boundary (0 when packed)."""
        if self._packed is not None:
            return 0
        return sum(-(-a.nbytes // 64) * 64 for a in (self._data, self._scales, self._mins) if a is not None)

    def move_rows(self, out):
        """Hold the row arrays (data, scales, mins) in ``out`` instead: a uint8 array of
        ``rows_bytes`` on a 64-byte boundary, which the matrix then keeps alive, each array
        copied whole to its own 64-byte boundary (the very values, read by the same kernels).
        For the rows a path computes on as they are (a repacked matrix holds tiles instead):
        a buffer of transparent huge pages streams them faster than a file mapping's 4 KB
        pages do (coli.weights.packing). Refused for a packed matrix and for an expert of an
        ExpertTable (the table holds the old pointers)."""
        if self._packed is not None:
            raise ValueError("QMatrix.move_rows: the matrix is packed (it holds tiles, not rows)")
        if self.in_table:
            raise ValueError("QMatrix.move_rows: the matrix is an expert of an ExpertTable, which reads its rows")
        cdef long size = self.rows_bytes
        if (not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.nbytes != size
                or not out.flags.c_contiguous or out.ctypes.data % 64):
            raise ValueError(f"QMatrix.move_rows: out must be {size} contiguous uint8 bytes on a 64-byte boundary")
        moved = []
        cdef long off = 0
        for a in (self._data, self._scales, self._mins):
            if a is None:
                moved.append(None)
                continue
            b = out[off: off + a.nbytes].view(a.dtype).reshape(a.shape)
            b[...] = a
            moved.append(b)
            off += -(-a.nbytes // 64) * 64
        self._data, self._scales, self._mins = moved
        self.m.w = <const void *><size_t>self._data.ctypes.data
        self.m.d = <const uint16_t *><size_t>self._scales.ctypes.data if self._scales is not None else NULL
        self.m.m = <const uint16_t *><size_t>self._mins.ctypes.data if self._mins is not None else NULL

    def _unpacked(self):
        """The row arrays (data, scales, mins) of a packed matrix, unpacked afresh."""
        cdef int kp = padded(self.cols)
        cdef int8_t *q8p
        cdef uint16_t *d8p
        if self.fmt == COLI_Q8:
            q = np.empty((self.rows, kp), np.int8)
            d = np.empty((self.rows, kp // QK), np.float16)
            q8p, d8p = <int8_t *><size_t>q.ctypes.data, <uint16_t *><size_t>d.ctypes.data
            with nogil:
                coli_q8x_unpack(self.m.pk, self.rows, self.cols, q8p, kp, d8p, kp // QK)
            return q, d, None
        q = np.empty((self.rows, kp // 2), np.uint8)
        d = np.empty((self.rows, kp // QK), np.float16)
        mn = np.empty((self.rows, kp // QK), np.float16) if self.fmt == COLI_Q4A else None
        cdef uint8_t *qp = <uint8_t *><size_t>q.ctypes.data
        cdef uint16_t *dp = <uint16_t *><size_t>d.ctypes.data
        cdef uint16_t *mp = <uint16_t *><size_t>mn.ctypes.data if mn is not None else NULL
        with nogil:
            coli_q4x_unpack(self.m.pk, self.fmt, self.rows, self.cols, qp, kp // 2, dp, mp, kp // QK)
        return q, d, mn

    def arrays(self):
        """(data, scales, mins): the row arrays, unpacked once for a packed matrix."""
        return self._unpacked() if self._packed is not None else (self._data, self._scales, self._mins)

    @property
    def data(self):
        return self.arrays()[0]

    @property
    def scales(self):
        return self.arrays()[1]

    @property
    def mins(self):
        return self.arrays()[2]

    @property
    def nbytes(self):
        """Bytes the matrix holds (the tiles' padding rows and groups included when packed)."""
        if self._packed is not None:
            return self._packed.nbytes
        return (self._data.nbytes + (self._scales.nbytes if self._scales is not None else 0)
                + (self._mins.nbytes if self._mins is not None else 0))


def embed_rows(const int32_t[::1] ids, QMatrix table, float[:, ::1] out, float scale=1.0):
    """out[m] = row ids[m] of table (any format) * scale; ids already checked against rows."""
    cdef int M = ids.shape[0], H = table.cols, m, i
    if out.shape[0] != M or out.shape[1] != H:
        raise ValueError("embed_rows: shape mismatch")
    for m in prange(M, nogil=True, num_threads=_team(<long>M * H * 2), schedule='static'):
        coli_dequant_row(&table.m, ids[m], H, &out[m, 0])
        if scale != 1.0:
            for i in range(H):
                out[m, i] = out[m, i] * scale


cdef inline coli_act _activations(const float *x, long ldx, int8_t *q, float *qd, int32_t *qs, long ldq,
                          long ldb) noexcept nogil:
    cdef coli_act a
    a.x, a.q, a.qd, a.qs, a.ldx, a.ldq, a.ldb = x, q, qd, qs, ldx, ldq, ldb
    a.xe, a.lde = NULL, 0
    return a


cdef inline coli_act16 _act16(int16_t *q, float *qd, long ldq) noexcept nogil:
    cdef coli_act16 a
    a.q, a.qd, a.ldq, a.ldb = q, qd, ldq, ldq // QK
    a.xe, a.lde = NULL, 0
    return a


cdef inline coli_act16 _rows16(coli_act16 a, int off) noexcept nogil:
    a.q = a.q + off * a.ldq
    a.qd = a.qd + off * a.ldb
    if a.xe != NULL:
        a.xe = a.xe + off * a.lde
    return a


cdef coli_act16 _act16_arranged(int16_t *q, float *qd, int M, int K, bint one_gemm=False) except *:
    """int16 activations (M, padded(K)) in q / qd, plus room for their arrangement where
    this SIMD path's int8 tiles take one (coli_q16_xe_ld; called with the GIL). one_gemm: the
    M tokens go through each matrix together (qlinear, not a MoE call, whose experts each see
    a few), so no room is made where a GEMM of M tokens never reads it (coli_q16_xe_used:
    AVX2's row-lane tiles, from 9 tokens, read the int16 rows themselves)."""
    cdef coli_act16 a = _act16(q, qd, padded(K))
    cdef long lde = coli_q16_xe_ld(M, K)
    if one_gemm and not coli_q16_xe_used(M):
        lde = 0
    if lde and M:
        a.xe, a.lde = <const uint8_t *>_xe_scratch(<size_t>M * lde), lde
    return a


cdef inline coli_act _rows(coli_act a, int off) noexcept nogil:
    a.x = a.x + off * a.ldx
    a.q = a.q + off * a.ldq
    a.qd = a.qd + off * a.ldb
    a.qs = a.qs + off * a.ldb
    if a.xe != NULL:
        a.xe = a.xe + off * a.lde
    return a


cdef void _quantize_rows(const float *x, long ldx, int M, int K, int8_t *q, float *qd, int32_t *qs) noexcept nogil:
    cdef int m
    cdef long kp = (K + QK - 1) // QK * QK
    cdef int nt = _team(<long>M * K * 2)
    if nt == 1:
        for m in range(M):
            coli_quantize_row_q8(x + m * ldx, K, q + m * kp, qd + m * (kp // QK), qs + m * (kp // QK))
    else:
        for m in prange(M, num_threads=nt, schedule='static'):
            coli_quantize_row_q8(x + m * ldx, K, q + m * kp, qd + m * (kp // QK), qs + m * (kp // QK))


cdef inline void _quantize_row16(const float *x, int K, const coli_act16 *a, int m) noexcept nogil:
    """Row m of a (its int16 groups and scales, and their arrangement if a has one) from x."""
    cdef coli_act16 one = _rows16(a[0], m)
    coli_quantize_row_q16(x, K, <int16_t *>one.q, <float *>one.qd)
    if one.xe != NULL:
        coli_q16_arrange(&one, 1, K, <uint8_t *>one.xe, one.lde)


cdef void _quantize_rows16(const float *x, long ldx, int M, int K, const coli_act16 *a) noexcept nogil:
    cdef int m
    cdef int nt = _team(<long>M * K * 2)
    if nt == 1:
        for m in range(M):
            _quantize_row16(x + m * ldx, K, a, m)
    else:
        for m in prange(M, num_threads=nt, schedule='static'):
            _quantize_row16(x + m * ldx, K, a, m)


def quantize_rows16(const float[:, ::1] x, int16_t[:, ::1] q, float[:, ::1] qd):
    """Activations to int16 groups of 32, as int8 weights take them: q (M, Kp) with each pair
    of groups in the order b[0:16], b+1[0:16], b[16:32], b+1[16:32] (simd_q16.h), scales qd
    (M, Kp/32)."""
    cdef int M = x.shape[0], K = x.shape[1], kp = padded(x.shape[1])
    if q.shape[0] < M or q.shape[1] != kp or qd.shape[0] < M or qd.shape[1] != kp // QK:
        raise ValueError("quantize_rows16: shape mismatch")
    cdef coli_act16 a
    if M:
        a = _act16(&q[0, 0], &qd[0, 0], kp)
        with nogil:
            _quantize_rows16(&x[0, 0], K, M, K, &a)


def quantize_rows(const float[:, ::1] x, int8_t[:, ::1] q, float[:, ::1] qd, int32_t[:, ::1] qs):
    """Activations to int8 groups of 32: q (M, Kp), scales qd (M, Kp/32), group sums qs (M, Kp/32)."""
    cdef int M = x.shape[0], K = x.shape[1], kp = padded(x.shape[1])
    if q.shape[0] < M or q.shape[1] != kp or qd.shape[1] != kp // QK or qs.shape[1] != kp // QK:
        raise ValueError("quantize_rows: shape mismatch")
    if M:
        with nogil:
            _quantize_rows(&x[0, 0], K, M, K, &q[0, 0], &qd[0, 0], &qs[0, 0])


def qlinear(x, QMatrix w, out, bias, xq, xqd, xqs):
    """out[M, N] = x @ W.T (+ bias) for W in any format; x, out, bias float32 ndarrays.
    For int4/int4s, x is first quantized into the scratch xq (M, Kp) int8, xqd (M, Kp/32)
    float32 and xqs (M, Kp/32) int32 (more rows are fine); for int8, into int16 groups
    (an internal buffer) with their scales in xqd."""
    _qlinear_group(x, (w,), (out,), (bias,), xq, xqd, xqs)


cdef enum:
    MAX_MANY = 8


def qlinear_many(x, tuple mats, tuple outs, tuple biases, xq, xqd, xqs, int act=-1):
    """outs[i][M, N_i] = x @ mats[i].T (+ biases[i]) for up to 8 matrices that read the same
    input (q, k and v; gate and up): x is quantized (or packed into token panels) once, and
    the row blocks of all the matrices are spread over the threads in one parallel region.
    All matrices must share one format. Same results as one qlinear per matrix.

    With ``act`` (0 silu, 1 gelu_tanh) there must be two matrices of as many rows, gate and
    up: a work item is then one block of rows of both, and outs[0] ends up act(gate) * up
    (outs[1] holds up): the same bits as this call without act followed by gated_act, one
    kernel call and no separate pass over the rows."""
    if act >= 0 and (len(mats) != 2 or len(outs) != 2 or (<QMatrix?>mats[0]).rows != (<QMatrix?>mats[1]).rows):
        raise ValueError("qlinear_many: act needs two matrices (gate, up) with as many rows")
    _qlinear_group(x, mats, outs, biases, xq, xqd, xqs, act)


cdef struct qgroup:
    # a _qlinear_group call: n matrices, their row blocks numbered first[i] .. first[i+1]-1
    int n, M, K, rb
    coli_act a
    coli_act16 a16         # int16 activations (int8 weights)
    coli_mat ms[MAX_MANY]
    float *Ys[MAX_MANY]
    const float *Bs[MAX_MANY]
    int Ns[MAX_MANY]
    int first[MAX_MANY + 1]
    int act                # >= 0: gate and up blocks in pairs, then the gated activation
    const float *panels


cdef inline void _qlinear_block(const qgroup *g, int b) noexcept nogil:
    """Row block b of a _qlinear_group call (with g.act, block b of gate and of up, then
    act(gate) * up over those rows)."""
    cdef int i = 0, m, n0, nb
    if g.act >= 0:
        n0 = b * g.rb
        nb = g.Ns[0] - n0 if g.Ns[0] - n0 < g.rb else g.rb
        _qlinear_rows(g, 0, n0, nb)
        _qlinear_rows(g, 1, n0, nb)
        for m in range(g.M):
            coli_gated_act_row(g.Ys[0] + <long>m * g.Ns[0] + n0, g.Ys[1] + <long>m * g.Ns[0] + n0,
                               g.Ys[0] + <long>m * g.Ns[0] + n0, nb, g.act)
        return
    while g.first[i + 1] <= b:
        i = i + 1
    n0 = (b - g.first[i]) * g.rb
    nb = g.Ns[i] - n0 if g.Ns[i] - n0 < g.rb else g.rb
    _qlinear_rows(g, i, n0, nb)


cdef inline void _qlinear_rows(const qgroup *g, int i, int n0, int nb) noexcept nogil:
    """Rows [n0, n0 + nb) of matrix i of a _qlinear_group call, bias included."""
    cdef int m, c
    if g.panels != NULL:
        coli_gemm_tokens_any(g.panels, g.M, &g.ms[i], n0, nb, g.K, g.Ys[i], g.Ns[i])
    elif g.ms[i].fmt == COLI_Q8:
        coli_gemm_q16(&g.a16, g.M, &g.ms[i], n0, nb, g.K, g.Ys[i], g.Ns[i])
    else:
        coli_gemm_any(&g.a, g.M, &g.ms[i], n0, nb, g.K, g.Ys[i], g.Ns[i])
    if g.Bs[i] != NULL:
        for m in range(g.M):
            for c in range(nb):
                g.Ys[i][m * g.Ns[i] + n0 + c] += g.Bs[i][n0 + c]


cdef int _qlinear_group(x, tuple mats, tuple outs, tuple biases, xq, xqd, xqs, int act=-1) except -1:
    """The body of qlinear (one matrix) and qlinear_many."""
    cdef qgroup g
    cdef const float *xp = <const float *>_arr(x, cnp.NPY_FLOAT32, 2, False, "qlinear: x")
    cdef int8_t *qp = <int8_t *>_arr(xq, cnp.NPY_INT8, 2, True, "qlinear: xq")
    cdef float *qdp = <float *>_arr(xqd, cnp.NPY_FLOAT32, 2, True, "qlinear: xqd")
    cdef int32_t *qsp = <int32_t *>_arr(xqs, cnp.NPY_INT32, 2, True, "qlinear: xqs")
    cdef int M = _dim(x, 0), K = _dim(x, 1), n = len(mats), i, b, total = 0
    cdef QMatrix w
    if not 0 < n <= MAX_MANY or len(outs) != n or len(biases) != n:
        raise ValueError("qlinear: 1 to 8 matrices, one output and one bias (or None) each")
    cdef int fmt = (<QMatrix?>mats[0]).fmt
    cdef bint quant = fmt == COLI_Q8 or fmt == COLI_Q4 or fmt == COLI_Q4A
    g.n, g.M, g.K = n, M, K
    for i in range(n):
        w = <QMatrix?>mats[i]
        o = outs[i]
        g.Ys[i] = <float *>_arr(o, cnp.NPY_FLOAT32, 2, True, "qlinear: out")
        if w.fmt != fmt or w.cols != K or _dim(o, 0) != M or _dim(o, 1) != w.rows:
            raise ValueError(f"qlinear: matrix {i} is {w.format} ({w.rows}, {w.cols}), x ({M}, {K}), "
                             f"out ({_dim(o, 0)}, {_dim(o, 1)})")
        g.ms[i], g.Ns[i] = w.m, w.rows
        g.Bs[i] = NULL
        if biases[i] is not None:
            g.Bs[i] = <const float *>_arr(biases[i], cnp.NPY_FLOAT32, 1, False, "qlinear: bias")
            if _dim(biases[i], 0) != w.rows:
                raise ValueError("qlinear: bias length != out features")
    cdef int kp = padded(K)
    cdef bint packed = False
    for i in range(n):
        packed = packed or (<QMatrix>mats[i]).m.pk != NULL
    if quant and (_dim(xq, 0) < M or _dim(xq, 1) != kp or _dim(xqd, 0) < M or _dim(xqd, 1) != kp // QK
                  or _dim(xqs, 0) < M or _dim(xqs, 1) != kp // QK):
        raise ValueError("qlinear: activation scratch too small")
    if M == 0:
        return 0
    # int4's arranged activations per token (0: none)
    cdef long lde = coli_xe_ld(fmt, M, K) if quant else 0
    if packed and lde == 0 and fmt != COLI_Q8:  # (AVX2: only packed int4 matrices take arranged activations,
        # below the GEMM's size; int8 arranges its int16 activations in any layout, _act16_arranged)
        lde = coli_q4x_xe_ld(M, K)
    # A long call (a prompt) in chunks of tokens: the tiles go over the rows 4 at a time and
    # re-read the activations of every token each time, from L3 once they outgrow L2
    cdef long per = lde, c
    cdef int s, e
    if fmt == COLI_Q8:
        per = coli_q16_xe_ld(M, K) if coli_q16_xe_used(M) else 0
    if per and XE_CHUNK_BYTES > 0:
        c = max(XE_CHUNK_MIN, XE_CHUNK_BYTES // per // 8 * 8)  # (a long: any budget is safe)
        if M >= 2 * c:  # chunks of c tokens, the last one up to 2c - 1 (c < M here)
            for s in range(0, M // c * c, c):
                e = M if s + 2 * c > M else s + c
                _qlinear_group(x[s:e], mats, tuple(o[s:e] for o in outs), biases, xq, xqd, xqs, act)
            return 0
    g.panels = NULL
    if (fmt == COLI_F32 or fmt == COLI_BF16) and M >= PANEL_MIN_ROWS:
        g.panels = _panel_scratch(_panel_floats(M, K))
    g.rb = 2 * ROW_BLOCK if g.panels != NULL else ROW_BLOCK
    for i in range(n):
        g.first[i] = total
        total += (g.Ns[i] + g.rb - 1) // g.rb
    g.first[n] = total
    g.act = act
    if act >= 0:  # one work item per block of gate and up rows
        total = g.first[1]
    g.a = _activations(xp, K, NULL, NULL, NULL, 0, 0)
    cdef int16_t *q16 = NULL
    g.a16 = _act16(NULL, NULL, QK)
    if fmt == COLI_Q8:
        q16 = _q16_scratch(<size_t>M * kp)
        g.a16 = _act16_arranged(q16, qdp, M, K, True)
    elif quant:
        g.a = _activations(xp, K, qp, qdp, qsp, kp, kp // QK)
    cdef int nt = _team(<long>M * K * total * g.rb // 4 * (2 if act >= 0 else 1))
    cdef int chunk
    if lde and M * lde > XE_MAX_BYTES:
        if not packed:
            lde = 0
        else:  # a packed matrix always takes the arranged activations: a long call in chunks of tokens
            chunk = max(8, XE_MAX_BYTES // lde // 8 * 8)
            if M > chunk:
                for i in range(0, M, chunk):
                    _qlinear_group(x[i: i + chunk], mats, tuple(o[i: i + chunk] for o in outs), biases, xq, xqd,
                                   xqs, act)
                return 0
    if lde:
        g.a.xe, g.a.lde = _xe_scratch(M * lde), lde
    with nogil:
        if q16 != NULL:
            _quantize_rows16(xp, K, M, K, &g.a16)
        elif quant:
            _quantize_rows(xp, K, M, K, qp, qdp, qsp)
        if lde:
            coli_expand_act(&g.a, M, K, fmt, <int8_t *>g.a.xe, lde)
        if g.panels != NULL:
            coli_pack_tokens(xp, K, M, K, <float *>g.panels)
        if nt == 1:
            for b in range(total):
                _qlinear_block(&g, b)
        else:
            for b in prange(total, num_threads=nt, schedule='static'):
                _qlinear_block(&g, b)
    return 0


cdef class ExpertTable:
    """The gate, up and down matrices of every expert of one MoE layer, all in one format.

    Entries can be replaced at any time (``set``): the table only points at them, so
    experts can live in a mapped file, one stacked tensor, or a cache of slots. int8
    experts may be packed (QMatrix.pack: resident ones are, coli.weights.packing), the same
    bits as their rows; other formats stay in rows."""
    cdef coli_mat *mats        # (E, 3): gate, up, down
    cdef readonly int n_experts, hidden, inter, fmt
    cdef list _keep

    def __cinit__(self, int n_experts, int hidden, int inter, int fmt):
        self.mats = <coli_mat *>malloc(n_experts * 3 * sizeof(coli_mat))
        if self.mats == NULL:
            raise MemoryError()
        memset(self.mats, 0, n_experts * 3 * sizeof(coli_mat))
        self.n_experts, self.hidden, self.inter, self.fmt = n_experts, hidden, inter, fmt
        self._keep = [None] * (n_experts * 3)

    def __dealloc__(self):
        free(self.mats)

    def set(self, int e, QMatrix gate, QMatrix up, QMatrix down):
        """Point expert e at these matrices: gate, up (inter, hidden), down (hidden, inter)."""
        if not 0 <= e < self.n_experts:
            raise IndexError(e)
        for q, r, c in ((gate, self.inter, self.hidden), (up, self.inter, self.hidden), (down, self.hidden, self.inter)):
            if q.packed and q.fmt != COLI_Q8 and q.rows % 4:
                # int8 experts take coli_gemm_q16, which reads tiles or rows with the same bits; int4
                # experts their tiles in whole tiles of 4 rows (on AVX-512 VNNI the rows past them
                # take the plain tiles, which round otherwise)
                raise ValueError(f"ExpertTable.set: expert {e} matrix is a packed {q.format} (QMatrix.pack) of "
                                 f"{q.rows} rows; int4 experts are computed on tiles only in whole tiles of 4 "
                                 "rows, else they stay in rows")
            if q.fmt != self.fmt or q.rows != r or q.cols != c:
                raise ValueError(f"ExpertTable.set: expert {e} matrix is {q.format} ({q.rows}, {q.cols}), "
                                 f"expected {FORMAT_NAMES[self.fmt]} ({r}, {c})")
        self.mats[3 * e], self.mats[3 * e + 1], self.mats[3 * e + 2] = gate.m, up.m, down.m
        gate.in_table = up.in_table = down.in_table = True
        self._keep[3 * e: 3 * e + 3] = [gate, up, down]

    def get(self, int e):
        return tuple(self._keep[3 * e: 3 * e + 3])


cdef long _moe_ints(long rows, int k, int E, int inter, int hidden):
    """Length of the int32 scratch moe_experts needs for ``rows`` tokens."""
    cdef long pairs = rows * k
    cdef long active = pairs if pairs < E else E
    cdef long items = active * ((inter + ROW_BLOCK - 1) // ROW_BLOCK + (hidden + ROW_BLOCK - 1) // ROW_BLOCK)
    return 4 * E + 1 + 2 * pairs + 2 * items


cdef class MoEScratch:
    """moe_experts' working memory for up to ``rows`` tokens, each routed to ``k`` of
    ``n_experts`` experts of size (hidden, inter): one row per (token, expert) pair of
    gathered inputs xg and expert outputs y (hidden), gate and up activations g, u
    (inter), their int8 quantizations for int8/int4 experts (xq/xqd/xqs, hq/hqd/hqs, see
    quantize_rows), and the routing ints. Allocated once and reused by every call (the
    MoE layers of a model share one); moe_experts only checks that it fits."""
    cdef readonly int rows, k, n_experts, hidden, inter
    cdef readonly tuple arrays  # xg, g, u, y, xq, xqd, xqs, hq, hqd, hqs, ints
    cdef float *xg
    cdef float *g
    cdef float *u
    cdef float *y
    cdef int8_t *xq
    cdef float *xqd
    cdef int32_t *xqs
    cdef int8_t *hq
    cdef float *hqd
    cdef int32_t *hqs
    cdef int *ints

    def __init__(self, int rows, int k, int n_experts, int hidden, int inter):
        if rows < 0 or k <= 0 or n_experts <= 0 or hidden <= 0 or inter <= 0:
            raise ValueError(f"MoEScratch: bad shape ({rows}, {k}, {n_experts}, {hidden}, {inter})")
        cdef long n = <long>rows * k
        cdef int hp = padded(hidden), ip = padded(inter)
        f, i8, i32 = np.float32, np.int8, np.int32
        self.arrays = (np.empty((n, hidden), f), np.empty((n, inter), f), np.empty((n, inter), f),
                       np.empty((n, hidden), f), np.empty((n, hp), i8), np.empty((n, hp // QK), f),
                       np.empty((n, hp // QK), i32), np.empty((n, ip), i8), np.empty((n, ip // QK), f),
                       np.empty((n, ip // QK), i32), np.empty(_moe_ints(rows, k, n_experts, inter, hidden), i32))
        a = self.arrays
        self.xg, self.g, self.u, self.y = (<float *>_arr(a[0], cnp.NPY_FLOAT32, 2, True, ""),
                                           <float *>_arr(a[1], cnp.NPY_FLOAT32, 2, True, ""),
                                           <float *>_arr(a[2], cnp.NPY_FLOAT32, 2, True, ""),
                                           <float *>_arr(a[3], cnp.NPY_FLOAT32, 2, True, ""))
        self.xq, self.xqd, self.xqs = (<int8_t *>_arr(a[4], cnp.NPY_INT8, 2, True, ""),
                                       <float *>_arr(a[5], cnp.NPY_FLOAT32, 2, True, ""),
                                       <int32_t *>_arr(a[6], cnp.NPY_INT32, 2, True, ""))
        self.hq, self.hqd, self.hqs = (<int8_t *>_arr(a[7], cnp.NPY_INT8, 2, True, ""),
                                       <float *>_arr(a[8], cnp.NPY_FLOAT32, 2, True, ""),
                                       <int32_t *>_arr(a[9], cnp.NPY_INT32, 2, True, ""))
        self.ints = <int *>_arr(a[10], cnp.NPY_INT32, 1, True, "")
        self.rows, self.k, self.n_experts, self.hidden, self.inter = rows, k, n_experts, hidden, inter

    @property
    def nbytes(self):
        return sum(a.nbytes for a in self.arrays)


cdef enum:
    MOE_TEAM_MAX = 256  # threads a moe_experts call splits its work items over, at most
    MOE_ITEM_EXTRA = 2  # what an item's weight reads cost, in tokens of compute (_moe_split)

# Whether a call whose active experts go round the threads evenly (as many tokens each, a
# multiple of the threads in number: a decode step's) gives each thread whole experts, its
# gate, up and down in turn in one parallel region (_moe_whole), instead of two phases of
# row blocks with the hidden activations quantized between them on one thread. Each thread's
# weight reads then run on from one matrix to the next with no barrier between.
cdef bint _moe_whole_on = True


def set_moe_whole(bint on):
    """Whether decode-shaped moe_experts calls give each thread whole experts (default on;
    see _moe_whole). For tests and measurements: results do not depend on it."""
    global _moe_whole_on
    _moe_whole_on = on


def get_moe_whole():
    return _moe_whole_on


cdef long _moe_ways[2]


def moe_ways(bint reset=False):
    """How many moe_experts calls that computed experts went each way since the last reset:
    {"whole": whole experts a thread, "phases": two phases of row blocks (one thread, or
    experts that do not go round the threads evenly)}. reset zeroes them."""
    out = {"whole": _moe_ways[0], "phases": _moe_ways[1]}
    if reset:
        _moe_ways[0] = _moe_ways[1] = 0
    return out


cdef void _moe_split(const int *items, int n, const int *cnt, int nt, int *bnd) noexcept nogil:
    """bnd[0..nt]: thread t takes items[bnd[t]:bnd[t+1]], runs in order of about equal cost.
    Item e * 65536 + b costs cnt[e] + MOE_ITEM_EXTRA: its rows' compute grows with the
    expert's tokens, its weight reads do not (at one token, a quantized row block's reads
    take longer than its compute). An extra of 1, 4 or 16 decoded alike; 16 prefilled slower."""
    cdef long total = 0, acc = 0, c
    cdef int i, ti, cur = 0
    for i in range(n):
        total += cnt[items[i] // 65536] + MOE_ITEM_EXTRA
    for i in range(nt + 1):
        bnd[i] = n
    bnd[0] = 0
    for i in range(n):
        c = cnt[items[i] // 65536] + MOE_ITEM_EXTRA
        ti = <int>((2 * acc + c) * nt // (2 * total))  # the thread whose share holds the item's middle
        if ti > nt - 1:
            ti = nt - 1
        while cur < ti:
            cur += 1
            bnd[cur] = i
        acc += c


cdef struct moe_job:
    # what the parallel phases of moe_experts read
    const coli_mat *mats   # the table's (E, 3): gate, up, down
    int M                  # tokens of the call (the kernels' choice of tiles for an expert's share)
    int H, inter, rb, act
    const int *cnt         # (E,) tokens per expert
    const int *offs        # (E+1,) first row of each expert in xg
    const int *poff        # (E,) first panel row of each packed expert, or -1
    float *g
    float *u
    float *y
    coli_act ax, ah        # the gathered inputs and the hidden activations, quantized or not
    coli_act16 ax16, ah16  # the same as int16 groups, for int8 experts
    bint q16
    const float *panels
    int fmt                # the table's format (for coli_expand_act in _moe_whole)


cdef void _moe_up(const moe_job *j, int item) noexcept nogil:
    """Work item e * 65536 + b of phase 1: rows [b*rb, b*rb + rb) of expert e's gate and up
    for its tokens, then g = act(g) * u there."""
    cdef int e = item // 65536, n0 = (item % 65536) * j.rb, r, c
    cdef int nb = j.inter - n0 if j.inter - n0 < j.rb else j.rb
    cdef int ne = j.cnt[e], off = j.offs[e], H = j.H, I = j.inter
    cdef coli_act sub = _rows(j.ax, off)
    cdef coli_act16 sub16 = _rows16(j.ax16, off)
    cdef float *g = j.g + <long>off * I
    cdef float *u = j.u + <long>off * I
    if j.poff[e] >= 0:
        coli_gemm_tokens_any(j.panels + <long>j.poff[e] * H, ne, &j.mats[3 * e], n0, nb, H, g, I)
        coli_gemm_tokens_any(j.panels + <long>j.poff[e] * H, ne, &j.mats[3 * e + 1], n0, nb, H, u, I)
    elif j.q16:
        coli_gemm_q16(&sub16, ne, &j.mats[3 * e], n0, nb, H, g, I)
        coli_gemm_q16(&sub16, ne, &j.mats[3 * e + 1], n0, nb, H, u, I)
    else:
        coli_gemm_any_of(&sub, ne, j.M, &j.mats[3 * e], n0, nb, H, g, I)
        coli_gemm_any_of(&sub, ne, j.M, &j.mats[3 * e + 1], n0, nb, H, u, I)
    for r in range(ne):
        coli_gated_act_row(g + r * I + n0, u + r * I + n0, g + r * I + n0, nb, j.act)


cdef void _moe_down(const moe_job *j, int item) noexcept nogil:
    """Work item e * 65536 + b of phase 2: rows [b*rb, b*rb + rb) of expert e's down."""
    cdef int e = item // 65536, n0 = (item % 65536) * j.rb
    cdef int nb = j.H - n0 if j.H - n0 < j.rb else j.rb
    cdef int ne = j.cnt[e], off = j.offs[e], H = j.H, I = j.inter
    cdef coli_act sub = _rows(j.ah, off)
    cdef coli_act16 sub16 = _rows16(j.ah16, off)
    if j.poff[e] >= 0:
        coli_gemm_tokens_any(j.panels + <long>j.poff[e] * I, ne, &j.mats[3 * e + 2], n0, nb, I, j.y + <long>off * H, H)
    elif j.q16:
        coli_gemm_q16(&sub16, ne, &j.mats[3 * e + 2], n0, nb, I, j.y + <long>off * H, H)
    else:
        coli_gemm_any_of(&sub, ne, j.M, &j.mats[3 * e + 2], n0, nb, I, j.y + <long>off * H, H)


cdef void _moe_whole(const moe_job *j, const int *experts, int n) noexcept nogil:
    """Experts experts[0:n] whole, one after the other: every row block of an expert's gate
    and up (_moe_up), its tokens' hidden activations quantized (and arranged, where the
    call's tiles read them so) as the two-phase way quantizes them, then every row block of
    its down (_moe_down). The same items and arithmetic as the phases, so the same bits.
    The hidden rows are quantized one by one here: _quantize_rows(16) may open a parallel
    region of their own, which must not nest inside this one."""
    cdef int i, e, b, r, off, ne
    cdef int nbu = (j.inter + j.rb - 1) // j.rb, nbd = (j.H + j.rb - 1) // j.rb
    cdef coli_act sub
    for i in range(n):
        e = experts[i]
        for b in range(nbu):
            _moe_up(j, e * 65536 + b)
        off, ne = j.offs[e], j.cnt[e]
        if j.q16:
            for r in range(ne):
                _quantize_row16(j.g + <long>(off + r) * j.inter, j.inter, &j.ah16, off + r)
        elif j.ah.q != NULL:
            sub = _rows(j.ah, off)
            for r in range(ne):
                coli_quantize_row_q8(j.g + <long>(off + r) * j.inter, j.inter, <int8_t *>sub.q + r * sub.ldq,
                                     <float *>sub.qd + r * sub.ldb, <int32_t *>sub.qs + r * sub.ldb)
            if sub.xe != NULL:
                coli_expand_act(&sub, ne, j.inter, j.fmt, <int8_t *>sub.xe, sub.lde)
        for b in range(nbd):
            _moe_down(j, e * 65536 + b)


def moe_experts(x, idx, weights, ExpertTable table, out, MoEScratch scratch, counts, int act,
                active=None, bint combine=True):
    """out[m] = sum_j weights[m, j] * expert_{idx[m, j]}(x[m]), each expert a gated MLP
    down(act(gate(x)) * up(x)) (act: 0 silu, 1 gelu_tanh) with its matrices from
    ``table``. Returns the number of distinct experts the tokens are routed to.

    Tokens are grouped by expert so each expert's weights are read once for all of
    its tokens; the (expert, row block) work items of all experts are spread over the
    threads together, each thread a run of them in order. With ``active`` (E,) uint8 only the marked experts are computed
    (their table entries must be valid; the others' need not be); ``combine`` then
    writes the weighted sum of the expert outputs of all pairs into out and grows
    counts[e] by the tokens routed to e. Calling it once per group of experts with
    combine only on the last call gives bit-identical results to one call: the expert
    outputs persist in ``scratch`` between calls and the final sum runs in one fixed
    order.
    x, out (M, hidden) and weights (M, k) float32; idx (M, k) int32; counts (E,) int64;
    scratch: a MoEScratch of the table's shape and k, for at least M tokens."""
    cdef const float *xp = <const float *>_arr(x, cnp.NPY_FLOAT32, 2, False, "moe_experts: x")
    cdef const int32_t *ip = <const int32_t *>_arr(idx, cnp.NPY_INT32, 2, False, "moe_experts: idx")
    cdef const float *wp = <const float *>_arr(weights, cnp.NPY_FLOAT32, 2, False, "moe_experts: weights")
    cdef float *op = <float *>_arr(out, cnp.NPY_FLOAT32, 2, True, "moe_experts: out")
    cdef int64_t *counts_p = <int64_t *>_arr(counts, cnp.NPY_INT64, 1, True, "moe_experts: counts")
    cdef int M = _dim(x, 0), H = _dim(x, 1), k = _dim(idx, 1), E = table.n_experts, inter = table.inter
    cdef int pairs = M * k
    cdef bint quant = table.fmt == COLI_Q8 or table.fmt == COLI_Q4 or table.fmt == COLI_Q4A
    if (H != table.hidden or _dim(idx, 0) != M or _dim(weights, 0) != M or _dim(weights, 1) != k
            or _dim(out, 0) != M or _dim(out, 1) != H):
        raise ValueError("moe_experts: shape mismatch")
    if _dim(counts, 0) != E:
        raise ValueError("moe_experts: counts length != experts")
    if (scratch.rows < M or scratch.k != k or scratch.n_experts != E or scratch.hidden != H
            or scratch.inter != inter):
        raise ValueError(f"moe_experts: scratch is for {scratch.rows} tokens x {scratch.k} of {scratch.n_experts} "
                         f"experts ({scratch.hidden}, {scratch.inter}), not {M} x {k} of {E} ({H}, {inter})")
    cdef const uint8_t *on = NULL
    if active is not None:
        on = <const uint8_t *>_arr(active, cnp.NPY_UINT8, 1, False, "moe_experts: active")
        if _dim(active, 0) != E:
            raise ValueError("moe_experts: active mask length != experts")
    cdef int m, j, e, b, p, it, n1 = 0, n2 = 0, used = 0, t
    cdef int bnd[MOE_TEAM_MAX + 1]
    for p in range(pairs):
        if not 0 <= ip[p] < E:
            raise ValueError(f"moe_experts: expert id {ip[p]} out of range")
    if M == 0:
        return 0
    cdef int *cnt = scratch.ints             # (E,) tokens per expert
    cdef int *offs = cnt + E                 # (E+1,) first row of each expert in xg
    cdef int *fill = offs + E + 1            # (E,)
    cdef int *slot = fill + E                # (M*k,) row of (m, j) in xg
    cdef int *poff = slot + pairs            # (E,) first panel row of each packed expert, or -1
    cdef int *it1 = poff + E                 # work items, phase 1 then phase 2
    cdef float *xg = scratch.xg
    cdef moe_job job
    job.mats, job.H, job.inter, job.act = table.mats, H, inter, act
    job.M = M
    job.fmt = table.fmt
    job.cnt, job.offs, job.poff = cnt, offs, poff
    memset(cnt, 0, E * sizeof(int))
    for p in range(pairs):
        cnt[ip[p]] += 1
    # rows per work item; in decoding (few tokens per expert) longer runs of rows keep each
    # thread's weight reads sequential, which the hardware prefetcher streams best
    cdef bint wide = table.fmt == COLI_F32 or table.fmt == COLI_BF16
    cdef int rb = 2 * ROW_BLOCK if wide else (4 * ROW_BLOCK if pairs <= 16 else ROW_BLOCK)
    job.rb = rb
    cdef int min_rows = PANEL_MIN_ROWS
    cdef int nt = _team(<long>pairs * H * inter * 3 // 4)  # as qlinear's: multiply-adds / 4
    if nt > MOE_TEAM_MAX:
        nt = MOE_TEAM_MAX
    # whole experts a thread (_moe_whole) where the active experts have as many tokens each
    # and go round the threads evenly, and none takes token panels
    cdef int n_on = 0, c0 = -1
    cdef bint whole = _moe_whole_on and nt > 1
    for e in range(E):
        if cnt[e] > 0 and (on == NULL or on[e]):
            n_on += 1
            if c0 < 0:
                c0 = cnt[e]
            elif cnt[e] != c0:
                whole = False
    whole = whole and n_on > 0 and n_on % nt == 0 and not (wide and c0 >= min_rows)
    cdef long kpx, kph, ldex, ldeh  # (int8 experts taken whole: their two int16 buffers)
    job.g, job.u, job.y = scratch.g, scratch.u, scratch.y
    job.ax = _activations(xg, H, NULL, NULL, NULL, 0, 0)
    job.ah = _activations(scratch.g, inter, NULL, NULL, NULL, 0, 0)
    # int8 experts: int16 activations in one internal buffer, the inputs' and then (after
    # phase 1 has read them) the hidden activations'
    job.q16 = table.fmt == COLI_Q8
    job.ax16 = job.ah16 = _act16(NULL, NULL, QK)
    cdef int16_t *q16 = NULL
    if job.q16 and whole:
        # each thread quantizes its experts' hidden activations while the other threads still
        # read their experts' inputs: the two get buffers of their own
        kpx, kph = padded(H), padded(inter)
        q16 = _q16_scratch(<size_t>pairs * (kpx + kph))
        job.ax16 = _act16(q16, scratch.xqd, kpx)
        job.ah16 = _act16(q16 + pairs * kpx, scratch.hqd, kph)
        if coli_q16_xe_ld(pairs, H if H > inter else inter):
            ldex, ldeh = coli_q16_xe_ld(pairs, H), coli_q16_xe_ld(pairs, inter)
            job.ax16.xe = <const uint8_t *>_xe_scratch(<size_t>pairs * (ldex + ldeh))
            job.ah16.xe = job.ax16.xe + pairs * ldex
            job.ax16.lde, job.ah16.lde = ldex, ldeh
    elif job.q16:
        q16 = _q16_scratch(<size_t>pairs * (padded(H) if H > inter else padded(inter)))
        # (their arrangements share one buffer too)
        job.ax16 = _act16_arranged(q16, scratch.xqd, pairs, H if H > inter else inter)
        job.ah16 = job.ax16
        job.ax16.ldq, job.ax16.ldb = padded(H), padded(H) // QK
        job.ax16.lde = coli_q16_xe_ld(pairs, H)
        job.ah16.qd, job.ah16.ldq, job.ah16.ldb = scratch.hqd, padded(inter), padded(inter) // QK
        job.ah16.lde = coli_q16_xe_ld(pairs, inter)
    elif quant:
        job.ax = _activations(xg, H, scratch.xq, scratch.xqd, scratch.xqs, padded(H), padded(H) // QK)
        job.ah = _activations(scratch.g, inter, scratch.hq, scratch.hqd, scratch.hqs, padded(inter),
                              padded(inter) // QK)
    cdef int kmax = H if H > inter else inter
    # f32 / bf16 experts with many tokens: their gathered rows packed into token panels
    cdef float *panels = _panel_scratch(<size_t>(pairs + E * COLI_NP) * kmax) if wide else NULL
    job.panels = panels
    # experts with several tokens take the multi-token tiles: their activations arranged once
    cdef long ldx = coli_xe_ld(table.fmt, pairs, H) if quant else 0
    cdef long ldh = coli_xe_ld(table.fmt, pairs, inter) if quant else 0
    cdef int8_t *xe = NULL
    b = 0
    # on a path with int4 tiles every call arranges int4 experts' activations, whatever its
    # size: packed experts read only arranged activations, and experts in rows then compute as
    # the tiles do (AVX-512 VNNI: the rows' multi-token tiles; AVX2: coli_q4tile_rx), so a
    # streamed layer's rows give a resident packed layer's bits and a token's bits do not
    # depend on its call (from COLI_Q4GEMM8_MIN tokens of an expert AVX2 takes the token-lane
    # GEMM, on rows and tiles alike)
    cdef bint always = COLI_Q4X_TILES and (table.fmt == COLI_Q4 or table.fmt == COLI_Q4A)
    if always and ldx == 0:  # (AVX2: a call's arrangement per token, as a packed GEMV's)
        ldx, ldh = coli_q4x_xe_ld(1, H), coli_q4x_xe_ld(1, inter)
    if ldx and ldh and (always or pairs * (ldx + ldh) <= XE_MAX_BYTES):
        xe = _xe_scratch(pairs * (ldx + ldh))
        job.ax.xe, job.ax.lde = xe, ldx
        job.ah.xe, job.ah.lde = xe + pairs * ldx, ldh
    cdef int *whole_e
    with nogil:
        offs[0] = 0
        for e in range(E):
            offs[e + 1] = offs[e] + cnt[e]
            fill[e] = offs[e]
            used += cnt[e] > 0
            if combine:
                counts_p[e] += cnt[e]
        for m in range(M):
            for j in range(k):
                e = ip[m * k + j]
                slot[m * k + j] = fill[e]
                memcpy(xg + <long>fill[e] * H, xp + <long>m * H, H * sizeof(float))
                fill[e] += 1
        for e in range(E):
            if cnt[e] > 0 and (on == NULL or on[e]):
                for b in range((inter + rb - 1) // rb):
                    it1[n1] = e * 65536 + b
                    n1 = n1 + 1
        for e in range(E):
            if cnt[e] > 0 and (on == NULL or on[e]):
                for b in range((H + rb - 1) // rb):
                    it1[n1 + n2] = e * 65536 + b
                    n2 = n2 + 1
        if job.q16:
            _quantize_rows16(xg, H, pairs, H, &job.ax16)
        elif quant:
            _quantize_rows(xg, H, pairs, H, scratch.xq, scratch.xqd, scratch.xqs)
        if xe != NULL:
            for e in range(E):
                b = b if b > cnt[e] else cnt[e]
            if b >= 2 or always:  # an expert with several tokens, or int4 tiles
                coli_expand_act(&job.ax, pairs, H, table.fmt, <int8_t *>job.ax.xe, ldx)
            else:
                xe = job.ax.xe = job.ah.xe = NULL
        p = 0
        for e in range(E):
            poff[e] = -1
            if panels != NULL and cnt[e] >= min_rows and (on == NULL or on[e]):
                poff[e] = p
                coli_pack_tokens(xg + <long>offs[e] * H, H, cnt[e], H, panels + <long>p * H)
                p = p + (cnt[e] + COLI_NP - 1) // COLI_NP * COLI_NP
        if whole and n1 > 0:
            # (after the items: the list of experts fits where they end)
            _moe_ways[0] += 1
            whole_e = it1 + n1 + n2
            n_on = 0
            for e in range(E):
                if cnt[e] > 0 and (on == NULL or on[e]):
                    whole_e[n_on] = e
                    n_on = n_on + 1
            n_on = n_on // nt
            for t in prange(nt, num_threads=nt, schedule='static', chunksize=1):
                _moe_whole(&job, whole_e + t * n_on, n_on)
        else:
            if n1 > 0:
                _moe_ways[1] += 1
            # Each phase's items go to the threads as runs in order, of about equal cost, so a
            # thread reads long stretches of one or a few experts. Handed out one by one, the
            # threads alternated blocks of the same expert, and each core's prefetchers ran on
            # into the blocks the other core then read again: olmoe-1b-7b's shape decoded 4
            # streams 1.22-1.28x faster in runs (BENCHMARKS.md, "MoE work items in runs").
            if nt == 1 or n1 == 0:
                for it in range(n1):
                    _moe_up(&job, it1[it])
            else:
                _moe_split(it1, n1, cnt, nt, bnd)
                for t in prange(nt, num_threads=nt, schedule='static', chunksize=1):
                    for it in range(bnd[t], bnd[t + 1]):
                        _moe_up(&job, it1[it])
            if job.q16:
                _quantize_rows16(scratch.g, inter, pairs, inter, &job.ah16)
            elif quant:
                _quantize_rows(scratch.g, inter, pairs, inter, scratch.hq, scratch.hqd, scratch.hqs)
            if xe != NULL:
                coli_expand_act(&job.ah, pairs, inter, table.fmt, <int8_t *>job.ah.xe, ldh)
            for e in range(E):
                if poff[e] >= 0:
                    coli_pack_tokens(scratch.g + <long>offs[e] * inter, inter, cnt[e], inter,
                                     panels + <long>poff[e] * inter)
            if nt == 1 or n2 == 0:
                for it in range(n2):
                    _moe_down(&job, it1[n1 + it])
            else:
                _moe_split(it1 + n1, n2, cnt, nt, bnd)
                for t in prange(nt, num_threads=nt, schedule='static', chunksize=1):
                    for it in range(bnd[t], bnd[t + 1]):
                        _moe_down(&job, it1[n1 + it])
    if not combine:
        return used
    with nogil:
        nt = _team(<long>M * k * H)
        if nt == 1:
            for m in range(M):
                _moe_combine(op + <long>m * H, wp + <long>m * k, slot + m * k, k, scratch.y, H)
        else:
            for m in prange(M, num_threads=nt, schedule='static'):
                _moe_combine(op + <long>m * H, wp + <long>m * k, slot + m * k, k, scratch.y, H)
    return used


cdef inline void _moe_combine(float *out, const float *weights, const int *slot, int k, const float *y,
                              int H) noexcept nogil:
    """out = sum_j weights[j] * y[slot[j]], added in order j = 0, 1, ... from zero."""
    cdef int j, c
    cdef const float *yr
    cdef float w
    for c in range(H):
        out[c] = 0
    for j in range(k):
        w = weights[j]
        yr = y + <long>slot[j] * H
        for c in range(H):
            out[c] += w * yr[c]
