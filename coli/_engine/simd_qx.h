/* The multi-token quantized tiles of the AVX-512 VNNI path (several tokens against the same
 * weight rows: batched decode, speculative verification, MoE experts with several tokens,
 * prefill). Included by simd_q.h after the plain tiles, whose one-token tiles it falls back
 * to; coli_gemm_any dispatches here when the call's activations were arranged
 * (coli_act.xe, see coli_xe_ld / coli_expand_act). */
#ifndef COLI_SIMD_QX_H
#define COLI_SIMD_QX_H

/* ---- Q4 / Q4A repacked into 4-row tiles ----------------------------------------------------
 * The interleaved tiles below spend most of a one-token step rearranging the weights: 8 dword
 * unpacks to bring 4 rows' groups into (row, group) lanes, and a gather, convert and permute
 * for each of the scales and the mins. A matrix that is read many times (every dense layer of
 * a decoded model) can be rearranged once instead, at load (QMatrix.pack): tile t holds rows
 * 4t .. 4t + 3 (zeros past the last row) as one contiguous run of steps, step s its groups
 * 4s .. 4s + g - 1 (g = 4, fewer in a short last step), in 80 g bytes (Q4A; 72 g for Q4):
 *   bytes 0 .. 64g - 1   the 4 vectors the unpacks make, 16 g bytes each: byte 16gp + 16L + 4j + c
 *                        is byte 4p + c of row 4t + j's group 4s + L (its 16 nibble bytes in
 *                        simd_q.h's order)
 *   then 4g f16 scales   in lane order: 4L + j is row 4t + j, group 4s + L
 *   then 4g f16 mins     likewise (Q4A only)
 * so a tile is exactly its rows' bytes. The tile's step loads 4 vectors and the scales as they
 * are (masked in a short step), and the whole matrix is read as one sequential stream; the
 * arithmetic is the interleaved tile's, operation for operation, so a token's result has the
 * same bits as there (the rows past a multiple of 4 go through the tile too, where a matrix in
 * rows takes the plain tiles). The functions here are plain C on every path (a packed matrix
 * still reads as rows: coli_q4x_row); the AVX-512 VNNI path computes on the tiles below, the
 * AVX2 paths (avx2, and avx512 without VNNI) on their own tiles over the same bytes (further
 * down), and only where a path has them (COLI_Q4X_TILES) does QMatrix.pack repack. */
static inline long coli_q4x_group_bytes(int fmt) { return fmt == COLI_Q4A ? 80 : 72; } /* per group of 4 rows */

/* A packed tile's weights are one stream; each step prefetches its lines COLI_Q4X_AHEAD bytes
 * ahead (~13 steps: most of a 576-column tile or the start of the next) into L2, and
 * COLI_Q4X_NEAR bytes ahead into L1. Prefetching only into L1 (at 4096, 4-5% faster than the
 * row layout on SmolLM2-135M int4, 2 threads; no prefetch 14% slower) caps a stream from memory at
 * the L1 misses one thread keeps in flight: one thread, a 604 MB packed 2048-column int4
 * matrix, one token, 12.0 GB/s into L1 against 14.2 into L2 + L1 (a plain read of its bytes:
 * 14.6); a 38 MB one from L3 22.6-23.3 against 24.5-25.9 (BENCHMARKS.md, "Prefetching into
 * L2"). The AVX2 tiles and the packed int8 tiles use the same distances. */
#define COLI_Q4X_AHEAD 4096
#define COLI_Q4X_NEAR 1024
/* Which of those prefetches a one-token packed int4 tile issues (kernels.set_stream_prefetch):
 * 2 both, 1 only the one into L1, 0 none. Tiles of several tokens issue both whatever it says:
 * without them a 4-stream SmolLM2-135M step took 1.24x (AVX-512 VNNI) and 1.31x (AVX2) as long
 * on a Zen 4; so does AVX2's packed int8 tile, whose one-token decode was 1.05-1.18x slower
 * without them there (BENCHMARKS.md, the thirty-seventh session). Prefetches change no
 * arithmetic. */
static int coli_stream_prefetch = 2;
static inline void coli_set_stream_prefetch(int mode) { coli_stream_prefetch = mode < 0 ? 0 : mode > 2 ? 2 : mode; }
/* a packed tile's step: its 5 lines COLI_Q4X_AHEAD bytes ahead into L2, COLI_Q4X_NEAR into L1 */
#define COLI_STREAM_PREFETCH5_BOTH(p, far)                                                         \
    for (int q_ = 0; q_ < 5; q_++) {                                                               \
        _mm_prefetch((const char *)((p) + (far) + 64 * q_), _MM_HINT_T1);                         \
        _mm_prefetch((const char *)((p) + COLI_Q4X_NEAR + 64 * q_), _MM_HINT_T0);                 \
    }
/* the same for a packed int4 tile of MR tokens, as coli_stream_prefetch says */
#define COLI_STREAM_PREFETCH5(p, far, MR)                                                          \
    {                                                                                              \
        const int pf_ = (MR) > 1 ? 2 : coli_stream_prefetch;                                       \
        for (int q_ = 0; q_ < 5 && pf_ > 0; q_++) {                                                \
            if (pf_ > 1) _mm_prefetch((const char *)((p) + (far) + 64 * q_), _MM_HINT_T1);         \
            _mm_prefetch((const char *)((p) + COLI_Q4X_NEAR + 64 * q_), _MM_HINT_T0);             \
        }                                                                                          \
    }

/* Bytes of one 4-row tile of a K-column matrix. */
static inline long coli_q4x_tile_bytes(int fmt, int K) { return (K + QK - 1) / QK * coli_q4x_group_bytes(fmt); }

/* Where (row j of a tile, group g) lives in the tile: its 4-byte piece p, its scale, its min. */
static inline long coli_q4x_piece(int fmt, int nb, int g, int j, int p) {
    int s = g / 4, n = nb - 4 * s < 4 ? nb - 4 * s : 4;
    return 4 * s * coli_q4x_group_bytes(fmt) + 16L * n * p + 16 * (g % 4) + 4 * j;
}
static inline long coli_q4x_scale(int fmt, int nb, int g, int j, int min) {
    int s = g / 4, n = nb - 4 * s < 4 ? nb - 4 * s : 4;
    return 4 * s * coli_q4x_group_bytes(fmt) + 64L * n + (min ? 8L * n : 0) + 2 * (4 * (g % 4) + j);
}

/* pk (N rounded up to 4 rows, coli_q4x_tile_bytes each) = W (row layout, rows [0, N)) repacked. */
static inline void coli_q4x_pack(const coli_mat *W, int N, int K, uint8_t *pk) {
    int nb = (K + QK - 1) / QK, asym = W->fmt == COLI_Q4A;
    long pks = coli_q4x_tile_bytes(W->fmt, K);
    const uint8_t *wq = (const uint8_t *)W->w;
    uint16_t zero = 0;
    const uint8_t none[16] = {0};
    for (int t = 0; t < (N + 3) / 4; t++) {
        uint8_t *o = pk + t * pks;
        for (int g = 0; g < nb; g++)
            for (int j = 0; j < 4; j++) {
                int r = 4 * t + j;
                const uint8_t *src = r < N ? wq + (long)r * W->ldw + g * 16 : none;
                long at = coli_q4x_piece(W->fmt, nb, g, j, 0), step = coli_q4x_piece(W->fmt, nb, g, j, 1) - at;
                for (int p = 0; p < 4; p++) memcpy(o + at + p * step, src + 4 * p, 4); /* 4-byte pieces */
                memcpy(o + coli_q4x_scale(W->fmt, nb, g, j, 0), r < N ? &W->d[(long)r * W->ldd + g] : &zero, 2);
                if (asym) memcpy(o + coli_q4x_scale(W->fmt, nb, g, j, 1), r < N ? &W->m[(long)r * W->ldd + g] : &zero, 2);
            }
    }
}

/* The inverse for rows [0, N): wq (N, ldw) nibble bytes (zeros after the groups), wd / wm
 * (N, ldd) f16 (wm: Q4A). */
static inline void coli_q4x_unpack(const uint8_t *pk, int fmt, int N, int K, uint8_t *wq, long ldw, uint16_t *wd,
                                   uint16_t *wm, long ldd) {
    int nb = (K + QK - 1) / QK;
    long pks = coli_q4x_tile_bytes(fmt, K);
    for (int r = 0; r < N; r++) {
        const uint8_t *o = pk + (r / 4) * pks;
        for (int g = 0; g < nb; g++) {
            for (int p = 0; p < 4; p++) memcpy(&wq[r * ldw + g * 16 + 4 * p], o + coli_q4x_piece(fmt, nb, g, r % 4, p), 4);
            memcpy(&wd[r * ldd + g], o + coli_q4x_scale(fmt, nb, g, r % 4, 0), 2);
            if (fmt == COLI_Q4A) memcpy(&wm[r * ldd + g], o + coli_q4x_scale(fmt, nb, g, r % 4, 1), 2);
        }
        for (long i = nb * 16; i < ldw; i++) wq[r * ldw + i] = 0;
    }
}

/* out[:K] = row r of a repacked Q4 / Q4A matrix as float32 (as coli_dequant_row computes it). */
static inline void coli_q4x_row(const coli_mat *W, int r, int K, float *out) {
    int nb = (K + QK - 1) / QK;
    const uint8_t *o = W->pk + (r / 4) * W->pks;
    for (int k = 0; k < K; k++) {
        int g = k / QK, i = k % QK;
        int byte = o[coli_q4x_piece(W->fmt, nb, g, r % 4, (i % 16) / 4) + i % 4];
        int v = i < 16 ? (byte & 15) : (byte >> 4);
        uint16_t d, mn;
        memcpy(&d, o + coli_q4x_scale(W->fmt, nb, g, r % 4, 0), 2);
        if (W->fmt == COLI_Q4A) {
            memcpy(&mn, o + coli_q4x_scale(W->fmt, nb, g, r % 4, 1), 2);
            out[k] = coli_f16_to_f32(d) * v + coli_f16_to_f32(mn);
        } else {
            out[k] = coli_f16_to_f32(d) * (v - 8);
        }
    }
}

/* Groups in the chunk of the AVX-512 VNNI int8 tiles (simd_q16.h) that starts with left groups
 * to go (>= 1); plain C, as the Q8 layout below on that path reads it. */
static inline int coli_q16v_groups(int left) { return left >= 16 ? 16 : left >= 8 ? 8 : left >= 4 ? 4 : 2; }

#if !defined(COLI_Q512)
/* ---- Q8 repacked into 4-row tiles (the AVX2 path: QMatrix.pack) ---------------------------
 * The AVX2 int8 tiles (simd_q16.h) spend most of a one-token step bringing 4 rows' groups
 * into (row, group) lanes: 8 loads and 8 inserts, 16 unpacks, and a gather, convert and
 * permute of the scales. A matrix read every decode step can be rearranged once instead, at load: tile t
 * holds rows 4t .. 4t + 3 (zeros past the last row), step s its groups 2s, 2s + 1 (zeros for a
 * missing last one) in COLI_Q8X_STEP bytes, exactly the registers those tiles' unpacks make:
 *   bytes 32q + 16L + 8u + 2j + c (q = 4h + k < 8)   byte 16h + 4k + 2u + c of row 4t + j's
 *                                                     group 2s + L (128-bit lane L)
 *   bytes 256 + 2(4L + j)                             that group's f16 scale
 * 34 bytes per row and group, as in rows. The step's arithmetic is the row tile's, operation
 * for operation, so a token's result has the same bits from tiles as from rows; the token-lane
 * prefill tiles read the same bytes back into their blocks (coli_q16r_prep_pk). These helpers
 * are plain C on every path (a packed matrix still reads as rows: coli_q8x_row); only a path
 * with the tiles (COLI_Q8X_TILES, simd_q16.h) packs. */
#define COLI_Q8X_STEP 272
#define COLI_Q8X_AHEAD 4096 /* bytes ahead that the packed tile prefetches, as the int4 tiles do */

/* Bytes of one 4-row tile of a K-column matrix. */
static inline long coli_q8x_tile_bytes(int K) { return (long)(((K + QK - 1) / QK + 1) / 2) * COLI_Q8X_STEP; }
/* Where byte i of (row j of a tile, group g) lives in the tile, and where its scale does. */
static inline long coli_q8x_at(int g, int j, int i) {
    int h = i / 16, k = (i % 16) / 4, u = (i % 4) / 2, c = i % 2;
    return (long)(g / 2) * COLI_Q8X_STEP + 32 * (4 * h + k) + 16 * (g % 2) + 8 * u + 2 * j + c;
}
static inline long coli_q8x_scale_at(int g, int j) { return (long)(g / 2) * COLI_Q8X_STEP + 256 + 2 * (4 * (g % 2) + j); }

/* pk (N rounded up to 4 rows, coli_q8x_tile_bytes each) = W (COLI_Q8 rows [0, N)) repacked. */
static inline void coli_q8x_pack(const coli_mat *W, int N, int K, uint8_t *pk) {
    int nb = (K + QK - 1) / QK;
    long pks = coli_q8x_tile_bytes(K);
    const int8_t *wq = (const int8_t *)W->w;
    memset(pk, 0, (size_t)((N + 3) / 4) * (size_t)pks);
    for (int r = 0; r < N; r++) {
        uint8_t *o = pk + (r / 4) * pks;
        for (int g = 0; g < nb; g++) {
            const int8_t *src = wq + (long)r * W->ldw + g * QK;
            uint8_t *dst = o + coli_q8x_at(g, r % 4, 0);
            for (int i = 0; i < QK; i += 2) /* 2-byte pairs: byte i + 1 lies right after byte i */
                memcpy(dst + (coli_q8x_at(0, 0, i) - coli_q8x_at(0, 0, 0)), src + i, 2);
            memcpy(o + coli_q8x_scale_at(g, r % 4), &W->d[(long)r * W->ldd + g], 2);
        }
    }
}

/* The inverse for rows [0, N): wq (N, ldw) int8 (zeros after the groups), wd (N, ldd) f16. */
static inline void coli_q8x_unpack(const uint8_t *pk, int N, int K, int8_t *wq, long ldw, uint16_t *wd, long ldd) {
    int nb = (K + QK - 1) / QK;
    long pks = coli_q8x_tile_bytes(K);
    for (int r = 0; r < N; r++) {
        const uint8_t *o = pk + (r / 4) * pks;
        for (int g = 0; g < nb; g++) {
            for (int i = 0; i < QK; i++) wq[r * ldw + g * QK + i] = (int8_t)o[coli_q8x_at(g, r % 4, i)];
            memcpy(&wd[r * ldd + g], o + coli_q8x_scale_at(g, r % 4), 2);
        }
        for (long i = (long)nb * QK; i < ldw; i++) wq[r * ldw + i] = 0;
    }
}

/* out[:K] = row r of a repacked Q8 matrix as float32 (as coli_dequant_row computes it). */
static inline void coli_q8x_row(const coli_mat *W, int r, int K, float *out) {
    const uint8_t *o = W->pk + (r / 4) * W->pks;
    for (int k = 0; k < K; k++) {
        uint16_t d;
        memcpy(&d, o + coli_q8x_scale_at(k / QK, r % 4), 2);
        out[k] = coli_f16_to_f32(d) * (int8_t)o[coli_q8x_at(k / QK, r % 4, k % QK)];
    }
}

#else
/* ---- Q8 repacked for AVX-512 VNNI: each row's chunks transposed once, at load -------------
 * The AVX-512 VNNI int8 tiles (simd_q16.h, coli_q16v_chunk) load a row's chunk of G groups
 * (G = 16 while 16 are left, then 8, 4, 2) as T = G / 2 registers of two groups each and
 * transpose them (log2 T stages of two vpermt2d per register pair) so that each int32 lane
 * sums one group; per row and 16 groups that is 24 permutes, more than a token's 16
 * multiply-adds. A matrix read every step can hold its rows transposed instead: tile t holds
 * rows 4t .. 4t + 3 (zeros past the last row), each in RB = 64 ceil(nb / 2) bytes, chunk by
 * chunk exactly the registers the transpose makes (the odd last group, a chunk of its own,
 * padded with zeros to 64 bytes), then the rows' f16 scales, 2 ceil(nb / 2) per row:
 *   byte 32b + 64t + 4m + c of row j    byte 4q + c of group b + r of row 4t + j, for the chunk
 *                                       starting at group b (T registers), r < 2T, q < 8:
 *                                       t = q & (T - 1), m = 8 (r & 1) | (q & 7 & ~(T - 1)) | r / 2
 *   byte 4 RB + 2 (j SD + g)            the f16 scale of row j's group g (SD = 2 ceil(nb / 2))
 * 272 bytes per 4 rows and 2 groups, as the AVX2 tiles' (the same coli_q8x_tile_bytes). The
 * kernel's registers are the very registers the transpose made from rows, so a token's result
 * has the same bits from tiles as from rows, at every token count. Plain C (a packed matrix
 * still reads as rows: coli_q8x_row); only this path packs int8 so (COLI_Q8X_TILES). */
#define COLI_Q8X_STEP 272

static inline long coli_q8x_tile_bytes(int K) { return (long)(((K + QK - 1) / QK + 1) / 2) * COLI_Q8X_STEP; }
static inline long coli_q8v_row_bytes(int nb) { return 64L * ((nb + 1) / 2); }
/* where byte i of group g lies in a row of the tile */
static inline long coli_q8v_at(int nb, int g, int i) {
    int b = 0, G = coli_q16v_groups(nb);
    while (g >= b + G) {
        b += G;
        G = coli_q16v_groups(nb - b);
    }
    int T = G / 2, r = g - b, q = i / 4, c = i % 4;
    int t = q & (T - 1), m = ((r & 1) << 3) | (q & 7 & ~(T - 1)) | (r >> 1);
    return 32L * b + 64 * t + 4 * m + c;
}
static inline long coli_q8v_scale_at(int nb, int g, int j) {
    return 4 * coli_q8v_row_bytes(nb) + 2 * ((long)j * 2 * ((nb + 1) / 2) + g);
}

/* pk (N rounded up to 4 rows, coli_q8x_tile_bytes each) = W (COLI_Q8 rows [0, N)) repacked. */
static inline void coli_q8x_pack(const coli_mat *W, int N, int K, uint8_t *pk) {
    int nb = (K + QK - 1) / QK;
    long pks = coli_q8x_tile_bytes(K), rb = coli_q8v_row_bytes(nb);
    const int8_t *wq = (const int8_t *)W->w;
    memset(pk, 0, (size_t)((N + 3) / 4) * (size_t)pks);
    for (int r = 0; r < N; r++) {
        uint8_t *o = pk + (r / 4) * pks;
        for (int g = 0; g < nb; g++) {
            const int8_t *src = wq + (long)r * W->ldw + g * QK;
            for (int i = 0; i < QK; i += 4) /* dwords: byte i + c lies c after byte i */
                memcpy(o + (r % 4) * rb + coli_q8v_at(nb, g, i), src + i, 4);
            memcpy(o + coli_q8v_scale_at(nb, g, r % 4), &W->d[(long)r * W->ldd + g], 2);
        }
    }
}

/* The inverse for rows [0, N): wq (N, ldw) int8 (zeros after the groups), wd (N, ldd) f16. */
static inline void coli_q8x_unpack(const uint8_t *pk, int N, int K, int8_t *wq, long ldw, uint16_t *wd, long ldd) {
    int nb = (K + QK - 1) / QK;
    long pks = coli_q8x_tile_bytes(K), rb = coli_q8v_row_bytes(nb);
    for (int r = 0; r < N; r++) {
        const uint8_t *o = pk + (r / 4) * pks;
        for (int g = 0; g < nb; g++) {
            for (int i = 0; i < QK; i += 4) memcpy(&wq[r * ldw + g * QK + i], o + (r % 4) * rb + coli_q8v_at(nb, g, i), 4);
            memcpy(&wd[r * ldd + g], o + coli_q8v_scale_at(nb, g, r % 4), 2);
        }
        for (long i = (long)nb * QK; i < ldw; i++) wq[r * ldw + i] = 0;
    }
}

/* out[:K] = row r of a repacked Q8 matrix as float32 (as coli_dequant_row computes it). */
static inline void coli_q8x_row(const coli_mat *W, int r, int K, float *out) {
    int nb = (K + QK - 1) / QK;
    const uint8_t *o = W->pk + (r / 4) * W->pks;
    const int8_t *row = (const int8_t *)(o + (r % 4) * coli_q8v_row_bytes(nb));
    for (int g = 0; g < nb; g++) {
        uint16_t d;
        memcpy(&d, o + coli_q8v_scale_at(nb, g, r % 4), 2);
        float s = coli_f16_to_f32(d);
        for (int i = 0; i < QK && g * QK + i < K; i++) out[g * QK + i] = s * row[coli_q8v_at(nb, g, i)];
    }
}
#endif

/* y[0 .. nr - 1] = the first nr (<= 4) lanes of v. A tile's last rows store with a mask: the
 * copy through the stack that it replaced became a libc memcpy call of variable size per token
 * and tile (nr is not a constant in the packed tiles), 5% of a 4-token step's time. */
#if defined(__AVX__)
static inline void coli_xt_store(float *y, __m128 v, int nr) {
    if (nr == 4)
        _mm_storeu_ps(y, v);
    else
        _mm_maskstore_ps(y, _mm_cmpgt_epi32(_mm_set1_epi32(nr), _mm_setr_epi32(0, 1, 2, 3)), v);
}
#endif

#if defined(COLI_Q512)
#define COLI_XT_MIN 1   /* tokens from which coli_gemm_any takes the interleaved tiles: every count, so
                        * a token gets the same bits alone, in a batch or in a verification */
/* Tokens per interleaved tile: 4, as on AVX2. Tiles of 8 read 8 tokens' arranged activations
 * per step (704 bytes each; 25 KB a call at K = 576, 67 KB at 1536), more than a 32 KB L1 holds
 * beside the weights, and spilled: on a Zen 4, one thread, cache-hot, two tiles of 4 took 8
 * tokens of a 576 x 576 int4 matrix in 29 us instead of 41, and 64 tokens of 1536 x 576 in 611
 * us instead of 835 (3: about as fast; 5: slower; BENCHMARKS.md, "int4 tiles of 4 tokens"). A
 * token's arithmetic does not depend on which tokens share its tile: the same bits. */
#define COLI_XT_MR 4
/* vectors of 64 bytes per token and step: 8 activation dwords, the scale, -8 * the group sum
 * (int32, where a Q4 step's integer sums start) and scale * sum (float) */
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
            _mm512_store_si512((void *)(o + 9 * 64), _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 3)));
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
/* Each int32 lane's sum over the 8 weight vectors w[q] (unsigned nibbles) times the token's
 * arranged activations at o + 64q, plus init: two chains of 4 vpdpbusd added at the end (integer sums,
 * exact in any order: the same result as one chain), so a step's 8 multiply-adds are not one
 * chain of 8 latencies. With one token the tiles are compute-bound from L2: a 4608 x 576
 * int4 matrix, cache-hot, 1 thread, 6-9% faster than one chain (BENCHMARKS.md). */
static inline __attribute__((always_inline)) __m512i coli_q4x_dot8_512(const __m512i *w, const int8_t *o, __m512i init) {
    __m512i d0 = _mm512_dpbusd_epi32(init, w[0], _mm512_load_si512((const void *)o));
    __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_load_si512((const void *)(o + 64)));
    for (int q = 2; q < 8; q += 2) {
        d0 = _mm512_dpbusd_epi32(d0, w[q], _mm512_load_si512((const void *)(o + q * 64)));
        d1 = _mm512_dpbusd_epi32(d1, w[q + 1], _mm512_load_si512((const void *)(o + (q + 1) * 64)));
    }
    return _mm512_add_epi32(d0, d1);
}

/* One step of the Q4 / Q4A interleaved tile: groups b .. b + n - 1 (n = 4, or fewer with
 * MASKED) of the 4 rows against every token's arranged activations. */
#define COLI_Q4XSTEP(MR, ASYM, MASKED, n)                                                          \
    {                                                                                              \
        __m512i T[4], w[8];                                                                        \
        if (!(MASKED))                                                                             \
            for (int j = 0; j < 4; j++) { /* the next tile's rows into L1, the one after into L2 */ \
                _mm_prefetch((const char *)(wq + (4 + j) * ldw + b * 16), _MM_HINT_T0);            \
                _mm_prefetch((const char *)(wq + (8 + j) * ldw + b * 16), _MM_HINT_T1);            \
            }                                                                                      \
        COLI_XT_LOAD4(T, wq, ldw, b * 16, MASKED, (n) == 4 ? ~0ull : (1ull << (16 * (n))) - 1);    \
        for (int p = 0; p < 4; p++) {                                                              \
            w[p] = _mm512_and_si512(T[p], m4);                                                     \
            w[4 + p] = _mm512_and_si512(_mm512_srli_epi16(T[p], 4), m4);                           \
        }                                                                                          \
        __m512 ws = coli_xt_scales4(wd, ldd, b, n);                                                \
        __m512 wmn = ASYM ? coli_xt_scales4(wm, ldd, b, n) : ws;                                   \
        for (int i = 0; i < MR; i++) {                                                             \
            const int8_t *o = a->xe + i * a->lde + (b / 4) * (COLI_XE_Q4 * 64);                    \
            __m512i d = coli_q4x_dot8_512(w, o, ASYM ? _mm512_setzero_si512() : _mm512_load_si512((const void *)(o + 9 * 64))); \
            __m512 sc = _mm512_mul_ps(ws, _mm512_load_ps((const float *)(o + 8 * 64)));            \
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sc, acc[i]);                           \
            if (ASYM) acc[i] = _mm512_fmadd_ps(wmn, _mm512_load_ps((const float *)(o + 10 * 64)), acc[i]); \
        }                                                                                          \
    }

/* The end of an interleaved tile: each token's sums of its first NR (<= 4) rows. */
#define COLI_XT_END(MR, NR)                                                                        \
        for (int i = 0; i < MR; i++) coli_xt_store(Y + i * ldy, coli_xt_rows(acc[i]), (NR));

/* Q4 (ASYM 0) / Q4A (ASYM 1): MR tokens x 4 rows, 4 groups per step, the last step masked
 * to the groups left. Q4's offset of 8 is taken off in the integers: a token's sums start at
 * -8 * the group's sum, from xe (no subtraction a token and step); Q4A's min adds
 * m * scale * sum. */
#define COLI_Q4XTILE512(NAME, MR, ASYM)                                                            \
    static inline void NAME##_x##MR(const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                    long ldw, long ldd, int nb, float *Y, long ldy) {              \
        __m512 acc[MR];                                                                            \
        for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();                                 \
        const __m512i m4 = _mm512_set1_epi8(0x0F);                                                 \
        int b = 0;                                                                                 \
        for (; b + 4 <= nb; b += 4) COLI_Q4XSTEP(MR, ASYM, 0, 4)                                   \
        if (b < nb) COLI_Q4XSTEP(MR, ASYM, 1, nb - b)                                              \
        COLI_XT_END(MR, 4)                                                                         \
    }

#define COLI_XTILES(NAME, ROLE)                                                                    \
    ROLE(NAME, 1) ROLE(NAME, 2) ROLE(NAME, 3) ROLE(NAME, 4)                                        \
    static inline void NAME##_x(int mr, const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                long ldw, long ldd, int nb, float *Y, long ldy) {                  \
        switch (mr) {                                                                              \
        case 1: NAME##_x1(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break; /* same bits as in a batch */ \
        case 2: NAME##_x2(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                             \
        case 3: NAME##_x3(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                             \
        default: NAME##_x4(a, wq, wd, wm, ldw, ldd, nb, Y, ldy); break;                            \
        }                                                                                          \
    }
/* One step of the tile over repacked rows: as COLI_Q4XSTEP, its weights and scales read as
 * they lie at p (n groups; fewer than 4 with MASKED, zeros in the lanes after). */
#define COLI_Q4XSTEP_PK(MR, ASYM, MASKED, n)                                                       \
    {                                                                                              \
        __m512i w[8];                                                                              \
        if (!(MASKED)) /* a step's 5 lines ahead (COLI_STREAM_PREFETCH5) */                       \
            COLI_STREAM_PREFETCH5(p, COLI_Q4X_AHEAD, MR)                                             \
        for (int q = 0; q < 4; q++) {                                                              \
            __m512i T = (MASKED) ? _mm512_maskz_loadu_epi8((n) >= 4 ? ~0ull : (1ull << (16 * (n))) - 1, (const void *)(p + 16 * (n) * q)) \
                                 : _mm512_loadu_si512((const void *)(p + 64 * q));                 \
            w[q] = _mm512_and_si512(T, m4);                                                        \
            w[4 + q] = _mm512_and_si512(_mm512_srli_epi16(T, 4), m4);                              \
        }                                                                                          \
        __m512 ws = _mm512_cvtph_ps((MASKED) ? _mm256_maskz_loadu_epi16((__mmask16)((1u << (4 * (n))) - 1), p + 64 * (n)) \
                                             : _mm256_loadu_si256((const __m256i *)(const void *)(p + 256))); \
        __m512 wmn = !(ASYM) ? ws : _mm512_cvtph_ps((MASKED) ? _mm256_maskz_loadu_epi16((__mmask16)((1u << (4 * (n))) - 1), p + 72 * (n)) \
                                                             : _mm256_loadu_si256((const __m256i *)(const void *)(p + 288))); \
        for (int i = 0; i < MR; i++) {                                                             \
            const int8_t *o = a->xe + i * a->lde + (b / 4) * (COLI_XE_Q4 * 64);                    \
            __m512i d = coli_q4x_dot8_512(w, o, ASYM ? _mm512_setzero_si512() : _mm512_load_si512((const void *)(o + 9 * 64))); \
            __m512 sc = _mm512_mul_ps(ws, _mm512_load_ps((const float *)(o + 8 * 64)));            \
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sc, acc[i]);                           \
            if (ASYM) acc[i] = _mm512_fmadd_ps(wmn, _mm512_load_ps((const float *)(o + 10 * 64)), acc[i]); \
        }                                                                                          \
        p += (n) * (ASYM ? 80 : 72);                                                               \
    }

/* MR tokens x the nr (<= 4) rows of one repacked tile. */
#define COLI_Q4XTILE512_PK(NAME, MR, ASYM)                                                         \
    static inline void NAME##_pk##MR(const coli_act *a, const uint8_t *pk, int nb, float *Y, long ldy, int nr) { \
        __m512 acc[MR];                                                                            \
        for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();                                 \
        const __m512i m4 = _mm512_set1_epi8(0x0F);                                                 \
        const uint8_t *p = pk;                                                                     \
        int b = 0;                                                                                 \
        for (; b + 4 <= nb; b += 4) COLI_Q4XSTEP_PK(MR, ASYM, 0, 4)                                \
        if (b < nb) COLI_Q4XSTEP_PK(MR, ASYM, 1, nb - b)                                           \
        COLI_XT_END(MR, nr)                                                                        \
    }
#define COLI_PKTILES(NAME, ASYM)                                                                   \
    COLI_Q4XTILE512_PK(NAME, 1, ASYM) COLI_Q4XTILE512_PK(NAME, 2, ASYM) COLI_Q4XTILE512_PK(NAME, 3, ASYM) \
    COLI_Q4XTILE512_PK(NAME, 4, ASYM)                                                              \
    static inline void NAME##_pk(int mr, const coli_act *a, const uint8_t *pk, int nb, float *Y, long ldy, int nr) { \
        switch (mr) {                                                                              \
        case 1: NAME##_pk1(a, pk, nb, Y, ldy, nr); break;                                          \
        case 2: NAME##_pk2(a, pk, nb, Y, ldy, nr); break;                                          \
        case 3: NAME##_pk3(a, pk, nb, Y, ldy, nr); break;                                          \
        default: NAME##_pk4(a, pk, nb, Y, ldy, nr); break;                                         \
        }                                                                                          \
    }
COLI_PKTILES(coli_q4tile, 0)
COLI_PKTILES(coli_q4atile, 1)
#define COLI_Q4X_TILES 1 /* this path computes on repacked matrices (QMatrix.pack repacks) */

#define COLI_Q4X_MR COLI_XT_MR /* tokens per packed tile */
#define COLI_Q4X_SYM(NAME, MR) COLI_Q4XTILE512(NAME, MR, 0)
#define COLI_Q4X_ASYM(NAME, MR) COLI_Q4XTILE512(NAME, MR, 1)
COLI_XTILES(coli_q4tile, COLI_Q4X_SYM)
COLI_XTILES(coli_q4atile, COLI_Q4X_ASYM)
static inline long coli_q4x_xe_ld(int M, int K) { return coli_xe_ld(COLI_Q4A, M, K); }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* ---- AVX2: the same packed tiles, half a step (2 groups) per 256-bit register -----------
 * A packed step's 64-byte vectors hold group 4s + L in 128-bit lane L, so their first and last
 * 32 bytes are two AVX2 registers of 2 groups each, rows in dwords: one and, one shift and
 * one more and unpack 64 weights with no shuffle. The activations are arranged as on AVX-512
 * VNNI (coli_expand_act below writes the same bytes), each half read as a register. vpmaddubsw
 * multiplies the unsigned nibbles by the int8 activations into int16 pair sums, 8 of them
 * summed in int16 per lane (|sum| <= 16 * 15 * 127 < 2^15: exact), one vpmaddwd then gives each
 * int32 lane a whole (row, group) dot product, and a convert, a scale multiply and an fma per
 * token serve 4 rows x 2 groups. A token's operations do not depend on its tile or slot, so
 * its bits are the same alone, in a batch or in a verification. Only packed matrices take
 * these tiles (the row layout keeps simd_q.h's), so only they take arranged activations. */
#define COLI_XE_Q4 11 /* vectors of 64 bytes per token and step, as on AVX-512 VNNI */
static inline long coli_xe_ld(int fmt, int M, int K) { (void)fmt; (void)M; (void)K; return 0; } /* rows: none */
/* Bytes of arranged activations a packed call of M tokens takes per token (0: none; from
 * COLI_Q4GEMM8_MIN tokens on the token-lane GEMM reads the tiles instead, simd_q.h). */
static inline long coli_q4x_xe_ld(int M, int K) {
    return M >= COLI_Q4GEMM8_MIN ? 0 : ((K + QK - 1) / QK + 3) / 4 * COLI_XE_Q4 * 64L;
}

/* xe (M rows of lde bytes) = a's quantized activations arranged as coli_expand_act arranges
 * them on AVX-512 VNNI (simd_qx.h above): per step, for each dword p of a group's first 16
 * elements and then of its last 16, that dword broadcast over the 4 dwords of 128-bit lane L
 * (group 4s + L); then the scales, 8 x the group sums (int32) and scale x sum, each
 * broadcast over its lane; zeros past the last group. */
static inline void coli_expand_act(const coli_act *a, int M, int K, int fmt, int8_t *xe, long lde) {
    (void)fmt;
    int nb = (K + QK - 1) / QK;
    for (int i = 0; i < M; i++) {
        const int8_t *xq = a->q + i * a->ldq;
        const float *qd = a->qd + i * a->ldb;
        const int32_t *qs = a->qs + i * a->ldb;
        int8_t *o = xe + i * lde;
        for (int s = 0; s < (nb + 3) / 4; s++, o += COLI_XE_Q4 * 64)
            for (int L = 0; L < 4; L++) {
                int g = 4 * s + L, ok = g < nb;
                /* the group's two 16-byte halves; dword p of each broadcast over lane L */
                __m128i lo = ok ? _mm_loadu_si128((const __m128i *)(const void *)(xq + g * QK)) : _mm_setzero_si128();
                __m128i hi = ok ? _mm_loadu_si128((const __m128i *)(const void *)(xq + g * QK + 16)) : _mm_setzero_si128();
                __m128i *d = (__m128i *)(void *)(o + 16 * L);
                _mm_store_si128(d + 0 * 4, _mm_shuffle_epi32(lo, 0x00));
                _mm_store_si128(d + 1 * 4, _mm_shuffle_epi32(lo, 0x55));
                _mm_store_si128(d + 2 * 4, _mm_shuffle_epi32(lo, 0xAA));
                _mm_store_si128(d + 3 * 4, _mm_shuffle_epi32(lo, 0xFF));
                _mm_store_si128(d + 4 * 4, _mm_shuffle_epi32(hi, 0x00));
                _mm_store_si128(d + 5 * 4, _mm_shuffle_epi32(hi, 0x55));
                _mm_store_si128(d + 6 * 4, _mm_shuffle_epi32(hi, 0xAA));
                _mm_store_si128(d + 7 * 4, _mm_shuffle_epi32(hi, 0xFF));
                float xs = ok ? qd[g] : 0.0f, xsum = ok ? qd[g] * (float)qs[g] : 0.0f;
                _mm_store_ps((float *)(void *)(d + 8 * 4), _mm_set1_ps(xs));
                _mm_store_si128(d + 9 * 4, _mm_set1_epi32(ok ? qs[g] * 8 : 0));
                _mm_store_ps((float *)(void *)(d + 10 * 4), _mm_set1_ps(xsum));
            }
    }
}

/* Each int32 lane's sum over the 8 weight registers w[q] (unsigned nibbles) times the token's
 * activations at o + 64q: vpdpbusd with AVX-VNNI (the avx2vnni path), else vpmaddubsw pair sums
 * added in int16 (16 products of at most 15 x 127 a lane: exact) and one vpmaddwd; the same
 * integers either way. */
static inline __m256i coli_q4x_dot8(const __m256i *w, const int8_t *o) {
#if defined(__AVXVNNI__) /* two chains of 4, as on AVX-512 VNNI (coli_q4x_dot8_512) */
    __m256i d0 = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w[0], _mm256_load_si256((const __m256i *)(const void *)o));
    __m256i d1 = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w[1], _mm256_load_si256((const __m256i *)(const void *)(o + 64)));
    for (int q = 2; q < 8; q += 2) {
        d0 = _mm256_dpbusd_avx_epi32(d0, w[q], _mm256_load_si256((const __m256i *)(const void *)(o + q * 64)));
        d1 = _mm256_dpbusd_avx_epi32(d1, w[q + 1], _mm256_load_si256((const __m256i *)(const void *)(o + (q + 1) * 64)));
    }
    return _mm256_add_epi32(d0, d1);
#else
    __m256i s = _mm256_maddubs_epi16(w[0], _mm256_load_si256((const __m256i *)(const void *)o));
    for (int q = 1; q < 8; q++)
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[q], _mm256_load_si256((const __m256i *)(const void *)(o + q * 64))));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}
/* The arithmetic of half h of a step at group b for MR tokens, once its 4 raw weight
 * registers RAW[q] (two nibbles a byte, rows in dwords), scales ws and mins wmn (lane 4L + j:
 * row j, group b + 2h + L) are loaded: the same operations whichever layout they came from.
 * Raw register q holds weight registers q (its low nibbles) and 4 + q (its high ones).
 * With AVX-VNNI the 8 weight registers are made first and go through coli_q4x_dot8. Without
 * it each raw register is unpacked in turn and serves every token at once: its two vpmaddubsw
 * per token are added into that token's int16 sum, so only the MR sums, the MR accumulators
 * and one register's nibbles are live. With the tiles scheduled for register pressure
 * (COLI_SCHED, simd.h) that keeps a 4-token tile in 16 registers, where 8 weight registers
 * for all tokens did not: GCC spilled the accumulators, and a 4-token call cost 2.5x one
 * token, now 2.1x (BENCHMARKS.md, the thirty-seventh session). The int16 sums are exact in
 * any order (the bound above), so a token's integers, and with the same float operations its
 * bits, are those of coli_q4x_dot8. */
#if defined(__AVXVNNI__)
#define COLI_Q4XHALF256_DOT(MR, ASYM, RAW)                                                         \
        __m256i w[8];                                                                              \
        for (int q = 0; q < 4; q++) {                                                              \
            w[q] = _mm256_and_si256(RAW[q], m4);                                                   \
            w[4 + q] = _mm256_and_si256(_mm256_srli_epi16(RAW[q], 4), m4);                         \
        }                                                                                          \
        for (int i = 0; i < MR; i++) {                                                             \
            const int8_t *o = a->xe + i * a->lde + (b / 4) * (COLI_XE_Q4 * 64) + 32 * h;            \
            COLI_Q4XHALF256_END(coli_q4x_dot8(w, o), ASYM)                                         \
        }
#else
#define COLI_Q4XHALF256_DOT(MR, ASYM, RAW)                                                         \
        __m256i s_[MR];                                                                            \
        for (int q = 0; q < 4; q++) {                                                              \
            const __m256i lo_ = _mm256_and_si256(RAW[q], m4);                                      \
            const __m256i hi_ = _mm256_and_si256(_mm256_srli_epi16(RAW[q], 4), m4);                \
            for (int i = 0; i < MR; i++) {                                                         \
                const int8_t *o = a->xe + i * a->lde + (b / 4) * (COLI_XE_Q4 * 64) + 32 * h + 64 * q; \
                __m256i x_ = _mm256_add_epi16(                                                     \
                    _mm256_maddubs_epi16(lo_, _mm256_load_si256((const __m256i *)(const void *)o)), \
                    _mm256_maddubs_epi16(hi_, _mm256_load_si256((const __m256i *)(const void *)(o + 256)))); \
                s_[i] = q == 0 ? x_ : _mm256_add_epi16(s_[i], x_);                                 \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < MR; i++) {                                                             \
            const int8_t *o = a->xe + i * a->lde + (b / 4) * (COLI_XE_Q4 * 64) + 32 * h;            \
            COLI_Q4XHALF256_END(_mm256_madd_epi16(s_[i], _mm256_set1_epi16(1)), ASYM)              \
        }
#endif
/* token i's whole (row, group) dot products DOT (int32 lanes) into its accumulator; o is its
 * arranged activations at this half step */
#define COLI_Q4XHALF256_END(DOT, ASYM)                                                             \
            __m256i d = (DOT);                                                                     \
            if (!ASYM) d = _mm256_sub_epi32(d, _mm256_load_si256((const __m256i *)(const void *)(o + 9 * 64))); \
            __m256 sc = _mm256_mul_ps(ws, _mm256_load_ps((const float *)(const void *)(o + 8 * 64))); \
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sc, acc[i]);                           \
            if (ASYM) acc[i] = _mm256_fmadd_ps(wmn, _mm256_load_ps((const float *)(const void *)(o + 10 * 64)), acc[i]);

/* Half h of a packed step of gs groups (its groups 2h, 2h + 1, n2 of them real: 1 or 2) for MR tokens. */
#define COLI_Q4XHALF256(MR, ASYM, MASKED, gs, n2)                                                      \
    {                                                                                              \
        __m256i raw[4];                                                                            \
        for (int q = 0; q < 4; q++)                                                                \
            raw[q] = (MASKED) ? coli_q4x_load_part(p + 16 * gs * q + 32 * h, 16 * (n2))            \
                              : _mm256_loadu_si256((const __m256i *)(const void *)(p + 64 * q + 32 * h)); \
        __m256 ws = _mm256_cvtph_ps((MASKED) ? coli_q4x_load_half(p + 64 * gs + 16 * h, 8 * (n2))  \
                                             : _mm_loadu_si128((const __m128i *)(const void *)(p + 256 + 16 * h))); \
        __m256 wmn = !(ASYM) ? ws : _mm256_cvtph_ps((MASKED) ? coli_q4x_load_half(p + 72 * gs + 16 * h, 8 * (n2)) \
                                                             : _mm_loadu_si128((const __m128i *)(const void *)(p + 288 + 16 * h))); \
        COLI_Q4XHALF256_DOT(MR, ASYM, raw)                                                         \
    }

/* n bytes (n <= 32, a multiple of 16) at p into a register, zeros after */
static inline __m256i coli_q4x_load_part(const uint8_t *p, int n) {
    __m128i lo = _mm_loadu_si128((const __m128i *)(const void *)p);
    return n > 16 ? _mm256_loadu_si256((const __m256i *)(const void *)p) : _mm256_zextsi128_si256(lo);
}
/* n bytes (8 or 16) of f16 at p, zeros after */
static inline __m128i coli_q4x_load_half(const uint8_t *p, int n) {
    return n > 8 ? _mm_loadu_si128((const __m128i *)(const void *)p) : _mm_loadl_epi64((const __m128i *)(const void *)p);
}

/* The token-lane GEMM's view of one packed tile (simd_q.h, coli_q4gemm8): groups c0 .. c0 + cn
 * (c0 a multiple of 4) of its 4 rows as unpacked nibbles (row r, group g at wb + (r * kc + g)
 * * 32: 16 low nibbles, then 16 high), scales and mins as floats (ws / wmn[r * kc + g]). Each
 * half step's 4 registers (row r's dword p of 2 groups) are transposed back into rows by 8
 * unpacks, the inverse of the packing. */
static inline void coli_q4x_rows4(const uint8_t *tile, int fmt, int nb, int c0, int cn, int kc, uint8_t *wb,
                                  float *ws, float *wmn) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const long gb = coli_q4x_group_bytes(fmt);
    for (int g0 = 0; g0 < cn; g0 += 4) {
        int s = (c0 + g0) / 4, n = nb - 4 * s < 4 ? nb - 4 * s : 4;
        const uint8_t *o = tile + 4L * s * gb;
        for (int h = 0; 2 * h < n; h++) {
            int n2 = n - 2 * h < 2 ? n - 2 * h : 2;
            __m256i A[4];
            for (int p = 0; p < 4; p++)
                A[p] = n == 4 ? _mm256_loadu_si256((const __m256i *)(const void *)(o + 64 * p + 32 * h))
                              : coli_q4x_load_part(o + 16 * n * p + 32 * h, 16 * n2);
            __m256i t0 = _mm256_unpacklo_epi32(A[0], A[1]), t1 = _mm256_unpackhi_epi32(A[0], A[1]);
            __m256i t2 = _mm256_unpacklo_epi32(A[2], A[3]), t3 = _mm256_unpackhi_epi32(A[2], A[3]);
            __m256i R[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                            _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
            for (int r = 0; r < 4; r++) {
                __m256i lo = _mm256_and_si256(R[r], m4), hi = _mm256_and_si256(_mm256_srli_epi16(R[r], 4), m4);
                int g = g0 + 2 * h;
                _mm256_store_si256((__m256i *)(void *)(wb + (r * kc + g) * 32), _mm256_permute2x128_si256(lo, hi, 0x20));
                if (n2 == 2)
                    _mm256_store_si256((__m256i *)(void *)(wb + (r * kc + g + 1) * 32),
                                       _mm256_permute2x128_si256(lo, hi, 0x31));
            }
        }
        for (int L = 0; L < n; L++)
            for (int r = 0; r < 4; r++) {
                uint16_t d, m = 0;
                memcpy(&d, o + 64 * n + 2 * (4 * L + r), 2);
                if (fmt == COLI_Q4A) memcpy(&m, o + 72 * n + 2 * (4 * L + r), 2);
                ws[r * kc + g0 + L] = coli_f16_to_f32(d);
                wmn[r * kc + g0 + L] = fmt == COLI_Q4A ? coli_f16_to_f32(m) : 0.0f;
            }
    }
}
/* MR tokens x the nr (<= 4) rows of one packed tile (AVX2). */
#define COLI_Q4XTILE256_PK(NAME, MR, ASYM)                                                         \
    COLI_SCHED static inline void NAME##_pk##MR(const coli_act *a, const uint8_t *pk, int nb, float *Y, long ldy, int nr) { \
        __m256 acc[MR];                                                                            \
        for (int i = 0; i < MR; i++) acc[i] = _mm256_setzero_ps();                                 \
        const __m256i m4 = _mm256_set1_epi8(0x0F);                                                 \
        const uint8_t *p = pk;                                                                     \
        int b = 0;                                                                                 \
        for (; b + 4 <= nb; b += 4, p += 4 * (ASYM ? 80 : 72)) {                                   \
            COLI_STREAM_PREFETCH5(p, COLI_Q4X_AHEAD, MR)                                             \
            for (int h = 0; h < 2; h++) COLI_Q4XHALF256(MR, ASYM, 0, 4, 2)                         \
        }                                                                                          \
        if (b < nb) { /* a short last step of gs groups: its halves' registers zero past them */    \
            const int gs = nb - b;                                                                 \
            for (int h = 0; 2 * h < gs; h++) {                                                     \
                const int n2 = gs - 2 * h < 2 ? gs - 2 * h : 2;                                    \
                COLI_Q4XHALF256(MR, ASYM, 1, gs, n2)                                               \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < MR; i++)                                                               \
            coli_xt_store(Y + i * ldy, _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1)), nr); \
    }
#define COLI_PKTILES256(NAME, ASYM)                                                                \
    COLI_Q4XTILE256_PK(NAME, 1, ASYM) COLI_Q4XTILE256_PK(NAME, 2, ASYM) COLI_Q4XTILE256_PK(NAME, 3, ASYM) \
    COLI_Q4XTILE256_PK(NAME, 4, ASYM)                                                              \
    static inline void NAME##_pk(int mr, const coli_act *a, const uint8_t *pk, int nb, float *Y, long ldy, int nr) { \
        switch (mr) {                                                                              \
        case 1: NAME##_pk1(a, pk, nb, Y, ldy, nr); break;                                          \
        case 2: NAME##_pk2(a, pk, nb, Y, ldy, nr); break;                                          \
        case 3: NAME##_pk3(a, pk, nb, Y, ldy, nr); break;                                          \
        default: NAME##_pk4(a, pk, nb, Y, ldy, nr); break;                                         \
        }                                                                                          \
    }
COLI_PKTILES256(coli_q4tile, 0)
COLI_PKTILES256(coli_q4atile, 1)

/* The packed tiles' arithmetic on rows: MR tokens x nr (<= 4) rows at wq (ldw bytes apart;
 * scales wd and mins wm ldd apart), against arranged activations. Each half step's registers
 * are made from the rows' 32 bytes of its 2 groups by the packing's own 8 unpacks (a 4 x 4
 * dword transpose per 128-bit lane) and its scales gathered into lane order, then go through
 * COLI_Q4XHALF256_DOT: a token gets the very bits of the same rows packed (MoE experts, whose
 * streamed layers are read as rows into cache slots while resident ones are packed). Rows
 * past nr repeat row 0 (their lanes are never stored). */
/* one half step's raw weight registers A from the rows' registers R (the packing's transpose) */
#define COLI_Q4XRX_W()                                                                             \
                __m256i t0 = _mm256_unpacklo_epi32(R[0], R[1]), t1 = _mm256_unpackhi_epi32(R[0], R[1]); \
                __m256i t2 = _mm256_unpacklo_epi32(R[2], R[3]), t3 = _mm256_unpackhi_epi32(R[2], R[3]); \
                __m256i A[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),      \
                                _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
/* 4 rows' f16 of groups b .. b + 3 (rows at p, ld apart) in lane order for half h = 0 / 1 */
#define COLI_Q4XRX_SCALES(p, ld, H0, H1)                                                          \
            {                                                                                      \
                __m128i q0 = _mm_loadl_epi64((const __m128i *)(const void *)((p) + b));            \
                __m128i q1 = _mm_loadl_epi64((const __m128i *)(const void *)((p) + (ld) * r1 + b)); \
                __m128i q2 = _mm_loadl_epi64((const __m128i *)(const void *)((p) + (ld) * r2 + b)); \
                __m128i q3 = _mm_loadl_epi64((const __m128i *)(const void *)((p) + (ld) * r3 + b)); \
                __m128i u01 = _mm_unpacklo_epi32(q0, q1), u23 = _mm_unpacklo_epi32(q2, q3);        \
                H0 = _mm_shuffle_epi8(_mm_unpacklo_epi64(u01, u23), order);                        \
                H1 = _mm_shuffle_epi8(_mm_unpackhi_epi64(u01, u23), order);                        \
            }
#define COLI_Q4XTILE256_RX(NAME, MR, ASYM)                                                         \
    COLI_SCHED static inline void NAME##_rx##MR(const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                     long ldw, long ldd, int nb, float *Y, long ldy, int nr) {      \
        __m256 acc[MR];                                                                            \
        for (int i = 0; i < MR; i++) acc[i] = _mm256_setzero_ps();                                 \
        const __m256i m4 = _mm256_set1_epi8(0x0F);                                                 \
        const __m128i order = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15); \
        const int r1 = nr > 1 ? 1 : 0, r2 = nr > 2 ? 2 : 0, r3 = nr > 3 ? 3 : 0;                   \
        const uint8_t *w0 = wq, *w1 = wq + r1 * ldw, *w2 = wq + r2 * ldw, *w3 = wq + r3 * ldw;       \
        int b = 0;                                                                                 \
        for (; b + 4 <= nb; b += 4) {                                                              \
            __m128i sh[2], mh[2] = {_mm_setzero_si128(), _mm_setzero_si128()};                     \
            COLI_Q4XRX_SCALES(wd, ldd, sh[0], sh[1])                                               \
            if (ASYM) COLI_Q4XRX_SCALES(wm, ldd, mh[0], mh[1])                                     \
            for (int h = 0; h < 2; h++) {                                                          \
                const long at = (long)(b + 2 * h) * 16;                                            \
                _mm_prefetch((const char *)(w0 + 4 * ldw + at), _MM_HINT_T0);                      \
                _mm_prefetch((const char *)(w1 + 4 * ldw + at), _MM_HINT_T0);                      \
                _mm_prefetch((const char *)(w2 + 4 * ldw + at), _MM_HINT_T0);                      \
                _mm_prefetch((const char *)(w3 + 4 * ldw + at), _MM_HINT_T0);                      \
                __m256i R[4] = {_mm256_loadu_si256((const __m256i *)(const void *)(w0 + at)),      \
                                _mm256_loadu_si256((const __m256i *)(const void *)(w1 + at)),      \
                                _mm256_loadu_si256((const __m256i *)(const void *)(w2 + at)),      \
                                _mm256_loadu_si256((const __m256i *)(const void *)(w3 + at))};     \
                COLI_Q4XRX_W()                                                                     \
                __m256 ws = _mm256_cvtph_ps(sh[h]);                                                \
                __m256 wmn = !(ASYM) ? ws : _mm256_cvtph_ps(mh[h]);                                \
                COLI_Q4XHALF256_DOT(MR, ASYM, A)                                                   \
            }                                                                                      \
        }                                                                                          \
        if (b < nb) { /* a short last step of gs groups: zeros past them, as in a packed tile */   \
            const int gs = nb - b;                                                                 \
            for (int h = 0; 2 * h < gs; h++) {                                                     \
                const int n2 = gs - 2 * h < 2 ? gs - 2 * h : 2, g = b + 2 * h;                     \
                const int rows[4] = {0, r1, r2, r3};                                               \
                __m256i R[4];                                                                      \
                uint16_t sv[8] = {0}, mv[8] = {0};                                                 \
                for (int r = 0; r < 4; r++) {                                                      \
                    const uint8_t *src = wq + rows[r] * ldw + g * 16;                              \
                    R[r] = n2 == 2 ? _mm256_loadu_si256((const __m256i *)(const void *)src)        \
                                   : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)src)); \
                    for (int L = 0; L < n2; L++) {                                                 \
                        sv[4 * L + r] = wd[rows[r] * ldd + g + L];                                 \
                        if (ASYM) mv[4 * L + r] = wm[rows[r] * ldd + g + L];                       \
                    }                                                                              \
                }                                                                                  \
                COLI_Q4XRX_W()                                                                     \
                __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)sv));   \
                __m256 wmn = !(ASYM) ? ws : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)mv)); \
                COLI_Q4XHALF256_DOT(MR, ASYM, A)                                                   \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < MR; i++)                                                               \
            coli_xt_store(Y + i * ldy, _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1)), nr); \
    }
#define COLI_RXTILES256(NAME, ASYM)                                                                \
    COLI_Q4XTILE256_RX(NAME, 1, ASYM) COLI_Q4XTILE256_RX(NAME, 2, ASYM) COLI_Q4XTILE256_RX(NAME, 3, ASYM) \
    COLI_Q4XTILE256_RX(NAME, 4, ASYM)                                                              \
    static inline void NAME##_rx(int mr, const coli_act *a, const uint8_t *wq, const uint16_t *wd, const uint16_t *wm, \
                                 long ldw, long ldd, int nb, float *Y, long ldy, int nr) {          \
        switch (mr) {                                                                              \
        case 1: NAME##_rx1(a, wq, wd, wm, ldw, ldd, nb, Y, ldy, nr); break;                        \
        case 2: NAME##_rx2(a, wq, wd, wm, ldw, ldd, nb, Y, ldy, nr); break;                        \
        case 3: NAME##_rx3(a, wq, wd, wm, ldw, ldd, nb, Y, ldy, nr); break;                        \
        default: NAME##_rx4(a, wq, wd, wm, ldw, ldd, nb, Y, ldy, nr); break;                       \
        }                                                                                          \
    }
COLI_RXTILES256(coli_q4tile, 0)
COLI_RXTILES256(coli_q4atile, 1)
#define COLI_Q4X_ROWS_X 1 /* rows with arranged activations take the packed tiles' arithmetic */
#define COLI_Q4X_TILES 1
#define COLI_Q4X_MR 4 /* tokens per tile: 8 weight registers, the masks and 4 accumulators fit in 16 */

#else
#define COLI_Q4X_TILES 0
static inline long coli_xe_ld(int fmt, int M, int K) { (void)fmt; (void)M; (void)K; return 0; }
static inline long coli_q4x_xe_ld(int M, int K) { (void)M; (void)K; return 0; }
static inline void coli_expand_act(const coli_act *a, int M, int K, int fmt, int8_t *xe, long lde) {
    (void)a; (void)M; (void)K; (void)fmt; (void)xe; (void)lde;
}
#endif

#if !defined(COLI_Q4X_ROWS_X)
#define COLI_Q4X_ROWS_X 0
#endif

#if COLI_Q4X_TILES
/* Y[m, n0 + n] for n < nb against the arranged activations a->xe (required), up to
 * COLI_Q4X_MR tokens a tile (this path's tiles above), of a repacked matrix (n0 a multiple of
 * 4) or, on AVX2 (COLI_Q4X_ROWS_X), of one in rows with the same arithmetic (MoE int4
 * experts in rows, coli_q4tile_rx). */
static inline void coli_q4x_packed(const coli_act *a, int M, const coli_mat *W, int n0, int nb, int K, float *Y,
                                   long ldy) {
    int ngroups = (K + QK - 1) / QK;
    for (int m = 0; m < M; m += COLI_Q4X_MR) {
        int mr = M - m < COLI_Q4X_MR ? M - m : COLI_Q4X_MR;
        coli_act sub = *a;
        sub.xe = a->xe + m * a->lde;
        for (int n = 0; n < nb; n += 4) {
            int nr = nb - n < 4 ? nb - n : 4;
            float *y = Y + m * ldy + n0 + n;
#if COLI_Q4X_ROWS_X
            if (W->pk == NULL) {
                const uint8_t *wq = (const uint8_t *)W->w + (long)(n0 + n) * W->ldw;
                const uint16_t *wd = W->d + (long)(n0 + n) * W->ldd, *wm = W->m ? W->m + (long)(n0 + n) * W->ldd : NULL;
                if (W->fmt == COLI_Q4A)
                    coli_q4atile_rx(mr, &sub, wq, wd, wm, W->ldw, W->ldd, ngroups, y, ldy, nr);
                else
                    coli_q4tile_rx(mr, &sub, wq, wd, NULL, W->ldw, W->ldd, ngroups, y, ldy, nr);
                continue;
            }
#endif
            const uint8_t *pk = W->pk + ((n0 + n) / 4) * W->pks;
            if (W->fmt == COLI_Q4A)
                coli_q4atile_pk(mr, &sub, pk, ngroups, y, ldy, nr);
            else
                coli_q4tile_pk(mr, &sub, pk, ngroups, y, ldy, nr);
        }
    }
}
#endif

#endif /* COLI_SIMD_QX_H */
