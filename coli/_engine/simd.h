/* SIMD building blocks for the fp32 kernels of coli._engine.kernels.
 *
 * One vector abstraction (cv_*) picked at compile time: AVX-512F, AVX2+FMA, or a
 * scalar fallback (COLI_PORTABLE=1 builds without -march=native and land here
 * unless the compiler's baseline already has AVX2).
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

/* One MR x NR register tile; MR, NR are literals at every call site so the
 * accumulator arrays are unrolled into registers. */
#define COLI_TILE(MR, NR)                                                          \
    static inline void coli_tile_##MR##x##NR(const float *X, long ldx, const float *W, \
                                             long ldw, int K, float *Y, long ldy) {  \
        cv_t acc[MR][NR];                                                          \
        for (int i = 0; i < MR; i++)                                               \
            for (int j = 0; j < NR; j++) acc[i][j] = cv_zero();                    \
        int k = 0;                                                                 \
        for (; k + CV_W <= K; k += CV_W) {                                         \
            cv_t w[NR];                                                            \
            for (int j = 0; j < NR; j++) w[j] = cv_load(W + j * ldw + k);          \
            for (int i = 0; i < MR; i++) {                                         \
                cv_t x = cv_load(X + i * ldx + k);                                 \
                for (int j = 0; j < NR; j++) acc[i][j] = cv_fma(x, w[j], acc[i][j]); \
            }                                                                      \
        }                                                                          \
        for (int i = 0; i < MR; i++)                                               \
            for (int j = 0; j < NR; j++) {                                         \
                float s = cv_sum(acc[i][j]);                                       \
                for (int kk = k; kk < K; kk++) s += X[i * ldx + kk] * W[j * ldw + kk]; \
                Y[i * ldy + j] = s;                                                \
            }                                                                      \
    }

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

/* One query row of one head against keys [j0, j1): o = softmax(scale * q.K) V.
 * Keys go in blocks of 32: the block's scores first, then one rescale of the running
 * output if the block raised the maximum, then the weighted value rows. */
static inline void coli_attend(const float *q, const float *K, long ks, const float *V, long vs, int j0, int j1,
                               int hd, int vd, float scale, float softcap, float *o) {
    float sc[32], mx = -INFINITY, l = 0.0f;
    memset(o, 0, vd * sizeof(float));
    for (int b = j0; b < j1; b += 32) {
        int n = j1 - b < 32 ? j1 - b : 32;
        float bm = -INFINITY;
        for (int i = 0; i < n; i++) {
            float s = coli_dot(q, K + (long)(b + i) * ks, hd) * scale;
            if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
            sc[i] = s;
            bm = s > bm ? s : bm;
        }
        if (bm > mx) {
            float c = expf(mx - bm);
            coli_scale_add(o, c, o, 0.0f, vd);
            l *= c;
            mx = bm;
        }
        for (int i = 0; i < n; i++) {
            float p = expf(sc[i] - mx);
            l += p;
            coli_scale_add(o, 1.0f, V + (long)(b + i) * vs, p, vd);
        }
    }
    coli_scale_add(o, 1.0f / l, o, 0.0f, vd);
}

/* ---- token-panel GEMM for many tokens (prefill) --------------------------------------
 * For M >= a few dozen rows, the dot-product tiles above spend their time on horizontal
 * sums. Here the activations are packed once per GEMM into panels of COLI_NP tokens,
 * P[t][k][j] = X[t*NP + j][k], and each block of COLI_WR weight rows x NP tokens is an
 * outer-product loop: per k, one vector load of the token panel, COLI_WR broadcasts of
 * weights (read straight from the row-major, possibly memory-mapped, matrix: nothing is
 * copied) and 2*COLI_WR FMAs into COLI_WR x 2 accumulators; no reductions. */
#define COLI_NP (2 * CV_W) /* tokens per panel */
#if defined(__AVX512F__)
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

#define COLI_RTILE(WR)                                                                             \
    static inline void coli_rtile_##WR(const float *W, long ldw, const float *P, int K, float *Y,  \
                                       long ldy, int nt) {                                         \
        cv_t a0[WR], a1[WR];                                                                       \
        for (int i = 0; i < WR; i++) a0[i] = a1[i] = cv_zero();                                    \
        for (int k = 0; k < K; k++) {                                                              \
            cv_t x0 = cv_load(P + (long)k * COLI_NP), x1 = cv_load(P + (long)k * COLI_NP + CV_W);  \
            for (int i = 0; i < WR; i++) {                                                         \
                cv_t w = cv_set1(W[i * ldw + k]);                                                  \
                a0[i] = cv_fma(w, x0, a0[i]);                                                      \
                a1[i] = cv_fma(w, x1, a1[i]);                                                      \
            }                                                                                      \
        }                                                                                          \
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

static inline float coli_silu(float x) { return x / (1.0f + expf(-x)); }

static inline float coli_gelu_tanh(float x) {
    const float c = 0.7978845608028654f; /* sqrt(2/pi) */
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

#endif /* COLI_SIMD_H */
