/* The quantized tiles of simd_q.h for 64-bit ARM (included from there when COLI_NEON).
 *
 * Same contract as the other paths' COLI_QTILE: MR tokens x NR weight rows of Y = X . W^T
 * for the symmetric int4 (Q4, int4s) and asymmetric int4 (Q4A, int4) formats, against
 * activations quantized to int8 groups of 32 (coli_act). One group (32 weights) per step:
 * the NR rows' weights are loaded and unpacked once and used by all MR tokens. (int8
 * weights take int16 activations: their NEON tiles are in simd_q16_neon.h; the int8 x int8
 * case of coli_gemm_any, which the engine does not call, is simd_q.h's plain C.)
 *
 *   int8 x int8 dot of a group   sdot (vdotq_s32) when compiled with +dotprod
 *                                (__ARM_FEATURE_DOTPROD: Apple M1+, Graviton 2+, Cortex-A55/
 *                                A76+); otherwise smull/smlal2 into int16 (a product is at
 *                                most 128 * 127, two of them fit) and sadalp into int32.
 *   2 tokens x 2 rows at once    smmla (vmmlaq_s32) when compiled with +i8mm
 *                                (__ARM_FEATURE_MATMUL_INT8: Graviton 3+, Apple M2+): one
 *                                instruction gives the four dot products of 8 bytes of 2
 *                                tokens with 8 bytes of 2 rows, so tiles with MR, NR >= 2 do
 *                                half the multiply instructions of sdot.
 *   int4 unpack                  and 0x0F / shift right 4 of a group's 16 bytes gives its
 *                                elements 0-15 / 16-31; int4s (Q4) subtracts its offset 8
 *                                from the nibbles (codes -8..7) before the dot; int4 (Q4A)
 *                                adds its mins' term m * (activation scale * sum) per group,
 *                                summed over the row at the end, 4 groups at a time.
 * Per group, the int32 lanes are converted to float and multiplied by the weight scale times
 * the activation scale into a float32x4 accumulator (fmla); one horizontal sum per output. */
#ifndef COLI_SIMD_Q_NEON_H
#define COLI_SIMD_Q_NEON_H

/* int32 lanes whose sum is dot(w0, x0) + dot(w1, x1) over 16 + 16 int8 pairs */
static inline int32x4_t coli_dot32_neon(int8x16_t w0, int8x16_t x0, int8x16_t w1, int8x16_t x1) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(vdotq_s32(vdupq_n_s32(0), w0, x0), w1, x1);
#else
    int16x8_t p0 = vmlal_high_s8(vmull_s8(vget_low_s8(w0), vget_low_s8(x0)), w0, x0);
    int16x8_t p1 = vmlal_high_s8(vmull_s8(vget_low_s8(w1), vget_low_s8(x1)), w1, x1);
    return vpadalq_s16(vpaddlq_s16(p0), p1);
#endif
}

/* The 32 int4 weights of group b of a row as two int8x16 (elements 0-15, 16-31); is4: 1
 * symmetric (Q4), 2 asymmetric (Q4A). */
static inline void coli_wgroup_neon(int is4, const uint8_t *row, int b, int8x16_t *w0, int8x16_t *w1) {
    uint8x16_t raw = vld1q_u8(row + b * 16);
    int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0F)));
    int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));
    if (is4 == 1) { /* symmetric: codes 0..15 stand for -8..7 */
        lo = vsubq_s8(lo, vdupq_n_s8(8));
        hi = vsubq_s8(hi, vdupq_n_s8(8));
    }
    *w0 = lo, *w1 = hi;
}

/* sum over groups b < n of m[b] * qd[b] * qs[b]: the mins' term of one row of Q4A. */
static inline float coli_min_term_neon(const uint16_t *m, const float *qd, const int32_t *qs, int n) {
    float32x4_t acc = vdupq_n_f32(0.0f);
    int b = 0;
    for (; b + 4 <= n; b += 4) {
        float32x4_t mv = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(m + b)));
        acc = vfmaq_f32(acc, mv, vmulq_f32(vld1q_f32(qd + b), vcvtq_f32_s32(vld1q_s32(qs + b))));
    }
    float s = vaddvq_f32(acc);
    for (; b < n; b++) s += coli_f16_to_f32(m[b]) * (qd[b] * (float)qs[b]);
    return s;
}

/* a + b * lane j of c (j a constant once the tiles' loops are unrolled) */
static inline float32x4_t coli_fma_lane_neon(float32x4_t a, float32x4_t b, float32x4_t c, int j) {
    switch (j) {
    case 0: return vfmaq_laneq_f32(a, b, c, 0);
    case 1: return vfmaq_laneq_f32(a, b, c, 1);
    case 2: return vfmaq_laneq_f32(a, b, c, 2);
    default: return vfmaq_laneq_f32(a, b, c, 3);
    }
}

/* The float scales of group b of NR <= 4 rows (wd + j * ldd + b) in lanes 0..NR-1. */
static inline float32x4_t coli_wscales_neon(const uint16_t *wd, long ldd, int b, int nr) {
    uint16x4_t h = vdup_n_u16(0);
    h = vld1_lane_u16(wd + b, h, 0);
    if (nr > 1) h = vld1_lane_u16(wd + ldd + b, h, 1);
    if (nr > 2) h = vld1_lane_u16(wd + 2 * ldd + b, h, 2);
    if (nr > 3) h = vld1_lane_u16(wd + 3 * ldd + b, h, 3);
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
}

/* MR tokens x NR rows, one group per step (sdot or smull). The NR rows' scales travel in one
 * vector, times the token's activation scale per token, and are applied by lane (fmla by
 * element): 16 accumulators, 8 weight vectors and 2 activation vectors leave the 4 x 4 tile
 * enough of the 32 registers. */
#define COLI_QTILE_NEON(NAME, IS4, MR, NR)                                                         \
    static inline void NAME##_##MR##x##NR(const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                          long ldw, long ldd, int nb, float *Y, long ldy) {         \
        float32x4_t acc[MR][NR];                                                                   \
        for (int i = 0; i < MR; i++)                                                               \
            for (int j = 0; j < NR; j++) acc[i][j] = vdupq_n_f32(0.0f);                            \
        for (int b = 0; b < nb; b++) {                                                             \
            int8x16_t w0[NR], w1[NR];                                                              \
            for (int j = 0; j < NR; j++) coli_wgroup_neon(IS4, wq + j * ldw, b, &w0[j], &w1[j]);   \
            float32x4_t dw = coli_wscales_neon(wd, ldd, b, NR);                                    \
            for (int i = 0; i < MR; i++) {                                                         \
                const int8_t *xp = a->q + i * a->ldq + b * 32;                                     \
                int8x16_t x0 = vld1q_s8(xp), x1 = vld1q_s8(xp + 16);                               \
                float32x4_t sc = vmulq_n_f32(dw, a->qd[i * a->ldb + b]);                           \
                for (int j = 0; j < NR; j++)                                                       \
                    acc[i][j] = coli_fma_lane_neon(acc[i][j], vcvtq_f32_s32(coli_dot32_neon(w0[j], x0, w1[j], x1)), \
                                                   sc, j);                                         \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < MR; i++)                                                               \
            for (int j = 0; j < NR; j++) {                                                         \
                float s = vaddvq_f32(acc[i][j]);                                                   \
                if (IS4 == 2)                                                                      \
                    s += coli_min_term_neon(wm + j * ldd, a->qd + i * a->ldb, a->qs + i * a->ldb, nb); \
                Y[i * ldy + j] = s;                                                                \
            }                                                                                      \
    }

/* MR = 3 or 4 tokens as 2 + (MR - 2): with 4 tokens, the 16 accumulators, 8 weight vectors
 * and the temporaries of the dot products do not fit the 32 registers (GCC spilled about
 * 50 vectors per tile), while a 2-token tile fits and rereads its weights from L1. */
#define COLI_QTILE_SPLIT(NAME, MR, NR, MR2)                                                        \
    static inline void NAME##_##MR##x##NR(const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                          long ldw, long ldd, int nb, float *Y, long ldy) {         \
        NAME##_2x##NR(a, wq, wd, wm, ldw, ldd, nb, Y, ldy);                                         \
        coli_act rest = *a;                                                                        \
        rest.q += 2 * a->ldq;                                                                      \
        rest.qd += 2 * a->ldb;                                                                     \
        rest.qs += 2 * a->ldb;                                                                     \
        NAME##_##MR2##x##NR(&rest, wq, wd, wm, ldw, ldd, nb, Y + 2 * ldy, ldy);                     \
    }
#define COLI_QTILE_DOT_1(NAME, IS4, MR, NR) COLI_QTILE_NEON(NAME, IS4, MR, NR)
#define COLI_QTILE_DOT_2(NAME, IS4, MR, NR) COLI_QTILE_NEON(NAME, IS4, MR, NR)
#define COLI_QTILE_DOT_3(NAME, IS4, MR, NR) COLI_QTILE_SPLIT(NAME, MR, NR, 1)
#define COLI_QTILE_DOT_4(NAME, IS4, MR, NR) COLI_QTILE_SPLIT(NAME, MR, NR, 2)

#if defined(__ARM_FEATURE_MATMUL_INT8)
/* 2 tokens x 2 rows per smmla. For a group, token pair (i, i+1) and row pair (j, j+1):
 * xz[c] holds bytes 8c..8c+7 of token i then of token i+1, wz[c] the same of rows j and
 * j+1; vmmlaq_s32 accumulates (x_i.w_j, x_i.w_j+1, x_i+1.w_j, x_i+1.w_j+1) over those 8
 * bytes, four times per group. The group's int32 results are scaled by
 * (dx_i dw_j, dx_i dw_j+1, dx_i+1 dw_j, dx_i+1 dw_j+1) into a float32x4 per block. Odd MR or
 * NR go through the sdot tile (MR2, NR2 even here). */
#define COLI_QTILE_MMLA(NAME, IS4, MR2, NR2)                                                       \
    static inline void NAME##_##MR2##x##NR2(const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                            long ldw, long ldd, int nb, float *Y, long ldy) {       \
        float32x4_t acc[MR2 / 2][NR2 / 2];                                                         \
        for (int i = 0; i < MR2 / 2; i++)                                                          \
            for (int j = 0; j < NR2 / 2; j++) acc[i][j] = vdupq_n_f32(0.0f);                       \
        for (int b = 0; b < nb; b++) {                                                             \
            int8x16_t wz[NR2 / 2][4];                                                              \
            float32x4_t dwv[NR2 / 2]; /* (dw_j, dw_j+1, dw_j, dw_j+1) */                           \
            for (int j = 0; j < NR2 / 2; j++) {                                                    \
                int8x16_t p0, p1, q0, q1;                                                          \
                coli_wgroup_neon(IS4, wq + (2 * j) * ldw, b, &p0, &p1);                            \
                coli_wgroup_neon(IS4, wq + (2 * j + 1) * ldw, b, &q0, &q1);                        \
                wz[j][0] = vreinterpretq_s8_s64(vzip1q_s64(vreinterpretq_s64_s8(p0), vreinterpretq_s64_s8(q0))); \
                wz[j][1] = vreinterpretq_s8_s64(vzip2q_s64(vreinterpretq_s64_s8(p0), vreinterpretq_s64_s8(q0))); \
                wz[j][2] = vreinterpretq_s8_s64(vzip1q_s64(vreinterpretq_s64_s8(p1), vreinterpretq_s64_s8(q1))); \
                wz[j][3] = vreinterpretq_s8_s64(vzip2q_s64(vreinterpretq_s64_s8(p1), vreinterpretq_s64_s8(q1))); \
                float d0 = coli_f16_to_f32(wd[(2 * j) * ldd + b]), d1 = coli_f16_to_f32(wd[(2 * j + 1) * ldd + b]); \
                float dd[4] = {d0, d1, d0, d1};                                                    \
                dwv[j] = vld1q_f32(dd);                                                            \
            }                                                                                      \
            for (int i = 0; i < MR2 / 2; i++) {                                                    \
                const int8_t *x0p = a->q + (2 * i) * a->ldq + b * 32, *x1p = x0p + a->ldq;         \
                int64x2_t u0 = vreinterpretq_s64_s8(vld1q_s8(x0p)), u1 = vreinterpretq_s64_s8(vld1q_s8(x0p + 16)); \
                int64x2_t v0 = vreinterpretq_s64_s8(vld1q_s8(x1p)), v1 = vreinterpretq_s64_s8(vld1q_s8(x1p + 16)); \
                int8x16_t xz0 = vreinterpretq_s8_s64(vzip1q_s64(u0, v0)), xz1 = vreinterpretq_s8_s64(vzip2q_s64(u0, v0)); \
                int8x16_t xz2 = vreinterpretq_s8_s64(vzip1q_s64(u1, v1)), xz3 = vreinterpretq_s8_s64(vzip2q_s64(u1, v1)); \
                float e0 = a->qd[(2 * i) * a->ldb + b], e1 = a->qd[(2 * i + 1) * a->ldb + b];       \
                float ee[4] = {e0, e0, e1, e1};                                                    \
                float32x4_t dxv = vld1q_f32(ee);                                                   \
                for (int j = 0; j < NR2 / 2; j++) {                                                \
                    int32x4_t d = vmmlaq_s32(vdupq_n_s32(0), xz0, wz[j][0]);                       \
                    d = vmmlaq_s32(d, xz1, wz[j][1]);                                              \
                    d = vmmlaq_s32(d, xz2, wz[j][2]);                                              \
                    d = vmmlaq_s32(d, xz3, wz[j][3]);                                              \
                    acc[i][j] = vfmaq_f32(acc[i][j], vcvtq_f32_s32(d), vmulq_f32(dwv[j], dxv));    \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < MR2 / 2; i++)                                                          \
            for (int j = 0; j < NR2 / 2; j++) {                                                    \
                float s[4];                                                                        \
                vst1q_f32(s, acc[i][j]);                                                           \
                for (int t = 0; t < 4; t++) {                                                      \
                    int ii = 2 * i + t / 2, jj = 2 * j + t % 2;                                    \
                    if (IS4 == 2)                                                                  \
                        s[t] += coli_min_term_neon(wm + jj * ldd, a->qd + ii * a->ldb, a->qs + ii * a->ldb, nb); \
                    Y[ii * ldy + jj] = s[t];                                                       \
                }                                                                                  \
            }                                                                                      \
    }
/* the tile for MR x NR: smmla when both are even, else sdot (or smull); the pasted
 * COLI_QTILE_EVEN_MR_NR names which */
#define COLI_QTILE_INT4(NAME, IS4, MR, NR) COLI_QTILE_PICK(NAME, IS4, MR, NR, COLI_QTILE_EVEN_##MR##_##NR)
#define COLI_QTILE_PICK(NAME, IS4, MR, NR, EVEN) COLI_QTILE_PICK_(NAME, IS4, MR, NR, EVEN)
#define COLI_QTILE_PICK_(NAME, IS4, MR, NR, EVEN) COLI_QTILE_##EVEN(NAME, IS4, MR, NR)
#define COLI_QTILE_MMLA2(NAME, IS4, MR, NR) COLI_QTILE_MMLA(NAME, IS4, MR, NR)
#define COLI_QTILE_DOT(NAME, IS4, MR, NR) COLI_QTILE_DOT_##MR(NAME, IS4, MR, NR)
#define COLI_QTILE_EVEN_1_1 DOT
#define COLI_QTILE_EVEN_1_2 DOT
#define COLI_QTILE_EVEN_1_3 DOT
#define COLI_QTILE_EVEN_1_4 DOT
#define COLI_QTILE_EVEN_2_1 DOT
#define COLI_QTILE_EVEN_2_2 MMLA2
#define COLI_QTILE_EVEN_2_3 DOT
#define COLI_QTILE_EVEN_2_4 MMLA2
#define COLI_QTILE_EVEN_3_1 DOT
#define COLI_QTILE_EVEN_3_2 DOT
#define COLI_QTILE_EVEN_3_3 DOT
#define COLI_QTILE_EVEN_3_4 DOT
#define COLI_QTILE_EVEN_4_1 DOT
#define COLI_QTILE_EVEN_4_2 MMLA2
#define COLI_QTILE_EVEN_4_3 DOT
#define COLI_QTILE_EVEN_4_4 MMLA2
#else
#define COLI_QTILE_INT4(NAME, IS4, MR, NR) COLI_QTILE_DOT_##MR(NAME, IS4, MR, NR)
#endif

#define COLI_QTILE(NAME, IS4, MR, NR) COLI_QTILE_NEON_##IS4(NAME, MR, NR)
#define COLI_QTILE_NEON_1(NAME, MR, NR) COLI_QTILE_INT4(NAME, 1, MR, NR)
#define COLI_QTILE_NEON_2(NAME, MR, NR) COLI_QTILE_INT4(NAME, 2, MR, NR)

#endif /* COLI_SIMD_Q_NEON_H */
