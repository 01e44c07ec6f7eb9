/* Quantized and half-precision weight formats for coli._engine.kernels.
 *
 * Formats (chosen per tensor at load time; see docs/FORMAT.md):
 *   COLI_F32   float32 weights                       (N, K)
 *   COLI_BF16  bfloat16 weights, widened in registers (N, K) uint16
 *   COLI_Q8    int8 in groups of 32 along K, one float16 scale per group:
 *              q (N, Kp) int8 in [-127, 127], d (N, Kp/32) f16;  w = d * q
 *   COLI_Q4    int4 in groups of 32 along K, one float16 scale per group:
 *              q (N, Kp/2) uint8, d (N, Kp/32) f16;  w = d * (nibble - 8).
 *              Within a group's 16 bytes, byte i holds element i (low nibble)
 *              and element i + 16 (high nibble).                  (user-facing name: int4s)
 *   COLI_Q4A   int4 in groups of 32 along K with a float16 scale and a float16 min per
 *              group (asymmetric): q as COLI_Q4, d and m (N, Kp/32) f16;
 *              w = d * nibble + m. 5 bits per weight.             (user-facing name: int4)
 * Kp is K rounded up to 32; padding weights are 0.
 *
 * Q8 weights take int16 activations (simd_q16.h, coli_gemm_q16), never the tiles here.
 * For Q4 the activations are quantized on the fly to int8 groups of 32 with a
 * float scale (and, for Q4's offset, the group's integer sum), so a group's dot
 * product is one integer multiply-add of 32 pairs: AVX512-VNNI / AVX-VNNI
 * dpbusd where the CPU has it, AVX2 maddubs otherwise, on 64-bit ARM sdot / smmla or
 * smull (simd_q_neon.h), plain C as the fallback.
 */
#ifndef COLI_SIMD_Q_H
#define COLI_SIMD_Q_H

#include "simd.h"

#define QK 32
enum { COLI_F32 = 0, COLI_BF16 = 1, COLI_Q8 = 2, COLI_Q4 = 3, COLI_Q4A = 4 };

/* A weight matrix in any format, rows [0, N). */
typedef struct {
    int fmt;
    const void *w;      /* data: float / uint16 (bf16) / int8 / uint8 nibbles */
    const uint16_t *d;  /* f16 group scales (Q8, Q4, Q4A), else NULL */
    const uint16_t *m;  /* f16 group mins (Q4A), else NULL; laid out as d */
    long ldw;           /* elements of w per row (bytes for Q8/Q4) */
    long ldd;           /* scales per row */
    const uint8_t *pk;  /* Q4 / Q4A / Q8 repacked into 4-row tiles (simd_qx.h: coli_q4x_pack,
                           coli_q8x_pack), or NULL; w, d and m are then NULL */
    long pks;           /* bytes of pk per 4-row tile */
} coli_mat;

/* Activations for one GEMM: float rows, plus their int8 quantization for Q4/Q4A. */
typedef struct {
    const float *x;     /* (M, ldx) */
    const int8_t *q;    /* (M, ldq) int8, Kp columns */
    const float *qd;    /* (M, ldb) group scales */
    const int32_t *qs;  /* (M, ldb) group sums of q */
    long ldx, ldq, ldb;
    const int8_t *xe;   /* (M, lde) bytes: q expanded for the multi-token 512-bit tiles
                           (coli_expand_act), or NULL */
    long lde;
} coli_act;

#if defined(COLI_NEON)
/* One group of 32 floats loaded into v, and its |x| max ignoring NaN as the plain-C loops
 * do (fmaxnm): the NEON quantizers' common first step (int8 here, int16 in simd_q16.h). */
static inline float coli_group_amax_neon(const float *x, float32x4_t v[8]) {
    float32x4_t m = vdupq_n_f32(0.0f);
    for (int k = 0; k < 8; k++) v[k] = vld1q_f32(x + 4 * k), m = vmaxnmq_f32(m, vabsq_f32(v[k]));
    return vmaxnmvq_f32(m);
}
#endif

/* Quantize one row of K floats into Kp/32 int8 groups: q = round(x / d), d = max|x| / 127
 * (round half to even, as lrintf). Whole groups go 32 lanes at a time on AVX-512 and NEON
 * with the same float operations, so every path gives the same bytes. */
static inline void coli_quantize_row_q8(const float *x, int K, int8_t *q, float *d, int32_t *s) {
    int nb = (K + QK - 1) / QK, b = 0;
#if defined(__AVX512F__)
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (; b < K / QK; b++) {
        __m512 x0 = _mm512_loadu_ps(x + b * QK), x1 = _mm512_loadu_ps(x + b * QK + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(q + b * QK), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + b * QK + 16), _mm512_cvtepi32_epi8(q1));
        d[b] = amax / 127.0f;
        s[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
#elif defined(COLI_NEON) /* |x| max ignoring NaN as the loop below does (fmaxnm), fcvtns = lrintf */
    for (; b < K / QK; b++) {
        float32x4_t v[8];
        float amax = coli_group_amax_neon(x + b * QK, v);
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32x4_t qi[8], sum = vdupq_n_s32(0);
        for (int k = 0; k < 8; k++) qi[k] = vcvtnq_s32_f32(vmulq_n_f32(v[k], inv)), sum = vaddq_s32(sum, qi[k]);
        int16x8_t h[4];
        for (int k = 0; k < 4; k++) h[k] = vcombine_s16(vmovn_s32(qi[2 * k]), vmovn_s32(qi[2 * k + 1]));
        vst1q_s8(q + b * QK, vcombine_s8(vmovn_s16(h[0]), vmovn_s16(h[1])));
        vst1q_s8(q + b * QK + 16, vcombine_s8(vmovn_s16(h[2]), vmovn_s16(h[3])));
        d[b] = amax / 127.0f;
        s[b] = vaddvq_s32(sum);
    }
#endif
    for (; b < nb; b++) {
        int n = K - b * QK < QK ? K - b * QK : QK;
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < n; i++) { float a = fabsf(xb[i]); amax = a > amax ? a : amax; }
        float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < n; i++) { int v = (int)lrintf(xb[i] * inv); q[b * QK + i] = (int8_t)v; sum += v; }
        for (int i = n; i < QK; i++) q[b * QK + i] = 0;
        d[b] = scale;
        s[b] = sum;
    }
}

#if defined(__AVX512F__)
/* The four horizontal sums of a, b, c and d, in one 128-bit vector (fewer shuffles than
 * four separate reductions). */
static inline __m128 coli_hsum4_512(__m512 a, __m512 b, __m512 c, __m512 d) {
    /* 128-bit lanes: ab = (a0 + a2, a1 + a3, b0 + b2, b1 + b3), likewise cd */
    __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    /* lanes: (a, b, c, d), each still 4 partial sums */
    __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    /* sum within each 128-bit lane, then take element 0 of each */
    s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(2, 3, 0, 1)));
    s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                         12, 8, 4, 0), s));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define COLI_Q512 1
/* Rows ahead of a tile's first row that its steps prefetch (into L1): two 4-row tiles ahead,
 * ~2.9 KB of a 576-column int4 matrix, the distance that hides more of DRAM's latency in a
 * one-token GEMV than the next tile's rows (4: one-thread decode CPU time of SmolLM2-135M int4
 * ~15% lower under load; 16 and 32 were no better). The rows past a block's end are the same
 * thread's next block, mostly. */
#ifndef COLI_Q4_PFD
#define COLI_Q4_PFD 8
#endif

/* Lane l of a 16-float vector of group values: group c0 + 4 * s + (l >> 2) (Q4, step s of
 * a chunk) or c0 + 2 * s + (l >> 3) (Q8). */
static inline __m512i coli_lane_groups(int shift) {
    return _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), shift);
}

/* The end of a 512-bit tile: out = acc - cor, the NR row sums of each token in one
 * transpose-reduce, plus the groups left after the last full step (Q8: nb % 2, starting at
 * group b; the Q4 tiles leave none, their last step is masked) through the 256-bit tile;
 * RB: bytes of a row per group. */
#define COLI_QTILE512_END(NAME, MR, NR, RB)                                                               \
        for (int i = 0; i < MR; i++) {                                                             \
            __m512 r[4];                                                                           \
            float sums[4];                                                                         \
            for (int j = 0; j < 4; j++)                                                            \
                r[j] = j < NR ? _mm512_sub_ps(acc[i][j], cor[i][j]) : _mm512_setzero_ps();         \
            _mm_storeu_ps(sums, coli_hsum4_512(r[0], r[1], r[2], r[3]));                           \
            for (int j = 0; j < NR; j++) {                                                         \
                float s = sums[j];                                                                 \
                if (b < nb) {                                                                      \
                    coli_act one = *a;                                                             \
                    one.q += i * a->ldq + b * 32;                                                  \
                    one.qd += i * a->ldb + b;                                                      \
                    one.qs += i * a->ldb + b;                                                      \
                    float t;                                                                       \
                    NAME##_tail(&one, wq + j * ldw + b * (RB), wd + j * ldd + b, wm ? wm + j * ldd + b : NULL, ldw, ldd, nb - b, &t, 1); \
                    s += t;                                                                        \
                }                                                                                  \
                Y[i * ldy + j] = s;                                                                \
            }                                                                                      \
        }

/* The start of one chunk of a 512-bit tile (groups c0 .. c0 + cn, cn <= 16): the chunk's
 * weight scales (wsv) and activation scales (xsv) loaded once as vectors, and the weight
 * offset OFF (128 for Q8, 8 for Q4) times each group's activation sum and scales added to
 * cor, for the groups done STEP at a time; with one token its scales are folded into the
 * weights' here. ASYM (Q4A): the offset is the group's min instead, w = d * q + m, so cor
 * takes -m * (activation scale * sum) per group. */
#define COLI_QCHUNK512(MR, NR, STEP, OFF, ASYM)                                                    \
            int cn = nb - c0 < 16 ? nb - c0 : 16;                                                  \
            __mmask16 cm = (__mmask16)((1u << cn) - 1u);                                           \
            __mmask16 ce = (__mmask16)((1u << (cn & ~((STEP) - 1))) - 1u);                         \
            __m512 wsv[NR], xsv[MR];                                                               \
            for (int j = 0; j < NR; j++)                                                           \
                wsv[j] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(cm, wd + j * ldd + c0));        \
            __m512 csv[NR];                                                                        \
            for (int j = 0; j < NR; j++)                                                           \
                csv[j] = ASYM ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(cm, wm + j * ldd + c0)) : wsv[j]; \
            for (int i = 0; i < MR; i++) {                                                         \
                xsv[i] = _mm512_maskz_loadu_ps(cm, a->qd + i * a->ldb + c0);                       \
                __m512 xb = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(             \
                                              ce, a->qs + i * a->ldb + c0)), xsv[i]);              \
                xb = _mm512_mul_ps(xb, _mm512_set1_ps(OFF));                                       \
                for (int j = 0; j < NR; j++) cor[i][j] = _mm512_fmadd_ps(xb, csv[j], cor[i][j]);   \
            }                                                                                      \
            if (MR == 1)                                                                           \
                for (int j = 0; j < NR; j++) wsv[j] = _mm512_mul_ps(wsv[j], xsv[0]);

/* Q4 on AVX-512: four groups (128 weights, 64 bytes of a row) per step. In one 64-byte
 * load each 128-bit lane is one group's 16 bytes, so its low nibbles are that group's
 * elements 0-15 and its high nibbles elements 16-31: two ands and a shift unpack 128
 * weights, with no lane crossing. The activations are brought to the same order by two
 * 128-bit lane shuffles per step, shared by the tile's rows (xlo: the first half of each
 * of the four groups, xhi: the second halves), and both dpbusd go into one int32 vector
 * whose lane l belongs to group b + l / 4, scaled by that group's weight (and activation)
 * scale picked from the chunk's 16 scales. The offset of 8 is one correction per group,
 * -8 * sum(x) * scales, summed per chunk into cor and subtracted once at the end. */
/* One step of the Q4 tile: groups b .. b + 3, or with MASKED the n < 4 groups left (the
 * rest of the 4 read as zeros, weights and activations both). */
#define COLI_Q4STEP512(MR, NR, MASKED, n)                                                          \
    {                                                                                              \
        __m512i sel = _mm512_add_epi32(pat, _mm512_set1_epi32(b - c0));                            \
        __m512i lo[NR], hi[NR];                                                                    \
        __m512 ws[NR];                                                                             \
        if (!(MASKED))                                                                             \
            for (int j = 0; j < NR; j++)                                                           \
                _mm_prefetch((const char *)(wq + (COLI_Q4_PFD + j) * ldw + b * 16), _MM_HINT_T0);  \
        for (int j = 0; j < NR; j++) {                                                             \
            __m512i raw = (MASKED) ? _mm512_maskz_loadu_epi8((1ull << (16 * (n))) - 1, wq + j * ldw + b * 16) \
                                   : _mm512_loadu_si512((const void *)(wq + j * ldw + b * 16));    \
            lo[j] = _mm512_and_si512(raw, m4);                                                     \
            hi[j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);                               \
            ws[j] = _mm512_permutexvar_ps(sel, wsv[j]);                                            \
        }                                                                                          \
        for (int i = 0; i < MR; i++) {                                                             \
            const int8_t *xp = a->q + i * a->ldq + b * 32;                                         \
            __m512i x01 = (MASKED) ? _mm512_maskz_loadu_epi8((n) >= 2 ? ~0ull : 0xFFFFFFFFull, xp)  \
                                   : _mm512_loadu_si512((const void *)xp);                         \
            __m512i x23 = (MASKED) ? _mm512_maskz_loadu_epi8((n) == 3 ? 0xFFFFFFFFull : 0ull, xp + 64) \
                                   : _mm512_loadu_si512((const void *)(xp + 64));                  \
            __m512i xlo = _mm512_shuffle_i64x2(x01, x23, _MM_SHUFFLE(2, 0, 2, 0));                 \
            __m512i xhi = _mm512_shuffle_i64x2(x01, x23, _MM_SHUFFLE(3, 1, 3, 1));                 \
            __m512 xs = MR == 1 ? _mm512_set1_ps(1.0f) : _mm512_permutexvar_ps(sel, xsv[i]);       \
            for (int j = 0; j < NR; j++) {                                                         \
                __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[j], xlo);               \
                d = _mm512_dpbusd_epi32(d, hi[j], xhi);                                            \
                __m512 sc = MR == 1 ? ws[j] : _mm512_mul_ps(ws[j], xs);                            \
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sc, acc[i][j]);                 \
            }                                                                                      \
        }                                                                                          \
    }

/* The groups after the last whole step of 4 are one masked step (no per-row tail). */
#define COLI_Q4TILE512(NAME, MR, NR, ASYM)                                                              \
    static inline void NAME##_##MR##x##NR(const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                          long ldw, long ldd, int nb, float *Y, long ldy) {         \
        __m512 acc[MR][NR], cor[MR][NR];                                                           \
        for (int i = 0; i < MR; i++)                                                               \
            for (int j = 0; j < NR; j++) acc[i][j] = cor[i][j] = _mm512_setzero_ps();              \
        const __m512i pat = coli_lane_groups(2), m4 = _mm512_set1_epi8(0x0F);                      \
        int b = 0;                                                                                 \
        for (int c0 = 0; c0 < nb; c0 += 16) {                                                      \
            COLI_QCHUNK512(MR, NR, 1, (ASYM ? -1.0f : 8.0f), ASYM)                                 \
            for (b = c0; b + 4 <= c0 + cn; b += 4) COLI_Q4STEP512(MR, NR, 0, 4)                    \
            if (b < c0 + cn) {                                                                     \
                COLI_Q4STEP512(MR, NR, 1, c0 + cn - b)                                             \
                b = c0 + cn;                                                                       \
            }                                                                                      \
        }                                                                                          \
        COLI_QTILE512_END(NAME, MR, NR, 16)                                                          \
    }
#endif

#if defined(__AVX2__)
/* 8 int32 lanes of sum(u8 * s8) over 32 byte pairs. u must be at most 127 a byte (the
 * callers pass int4 nibbles): plain AVX2's maddubs saturates its int16 pair sums
 * (2 x 255 x 128 does not fit), where vpdpbusd would not, and the avx2 and avx2vnni paths
 * must give the same bits. */
static inline __m256i coli_dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline __m256i coli_unpack_q4(const uint8_t *p) {
    __m128i b = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}

static inline float coli_hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

/* sum over groups b < n of m[b] * (activation scale * activation sum)[b]: the min term of
 * the asymmetric int4 format (Q4A), 8 groups per step. */
static inline float coli_min_term256(const uint16_t *m, const float *qd, const int32_t *qs, int n) {
    int b = 0;
    float s = 0.0f;
#if defined(__F16C__)
    __m256 acc = _mm256_setzero_ps();
    for (; b + 8 <= n; b += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m + b))),
                              _mm256_mul_ps(_mm256_loadu_ps(qd + b), _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(qs + b)))),
                              acc);
    s = coli_hsum256(acc);
#endif
    for (; b < n; b++) s += coli_f16_to_f32(m[b]) * (qd[b] * (float)qs[b]);
    return s;
}

/* 8 int32 lanes of sum(u1 * s1) + sum(u2 * s2), u bytes at most 15 (int4 nibbles, so
 * that the int16 sums of maddubs cannot saturate on plain AVX2). */
static inline __m256i coli_dot2_u4s8(__m256i u1, __m256i s1, __m256i u2, __m256i s2) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u1, s1), u2, s2);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u1, s1), u2, s2);
#else
    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u1, s1), _mm256_maddubs_epi16(u2, s2));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}

/* Q4 on AVX2: two groups (one 32-byte load of a row) per step, one group per 128-bit lane,
 * so an and and a shift unpack 64 weights (low nibbles: elements 0-15 of each group, high
 * nibbles 16-31) and the activations are brought into the same order by two lane
 * permutes per token that all rows share; lanes 0-3 then belong to group b and 4-7 to
 * group b + 1, and each lane takes 2 * (group sum of x) off for the offset of 8. An odd
 * last group goes through the one-group tile. */
#define COLI_Q4TILE256(NAME, MR, NR, ASYM)                                                              \
    static inline void NAME##_##MR##x##NR(const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                          long ldw, long ldd, int nb, float *Y, long ldy) {         \
        __m256 acc[MR][NR];                                                                        \
        for (int i = 0; i < MR; i++)                                                               \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();                          \
        const __m256i m4 = _mm256_set1_epi8(0x0F);                                                 \
        int b = 0;                                                                                 \
        for (; b + 2 <= nb; b += 2) {                                                              \
            __m256i lo[NR], hi[NR];                                                                \
            __m256 ws[NR];                                                                         \
            for (int j = 0; j < NR; j++)                                                           \
                _mm_prefetch((const char *)(wq + (NR + j) * ldw + b * 16), _MM_HINT_T0);           \
            for (int j = 0; j < NR; j++) {                                                         \
                __m256i raw = _mm256_loadu_si256((const __m256i *)(wq + j * ldw + b * 16));        \
                lo[j] = _mm256_and_si256(raw, m4);                                                 \
                hi[j] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);                           \
                ws[j] = _mm256_set_m128(_mm_set1_ps(coli_f16_to_f32(wd[j * ldd + b + 1])),         \
                                        _mm_set1_ps(coli_f16_to_f32(wd[j * ldd + b])));            \
            }                                                                                      \
            for (int i = 0; i < MR; i++) {                                                         \
                const int8_t *xp = a->q + i * a->ldq + b * 32;                                     \
                __m256i x0 = _mm256_loadu_si256((const __m256i *)xp);                              \
                __m256i x1 = _mm256_loadu_si256((const __m256i *)(xp + 32));                       \
                __m256i xlo = _mm256_permute2x128_si256(x0, x1, 0x20);                             \
                __m256i xhi = _mm256_permute2x128_si256(x0, x1, 0x31);                             \
                const float *xd = a->qd + i * a->ldb + b;                                          \
                const int32_t *xs = a->qs + i * a->ldb + b;                                        \
                __m256 xsc = _mm256_set_m128(_mm_set1_ps(xd[1]), _mm_set1_ps(xd[0]));              \
                __m256i off = _mm256_set_m128i(_mm_set1_epi32(ASYM ? 0 : 2 * xs[1]),              \
                                               _mm_set1_epi32(ASYM ? 0 : 2 * xs[0]));              \
                for (int j = 0; j < NR; j++) {                                                     \
                    __m256i d = _mm256_sub_epi32(coli_dot2_u4s8(lo[j], xlo, hi[j], xhi), off);     \
                    acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(ws[j], xsc), acc[i][j]); \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < MR; i++)                                                               \
            for (int j = 0; j < NR; j++) {                                                         \
                float s = coli_hsum256(acc[i][j]);                                                 \
                if (ASYM) /* Q4A: the mins' term of the groups before b, in one vector pass */      \
                    s += coli_min_term256(wm + j * ldd, a->qd + i * a->ldb, a->qs + i * a->ldb, b); \
                if (b < nb) {                                                                      \
                    coli_act one = *a;                                                             \
                    one.q += i * a->ldq + b * 32;                                                  \
                    one.qd += i * a->ldb + b;                                                      \
                    one.qs += i * a->ldb + b;                                                      \
                    float t;                                                                       \
                    NAME##_tail(&one, wq + j * ldw + b * 16, wd + j * ldd + b, wm ? wm + j * ldd + b : NULL, ldw, ldd, nb - b, &t, 1); \
                    s += t;                                                                        \
                }                                                                                  \
                Y[i * ldy + j] = s;                                                                \
            }                                                                                      \
    }

#if defined(__F16C__)
#define COLI_Q4GEMV256_OK 1
/* The four row sums of a, b, c and d (four 8-lane accumulators) in one 128-bit vector. */
static inline __m128 coli_hsum4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* One token's chunk of up to 8 groups c0 .. c0 + cn for a Q4/Q4A GEMV on AVX2: the rows'
 * weight scales times the token's activation scales as 8-lane vectors sc[j] (lane g: group
 * c0 + g; lanes past cn are 0), and the group offsets added straight into the accumulators
 * acc[j], whose lanes are only ever summed: Q4 adds d * dx * (-8 * sum(x)) per group, Q4A
 * adds m * dx * sum(x). A short last chunk is read with masked loads (its lanes past cn are 0). */
#define COLI_Q4GEMV256_CHUNK(NR, ASYM)                                                             \
            __m256 sc[NR], dx, xo;                                                                 \
            if (cn == 8) {                                                                         \
                dx = _mm256_loadu_ps(a->qd + c0);                                                  \
                xo = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(a->qs + c0)));        \
                for (int j = 0; j < NR; j++) {                                                     \
                    sc[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + j * ldd + c0))); \
                    mn[j] = ASYM ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + j * ldd + c0))) \
                                 : _mm256_setzero_ps();                                            \
                }                                                                                  \
            } else {                                                                               \
                /* cn is even: the f16 scales of the chunk are cn / 2 whole dwords */             \
                const __m256i m8 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cn), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); \
                const __m128i m2 = _mm_cmpgt_epi32(_mm_set1_epi32(cn / 2), _mm_setr_epi32(0, 1, 2, 3)); \
                dx = _mm256_maskload_ps(a->qd + c0, m8);                                           \
                xo = _mm256_cvtepi32_ps(_mm256_maskload_epi32((const int *)(a->qs + c0), m8));     \
                for (int j = 0; j < NR; j++) {                                                     \
                    sc[j] = _mm256_cvtph_ps(_mm_maskload_epi32((const int *)(wd + j * ldd + c0), m2)); \
                    mn[j] = ASYM ? _mm256_cvtph_ps(_mm_maskload_epi32((const int *)(wm + j * ldd + c0), m2)) \
                                 : _mm256_setzero_ps();                                            \
                }                                                                                  \
            }                                                                                      \
            xo = ASYM ? _mm256_mul_ps(xo, dx) : _mm256_mul_ps(xo, _mm256_set1_ps(-8.0f));          \
            for (int j = 0; j < NR; j++) {                                                         \
                sc[j] = _mm256_mul_ps(sc[j], dx);                                                  \
                acc[j] = _mm256_fmadd_ps(ASYM ? mn[j] : sc[j], xo, acc[j]);                        \
            }

/* Q4/Q4A GEMV on AVX2 (one token, NR rows): the layout of COLI_Q4TILE256 (two groups per
 * 32-byte load, one per 128-bit lane; the activations brought to that order by two lane
 * permutes shared by the rows), with the scales handled 8 groups at a time: one f16
 * conversion per row and chunk gives the rows' scales times the token's (sc), and each
 * step picks its two groups' lanes out of them with one permute instead of converting and
 * broadcasting scalars; the offset of 8 (or the mins) leaves the integer loop (see
 * COLI_Q4GEMV256_CHUNK). The NR row sums reduce together; an odd last group goes through
 * the one-group tile. */
#define COLI_Q4GEMV256(NAME, NR, ASYM)                                                             \
    static inline void NAME##_1x##NR(const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                     long ldw, long ldd, int nb, float *Y, long ldy) {              \
        __m256 acc[NR], mn[NR];                                                                    \
        for (int j = 0; j < NR; j++) acc[j] = _mm256_setzero_ps();                                 \
        const __m256i m4 = _mm256_set1_epi8(0x0F);                                                 \
        const int ne = nb & ~1;                                                                    \
        for (int c0 = 0; c0 < ne; c0 += 8) {                                                       \
            const int cn = ne - c0 < 8 ? ne - c0 : 8;                                              \
            COLI_Q4GEMV256_CHUNK(NR, ASYM)                                                         \
            for (int s = 0; s < cn; s += 2) {                                                      \
                const int b = c0 + s;                                                              \
                const __m256i pick = _mm256_set_epi32(s + 1, s + 1, s + 1, s + 1, s, s, s, s);     \
                const int8_t *xp = a->q + b * 32;                                                  \
                __m256i x0 = _mm256_loadu_si256((const __m256i *)xp);                              \
                __m256i x1 = _mm256_loadu_si256((const __m256i *)(xp + 32));                       \
                __m256i xlo = _mm256_permute2x128_si256(x0, x1, 0x20);                             \
                __m256i xhi = _mm256_permute2x128_si256(x0, x1, 0x31);                             \
                for (int j = 0; j < NR; j++)                                                       \
                    _mm_prefetch((const char *)(wq + (NR + j) * ldw + b * 16), _MM_HINT_T0);       \
                for (int j = 0; j < NR; j++) {                                                     \
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(wq + j * ldw + b * 16));    \
                    __m256i d = coli_dot2_u4s8(_mm256_and_si256(raw, m4), xlo,                     \
                                               _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), xhi); \
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_permutevar8x32_ps(sc[j], pick), acc[j]); \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        float sums[4];                                                                             \
        __m256 z = _mm256_setzero_ps();                                                            \
        _mm_storeu_ps(sums, coli_hsum4_256(acc[0], NR > 1 ? acc[NR > 1 ? 1 : 0] : z,               \
                                           NR > 2 ? acc[NR > 2 ? 2 : 0] : z, NR > 3 ? acc[NR > 3 ? 3 : 0] : z)); \
        for (int j = 0; j < NR; j++) {                                                             \
            float s = sums[j];                                                                     \
            if (ne < nb) {                                                                         \
                coli_act one = *a;                                                                 \
                one.q += ne * 32;                                                                  \
                one.qd += ne;                                                                      \
                one.qs += ne;                                                                      \
                float t;                                                                           \
                NAME##_tail(&one, wq + j * ldw + ne * 16, wd + j * ldd + ne, wm ? wm + j * ldd + ne : NULL, ldw, ldd, nb - ne, &t, 1); \
                s += t;                                                                            \
            }                                                                                      \
            Y[j] = s;                                                                              \
        }                                                                                          \
        (void)ldy;                                                                                 \
    }
#endif

/* MR tokens x NR rows of a quantized GEMM; IS4: 1 Q4, 2 Q4A (asymmetric: its mins
 * times the groups' activation sums added as floats, in ca). */
#define COLI_QTILE(NAME, IS4, MR, NR)                                                              \
    static inline void NAME##_##MR##x##NR(const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                          long ldw, long ldd, int nb, float *Y, long ldy) {         \
        __m256 acc[MR][NR];                                                                        \
        float ca[MR][NR];                                                                          \
        for (int i = 0; i < MR; i++)                                                               \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps(), ca[i][j] = 0.0f;         \
        for (int b = 0; b < nb; b++) {                                                             \
            __m256i w[NR];                                                                         \
            float dw[NR];                                                                          \
            for (int j = 0; j < NR; j++) /* the next tile's rows arrive while this one computes */ \
                _mm_prefetch((const char *)(wq + (NR + j) * ldw + b * 16), _MM_HINT_T0);           \
            for (int j = 0; j < NR; j++) {                                                         \
                w[j] = coli_unpack_q4(wq + j * ldw + b * 16);                                      \
                dw[j] = coli_f16_to_f32(wd[j * ldd + b]);                                          \
            }                                                                                      \
            for (int i = 0; i < MR; i++) {                                                         \
                __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + i * a->ldq + b * 32));     \
                float dx = a->qd[i * a->ldb + b];                                                  \
                __m256i bs = _mm256_set1_epi32(IS4 == 1 ? a->qs[i * a->ldb + b] : 0);              \
                for (int j = 0; j < NR; j++) {                                                     \
                    __m256i d = _mm256_sub_epi32(coli_dot_u8s8(w[j], x), bs);                      \
                    acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(dw[j] * dx), \
                                                acc[i][j]);                                        \
                    if (IS4 == 2)                                                                  \
                        ca[i][j] += coli_f16_to_f32(wm[j * ldd + b]) * (dx * (float)a->qs[i * a->ldb + b]); \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < MR; i++)                                                               \
            for (int j = 0; j < NR; j++) Y[i * ldy + j] = coli_hsum256(acc[i][j]) + ca[i][j];      \
    }
#elif defined(COLI_NEON)
#include "simd_q_neon.h"
#endif
/* Plain C: the fallback tile, same arithmetic one pair at a time. */
#define COLI_QTILE_C(NAME, IS4, MR, NR)                                                            \
    static inline void NAME##_##MR##x##NR(const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                          long ldw, long ldd, int nb, float *Y, long ldy) {         \
        for (int i = 0; i < MR; i++)                                                               \
            for (int j = 0; j < NR; j++) {                                                         \
                float acc = 0.0f;                                                                  \
                for (int b = 0; b < nb; b++) {                                                     \
                    const int8_t *x = a->q + i * a->ldq + b * 32;                                  \
                    int32_t dot = 0;                                                               \
                    for (int t = 0; t < 32; t++) {                                                 \
                        int wv = (t < 16 ? (wq[j * ldw + b * 16 + t] & 15)                         \
                                         : (wq[j * ldw + b * 16 + t - 16] >> 4)) - (IS4 == 1 ? 8 : 0); \
                        dot += wv * x[t];                                                          \
                    }                                                                              \
                    acc += (float)dot * (coli_f16_to_f32(wd[j * ldd + b]) * a->qd[i * a->ldb + b]); \
                    if (IS4 == 2)                                                                  \
                        acc += coli_f16_to_f32(wm[j * ldd + b]) * (a->qd[i * a->ldb + b] * (float)a->qs[i * a->ldb + b]); \
                }                                                                                  \
                Y[i * ldy + j] = acc;                                                              \
            }                                                                                      \
    }
#if !defined(COLI_QTILE)
#define COLI_QTILE(NAME, IS4, MR, NR) COLI_QTILE_C(NAME, IS4, MR, NR)
#endif

/* Which tile computes a block: COLI_QTILE_MAIN(NAME, IS4, MR, NR) defines NAME_MRxNR, and
 * NAME_tail is the one-group-at-a-time tile the wide ones hand their last groups to. */
#if defined(COLI_Q512)
#define COLI_QTILE_MAIN(NAME, IS4, MR, NR) COLI_QTILE512_##IS4(NAME, MR, NR)
#define COLI_QTILE512_1(NAME, MR, NR) COLI_Q4TILE512(NAME, MR, NR, 0)
#define COLI_QTILE512_2(NAME, MR, NR) COLI_Q4TILE512(NAME, MR, NR, 1)
#elif defined(__AVX2__)
#define COLI_QTILE_MAIN(NAME, IS4, MR, NR) COLI_QTILE256_##IS4(NAME, MR, NR)
#if defined(COLI_Q4GEMV256_OK) /* COLI_Q4GEMV256 per token (and coli_q4gemm8 from 6 tokens) */
#define COLI_QTILE256_1(NAME, MR, NR) COLI_Q4TILE256_##MR(NAME, NR, 0)
#define COLI_QTILE256_2(NAME, MR, NR) COLI_Q4TILE256_##MR(NAME, NR, 1)
#define COLI_Q4TILE256_1(NAME, NR, ASYM) COLI_Q4GEMV256(NAME, NR, ASYM)
/* 2-4 tokens (below the GEMM's threshold): the GEMV tile once per token, the tile's rows
 * then in L1 for the next token (as fast as a shared-unpack tile whose MR x NR accumulators
 * spill out of AVX2's 16 registers, and faster at 2-3 tokens). */
#define COLI_Q4TILE256_MR(NAME, MR, NR)                                                           \
    static inline void NAME##_##MR##x##NR(const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                          long ldw, long ldd, int nb, float *Y, long ldy) {         \
        for (int i = 0; i < MR; i++) {                                                             \
            coli_act one = *a;                                                                     \
            one.q += i * a->ldq, one.qd += i * a->ldb, one.qs += i * a->ldb;                       \
            NAME##_1x##NR(&one, wq, wd, wm, ldw, ldd, nb, Y + i * ldy, ldy);                        \
        }                                                                                          \
    }
#define COLI_Q4TILE256_2(NAME, NR, ASYM) COLI_Q4TILE256_MR(NAME, 2, NR)
#define COLI_Q4TILE256_3(NAME, NR, ASYM) COLI_Q4TILE256_MR(NAME, 3, NR)
#define COLI_Q4TILE256_4(NAME, NR, ASYM) COLI_Q4TILE256_MR(NAME, 4, NR)
#else
#define COLI_QTILE256_1(NAME, MR, NR) COLI_Q4TILE256(NAME, MR, NR, 0)
#define COLI_QTILE256_2(NAME, MR, NR) COLI_Q4TILE256(NAME, MR, NR, 1)
#endif
#else
#define COLI_QTILE_MAIN(NAME, IS4, MR, NR) COLI_QTILE(NAME, IS4, MR, NR)
#endif
#if defined(__AVX2__)
#define COLI_QTILE_TAIL(NAME, IS4) COLI_QTILE(NAME##_t, IS4, 1, 1)                                 \
    static inline void NAME##_tail(const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                   long ldw, long ldd, int nb, float *Y, long ldy) {                \
        NAME##_t_1x1(a, wq, wd, wm, ldw, ldd, nb, Y, ldy);                                             \
    }
#else
#define COLI_QTILE_TAIL(NAME, IS4)
#endif

#define COLI_QTILES(NAME, IS4)                                                                     \
    COLI_QTILE_TAIL(NAME, IS4)                                                                     \
    COLI_QTILE_MAIN(NAME, IS4, 1, 1) COLI_QTILE_MAIN(NAME, IS4, 1, 2) COLI_QTILE_MAIN(NAME, IS4, 1, 3) \
    COLI_QTILE_MAIN(NAME, IS4, 1, 4) COLI_QTILE_MAIN(NAME, IS4, 2, 1) COLI_QTILE_MAIN(NAME, IS4, 2, 2) \
    COLI_QTILE_MAIN(NAME, IS4, 2, 3) COLI_QTILE_MAIN(NAME, IS4, 2, 4) COLI_QTILE_MAIN(NAME, IS4, 3, 1) \
    COLI_QTILE_MAIN(NAME, IS4, 3, 2) COLI_QTILE_MAIN(NAME, IS4, 3, 3) COLI_QTILE_MAIN(NAME, IS4, 3, 4) \
    COLI_QTILE_MAIN(NAME, IS4, 4, 1) COLI_QTILE_MAIN(NAME, IS4, 4, 2) COLI_QTILE_MAIN(NAME, IS4, 4, 3) \
    COLI_QTILE_MAIN(NAME, IS4, 4, 4)                                                               \
    static inline void NAME(int mr, int nr, const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                            long ldw, long ldd, int nb, float *Y, long ldy) {                       \
        switch (mr * 8 + nr) {                                                                     \
        case 9: NAME##_1x1(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                                \
        case 10: NAME##_1x2(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                               \
        case 11: NAME##_1x3(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                               \
        case 12: NAME##_1x4(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                               \
        case 17: NAME##_2x1(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                               \
        case 18: NAME##_2x2(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                               \
        case 19: NAME##_2x3(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                               \
        case 20: NAME##_2x4(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                               \
        case 25: NAME##_3x1(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                               \
        case 26: NAME##_3x2(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                               \
        case 27: NAME##_3x3(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                               \
        case 28: NAME##_3x4(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                               \
        case 33: NAME##_4x1(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                               \
        case 34: NAME##_4x2(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                               \
        case 35: NAME##_4x3(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                               \
        default: NAME##_4x4(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                               \
        }                                                                                          \
    }

COLI_QTILES(coli_q4tile, 1)
COLI_QTILES(coli_q4atile, 2)

#if defined(__AVX2__) && defined(__F16C__) && !defined(COLI_Q512)
#define COLI_Q4GEMM8_OK 1
#define COLI_Q4GEMM8_KC 16  /* groups of a K chunk */
#define COLI_Q4GEMM8_TB 4   /* blocks of 8 tokens whose activations one chunk holds: 16 KB */
#define COLI_Q4GEMM8_NR 64  /* rows whose accumulators stay in one stack block */
#ifndef COLI_Q4GEMM8_MIN
/* fewer tokens: each token through the one-token tile. The token-lane GEMM sums in another
 * order, so below this a token gets the same bits alone, in a batch or in a speculative
 * verification (up to 17 tokens a sequence); prefill chunks take the GEMM. */
#define COLI_Q4GEMM8_MIN 64
#endif
#ifndef COLI_Q4GEMM8_FEW
/* a MoE expert's tokens in a call of COLI_Q4GEMM8_MIN or more (prefill): from this many on the
 * GEMM (one block of 8 token lanes) beats the one-token tile once per token */
#define COLI_Q4GEMM8_FEW 6
#endif

/* The activations of 8 tokens (q rows t0 .. t0 + 7; rows past nt are zeros) for groups
 * c0 .. c0 + cn, interleaved by 4-byte pieces: xb[(g * 8 + k) * 32 + 4 * t ..] holds token
 * t's elements 4k .. 4k + 3 of group c0 + g, so one 32-byte load gives the same 4 elements
 * of all 8 tokens (an 8 x 8 transpose of dwords per group). dx[g * 8 + t]: the token's
 * group scale; xo[g * 8 + t]: 8 * its group sum (Q4's offset, as int32) or scale * sum
 * (Q4A's mins, as float). */
/* o[8 * g + t] = lane g of r[t] (an 8 x 8 transpose of floats) */
static inline void coli_t8x8_ps(const __m256 r[8], float *o) {
    __m256 a0 = _mm256_unpacklo_ps(r[0], r[1]), a1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 a2 = _mm256_unpacklo_ps(r[2], r[3]), a3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 a4 = _mm256_unpacklo_ps(r[4], r[5]), a5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 a6 = _mm256_unpacklo_ps(r[6], r[7]), a7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
    __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
    __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
    __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
    _mm256_store_ps(o + 0, _mm256_permute2f128_ps(b0, b4, 0x20));
    _mm256_store_ps(o + 8, _mm256_permute2f128_ps(b1, b5, 0x20));
    _mm256_store_ps(o + 16, _mm256_permute2f128_ps(b2, b6, 0x20));
    _mm256_store_ps(o + 24, _mm256_permute2f128_ps(b3, b7, 0x20));
    _mm256_store_ps(o + 32, _mm256_permute2f128_ps(b0, b4, 0x31));
    _mm256_store_ps(o + 40, _mm256_permute2f128_ps(b1, b5, 0x31));
    _mm256_store_ps(o + 48, _mm256_permute2f128_ps(b2, b6, 0x31));
    _mm256_store_ps(o + 56, _mm256_permute2f128_ps(b3, b7, 0x31));
}

static inline void coli_q4gemm8_acts(const coli_act *a, int t0, int nt, int c0, int cn, int asym, int8_t *xb,
                                     float *dx, int32_t *xo) {
    for (int g0 = 0; g0 < cn; g0 += 8) { /* the scales and offsets of 8 groups, transposed */
        const __m256i gm = _mm256_cmpgt_epi32(_mm256_set1_epi32(cn - g0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 d[8], o[8];
        for (int t = 0; t < 8; t++) {
            __m256i sum = _mm256_setzero_si256();
            d[t] = _mm256_setzero_ps();
            if (t < nt) {
                d[t] = _mm256_maskload_ps(a->qd + (long)(t0 + t) * a->ldb + c0 + g0, gm);
                sum = _mm256_maskload_epi32((const int *)(a->qs + (long)(t0 + t) * a->ldb + c0 + g0), gm);
            }
            o[t] = asym ? _mm256_mul_ps(d[t], _mm256_cvtepi32_ps(sum)) : _mm256_castsi256_ps(_mm256_slli_epi32(sum, 3));
        }
        coli_t8x8_ps(d, dx + g0 * 8);
        coli_t8x8_ps(o, (float *)(xo + g0 * 8));
    }
    for (int g = 0; g < cn; g++) { /* the 8 tokens' 4-byte pieces of group g, interleaved */
        __m256 r[8];
        for (int t = 0; t < 8; t++) {
            const int8_t *src = a->q + (long)(t0 + t) * a->ldq + (long)(c0 + g) * 32;
            r[t] = _mm256_castsi256_ps(t < nt ? _mm256_loadu_si256((const __m256i *)src) : _mm256_setzero_si256());
        }
        coli_t8x8_ps(r, (float *)(xb + g * 256)); /* dword moves only: the bytes as they are */
    }
}

/* 4 rows x 8 tokens over cn groups: acc[r] (lane t: token t) += the rows' group dots with
 * the token block's interleaved activations xb (coli_q4gemm8_acts), times the scales. wb:
 * the 4 rows' unpacked nibbles (row r, group g at wb + (r * KC + g) * 32, element order),
 * ws / wmn: their scales / mins as floats (row r, group g at [r * KC + g]). */
static inline void coli_q4gemm8_4x8(const int8_t *xb, const float *dxb, const int32_t *xob, int cn, int asym,
                                    const uint8_t *wb, const float *ws, const float *wmn, __m256 acc[4]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int g = 0; g < cn; g++) {
        const __m256i *xg = (const __m256i *)(xb + g * 256);
        __m256 dx = _mm256_load_ps(dxb + g * 8);
        __m256i xo = _mm256_load_si256((const __m256i *)(xob + g * 8));
        for (int r = 0; r < 4; r++) {
            const int32_t *wp = (const int32_t *)(wb + (r * COLI_Q4GEMM8_KC + g) * 32);
#if defined(__AVXVNNI__) /* vpdpbusd: the same exact sums in int32 */
            __m256i d = _mm256_setzero_si256();
            (void)ones;
            for (int k = 0; k < 8; k++) d = _mm256_dpbusd_avx_epi32(d, _mm256_set1_epi32(wp[k]), _mm256_load_si256(xg + k));
#else
            /* two int16 chains of 4 maddubs: at most 8 products of 15 x 127 per lane each */
            __m256i s0 = _mm256_maddubs_epi16(_mm256_set1_epi32(wp[0]), _mm256_load_si256(xg + 0));
            __m256i s1 = _mm256_maddubs_epi16(_mm256_set1_epi32(wp[1]), _mm256_load_si256(xg + 1));
            s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_set1_epi32(wp[2]), _mm256_load_si256(xg + 2)));
            s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_set1_epi32(wp[3]), _mm256_load_si256(xg + 3)));
            s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_set1_epi32(wp[4]), _mm256_load_si256(xg + 4)));
            s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_set1_epi32(wp[5]), _mm256_load_si256(xg + 5)));
            s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(_mm256_set1_epi32(wp[6]), _mm256_load_si256(xg + 6)));
            s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(_mm256_set1_epi32(wp[7]), _mm256_load_si256(xg + 7)));
            /* and one int16 sum of both: 16 products of at most 15 x 127 per lane, < 2^15 */
            __m256i d = _mm256_madd_epi16(_mm256_add_epi16(s0, s1), ones);
#endif
            if (!asym) d = _mm256_sub_epi32(d, xo);
            __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(d), dx);
            acc[r] = _mm256_fmadd_ps(f, _mm256_broadcast_ss(ws + r * COLI_Q4GEMM8_KC + g), acc[r]);
            if (asym)
                acc[r] = _mm256_fmadd_ps(_mm256_castsi256_ps(xo), _mm256_broadcast_ss(wmn + r * COLI_Q4GEMM8_KC + g),
                                         acc[r]);
        }
    }
}

/* Q4/Q4A GEMM on AVX2 for several tokens: Y[m, r] = act row m . W row r for m < M, r < N.
 * The tokens go 8 at a time, one per 32-bit lane: their activations interleaved by
 * coli_q4gemm8_acts (up to COLI_Q4GEMM8_TB blocks per K chunk), 4 rows' groups unpacked
 * once per chunk (16 bytes into 32 nibble bytes, in element order) for all those token
 * blocks, and each 4-byte piece of a row broadcast against the 8 tokens' same 4 elements,
 * so maddubs, int16 adds and one madd give a group's dot product for 8 tokens with no
 * horizontal sums; a scale per token and one per row then make it float. */
#if defined(__FMA__) /* (simd_qx.h's AVX2 packed tiles; a path without them never packs) */
static inline void coli_q4x_rows4(const uint8_t *tile, int fmt, int nb, int c0, int cn, int kc, uint8_t *wb,
                                  float *ws, float *wmn);
#endif

static inline void coli_q4gemm8(const coli_act *a, int M, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm,
                                long ldw, long ldd, int nb, int N, float *Y, long ldy, const coli_mat *P) {
    enum { KC = COLI_Q4GEMM8_KC, TB = COLI_Q4GEMM8_TB, NR = COLI_Q4GEMM8_NR };
    _Alignas(64) int8_t xb[TB][KC * 256];
    _Alignas(64) float dxb[TB][KC * 8];
    _Alignas(64) int32_t xob[TB][KC * 8];
    _Alignas(64) float accb[NR / 4][TB][4 * 8];
    _Alignas(64) uint8_t wb[4 * KC * 32];
    _Alignas(64) float ws[4 * KC], wmn[4 * KC];
    const int asym = P != NULL ? P->fmt == COLI_Q4A : wm != NULL;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    for (int n0 = 0; n0 < N; n0 += NR) {
        int nr = N - n0 < NR ? N - n0 : NR;
        for (int T0 = 0; T0 < M; T0 += 8 * TB) {
            int ntb = (M - T0 + 7) / 8 < TB ? (M - T0 + 7) / 8 : TB;
            for (int c0 = 0; c0 < nb; c0 += KC) {
                int cn = nb - c0 < KC ? nb - c0 : KC;
                for (int tb = 0; tb < ntb; tb++) {
                    int t0 = T0 + 8 * tb, nt = M - t0 < 8 ? M - t0 : 8;
                    coli_q4gemm8_acts(a, t0, nt, c0, cn, asym, xb[tb], dxb[tb], xob[tb]);
                }
                for (int r0 = 0; r0 < nr; r0 += 4) {
#if defined(__FMA__)
                    if (P != NULL) /* a packed tile: its 4 rows' groups by one transpose per step */
                        coli_q4x_rows4(P->pk + ((n0 + r0) / 4) * P->pks, P->fmt, nb, c0, cn, KC, wb, ws, wmn);
#endif
                    for (int r = 0; r < 4 && P == NULL; r++) { /* rows past nr repeat the last one; dropped below */
                        long row = n0 + (r0 + r < nr ? r0 + r : nr - 1);
                        const uint8_t *wr = wq + row * ldw + (long)c0 * 16;
                        for (int g = 0; g < cn; g++) {
                            __m128i raw = _mm_loadu_si128((const __m128i *)(wr + g * 16));
                            _mm_store_si128((__m128i *)(wb + (r * KC + g) * 32), _mm_and_si128(raw, m4));
                            _mm_store_si128((__m128i *)(wb + (r * KC + g) * 32 + 16),
                                            _mm_and_si128(_mm_srli_epi16(raw, 4), m4));
                            ws[r * KC + g] = coli_f16_to_f32(wd[row * ldd + c0 + g]);
                            wmn[r * KC + g] = asym ? coli_f16_to_f32(wm[row * ldd + c0 + g]) : 0.0f;
                        }
                    }
                    for (int tb = 0; tb < ntb; tb++) {
                        float *ab = accb[r0 / 4][tb];
                        __m256 acc[4];
                        for (int r = 0; r < 4; r++) acc[r] = c0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(ab + r * 8);
                        coli_q4gemm8_4x8(xb[tb], dxb[tb], xob[tb], cn, asym, wb, ws, wmn, acc);
                        for (int r = 0; r < 4; r++) _mm256_store_ps(ab + r * 8, acc[r]);
                    }
                }
            }
            for (int tb = 0; tb < ntb; tb++) {
                int t0 = T0 + 8 * tb, nt = M - t0 < 8 ? M - t0 : 8;
                for (int t = 0; t < nt; t++)
                    for (int r = 0; r < nr; r++) Y[(long)(t0 + t) * ldy + n0 + r] = accb[r / 4][tb][(r % 4) * 8 + t];
            }
        }
    }
}
#endif
#include "simd_qx.h" /* the multi-token tiles (AVX-512 VNNI) */

/* ---- bf16 weights ----------------------------------------------------------------------
 * bf16 is the top half of an f32, so widening is a zero-extend and a shift: no AVX512-BF16
 * needed. Few tokens (decode): the f32 4 x 4 dot-product tiles with the weight vectors
 * widened as they are loaded. Many tokens (prefill): the f32 token-panel GEMM, with blocks
 * of COLI_WR rows x COLI_BF16_KC columns widened once into an L1 buffer and then used by
 * up to COLI_BF16_PANELS token panels (the accumulators of each panel kept in a small
 * buffer between column chunks), so the widening costs ~1/COLI_BF16_PANELS of an f32 pass
 * while the weights stay bf16 in memory. Sums run in the same order as the f32 kernels on
 * the widened weights, so results equal theirs bit for bit. */
static inline float coli_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#if defined(__AVX512F__)
static inline cv_t cv_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#elif defined(__AVX2__)
static inline cv_t cv_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#elif defined(COLI_NEON)
static inline cv_t cv_load_bf16(const uint16_t *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
#else
static inline cv_t cv_load_bf16(const uint16_t *p) { return coli_bf16_to_f32(*p); }
#endif

/* out[:n] = the bf16 w[:n] as f32 */
static inline void coli_widen_bf16(const uint16_t *w, int n, float *out) {
    int k = 0;
    for (; k + CV_W <= n; k += CV_W) cv_store(out + k, cv_load_bf16(w + k));
    for (; k < n; k++) out[k] = coli_bf16_to_f32(w[k]);
}

#define COLI_BTILE(MR, NR) COLI_TILE_OF(coli_btile, uint16_t, cv_load_bf16, coli_bf16_to_f32, MR, NR)
COLI_BTILE(1, 1) COLI_BTILE(1, 2) COLI_BTILE(1, 3) COLI_BTILE(1, 4)
COLI_BTILE(2, 1) COLI_BTILE(2, 2) COLI_BTILE(2, 3) COLI_BTILE(2, 4)
COLI_BTILE(3, 1) COLI_BTILE(3, 2) COLI_BTILE(3, 3) COLI_BTILE(3, 4)
COLI_BTILE(4, 1) COLI_BTILE(4, 2) COLI_BTILE(4, 3) COLI_BTILE(4, 4)

/* bf16 weights x f32 activations, few tokens: Y[m, n] = X[m] . W[n] (4 x 4 tiles). */
static inline void coli_gemm_bf16(const float *X, long ldx, int M, const uint16_t *W, long ldw, int N,
                                  int K, float *Y, long ldy) {
    for (int n = 0; n < N; n += 4) {
        int nr = N - n < 4 ? N - n : 4;
        for (int m = 0; m < M; m += 4) {
            int mr = M - m < 4 ? M - m : 4;
            const float *x = X + m * ldx;
            const uint16_t *w = W + n * ldw;
            float *y = Y + m * ldy + n;
            switch (mr * 8 + nr) {
            case 9: coli_btile_1x1(x, ldx, w, ldw, K, y, ldy); break;
            case 10: coli_btile_1x2(x, ldx, w, ldw, K, y, ldy); break;
            case 11: coli_btile_1x3(x, ldx, w, ldw, K, y, ldy); break;
            case 12: coli_btile_1x4(x, ldx, w, ldw, K, y, ldy); break;
            case 17: coli_btile_2x1(x, ldx, w, ldw, K, y, ldy); break;
            case 18: coli_btile_2x2(x, ldx, w, ldw, K, y, ldy); break;
            case 19: coli_btile_2x3(x, ldx, w, ldw, K, y, ldy); break;
            case 20: coli_btile_2x4(x, ldx, w, ldw, K, y, ldy); break;
            case 25: coli_btile_3x1(x, ldx, w, ldw, K, y, ldy); break;
            case 26: coli_btile_3x2(x, ldx, w, ldw, K, y, ldy); break;
            case 27: coli_btile_3x3(x, ldx, w, ldw, K, y, ldy); break;
            case 28: coli_btile_3x4(x, ldx, w, ldw, K, y, ldy); break;
            case 33: coli_btile_4x1(x, ldx, w, ldw, K, y, ldy); break;
            case 34: coli_btile_4x2(x, ldx, w, ldw, K, y, ldy); break;
            case 35: coli_btile_4x3(x, ldx, w, ldw, K, y, ldy); break;
            default: coli_btile_4x4(x, ldx, w, ldw, K, y, ldy); break;
            }
        }
    }
}

#define COLI_BF16_KC 256    /* columns of a widened weight block */
#define COLI_BF16_PANELS 8  /* token panels that share one widened block */

/* A[i][0:NP] (+)= W[i] . P over the K columns of one chunk: the f32 panel tile, with its
 * accumulators in A (not read when first). */
#define COLI_RTILE_ACC(WR)                                                                         \
    static inline void coli_rtile_acc_##WR(const float *W, long ldw, const float *P, int K, float *A, \
                                           int first) {                                            \
        cv_t a0[WR], a1[WR];                                                                       \
        for (int i = 0; i < WR; i++) {                                                             \
            a0[i] = first ? cv_zero() : cv_load(A + i * COLI_NP);                                  \
            a1[i] = first ? cv_zero() : cv_load(A + i * COLI_NP + CV_W);                           \
        }                                                                                          \
        COLI_RTILE_PANEL(WR)                                                                       \
        for (int i = 0; i < WR; i++) {                                                             \
            cv_store(A + i * COLI_NP, a0[i]);                                                      \
            cv_store(A + i * COLI_NP + CV_W, a1[i]);                                               \
        }                                                                                          \
    }
COLI_RTILE_ACC(1) COLI_RTILE_ACC(2) COLI_RTILE_ACC(3) COLI_RTILE_ACC(4) COLI_RTILE_ACC(5) COLI_RTILE_ACC(6)
#if COLI_WR == 8
COLI_RTILE_ACC(7) COLI_RTILE_ACC(8)
#endif

static inline void coli_rtile_acc(int wr, const float *W, long ldw, const float *P, int K, float *A, int first) {
    switch (wr) {
    case 1: coli_rtile_acc_1(W, ldw, P, K, A, first); break;
    case 2: coli_rtile_acc_2(W, ldw, P, K, A, first); break;
    case 3: coli_rtile_acc_3(W, ldw, P, K, A, first); break;
    case 4: coli_rtile_acc_4(W, ldw, P, K, A, first); break;
    case 5: coli_rtile_acc_5(W, ldw, P, K, A, first); break;
#if COLI_WR == 8
    case 6: coli_rtile_acc_6(W, ldw, P, K, A, first); break;
    case 7: coli_rtile_acc_7(W, ldw, P, K, A, first); break;
    default: coli_rtile_acc_8(W, ldw, P, K, A, first); break;
#else
    default: coli_rtile_acc_6(W, ldw, P, K, A, first); break;
#endif
    }
}

/* Y[m, 0:nb] = X[m] . W[0:nb] for all m < M, bf16 W, X packed into token panels P (as
 * coli_gemm_tokens). */
static inline void coli_gemm_tokens_bf16(const float *P, int M, const uint16_t *W, long ldw, int nb, int K,
                                         float *Y, long ldy) {
    _Alignas(64) float wbuf[COLI_WR * COLI_BF16_KC];
    _Alignas(64) float acc[COLI_BF16_PANELS][COLI_WR * COLI_NP];
    int npan = (M + COLI_NP - 1) / COLI_NP;
    for (int n = 0; n < nb; n += COLI_WR) {
        int wr = nb - n < COLI_WR ? nb - n : COLI_WR;
        for (int g0 = 0; g0 < npan; g0 += COLI_BF16_PANELS) {
            int gn = npan - g0 < COLI_BF16_PANELS ? npan - g0 : COLI_BF16_PANELS;
            for (int k0 = 0; k0 < K; k0 += COLI_BF16_KC) {
                int kc = K - k0 < COLI_BF16_KC ? K - k0 : COLI_BF16_KC;
                for (int i = 0; i < wr; i++) coli_widen_bf16(W + (long)(n + i) * ldw + k0, kc, wbuf + i * COLI_BF16_KC);
                for (int p = 0; p < gn; p++)
                    coli_rtile_acc(wr, wbuf, COLI_BF16_KC, P + (long)(g0 + p) * K * COLI_NP + (long)k0 * COLI_NP, kc,
                                   acc[p], k0 == 0);
            }
            for (int p = 0; p < gn; p++) {
                int t0 = (g0 + p) * COLI_NP, nt = M - t0 < COLI_NP ? M - t0 : COLI_NP;
                for (int j = 0; j < nt; j++)
                    for (int i = 0; i < wr; i++) Y[(long)(t0 + j) * ldy + n + i] = acc[p][i * COLI_NP + j];
            }
        }
    }
}

/* The token-panel GEMM for an f32 or bf16 W: Y[m, n0 + n] for n < nb (see coli_gemm_tokens). */
static inline void coli_gemm_tokens_any(const float *P, int M, const coli_mat *W, int n0, int nb, int K, float *Y,
                                        long ldy) {
    if (W->fmt == COLI_BF16)
        coli_gemm_tokens_bf16(P, M, (const uint16_t *)W->w + (long)n0 * W->ldw, W->ldw, nb, K, Y + n0, ldy);
    else
        coli_gemm_tokens(P, M, (const float *)W->w + (long)n0 * W->ldw, W->ldw, nb, K, Y + n0, ldy);
}

/* Y[m, n] = dot(act row m, W row n0 + n) for n < nb: f32, bf16, Q4 or Q4A weights (Q8 takes
 * int16 activations: coli_gemm_q16, simd_q16.h). K: logical columns. The M tokens are part of
 * a call of Mcall (a MoE expert's tokens of the call's): on AVX2, Q4 / Q4A take the token-lane
 * GEMM from COLI_Q4GEMM8_MIN tokens, or from COLI_Q4GEMM8_FEW when the call has at least
 * COLI_Q4GEMM8_MIN, so a token's bits still depend only on the size of its call. */
static inline void coli_gemm_any_of(const coli_act *a, int M, int Mcall, const coli_mat *W, int n0, int nb, int K,
                                    float *Y, long ldy) {
    (void)Mcall;
    if (W->fmt == COLI_F32) {
        coli_gemm_nt(a->x, a->ldx, M, (const float *)W->w + n0 * W->ldw, W->ldw, nb, K, Y + n0, ldy);
    } else if (W->fmt == COLI_BF16) {
        coli_gemm_bf16(a->x, a->ldx, M, (const uint16_t *)W->w + n0 * W->ldw, W->ldw, nb, K, Y + n0, ldy);
    } else {
        int ngroups = (K + QK - 1) / QK;
        const uint8_t *wq = W->w ? (const uint8_t *)W->w + n0 * W->ldw : NULL; /* (NULL: packed) */
        const uint16_t *wd = W->d ? W->d + n0 * W->ldd : NULL, *wm = W->m ? W->m + n0 * W->ldd : NULL;
#if defined(COLI_Q4GEMM8_OK)
        if ((M >= COLI_Q4GEMM8_MIN || (Mcall >= COLI_Q4GEMM8_MIN && M >= COLI_Q4GEMM8_FEW)) &&
            (W->fmt == COLI_Q4 || W->fmt == COLI_Q4A)) {
            if (W->pk != NULL) { /* packed: the rows' groups gathered from the tiles */
                coli_mat P = *W;
                P.pk = W->pk + (n0 / 4) * W->pks;
                coli_q4gemm8(a, M, NULL, NULL, NULL, 0, 0, ngroups, nb, Y + n0, ldy, &P);
            } else {
                coli_q4gemm8(a, M, wq, wd, wm, W->ldw, W->ldd, ngroups, nb, Y + n0, ldy, NULL);
            }
            return;
        }
#endif
#if COLI_Q4X_TILES
        /* repacked rows (n0 a multiple of 4; the caller arranged the activations), or on AVX2
           rows with arranged activations (MoE int4 experts), with the same arithmetic */
        if (W->pk != NULL || (COLI_Q4X_ROWS_X && a->xe != NULL)) {
            coli_q4x_packed(a, M, W, n0, nb, K, Y, ldy);
            return;
        }
#endif
        int n = 0;
#if defined(COLI_Q512)
        if (a->xe != NULL && M >= COLI_XT_MIN) { /* several tokens: 4 interleaved rows at a time */
            for (int m = 0; m < M; m += COLI_XT_MR) /* (tokens outside: their activations stay in L1) */
                for (n = 0; n + 4 <= nb; n += 4) {
                    int mr = M - m < COLI_XT_MR ? M - m : COLI_XT_MR;
                    coli_act sub = *a;
                    sub.q = a->q + m * a->ldq;
                    sub.qd = a->qd + m * a->ldb;
                    sub.qs = a->qs + m * a->ldb;
                    sub.xe = a->xe + m * a->lde;
                    const uint8_t *w4 = wq + n * W->ldw;
                    float *y = Y + m * ldy + n0 + n;
                    const uint16_t *d4 = wd + n * W->ldd, *m4 = wm ? wm + n * W->ldd : NULL;
                    if (W->fmt == COLI_Q4A)
                        coli_q4atile_x(mr, &sub, w4, d4, m4, W->ldw, W->ldd, ngroups, y, ldy);
                    else
                        coli_q4tile_x(mr, &sub, w4, d4, NULL, W->ldw, W->ldd, ngroups, y, ldy);
                }
            n = nb / 4 * 4; /* (also with M = 0) the rows left take the plain tiles below */
        }
#endif
        for (; n < nb; n += 4) {
            int nr = nb - n < 4 ? nb - n : 4;
            for (int m = 0; m < M; m += 4) {
                int mr = M - m < 4 ? M - m : 4;
                coli_act sub = *a;
                sub.q = a->q + m * a->ldq;
                sub.qd = a->qd + m * a->ldb;
                sub.qs = a->qs + m * a->ldb;
                if (W->fmt == COLI_Q4A)
                    coli_q4atile(mr, nr, &sub, wq + n * W->ldw, wd + n * W->ldd, wm + n * W->ldd, W->ldw, W->ldd,
                                 ngroups, Y + m * ldy + n0 + n, ldy);
                else
                    coli_q4tile(mr, nr, &sub, wq + n * W->ldw, wd + n * W->ldd, NULL, W->ldw, W->ldd, ngroups,
                                Y + m * ldy + n0 + n, ldy);
            }
        }
    }
}

static inline void coli_gemm_any(const coli_act *a, int M, const coli_mat *W, int n0, int nb, int K, float *Y,
                                 long ldy) {
    coli_gemm_any_of(a, M, M, W, n0, nb, K, Y, ldy);
}

/* out[:K] = row r of W as float32. */
static inline void coli_dequant_row(const coli_mat *W, int r, int K, float *out) {
    if (W->fmt == COLI_F32) {
        memcpy(out, (const float *)W->w + r * W->ldw, K * sizeof(float));
    } else if (W->fmt == COLI_BF16) {
        coli_widen_bf16((const uint16_t *)W->w + (long)r * W->ldw, K, out);
    } else if (W->fmt == COLI_Q8 && W->pk != NULL) {
        coli_q8x_row(W, r, K, out);
    } else if (W->fmt == COLI_Q8) {
        const int8_t *q = (const int8_t *)W->w + r * W->ldw;
        for (int k = 0; k < K; k++) out[k] = coli_f16_to_f32(W->d[r * W->ldd + k / QK]) * q[k];
    } else if (W->pk != NULL) {
        coli_q4x_row(W, r, K, out);
    } else {
        const uint8_t *q = (const uint8_t *)W->w + r * W->ldw;
        for (int k = 0; k < K; k++) {
            int b = k / QK, i = k % QK;
            int v = i < 16 ? (q[b * 16 + i] & 15) : (q[b * 16 + i - 16] >> 4);
            if (W->fmt == COLI_Q4A)
                out[k] = coli_f16_to_f32(W->d[r * W->ldd + b]) * v + coli_f16_to_f32(W->m[r * W->ldd + b]);
            else
                out[k] = coli_f16_to_f32(W->d[r * W->ldd + b]) * (v - 8);
        }
    }
}

#endif /* COLI_SIMD_Q_H */
