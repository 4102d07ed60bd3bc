/* What the running CPU can execute, as a bit mask (kernels/_cbuild.py, FEATURE_BITS).
 *
 * Built at the baseline ISA level of its architecture (x86-64 / armv8-a), so it runs on any CPU
 * of that architecture and tells which of the other builds may be loaded. Why a C probe and not
 * /proc/cpuinfo text: cpuid (x86, through libgcc's __builtin_cpu_supports, which also checks that
 * the OS saves the AVX / AVX-512 registers) and the kernel's hardware capabilities (aarch64,
 * getauxval) are what the instructions need; an emulator (qemu-user -cpu Nehalem) or a container
 * moved to another host answers them for the CPU the code really runs on.
 */
#include <stdint.h>

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDHP
#define HWCAP_ASIMDHP (1UL << 10)
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1UL << 20)
#endif
#endif

/* Bits (keep in step with _cbuild.FEATURE_BITS). */
enum {
    F_AVX2 = 1 << 0, F_FMA = 1 << 1, F_F16C = 1 << 2, F_BMI2 = 1 << 3,
    F_AVX512F = 1 << 4, F_AVX512BW = 1 << 5, F_AVX512DQ = 1 << 6, F_AVX512VL = 1 << 7,
    F_AVX512CD = 1 << 8, F_AVX512BF16 = 1 << 9, F_AVX512VNNI = 1 << 10,
    F_SSSE3 = 1 << 11, F_SSE41 = 1 << 12, F_SSE42 = 1 << 13, F_POPCNT = 1 << 14,
    F_NEON = 1 << 16, F_DOTPROD = 1 << 17, F_FP16 = 1 << 18,
};

int64_t llmsys_cpu_features(void) {
    int64_t f = 0;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("ssse3")) f |= F_SSSE3;
    if (__builtin_cpu_supports("sse4.1")) f |= F_SSE41;
    if (__builtin_cpu_supports("sse4.2")) f |= F_SSE42;
    if (__builtin_cpu_supports("popcnt")) f |= F_POPCNT;
    if (__builtin_cpu_supports("avx2")) f |= F_AVX2;
    if (__builtin_cpu_supports("fma")) f |= F_FMA;
    if (__builtin_cpu_supports("f16c")) f |= F_F16C;
    if (__builtin_cpu_supports("bmi2")) f |= F_BMI2;
    if (__builtin_cpu_supports("avx512f")) f |= F_AVX512F;
    if (__builtin_cpu_supports("avx512bw")) f |= F_AVX512BW;
    if (__builtin_cpu_supports("avx512dq")) f |= F_AVX512DQ;
    if (__builtin_cpu_supports("avx512vl")) f |= F_AVX512VL;
    if (__builtin_cpu_supports("avx512cd")) f |= F_AVX512CD;
    if (__builtin_cpu_supports("avx512bf16")) f |= F_AVX512BF16;
    if (__builtin_cpu_supports("avx512vnni")) f |= F_AVX512VNNI;
#elif defined(__aarch64__)
    f |= F_NEON; /* Advanced SIMD is part of every AArch64 Linux / macOS CPU */
#if defined(__linux__)
    unsigned long hw = getauxval(AT_HWCAP);
    if (hw & HWCAP_ASIMDDP) f |= F_DOTPROD;
    if (hw & HWCAP_ASIMDHP) f |= F_FP16;
#endif
#endif
    return f;
}
