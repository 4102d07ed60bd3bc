/* Every C kernel on fixed pseudo-random inputs, outputs printed as hex: tests/test_isa_cross.py builds
 * this with the kernel sources for each ISA level (x86-64 natively, aarch64 with the cross compiler,
 * run under qemu-aarch64) and compares the bits, without a Python or torch for the other
 * architecture. The kernels define their arithmetic independently of the ISA (fixed summation
 * order, no contraction: kernels/a8_gemv.c), so every build must print the same lines; only
 * the attention's expf may round differently in another libm (compared within a tolerance).
 *
 *     gcc -O3 -fopenmp -ffp-contract=off tests/isa_harness.c kernels/cpu_{decode,int4}.c \
 *         kernels/{a8_gemv,dense_gemv,fused_layer,decode_stack}.c -lm
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int llmsys_rms_norm(const void *x, const void *res, const void *w, void *out, void *new_res, int64_t rows,
                    int64_t d, float eps, int f32, int threads);
int llmsys_silu_mul(const void *g, int64_t ldg, const void *u, int64_t ldu, void *y, int64_t rows, int64_t inter,
                    int f32, int threads);
int llmsys_rope(const void *q, int64_t q_stride, const void *k, int64_t k_stride, void *q_out, void *k_out,
                const int64_t *pos, const float *cache, int64_t max_pos, int64_t t_count, int64_t hq, int64_t hk,
                int64_t d, int f32);
int llmsys_gemv_f32(const float *x, int64_t ldx, const float *w, int64_t ldw, float *out, int64_t ldo,
                    int64_t m_count, int64_t n, int64_t k, int threads);
int llmsys_gemv_bf16_io(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, void *out, int64_t ldo,
                        int64_t m_count, int64_t n, int64_t k, int threads, int io);
int llmsys_decode_attention(const void *q, const void *k, const void *v, const int64_t *slots, const int64_t *lens,
                            float scale, void *out, int64_t b_count, int64_t l_max, int64_t hq, int64_t hk, int64_t d,
                            int f32, int threads);
int llmsys_qgemv_int8_a8(const uint16_t *x, int64_t ldx, const int8_t *q, const uint16_t *scales, uint16_t *out,
                         int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads);
int llmsys_qgemv_int8g_a8(const uint16_t *x, int64_t ldx, const int8_t *q, const uint16_t *block_scales,
                          uint16_t *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads);
int llmsys_qgemv_int4_a8(const uint16_t *x, int64_t ldx, const uint8_t *packed, const void *scales, int64_t s_n,
                         int64_t s_g, int scale_kind, const uint8_t *zeros, int64_t z_n, int64_t z_g, uint16_t *out,
                         int64_t ldo, int64_t m_count, int64_t n, int64_t kp, int64_t k, int64_t gs, int threads);
int llmsys_qgemv_int4o_a8(const uint16_t *x, int64_t ldx, const uint8_t *packed, const void *scales, int64_t s_n,
                          int64_t s_g, int scale_kind, const uint8_t *zeros, int64_t z_n, int64_t z_g, const float *offs,
                          int64_t o_n, int64_t o_g, uint16_t *out, int64_t ldo, int64_t m_count, int64_t n, int64_t kp,
                          int64_t k, int64_t gs, int threads);
int llmsys_qgemv_int8h_a8(const uint16_t *x, int64_t ldx, const int8_t *q, const int8_t *sc, const uint16_t *d,
                          uint16_t *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads);
int llmsys_qgemv_int8o_a8(const uint16_t *x, int64_t ldx, const int8_t *q, const float *scales, const float *offsets,
                          uint16_t *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads);
int llmsys_qgemv_int4k_a8(const uint16_t *x, int64_t ldx, const uint8_t *packed, const uint8_t *ksc, const uint8_t *km,
                          const uint16_t *kd, const uint16_t *kdm, int64_t k_n, uint16_t *out, int64_t ldo,
                          int64_t m_count, int64_t n, int64_t kp, int64_t k, int threads);
int llmsys_int4_cpu_dequant(const uint8_t *packed, const void *scales, int64_t s_n, int64_t s_g, int scale_f32,
                            const uint8_t *zeros, uint16_t *out, int64_t ldo, int64_t n_rows, int64_t kp, int64_t k,
                            int64_t gs, int nthreads);

static uint64_t state = 88172645463325252ull;
static uint32_t next(void) { /* xorshift64: the same stream on every machine */
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return (uint32_t)(state >> 32);
}
static float uniform(float lo, float hi) { return lo + (hi - lo) * (float)(next() >> 8) / (float)(1 << 24); }
static uint16_t bf16(float f) { /* round to nearest even (inputs are finite) */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
static uint16_t *bf16_array(int64_t n, float lo, float hi) {
    uint16_t *a = malloc(2 * n);
    for (int64_t i = 0; i < n; i++) a[i] = bf16(uniform(lo, hi));
    return a;
}
static float *f32_array(int64_t n, float lo, float hi) {
    float *a = malloc(4 * n);
    for (int64_t i = 0; i < n; i++) a[i] = uniform(lo, hi);
    return a;
}
static void dump(const char *name, int rc, const void *p, int64_t bytes) {
    printf("%s rc=%d ", name, rc);
    const uint8_t *b = p;
    for (int64_t i = 0; i < bytes; i++) printf("%02x", b[i]);
    printf("\n");
}

int main(void) {
    enum { D = 300, ROWS = 4 };
    uint16_t *x = bf16_array(ROWS * D, -2, 2), *res = bf16_array(ROWS * D, -2, 2), *w = bf16_array(D, 0.5f, 1.5f);
    uint16_t out[ROWS * D], new_res[ROWS * D];
    dump("rms_norm", llmsys_rms_norm(x, res, w, out, new_res, ROWS, D, 1e-6f, 0, 2), out, sizeof out);
    dump("rms_norm_residual", 0, new_res, sizeof new_res);
    /* float32 rows: RMSNorm, silu * mul (its own exp), the float32 GEMV (K and N tails) */
    float *xf = f32_array(ROWS * D, -2, 2), *rf = f32_array(ROWS * D, -2, 2), *wf = f32_array(D, 0.5f, 1.5f);
    float outf[ROWS * D], resf[ROWS * D];
    dump("rms_norm_f32", llmsys_rms_norm(xf, rf, wf, outf, resf, ROWS, D, 1e-6f, 1, 2), outf, sizeof outf);
    dump("silu_mul_f32", llmsys_silu_mul(xf, D, rf, D, outf, ROWS, D - 3, 1, 2), outf, 4 * ROWS * (D - 3));
    enum { NF = 70 };
    float *gw = f32_array(NF * (D - 3), -1, 1), gout[ROWS * NF];
    for (int m = 1; m <= ROWS; m += 3) {
        char name[32];
        snprintf(name, sizeof name, "gemv_f32_m%d", m);
        dump(name, llmsys_gemv_f32(xf, D, gw, D - 3, gout, NF, m, NF, D - 3, 2), gout, 4 * m * NF);
    }
    /* the bf16 GEMV's float32 sums (IO_OUT_F32: not rounded to bf16, so a lane-order slip shows), K tail */
    uint16_t *bw = bf16_array(NF * (D - 3), -1, 1);
    for (int m = 1; m <= ROWS; m += 3) {
        char name[32];
        snprintf(name, sizeof name, "gemv_bf16_f32out_m%d", m);
        dump(name, llmsys_gemv_bf16_io(x, D, bw, D - 3, gout, NF, m, NF, D - 3, 2, 2), gout, 4 * m * NF);
    }

    enum { T = 3, HQ = 8, HK = 2, HD = 64, MAXPOS = 32 };
    uint16_t *q = bf16_array(T * HQ * HD, -2, 2), *k = bf16_array(T * HK * HD, -2, 2);
    float cache[MAXPOS * HD];
    for (int i = 0; i < MAXPOS * HD; i++) cache[i] = uniform(-1, 1);
    int64_t pos[T] = {0, 5, 31};
    uint16_t qo[T * HQ * HD], ko[T * HK * HD];
    int rc = llmsys_rope(q, HQ * HD, k, HK * HD, qo, ko, pos, cache, MAXPOS, T, HQ, HK, HD, 0);
    dump("rope_q", rc, qo, sizeof qo);
    dump("rope_k", rc, ko, sizeof ko);

    enum { B = 3, L = 40 };
    int64_t lens[B] = {40, 17, 1};
    uint16_t *aq = bf16_array(B * HQ * HD, -2, 2), *ak = bf16_array(B * L * HK * HD, -2, 2),
             *av = bf16_array(B * L * HK * HD, -2, 2), ao[B * HQ * HD];
    dump("attention_bf16", llmsys_decode_attention(aq, ak, av, NULL, lens, 0.125f, ao, B, L, HQ, HK, HD, 0, 2), ao,
         sizeof ao);
    float *fq = malloc(4 * B * HQ * HD), *fk = malloc(4 * B * L * HK * HD), *fv = malloc(4 * B * L * HK * HD),
          fo[B * HQ * HD];
    for (int i = 0; i < B * HQ * HD; i++) fq[i] = uniform(-2, 2);
    for (int i = 0; i < B * L * HK * HD; i++) fk[i] = uniform(-2, 2), fv[i] = uniform(-2, 2);
    dump("attention_f32", llmsys_decode_attention(fq, fk, fv, NULL, lens, 0.125f, fo, B, L, HQ, HK, HD, 1, 2), fo,
         sizeof fo);

    enum { M = 9, N8 = 130, K8 = 300 }; /* the a8 GEMVs at 1, 5 and 9 rows: every pass size of their loops */
    uint16_t *gx = bf16_array(M * K8, -2, 2), *s8 = bf16_array(N8, 0.001f, 0.02f), o8[M * N8];
    int8_t *q8 = malloc(N8 * K8);
    for (int i = 0; i < N8 * K8; i++) q8[i] = (int8_t)((int)(next() % 255) - 127);
    for (int m = 1; m <= M; m += 4) {
        char name[32];
        snprintf(name, sizeof name, "int8_a8_m%d", m);
        dump(name, llmsys_qgemv_int8_a8(gx, K8, q8, s8, o8, N8, m, N8, K8, 2), o8, 2 * m * N8);
    }
    enum { NB8 = (K8 + 31) / 32 };
    uint16_t *bs8 = malloc(2 * NB8 * N8); /* fp16 block scales [NB8, N8] (GGUF Q8_0's): 2^-9 .. 2^-8 */
    for (int i = 0; i < NB8 * N8; i++) bs8[i] = (uint16_t)(0x1800u + next() % 0x400u);
    for (int m = 1; m <= M; m += 4) {
        char name[32];
        snprintf(name, sizeof name, "int8g_a8_m%d", m);
        dump(name, llmsys_qgemv_int8g_a8(gx, K8, q8, bs8, o8, N8, m, N8, K8, 2), o8, 2 * m * N8);
    }

    enum { KH = 256 }; /* GGUF Q6_K / Q5_K layouts: K a multiple of 32 */
    float *hs = malloc(sizeof(float) * (KH / 32) * N8), *fo8 = malloc(sizeof(float) * (KH / 32) * N8);
    int8_t *sc6 = malloc((KH / 16) * N8); /* Q6_K's stored scales: int8 per 16 columns, fp16 d per 256 */
    uint16_t *d6 = malloc(2 * (KH / 256) * N8);
    for (int i = 0; i < (KH / 16) * N8; i++) sc6[i] = (int8_t)((int)(next() % 256) - 128);
    for (int i = 0; i < (KH / 256) * N8; i++) d6[i] = (uint16_t)(0x1000u + next() % 0x400u);
    for (int i = 0; i < (KH / 32) * N8; i++) hs[i] = uniform(0.001f, 0.02f);
    for (int i = 0; i < (KH / 32) * N8; i++) fo8[i] = uniform(-0.2f, 0.0f);
    for (int m = 1; m <= M; m += 4) {
        char name[32];
        snprintf(name, sizeof name, "int8h_a8_m%d", m);
        dump(name, llmsys_qgemv_int8h_a8(gx, K8, q8, sc6, d6, o8, N8, m, N8, KH, 2), o8, 2 * m * N8);
        snprintf(name, sizeof name, "int8o_a8_m%d", m);
        dump(name, llmsys_qgemv_int8o_a8(gx, K8, q8, hs, fo8, o8, N8, m, N8, KH, 2), o8, 2 * m * N8);
    }

    enum { N4 = 128, K4 = 250, KP = 256, GS = 64, G = KP / GS };
    uint8_t *packed = malloc(N4 * KP / 2), zeros[N4 * G];
    for (int i = 0; i < N4 * KP / 2; i++) packed[i] = (uint8_t)next();
    for (int i = 0; i < N4 * G; i++) zeros[i] = (uint8_t)(next() % 16);
    uint16_t *s4 = bf16_array(N4 * G, 0.001f, 0.05f), o4[M * N4], dq[N4 * K4];
    for (int m = 1; m <= M; m += 4) {
        char name[32];
        snprintf(name, sizeof name, "int4_a8_m%d", m);
        dump(name, llmsys_qgemv_int4_a8(gx, K8, packed, s4, G, 1, 0, zeros, G, 1, o4, N4, m, N4, KP, K4, GS, 2), o4,
             2 * m * N4);
    }
    float f4[N4 * G], o4f[N4 * G]; /* float32 scales and offsets, group-major [G, N4] (GGUF Q4_K's as loaded) */
    for (int i = 0; i < N4 * G; i++) f4[i] = uniform(0.001f, 0.05f), o4f[i] = uniform(-0.2f, 0.0f);
    for (int m = 1; m <= M; m += 4) {
        char name[32];
        snprintf(name, sizeof name, "int4o_a8_m%d", m);
        dump(name, llmsys_qgemv_int4o_a8(gx, K8, packed, f4, 1, N4, 1, zeros, 0, 0, o4f, 1, N4, o4, N4, m, N4, KP, K4,
                                         GS, 2), o4, 2 * m * N4);
    }
    uint8_t ksc[N4 * (KP / 32)], km[N4 * (KP / 32)]; /* Q4_K's stored scales: 6-bit, group-major */
    uint16_t kd[N4 * (KP / 256)], kdm[N4 * (KP / 256)];
    for (int i = 0; i < N4 * (KP / 32); i++) ksc[i] = (uint8_t)(next() % 64), km[i] = (uint8_t)(next() % 64);
    for (int i = 0; i < N4 * (KP / 256); i++) kd[i] = (uint16_t)(0x1000u + next() % 0x400u), kdm[i] = (uint16_t)(0x1000u + next() % 0x400u);
    for (int m = 1; m <= M; m += 4) {
        char name[32];
        snprintf(name, sizeof name, "int4k_a8_m%d", m);
        dump(name, llmsys_qgemv_int4k_a8(gx, K8, packed, ksc, km, kd, kdm, N4, o4, N4, m, N4, KP, K4, 2), o4,
             2 * m * N4);
    }
    dump("int4_dequant", llmsys_int4_cpu_dequant(packed, s4, G, 1, 0, zeros, dq, K4, N4, KP, K4, GS, 2), dq,
         sizeof dq);
    return 0;
}
