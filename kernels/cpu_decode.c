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
 *            (the RMSNorm and silu_mul rows live in cpu_ops.h: the fused a8 layers of cpu_qgemv.c
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

#include "cpu_ops.h"

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
        load_row(k, rows[l], f32, row, d);
        s[l] = ops_dot_f32(qf, row, d) * scale;
    }
    float m = -INFINITY, z = 0.0f;
    for (int64_t l = 0; l < len; l++) m = s[l] > m ? s[l] : m;
    int64_t l = 0;
#ifdef ATT_VEC
    const __m256 mv = _mm256_set1_ps(m);
    for (; l + 8 <= len; l += 8) _mm256_storeu_ps(s + l, ops_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + l), mv)));
#endif
    for (; l < len; l++) s[l] = ops_exp(s[l] - m);
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
#else
        load_row(v, rows[l], f32, row, d);
#endif
        for (; e < d; e++) acc[e] = acc[e] + p * row[e];
    }
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
    if (hk <= 0 || hq % hk || d <= 0 || d > 1024) return 1;
    int64_t work = 0;
    for (int64_t b = 0; b < b_count; b++) {
        const int64_t f = first ? first[b] : 0;
        if (lens[b] < 1 || lens[b] > l_max || f < 0 || f >= lens[b] || (seq && seq[b] < 0)) return 2;
        work += lens[b] - f;
    }
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

/* Any tokens of any sequences (prompt chunks): token t is a decode step of sequence seq[t] over its keys
   first[t] .. lens[t] - 1 (a sliding window's band; first may be NULL). */
int llmsys_rows_attention(const void *q, const void *k, const void *v, const int64_t *slots, const int64_t *seq,
                          const int64_t *first, const int64_t *lens, float scale, void *out, int64_t t_count,
                          int64_t l_max, int64_t hq, int64_t hk, int64_t d, int f32, int threads) {
    if (!seq) return 1;
    return attention_rows(q, k, v, slots, seq, first, lens, scale, out, t_count, l_max, hq, hk, d, f32, threads);
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

/* rope_store_attend on bf16 and on float32 activations and pools: one signature (the decode stack of
   cpu_qgemv.c calls either through a function pointer). */
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
