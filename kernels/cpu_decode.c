/* Decode-step kernels for the CPU: RMSNorm, SwiGLU's silu * mul, RoPE and decode attention, on bfloat16
 * or float32 rows (an `f32` argument; float32 skips every bf16 rounding below).
 *
 * Built for each ISA level and loaded for the running CPU by kernels/_cbuild.py
 * (gcc -O3 -march=<level> -fopenmp -ffp-contract=off -shared). Why: a
 * bfloat16 decode step of a small model spends as long in small torch ops
 * (upcasts, elementwise, softmax, their dispatch) as in its GEMVs; each kernel
 * here replaces 4-12 of them with one call. The engine uses these kernels for
 * every CPU bfloat16 and float32 step that computes the op (prefill and decode,
 * resident or streamed layers), so all paths give the same bits.
 *
 * Arithmetic (documented because tests/test_cpu_decode.py holds the torch
 * definitions in kernels/cpu_decode.py to it):
 *   - bf16 -> f32 is exact; f32 -> bf16 rounds to nearest even (torch's).
 *   - No fused multiply-adds (-ffp-contract=off): every product and sum is
 *     one float32 rounding, so the torch definitions can reproduce them.
 *   - Dot products and sums of squares accumulate in 16 float32 lanes, lane j
 *     taking elements j, j+16, j+32, ... in order, then reduce the lanes as a
 *     tree: lanes i + (i+8), then i + (i+4), then i + (i+2), then i + (i+1).
 *
 * rms_norm:  h = residual ? bf16(x + residual) : x
 *            ms = sumsq(h) / D;  r = 1 / sqrt(ms + eps)
 *            out = bf16(w * bf16(h * r))      (HF LlamaRMSNorm's roundings)
 * silu_mul:  out = bf16(bf16(g / (1 + expf(-g))) * u)
 *            (the RMSNorm and silu_mul rows live in cpu_ops.h: the fused a8 layers of fused_layer.c
 *            run the same code)
 * rope:      out = bf16(x * [cos, cos] + [x2, x1] * [-sin, sin])  (kernels.rope's reference, exactly)
 * attention: per sequence b, query head h (KV head h / G):
 *            s_l = dot(q, k_l) * scale for l < len_b;  m = max s
 *            e_l = ops_exp(s_l - m) (cpu_ops.h);  z = sum_l e_l (in order);  p_l = e_l / z
 *            out = bf16(sum_l p_l * v_l)    (in order of l, per element)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_decode.h"
#include "cpu_ops.h"
#include "isa.h"

int llmsys_rms_norm(const void *x, const void *res, const void *w, void *out, void *new_res, int64_t rows,
                    int64_t d, float eps, int f32, int threads) {
    if (d <= 0 || d > (1 << 20)) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * d >= (1 << 16))
    for (int64_t t = 0; t < rows; t++) {
        if (f32) {
            ops_rms_norm_row_f32((const float *)x + t * d, res ? (const float *)res + t * d : NULL, w,
                                 (float *)out + t * d, res ? (float *)new_res + t * d : NULL, d, eps);
            continue;
        }
        float *h = malloc(sizeof(float) * (size_t)d);
        ops_rms_norm_row((const uint16_t *)x + t * d, res ? (const uint16_t *)res + t * d : NULL, w,
                         (uint16_t *)out + t * d, res ? (uint16_t *)new_res + t * d : NULL, d, eps, h);
        free(h);
    }
    return 0;
}

/* SwiGLU's product y [T, I] (contiguous) = silu(g) * u, g and u [T, I] rows of strides ldg, ldu (cpu_ops.h);
   bf16 (f32 = 0) or float32 (f32 = 1). */
int llmsys_silu_mul(const void *g, int64_t ldg, const void *u, int64_t ldu, void *y, int64_t rows, int64_t inter,
                    int f32, int threads) {
    if (inter <= 0 || ldg < inter || ldu < inter) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inter >= (1 << 16))
    for (int64_t t = 0; t < rows; t++) {
        if (f32)
            ops_silu_mul_row_f32((const float *)g + t * ldg, (const float *)u + t * ldu, (float *)y + t * inter, inter);
        else
            ops_silu_mul_row((const uint16_t *)g + t * ldg, (const uint16_t *)u + t * ldu, (uint16_t *)y + t * inter,
                             inter);
    }
    return 0;
}

/* gpt-oss's clamped SwiGLU y [T, I] (contiguous) of g and u [T, I] rows of strides ldg, ldu (cpu_ops.h
   ops_cswiglu_row); bf16 (f32 = 0) or float32 (f32 = 1). */
int llmsys_clamped_swiglu(const void *g, int64_t ldg, const void *u, int64_t ldu, void *y, int64_t rows, int64_t inter,
                          float alpha, float limit, int f32, int threads) {
    if (inter <= 0 || ldg < inter || ldu < inter) return 1;
    const size_t es = f32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inter >= (1 << 16))
    for (int64_t t = 0; t < rows; t++)
        ops_cswiglu_row((const char *)g + es * (size_t)(t * ldg), (const char *)u + es * (size_t)(t * ldu),
                        (char *)y + es * (size_t)(t * inter), inter, alpha, limit, f32);
    return 0;
}

/* element i of a bf16 (f32 = 0) or float32 array, as float32; and a float32 value stored (rounded for bf16) */
static inline float ld_el(const void *p, int64_t i, int f32) {
    return f32 ? ((const float *)p)[i] : bf(((const uint16_t *)p)[i]);
}
static inline void st_el(void *p, int64_t i, float v, int f32) {
    if (f32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = rne(v);
}

/* x [T, H, D] rows with row stride `stride` (elements between tokens), out [T, H, D] contiguous. */
static void rope_one(const void *x, int64_t stride, void *out, const int64_t *pos, const float *cache,
                     int64_t t_count, int64_t heads, int64_t d, int f32) {
    int64_t half = d / 2;
    for (int64_t t = 0; t < t_count; t++) {
        const float *cs = cache + pos[t] * d; /* cos | sin */
        for (int64_t hh = 0; hh < heads; hh++) {
            const int64_t xr = t * stride + hh * d, o = (t * heads + hh) * d;
            for (int64_t i = 0; i < half; i++) {
                float x1 = ld_el(x, xr + i, f32), x2 = ld_el(x, xr + i + half, f32), c = cs[i], s = cs[half + i];
                float a = x1 * c, b = x2 * -s;
                st_el(out, o + i, a + b, f32);
                float a2 = x2 * c, b2 = x1 * s;
                st_el(out, o + i + half, a2 + b2, f32);
            }
        }
    }
}

/* bf16 (f32 = 0) or float32 (f32 = 1) q, k, outputs */
int llmsys_rope(const void *q, int64_t q_stride, const void *k, int64_t k_stride, void *q_out, void *k_out,
                const int64_t *pos, const float *cache, int64_t max_pos, int64_t t_count, int64_t hq, int64_t hk,
                int64_t d, int f32) {
    if (d % 2) return 1;
    for (int64_t t = 0; t < t_count; t++)
        if (pos[t] < 0 || pos[t] >= max_pos) return 2;
    rope_one(q, q_stride, q_out, pos, cache, t_count, hq, d, f32);
    rope_one(k, k_stride, k_out, pos, cache, t_count, hk, d, f32);
    return 0;
}

/* RoPE on q (-> q_out) and k, with k and v written straight into their pool rows:
 * token t's k and v go to row slots[t] of k_pool / v_pool ([slots, Hk, D]); slots[t] < 0 skips the token.
 * All bf16 (f32 = 0) or all float32 (f32 = 1). */
int llmsys_rope_store(const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                      int64_t v_stride, void *q_out, void *k_pool, void *v_pool, const int64_t *slots, int64_t n_slots,
                      const int64_t *pos, const float *cache, int64_t max_pos, int64_t t_count, int64_t hq, int64_t hk,
                      int64_t d, int f32) {
    if (d % 2) return 1;
    for (int64_t t = 0; t < t_count; t++) {
        if (pos[t] < 0 || pos[t] >= max_pos) return 2;
        if (slots[t] >= n_slots) return 3;
    }
    const size_t es = f32 ? 4 : 2;
    rope_one(q, q_stride, q_out, pos, cache, t_count, hq, d, f32);
    for (int64_t t = 0; t < t_count; t++) {
        if (slots[t] < 0) continue;
        rope_one((const char *)k + es * (size_t)(t * k_stride), 0, (char *)k_pool + es * (size_t)(slots[t] * hk * d),
                 pos + t, cache, 1, hk, d, f32);
        memcpy((char *)v_pool + es * (size_t)(slots[t] * hk * d), (const char *)v + es * (size_t)(t * v_stride),
               es * (size_t)(hk * d));
    }
    return 0;
}

/* d elements of a bf16 (f32 = 0) or float32 (f32 = 1) array from element `at`, as float32. */
static inline void load_row(const void *base, int64_t at, int f32, float *dst, int64_t d) {
    if (f32) {
        memcpy(dst, (const float *)base + at, sizeof(float) * (size_t)d);
    } else {
        const uint16_t *src = (const uint16_t *)base + at;
        for (int64_t i = 0; i < d; i++) dst[i] = bf(src[i]);
    }
}

#if defined(__AVX2__)
/* 8 elements of a bf16 (f32 = 0) or float32 row from element `at`, as float32 */
static inline __m256 load8(const void *base, int64_t at, int f32) {
    return f32 ? _mm256_loadu_ps((const float *)base + at) : ops_bf8((const uint16_t *)base + at);
}

#define ATT_VEC 1
#endif

#if defined(__AVX512F__)
/* 16 elements of a bf16 (f32 = 0) or float32 row from element `at`, as float32 */
static inline __m512 load16(const void *base, int64_t at, int f32) {
    return f32 ? _mm512_loadu_ps((const float *)base + at)
               : _mm512_castsi512_ps(_mm512_slli_epi32(
                     _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at))), 16));
}
#endif

/* ops_dot_f32(q, row) for a row of d % 16 == 0 elements read in place, lanes 0-15 in one 512-bit register
   (AVX-512) or lanes 0-7 and 8-15 in two, then ops_tree's order (i + (i+8), i + (i+4), i + (i+2), i + (i+1)). */
#ifdef ATT_VEC
static inline float dot_row16(const float *q, const void *base, int64_t at, int f32, int64_t d) {
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(q + i), load16(base, at + i, f32)));
    const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
#else
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
        lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(q + i), load8(base, at + i, f32)));
        hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(q + i + 8), load8(base, at + i + 8, f32)));
    }
    const __m256 t8 = _mm256_add_ps(lo, hi);
#endif
    const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
    const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}

/* acc[0 .. 64) += p_l * v_l[c .. c + 64) for l < len, in order of l, held in registers over the whole context
   (the bits of the element-by-element loop: each element's sum is its own chain). */
static inline void pv_chunk64(const float *p, const void *v, const int64_t *rows, int64_t len, int64_t c, int f32,
                              float *acc) {
#if defined(__AVX512F__)
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t l = 0; l < len; l++) {
        const __m512 pv = _mm512_set1_ps(p[l]);
        const int64_t at = rows[l] + c;
        a0 = _mm512_add_ps(a0, _mm512_mul_ps(pv, load16(v, at, f32)));
        a1 = _mm512_add_ps(a1, _mm512_mul_ps(pv, load16(v, at + 16, f32)));
        a2 = _mm512_add_ps(a2, _mm512_mul_ps(pv, load16(v, at + 32, f32)));
        a3 = _mm512_add_ps(a3, _mm512_mul_ps(pv, load16(v, at + 48, f32)));
    }
    _mm512_storeu_ps(acc, a0);
    _mm512_storeu_ps(acc + 16, a1);
    _mm512_storeu_ps(acc + 32, a2);
    _mm512_storeu_ps(acc + 48, a3);
#else
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t l = 0; l < len; l++) {
        const __m256 pv = _mm256_set1_ps(p[l]);
        const int64_t at = rows[l] + c;
        for (int i = 0; i < 8; i++) a[i] = _mm256_add_ps(a[i], _mm256_mul_ps(pv, load8(v, at + 8 * i, f32)));
    }
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + 8 * i, a[i]);
#endif
}
#endif

/* One query head against its context of len keys: q_row (d floats), K/V rows srow[0 .. len) by slot (or rows
   base .. base + len of gathered K/V when srow is NULL); s: len floats of scratch, rows: len
   int64 of scratch, row / acc: d floats each. Writes acc (the head's output in float32). Vectorised (d % 16 ==
   0): the scores a row at a time, the softmax's exps 8 at a time, p_l = e_l / z 8 at a time (a correctly rounded
   division either way), the output 64 elements at a time in registers over the whole context. */
static void attend_head(const float *qf, const void *k, const void *v, const int64_t *srow, int64_t base,
                        int64_t len, int64_t hk, int64_t j, int64_t d, int f32, float scale, float *s, int64_t *rows,
                        float *row, float *acc) {
#ifdef ATT_VEC
    const int vec = d % 16 == 0;
#else
    const int vec = 0;
#endif
    for (int64_t l = 0; l < len; l++) rows[l] = ((srow ? srow[l] : base + l) * hk + j) * d;
    for (int64_t l = 0; l < len; l++) { /* scores */
#ifdef ATT_VEC
        if (vec) {
            s[l] = dot_row16(qf, k, rows[l], f32, d) * scale;
            continue;
        }
#endif
        s[l] = (f32 ? isa_dot_f32(qf, (const float *)k + rows[l], d) : isa_dot_f32_bf16(qf, (const uint16_t *)k + rows[l], d))
               * scale; /* NEON / SSE / C: ops_dot_f32's order */
    }
    float m = -INFINITY, z = 0.0f;
    for (int64_t l = 0; l < len; l++) m = s[l] > m ? s[l] : m;
    int64_t l = 0;
#ifdef ATT_VEC
    const __m256 mv = _mm256_set1_ps(m);
    for (; l + 8 <= len; l += 8) _mm256_storeu_ps(s + l, ops_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + l), mv)));
#endif
    isa_exp_sub(s + l, len - l, m);
    for (l = 0; l < len; l++) z = z + s[l]; /* in order */
    l = 0;
#ifdef ATT_VEC
    const __m256 zv = _mm256_set1_ps(z);
    for (; l + 8 <= len; l += 8) _mm256_storeu_ps(s + l, _mm256_div_ps(_mm256_loadu_ps(s + l), zv));
#endif
    for (; l < len; l++) s[l] = s[l] / z;
    int64_t i = 0;
#ifdef ATT_VEC
    for (; i + 64 <= d; i += 64) pv_chunk64(s, v, rows, len, i, f32, acc + i);
#endif
    if (i == d) return;
    for (int64_t e = i; e < d; e++) acc[e] = 0.0f;
    for (l = 0; l < len; l++) { /* every output element sums over l in order */
        const float p = s[l];
        int64_t e = i;
#ifdef ATT_VEC
        const __m256 pv = _mm256_set1_ps(p);
        for (; e + 8 <= d; e += 8)
            _mm256_storeu_ps(acc + e, _mm256_add_ps(_mm256_loadu_ps(acc + e), _mm256_mul_ps(pv, load8(v, rows[l] + e, f32))));
        if (e < d) load_row(v, rows[l], f32, row, d);
        for (; e < d; e++) acc[e] = acc[e] + p * row[e];
#else
        isa_axpy(acc + e, p, f32 ? (const void *)((const float *)v + rows[l] + e) : (const void *)((const uint16_t *)v + rows[l] + e),
                 f32, d - e);
#endif
    }
}

/* The rows' shapes and key ranges checked (1: shapes, 2: a row's keys outside 0 .. l_max or a negative
   sequence), and *work = the keys all rows attend (for the threading threshold). */
static int rows_checked(const int64_t *seq, const int64_t *first, const int64_t *lens, int64_t rows, int64_t l_max,
                        int64_t hq, int64_t hk, int64_t d, int64_t *work) {
    if (hk <= 0 || hq % hk || d <= 0 || d > 1024) return 1;
    *work = 0;
    for (int64_t b = 0; b < rows; b++) {
        const int64_t f = first ? first[b] : 0;
        if (lens[b] < 1 || lens[b] > l_max || f < 0 || f >= lens[b] || (seq && seq[b] < 0)) return 2;
        *work += lens[b] - f;
    }
    return 0;
}

/* q [B, Hq, D]; k, v: rows of [Hk, D]: with slots [S, L], row slots[seq[b], l] of the pool, else row seq[b] * L + l
 * (gathered); seq [B] (NULL: seq[b] = b); row b attends keys first[b] .. lens[b] - 1 (first NULL: from 0); out
 * [B, Hq, D]. All bf16 (f32 = 0) or all float32 (f32 = 1). One query head per work item (each head's arithmetic
 * is its own, so the split never changes a bit). Why rows of any sequence: a prompt token runs the very
 * arithmetic of a decode step at its position (llmsys_rows_attention), so its bits do not depend on the chunk,
 * the batch or a prefix-cache hit (kernels/cpu_attention.py). */
static int attention_rows(const void *q, const void *k, const void *v, const int64_t *slots, const int64_t *seq,
                          const int64_t *first, const int64_t *lens, float scale, void *out, int64_t b_count,
                          int64_t l_max, int64_t hq, int64_t hk, int64_t d, int f32, int threads) {
    int64_t work = 0;
    const int rc = rows_checked(seq, first, lens, b_count, l_max, hq, hk, d, &work);
    if (rc) return rc;
    const int64_t g = hq / hk;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (b_count * hq > 1 && work * hq * d >= (1 << 14))
    for (int64_t item = 0; item < b_count * hq; item++) {
        const int64_t b = item / hq, h = item % hq, f = first ? first[b] : 0, len = lens[b] - f;
        const int64_t sb = seq ? seq[b] : b;
        float *s = malloc(sizeof(float) * (size_t)(len + 3 * d) + sizeof(int64_t) * (size_t)len);
        if (!s) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        float *qf = s + len, *row = qf + d, *acc = row + d;
        int64_t *rows = (int64_t *)(acc + d);
        load_row(q, (b * hq + h) * d, f32, qf, d);
        attend_head(qf, k, v, slots ? slots + sb * l_max + f : NULL, sb * l_max + f, len, hk, h / g, d, f32, scale, s,
                    rows, row, acc);
        const int64_t o = (b * hq + h) * d;
        if (f32) {
            memcpy((float *)out + o, acc, sizeof(float) * (size_t)d);
        } else {
            for (int64_t i = 0; i < d; i++) ((uint16_t *)out)[o + i] = rne(acc[i]);
        }
        free(s);
    }
    return failed ? 3 : 0;
}

/* One query per sequence (decode): attention_rows with seq[b] = b, every key from 0. */
int llmsys_decode_attention(const void *q, const void *k, const void *v, const int64_t *slots, const int64_t *lens,
                            float scale, void *out, int64_t b_count, int64_t l_max, int64_t hq, int64_t hk, int64_t d,
                            int f32, int threads) {
    return attention_rows(q, k, v, slots, NULL, NULL, lens, scale, out, b_count, l_max, hq, hk, d, f32, threads);
}

#if defined(__AVX2__)
/* Prompt rows in blocks (AVX-512 and AVX2). Why: one query head at a time (attention_rows) re-reads and
 * re-widens every K / V row per query and runs one serial chain per sum; a 2048-token prompt's attention took
 * ~5x SDPA's time. Here a run of consecutive tokens of one sequence (at most ROWS_Q query heads, ROWS_S floats
 * of scores) and the G query heads of one KV head form a work item: each K / V row is widened to float32 once
 * per item, in chunks of ROWS_KC keys. Each query still gets exactly attend_head's bits:
 *   - scores: K transposed to [D][ROWS_KC]; for 16 keys, accumulator vector j (one lane per key) is dot_row16's
 *     lane j (elements j, j+16, ... in order, from zero), then the same tree (j + (j+8), j + (j+4), j + (j+2),
 *     j + (j+1)) as vertical adds, then * scale (scores_tile). For bf16 q and k each multiply-add is one fma
 *     where no product can round (fma_safe): the same bits;
 *   - m the max of the query's scores (its value: only a zero m's sign could differ, and s - m and
 *     ops_exp(s - m) do not depend on it);
 *   - e = ops_exp8's operations 16 lanes at a time (ops_exp's bits), z summed in order of l (8 queries'
 *     chains side by side), p = e / z (correctly rounded);
 *   - out[e] = sum over l in order of p_l * v_l[e] (multiply, then add) from zero, carried in memory between
 *     chunks, up to ROWS_PV_Q queries with the same keys sharing each loaded row of V.
 * Keys at a query's 16-key blocks' ends outside its range are scored and never used. The two ISAs differ only
 * in v16 (one 512-bit register or two 256-bit ones), the register tiles' sizes and the widening. */
#define ROWS_Q 192 /* query heads per work item (tokens x G), at most */
#define ROWS_S (1 << 21) /* floats of scores per work item, at most (unless one token alone needs more) */
#define ROWS_KC 128 /* keys per chunk of K / V widened to float32 (a multiple of 16) */

/* 16 float32 lanes and the operations the blocked rows use */
#if defined(__AVX512F__)
typedef __m512 v16;
#define ROWS_SC_C 4 /* score chains per pass of scores_tile (x 3 queries x ROWS_SC_KB blocks in registers) */
#define ROWS_SC_KB 2 /* 16-key blocks per scores_tile */
#define ROWS_PV_Q 4 /* queries per p @ V tile */
#define ROWS_PV_W 4 /* v16 columns per p @ V tile */
static inline v16 v16_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v16_store(float *p, v16 x) { _mm512_storeu_ps(p, x); }
static inline v16 v16_set1(float x) { return _mm512_set1_ps(x); }
static inline v16 v16_zero(void) { return _mm512_setzero_ps(); }
static inline v16 v16_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v16_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
static inline v16 v16_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v16_div(v16 a, v16 b) { return _mm512_div_ps(a, b); }
static inline v16 v16_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v16_max(v16 a, v16 b) { return _mm512_max_ps(a, b); } /* a > b ? a : b per lane */
#define V16_PIN(x) __asm__("" : "+v"(x)) /* keep x in a register (one load shared, not one per use) */
/* ops_exp8 on 16 floats: the same operations in the same order, masks for the blends (the bits of ops_exp8,
   compared on all 2^32 inputs when written) */
static inline __m512 exp16(__m512 x) {
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __mmask16 big = _mm512_cmp_ps_mask(x, _mm512_set1_ps(OPS_EXP_HI), _CMP_GT_OQ);
    const __mmask16 small = _mm512_cmp_ps_mask(x, _mm512_set1_ps(OPS_EXP_LO), _CMP_LT_OQ);
    const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(OPS_EXP_LO)), _mm512_set1_ps(OPS_EXP_HI));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(OPS_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(_mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(OPS_C1))), _mm512_mul_ps(n, _mm512_set1_ps(OPS_C2)));
    __m512 p = _mm512_set1_ps(OPS_P0);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(OPS_P1));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(OPS_P2));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(OPS_P3));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(OPS_P4));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(OPS_P5));
    const __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(126)), 23);
    __m512 v = _mm512_mul_ps(_mm512_mul_ps(y, _mm512_castsi512_ps(e)), _mm512_set1_ps(2.0f));
    v = _mm512_mask_blend_ps(small, v, _mm512_setzero_ps());
    v = _mm512_mask_blend_ps(big, v, _mm512_set1_ps(INFINITY));
    return _mm512_mask_blend_ps(nan, v, x);
}
static inline v16 v16_exp(v16 x) { return exp16(x); }
#else
typedef struct {
    __m256 lo, hi;
} v16;
#define ROWS_SC_C 2
#define ROWS_SC_KB 1
#define ROWS_PV_Q 2
#define ROWS_PV_W 2
static inline v16 v16_load(const float *p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void v16_store(float *p, v16 x) {
    _mm256_storeu_ps(p, x.lo);
    _mm256_storeu_ps(p + 8, x.hi);
}
static inline v16 v16_set1(float x) { return (v16){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline v16 v16_zero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline v16 v16_add(v16 a, v16 b) { return (v16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline v16 v16_sub(v16 a, v16 b) { return (v16){_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline v16 v16_mul(v16 a, v16 b) { return (v16){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline v16 v16_div(v16 a, v16 b) { return (v16){_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
static inline v16 v16_fma(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline v16 v16_max(v16 a, v16 b) { return (v16){_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
#define V16_PIN(x) __asm__("" : "+x"((x).lo), "+x"((x).hi))
static inline v16 v16_exp(v16 x) { return (v16){ops_exp8(x.lo), ops_exp8(x.hi)}; }
#endif

/* acc + x * y: multiply then add, or (fma: only where x * y is exact, fma_safe) one fused operation: the same bits */
static inline v16 mac(v16 acc, v16 x, v16 y, const int fma) {
    return fma ? v16_fma(x, y, acc) : v16_add(acc, v16_mul(x, y));
}

/* Is the float x (a bf16 value widened) fma-safe: zero, or |x| in [2^-63, 2^63)? Why: a product of two bf16
   values has at most 16 significant bits, so it is exact unless it underflows or overflows, and then
   fma(q, k, acc) rounds acc + q * k once, exactly as acc + round(q * k) does: the same bits as the multiply then
   add, in half the instructions. Subnormal, tiny, huge, inf and NaN values are not safe. */
static inline int fma_safe(float x) {
    uint32_t a;
    memcpy(&a, &x, 4);
    a &= 0x7fffffffu;
    return a == 0 || a - (64u << 23) < ((190u - 64u) << 23);
}

#if defined(__AVX512F__)

/* r[0 .. 16) rows of 16 floats -> columns (r[c][i] = old r[i][c]) */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), e = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* up to 16 elements (mask) of a bf16 (f32 = 0) or float32 row from element `at`, as float32, zeros elsewhere */
static inline __m512 load16m(const void *base, int64_t at, int f32, __mmask16 m) {
    return f32 ? _mm512_maskz_loadu_ps(m, (const float *)base + at)
               : _mm512_castsi512_ps(_mm512_slli_epi32(
                     _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)base + at)), 16));
}

/* lanes of x that are not fma_safe */
static inline __mmask16 fma_unsafe(__m512 x) {
    const __m512i a = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
    const __mmask16 zero = _mm512_cmpeq_epi32_mask(a, _mm512_setzero_si512());
    const __mmask16 in = _mm512_cmplt_epu32_mask(_mm512_sub_epi32(a, _mm512_set1_epi32(64 << 23)),
                                                 _mm512_set1_epi32((190 - 64) << 23));
    return (__mmask16)~(zero | in);
}

/* rows[0 .. cn) (element offsets) widened to float32: with v NULL, the keys transposed, kt[i * ROWS_KC + c] =
   k_c[i] (i < d, c < round16(cn), zero columns past cn), returning whether every value is fma-safe (bf16 only);
   else the values as rows, vf[c * dp + i] = v_c[i] (zero past d), returning 0. */
static int rows_widen(const void *k, const void *v, const int64_t *rows, int64_t cn, int64_t d, int64_t dp, int f32,
                      float *kt, float *vf) {
    if (v) { /* V rows as they are */
        for (int64_t c = 0; c < cn; c++)
            for (int64_t i0 = 0; i0 < d; i0 += 16)
                _mm512_storeu_ps(vf + c * dp + i0, load16m(v, rows[c] + i0, f32, d - i0 >= 16 ? 0xffff : (__mmask16)((1u << (d - i0)) - 1)));
        return 0;
    }
    __mmask16 unsafe = 0;
    for (int64_t c0 = 0; c0 < cn; c0 += 16) {
        for (int64_t i0 = 0; i0 < d; i0 += 16) {
            const __mmask16 m = d - i0 >= 16 ? 0xffff : (__mmask16)((1u << (d - i0)) - 1);
            __m512 r[16];
            for (int c = 0; c < 16; c++) {
                if (c0 + c >= cn) {
                    r[c] = _mm512_setzero_ps();
                    continue;
                }
                r[c] = load16m(k, rows[c0 + c] + i0, f32, m);
                unsafe |= fma_unsafe(r[c]);
            }
            transpose16(r);
            for (int64_t i = 0; i < 16 && i0 + i < d; i++) _mm512_storeu_ps(kt + (i0 + i) * ROWS_KC + c0, r[i]);
        }
    }
    return !f32 && !unsafe;
}

#else
/* rows_widen without AVX-512: the same layout and answer, element by element */
static int rows_widen(const void *k, const void *v, const int64_t *rows, int64_t cn, int64_t d, int64_t dp, int f32,
                      float *kt, float *vf) {
    if (v) {
        for (int64_t c = 0; c < cn; c++) {
            load_row(v, rows[c], f32, vf + c * dp, d);
            for (int64_t i = d; i < dp; i++) vf[c * dp + i] = 0.0f;
        }
        return 0;
    }
    int safe = !f32;
    const int64_t cp = (cn + 15) / 16 * 16;
    for (int64_t c = 0; c < cp; c++)
        for (int64_t i = 0; i < d; i++) {
            const float x = c < cn ? ld_el(k, rows[c] + i, f32) : 0.0f;
            kt[i * ROWS_KC + c] = x;
            safe &= fma_safe(x);
        }
    return safe;
}
#endif

/* z_i = sum over l in [a_i, e_i) of s_i[l] in order of l (from zero), for q <= 8 queries at once: the common
   range in lockstep (q independent chains), the ends one query at a time. */
static void z_sums(float *const *s, const int64_t *a, const int64_t *e, int q, float *z) {
    float zz[8];
    int64_t lo = a[0], hi = e[0];
    for (int i = 0; i < q; i++) {
        zz[i] = 0.0f;
        lo = a[i] > lo ? a[i] : lo;
        hi = e[i] < hi ? e[i] : hi;
    }
    if (lo >= hi) { /* no common range */
        for (int i = 0; i < q; i++)
            for (int64_t l = a[i]; l < e[i]; l++) zz[i] = zz[i] + s[i][l];
    } else {
        for (int i = 0; i < q; i++)
            for (int64_t l = a[i]; l < lo; l++) zz[i] = zz[i] + s[i][l];
        if (q == 8) {
            float z0 = zz[0], z1 = zz[1], z2 = zz[2], z3 = zz[3], z4 = zz[4], z5 = zz[5], z6 = zz[6], z7 = zz[7];
            for (int64_t l = lo; l < hi; l++) {
                z0 = z0 + s[0][l]; z1 = z1 + s[1][l]; z2 = z2 + s[2][l]; z3 = z3 + s[3][l];
                z4 = z4 + s[4][l]; z5 = z5 + s[5][l]; z6 = z6 + s[6][l]; z7 = z7 + s[7][l];
            }
            zz[0] = z0; zz[1] = z1; zz[2] = z2; zz[3] = z3; zz[4] = z4; zz[5] = z5; zz[6] = z6; zz[7] = z7;
        } else {
            for (int64_t l = lo; l < hi; l++)
                for (int i = 0; i < q; i++) zz[i] = zz[i] + s[i][l];
        }
        for (int i = 0; i < q; i++)
            for (int64_t l = hi; l < e[i]; l++) zz[i] = zz[i] + s[i][l];
    }
    for (int i = 0; i < q; i++) z[i] = zz[i];
}

/* Scores of Q queries (qf[q]) x KB blocks of 16 keys (kt columns + 16 kb): out[q][16 kb + c] = dot_row16(q, key c)
 * * scale. Lane j of dot_row16 is a chain over elements j, j+16, ... in order: ROWS_SC_C chains at a time for
 * every query and block (Q x KB x ROWS_SC_C accumulators in registers, each loaded key vector and query value used KB or Q
 * times), parked, then the tree j + (j+8), j + (j+4), j + (j+2), j + (j+1) as vertical adds. */
static inline __attribute__((always_inline)) void scores_tile(const float *const *qf, const float *kt, int64_t d,
                                                              v16 scale, float *const *out, const int Q,
                                                              const int KB, const int fma) {
    v16 part[3][ROWS_SC_KB][16];
    for (int j0 = 0; j0 < 16; j0 += ROWS_SC_C) {
        v16 a[3][ROWS_SC_KB][ROWS_SC_C];
        for (int q = 0; q < Q; q++)
            for (int b = 0; b < KB; b++)
                for (int c = 0; c < ROWS_SC_C; c++) a[q][b][c] = v16_zero();
        int64_t i = j0;
        for (; i + ROWS_SC_C <= d; i += 16)
            for (int c = 0; c < ROWS_SC_C; c++) {
                v16 kv[ROWS_SC_KB];
                for (int b = 0; b < KB; b++) {
                    kv[b] = v16_load(kt + (i + c) * ROWS_KC + 16 * b);
                    V16_PIN(kv[b]); /* one load for the Q queries (not one per use) */
                }
                for (int q = 0; q < Q; q++) {
                    const v16 qv = v16_set1(qf[q][i + c]);
                    for (int b = 0; b < KB; b++) a[q][b][c] = mac(a[q][b][c], qv, kv[b], fma);
                }
            }
        for (int c = 0; c < ROWS_SC_C && i + c < d; c++) /* d % 16: the chains' last elements */
            for (int q = 0; q < Q; q++)
                for (int b = 0; b < KB; b++)
                    a[q][b][c] = mac(a[q][b][c], v16_set1(qf[q][i + c]), v16_load(kt + (i + c) * ROWS_KC + 16 * b), fma);
        for (int q = 0; q < Q; q++)
            for (int b = 0; b < KB; b++)
                for (int c = 0; c < ROWS_SC_C; c++) part[q][b][j0 + c] = a[q][b][c];
    }
    for (int q = 0; q < Q; q++)
        for (int b = 0; b < KB; b++) {
            v16 *t = part[q][b];
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) t[c] = v16_add(t[c], t[c + 8]);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) t[c] = v16_add(t[c], t[c + 4]);
            t[0] = v16_add(t[0], t[2]);
            t[1] = v16_add(t[1], t[3]);
            v16_store(out[q] + 16 * b, v16_mul(v16_add(t[0], t[1]), scale));
        }
}

#define SC_TILE(Q, KB) \
    (fma ? scores_tile(qf, kt, d, scale, out, Q, KB, 1) : scores_tile(qf, kt, d, scale, out, Q, KB, 0))

/* scores_tile for q = 1 .. 3 queries and kb = 1 .. ROWS_SC_KB blocks */
static void scores_rows(const float *const *qf, const float *kt, int64_t d, v16 scale, float *const *out, int q,
                        int kb, int fma) {
#if ROWS_SC_KB == 2
    switch (q * 2 + kb) {
    case 3: SC_TILE(1, 1); break;
    case 4: SC_TILE(1, 2); break;
    case 5: SC_TILE(2, 1); break;
    case 6: SC_TILE(2, 2); break;
    case 7: SC_TILE(3, 1); break;
    default: SC_TILE(3, 2); break;
    }
#else
    (void)kb;
    switch (q) {
    case 1: SC_TILE(1, 1); break;
    case 2: SC_TILE(2, 1); break;
    default: SC_TILE(3, 1); break;
    }
#endif
}

#undef SC_TILE

/* for Q queries over the same keys: acc_q[0 .. 16 W) += p_q[l] * vf_l[0 .. 16 W) for l < n in order (vf rows dp
   apart); Q x W independent chains share each loaded v row. */
static inline __attribute__((always_inline)) void pv_block(float *const *p, const float *vf, int64_t dp, int64_t n,
                                                           float *const *acc, const int Q, const int W) {
    v16 a[ROWS_PV_Q][ROWS_PV_W];
    for (int q = 0; q < Q; q++)
        for (int w = 0; w < W; w++) a[q][w] = v16_load(acc[q] + 16 * w);
    for (int64_t l = 0; l < n; l++) {
        v16 vr[ROWS_PV_W];
        for (int w = 0; w < W; w++) vr[w] = v16_load(vf + l * dp + 16 * w);
        for (int q = 0; q < Q; q++) {
            const v16 pv = v16_set1(p[q][l]);
            for (int w = 0; w < W; w++) a[q][w] = v16_add(a[q][w], v16_mul(pv, vr[w]));
        }
    }
    for (int q = 0; q < Q; q++)
        for (int w = 0; w < W; w++) v16_store(acc[q] + 16 * w, a[q][w]);
}

#define PV_W(Q)                                                                                                      \
    switch (w) {                                                                                                     \
    case 1: pv_block(p, vf + c, dp, n, ac, Q, 1); break;                                                            \
    default: pv_block(p, vf + c, dp, n, ac, Q, ROWS_PV_W); break;                                                   \
    }
#if ROWS_PV_W == 4
#undef PV_W
#define PV_W(Q)                                                                                                      \
    switch (w) {                                                                                                     \
    case 1: pv_block(p, vf + c, dp, n, ac, Q, 1); break;                                                            \
    case 2: pv_block(p, vf + c, dp, n, ac, Q, 2); break;                                                            \
    case 3: pv_block(p, vf + c, dp, n, ac, Q, 3); break;                                                            \
    default: pv_block(p, vf + c, dp, n, ac, Q, 4); break;                                                           \
    }

#endif

/* pv_block for q = 1 .. ROWS_PV_Q queries (p[i], acc[i]) over every block of 16 ROWS_PV_W columns of the dp columns */
static void pv_rows(float *const *p, const float *vf, int64_t dp, int64_t n, float *const *acc, int q) {
    for (int64_t c = 0; c < dp; c += 16 * ROWS_PV_W) {
        const int w = (dp - c) >= 16 * ROWS_PV_W ? ROWS_PV_W : (int)((dp - c) / 16);
        float *ac[ROWS_PV_Q] = {0};
        for (int i = 0; i < q; i++) ac[i] = acc[i] + c;
        switch (q) {
        case 1: PV_W(1) break;
#if ROWS_PV_Q == 4
        case 2: PV_W(2) break;
        case 3: PV_W(3) break;
        default: PV_W(4) break;
#else
        default: PV_W(2) break;
#endif
        }
    }
}

#undef PV_W

/* the keys [lo, hi) of token t in the chunk of keys c0 .. c0 + cn - 1 (lo >= hi: none) */
static inline void chunk_range(const int64_t *first, const int64_t *lens, int64_t t, int64_t c0, int64_t cn,
                               int64_t *lo, int64_t *hi) {
    const int64_t f = first ? first[t] : 0, n = lens[t];
    *lo = f > c0 ? f : c0;
    *hi = n < c0 + cn ? n : c0 + cn;
}

/* One work item: tokens t0 .. t1 - 1 (all of sequence sb) x the G query heads of KV head j. 0, or 3 (no memory). */
static int rows_item(const void *q, const void *k, const void *v, const int64_t *slots, int64_t sb, const int64_t *first,
                     const int64_t *lens, float scale, void *out, int64_t t0, int64_t t1, int64_t l_max, int64_t hq,
                     int64_t hk, int64_t j, int64_t d, int f32) {
    const int64_t g = hq / hk, nq = (t1 - t0) * g, dp = (d + 15) / 16 * 16;
    int64_t u0 = INT64_MAX, u1 = 0;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t f = first ? first[t] : 0;
        u0 = f < u0 ? f : u0;
        u1 = lens[t] > u1 ? lens[t] : u1;
    }
    /* query qi = (t - t0) * g + hh: keys [f, n); its scores s + soff[qi] hold keys from sbeg[qi] (16-aligned from u0) */
    int64_t stotal = 0;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t f = first ? first[t] : 0, beg = u0 + (f - u0) / 16 * 16;
        stotal += g * ((lens[t] - beg + 15) / 16 * 16);
    }
    const size_t floats = (size_t)(nq * d + nq * dp + stotal + d * ROWS_KC + ROWS_KC * dp);
    float *buf = aligned_alloc(64, (sizeof(float) * floats + 2 * sizeof(int64_t) * (size_t)nq +
                                    sizeof(int64_t) * ROWS_KC + 63) / 64 * 64);
    if (!buf) return 3;
    float *qf = buf, *acc = qf + nq * d, *s = acc + nq * dp, *kt = s + stotal, *vf = kt + d * ROWS_KC;
    int64_t *soff = (int64_t *)(vf + ROWS_KC * dp), *sbeg = soff + nq, *rows = sbeg + nq;
    int64_t off = 0;
    for (int64_t qi = 0; qi < nq; qi++) {
        const int64_t t = t0 + qi / g, f = first ? first[t] : 0;
        sbeg[qi] = u0 + (f - u0) / 16 * 16;
        soff[qi] = off;
        off += (lens[t] - sbeg[qi] + 15) / 16 * 16;
        load_row(q, (t * hq + j * g + qi % g) * d, f32, qf + qi * d, d);
    }
    int q_safe = !f32; /* every query value fma_safe */
    for (int64_t i = 0; i < nq * d; i++) q_safe &= fma_safe(qf[i]);
    memset(acc, 0, sizeof(float) * (size_t)(nq * dp));
    const v16 scv = v16_set1(scale);
    for (int pass = 0; pass < 2; pass++) { /* 0: scores, 1: p @ V */
        for (int64_t c0 = u0; c0 < u1; c0 += ROWS_KC) {
            const int64_t cn = u1 - c0 < ROWS_KC ? u1 - c0 : ROWS_KC;
            for (int64_t c = 0; c < cn; c++)
                rows[c] = ((slots ? slots[sb * l_max + c0 + c] : sb * l_max + c0 + c) * hk + j) * d;
            const int fma = rows_widen(k, pass ? v : NULL, rows, cn, d, dp, f32, kt, vf) && q_safe;
            for (int64_t qi = 0; qi < nq;) {
                int64_t lo, hi, qe = qi;
                chunk_range(first, lens, t0 + qi / g, c0, cn, &lo, &hi);
                if (lo >= hi) {
                    qi++;
                    continue;
                }
                if (pass == 0) { /* up to 3 heads of this token (the same keys) together, 2 blocks of 16 keys at a time */
                    const float *qq[3];
                    for (; qe < nq && qe - qi < 3 && qe / g == qi / g; qe++) qq[qe - qi] = qf + qe * d;
                    for (int64_t kb = sbeg[qi] > c0 ? sbeg[qi] : c0; kb < hi; kb += 16 * ROWS_SC_KB) {
                        float *so[3];
                        for (int64_t x = qi; x < qe; x++) so[x - qi] = s + soff[x] + (kb - sbeg[x]);
                        scores_rows(qq, kt + (kb - c0), d, scv, so, (int)(qe - qi),
                                    ROWS_SC_KB == 2 && kb + 16 < hi ? 2 : 1, fma);
                    }
                    qi = qe;
                    continue;
                }
                /* p @ V: up to ROWS_PV_Q queries with this chunk's same keys together */
                float *pq[ROWS_PV_Q] = {0}, *aq[ROWS_PV_Q] = {0};
                for (; qe < nq && qe - qi < ROWS_PV_Q; qe++) {
                    int64_t lo2, hi2;
                    chunk_range(first, lens, t0 + qe / g, c0, cn, &lo2, &hi2);
                    if (lo2 != lo || hi2 != hi) break;
                    pq[qe - qi] = s + soff[qe] + (lo - sbeg[qe]);
                    aq[qe - qi] = acc + qe * dp;
                }
                pv_rows(pq, vf + (lo - c0) * dp, dp, hi - lo, aq, (int)(qe - qi));
                qi = qe;
            }
        }
        if (pass == 1) break;
        for (int64_t q0 = 0; q0 < nq; q0 += 8) { /* softmax: p over each query's keys, 8 queries at a time */
            const int qn = nq - q0 < 8 ? (int)(nq - q0) : 8;
            float *sq[8], z[8];
            int64_t a[8], e[8];
            for (int i = 0; i < qn; i++) {
                const int64_t qi = q0 + i, t = t0 + qi / g;
                sq[i] = s + soff[qi];
                a[i] = (first ? first[t] : 0) - sbeg[qi];
                e[i] = lens[t] - sbeg[qi];
                const int64_t ep = (e[i] + 15) / 16 * 16;
                float m = -INFINITY, mm[16];
                int64_t l = a[i];
                for (; l < e[i] && l % 16; l++) m = sq[i][l] > m ? sq[i][l] : m;
                v16 mv = v16_set1(-INFINITY);
                for (; l + 16 <= e[i]; l += 16) mv = v16_max(v16_load(sq[i] + l), mv); /* skips NaN as > does */
                for (; l < e[i]; l++) m = sq[i][l] > m ? sq[i][l] : m;
                v16_store(mm, mv);
                for (int c = 0; c < 16; c++) m = mm[c] > m ? mm[c] : m;
                const v16 m16 = v16_set1(m);
                for (l = 0; l < ep; l += 16) v16_store(sq[i] + l, v16_exp(v16_sub(v16_load(sq[i] + l), m16)));
            }
            z_sums(sq, a, e, qn, z);
            for (int i = 0; i < qn; i++) {
                const v16 zv = v16_set1(z[i]);
                for (int64_t l = 0; l < (e[i] + 15) / 16 * 16; l += 16) v16_store(sq[i] + l, v16_div(v16_load(sq[i] + l), zv));
            }
        }
    }
    for (int64_t qi = 0; qi < nq; qi++) {
        const int64_t o = ((t0 + qi / g) * hq + j * g + qi % g) * d;
        if (f32) {
            memcpy((float *)out + o, acc + qi * dp, sizeof(float) * (size_t)d);
        } else {
            for (int64_t i = 0; i < d; i++) ((uint16_t *)out)[o + i] = rne(acc[qi * dp + i]);
        }
    }
    free(buf);
    return 0;
}

/* llmsys_rows_attention by work items (rows_item): runs of consecutive tokens of one sequence x the KV heads,
   spread over the threads (each query's arithmetic is its own: the split changes no bit). */
static int rows_blocked(const void *q, const void *k, const void *v, const int64_t *slots, const int64_t *seq,
                        const int64_t *first, const int64_t *lens, float scale, void *out, int64_t t_count,
                        int64_t l_max, int64_t hq, int64_t hk, int64_t d, int f32, int threads) {
    int64_t work = 0;
    const int rc = rows_checked(seq, first, lens, t_count, l_max, hq, hk, d, &work);
    if (rc) return rc;
    /* runs of at most `tok` consecutive tokens of one sequence: ROWS_Q query heads, ROWS_S floats of scores */
    const int64_t g = hq / hk, by_s = ROWS_S / (g * (l_max + 32));
    int64_t tok = ROWS_Q / g < by_s ? ROWS_Q / g : by_s, runs = 0;
    tok = tok < 1 ? 1 : tok;
    int64_t *start = malloc(sizeof(int64_t) * (size_t)(t_count + 1));
    if (!start) return 3;
    for (int64_t t = 0; t < t_count; t++)
        if (t == 0 || seq[t] != seq[t - 1] || t - start[runs - 1] == tok) start[runs++] = t;
    start[runs] = t_count;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (runs * hk > 1 && work * hq * d >= (1 << 14))
    for (int64_t item = 0; item < runs * hk; item++) {
        const int64_t r = item / hk, j = item % hk;
        if (rows_item(q, k, v, slots, seq[start[r]], first, lens, scale, out, start[r], start[r + 1], l_max, hq, hk,
                      j, d, f32)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    free(start);
    return failed ? 3 : 0;
}

#endif

/* Any tokens of any sequences (prompt chunks): token t is a decode step of sequence seq[t] over its keys
   first[t] .. lens[t] - 1 (a sliding window's band; first may be NULL). */
int llmsys_rows_attention(const void *q, const void *k, const void *v, const int64_t *slots, const int64_t *seq,
                          const int64_t *first, const int64_t *lens, float scale, void *out, int64_t t_count,
                          int64_t l_max, int64_t hq, int64_t hk, int64_t d, int f32, int threads) {
    if (!seq) return 1;
#if defined(__AVX2__)
    return rows_blocked(q, k, v, slots, seq, first, lens, scale, out, t_count, l_max, hq, hk, d, f32, threads);
#else
    return attention_rows(q, k, v, slots, seq, first, lens, scale, out, t_count, l_max, hq, hk, d, f32, threads);
#endif
}

/* A decode step's attention from the q|k|v projection in one call: qkv [T, (Hq + 2 Hk) D] rows (stride ld)
 * -> RoPE on q and k, k and v stored at slot_mapping (llmsys_rope_store), then each token over its
 * sequence's context (llmsys_decode_attention, gather_slots [T, L], lens [T]) -> out [T, Hq, D]: the bits of
 * the two calls. Why one: at decode each separate call cost ~20 us of Python around ~5 us of C. */
static int rope_store_attend(const void *qkv, int64_t ld, void *k_pool, void *v_pool, const int64_t *slot_mapping,
                             int64_t n_slots, const int64_t *pos, const float *cache, int64_t max_pos, int64_t t_count,
                             int64_t hq, int64_t hk, int64_t d, const int64_t *gather_slots, const int64_t *lens,
                             int64_t l_max, float scale, void *out, int f32, int threads) {
    if (t_count <= 0 || hq <= 0 || hk <= 0 || ld < (hq + 2 * hk) * d) return 1;
    const size_t es = f32 ? 4 : 2;
    void *q = malloc(es * (size_t)(t_count * hq * d));
    if (!q) return 4;
    const char *c = qkv;
    int rc = llmsys_rope_store(c, ld, c + es * (size_t)(hq * d), ld, c + es * (size_t)((hq + hk) * d), ld, q, k_pool,
                               v_pool, slot_mapping, n_slots, pos, cache, max_pos, t_count, hq, hk, d, f32);
    if (!rc) {
        rc = llmsys_decode_attention(q, k_pool, v_pool, gather_slots, lens, scale, out, t_count, l_max, hq, hk, d, f32,
                                     threads);
        if (rc) rc += 10;
    }
    free(q);
    return rc;
}

/* rope_store_attend on bf16 and on float32 activations and pools (cpu_decode.h: the decode stack of
   decode_stack.c calls them). */
int llmsys_rope_store_attend_bf16(const void *qkv, int64_t ld, void *k_pool, void *v_pool, const int64_t *slot_mapping,
                                  int64_t n_slots, const int64_t *pos, const float *cache, int64_t max_pos,
                                  int64_t t_count, int64_t hq, int64_t hk, int64_t d, const int64_t *gather_slots,
                                  const int64_t *lens, int64_t l_max, float scale, void *out, int threads) {
    return rope_store_attend(qkv, ld, k_pool, v_pool, slot_mapping, n_slots, pos, cache, max_pos, t_count, hq, hk, d,
                             gather_slots, lens, l_max, scale, out, 0, threads);
}

int llmsys_rope_store_attend_f32(const void *qkv, int64_t ld, void *k_pool, void *v_pool, const int64_t *slot_mapping,
                                 int64_t n_slots, const int64_t *pos, const float *cache, int64_t max_pos,
                                 int64_t t_count, int64_t hq, int64_t hk, int64_t d, const int64_t *gather_slots,
                                 const int64_t *lens, int64_t l_max, float scale, void *out, int threads) {
    return rope_store_attend(qkv, ld, k_pool, v_pool, slot_mapping, n_slots, pos, cache, max_pos, t_count, hq, hk, d,
                             gather_slots, lens, l_max, scale, out, 1, threads);
}
