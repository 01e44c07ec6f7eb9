/* SIMD building blocks for the fp32 kernels of coli._engine.kernels.
 *
 * One vector abstraction (cv_*) picked at compile time: AVX-512F, AVX2+FMA, or a
 * scalar fallback. setup.py compiles the kernels once per SIMD path (avx512vnni,
 * avx512, avx2, scalar: each its own module with its own -m flags) and
 * coli/_engine/dispatch.py loads the one the CPU has at run time.
 *
 * The central primitive is coli_gemm_nt: Y[m, n] = dot(X[m, :K], W[n, :K]) for a
 * block of rows of a row-major weight W[N, K] (PyTorch's Linear layout, so the
 * checkpoint's tensors are used as mapped, never transposed). It is register
 * tiled 4 tokens x 4 weight rows: each weight vector loaded is used for up to 4
 * tokens, each activation vector for 4 weight rows. Callers split N across
 * threads; this function is single-threaded and allocates nothing.
 */
#ifndef COLI_SIMD_H
#define COLI_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
/* 64-bit ARM (Apple Silicon, Graviton, Ampere, Raspberry Pi 4/5): Advanced SIMD (NEON) is
 * part of the baseline, so every aarch64 build has it; COLI_NO_NEON (setup.py's "scalar"
 * module there) turns it off. sdot (__ARM_FEATURE_DOTPROD) and smmla
 * (__ARM_FEATURE_MATMUL_INT8) are used by the quantized tiles when the module is compiled
 * for them (simd_q_neon.h). */
#if defined(__ARM_NEON) && defined(__aarch64__) && !defined(COLI_NO_NEON)
#define COLI_NEON 1
#include <arm_neon.h>
#endif

#if defined(__AVX512F__)
#define CV_W 16
typedef __m512 cv_t;
#define cv_zero() _mm512_setzero_ps()
#define cv_load(p) _mm512_loadu_ps(p)
#define cv_store(p, v) _mm512_storeu_ps(p, v)
#define cv_set1(a) _mm512_set1_ps(a)
#define cv_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define cv_mul(a, b) _mm512_mul_ps(a, b)
static inline float cv_sum(cv_t v) { return _mm512_reduce_add_ps(v); }
#define COLI_SIMD_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define CV_W 8
typedef __m256 cv_t;
#define cv_zero() _mm256_setzero_ps()
#define cv_load(p) _mm256_loadu_ps(p)
#define cv_store(p, v) _mm256_storeu_ps(p, v)
#define cv_set1(a) _mm256_set1_ps(a)
#define cv_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define cv_mul(a, b) _mm256_mul_ps(a, b)
static inline float cv_sum(cv_t v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}
#define COLI_SIMD_NAME "avx2"
#elif defined(COLI_NEON)
#define CV_W 4
typedef float32x4_t cv_t;
#define cv_zero() vdupq_n_f32(0.0f)
#define cv_load(p) vld1q_f32(p)
#define cv_store(p, v) vst1q_f32(p, v)
#define cv_set1(a) vdupq_n_f32(a)
#define cv_fma(a, b, c) vfmaq_f32(c, a, b)
#define cv_mul(a, b) vmulq_f32(a, b)
static inline float cv_sum(cv_t v) { return vaddvq_f32(v); }
#define COLI_SIMD_NAME "neon"
#else
#define CV_W 1
typedef float cv_t;
#define cv_zero() 0.0f
#define cv_load(p) (*(p))
#define cv_store(p, v) (*(p) = (v))
#define cv_set1(a) (a)
#define cv_fma(a, b, c) ((a) * (b) + (c))
#define cv_mul(a, b) ((a) * (b))
static inline float cv_sum(cv_t v) { return v; }
#define COLI_SIMD_NAME "scalar"
#endif

static inline const char *coli_simd_name(void) { return COLI_SIMD_NAME; }

/* COLI_SCHED: a function scheduled by GCC before register allocation, aware of register
 * pressure (-fschedule-insns -fsched-pressure). The multi-token AVX2 tiles take it: with 16
 * vector registers they spill their accumulators otherwise (BENCHMARKS.md, the thirty-seventh
 * session). Only on tiles: it slows the int4 row kernels and the int8 prefill tiles, and GCC
 * does not inline a function of other options into one without them, so a small helper
 * with it would become a call (helpers without it inline into it as usual). Not on the
 * avx2vnni path, whose tiles keep their 8 weight registers and were not measured with it;
 * other compilers schedule as they do. */
#if defined(__GNUC__) && !defined(__clang__) && !defined(__INTEL_COMPILER) && !defined(__AVXVNNI__)
#define COLI_SCHED __attribute__((optimize("schedule-insns", "sched-pressure")))
#else
#define COLI_SCHED
#endif

/* ---- half precision: weight scales and the f16 KV cache ---------------------------------
 * IEEE binary16 <-> float32. Widening is exact. Narrowing rounds to nearest, ties to even
 * (as vcvtps2ph with _MM_FROUND_TO_NEAREST_INT, NEON's default rounding and NumPy's
 * astype(float16)), with overflow to +-inf and gradual underflow to half subnormals; a NaN
 * becomes a quiet NaN (as the F16C and NEON instructions make it; NumPy keeps a signalling
 * NaN's payload instead). */
static inline float coli_f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#elif defined(COLI_NEON)
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
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

static inline uint16_t coli_f32_to_f16(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(COLI_NEON)
    return vget_lane_u16(vreinterpret_u16_f16(vcvt_f16_f32(vdupq_n_f32(f))), 0);
#else
    uint32_t x, s, a;
    memcpy(&x, &f, 4);
    s = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(s | 0x7e00u | ((a >> 13) & 0x3ffu)); /* NaN stays NaN, quiet */
    if (a >= 0x477ff000u) return (uint16_t)(s | 0x7c00u);                       /* >= 65520: inf */
    if (a >= 0x38800000u) {                                                      /* a normal half */
        uint32_t r = a - 0x38000000u;                                            /* exponent rebiased */
        return (uint16_t)(s | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
    }
    int shift = 126 - (int)(a >> 23); /* a subnormal half (or zero): units of 2^-24 */
    if (shift > 25) return (uint16_t)s;
    uint32_t m = (a & 0x7fffffu) | (a >> 23 ? 0x800000u : 0u), q = m >> shift, rem = m & ((1u << shift) - 1u),
             half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(s | q);
#endif
}

/* o[:d] = h[:d] widened */
static inline void coli_f16_row(const uint16_t *h, long d, float *o) {
    long i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= d; i += 16) _mm512_storeu_ps(o + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#if defined(__AVX512BW__) && defined(__AVX512VL__) /* the masked 16-bit load of the tail */
    if (i < d) {
        __mmask16 k = (__mmask16)((1u << (d - i)) - 1u);
        _mm512_mask_storeu_ps(o + i, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, h + i)));
        return;
    }
#endif
#elif defined(__F16C__)
    for (; i + 8 <= d; i += 8) _mm256_storeu_ps(o + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#elif defined(COLI_NEON)
    for (; i + 4 <= d; i += 4) vst1q_f32(o + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + i))));
#endif
    for (; i < d; i++) o[i] = coli_f16_to_f32(h[i]);
}

/* CV_W halves at h widened into one vector (exact): an f16 cache's keys and values read straight
 * into registers, the same floats coli_f16_row writes. */
#if defined(__AVX512F__)
#define cv_load_h(h) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(h)))
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define cv_load_h(h) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(h)))
#elif defined(COLI_NEON)
#define cv_load_h(h) vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h)))
#elif CV_W == 1
#define cv_load_h(h) coli_f16_to_f32(*(h))
#endif

/* h[:d] = x[:d] narrowed (round to nearest even) */
static inline void coli_to_f16_row(const float *x, int d, uint16_t *h) {
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= d; i += 16)
        _mm256_storeu_si256((__m256i *)(h + i), _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
#if defined(__F16C__)
    for (; i + 8 <= d; i += 8)
        _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(COLI_NEON)
    for (; i + 4 <= d; i += 4) vst1_u16(h + i, vreinterpret_u16_f16(vcvt_f16_f32(vld1q_f32(x + i))));
#endif
    for (; i < d; i++) h[i] = coli_f32_to_f16(x[i]);
}

/* One KV row written at row `pos` of a cache of `half` precision (f16) or float32, w floats wide. */
static inline void coli_kv_put(void *cache, long pos, const float *x, int w, int half) {
    if (half) coli_to_f16_row(x, w, (uint16_t *)cache + pos * w);
    else memcpy((float *)cache + pos * w, x, (size_t)w * sizeof(float));
}

/* p advanced by i elements of a KV cache of `half` precision or float32 */
#define COLI_KV_AT(p, i, half) ((const void *)((const char *)(p) + (long)(i) * ((half) ? 2 : 4)))

/* dot(a[:K], b[:K]) */
static inline float coli_dot(const float *a, const float *b, int K) {
    cv_t acc0 = cv_zero(), acc1 = cv_zero();
    int k = 0;
    for (; k + 2 * CV_W <= K; k += 2 * CV_W) {
        acc0 = cv_fma(cv_load(a + k), cv_load(b + k), acc0);
        acc1 = cv_fma(cv_load(a + k + CV_W), cv_load(b + k + CV_W), acc1);
    }
    for (; k + CV_W <= K; k += CV_W) acc0 = cv_fma(cv_load(a + k), cv_load(b + k), acc0);
    float s = cv_sum(acc0) + cv_sum(acc1);
    for (; k < K; k++) s += a[k] * b[k];
    return s;
}

/* y[:n] = y * a + x * b  (used by the online softmax of attention) */
static inline void coli_scale_add(float *y, float a, const float *x, float b, int n) {
    int i = 0;
    cv_t va = cv_set1(a), vb = cv_set1(b);
    for (; i + CV_W <= n; i += CV_W)
        cv_store(y + i, cv_fma(cv_load(x + i), vb, cv_mul(cv_load(y + i), va)));
    for (; i < n; i++) y[i] = y[i] * a + x[i] * b;
}

/* One MR x NR register tile of Y = X . W^T; MR, NR are literals at every call site so the
 * accumulator arrays are unrolled into registers. WT is the weights' element type, WLOAD
 * loads CV_W of them widened to floats, WGET widens one (the K remainder): the f32 tiles
 * below and the bf16 ones in simd_q.h are the same loop. */
#define COLI_TILE_OF(NAME, WT, WLOAD, WGET, MR, NR)                                           \
    static inline void NAME##_##MR##x##NR(const float *X, long ldx, const WT *W, long ldw, int K, \
                                          float *Y, long ldy) {                               \
        cv_t acc[MR][NR];                                                                     \
        for (int i = 0; i < MR; i++)                                                          \
            for (int j = 0; j < NR; j++) acc[i][j] = cv_zero();                               \
        int k = 0;                                                                            \
        for (; k + CV_W <= K; k += CV_W) {                                                    \
            cv_t w[NR];                                                                       \
            for (int j = 0; j < NR; j++) w[j] = WLOAD(W + j * ldw + k);                       \
            for (int i = 0; i < MR; i++) {                                                    \
                cv_t x = cv_load(X + i * ldx + k);                                            \
                for (int j = 0; j < NR; j++) acc[i][j] = cv_fma(x, w[j], acc[i][j]);          \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < MR; i++)                                                          \
            for (int j = 0; j < NR; j++) {                                                    \
                float s = cv_sum(acc[i][j]);                                                  \
                for (int kk = k; kk < K; kk++) s += X[i * ldx + kk] * WGET(W[j * ldw + kk]);  \
                Y[i * ldy + j] = s;                                                           \
            }                                                                                 \
    }
#define COLI_F32_ITSELF(v) (v)
#define COLI_TILE(MR, NR) COLI_TILE_OF(coli_tile, float, cv_load, COLI_F32_ITSELF, MR, NR)

COLI_TILE(1, 1) COLI_TILE(1, 2) COLI_TILE(1, 3) COLI_TILE(1, 4)
COLI_TILE(2, 1) COLI_TILE(2, 2) COLI_TILE(2, 3) COLI_TILE(2, 4)
COLI_TILE(3, 1) COLI_TILE(3, 2) COLI_TILE(3, 3) COLI_TILE(3, 4)
COLI_TILE(4, 1) COLI_TILE(4, 2) COLI_TILE(4, 3) COLI_TILE(4, 4)

static inline void coli_tile(int mr, int nr, const float *X, long ldx, const float *W, long ldw,
                             int K, float *Y, long ldy) {
    switch (mr * 8 + nr) {
    case 9: coli_tile_1x1(X, ldx, W, ldw, K, Y, ldy); break;
    case 10: coli_tile_1x2(X, ldx, W, ldw, K, Y, ldy); break;
    case 11: coli_tile_1x3(X, ldx, W, ldw, K, Y, ldy); break;
    case 12: coli_tile_1x4(X, ldx, W, ldw, K, Y, ldy); break;
    case 17: coli_tile_2x1(X, ldx, W, ldw, K, Y, ldy); break;
    case 18: coli_tile_2x2(X, ldx, W, ldw, K, Y, ldy); break;
    case 19: coli_tile_2x3(X, ldx, W, ldw, K, Y, ldy); break;
    case 20: coli_tile_2x4(X, ldx, W, ldw, K, Y, ldy); break;
    case 25: coli_tile_3x1(X, ldx, W, ldw, K, Y, ldy); break;
    case 26: coli_tile_3x2(X, ldx, W, ldw, K, Y, ldy); break;
    case 27: coli_tile_3x3(X, ldx, W, ldw, K, Y, ldy); break;
    case 28: coli_tile_3x4(X, ldx, W, ldw, K, Y, ldy); break;
    case 33: coli_tile_4x1(X, ldx, W, ldw, K, Y, ldy); break;
    case 34: coli_tile_4x2(X, ldx, W, ldw, K, Y, ldy); break;
    case 35: coli_tile_4x3(X, ldx, W, ldw, K, Y, ldy); break;
    default: coli_tile_4x4(X, ldx, W, ldw, K, Y, ldy); break;
    }
}

/* Y[m, n] = dot(X[m, :K], W[n, :K]) for m < M, n < N.
 * W rows are walked in blocks of 4 (the outer loop) so a block stays in L1 while
 * every token passes over it. */
static inline void coli_gemm_nt(const float *X, long ldx, int M, const float *W, long ldw, int N,
                                int K, float *Y, long ldy) {
    for (int n = 0; n < N; n += 4) {
        int nr = N - n < 4 ? N - n : 4;
        for (int m = 0; m < M; m += 4) {
            int mr = M - m < 4 ? M - m : 4;
            coli_tile(mr, nr, X + m * ldx, ldx, W + n * ldw, ldw, K, Y + m * ldy + n, ldy);
        }
    }
}

/* ---- decode attention ------------------------------------------------------------------
 * Query heads of one row against keys [j0, j1) of its cache, in fixed CHUNKS of COLI_ATT_CH
 * keys counted from j0 (flash-decoding split-K). A work item (coli_attend_part) is one chunk
 * for up to COLI_ATT_HB heads of one KV group; it writes, per head, the chunk's unnormalized
 * output o_c = sum_j e^(s_j - m_c) v_j, its max m_c and its sum l_c = sum_j e^(s_j - m_c):
 *   scores  keys in blocks of CV_W (16 with AVX-512, 8 with AVX2, 1 in the scalar build): one
 *           accumulator vector per key (q . k lane-wise), a transpose-and-add tree
 *           (cv_sum_lanes) turns the CV_W accumulators into ONE vector whose lane i is the
 *           score of key i; the chunk's scores go to a small buffer (COLI_ATT_CH floats a head);
 *   softmax one max per head and chunk (vector max, one horizontal max), then a vectorized
 *           exp (cv_exp) of the whole buffer in place and its sum: no per-block rescaling;
 *   P . V   the heads of the item share every V load: accumulators for up to 16 vectors
 *           (heads x output vectors) stay in registers across the keys of a block.
 * Chunks then merge in chunk order (coli_attend_merge: a running max and sum, the output
 * rescaled once per chunk), whether one thread walks them in turn (coli_attend_seq) or several
 * computed them apart (the caller's split, kernels.pyx): the same arithmetic, so a head's
 * result depends neither on the thread count nor on which heads share an item (each head's
 * sums run in the same order whatever the item's width). */

#define COLI_ATT_CH 64 /* keys per chunk (a multiple of 16) */
#define COLI_ATT_HB 4  /* heads of a KV group per work item */

/* exp(x) = 2^n * e^r, n = round(x / ln 2), r = x - n ln 2 (two-constant Cody-Waite,
 * |r| <= ln2 / 2), e^r = 1 + r + r^2 P(r) with P a degree-4 fit of relative error ~3e-9 (well
 * under float32 rounding): results within ~1 ulp of expf down to ~1e-38, below which they are
 * flushed to 0 (no denormals: see below). x = -inf gives 0, NaN gives NaN. */
#define COLI_EXP_POLY(r)                                                                        \
    cv_fma(cv_mul(r, r),                                                                        \
           cv_fma(cv_fma(cv_fma(cv_fma(cv_set1(1.381473383e-3f), r, cv_set1(8.368710056e-3f)), r, \
                                cv_set1(4.166838527e-2f)), r, cv_set1(1.666652113e-1f)), r,      \
                  cv_set1(4.999999404e-1f)),                                                     \
           cv_add(r, cv_set1(1.0f)))

/* Per-ISA helpers: tail loads / stores (the first n < CV_W floats), horizontal max, lane
 * mask, exp, the transpose-add tree, and (AVX-512) the realigned staging of rows. */
#if defined(__AVX512F__)
#define cv_add(a, b) _mm512_add_ps(a, b)
#define cv_sub(a, b) _mm512_sub_ps(a, b)
#define cv_max(a, b) _mm512_max_ps(a, b)
static inline __mmask16 cv_tailmask(int n) { return (__mmask16)((1u << n) - 1u); }
static inline cv_t cv_loadn(const float *p, int n) { return _mm512_maskz_loadu_ps(cv_tailmask(n), p); }
static inline void cv_storen(float *p, cv_t v, int n) { _mm512_mask_storeu_ps(p, cv_tailmask(n), v); }
static inline float cv_hmax(cv_t v) { return _mm512_reduce_max_ps(v); }
static inline float cv_first(cv_t v) { return _mm512_cvtss_f32(v); }
/* lanes >= n replaced by fill */
static inline cv_t cv_keep(cv_t v, int n, float fill) {
    return _mm512_mask_blend_ps(cv_tailmask(n), _mm512_set1_ps(fill), v);
}
/* 2^n applied by vscalefps. Results below e^-87 (~1.6e-38) are flushed to 0: a denormal
 * result costs a microcode assist (hundreds of cycles), and the masked lanes of a block's
 * last keys (-inf) would produce one every block. */
static inline cv_t cv_exp(cv_t x) {
    __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ); /* NaN kept */
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), x); /* e^89 overflows to inf; +inf would give NaN */
    cv_t n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    cv_t r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    return _mm512_maskz_scalef_ps(keep, COLI_EXP_POLY(r), n);
}
/* One level of the tree: lanes whose bit s is clear get a[l] + a[l ^ s], the others
 * b[l] + b[l ^ s] (a blend and a two-source permute). */
static inline cv_t coli_tr_add(cv_t a, cv_t b, __mmask16 m, __m512i idx) {
    return _mm512_add_ps(_mm512_mask_blend_ps(m, a, b), _mm512_permutex2var_ps(a, idx, b));
}
/* lane i of the result = sum of the lanes of a[i]: levels s = 8, 4, 2, 1 pair a[i] with
 * a[i + s], so key i ends in the lane whose bits are i's bits. */
static inline cv_t cv_sum_lanes(const cv_t *a) {
    const __m512i i8 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i i4 = _mm512_setr_epi32(4, 5, 6, 7, 16, 17, 18, 19, 12, 13, 14, 15, 24, 25, 26, 27);
    const __m512i i2 = _mm512_setr_epi32(2, 3, 16, 17, 6, 7, 20, 21, 10, 11, 24, 25, 14, 15, 28, 29);
    const __m512i i1 = _mm512_setr_epi32(1, 16, 3, 18, 5, 20, 7, 22, 9, 24, 11, 26, 13, 28, 15, 30);
    cv_t t[8], u[4], v[2];
    for (int i = 0; i < 8; i++) t[i] = coli_tr_add(a[i], a[i + 8], 0xFF00, i8);
    for (int i = 0; i < 4; i++) u[i] = coli_tr_add(t[i], t[i + 4], 0xF0F0, i4);
    for (int i = 0; i < 2; i++) v[i] = coli_tr_add(u[i], u[i + 2], 0xCCCC, i2);
    return coli_tr_add(v[0], v[1], 0xAAAA, i1);
}
/* Realigned staging. KV caches are rarely 64-byte aligned (NumPy's large arrays sit 16
 * bytes past a page), and zmm loads that straddle two cache lines read a stream of K / V rows
 * from L2 at about half the rate. When several query heads read a KV head's block of rows
 * that sits s floats past a 64-byte boundary (s > 0), the block is first copied to an aligned
 * buffer reading aligned lines only: vector v of a row is lanes s..15 of line v and lanes
 * 0..s-1 of line v+1 (one vpermt2ps), exactly the floats an unaligned load gives, so results
 * do not depend on the alignment. Line v+1 of a row's last full vector holds that vector's
 * last floats: no line outside the row is read. The last partial vector (d % 16 floats) takes
 * a masked load; buffer rows are zero-padded. A single head reads misaligned rows directly:
 * the permutes and the copy cost it more than the split loads they avoid. */
#define COLI_REALIGN 1
static inline void coli_stage_rows(const float *R, long rs, int n, int d, int s, float *B, long ld) {
    const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(s));
    int nv = d / 16, t = d - nv * 16;
    for (int i = 0; i < n; i++) {
        const float *a = R + (long)i * rs - s;
        float *o = B + (long)i * ld;
        for (int v = 0; v < nv; v++)
            _mm512_store_ps(o + v * 16, _mm512_permutex2var_ps(_mm512_load_ps(a + v * 16), idx,
                                                               _mm512_load_ps(a + v * 16 + 16)));
        if (t) _mm512_store_ps(o + nv * 16, cv_loadn(a + s + nv * 16, t));
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define cv_add(a, b) _mm256_add_ps(a, b)
#define cv_sub(a, b) _mm256_sub_ps(a, b)
#define cv_max(a, b) _mm256_max_ps(a, b)
static inline __m256i cv_tailmask(int n) {
    static const int32_t t[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_loadu_si256((const __m256i *)(t + 8 - n));
}
static inline cv_t cv_loadn(const float *p, int n) { return _mm256_maskload_ps(p, cv_tailmask(n)); }
static inline void cv_storen(float *p, cv_t v, int n) { _mm256_maskstore_ps(p, cv_tailmask(n), v); }
static inline float cv_hmax(cv_t v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
static inline float cv_first(cv_t v) { return _mm256_cvtss_f32(v); }
static inline cv_t cv_keep(cv_t v, int n, float fill) {
    return _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(cv_tailmask(n)));
}
/* 2^n built in the exponent field: results below e^-86.6 (~2e-38) are flushed to 0 (n stays
 * >= -125) and 2^n is applied as 2^(n-1) * 2 (n = 128 stays finite). */
static inline cv_t cv_exp(cv_t x) {
    cv_t keep = _mm256_cmp_ps(x, _mm256_set1_ps(-86.6f), _CMP_NLT_UQ); /* NaN kept */
    x = _mm256_max_ps(_mm256_set1_ps(-86.6f), x);
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), x);
    cv_t n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    cv_t r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
    cv_t y = _mm256_mul_ps(_mm256_mul_ps(COLI_EXP_POLY(r), _mm256_castsi256_ps(e)), _mm256_set1_ps(2.0f));
    return _mm256_and_ps(y, keep);
}
/* lane i of the result = sum of the lanes of a[i]: two levels of hadd leave keys 0-3 (4-7)
 * in both 128-bit halves of g0 (g1); adding the halves finishes. */
static inline cv_t cv_sum_lanes(const cv_t *a) {
    cv_t g0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    cv_t g1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}
#elif defined(COLI_NEON)
#define cv_add(a, b) vaddq_f32(a, b)
#define cv_sub(a, b) vsubq_f32(a, b)
#define cv_max(a, b) vmaxq_f32(a, b)
static inline uint32x4_t cv_tailmask(int n) { /* lanes < n */
    static const uint32_t lane[4] = {0, 1, 2, 3};
    return vcltq_u32(vld1q_u32(lane), vdupq_n_u32((uint32_t)n));
}
static inline cv_t cv_loadn(const float *p, int n) {
    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    memcpy(t, p, (size_t)n * sizeof(float));
    return vld1q_f32(t);
}
static inline void cv_storen(float *p, cv_t v, int n) {
    float t[4];
    vst1q_f32(t, v);
    memcpy(p, t, (size_t)n * sizeof(float));
}
static inline float cv_hmax(cv_t v) { return vmaxvq_f32(v); }
static inline float cv_first(cv_t v) { return vgetq_lane_f32(v, 0); }
static inline cv_t cv_keep(cv_t v, int n, float fill) { return vbslq_f32(cv_tailmask(n), v, vdupq_n_f32(fill)); }
/* as the AVX2 one: 2^n built in the exponent field, results below e^-86.6 flushed to 0
 * (x < -86.6 is false for NaN, which is kept), 2^n applied as 2^(n-1) * 2. */
static inline cv_t cv_exp(cv_t x) {
    uint32x4_t keep = vmvnq_u32(vcltq_f32(x, vdupq_n_f32(-86.6f)));
    x = vmaxq_f32(vdupq_n_f32(-86.6f), x);
    x = vminq_f32(vdupq_n_f32(89.0f), x);
    cv_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504f)));
    cv_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
    int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(126)), 23);
    cv_t y = vmulq_f32(vmulq_f32(COLI_EXP_POLY(r), vreinterpretq_f32_s32(e)), vdupq_n_f32(2.0f));
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(y), keep));
}
/* lane i of the result = sum of the lanes of a[i]: two levels of pairwise adds. */
static inline cv_t cv_sum_lanes(const cv_t *a) {
    return vpaddq_f32(vpaddq_f32(a[0], a[1]), vpaddq_f32(a[2], a[3]));
}
#else
#define cv_add(a, b) ((a) + (b))
#define cv_sub(a, b) ((a) - (b))
#define cv_max(a, b) ((a) > (b) ? (a) : (b))
static inline cv_t cv_loadn(const float *p, int n) { return n > 0 ? *p : 0.0f; }
static inline void cv_storen(float *p, cv_t v, int n) {
    if (n > 0) *p = v;
}
static inline float cv_hmax(cv_t v) { return v; }
static inline float cv_first(cv_t v) { return v; }
static inline cv_t cv_keep(cv_t v, int n, float fill) { return n > 0 ? v : fill; }
static inline cv_t cv_exp(cv_t x) { return expf(x); }
static inline cv_t cv_sum_lanes(const cv_t *a) { return a[0]; }
#endif
#ifndef COLI_REALIGN
#define COLI_REALIGN 0
static inline void coli_stage_rows(const float *R, long rs, int n, int d, int s, float *B, long ld) {
    (void)R, (void)rs, (void)n, (void)d, (void)s, (void)B, (void)ld;
}
#endif
#define COLI_STAGE_LD 576 /* widest row (floats) that is staged; MLA's 512 + 64 */

/* Floats past a 64-byte boundary of the rows p + j*stride when that is the same for every
 * row, not 0, and the rows fit the staging buffer (such blocks are staged); 0 otherwise. */
static inline int coli_row_shift(const float *p, long stride, int d) {
    if (!COLI_REALIGN || stride % 16 != 0 || d > COLI_STAGE_LD || (uintptr_t)p % sizeof(float)) return 0;
    return (int)(((uintptr_t)p / sizeof(float)) % 16);
}

/* acc[i] (+)= q[0 : NV*CV_W] * K_i[same] lane-wise for the keys K_i = K + i*ks, i < n. NV is
 * a literal at every call site, so the query vectors stay in registers while the keys stream
 * past. */
#define COLI_QK(NV)                                                                                \
    static inline void coli_qk_##NV(const float *q, const float *K, long ks, int n, cv_t *acc, int add) { \
        cv_t qv[NV];                                                                               \
        for (int v = 0; v < NV; v++) qv[v] = cv_load(q + v * CV_W);                                \
        for (int i = 0; i < n; i++, K += ks) {                                                     \
            cv_t a = add ? acc[i] : cv_zero();                                                     \
            for (int v = 0; v < NV; v++) a = cv_fma(qv[v], cv_load(K + v * CV_W), a);             \
            acc[i] = a;                                                                            \
        }                                                                                          \
    }
COLI_QK(1) COLI_QK(2) COLI_QK(3) COLI_QK(4) COLI_QK(5) COLI_QK(6) COLI_QK(7) COLI_QK(8)

/* Scores of q against the n <= CV_W keys K + i*ks as one vector (lane i = key i; lanes >= n
 * are 0). hd need not be a multiple of CV_W: the last partial vector is read with a masked
 * load. */
static inline cv_t coli_qk_block(const float *q, const float *K, long ks, int n, int hd) {
    cv_t acc[CV_W];
#if CV_W == 1
    acc[0] = 0.0f; /* n >= 1: tells the compiler so */
#endif
    int d = 0, add = 0;
    for (; d + 8 * CV_W <= hd; d += 8 * CV_W, add = 1) coli_qk_8(q + d, K + d, ks, n, acc, add);
    switch ((hd - d) / CV_W) {
    case 1: coli_qk_1(q + d, K + d, ks, n, acc, add); break;
    case 2: coli_qk_2(q + d, K + d, ks, n, acc, add); break;
    case 3: coli_qk_3(q + d, K + d, ks, n, acc, add); break;
    case 4: coli_qk_4(q + d, K + d, ks, n, acc, add); break;
    case 5: coli_qk_5(q + d, K + d, ks, n, acc, add); break;
    case 6: coli_qk_6(q + d, K + d, ks, n, acc, add); break;
    case 7: coli_qk_7(q + d, K + d, ks, n, acc, add); break;
    default: break;
    }
    add |= hd - d >= CV_W;
    d = hd / CV_W * CV_W;
    if (d < hd) {
        cv_t qv = cv_loadn(q + d, hd - d);
        for (int i = 0; i < n; i++) {
            cv_t a = cv_mul(qv, cv_loadn(K + (long)i * ks + d, hd - d));
            acc[i] = add ? cv_add(acc[i], a) : a;
        }
    }
    for (int i = n; i < CV_W; i++) acc[i] = cv_zero();
    return cv_sum_lanes(acc);
}

/* o_h[0 : NV*CV_W] (+)= sum_i p_h[i] * V_i[same] for the HB heads h of a work item (o_h = o + h*ldo,
 * p_h = p + h*ldp) over the keys V_i = V + i*vs, i < n; with first set the old o is not read (it
 * may be uninitialized). HB and NV are literals at every call site: the HB x NV sums stay in
 * registers, each V vector loaded serves every head, and each head's sums run over the keys in
 * order, whatever HB (so a head's result does not depend on which heads share its item). */
#define COLI_PVH_OF(SFX, VT, LOAD, HB, NV)                                                         \
    static inline void coli_pvh##SFX##_##HB##_##NV(float *o, long ldo, const VT *V, long vs, int n, \
                                                   const float *p, long ldp, int first) {          \
        cv_t a[HB][NV];                                                                            \
        for (int h = 0; h < HB; h++)                                                               \
            for (int v = 0; v < NV; v++) a[h][v] = first ? cv_zero() : cv_load(o + h * ldo + v * CV_W); \
        for (int i = 0; i < n; i++) {                                                              \
            const VT *r = V + (long)i * vs;                                                        \
            cv_t x[NV];                                                                            \
            for (int v = 0; v < NV; v++) x[v] = LOAD(r + v * CV_W);                                \
            for (int h = 0; h < HB; h++) {                                                         \
                cv_t ph = cv_set1(p[h * ldp + i]);                                                 \
                for (int v = 0; v < NV; v++) a[h][v] = cv_fma(ph, x[v], a[h][v]);                  \
            }                                                                                      \
        }                                                                                          \
        for (int h = 0; h < HB; h++)                                                               \
            for (int v = 0; v < NV; v++) cv_store(o + h * ldo + v * CV_W, a[h][v]);                \
    }
/* Every (HB, NV) a work item takes: float32 values (coli_pvh), f16 values widened as they are
 * read (coli_pvh_h, the same arithmetic on the same floats) */
#define COLI_PVH_ALL(SFX, VT, LOAD)                                                                \
    COLI_PVH_OF(SFX, VT, LOAD, 1, 1) COLI_PVH_OF(SFX, VT, LOAD, 1, 2) COLI_PVH_OF(SFX, VT, LOAD, 1, 3) \
    COLI_PVH_OF(SFX, VT, LOAD, 1, 4) COLI_PVH_OF(SFX, VT, LOAD, 1, 5) COLI_PVH_OF(SFX, VT, LOAD, 1, 6) \
    COLI_PVH_OF(SFX, VT, LOAD, 1, 7) COLI_PVH_OF(SFX, VT, LOAD, 1, 8) COLI_PVH_OF(SFX, VT, LOAD, 2, 1) \
    COLI_PVH_OF(SFX, VT, LOAD, 2, 2) COLI_PVH_OF(SFX, VT, LOAD, 2, 3) COLI_PVH_OF(SFX, VT, LOAD, 2, 4) \
    COLI_PVH_OF(SFX, VT, LOAD, 2, 5) COLI_PVH_OF(SFX, VT, LOAD, 2, 6) COLI_PVH_OF(SFX, VT, LOAD, 2, 7) \
    COLI_PVH_OF(SFX, VT, LOAD, 2, 8) COLI_PVH_OF(SFX, VT, LOAD, 3, 1) COLI_PVH_OF(SFX, VT, LOAD, 3, 2) \
    COLI_PVH_OF(SFX, VT, LOAD, 3, 3) COLI_PVH_OF(SFX, VT, LOAD, 3, 4) COLI_PVH_OF(SFX, VT, LOAD, 3, 5) \
    COLI_PVH_OF(SFX, VT, LOAD, 4, 1) COLI_PVH_OF(SFX, VT, LOAD, 4, 2) COLI_PVH_OF(SFX, VT, LOAD, 4, 3) \
    COLI_PVH_OF(SFX, VT, LOAD, 4, 4)
COLI_PVH_ALL(, float, cv_load)
#if defined(cv_load_h)
COLI_PVH_ALL(_h, uint16_t, cv_load_h)
#endif
#define COLI_PVH_CASES(SFX)                                                                        \
        COLI_PVH_CASE(SFX, 1, 1) COLI_PVH_CASE(SFX, 1, 2) COLI_PVH_CASE(SFX, 1, 3) COLI_PVH_CASE(SFX, 1, 4) \
        COLI_PVH_CASE(SFX, 1, 5) COLI_PVH_CASE(SFX, 1, 6) COLI_PVH_CASE(SFX, 1, 7) COLI_PVH_CASE(SFX, 1, 8) \
        COLI_PVH_CASE(SFX, 2, 1) COLI_PVH_CASE(SFX, 2, 2) COLI_PVH_CASE(SFX, 2, 3) COLI_PVH_CASE(SFX, 2, 4) \
        COLI_PVH_CASE(SFX, 2, 5) COLI_PVH_CASE(SFX, 2, 6) COLI_PVH_CASE(SFX, 2, 7) COLI_PVH_CASE(SFX, 2, 8) \
        COLI_PVH_CASE(SFX, 3, 1) COLI_PVH_CASE(SFX, 3, 2) COLI_PVH_CASE(SFX, 3, 3) COLI_PVH_CASE(SFX, 3, 4) \
        COLI_PVH_CASE(SFX, 3, 5) COLI_PVH_CASE(SFX, 4, 1) COLI_PVH_CASE(SFX, 4, 2) COLI_PVH_CASE(SFX, 4, 3) \
        COLI_PVH_CASE(SFX, 4, 4)
#define COLI_PVH_CASE(SFX, HB, NV)                                                                 \
    case HB * 16 + NV: coli_pvh##SFX##_##HB##_##NV(o + d, ldo, V + d, vs, n, p, ldp, first); break;

/* How many of the `left` whole vectors the next coli_pvh piece of hb heads takes: up to 16 / hb
 * accumulators (at most 8). */
static inline int coli_pvh_piece(int hb, int left) {
    int nvmax = hb <= 2 ? 8 : hb == 3 ? 5 : 4;
    return left < nvmax ? left : nvmax;
}

/* coli_pvh_HB_NV over the whole o_h[:vd] of hb <= 4 heads: pieces of coli_pvh_piece vectors,
 * then the last partial vector (vd % CV_W floats) with masked loads. */
static inline void coli_pvh(int hb, float *o, long ldo, const float *V, long vs, int n, const float *p, long ldp,
                            int first, int vd) {
    int d = 0;
    for (int nv; d + CV_W <= vd; d += nv * CV_W) {
        nv = coli_pvh_piece(hb, (vd - d) / CV_W);
        switch (hb * 16 + nv) {
        COLI_PVH_CASES()
        default: break;
        }
    }
    if (d < vd) {
        int t = vd - d;
        for (int h = 0; h < hb; h++) {
            cv_t a = first ? cv_zero() : cv_loadn(o + h * ldo + d, t);
            for (int i = 0; i < n; i++) a = cv_fma(cv_set1(p[h * ldp + i]), cv_loadn(V + (long)i * vs + d, t), a);
            cv_storen(o + h * ldo + d, a, t);
        }
    }
}

#if defined(cv_load_h)
/* coli_pvh over f16 values (vd a multiple of CV_W), each vector widened as it is read: the
 * floats and the arithmetic of coli_pvh on the block widened first, without the copy. */
static inline void coli_pvh_h(int hb, float *o, long ldo, const uint16_t *V, long vs, int n, const float *p,
                              long ldp, int first, int vd) {
    for (int nv, d = 0; d + CV_W <= vd; d += nv * CV_W) {
        nv = coli_pvh_piece(hb, (vd - d) / CV_W);
        switch (hb * 16 + nv) {
        COLI_PVH_CASES(_h)
        default: break;
        }
    }
}

/* The scores of HB heads (head h's queries at q + h*ldq, NV*CV_W floats) against n <= CV_W keys
 * of an f16 cache (key i at K + i*ks halves), one vector per head in sc[h] (lane i = key i,
 * lanes >= n are 0), unscaled: each key's vectors are widened once, in registers, for every
 * head. A head's sums are coli_qk_block's (its chain over the vectors in order, from zero),
 * so its scores are the bits of the key block widened first. */
#define COLI_QKH(HB, NV)                                                                           \
    static inline void coli_qkh_##HB##_##NV(const float *q, long ldq, const uint16_t *K, long ks, int n, \
                                            cv_t *sc) {                                            \
        cv_t qv[HB][NV], acc[HB][CV_W];                                                            \
        for (int h = 0; h < HB; h++)                                                               \
            for (int v = 0; v < NV; v++) qv[h][v] = cv_load(q + h * ldq + v * CV_W);              \
        for (int i = 0; i < n; i++, K += ks) {                                                     \
            cv_t a[HB];                                                                            \
            for (int h = 0; h < HB; h++) a[h] = cv_zero();                                         \
            for (int v = 0; v < NV; v++) {                                                         \
                cv_t k = cv_load_h(K + v * CV_W);                                                  \
                for (int h = 0; h < HB; h++) a[h] = cv_fma(qv[h][v], k, a[h]);                     \
            }                                                                                      \
            for (int h = 0; h < HB; h++) acc[h][i] = a[h];                                         \
        }                                                                                          \
        for (int h = 0; h < HB; h++) {                                                             \
            for (int i = n; i < CV_W; i++) acc[h][i] = cv_zero();                                  \
            sc[h] = cv_sum_lanes(acc[h]);                                                          \
        }                                                                                          \
    }
#define COLI_QKH_NV(HB) COLI_QKH(HB, 1) COLI_QKH(HB, 2) COLI_QKH(HB, 4) COLI_QKH(HB, 8) COLI_QKH(HB, 16)
COLI_QKH_NV(1) COLI_QKH_NV(2) COLI_QKH_NV(3) COLI_QKH_NV(4)
#define COLI_QKH_CASE(HB, NV)                                                                      \
    case HB * 32 + NV: coli_qkh_##HB##_##NV(q, ldq, K, ks, n, sc); return 1;
#define COLI_QKH_CASES(HB) COLI_QKH_CASE(HB, 1) COLI_QKH_CASE(HB, 2) COLI_QKH_CASE(HB, 4) COLI_QKH_CASE(HB, 8) COLI_QKH_CASE(HB, 16)

/* Whether a work item of nb heads of hd floats reads an f16 cache widening in registers: coli_qkh
 * has a tile for 1, 2, 4, 8 or 16 vectors, and a lone head of 16 (olmoe's 128 on AVX2, no key
 * shared) keeps the buffer, whose row-by-row widening read olmoe's cold cache 8-12% faster. */
static inline int coli_qkh_fits(int nb, int hd) {
    int nv = hd / CV_W;
    return hd % CV_W == 0 && (nv == 1 || nv == 2 || nv == 4 || nv == 8 || (nv == 16 && nb > 1));
}

/* coli_qkh_HB_NV for nb <= 4 heads of hd = NV*CV_W floats; 0 (nothing computed) for a width
 * it has no tile for. */
static inline int coli_qkh(int nb, int hd, const float *q, long ldq, const uint16_t *K, long ks, int n, cv_t *sc) {
    if (!coli_qkh_fits(nb, hd)) return 0;
    switch (nb * 32 + hd / CV_W) {
    COLI_QKH_CASES(1) COLI_QKH_CASES(2) COLI_QKH_CASES(3) COLI_QKH_CASES(4)
    default: return 0;
    }
}
#endif

static inline float coli_exp1(float x) { return cv_first(cv_exp(cv_set1(x))); }

/* n rows of d halves, rs halves apart, widened into B (rows ld floats apart): an f16 cache's
 * block of keys or values, read once from memory and then by every head of the item from L1. */
static inline void coli_f16_rows(const uint16_t *R, long rs, int n, int d, float *B, long ld) {
    for (int i = 0; i < n; i++) coli_f16_row(R + (long)i * rs, d, B + (long)i * ld);
}

/* Ask for the cache lines of n rows of d halves, rs halves apart, ahead of their use: an f16
 * block's widening is a short chain per row, so without it too few lines are in flight. */
static inline void coli_f16_prefetch(const uint16_t *R, long rs, int n, int d) {
    for (int i = 0; i < n; i++)
        for (int j = 0; j < d; j += 32) __builtin_prefetch(R + (long)i * rs + j, 0, 3);
}

/* How many chunks ahead decode and prefill attention ask for their keys and values into L2
 * (0: not at all; kernels.set_att_prefetch). While a thread computes one chunk of a KV head,
 * it asks for that KV head's rows of the chunk it will read after it. The cache holds every KV
 * head of a position in one row, so a KV head reads a slice of each row, rows a few hundred
 * bytes apart: the hardware prefetchers follow such a walk only a little ahead, and the
 * block-ahead L1 prefetch of coli_attend_part covers one block's compute, too short for memory's
 * latency. A chunk ahead (64 positions: 16-48 KB of an f16 cache) kept memory busy: a
 * one-token attention of SmolLM2's shape at 4096 positions read its cold cache 1.3-1.65x faster
 * (BENCHMARKS.md, "Attention: the next chunk into L2"). Prefetches change no arithmetic. */
static int coli_att_prefetch = 1;

/* One cache line into L2. An instruction the compiler must keep: GCC 12 took
 * coli_attend_prefetch, whose only effect is __builtin_prefetch calls, for a function with no
 * effect and dropped it with its loops (no prefetcht1 in the built kernels). */
#if defined(__x86_64__) || defined(__i386__)
#define COLI_PREFETCH_L2(p) __asm__ volatile("prefetcht1 (%0)" : : "r"((const void *)(p)))
#elif defined(__aarch64__)
#define COLI_PREFETCH_L2(p) __asm__ volatile("prfm pldl2keep, [%0]" : : "r"((const void *)(p)))
#else
#define COLI_PREFETCH_L2(p) __builtin_prefetch((p), 0, 2)
#endif

/* Ask for keys [j0, j1) of one KV head (rows ks elements apart, hd wide) and their values (vs,
 * vd; none when the values lie inside the key rows, as MLA's do) to be brought into L2. */
static inline void coli_attend_prefetch(const void *Kg, long ks, const void *Vg, long vs, int j0, int j1, int hd,
                                        int vd, int half) {
    long e = half ? 2 : 4;
    int inkeys = Vg == Kg && vs == ks && vd <= hd;
    for (int j = j0; j < j1; j++) {
        const char *k = (const char *)Kg + (long)j * ks * e, *v = (const char *)Vg + (long)j * vs * e;
        for (long b = 0; b < hd * e; b += 64) COLI_PREFETCH_L2(k + b);
        if (!inkeys)
            for (long b = 0; b < vd * e; b += 64) COLI_PREFETCH_L2(v + b);
    }
}

/* A block's raw scores v (lane i = key i of its n) scaled, soft-capped (softcap > 0: softcap *
 * tanh(s / softcap)) and stored at s, lanes >= n as -inf: what every decode and prefill item
 * does to its scores, so that they are the same bits whichever kernel computed them. */
static inline void coli_att_score(cv_t v, int n, float scale, float softcap, float *s) {
    v = cv_mul(v, cv_set1(scale));
    if (softcap > 0.0f) { /* rare (Gemma 2): scalar tanh */
        _Alignas(64) float t[CV_W];
        cv_store(t, v);
        for (int j = 0; j < n; j++) t[j] = softcap * tanhf(t[j] / softcap);
        v = cv_load(t);
    }
    cv_store(s, cv_keep(v, n, -INFINITY));
}

/* One head's chunk of scores (nvec vectors at s) turned in place into e^(s - m_c), its max m_c
 * to ml[0] and its sum l_c to ml[1]. */
static inline void coli_att_softmax(float *s, int nvec, float *ml) {
    cv_t mv = cv_load(s);
    for (int v = 1; v < nvec; v++) mv = cv_max(mv, cv_load(s + v * CV_W));
    float mx = cv_hmax(mv);
    cv_t m = cv_set1(mx), l = cv_zero();
    for (int v = 0; v < nvec; v++) {
        cv_t e = cv_exp(cv_sub(cv_load(s + v * CV_W), m));
        cv_store(s + v * CV_W, e);
        l = cv_add(l, e);
    }
    ml[0] = mx;
    ml[1] = cv_sum(l);
}

/* One work item: heads h0 .. h0+nb-1 of one row (nb <= COLI_ATT_HB, all of one KV head) against
 * keys [c0, c1) (c1 - c0 <= COLI_ATT_CH). q: the row's queries (head h at q + h*hd); Kg, Vg: that
 * KV head's rows (key j at Kg + j*ks, Vg + j*vs elements): float32, or f16 when half is set
 * (then hd, vd <= COLI_STAGE_LD). Writes head h0+i's unnormalized chunk output o_c to
 * oc + i*ldo (vd floats), its max m_c to ml[i*lds] and its sum l_c to ml[i*lds + 1].
 * softcap > 0 applies softcap * tanh(s / softcap) to the scaled scores. Allocates nothing.
 *
 * An f16 cache's keys and values are widened (exactly) and go through the same float32
 * arithmetic, so its results are the bits a float32 cache holding the same (rounded) values
 * gives: what reads the cache is tested against float32 directly. Where a tile fits
 * (coli_qkh_fits) they are widened in registers as they are read, each key vector once for all
 * the item's heads (coli_qkh, coli_pvh_h); otherwise block by block into the staging buffer.
 * Widening in registers instead of through the buffer made a one-token attention of SmolLM2's
 * shape 1.3-1.6x faster from memory (BENCHMARKS.md, "Attention: f16 keys and values widened
 * in registers"). */
static inline void coli_attend_part(const float *q, const void *Kg, long ks, const void *Vg, long vs, int h0,
                                    int nb, int c0, int c1, int hd, int vd, float scale, float softcap, int half,
                                    float *oc, long ldo, float *ml, long lds) {
    _Alignas(64) float s[COLI_ATT_HB][COLI_ATT_CH]; /* scores, then probabilities */
    _Alignas(64) float buf[CV_W * COLI_STAGE_LD];
    long ldk = (hd + 15) / 16 * 16, ldv = (vd + 15) / 16 * 16;
    int nk = c1 - c0, nvec = (nk + CV_W - 1) / CV_W;
    for (int b = 0; b < nk; b += CV_W) {
        int n = nk - b < CV_W ? nk - b : CV_W;
        const float *Kb;
        long kst = ks;
        cv_t sc[COLI_ATT_HB];
        int direct = 0; /* the scores computed straight from the f16 keys */
        if (half) {
            int next = nk - b - CV_W < CV_W ? nk - b - CV_W : CV_W; /* the next block's keys, and this block's values */
            if (next > 0) coli_f16_prefetch((const uint16_t *)Kg + (long)(c0 + b + CV_W) * ks, ks, next, hd);
            coli_f16_prefetch((const uint16_t *)Vg + (long)(c0 + b) * vs, vs, n, vd);
#if defined(cv_load_h)
            direct = coli_qkh(nb, hd, q + (long)h0 * hd, hd, (const uint16_t *)Kg + (long)(c0 + b) * ks, ks, n, sc);
#endif
            if (!direct) coli_f16_rows((const uint16_t *)Kg + (long)(c0 + b) * ks, ks, n, hd, buf, ldk);
            Kb = buf, kst = ldk;
        } else {
            Kb = (const float *)Kg + (long)(c0 + b) * ks;
#if COLI_REALIGN
            int sk = nb > 1 ? coli_row_shift(Kb, ks, hd) : 0; /* staging pays off when several heads read */
            if (sk) {
                coli_stage_rows(Kb, ks, n, hd, sk, buf, ldk);
                Kb = buf, kst = ldk;
            }
#endif
        }
        for (int i = 0; i < nb; i++)
            coli_att_score(direct ? sc[i] : coli_qk_block(q + (long)(h0 + i) * hd, Kb, kst, n, hd), n, scale, softcap,
                           s[i] + b);
    }
    for (int i = 0; i < nb; i++) coli_att_softmax(s[i], nvec, ml + i * lds);
    const float *V0 = half ? NULL : (const float *)Vg + (long)c0 * vs;
    int sv = V0 != NULL && nb > 1 ? coli_row_shift(V0, vs, vd) : 0;
#if defined(cv_load_h)
    /* widened as read, block by block: the same floats and sums as through the buffer. Only where
     * the keys are read so too: on AVX2 olmoe's values (one head, vd 128, two pieces of a row)
     * read cold 2-6% slower without the buffer's row-by-row walk, while its keys took the buffer. */
    if (half && vd % CV_W == 0 && coli_qkh_fits(nb, hd)) {
        for (int b = 0; b < nk; b += CV_W)
            coli_pvh_h(nb, oc, ldo, (const uint16_t *)Vg + (long)(c0 + b) * vs, vs, nk - b < CV_W ? nk - b : CV_W,
                       s[0] + b, COLI_ATT_CH, b == 0, vd);
        return;
    }
#endif
    if (half || sv) { /* block by block through the buffer (the sums go through oc: the same bits) */
        for (int b = 0; b < nk; b += CV_W) {
            int n = nk - b < CV_W ? nk - b : CV_W;
            if (half) coli_f16_rows((const uint16_t *)Vg + (long)(c0 + b) * vs, vs, n, vd, buf, ldv);
            else coli_stage_rows(V0 + (long)b * vs, vs, n, vd, sv, buf, ldv); /* realigned */
            coli_pvh(nb, oc, ldo, buf, ldv, n, s[0] + b, COLI_ATT_CH, b == 0, vd);
        }
        return;
    }
    coli_pvh(nb, oc, ldo, V0, vs, nk, s[0], COLI_ATT_CH, 1, vd);
}

/* Merge a chunk (output oc, max mc, sum lc) into one head's running (o, *m, *l), in chunk order:
 * m' = max(m, mc), o = o e^(m - m') + oc e^(mc - m'), l likewise. */
static inline void coli_attend_merge(float *o, float *m, float *l, const float *oc, float mc, float lc, int vd) {
    float mn = mc > *m ? mc : *m, a = coli_exp1(*m - mn), b = coli_exp1(mc - mn);
    coli_scale_add(o, a, oc, b, vd);
    *l = *l * a + lc * b;
    *m = mn;
}

/* o[:vd] /= l (as a product by 1 / l) */
static inline void coli_attend_finish(float *o, float l, int vd) {
    float f = 1.0f / l;
    int i = 0;
    for (; i + CV_W <= vd; i += CV_W) cv_store(o + i, cv_mul(cv_load(o + i), cv_set1(f)));
    if (i < vd) cv_storen(o + i, cv_mul(cv_loadn(o + i, vd - i), cv_set1(f)), vd - i);
}

/* Heads h0 .. h0+nb-1 of one KV group of a row over keys [j0, j1): their chunks in turn, merged
 * into o (head h at o + h*vd) and normalized. tmp: nb*vd floats of scratch. */
static inline void coli_attend_seq(const float *q, const void *Kg, long ks, const void *Vg, long vs, int h0,
                                   int nb, int j0, int j1, int hd, int vd, float scale, float softcap, int half,
                                   float *o, float *tmp) {
    float ml[2 * COLI_ATT_HB], mc[2 * COLI_ATT_HB];
    float *oh = o + (long)h0 * vd;
    if (j1 <= j0) {
        memset(oh, 0, (size_t)nb * vd * sizeof(float));
        return;
    }
    int c1 = j1 - j0 < COLI_ATT_CH ? j1 : j0 + COLI_ATT_CH;
    coli_attend_part(q, Kg, ks, Vg, vs, h0, nb, j0, c1, hd, vd, scale, softcap, half, oh, vd, ml, 2);
    for (int c0 = c1; c0 < j1; c0 += COLI_ATT_CH) {
        c1 = j1 - c0 < COLI_ATT_CH ? j1 : c0 + COLI_ATT_CH;
        coli_attend_part(q, Kg, ks, Vg, vs, h0, nb, c0, c1, hd, vd, scale, softcap, half, tmp, vd, mc, 2);
        for (int i = 0; i < nb; i++)
            coli_attend_merge(oh + (long)i * vd, &ml[2 * i], &ml[2 * i + 1], tmp + (long)i * vd, mc[2 * i],
                              mc[2 * i + 1], vd);
    }
    for (int i = 0; i < nb; i++) coli_attend_finish(oh + (long)i * vd, ml[2 * i + 1], vd);
}

/* ---- prefill attention: a tile of rows of one sequence ----------------------------------
 * In a prompt's prefill every row reads all the keys before it. Walked row after row, each
 * row streams its sequence's whole K / V from L3 (SmolLM2's 2048 positions: 3 MB a layer,
 * larger than L2), and the L3's bandwidth, shared by the cores, is the limit: two threads ran
 * no faster than one. A tile walks its nr rows chunk by chunk instead: chunk c of every row,
 * then chunk c + 1, so a chunk's keys and values (COLI_ATT_CH rows of one KV head: 32 KB at
 * head_dim 64) come from L3 once and from L1 / L2 for the tile's other rows. Each row's
 * arithmetic is coli_attend_seq's, in the same order (its own chunks counted from its own
 * first key, merged in chunk order): the same bits, whichever rows share a tile.
 *
 * From an f16 cache, the positions the tile's rows read in chunk c (one range of at most
 * COLI_ATT_CH + COLI_ATT_ROWS positions for a prompt's consecutive rows, windows included) are
 * widened once into the caller's scratch, 64-byte aligned, and every row reads them as a
 * float32 cache: the same exact widening, so the same bits again, without each row widening
 * every block for itself. */
#define COLI_ATT_ROWS 16 /* rows a tile holds at most */
#define COLI_ATT_SPAN (COLI_ATT_CH + COLI_ATT_ROWS) /* positions a tile's widened chunk holds */
/* floats of the scratch coli_attend_rows widens an f16 chunk into (keys, then values) */
#define COLI_ATT_WIDE(hd, vd) ((long)COLI_ATT_SPAN * (((hd) + 15) / 16 * 16 + ((vd) + 15) / 16 * 16))

/* The positions [*lo, *hi) that chunk c of nr rows covers (row r reads [j0[r] + c*COLI_ATT_CH,
 * at most COLI_ATT_CH on, below j1[r])), and how many of the rows read in it (0: none; *lo and
 * *hi are then left as they were). */
static inline int coli_att_chunk_range(const int *j0, const int *j1, int nr, int c, int *lo, int *hi) {
    int live = 0;
    for (int r = 0; r < nr; r++) {
        int c0 = j0[r] + c * COLI_ATT_CH, c1 = j1[r] - c0 < COLI_ATT_CH ? j1[r] : c0 + COLI_ATT_CH;
        if (c0 >= j1[r]) continue;
        *lo = live++ == 0 || c0 < *lo ? c0 : *lo;
        *hi = live == 1 || c1 > *hi ? c1 : *hi;
    }
    return live;
}

/* Heads h0 .. h0+nb-1 (one KV group) of nr <= COLI_ATT_ROWS rows reading the same KV head: row
 * r's queries at q + r*ldq, its keys [j0[r], j1[r]), its output at o + r*ldo (head h at
 * + h*vd). tmp: nb*vd floats of scratch; wide: COLI_ATT_WIDE(hd, vd) floats, 64-byte aligned,
 * for an f16 cache's chunks (NULL: each row widens its own blocks). */
static inline void coli_attend_rows(const float *q, long ldq, const void *Kg, long ks, const void *Vg, long vs,
                                    int h0, int nb, const int *j0, const int *j1, int nr, int hd, int vd, float scale,
                                    float softcap, int half, float *o, long ldo, float *tmp, float *wide) {
    float ml[COLI_ATT_ROWS][2 * COLI_ATT_HB], mc[2 * COLI_ATT_HB];
    int nc = 0, inkeys = Vg == Kg && vs == ks && vd <= hd; /* MLA: the values lead the key rows */
    long ldk = (hd + 15) / 16 * 16, ldv = inkeys ? ldk : (vd + 15) / 16 * 16;
    float *wv = wide == NULL || inkeys ? wide : wide + COLI_ATT_SPAN * ldk;
    for (int r = 0; r < nr; r++) {
        int c = (j1[r] - j0[r] + COLI_ATT_CH - 1) / COLI_ATT_CH;
        nc = c > nc ? c : nc;
        if (j1[r] <= j0[r]) memset(o + r * ldo + (long)h0 * vd, 0, (size_t)nb * vd * sizeof(float));
    }
    for (int c = 0; c < nc; c++) {
        const void *Kc = Kg, *Vc = Vg;
        long ksc = ks, vsc = vs;
        int hc = half, lo = 0, hi = 0, live = 0;
        if (coli_att_prefetch > 0 && c + coli_att_prefetch < nc) { /* the rows of the chunk ahead */
            int plo = 0, phi = 0;
            if (coli_att_chunk_range(j0, j1, nr, c + coli_att_prefetch, &plo, &phi) > 0)
                coli_attend_prefetch(Kg, ks, Vg, vs, plo, phi - plo > COLI_ATT_SPAN ? plo + COLI_ATT_SPAN : phi, hd,
                                     vd, half);
        }
        if (half && wide != NULL && nr > 1) {
            live = coli_att_chunk_range(j0, j1, nr, c, &lo, &hi);
            if (live > 1 && hi - lo <= COLI_ATT_SPAN) {
                coli_f16_rows((const uint16_t *)Kg + (long)lo * ks, ks, hi - lo, hd, wide, ldk);
                if (!inkeys) coli_f16_rows((const uint16_t *)Vg + (long)lo * vs, vs, hi - lo, vd, wv, ldv);
                Kc = wide, Vc = wv, ksc = ldk, vsc = ldv, hc = 0;
            } else
                lo = 0;
        }
        for (int r = 0; r < nr; r++) {
            int c0 = j0[r] + c * COLI_ATT_CH, c1;
            if (c0 >= j1[r]) continue;
            c1 = j1[r] - c0 < COLI_ATT_CH ? j1[r] : c0 + COLI_ATT_CH;
            float *oh = o + r * ldo + (long)h0 * vd;
            const float *qr = q + r * ldq;
            if (c == 0) {
                coli_attend_part(qr, Kc, ksc, Vc, vsc, h0, nb, c0 - lo, c1 - lo, hd, vd, scale, softcap, hc, oh, vd,
                                 ml[r], 2);
                continue;
            }
            coli_attend_part(qr, Kc, ksc, Vc, vsc, h0, nb, c0 - lo, c1 - lo, hd, vd, scale, softcap, hc, tmp, vd, mc, 2);
            for (int i = 0; i < nb; i++)
                coli_attend_merge(oh + (long)i * vd, &ml[r][2 * i], &ml[r][2 * i + 1], tmp + (long)i * vd,
                                  mc[2 * i], mc[2 * i + 1], vd);
        }
    }
    for (int r = 0; r < nr; r++)
        if (j1[r] > j0[r])
            for (int i = 0; i < nb; i++)
                coli_attend_finish(o + r * ldo + (long)(h0 + i) * vd, ml[r][2 * i + 1], vd);
}

/* One head's nc chunks computed apart (chunk c's output at oc + c*vd, its max and sum at
 * ml[2c], ml[2c + 1]) merged in order into o[:vd] and normalized: coli_attend_seq's bits. */
static inline void coli_attend_join(float *o, const float *oc, const float *ml, int nc, int vd) {
    float m = ml[0], l = ml[1];
    memcpy(o, oc, (size_t)vd * sizeof(float));
    for (int c = 1; c < nc; c++) coli_attend_merge(o, &m, &l, oc + (long)c * vd, ml[2 * c], ml[2 * c + 1], vd);
    coli_attend_finish(o, l, vd);
}

/* ---- decode attention, every head of a row at once -------------------------------------
 * A work item of coli_attend_part reads one KV head's slice of each cache row: rows hold every
 * KV head of a position, so that is a few lines every few KB, a walk the hardware prefetchers
 * hardly follow (olmoe's 16 KV heads of 64 f16: 128 bytes every 2 KB). Read that way a decode
 * step's cold cache came at 7-9 GB/s where its weights stream at 31-33 (BENCHMARKS.md). Here one
 * query row takes one chunk of its keys for all its heads, reading the chunk's K rows and then
 * its V rows each whole and in address order, the walk the prefetchers follow best.
 *
 * The arithmetic is coli_attend_part's, for head dims that are whole vectors (coli_attend_wide_fits):
 * a key's score for head h is the chain of FMAs over its vectors from zero, the block's CV_W
 * chains summed by cv_sum_lanes, scaled and capped by coli_att_score, the chunk's softmax by
 * coli_att_softmax, and each output lane the chain of FMAs over the chunk's keys in order from
 * zero. Only where the chains wait differs: the score chains of a block (nh x CV_W vectors) and
 * the output sums (nh x vd floats, at oc) are kept in L1 instead of registers. So a head's
 * chunk output, max and sum are coli_attend_part's bits and merge as its do. */

/* Whether coli_attend_wide computes heads of these dims (whole vectors) from such a cache */
static inline int coli_attend_wide_fits(int hd, int vd, int half) {
#if !defined(cv_load_h)
    if (half) return 0;
#endif
    return hd % CV_W == 0 && vd % CV_W == 0;
}

/* floats of the scratch coli_attend_wide takes for nh heads (64-byte aligned): the score
 * chains of a block, the chunk's scores */
#define COLI_ATT_WIDE_WORK(nh) ((long)(nh) * (CV_W * CV_W + COLI_ATT_CH))

/* While it reads one K or V row, coli_attend_wide asks for the row this many ahead into L2 (when
 * coli_att_prefetch is on): the prefetchers alone, on rows of a few KB, kept too few lines in flight.
 * With it one-token attention of olmoe-mini's shape read a cold cache 1.25-1.4x faster at 160-2000
 * positions; 2, 4 and 8 rows measured alike, 16 worse (BENCHMARKS.md). */
#define COLI_ATT_WIDE_AHEAD 4
static inline void coli_prefetch_row(const void *p, long bytes) {
    for (long b = 0; b < bytes; b += 64) COLI_PREFETCH_L2((const char *)p + b);
}
/* Head h's score chain for one key of the block: the FMAs over its vectors from zero (as
 * coli_attend_part's), for NR heads h0 .. h0 + NR - 1 of one KV group, whose key vector k is
 * widened once for all of them. */
#define COLI_ATT_WIDE_QK(NR, VT, LOAD)                                                             \
    {                                                                                              \
        const float *qh = q + (long)h0 * hd;                                                       \
        cv_t a0 = cv_zero(), a1 = cv_zero(), a2 = cv_zero(), a3 = cv_zero();                       \
        for (int v = 0; v < nq; v++) {                                                             \
            cv_t kv = LOAD(k + v * CV_W);                                                          \
            a0 = cv_fma(cv_load(qh + v * CV_W), kv, a0);                                           \
            if (NR > 1) a1 = cv_fma(cv_load(qh + hd + v * CV_W), kv, a1);                          \
            if (NR > 2) a2 = cv_fma(cv_load(qh + 2 * hd + v * CV_W), kv, a2);                      \
            if (NR > 3) a3 = cv_fma(cv_load(qh + 3 * hd + v * CV_W), kv, a3);                      \
        }                                                                                          \
        acc[h0 * CV_W + i] = a0;                                                                   \
        if (NR > 1) acc[(h0 + 1) * CV_W + i] = a1;                                                 \
        if (NR > 2) acc[(h0 + 2) * CV_W + i] = a2;                                                 \
        if (NR > 3) acc[(h0 + 3) * CV_W + i] = a3;                                                 \
    }
/* Output vector v of heads h .. h + NR - 1 of one KV group over the NJ (1 or 4) keys j .. of the
 * value vectors x0 .. x3 (widened once for the group), each output lane the chain of FMAs over
 * the keys in order (from zero at the chunk's first key), kept in a register across the NJ keys. */
#define COLI_ATT_WIDE_PV(NJ, VT, LOAD)                                                             \
    {                                                                                              \
        cv_t v0 = LOAD(x0 + v * CV_W), v1 = v0, v2 = v0, v3 = v0;                                  \
        if (NJ > 1) v1 = LOAD(x0 + vs + v * CV_W), v2 = LOAD(x0 + 2 * vs + v * CV_W), v3 = LOAD(x0 + 3 * vs + v * CV_W); \
        for (int r = 0; r < group; r++) {                                                          \
            const float *sp = s + (long)(h + r) * COLI_ATT_CH + j;                                 \
            float *o = oc + (long)(h + r) * ldo + v * CV_W;                                        \
            cv_t t = cv_fma(cv_set1(sp[0]), v0, j == 0 ? cv_zero() : cv_load(o));                  \
            if (NJ > 1) {                                                                          \
                t = cv_fma(cv_set1(sp[1]), v1, t);                                                 \
                t = cv_fma(cv_set1(sp[2]), v2, t);                                                 \
                t = cv_fma(cv_set1(sp[3]), v3, t);                                                 \
            }                                                                                      \
            cv_store(o, t);                                                                        \
        }                                                                                          \
    }
/* GQA in coli_attend_wide: the heads of a run (of a KV group) a pass of coli_qkh takes for NQ
 * vectors a head, about what the path's vector registers hold besides the chains and the key
 * vector (AVX-512 with 8 vectors a head takes 4 heads though some of their queries spill:
 * Llama-3-8B's shape, group 4 of 128, measured 289 us against 325 with 2); 0: no such pass. */
#if CV_W == 16 || CV_W == 4
#define COLI_ATT_WIDE_HB(NQ) ((NQ) <= 8 ? 4 : 0)
#elif CV_W == 8
#define COLI_ATT_WIDE_HB(NQ) ((NQ) <= 2 ? 4 : (NQ) <= 4 ? 2 : (NQ) <= 8 ? 1 : 0)
#else
#define COLI_ATT_WIDE_HB(NQ) 0
#endif
/* Whether coli_attend_wide's GQA blocks take coli_qkh passes (an f16 cache whose head width it
 * has a tile for at any run length), and the pass (sc: one score vector a head, coli_qkh's). */
static inline int coli_att_wide_qkh_fits_f32(int hd) { (void)hd; return 0; }
static inline void coli_att_wide_qkh_f32(int nb, int hd, const float *q, const float *K, long ks, int n, cv_t *sc) {
    (void)nb, (void)hd, (void)q, (void)K, (void)ks, (void)n, (void)sc;
}
#if defined(cv_load_h)
static inline int coli_att_wide_qkh_fits_f16(int hd) {
    return coli_qkh_fits(1, hd) && COLI_ATT_WIDE_HB(hd / CV_W) > 0;
}
static inline void coli_att_wide_qkh_f16(int nb, int hd, const float *q, const uint16_t *K, long ks, int n,
                                         cv_t *sc) {
    coli_qkh(nb, hd, q, hd, K, ks, n, sc);
}
#endif

#define COLI_ATT_WIDE_OF(SFX, VT, LOAD)                                                            \
    static inline void coli_attend_wide##SFX(const float *q, const VT *K, long ks, const VT *V, long vs, int nkv, \
                                             int group, int c0, int c1, int hd, int vd, float scale, float softcap, \
                                             float *oc, long ldo, float *ml, long lds, float *work) {     \
        int nh = nkv * group, ahead = coli_att_prefetch > 0, nk = c1 - c0, nq = hd / CV_W, nv = vd / CV_W;                        \
        int qkh = coli_att_wide_qkh_fits##SFX(hd);                                                  \
        cv_t *acc = (cv_t *)work; /* acc[h * CV_W + i]: head h's chain for key i of the block */  \
        float *s = work + (long)nh * CV_W * CV_W; /* s[h * COLI_ATT_CH + j]: head h, key j */      \
        for (int b = 0; b < nk; b += CV_W) {                                                       \
            int n = nk - b < CV_W ? nk - b : CV_W;                                                 \
            if (group > 1 && qkh) { /* GQA: coli_qkh passes of a KV group's runs of heads, their   \
                                     * queries held in registers across the block's keys, each key \
                                     * vector widened once for a run (without GQA, passes by heads \
                                     * over a block's 16 rows measured 2.5% slower in olmoe-mini's \
                                     * whole steps than the rows one by one for all heads, below) */ \
                for (int i = 0; ahead && i < n && c0 + b + i + COLI_ATT_WIDE_AHEAD < c1; i++)         \
                    coli_prefetch_row(K + (long)(c0 + b + i + COLI_ATT_WIDE_AHEAD) * ks, (long)nkv * hd * sizeof(VT)); \
                for (int g = 0; g < nkv; g++)                                                      \
                    for (int h0 = g * group, r; h0 < (g + 1) * group; h0 += r) {                   \
                        cv_t sc[4];                                                                \
                        r = (g + 1) * group - h0 < COLI_ATT_WIDE_HB(nq) ? (g + 1) * group - h0 : COLI_ATT_WIDE_HB(nq); \
                        coli_att_wide_qkh##SFX(r, hd, q + (long)h0 * hd, K + (long)(c0 + b) * ks + (long)g * hd, ks, n, sc); \
                        for (int t = 0; t < r; t++)                                                \
                            coli_att_score(sc[t], n, scale, softcap, s + (long)(h0 + t) * COLI_ATT_CH + b); \
                    }                                                                              \
                continue;                                                                          \
            }                                                                                      \
            for (int i = 0; i < n; i++) {                                                          \
                const VT *row = K + (long)(c0 + b + i) * ks;                                       \
                if (ahead && c0 + b + i + COLI_ATT_WIDE_AHEAD < c1)                                \
                    coli_prefetch_row(row + COLI_ATT_WIDE_AHEAD * ks, (long)nkv * hd * sizeof(VT)); \
                if (group == 1) { /* four heads' chains in flight, each its own key vectors */    \
                    int h0 = 0;                                                                    \
                    for (; h0 + 4 <= nh; h0 += 4) {                                                \
                        const float *qh = q + (long)h0 * hd;                                       \
                        const VT *k0 = row + (long)h0 * hd, *k1 = k0 + hd, *k2 = k0 + 2 * hd, *k3 = k0 + 3 * hd; \
                        cv_t a0 = cv_zero(), a1 = cv_zero(), a2 = cv_zero(), a3 = cv_zero();       \
                        for (int v = 0; v < nq; v++) {                                             \
                            a0 = cv_fma(cv_load(qh + v * CV_W), LOAD(k0 + v * CV_W), a0);          \
                            a1 = cv_fma(cv_load(qh + hd + v * CV_W), LOAD(k1 + v * CV_W), a1);     \
                            a2 = cv_fma(cv_load(qh + 2 * hd + v * CV_W), LOAD(k2 + v * CV_W), a2); \
                            a3 = cv_fma(cv_load(qh + 3 * hd + v * CV_W), LOAD(k3 + v * CV_W), a3); \
                        }                                                                          \
                        acc[h0 * CV_W + i] = a0, acc[(h0 + 1) * CV_W + i] = a1;                    \
                        acc[(h0 + 2) * CV_W + i] = a2, acc[(h0 + 3) * CV_W + i] = a3;              \
                    }                                                                              \
                    for (; h0 < nh; h0++) {                                                        \
                        const VT *k = row + (long)h0 * hd;                                         \
                        COLI_ATT_WIDE_QK(1, VT, LOAD)                                              \
                    }                                                                              \
                } else /* GQA: each KV head's key vectors widened once for up to 4 of its heads */ \
                    for (int g = 0; g < nkv; g++) {                                                \
                        const VT *k = row + (long)g * hd;                                          \
                        for (int h0 = g * group; h0 < (g + 1) * group;) {                          \
                            switch ((g + 1) * group - h0) {                                        \
                            case 1: COLI_ATT_WIDE_QK(1, VT, LOAD) h0 += 1; break;                  \
                            case 2: COLI_ATT_WIDE_QK(2, VT, LOAD) h0 += 2; break;                  \
                            case 3: COLI_ATT_WIDE_QK(3, VT, LOAD) h0 += 3; break;                  \
                            default: COLI_ATT_WIDE_QK(4, VT, LOAD) h0 += 4; break;                 \
                            }                                                                      \
                        }                                                                          \
                    }                                                                              \
            }                                                                                      \
            for (int h = 0; h < nh; h++) {                                                         \
                for (int i = n; i < CV_W; i++) acc[h * CV_W + i] = cv_zero();                      \
                coli_att_score(cv_sum_lanes(acc + h * CV_W), n, scale, softcap, s + (long)h * COLI_ATT_CH + b); \
            }                                                                                      \
        }                                                                                          \
        int nvec = (nk + CV_W - 1) / CV_W;                                                         \
        for (int h = 0; h < nh; h++) coli_att_softmax(s + (long)h * COLI_ATT_CH, nvec, ml + (long)h * lds); \
        /* keys four at a time: each output vector loaded and stored once for the four */          \
        int j = 0;                                                                                 \
        for (; j + 4 <= nk; j += 4) {                                                              \
            const VT *x = V + (long)(c0 + j) * vs;                                                 \
            if (ahead)                                                                             \
                for (int a = COLI_ATT_WIDE_AHEAD; a < COLI_ATT_WIDE_AHEAD + 4; a++)                \
                    if (c0 + j + a < c1) coli_prefetch_row(x + a * vs, (long)nkv * vd * sizeof(VT)); \
            for (int g = 0, h = 0; g < nkv; g++, h += group) {                                     \
                const VT *x0 = x + (long)g * vd;                                                   \
                for (int v = 0; v < nv; v++) COLI_ATT_WIDE_PV(4, VT, LOAD)                         \
            }                                                                                      \
        }                                                                                          \
        for (; j < nk; j++) {                                                                      \
            const VT *x = V + (long)(c0 + j) * vs;                                                 \
            for (int g = 0, h = 0; g < nkv; g++, h += group) {                                     \
                const VT *x0 = x + (long)g * vd;                                                   \
                for (int v = 0; v < nv; v++) COLI_ATT_WIDE_PV(1, VT, LOAD)                         \
            }                                                                                      \
        }                                                                                          \
    }
COLI_ATT_WIDE_OF(_f32, float, cv_load)
#if defined(cv_load_h)
COLI_ATT_WIDE_OF(_f16, uint16_t, cv_load_h)
#endif

/* Every head of one query row (q: head h at q + h*hd) against keys [c0, c1) (one chunk, at most
 * COLI_ATT_CH) of its cache: K, V the caches' rows (key j at K + j*ks, V + j*vs elements; KV head g
 * at + g*hd, + g*vd), float32 or f16 (half). Head h's unnormalized chunk output to oc + h*ldo, its
 * max and sum to ml[h*lds], ml[h*lds + 1] (coli_attend_part's outputs). work:
 * COLI_ATT_WIDE_WORK(nkv * group) floats, 64-byte aligned. The head dims must fit
 * (coli_attend_wide_fits). */
static inline void coli_attend_wide(const float *q, const void *K, long ks, const void *V, long vs, int nkv,
                                    int group, int c0, int c1, int hd, int vd, float scale, float softcap, int half,
                                    float *oc, long ldo, float *ml, long lds, float *work) {
#if defined(cv_load_h)
    if (half) {
        coli_attend_wide_f16(q, (const uint16_t *)K, ks, (const uint16_t *)V, vs, nkv, group, c0, c1, hd, vd, scale,
                             softcap, oc, ldo, ml, lds, work);
        return;
    }
#endif
    coli_attend_wide_f32(q, (const float *)K, ks, (const float *)V, vs, nkv, group, c0, c1, hd, vd, scale, softcap,
                         oc, ldo, ml, lds, work);
}

/* Query heads [h0, h1) of one row (head h at q + h*hd, output at o + h*vd) against keys
 * [j0, j1): o_h = softmax(scale * q_h . K) V over the cache rows K + j*ks, V + j*vs of KV head
 * h / group (at K + (h / group) * hd, V + (h / group) * vd), single-threaded (kernels.pyx splits
 * the same work items across threads itself). vd <= 4 * COLI_STAGE_LD. K and V are float32,
 * or f16 when half is set (elements, not bytes, in ks, vs and the offsets). */
static inline void coli_attend(const float *q, const void *K, long ks, const void *V, long vs, int h0, int h1,
                               int group, int j0, int j1, int hd, int vd, float scale, float softcap, int half,
                               float *o) {
    float tmp[COLI_ATT_HB * COLI_STAGE_LD];
    int nbmax = COLI_ATT_HB * COLI_STAGE_LD / vd < COLI_ATT_HB ? COLI_ATT_HB * COLI_STAGE_LD / vd : COLI_ATT_HB;
    for (int h = h0; h < h1;) {
        int g = h / group, he = (g + 1) * group < h1 ? (g + 1) * group : h1;
        if (he - h > nbmax) he = h + nbmax;
        coli_attend_seq(q, COLI_KV_AT(K, (long)g * hd, half), ks, COLI_KV_AT(V, (long)g * vd, half), vs, h, he - h,
                        j0, j1, hd, vd, scale, softcap, half, o, tmp);
        h = he;
    }
}

/* ---- token-panel GEMM for many tokens (prefill) --------------------------------------
 * For M >= a few dozen rows, the dot-product tiles above spend their time on horizontal
 * sums. Here the activations are packed once per GEMM into panels of COLI_NP tokens,
 * P[t][k][j] = X[t*NP + j][k], and each block of COLI_WR weight rows x NP tokens is an
 * outer-product loop: per k, one vector load of the token panel, COLI_WR broadcasts of
 * weights (read straight from the row-major, possibly memory-mapped, matrix: nothing is
 * copied) and 2*COLI_WR FMAs into COLI_WR x 2 accumulators; no reductions. */
#define COLI_NP (2 * CV_W) /* tokens per panel */
#if defined(__AVX512F__) || defined(COLI_NEON) /* NEON: 32 registers, room for 8 x 2 sums */
#define COLI_WR 8
#else
#define COLI_WR 6
#endif

/* Pack X (M, K) into ceil(M / NP) token panels of K x NP floats (zero rows past M). */
static inline void coli_pack_tokens(const float *X, long ldx, int M, int K, float *P) {
    for (int t0 = 0; t0 < M; t0 += COLI_NP) {
        float *p = P + (long)(t0 / COLI_NP) * K * COLI_NP;
        int nt = M - t0 < COLI_NP ? M - t0 : COLI_NP;
        for (int k = 0; k < K; k++) {
            float *q = p + (long)k * COLI_NP;
            int j = 0;
            for (; j < nt; j++) q[j] = X[(long)(t0 + j) * ldx + k];
            for (; j < COLI_NP; j++) q[j] = 0.0f;
        }
    }
}

/* a0[i], a1[i] (WR rows x COLI_NP tokens) += W[i, k] * P[k, :] for k < K: the panel product
 * of the register tiles here and of their accumulating twins in simd_q.h. */
#define COLI_RTILE_PANEL(WR)                                                                       \
        for (int k = 0; k < K; k++) {                                                              \
            cv_t x0 = cv_load(P + (long)k * COLI_NP), x1 = cv_load(P + (long)k * COLI_NP + CV_W);  \
            for (int i = 0; i < WR; i++) {                                                         \
                cv_t w = cv_set1(W[i * ldw + k]);                                                  \
                a0[i] = cv_fma(w, x0, a0[i]);                                                      \
                a1[i] = cv_fma(w, x1, a1[i]);                                                      \
            }                                                                                      \
        }

#define COLI_RTILE(WR)                                                                             \
    static inline void coli_rtile_##WR(const float *W, long ldw, const float *P, int K, float *Y,  \
                                       long ldy, int nt) {                                         \
        cv_t a0[WR], a1[WR];                                                                       \
        for (int i = 0; i < WR; i++) a0[i] = a1[i] = cv_zero();                                    \
        COLI_RTILE_PANEL(WR)                                                                       \
        float t[WR][COLI_NP];                                                                      \
        for (int i = 0; i < WR; i++) {                                                             \
            cv_store(t[i], a0[i]);                                                                 \
            cv_store(t[i] + CV_W, a1[i]);                                                          \
        }                                                                                          \
        for (int j = 0; j < nt; j++)                                                               \
            for (int i = 0; i < WR; i++) Y[j * ldy + i] = t[i][j];                                 \
    }
COLI_RTILE(1) COLI_RTILE(2) COLI_RTILE(3) COLI_RTILE(4) COLI_RTILE(5) COLI_RTILE(6)
#if COLI_WR == 8
COLI_RTILE(7) COLI_RTILE(8)
#endif

/* Y[m, 0:nb] = X[m] . W[0:nb] for all m < M, X already packed into token panels P. */
static inline void coli_gemm_tokens(const float *P, int M, const float *W, long ldw, int nb, int K, float *Y,
                                    long ldy) {
    for (int n = 0; n < nb; n += COLI_WR) {
        int wr = nb - n < COLI_WR ? nb - n : COLI_WR;
        for (int t0 = 0; t0 < M; t0 += COLI_NP) {
            int nt = M - t0 < COLI_NP ? M - t0 : COLI_NP;
            const float *p = P + (long)(t0 / COLI_NP) * K * COLI_NP;
            const float *w = W + (long)n * ldw;
            float *y = Y + (long)t0 * ldy + n;
            switch (wr) {
            case 1: coli_rtile_1(w, ldw, p, K, y, ldy, nt); break;
            case 2: coli_rtile_2(w, ldw, p, K, y, ldy, nt); break;
            case 3: coli_rtile_3(w, ldw, p, K, y, ldy, nt); break;
            case 4: coli_rtile_4(w, ldw, p, K, y, ldy, nt); break;
            case 5: coli_rtile_5(w, ldw, p, K, y, ldy, nt); break;
#if COLI_WR == 8
            case 6: coli_rtile_6(w, ldw, p, K, y, ldy, nt); break;
            case 7: coli_rtile_7(w, ldw, p, K, y, ldy, nt); break;
            default: coli_rtile_8(w, ldw, p, K, y, ldy, nt); break;
#else
            default: coli_rtile_6(w, ldw, p, K, y, ldy, nt); break;
#endif
            }
        }
    }
}

/* out[i] = act(g[i]) * u[i] for i < n (act 0: silu, 1: gelu_tanh; out may be g), CV_W lanes at a
 * time with cv_exp (the tail: the same arithmetic on a partial vector, so an element's result
 * does not depend on where it sits). silu(g) = g / (1 + e^-g); gelu_tanh(g) = 0.5 g (1 + tanh z)
 * = g / (1 + e^-2z), z = sqrt(2/pi) (g + 0.044715 g^3): one exp and one division per element
 * (a scalar expf or tanhf per element cost a decode step of SmolLM2-135M ~0.4 ms). */
#if defined(__AVX512F__)
#define cv_div(a, b) _mm512_div_ps(a, b)
#elif defined(__AVX2__) && defined(__FMA__)
#define cv_div(a, b) _mm256_div_ps(a, b)
#elif defined(COLI_NEON)
#define cv_div(a, b) vdivq_f32(a, b)
#else
#define cv_div(a, b) ((a) / (b))
#endif
static inline cv_t coli_gated_act_v(cv_t g, cv_t u, int act) {
    cv_t t = g; /* silu: e^-g */
    if (act == 1) /* gelu_tanh: e^-2z = e^(g * (-2c - 2c 0.044715 g^2)) */
        t = cv_mul(g, cv_fma(cv_mul(g, g), cv_set1(0.0713548162726f), cv_set1(1.5957691216057f)));
    cv_t e = cv_exp(cv_sub(cv_zero(), t));
    return cv_div(cv_mul(g, u), cv_add(e, cv_set1(1.0f)));
}
static inline void coli_gated_act_row(const float *g, const float *u, float *out, int n, int act) {
    int i = 0;
    for (; i + CV_W <= n; i += CV_W) cv_store(out + i, coli_gated_act_v(cv_load(g + i), cv_load(u + i), act));
    if (i < n) cv_storen(out + i, coli_gated_act_v(cv_loadn(g + i, n - i), cv_loadn(u + i, n - i), act), n - i);
}

#endif /* COLI_SIMD_H */
