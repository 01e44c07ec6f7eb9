/* int8 weights x int16 activations on 64-bit ARM: simd_q16.h's COLI_Q16TILE for NEON
 * (included from there when COLI_NEON; every ARM path, neon, neondot and neoni8mm, runs
 * these: sdot and smmla multiply int8 only).
 *
 * One group per step. Each of the NR rows' 32 int8 weights is widened once to four int16x8
 * (sxtl) and used by the MR tokens; a group's dot product with a token's 32 int16
 * activations (its halves where coli_q16_first / coli_q16_gap say) is one chain of smull /
 * smlal2 / smlal / smlal2 ... into an int32x4 (a lane sums 8 products, |sum| < 2^25). The
 * NR rows' chains are reduced pairwise (addp) into one int32x4, lane j the group's exact
 * int32 sum for row j, converted to float and scaled as the scalar tile does, lane by lane:
 *
 *     acc[j] = acc[j] + (float)sum[j] * (weight scale[j] * activation scale)
 *
 * a multiply, then an add (no fused multiply-add: setup.py compiles the scalar tile's C with
 * -ffp-contract=off, so neither GCC nor clang fuses that expression), groups in order. So every output has the
 * bits of the scalar tile's, whatever MR, NR and the other tokens of the call: a token gets
 * the same bits alone, in a batch or in a speculative verification. MR = 3 and 4 run as 2 + 1 and
 * 2 + 2 tokens: the 16 widened weight vectors, a token's 4 activation vectors, its 4 chains
 * and accumulators fill most of the 32 registers at 2 tokens. */
#ifndef COLI_SIMD_Q16_NEON_H
#define COLI_SIMD_Q16_NEON_H

/* the 32 int8 weights at p as int16: w[0] elements 0-7, w[1] 8-15, w[2] 16-23, w[3] 24-31 */
static inline void coli_q16_wgroup_neon(const int8_t *p, int16x8_t *w) {
    int8x16_t lo = vld1q_s8(p), hi = vld1q_s8(p + 16);
    w[0] = vmovl_s8(vget_low_s8(lo));
    w[1] = vmovl_high_s8(lo);
    w[2] = vmovl_s8(vget_low_s8(hi));
    w[3] = vmovl_high_s8(hi);
}

/* int32 lanes whose sum is dot(w, x) over 32 int16 pairs */
static inline int32x4_t coli_q16_dot_neon(const int16x8_t *w, const int16x8_t *x) {
    int32x4_t s = vmull_s16(vget_low_s16(w[0]), vget_low_s16(x[0]));
    s = vmlal_high_s16(s, w[0], x[0]);
    s = vmlal_s16(s, vget_low_s16(w[1]), vget_low_s16(x[1]));
    s = vmlal_high_s16(s, w[1], x[1]);
    s = vmlal_s16(s, vget_low_s16(w[2]), vget_low_s16(x[2]));
    s = vmlal_high_s16(s, w[2], x[2]);
    s = vmlal_s16(s, vget_low_s16(w[3]), vget_low_s16(x[3]));
    return vmlal_high_s16(s, w[3], x[3]);
}

#define COLI_Q16TILE_NEON(MR, NR)                                                                  \
    static inline void coli_q16tile_##MR##x##NR(const coli_act16 *a, const int8_t *wq, const uint16_t *wd, \
                                                long ldw, long ldd, int nb, float *Y, long ldy) {  \
        float32x4_t acc[MR]; /* lane j: row j */                                                   \
        for (int i = 0; i < MR; i++) acc[i] = vdupq_n_f32(0.0f);                                   \
        for (int b = 0; b < nb; b++) {                                                             \
            int16x8_t w[NR][4];                                                                    \
            for (int j = 0; j < NR; j++) coli_q16_wgroup_neon(wq + j * ldw + b * QK, w[j]);        \
            float32x4_t dw = coli_wscales_neon(wd, ldd, b, NR); /* simd_q_neon.h */             \
            long f = coli_q16_first(b, nb);                                                        \
            int g = coli_q16_gap(b, nb);                                                           \
            for (int i = 0; i < MR; i++) {                                                         \
                const int16_t *xp = a->q + i * a->ldq + f;                                         \
                int16x8_t x[4] = {vld1q_s16(xp), vld1q_s16(xp + 8), vld1q_s16(xp + g), vld1q_s16(xp + g + 8)}; \
                int32x4_t s[4];                                                                    \
                for (int j = 0; j < 4; j++) s[j] = j < NR ? coli_q16_dot_neon(w[j < NR ? j : 0], x) : vdupq_n_s32(0); \
                int32x4_t sum = vpaddq_s32(vpaddq_s32(s[0], s[1]), vpaddq_s32(s[2], s[3]));       \
                float32x4_t sc = vmulq_n_f32(dw, a->qd[i * a->ldb + b]);                           \
                acc[i] = vaddq_f32(acc[i], vmulq_f32(vcvtq_f32_s32(sum), sc));                     \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < MR; i++) {                                                             \
            float y[4];                                                                            \
            vst1q_f32(y, acc[i]);                                                                  \
            for (int j = 0; j < NR; j++) Y[i * ldy + j] = y[j];                                    \
        }                                                                                          \
    }

/* 2 + (MR - 2) tokens */
#define COLI_Q16TILE_SPLIT(MR, NR, MR2)                                                            \
    static inline void coli_q16tile_##MR##x##NR(const coli_act16 *a, const int8_t *wq, const uint16_t *wd, \
                                                long ldw, long ldd, int nb, float *Y, long ldy) {  \
        coli_q16tile_2x##NR(a, wq, wd, ldw, ldd, nb, Y, ldy);                                      \
        coli_act16 rest = *a;                                                                      \
        rest.q += 2 * a->ldq;                                                                      \
        rest.qd += 2 * a->ldb;                                                                     \
        coli_q16tile_##MR2##x##NR(&rest, wq, wd, ldw, ldd, nb, Y + 2 * ldy, ldy);                  \
    }
#define COLI_Q16TILE_NEON_1(NR) COLI_Q16TILE_NEON(1, NR)
#define COLI_Q16TILE_NEON_2(NR) COLI_Q16TILE_NEON(2, NR)
#define COLI_Q16TILE_NEON_3(NR) COLI_Q16TILE_SPLIT(3, NR, 1)
#define COLI_Q16TILE_NEON_4(NR) COLI_Q16TILE_SPLIT(4, NR, 2)
#define COLI_Q16TILE(MR, NR) COLI_Q16TILE_NEON_##MR(NR)

#endif /* COLI_SIMD_Q16_NEON_H */
