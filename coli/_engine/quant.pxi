# Included by kernels.pyx: weight matrices in any format (f32, bf16, q8, q4), the
# quantized linear layer, and the mixture-of-experts kernel built on them.

FORMATS = {"f32": COLI_F32, "bf16": COLI_BF16, "int8": COLI_Q8, "int4": COLI_Q4}
FORMAT_NAMES = {v: k for k, v in FORMATS.items()}


def padded(int K):
    """K rounded up to the quantization group (32)."""
    return (K + QK - 1) // QK * QK


cdef class QMatrix:
    """A (rows, cols) weight matrix in one format; holds its arrays alive.

    f32: data float32 (rows, cols). bf16: data uint16 (rows, cols).
    int8: data int8 (rows, Kp), scales float16 (rows, Kp/32).
    int4: data uint8 (rows, Kp/2), scales float16 (rows, Kp/32). Kp = padded(cols)."""
    cdef coli_mat m
    cdef readonly int fmt, rows, cols
    cdef readonly object data, scales

    def __init__(self, int fmt, data, scales, int rows, int cols):
        cdef int kp = padded(cols)
        want = {COLI_F32: (np.float32, (rows, cols)), COLI_BF16: (np.uint16, (rows, cols)),
                COLI_Q8: (np.int8, (rows, kp)), COLI_Q4: (np.uint8, (rows, kp // 2))}
        if fmt not in want:
            raise ValueError(f"QMatrix: unknown format {fmt}")
        dt, shape = want[fmt]
        if data.dtype != dt or tuple(data.shape) != shape or not data.flags.c_contiguous:
            raise ValueError(f"QMatrix: {FORMAT_NAMES[fmt]} data must be C-contiguous {np.dtype(dt)} {shape}, "
                             f"got {data.dtype} {tuple(data.shape)}")
        if fmt in (COLI_Q8, COLI_Q4):
            if (scales is None or scales.dtype != np.float16 or tuple(scales.shape) != (rows, kp // QK)
                    or not scales.flags.c_contiguous):
                raise ValueError(f"QMatrix: {FORMAT_NAMES[fmt]} scales must be C-contiguous float16 ({rows}, {kp // QK})")
        self.fmt, self.rows, self.cols, self.data, self.scales = fmt, rows, cols, data, scales
        self.m.fmt = fmt
        self.m.w = <const void *><size_t>data.ctypes.data
        self.m.d = <const uint16_t *><size_t>scales.ctypes.data if scales is not None else NULL
        self.m.ldw = shape[1]
        self.m.ldd = kp // QK

    @property
    def format(self):
        return FORMAT_NAMES[self.fmt]

    @property
    def nbytes(self):
        return self.data.nbytes + (self.scales.nbytes if self.scales is not None else 0)


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
    return a


cdef inline coli_act _rows(coli_act a, int off) noexcept nogil:
    a.x = a.x + off * a.ldx
    a.q = a.q + off * a.ldq
    a.qd = a.qd + off * a.ldb
    a.qs = a.qs + off * a.ldb
    return a


cdef void _quantize_rows(const float *x, long ldx, int M, int K, int8_t *q, float *qd, int32_t *qs) noexcept nogil:
    cdef int m
    cdef long kp = (K + QK - 1) // QK * QK
    for m in prange(M, num_threads=_team(<long>M * K * 2), schedule='static'):
        coli_quantize_row_q8(x + m * ldx, K, q + m * kp, qd + m * (kp // QK), qs + m * (kp // QK))


def quantize_rows(const float[:, ::1] x, int8_t[:, ::1] q, float[:, ::1] qd, int32_t[:, ::1] qs):
    """Activations to int8 groups of 32: q (M, Kp), scales qd (M, Kp/32), group sums qs (M, Kp/32)."""
    cdef int M = x.shape[0], K = x.shape[1], kp = padded(x.shape[1])
    if q.shape[0] < M or q.shape[1] != kp or qd.shape[1] != kp // QK or qs.shape[1] != kp // QK:
        raise ValueError("quantize_rows: shape mismatch")
    if M:
        with nogil:
            _quantize_rows(&x[0, 0], K, M, K, &q[0, 0], &qd[0, 0], &qs[0, 0])


def qlinear(const float[:, ::1] x, QMatrix w, float[:, ::1] out, const float[::1] bias,
            int8_t[:, ::1] xq, float[:, ::1] xqd, int32_t[:, ::1] xqs):
    """out[M, N] = x @ W.T (+ bias) for W in any format. For int8/int4, x is first quantized
    into the scratch xq (M, Kp) int8, xqd / xqs (M, Kp/32)."""
    _qlinear_group(x, (w,), (out,), (bias,), xq, xqd, xqs)


cdef enum:
    MAX_MANY = 8


def qlinear_many(const float[:, ::1] x, tuple mats, tuple outs, tuple biases,
                 int8_t[:, ::1] xq, float[:, ::1] xqd, int32_t[:, ::1] xqs):
    """outs[i][M, N_i] = x @ mats[i].T (+ biases[i]) for up to 8 matrices that read the same
    input (q, k and v; gate and up): x is quantized (or packed into token panels) once, and
    the row blocks of all the matrices are spread over the threads in one parallel region.
    All matrices must share one format. Same results as one qlinear per matrix."""
    _qlinear_group(x, mats, outs, biases, xq, xqd, xqs)


cdef int _qlinear_group(const float[:, ::1] x, tuple mats, tuple outs, tuple biases,
                        int8_t[:, ::1] xq, float[:, ::1] xqd, int32_t[:, ::1] xqs) except -1:
    """The body of qlinear (one matrix) and qlinear_many."""
    cdef int M = x.shape[0], K = x.shape[1], n = len(mats), i, b, n0, nb, m, c, total = 0
    cdef coli_mat ms[MAX_MANY]
    cdef float *Ys[MAX_MANY]
    cdef const float *Bs[MAX_MANY]
    cdef int Ns[MAX_MANY]
    cdef int first[MAX_MANY + 1]
    cdef float[:, ::1] o
    cdef const float[::1] bv
    cdef QMatrix w
    if not 0 < n <= MAX_MANY or len(outs) != n or len(biases) != n:
        raise ValueError("qlinear: 1 to 8 matrices, one output and one bias (or None) each")
    cdef int fmt = (<QMatrix>mats[0]).fmt
    cdef bint quant = fmt == COLI_Q8 or fmt == COLI_Q4
    for i in range(n):
        w = <QMatrix?>mats[i]
        o = outs[i]
        if w.fmt != fmt or w.cols != K or o.shape[0] != M or o.shape[1] != w.rows:
            raise ValueError(f"qlinear: matrix {i} is {w.format} ({w.rows}, {w.cols}), x ({M}, {K}), "
                             f"out ({o.shape[0]}, {o.shape[1]})")
        ms[i], Ns[i] = w.m, w.rows
        Ys[i] = &o[0, 0] if M > 0 else NULL
        Bs[i] = NULL
        if biases[i] is not None:
            bv = biases[i]
            if bv.shape[0] != w.rows:
                raise ValueError("qlinear: bias length != out features")
            Bs[i] = &bv[0]
    if quant and (xq.shape[0] < M or xq.shape[1] != padded(K) or xqd.shape[0] < M or xqs.shape[0] < M):
        raise ValueError("qlinear: activation scratch too small")
    if M == 0:
        return 0
    cdef float *panels = NULL
    if fmt == COLI_F32 and M >= PANEL_MIN_ROWS:
        panels = _panel_scratch(_panel_floats(M, K))
    cdef int rb = 2 * ROW_BLOCK if panels != NULL else ROW_BLOCK
    for i in range(n):
        first[i] = total
        total += (Ns[i] + rb - 1) // rb
    first[n] = total
    cdef coli_act a = _activations(&x[0, 0], K, NULL, NULL, NULL, 0, 0)
    if quant:
        a = _activations(&x[0, 0], K, &xq[0, 0], &xqd[0, 0], &xqs[0, 0], xq.shape[1], xqd.shape[1])
    cdef int nt = _team(<long>M * K * total * rb // 4)
    with nogil:
        if quant:
            _quantize_rows(&x[0, 0], K, M, K, &xq[0, 0], &xqd[0, 0], &xqs[0, 0])
        if panels != NULL:
            coli_pack_tokens(&x[0, 0], K, M, K, panels)
        for b in prange(total, num_threads=nt, schedule='static'):
            i = 0
            while first[i + 1] <= b:
                i = i + 1
            n0 = (b - first[i]) * rb
            nb = Ns[i] - n0 if Ns[i] - n0 < rb else rb
            if panels != NULL:
                coli_gemm_tokens(panels, M, <const float *>ms[i].w + <long>n0 * K, K, nb, K, Ys[i] + n0, Ns[i])
            else:
                coli_gemm_any(&a, M, &ms[i], n0, nb, K, Ys[i], Ns[i])
            if Bs[i] != NULL:
                for m in range(M):
                    for c in range(nb):
                        Ys[i][m * Ns[i] + n0 + c] += Bs[i][n0 + c]
    return 0


cdef class ExpertTable:
    """The gate, up and down matrices of every expert of one MoE layer, all in one format.

    Entries can be replaced at any time (``set``): the table only points at them, so
    experts can live in a mapped file, one stacked tensor, or a cache of slots."""
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
            if q.fmt != self.fmt or q.rows != r or q.cols != c:
                raise ValueError(f"ExpertTable.set: expert {e} matrix is {q.format} ({q.rows}, {q.cols}), "
                                 f"expected {FORMAT_NAMES[self.fmt]} ({r}, {c})")
        self.mats[3 * e], self.mats[3 * e + 1], self.mats[3 * e + 2] = gate.m, up.m, down.m
        self._keep[3 * e: 3 * e + 3] = [gate, up, down]

    def get(self, int e):
        return tuple(self._keep[3 * e: 3 * e + 3])


def moe_scratch_ints(int M, int k, int E, int inter, int hidden):
    """Length of the int32 scratch moe_experts needs for M tokens."""
    cdef long pairs = <long>M * k
    cdef long active = pairs if pairs < E else E
    cdef long items = active * ((inter + ROW_BLOCK - 1) // ROW_BLOCK + (hidden + ROW_BLOCK - 1) // ROW_BLOCK)
    return 4 * E + 1 + 2 * pairs + 2 * items


def moe_experts(const float[:, ::1] x, const int32_t[:, ::1] idx, const float[:, ::1] weights,
                ExpertTable table, float[:, ::1] out, float[:, ::1] xg, float[:, ::1] gbuf,
                float[:, ::1] ubuf, float[:, ::1] ybuf, int32_t[::1] iscratch, int64_t[::1] counts,
                int act, int8_t[:, ::1] xq, float[:, ::1] xqd, int32_t[:, ::1] xqs,
                int8_t[:, ::1] hq, float[:, ::1] hqd, int32_t[:, ::1] hqs,
                const uint8_t[::1] active=None, bint combine=True):
    """out[m] += sum_j weights[m, j] * expert_{idx[m, j]}(x[m]), each expert a gated MLP
    down(act(gate(x)) * up(x)) with its matrices from ``table``.

    Tokens are grouped by expert so each expert's weights are read once for all of
    its tokens; the (expert, row block) work items of all experts are spread over the
    threads together. With ``active`` (E,) only the marked experts are computed (their
    table entries must be valid; the others' need not be); ``combine`` then adds the
    weighted expert outputs of all pairs into out and grows counts[e] by the tokens
    routed to e. Calling it once per group of experts with combine only on the last
    call gives bit-identical results to one call: the rows of ybuf persist between
    calls and the final sum runs in one fixed order.
    Scratch: xg, ybuf (M*k, hidden); gbuf, ubuf (M*k, inter); iscratch
    (moe_scratch_ints); for int8/int4 tables, xq/xqd/xqs and hq/hqd/hqs hold the
    quantized gathered inputs and hidden activations (see quantize_rows)."""
    cdef int M = x.shape[0], H = x.shape[1], k = idx.shape[1], E = table.n_experts, inter = table.inter
    cdef int pairs = M * k
    cdef bint quant = table.fmt == COLI_Q8 or table.fmt == COLI_Q4
    if M == 0:
        return
    if H != table.hidden or weights.shape[0] != M or weights.shape[1] != k or out.shape[0] != M or out.shape[1] != H:
        raise ValueError("moe_experts: shape mismatch")
    if counts.shape[0] != E:
        raise ValueError("moe_experts: counts length != experts")
    if (xg.shape[0] < pairs or xg.shape[1] != H or ybuf.shape[0] < pairs or ybuf.shape[1] != H
            or gbuf.shape[0] < pairs or gbuf.shape[1] != inter or ubuf.shape[0] < pairs
            or ubuf.shape[1] != inter or iscratch.shape[0] < moe_scratch_ints(M, k, E, inter, H)):
        raise ValueError("moe_experts: scratch too small")
    if quant and (xq.shape[0] < pairs or xq.shape[1] != padded(H) or hq.shape[0] < pairs
                  or hq.shape[1] != padded(inter)):
        raise ValueError("moe_experts: quantization scratch too small")
    cdef int *cnt = <int *>&iscratch[0]      # (E,) tokens per expert
    cdef int *offs = cnt + E                 # (E+1,) first row of each expert in xg
    cdef int *fill = offs + E + 1            # (E,)
    cdef int *slot = fill + E                # (M*k,) row of (m, j) in xg
    cdef int *poff = slot + pairs            # (E,) first panel row of each packed expert, or -1
    cdef int *it1 = poff + E                 # work items, phase 1 then phase 2
    cdef int m, j, e, b, r, c, p, it, n0, nb, ne, off, n1 = 0, n2 = 0
    cdef float w
    cdef coli_act ax = _activations(&xg[0, 0], H, NULL, NULL, NULL, 0, 0)
    cdef coli_act ah = _activations(&gbuf[0, 0], inter, NULL, NULL, NULL, 0, 0)
    cdef coli_act sub
    # rows per work item; in decoding (few tokens per expert) longer runs of rows keep each
    # thread's weight reads sequential, which the hardware prefetcher streams best
    cdef int rb = 2 * ROW_BLOCK if table.fmt == COLI_F32 else (4 * ROW_BLOCK if pairs <= 16 else ROW_BLOCK)
    cdef int kmax = H if H > inter else inter
    # f32 experts with many tokens: their gathered rows packed into token panels
    cdef float *panels = (_panel_scratch(<size_t>(pairs + E * COLI_NP) * kmax) if table.fmt == COLI_F32
                          else NULL)
    cdef int min_rows = PANEL_MIN_ROWS
    cdef const float *Wf
    if quant:
        ax = _activations(&xg[0, 0], H, &xq[0, 0], &xqd[0, 0], &xqs[0, 0], xq.shape[1], xqd.shape[1])
        ah = _activations(&gbuf[0, 0], inter, &hq[0, 0], &hqd[0, 0], &hqs[0, 0], hq.shape[1], hqd.shape[1])
    for m in range(M):
        for j in range(k):
            if not 0 <= idx[m, j] < E:
                raise ValueError(f"moe_experts: expert id {idx[m, j]} out of range")
    if active is not None and active.shape[0] != E:
        raise ValueError("moe_experts: active mask length != experts")
    cdef const uint8_t *on = &active[0] if active is not None else NULL
    with nogil:
        memset(cnt, 0, E * sizeof(int))
        for m in range(M):
            for j in range(k):
                cnt[idx[m, j]] += 1
        offs[0] = 0
        for e in range(E):
            offs[e + 1] = offs[e] + cnt[e]
            fill[e] = offs[e]
            if combine:
                counts[e] += cnt[e]
        for m in range(M):
            for j in range(k):
                e = idx[m, j]
                slot[m * k + j] = fill[e]
                memcpy(&xg[fill[e], 0], &x[m, 0], H * sizeof(float))
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
        if quant:
            _quantize_rows(&xg[0, 0], H, pairs, H, &xq[0, 0], &xqd[0, 0], &xqs[0, 0])
        p = 0
        for e in range(E):
            poff[e] = -1
            if panels != NULL and cnt[e] >= min_rows and (on == NULL or on[e]):
                poff[e] = p
                coli_pack_tokens(&xg[offs[e], 0], H, cnt[e], H, panels + <long>p * H)
                p = p + (cnt[e] + COLI_NP - 1) // COLI_NP * COLI_NP
    with nogil, parallel(num_threads=_nthreads):
        for it in prange(n1, schedule='dynamic'):
            e = it1[it] // 65536
            n0 = (it1[it] % 65536) * rb
            nb = inter - n0 if inter - n0 < rb else rb
            ne = cnt[e]
            off = offs[e]
            sub = _rows(ax, off)
            if poff[e] >= 0:
                Wf = <const float *>table.mats[3 * e].w
                coli_gemm_tokens(panels + <long>poff[e] * H, ne, Wf + <long>n0 * H, H, nb, H, &gbuf[off, n0], inter)
                Wf = <const float *>table.mats[3 * e + 1].w
                coli_gemm_tokens(panels + <long>poff[e] * H, ne, Wf + <long>n0 * H, H, nb, H, &ubuf[off, n0], inter)
            else:
                coli_gemm_any(&sub, ne, &table.mats[3 * e], n0, nb, H, &gbuf[off, 0], inter)
                coli_gemm_any(&sub, ne, &table.mats[3 * e + 1], n0, nb, H, &ubuf[off, 0], inter)
            for r in range(ne):
                for c in range(nb):
                    gbuf[off + r, n0 + c] = _act(gbuf[off + r, n0 + c], act) * ubuf[off + r, n0 + c]
    with nogil:
        if quant:
            _quantize_rows(&gbuf[0, 0], inter, pairs, inter, &hq[0, 0], &hqd[0, 0], &hqs[0, 0])
        for e in range(E):
            if poff[e] >= 0:
                coli_pack_tokens(&gbuf[offs[e], 0], inter, cnt[e], inter, panels + <long>poff[e] * inter)
    with nogil, parallel(num_threads=_nthreads):
        for it in prange(n2, schedule='dynamic'):
            e = it1[n1 + it] // 65536
            n0 = (it1[n1 + it] % 65536) * rb
            nb = H - n0 if H - n0 < rb else rb
            ne = cnt[e]
            off = offs[e]
            sub = _rows(ah, off)
            if poff[e] >= 0:
                Wf = <const float *>table.mats[3 * e + 2].w
                coli_gemm_tokens(panels + <long>poff[e] * inter, ne, Wf + <long>n0 * inter, inter, nb, inter,
                                 &ybuf[off, n0], H)
            else:
                coli_gemm_any(&sub, ne, &table.mats[3 * e + 2], n0, nb, inter, &ybuf[off, 0], H)
    if not combine:
        return
    for m in prange(M, nogil=True, num_threads=_team(<long>M * k * H), schedule='static'):
        for j in range(k):
            p = slot[m * k + j]
            w = weights[m, j]
            for c in range(H):
                out[m, c] += w * ybuf[p, c]
