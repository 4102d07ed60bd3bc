/* The ISA primitives' definitions in plain C (isa_ref_*), and the scalar family's primitives (isa_*, ISA_SCALAR:
 * the x86-64 baseline and aarch64 with -DLLMSYS_NO_NEON). Included by isa.h only.
 *
 * Every family's isa_* must return the bits of these definitions (tests/isa_prims.c checks the NEON and x86
 * headers against them on random and extreme inputs):
 *   - integer dot products (int8 x int8, int8 x int4 code) are exact int32 sums: any order gives the same value;
 *   - float dot products accumulate in 16 float32 lanes, lane j taking elements j, j + 16, ... in order, the
 *     tail (n % 16 elements) into lanes 0 .. n % 16 - 1, then the lanes reduce as a tree:
 *     i + (i+8), i + (i+4), i + (i+2), i + (i+1) (cpu_ops.h's ops_dot_f32; multiply, then add: no FMA);
 *   - elementwise steps (axpy, exp) are per element, so any vector width gives the same bits.
 */
#ifndef LLMSYS_ISA_SCALAR_H
#define LLMSYS_ISA_SCALAR_H
#include <stdint.h>
#include <string.h>

#include "cpu_ops.h"

#define ISA_LANES 16

/* sum of x[i] * w[i], i < len: exact */
static inline int32_t isa_ref_dot_i8(const int8_t *x, const int8_t *w, int64_t len) {
    int32_t s = 0;
    for (int64_t i = 0; i < len; i++) s += (int32_t)x[i] * (int32_t)w[i];
    return s;
}

/* 8 weight rows (ldq bytes apart) against one full 32-code activation block: s[r] = dot(qx[0 .. 32), q + r * ldq) */
static inline void isa_ref_dot32_i8_x8(const int8_t *qx, const int8_t *q, int64_t ldq, int32_t s[8]) {
    for (int r = 0; r < 8; r++) s[r] = isa_ref_dot_i8(qx, q + r * ldq, 32);
}

/* One 32-column block of a 64-row block of the CPU int4 tiling (32 bytes a column: byte j holds row j's code in
   its low nibble, row j + 32's in its high nibble) against 32 activation codes: s[j] = sum over c of
   qx[c] * code(c, j), rows in natural order. */
static inline void isa_ref_i4_dot64(const uint8_t *p, const int8_t *qx, int32_t s[64]) {
    for (int j = 0; j < 64; j++) s[j] = 0;
    for (int c = 0; c < 32; c++) {
        const int32_t xv = qx[c];
        const uint8_t *pc = p + c * 32;
        for (int j = 0; j < 32; j++) {
            s[j] += xv * (int32_t)(pc[j] & 15);
            s[j + 32] += xv * (int32_t)(pc[j] >> 4);
        }
    }
}

/* the float dots: x float32, y float32 (f32) / bf16; both bf16 (dot_bf16) */
static inline float isa_ref_dot_f32(const float *x, const float *y, int64_t n) { return ops_dot_f32(x, y, n); }

static inline float isa_ref_dot_f32_bf16(const float *x, const uint16_t *w, int64_t n) {
    float a[ISA_LANES] = {0};
    int64_t i = 0;
    for (; i + ISA_LANES <= n; i += ISA_LANES)
        for (int j = 0; j < ISA_LANES; j++) a[j] = a[j] + x[i + j] * bf(w[i + j]);
    for (int j = 0; i + j < n; j++) a[j] = a[j] + x[i + j] * bf(w[i + j]);
    return ops_tree(a);
}

static inline float isa_ref_dot_bf16(const uint16_t *x, const uint16_t *w, int64_t n) {
    float a[ISA_LANES] = {0};
    int64_t i = 0;
    for (; i + ISA_LANES <= n; i += ISA_LANES)
        for (int j = 0; j < ISA_LANES; j++) a[j] = a[j] + bf(x[i + j]) * bf(w[i + j]);
    for (int j = 0; i + j < n; j++) a[j] = a[j] + bf(x[i + j]) * bf(w[i + j]);
    return ops_tree(a);
}

/* acc[e] = acc[e] + p * v[e], e < n; v float32 (f32 set) or bf16 */
static inline void isa_ref_axpy(float *acc, float p, const void *v, int f32, int64_t n) {
    if (f32)
        for (int64_t e = 0; e < n; e++) acc[e] = acc[e] + p * ((const float *)v)[e];
    else
        for (int64_t e = 0; e < n; e++) acc[e] = acc[e] + p * bf(((const uint16_t *)v)[e]);
}

/* s[i] = ops_exp(s[i] - m), i < n (the softmax's numerators) */
static inline void isa_ref_exp_sub(float *s, int64_t n, float m) {
    for (int64_t i = 0; i < n; i++) s[i] = ops_exp(s[i] - m);
}

/* dst[i] = float(src[i]) (exact) */
static inline void isa_ref_widen_bf16(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = bf(src[i]);
}

#ifdef ISA_SCALAR
#define ISA_NAME "scalar"
static inline int32_t isa_dot_i8(const int8_t *x, const int8_t *w, int64_t len) { return isa_ref_dot_i8(x, w, len); }
static inline void isa_dot32_i8_x8(const int8_t *qx, const int8_t *q, int64_t ldq, int32_t s[8]) {
    isa_ref_dot32_i8_x8(qx, q, ldq, s);
}
static inline void isa_i4_dot64(const uint8_t *p, const int8_t *qx, int32_t s[64]) { isa_ref_i4_dot64(p, qx, s); }
static inline float isa_dot_f32(const float *x, const float *y, int64_t n) { return isa_ref_dot_f32(x, y, n); }
static inline float isa_dot_f32_bf16(const float *x, const uint16_t *w, int64_t n) { return isa_ref_dot_f32_bf16(x, w, n); }
static inline float isa_dot_bf16(const uint16_t *x, const uint16_t *w, int64_t n) { return isa_ref_dot_bf16(x, w, n); }
static inline void isa_axpy(float *acc, float p, const void *v, int f32, int64_t n) { isa_ref_axpy(acc, p, v, f32, n); }
static inline void isa_exp_sub(float *s, int64_t n, float m) { isa_ref_exp_sub(s, n, m); }
static inline void isa_widen_bf16(const uint16_t *src, float *dst, int64_t n) { isa_ref_widen_bf16(src, dst, n); }
#endif

#endif
