/* GEMVs and the GEMM on plain bf16 and float32 weights: the bf16 decode GEMV (where oneDNN has no bf16),
 * the bf16 prompt GEMM (AVX2 + FMA) and the float32 decode GEMV; each section says its arithmetic
 * (kernels/cpu_qgemv.py's *_def functions hold it bit for bit, tests/test_cpu_qgemv.py).
 *
 * Built into the kernel library for each ISA level (kernels/_cbuild.py: gcc -O3 -march=<level> -fopenmp
 * -ffp-contract=off -shared). The result for one (m, n) depends only on x[m] and row n: not on M, N, the
 * thread count or how work is split, so a batched decode step gives each sequence the bits it would get alone.
 */
#include "gemv_common.h"

#ifdef QG_AVX512
static inline float tree512(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                  /* lanes i + (i+2) */
    __m128 d = _mm_add_ss(c, _mm_shuffle_ps(c, c, 1));              /* lane 0 + lane 1 */
    return _mm_cvtss_f32(d);
}
#endif

#if defined(QG_AVX512) && defined(__AVX512BF16__)
/* bf16 weights with AVX512-BF16 dot products: x and the weight are held as "lane pairs", dword j of 32-column
   block t holding column 32t + j in its high word and column 32t + 16 + j in its low word. vdpbf16ps adds the
   high word's product first, so lane j adds the products of columns j, j + 16, j + 32, ... in that order,
   each exact (a product of two bf16 values) and each sum rounded once: the 16 float32 lanes of the
   definition (vdpbf16ps also flushes subnormal inputs and sums to zero). */
#define I8B_R 4     /* weight rows per tile */
#define I8B_MT 6    /* rows of x per tile: 24 accumulators */

/* x bf16 [M, K] -> lane pairs [M, nb * 16] dwords (nb = ceil(K / 32)), zero past K. */
uint32_t *lane_pairs(const uint16_t *x, int64_t ldx, int64_t m_count, int64_t k, int64_t nb) {
    uint32_t *xw = aligned_alloc(64, (size_t)(m_count * nb) * 64);
    if (!xw) return NULL;
    for (int64_t m = 0; m < m_count; m++)
        for (int64_t t = 0; t < nb; t++) {
            const int64_t kn = k - 32 * t < 32 ? k - 32 * t : 32;
            const __m512i v = _mm512_maskz_loadu_epi16(kn >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << kn) - 1),
                                                       x + m * ldx + 32 * t);
            const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(v));       /* columns j */
            const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)); /* columns 16 + j */
            _mm512_store_si512(xw + (m * nb + t) * 16, _mm512_or_si512(_mm512_slli_epi32(lo, 16), hi));
        }
    return xw;
}

/* out[i] = tree512(a[i]) for 16 vectors, the same additions in the same tree (lane j + lane j + 8,
   then j + (j + 4), j + (j + 2), j + (j + 1)), with the lanes of up to 16 vectors in one register per
   step: ~30 instructions instead of ~7 per vector. Afterwards lane 4k + t holds vector 4t + k. */
static inline void reduce16(const __m512 *a, float *out) {
    __m512 s1[8], s2[4], s3[2];
    for (int j = 0; j < 8; j++) { /* i + (i + 8): [a0 lanes 0-7, a1 lanes 0-7] */
        const __m512d x = _mm512_castps_pd(a[2 * j]), y = _mm512_castps_pd(a[2 * j + 1]);
        s1[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_shuffle_f64x2(x, y, 0x44)),
                              _mm512_castpd_ps(_mm512_shuffle_f64x2(x, y, 0xEE)));
    }
    for (int j = 0; j < 4; j++) /* i + (i + 4): 128-bit lane k holds vector 4j + k */
        s2[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * j], s1[2 * j + 1], 0x88),
                              _mm512_shuffle_f32x4(s1[2 * j], s1[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; j++) /* i + (i + 2): lane k: [v(8j+k) p0, p1, v(8j+4+k) p0, p1] */
        s3[j] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * j], s2[2 * j + 1], 0x44),
                              _mm512_shuffle_ps(s2[2 * j], s2[2 * j + 1], 0xEE));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88), _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
    float t[16];
    _mm512_storeu_ps(t, r);
    for (int k = 0; k < 4; k++)
        for (int q = 0; q < 4; q++) out[4 * q + k] = t[4 * k + q];
}

/* I8B_R converted weight rows (wb[t * I8B_R + r]) against MT rows of x (lane pairs): res[m * I8B_R + r]. */
static inline __attribute__((always_inline)) void bf16_lane_tile(const uint32_t *xs, int64_t nb, const __m512i *wb,
                                                                 float *res, const int MT) {
    __m512 acc[I8B_R][I8B_MT];
#pragma GCC unroll 4
    for (int r = 0; r < I8B_R; r++)
#pragma GCC unroll 6
        for (int m = 0; m < MT; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t t = 0; t < nb; t++) {
        const __m512i w0 = _mm512_load_si512(wb + t * I8B_R), w1 = _mm512_load_si512(wb + t * I8B_R + 1);
        const __m512i w2 = _mm512_load_si512(wb + t * I8B_R + 2), w3 = _mm512_load_si512(wb + t * I8B_R + 3);
#pragma GCC unroll 6
        for (int m = 0; m < MT; m++) {
            const __m512i xv = _mm512_load_si512(xs + (m * nb + t) * 16);
            acc[0][m] = _mm512_dpbf16_ps(acc[0][m], (__m512bh)w0, (__m512bh)xv);
            acc[1][m] = _mm512_dpbf16_ps(acc[1][m], (__m512bh)w1, (__m512bh)xv);
            acc[2][m] = _mm512_dpbf16_ps(acc[2][m], (__m512bh)w2, (__m512bh)xv);
            acc[3][m] = _mm512_dpbf16_ps(acc[3][m], (__m512bh)w3, (__m512bh)xv);
        }
    }
    /* res[m * I8B_R + r] = tree512(acc[r][m]), 16 at a time (reduce16) */
    __m512 all[I8B_R * I8B_MT + 16];
    int cnt = 0;
#pragma GCC unroll 6
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int r = 0; r < I8B_R; r++) all[cnt++] = acc[r][m];
    for (int i = cnt; i % 16; i++) all[i] = _mm512_setzero_ps();
    for (int i = 0; i < cnt; i += 16) {
        float r16[16];
        reduce16(all + i, r16);
        for (int j = 0; j < 16 && i + j < cnt; j++) res[i + j] = r16[j];
    }
}

/* bf16_lane_tile for mt = 1..I8B_MT rows of x, each a constant (the accumulators stay in registers) */
static void lane_tile(const uint32_t *xt, int64_t nb, const __m512i *wb, float *res, int mt) {
    switch (mt) {
    case 1: bf16_lane_tile(xt, nb, wb, res, 1); break;
    case 2: bf16_lane_tile(xt, nb, wb, res, 2); break;
    case 3: bf16_lane_tile(xt, nb, wb, res, 3); break;
    case 4: bf16_lane_tile(xt, nb, wb, res, 4); break;
    case 5: bf16_lane_tile(xt, nb, wb, res, 5); break;
    default: bf16_lane_tile(xt, nb, wb, res, 6); break;
    }
}

/* Batches on lane pairs: bf16 weight rows n in [n0, n1) (rows ldw apart) against all rows of x (xs, lane_pairs),
   I8B_R weight rows at a time turned into lane pairs once (wb: nb * I8B_R vectors of scratch) for every tile of
   x rows: out = bf16(sum); rows BF_AHEAD ahead prefetched into L2, one 64-byte line each. */
static void rows_lanes(const uint32_t *xs, int64_t nb, int64_t m_count, const uint16_t *w, int64_t ldw, int64_t k,
                       qout out, int64_t n0, int64_t n1, __m512i *wb) {
    /* word 2j of a block's pair vector = column 16 + j (low), word 2j + 1 = column j (high) */
    const __m512i perm = _mm512_set_epi16(15, 31, 14, 30, 13, 29, 12, 28, 11, 27, 10, 26, 9, 25, 8, 24,
                                          7, 23, 6, 22, 5, 21, 4, 20, 3, 19, 2, 18, 1, 17, 0, 16);
    float res[I8B_MT * I8B_R];
    for (int64_t n = n0; n < n1; n += I8B_R) {
        const int r = n1 - n < I8B_R ? (int)(n1 - n) : I8B_R;
        for (int64_t t = 0; t < nb; t++) {
            const int64_t kn = k - 32 * t < 32 ? k - 32 * t : 32;
            const __mmask32 mk = kn >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << kn) - 1);
            for (int rr = 0; rr < I8B_R; rr++)
                _mm_prefetch((const char *)(w + (n + rr + BF_AHEAD) * ldw + 32 * t), _MM_HINT_T1);
            for (int rr = 0; rr < I8B_R; rr++)
                wb[t * I8B_R + rr] = rr >= r ? _mm512_setzero_si512()
                                   : _mm512_permutexvar_epi16(perm, _mm512_maskz_loadu_epi16(mk, w + (n + rr) * ldw + 32 * t));
        }
        for (int64_t m0 = 0; m0 < m_count; m0 += I8B_MT) {
            const int mt = m_count - m0 < I8B_MT ? (int)(m_count - m0) : I8B_MT;
            lane_tile(xs + m0 * nb * 16, nb, wb, res, mt);
            for (int rr = 0; rr < r; rr++)
                for (int m = 0; m < mt; m++) put1(out, m0 + m, n + rr, res[m * I8B_R + rr]);
        }
    }
}
#endif

/* ------------------------------------------------------------ bf16 GEMV (decode)
 *
 * out[m, n] = bf16(dot(x[m], w[n])) for bf16 x and w, the dot in 16 float32 lanes (lane j takes k = j,
 * j+16, ... in order) reduced as cpu_ops.h's tree (kernels/cpu_qgemv.py bf16_gemv_def). A product of two
 * bf16 values is exact in float32, so the AVX2 FMAs give the bits of the portable product-then-sum.
 * Why: where oneDNN has no bf16 (AVX2: Zen 2/3, most laptops) torch's bf16 GEMV read SmolLM2's weights
 * at ~12-19 GB/s; this reads each weight row once, 4 rows at a time, with x widened once per call.
 */


static inline float bf16_row_tail(float *a, const uint16_t *x, const uint16_t *w, int64_t full, int64_t k) {
    for (int64_t j = 0; full + j < k; j++) a[j] = a[j] + bf(x[full + j]) * bf(w[full + j]);
    return ops_tree(a);
}

/* weight rows [n0, n1) (row stride ldw) against the bf16 rows x [M, K] (row stride ldx): out[m * ldo + n].
   AVX2: 16 elements of a row in one load; shifting each 32-bit word left 16 gives the even elements as
   floats, masking its high half the odd ones, so two registers hold the 16 lanes (even | odd) with no
   conversion instruction but a shift and an and; the lanes are put back in order before the tree. */
void bf16_rows(const uint16_t *xb, int64_t ldx, int64_t m_count, int64_t k, const uint16_t *w, int64_t ldw,
                      qout out, int64_t n0, int64_t n1) {
    const int64_t full = k / 16 * 16;
    (void)full;  /* (the x86 tiles' bound; NEON and scalar run the primitives over all of k) */
    for (int64_t m = 0; m < m_count; m++) {
        const uint16_t *x = xb + m * ldx;
        int64_t n = n0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256i hi16 = _mm256_set1_epi32((int)0xFFFF0000u);
        /* One row of x (decode): a weight row at a time, front to back (one stream, as bf16_rows_one: the
           x86-64-v3 build run on Zen 5, 2 threads, from DRAM: 1.1-1.45x the 4-row tile below, 1.0-1.14x
           oneDNN's packed GEMV; not measured on Zen 3) */
        for (; m_count == 1 && n < n1; n++) {
            const uint16_t *wr = w + n * ldw;
            __m256 ev = _mm256_setzero_ps(), od = _mm256_setzero_ps();
            for (int64_t i = 0; i < full; i += 16) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + i));
                if (!(i & 31)) __builtin_prefetch(wr + BF1_AHEAD * ldw + i, 0, 3);
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + i));
                ev = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(xv, 16)),
                                     _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16)), ev);
                od = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(xv, hi16)),
                                     _mm256_castsi256_ps(_mm256_and_si256(wv, hi16)), od);
            }
            float e[8], o[8], a[16];
            _mm256_storeu_ps(e, ev);
            _mm256_storeu_ps(o, od);
            for (int t = 0; t < 8; t++) { a[2 * t] = e[t]; a[2 * t + 1] = o[t]; }
            put1(out, m, n, bf16_row_tail(a, x, wr, full, k));
        }
        for (; n + 4 <= n1; n += 4) {
            __m256 ev[4], od[4];
            for (int r = 0; r < 4; r++) ev[r] = od[r] = _mm256_setzero_ps();
            for (int64_t i = 0; i < full; i += 16) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + i));
                const __m256 xe = _mm256_castsi256_ps(_mm256_slli_epi32(xv, 16));
                const __m256 xo = _mm256_castsi256_ps(_mm256_and_si256(xv, hi16));
                if (!(i & 31))
                    for (int r = 0; r < 4; r++) __builtin_prefetch(w + (n + r + BF_AHEAD) * ldw + i, 0, 2);
                for (int r = 0; r < 4; r++) {
                    const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (n + r) * ldw + i));
                    ev[r] = _mm256_fmadd_ps(xe, _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16)), ev[r]);
                    od[r] = _mm256_fmadd_ps(xo, _mm256_castsi256_ps(_mm256_and_si256(wv, hi16)), od[r]);
                }
            }
            for (int r = 0; r < 4; r++) {
                float e[8], o[8], a[16];
                _mm256_storeu_ps(e, ev[r]);
                _mm256_storeu_ps(o, od[r]);
                for (int t = 0; t < 8; t++) { a[2 * t] = e[t]; a[2 * t + 1] = o[t]; }
                put1(out, m, n + r, bf16_row_tail(a, x, w + (n + r) * ldw, full, k));
            }
        }
#endif
        for (; n < n1; n++) put1(out, m, n, isa_dot_bf16(x, w + n * ldw, k)); /* the rows left, NEON / SSE / C */
    }
}

#if defined(QG_AVX512) && defined(__AVX512BF16__)
/* The AVX512-BF16 build's bf16_rows (bf16_rows_lanes below), the same bits with vdpbf16ps (as bf16_lane_tile's): x as lane pairs (lane_pairs),
   each weight row's 32-column block turned into lane pairs in a register by one vpermw, then one vdpbf16ps
   per 32 multiply-adds for each row of x. Why: the AVX2 code widens every weight element to float32 (two
   shifts / masks and two FMAs per 16 columns) and walks the weight once per row of x, so batches of 2-11
   rows ran at 0.17-0.5x oneDNN's packed bf16 GEMV (Zen 5, 2 threads); here a weight block is read once
   for up to 6 rows of x. */
/* One row of x (decode): a weight row at a time, front to back, the row BF1_AHEAD ahead prefetched. Why:
   four rows at a time read ~30 GB/s from DRAM where oneDNN's packed GEMV read ~35; one row's single
   stream reads more than either (Zen 5, 2 threads, from DRAM: 151936x896 91 vs 75 GB/s oneDNN, 4864x896
   76 vs 62; 4 rows: ~0.8x oneDNN). One vdpbf16ps chain per row is no limit: ~40 GB/s a thread. */
static void bf16_rows_one(const uint32_t *xs, int64_t nb, int64_t k, const uint16_t *w, int64_t ldw, qout out,
                          int64_t n0, int64_t n1) {
    const __m512i perm = _mm512_set_epi16(15, 31, 14, 30, 13, 29, 12, 28, 11, 27, 10, 26, 9, 25, 8, 24,
                                          7, 23, 6, 22, 5, 21, 4, 20, 3, 19, 2, 18, 1, 17, 0, 16);
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wr = w + n * ldw;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t t = 0; t < nb; t++) {
            const int64_t kn = k - 32 * t < 32 ? k - 32 * t : 32;
            const __mmask32 mk = kn >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << kn) - 1);
            _mm_prefetch((const char *)(wr + BF1_AHEAD * ldw + 32 * t), _MM_HINT_T0); /* never faults */
            const __m512i v = _mm512_permutexvar_epi16(perm, _mm512_maskz_loadu_epi16(mk, wr + 32 * t));
            acc = _mm512_dpbf16_ps(acc, (__m512bh)v, (__m512bh)_mm512_load_si512(xs + t * 16));
        }
        put1(out, 0, n, tree512(acc));
    }
}

/* bf16_rows' contract; x as lane pairs xs [M, nb * 16] (lane_pairs): one row of x bf16_rows_one, more the
   lane-pair tiles (rows_lanes). */
void bf16_rows_lanes(const uint32_t *xs, int64_t nb, int64_t m_count, int64_t k, const uint16_t *w,
                            int64_t ldw, qout out, int64_t n0, int64_t n1) {
    __m512i *wb = m_count > 1 ? aligned_alloc(64, sizeof(__m512i) * (size_t)(nb * I8B_R)) : NULL;
    if (!wb) { /* one row of x, or out of memory: one weight row at a time for each row of x (the same bits) */
        for (int64_t m = 0; m < m_count; m++) bf16_rows_one(xs + m * nb * 16, nb, k, w, ldw, qout_at(out, m, 0), n0, n1);
        return;
    }
    rows_lanes(xs, nb, m_count, w, ldw, k, out, n0, n1, wb);
    free(wb);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !(defined(QG_AVX512) && defined(__AVX512BF16__))
/* Batches of BL_MIN_ROWS rows and more on AVX2 (prompts): bf16_rows' bits -- 16 float32 lanes per output, lane j
 * summing k = j, j + 16, ... in order, the tail then the tree -- as a register-blocked GEMM. x is widened to
 * float32 once per call; each thread widens BL_NB weight rows x BL_KC columns at a time into its own buffer
 * (L2) and runs tiles of 3 rows of x by 2 weight rows (12 accumulators of 8 lanes, 2 weight registers, 1 for x:
 * 5 loads per 6 FMAs), the lanes' partial sums kept between column blocks, the tree taken from the registers. Why: the
 * GEMV widens every weight element again for each row of x (~50 GFLOP/s a thread, x86-64-v3 build on a
 * Xeon 8581C) where a GEMM summing in another order ran ~110 and gave a row other bits in a prompt than at
 * decode; this runs the GEMV's sums at the GEMM's speed, so a row's bits never depend on its batch. */
#define BL_MIN_ROWS 4
#define BL_NB 48   /* weight rows a thread widens at a time (24 tiles of 2) */
#define BL_KC 512  /* columns widened at a time (a multiple of 16: a lane keeps its k mod 16) */
#define BL_REG(v) __asm__("" : "+x"(v)) /* v lives in a register here: no arithmetic, no bits changed */

/* ops_tree of the 16 lanes lo (0-7) | hi (8-15): i + (i+8), i + (i+4), i + (i+2), i + (i+1), as cpu_decode.c's dot_row16 */
static inline float bl_tree(__m256 lo, __m256 hi) {
    const __m256 t8 = _mm256_add_ps(lo, hi);
    const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
    const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}

static void bl_block(const float *xf, int64_t m_count, int64_t k, const uint16_t *w, int64_t ldw, qout out,
                     int64_t n0, int64_t n1, float *wf, float *part) {
    const int64_t full = k / 16 * 16, nr = n1 - n0;
    for (int64_t k0 = 0; k0 < full; k0 += BL_KC) {
        const int64_t kc = full - k0 < BL_KC ? full - k0 : BL_KC;
        const int first = k0 == 0, last = k0 + kc == k; /* last: no tail follows, the tree comes here */
        for (int64_t r = 0; r < nr; r++) /* widen the block: wf [nr][kc] */
            for (int64_t i = 0; i < kc; i += 8)
                _mm256_storeu_ps(wf + r * BL_KC + i, ops_bf8(w + (n0 + r) * ldw + k0 + i));
        for (int64_t m = 0; m < m_count; m += 3) {
            const int mr = m_count - m < 3 ? (int)(m_count - m) : 3;
            const float *x0 = xf + m * k + k0, *x1 = mr > 1 ? x0 + k : x0, *x2 = mr > 2 ? x0 + 2 * k : x0;
            for (int64_t r = 0; r < nr; r += 2) {
                const int rn = nr - r < 2 ? 1 : 2;
                float *pp = part + (m * BL_NB + r) * 16; /* part [M][BL_NB][16]: row m + i, weight row r + j */
                const float *w0 = wf + r * BL_KC, *w1 = rn > 1 ? w0 + BL_KC : w0;
                __m256 a[3][2][2]; /* [row of x][weight row][lanes 0-7 | 8-15] */
                for (int i = 0; i < 3; i++)
                    for (int j = 0; j < 2; j++)
                        for (int h = 0; h < 2; h++)
                            a[i][j][h] = first || i >= mr || j >= rn ? _mm256_setzero_ps()
                                                                     : _mm256_loadu_ps(pp + (i * BL_NB + j) * 16 + 8 * h);
                for (int64_t t = 0; t < kc; t += 16) {
                    for (int h = 0; h < 2; h++) { /* lanes 0-7, then 8-15: 2 weight + 3 x registers, 6 FMAs */
                        const __m256 wa = _mm256_loadu_ps(w0 + t + 8 * h), wb = _mm256_loadu_ps(w1 + t + 8 * h);
                        __m256 xv = _mm256_loadu_ps(x0 + t + 8 * h);
                        BL_REG(xv); /* one load for two FMAs (GCC would fold it into both) */
                        a[0][0][h] = _mm256_fmadd_ps(xv, wa, a[0][0][h]);
                        a[0][1][h] = _mm256_fmadd_ps(xv, wb, a[0][1][h]);
                        xv = _mm256_loadu_ps(x1 + t + 8 * h);
                        BL_REG(xv);
                        a[1][0][h] = _mm256_fmadd_ps(xv, wa, a[1][0][h]);
                        a[1][1][h] = _mm256_fmadd_ps(xv, wb, a[1][1][h]);
                        xv = _mm256_loadu_ps(x2 + t + 8 * h);
                        BL_REG(xv);
                        a[2][0][h] = _mm256_fmadd_ps(xv, wa, a[2][0][h]);
                        a[2][1][h] = _mm256_fmadd_ps(xv, wb, a[2][1][h]);
                    }
                }
                for (int i = 0; i < mr; i++) /* missing rows of x or weights were computed on valid memory: dropped */
                    for (int j = 0; j < rn; j++) {
                        if (last) {
                            put1(out, m + i, n0 + r + j, bl_tree(a[i][j][0], a[i][j][1]));
                        } else {
                            _mm256_storeu_ps(pp + (i * BL_NB + j) * 16, a[i][j][0]);
                            _mm256_storeu_ps(pp + (i * BL_NB + j) * 16 + 8, a[i][j][1]);
                        }
                    }
            }
        }
    }
    if (full == k) return;
    for (int64_t m = 0; m < m_count; m++) /* the tail into lanes 0 .. k - full, then the tree */
        for (int64_t r = 0; r < nr; r++) {
            float a[16];
            if (full) memcpy(a, part + (m * BL_NB + r) * 16, sizeof a);
            else memset(a, 0, sizeof a);
            const uint16_t *wr = w + (n0 + r) * ldw;
            for (int64_t j = 0; full + j < k; j++) a[j] = a[j] + xf[m * k + full + j] * bf(wr[full + j]);
            put1(out, m, n0 + r, ops_tree(a));
        }
}

/* x bf16 [M, K] -> out [M, N] with bf16_rows' bits (see above); 0 when done, 2 when out of memory. */
static int bf16_gemm_lanes(const uint16_t *x, int64_t ldx, int64_t m_count, int64_t k, const uint16_t *w, int64_t ldw,
                           qout out, int64_t n, int threads) {
    float *xf = malloc(sizeof(float) * (size_t)(m_count * k));
    if (!xf) return 2;
    for (int64_t m = 0; m < m_count; m++)
        for (int64_t i = 0; i < k; i++) xf[m * k + i] = bf(x[m * ldx + i]);
    const int64_t items = (n + BL_NB - 1) / BL_NB;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1 && m_count * n * k >= PAR_MIN)
    {
        float *wf = malloc(sizeof(float) * (size_t)(BL_NB * BL_KC));
        float *part = malloc(sizeof(float) * (size_t)(m_count * BL_NB * 16));
        if (!wf || !part) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++)
            if (wf && part) bl_block(xf, m_count, k, w, ldw, out, it * BL_NB, it * BL_NB + BL_NB < n ? it * BL_NB + BL_NB : n, wf, part);
        free(wf);
        free(part);
    }
    free(xf);
    return failed ? 2 : 0;
}
#endif

/* x [M, K] bf16 (row stride ldx), w bf16 [N, K] (row stride ldw) -> out [M, N] (row stride ldo): bf16, or float32
   unrounded with IO_OUT_F32 in io (the LM head's logits). */
int llmsys_gemv_bf16_io(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, void *outp, int64_t ldo,
                        int64_t m_count, int64_t n, int64_t k, int threads, int io) {
    if (m_count <= 0 || n <= 0 || k <= 0 || ldx < k || ldw < k || ldo < n || io & ~IO_OUT_F32) return 1;
    const qout out = {outp, ldo, (io & IO_OUT_F32) != 0};
    const int64_t items = (n + 63) / 64;
    const int par = threads > 1 && items > 1 && m_count * n * k >= PAR_MIN;
#if defined(QG_AVX512) && defined(__AVX512BF16__)
    const int64_t nb = (k + 31) / 32;
    uint32_t *xs = lane_pairs(x, ldx, m_count, k, nb);
    if (!xs) return 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
    for (int64_t it = 0; it < items; it++)
        bf16_rows_lanes(xs, nb, m_count, k, w, ldw, out, it * 64, it * 64 + 64 < n ? it * 64 + 64 : n);
    free(xs);
#else
#if defined(__AVX2__) && defined(__FMA__)
    if (m_count >= BL_MIN_ROWS) return bf16_gemm_lanes(x, ldx, m_count, k, w, ldw, out, n, threads);
#endif
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
    for (int64_t it = 0; it < items; it++)
        bf16_rows(x, ldx, m_count, k, w, ldw, out, it * 64, it * 64 + 64 < n ? it * 64 + 64 : n);
#endif
    return 0;
}

int llmsys_gemv_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, uint16_t *out, int64_t ldo,
                     int64_t m_count, int64_t n, int64_t k, int threads) {
    return llmsys_gemv_bf16_io(x, ldx, w, ldw, out, ldo, m_count, n, k, threads, 0);
}

/* ------------------------------------------------------------ bf16 GEMM (prompts, AVX2 + FMA)
 *
 * out[m, n] = bf16(c + bias[n]), c = fma(x[m, K-1], w[n, K-1], ... fma(x[m, 0], w[n, 0], 0)): one float32
 * fused multiply-add chain per output element, over k in order. Why: on CPUs where oneDNN has no bf16
 * (AVX2: Zen 2/3, Intel before Ice Lake) a bf16 prompt ran float32 sgemm on weight chunks upcast for each
 * call (kernels/cpu_linear.py), ~180 GFLOP/s on 2 Zen 5 cores held to AVX2 where llama.cpp's f16 prompt
 * ran ~190-200: a Qwen2.5-0.5B bf16 prefill 0.88x llama.cpp's. Here the weight is read as bf16 and
 * converted in L1-sized blocks, no float32 copy of it is made, and an element's chain does not depend on
 * how many rows of x come with it, the row split between threads or a chunked weight (the bits of a row are
 * the same in any batch, unlike sgemm's).
 *
 * How (the classic register-blocked GEMM): x converted once to float32 panels of GB_MR rows, k-major
 * ([K][GB_MR]); per 16 weight rows and GB_KC columns, the block transposed into float32 [GB_KC][16] (L1);
 * a 6 x 16 tile of outputs in 12 registers takes per k 2 weight loads, 6 broadcasts of x and 12 FMAs. The
 * tiles' partial sums wait in a per-thread float32 buffer between column blocks (loaded back into the same
 * chain). Threads split the weight's 16-row blocks.
 */
#define GB_MR 6
#define GB_NR 16
#define GB_KC 256

int llmsys_gemm_bf16_native(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
/* c[r][0..16) for rows r < mr of the panel a ([kc][GB_MR] floats) against b ([kc][16] floats), chains
   continued from c (zero when first). mr is a constant where inlined. */
static inline __attribute__((always_inline)) void gb_tile(const float *a, const float *b, int64_t kc, float *c,
                                                          int first, const int mr) {
    __m256 acc[GB_MR][2];
    for (int r = 0; r < mr; r++) {
        acc[r][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * GB_NR);
        acc[r][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * GB_NR + 8);
    }
    for (int64_t kk = 0; kk < kc; kk++) {
        const __m256 b0 = _mm256_load_ps(b + kk * GB_NR), b1 = _mm256_load_ps(b + kk * GB_NR + 8);
        for (int r = 0; r < mr; r++) {
            const __m256 av = _mm256_broadcast_ss(a + kk * GB_MR + r);
            acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm256_storeu_ps(c + r * GB_NR, acc[r][0]);
        _mm256_storeu_ps(c + r * GB_NR + 8, acc[r][1]);
    }
}

/* 8 x 8 floats: rows r[0..8) -> columns (r[i] lane j -> out[j] lane i) */
static inline void gb_transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* b [kc][16] floats = weight rows [n0, n0 + 16) (rows >= n: zeros), columns [k0, k0 + kc), transposed */
static void gb_pack_w(const uint16_t *w, int64_t ldw, int64_t n, int64_t n0, int64_t k0, int64_t kc, float *b) {
    int64_t kk = 0;
    if (n0 + GB_NR <= n)
        for (; kk + 8 <= kc; kk += 8)
            for (int h = 0; h < 2; h++) { /* rows n0 + 8h .. + 8: an 8 x 8 block */
                __m256 r[8];
                for (int i = 0; i < 8; i++) r[i] = ops_bf8(w + (n0 + 8 * h + i) * ldw + k0 + kk);
                gb_transpose8(r);
                for (int j = 0; j < 8; j++) _mm256_store_ps(b + (kk + j) * GB_NR + 8 * h, r[j]);
            }
    for (; kk < kc; kk++)
        for (int j = 0; j < GB_NR; j++) b[kk * GB_NR + j] = n0 + j < n ? bf(w[(n0 + j) * ldw + k0 + kk]) : 0.0f;
}
#endif

/* x [M, K] bf16 (row stride ldx) times w [N, K] bf16 (row stride ldw) (+ bias [N] bf16 or NULL) -> out [M, N]
   bf16 (row stride ldo). 0; 1 bad arguments or not an AVX2 + FMA build; 2 no memory. */
int llmsys_gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, const uint16_t *bias,
                     uint16_t *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads) {
    if (m_count <= 0 || n <= 0 || k <= 0 || ldx < k || ldw < k || ldo < n) return 1;
#if defined(__AVX2__) && defined(__FMA__)
    const int64_t panels = (m_count + GB_MR - 1) / GB_MR, mpad = panels * GB_MR;
    float *a = aligned_alloc(64, sizeof(float) * (size_t)(mpad * k + 16));
    if (!a) return 2;
    const int64_t blocks = (n + GB_NR - 1) / GB_NR;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1 && m_count * n * k >= PAR_MIN)
    {
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) /* x as k-major panels of GB_MR rows (rows past M: zeros) */
            for (int64_t r = 0; r < GB_MR; r++) {
                const int64_t m = p * GB_MR + r;
                float *ap = a + p * GB_MR * k + r;
                if (m < m_count)
                    for (int64_t kk = 0; kk < k; kk++) ap[kk * GB_MR] = bf(x[m * ldx + kk]);
                else
                    for (int64_t kk = 0; kk < k; kk++) ap[kk * GB_MR] = 0.0f;
            }
        float *b = aligned_alloc(64, sizeof(float) * GB_KC * GB_NR);
        float *c = aligned_alloc(64, sizeof(float) * (size_t)(mpad * GB_NR));
        if (!b || !c) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; blk++) {
            if (!b || !c) continue;
            const int64_t n0 = blk * GB_NR;
            for (int64_t k0 = 0; k0 < k; k0 += GB_KC) {
                const int64_t kc = k - k0 < GB_KC ? k - k0 : GB_KC;
                gb_pack_w(w, ldw, n, n0, k0, kc, b);
                for (int64_t p = 0; p < panels; p++) {
                    const int64_t mr = m_count - p * GB_MR < GB_MR ? m_count - p * GB_MR : GB_MR;
                    const float *ap = a + p * GB_MR * k + k0 * GB_MR;
                    float *cp = c + p * GB_MR * GB_NR;
                    if (mr == GB_MR) gb_tile(ap, b, kc, cp, k0 == 0, GB_MR);
                    else if (mr == 5) gb_tile(ap, b, kc, cp, k0 == 0, 5);
                    else if (mr == 4) gb_tile(ap, b, kc, cp, k0 == 0, 4);
                    else if (mr == 3) gb_tile(ap, b, kc, cp, k0 == 0, 3);
                    else if (mr == 2) gb_tile(ap, b, kc, cp, k0 == 0, 2);
                    else gb_tile(ap, b, kc, cp, k0 == 0, 1);
                }
            }
            const int64_t nr = n - n0 < GB_NR ? n - n0 : GB_NR;
            for (int64_t m = 0; m < m_count; m++)
                for (int64_t j = 0; j < nr; j++) {
                    const float v = c[m * GB_NR + j];
                    out[m * ldo + n0 + j] = rne(bias ? v + bf(bias[n0 + j]) : v);
                }
        }
        free(b);
        free(c);
    }
    free(a);
    return failed ? 2 : 0;
#else
    (void)x; (void)w; (void)bias; (void)out; (void)threads;
    return 1;
#endif
}

/* ------------------------------------------------------------ float32 GEMV (decode)
 *
 * out[m, n] = dot(x[m], w[n]) for float32 x and w in cpu_ops.h's order (ops_dot_f32: 16 lanes, each product
 * rounded and then added, the lanes reduced as its tree; kernels/cpu_qgemv.py f32_gemv_def), so every build
 * gives the same bits. Why: a float32 model's decode layers run fused like the bf16 and quantized ones (the
 * layer kernels of fused_layer.c and decode_stack.c), which needs a GEMV of their own; torch's own (MKL sgemv)
 * also ran 2.5x slower at M = 2..8 than at M = 1 (cpu_linear.py). A weight row at a time, front to back,
 * the row F1_AHEAD ahead prefetched (bf16_rows_one's one stream), every row of x against it while it sits
 * in L1. No FMA: the definition rounds the product before the add (memory-bound either way).
 */
#define F1_AHEAD 4

void f32_rows(const float *x, int64_t ldx, int64_t m_count, int64_t k, const float *w, int64_t ldw,
                     float *out, int64_t ldo, int64_t n0, int64_t n1) {
    const int64_t full = k / 16 * 16;
    (void)full;  /* (the x86 tiles' bound) */
    for (int64_t n = n0; n < n1; n++) {
        const float *wr = w + n * ldw;
#if defined(QG_AVX512)
        for (int64_t i = 0; i < k; i += 16) _mm_prefetch((const char *)(wr + F1_AHEAD * ldw + i), _MM_HINT_T0);
#endif
        for (int64_t m = 0; m < m_count; m++) {
            const float *xr = x + m * ldx;
#if defined(QG_AVX512)
            __m512 acc = _mm512_setzero_ps();
            for (int64_t i = 0; i < full; i += 16)
                acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(xr + i), _mm512_loadu_ps(wr + i)));
            if (full < k) { /* the tail into lanes 0 .. k - full - 1, the others untouched */
                const __mmask16 mk = (__mmask16)((1u << (k - full)) - 1);
                acc = _mm512_mask_add_ps(acc, mk, acc,
                                         _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, xr + full), _mm512_maskz_loadu_ps(mk, wr + full)));
            }
            out[m * ldo + n] = tree512(acc);
#elif defined(__AVX2__)
            float a[16] = {0};
            __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
            for (int64_t i = 0; i < full; i += 16) {
                lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(wr + i)));
                hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(xr + i + 8), _mm256_loadu_ps(wr + i + 8)));
            }
            _mm256_storeu_ps(a, lo);
            _mm256_storeu_ps(a + 8, hi);
            for (int64_t j = 0; full + j < k; j++) a[j] = a[j] + xr[full + j] * wr[full + j];
            out[m * ldo + n] = ops_tree(a);
#else
            out[m * ldo + n] = isa_dot_f32(xr, wr, k); /* NEON / SSE / C */
#endif
        }
    }
}

/* x [M, K] float32 (row stride ldx), w float32 [N, K] (row stride ldw) -> out [M, N] float32 (row stride ldo). */
int llmsys_gemv_f32(const float *x, int64_t ldx, const float *w, int64_t ldw, float *out, int64_t ldo,
                    int64_t m_count, int64_t n, int64_t k, int threads) {
    if (m_count <= 0 || n <= 0 || k <= 0 || ldx < k || ldw < k || ldo < n) return 1;
    const int64_t items = (n + 63) / 64;
    const int par = threads > 1 && items > 1 && m_count * n * k >= PAR_MIN;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
    for (int64_t it = 0; it < items; it++)
        f32_rows(x, ldx, m_count, k, w, ldw, out, ldo, it * 64, it * 64 + 64 < n ? it * 64 + 64 : n);
    return 0;
}
