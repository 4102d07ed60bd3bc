/* bfloat16 <-> float32 for the CPU C kernels (cpu_decode.c, cpu_int4.c, a8_gemv.c, dense_gemv.c, fused_layer.c).
 * bf16 -> f32 is exact; f32 -> bf16 rounds to nearest even, NaN -> 0x7fc0 (torch's c10::BFloat16). */
#ifndef LLMSYS_CPU_BF16_H
#define LLMSYS_CPU_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t rne(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
#endif
