/* The NEON family's primitives (aarch64; isa.h's ISA_NEON): the bits of isa_scalar.h's definitions.
 *
 * How:
 *   - int8 dots: on the armv8.2-a-dotprod level (__ARM_FEATURE_DOTPROD) vdotq_s32 sums 4 byte products into
 *     an int32 lane, 16 bytes an instruction; on armv8-a vmull_s8 / vmlal_high_s8 give int16 pairs of
 *     products (|x| <= 127, |w| <= 128: a pair's sum fits int16) that vpadalq_s16 adds into int32 lanes. Exact.
 *   - int4 dots (the CPU int4 tiling is column-major: a column's 32 bytes hold 64 rows' codes, so a row's codes
 *     are not contiguous and vdotq would need a transpose costing more than it saves): per column, the
 *     broadcast activation code times the 64 rows' codes by vmlal_s8 into int16 lanes, 16 columns at a time
 *     (16 * 15 * 127 < 2^15), then widened into int32. Exact.
 *   - float dots: 4 float32x4 registers are the 16 lanes, vmulq then vaddq (built with -ffp-contract=off, so
 *     not fused), the tail and the tree as the definition.
 *   - exp: cpu_ops.h's ops_exp, the same operations 4 lanes at a time (vrndnq_f32 is nearbyintf's
 *     round-half-even; out-of-range lanes replaced by vbslq as ops_exp8's blends).
 */
#ifndef LLMSYS_ISA_NEON_H
#define LLMSYS_ISA_NEON_H
#include <arm_neon.h>

#if defined(__ARM_FEATURE_DOTPROD)
#define ISA_NAME "neon-dotprod"
#else
#define ISA_NAME "neon"
#endif

/* the int32 lanes of 16 byte products x * w added to acc */
static inline int32x4_t isa_neon_dot16(int32x4_t acc, int8x16_t x, int8x16_t w) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, x, w);
#else
    return vpadalq_s16(acc, vmlal_high_s8(vmull_s8(vget_low_s8(x), vget_low_s8(w)), x, w));
#endif
}

static inline int32_t isa_dot_i8(const int8_t *x, const int8_t *w, int64_t len) {
    int32x4_t acc = vdupq_n_s32(0);
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) acc = isa_neon_dot16(acc, vld1q_s8(x + i), vld1q_s8(w + i));
    int32_t s = vaddvq_s32(acc);
    for (; i < len; i++) s += (int32_t)x[i] * (int32_t)w[i];
    return s;
}

static inline void isa_dot32_i8_x8(const int8_t *qx, const int8_t *q, int64_t ldq, int32_t s[8]) {
    const int8x16_t x0 = vld1q_s8(qx), x1 = vld1q_s8(qx + 16);
    int32x4_t v[8];
    for (int r = 0; r < 8; r++) {
        const int8_t *w = q + r * ldq;
        v[r] = isa_neon_dot16(isa_neon_dot16(vdupq_n_s32(0), x0, vld1q_s8(w)), x1, vld1q_s8(w + 16));
    }
    /* pairwise adds: [r0 r1 r2 r3], [r4 r5 r6 r7] */
    const int32x4_t p01 = vpaddq_s32(v[0], v[1]), p23 = vpaddq_s32(v[2], v[3]);
    const int32x4_t p45 = vpaddq_s32(v[4], v[5]), p67 = vpaddq_s32(v[6], v[7]);
    vst1q_s32(s, vpaddq_s32(p01, p23));
    vst1q_s32(s + 4, vpaddq_s32(p45, p67));
}

static inline void isa_i4_dot64(const uint8_t *p, const int8_t *qx, int32_t s[64]) {
    const uint8x16_t low4 = vdupq_n_u8(15);
    int32x4_t s32[16];
    for (int v = 0; v < 16; v++) s32[v] = vdupq_n_s32(0);
    for (int h = 0; h < 2; h++) {
        int16x8_t a[8]; /* rows 8i .. 8i + 7 */
        for (int v = 0; v < 8; v++) a[v] = vdupq_n_s16(0);
        for (int c = 16 * h; c < 16 * h + 16; c++) {
            const uint8x16_t b0 = vld1q_u8(p + 32 * c), b1 = vld1q_u8(p + 32 * c + 16);
            const int8x16_t xq = vdupq_n_s8(qx[c]);
            const int8x16_t n[4] = {vreinterpretq_s8_u8(vandq_u8(b0, low4)), vreinterpretq_s8_u8(vandq_u8(b1, low4)),
                                    vreinterpretq_s8_u8(vshrq_n_u8(b0, 4)), vreinterpretq_s8_u8(vshrq_n_u8(b1, 4))};
            for (int i = 0; i < 4; i++) { /* rows 16i .. 16i + 15 */
                a[2 * i] = vmlal_s8(a[2 * i], vget_low_s8(n[i]), vget_low_s8(xq));
                a[2 * i + 1] = vmlal_high_s8(a[2 * i + 1], n[i], xq);
            }
        }
        for (int v = 0; v < 8; v++) {
            s32[2 * v] = vaddw_s16(s32[2 * v], vget_low_s16(a[v]));
            s32[2 * v + 1] = vaddw_high_s16(s32[2 * v + 1], a[v]);
        }
    }
    for (int v = 0; v < 16; v++) vst1q_s32(s + 4 * v, s32[v]);
}

/* 4 bf16 -> 4 floats (exact) */
static inline float32x4_t isa_neon_bf4(const uint16_t *p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }

/* the 16 lanes (a[0] lanes 0-3 .. a[3] lanes 12-15) with the tail n % 16 elements of x * (y or bf16 w) added
   into lanes 0 .., then reduced as the tree */
static inline float isa_neon_finish(const float32x4_t a[4], const float *x, const float *y, const uint16_t *xb,
                                    const uint16_t *w, int64_t tail) {
    float l[ISA_LANES];
    for (int i = 0; i < 4; i++) vst1q_f32(l + 4 * i, a[i]);
    for (int64_t j = 0; j < tail; j++) {
        const float xv = xb ? bf(xb[j]) : x[j];
        l[j] = l[j] + xv * (w ? bf(w[j]) : y[j]);
    }
    if (tail) return ops_tree(l);
    /* the tree in registers: i + (i+8), i + (i+4), i + (i+2), i + (i+1) */
    const float32x4_t t = vaddq_f32(vaddq_f32(a[0], a[2]), vaddq_f32(a[1], a[3]));
    const float32x2_t u = vadd_f32(vget_low_f32(t), vget_high_f32(t));
    return vget_lane_f32(u, 0) + vget_lane_f32(u, 1);
}

static inline float isa_dot_f32(const float *x, const float *y, int64_t n) {
    float32x4_t a[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    int64_t i = 0;
    for (; i + ISA_LANES <= n; i += ISA_LANES)
        for (int v = 0; v < 4; v++) a[v] = vaddq_f32(a[v], vmulq_f32(vld1q_f32(x + i + 4 * v), vld1q_f32(y + i + 4 * v)));
    return isa_neon_finish(a, x + i, y + i, NULL, NULL, n - i);
}

static inline float isa_dot_f32_bf16(const float *x, const uint16_t *w, int64_t n) {
    float32x4_t a[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    int64_t i = 0;
    for (; i + ISA_LANES <= n; i += ISA_LANES)
        for (int v = 0; v < 4; v++) a[v] = vaddq_f32(a[v], vmulq_f32(vld1q_f32(x + i + 4 * v), isa_neon_bf4(w + i + 4 * v)));
    return isa_neon_finish(a, x + i, NULL, NULL, w + i, n - i);
}

static inline float isa_dot_bf16(const uint16_t *x, const uint16_t *w, int64_t n) {
    float32x4_t a[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    int64_t i = 0;
    for (; i + ISA_LANES <= n; i += ISA_LANES)
        for (int v = 0; v < 4; v++) a[v] = vaddq_f32(a[v], vmulq_f32(isa_neon_bf4(x + i + 4 * v), isa_neon_bf4(w + i + 4 * v)));
    return isa_neon_finish(a, NULL, NULL, x + i, w + i, n - i);
}

static inline void isa_axpy(float *acc, float p, const void *v, int f32, int64_t n) {
    const float32x4_t pv = vdupq_n_f32(p);
    int64_t e = 0;
    if (f32)
        for (; e + 4 <= n; e += 4)
            vst1q_f32(acc + e, vaddq_f32(vld1q_f32(acc + e), vmulq_f32(pv, vld1q_f32((const float *)v + e))));
    else
        for (; e + 4 <= n; e += 4)
            vst1q_f32(acc + e, vaddq_f32(vld1q_f32(acc + e), vmulq_f32(pv, isa_neon_bf4((const uint16_t *)v + e))));
    isa_ref_axpy(acc + e, p, f32 ? (const void *)((const float *)v + e) : (const void *)((const uint16_t *)v + e), f32, n - e);
}

/* ops_exp on 4 floats: the same operations in the same order */
static inline float32x4_t isa_neon_exp4(float32x4_t x) {
    const uint32x4_t nan = vmvnq_u32(vceqq_f32(x, x));
    const uint32x4_t big = vcgtq_f32(x, vdupq_n_f32(OPS_EXP_HI)), small = vcltq_f32(x, vdupq_n_f32(OPS_EXP_LO));
    const float32x4_t xc = vminq_f32(vmaxq_f32(x, vdupq_n_f32(OPS_EXP_LO)), vdupq_n_f32(OPS_EXP_HI));
    const float32x4_t n = vrndnq_f32(vmulq_f32(xc, vdupq_n_f32(OPS_LOG2E)));
    const float32x4_t r = vsubq_f32(vsubq_f32(xc, vmulq_f32(n, vdupq_n_f32(OPS_C1))), vmulq_f32(n, vdupq_n_f32(OPS_C2)));
    float32x4_t p = vdupq_n_f32(OPS_P0);
    p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(OPS_P1));
    p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(OPS_P2));
    p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(OPS_P3));
    p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(OPS_P4));
    p = vaddq_f32(vmulq_f32(p, r), vdupq_n_f32(OPS_P5));
    const float32x4_t y = vaddq_f32(vaddq_f32(vmulq_f32(p, vmulq_f32(r, r)), r), vdupq_n_f32(1.0f));
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(126)), 23); /* 2^(n-1); n integral */
    float32x4_t v = vmulq_f32(vmulq_f32(y, vreinterpretq_f32_s32(e)), vdupq_n_f32(2.0f));
    v = vbslq_f32(small, vdupq_n_f32(0.0f), v);
    v = vbslq_f32(big, vdupq_n_f32(INFINITY), v);
    return vbslq_f32(nan, x, v);
}

static inline void isa_exp_sub(float *s, int64_t n, float m) {
    const float32x4_t mv = vdupq_n_f32(m);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(s + i, isa_neon_exp4(vsubq_f32(vld1q_f32(s + i), mv)));
    isa_ref_exp_sub(s + i, n - i, m);
}

static inline void isa_widen_bf16(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const uint16x8_t v = vld1q_u16(src + i);
        vst1q_f32(dst + i, vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16)));
        vst1q_f32(dst + i + 4, vreinterpretq_f32_u32(vshll_high_n_u16(v, 16)));
    }
    isa_ref_widen_bf16(src + i, dst + i, n - i);
}

#endif
