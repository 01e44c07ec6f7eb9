/* The multi-token quantized tiles of the AVX-512 VNNI path (several tokens against the same
 * weight rows: batched decode, speculative verification, MoE experts with several tokens,
 * prefill). Included by simd_q.h after the plain tiles, whose one-token tiles it falls back
 * to; coli_gemm_any dispatches here when the call's activations were arranged
 * (coli_act.xe, see coli_xe_ld / coli_expand_act). */
#ifndef COLI_SIMD_QX_H
#define COLI_SIMD_QX_H

/* ---- several tokens x 4 rows, rows interleaved in registers (AVX-512 VNNI) -------------
 * The plain tiles (simd_q.h) keep each row's 64-byte load in its natural order, so every
 * int32 lane of a dot product holds a quarter of one group of one row: each (token, row)
 * pair then pays a convert, a scale multiply and an fma per step besides its two dpbusd,
 * and with a few tokens that, not the weight bytes, sets the speed. Here the 64-byte loads
 * of 4 rows are transposed by dwords within each 128-bit lane (8 unpacks), so lane (L, j)
 * (128-bit lane L, dword j) holds row j's bytes of group b + L: after the 8
 * dpbusd of a step each lane is one whole (row, group) dot product, and one convert +
 * multiply + fma per token serves 4 rows. The activations come pre-arranged
 * (coli_expand_act, once per call): per token and step, each vector a dword of every group
 * broadcast over its 128-bit lane, then the step's activation scales and offset terms in
 * the same lane order, so the inner loop reads them as memory operands. Used from 2 tokens
 * on (COLI_XT_MIN), up to 8 per tile; the groups after the last whole step are one masked
 * step (zeros past the end, in the weights and in the arranged activations). */
#if defined(COLI_Q512)
#define COLI_XT_MIN 1   /* tokens from which coli_gemm_any takes the interleaved tiles: every count, so
                        * a token gets the same bits alone, in a batch or in a verification */
#define COLI_XT_MR 8    /* tokens per interleaved tile */
/* vectors of 64 bytes per token and step: 8 activation dwords, the scale, 8 * the group sum
 * (int32) and scale * sum (float) */
#define COLI_XE_Q4 11

/* Bytes of coli_expand_act's output per token (0: the interleaved tiles are not used). */
static inline long coli_xe_ld(int fmt, int M, int K) {
    int nb = (K + QK - 1) / QK;
    if (M < COLI_XT_MIN) return 0;
    if (fmt == COLI_Q4 || fmt == COLI_Q4A) return (nb + 3) / 4 * COLI_XE_Q4 * 64L;
    return 0; /* int8 weights take int16 activations (simd_q16.h), never these tiles */
}

/* xe (64-byte aligned, M rows of lde bytes) = the quantized activations of a, arranged for
 * the interleaved tiles of format fmt, Q4 or Q4A (see above). */
static inline void coli_expand_act(const coli_act *a, int M, int K, int fmt, int8_t *xe, long lde) {
    (void)fmt; /* the same arrangement for both */
    int nb = (K + QK - 1) / QK;
    const __m512i quad = coli_lane_groups(2);
    for (int i = 0; i < M; i++) {
        const int8_t *xq = a->q + i * a->ldq;
        const float *qd = a->qd + i * a->ldb;
        const int32_t *qs = a->qs + i * a->ldb;
        int8_t *o = xe + i * lde;
        for (int s = 0; s < (nb + 3) / 4; s++, o += COLI_XE_Q4 * 64) {
            /* 128-bit lane L: group 4s + L, its first 16 elements (xlo) or last 16 (xhi);
               past the last group, zeros */
            int n = nb - 4 * s < 4 ? nb - 4 * s : 4;
            __mmask16 gm = (__mmask16)((1u << n) - 1u);
            __m512i x01 = _mm512_maskz_loadu_epi8(n >= 2 ? ~0ull : 0xFFFFFFFFull, xq + s * 128);
            __m512i x23 = _mm512_maskz_loadu_epi8(n == 4 ? ~0ull : n == 3 ? 0xFFFFFFFFull : 0ull, xq + s * 128 + 64);
            __m512i xlo = _mm512_shuffle_i64x2(x01, x23, _MM_SHUFFLE(2, 0, 2, 0));
            __m512i xhi = _mm512_shuffle_i64x2(x01, x23, _MM_SHUFFLE(3, 1, 3, 1));
            _mm512_store_si512((void *)(o + 0 * 64), _mm512_shuffle_epi32(xlo, (_MM_PERM_ENUM)0x00));
            _mm512_store_si512((void *)(o + 1 * 64), _mm512_shuffle_epi32(xlo, (_MM_PERM_ENUM)0x55));
            _mm512_store_si512((void *)(o + 2 * 64), _mm512_shuffle_epi32(xlo, (_MM_PERM_ENUM)0xAA));
            _mm512_store_si512((void *)(o + 3 * 64), _mm512_shuffle_epi32(xlo, (_MM_PERM_ENUM)0xFF));
            _mm512_store_si512((void *)(o + 4 * 64), _mm512_shuffle_epi32(xhi, (_MM_PERM_ENUM)0x00));
            _mm512_store_si512((void *)(o + 5 * 64), _mm512_shuffle_epi32(xhi, (_MM_PERM_ENUM)0x55));
            _mm512_store_si512((void *)(o + 6 * 64), _mm512_shuffle_epi32(xhi, (_MM_PERM_ENUM)0xAA));
            _mm512_store_si512((void *)(o + 7 * 64), _mm512_shuffle_epi32(xhi, (_MM_PERM_ENUM)0xFF));
            __m512 xs = _mm512_permutexvar_ps(quad, _mm512_maskz_loadu_ps(gm, qd + 4 * s));
            __m512i sum = _mm512_permutexvar_epi32(quad, _mm512_maskz_loadu_epi32(gm, qs + 4 * s));
            _mm512_store_ps((float *)(o + 8 * 64), xs);
            _mm512_store_si512((void *)(o + 9 * 64), _mm512_slli_epi32(sum, 3));
            _mm512_store_ps((float *)(o + 10 * 64), _mm512_mul_ps(xs, _mm512_cvtepi32_ps(sum)));
        }
    }
}

/* The 4 rows' 64 bytes at byte offset off (only the bytes of mask bm when MASKED),
 * transposed by dwords in each 128-bit lane: T[p] lane (L, j) = dword p of row j's lane L. */
#define COLI_XT_LD(p, MASKED, bm) ((MASKED) ? _mm512_maskz_loadu_epi8((bm), (const void *)(p)) : _mm512_loadu_si512((const void *)(p)))
#define COLI_XT_LOAD4(T, wq, ldw, off, MASKED, bm)                                                 \
    do {                                                                                           \
        __m512i r0 = COLI_XT_LD((wq) + (off), MASKED, bm);                                         \
        __m512i r1 = COLI_XT_LD((wq) + (ldw) + (off), MASKED, bm);                                 \
        __m512i r2 = COLI_XT_LD((wq) + 2 * (ldw) + (off), MASKED, bm);                             \
        __m512i r3 = COLI_XT_LD((wq) + 3 * (ldw) + (off), MASKED, bm);                             \
        __m512i a01 = _mm512_unpacklo_epi32(r0, r1), b01 = _mm512_unpackhi_epi32(r0, r1);          \
        __m512i a23 = _mm512_unpacklo_epi32(r2, r3), b23 = _mm512_unpackhi_epi32(r2, r3);          \
        T[0] = _mm512_unpacklo_epi64(a01, a23);                                                    \
        T[1] = _mm512_unpackhi_epi64(a01, a23);                                                    \
        T[2] = _mm512_unpacklo_epi64(b01, b23);                                                    \
        T[3] = _mm512_unpackhi_epi64(b01, b23);                                                    \
    } while (0)

/* lanes (L, j) summed over L: the 4 rows' totals */
static inline __m128 coli_xt_rows(__m512 v) {
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_castps512_ps128(v);
}

/* The f16 values of groups g0 .. g0 + n - 1 (n <= 4; zeros after) of 4 rows as floats in
 * lane order (L, j): lane 4L + j = row j, group g0 + L. The rows are read with masked loads
 * (nothing past group g0 + n - 1 is touched): a short last step used to copy them through
 * the stack with a libc memcpy of variable size, whose store-to-load stall cost a 576-column
 * matrix a third of its one-token time. */
static inline __m512 coli_xt_scales4(const uint16_t *d, long ldd, int g0, int n) {
    const __m512i t = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0); /* 4j + L -> 4L + j */
    if (n == 4) { /* every step but a short last one (n is a constant there) */
        int64_t e[4];
        for (int j = 0; j < 4; j++) memcpy(&e[j], d + j * ldd + g0, 8);
        return _mm512_permutexvar_ps(t, _mm512_cvtph_ps(_mm256_set_epi64x(e[3], e[2], e[1], e[0])));
    }
    const __mmask8 m = (__mmask8)((1u << n) - 1u);
    __m128i r01 = _mm_unpacklo_epi64(_mm_maskz_loadu_epi16(m, d + g0), _mm_maskz_loadu_epi16(m, d + ldd + g0));
    __m128i r23 = _mm_unpacklo_epi64(_mm_maskz_loadu_epi16(m, d + 2 * ldd + g0), _mm_maskz_loadu_epi16(m, d + 3 * ldd + g0));
    return _mm512_permutexvar_ps(t, _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(r01), r23, 1)));
}
/* One step of the Q4 / Q4A interleaved tile: groups b .. b + n - 1 (n = 4, or fewer with
 * MASKED) of the 4 rows against every token's arranged activations. */
#define COLI_Q4XSTEP(MR, ASYM, MASKED, n)                                                          \
    {                                                                                              \
        __m512i T[4], w[8];                                                                        \
        if (!(MASKED))                                                                             \
            for (int j = 0; j < 4; j++)                                                            \
                _mm_prefetch((const char *)(wq + (4 + j) * ldw + b * 16), _MM_HINT_T0);            \
        COLI_XT_LOAD4(T, wq, ldw, b * 16, MASKED, (n) == 4 ? ~0ull : (1ull << (16 * (n))) - 1);    \
        for (int p = 0; p < 4; p++) {                                                              \
            w[p] = _mm512_and_si512(T[p], m4);                                                     \
            w[4 + p] = _mm512_and_si512(_mm512_srli_epi16(T[p], 4), m4);                           \
        }                                                                                          \
        __m512 ws = coli_xt_scales4(wd, ldd, b, n);                                                \
        __m512 wmn = ASYM ? coli_xt_scales4(wm, ldd, b, n) : ws;                                   \
        for (int i = 0; i < MR; i++) {                                                             \
            const int8_t *o = a->xe + i * a->lde + (b / 4) * (COLI_XE_Q4 * 64);                    \
            __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_load_si512((const void *)o)); \
            for (int p = 1; p < 8; p++)                                                            \
                d = _mm512_dpbusd_epi32(d, w[p], _mm512_load_si512((const void *)(o + p * 64)));   \
            if (!ASYM) d = _mm512_sub_epi32(d, _mm512_load_si512((const void *)(o + 9 * 64)));     \
            __m512 sc = _mm512_mul_ps(ws, _mm512_load_ps((const float *)(o + 8 * 64)));            \
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sc, acc[i]);                           \
            if (ASYM) acc[i] = _mm512_fmadd_ps(wmn, _mm512_load_ps((const float *)(o + 10 * 64)), acc[i]); \
        }                                                                                          \
    }

/* The end of an interleaved tile: each token's 4 row sums. */
#define COLI_XT_END(MR)                                                                            \
        for (int i = 0; i < MR; i++) {                                                             \
            float sums[4];                                                                         \
            _mm_storeu_ps(sums, coli_xt_rows(acc[i]));                                             \
            for (int j = 0; j < 4; j++) Y[i * ldy + j] = sums[j];                                  \
        }

/* Q4 (ASYM 0) / Q4A (ASYM 1): MR tokens x 4 rows, 4 groups per step, the last step masked
 * to the groups left. Q4's offset of 8 is taken off in the integers (8 * the group's sum,
 * from xe); Q4A's min adds m * scale * sum. */
#define COLI_Q4XTILE512(NAME, MR, ASYM)                                                            \
    static inline void NAME##_x##MR(const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                    long ldw, long ldd, int nb, float *Y, long ldy) {              \
        __m512 acc[MR];                                                                            \
        for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();                                 \
        const __m512i m4 = _mm512_set1_epi8(0x0F);                                                 \
        int b = 0;                                                                                 \
        for (; b + 4 <= nb; b += 4) COLI_Q4XSTEP(MR, ASYM, 0, 4)                                   \
        if (b < nb) COLI_Q4XSTEP(MR, ASYM, 1, nb - b)                                              \
        COLI_XT_END(MR)                                                                            \
    }

#define COLI_XTILES(NAME, ROLE)                                                                    \
    ROLE(NAME, 1) ROLE(NAME, 2) ROLE(NAME, 3) ROLE(NAME, 4) ROLE(NAME, 5) ROLE(NAME, 6) ROLE(NAME, 7) ROLE(NAME, 8) \
    static inline void NAME##_x(int mr, const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                long ldw, long ldd, int nb, float *Y, long ldy) {                  \
        switch (mr) {                                                                              \
        case 1: NAME##_x1(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break; /* same bits as in a batch */ \
        case 2: NAME##_x2(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                             \
        case 3: NAME##_x3(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                             \
        case 4: NAME##_x4(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                             \
        case 5: NAME##_x5(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                             \
        case 6: NAME##_x6(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                             \
        case 7: NAME##_x7(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                             \
        default: NAME##_x8(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                            \
        }                                                                                          \
    }
#define COLI_Q4X_SYM(NAME, MR) COLI_Q4XTILE512(NAME, MR, 0)
#define COLI_Q4X_ASYM(NAME, MR) COLI_Q4XTILE512(NAME, MR, 1)
COLI_XTILES(coli_q4tile, COLI_Q4X_SYM)
COLI_XTILES(coli_q4atile, COLI_Q4X_ASYM)
#else
static inline long coli_xe_ld(int fmt, int M, int K) { (void)fmt; (void)M; (void)K; return 0; }
static inline void coli_expand_act(const coli_act *a, int M, int K, int fmt, int8_t *xe, long lde) {
    (void)a; (void)M; (void)K; (void)fmt; (void)xe; (void)lde;
}
#endif

#endif /* COLI_SIMD_QX_H */
