/* Decode-step kernels for the CPU: bfloat16 RMSNorm, SwiGLU's silu * mul and RoPE, bfloat16 / float32
 * decode attention.
 *
 * Built for each ISA level and loaded for the running CPU by kernels/_cbuild.py
 * (gcc -O3 -march=<level> -fopenmp -ffp-contract=off -shared). Why: a
 * bfloat16 decode step of a small model spends as long in small torch ops
 * (upcasts, elementwise, softmax, their dispatch) as in its GEMVs; each kernel
 * here replaces 4-12 of them with one call. The engine uses these kernels for
 * every CPU bfloat16 step that computes the op (prefill and decode, resident
 * or streamed layers), so all paths give the same bits.
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
 *            e_l = expf(s_l - m);  z = sum_l e_l (in order);  p_l = e_l / z
 *            out = bf16(sum_l p_l * v_l)    (in order of l, per element)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_ops.h"

int llmsys_rms_norm_bf16(const uint16_t *x, const uint16_t *res, const uint16_t *w, uint16_t *out,
                         uint16_t *new_res, int64_t rows, int64_t d, float eps, int threads) {
    if (d <= 0 || d > (1 << 20)) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * d >= (1 << 16))
    for (int64_t t = 0; t < rows; t++) {
        float *h = malloc(sizeof(float) * (size_t)d);
        ops_rms_norm_row(x + t * d, res ? res + t * d : NULL, w, out + t * d, res ? new_res + t * d : NULL, d, eps, h);
        free(h);
    }
    return 0;
}

/* SwiGLU's product y [T, I] (contiguous) = silu(g) * u, g and u [T, I] rows of strides ldg, ldu (cpu_ops.h). */
int llmsys_silu_mul_bf16(const uint16_t *g, int64_t ldg, const uint16_t *u, int64_t ldu, uint16_t *y, int64_t rows,
                         int64_t inter, int threads) {
    if (inter <= 0 || ldg < inter || ldu < inter) return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inter >= (1 << 16))
    for (int64_t t = 0; t < rows; t++) ops_silu_mul_row(g + t * ldg, u + t * ldu, y + t * inter, inter);
    return 0;
}

/* x [T, H, D] rows with row stride `stride` (elements between tokens), out [T, H, D] contiguous. */
static void rope_one(const uint16_t *x, int64_t stride, uint16_t *out, const int64_t *pos, const float *cache,
                     int64_t t_count, int64_t heads, int64_t d) {
    int64_t half = d / 2;
    for (int64_t t = 0; t < t_count; t++) {
        const float *cs = cache + pos[t] * d; /* cos | sin */
        for (int64_t hh = 0; hh < heads; hh++) {
            const uint16_t *xr = x + t * stride + hh * d;
            uint16_t *o = out + (t * heads + hh) * d;
            for (int64_t i = 0; i < half; i++) {
                float x1 = bf(xr[i]), x2 = bf(xr[i + half]), c = cs[i], s = cs[half + i];
                float a = x1 * c, b = x2 * -s;
                o[i] = rne(a + b);
                float a2 = x2 * c, b2 = x1 * s;
                o[i + half] = rne(a2 + b2);
            }
        }
    }
}

int llmsys_rope_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride, uint16_t *q_out,
                     uint16_t *k_out, const int64_t *pos, const float *cache, int64_t max_pos, int64_t t_count,
                     int64_t hq, int64_t hk, int64_t d) {
    if (d % 2) return 1;
    for (int64_t t = 0; t < t_count; t++)
        if (pos[t] < 0 || pos[t] >= max_pos) return 2;
    rope_one(q, q_stride, q_out, pos, cache, t_count, hq, d);
    rope_one(k, k_stride, k_out, pos, cache, t_count, hk, d);
    return 0;
}

/* RoPE on q (-> q_out) and k, with k and v written straight into their pool rows:
 * token t's k and v go to row slots[t] of k_pool / v_pool ([slots, Hk, D]); slots[t] < 0 skips the token. */
int llmsys_rope_store_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                           const uint16_t *v, int64_t v_stride, uint16_t *q_out, uint16_t *k_pool, uint16_t *v_pool,
                           const int64_t *slots, int64_t n_slots, const int64_t *pos, const float *cache,
                           int64_t max_pos, int64_t t_count, int64_t hq, int64_t hk, int64_t d) {
    if (d % 2) return 1;
    for (int64_t t = 0; t < t_count; t++) {
        if (pos[t] < 0 || pos[t] >= max_pos) return 2;
        if (slots[t] >= n_slots) return 3;
    }
    rope_one(q, q_stride, q_out, pos, cache, t_count, hq, d);
    for (int64_t t = 0; t < t_count; t++) {
        if (slots[t] < 0) continue;
        rope_one(k + t * k_stride, 0, k_pool + slots[t] * hk * d, pos + t, cache, 1, hk, d);
        memcpy(v_pool + slots[t] * hk * d, v + t * v_stride, sizeof(uint16_t) * (size_t)(hk * d));
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

/* q [B, Hq, D]; k, v: rows of [Hk, D]: with slots [B, L], row slots[b, l] of the pool, else row b * L + l
 * (gathered); lens [B]; out [B, Hq, D]. All bf16 (f32 = 0) or all float32 (f32 = 1). */
int llmsys_decode_attention(const void *q, const void *k, const void *v, const int64_t *slots, const int64_t *lens,
                            float scale, void *out, int64_t b_count, int64_t l_max, int64_t hq, int64_t hk, int64_t d,
                            int f32, int threads) {
    if (hk <= 0 || hq % hk || d <= 0 || d > 1024) return 1;
    for (int64_t b = 0; b < b_count; b++)
        if (lens[b] < 1 || lens[b] > l_max) return 2;
    int64_t g = hq / hk;
#pragma omp parallel for num_threads(threads) schedule(static) if (b_count * hk > 1)
    for (int64_t item = 0; item < b_count * hk; item++) {
        int64_t b = item / hk, j = item % hk, len = lens[b];
        float *s = malloc(sizeof(float) * (size_t)(len * g + (2 * g + 1) * d));
        float *qf = s + len * g, *row = qf + g * d, *acc = row + d;
        load_row(q, (b * hq + j * g) * d, f32, qf, g * d);
        for (int64_t l = 0; l < len; l++) { /* scores: K row l against the g query heads of KV head j */
            int64_t r = slots ? slots[b * l_max + l] : b * l_max + l;
            load_row(k, (r * hk + j) * d, f32, row, d);
            for (int64_t gi = 0; gi < g; gi++) s[gi * len + l] = ops_dot_f32(qf + gi * d, row, d) * scale;
        }
        for (int64_t gi = 0; gi < g; gi++) { /* softmax per query head */
            float *sr = s + gi * len, m = -INFINITY, z = 0.0f;
            for (int64_t l = 0; l < len; l++) m = sr[l] > m ? sr[l] : m;
            for (int64_t l = 0; l < len; l++) {
                sr[l] = expf(sr[l] - m);
                z = z + sr[l];
            }
            for (int64_t l = 0; l < len; l++) sr[l] = sr[l] / z;
        }
        for (int64_t i = 0; i < g * d; i++) acc[i] = 0.0f;
        for (int64_t l = 0; l < len; l++) { /* each V row read once; every output sums over l in order */
            int64_t r = slots ? slots[b * l_max + l] : b * l_max + l;
            load_row(v, (r * hk + j) * d, f32, row, d);
            for (int64_t gi = 0; gi < g; gi++) {
                float p = s[gi * len + l];
                float *a = acc + gi * d;
                for (int64_t i = 0; i < d; i++) a[i] = a[i] + p * row[i];
            }
        }
        int64_t o = (b * hq + j * g) * d;
        if (f32) {
            memcpy((float *)out + o, acc, sizeof(float) * (size_t)(g * d));
        } else {
            for (int64_t i = 0; i < g * d; i++) ((uint16_t *)out)[o + i] = rne(acc[i]);
        }
        free(s);
    }
    return 0;
}
