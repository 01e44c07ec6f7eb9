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
 * For Q8/Q4 the activations are quantized on the fly to int8 groups of 32 with a
 * float scale (and, for Q4's offset, the group's integer sum), so a group's dot
 * product is one integer multiply-add of 32 pairs: AVX512-VNNI / AVX-VNNI
 * dpbusd where the CPU has it, AVX2 maddubs otherwise, plain C as the fallback.
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
} coli_mat;

/* Activations for one GEMM: float rows, plus their int8 quantization for Q8/Q4. */
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

static inline float coli_f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0) {
        if (m == 0) bits = s;
        else { e = 127 - 15 + 1; while (!(m & 0x400)) { m <<= 1; e--; } bits = s | (e << 23) | ((m & 0x3ff) << 13); }
    } else if (e == 31) bits = s | 0x7f800000 | (m << 13);
    else bits = s | ((e + 127 - 15) << 23) | (m << 13);
    float f; memcpy(&f, &bits, 4); return f;
#endif
}

/* Quantize one row of K floats into Kp/32 int8 groups: q = round(x / d), d = max|x| / 127
 * (round half to even, as lrintf). Whole groups go 32 lanes at a time on AVX-512 with the
 * same float operations, so both paths give the same bytes. */
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define COLI_Q512 1
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

/* Q8 on AVX-512: two groups (64 weights) per step, weights and activations in natural
 * order, so lanes 0-7 hold group b and lanes 8-15 group b + 1. dpbusd multiplies unsigned
 * by signed bytes, so the weights go in as w + 128 (one xor with 0x80): the products then
 * carry 128 * sum(x) per group, which is taken out like Q4's offset, as one correction per
 * group from the activations' group sums, summed per chunk into cor. */
#define COLI_Q8TILE512(NAME, MR, NR)                                                                \
    static inline void NAME##_##MR##x##NR(const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                          long ldw, long ldd, int nb, float *Y, long ldy) {         \
        __m512 acc[MR][NR], cor[MR][NR];                                                           \
        for (int i = 0; i < MR; i++)                                                               \
            for (int j = 0; j < NR; j++) acc[i][j] = cor[i][j] = _mm512_setzero_ps();              \
        const __m512i pat = coli_lane_groups(3), flip = _mm512_set1_epi8((char)0x80);              \
        int b = 0;                                                                                 \
        for (int c0 = 0; c0 + 2 <= nb; c0 += 16) {                                                 \
            COLI_QCHUNK512(MR, NR, 2, 128.0f, 0)                                                      \
            for (b = c0; b + 2 <= c0 + cn; b += 2) {                                               \
                __m512i sel = _mm512_add_epi32(pat, _mm512_set1_epi32(b - c0));                    \
                __m512i w[NR];                                                                     \
                __m512 ws[NR];                                                                     \
                /* the rows of the next tile, one cache line per row per step: they arrive      \
                   while this tile computes */                                                    \
                for (int j = 0; j < NR; j++)                                                       \
                    _mm_prefetch((const char *)(wq + (NR + j) * ldw + b * 32), _MM_HINT_T0);       \
                for (int j = 0; j < NR; j++) {                                                     \
                    w[j] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(wq + j * ldw + b * 32)), flip); \
                    ws[j] = _mm512_permutexvar_ps(sel, wsv[j]);                                    \
                }                                                                                  \
                for (int i = 0; i < MR; i++) {                                                     \
                    __m512i x = _mm512_loadu_si512((const void *)(a->q + i * a->ldq + b * 32));    \
                    __m512 xs = MR == 1 ? _mm512_set1_ps(1.0f) : _mm512_permutexvar_ps(sel, xsv[i]); \
                    for (int j = 0; j < NR; j++) {                                                 \
                        __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[j], x);          \
                        __m512 sc = MR == 1 ? ws[j] : _mm512_mul_ps(ws[j], xs);                    \
                        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sc, acc[i][j]);         \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        COLI_QTILE512_END(NAME, MR, NR, 32)                                                          \
    }

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
                _mm_prefetch((const char *)(wq + (NR + j) * ldw + b * 16), _MM_HINT_T0);           \
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
/* 8 int32 lanes of sum(u8 * s8) over 32 byte pairs. */
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

/* MR tokens x NR rows of a quantized GEMM; IS4: 0 Q8, 1 Q4, 2 Q4A (asymmetric: its mins
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
                _mm_prefetch((const char *)(wq + (NR + j) * ldw + b * (IS4 ? 16 : 32)), _MM_HINT_T0); \
            for (int j = 0; j < NR; j++) {                                                         \
                w[j] = IS4 ? coli_unpack_q4(wq + j * ldw + b * 16)                                 \
                           : _mm256_loadu_si256((const __m256i *)(wq + j * ldw + b * 32));         \
                dw[j] = coli_f16_to_f32(wd[j * ldd + b]);                                          \
            }                                                                                      \
            for (int i = 0; i < MR; i++) {                                                         \
                __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + i * a->ldq + b * 32));     \
                float dx = a->qd[i * a->ldb + b];                                                  \
                __m256i bs = _mm256_set1_epi32(IS4 == 1 ? a->qs[i * a->ldb + b] : 0);              \
                for (int j = 0; j < NR; j++) {                                                     \
                    __m256i d = IS4 ? _mm256_sub_epi32(coli_dot_u8s8(w[j], x), bs)                 \
                                    : coli_dot_u8s8(_mm256_abs_epi8(w[j]), _mm256_sign_epi8(x, w[j])); \
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
#else
/* Scalar fallback: same arithmetic, one pair at a time. */
#define COLI_QTILE(NAME, IS4, MR, NR)                                                              \
    static inline void NAME##_##MR##x##NR(const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                          long ldw, long ldd, int nb, float *Y, long ldy) {         \
        for (int i = 0; i < MR; i++)                                                               \
            for (int j = 0; j < NR; j++) {                                                         \
                float acc = 0.0f;                                                                  \
                for (int b = 0; b < nb; b++) {                                                     \
                    const int8_t *x = a->q + i * a->ldq + b * 32;                                  \
                    int32_t dot = 0;                                                               \
                    for (int t = 0; t < 32; t++) {                                                 \
                        int wv = IS4 ? ((t < 16 ? (wq[j * ldw + b * 16 + t] & 15)                  \
                                                : (wq[j * ldw + b * 16 + t - 16] >> 4)) - (IS4 == 1 ? 8 : 0)) \
                                     : (int)((const int8_t *)wq)[j * ldw + b * 32 + t];            \
                        dot += wv * x[t];                                                          \
                    }                                                                              \
                    acc += (float)dot * (coli_f16_to_f32(wd[j * ldd + b]) * a->qd[i * a->ldb + b]); \
                    if (IS4 == 2)                                                                  \
                        acc += coli_f16_to_f32(wm[j * ldd + b]) * (a->qd[i * a->ldb + b] * (float)a->qs[i * a->ldb + b]); \
                }                                                                                  \
                Y[i * ldy + j] = acc;                                                              \
            }                                                                                      \
    }
#endif

/* Which tile computes a block: COLI_QTILE_MAIN(NAME, IS4, MR, NR) defines NAME_MRxNR, and
 * NAME_tail is the one-group-at-a-time tile the wide ones hand their last groups to. */
#if defined(COLI_Q512)
#define COLI_QTILE_MAIN(NAME, IS4, MR, NR) COLI_QTILE512_##IS4(NAME, MR, NR)
#define COLI_QTILE512_0(NAME, MR, NR) COLI_Q8TILE512(NAME, MR, NR)
#define COLI_QTILE512_1(NAME, MR, NR) COLI_Q4TILE512(NAME, MR, NR, 0)
#define COLI_QTILE512_2(NAME, MR, NR) COLI_Q4TILE512(NAME, MR, NR, 1)
#elif defined(__AVX2__)
#define COLI_QTILE_MAIN(NAME, IS4, MR, NR) COLI_QTILE256_##IS4(NAME, MR, NR)
#define COLI_QTILE256_0(NAME, MR, NR) COLI_QTILE(NAME, 0, MR, NR)
#define COLI_QTILE256_1(NAME, MR, NR) COLI_Q4TILE256(NAME, MR, NR, 0)
#define COLI_QTILE256_2(NAME, MR, NR) COLI_Q4TILE256(NAME, MR, NR, 1)
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

COLI_QTILES(coli_q8tile, 0)
COLI_QTILES(coli_q4tile, 1)
COLI_QTILES(coli_q4atile, 2)

/* ---- several tokens x 4 rows, rows interleaved in registers (AVX-512 VNNI) -------------
 * The tiles above keep each row's 64-byte load in its natural order, so every int32 lane of
 * a dot product holds a quarter of one group of one row: each (token, row) pair then pays a
 * convert, a scale multiply and an fma per step besides its two dpbusd, and with a few
 * tokens that, not the weight bytes, sets the speed. Here the 64-byte loads of 4 rows are
 * transposed by dwords within each 128-bit lane (8 unpacks), so lane (L, j) (128-bit lane L,
 * dword j) holds row j's bytes of group b + L: after the 8 (Q4) or 4 (Q8) dpbusd of a step
 * each lane is one whole (row, group) dot product, and one convert + multiply + fma per
 * token serves 4 rows. The activations come pre-arranged (coli_expand_act, once per call):
 * per token and step, each vector a dword of every group broadcast over its 128-bit lane,
 * then the step's activation scales and offset terms in the same lane order, so the inner
 * loop reads them as memory operands. Used from 2 tokens on (COLI_XT_MIN); the groups after
 * the last whole step go through the one-group tail per (token, row). */
#if defined(COLI_Q512)
#define COLI_XT_MIN 2   /* tokens from which coli_gemm_any takes the interleaved tiles */
#define COLI_XT_MR 8    /* tokens per interleaved tile */
/* vectors of 64 bytes per token and step: Q4/Q4A: 8 activation dwords, the scale, 8 * the
 * group sum (int32) and scale * sum (float); Q8: 4 dwords, the scale, 128 * the half-group
 * sum (int32) */
#define COLI_XE_Q4 11
#define COLI_XE_Q8 6

/* Bytes of coli_expand_act's output per token (0: the interleaved tiles are not used). */
static inline long coli_xe_ld(int fmt, int M, int K) {
    int nb = (K + QK - 1) / QK;
    if (M < COLI_XT_MIN) return 0;
    if (fmt == COLI_Q4 || fmt == COLI_Q4A) return (nb + 3) / 4 * COLI_XE_Q4 * 64L;
    if (fmt == COLI_Q8) return (nb + 1) / 2 * COLI_XE_Q8 * 64L;
    return 0;
}

/* xe (64-byte aligned, M rows of lde bytes) = the quantized activations of a, arranged for
 * the interleaved tiles of format fmt (see above). */
static inline void coli_expand_act(const coli_act *a, int M, int K, int fmt, int8_t *xe, long lde) {
    int nb = (K + QK - 1) / QK;
    const __m512i quad = coli_lane_groups(2), pair = coli_lane_groups(3);
    for (int i = 0; i < M; i++) {
        const int8_t *xq = a->q + i * a->ldq;
        const float *qd = a->qd + i * a->ldb;
        const int32_t *qs = a->qs + i * a->ldb;
        int8_t *o = xe + i * lde;
        if (fmt == COLI_Q8) {
            const __m512i bias = _mm512_set1_epi8((char)0x80);
            for (int s = 0; s < (nb + 1) / 2; s++, o += COLI_XE_Q8 * 64) {
                /* 128-bit lane L: half L % 2 of group 2s + L / 2; a last odd group pairs with zeros */
                int odd = 2 * s + 1 == nb;
                __m512i x = _mm512_maskz_loadu_epi8(odd ? 0xFFFFFFFFull : ~0ull, xq + s * 64), off = _mm512_setzero_si512();
                __m512i xp[4] = {_mm512_shuffle_epi32(x, (_MM_PERM_ENUM)0x00), _mm512_shuffle_epi32(x, (_MM_PERM_ENUM)0x55),
                                 _mm512_shuffle_epi32(x, (_MM_PERM_ENUM)0xAA), _mm512_shuffle_epi32(x, (_MM_PERM_ENUM)0xFF)};
                for (int p = 0; p < 4; p++) {
                    _mm512_store_si512((void *)(o + p * 64), xp[p]);
                    off = _mm512_dpbusd_epi32(off, bias, xp[p]);  /* 128 * the half group's sum */
                }
                __m512 xs = _mm512_permutexvar_ps(pair, _mm512_maskz_loadu_ps(odd ? 0x1 : 0x3, qd + 2 * s));
                _mm512_store_ps((float *)(o + 4 * 64), xs);
                _mm512_store_si512((void *)(o + 5 * 64), off);
            }
        } else {
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
 * lane order (L, j): lane 4L + j = row j, group g0 + L. */
static inline __m512 coli_xt_scales4(const uint16_t *d, long ldd, int g0, int n) {
    int64_t e[4] = {0, 0, 0, 0};
    for (int j = 0; j < 4; j++) memcpy(&e[j], d + j * ldd + g0, 2 * n);
    const __m512i t = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0); /* 4j + L -> 4L + j */
    return _mm512_permutexvar_ps(t, _mm512_cvtph_ps(_mm256_set_epi64x(e[3], e[2], e[1], e[0])));
}
/* The same for groups g0, g0 + 1 (n <= 2) in Q8's lane order: lane 4L + j = row j, group
 * g0 + L / 2. */
static inline __m512 coli_xt_scales2(const uint16_t *d, long ldd, int g0, int n) {
    int32_t e[4] = {0, 0, 0, 0};
    for (int j = 0; j < 4; j++) memcpy(&e[j], d + j * ldd + g0, 2 * n);
    const __m512i t = _mm512_set_epi32(7, 5, 3, 1, 7, 5, 3, 1, 6, 4, 2, 0, 6, 4, 2, 0);  /* 2j + L/2 -> 4L + j */
    return _mm512_permutexvar_ps(t, _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_set_epi32(e[3], e[2], e[1], e[0]))));
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

/* One step of the Q8 interleaved tile: groups b, b + 1 (or b alone with MASKED). */
#define COLI_Q8XSTEP(MR, MASKED)                                                                   \
    {                                                                                              \
        __m512i T[4];                                                                              \
        if (!(MASKED))                                                                             \
            for (int j = 0; j < 4; j++)                                                            \
                _mm_prefetch((const char *)(wq + (4 + j) * ldw + b * 32), _MM_HINT_T0);            \
        COLI_XT_LOAD4(T, wq, ldw, b * 32, MASKED, 0xFFFFFFFFull);                                  \
        for (int p = 0; p < 4; p++) T[p] = _mm512_xor_si512(T[p], flip);                           \
        __m512 ws = coli_xt_scales2(wd, ldd, b, (MASKED) ? 1 : 2);                                 \
        for (int i = 0; i < MR; i++) {                                                             \
            const int8_t *o = a->xe + i * a->lde + (b / 2) * (COLI_XE_Q8 * 64);                    \
            __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), T[0], _mm512_load_si512((const void *)o)); \
            for (int p = 1; p < 4; p++)                                                            \
                d = _mm512_dpbusd_epi32(d, T[p], _mm512_load_si512((const void *)(o + p * 64)));   \
            d = _mm512_sub_epi32(d, _mm512_load_si512((const void *)(o + 5 * 64)));                \
            __m512 sc = _mm512_mul_ps(ws, _mm512_load_ps((const float *)(o + 4 * 64)));            \
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sc, acc[i]);                           \
        }                                                                                          \
    }

/* Q8: MR tokens x 4 rows, 2 groups (64 bytes) per step; lane (L, j) is half of group
 * b + L / 2. The weights go into dpbusd as w + 128 and 128 * the half group's sum (from xe)
 * comes off in the integers. A last odd group is a masked step (its other half: zeros,
 * which after the xor meet zero activations). */
#define COLI_Q8XTILE512(NAME, MR)                                                                  \
    static inline void NAME##_x##MR(const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                    long ldw, long ldd, int nb, float *Y, long ldy) {              \
        (void)wm;                                                                                  \
        __m512 acc[MR];                                                                            \
        for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();                                 \
        const __m512i flip = _mm512_set1_epi8((char)0x80);                                         \
        int b = 0;                                                                                 \
        for (; b + 2 <= nb; b += 2) COLI_Q8XSTEP(MR, 0)                                            \
        if (b < nb) COLI_Q8XSTEP(MR, 1)                                                            \
        COLI_XT_END(MR)                                                                            \
    }

#define COLI_XTILES(NAME, ROLE)                                                                    \
    ROLE(NAME, 2) ROLE(NAME, 3) ROLE(NAME, 4) ROLE(NAME, 5) ROLE(NAME, 6) ROLE(NAME, 7) ROLE(NAME, 8) \
    static inline void NAME##_x(int mr, const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                long ldw, long ldd, int nb, float *Y, long ldy) {                  \
        switch (mr) {                                                                              \
        case 1: NAME##_1x4(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break; /* the one-token tile */   \
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
COLI_XTILES(coli_q8tile, COLI_Q8XTILE512)
#else
static inline long coli_xe_ld(int fmt, int M, int K) { (void)fmt; (void)M; (void)K; return 0; }
static inline void coli_expand_act(const coli_act *a, int M, int K, int fmt, int8_t *xe, long lde) {
    (void)a; (void)M; (void)K; (void)fmt; (void)xe; (void)lde;
}
#endif

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

/* Y[m, n] = dot(act row m, W row n0 + n) for n < nb, any format. K: logical columns. */
static inline void coli_gemm_any(const coli_act *a, int M, const coli_mat *W, int n0, int nb, int K,
                                 float *Y, long ldy) {
    if (W->fmt == COLI_F32) {
        coli_gemm_nt(a->x, a->ldx, M, (const float *)W->w + n0 * W->ldw, W->ldw, nb, K, Y + n0, ldy);
    } else if (W->fmt == COLI_BF16) {
        coli_gemm_bf16(a->x, a->ldx, M, (const uint16_t *)W->w + n0 * W->ldw, W->ldw, nb, K, Y + n0, ldy);
    } else {
        int ngroups = (K + QK - 1) / QK;
        const uint8_t *wq = (const uint8_t *)W->w + n0 * W->ldw;
        const uint16_t *wd = W->d + n0 * W->ldd, *wm = W->m ? W->m + n0 * W->ldd : NULL;
        int n = 0;
#if defined(COLI_Q512)
        if (a->xe != NULL && M >= COLI_XT_MIN) /* several tokens: 4 interleaved rows at a time */
            for (; n + 4 <= nb; n += 4)
                for (int m = 0; m < M; m += COLI_XT_MR) {
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
                    else if (W->fmt == COLI_Q4)
                        coli_q4tile_x(mr, &sub, w4, d4, NULL, W->ldw, W->ldd, ngroups, y, ldy);
                    else
                        coli_q8tile_x(mr, &sub, w4, d4, NULL, W->ldw, W->ldd, ngroups, y, ldy);
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
                else if (W->fmt == COLI_Q4)
                    coli_q4tile(mr, nr, &sub, wq + n * W->ldw, wd + n * W->ldd, NULL, W->ldw, W->ldd, ngroups,
                                Y + m * ldy + n0 + n, ldy);
                else
                    coli_q8tile(mr, nr, &sub, wq + n * W->ldw, wd + n * W->ldd, NULL, W->ldw, W->ldd, ngroups,
                                Y + m * ldy + n0 + n, ldy);
            }
        }
    }
}

/* out[:K] = row r of W as float32. */
static inline void coli_dequant_row(const coli_mat *W, int r, int K, float *out) {
    if (W->fmt == COLI_F32) {
        memcpy(out, (const float *)W->w + r * W->ldw, K * sizeof(float));
    } else if (W->fmt == COLI_BF16) {
        coli_widen_bf16((const uint16_t *)W->w + (long)r * W->ldw, K, out);
    } else if (W->fmt == COLI_Q8) {
        const int8_t *q = (const int8_t *)W->w + r * W->ldw;
        for (int k = 0; k < K; k++) out[k] = coli_f16_to_f32(W->d[r * W->ldd + k / QK]) * q[k];
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
