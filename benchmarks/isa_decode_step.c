/* One SmolLM2-135M-shape decode step's GEMVs (hidden 576, intermediate 1536, 9 query / 3 KV heads of 64,
 * 30 layers: q, k, v, o, gate, up, down per layer) with the a8 GEMVs, one thread, one row of x: the time a
 * step's weight products take, for comparing two builds of the same kernels (e.g. aarch64 with and without
 * kernels/isa_neon.h, run under qemu-aarch64, where the time is a rough proxy of the instructions executed,
 * not of a real ARM CPU's speed). One layer's weights serve all 30 layers (the proxy counts work, not cache
 * misses). Prints the median CPU milliseconds per step of `steps` and a checksum of the outputs (the two builds
 * must agree).
 *
 *     aarch64-linux-gnu-gcc -O3 -fopenmp -ffp-contract=off -march=armv8.2-a+dotprod+fp16 \
 *         benchmarks/isa_decode_step.c kernels/<the a8 GEMV sources> -lm -o step   [-DLLMSYS_NO_NEON]
 *     qemu-aarch64 -L /usr/aarch64-linux-gnu ./step int4 5
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int llmsys_qgemv_int8_a8(const uint16_t *x, int64_t ldx, const int8_t *q, const uint16_t *scales, uint16_t *out,
                         int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads);
int llmsys_qgemv_int4_a8(const uint16_t *x, int64_t ldx, const uint8_t *packed, const void *scales, int64_t s_n,
                         int64_t s_g, int scale_kind, const uint8_t *zeros, int64_t z_n, int64_t z_g, uint16_t *out,
                         int64_t ldo, int64_t m_count, int64_t n, int64_t kp, int64_t k, int64_t gs, int threads);

static uint64_t state = 88172645463325252ull;
static uint32_t next(void) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)(state >> 32);
}

enum { HIDDEN = 576, INTER = 1536, KV = 192, LAYERS = 30, NW = 7, GS = 32 };
static const int64_t SHAPE[NW][2] = {{HIDDEN, HIDDEN}, {KV, HIDDEN}, {KV, HIDDEN}, {HIDDEN, HIDDEN},
                                     {INTER, HIDDEN}, {INTER, HIDDEN}, {HIDDEN, INTER}}; /* (n, k) */

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); /* CPU time: the machine running qemu may be shared */
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int cmp(const void *a, const void *b) { return (*(const double *)a > *(const double *)b) - (*(const double *)a < *(const double *)b); }

int main(int argc, char **argv) {
    if (argc != 3 || (strcmp(argv[1], "int8") && strcmp(argv[1], "int4")) || atoi(argv[2]) < 1) {
        fprintf(stderr, "usage: %s int8|int4 STEPS\n", argv[0]);
        return 2;
    }
    const int int4 = argv[1][3] == '4', steps = atoi(argv[2]) > 64 ? 64 : atoi(argv[2]);
    void *w[NW];
    uint16_t *scales[NW];
    uint8_t *zeros[NW];
    for (int i = 0; i < NW; i++) {
        const int64_t n = SHAPE[i][0], k = SHAPE[i][1], g = k / GS;
        const size_t bytes = (size_t)(int4 ? n * k / 2 : n * k);
        uint8_t *p = malloc(bytes);
        for (size_t j = 0; j < bytes; j++) p[j] = int4 ? (uint8_t)next() : (uint8_t)((int)(next() % 255) - 127);
        w[i] = p;
        scales[i] = malloc(2 * (size_t)(n * g));
        zeros[i] = malloc((size_t)(n * g));
        for (int64_t j = 0; j < n * g; j++) scales[i][j] = (uint16_t)(0x3b00u + next() % 0x100u), zeros[i][j] = (uint8_t)(next() % 16);
    }
    uint16_t x[INTER], out[INTER];
    for (int i = 0; i < INTER; i++) x[i] = (uint16_t)(0x3f00u + next() % 0x100u) | (next() & 1 ? 0x8000u : 0);
    double t[64];
    uint32_t sum = 0;
    for (int s = 0; s < steps; s++) {
        const double t0 = now_ms();
        for (int l = 0; l < LAYERS; l++)
            for (int i = 0; i < NW; i++) {
                const int64_t n = SHAPE[i][0], k = SHAPE[i][1], g = k / GS;
                const int rc = int4 ? llmsys_qgemv_int4_a8(x, k, w[i], scales[i], g, 1, 0, zeros[i], g, 1, out, n, 1, n, k, k, GS, 1)
                                    : llmsys_qgemv_int8_a8(x, k, w[i], scales[i], out, n, 1, n, k, 1);
                if (rc) {
                    fprintf(stderr, "GEMV %d failed: %d\n", i, rc);
                    return 1;
                }
                for (int64_t j = 0; j < n; j++) sum = sum * 31u + out[j];
            }
        t[s] = now_ms() - t0;
    }
    qsort(t, (size_t)steps, sizeof *t, cmp);
    printf("%s step: median %.1f ms (min %.1f, %d steps), checksum %08x\n", argv[1], t[steps / 2], t[0], steps, sum);
    return 0;
}
