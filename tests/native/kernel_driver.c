/* A stand-alone driver for the engine's C kernels (coli/_engine/simd.h, simd_q.h, simd_q16.h), so that
 * they can be compiled for another CPU (aarch64-linux-gnu-gcc) and run under an emulator
 * (qemu-aarch64) without Python there. tests/test_neon_qemu.py compiles it for each ARM
 * target (and natively, to check the harness itself on every machine), feeds it the cases
 * on stdin and compares its answers with the NumPy twins.
 *
 * Protocol (little-endian): each request is a header of 8 int32 (op, then its integer
 * parameters) and 4 float32, followed by the op's input arrays; the answers are written to
 * stdout in the same order, sizes implied by the request.
 *   op 0 INFO      -> 16 bytes of coli_simd_name(), int32 coli_arm_features(), int32 build
 *                     bits (1: __ARM_FEATURE_DOTPROD, 2: __ARM_FEATURE_MATMUL_INT8, 4: NEON)
 *   op 1 GEMM      i: fmt M N K ldw ldd split; x f32 (M, K), w (N, ldw) of the format's
 *                  element, d f16 (N, ldd) [quantized], m f16 (N, ldd) [Q4A]
 *                  -> [int8: q int16 (M, Kp) in simd_q16.h's order, qd f32 (M, nb);
 *                      int4, int4s: q int8 (M, Kp), qd f32 (M, nb), qs int32 (M, nb)] then
 *                     y f32 (M, N): coli_gemm_q16 (int8) or coli_gemm_any over row blocks
 *                     of `split` rows
 *   op 2 TOKENS    i: fmt M N K ldw 0 split; x, w as GEMM (f32 / bf16 only)
 *                  -> y f32 (M, N): the token-panel GEMM (prefill)
 *   op 3 ATTEND    i: nh nkv hd vd T half; f: scale softcap; q f32 (nh, hd), k (T, nkv, hd),
 *                  v (T, nkv, vd), f32 or with half f16 -> o f32 (nh, vd)
 *   op 4 DEQUANT   i: fmt N K ldw ldd; w, d, m as GEMM -> f32 (N, K)
 *   op 5 DOT       i: n; f: a b; x f32 (n), y f32 (n) -> f32 dot(x, y), then
 *                  f32 (n): y * a + x * b
 *   op 6 F16       i: n; x f32 (n) -> f16 (n): the KV cache's rounding (coli_kv_put)
 */
#include <stdio.h>
#include <stdlib.h>

#include "cpu_arm.h"
#include "simd_q.h"
#include "simd_q16.h"

typedef struct {
    int32_t op, i[7];
    float f[4];
} request;

static void *input(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || fread(p, 1, bytes, stdin) != bytes) {
        fprintf(stderr, "kernel_driver: short input (%zu bytes)\n", bytes);
        exit(2);
    }
    return p;
}

static void output(const void *p, size_t bytes) {
    if (fwrite(p, 1, bytes, stdout) != bytes) exit(3);
}

static size_t elem_size(int fmt) { return fmt == COLI_F32 ? 4 : fmt == COLI_BF16 ? 2 : 1; }

/* the weight matrix of a GEMM / DEQUANT request, read from stdin */
static coli_mat read_mat(int fmt, int N, long ldw, long ldd) {
    coli_mat W = {fmt, NULL, NULL, NULL, ldw, ldd};
    W.w = input((size_t)N * ldw * elem_size(fmt));
    if (fmt >= COLI_Q8) W.d = input((size_t)N * ldd * 2);
    if (fmt == COLI_Q4A) W.m = input((size_t)N * ldd * 2);
    return W;
}

static void free_mat(coli_mat *W) {
    free((void *)W->w);
    free((void *)W->d);
    free((void *)W->m);
}

static void gemm(const request *r, int tokens) {
    int fmt = r->i[0], M = r->i[1], N = r->i[2], K = r->i[3], split = r->i[6] > 0 ? r->i[6] : N;
    long ldw = r->i[4], ldd = r->i[5];
    float *x = input((size_t)M * K * 4);
    coli_mat W = read_mat(fmt, N, ldw, ldd);
    float *y = calloc((size_t)M * N, 4);
    if (tokens) {
        float *P = malloc((size_t)(M + COLI_NP - 1) / COLI_NP * COLI_NP * K * 4);
        coli_pack_tokens(x, K, M, K, P);
        for (int n0 = 0; n0 < N; n0 += split)
            coli_gemm_tokens_any(P, M, &W, n0, N - n0 < split ? N - n0 : split, K, y, N);
        free(P);
    } else {
        int nb = (K + QK - 1) / QK, kp = nb * QK;
        int8_t *q = calloc((size_t)M * kp, 1);
        float *qd = calloc((size_t)M * nb, 4);
        int32_t *qs = calloc((size_t)M * nb, 4);
        coli_act a = {x, q, qd, qs, K, kp, nb};
        if (fmt == COLI_Q8) { /* int8 weights take int16 activations (simd_q16.h), as in the engine */
            int16_t *q16 = calloc((size_t)M * kp, 2);
            for (int m = 0; m < M; m++) coli_quantize_row_q16(x + (long)m * K, K, q16 + (long)m * kp, qd + (long)m * nb);
            output(q16, (size_t)M * kp * 2);
            output(qd, (size_t)M * nb * 4);
            coli_act16 a16 = {q16, qd, kp, nb, NULL, 0};
            long lde = coli_q16_xe_ld(M, K); /* the interleaved tiles' arrangement (x86 AVX2), else 0 */
            uint8_t *xe = NULL;
            if (lde) {
                xe = aligned_alloc(64, ((size_t)M * lde + 63) / 64 * 64);
                coli_q16_arrange(&a16, M, K, xe, lde);
                a16.xe = xe, a16.lde = lde;
            }
            for (int n0 = 0; n0 < N; n0 += split) coli_gemm_q16(&a16, M, &W, n0, N - n0 < split ? N - n0 : split, K, y, N);
            free(q16), free(xe);
        } else if (fmt > COLI_Q8) {
            for (int m = 0; m < M; m++) coli_quantize_row_q8(x + (long)m * K, K, q + (long)m * kp, qd + (long)m * nb, qs + (long)m * nb);
            output(q, (size_t)M * kp);
            output(qd, (size_t)M * nb * 4);
            output(qs, (size_t)M * nb * 4);
        }
        if (fmt != COLI_Q8)
            for (int n0 = 0; n0 < N; n0 += split) coli_gemm_any(&a, M, &W, n0, N - n0 < split ? N - n0 : split, K, y, N);
        free(q), free(qd), free(qs);
    }
    output(y, (size_t)M * N * 4);
    free(x), free(y);
    free_mat(&W);
}

/* The last query row against T keys (coli_attend); with i[6] = R > 0, the last R rows (positions
 * T - R .. T - 1) as one prefill tile (coli_attend_rows, its f16 chunks widened once), then each of
 * them alone: both outputs, which must be the same bits. */
static void attend(const request *r) {
    int nh = r->i[0], nkv = r->i[1], hd = r->i[2], vd = r->i[3], T = r->i[4], half = r->i[5], R = r->i[6];
    int rows = R > 0 ? R : 1, group = nh / nkv;
    size_t b = half ? 2 : 4;
    float *q = input((size_t)rows * nh * hd * 4);
    void *k = input((size_t)T * nkv * hd * b), *v = input((size_t)T * nkv * vd * b);
    float *o = calloc((size_t)rows * nh * vd, 4);
    if (R > 0) {
        int j0[COLI_ATT_ROWS] = {0}, j1[COLI_ATT_ROWS];
        float *tmp = malloc((size_t)COLI_ATT_HB * vd * 4);
        float *wide = aligned_alloc(64, ((size_t)COLI_ATT_WIDE(hd, vd) * 4 + 63) / 64 * 64);
        for (int i = 0; i < R; i++) j1[i] = T - R + i + 1;
        for (int h = 0; h < nh;) { /* runs of up to COLI_ATT_HB heads of one KV group, as kernels.pyx */
            int g = h / group, nb = (g + 1) * group - h < COLI_ATT_HB ? (g + 1) * group - h : COLI_ATT_HB;
            coli_attend_rows(q, (long)nh * hd, COLI_KV_AT(k, (long)g * hd, half), (long)nkv * hd,
                             COLI_KV_AT(v, (long)g * vd, half), (long)nkv * vd, h, nb, j0, j1, R, hd, vd, r->f[0],
                             r->f[1], half, o, (long)nh * vd, tmp, wide);
            h += nb;
        }
        output(o, (size_t)R * nh * vd * 4);
        free(tmp), free(wide);
    }
    for (int i = 0; i < rows; i++)
        coli_attend(q + (long)i * nh * hd, k, (long)nkv * hd, v, (long)nkv * vd, 0, nh, group, 0, T - rows + i + 1, hd,
                    vd, r->f[0], r->f[1], half, o + (long)i * nh * vd);
    output(o, (size_t)rows * nh * vd * 4);
    free(q), free(k), free(v), free(o);
}

static void dequant(const request *r) {
    int fmt = r->i[0], N = r->i[1], K = r->i[2];
    coli_mat W = read_mat(fmt, N, r->i[3], r->i[4]);
    float *out = malloc((size_t)N * K * 4);
    for (int n = 0; n < N; n++) coli_dequant_row(&W, n, K, out + (long)n * K);
    output(out, (size_t)N * K * 4);
    free(out);
    free_mat(&W);
}

static void dot(const request *r) {
    int n = r->i[0];
    float *x = input((size_t)n * 4), *y = input((size_t)n * 4);
    float s = coli_dot(x, y, n);
    output(&s, 4);
    coli_scale_add(y, r->f[0], x, r->f[1], n);
    output(y, (size_t)n * 4);
    free(x), free(y);
}

int main(void) {
    request r;
    while (fread(&r, sizeof r, 1, stdin) == 1) {
        switch (r.op) {
        case 0: {
            char name[16] = {0};
            strncpy(name, coli_simd_name(), sizeof name - 1);
            int32_t info[2] = {(int32_t)coli_arm_features(), 0};
#if defined(__ARM_FEATURE_DOTPROD)
            info[1] |= 1;
#endif
#if defined(__ARM_FEATURE_MATMUL_INT8)
            info[1] |= 2;
#endif
#if defined(COLI_NEON)
            info[1] |= 4;
#endif
            output(name, sizeof name);
            output(info, sizeof info);
            break;
        }
        case 1: gemm(&r, 0); break;
        case 2: gemm(&r, 1); break;
        case 3: attend(&r); break;
        case 4: dequant(&r); break;
        case 5: dot(&r); break;
        case 6: {
            int n = r.i[0];
            float *x = input((size_t)n * 4);
            uint16_t *h = malloc((size_t)n * 2 + 2);
            coli_kv_put(h, 0, x, n, 1);
            output(h, (size_t)n * 2);
            free(x), free(h);
            break;
        }
        default: fprintf(stderr, "kernel_driver: unknown op %d\n", r.op); return 2;
        }
    }
    return fflush(stdout) == 0 ? 0 : 3;
}
