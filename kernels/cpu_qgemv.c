/* Decode GEMVs on the CPU: quantized weights (int8 per row, int4 per group; exact for prefill, and the
 * "a8" GEMVs with x quantized to int8 for decode), the int4 GEMM for prefill, the bf16 GEMV for decode
 * where oneDNN has no bf16, and the fused decode layers over them (at the end of this file).
 *
 * Built for each ISA level and loaded for the running CPU by kernels/_cbuild.py
 * (gcc -O3 -march=<level> -fopenmp -ffp-contract=off -shared). Why: torch's
 * _weight_int8pack_mm and _weight_int4pack_mm_for_cpu read their weights at
 * ~13 and ~18 GB/s at M = 1 on Zen 4 (2 threads, from DRAM), below the bf16
 * prepacked GEMV's ~22 GB/s, so the quantized formats lost most of their byte
 * savings at decode. These kernels read every weight byte once, at ~26-33 GB/s.
 *
 * Arithmetic (tests/test_cpu_qgemv.py holds the torch definitions in
 * kernels/cpu_qgemv.py to it, bit for bit):
 *   - bf16 -> f32 is exact; f32 -> bf16 rounds to nearest even (torch's).
 *   - Every product x * w below multiplies a bf16 value (8 significant bits)
 *     by an integer of at most 8 bits, so it is exact in float32 (for finite,
 *     non-overflowing products): a fused multiply-add then gives the same
 *     bits as the separate product and sum of the definition, which is why
 *     the AVX-512 paths may use FMA while the C is built with
 *     -ffp-contract=off and the portable paths multiply, then add.
 *
 * int8: x [M, K] bf16, q int8 [N, K], scale [N] bf16
 *       acc = dot(x[m], q[n]) in 16 float32 lanes (lane j takes k = j, j+16,
 *             ... in order), lanes reduced as a tree: i + (i+8), i + (i+4),
 *             i + (i+2), i + (i+1)   (cpu_decode.c's order)
 *       out[m, n] = bf16(acc * scale[n])
 * int4: x [M, K] bf16 (zero-padded to Kp), the CPU int4 tiling of q [Np, Kp] (cpu_int4.py)
 *       (bytes [Np/64, Kp, 32]: byte (b, k, j) holds row 64b+j in its low
 *       nibble, row 64b+32+j in its high nibble), zero [N, G] uint8,
 *       scale [N, G] (bf16, fp16 or f32 values, read as f32):
 *       per row n, group g (columns g*gs .. g*gs+gs-1):
 *           a_g = sum over k of x[m, k] * (q[n, k] - zero[n, g]), in order of k
 *       acc = sum over g of a_g * scale[n, g], in order of g (product rounded, then added)
 *       out[m, n] = bf16(acc)
 *       (w = (q - zero) * scale is the canonical int4 formula, dequantize_int4's.)
 *
 * The result for one (m, n) depends only on x[m] and row n: not on M, N, the
 * thread count or how work is split, so a batched decode step gives each
 * sequence the bits it would get alone.
 *
 * How: int8 works on 8 weight rows at once at M = 1 (4 rows times up to 4
 * rows of x up to M = 4), converting each 16-byte piece of q to float once, and
 * prefetches the rows 16 ahead into L2 (without it the row streams reached
 * only ~11 GB/s from DRAM, with it ~27-33). From 5 rows of x, with
 * AVX512-BF16, it converts each weight row once to bf16 "lane pairs" that
 * vdpbf16ps adds in the same lane order (rows_lanes: the same bits, twice
 * the multiply-adds per instruction). int4 works on one 64-row block at
 * a time, whose bytes for consecutive columns are contiguous (32 bytes per
 * column give 64 rows' codes), one group at a time: with AVX512-BF16 two
 * columns' codes are interleaved into words, looked up as bf16(q - zero)
 * (exact, vpermw on a 32-entry table) and multiplied into 16 float lanes by
 * vdpbf16ps, which adds the column-k product before the column-k+1 product,
 * each rounded: the definition's order (it also treats subnormal x and partial
 * sums as zero, the one case where it differs); without it (q - zero) becomes
 * float by the 2^23 trick ((2^23 + q) - (2^23 + zero), exact) and meets a
 * broadcast x[m, k] in an FMA. A group's 64 zero points and scales are vector
 * loads when they lie contiguously (Int4Linear's group-major zeros_gm, its
 * scales_zeros view), a scalar gather otherwise (~1.4x slower). AVX2 (x86-64-v3) builds run the
 * same lanes in pairs of 8-float registers (int8_tile2, int4_group_avx2). OpenMP splits
 * rows (int8) or 64-row blocks (int4) over threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_ops.h"
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QG_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QG_AVX2 1
#endif

#define LANES 16
/* Software prefetch distance, measured on Zen 4 at M = 1, 2 threads, weights from DRAM: int8 rows ahead:
   none 11 GB/s, L1 hint 14, L2 hint 8-16 rows ahead 27-33 (151936 x 896). The a8 paths prefetch the rows
   this far ahead as one run in address order (not a line a row: 8-16 interleaved streams read ~35 GB/s where
   one run reads ~48, Zen 5), with locality PF_LOC (3 = T0: a streaming test read 47-49 GB/s with it, 43-48
   with T1). */
#define I8_AHEAD 16
#ifndef PF_LOC
#define PF_LOC 3
#endif
#define BF_AHEAD 8  /* bf16 weight rows prefetched ahead (into L2) */
#define BF1_AHEAD 8 /* bf16, one row of x, a weight row at a time: the row this far ahead prefetched (into L1) */
#define MTILE 4             /* rows of x per pass over a weight tile */
#define PAR_MIN (1 << 16)   /* multiply-adds below which one thread runs (no fork) */


static inline float half_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
    if (e == 0x1f) {
        u = sign | 0x7f800000u | (m << 13);
    } else if (e) {
        u = sign | ((e + 112u) << 23) | (m << 13);
    } else if (m) { /* subnormal: normalize */
        int sh = 0;
        while (!(m & 0x400u)) { m <<= 1; sh++; }
        u = sign | ((uint32_t)(113 - sh) << 23) | ((m & 0x3ffu) << 13);
    } else {
        u = sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* scale_kind: 0 bf16, 1 float32, 2 float16 */
static inline float load_scale(const void *s, int64_t at, int kind) {
    if (kind == 1) return ((const float *)s)[at];
    if (kind == 2) return half_to_f32(((const uint16_t *)s)[at]);
    return bf(((const uint16_t *)s)[at]);
}

static inline float tree(float *a) {
    for (int w = LANES / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) a[i] = a[i] + a[i + w];
    return a[0];
}

/* x bf16 rows (stride ldx) -> float rows of width kpad, zero beyond k. */
static float *widen(const uint16_t *x, int64_t ldx, int64_t m_count, int64_t k, int64_t kpad) {
    float *xf = aligned_alloc(64, sizeof(float) * (size_t)(m_count * kpad));
    if (!xf) return NULL;
    for (int64_t m = 0; m < m_count; m++) {
        for (int64_t i = 0; i < k; i++) xf[m * kpad + i] = bf(x[m * ldx + i]);
        for (int64_t i = k; i < kpad; i++) xf[m * kpad + i] = 0.0f;
    }
    return xf;
}

/* Where a GEMV writes: out[m * ld + n], bf16 rounded to nearest even (the layers' activations), or with f32 set
   float32 as summed, unrounded (the LM head's logits: rounded to bf16 their gaps were multiples of 2^-3 near
   10, argmax ties everywhere and a coarse distribution for the sampler). */
typedef struct {
    void *p;
    int64_t ld;
    int f32;
} qout;

static inline qout qout_at(qout o, int64_t m, int64_t n) { /* the same matrix from row m, column n */
    o.p = (char *)o.p + (m * o.ld + n) * (o.f32 ? 4 : 2);
    return o;
}

static inline void put1(qout o, int64_t m, int64_t n, float v) {
    if (o.f32) ((float *)o.p)[m * o.ld + n] = v;
    else ((uint16_t *)o.p)[m * o.ld + n] = rne(v);
}

#if defined(__AVX2__)
static inline void put8(qout o, int64_t m, int64_t n, __m256 v) { /* 8 outputs at once */
    if (o.f32) _mm256_storeu_ps((float *)o.p + m * o.ld + n, v);
    else _mm_storeu_si128((__m128i *)((uint16_t *)o.p + m * o.ld + n), ops_rne8(v));
}
#endif

/* ------------------------------------------------------------ int8 */

#ifdef QG_AVX512
/* Outputs leave the AVX-512 kernels as vectors: a vector stored and read back a float at a time
   stalled each read (store-to-load forwarding; ~10 cycles an output, ~40% of an int8 GEMM at M = 128 on
   Zen 5). 16 floats -> 16 bf16, rounded to nearest even, NaN -> 0x7fc0 (rne()'s bits). */
static inline __m256i rne16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}

/* out[m, row0 + 16v + i] = bf16(r[v] lane i) for rows below `rows`; r in row order. */
static inline void store_rows(uint16_t *o, const __m512 *r, int64_t rows) {
    for (int v = 0; v < 4; v++) {
        const int64_t left = rows - 16 * v;
        if (left <= 0) break;
        const __mmask16 mk = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);
        _mm256_mask_storeu_epi16(o + 16 * v, mk, rne16(r[v]));
    }
}

/* 16 outputs at once; the first `rows` (<= 16) of them with rows_mask */
static inline void put16(qout o, int64_t m, int64_t n, __m512 v) {
    if (o.f32) _mm512_storeu_ps((float *)o.p + m * o.ld + n, v);
    else _mm256_storeu_si256((__m256i *)((uint16_t *)o.p + m * o.ld + n), rne16(v));
}

/* store_rows into a qout: out[m, n + 16v + i] = r[v] lane i for the first `rows` */
static inline void put_rows(qout o, int64_t m, int64_t n, const __m512 *r, int64_t rows) {
    if (!o.f32) {
        store_rows((uint16_t *)o.p + m * o.ld + n, r, rows);
        return;
    }
    for (int v = 0; v < 4; v++) {
        const int64_t left = rows - 16 * v;
        if (left <= 0) break;
        const __mmask16 mk = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);
        _mm512_mask_storeu_ps((float *)o.p + m * o.ld + n + 16 * v, mk, r[v]);
    }
}

static inline float tree512(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                  /* lanes i + (i+2) */
    __m128 d = _mm_add_ss(c, _mm_shuffle_ps(c, c, 1));              /* lane 0 + lane 1 */
    return _mm_cvtss_f32(d);
}

/* R weight rows from q (stride ldq) against MT rows of xf (stride kpad): res[m * R + r]. */
static inline __attribute__((always_inline)) void int8_tile(const float *xf, int64_t kpad, int mt_count,
                                                            const int8_t *q, int64_t ldq, int64_t k, float *res,
                                                            const int R, const int MT) {
    __m512 acc[8][MTILE];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++) acc[r][m] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + LANES <= k; i += LANES) {
        __m512 xv[MTILE];
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++) xv[m] = _mm512_load_ps(xf + m * kpad + i);
        if ((i & 63) == 0) /* into L2, I8_AHEAD rows ahead: ~2.5x the bandwidth of no or L1 prefetches */
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)(q + (r + I8_AHEAD) * ldq + i), _MM_HINT_T1);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + r * ldq + i))));
#pragma GCC unroll 4
            for (int m = 0; m < MT; m++) acc[r][m] = _mm512_fmadd_ps(xv[m], w, acc[r][m]);
        }
    }
    if (i < k) { /* tail: zero codes against zero-padded x add +0 to every lane (acc is never -0) */
        const __mmask16 mask = (__mmask16)((1u << (k - i)) - 1u);
        __m512 xv[MTILE];
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++) xv[m] = _mm512_load_ps(xf + m * kpad + i);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, q + r * ldq + i)));
#pragma GCC unroll 4
            for (int m = 0; m < MT; m++) acc[r][m] = _mm512_fmadd_ps(xv[m], w, acc[r][m]);
        }
    }
    (void)mt_count;
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++) res[m * R + r] = tree512(acc[r][m]);
}
#endif

#ifdef QG_AVX2
/* The 16 lanes as two 8-float registers (lanes 0-7: columns i..i+7, lanes 8-15: i+8..i+15), reduced in
   tree()'s order: the bits of the portable loop (an FMA of an exact product is the product, then the sum). */
static inline float tree256(__m256 lo, __m256 hi) {
    const __m256 a = _mm256_add_ps(lo, hi);                                      /* i + (i+8) */
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* i + (i+4) */
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));                         /* i + (i+2) */
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));               /* 0 + 1 */
}

static inline __m256 int8_8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }

/* R weight rows against MT rows of xf (R * MT <= 4: 8 accumulators of the 16 ymm registers). */
static inline __attribute__((always_inline)) void int8_tile2(const float *xf, int64_t kpad, const int8_t *q,
                                                             int64_t ldq, int64_t k, float *res, const int R,
                                                             const int MT) {
    __m256 lo[4], hi[4];
#pragma GCC unroll 4
    for (int t = 0; t < R * MT; t++) lo[t] = hi[t] = _mm256_setzero_ps();
    int8_t tail[4][LANES] __attribute__((aligned(16)));
    int64_t i = 0;
    for (; i < k; i += LANES) {
        const int8_t *qr[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            qr[r] = q + r * ldq + i;
            if (i + LANES > k) { /* zero codes against zero-padded x add +0 to every lane (acc is never -0) */
                memset(tail[r], 0, LANES);
                memcpy(tail[r], qr[r], (size_t)(k - i));
                qr[r] = tail[r];
            } else if ((i & 63) == 0) {
                _mm_prefetch((const char *)(q + (r + I8_AHEAD) * ldq + i), _MM_HINT_T1);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256 w0 = int8_8(qr[r]), w1 = int8_8(qr[r] + 8);
#pragma GCC unroll 4
            for (int m = 0; m < MT; m++) {
                lo[r * MT + m] = _mm256_fmadd_ps(_mm256_load_ps(xf + m * kpad + i), w0, lo[r * MT + m]);
                hi[r * MT + m] = _mm256_fmadd_ps(_mm256_load_ps(xf + m * kpad + i + 8), w1, hi[r * MT + m]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++) res[m * R + r] = tree256(lo[r * MT + m], hi[r * MT + m]);
}
#endif

#if !defined(QG_AVX512) && !defined(QG_AVX2)
/* Portable: the same lanes, products and sums in plain C. */
static void int8_tile_c(const float *xf, int64_t kpad, int mt_count, const int8_t *q, int64_t ldq, int64_t k,
                        float *res, int r_count) {
    for (int r = 0; r < r_count; r++)
        for (int m = 0; m < mt_count; m++) {
            float acc[LANES] = {0};
            const float *xr = xf + m * kpad;
            const int8_t *qr = q + r * ldq;
            int64_t i = 0;
            for (; i + LANES <= k; i += LANES)
                for (int j = 0; j < LANES; j++) acc[j] = acc[j] + xr[i + j] * (float)qr[i + j];
            for (int j = 0; i + j < k; j++) acc[j] = acc[j] + xr[i + j] * (float)qr[i + j];
            res[m * r_count + r] = tree(acc);
        }
}
#endif

#define I8_ROWS 8 /* weight rows per step at M = 1 (4 with more rows of x: 16 accumulators) */

/* out[m, n] (stride ldo) for rows n in [n0, n1): all rows of x, in tiles of MTILE. */
static void int8_rows(const float *xf, int64_t kpad, int64_t m_count, const int8_t *q, int64_t k,
                      const uint16_t *scales, uint16_t *out, int64_t ldo, int64_t n0, int64_t n1) {
    float res[I8_ROWS * MTILE];
    for (int64_t m0 = 0; m0 < m_count; m0 += MTILE) {
        const int mt = m_count - m0 < MTILE ? (int)(m_count - m0) : MTILE;
        const float *xt = xf + m0 * kpad;
        const int rows = mt == 1 ? 8 : 4;
        for (int64_t n = n0; n < n1;) {
            const int r = n1 - n >= rows ? rows : 1;
            const int8_t *qn = q + n * k;
#ifdef QG_AVX512
            if (r == 8) int8_tile(xt, kpad, 1, qn, k, k, res, 8, 1);
            else if (r == 4 && mt == 4) int8_tile(xt, kpad, 4, qn, k, k, res, 4, 4);
            else if (r == 4 && mt == 3) int8_tile(xt, kpad, 3, qn, k, k, res, 4, 3);
            else if (r == 4 && mt == 2) int8_tile(xt, kpad, 2, qn, k, k, res, 4, 2);
            else if (mt == 1) int8_tile(xt, kpad, 1, qn, k, k, res, 1, 1);
            else if (mt == 2) int8_tile(xt, kpad, 2, qn, k, k, res, 1, 2);
            else if (mt == 3) int8_tile(xt, kpad, 3, qn, k, k, res, 1, 3);
            else int8_tile(xt, kpad, 4, qn, k, k, res, 1, 4);
#elif defined(QG_AVX2)
            if (r == 8) { /* M = 1: two tiles of 4 rows */
                int8_tile2(xt, kpad, qn, k, k, res, 4, 1);
                int8_tile2(xt, kpad, qn + 4 * k, k, k, res + 4, 4, 1);
            } else if (r == 4 && mt == 4) {
                for (int h = 0; h < 4; h += 2) { /* rows of x h, h+1 against the 4 weight rows, 2 at a time */
                    float part[4];
                    for (int rr = 0; rr < 4; rr += 2) {
                        int8_tile2(xt + h * kpad, kpad, qn + rr * k, k, k, part, 2, 2);
                        res[h * 4 + rr] = part[0], res[h * 4 + rr + 1] = part[1];
                        res[(h + 1) * 4 + rr] = part[2], res[(h + 1) * 4 + rr + 1] = part[3];
                    }
                }
            } else {
                for (int m = 0; m < mt; m++) { /* one row of x against r weight rows, up to 4 at a time */
                    float part[4];
                    for (int rr = 0; rr < r; rr += 4) {
                        const int c = r - rr < 4 ? r - rr : 4;
                        if (c == 4) int8_tile2(xt + m * kpad, kpad, qn + rr * k, k, k, part, 4, 1);
                        else if (c == 1) int8_tile2(xt + m * kpad, kpad, qn + rr * k, k, k, part, 1, 1);
                        else for (int e = 0; e < c; e++) int8_tile2(xt + m * kpad, kpad, qn + (rr + e) * k, k, k, part + e, 1, 1);
                        for (int e = 0; e < c; e++) res[m * r + rr + e] = part[e];
                    }
                }
            }
#else
            int8_tile_c(xt, kpad, mt, qn, k, k, res, r);
#endif
            for (int rr = 0; rr < r; rr++) {
                const float s = bf(scales[n + rr]);
                for (int m = 0; m < mt; m++) out[(m0 + m) * ldo + n + rr] = rne(res[m * r + rr] * s);
            }
            n += r;
        }
    }
}

#if defined(QG_AVX512) && defined(__AVX512BF16__)
/* Batches (M >= I8B_MIN_M) with AVX512-BF16 dot products, the same bits as int8_tile: x and the weight are
   held as "lane pairs", dword j of 32-column block t holding column 32t + j in its high word and column
   32t + 16 + j in its low word. vdpbf16ps adds the high word's product first, so lane j adds the
   products of columns j, j + 16, j + 32, ... in that order, each exact (bf16 x times an integer of at
   most 8 bits) and each sum rounded once: int8_tile's 16 FMA lanes, at twice the multiply-adds per
   instruction (vdpbf16ps also flushes subnormal inputs and sums to zero, where the FMAs do not).
   Each weight row is converted once per call into a buffer that all rows of x then read, where
   int8_tile converts it again for every 4 rows of x; so batches of 8-32 rows are no longer bound by
   the FMAs: Qwen2.5-0.5B matrices at M = 8-32 went from 0.46-0.68x to 0.61-0.87x a prepacked bf16
   GEMM (1.1-1.2x faster than int8_tile at M = 5, 1.5-1.6x at M = 32), and at M = 128 (prefill)
   0.77-0.90x (benchmarks/bench_qmatmul.py). */
#ifndef I8B_MIN_M
#define I8B_MIN_M 5 /* rows of x from which the lane-pair path runs */
#endif
#define I8B_R 4     /* weight rows per tile */
#define I8B_MT 6    /* rows of x per tile: 24 accumulators */

/* x bf16 [M, K] -> lane pairs [M, nb * 16] dwords (nb = ceil(K / 32)), zero past K. */
static uint32_t *lane_pairs(const uint16_t *x, int64_t ldx, int64_t m_count, int64_t k, int64_t nb) {
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

/* 32 codes of one row (columns 32t..32t+31, masked) -> lane pairs of bf16(q) (exact). */
static inline __m512i int8_lane_words(const int8_t *p, __mmask32 mk) {
    const __m256i b = _mm256_maskz_loadu_epi8(mk, p);
    const __m512i a = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b))));
    const __m512i c = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1))));
    return _mm512_ternarylogic_epi32(_mm512_set1_epi32((int)0xffff0000u), a, _mm512_srli_epi32(c, 16), 0xCA);
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
static inline __attribute__((always_inline)) void int8_lane_tile(const uint32_t *xs, int64_t nb, const __m512i *wb,
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

/* int8_lane_tile for mt = 1..I8B_MT rows of x, each a constant (the accumulators stay in registers) */
static void lane_tile(const uint32_t *xt, int64_t nb, const __m512i *wb, float *res, int mt) {
    switch (mt) {
    case 1: int8_lane_tile(xt, nb, wb, res, 1); break;
    case 2: int8_lane_tile(xt, nb, wb, res, 2); break;
    case 3: int8_lane_tile(xt, nb, wb, res, 3); break;
    case 4: int8_lane_tile(xt, nb, wb, res, 4); break;
    case 5: int8_lane_tile(xt, nb, wb, res, 5); break;
    default: int8_lane_tile(xt, nb, wb, res, 6); break;
    }
}

/* Batches on lane pairs: weight rows n in [n0, n1) against all rows of x (xs, lane_pairs), I8B_R weight rows at a
   time turned into lane pairs once (wb: nb * I8B_R vectors of scratch) for every tile of x rows. The weight is
   int8 codes (bf16 == 0: rows of k, out = bf16(sum * scale)) or bf16 (bf16 == 1: rows ldw apart, out = bf16(sum),
   scales unused); rows ahead prefetched into L2, one 64-byte line each (int8: every other block). */
static void rows_lanes(const uint32_t *xs, int64_t nb, int64_t m_count, const void *w, int bf16, int64_t ldw,
                       int64_t k, const uint16_t *scales, qout out, int64_t n0, int64_t n1,
                       __m512i *wb) {
    /* bf16: word 2j of a block's pair vector = column 16 + j (low), word 2j + 1 = column j (high) */
    const __m512i perm = _mm512_set_epi16(15, 31, 14, 30, 13, 29, 12, 28, 11, 27, 10, 26, 9, 25, 8, 24,
                                          7, 23, 6, 22, 5, 21, 4, 20, 3, 19, 2, 18, 1, 17, 0, 16);
    const int64_t ahead = bf16 ? BF_AHEAD : I8_AHEAD, es = bf16 ? 2 : 1;
    float res[I8B_MT * I8B_R];
    for (int64_t n = n0; n < n1; n += I8B_R) {
        const int r = n1 - n < I8B_R ? (int)(n1 - n) : I8B_R;
        for (int64_t t = 0; t < nb; t++) {
            const int64_t kn = k - 32 * t < 32 ? k - 32 * t : 32;
            const __mmask32 mk = kn >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << kn) - 1);
            if (bf16 || (t & 1) == 0)
                for (int rr = 0; rr < I8B_R; rr++)
                    _mm_prefetch((const char *)w + ((n + rr + ahead) * ldw + 32 * t) * es, _MM_HINT_T1);
            for (int rr = 0; rr < I8B_R; rr++) {
                const int64_t at = (n + rr) * ldw + 32 * t;
                wb[t * I8B_R + rr] = rr >= r ? _mm512_setzero_si512()
                                   : bf16 ? _mm512_permutexvar_epi16(perm, _mm512_maskz_loadu_epi16(mk, (const uint16_t *)w + at))
                                          : int8_lane_words((const int8_t *)w + at, mk);
            }
        }
        for (int64_t m0 = 0; m0 < m_count; m0 += I8B_MT) {
            const int mt = m_count - m0 < I8B_MT ? (int)(m_count - m0) : I8B_MT;
            lane_tile(xs + m0 * nb * 16, nb, wb, res, mt);
            for (int rr = 0; rr < r; rr++) {
                const float s = bf16 ? 1.0f : bf(scales[n + rr]);
                for (int m = 0; m < mt; m++)
                    put1(out, m0 + m, n + rr, bf16 ? res[m * I8B_R + rr] : res[m * I8B_R + rr] * s);
            }
        }
    }
}
#endif

/* x [M, K] bf16 (row stride ldx), q int8 [N, K] contiguous, scales bf16 [N] -> out [M, N] bf16 (row stride ldo). */
int llmsys_qgemv_int8(const uint16_t *x, int64_t ldx, const int8_t *q, const uint16_t *scales, uint16_t *out,
                      int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads) {
    if (m_count <= 0 || n <= 0 || k <= 0 || ldx < k || ldo < n) return 1;
#if defined(QG_AVX512) && defined(__AVX512BF16__)
    if (m_count >= I8B_MIN_M) {
        const int64_t nb = (k + 31) / 32, items = (n + 63) / 64;
        uint32_t *xs = lane_pairs(x, ldx, m_count, k, nb);
        if (!xs) return 2;
        int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1)
        {
            __m512i *wb = aligned_alloc(64, sizeof(__m512i) * (size_t)(nb * I8B_R));
            if (!wb) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(static)
            for (int64_t it = 0; it < items; it++)
                if (wb) rows_lanes(xs, nb, m_count, q, 0, k, k, scales, (qout){out, ldo, 0}, it * 64,
                                   it * 64 + 64 < n ? it * 64 + 64 : n, wb);
            free(wb);
        }
        free(xs);
        return failed ? 2 : 0;
    }
#endif
    const int64_t kpad = (k + LANES - 1) / LANES * LANES;
    float *xf = widen(x, ldx, m_count, k, kpad);
    if (!xf) return 2;
    const int64_t step = 64; /* rows per work item: a multiple of both row counts */
    const int64_t items = (n + step - 1) / step;
    const int par = threads > 1 && m_count * n * k >= PAR_MIN && items > 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
    for (int64_t it = 0; it < items; it++) {
        const int64_t n0 = it * step, n1 = n0 + step < n ? n0 + step : n;
        int8_rows(xf, kpad, m_count, q, k, scales, out, ldo, n0, n1);
    }
    free(xf);
    return 0;
}

/* ------------------------------------------------------------ int4 */

#if defined(QG_AVX512) && defined(__AVX512BF16__)
#define QG_BF16 1
#endif

/* One group's zero points and scales for the rows [row0, row0 + rows) of a block, rows past `rows`
   (padding) getting zero 0 and scale 0 (their sums are never written). zeros at z[n * z_n + g * z_g],
   scales at s[n * s_n + g * s_g]. */
typedef struct {
    const uint8_t *zeros;
    int64_t z_n, z_g;
    const void *scales;
    int64_t s_n, s_g;
    int kind;  /* scales: 0 bf16, 1 float32, 2 float16 */
    /* float32 offsets at [n * o_n + g * o_g], w = scale * q + offset (GGUF Q4_K / Q4_1: a float minimum per
       group), or NULL: integer zero points, w = scale * (q - zero). Only the a8 GEMV reads them. */
    const float *offs;
    int64_t o_n, o_g;
    /* GGUF Q4_K's scales as stored (instead of scales and offs): per 32 columns 6-bit sc and m (uint8
       [G, k_n] group-major), per 256 the fp16 d and dmin ([G / 8, k_n]); scale = d * sc, offset = -(dmin * m),
       the float32 products llama.cpp's dequantization computes. NULL: scales / offs as above. */
    const uint8_t *ksc, *km;
    const uint16_t *kd, *kdm;
    int64_t k_n;
} int4_meta;

static inline int has_offsets(const int4_meta *md) { return md->offs != NULL || md->ksc != NULL; }

/* bytes [from, from + len) of base into L1 (a prefetch per 64-byte line; a prefetch never faults) */
static inline void pf_span(const void *base, int64_t from, int64_t len) {
    for (int64_t l = 0; l < len; l += 64) __builtin_prefetch((const char *)base + from + l, 0, 3);
}

/* Group g's metadata of the 64-row block at row0 (the next block, called during this one) into the cache.
   Why: in the group-major arrays (Int4Linear's zeros_gm and scales, GGUF's scales) a block's rows of each
   group are their own short run of bytes, one run per group a block, which the hardware prefetchers do not
   follow: each was a miss to RAM in the decode GEMV, which streamed at ~2/3 of the RAM's read rate.
   Row-major arrays (row stride > 2) are one run a block, in address order: left to the hardware. */
static inline void meta_prefetch(const int4_meta *md, int64_t row0, int64_t g) {
    if (md->ksc) { /* Q4_K: uint8 sc / m [G, k_n], fp16 d / dmin [G / 8, k_n] */
        pf_span(md->ksc, g * md->k_n + row0, 64), pf_span(md->km, g * md->k_n + row0, 64);
        if (g % 8 == 0) pf_span(md->kd, 2 * ((g / 8) * md->k_n + row0), 128), pf_span(md->kdm, 2 * ((g / 8) * md->k_n + row0), 128);
        return;
    }
    if (md->z_n == 1 && !md->offs) pf_span(md->zeros, g * md->z_g + row0, 64);
    const int64_t es = md->kind == 1 ? 4 : 2;
    if (md->s_n <= 2) pf_span(md->scales, es * (g * md->s_g + row0 * md->s_n), 64 * es * md->s_n);
    if (md->offs && md->o_n == 1) pf_span(md->offs, 4 * (g * md->o_g + row0), 256);
}

static void meta_scalar(const int4_meta *md, int64_t row0, int64_t rows, int64_t g, float *zf, float *sf) {
    for (int64_t j = 0; j < 64; j++) {
        const int in = j < rows;
        zf[j] = in ? (float)md->zeros[(row0 + j) * md->z_n + g * md->z_g] : 0.0f;
        sf[j] = in ? load_scale(md->scales, (row0 + j) * md->s_n + g * md->s_g, md->kind) : 0.0f;
    }
}

#ifdef QG_AVX512
/* The same as vectors in row order: z[v], s[v] hold rows 16v .. 16v+15. Vector loads where the rows
   of a group lie contiguously (zeros with z_n = 1, Int4Linear's group-major copy; bf16 scales with
   s_n = 2, a view into its scales_zeros [G, Np, 2]; or s_n = 1), else the scalar gather. */
static inline void meta_vec(const int4_meta *md, int64_t row0, int64_t rows, int64_t g, __m512i *z, __m512 *s) {
    const int vz = md->z_n == 1, vs = (md->kind == 0 && (md->s_n == 2 || md->s_n == 1)) || (md->kind != 0 && md->s_n == 1);
    float zf[64], sf[64];
    if (!vz || !vs) meta_scalar(md, row0, rows, g, zf, sf);
    for (int v = 0; v < 4; v++) {
        const int64_t left = rows - 16 * v;
        const __mmask16 m = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1u);
        const int64_t r = row0 + 16 * v;
        if (vz)
            z[v] = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, md->zeros + r + g * md->z_g));
        else
            z[v] = _mm512_cvtps_epi32(_mm512_loadu_ps(zf + 16 * v));
        if (!vs) {
            s[v] = _mm512_loadu_ps(sf + 16 * v);
        } else if (md->kind == 1) {
            s[v] = _mm512_maskz_loadu_ps(m, (const float *)md->scales + r + g * md->s_g);
        } else if (md->kind == 2) { /* fp16, group-major (GGUF Q4_0's scales): exact conversion */
            s[v] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)md->scales + r + g * md->s_g));
        } else if (md->s_n == 2) { /* dwords (scale, other): the scale is the low half */
            const __m512i d = _mm512_maskz_loadu_epi32(m, (const uint16_t *)md->scales + 2 * r + g * md->s_g);
            s[v] = _mm512_castsi512_ps(_mm512_slli_epi32(d, 16));
        } else {
            const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)md->scales + r + g * md->s_g);
            s[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
    }
}
#endif

#ifdef QG_BF16
/* The AVX512-BF16 path keeps lane i of its accumulator v (0..3) for this row of the 64-row block:
   lanes of the byte unpacks (_mm256_unpacklo/hi_epi8 work per 128-bit half). */
static inline int slot_row(int slot) {
    const int v = slot / 16, i = slot % 16;
    return (v >= 2 ? 32 : 0) + ((v & 1) ? (i < 8 ? i + 8 : i + 16) : (i < 8 ? i : i + 8));
}

/* Row-order vectors r[0..3] -> slot order (see slot_row). */
static inline void to_slots(__m512i *r) {
    const __m512i a = _mm512_shuffle_i64x2(r[0], r[1], 0x44), b = _mm512_shuffle_i64x2(r[0], r[1], 0xEE);
    const __m512i c = _mm512_shuffle_i64x2(r[2], r[3], 0x44), d = _mm512_shuffle_i64x2(r[2], r[3], 0xEE);
    r[0] = a, r[1] = b, r[2] = c, r[3] = d;
}

/* One group of one 64-row block, MT rows of x (xs: bf16 pairs, see llmsys_qgemv_int4): per column pair
   (c, c+1), the codes of both columns are interleaved into words (column c+1 low, c high), nibbles
   become table indices q - zero + 16 and vpermw looks up bf16(q - zero) (exact); vdpbf16ps then adds
   x[c] * w[c] and then x[c+1] * w[c+1] to each float lane, two roundings, in order of k: the
   definition's sum (measured on Zen 4; Intel documents the same order, odd element first). It treats
   subnormal x and sums as zero, the one difference from the definition. zz: 16 - zero in both words. */
/* The words of columns c, c+1 (codes at p: column c's 32 bytes, then column c+1's) for the 64 rows of a
   block, in slot order (see slot_row): w[v] word 2i+1 = bf16(q[c] - zero), word 2i = bf16(q[c+1] - zero)
   (exact). zz: 16 - zero in both words of each dword; tbl: bf16(i - 16). */
static inline __attribute__((always_inline)) void int4_pair_words(const uint8_t *p, const __m512i *zz, __m512i tbl,
                                                                  __m512i *w) {
    const __m512i lo4 = _mm512_set1_epi16(15);
    const __m256i b0 = _mm256_loadu_si256((const __m256i *)p);
    const __m256i b1 = _mm256_loadu_si256((const __m256i *)(p + 32));
    const __m512i ulo = _mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(b1, b0));
    const __m512i uhi = _mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(b1, b0));
    w[0] = _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_and_si512(ulo, lo4), zz[0]), tbl);
    w[1] = _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_and_si512(uhi, lo4), zz[1]), tbl);
    w[2] = _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_srli_epi16(ulo, 4), zz[2]), tbl);
    w[3] = _mm512_permutexvar_epi16(_mm512_add_epi16(_mm512_srli_epi16(uhi, 4), zz[3]), tbl);
}

static inline __attribute__((always_inline)) void int4_group_bf16(const uint32_t *xs, int64_t xstride,
                                                                  const uint8_t *p, int64_t gs, const __m512i *zz,
                                                                  __m512i tbl, __m512 a[MTILE][4], const int MT) {
    for (int m = 0; m < MT; m++)
        for (int v = 0; v < 4; v++) a[m][v] = _mm512_setzero_ps();
    for (int64_t c = 0; c < gs; c += 2) {
        __m512i w[4];
        int4_pair_words(p + c * 32, zz, tbl, w);
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++) {
            const __m512i xv = _mm512_set1_epi32((int)xs[m * xstride + c / 2]);
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) a[m][v] = _mm512_dpbf16_ps(a[m][v], (__m512bh)w[v], (__m512bh)xv);
        }
    }
}
#else
static inline int slot_row(int slot) { return slot; }
#endif

#ifdef QG_BF16
/* x bf16 [M, K] (row stride ldx) -> pairs [M, np]: word 0 = x[2i+1], word 1 = x[2i] (vdpbf16ps adds
   the high word's product first, so the sum runs in order of k), zero past K. Rows in parallel. */
static uint32_t *pairs(const uint16_t *x, int64_t ldx, int64_t m_count, int64_t k, int64_t np, int threads) {
    uint32_t *xw = aligned_alloc(64, (sizeof(uint32_t) * (size_t)(m_count * np + 16) + 63) / 64 * 64);
    if (!xw) return NULL;
    const int64_t full = k / 32 * 16; /* pairs filled 16 at a time from 32 values */
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && m_count * np >= PAR_MIN)
    for (int64_t m = 0; m < m_count; m++) {
        const uint16_t *xr = x + m * ldx;
        uint32_t *o = xw + m * np;
        for (int64_t i = 0; i < full; i += 16)
            _mm512_storeu_si512(o + i, _mm512_rol_epi32(_mm512_loadu_si512(xr + 2 * i), 16));
        for (int64_t i = full; i < np; i++) {
            const uint32_t lo = 2 * i + 1 < k ? xr[2 * i + 1] : 0, hi = 2 * i < k ? xr[2 * i] : 0;
            o[i] = lo | hi << 16;
        }
    }
    return xw;
}
#endif

#ifdef QG_AVX2
/* One group of one 64-row block against mt (<= MTILE) rows of x, AVX2: acc[m][j] += a_g[j] * scale[j] with
   a_g[j] = sum over the group's columns c of x[m, c] * (q[j, c] - zero[j]), in order of c, exactly the
   portable loop's arithmetic ((q - zero) is exact by the 2^23 trick, the product x * (q - zero) is exact,
   so the FMA rounds only the sum). A half-block (32 rows: the low or the high nibbles) at a time, two
   rows of x per pass: 8 accumulators and 4 decoded weight vectors stay in the 16 ymm registers. */
static inline __attribute__((always_inline)) void int4_half_avx2(const float *x0, const float *x1, const uint8_t *p,
                                                                  int64_t gs, int h, const __m256 *z, __m256 (*a)[4],
                                                                  const int MT) {
    const __m256i magic_i = _mm256_castps_si256(_mm256_set1_ps(8388608.0f)), low4 = _mm256_set1_epi8(15);
    for (int64_t c = 0; c < gs; c++) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(p + c * 32));
        b = _mm256_and_si256(h ? _mm256_srli_epi16(b, 4) : b, low4); /* rows 32h + 0..31 */
        const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
        const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        const __m256 xv0 = _mm256_set1_ps(x0[c]), xv1 = _mm256_set1_ps(x1[c]);
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            const __m256 w = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_cvtepu8_epi32(part[v]), magic_i)), z[v]);
            a[0][v] = _mm256_fmadd_ps(xv0, w, a[0][v]);
            if (MT == 2) a[1][v] = _mm256_fmadd_ps(xv1, w, a[1][v]);
        }
    }
}

static void int4_group_avx2(const float *xg, int64_t kp, int mt, const uint8_t *p, int64_t gs, const float *zf,
                            const float *sf, float (*acc)[64]) {
    const __m256 magic = _mm256_set1_ps(8388608.0f); /* 2^23: (2^23 + q) - (2^23 + zero) = q - zero */
    for (int h = 0; h < 2; h++) {
        __m256 z[4];
        for (int v = 0; v < 4; v++) z[v] = _mm256_add_ps(magic, _mm256_load_ps(zf + 32 * h + 8 * v));
        for (int m = 0; m < mt; m += 2) {
            const int two = mt - m >= 2;
            __m256 a[2][4];
            for (int v = 0; v < 4; v++) a[0][v] = a[1][v] = _mm256_setzero_ps();
            const float *x0 = xg + m * kp, *x1 = xg + (m + two) * kp;
            if (two) int4_half_avx2(x0, x1, p, gs, h, z, a, 2);
            else int4_half_avx2(x0, x1, p, gs, h, z, a, 1);
            for (int r = 0; r <= two; r++)
                for (int v = 0; v < 4; v++) { /* acc = acc + a_g * scale: product rounded, then added */
                    float *dst = acc[m + r] + 32 * h + 8 * v;
                    const __m256 prod = _mm256_mul_ps(a[r][v], _mm256_load_ps(sf + 32 * h + 8 * v));
                    _mm256_store_ps(dst, _mm256_add_ps(_mm256_load_ps(dst), prod));
                }
        }
    }
}
#endif

/* One 64-row block (rows row0.., n < n_rows), all rows of x: writes out[m, row0 + j].
   x: float rows of width kp (xf), or with AVX512-BF16 pairs of bf16 (xs, kp / 2 per row). */
static void int4_block(const void *x, int64_t kp, int64_t m_count, const uint8_t *blk, const int4_meta *md,
                       int64_t n_groups, int64_t gs, int64_t row0, int64_t n_rows, uint16_t *out, int64_t ldo) {
    const int64_t rows = n_rows - row0 < 64 ? n_rows - row0 : 64;
    float acc[MTILE][64] __attribute__((aligned(64)));  /* per accumulator slot (slot_row) */
#ifdef QG_BF16
    uint16_t t[32];
    for (int i = 0; i < 32; i++) t[i] = rne((float)(i - 16));
    const __m512i tbl = _mm512_loadu_si512(t); /* bf16(i - 16) */
#endif
    for (int64_t m0 = 0; m0 < m_count; m0 += MTILE) {
        const int mt = m_count - m0 < MTILE ? (int)(m_count - m0) : MTILE;
        for (int m = 0; m < mt; m++)
            for (int j = 0; j < 64; j++) acc[m][j] = 0.0f;
        for (int64_t g = 0; g < n_groups; g++) {
            const uint8_t *p = blk + g * gs * 32;
#ifdef QG_AVX512
            __m512i zi[4];
            __m512 sv[4];
            meta_vec(md, row0, rows, g, zi, sv);
            __m512 a[MTILE][4];
#endif
#ifdef QG_BF16
            __m512i *svi = (__m512i *)sv;
            for (int v = 0; v < 4; v++) {
                const __m512i w = _mm512_sub_epi32(_mm512_set1_epi32(16), zi[v]);
                zi[v] = _mm512_or_si512(w, _mm512_slli_epi32(w, 16));
                svi[v] = _mm512_castps_si512(sv[v]);
            }
            to_slots(zi);
            to_slots(svi);
            const uint32_t *xs = (const uint32_t *)x + m0 * (kp / 2) + g * gs / 2;
            switch (mt) {
            case 1: int4_group_bf16(xs, kp / 2, p, gs, zi, tbl, a, 1); break;
            case 2: int4_group_bf16(xs, kp / 2, p, gs, zi, tbl, a, 2); break;
            case 3: int4_group_bf16(xs, kp / 2, p, gs, zi, tbl, a, 3); break;
            default: int4_group_bf16(xs, kp / 2, p, gs, zi, tbl, a, 4); break;
            }
#elif defined(QG_AVX512)
            const float *xg = (const float *)x + m0 * kp + g * gs;
            const __m512 magic = _mm512_set1_ps(8388608.0f); /* 2^23 */
            const __m512i magic_i = _mm512_castps_si512(magic);
            __m512 z[4];
            for (int v = 0; v < 4; v++) z[v] = _mm512_add_ps(magic, _mm512_cvtepi32_ps(zi[v])); /* 2^23 + zero */
            for (int m = 0; m < MTILE; m++)
                for (int v = 0; v < 4; v++) a[m][v] = _mm512_setzero_ps();
#define INT4_STEP(MT)                                                                                          \
    for (int64_t c = 0; c < gs; c++) {                                                                         \
        const __m512i d0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + c * 32)));               \
        const __m512i d1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + c * 32 + 16)));          \
        __m512 w[4];                                                                                           \
        w[0] = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_ternarylogic_epi32(d0, _mm512_set1_epi32(15), magic_i, 0xEA)), z[0]); \
        w[1] = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_ternarylogic_epi32(d1, _mm512_set1_epi32(15), magic_i, 0xEA)), z[1]); \
        w[2] = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_srli_epi32(d0, 4), magic_i)), z[2]);  \
        w[3] = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_srli_epi32(d1, 4), magic_i)), z[3]);  \
        _Pragma("GCC unroll 4") for (int m = 0; m < MT; m++) {                                                 \
            const __m512 xv = _mm512_set1_ps(xg[m * kp + c]);                                                  \
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) a[m][v] = _mm512_fmadd_ps(xv, w[v], a[m][v]); \
        }                                                                                                      \
    }
            switch (mt) {
            case 1: INT4_STEP(1) break;
            case 2: INT4_STEP(2) break;
            case 3: INT4_STEP(3) break;
            default: INT4_STEP(4) break;
            }
#undef INT4_STEP
#endif
#ifdef QG_AVX512
            for (int m = 0; m < mt; m++)
                for (int v = 0; v < 4; v++) { /* acc = acc + a_g * scale: product rounded, then added */
                    const __m512 prod = _mm512_mul_ps(a[m][v], sv[v]);
                    _mm512_store_ps(acc[m] + 16 * v, _mm512_add_ps(_mm512_load_ps(acc[m] + 16 * v), prod));
                }
#elif defined(QG_AVX2)
            float zf[64] __attribute__((aligned(32))), sf[64] __attribute__((aligned(32)));
            meta_scalar(md, row0, rows, g, zf, sf);
            const float *xg = (const float *)x + m0 * kp + g * gs;
            int4_group_avx2(xg, kp, mt, p, gs, zf, sf, acc);
#else
            float zf[64], sf[64];
            meta_scalar(md, row0, rows, g, zf, sf);
            const float *xg = (const float *)x + m0 * kp + g * gs;
            for (int m = 0; m < mt; m++) {
                float a[64];
                for (int j = 0; j < 64; j++) a[j] = 0.0f;
                for (int64_t c = 0; c < gs; c++) {
                    const float xv = xg[m * kp + c];
                    const uint8_t *pc = p + c * 32;
                    for (int j = 0; j < 32; j++) {
                        a[j] = a[j] + xv * ((float)(pc[j] & 15) - zf[j]);
                        a[j + 32] = a[j + 32] + xv * ((float)(pc[j] >> 4) - zf[j + 32]);
                    }
                }
                for (int j = 0; j < 64; j++) acc[m][j] = acc[m][j] + a[j] * sf[j];
            }
#endif
        }
        for (int m = 0; m < mt; m++)
            for (int slot = 0; slot < 64; slot++) {
                const int64_t j = slot_row(slot);
                if (j < rows) out[(m0 + m) * ldo + row0 + j] = rne(acc[m][slot]);
            }
    }
}

/* x [M, K] bf16 (row stride ldx); packed: the CPU int4 tiling of [Np, Kp]; zeros uint8 read at
 * zeros[n * z_n + g * z_g]; scales at scales[n * s_n + g * s_g] (scale_kind 0 bf16, 1 f32, 2 f16)
 * -> out [M, N] bf16 (row stride ldo). */
int llmsys_qgemv_int4(const uint16_t *x, int64_t ldx, const uint8_t *packed, const void *scales, int64_t s_n,
                      int64_t s_g, int scale_kind, const uint8_t *zeros, int64_t z_n, int64_t z_g, uint16_t *out,
                      int64_t ldo, int64_t m_count, int64_t n, int64_t kp, int64_t k, int64_t gs, int threads) {
    if (m_count <= 0 || n <= 0 || gs % 32 || gs > 128 || kp % gs || k <= kp - gs || k > kp || ldx < k || ldo < n)
        return 1;
    const int4_meta md = {zeros, z_n, z_g, scales, s_n, s_g, scale_kind, NULL, 0, 0, NULL, NULL, NULL, NULL, 0};
#ifdef QG_BF16
    uint32_t *xw = pairs(x, ldx, m_count, k, kp / 2, threads);
    if (!xw) return 2;
    const void *xin = xw;
#else
    float *xw = widen(x, ldx, m_count, k, kp);
    if (!xw) return 2;
    const void *xin = xw;
#endif
    const int64_t blocks = (n + 63) / 64, n_groups = kp / gs;
    const int par = threads > 1 && m_count * n * kp >= PAR_MIN && blocks > 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
    for (int64_t b = 0; b < blocks; b++)
        int4_block(xin, kp, m_count, packed + b * kp * 32, &md, n_groups, gs, b * 64, n, out, ldo);
    free(xw);
    return 0;
}

/* ------------------------------------------------------------ prefill GEMM
 *
 * int4 at prefill sizes: the GEMV's loop order (each MTILE rows of x decode the block's codes afresh)
 * spends most of its time decoding. The GEMM decodes each (64-row block, group) of the weight once into
 * words W (the GEMV's bf16(q - zero) pairs), small enough for L1, and runs every row of x against them,
 * GM_MT rows at a time (4 x GM_MT float accumulators). It forms the GEMV's sums in the GEMV's order (a
 * group's a_g from zero, then acc + a_g * scale), so llmsys_qgemm_int4 equals llmsys_qgemv_int4 bit for
 * bit: prefill and decode give the same bits, and either may run for any M. Needs AVX512-BF16
 * (llmsys_qgemm_native); other builds run the GEMV's loop. (int8 needs no GEMM: its lane-pair GEMV,
 * rows_lanes, already converts each weight row once per call.)
 */
#define GM_MT 6      /* rows of x per tile: 24 accumulators, 4 weight vectors, 1 broadcast */
#ifndef GM_MB
#define GM_MB 128
#endif

int llmsys_qgemm_native(void) {
#ifdef QG_BF16
    return 1;
#else
    return 0;
#endif
}

#ifdef QG_BF16
/* acc[m][slot] = acc + a * s[slot / 16] for MT rows of x, a = the sum over cp pairs of x . W (in order). */
static inline __attribute__((always_inline)) void gm_tile(const uint32_t *xs, int64_t xstride, const __m512i *W,
                                                          int64_t cp, const __m512 *s, float *acc, const int MT) {
    __m512 a[GM_MT][4];
#pragma GCC unroll 6
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) a[m][v] = _mm512_setzero_ps();
    for (int64_t c = 0; c < cp; c++) {
        const __m512i w0 = _mm512_load_si512(W + 4 * c), w1 = _mm512_load_si512(W + 4 * c + 1);
        const __m512i w2 = _mm512_load_si512(W + 4 * c + 2), w3 = _mm512_load_si512(W + 4 * c + 3);
#pragma GCC unroll 6
        for (int m = 0; m < MT; m++) {
            const __m512i xv = _mm512_set1_epi32((int)xs[m * xstride + c]);
            a[m][0] = _mm512_dpbf16_ps(a[m][0], (__m512bh)w0, (__m512bh)xv);
            a[m][1] = _mm512_dpbf16_ps(a[m][1], (__m512bh)w1, (__m512bh)xv);
            a[m][2] = _mm512_dpbf16_ps(a[m][2], (__m512bh)w2, (__m512bh)xv);
            a[m][3] = _mm512_dpbf16_ps(a[m][3], (__m512bh)w3, (__m512bh)xv);
        }
    }
#pragma GCC unroll 6
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            float *o = acc + m * 64 + 16 * v;
            _mm512_store_ps(o, _mm512_add_ps(_mm512_load_ps(o), _mm512_mul_ps(a[m][v], s[v])));
        }
}

/* gm_tile over all m_count rows of x (xs: row m at xs + m * xstride). */
static void gm_rows(const uint32_t *xs, int64_t xstride, int64_t m_count, const __m512i *W, int64_t cp,
                    const __m512 *s, float *acc) {
    int64_t m0 = 0;
    for (; m0 + GM_MT <= m_count; m0 += GM_MT) gm_tile(xs + m0 * xstride, xstride, W, cp, s, acc + m0 * 64, GM_MT);
    const uint32_t *xt = xs + m0 * xstride;
    float *at = acc + m0 * 64;
    switch (m_count - m0) {
    case 1: gm_tile(xt, xstride, W, cp, s, at, 1); break;
    case 2: gm_tile(xt, xstride, W, cp, s, at, 2); break;
    case 3: gm_tile(xt, xstride, W, cp, s, at, 3); break;
    case 4: gm_tile(xt, xstride, W, cp, s, at, 4); break;
    case 5: gm_tile(xt, xstride, W, cp, s, at, 5); break;
    default: break;
    }
}

/* Prefetch bytes [from, from + len) of the next block's weight (starting at `next`, stopping at `end`)
   into L2 while this block computes (a 64-row block is read one group at a time; in an int8 GEMM of
   the same design, since removed, it took 9728 x 896 at M = 128 from 0.81x to 0.90x a bf16 GEMM). */
static inline void prefetch_share(const char *next, const char *end, int64_t from, int64_t len) {
    for (const char *p = next + from; p < next + from + len && p < end; p += 64) _mm_prefetch(p, _MM_HINT_T1);
}

static void int4_gemm_block(const uint32_t *xs, int64_t kp, int64_t m_count, const uint8_t *blk, const uint8_t *wend,
                            const int4_meta *md, int64_t n_groups, int64_t gs, int64_t row0, int64_t n_rows,
                            uint16_t *out, int64_t ldo, float *acc, __m512i *W) {
    const int64_t rows = n_rows - row0 < 64 ? n_rows - row0 : 64;
    uint16_t t[32];
    for (int i = 0; i < 32; i++) t[i] = rne((float)(i - 16));
    const __m512i tbl = _mm512_loadu_si512(t); /* bf16(i - 16) */
    memset(acc, 0, sizeof(float) * (size_t)(m_count * 64));
    for (int64_t g = 0; g < n_groups; g++) {
        __m512i zi[4];
        __m512 sv[4];
        meta_vec(md, row0, rows, g, zi, sv);
        __m512i *svi = (__m512i *)sv;
        for (int v = 0; v < 4; v++) {
            const __m512i w = _mm512_sub_epi32(_mm512_set1_epi32(16), zi[v]);
            zi[v] = _mm512_or_si512(w, _mm512_slli_epi32(w, 16));
        }
        to_slots(zi);
        to_slots(svi);
        const uint8_t *p = blk + g * gs * 32;
        prefetch_share((const char *)blk + kp * 32, (const char *)wend, g * gs * 32, gs * 32);
        for (int64_t c = 0; c < gs; c += 2) int4_pair_words(p + c * 32, zi, tbl, W + 2 * c);
        gm_rows(xs + g * gs / 2, kp / 2, m_count, W, gs / 2, sv, acc);
    }
    for (int64_t m = 0; m < m_count; m++) {
        __m512i r[4];
        for (int v = 0; v < 4; v++) r[v] = _mm512_castps_si512(_mm512_load_ps(acc + m * 64 + 16 * v));
        to_slots(r); /* its own inverse: slot order -> row order */
        store_rows(out + m * ldo + row0, (const __m512 *)r, rows);
    }
}
#endif

/* The int4 product of llmsys_qgemv_int4 (same arguments, same bits), in the GEMM's loop order: work
   items (64-row block, up to GM_MB rows of x) over threads, each thread with its own accumulators and
   word buffer. */
int llmsys_qgemm_int4(const uint16_t *x, int64_t ldx, const uint8_t *packed, const void *scales, int64_t s_n,
                      int64_t s_g, int scale_kind, const uint8_t *zeros, int64_t z_n, int64_t z_g, uint16_t *out,
                      int64_t ldo, int64_t m_count, int64_t n, int64_t kp, int64_t k, int64_t gs, int threads) {
#ifndef QG_BF16
    return llmsys_qgemv_int4(x, ldx, packed, scales, s_n, s_g, scale_kind, zeros, z_n, z_g, out, ldo, m_count, n,
                             kp, k, gs, threads);
#else
    if (m_count <= 0 || n <= 0 || gs % 32 || gs > 128 || kp % gs || k <= kp - gs || k > kp || ldx < k || ldo < n)
        return 1;
    const int4_meta md = {zeros, z_n, z_g, scales, s_n, s_g, scale_kind, NULL, 0, 0, NULL, NULL, NULL, NULL, 0};
    uint32_t *xw = pairs(x, ldx, m_count, k, kp / 2, threads);
    if (!xw) return 2;
    const int64_t blocks = (n + 63) / 64, mblocks = (m_count + GM_MB - 1) / GM_MB, bytes = kp * 32;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && blocks * mblocks > 1)
    {
        float *acc = aligned_alloc(64, sizeof(float) * (size_t)((m_count < GM_MB ? m_count : GM_MB) * 64));
        __m512i *W = aligned_alloc(64, sizeof(__m512i) * (size_t)(2 * gs)); /* gs / 2 pairs x 4 vectors */
        if (!acc || !W) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t w = 0; w < blocks * mblocks; w++) {
            const int64_t b = w / mblocks, m0 = (w % mblocks) * GM_MB;
            const int64_t mc = m_count - m0 < GM_MB ? m_count - m0 : GM_MB;
            if (acc && W)
                int4_gemm_block(xw + m0 * (kp / 2), kp, mc, packed + b * bytes, packed + blocks * bytes, &md, kp / gs,
                                gs, b * 64, n, out + m0 * ldo, ldo, acc, W);
        }
        free(acc);
        free(W);
    }
    free(xw);
    return failed ? 2 : 0;
#endif
}

/* ------------------------------------------------------------ int8-activation GEMVs (a8)
 *
 * Decode on int8 and int4 weights with x quantized to int8 per 32-column block, as llama.cpp's CPU
 * backend does (its q8_0 activations). Why: the float paths above spend 4-6 instructions per 8
 * multiply-adds turning weight codes into floats (AVX2 int4: ~3 GB/s on Zen 3, far below the memory);
 * with both operands integer, vpmaddubsw/vpmaddwd do 32 multiply-adds in 2-4 instructions and the
 * weights stream at memory speed.
 *
 * Arithmetic (kernels/cpu_qgemv.py int8_a8_def / int4_a8_def, bit for bit; every sum of products
 * below is an exact integer, so no lane order enters and every ISA build gives the same bits):
 *   x block b of row m (columns 32b .. 32b+31, zero past K):
 *       amax = max |x|, d = amax / 127 (float32), id = d != 0 ? 1 / d : 0,
 *       qx = round-half-even(x * id) (|qx| <= 127), dx[b] = d, sx[b] = sum of qx
 *   int8: S_b = sum over the block of qx * q[n]            (exact int32)
 *         f = f + float(S_b) * dx[b], in order of b (product rounded, then added)
 *         out[m, n] = bf16(f * scale[n])
 *   int4: S_b = sum over the block of qx * q[n]; T_b = S_b - zero[n, g] * sx[b]   (exact, g = b's group)
 *         f = f + float(T_b) * (scale[n, g] * dx[b]), in order of b
 *         out[m, n] = bf16(f)
 *   int4 with float32 offsets (w = scale * q + offset: GGUF Q4_K / Q4_1, whose minimum per group is a float,
 *         not a multiple of the scale): f = f + (float(S_b) * (scale[n, g] * dx[b]) + float(sx[b]) * (offset[n, g] * dx[b]))
 * float(T_b) is exact (|T_b| < 2^24). The error against the float GEMVs is that of x's int8 rounding,
 * at most d / 2 per element (the perplexity figures in docs/benchmarks.md).
 *
 * How (AVX2, also in the AVX-512 builds): int8 takes 8 weight rows per block: |qx| times q with qx's
 * signs (vpsignb) in vpmaddubsw, vpmaddwd with ones to int32, the 8 rows' sums reduced by vphaddd.
 * int4 reads the CPU int4 tiling (32 bytes per column give 64 rows' codes) two columns at a time:
 * both columns' bytes interleaved by vpunpck{l,h}bw hold each row's (code k, code k+1) pair in their low
 * nibbles (row + 32's in the high ones), and
 * vpmaddubsw against the broadcast pair (qx_k, qx_k+1) gives every row's two products summed, added in
 * int16 for 8 column pairs (at most 8 * 2 * 15 * 127 < 2^15) and then widened.
 */

#define A8 32 /* columns per activation block */
/* io flags of the *_io entry points: x float32 (else bf16), out float32 unrounded (else bf16) */
#define IO_X_F32 1
#define IO_OUT_F32 2
#define A8_AHEAD 4096 /* int4: bytes of the tiling prefetched ahead (4 activation blocks) */

#if defined(__AVX2__)
#define QA8_AVX2 1
#include <immintrin.h>
#elif defined(__SSSE3__) && defined(__SSE4_1__)
#define QA8_SSSE3 1 /* the x86-64-v2 build (no AVX): int4's byte dot products with 128-bit pmaddubsw */
#include <smmintrin.h>
#endif
#if defined(QG_AVX512) && defined(__AVX512VNNI__)
#define QA8_VNNI 1 /* AVX512-VNNI (the x86-64-v4-bf16 build): vpdpbusd sums 4 byte products into an int32 lane */
#ifndef I8_VNNI_MIN_M
#define I8_VNNI_MIN_M 2 /* rows of x from which the int8 VNNI tile runs (one row: the AVX2 rows, cheaper there) */
#endif
#endif

typedef struct {
    int8_t *q;      /* [M, nb * 32] codes, zero past K (int16 pairs (code 2i, code 2i+1) for the int4 broadcasts) */
    int8_t *q4;     /* VNNI builds: q with each 4 codes' middle two swapped (int4's column quads), else NULL */
    uint8_t *qu;    /* VNNI builds: q + 128 as unsigned bytes (int8's vpdpbusd operand), else NULL */
    float *d;       /* [M, nb] block scales */
    int32_t *s;     /* [M, nb] sums of a block's codes */
    int64_t nb;
} a8_x;

static void a8_free(a8_x *a) { free(a->q); free(a->q4); free(a->qu); free(a->d); free(a->s); }

#ifdef QA8_AVX2
/* One full block of 32 bf16 values -> its codes qb, returning the scale d and the codes' sum (*sum): the scalar
   loop's operations lane by lane (abs, max ignoring NaN, v * (1 / d) rounded to nearest even, clamped to
   +-127, NaN -> 0), so the same bits. Why: the scalar loop cost ~7 cycles a value, ~0.15 ms for a 128 x 576
   prompt: ~20% of an int8 layer's GEMM at M = 128 once the GEMMs lost their output stalls (Zen 5). */
static inline float a8_block_avx2(const void *x, int xf32, int8_t *qb, int32_t *sum) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < 4; i++) {
        v[i] = xf32 ? _mm256_loadu_ps((const float *)x + 8 * i) : ops_bf8((const uint16_t *)x + 8 * i);
        amax = _mm256_max_ps(_mm256_and_ps(v[i], absm), amax); /* a NaN lane leaves amax (max's second operand) */
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float am = _mm_cvtss_f32(h), d = am / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256 idv = _mm256_set1_ps(id), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    __m256i c[4], tot = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 cl = _mm256_and_ps(_mm256_min_ps(_mm256_max_ps(r, lo), hi), _mm256_cmp_ps(r, r, _CMP_ORD_Q));
        c[i] = _mm256_cvtps_epi32(cl);
        tot = _mm256_add_epi32(tot, c[i]);
    }
    const __m256i w01 = _mm256_packs_epi32(c[0], c[1]), w23 = _mm256_packs_epi32(c[2], c[3]);
    const __m256i b8 = _mm256_packs_epi16(w01, w23); /* dwords in lane order 0, 2, 4, 6, 1, 3, 5, 7 */
    _mm256_storeu_si256((__m256i *)qb, _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(tot), _mm256_extracti128_si256(tot, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    *sum = _mm_cvtsi128_si32(t);
    return d;
}
#endif

/* x [M, K] bf16, or float32 with xf32 set (the LM head's input: the final norm's unrounded output, quantized as
   llama.cpp quantizes its float32 activations), row stride ldx -> int8 blocks (the arithmetic above). 0, or 2
   when out of memory. */
static int a8_quantize(const void *x, int64_t ldx, int xf32, int64_t m_count, int64_t k, int64_t nb, a8_x *a) {
    const size_t qbytes = (size_t)((m_count * nb * A8 + 63) / 64 * 64);
    a->nb = nb;
    a->q = aligned_alloc(64, qbytes);
    a->q4 = NULL, a->qu = NULL; /* only the VNNI paths read them */
#ifdef QA8_VNNI
    const int vnni = 1; /* int4 decodes one row of x with VNNI too; int8's qu costs a xor a block */
    a->q4 = aligned_alloc(64, qbytes), a->qu = aligned_alloc(64, qbytes);
#else
    const int vnni = 0;
#endif
    a->d = malloc(sizeof(float) * (size_t)(m_count * nb));
    a->s = malloc(sizeof(int32_t) * (size_t)(m_count * nb));
    if (!a->q || !a->d || !a->s || (vnni && (!a->q4 || !a->qu))) { a8_free(a); return 2; }
    for (int64_t m = 0; m < m_count; m++)
        for (int64_t b = 0; b < nb; b++) {
            int8_t *qb = a->q + (m * nb + b) * A8;
#ifdef QA8_AVX2
            if ((b + 1) * A8 <= k) { /* a full block */
                int32_t sum;
                a->d[m * nb + b] = a8_block_avx2(xf32 ? (const void *)((const float *)x + m * ldx + b * A8)
                                                      : (const void *)((const uint16_t *)x + m * ldx + b * A8), xf32, qb, &sum);
                a->s[m * nb + b] = sum;
                const __m256i qv = _mm256_loadu_si256((const __m256i *)qb);
                if (a->q4) /* (c, c+2, c+1, c+3) in each 4 */
                    _mm256_storeu_si256((__m256i *)(a->q4 + (m * nb + b) * A8),
                                        _mm256_shuffle_epi8(qv, _mm256_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15,
                                                                                 0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15)));
                if (a->qu)
                    _mm256_storeu_si256((__m256i *)(a->qu + (m * nb + b) * A8), _mm256_xor_si256(qv, _mm256_set1_epi8((char)0x80)));
                continue;
            }
#endif
            float v[A8], amax = 0.0f;
            for (int i = 0; i < A8; i++) {
                const int64_t c = b * A8 + i;
                v[i] = c >= k ? 0.0f : xf32 ? ((const float *)x)[m * ldx + c] : bf(((const uint16_t *)x)[m * ldx + c]);
                const float av = v[i] < 0.0f ? -v[i] : v[i];
                amax = av > amax ? av : amax;
            }
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int32_t sum = 0;
            for (int i = 0; i < A8; i++) {
                float r = nearbyintf(v[i] * id);
                r = r == r ? (r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r)) : 0.0f; /* NaN / inf x: bounded */
                qb[i] = (int8_t)r;
                sum += qb[i];
            }
            a->d[m * nb + b] = d;
            a->s[m * nb + b] = sum;
            if (a->q4) /* (c, c+2, c+1, c+3): the order int4_a8_block's unpacks leave a row's 4 codes in */
                for (int i = 0; i < A8; i += 4) {
                    int8_t *o = a->q4 + (m * nb + b) * A8 + i;
                    o[0] = qb[i], o[1] = qb[i + 2], o[2] = qb[i + 1], o[3] = qb[i + 3];
                }
            if (a->qu)
                for (int i = 0; i < A8; i++) a->qu[(m * nb + b) * A8 + i] = (uint8_t)(qb[i] + 128);
        }
    return 0;
}

/* exact int32 dot of one full block of codes (scalar; tails and the portable build) */
static inline int32_t dot_block_i8(const int8_t *qx, const int8_t *w, int64_t len) {
    int32_t s = 0;
    int64_t i = 0;
#ifdef QA8_SSSE3
    /* 16 bytes at a time, as the AVX2 code's dot32_i8: |x| times w with x's sign, pairs of int16 products
       summed to int32 (codes within +-127, so no saturation), the sum exact in any order */
    __m128i acc = _mm_setzero_si128();
    for (; i + 16 <= len; i += 16) {
        const __m128i xv = _mm_loadu_si128((const __m128i *)(qx + i)), wv = _mm_loadu_si128((const __m128i *)(w + i));
        acc = _mm_add_epi32(acc, _mm_madd_epi16(_mm_maddubs_epi16(_mm_sign_epi8(xv, xv), _mm_sign_epi8(wv, xv)),
                                                _mm_set1_epi16(1)));
    }
    acc = _mm_add_epi32(acc, _mm_srli_si128(acc, 8));
    acc = _mm_add_epi32(acc, _mm_srli_si128(acc, 4));
    s = _mm_cvtsi128_si32(acc);
#endif
    for (; i < len; i++) s += (int32_t)qx[i] * (int32_t)w[i];
    return s;
}

#ifdef QA8_AVX2
static inline __m256i dot32_i8(__m256i ax, __m256i sx, const int8_t *w) {
    const __m256i wv = _mm256_loadu_si256((const __m256i *)w);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, sx)), _mm256_set1_epi16(1));
}

/* 8 int32 vectors -> their 8 horizontal sums in order (exact) */
static inline __m256i hsum8_epi32(const __m256i *p) {
    const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
    const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    /* a: [r0 r1 r2 r3 | r0 r1 r2 r3] halves of the 128-bit lanes, b the same for r4..r7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* 8 fp16 block scales (bs[b * bs_ld + n .. n + 7]) as floats, exact */
static inline __m256 bs8(const uint16_t *p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float t[8];
    for (int i = 0; i < 8; i++) t[i] = half_to_f32(p[i]);
    return _mm256_loadu_ps(t);
#endif
}
#endif

/* rows [n0, n1) of the int8 weight against x row m: out[m * ldo + n]. Per-row scales (bs NULL):
   f += float(S_b) * dx[b], out = bf16(f * scale[n]); block scales (bs: fp16 [nb, >= N] group-major,
   row stride bs_ld, GGUF Q8_0's): f += float(S_b) * (bs[b, n] * dx[b]), out = bf16(f). */
static void int8_a8_rows(const a8_x *a, int64_t m, const int8_t *q, int64_t k, const uint16_t *scales,
                         const uint16_t *bs, int64_t bs_ld, qout out, int64_t n0, int64_t n1) {
    const int64_t full = k / A8, nb = a->nb;
    const int8_t *qx = a->q + m * nb * A8;
    const float *dx = a->d + m * nb;
    int64_t n = n0;
#ifdef QA8_AVX2
    for (; n + 8 <= n1; n += 8) {
        __m256 f = _mm256_setzero_ps();
        for (int64_t b = 0; b < full; b++) {
            const __m256i xv = _mm256_load_si256((const __m256i *)(qx + b * A8));
            const __m256i ax = _mm256_sign_epi8(xv, xv);
            __m256i p[8];
            /* the 8 rows I8_AHEAD ahead are 8 k contiguous bytes: 256 of them a block, in address order */
            for (int l = 0; l < 4; l++) __builtin_prefetch(q + (n + I8_AHEAD) * k + b * 8 * A8 + 64 * l, 0, PF_LOC);
            if (bs) /* and their block's scales: a line of a group-major row, 32 rows, a miss to RAM each group */
                __builtin_prefetch(bs + b * bs_ld + n + I8_AHEAD, 0, PF_LOC);
            for (int r = 0; r < 8; r++) p[r] = dot32_i8(ax, xv, q + (n + r) * k + b * A8);
            const __m256 sb = _mm256_cvtepi32_ps(hsum8_epi32(p));
            const __m256 db = bs ? _mm256_mul_ps(bs8(bs + b * bs_ld + n), _mm256_set1_ps(dx[b])) : _mm256_set1_ps(dx[b]);
            f = _mm256_add_ps(f, _mm256_mul_ps(sb, db));
        }
        if (full == nb) { /* no K tail: rne(v * bf(scale)) below, 8 at once (the AVX-512 rne16's why) */
            const __m256 sc = bs ? _mm256_set1_ps(1.0f) : ops_bf8(scales + n);
            put8(out, m, n, _mm256_mul_ps(f, sc));
            continue;
        }
        float fr[8];
        _mm256_storeu_ps(fr, f);
        for (int r = 0; r < 8; r++) {
            float v = fr[r];
            if (full < nb) v = v + (float)dot_block_i8(qx + full * A8, q + (n + r) * k + full * A8, k - full * A8)
                                       * (bs ? half_to_f32(bs[full * bs_ld + n + r]) * dx[full] : dx[full]);
            put1(out, m, n + r, bs ? v : v * bf(scales[n + r]));
        }
    }
#endif
    for (; n < n1; n++) {
        float f = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t len = b < full ? A8 : k - full * A8;
            f = f + (float)dot_block_i8(qx + b * A8, q + n * k + b * A8, len) * (bs ? half_to_f32(bs[b * bs_ld + n]) * dx[b] : dx[b]);
        }
        put1(out, m, n, bs ? f : f * bf(scales[n]));
    }
}

#ifdef QA8_VNNI
/* Rows of x per pass over decoded weights (int8: a transposed 16-row tile; int4: a column quad's 4
   vectors): the accumulators of that many rows stay in the 32 zmm registers (int8: Zen 4, 2 threads;
   int4: 3 rows = 12 integer sums + 12 float sums + 4 codes + x, where 4 rows spilled: 7-10% faster at
   M = 128 on Zen 5, 2 threads, than 4 rows, 1.2-1.5x than 6 or 8). */
#ifndef I8_MT
#define I8_MT 8
#endif
#ifndef I4_MT
#define I4_MT 3
#endif

/* x rows [mb, mb + mt) against weight rows [n, n + 16) (mt a constant where inlined): each full 32-column
   block's 16 x 8 dwords are transposed once (vector t[j] = dword j of the 16 rows, rows in lane order) for
   the mt rows of x, whose codes enter vpdpbusd as unsigned bytes qx + 128 (an xor): that sum is
   S_b + 128 * (the block's weight sum), taken back exactly. Then the portable float steps in block order
   (the K tail's block last, scalar), so the same bits. */
static inline __attribute__((always_inline)) void int8_a8_vnni_tile(const a8_x *a, int64_t mb, const int mt,
                                                                    const int8_t *q, int64_t k,
                                                                    const uint16_t *scales, const uint16_t *bs,
                                                                    int64_t bs_ld, qout out, int64_t n) {
    const int64_t full = k / A8, nb = a->nb;
    const __m512i ones = _mm512_set1_epi8(1);
    const __m512i lo_idx = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i hi_idx = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    __m512 f[I8_MT];
    for (int m = 0; m < mt; m++) f[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < full; b++) {
        __m512i z[8];
        /* the 16 rows I8_AHEAD ahead: 512 of their 16 k contiguous bytes a block, in address order */
        for (int l = 0; l < 8; l++) __builtin_prefetch(q + (n + I8_AHEAD) * k + b * 16 * A8 + 64 * l, 0, PF_LOC);
        if (bs) __builtin_prefetch(bs + b * bs_ld + n + I8_AHEAD, 0, PF_LOC); /* their block's scales (int8_a8_rows) */
        for (int i = 0; i < 8; i++) /* z[i] = row i's 8 dwords | row i + 8's */
            z[i] = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(q + (n + i) * k + b * A8))),
                _mm256_loadu_si256((const __m256i *)(q + (n + 8 + i) * k + b * A8)), 1);
        /* 8 x 8 dword transposes in each 256-bit half */
        __m512i u[8], v[8], t[8];
        for (int i = 0; i < 4; i++) {
            u[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
            u[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
        }
        /* v[4h + j]: dwords j (lanes 0, 2) and j + 4 (lanes 1, 3) of rows 4h .. 4h + 3 (and + 8) */
        for (int h = 0; h < 2; h++) {
            v[4 * h + 0] = _mm512_unpacklo_epi64(u[4 * h], u[4 * h + 2]);
            v[4 * h + 1] = _mm512_unpackhi_epi64(u[4 * h], u[4 * h + 2]);
            v[4 * h + 2] = _mm512_unpacklo_epi64(u[4 * h + 1], u[4 * h + 3]);
            v[4 * h + 3] = _mm512_unpackhi_epi64(u[4 * h + 1], u[4 * h + 3]);
        }
        for (int j = 0; j < 4; j++) {
            t[j] = _mm512_permutex2var_epi64(v[j], lo_idx, v[4 + j]);
            t[j + 4] = _mm512_permutex2var_epi64(v[j], hi_idx, v[4 + j]);
        }
        __m512i w = _mm512_setzero_si512(); /* the 16 rows' sums of the block's codes */
        for (int j = 0; j < 8; j++) w = _mm512_dpbusd_epi32(w, ones, t[j]);
        const __m512i w128 = _mm512_slli_epi32(w, 7);
        const __m512 bsv = bs ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(bs + b * bs_ld + n))) : _mm512_set1_ps(1.0f);
        for (int m = 0; m < mt; m++) {
            const uint8_t *xu = a->qu + ((mb + m) * nb + b) * A8;
            __m512i acc = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) {
                int32_t xq;
                memcpy(&xq, xu + 4 * j, 4);
                acc = _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(xq), t[j]);
            }
            const __m512 sb = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, w128));
            const __m512 dv = _mm512_set1_ps(a->d[(mb + m) * nb + b]);
            f[m] = _mm512_add_ps(f[m], _mm512_mul_ps(sb, bs ? _mm512_mul_ps(bsv, dv) : dv));
        }
    }
    const __m512 sc = bs ? _mm512_set1_ps(1.0f)
                         : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(scales + n))), 16));
    for (int m = 0; m < mt; m++) {
        if (full == nb) { /* no K tail: bf16(f * scale) as rne(val * bf(scale)) below, 16 at once */
            put16(out, mb + m, n, bs ? f[m] : _mm512_mul_ps(f[m], sc));
            continue;
        }
        float fr[16];
        _mm512_storeu_ps(fr, f[m]);
        const int8_t *qx = a->q + (mb + m) * nb * A8;
        const float *dx = a->d + (mb + m) * nb;
        for (int r = 0; r < 16; r++) {
            float val = fr[r];
            if (full < nb) val = val + (float)dot_block_i8(qx + full * A8, q + (n + r) * k + full * A8, k - full * A8)
                                           * (bs ? half_to_f32(bs[full * bs_ld + n + r]) * dx[full] : dx[full]);
            put1(out, mb + m, n + r, bs ? val : val * bf(scales[n + r]));
        }
    }
}

/* Weight rows [n0, n1) against x rows [0, m_count): 16-row tiles for 2+ rows of x (one row: the AVX2
   code, whose 8-row blocks cost less than a transpose used once; Zen 4), the rows left one by one. */
static void int8_a8_many(const a8_x *a, int64_t m_count, const int8_t *q, int64_t k, const uint16_t *scales,
                         const uint16_t *bs, int64_t bs_ld, qout out, int64_t n0, int64_t n1) {
    int64_t n = n0;
    if (m_count >= I8_VNNI_MIN_M)
        for (; n + 16 <= n1; n += 16)
            for (int64_t mb = 0; mb < m_count;) { /* I8_MT rows at a time, then 4, 2, 1 (constants: inlined) */
                const int64_t left = m_count - mb;
                if (left >= I8_MT) int8_a8_vnni_tile(a, mb, I8_MT, q, k, scales, bs, bs_ld, out, n), mb += I8_MT;
                else if (left >= 4) int8_a8_vnni_tile(a, mb, 4, q, k, scales, bs, bs_ld, out, n), mb += 4;
                else if (left >= 2) int8_a8_vnni_tile(a, mb, 2, q, k, scales, bs, bs_ld, out, n), mb += 2;
                else int8_a8_vnni_tile(a, mb, 1, q, k, scales, bs, bs_ld, out, n), mb += 1;
            }
    for (int64_t m = 0; m < m_count; m++) int8_a8_rows(a, m, q, k, scales, bs, bs_ld, out, n, n1);
}
#else
static void int8_a8_many(const a8_x *a, int64_t m_count, const int8_t *q, int64_t k, const uint16_t *scales,
                         const uint16_t *bs, int64_t bs_ld, qout out, int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < m_count; m++) int8_a8_rows(a, m, q, k, scales, bs, bs_ld, out, n0, n1);
}
#endif

static int int8_a8_run(const void *x, int64_t ldx, const int8_t *q, const uint16_t *scales, const uint16_t *bs,
                       void *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads, int io) {
    if (m_count <= 0 || n <= 0 || k <= 0 || ldx < k || ldo < n || io & ~3) return 1;
    a8_x a;
    if (a8_quantize(x, ldx, io & IO_X_F32, m_count, k, (k + A8 - 1) / A8, &a)) return 2;
    const qout o = {out, ldo, (io & IO_OUT_F32) != 0};
    const int64_t step = 64, items = (n + step - 1) / step;
    const int par = threads > 1 && m_count * n * k >= PAR_MIN && items > 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
    for (int64_t it = 0; it < items; it++) {
        const int64_t n0 = it * step, n1 = n0 + step < n ? n0 + step : n;
        int8_a8_many(&a, m_count, q, k, scales, bs, n, o, n0, n1);
    }
    a8_free(&a);
    return 0;
}

/* x [M, K] bf16 (row stride ldx), q int8 [N, K] contiguous, scales bf16 [N] -> out [M, N] bf16 (row stride ldo). */
int llmsys_qgemv_int8_a8(const uint16_t *x, int64_t ldx, const int8_t *q, const uint16_t *scales, uint16_t *out,
                         int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads) {
    return int8_a8_run(x, ldx, q, scales, NULL, out, ldo, m_count, n, k, threads, 0);
}

/* llmsys_qgemv_int8_a8 with io (IO_X_F32: x float32; IO_OUT_F32: out float32, unrounded) */
int llmsys_qgemv_int8_a8_io(const void *x, int64_t ldx, const int8_t *q, const uint16_t *scales, void *out,
                            int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads, int io) {
    return int8_a8_run(x, ldx, q, scales, NULL, out, ldo, m_count, n, k, threads, io);
}

/* The same with a scale per 32-column block (GGUF Q8_0): block_scales fp16 [ceil(K / 32), N] (group-major). */
int llmsys_qgemv_int8g_a8(const uint16_t *x, int64_t ldx, const int8_t *q, const uint16_t *block_scales,
                          uint16_t *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads) {
    return int8_a8_run(x, ldx, q, NULL, block_scales, out, ldo, m_count, n, k, threads, 0);
}

int llmsys_qgemv_int8g_a8_io(const void *x, int64_t ldx, const int8_t *q, const uint16_t *block_scales,
                             void *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads, int io) {
    return int8_a8_run(x, ldx, q, NULL, block_scales, out, ldo, m_count, n, k, threads, io);
}

/* int8 codes with the scales of GGUF K-quants kept as stored, group-major arrays [.., >= N] (row stride f_ld),
   K a multiple of 32, per 32-column block b of x:
   - ksc set (Q6_K: codes q - 32, int8 scales sc per 16 columns ksc [K / 16, N], fp16 d per 256 kd [K / 256, N];
     h(j) = d * sc(j), the float32 product llama.cpp's dequantization rounds): S_lo, S_hi = the exact integer dots
     of the block's columns 0-15 and 16-31, f = f + (float(S_lo) * (h(2b) * dx[b]) + float(S_hi) * (h(2b + 1) * dx[b]));
   - else (Q5_K: 5-bit codes, float32 scales d * sc and offsets -(dmin * m) per 32 columns, fs / fo [K / 32, N]):
     f = f + (float(S_b) * (fs[b, n] * dx[b]) + float(sx[b]) * (fo[b, n] * dx[b]));
   out = bf16(f). AVX2: the 8 int32 lanes vpmaddwd leaves per row hold 4 columns each, lanes 0-3 the block's
   first 16 columns (the low 128 bits), 4-7 the next 16: two rounds of vphaddd keep the halves apart. */
static void int8k_a8_rows(const a8_x *a, int64_t m, const int8_t *q, int64_t k, const float *fs, const float *fo,
                          const int8_t *ksc, const uint16_t *kd, int64_t f_ld, qout out,
                          int64_t n0, int64_t n1) {
    const int64_t nb = k / A8;
    const int8_t *qx = a->q + m * a->nb * A8;
    const float *dx = a->d + m * a->nb;
    const int32_t *sx = a->s + m * a->nb;
    int64_t n = n0;
#ifdef QA8_AVX2
    for (; n + 8 <= n1; n += 8) {
        __m256 f = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const __m256i xv = _mm256_load_si256((const __m256i *)(qx + b * A8));
            const __m256i ax = _mm256_sign_epi8(xv, xv);
            __m256i p[8];
            /* the 8 rows I8_AHEAD ahead in address order (int8_a8_rows' why), and their group-major scales */
            for (int l = 0; l < 4; l++) __builtin_prefetch(q + (n + I8_AHEAD) * k + b * 8 * A8 + 64 * l, 0, PF_LOC);
            if (!ksc) {
                __builtin_prefetch(fs + b * f_ld + n + I8_AHEAD, 0, PF_LOC);
                __builtin_prefetch(fo + b * f_ld + n + I8_AHEAD, 0, PF_LOC);
            } else {
                __builtin_prefetch(ksc + 2 * b * f_ld + n + I8_AHEAD, 0, PF_LOC);
                __builtin_prefetch(ksc + (2 * b + 1) * f_ld + n + I8_AHEAD, 0, PF_LOC);
                if (!(b & 7)) __builtin_prefetch(kd + (b / 8) * f_ld + n + I8_AHEAD, 0, PF_LOC);
            }
            for (int r = 0; r < 8; r++) p[r] = dot32_i8(ax, xv, q + (n + r) * k + b * A8);
            const __m256 dv = _mm256_set1_ps(dx[b]);
            if (!ksc) {
                const __m256 sb = _mm256_cvtepi32_ps(hsum8_epi32(p));
                const __m256 sd = _mm256_mul_ps(_mm256_loadu_ps(fs + b * f_ld + n), dv);
                const __m256 od = _mm256_mul_ps(_mm256_loadu_ps(fo + b * f_ld + n), dv);
                f = _mm256_add_ps(f, _mm256_add_ps(_mm256_mul_ps(sb, sd), _mm256_mul_ps(_mm256_set1_ps((float)sx[b]), od)));
                continue;
            }
            const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
            const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
            const __m256i u = _mm256_hadd_epi32(h01, h23), v = _mm256_hadd_epi32(h45, h67);
            /* u: rows 0-3's first halves | their second halves; v: the same for rows 4-7 */
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(u, v, 0x20));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(u, v, 0x31));
            const __m256 d8 = bs8(kd + (b / 8) * f_ld + n);
            const __m256 hlo = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(ksc + 2 * b * f_ld + n)))));
            const __m256 hhi = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(ksc + (2 * b + 1) * f_ld + n)))));
            f = _mm256_add_ps(f, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_mul_ps(hlo, dv)),
                                               _mm256_mul_ps(hi, _mm256_mul_ps(hhi, dv))));
        }
        float fr[8];
        _mm256_storeu_ps(fr, f);
        for (int r = 0; r < 8; r++) put1(out, m, n + r, fr[r]);
    }
#endif
    for (; n < n1; n++) {
        float f = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *w = q + n * k + b * A8, *xb = qx + b * A8;
            if (!ksc) {
                f = f + ((float)dot_block_i8(xb, w, A8) * (fs[b * f_ld + n] * dx[b])
                         + (float)sx[b] * (fo[b * f_ld + n] * dx[b]));
                continue;
            }
            const float d = half_to_f32(kd[(b / 8) * f_ld + n]);
            const float hlo = d * (float)ksc[2 * b * f_ld + n], hhi = d * (float)ksc[(2 * b + 1) * f_ld + n];
            f = f + ((float)dot_block_i8(xb, w, 16) * (hlo * dx[b]) + (float)dot_block_i8(xb + 16, w + 16, 16) * (hhi * dx[b]));
        }
        put1(out, m, n, f);
    }
}

static int int8k_a8_run(const void *x, int64_t ldx, const int8_t *q, const float *fs, const float *fo,
                        const int8_t *ksc, const uint16_t *kd, void *out, int64_t ldo, int64_t m_count,
                        int64_t n, int64_t k, int threads, int io) {
    if (m_count <= 0 || n <= 0 || k <= 0 || k % A8 || ldx < k || ldo < n || (ksc && k % 256) || io & ~3) return 1;
    a8_x a;
    if (a8_quantize(x, ldx, io & IO_X_F32, m_count, k, k / A8, &a)) return 2;
    const qout o = {out, ldo, (io & IO_OUT_F32) != 0};
    const int64_t step = 64, items = (n + step - 1) / step;
    const int par = threads > 1 && m_count * n * k >= PAR_MIN && items > 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
    for (int64_t it = 0; it < items; it++) {
        const int64_t n0 = it * step, n1 = n0 + step < n ? n0 + step : n;
        for (int64_t m = 0; m < m_count; m++) int8k_a8_rows(&a, m, q, k, fs, fo, ksc, kd, n, o, n0, n1);
    }
    a8_free(&a);
    return 0;
}

/* x [M, K] bf16 (row stride ldx), q int8 [N, K] contiguous, float32 scales and offsets [K / 32, N] (Q5_K) -> out
   [M, N] bf16 (row stride ldo); K a multiple of 32 (else 1). */
int llmsys_qgemv_int8o_a8(const uint16_t *x, int64_t ldx, const int8_t *q, const float *scales, const float *offsets,
                          uint16_t *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads) {
    return scales && offsets ? int8k_a8_run(x, ldx, q, scales, offsets, NULL, NULL, out, ldo, m_count, n, k, threads, 0) : 1;
}

int llmsys_qgemv_int8o_a8_io(const void *x, int64_t ldx, const int8_t *q, const float *scales, const float *offsets,
                             void *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads, int io) {
    return scales && offsets ? int8k_a8_run(x, ldx, q, scales, offsets, NULL, NULL, out, ldo, m_count, n, k, threads, io) : 1;
}

/* x [M, K] bf16 (row stride ldx), q int8 [N, K] contiguous, Q6_K's scales as stored: int8 sc [K / 16, N] and fp16
   d [K / 256, N] -> out [M, N] bf16 (row stride ldo); K a multiple of 256 (else 1). */
int llmsys_qgemv_int8h_a8(const uint16_t *x, int64_t ldx, const int8_t *q, const int8_t *sc, const uint16_t *d,
                          uint16_t *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads) {
    return sc && d ? int8k_a8_run(x, ldx, q, NULL, NULL, sc, d, out, ldo, m_count, n, k, threads, 0) : 1;
}

int llmsys_qgemv_int8h_a8_io(const void *x, int64_t ldx, const int8_t *q, const int8_t *sc, const uint16_t *d,
                             void *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads, int io) {
    return sc && d ? int8k_a8_run(x, ldx, q, NULL, NULL, sc, d, out, ldo, m_count, n, k, threads, io) : 1;
}

/* Slot s of an int4 a8 block's accumulators holds row a8_row(s): the AVX2 unpacks interleave
   8-row groups as 0, 16, 8, 24 (low nibbles), then the same + 32 (high nibbles). */
static inline int a8_row(int s) {
#if defined(QA8_AVX2)
    static const int base[8] = {0, 16, 8, 24, 32, 48, 40, 56};
    return base[s / 8] + s % 8;
#else
    return s;
#endif
}

/* A group's Q4_K scales (neg 0) or offsets (neg 1) from md->ksc / km, kd / kdm, rows of a 64-row block in
   a8_row's slot order, 0 past `rows`: d * sc, -(dmin * m) (float32, as llama.cpp's dequantization). */
static void k_meta(const int4_meta *md, int64_t row0, int64_t rows, int64_t g, int neg, float *out) {
    const uint8_t *c = (neg ? md->km : md->ksc) + g * md->k_n;
    const uint16_t *d = (neg ? md->kdm : md->kd) + (g / 8) * md->k_n;
#ifdef QA8_AVX2
    if (rows == 64) {
        const __m256 sign = _mm256_set1_ps(neg ? -0.0f : 0.0f);
        for (int v = 0; v < 8; v++) {
            const int64_t r = row0 + a8_row(8 * v);
            const __m256 cf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + r))));
            _mm256_store_ps(out + 8 * v, _mm256_xor_ps(_mm256_mul_ps(bs8(d + r), cf), sign));
        }
        return;
    }
#endif
    for (int s = 0; s < 64; s++) {
        const int64_t j = a8_row(s);
        const float p = j < rows ? half_to_f32(d[row0 + j]) * (float)c[row0 + j] : 0.0f;
        out[s] = neg ? -p : p;
    }
}

/* A group's offsets (md->offs set) for the rows of a 64-row block in a8_row's slot order, 0 past `rows`. */
static void a8_offsets(const int4_meta *md, int64_t row0, int64_t rows, int64_t g, float *os) {
    if (md->ksc) {
        k_meta(md, row0, rows, g, 1, os);
        return;
    }
#ifdef QA8_AVX2
    if (rows == 64 && md->o_n == 1) {
        for (int v = 0; v < 8; v++)
            _mm256_store_ps(os + 8 * v, _mm256_loadu_ps(md->offs + row0 + a8_row(8 * v) + g * md->o_g));
        return;
    }
#endif
    for (int s = 0; s < 64; s++) {
        const int j = a8_row(s);
        os[s] = j < rows ? md->offs[(row0 + j) * md->o_n + g * md->o_g] : 0.0f;
    }
}

/* A group's zero points and scales for the rows of a 64-row block, in a8_row's slot order. Vector
   loads where the block is full and the rows lie contiguously (Int4Linear's group-major zeros, z_n = 1;
   bf16 scales with s_n = 2, its scales_zeros [G, Np, 2], or s_n = 1; float32 / fp16 scales with s_n = 1,
   its group-major scales_orig), else meta_scalar's gather. With offsets the zeros are not read (0). */
static void a8_meta(const int4_meta *md, int64_t row0, int64_t rows, int64_t g, int32_t *zs, float *ss) {
    if (md->ksc) {
        for (int s = 0; s < 64; s++) zs[s] = 0;
        k_meta(md, row0, rows, g, 0, ss);
        return;
    }
#ifdef QA8_AVX2
    if (rows == 64 && (md->z_n == 1 || md->offs) && ((md->kind == 0 && (md->s_n == 2 || md->s_n == 1)) || (md->kind != 0 && md->s_n == 1))) {
        for (int v = 0; v < 8; v++) {
            const int64_t r = row0 + a8_row(8 * v);
            _mm256_store_si256((__m256i *)(zs + 8 * v), md->offs ? _mm256_setzero_si256() :
                               _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(md->zeros + r + g * md->z_g))));
            if (md->kind == 1) { /* float32, group-major */
                _mm256_store_ps(ss + 8 * v, _mm256_loadu_ps((const float *)md->scales + r + g * md->s_g));
                continue;
            }
            const uint16_t *sp = (const uint16_t *)md->scales + r * md->s_n + g * md->s_g;
            if (md->kind == 2) { /* fp16, group-major (GGUF Q4_0's scales): exact conversion */
                _mm256_store_ps(ss + 8 * v, bs8(sp));
                continue;
            }
            const __m256i w = md->s_n == 2 ? _mm256_loadu_si256((const __m256i *)sp)
                                           : _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)sp));
            _mm256_store_ps(ss + 8 * v, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
        return;
    }
#endif
    float zr[64], sr[64];
    meta_scalar(md, row0, rows, g, zr, sr);
    for (int s = 0; s < 64; s++) { zs[s] = md->offs ? 0 : (int32_t)zr[a8_row(s)]; ss[s] = sr[a8_row(s)]; }
}

/* One 64-row block of the CPU int4 tiling against x rows [m0, m1): out[m, row0 + j]. */
static void int4_a8_block(const a8_x *a, int64_t m0, int64_t m1, const uint8_t *blk, const int4_meta *md,
                          int64_t n_groups, int64_t gs, int64_t row0, int64_t n_rows, qout out) {
    const int64_t rows = n_rows - row0 < 64 ? n_rows - row0 : 64, per_g = gs / A8, nb = a->nb;
    enum { MT8 = 8 };
    float acc[MT8][64] __attribute__((aligned(32)));
    for (int64_t mb = m0; mb < m1; mb += MT8) {
        const int mt = m1 - mb < MT8 ? (int)(m1 - mb) : MT8;
        for (int m = 0; m < mt; m++)
            for (int s = 0; s < 64; s++) acc[m][s] = 0.0f;
        for (int64_t g = 0; g < n_groups; g++) {
            int32_t zs[64] __attribute__((aligned(32)));
            float ss[64] __attribute__((aligned(32))), os[64] __attribute__((aligned(32)));
            a8_meta(md, row0, rows, g, zs, ss);
            meta_prefetch(md, row0 + 64, g);
            if (has_offsets(md)) a8_offsets(md, row0, rows, g, os);
            for (int64_t bi = 0; bi < per_g; bi++) {
                const int64_t b = g * per_g + bi;
                const uint8_t *p = blk + b * A8 * 32;
                for (int l = 0; l < A8 * 32; l += 64) __builtin_prefetch(p + A8_AHEAD + l, 0, 2); /* L2; never faults */
                for (int m = 0; m < mt; m++) {
                    const int8_t *qx = a->q + ((mb + m) * nb + b) * A8;
                    const float dxb = a->d[(mb + m) * nb + b];
                    const int32_t sxb = a->s[(mb + m) * nb + b];
#ifdef QA8_AVX2
                    const __m256i low4 = _mm256_set1_epi8(15);
                    __m256i s32[8];
                    for (int v = 0; v < 8; v++) s32[v] = _mm256_setzero_si256();
                    for (int h16 = 0; h16 < 2; h16++) {
                        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
                        const uint8_t *pc = p + h16 * 16 * 32;
                        const int8_t *xc = qx + h16 * 16;
#pragma GCC unroll 2
                        for (int pr = 0; pr < 8; pr++) {
                            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(pc + 64 * pr));
                            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(pc + 64 * pr + 32));
                            /* the two columns' bytes interleaved first (2 shuffles, not 4): each word's low
                               nibbles are one row's (code c, code c + 1), its high nibbles row + 32's */
                            const __m256i ul = _mm256_unpacklo_epi8(v0, v1), uh = _mm256_unpackhi_epi8(v0, v1);
                            int16_t pw; /* the pair (qx[c], qx[c + 1]) as one little-endian word */
                            memcpy(&pw, xc + 2 * pr, 2);
                            const __m256i xp = _mm256_set1_epi16(pw);
                            a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(_mm256_and_si256(ul, low4), xp));
                            a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(_mm256_and_si256(uh, low4), xp));
                            a2 = _mm256_add_epi16(a2, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(ul, 4), low4), xp));
                            a3 = _mm256_add_epi16(a3, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(uh, 4), low4), xp));
                        }
                        /* a0: rows 0-7 | 16-23, a1: 8-15 | 24-31, a2, a3: the same + 32 */
                        const __m256i a16[4] = {a0, a1, a2, a3};
                        for (int v = 0; v < 4; v++) {
                            s32[2 * v] = _mm256_add_epi32(s32[2 * v], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(a16[v])));
                            s32[2 * v + 1] = _mm256_add_epi32(s32[2 * v + 1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a16[v], 1)));
                        }
                    }
                    /* s32 order: 0-7, 16-23, 8-15, 24-31, 32-39, 48-55, 40-47, 56-63 = a8_row's slots */
                    const __m256i sxv = _mm256_set1_epi32(sxb);
                    const __m256 dv = _mm256_set1_ps(dxb);
                    if (has_offsets(md)) { /* f + (float(S_b) * (scale * d_b) + float(sum qx_b) * (offset * d_b)) */
                        const __m256 sxf = _mm256_set1_ps((float)sxb);
                        for (int v = 0; v < 8; v++) {
                            const __m256 sd = _mm256_mul_ps(_mm256_load_ps(ss + 8 * v), dv);
                            const __m256 od = _mm256_mul_ps(_mm256_load_ps(os + 8 * v), dv);
                            const __m256 prod = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s32[v]), sd),
                                                              _mm256_mul_ps(sxf, od));
                            _mm256_store_ps(acc[m] + 8 * v, _mm256_add_ps(_mm256_load_ps(acc[m] + 8 * v), prod));
                        }
                        continue;
                    }
                    for (int v = 0; v < 8; v++) {
                        const __m256i t = _mm256_sub_epi32(s32[v], _mm256_mullo_epi32(_mm256_load_si256((const __m256i *)(zs + 8 * v)), sxv));
                        const __m256 sd = _mm256_mul_ps(_mm256_load_ps(ss + 8 * v), dv);
                        const __m256 prod = _mm256_mul_ps(_mm256_cvtepi32_ps(t), sd);
                        _mm256_store_ps(acc[m] + 8 * v, _mm256_add_ps(_mm256_load_ps(acc[m] + 8 * v), prod));
                    }
#else
                    int32_t S[64] __attribute__((aligned(16)));
#ifdef QA8_SSSE3
                    /* the AVX2 code's pairs 128 bits at a time: u[i] interleaves two columns' bytes of rows
                       8i .. 8i + 7 (low nibbles; high nibbles: rows + 32), int16 sums of 8 column pairs */
                    const __m128i low4 = _mm_set1_epi8(15);
                    __m128i s32[16];
                    for (int v = 0; v < 16; v++) s32[v] = _mm_setzero_si128();
                    for (int h16 = 0; h16 < 2; h16++) {
                        __m128i a16[8];
                        for (int v = 0; v < 8; v++) a16[v] = _mm_setzero_si128();
                        const uint8_t *pc = p + h16 * 16 * 32;
                        const int8_t *xc = qx + h16 * 16;
                        for (int pr = 0; pr < 8; pr++) {
                            const uint8_t *c0 = pc + 64 * pr;
                            const __m128i v0l = _mm_loadu_si128((const __m128i *)c0), v0h = _mm_loadu_si128((const __m128i *)(c0 + 16));
                            const __m128i v1l = _mm_loadu_si128((const __m128i *)(c0 + 32)), v1h = _mm_loadu_si128((const __m128i *)(c0 + 48));
                            int16_t pw; /* the pair (qx[c], qx[c + 1]) as one little-endian word */
                            memcpy(&pw, xc + 2 * pr, 2);
                            const __m128i xp = _mm_set1_epi16(pw);
                            const __m128i u[4] = {_mm_unpacklo_epi8(v0l, v1l), _mm_unpackhi_epi8(v0l, v1l),
                                                  _mm_unpacklo_epi8(v0h, v1h), _mm_unpackhi_epi8(v0h, v1h)};
                            for (int i = 0; i < 4; i++) {
                                a16[i] = _mm_add_epi16(a16[i], _mm_maddubs_epi16(_mm_and_si128(u[i], low4), xp));
                                a16[i + 4] = _mm_add_epi16(a16[i + 4], _mm_maddubs_epi16(
                                    _mm_and_si128(_mm_srli_epi16(u[i], 4), low4), xp));
                            }
                        }
                        for (int v = 0; v < 8; v++) { /* rows 8v .. 8v + 7 as int32 */
                            s32[2 * v] = _mm_add_epi32(s32[2 * v], _mm_cvtepi16_epi32(a16[v]));
                            s32[2 * v + 1] = _mm_add_epi32(s32[2 * v + 1], _mm_cvtepi16_epi32(_mm_srli_si128(a16[v], 8)));
                        }
                    }
                    for (int v = 0; v < 16; v++) _mm_store_si128((__m128i *)(S + 4 * v), s32[v]);
#else
                    for (int j = 0; j < 64; j++) S[j] = 0;
                    for (int c = 0; c < A8; c++) {
                        const int32_t xv = qx[c];
                        const uint8_t *pc = p + c * 32;
                        for (int j = 0; j < 32; j++) {
                            S[j] += xv * (int32_t)(pc[j] & 15);
                            S[j + 32] += xv * (int32_t)(pc[j] >> 4);
                        }
                    }
#endif
                    for (int s = 0; s < 64; s++) {
                        if (has_offsets(md)) {
                            acc[m][s] = acc[m][s] + ((float)S[s] * (ss[s] * dxb) + (float)sxb * (os[s] * dxb));
                            continue;
                        }
                        const int32_t t = S[s] - zs[s] * sxb;
                        acc[m][s] = acc[m][s] + (float)t * (ss[s] * dxb);
                    }
#endif
                }
            }
        }
        for (int m = 0; m < mt; m++)
            for (int s8 = 0; s8 < 64; s8 += 8) { /* 8 slots are 8 consecutive rows (a8_row) */
                const int j = a8_row(s8);
#ifdef QA8_AVX2
                if (j + 8 <= rows) { /* 8 at once: a float read back after the vector store stalled (see rne16) */
                    put8(out, mb + m, row0 + j, _mm256_load_ps(acc[m] + s8));
                    continue;
                }
#endif
                for (int i = 0; i < 8 && j + i < rows; i++) put1(out, mb + m, row0 + j + i, acc[m][s8 + i]);
            }
    }
}

#ifdef QA8_VNNI

/* Slot s of int4_a8_block_vnni's accumulators (4 vectors of 16 slots) holds row
   (s / 16 >= 2 ? 32 : 0) + (s / 16 odd ? 4 : 0) + 0, 16, 8, 24 for each 4 lanes, + the lane within them. */

/* int4_a8_block with vpdpbusd: 4 columns at a time, each row's 4 codes brought into one dword by two
   rounds of unpacks (bytes of columns c, c+2, then words of the (c, c+2) and (c+1, c+3) pairs), decoded
   once for up to I4_MT rows of x, whose codes (a->q4) lie in the same order. The integer sums are exact
   and the float steps per row those of the other builds, so the same bits. Every row count: with the
   next block's metadata prefetched (meta_prefetch), one row of x from RAM is 1.08-1.39x the AVX2 code's
   pairs on Zen 5 (2 threads; cache-warm 1.4x); on Zen 4 the cache-warm decode was 0.8-0.9x for one row,
   1.35-1.7x from 4. */
/* x rows [mb, mb + mt) of int4_a8_block_vnni, mt a constant where inlined (the accumulators stay in registers) */
static inline __attribute__((always_inline)) void int4_a8_vnni_tile(
        const a8_x *a, int64_t mb, const int mt, const uint8_t *blk, const int4_meta *md, int64_t n_groups,
        int64_t gs, int64_t row0, int64_t rows, qout out) {
    const int64_t per_g = gs / A8, nb = a->nb;
    const __m512i low4 = _mm512_set1_epi8(15);
    /* slot vector v of a half (rows 0-31 or 32-63) from that half's two row-order vectors */
    const __m512i ie = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    const __m512i io = _mm512_add_epi32(ie, _mm512_set1_epi32(4));
    __m512 acc[I4_MT][4];
    for (int m = 0; m < mt; m++)
        for (int v = 0; v < 4; v++) acc[m][v] = _mm512_setzero_ps();
    for (int64_t g = 0; g < n_groups; g++) {
        __m512i zr[4], zs[4];
        __m512 sr[4], ss[4];
        meta_vec(md, row0, rows, g, zr, sr);
        meta_prefetch(md, row0 + 64, g);
        for (int h = 0; h < 2; h++) {
            zs[2 * h] = _mm512_permutex2var_epi32(zr[2 * h], ie, zr[2 * h + 1]);
            zs[2 * h + 1] = _mm512_permutex2var_epi32(zr[2 * h], io, zr[2 * h + 1]);
            ss[2 * h] = _mm512_permutex2var_ps(sr[2 * h], ie, sr[2 * h + 1]);
            ss[2 * h + 1] = _mm512_permutex2var_ps(sr[2 * h], io, sr[2 * h + 1]);
        }
        for (int64_t bi = 0; bi < per_g; bi++) {
            const int64_t b = g * per_g + bi;
            const uint8_t *p = blk + b * A8 * 32;
            for (int l = 0; l < A8 * 32; l += 64) __builtin_prefetch(p + A8_AHEAD + l, 0, 2); /* L2; never faults */
            __m512i S[I4_MT][4];
            for (int m = 0; m < mt; m++)
                for (int v = 0; v < 4; v++) S[m][v] = _mm512_setzero_si512();
            for (int qd = 0; qd < A8 / 4; qd++) {
                /* columns 4qd .. 4qd+3: 32 bytes each, byte j = rows j (low nibble) and j + 32 (high) */
                const __m512i z01 = _mm512_loadu_si512((const void *)(p + qd * 128));
                const __m512i z23 = _mm512_loadu_si512((const void *)(p + qd * 128 + 64));
                /* per 128-bit lane: (c, c+2) byte pairs; lanes 0, 1 from c / c+2, lanes 2, 3 c+1 / c+3 */
                const __m512i u = _mm512_unpacklo_epi8(z01, z23), w = _mm512_unpackhi_epi8(z01, z23);
                const __m512i pa = _mm512_shuffle_i64x2(u, w, 0x44), pb = _mm512_shuffle_i64x2(u, w, 0xEE);
                /* dwords (c, c+2, c+1, c+3) of rows 0-3 | 16-19 | 8-11 | 24-27, and the same + 4 */
                const __m512i r0 = _mm512_unpacklo_epi16(pa, pb), r1 = _mm512_unpackhi_epi16(pa, pb);
                const __m512i c0 = _mm512_and_si512(r0, low4), c1 = _mm512_and_si512(r1, low4);
                const __m512i c2 = _mm512_and_si512(_mm512_srli_epi16(r0, 4), low4);
                const __m512i c3 = _mm512_and_si512(_mm512_srli_epi16(r1, 4), low4);
                for (int m = 0; m < mt; m++) {
                    int32_t xq;
                    memcpy(&xq, a->q4 + ((mb + m) * nb + b) * A8 + 4 * qd, 4);
                    const __m512i xb = _mm512_set1_epi32(xq);
                    S[m][0] = _mm512_dpbusd_epi32(S[m][0], c0, xb);
                    S[m][1] = _mm512_dpbusd_epi32(S[m][1], c1, xb);
                    S[m][2] = _mm512_dpbusd_epi32(S[m][2], c2, xb);
                    S[m][3] = _mm512_dpbusd_epi32(S[m][3], c3, xb);
                }
            }
            for (int m = 0; m < mt; m++) {
                const __m512i sx = _mm512_set1_epi32(a->s[(mb + m) * nb + b]);
                const __m512 dv = _mm512_set1_ps(a->d[(mb + m) * nb + b]);
                for (int v = 0; v < 4; v++) {
                    const __m512i t = _mm512_sub_epi32(S[m][v], _mm512_mullo_epi32(zs[v], sx));
                    const __m512 prod = _mm512_mul_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(ss[v], dv));
                    acc[m][v] = _mm512_add_ps(acc[m][v], prod);
                }
            }
        }
    }
    for (int m = 0; m < mt; m++) { /* slots back into row order (ie, io: the inverse of vnni_row's order) */
        const __m512 r[4] = {_mm512_permutex2var_ps(acc[m][0], ie, acc[m][1]), _mm512_permutex2var_ps(acc[m][0], io, acc[m][1]),
                             _mm512_permutex2var_ps(acc[m][2], ie, acc[m][3]), _mm512_permutex2var_ps(acc[m][2], io, acc[m][3])};
        put_rows(out, mb + m, row0, r, rows);
    }
}

static void int4_a8_block_vnni(const a8_x *a, int64_t m0, int64_t m1, const uint8_t *blk, const int4_meta *md,
                               int64_t n_groups, int64_t gs, int64_t row0, int64_t n_rows, qout out) {
    const int64_t rows = n_rows - row0 < 64 ? n_rows - row0 : 64;
    for (int64_t mb = m0; mb < m1;) { /* I4_MT rows at a time, then 2, 1 (constants: inlined) */
        const int64_t left = m1 - mb;
        if (left >= I4_MT) int4_a8_vnni_tile(a, mb, I4_MT, blk, md, n_groups, gs, row0, rows, out), mb += I4_MT;
        else if (left >= 2) int4_a8_vnni_tile(a, mb, 2, blk, md, n_groups, gs, row0, rows, out), mb += 2;
        else int4_a8_vnni_tile(a, mb, 1, blk, md, n_groups, gs, row0, rows, out), mb += 1;
    }
}
#endif

/* A 64-row block of the tiling against x rows [m0, m1): the VNNI code where built (but offsets: AVX2's). */
static void int4_a8_rows(const a8_x *a, int64_t m0, int64_t m1, const uint8_t *blk, const int4_meta *md,
                         int64_t n_groups, int64_t gs, int64_t row0, int64_t n_rows, qout out) {
#ifdef QA8_VNNI
    if (!has_offsets(md)) { /* offsets: the AVX2 code (also in this build) */
        int4_a8_block_vnni(a, m0, m1, blk, md, n_groups, gs, row0, n_rows, out);
        return;
    }
#endif
    int4_a8_block(a, m0, m1, blk, md, n_groups, gs, row0, n_rows, out);
}

#define I4_SPLIT_MIN_M 16 /* rows of x from which a block's rows are split between the threads */

/* The int4 a8 GEMV over every 64-row block (threads split the blocks), arguments checked by the caller. */
static int int4_a8_run(const void *x, int64_t ldx, const uint8_t *packed, const int4_meta *md, void *out,
                       int64_t ldo, int64_t m_count, int64_t n, int64_t kp, int64_t k, int64_t gs, int threads, int io) {
    if (io & ~3) return 1;
    a8_x a;
    if (a8_quantize(x, ldx, io & IO_X_F32, m_count, k, kp / A8, &a)) return 2;
    const qout o = {out, ldo, (io & IO_OUT_F32) != 0};
    const int64_t blocks = (n + 63) / 64, n_groups = kp / gs;
    const int par = threads > 1 && m_count * n * kp >= PAR_MIN && blocks > 1;
    /* Prompts: a block count the threads do not divide (576 rows: 9 blocks, 5 + 4 on 2 threads) leaves a thread
       idle for the last block; with many rows of x, each block's rows are split too (each output is computed
       alone, so the same bits). */
    const int64_t parts = par && m_count >= I4_SPLIT_MIN_M && blocks % threads ? threads : 1;
    const int64_t per = (m_count + parts - 1) / parts;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
    for (int64_t it = 0; it < blocks * parts; it++) {
        const int64_t b = it / parts, m0 = it % parts * per, m1 = m0 + per < m_count ? m0 + per : m_count;
        if (m0 < m1) int4_a8_rows(&a, m0, m1, packed + b * kp * 32, md, n_groups, gs, b * 64, n, o);
    }
    a8_free(&a);
    return 0;
}

/* llmsys_qgemv_int4's arguments and layout, x quantized per 32 columns (the a8 arithmetic above); offs:
   float32 offsets [n * o_n + g * o_g] (w = scale * q + offset, zeros not read), or NULL. */
int llmsys_qgemv_int4o_a8_io(const void *x, int64_t ldx, const uint8_t *packed, const void *scales, int64_t s_n,
                             int64_t s_g, int scale_kind, const uint8_t *zeros, int64_t z_n, int64_t z_g, const float *offs,
                             int64_t o_n, int64_t o_g, void *out, int64_t ldo, int64_t m_count, int64_t n, int64_t kp,
                             int64_t k, int64_t gs, int threads, int io) {
    if (m_count <= 0 || n <= 0 || gs % A8 || gs > 256 || kp % gs || k <= kp - gs || k > kp || ldx < k || ldo < n)
        return 1;
    const int4_meta md = {zeros, z_n, z_g, scales, s_n, s_g, scale_kind, offs, o_n, o_g, NULL, NULL, NULL, NULL, 0};
    return int4_a8_run(x, ldx, packed, &md, out, ldo, m_count, n, kp, k, gs, threads, io);
}

int llmsys_qgemv_int4o_a8(const uint16_t *x, int64_t ldx, const uint8_t *packed, const void *scales, int64_t s_n,
                          int64_t s_g, int scale_kind, const uint8_t *zeros, int64_t z_n, int64_t z_g, const float *offs,
                          int64_t o_n, int64_t o_g, uint16_t *out, int64_t ldo, int64_t m_count, int64_t n, int64_t kp,
                          int64_t k, int64_t gs, int threads) {
    return llmsys_qgemv_int4o_a8_io(x, ldx, packed, scales, s_n, s_g, scale_kind, zeros, z_n, z_g, offs, o_n, o_g, out,
                                    ldo, m_count, n, kp, k, gs, threads, 0);
}

/* llmsys_qgemv_int4o_a8 with GGUF Q4_K's scales as stored (int4_meta.ksc ..; group size 32): sc, m uint8
   [G, k_n], d, dmin fp16 [G / 8, k_n], group-major. */
int llmsys_qgemv_int4k_a8_io(const void *x, int64_t ldx, const uint8_t *packed, const uint8_t *ksc, const uint8_t *km,
                             const uint16_t *kd, const uint16_t *kdm, int64_t k_n, void *out, int64_t ldo,
                             int64_t m_count, int64_t n, int64_t kp, int64_t k, int threads, int io) {
    const int64_t gs = A8;
    if (m_count <= 0 || n <= 0 || kp % 256 || k <= kp - gs || k > kp || ldx < k || ldo < n || k_n < n) return 1;
    const int4_meta md = {NULL, 0, 0, NULL, 0, 0, 1, NULL, 0, 0, ksc, km, kd, kdm, k_n};
    return int4_a8_run(x, ldx, packed, &md, out, ldo, m_count, n, kp, k, gs, threads, io);
}

int llmsys_qgemv_int4k_a8(const uint16_t *x, int64_t ldx, const uint8_t *packed, const uint8_t *ksc, const uint8_t *km,
                          const uint16_t *kd, const uint16_t *kdm, int64_t k_n, uint16_t *out, int64_t ldo,
                          int64_t m_count, int64_t n, int64_t kp, int64_t k, int threads) {
    return llmsys_qgemv_int4k_a8_io(x, ldx, packed, ksc, km, kd, kdm, k_n, out, ldo, m_count, n, kp, k, threads, 0);
}

/* llmsys_qgemv_int4o_a8 with integer zero points (no offsets). */
int llmsys_qgemv_int4_a8(const uint16_t *x, int64_t ldx, const uint8_t *packed, const void *scales, int64_t s_n,
                         int64_t s_g, int scale_kind, const uint8_t *zeros, int64_t z_n, int64_t z_g, uint16_t *out,
                         int64_t ldo, int64_t m_count, int64_t n, int64_t kp, int64_t k, int64_t gs, int threads) {
    return llmsys_qgemv_int4o_a8(x, ldx, packed, scales, s_n, s_g, scale_kind, zeros, z_n, z_g, NULL, 0, 0, out, ldo,
                                 m_count, n, kp, k, gs, threads);
}

int llmsys_qgemv_int4_a8_io(const void *x, int64_t ldx, const uint8_t *packed, const void *scales, int64_t s_n,
                            int64_t s_g, int scale_kind, const uint8_t *zeros, int64_t z_n, int64_t z_g, void *out,
                            int64_t ldo, int64_t m_count, int64_t n, int64_t kp, int64_t k, int64_t gs, int threads, int io) {
    return llmsys_qgemv_int4o_a8_io(x, ldx, packed, scales, s_n, s_g, scale_kind, zeros, z_n, z_g, NULL, 0, 0, out, ldo,
                                    m_count, n, kp, k, gs, threads, io);
}

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
static __attribute__((unused)) void bf16_rows(const uint16_t *xb, int64_t ldx, int64_t m_count, int64_t k, const uint16_t *w, int64_t ldw,
                      qout out, int64_t n0, int64_t n1) {
    const int64_t full = k / 16 * 16;
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
        for (; n < n1; n++) {
            const uint16_t *wr = w + n * ldw;
            float a[16] = {0};
            for (int64_t i = 0; i < full; i += 16)
                for (int j = 0; j < 16; j++) a[j] = a[j] + bf(x[i + j]) * bf(wr[i + j]);
            put1(out, m, n, bf16_row_tail(a, x, wr, full, k));
        }
    }
}

#if defined(QG_AVX512) && defined(__AVX512BF16__)
/* The AVX512-BF16 build's bf16_rows (bf16_rows_lanes below), the same bits with vdpbf16ps (as int8_lane_tile's): x as lane pairs (lane_pairs),
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
   int8 batches' lane-pair tiles (rows_lanes). */
static void bf16_rows_lanes(const uint32_t *xs, int64_t nb, int64_t m_count, int64_t k, const uint16_t *w,
                            int64_t ldw, qout out, int64_t n0, int64_t n1) {
    __m512i *wb = m_count > 1 ? aligned_alloc(64, sizeof(__m512i) * (size_t)(nb * I8B_R)) : NULL;
    if (!wb) { /* one row of x, or out of memory: one weight row at a time for each row of x (the same bits) */
        for (int64_t m = 0; m < m_count; m++) bf16_rows_one(xs + m * nb * 16, nb, k, w, ldw, qout_at(out, m, 0), n0, n1);
        return;
    }
    rows_lanes(xs, nb, m_count, w, 1, ldw, k, NULL, out, n0, n1, wb);
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
 * layer kernels and the decode stack below), which needs a GEMV of their own; torch's own (MKL sgemv)
 * also ran 2.5x slower at M = 2..8 than at M = 1 (cpu_linear.py). A weight row at a time, front to back,
 * the row F1_AHEAD ahead prefetched (bf16_rows_one's one stream), every row of x against it while it sits
 * in L1. No FMA: the definition rounds the product before the add (memory-bound either way).
 */
#define F1_AHEAD 4

static void f32_rows(const float *x, int64_t ldx, int64_t m_count, int64_t k, const float *w, int64_t ldw,
                     float *out, int64_t ldo, int64_t n0, int64_t n1) {
    const int64_t full = k / 16 * 16;
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
#else
            float a[16] = {0};
#if defined(__AVX2__)
            __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
            for (int64_t i = 0; i < full; i += 16) {
                lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(wr + i)));
                hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(xr + i + 8), _mm256_loadu_ps(wr + i + 8)));
            }
            _mm256_storeu_ps(a, lo);
            _mm256_storeu_ps(a + 8, hi);
#else
            for (int64_t i = 0; i < full; i += 16)
                for (int j = 0; j < 16; j++) a[j] = a[j] + xr[i + j] * wr[i + j];
#endif
            for (int64_t j = 0; full + j < k; j++) a[j] = a[j] + xr[full + j] * wr[full + j];
            out[m * ldo + n] = ops_tree(a);
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

/* ------------------------------------------------------------ fused decode layers
 *
 * A decode step's layer in two calls instead of ~10: llmsys_layer_attn_in (input RMSNorm with its
 * residual add, then the q|k|v projection) and llmsys_layer_mlp (o_proj, the post-attention RMSNorm,
 * gate|up, silu * mul, down). Why: with the a8 GEMVs a SmolLM2-135M int4 decode step spent more time in
 * the Python and dispatch around the kernels (per linear call ~25-35 us of wrappers and module calls)
 * than in the kernels (benchmarks/profile_decode.py). The arithmetic is that of the separate kernels: the
 * RMSNorm and silu * mul rows of cpu_ops.h (what llmsys_rms_norm_bf16 and llmsys_silu_mul_bf16 run), the
 * a8 GEMVs above, a bias added as bf16(y + b): a layer computed fused or op by op gives the same bits
 * (tests/test_fused_layer.py), so which one runs never depends on the memory budget's answers.
 *
 * A projection is 1-4 weights (llmsys_qw) whose outputs lie side by side (q | k | v, gate | up: fused
 * into one weight or not, the same bits: each output row depends on its own weight row only).
 *
 * A float32 model's layer (llmsys_layer.f32) runs the same calls on float32 rows: float32 weights (kind 6,
 * f32_rows), biases and norm weights, cpu_ops.h's float32 RMSNorm and silu * mul rows.
 */

typedef struct {
    int64_t kind;          /* 0: int8 codes [N, K], bf16 scales [N]; 1: int4 in the CPU tiling; 2: bf16 [N, K];
                              3: int8 codes [N, K], fp16 block scales [nb, s_g] (group-major, one per 32 columns);
                              4: int8 codes [N, K], GGUF Q6_K's scales as stored: int8 sc per 16 columns (ksc
                                 [K / 16, s_g]) times fp16 d per 256 (kd [K / 256, s_g]);
                              5: int8 codes [N, K], float32 scales and offsets (offs) [K / 32, s_g] (GGUF Q5_K);
                              6: float32 [N, K] (rows kp elements apart; x and out float32, bias float32) */
    int64_t n, k, kp, gs;  /* rows, columns; int4: padded columns Kp = G * gs and the group size */
    const void *q;         /* the codes (bf16: the weight, rows of kp elements apart) */
    const void *scales;    /* int4: scales at [n * s_n + g * s_g] of scale_kind (0 bf16, 1 f32, 2 f16) */
    int64_t s_n, s_g, scale_kind;
    const uint8_t *zeros;  /* int4: zero points at [n * z_n + g * z_g] */
    int64_t z_n, z_g;
    const void *bias;      /* bf16 [N] (float32 for kind 6), or NULL */
    const float *offs;     /* int4: float32 offsets at [n * o_n + g * o_g] (int4_meta.offs), or NULL */
    int64_t o_n, o_g;
    const uint8_t *ksc, *km; /* int4: GGUF Q4_K's scales as stored (int4_meta.ksc ..; scales, zeros unused), or NULL */
    const uint16_t *kd, *kdm;
    int64_t k_n;
} llmsys_qw;

#define QW_MAX 4 /* weights per projection */

static int64_t qw_nb(const llmsys_qw *w) { return w->kind == 1 ? w->kp / A8 : (w->k + A8 - 1) / A8; }

/* weights that read x as it is (bf16 or float32), not as a8 blocks */
static int qw_plain(const llmsys_qw *w) { return w->kind == 2 || w->kind == 6; }

/* Rows of a work item: 32 for weights read a row at a time (bf16, float32), so a 576-row matrix splits 9 / 9
   between 2 threads, not 5 / 4 items of 64 (one thread idle a ninth of each o_proj and down_proj: measured as
   ~0.4 ms of a SmolLM2-135M bf16 decode step); 64 else (int4's blocks; int8's 16- or 32-row items measured no
   faster in the decode stack, here and in session 23). */
static int64_t qw_step(const llmsys_qw *w) { return qw_plain(w) ? 32 : 64; }

/* 0 when w is a weight of k columns the a8 GEMVs take (their own argument checks), else 1 */
static int qw_check(const llmsys_qw *w, int64_t k) {
    if (w->n <= 0 || w->k != k || !w->q) return 1;
    if (w->kind == 2 || w->kind == 6) return w->kp < k;
    if (w->kind == 1 && w->ksc) /* Q4_K's scales as stored: group 32, whole super-blocks */
        return !w->km || !w->kd || !w->kdm || w->gs != A8 || w->kp % 256 || k <= w->kp - w->gs || k > w->kp
               || w->k_n < w->n;
    if (w->kind == 4) return w->s_g < w->n || k % 256 || !w->ksc || !w->kd; /* Q6_K's stored scales */
    if (!w->scales) return 1;
    if (w->kind == 0) return 0;
    if (w->kind == 3) return w->s_g < w->n;
    if (w->kind == 5) return w->s_g < w->n || k % A8 || !w->offs || !w->scales;
    if (w->kind != 1 || w->gs <= 0 || w->gs % A8 || w->gs > 256 || w->kp % w->gs || k <= w->kp - w->gs || k > w->kp
        || !w->zeros || w->scale_kind < 0 || w->scale_kind > 2)
        return 1;
    return 0;
}

/* Rows [step it, step it + step) of w (step = qw_step(w)) against the m_count rows of x (contiguous bf16, read by bf16 weights; a: its
   a8 blocks, read by int8 / int4 weights; float32 for a float32 weight): out[m * ldo + n], bias added. */
static void qw_item(const llmsys_qw *w, const a8_x *a, const void *xv, const uint32_t *xs, int64_t m_count,
                    int64_t it, void *outv, int64_t ldo) {
    const int64_t step = qw_step(w), n0 = it * step, n1 = n0 + step < w->n ? n0 + step : w->n;
    if (w->kind == 6) {
        float *out = outv;
        f32_rows(xv, w->k, m_count, w->k, (const float *)w->q, w->kp, out, ldo, n0, n1);
        if (w->bias)
            for (int64_t m = 0; m < m_count; m++)
                for (int64_t n = n0; n < n1; n++) out[m * ldo + n] = out[m * ldo + n] + ((const float *)w->bias)[n];
        return;
    }
    const uint16_t *x = xv;
    uint16_t *out = outv;
    const qout o = {outv, ldo, 0}; /* the layers' activations: bf16 */
    if (w->kind == 2) {
#if defined(QG_AVX512) && defined(__AVX512BF16__)
        (void)x;
        bf16_rows_lanes(xs, (w->k + 31) / 32, m_count, w->k, (const uint16_t *)w->q, w->kp, o, n0, n1);
#else
        (void)xs;
        bf16_rows(x, w->k, m_count, w->k, (const uint16_t *)w->q, w->kp, o, n0, n1);
#endif
    } else if (w->kind == 0) {
        int8_a8_many(a, m_count, (const int8_t *)w->q, w->k, (const uint16_t *)w->scales, NULL, 0, o, n0, n1);
    } else if (w->kind == 3) {
        int8_a8_many(a, m_count, (const int8_t *)w->q, w->k, NULL, (const uint16_t *)w->scales, w->s_g, o, n0, n1);
    } else if (w->kind == 4 || w->kind == 5) { /* Q6_K: its stored scales (ksc, kd); Q5_K: scales and offsets */
        const int q6 = w->kind == 4;
        for (int64_t m = 0; m < m_count; m++)
            int8k_a8_rows(a, m, (const int8_t *)w->q, w->k, (const float *)w->scales, w->offs,
                          q6 ? (const int8_t *)w->ksc : NULL, q6 ? w->kd : NULL, w->s_g, o, n0, n1);
    } else {
        const int4_meta md = {w->zeros, w->z_n, w->z_g, w->scales, w->s_n, w->s_g, (int)w->scale_kind, w->offs,
                              w->o_n, w->o_g, w->ksc, w->km, w->kd, w->kdm, w->k_n};
        int4_a8_rows(a, 0, m_count, (const uint8_t *)w->q + it * w->kp * 32, &md, w->kp / w->gs, w->gs, n0, w->n, o);
    }
    if (w->bias)
        for (int64_t m = 0; m < m_count; m++)
            for (int64_t n = n0; n < n1; n++)
                out[m * ldo + n] = rne(bf(out[m * ldo + n]) + bf(((const uint16_t *)w->bias)[n]));
}

/* out [M, sum of n] = x [M, K] (contiguous) times each weight, side by side; x and out float32 (f32) or bf16:
   float32 weights then, no float32 weight else. 0, 1 bad weights, 2 no memory. */
static int proj_run(const llmsys_qw *ws, int64_t nw, const void *x, int64_t m_count, int64_t k, void *out, int f32,
                    int threads) {
    if (nw < 1 || nw > QW_MAX) return 1;
    a8_x a[QW_MAX];
    const a8_x *use[QW_MAX];
    int64_t first[QW_MAX + 1], col[QW_MAX], ldo = 0, work = 0;
    int made = 0, rc = 0;
    uint32_t *xs = NULL; /* x as lane pairs, for bf16 weights in the AVX512-BF16 build */
    first[0] = 0;
    for (int64_t j = 0; j < nw; j++) {
        if (qw_check(&ws[j], k) || (ws[j].kind == 6) != f32) { rc = 1; break; }
        use[j] = NULL;
#if defined(QG_AVX512) && defined(__AVX512BF16__)
        if (ws[j].kind == 2 && !xs && !(xs = lane_pairs(x, k, m_count, k, (k + 31) / 32))) { rc = 2; break; }
#endif
        if (!qw_plain(&ws[j])) {
            for (int64_t i = 0; i < j; i++) /* x's blocks are shared by weights with the same block count */
                if (!qw_plain(&ws[i]) && qw_nb(&ws[i]) == qw_nb(&ws[j])) { use[j] = use[i]; break; }
            if (!use[j]) {
                if (a8_quantize(x, k, 0, m_count, k, qw_nb(&ws[j]), &a[made])) { rc = 2; break; }
                use[j] = &a[made++];
            }
        }
        col[j] = ldo;
        ldo += ws[j].n;
        first[j + 1] = first[j] + (ws[j].n + qw_step(&ws[j]) - 1) / qw_step(&ws[j]);
        work += ws[j].n * (ws[j].kind == 1 ? ws[j].kp : ws[j].k);
    }
    if (!rc) {
        const int64_t items = first[nw];
        const int par = threads > 1 && items > 1 && m_count * work >= PAR_MIN;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
        for (int64_t it = 0; it < items; it++) {
            int64_t j = 0;
            while (it >= first[j + 1]) j++;
            qw_item(&ws[j], use[j], x, xs, m_count, it - first[j], (char *)out + (f32 ? 4 : 2) * col[j], ldo);
        }
    }
    free(xs);
    for (int i = 0; i < made; i++) a8_free(&a[i]);
    return rc;
}

/* rows of x [M, D] (+ res) RMSNormed into xn; with res, new_res = bf16(x + res) (float32 rows: x + res) */
static int norm_rows(const void *xv, const void *resv, const void *wv, float eps, void *xnv, void *new_resv,
                     int64_t m_count, int64_t d, int f32) {
    if (f32) {
        const float *x = xv, *res = resv;
        float *new_res = new_resv;
        for (int64_t t = 0; t < m_count; t++)
            ops_rms_norm_row_f32(x + t * d, res ? res + t * d : NULL, wv, (float *)xnv + t * d,
                                 res ? new_res + t * d : NULL, d, eps);
        return 0;
    }
    const uint16_t *x = xv, *res = resv, *w = wv;
    uint16_t *xn = xnv, *new_res = new_resv;
    float *h = malloc(sizeof(float) * (size_t)d);
    if (!h) return 2;
    for (int64_t t = 0; t < m_count; t++)
        ops_rms_norm_row(x + t * d, res ? res + t * d : NULL, w, xn + t * d, res ? new_res + t * d : NULL, d, eps, h);
    free(h);
    return 0;
}

/* One decoder layer's fixed arguments (built once per bound weights, kernels/cpu_qgemv.py DecodeLayer). */
typedef struct {
    const void *ln1, *ln2;     /* input and post-attention RMSNorm weights, [D] in the activations' dtype */
    float eps1, eps2;
    int64_t d, k_o;            /* hidden size; o_proj's input size (Hq D) */
    const llmsys_qw *qkv;      /* q | k | v: n_qkv weights side by side */
    int64_t n_qkv;
    const llmsys_qw *o;        /* one weight */
    const llmsys_qw *gu;       /* gate | up: n_gu weights side by side */
    int64_t n_gu;
    const llmsys_qw *down;     /* one weight */
    int64_t f32;               /* 1: float32 activations, weights (kind 6) and norm weights; 0: bf16 activations */
} llmsys_layer;

/* 0 when the layer's shapes fit together (what proj_run does not check itself), else 1 */
static int layer_check(const llmsys_layer *L, int64_t m_count) {
    if (m_count <= 0 || L->d <= 0 || L->d > (1 << 20) || L->o->n != L->d || L->down->n != L->d || L->n_gu < 1
        || L->n_gu > QW_MAX)
        return 1;
    int64_t two_i = 0;
    for (int64_t j = 0; j < L->n_gu; j++) two_i += L->gu[j].n;
    return two_i % 2 || L->down->k != two_i / 2;
}

/* The attention input: x [M, D] (the previous layer's MLP output; the embeddings with res NULL), res [M, D]
 * or NULL -> out [M, sum of q|k|v rows] = RMSNorm(x + res) times the q|k|v weights (+ bias), new_res [M, D]
 * = bf16(x + res) (not written when res is NULL). 0, 1 bad arguments, 2 no memory. */
int llmsys_layer_attn_in(const llmsys_layer *L, const void *x, const void *res, void *out, void *new_res,
                         int64_t m_count, int threads) {
    if (layer_check(L, m_count)) return 1;
    const int64_t d = L->d, f32 = L->f32 != 0;
    void *xn = malloc((f32 ? 4 : 2) * (size_t)(m_count * d));
    int rc = xn ? norm_rows(x, res, L->ln1, L->eps1, xn, new_res, m_count, d, f32) : 2;
    if (!rc) rc = proj_run(L->qkv, L->n_qkv, xn, m_count, d, out, f32, threads);
    free(xn);
    return rc;
}

/* The attention output to the MLP output: o [M, K_o] (attention heads side by side), res [M, D]
 * -> a = o times o; x = RMSNorm(a + res) (ln2); new_res = bf16(a + res);
 * out [M, D] = down(silu(gate(x)) * up(x)), gate | up the gu weights' outputs side by side (2 I).
 * 0, 1 bad arguments, 2 no memory. */
int llmsys_layer_mlp(const llmsys_layer *L, const void *o, const void *res, void *out, void *new_res,
                     int64_t m_count, int threads) {
    if (layer_check(L, m_count)) return 1;
    const int64_t d = L->d, f32 = L->f32 != 0;
    const size_t es = f32 ? 4 : 2;
    int64_t two_i = 0;
    for (int64_t j = 0; j < L->n_gu; j++) two_i += L->gu[j].n;
    const int64_t inter = two_i / 2;
    char *a = malloc(es * (size_t)(m_count * (2 * d + two_i + inter)));
    if (!a) return 2;
    char *xn = a + es * (size_t)(m_count * d), *g = xn + es * (size_t)(m_count * d),
         *y = g + es * (size_t)(m_count * two_i);
    int rc = proj_run(L->o, 1, o, m_count, L->k_o, a, f32, threads);
    if (!rc) rc = norm_rows(a, res, L->ln2, L->eps2, xn, new_res, m_count, d, f32);
    if (!rc) rc = proj_run(L->gu, L->n_gu, xn, m_count, d, g, f32, threads);
    if (!rc) {
        for (int64_t t = 0; t < m_count; t++) {
            if (f32) {
                const float *gt = (const float *)g + t * two_i;
                ops_silu_mul_row_f32(gt, gt + inter, (float *)y + t * inter, inter);
            } else {
                const uint16_t *gt = (const uint16_t *)g + t * two_i;
                ops_silu_mul_row(gt, gt + inter, (uint16_t *)y + t * inter, inter);
            }
        }
        rc = proj_run(L->down, 1, y, m_count, inter, out, f32, threads);
    }
    free(a);
    return rc;
}

/* ------------------------------------------------------------ the decode stack
 *
 * A decode step's decoder layers in one call: per layer llmsys_layer_attn_in, then RoPE + the K/V store +
 * decode attention (cpu_decode.c's llmsys_rope_store_attend_bf16, reached through a function pointer: the
 * two kernels are separate libraries), then llmsys_layer_mlp. The same calls in the same order on the same
 * arguments as the Python loop over DecoderLayer._forward_fused, so the same bits (tests/test_fused_decode.py
 * checks both against the op-by-op decoder). Why: that loop spent ~50 us of Python and ctypes per layer
 * around ~150 us of kernels (SmolLM2-135M int4, 30 layers: ~1.5 ms of a ~7 ms step, profile_decode.py). */

typedef int (*llmsys_rope_attend_fn)(const void *qkv, int64_t ld, void *k_pool, void *v_pool,
                                     const int64_t *slot_mapping, int64_t n_slots, const int64_t *pos,
                                     const float *cache, int64_t max_pos, int64_t t_count, int64_t hq, int64_t hk,
                                     int64_t d, const int64_t *gather_slots, const int64_t *lens, int64_t l_max,
                                     float scale, void *out, int threads);

typedef struct {
    const llmsys_layer *layer; /* the layer's fused decode arguments */
    void *k_pool, *v_pool;     /* its K/V pools, [n_slots, Hk, D] in the activations' dtype */
    int64_t table, tables;     /* it rotates with table `table` of the `tables` stacked in the RoPE cache */
    int64_t hq, hk, hd;        /* heads of q and of k/v, head dim */
    float scale;               /* attention's softmax scale */
} llmsys_stack_layer;

typedef struct {
    const llmsys_stack_layer *layers;
    int64_t n_layers;
    const void *rope_attend;       /* llmsys_rope_attend_fn (cpu_decode.c's, for the activations' dtype) */
    const int64_t *positions;      /* [M] RoPE rows of the step's tokens in the first table */
    const int64_t *slot_mapping;   /* [M] pool slot of each new token */
    int64_t n_slots;
    const float *cache;            /* the RoPE table [max_pos, rotary dim] */
    int64_t max_pos;
    const int64_t *gather_slots;   /* [M, l_max] context slots of each token */
    const int64_t *lens;           /* [M] context lengths */
    int64_t l_max;
} llmsys_stack;

/* h [M, D]: the embeddings -> out [M, D] the last layer's MLP output, res [M, D] its residual (the model's
 * hidden state is out + res, normed by the caller); bf16, or float32 when the layers are (f32). 0; 1 bad
 * arguments; 2 no memory; 100 * (layer + 1) + the attention's code when it rejects a layer's step. */
int llmsys_decode_stack(const llmsys_stack *S, const void *h, void *out, void *res, int64_t m_count, int threads) {
    if (!S || S->n_layers < 1 || m_count <= 0 || !S->rope_attend) return 1;
    const llmsys_rope_attend_fn attend = (llmsys_rope_attend_fn)S->rope_attend;
    const int64_t d = S->layers[0].layer->d, f32 = S->layers[0].layer->f32;
    const size_t es = f32 ? 4 : 2;
    int64_t qkv_max = 0, o_max = 0;
    for (int64_t i = 0; i < S->n_layers; i++) {
        const llmsys_stack_layer *s = &S->layers[i];
        if (s->layer->d != d || s->layer->f32 != f32 || s->layer->k_o != s->hq * s->hd || s->tables < 1
            || s->table < 0 || s->table >= s->tables)
            return 1;
        int64_t rows = 0;
        for (int64_t j = 0; j < s->layer->n_qkv; j++) rows += s->layer->qkv[j].n;
        if (rows != (s->hq + 2 * s->hk) * s->hd) return 1;
        if (rows > qkv_max) qkv_max = rows;
        if (s->hq * s->hd > o_max) o_max = s->hq * s->hd;
    }
    /* qkv, attention output, one hidden state and two residuals used in turn: no call writes what it reads */
    char *buf = malloc(es * (size_t)(m_count * (qkv_max + o_max + 3 * d)));
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)m_count); /* a later table's rows */
    if (!buf || !pos) { free(buf); free(pos); return 2; }
    int64_t pos_table = -1;
    char *qkv = buf, *o = qkv + es * (size_t)(m_count * qkv_max), *hb = o + es * (size_t)(m_count * o_max);
    char *rs[2] = {hb + es * (size_t)(m_count * d), hb + 2 * es * (size_t)(m_count * d)};
    const void *x = h, *r = NULL;
    int rc = 0;
    for (int64_t i = 0; i < S->n_layers; i++) {
        const llmsys_stack_layer *s = &S->layers[i];
        const int last = i == S->n_layers - 1;
        char *r_in = r == rs[0] ? rs[1] : rs[0]; /* never the residual it reads */
        void *r_out = last ? res : (r_in == rs[0] ? rs[1] : rs[0]), *h_out = last ? out : hb;
        rc = llmsys_layer_attn_in(s->layer, x, r, qkv, r_in, m_count, threads);
        if (rc) break;
        r = r ? r_in : x; /* layer 0: the residual is the embeddings themselves (attn_in does not write it) */
        const int64_t rows = (s->hq + 2 * s->hk) * s->hd;
        if (s->table && s->table != pos_table) { /* Attention.rope_positions: + table * rows per table */
            for (int64_t t = 0; t < m_count; t++) pos[t] = S->positions[t] + s->table * (S->max_pos / s->tables);
            pos_table = s->table;
        }
        rc = attend(qkv, rows, s->k_pool, s->v_pool, S->slot_mapping, S->n_slots, s->table ? pos : S->positions,
                    S->cache, S->max_pos,
                    m_count, s->hq, s->hk, s->hd, S->gather_slots, S->lens, S->l_max, s->scale, o, threads);
        if (rc) { rc += 100 * (int)(i + 1); break; }
        rc = llmsys_layer_mlp(s->layer, o, r, h_out, r_out, m_count, threads);
        if (rc) break;
        x = h_out;
        r = r_out;
    }
    free(buf);
    free(pos);
    return rc;
}
