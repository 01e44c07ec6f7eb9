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
 * scaled by (weight scale * activation scale) in float. Twice the multiplies of int8
 * activations: decode, bound by memory, barely notices. The AVX2 tiles below instead
 * interleave 4 rows so that each int32 lane sums a whole group (exact in int32) and one
 * float conversion, scale and fma per token serve 4 rows x 2 groups; the AVX-512 VNNI
 * tiles transpose a row's chunk of up to 16 groups so that one serves 16 groups (vpdpbusd
 * on the activations' two bytes; the plain 512-bit tiles remain for AVX-512 without VNNI).
 */
#ifndef COLI_SIMD_Q16_H
#define COLI_SIMD_Q16_H

#include "simd_q.h"

/* int16 activations for one GEMM with int8 weights. */
typedef struct {
    const int16_t *q;   /* (M, ldq) int16, Kp columns in the pair order above */
    const float *qd;    /* (M, ldb) group scales */
    long ldq, ldb;
    const uint8_t *xe;  /* (M, lde) bytes: q arranged for the interleaved tiles (coli_q16_arrange;
                           64-byte aligned), where coli_q16_xe_ld is not 0 */
    long lde;
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
        float32x4_t v[8];
        float amax = coli_group_amax_neon(x + b * QK, v);
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

#if defined(__AVX512VNNI__)
/* ---- AVX-512 VNNI: a whole (row, group) sum per int32 lane --------------------------------
 * The plain tiles below spend a float conversion, a scale multiply and an fma per token, row
 * and 2 groups, more than their 2 multiply-adds. Here the weights of a chunk of G groups
 * (G = 16 while 16 are left, then 8, 4, 2; a last odd group is a pair with a zero group) are
 * transposed once per row in registers so that the T = G / 2 multiply-adds of a token leave
 * in each int32 lane an exact sum over 32 / (16 / G) values of one group (16 lanes = G
 * groups x 16 / G parts), and one convert, one scale multiply and one fma per token serve
 * the whole chunk.
 *
 * The multiply-add is vpdpbusd (unsigned x signed bytes, 4 per lane): an int16 activation
 * x is split into the bytes of x + 32768 = 256 hi + lo (both unsigned), so
 * w . x = 256 (w . hi - 128 sum w) + w . lo, with 128 sum w taken per row by the same
 * instruction on bytes of 128 (all sums exact in int32: |w . hi| < 2^20, the total
 * < 32 * 127 * 32767 < 2^27). The weights stay bytes: no widening.
 *
 * Transpose: a chunk's T natural registers (register r = groups 2r, 2r + 1 of 8 dword
 * quads each: lane m = (g & 1) << 3 | quad) go through log2 T stages; stage k swaps register
 * bit k with lane bit k (two vpermt2d per register pair). Afterwards step t (register t)
 * holds in lane m quad t | (m & (7 & ~(T - 1))) of group (m >> 3) | ((m & (T - 1)) << 1).
 * Each token's activations are arranged once per call (coli_q16_arrange) by the same
 * transpose: per chunk T registers of lo bytes, T of hi bytes, then its 16 group scales in
 * lane order.
 *
 * The same bits alone or in any batch: a token's operations do not depend on the tile or
 * its slot (integer sums are exact in any order, so the number of chains may vary; the
 * float sums run chunk by chunk per lane, then over the 16 lanes). */
#define COLI_Q16V 1
#define COLI_Q16V_MR 8   /* tokens per tile */
#define COLI_UNROLL _Pragma("GCC unroll 16")

/* (coli_q16v_groups, the groups of a chunk: simd_qx.h, beside the packed layout) */

/* Bytes of coli_q16_arrange's output per token: per chunk of T steps, 2T + 2 vectors. */
static inline long coli_q16_xe_ld(int M, int K) {
    (void)M;
    int nb = (K + QK - 1) / QK;
    long v = 0;
    for (int b = 0; b < nb;) {
        int G = coli_q16v_groups(nb - b);
        v += G + 2;
        b += G;
    }
    return v * 64;
}

static const int32_t coli_q16v_perm[3][2][16] = {
    {{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
     {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}},
    {{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
     {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}},
    {{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
     {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}},
};

/* lane m -> its group in a chunk of T steps (the scales' order) */
static const int32_t coli_q16v_lanegroup[4][16] = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},          /* T = 1 */
    {0, 2, 0, 2, 0, 2, 0, 2, 1, 3, 1, 3, 1, 3, 1, 3},          /* T = 2 */
    {0, 2, 4, 6, 0, 2, 4, 6, 1, 3, 5, 7, 1, 3, 5, 7},          /* T = 4 */
    {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15},    /* T = 8 */
};

static inline __m512i coli_q16v_lanes(int T) {
    return _mm512_loadu_si512((const void *)coli_q16v_lanegroup[T == 1 ? 0 : T == 2 ? 1 : T == 4 ? 2 : 3]);
}

/* stage k of the transpose below: register bit k <-> lane bit k */
static inline __attribute__((always_inline)) void coli_q16v_stage(__m512i *R, int T, int k) {
    __m512i ia = _mm512_loadu_si512((const void *)coli_q16v_perm[k][0]);
    __m512i ib = _mm512_loadu_si512((const void *)coli_q16v_perm[k][1]);
    COLI_UNROLL
    for (int p = 0; p < T / 2; p++) {
        int i = ((p >> k) << (k + 1)) | (p & ((1 << k) - 1)), j = i | (1 << k);
        __m512i a = R[i], b = R[j];
        R[i] = _mm512_permutex2var_epi32(a, ia, b);
        R[j] = _mm512_permutex2var_epi32(a, ib, b);
    }
}

/* the transpose above, in place on R[0 .. T-1] */
static inline __attribute__((always_inline)) void coli_q16v_transpose(__m512i *R, int T) {
    if (T >= 2) coli_q16v_stage(R, T, 0);
    if (T >= 4) coli_q16v_stage(R, T, 1);
    if (T >= 8) coli_q16v_stage(R, T, 2);
}

/* xe (M rows of lde bytes, 64-byte aligned) = the int16 activations of a arranged for the
 * tiles below: per chunk T vectors of lo bytes, T of hi bytes, the hi correction
 * -128 sum hi per lane (int32), the scales in lane order. */
static inline void coli_q16_arrange(const coli_act16 *a, int M, int K, uint8_t *xe, long lde) {
    int nb = (K + QK - 1) / QK;
    const __m512i one = _mm512_set1_epi8(1);
    for (int i = 0; i < M; i++) {
        const int16_t *q = a->q + i * a->ldq;
        const float *qd = a->qd + i * a->ldb;
        uint8_t *o = xe + i * lde;
        for (int b = 0; b < nb;) {
            int G = coli_q16v_groups(nb - b), T = G / 2;
            __m512i lo[8], hi[8];
            for (int r = 0; r < T; r++) {
                int g = b + 2 * r;
                if (g + 1 < nb) { /* a pair: b[0:16], b+1[0:16], b[16:32], b+1[16:32] */
                    __m512i x0 = _mm512_loadu_si512((const void *)(q + (long)g * QK));
                    __m512i x1 = _mm512_loadu_si512((const void *)(q + (long)g * QK + 32));
                    __m512i l = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(x0)),
                                                   _mm512_cvtepi16_epi8(x1), 1);
                    __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(x0, 8))),
                                                   _mm512_cvtepi16_epi8(_mm512_srai_epi16(x1, 8)), 1);
                    /* 128-bit blocks (b lo, b+1 lo, b hi, b+1 hi) -> natural (b lo, b hi, b+1 lo, b+1 hi) */
                    lo[r] = _mm512_shuffle_i64x2(l, l, 0xD8);
                    hi[r] = _mm512_shuffle_i64x2(h, h, 0xD8);
                } else { /* the odd last group, natural; its partner is zeros */
                    __m512i x0 = _mm512_loadu_si512((const void *)(q + (long)g * QK));
                    lo[r] = _mm512_zextsi256_si512(_mm512_cvtepi16_epi8(x0));
                    hi[r] = _mm512_zextsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(x0, 8)));
                }
            }
            coli_q16v_transpose(lo, T);
            coli_q16v_transpose(hi, T);
            __m512i c = _mm512_setzero_si512();
            for (int t = 0; t < T; t++) {
                _mm512_store_si512((void *)(o + 64 * t), lo[t]);
                _mm512_store_si512((void *)(o + 64 * (T + t)), hi[t]);
                c = _mm512_dpbusd_epi32(c, one, hi[t]);
            }
            _mm512_store_si512((void *)(o + 64 * 2 * T), _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(c, 7)));
            int n = nb - b < G ? nb - b : G;
            __m512 s = _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), qd + b);
            _mm512_store_ps((void *)(o + 64 * (2 * T + 1)), _mm512_permutexvar_ps(coli_q16v_lanes(T), s));
            o += 64 * (2 * T + 2);
            b += G;
        }
    }
}

/* One chunk (T steps, n real groups) of NR weight rows (ldw, ldd apart) for MR tokens:
 * acc[j * MR + i] for row j, token i. Per row: the weights transposed (W, signed) and
 * W + 128 (V, unsigned); per token: L = lo . W, H = hi . V - 128 sum hi = hi . W. pre: the
 * rows hold their chunks transposed already (coli_q8x_pack); ahead: bytes from a row to the
 * row whose chunk is prefetched (4 rows down, or the next packed tile's row). */
static inline __attribute__((always_inline)) void coli_q16v_chunk(int MR, int NR, int T, const uint8_t *xe, long lde,
                                                                 const int8_t *w, long ldw, const uint16_t *wd,
                                                                 long ldd, int n, __m512 *acc, long ahead, int pre) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    COLI_UNROLL
    for (int j = 0; j < NR; j++) {
        __m512i W[8], V[8];
        COLI_UNROLL
        for (int r = 0; r < T; r++)
            W[r] = 2 * r + 1 < n ? _mm512_loadu_si512((const void *)(w + j * ldw + 64 * r))
                                 : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, w + j * ldw + 64 * r);
        COLI_UNROLL
        for (int r = 0; r < T; r++) { /* 4 rows ahead: the next tiles' rows arrive while these compute */
            _mm_prefetch((const char *)(w + j * ldw + ahead + 64 * r), _MM_HINT_T0);
            /* and 8 rows ahead into L2 where a row serves few tokens (see COLI_Q4X_NEAR; with 5-8
             * tokens, prefill's tiles, no faster, and int8 prefill from L2 4% slower) */
            if (MR <= 4) _mm_prefetch((const char *)(w + j * ldw + 2 * ahead + 64 * r), _MM_HINT_T1);
        }
        if (!pre) coli_q16v_transpose(W, T);
        COLI_UNROLL
        for (int t = 0; t < T; t++) V[t] = _mm512_xor_si512(W[t], flip);
        __m512 ws = _mm512_permutexvar_ps(
            coli_q16v_lanes(T), _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1u), wd + j * ldd)));
        COLI_UNROLL
        for (int i = 0; i < MR; i++) {
            const uint8_t *o = xe + i * lde;
            __m512i L = _mm512_setzero_si512(), H = _mm512_load_si512((const void *)(o + 64 * 2 * T));
            COLI_UNROLL
            for (int t = 0; t < T; t++) {
                L = _mm512_dpbusd_epi32(L, _mm512_load_si512((const void *)(o + 64 * t)), W[t]);
                H = _mm512_dpbusd_epi32(H, V[t], _mm512_load_si512((const void *)(o + 64 * (T + t))));
            }
            __m512i d = _mm512_add_epi32(_mm512_slli_epi32(H, 8), L);
            acc[j * MR + i] = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(d), _mm512_mul_ps(ws, _mm512_load_ps((const float *)(o + 64 * (2 * T + 1)))),
                acc[j * MR + i]);
        }
    }
}

/* MR tokens (arranged activations xe, lde bytes apart) x NR weight rows of nb groups */
#define COLI_Q16VTILE(MR, NR)                                                                      \
    static inline void coli_q16vtile_##MR##x##NR(const uint8_t *xe, long lde, const int8_t *w, long ldw, \
                                                const uint16_t *wd, long ldd, int nb, float *Y, long ldy, \
                                                long ahead, int pre) {                             \
        enum { NA = (MR * NR + 3) / 4 * 4 };                                                       \
        __m512 acc[NA];                                                                            \
        COLI_UNROLL                                                                                \
        for (int i = 0; i < NA; i++) acc[i] = _mm512_setzero_ps();                                 \
        const uint8_t *o = xe;                                                                     \
        for (int b = 0; b < nb;) {                                                                 \
            int G = coli_q16v_groups(nb - b), n = nb - b < G ? nb - b : G;                         \
            const int8_t *wb = w + (long)b * QK;                                                   \
            switch (G) {                                                                           \
            case 16: coli_q16v_chunk(MR, NR, 8, o, lde, wb, ldw, wd + b, ldd, n, acc, ahead, pre); break; \
            case 8: coli_q16v_chunk(MR, NR, 4, o, lde, wb, ldw, wd + b, ldd, n, acc, ahead, pre); break; \
            case 4: coli_q16v_chunk(MR, NR, 2, o, lde, wb, ldw, wd + b, ldd, n, acc, ahead, pre); break; \
            default: coli_q16v_chunk(MR, NR, 1, o, lde, wb, ldw, wd + b, ldd, n, acc, ahead, pre); break; \
            }                                                                                      \
            o += 64 * (G + 2);                                                                     \
            b += G;                                                                                \
        }                                                                                          \
        for (int k = 0; k < NA; k += 4) { /* each output's sum does not depend on its slot */      \
            float sums[4];                                                                         \
            _mm_storeu_ps(sums, coli_hsum4_512(acc[k], acc[k + 1], acc[k + 2], acc[k + 3]));       \
            for (int u = 0; u < 4 && k + u < MR * NR; u++)                                         \
                Y[((k + u) % MR) * ldy + (k + u) / MR] = sums[u];                                  \
        }                                                                                          \
    }

COLI_Q16VTILE(1, 4) COLI_Q16VTILE(2, 2) COLI_Q16VTILE(1, 1) COLI_Q16VTILE(2, 1)
COLI_Q16VTILE(3, 1) COLI_Q16VTILE(4, 1) COLI_Q16VTILE(5, 1) COLI_Q16VTILE(6, 1)
COLI_Q16VTILE(7, 1) COLI_Q16VTILE(8, 1)

/* rows per tile for mr tokens */
static inline int coli_q16v_rows(int mr) { return mr == 1 ? 4 : mr == 2 ? 2 : 1; }

static inline void coli_q16vtile(int mr, int nr, const uint8_t *xe, long lde, const int8_t *w, long ldw,
                                 const uint16_t *wd, long ldd, int nb, float *Y, long ldy, long ahead, int pre) {
    if (nr == 4) { coli_q16vtile_1x4(xe, lde, w, ldw, wd, ldd, nb, Y, ldy, ahead, pre); return; }
    if (nr == 2) { coli_q16vtile_2x2(xe, lde, w, ldw, wd, ldd, nb, Y, ldy, ahead, pre); return; }
    switch (mr) {
    case 1: coli_q16vtile_1x1(xe, lde, w, ldw, wd, ldd, nb, Y, ldy, ahead, pre); break; /* same bits as in a batch */
    case 2: coli_q16vtile_2x1(xe, lde, w, ldw, wd, ldd, nb, Y, ldy, ahead, pre); break;
    case 3: coli_q16vtile_3x1(xe, lde, w, ldw, wd, ldd, nb, Y, ldy, ahead, pre); break;
    case 4: coli_q16vtile_4x1(xe, lde, w, ldw, wd, ldd, nb, Y, ldy, ahead, pre); break;
    case 5: coli_q16vtile_5x1(xe, lde, w, ldw, wd, ldd, nb, Y, ldy, ahead, pre); break;
    case 6: coli_q16vtile_6x1(xe, lde, w, ldw, wd, ldd, nb, Y, ldy, ahead, pre); break;
    case 7: coli_q16vtile_7x1(xe, lde, w, ldw, wd, ldd, nb, Y, ldy, ahead, pre); break;
    default: coli_q16vtile_8x1(xe, lde, w, ldw, wd, ldd, nb, Y, ldy, ahead, pre); break;
    }
}

/* Y[m, n] = dot(act row m, W row n0 + n) for n < nb, W int8 (COLI_Q8), int16 activations
 * arranged (a->xe); up to 8 tokens x 1 row per tile (4 rows for one token, 2 for two), the
 * rows' transposes paid once for the tile's tokens, or not at all for a packed matrix
 * (coli_q8x_pack; n0 a multiple of 4), whose 4-row tiles hold the rows transposed and their
 * scales. K: logical columns. */
static inline void coli_gemm_q16(const coli_act16 *a, int M, const coli_mat *W, int n0, int nb, int K, float *Y,
                                 long ldy) {
    int ngroups = (K + QK - 1) / QK;
    const int pre = W->pk != NULL;
    const long rb = coli_q8v_row_bytes(ngroups), sd = 2 * ((ngroups + 1) / 2);
    for (int m = 0; m < M; m += COLI_Q16V_MR) {
        int mr = M - m < COLI_Q16V_MR ? M - m : COLI_Q16V_MR;
        for (int n = 0; n < nb; n += 4) {
            const int8_t *wq;
            const uint16_t *wd;
            long ldw, ldd, ahead;
            if (pre) { /* tile (n0 + n) / 4: 4 rows of rb bytes, then their scales */
                wq = (const int8_t *)(W->pk + ((n0 + n) / 4) * W->pks);
                wd = (const uint16_t *)(const void *)(wq + 4 * rb);
                ldw = rb, ldd = sd, ahead = W->pks;
            } else {
                wq = (const int8_t *)W->w + (long)(n0 + n) * W->ldw;
                wd = W->d + (long)(n0 + n) * W->ldd;
                ldw = W->ldw, ldd = W->ldd, ahead = 4 * W->ldw;
            }
            int n4 = nb - n < 4 ? nb - n : 4, step = coli_q16v_rows(mr);
            for (int r = 0; r < n4; r += step) {
                int nr = n4 - r < step ? 1 : step;
                if (nr == 1) step = 1;
                coli_q16vtile(mr, nr, a->xe + (long)m * a->lde, a->lde, wq + (long)r * ldw, ldw, wd + (long)r * ldd,
                              ldd, ngroups, Y + (long)m * ldy + n0 + n + r, ldy, ahead, pre);
            }
        }
    }
}
#define COLI_Q8X_TILES 1 /* this path computes on repacked int8 matrices (QMatrix.pack repacks) */
#else /* AVX-512 without VNNI: the plain tiles */
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
#endif /* __AVX512VNNI__ */
#elif defined(__AVX2__)
#define COLI_Q16X 1      /* the interleaved tiles below */
#define COLI_Q16X_G 2    /* groups per step: one per 128-bit lane */
#define COLI_Q16X_V 32   /* bytes per vector */
/* ---- several tokens x 4 rows, rows interleaved in registers (AVX2) ---------------------
 * Lane (L, j) of a vector (128-bit lane L, dword j) belongs to weight row j and group
 * b + L of the step (groups b, b + 1). Per step the 4 rows' int8 weights are transposed by
 * 16-bit pairs (8 unpacks per 4 registers) and widened (unpack with itself, arithmetic
 * shift): vector S[p] lane (L, j) = pair p (values 2p, 2p + 1) of row j's group b + L as
 * two int16. Each token's activations come arranged (coli_q16_arrange, once per call, as
 * each row is quantized): per step, 16 vectors whose lane L holds pair p of the token's
 * group b + L four times over, then the two groups' scales in lane order, so a multiply-add
 * takes its activations straight from memory (the arrangement used to keep 4 quarters and
 * broadcast each pair with a vpshufd per token and pair: 16 shuffles a step, all on one
 * port, were most of a several-token tile's time). The 16 vpmaddwd + vpaddd leave in each int32 lane one
 * whole (row, group) dot product, exact (|sum| <= 32 * 127 * 32767 < 2^31), so one
 * convert, one scale multiply (weight scale x activation scale) and one fma per token
 * serve 4 rows x 2 groups, where the plain tiles spent them per row and group. The
 * weights' transpose and widening are paid once per step for up to COLI_Q16X_MR tokens.
 * (On AVX-512 the same scheme was slower at one token than the plain tiles: BENCHMARKS.md.)
 *
 * The same bits alone or in any batch: every token, in any tile, any slot of a tile,
 * runs the same operations on its own lanes (integer sums are exact in any order; the
 * float sums run step by step per lane, then over the 2 lanes of a row), and rows past
 * the last 4 are computed in a tile whose missing rows repeat the last one. A last odd
 * group is a step with zeros (weights, scales and arranged activations). */
#define COLI_Q16X_MR 8  /* tokens per tile */
#define COLI_Q16X_NV 17 /* vectors per token and step: 16 broadcast pairs, then the scales */

/* Bytes of coli_q16_arrange's output per token (0 where the plain tiles are used). */
static inline long coli_q16_xe_ld(int M, int K) {
    (void)M;
    int nb = (K + QK - 1) / QK;
    return (long)((nb + COLI_Q16X_G - 1) / COLI_Q16X_G) * COLI_Q16X_NV * COLI_Q16X_V;
}

/* 8 int16 of group g's values 8q .. 8q + 7 (quarter q) in a quantized row (pair order);
 * zeros past the last group. */
static inline __m128i coli_q16_quarter(const int16_t *q, int g, int nb, int qi) {
    if (g >= nb) return _mm_setzero_si128();
    long f = coli_q16_first(g, nb) + (qi < 2 ? 8 * qi : coli_q16_gap(g, nb) + 8 * (qi - 2));
    return _mm_loadu_si128((const __m128i *)(q + f));
}

/* xe (M rows of lde bytes, 32-byte aligned) = the int16 activations of a arranged for the
 * interleaved tiles (see above). */
static inline void coli_q16_arrange(const coli_act16 *a, int M, int K, uint8_t *xe, long lde) {
    int nb = (K + QK - 1) / QK, ns = (nb + COLI_Q16X_G - 1) / COLI_Q16X_G;
    for (int i = 0; i < M; i++) {
        const int16_t *q = a->q + i * a->ldq;
        const float *qd = a->qd + i * a->ldb;
        uint8_t *o = xe + i * lde;
        for (int s = 0; s < ns; s++, o += COLI_Q16X_NV * COLI_Q16X_V) {
            int b = s * COLI_Q16X_G;
            float sc[COLI_Q16X_G * 4];
            for (int L = 0; L < COLI_Q16X_G; L++)
                for (int j = 0; j < 4; j++) sc[4 * L + j] = b + L < nb ? qd[b + L] : 0.0f;
            for (int qi = 0; qi < 4; qi++) { /* pairs 4qi .. 4qi + 3 */
                __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(coli_q16_quarter(q, b, nb, qi)),
                                                    coli_q16_quarter(q, b + 1, nb, qi), 1);
                __m256i *d = (__m256i *)(void *)(o + 4 * qi * COLI_Q16X_V);
                _mm256_store_si256(d + 0, _mm256_shuffle_epi32(x, 0x00));
                _mm256_store_si256(d + 1, _mm256_shuffle_epi32(x, 0x55));
                _mm256_store_si256(d + 2, _mm256_shuffle_epi32(x, 0xAA));
                _mm256_store_si256(d + 3, _mm256_shuffle_epi32(x, 0xFF));
            }
            memcpy(o + (COLI_Q16X_NV - 1) * COLI_Q16X_V, sc, sizeof(sc));
        }
    }
}

typedef __m256i coli_q16v;
typedef __m256 coli_q16f;
/* acc + the pair sums of w * x (int16) in each int32 lane: one vpdpwssd with AVX-VNNI (the
 * avx2vnni path), vpmaddwd + vpaddd otherwise; the same exact integers either way. */
static inline __m256i coli_q16_dot(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}
#define COLI_Q16_LOAD(p) _mm256_load_si256((const __m256i *)(p))
#define COLI_Q16_ZERO() _mm256_setzero_si256()
#define COLI_Q16_FZERO() _mm256_setzero_ps()
#define COLI_Q16_ADD(a, b) _mm256_add_epi32(a, b)
#define COLI_Q16_FMA(d, ws, x, acc) _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(ws, _mm256_load_ps((const float *)(x))), acc)
#define COLI_Q16_UNLO16 _mm256_unpacklo_epi16
#define COLI_Q16_UNHI16 _mm256_unpackhi_epi16
#define COLI_Q16_UNLO32 _mm256_unpacklo_epi32
#define COLI_Q16_UNHI32 _mm256_unpackhi_epi32
#define COLI_Q16_WIDEN_LO(v) _mm256_srai_epi16(_mm256_unpacklo_epi8(v, v), 8)
#define COLI_Q16_WIDEN_HI(v) _mm256_srai_epi16(_mm256_unpackhi_epi8(v, v), 8)

/* Row r's groups b, b + 1 (n <= 2): first halves in A (lane L: group b + L's bytes 0-15),
 * second halves in B; zeros past n. */
static inline void coli_q16x_halves(const int8_t *r, int b, int n, __m256i *A, __m256i *B) {
    const int8_t *p = r + (long)b * QK;
    __m128i a0 = _mm_loadu_si128((const __m128i *)p), b0 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i a1 = n == 2 ? _mm_loadu_si128((const __m128i *)(p + 32)) : _mm_setzero_si128();
    __m128i b1 = n == 2 ? _mm_loadu_si128((const __m128i *)(p + 48)) : _mm_setzero_si128();
    *A = _mm256_inserti128_si256(_mm256_castsi128_si256(a0), a1, 1);
    *B = _mm256_inserti128_si256(_mm256_castsi128_si256(b0), b1, 1);
}

/* lane 4L + j = row j, group b + L (zeros past n) */
static inline __m256 coli_q16x_scales(const uint16_t *const *d, int b, int n) {
    int32_t e[4] = {0, 0, 0, 0};
    for (int j = 0; j < 4; j++) {
        if (n == 2) memcpy(&e[j], d[j] + b, 4);
        else memcpy(&e[j], d[j] + b, 2);
    }
    const __m256i t = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7); /* 2j + L -> 4L + j */
    return _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_set_epi32(e[3], e[2], e[1], e[0])), t);
}

/* row sums: lane j + lane 4 + j */
static inline __m128 coli_q16x_rows(__m256 v) {
    return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}

/* per token: the step's 16 pairs against its broadcast activations */
#define COLI_Q16X_TOKENS(MR)                                                                       \
            coli_q16v S[16];                                                                       \
            for (int p = 0; p < 16; p++)                                                           \
                S[p] = p & 1 ? COLI_Q16_WIDEN_HI(Q[p / 2]) : COLI_Q16_WIDEN_LO(Q[p / 2]);          \
            for (int i = 0; i < MR; i++) {                                                         \
                const uint8_t *o = xs + i * lde;                                                   \
                coli_q16v d[2] = {COLI_Q16_ZERO(), COLI_Q16_ZERO()};                               \
                for (int p = 0; p < 16; p += 2) { /* pair p's activations, broadcast by the arrangement */ \
                    d[0] = coli_q16_dot(d[0], S[p], COLI_Q16_LOAD(o + p * COLI_Q16X_V));             \
                    d[1] = coli_q16_dot(d[1], S[p + 1], COLI_Q16_LOAD(o + (p + 1) * COLI_Q16X_V));   \
                }                                                                                  \
                acc[i] = COLI_Q16_FMA(COLI_Q16_ADD(d[0], d[1]), ws, o + 16 * COLI_Q16X_V, acc[i]);  \
            }

/* The end of a tile: each token's sums of the nr real rows. */
#define COLI_Q16X_END(MR)                                                                          \
        for (int i = 0; i < MR; i++) coli_xt_store(Y + i * ldy, coli_q16x_rows(acc[i]), nr); /* simd_qx.h */

/* MR tokens (arranged activations xe, lde bytes apart) x 4 rows (nr of them real). CH
 * int32 chains per token (two with few tokens, so the multiply-adds' latency overlaps). */
#define COLI_Q16XTILE(MR)                                                                          \
    COLI_SCHED static inline void coli_q16xtile_##MR(const uint8_t *xe, long lde, const int8_t *wq, const uint16_t *wd, \
                                         long ldw, long ldd, int nr, int nb, float *Y, long ldy) { \
        enum { CH = MR <= 2 ? 2 : 1 };                                                             \
        const int8_t *r[4];                                                                        \
        const uint16_t *dr[4];                                                                     \
        for (int j = 0; j < 4; j++) {                                                              \
            int jj = j < nr ? j : nr - 1;                                                          \
            r[j] = wq + jj * ldw;                                                                  \
            dr[j] = wd + jj * ldd;                                                                 \
        }                                                                                          \
        coli_q16f acc[MR];                                                                         \
        for (int i = 0; i < MR; i++) acc[i] = COLI_Q16_FZERO();                                    \
        for (int b = 0, s = 0; b < nb; b += COLI_Q16X_G, s++) {                                    \
            int n = nb - b < COLI_Q16X_G ? nb - b : COLI_Q16X_G;                                   \
            coli_q16v A[4], B[4], Q[8];                                                            \
            for (int j = 0; j < 4; j++) {                                                          \
                _mm_prefetch((const char *)(r[j] + 4 * ldw + b * QK), _MM_HINT_T0);                \
                coli_q16x_halves(r[j], b, n, &A[j], &B[j]);                                        \
            }                                                                                      \
            for (int h = 0; h < 2; h++) { /* pairs 0-7 from A, 8-15 from B */                      \
                const coli_q16v *H = h ? B : A;                                                    \
                coli_q16v lo01 = COLI_Q16_UNLO16(H[0], H[1]), hi01 = COLI_Q16_UNHI16(H[0], H[1]); \
                coli_q16v lo23 = COLI_Q16_UNLO16(H[2], H[3]), hi23 = COLI_Q16_UNHI16(H[2], H[3]); \
                Q[4 * h + 0] = COLI_Q16_UNLO32(lo01, lo23); /* pairs 8h + 0, 1 */                  \
                Q[4 * h + 1] = COLI_Q16_UNHI32(lo01, lo23); /* 2, 3 */                             \
                Q[4 * h + 2] = COLI_Q16_UNLO32(hi01, hi23); /* 4, 5 */                             \
                Q[4 * h + 3] = COLI_Q16_UNHI32(hi01, hi23); /* 6, 7 */                             \
            }                                                                                      \
            coli_q16f ws = coli_q16x_scales(dr, b, n);                                             \
            const uint8_t *xs = xe + (long)s * (COLI_Q16X_NV * COLI_Q16X_V);                       \
            COLI_Q16X_TOKENS(MR)                                                                   \
        }                                                                                          \
        COLI_Q16X_END(MR)                                                                          \
    }

COLI_Q16XTILE(1) COLI_Q16XTILE(2) COLI_Q16XTILE(3) COLI_Q16XTILE(4)
COLI_Q16XTILE(5) COLI_Q16XTILE(6) COLI_Q16XTILE(7) COLI_Q16XTILE(8)

static inline void coli_q16xtile(int mr, const uint8_t *xe, long lde, const int8_t *wq, const uint16_t *wd, long ldw,
                                 long ldd, int nr, int nb, float *Y, long ldy) {
    switch (mr) {
    case 1: coli_q16xtile_1(xe, lde, wq, wd, ldw, ldd, nr, nb, Y, ldy); break; /* same bits as in a batch */
    case 2: coli_q16xtile_2(xe, lde, wq, wd, ldw, ldd, nr, nb, Y, ldy); break;
    case 3: coli_q16xtile_3(xe, lde, wq, wd, ldw, ldd, nr, nb, Y, ldy); break;
    case 4: coli_q16xtile_4(xe, lde, wq, wd, ldw, ldd, nr, nb, Y, ldy); break;
    case 5: coli_q16xtile_5(xe, lde, wq, wd, ldw, ldd, nr, nb, Y, ldy); break;
    case 6: coli_q16xtile_6(xe, lde, wq, wd, ldw, ldd, nr, nb, Y, ldy); break;
    case 7: coli_q16xtile_7(xe, lde, wq, wd, ldw, ldd, nr, nb, Y, ldy); break;
    default: coli_q16xtile_8(xe, lde, wq, wd, ldw, ldd, nr, nb, Y, ldy); break;
    }
}

/* MR tokens x the nr (<= 4) rows of one repacked tile (coli_q8x_pack): the tile above with its
 * step's registers and scales loaded as they lie. */
#define COLI_Q16XTILE_PK(MR)                                                                       \
    COLI_SCHED static inline void coli_q16xtile_pk##MR(const uint8_t *xe, long lde, const uint8_t *pk, int nr, int nb, \
                                            float *Y, long ldy) {                                  \
        coli_q16f acc[MR];                                                                         \
        for (int i = 0; i < MR; i++) acc[i] = COLI_Q16_FZERO();                                    \
        const uint8_t *p = pk;                                                                     \
        for (int s = 0; 2 * s < nb; s++, p += COLI_Q8X_STEP) {                                     \
            coli_q16v Q[8];                                                                        \
            COLI_STREAM_PREFETCH5_BOTH(p, COLI_Q8X_AHEAD)                                               \
            for (int q = 0; q < 8; q++) Q[q] = _mm256_loadu_si256((const __m256i *)(const void *)(p + 32 * q)); \
            coli_q16f ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p + 256))); \
            const uint8_t *xs = xe + (long)s * (COLI_Q16X_NV * COLI_Q16X_V);                       \
            COLI_Q16X_TOKENS(MR)                                                                   \
        }                                                                                          \
        COLI_Q16X_END(MR)                                                                          \
    }

COLI_Q16XTILE_PK(1) COLI_Q16XTILE_PK(2) COLI_Q16XTILE_PK(3) COLI_Q16XTILE_PK(4)
COLI_Q16XTILE_PK(5) COLI_Q16XTILE_PK(6) COLI_Q16XTILE_PK(7) COLI_Q16XTILE_PK(8)

static inline void coli_q16xtile_pk(int mr, const uint8_t *xe, long lde, const uint8_t *pk, int nr, int nb, float *Y,
                                    long ldy) {
    switch (mr) {
    case 1: coli_q16xtile_pk1(xe, lde, pk, nr, nb, Y, ldy); break; /* same bits as in a batch */
    case 2: coli_q16xtile_pk2(xe, lde, pk, nr, nb, Y, ldy); break;
    case 3: coli_q16xtile_pk3(xe, lde, pk, nr, nb, Y, ldy); break;
    case 4: coli_q16xtile_pk4(xe, lde, pk, nr, nb, Y, ldy); break;
    case 5: coli_q16xtile_pk5(xe, lde, pk, nr, nb, Y, ldy); break;
    case 6: coli_q16xtile_pk6(xe, lde, pk, nr, nb, Y, ldy); break;
    case 7: coli_q16xtile_pk7(xe, lde, pk, nr, nb, Y, ldy); break;
    default: coli_q16xtile_pk8(xe, lde, pk, nr, nb, Y, ldy); break;
    }
}
#define COLI_Q8X_TILES 1 /* this path computes on repacked int8 matrices (QMatrix.pack repacks) */

/* ---- many tokens x 8 rows, rows in lanes (AVX2 prefill) ---------------------------------
 * The tiles above broadcast each activation pair over its 128-bit lane in registers
 * (16 vpshufd per token and step, all on the shuffle port) and transpose and widen the
 * weights again for every 8 tokens. From COLI_Q16R_MIN tokens on, coli_gemm_q16 takes these
 * instead: lane j of a vector is weight row j (8 rows) of one group, so an activation pair
 * is one vpbroadcastd straight from the quantized row (a load, no ALU uop), and a block of
 * 8 rows x COLI_Q16R_KC groups is widened and transposed once (coli_q16r_prep, 16 KB, L1)
 * for up to COLI_Q16R_TB tokens. Per token and group: 16 broadcasts, 16 vpmaddwd, 15 vpaddd,
 * then one convert, scale multiply and fma for 8 rows.
 *
 * The same bits as the tiles above, so a token's result does not depend on which kernel M
 * picks: each int32 lane is the same exact group sum, and each row keeps two float sums,
 * its even groups and its odd groups (the tiles' 128-bit lanes 0 and 1), each
 * fma(float(sum), weight scale x activation scale, acc) in group order, added at the end
 * (even + odd); a missing odd group (nb odd) adds the +0 the tiles' zero step adds. */
#ifndef COLI_Q16R_MIN
/* tokens from which coli_gemm_q16 takes the row-lane tiles. One call alone in cache, they were as
 * fast from 4-5 tokens on; in a model's step (SmolLM2-135M int8, 1 thread, thread CPU time) a
 * speculative verification of 6 and 7 tokens took 1.3-1.5x longer on them than on the
 * interleaved tiles (29.9-30.3 ms a step against 41.7-44.8 at 6), 8 about even, 12 even, 16 on
 * faster (71-72 ms against 88-100). The same bits either way. */
#define COLI_Q16R_MIN 9
#endif
#define COLI_Q16R_MR 4    /* tokens per tile: 8 float + 4 int32 accumulators */
#define COLI_Q16R_KC 32   /* groups per widened weight block (8 rows: 16 KB) */
#define COLI_Q16R_TB 64   /* tokens whose partial sums one weight block serves */

/* S[(g * 16 + p) * 8 + j] = pair p (values 2p, 2p + 1, as int16) of row j's group c0 + g,
 * ws[g * 8 + j] = its scale, for g < cn. */
static inline void coli_q16r_prep(const int8_t *const *r, const uint16_t *const *d, int c0, int cn, int32_t *S,
                                  float *ws) {
    for (int g = 0; g < cn; g++) {
        long o = (long)(c0 + g) * QK;
        for (int h = 0; h < 2; h++) { /* pairs 8h .. 8h + 7: an 8 x 8 transpose of dwords */
            __m256i v[8], t[8], u[8];
            for (int j = 0; j < 8; j++) v[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(r[j] + o + 16 * h)));
            for (int j = 0; j < 8; j += 2) {
                t[j] = _mm256_unpacklo_epi32(v[j], v[j + 1]);     /* rows j, j+1: pairs 0, 1 | 4, 5 */
                t[j + 1] = _mm256_unpackhi_epi32(v[j], v[j + 1]); /* 2, 3 | 6, 7 */
            }
            for (int j = 0; j < 8; j += 4) {
                u[j + 0] = _mm256_unpacklo_epi64(t[j], t[j + 2]);     /* rows j .. j+3: pair 0 | 4 */
                u[j + 1] = _mm256_unpackhi_epi64(t[j], t[j + 2]);     /* 1 | 5 */
                u[j + 2] = _mm256_unpacklo_epi64(t[j + 1], t[j + 3]); /* 2 | 6 */
                u[j + 3] = _mm256_unpackhi_epi64(t[j + 1], t[j + 3]); /* 3 | 7 */
            }
            __m256i *s = (__m256i *)(S + (g * 16 + 8 * h) * 8);
            for (int k = 0; k < 4; k++) {
                _mm256_store_si256(s + k, _mm256_permute2x128_si256(u[k], u[k + 4], 0x20));
                _mm256_store_si256(s + k + 4, _mm256_permute2x128_si256(u[k], u[k + 4], 0x31));
            }
        }
        uint16_t e[8];
        for (int j = 0; j < 8; j++) e[j] = d[j][c0 + g];
        _mm256_store_ps(ws + g * 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)e)));
    }
}

/* coli_q16r_prep's block from two repacked tiles (rows 0-3 in ta, 4-7 in tb): each 16 bytes of
 * a step's register are one pair of 4 rows twice (dwords 0-3: pair 8h + 2k, 4-7: the next),
 * so widening them and joining the two tiles' halves gives the block's vectors directly. */
static inline void coli_q16r_prep_pk(const uint8_t *ta, const uint8_t *tb, int c0, int cn, int32_t *S, float *ws) {
    for (int g = 0; g < cn; g++) {
        int G = c0 + g;
        long o = (long)(G / 2) * COLI_Q8X_STEP;
        const uint8_t *a = ta + o + 16 * (G % 2), *b = tb + o + 16 * (G % 2);
        __m256i *s = (__m256i *)(void *)(S + g * 128);
        for (int q = 0; q < 8; q++) { /* q = 4h + k: pairs 8h + 2k, 8h + 2k + 1 */
            __m256i wa = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(a + 32 * q)));
            __m256i wb = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(b + 32 * q)));
            int p0 = 8 * (q / 4) + 2 * (q % 4);
            _mm256_store_si256(s + p0, _mm256_permute2x128_si256(wa, wb, 0x20));
            _mm256_store_si256(s + p0 + 1, _mm256_permute2x128_si256(wa, wb, 0x31));
        }
        __m128i e = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(const void *)(ta + o + 256 + 8 * (G % 2))),
                                       _mm_loadl_epi64((const __m128i *)(const void *)(tb + o + 256 + 8 * (G % 2))));
        _mm256_store_ps(ws + g * 8, _mm256_cvtph_ps(e));
    }
}

/* The int32 sums stay one chain per token in a register: left alone, gcc reassociates the
 * 16 adds into a tree and spills the 64 products to the stack. */
#if defined(__GNUC__)
#define COLI_Q16R_KEEP(v) __asm__("" : "+x"(v))
#else
#define COLI_Q16R_KEEP(v) (void)0
#endif
/* one group b (block group g) of MR tokens into their accumulators acc[i][K] */
#define COLI_Q16R_GROUP(MR, K)                                                                     \
    {                                                                                              \
        int b = c0 + g;                                                                            \
        long f = coli_q16_first(b, nb), h = f + coli_q16_gap(b, nb) - 16;                          \
        const __m256i *s = (const __m256i *)(S + g * 128);                                         \
        __m256i d[MR];                                                                             \
        for (int i = 0; i < MR; i++) d[i] = _mm256_setzero_si256();                                \
        _Pragma("GCC unroll 16") for (int p = 0; p < 16; p++) {                                    \
            __m256i w = _mm256_load_si256(s + p);                                                  \
            long off = p < 8 ? f + 2 * p : h + 2 * p;                                              \
            for (int i = 0; i < MR; i++) {                                                         \
                int32_t x2;                                                                        \
                memcpy(&x2, q + i * ldq + off, 4);                                                 \
                d[i] = coli_q16_dot(d[i], w, _mm256_set1_epi32(x2));                              \
                COLI_Q16R_KEEP(d[i]);                                                              \
            }                                                                                      \
        }                                                                                          \
        __m256 wsc = _mm256_load_ps(ws + g * 8);                                                   \
        for (int i = 0; i < MR; i++)                                                               \
            acc[i][K] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[i]), _mm256_mul_ps(wsc, _mm256_broadcast_ss(qd + i * ldb + b)), \
                                        acc[i][K]);                                                \
    }

/* MR tokens (int16 rows q, ldq apart; scales qd, ldb apart) x the 8 rows of a prepared
 * block of groups c0 .. c0 + cn of nb (c0 even): the partial sums A[i * 16 ..] (even
 * groups' 8 rows, then odd groups') go on from A (or from zero with first), and with last
 * the rows' sums go to Y[i * ldy + j], j < nr, instead. */
#define COLI_Q16RTILE(MR)                                                                          \
    static inline void coli_q16rtile_##MR(const int16_t *q, long ldq, const float *qd, long ldb, const int32_t *S, \
                                         const float *ws, int c0, int cn, int nb, float *A, int first, int last, \
                                         int nr, float *Y, long ldy) {                             \
        __m256 acc[MR][2];                                                                         \
        for (int i = 0; i < MR; i++)                                                               \
            for (int k = 0; k < 2; k++) acc[i][k] = first ? _mm256_setzero_ps() : _mm256_load_ps(A + i * 16 + 8 * k); \
        int g = 0;                                                                                 \
        for (; g + 2 <= cn; g++) {                                                                 \
            COLI_Q16R_GROUP(MR, 0)                                                                 \
            g++;                                                                                   \
            COLI_Q16R_GROUP(MR, 1)                                                                 \
        }                                                                                          \
        if (g < cn) COLI_Q16R_GROUP(MR, 0)                                                         \
        if (!last) {                                                                               \
            for (int i = 0; i < MR; i++)                                                           \
                for (int k = 0; k < 2; k++) _mm256_store_ps(A + i * 16 + 8 * k, acc[i][k]);        \
            return;                                                                                \
        }                                                                                          \
        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); \
        for (int i = 0; i < MR; i++) { /* a masked store: no copy through the stack (simd_qx.h, coli_xt_store) */ \
            __m256 odd = nb & 1 ? _mm256_add_ps(acc[i][1], _mm256_setzero_ps()) : acc[i][1];       \
            _mm256_maskstore_ps(Y + i * ldy, keep, _mm256_add_ps(acc[i][0], odd));                 \
        }                                                                                          \
    }

COLI_Q16RTILE(1) COLI_Q16RTILE(2) COLI_Q16RTILE(3) COLI_Q16RTILE(4)

/* Y[m, n] = dot(act row m, W row n) for m < M, n < N (W: rows wq / wd, ldw / ldd apart, or
 * repacked tiles pk, pks bytes apart, from row 0): the row-lane tiles, 8 rows x up to
 * COLI_Q16R_TB tokens x COLI_Q16R_KC groups per block. */
static inline void coli_gemm_q16r(const coli_act16 *a, int M, const int8_t *wq, const uint16_t *wd, long ldw,
                                  long ldd, const uint8_t *pk, long pks, int N, int nb, float *Y, long ldy) {
    enum { KC = COLI_Q16R_KC, TB = COLI_Q16R_TB, MR = COLI_Q16R_MR };
    _Alignas(32) int32_t S[KC * 128];
    _Alignas(32) float ws[KC * 8];
    _Alignas(32) float A[TB * 16];
    for (int n = 0; n < N; n += 8) {
        int nr = N - n < 8 ? N - n : 8;
        const int8_t *r[8];
        const uint16_t *dr[8];
        const uint8_t *ta = pk ? pk + (n / 4) * pks : NULL, *tb = pk && nr > 4 ? ta + pks : ta;
        for (int j = 0; j < 8 && !pk; j++) { /* rows past nr repeat the last one; dropped at the end */
            long jj = n + (j < nr ? j : nr - 1);
            r[j] = wq + jj * ldw;
            dr[j] = wd + jj * ldd;
        }
        for (int t0 = 0; t0 < M; t0 += TB) {
            int tn = M - t0 < TB ? M - t0 : TB;
            for (int c0 = 0; c0 < nb; c0 += KC) {
                int cn = nb - c0 < KC ? nb - c0 : KC, first = c0 == 0, last = c0 + cn == nb;
                if (pk)
                    coli_q16r_prep_pk(ta, tb, c0, cn, S, ws);
                else
                    coli_q16r_prep(r, dr, c0, cn, S, ws);
                for (int t = 0; t < tn; t += MR) {
                    const int16_t *q = a->q + (long)(t0 + t) * a->ldq;
                    const float *qd = a->qd + (long)(t0 + t) * a->ldb;
                    float *y = Y + (long)(t0 + t) * ldy + n, *acc = A + t * 16;
                    switch (tn - t < MR ? tn - t : MR) {
                    case 1: coli_q16rtile_1(q, a->ldq, qd, a->ldb, S, ws, c0, cn, nb, acc, first, last, nr, y, ldy); break;
                    case 2: coli_q16rtile_2(q, a->ldq, qd, a->ldb, S, ws, c0, cn, nb, acc, first, last, nr, y, ldy); break;
                    case 3: coli_q16rtile_3(q, a->ldq, qd, a->ldb, S, ws, c0, cn, nb, acc, first, last, nr, y, ldy); break;
                    default: coli_q16rtile_4(q, a->ldq, qd, a->ldb, S, ws, c0, cn, nb, acc, first, last, nr, y, ldy); break;
                    }
                }
            }
        }
    }
}

/* Y[m, n] = dot(act row m, W row n0 + n) for n < nb, W int8 (COLI_Q8), int16 activations
 * arranged (a->xe); 4 rows x up to 8 tokens per tile, each block of 4 weight rows read
 * once for all M tokens. K: logical columns. */
static inline void coli_gemm_q16(const coli_act16 *a, int M, const coli_mat *W, int n0, int nb, int K, float *Y,
                                 long ldy) {
    int ngroups = (K + QK - 1) / QK;
    if (W->pk != NULL) { /* repacked (n0 a multiple of 4) */
        const uint8_t *pk = W->pk + (n0 / 4) * W->pks;
        if (M >= COLI_Q16R_MIN) {
            coli_gemm_q16r(a, M, NULL, NULL, 0, 0, pk, W->pks, nb, ngroups, Y + n0, ldy);
            return;
        }
        for (int n = 0; n < nb; n += 4) {
            int nr = nb - n < 4 ? nb - n : 4;
            for (int m = 0; m < M; m += COLI_Q16X_MR) {
                int mr = M - m < COLI_Q16X_MR ? M - m : COLI_Q16X_MR;
                coli_q16xtile_pk(mr, a->xe + (long)m * a->lde, a->lde, pk + (n / 4) * W->pks, nr, ngroups,
                                 Y + (long)m * ldy + n0 + n, ldy);
            }
        }
        return;
    }
    const int8_t *wq = (const int8_t *)W->w + (long)n0 * W->ldw;
    const uint16_t *wd = W->d + (long)n0 * W->ldd;
    if (M >= COLI_Q16R_MIN) {
        coli_gemm_q16r(a, M, wq, wd, W->ldw, W->ldd, NULL, 0, nb, ngroups, Y + n0, ldy);
        return;
    }
    for (int n = 0; n < nb; n += 4) {
        int nr = nb - n < 4 ? nb - n : 4;
        for (int m = 0; m < M; m += COLI_Q16X_MR) {
            int mr = M - m < COLI_Q16X_MR ? M - m : COLI_Q16X_MR;
            coli_q16xtile(mr, a->xe + (long)m * a->lde, a->lde, wq + (long)n * W->ldw, wd + (long)n * W->ldd, W->ldw,
                          W->ldd, nr, ngroups, Y + (long)m * ldy + n0 + n, ldy);
        }
    }
}
#elif defined(COLI_NEON)
#include "simd_q16_neon.h"
#else

/* Scalar fallback: MR tokens x NR rows, one pair at a time (each token's sums in the same
 * order in any tile). */
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

#ifndef COLI_Q8X_TILES
#define COLI_Q8X_TILES 0 /* int8 keeps its rows on this path */
#endif
#if !defined(COLI_Q16X) && !defined(COLI_Q16V)
/* The plain tiles (AVX-512, scalar): no arranged activations. */
static inline long coli_q16_xe_ld(int M, int K) { (void)M; (void)K; return 0; }
static inline void coli_q16_arrange(const coli_act16 *a, int M, int K, uint8_t *xe, long lde) {
    (void)a; (void)M; (void)K; (void)xe; (void)lde;
}

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
#endif

/* Whether coli_gemm_q16 reads the arrangement (a->xe) for a GEMM of M tokens: on AVX2 not
 * from COLI_Q16R_MIN tokens on (the row-lane tiles read the int16 rows), so a qlinear call
 * of that many skips arranging them; elsewhere the tiles that arrange read it at any M. */
static inline int coli_q16_xe_used(int M) {
#if defined(COLI_Q16X)
    return M < COLI_Q16R_MIN;
#else
    (void)M;
    return 1;
#endif
}

#endif /* COLI_SIMD_Q16_H */
