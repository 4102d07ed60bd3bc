/* What the GEMV sources share (a8_gemv.c, dense_gemv.c, fused_layer.c): the ISA switches, prefetch
 * distances, where a GEMV writes (qout), x's int8 blocks (a8_x) and the int4 metadata (int4_meta), and the
 * row kernels one source runs for another, declared here with hidden visibility (not exported from the
 * library: the Python side reaches only the llmsys_* entry points).
 */
#ifndef LLMSYS_GEMV_COMMON_H
#define LLMSYS_GEMV_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_ops.h"
#include "isa.h" /* the ISA primitives: the kernels' paths outside the x86 AVX2 / AVX-512 tiles */
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
#define PAR_MIN (1 << 16)   /* multiply-adds below which one thread runs (no fork) */


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

/* How int4 group scales are stored (kernels/cpu_qgemv.py ScaleKind): read in place as float32. */
enum scale_kind { SCALE_BF16 = 0, SCALE_F32 = 1, SCALE_F16 = 2 };

/* One group's zero points and scales for the rows [row0, row0 + rows) of a block, rows past `rows`
   (padding) getting zero 0 and scale 0 (their sums are never written). zeros at z[n * z_n + g * z_g],
   scales at s[n * s_n + g * s_g]. */
typedef struct {
    const uint8_t *zeros;
    int64_t z_n, z_g;
    const void *scales;
    int64_t s_n, s_g;
    int kind;  /* scales: enum scale_kind */
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

#define A8 32 /* columns per activation block */
/* io flags of the *_io entry points: x float32 (else bf16), out float32 unrounded (else bf16) */
#define IO_X_F32 1
#define IO_OUT_F32 2
#define A8_AHEAD 4096 /* int4: bytes of the tiling prefetched ahead (4 activation blocks) */

#if defined(__AVX2__)
#define QA8_AVX2 1
#include <immintrin.h>
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

static inline void a8_free(a8_x *a) { free(a->q); free(a->q4); free(a->qu); free(a->d); free(a->s); }

#define QG_HIDDEN __attribute__((visibility("hidden")))

/* a8_gemv.c */
/* x [M, K] bf16 (or float32 with xf32) -> its int8 blocks (nb of them a row) in a; 0, or 1 with no memory. */
QG_HIDDEN int a8_quantize(const void *x, int64_t ldx, int xf32, int64_t m_count, int64_t k, int64_t nb, a8_x *a);
/* int8 codes [N, K] with bf16 row scales (bs NULL) or fp16 block scales bs [nb, bs_ld]: rows [n0, n1), all rows of x */
QG_HIDDEN void int8_a8_many(const a8_x *a, int64_t m_count, const int8_t *q, int64_t k, const uint16_t *scales,
                            const uint16_t *bs, int64_t bs_ld, qout out, int64_t n0, int64_t n1);
/* int8 codes with float32 scales and offsets (Q5_K) or Q6_K's stored scales (ksc, kd): rows [n0, n1), row m of x */
QG_HIDDEN void int8k_a8_rows(const a8_x *a, int64_t m, const int8_t *q, int64_t k, const float *fs, const float *fo,
                             const int8_t *ksc, const uint16_t *kd, int64_t f_ld, qout out, int64_t n0, int64_t n1);
/* one 64-row block of the CPU int4 tiling against x rows [m0, m1) */
QG_HIDDEN void int4_a8_rows(const a8_x *a, int64_t m0, int64_t m1, const uint8_t *blk, const int4_meta *md,
                            int64_t n_groups, int64_t gs, int64_t row0, int64_t n_rows, qout out);

/* dense_gemv.c */
/* float32 weight rows [n0, n1) against float32 x [M, K]: out[m * ldo + n] */
QG_HIDDEN void f32_rows(const float *x, int64_t ldx, int64_t m_count, int64_t k, const float *w, int64_t ldw,
                        float *out, int64_t ldo, int64_t n0, int64_t n1);
/* bf16 weight rows [n0, n1) against bf16 x [M, K] */
QG_HIDDEN void bf16_rows(const uint16_t *xb, int64_t ldx, int64_t m_count, int64_t k, const uint16_t *w, int64_t ldw,
                         qout out, int64_t n0, int64_t n1);
#if defined(QG_AVX512) && defined(__AVX512BF16__)
/* x bf16 [M, K] -> lane pairs [M, nb * 16] dwords (NULL with no memory), and bf16_rows on them */
QG_HIDDEN uint32_t *lane_pairs(const uint16_t *x, int64_t ldx, int64_t m_count, int64_t k, int64_t nb);
QG_HIDDEN void bf16_rows_lanes(const uint32_t *xs, int64_t nb, int64_t m_count, int64_t k, const uint16_t *w,
                               int64_t ldw, qout out, int64_t n0, int64_t n1);
#endif
#endif
