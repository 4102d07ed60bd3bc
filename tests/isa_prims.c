/* The ISA primitives of kernels/isa.h against their definitions (kernels/isa_scalar.h's isa_ref_*) on random and
 * extreme inputs: tests/test_isa_cross.py builds this for every ISA level (x86-64 natively, aarch64 with the
 * cross compiler, run under qemu-aarch64), and for aarch64 also with -DLLMSYS_NO_NEON (the scalar family).
 * Each line is "<case> <family> <mismatches against isa_ref_*> <hex of the primitive's outputs>"; every build
 * must report 0 mismatches and print the x86-64 baseline's hex.
 *
 *     gcc -O3 -ffp-contract=off -Ikernels tests/isa_prims.c -lm
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"

static uint64_t state = 88172645463325252ull;
static uint32_t next(void) { /* xorshift64: the same stream on every machine */
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)(state >> 32);
}

/* a float of random sign and exponent in 2^-lo .. 2^hi: sums of such values round differently in any
   other order, so a lane-order or contraction slip changes bits */
static float wide(int lo, int hi) {
    const float m = 1.0f + (float)(next() >> 9) / (float)(1 << 23);
    const int e = (int)(next() % (uint32_t)(lo + hi + 1)) - lo;
    return (next() & 1 ? -1.0f : 1.0f) * ldexpf(m, e);
}
static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16); /* truncation: any bf16 value will do */
}

static void line(const char *name, int bad, const void *p, size_t bytes) {
    printf("%s %s %d ", name, ISA_NAME, bad);
    const uint8_t *b = p;
    for (size_t i = 0; i < bytes; i++) printf("%02x", b[i]);
    printf("\n");
}

static int differ(const void *a, const void *b, size_t bytes) { return memcmp(a, b, bytes) != 0; }

int main(void) {
    enum { K = 1600 };
    static const int64_t lens[] = {0, 1, 7, 15, 16, 17, 31, 32, 33, 48, 63, 64, 100, 576, 1536};
    int8_t *x8 = malloc(K), *w8 = malloc(K);
    char name[64];

    /* int8 dots: random codes; then the extremes (x, w +-127: the largest int16 pairs). Weight codes are within
       +-127 (the kernels' int8 formats): the x86 sign trick (psignb) cannot negate -128. */
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < K; i++) {
            x8[i] = round == 0 ? (int8_t)((int)(next() % 255) - 127) : (int8_t)(next() & 1 ? 127 : -127);
            w8[i] = round == 0 ? (int8_t)((int)(next() % 255) - 127) : round == 1 ? (int8_t)-127 : (int8_t)127;
            if (round == 2 && (i & 1)) w8[i] = -127;
        }
        int32_t got[sizeof lens / sizeof *lens];
        int bad = 0;
        for (size_t j = 0; j < sizeof lens / sizeof *lens; j++) {
            got[j] = isa_dot_i8(x8 + j, w8 + 3 * j, lens[j]);
            bad += got[j] != isa_ref_dot_i8(x8 + j, w8 + 3 * j, lens[j]);
        }
        snprintf(name, sizeof name, "dot_i8_r%d", round);
        line(name, bad, got, sizeof got);
        /* 8 rows of one 32-code block, rows ldq = 40 apart */
        int32_t s[8], r[8];
        isa_dot32_i8_x8(x8 + 5, w8, 40, s);
        isa_ref_dot32_i8_x8(x8 + 5, w8, 40, r);
        snprintf(name, sizeof name, "dot32_i8_x8_r%d", round);
        line(name, differ(s, r, sizeof s), s, sizeof s);
    }

    /* int4 block dots: random nibbles; all 15 against +-127 (the int16 sums' extremes) */
    uint8_t p[32 * 32];
    int8_t qx[32];
    for (int round = 0; round < 4; round++) {
        for (int i = 0; i < 32 * 32; i++) p[i] = round == 0 ? (uint8_t)next() : round == 3 ? (uint8_t)next() : 0xff;
        for (int c = 0; c < 32; c++)
            qx[c] = round == 0 ? (int8_t)((int)(next() % 255) - 127) : round == 1 ? 127 : round == 2 ? -127 : (int8_t)(c & 1 ? 127 : -127);
        int32_t s[64], r[64];
        isa_i4_dot64(p, qx, s);
        isa_ref_i4_dot64(p, qx, r);
        snprintf(name, sizeof name, "i4_dot64_r%d", round);
        line(name, differ(s, r, sizeof s), s, sizeof s);
    }

    /* float dots over every length (the tail into lanes 0 ..), wide-range values */
    float *xf = malloc(4 * K), *yf = malloc(4 * K);
    uint16_t *xb = malloc(2 * K), *wb = malloc(2 * K);
    for (int i = 0; i < K; i++) xf[i] = wide(20, 20), yf[i] = wide(20, 20), xb[i] = to_bf16(wide(20, 20)), wb[i] = to_bf16(wide(20, 20));
    {
        float got[3][sizeof lens / sizeof *lens];
        int bad[3] = {0, 0, 0};
        for (size_t j = 0; j < sizeof lens / sizeof *lens; j++) {
            float r;
            got[0][j] = isa_dot_f32(xf + j, yf + 2 * j, lens[j]), r = isa_ref_dot_f32(xf + j, yf + 2 * j, lens[j]);
            bad[0] += differ(&got[0][j], &r, 4);
            got[1][j] = isa_dot_f32_bf16(xf + j, wb + 2 * j, lens[j]), r = isa_ref_dot_f32_bf16(xf + j, wb + 2 * j, lens[j]);
            bad[1] += differ(&got[1][j], &r, 4);
            got[2][j] = isa_dot_bf16(xb + j, wb + 2 * j, lens[j]), r = isa_ref_dot_bf16(xb + j, wb + 2 * j, lens[j]);
            bad[2] += differ(&got[2][j], &r, 4);
        }
        line("dot_f32", bad[0], got[0], sizeof got[0]);
        line("dot_f32_bf16", bad[1], got[1], sizeof got[1]);
        line("dot_bf16", bad[2], got[2], sizeof got[2]);
    }

    /* axpy (float32 and bf16 v), an odd length for the tail */
    {
        enum { N = 203 };
        float a[2][N], r[2][N];
        for (int i = 0; i < N; i++) a[0][i] = a[1][i] = r[0][i] = r[1][i] = wide(10, 10);
        const float pv = wide(5, 5);
        isa_axpy(a[0], pv, yf, 1, N), isa_ref_axpy(r[0], pv, yf, 1, N);
        isa_axpy(a[1], pv, wb, 0, N), isa_ref_axpy(r[1], pv, wb, 0, N);
        line("axpy_f32", differ(a[0], r[0], sizeof a[0]), a[0], sizeof a[0]);
        line("axpy_bf16", differ(a[1], r[1], sizeof a[1]), a[1], sizeof a[1]);
    }

    /* exp over its range, its edges, inf and NaN; widening */
    {
        enum { N = 4099 };
        float *e = malloc(4 * N), *r = malloc(4 * N);
        static const float edge[] = {0.0f, -0.0f, 1.0f, -1.0f, OPS_EXP_HI, -86.0f, -86.00001f, 88.7229f, 89.0f, -87.0f,
                                     INFINITY, -INFINITY, NAN, 1e-30f, -1e-30f, 0.5f, -0.5f, 44.3614196f, -44.3614196f};
        for (int i = 0; i < N; i++)
            e[i] = i < (int)(sizeof edge / sizeof *edge) ? edge[i] : -100.0f + 200.0f * (float)(next() >> 8) / (float)(1 << 24);
        memcpy(r, e, 4 * N);
        isa_exp_sub(e, N, 0.25f);
        isa_ref_exp_sub(r, N, 0.25f);
        line("exp_sub", differ(e, r, 4 * N), e, 4 * N);
        isa_widen_bf16(wb, e, 1001);
        isa_ref_widen_bf16(wb, r, 1001);
        line("widen_bf16", differ(e, r, 4 * 1001), e, 4 * 1001);
        free(e), free(r);
    }
    free(x8), free(w8), free(xf), free(yf), free(xb), free(wb);
    return 0;
}
