/* int8 weights x int16 activations: the int8 format's kernels (COLI_Q8; see simd_q.h).
 *
 * int8 weights keep their layout (groups of 32 int8 with one float16 scale). Their
 * activations are quantized on the fly to int16 groups of 32: q = round(x / d),
 * d = max|x| / 32767 (round half to even, as lrintf), so the activations' rounding error
 * is ~1/256 of int8 groups' and int8's error is that of its weights alone (int8
 * activations cost three quarters of its KL divergence on SmolLM2; docs/QUANTIZATION.md).
 *
 * Layout of a quantized activation row (Kp int16): each pair of groups (b, b + 1), b even,
 * takes 64 values, in the order b[0:16], b+1[0:16], b[16:32], b+1[16:32]; an odd last group
 * is stored as it is. coli_q16_first / coli_q16_gap say where a group's halves are. The
 * order lets one 512-bit multiply-add cover two groups at once (lanes 0-7 group b, lanes
 * 8-15 group b + 1), so each step converts and scales half as many vectors.
 *
 * One group's dot product: int8 weights widened to int16 (vpmovsxbw) times the int16
 * activations, pairs summed into int32 (vpdpwssd on AVX-512 VNNI, vpmaddwd + vpaddd on
 * AVX-512BW and AVX2, smull / smlal on 64-bit ARM (simd_q16_neon.h: the scalar tile's bits),
 * plain C otherwise). A lane sums at most 4 products, |sum| <
 * 4 * 127 * 32767 < 2^24, so its conversion to float is exact; the group's sum is then
 * scaled by (weight scale * activation scale) in float, like the int8 x int8 tiles.
 * Twice the multiplies of int8 activations: decode, bound by memory, barely notices.
 */
#ifndef COLI_SIMD_Q16_H
#define COLI_SIMD_Q16_H

#include "simd_q.h"

/* int16 activations for one GEMM with int8 weights. */
typedef struct {
    const int16_t *q;   /* (M, ldq) int16, Kp columns in the pair order above */
    const float *qd;    /* (M, ldb) group scales */
    long ldq, ldb;
} coli_act16;

/* Where group b (of nb) starts in a quantized row, and how far its second 16 values are
 * from its first 16. */
static inline long coli_q16_first(int b, int nb) {
    return b < (nb & ~1) ? (long)(b & ~1) * QK + (b & 1) * 16 : (long)b * QK;
}
static inline int coli_q16_gap(int b, int nb) { return b < (nb & ~1) ? 32 : 16; }

/* Quantize one row of K floats into Kp/32 int16 groups (pair order), scales in d. Whole
 * groups go 32 lanes at a time with the same float operations as the scalar loop (|x|
 * max, 32767 / max, x * that, round to nearest even), so every path writes the same
 * values. */
static inline void coli_quantize_row_q16(const float *x, int K, int16_t *q, float *d) {
    int nb = (K + QK - 1) / QK, b = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (; b < K / QK; b++) {
        __m512 x0 = _mm512_loadu_ps(x + b * QK), x1 = _mm512_loadu_ps(x + b * QK + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
        __m512 inv = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
        long f = coli_q16_first(b, nb);
        _mm256_storeu_si256((__m256i *)(q + f), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x0, inv))));
        _mm256_storeu_si256((__m256i *)(q + f + coli_q16_gap(b, nb)),
                            _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x1, inv))));
        d[b] = amax / 32767.0f;
    }
#elif defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; b < K / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v[4], m;
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(xb + 8 * k);
        m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                          _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        float amax = _mm_cvtss_f32(h);
        __m256 inv = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
        long f = coli_q16_first(b, nb);
        int g = coli_q16_gap(b, nb);
        for (int k = 0; k < 2; k++) { /* values 16k .. 16k + 15; packs interleaves 128-bit lanes */
            __m256i p = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[2 * k], inv)),
                                           _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * k + 1], inv)));
            _mm256_storeu_si256((__m256i *)(q + f + k * g), _mm256_permute4x64_epi64(p, 0xD8));
        }
        d[b] = amax / 32767.0f;
    }
#elif defined(COLI_NEON) /* |x| max ignoring NaN as the loop below does (fmaxnm), fcvtns = lrintf */
    for (; b < K / QK; b++) {
        float32x4_t v[8], m = vdupq_n_f32(0.0f);
        for (int k = 0; k < 8; k++) v[k] = vld1q_f32(x + b * QK + 4 * k), m = vmaxnmq_f32(m, vabsq_f32(v[k]));
        float amax = vmaxnmvq_f32(m);
        float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        long f = coli_q16_first(b, nb);
        int g = coli_q16_gap(b, nb);
        for (int k = 0; k < 4; k++) /* values 8k .. 8k + 7 */
            vst1q_s16(q + f + (k < 2 ? 8 * k : g + 8 * (k - 2)),
                      vcombine_s16(vmovn_s32(vcvtnq_s32_f32(vmulq_n_f32(v[2 * k], inv))),
                                   vmovn_s32(vcvtnq_s32_f32(vmulq_n_f32(v[2 * k + 1], inv)))));
        d[b] = amax / 32767.0f;
    }
#endif
    for (; b < nb; b++) {
        int n = K - b * QK < QK ? K - b * QK : QK;
        const float *xb = x + b * QK;
        long f = coli_q16_first(b, nb);
        int g = coli_q16_gap(b, nb);
        float amax = 0.0f;
        for (int i = 0; i < n; i++) { float a = fabsf(xb[i]); amax = a > amax ? a : amax; }
        float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        for (int i = 0; i < QK; i++) {
            int v = i < n ? (int)lrintf(xb[i] * inv) : 0;
            q[f + (i < 16 ? i : g + i - 16)] = (int16_t)v;
        }
        d[b] = amax / 32767.0f;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define COLI_Q16_512 1
/* acc + the pairwise int32 sums of w * x (32 int16 pairs into 16 lanes) */
static inline __m512i coli_q16_dot512(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

/* bytes p[0:16] and p[32:48] widened to 32 int16: the same half of two adjacent groups */
static inline __m512i coli_q16_wpair(const int8_t *p) {
    __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                        _mm_loadu_si128((const __m128i *)(p + 32)), 1);
    return _mm512_cvtepi8_epi16(v);
}

/* One group in natural order (the odd last one): sum(w * x) * scale. */
static inline float coli_q16_group512(const int8_t *w, const int16_t *x, float scale) {
    __m512i d = coli_q16_dot512(_mm512_setzero_si512(), _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)w)),
                                _mm512_loadu_si512((const void *)x));
    return (float)_mm512_reduce_add_epi32(d) * scale;
}

/* MR tokens x NR rows, two groups (64 weights of a row) per step: lanes 0-7 of the int32
 * sums belong to group b, 8-15 to b + 1, scaled by the scales of 16 groups loaded once
 * per chunk and permuted into place (with one token its scale is folded into the weights'
 * per chunk). */
#define COLI_Q16TILE(MR, NR)                                                                       \
    static inline void coli_q16tile_##MR##x##NR(const coli_act16 *a, const int8_t *wq, const uint16_t *wd, \
                                                long ldw, long ldd, int nb, float *Y, long ldy) {  \
        __m512 acc[MR][NR];                                                                        \
        for (int i = 0; i < MR; i++)                                                               \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();                          \
        const __m512i pat = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3); \
        int np = nb & ~1;                                                                          \
        for (int c0 = 0; c0 < np; c0 += 16) {                                                      \
            int cn = np - c0 < 16 ? np - c0 : 16;                                                  \
            __mmask16 cm = (__mmask16)((1u << cn) - 1u);                                           \
            __m512 wsv[NR], xsv[MR];                                                               \
            for (int j = 0; j < NR; j++)                                                           \
                wsv[j] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(cm, wd + j * ldd + c0));        \
            for (int i = 0; i < MR; i++) xsv[i] = _mm512_maskz_loadu_ps(cm, a->qd + i * a->ldb + c0); \
            if (MR == 1)                                                                           \
                for (int j = 0; j < NR; j++) wsv[j] = _mm512_mul_ps(wsv[j], xsv[0]);               \
            for (int b = c0; b < c0 + cn; b += 2) {                                                \
                __m512i sel = _mm512_add_epi32(pat, _mm512_set1_epi32(b - c0));                    \
                __m512i wl[NR], wh[NR];                                                            \
                __m512 ws[NR];                                                                     \
                for (int j = 0; j < NR; j++) /* the next tile's rows arrive while this one computes */ \
                    _mm_prefetch((const char *)(wq + (NR + j) * ldw + b * QK), _MM_HINT_T0);       \
                for (int j = 0; j < NR; j++) {                                                     \
                    const int8_t *p = wq + j * ldw + b * QK;                                       \
                    wl[j] = coli_q16_wpair(p);                                                     \
                    wh[j] = coli_q16_wpair(p + 16);                                                \
                    ws[j] = _mm512_permutexvar_ps(sel, wsv[j]);                                    \
                }                                                                                  \
                for (int i = 0; i < MR; i++) {                                                     \
                    const int16_t *xp = a->q + i * a->ldq + b * QK;                                \
                    __m512i xl = _mm512_loadu_si512((const void *)xp);                             \
                    __m512i xh = _mm512_loadu_si512((const void *)(xp + 32));                      \
                    __m512 xs = MR == 1 ? _mm512_set1_ps(1.0f) : _mm512_permutexvar_ps(sel, xsv[i]); \
                    for (int j = 0; j < NR; j++) {                                                 \
                        __m512i d = coli_q16_dot512(coli_q16_dot512(_mm512_setzero_si512(), wl[j], xl), wh[j], xh); \
                        __m512 sc = MR == 1 ? ws[j] : _mm512_mul_ps(ws[j], xs);                    \
                        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sc, acc[i][j]);         \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < MR; i++) {                                                             \
            float sums[4];                                                                         \
            __m512 r[4];                                                                           \
            for (int j = 0; j < 4; j++) r[j] = j < NR ? acc[i][j] : _mm512_setzero_ps();           \
            _mm_storeu_ps(sums, coli_hsum4_512(r[0], r[1], r[2], r[3]));                           \
            for (int j = 0; j < NR; j++) {                                                         \
                float s = sums[j];                                                                 \
                if (np < nb)                                                                       \
                    s += coli_q16_group512(wq + j * ldw + np * QK, a->q + i * a->ldq + np * QK,   \
                                           coli_f16_to_f32(wd[j * ldd + np]) * a->qd[i * a->ldb + np]); \
                Y[i * ldy + j] = s;                                                                \
            }                                                                                      \
        }                                                                                          \
    }
#elif defined(__AVX2__)
static inline float coli_q16_hsum256(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

/* MR tokens x NR rows, one group per step: its two halves of 16 weights widened to int16
 * and multiplied pairwise (vpmaddwd) with the activations' halves, 8 int32 lanes per
 * group, scaled by weight scale * activation scale. The scales of 8 groups are converted
 * once per chunk and broadcast from a register per group (with one token its scale is
 * folded into the weights' per chunk). The weights are widened again for each token
 * rather than kept: 16 registers hold the accumulators, and the widening runs on a port
 * the multiply-adds leave idle. */
#define COLI_Q16TILE(MR, NR)                                                                       \
    static inline void coli_q16tile_##MR##x##NR(const coli_act16 *a, const int8_t *wq, const uint16_t *wd, \
                                                long ldw, long ldd, int nb, float *Y, long ldy) {  \
        __m256 acc[MR][NR];                                                                        \
        for (int i = 0; i < MR; i++)                                                               \
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();                          \
        for (int c0 = 0; c0 < nb; c0 += 8) {                                                       \
            int cn = nb - c0 < 8 ? nb - c0 : 8;                                                    \
            __m256 wsv[NR], xsv[MR];                                                               \
            for (int j = 0; j < NR; j++) {                                                         \
                uint16_t h[8] = {0};                                                               \
                memcpy(h, wd + j * ldd + c0, cn * sizeof(uint16_t));                               \
                wsv[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));                     \
            }                                                                                      \
            for (int i = 0; i < MR; i++) {                                                         \
                float f[8] = {0};                                                                  \
                memcpy(f, a->qd + i * a->ldb + c0, cn * sizeof(float));                            \
                xsv[i] = _mm256_loadu_ps(f);                                                       \
            }                                                                                      \
            if (MR == 1)                                                                           \
                for (int j = 0; j < NR; j++) wsv[j] = _mm256_mul_ps(wsv[j], xsv[0]);               \
            for (int b = c0; b < c0 + cn; b++) {                                                   \
                long f = coli_q16_first(b, nb);                                                    \
                int g = coli_q16_gap(b, nb);                                                       \
                __m256i sel = _mm256_set1_epi32(b - c0);                                           \
                if (!(b & 1))                                                                      \
                    for (int j = 0; j < NR; j++)                                                   \
                        _mm_prefetch((const char *)(wq + (NR + j) * ldw + b * QK), _MM_HINT_T0);   \
                for (int i = 0; i < MR; i++) {                                                     \
                    const int16_t *xp = a->q + i * a->ldq + f;                                     \
                    __m256i x0 = _mm256_loadu_si256((const __m256i *)xp);                          \
                    __m256i x1 = _mm256_loadu_si256((const __m256i *)(xp + g));                    \
                    __m256 xs = MR == 1 ? _mm256_set1_ps(1.0f) : _mm256_permutevar8x32_ps(xsv[i], sel); \
                    for (int j = 0; j < NR; j++) { /* the rows' 32 bytes stay in L1 across tokens */ \
                        const int8_t *p = wq + j * ldw + b * QK;                                   \
                        __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));   \
                        __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16))); \
                        __m256i d = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1)); \
                        __m256 ws = _mm256_permutevar8x32_ps(wsv[j], sel);                         \
                        __m256 sc = MR == 1 ? ws : _mm256_mul_ps(ws, xs);                          \
                        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sc, acc[i][j]);         \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < MR; i++)                                                               \
            for (int j = 0; j < NR; j++) Y[i * ldy + j] = coli_q16_hsum256(acc[i][j]);             \
    }
#elif defined(COLI_NEON)
#include "simd_q16_neon.h"
#else
/* Scalar fallback: the same arithmetic, one pair at a time. */
#define COLI_Q16TILE(MR, NR)                                                                       \
    static inline void coli_q16tile_##MR##x##NR(const coli_act16 *a, const int8_t *wq, const uint16_t *wd, \
                                                long ldw, long ldd, int nb, float *Y, long ldy) {  \
        for (int i = 0; i < MR; i++)                                                               \
            for (int j = 0; j < NR; j++) {                                                         \
                float acc = 0.0f;                                                                  \
                for (int b = 0; b < nb; b++) {                                                     \
                    const int16_t *x = a->q + i * a->ldq + coli_q16_first(b, nb);                  \
                    const int8_t *w = wq + j * ldw + b * QK;                                       \
                    int g = coli_q16_gap(b, nb);                                                   \
                    int32_t dot = 0;                                                               \
                    for (int t = 0; t < 16; t++) dot += (int32_t)w[t] * x[t] + (int32_t)w[16 + t] * x[g + t]; \
                    acc += (float)dot * (coli_f16_to_f32(wd[j * ldd + b]) * a->qd[i * a->ldb + b]); \
                }                                                                                  \
                Y[i * ldy + j] = acc;                                                              \
            }                                                                                      \
    }
#endif

COLI_Q16TILE(1, 1) COLI_Q16TILE(1, 2) COLI_Q16TILE(1, 3) COLI_Q16TILE(1, 4)
COLI_Q16TILE(2, 1) COLI_Q16TILE(2, 2) COLI_Q16TILE(2, 3) COLI_Q16TILE(2, 4)
COLI_Q16TILE(3, 1) COLI_Q16TILE(3, 2) COLI_Q16TILE(3, 3) COLI_Q16TILE(3, 4)
COLI_Q16TILE(4, 1) COLI_Q16TILE(4, 2) COLI_Q16TILE(4, 3) COLI_Q16TILE(4, 4)

static inline void coli_q16tile(int mr, int nr, const coli_act16 *a, const int8_t *wq, const uint16_t *wd, long ldw,
                                long ldd, int nb, float *Y, long ldy) {
    switch (mr * 8 + nr) {
    case 9: coli_q16tile_1x1(a, wq, wd, ldw, ldd, nb, Y, ldy); break;
    case 10: coli_q16tile_1x2(a, wq, wd, ldw, ldd, nb, Y, ldy); break;
    case 11: coli_q16tile_1x3(a, wq, wd, ldw, ldd, nb, Y, ldy); break;
    case 12: coli_q16tile_1x4(a, wq, wd, ldw, ldd, nb, Y, ldy); break;
    case 17: coli_q16tile_2x1(a, wq, wd, ldw, ldd, nb, Y, ldy); break;
    case 18: coli_q16tile_2x2(a, wq, wd, ldw, ldd, nb, Y, ldy); break;
    case 19: coli_q16tile_2x3(a, wq, wd, ldw, ldd, nb, Y, ldy); break;
    case 20: coli_q16tile_2x4(a, wq, wd, ldw, ldd, nb, Y, ldy); break;
    case 25: coli_q16tile_3x1(a, wq, wd, ldw, ldd, nb, Y, ldy); break;
    case 26: coli_q16tile_3x2(a, wq, wd, ldw, ldd, nb, Y, ldy); break;
    case 27: coli_q16tile_3x3(a, wq, wd, ldw, ldd, nb, Y, ldy); break;
    case 28: coli_q16tile_3x4(a, wq, wd, ldw, ldd, nb, Y, ldy); break;
    case 33: coli_q16tile_4x1(a, wq, wd, ldw, ldd, nb, Y, ldy); break;
    case 34: coli_q16tile_4x2(a, wq, wd, ldw, ldd, nb, Y, ldy); break;
    case 35: coli_q16tile_4x3(a, wq, wd, ldw, ldd, nb, Y, ldy); break;
    default: coli_q16tile_4x4(a, wq, wd, ldw, ldd, nb, Y, ldy); break;
    }
}

/* Y[m, n] = dot(act row m, W row n0 + n) for n < nb, W int8 (COLI_Q8), int16 activations;
 * 4 x 4 tiles, each block of weight rows read once for all M tokens. K: logical columns. */
static inline void coli_gemm_q16(const coli_act16 *a, int M, const coli_mat *W, int n0, int nb, int K, float *Y,
                                 long ldy) {
    int ngroups = (K + QK - 1) / QK;
    const int8_t *wq = (const int8_t *)W->w + (long)n0 * W->ldw;
    const uint16_t *wd = W->d + (long)n0 * W->ldd;
    for (int n = 0; n < nb; n += 4) {
        int nr = nb - n < 4 ? nb - n : 4;
        for (int m = 0; m < M; m += 4) {
            int mr = M - m < 4 ? M - m : 4;
            coli_act16 sub = *a;
            sub.q = a->q + (long)m * a->ldq;
            sub.qd = a->qd + (long)m * a->ldb;
            coli_q16tile(mr, nr, &sub, wq + (long)n * W->ldw, wd + (long)n * W->ldd, W->ldw, W->ldd, ngroups,
                         Y + (long)m * ldy + n0 + n, ldy);
        }
    }
}

#endif /* COLI_SIMD_Q16_H */
