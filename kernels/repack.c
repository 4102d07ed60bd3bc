/* GGUF K-quant blocks straight into the layouts the engine computes on, in one pass over the stored bytes.
 *
 * Why: an expert read from a GGUF file at run time (offload/experts.py) is rebuilt from its stored blocks into
 * the run-time layout every time it is read; the torch definitions (engine/loader/gguf_io.py: _q4k_parts /
 * _k_scales then Int4Linear's tiling; _q6k_parts) take many passes over temporaries. These write the same
 * bytes directly. Plain C on every ISA level (built into the one kernel library, kernels/_cbuild.py).
 *
 * llmsys_repack_q4k: Q4_K super-blocks src uint8 [N, K/256, 144] (fp16 d, dmin; 12 bytes of 6-bit sc / m as
 * llama.cpp's get_scale_min_k4; 128 bytes of codes, per 64 columns 32 bytes: low nibbles the first 32 columns,
 * high nibbles the next 32) ->
 *   packed uint8 [Np/64, K, 32] (the CPU int4 tiling, kernels/cpu_int4.py pack_cpu_int4; rows N..Np-1 code 8),
 *   sc, m  uint8 [K/32, N] (group-major), d, dmin fp16 bits [K/256, N].
 * llmsys_repack_q6k: Q6_K super-blocks src uint8 [N, K/256, 210] (128 bytes of low 4 bits, 64 of high 2 bits,
 * 16 int8 scales, fp16 d; llama.cpp's dequantize_row_q6_K) ->
 *   q int8 [N, K] (code - 32), sc int8 [K/16, N], d fp16 bits [K/256, N].
 * llmsys_repack_q4_0: Q4_0 blocks src uint8 [N, K/32, 18] (fp16 d; 16 bytes: byte i holds column i in its low
 * nibble, i + 16 in its high) -> packed uint8 [Np/64, K, 32] (as above) and d fp16 bits [K/32, N].
 * llmsys_repack_q8_0: Q8_0 blocks src uint8 [N, K/32, 34] (fp16 d, 32 int8 codes) -> q int8 [N, K], d [K/32, N].
 * All return 0, or 1 for shapes they do not take (K not a multiple of the block, N < 1, Np not N rounded up to 64).
 */
#include <stdint.h>
#include <string.h>

/* The CPU int4 tiling of 4-bit codes stored two to a byte, two columns at a time: for rows 64t + j and 64t + 32 + j,
 * the low nibbles of their byte `at` (of a row) are column c0's codes, the high nibbles column c1's; rows past N
 * take code 8. */
static void tile_nibbles(const uint8_t *src, int64_t n, int64_t row_bytes, int64_t t, int64_t at, int64_t c0,
                         int64_t c1, uint8_t *out) {
    uint8_t lo[32], hi[32];
    for (int j = 0; j < 32; ++j) {
        const int64_t r0 = t * 64 + j, r1 = r0 + 32;
        lo[j] = r0 < n ? src[r0 * row_bytes + at] : 0x88;
        hi[j] = r1 < n ? src[r1 * row_bytes + at] : 0x88;
    }
    uint8_t *o0 = out + c0 * 32, *o1 = out + c1 * 32;
    for (int j = 0; j < 32; ++j) {
        o0[j] = (uint8_t)((lo[j] & 15) | (hi[j] << 4));
        o1[j] = (uint8_t)((lo[j] >> 4) | (hi[j] & 0xF0));
    }
}

int llmsys_repack_q4k(const uint8_t *src, int64_t n, int64_t k, int64_t np, uint8_t *packed, uint8_t *sc,
                      uint8_t *m, uint16_t *d, uint16_t *dmin) {
    if (n < 1 || k < 256 || k % 256 || np != (n + 63) / 64 * 64) return 1;
    const int64_t sb = k / 256, row_bytes = sb * 144;
    /* scales: one row's super-blocks at a time, written group-major */
    for (int64_t r = 0; r < n; ++r) {
        const uint8_t *row = src + r * row_bytes;
        for (int64_t s = 0; s < sb; ++s) {
            const uint8_t *b = row + s * 144;
            uint16_t dv, mv;
            memcpy(&dv, b, 2);
            memcpy(&mv, b + 2, 2);
            d[s * n + r] = dv;
            dmin[s * n + r] = mv;
            const uint8_t *q = b + 4;
            for (int j = 0; j < 4; ++j) {
                sc[(s * 8 + j) * n + r] = q[j] & 63;
                m[(s * 8 + j) * n + r] = q[j + 4] & 63;
                sc[(s * 8 + 4 + j) * n + r] = (uint8_t)((q[j + 8] & 15) | ((q[j] >> 6) << 4));
                m[(s * 8 + 4 + j) * n + r] = (uint8_t)((q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4));
            }
        }
    }
    /* codes: per 64-row tile, per 64 columns of a super-block, byte l holds columns l and l + 32 */
    for (int64_t t = 0; t < np / 64; ++t)
        for (int64_t s = 0; s < sb; ++s)
            for (int64_t p = 0; p < 4; ++p)
                for (int64_t l = 0; l < 32; ++l) {
                    const int64_t c = s * 256 + p * 64 + l;
                    tile_nibbles(src, n, row_bytes, t, s * 144 + 16 + p * 32 + l, c, c + 32, packed + t * k * 32);
                }
    return 0;
}

int llmsys_repack_q6k(const uint8_t *src, int64_t n, int64_t k, int8_t *q, int8_t *sc, uint16_t *d) {
    if (n < 1 || k < 256 || k % 256) return 1;
    const int64_t sb = k / 256, row_bytes = sb * 210;
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t s = 0; s < sb; ++s) {
            const uint8_t *b = src + r * row_bytes + s * 210;
            int8_t *out = q + r * k + s * 256;
            for (int h = 0; h < 2; ++h) { /* 128 columns each: 64 bytes of low bits, 32 of high bits */
                const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
                int8_t *o = out + 128 * h;
                for (int l = 0; l < 32; ++l) {
                    const int a = ql[l], c = ql[l + 32], e = qh[l];
                    o[l] = (int8_t)(((a & 15) | ((e & 3) << 4)) - 32);
                    o[l + 32] = (int8_t)(((c & 15) | (((e >> 2) & 3) << 4)) - 32);
                    o[l + 64] = (int8_t)(((a >> 4) | (((e >> 4) & 3) << 4)) - 32);
                    o[l + 96] = (int8_t)(((c >> 4) | (((e >> 6) & 3) << 4)) - 32);
                }
            }
            for (int i = 0; i < 16; ++i) sc[(s * 16 + i) * n + r] = (int8_t)b[192 + i];
            uint16_t dv;
            memcpy(&dv, b + 208, 2);
            d[s * n + r] = dv;
        }
    }
    return 0;
}

int llmsys_repack_q4_0(const uint8_t *src, int64_t n, int64_t k, int64_t np, uint8_t *packed, uint16_t *d) {
    if (n < 1 || k < 32 || k % 32 || np != (n + 63) / 64 * 64) return 1;
    const int64_t g = k / 32, row_bytes = g * 18;
    for (int64_t r = 0; r < n; ++r)
        for (int64_t b = 0; b < g; ++b) {
            uint16_t dv;
            memcpy(&dv, src + r * row_bytes + b * 18, 2);
            d[b * n + r] = dv;
        }
    for (int64_t t = 0; t < np / 64; ++t)
        for (int64_t b = 0; b < g; ++b)
            for (int64_t i = 0; i < 16; ++i)
                tile_nibbles(src, n, row_bytes, t, b * 18 + 2 + i, b * 32 + i, b * 32 + 16 + i, packed + t * k * 32);
    return 0;
}

int llmsys_repack_q8_0(const uint8_t *src, int64_t n, int64_t k, int8_t *q, uint16_t *d) {
    if (n < 1 || k < 32 || k % 32) return 1;
    const int64_t g = k / 32, row_bytes = g * 34;
    for (int64_t r = 0; r < n; ++r)
        for (int64_t b = 0; b < g; ++b) {
            const uint8_t *blk = src + r * row_bytes + b * 34;
            uint16_t dv;
            memcpy(&dv, blk, 2);
            d[b * n + r] = dv;
            memcpy(q + r * k + b * 32, blk + 2, 32);
        }
    return 0;
}
