/* Row kernels shared by cpu_decode.c (the module path's RMSNorm and SwiGLU) and fused_layer.c (the fused
 * a8 decode layers), so a layer computed either way gives the same bits.
 *
 * Arithmetic (kernels/cpu_decode.py rms_norm_def / silu_mul_def):
 *   - sums of products accumulate in 16 float32 lanes, lane j taking elements j, j+16, ... in order,
 *     then the lanes reduce as a tree: i + (i+8), i + (i+4), i + (i+2), i + (i+1).
 *   - rms_norm: h = residual ? bf16(x + residual) : x;  r = 1 / sqrt(sumsq(h) / D + eps);
 *               out = bf16(w * bf16(h * r))   (HF LlamaRMSNorm's roundings)
 *   - silu_mul: out = bf16(bf16(g / (1 + e)) * u), e = ops_exp(-g) (torch's bf16 F.silu(g) * u, up to exp)
 *   - float32 rows (the _f32 functions): the same operations, no bf16 roundings
 *   - ops_exp(x): n = round-half-even(x * log2 e); r = (x - n * C1) - n * C2; p = Horner over the
 *     Cephes expf coefficients; y = ((p * (r * r)) + r) + 1; e = (y * 2^(n-1)) * 2; +inf above 88.7228
 *     (float's overflow, as torch.exp), 0 below -86, NaN for NaN. ~1 float ulp: against torch.exp no bf16
 *     difference in tests/test_cpu_decode.py's sweep but at rare ties.
 *     Why not libm's expf: it does not vectorize here, and glibc picks an FMA variant per CPU; this one
 *     is written once as plain float operations (no FMA: -ffp-contract=off) and once in AVX2 with the
 *     same operations in the same order, so every ISA build gives the same bits.
 */
#ifndef LLMSYS_CPU_OPS_H
#define LLMSYS_CPU_OPS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"

#define OPS_LANES 16

static inline float ops_tree(float *a) {
    for (int w = OPS_LANES / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) a[i] = a[i] + a[i + w];
    return a[0];
}

/* sum of x[i] * y[i], i < n, in the lane order above (float32 inputs). */
static inline float ops_dot_f32(const float *x, const float *y, int64_t n) {
    float acc[OPS_LANES] = {0};
    int64_t i = 0;
    for (; i + OPS_LANES <= n; i += OPS_LANES)
        for (int j = 0; j < OPS_LANES; j++) acc[j] = acc[j] + x[i + j] * y[i + j];
    for (int j = 0; i + j < n; j++) acc[j] = acc[j] + x[i + j] * y[i + j];
    return ops_tree(acc);
}

/* One row of D: out = RMSNorm(x (+ res)) * w; with res, new_res = bf16(x + res). h: D floats of scratch. */
static inline void ops_rms_norm_row(const uint16_t *x, const uint16_t *res, const uint16_t *w, uint16_t *out,
                                    uint16_t *new_res, int64_t d, float eps, float *h) {
    for (int64_t i = 0; i < d; i++) {
        if (res) {
            const uint16_t s = rne(bf(x[i]) + bf(res[i]));
            new_res[i] = s;
            h[i] = bf(s);
        } else {
            h[i] = bf(x[i]);
        }
    }
    const float ms = ops_dot_f32(h, h, d) / (float)d;
    const float r = 1.0f / sqrtf(ms + eps);
    for (int64_t i = 0; i < d; i++) out[i] = rne(bf(w[i]) * bf(rne(h[i] * r)));
}

/* ops_rms_norm_row for float32 rows (a float32 model): the same arithmetic without the bf16 roundings,
 * h = res ? x + res : x;  out = w * (h * r)  (HF LlamaRMSNorm in float32). With res, new_res = h. */
static inline void ops_rms_norm_row_f32(const float *x, const float *res, const float *w, float *out,
                                        float *new_res, int64_t d, float eps) {
    const float *h = x;
    if (res) {
        for (int64_t i = 0; i < d; i++) new_res[i] = x[i] + res[i];
        h = new_res;
    }
    const float ms = ops_dot_f32(h, h, d) / (float)d;
    const float r = 1.0f / sqrtf(ms + eps);
    for (int64_t i = 0; i < d; i++) out[i] = w[i] * (h[i] * r);
}

#define OPS_EXP_LO (-86.0f) /* below: 0 (e^-86 ~ 4e-38; keeps 2^(n-1) a normal float) */
#define OPS_EXP_HI 88.72283935546875f /* above: float overflow */
#define OPS_LOG2E 1.44269504088896341f
#define OPS_C1 0.693359375f
#define OPS_C2 (-2.12194440e-4f)
#define OPS_P0 1.9875691500e-4f
#define OPS_P1 1.3981999507e-3f
#define OPS_P2 8.3334519073e-3f
#define OPS_P3 4.1665795894e-2f
#define OPS_P4 1.6666665459e-1f
#define OPS_P5 5.0000001201e-1f

/* e^x (the arithmetic above), scalar */
static inline float ops_exp(float x) {
    if (x != x) return x;
    if (x > OPS_EXP_HI) return INFINITY;
    if (x < OPS_EXP_LO) return 0.0f;
    const float n = nearbyintf(x * OPS_LOG2E);
    const float r = (x - n * OPS_C1) - n * OPS_C2;
    float p = OPS_P0;
    p = p * r + OPS_P1;
    p = p * r + OPS_P2;
    p = p * r + OPS_P3;
    p = p * r + OPS_P4;
    p = p * r + OPS_P5;
    const float y = ((p * (r * r)) + r) + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n - 1 + 127) << 23; /* 2^(n-1): n - 1 in -125 .. 127 */
    float scale;
    memcpy(&scale, &bits, 4);
    return (y * scale) * 2.0f;
}

#if defined(__AVX2__)
#include <immintrin.h>
/* ops_exp on 8 floats, the same operations (lanes out of range computed on a clamped value, then replaced) */
static inline __m256 ops_exp8(__m256 x) {
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const __m256 big = _mm256_cmp_ps(x, _mm256_set1_ps(OPS_EXP_HI), _CMP_GT_OQ);
    const __m256 small = _mm256_cmp_ps(x, _mm256_set1_ps(OPS_EXP_LO), _CMP_LT_OQ);
    const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(OPS_EXP_LO)), _mm256_set1_ps(OPS_EXP_HI));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(OPS_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(xc, _mm256_mul_ps(n, _mm256_set1_ps(OPS_C1))), _mm256_mul_ps(n, _mm256_set1_ps(OPS_C2)));
    __m256 p = _mm256_set1_ps(OPS_P0);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(OPS_P1));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(OPS_P2));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(OPS_P3));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(OPS_P4));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(OPS_P5));
    const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
    __m256 v = _mm256_mul_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), _mm256_set1_ps(2.0f));
    v = _mm256_blendv_ps(v, _mm256_setzero_ps(), small);
    v = _mm256_blendv_ps(v, _mm256_set1_ps(INFINITY), big);
    return _mm256_blendv_ps(v, x, nan);
}

/* 8 bf16 -> 8 floats (exact) and back (round to nearest even, NaN -> 0x7fc0: rne's bits) */
static inline __m256 ops_bf8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline __m128i ops_rne8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
#endif

/* One row of SwiGLU's product: y[i] = silu(g[i]) * u[i], i < n (the arithmetic above). */
static inline void ops_silu_mul_row(const uint16_t *g, const uint16_t *u, uint16_t *y, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = ops_bf8(g + i);
        const __m256 e = ops_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m128i sb = ops_rne8(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
        const __m256 sf = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(sb), 16));
        _mm_storeu_si128((__m128i *)(y + i), ops_rne8(_mm256_mul_ps(sf, ops_bf8(u + i))));
    }
#endif
    for (; i < n; i++) {
        const float gv = bf(g[i]);
        y[i] = rne(bf(rne(gv / (1.0f + ops_exp(-gv)))) * bf(u[i]));
    }
}

/* One row of gpt-oss's clamped SwiGLU (transformers' GptOssExperts, its bf16 torch ops in order):
   g' = min(g, limit), u' = clamp(u, -limit, limit), a = bf16(g' alpha), s = bf16(1 / (1 + ops_exp(-a))),
   y = bf16(bf16(u' + 1) * bf16(g' s)); NaN stays NaN. float32 rows (f32): the same without the roundings. */
static inline float ops_cswiglu1(float g, float u, float alpha, float limit, int f32) {
    g = g > limit ? limit : g;
    u = u < -limit ? -limit : (u > limit ? limit : u);
    float a = g * alpha;
    if (!f32) a = bf(rne(a));
    float s = 1.0f / (1.0f + ops_exp(-a));
    if (!f32) s = bf(rne(s));
    float m = g * s, u1 = u + 1.0f;
    if (!f32) m = bf(rne(m)), u1 = bf(rne(u1));
    return u1 * m;
}

#if defined(__AVX2__)
/* 8 lanes of ops_cswiglu1 (bf16 rounding after each step when !f32) */
static inline __m256 ops_round_bf8(__m256 v, int f32) {
    return f32 ? v : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(ops_rne8(v)), 16));
}
static inline __m256 ops_cswiglu8(__m256 g, __m256 u, float alpha, float limit, int f32) {
    const __m256 lim = _mm256_set1_ps(limit), nlim = _mm256_set1_ps(-limit), one = _mm256_set1_ps(1.0f);
    g = _mm256_blendv_ps(g, lim, _mm256_cmp_ps(g, lim, _CMP_GT_OQ));
    u = _mm256_blendv_ps(u, nlim, _mm256_cmp_ps(u, nlim, _CMP_LT_OQ));
    u = _mm256_blendv_ps(u, lim, _mm256_cmp_ps(u, lim, _CMP_GT_OQ));
    const __m256 a = ops_round_bf8(_mm256_mul_ps(g, _mm256_set1_ps(alpha)), f32);
    const __m256 s = ops_round_bf8(_mm256_div_ps(one, _mm256_add_ps(one, ops_exp8(_mm256_sub_ps(_mm256_setzero_ps(), a)))), f32);
    return _mm256_mul_ps(ops_round_bf8(_mm256_add_ps(u, one), f32), ops_round_bf8(_mm256_mul_ps(g, s), f32));
}
#endif

/* gate | up rows g, u of n (bf16, or float32 with f32) -> y = ops_cswiglu1 of each element */
static inline void ops_cswiglu_row(const void *g, const void *u, void *y, int64_t n, float alpha, float limit, int f32) {
    int64_t i = 0;
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = f32 ? _mm256_loadu_ps((const float *)g + i) : ops_bf8((const uint16_t *)g + i);
        const __m256 uv = f32 ? _mm256_loadu_ps((const float *)u + i) : ops_bf8((const uint16_t *)u + i);
        const __m256 r = ops_cswiglu8(gv, uv, alpha, limit, f32);
        if (f32) _mm256_storeu_ps((float *)y + i, r);
        else _mm_storeu_si128((__m128i *)((uint16_t *)y + i), ops_rne8(r));
    }
#endif
    for (; i < n; i++) {
        if (f32) {
            ((float *)y)[i] = ops_cswiglu1(((const float *)g)[i], ((const float *)u)[i], alpha, limit, 1);
        } else {
            ((uint16_t *)y)[i] = rne(ops_cswiglu1(bf(((const uint16_t *)g)[i]), bf(((const uint16_t *)u)[i]), alpha, limit, 0));
        }
    }
}

/* ops_silu_mul_row for float32 rows: y[i] = (g[i] / (1 + e)) * u[i], e = ops_exp(-g[i]) */
static inline void ops_silu_mul_row_f32(const float *g, const float *u, float *y, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = ops_exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) y[i] = (g[i] / (1.0f + ops_exp(-g[i]))) * u[i];
}
#endif
