/* The int8-activation ("a8") GEMVs: the quantized layers' GEMVs for every row of x, prompt and decode.
 *
 * Decode on int8 and int4 weights with x quantized to int8 per 32-column block, as llama.cpp's CPU
 * backend does (its q8_0 activations). Why: float GEMVs on these weights spend 4-6 instructions per 8
 * multiply-adds turning weight codes into floats (AVX2 int4: ~3 GB/s on Zen 3, far below the memory);
 * with both operands integer, vpmaddubsw/vpmaddwd do 32 multiply-adds in 2-4 instructions and the
 * weights stream at memory speed.
 *
 * Arithmetic (kernels/cpu_qgemv.py int8_a8_def / int4_a8_def, bit for bit; every sum of products
 * below is an exact integer, so no lane order enters and every ISA build gives the same bits):
 *   x block b of row m (columns 32b .. 32b+31, zero past K):
 *       amax = max |x|, d = amax / 127 (float32), id = d != 0 ? 1 / d : 0,
 *       qx = round-half-even(x * id) (|qx| <= 127), dx[b] = d, sx[b] = sum of qx
 *   int8: S_b = sum over the block of qx * q[n]            (exact int32)
 *         f = f + float(S_b) * dx[b], in order of b (product rounded, then added)
 *         out[m, n] = bf16(f * scale[n])
 *   int4: S_b = sum over the block of qx * q[n]; T_b = S_b - zero[n, g] * sx[b]   (exact, g = b's group)
 *         f = f + float(T_b) * (scale[n, g] * dx[b]), in order of b
 *         out[m, n] = bf16(f)
 *   int4 with float32 offsets (w = scale * q + offset: GGUF Q4_K / Q4_1, whose minimum per group is a float,
 *         not a multiple of the scale): f = f + (float(S_b) * (scale[n, g] * dx[b]) + float(sx[b]) * (offset[n, g] * dx[b]))
 * float(T_b) is exact (|T_b| < 2^24). The error against the float GEMVs is that of x's int8 rounding,
 * at most d / 2 per element (the perplexity figures in docs/benchmarks.md).
 *
 * How (AVX2, also in the AVX-512 builds): int8 takes 8 weight rows per block: |q| (vpabsb) times qx with
 * q's signs (vpsignb) in vpmaddubsw -- a weight code of -128 is never negated --, vpmaddwd with ones to
 * int32, the 8 rows' sums reduced by vphaddd.
 * int4 reads the CPU int4 tiling (32 bytes per column give 64 rows' codes) two columns at a time:
 * both columns' bytes interleaved by vpunpck{l,h}bw hold each row's (code k, code k+1) pair in their low
 * nibbles (row + 32's in the high ones), and
 * vpmaddubsw against the broadcast pair (qx_k, qx_k+1) gives every row's two products summed, added in
 * int16 for 8 column pairs (at most 8 * 2 * 15 * 127 < 2^15) and then widened.
 */
#include "gemv_common.h"

static inline float half_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
    if (e == 0x1f) {
        u = sign | 0x7f800000u | (m << 13);
    } else if (e) {
        u = sign | ((e + 112u) << 23) | (m << 13);
    } else if (m) { /* subnormal: normalize */
        int sh = 0;
        while (!(m & 0x400u)) { m <<= 1; sh++; }
        u = sign | ((uint32_t)(113 - sh) << 23) | ((m & 0x3ffu) << 13);
    } else {
        u = sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* a scale of enum scale_kind `kind` as float32 (exact) */
static inline float load_scale(const void *s, int64_t at, int kind) {
    if (kind == SCALE_F32) return ((const float *)s)[at];
    if (kind == SCALE_F16) return half_to_f32(((const uint16_t *)s)[at]);
    return bf(((const uint16_t *)s)[at]);
}

#ifdef QG_AVX512
/* Outputs leave the AVX-512 kernels as vectors: a vector stored and read back a float at a time
   stalled each read (store-to-load forwarding; ~10 cycles an output, ~40% of an int8 GEMM at M = 128 on
   Zen 5). 16 floats -> 16 bf16, rounded to nearest even, NaN -> 0x7fc0 (rne()'s bits). */
static inline __m256i rne16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}

/* out[m, row0 + 16v + i] = bf16(r[v] lane i) for rows below `rows`; r in row order. */
static inline void store_rows(uint16_t *o, const __m512 *r, int64_t rows) {
    for (int v = 0; v < 4; v++) {
        const int64_t left = rows - 16 * v;
        if (left <= 0) break;
        const __mmask16 mk = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);
        _mm256_mask_storeu_epi16(o + 16 * v, mk, rne16(r[v]));
    }
}

/* 16 outputs at once; the first `rows` (<= 16) of them with rows_mask */
static inline void put16(qout o, int64_t m, int64_t n, __m512 v) {
    if (o.f32) _mm512_storeu_ps((float *)o.p + m * o.ld + n, v);
    else _mm256_storeu_si256((__m256i *)((uint16_t *)o.p + m * o.ld + n), rne16(v));
}

/* store_rows into a qout: out[m, n + 16v + i] = r[v] lane i for the first `rows` */
static inline void put_rows(qout o, int64_t m, int64_t n, const __m512 *r, int64_t rows) {
    if (!o.f32) {
        store_rows((uint16_t *)o.p + m * o.ld + n, r, rows);
        return;
    }
    for (int v = 0; v < 4; v++) {
        const int64_t left = rows - 16 * v;
        if (left <= 0) break;
        const __mmask16 mk = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);
        _mm512_mask_storeu_ps((float *)o.p + m * o.ld + n + 16 * v, mk, r[v]);
    }
}
#endif

static inline int has_offsets(const int4_meta *md) { return md->offs != NULL || md->ksc != NULL; }

/* bytes [from, from + len) of base into L1 (a prefetch per 64-byte line; a prefetch never faults) */
static inline void pf_span(const void *base, int64_t from, int64_t len) {
    for (int64_t l = 0; l < len; l += 64) __builtin_prefetch((const char *)base + from + l, 0, 3);
}

/* Group g's metadata of the 64-row block at row0 (the next block, called during this one) into the cache.
   Why: in the group-major arrays (Int4Linear's zeros_gm and scales, GGUF's scales) a block's rows of each
   group are their own short run of bytes, one run per group a block, which the hardware prefetchers do not
   follow: each was a miss to RAM in the decode GEMV, which streamed at ~2/3 of the RAM's read rate.
   Row-major arrays (row stride > 2) are one run a block, in address order: left to the hardware. */
static inline void meta_prefetch(const int4_meta *md, int64_t row0, int64_t g) {
    if (md->ksc) { /* Q4_K: uint8 sc / m [G, k_n], fp16 d / dmin [G / 8, k_n] */
        pf_span(md->ksc, g * md->k_n + row0, 64), pf_span(md->km, g * md->k_n + row0, 64);
        if (g % 8 == 0) pf_span(md->kd, 2 * ((g / 8) * md->k_n + row0), 128), pf_span(md->kdm, 2 * ((g / 8) * md->k_n + row0), 128);
        return;
    }
    if (md->z_n == 1 && !md->offs) pf_span(md->zeros, g * md->z_g + row0, 64);
    const int64_t es = md->kind == SCALE_F32 ? 4 : 2;
    if (md->s_n <= 2) pf_span(md->scales, es * (g * md->s_g + row0 * md->s_n), 64 * es * md->s_n);
    if (md->offs && md->o_n == 1) pf_span(md->offs, 4 * (g * md->o_g + row0), 256);
}

static void meta_scalar(const int4_meta *md, int64_t row0, int64_t rows, int64_t g, float *zf, float *sf) {
    for (int64_t j = 0; j < 64; j++) {
        const int in = j < rows;
        zf[j] = in && !md->offs ? (float)md->zeros[(row0 + j) * md->z_n + g * md->z_g] : 0.0f; /* offsets: no zeros */
        sf[j] = in ? load_scale(md->scales, (row0 + j) * md->s_n + g * md->s_g, md->kind) : 0.0f;
    }
}

#ifdef QG_AVX512
/* The same as vectors in row order: z[v], s[v] hold rows 16v .. 16v+15. Vector loads where the rows
   of a group lie contiguously (zeros with z_n = 1, Int4Linear's group-major copy; bf16 scales with
   s_n = 2, a view into its scales_zeros [G, Np, 2]; or s_n = 1), else the scalar gather. */
static inline void meta_vec(const int4_meta *md, int64_t row0, int64_t rows, int64_t g, __m512i *z, __m512 *s) {
    const int vz = md->z_n == 1 || md->offs, vs = (md->kind == SCALE_BF16 && (md->s_n == 2 || md->s_n == 1)) || (md->kind != SCALE_BF16 && md->s_n == 1);
    float zf[64], sf[64];
    if (!vz || !vs) meta_scalar(md, row0, rows, g, zf, sf);
    for (int v = 0; v < 4; v++) {
        const int64_t left = rows - 16 * v;
        const __mmask16 m = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1u);
        const int64_t r = row0 + 16 * v;
        if (md->offs)
            z[v] = _mm512_setzero_si512(); /* w = scale * q + offset: no zero points */
        else if (vz)
            z[v] = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, md->zeros + r + g * md->z_g));
        else
            z[v] = _mm512_cvtps_epi32(_mm512_loadu_ps(zf + 16 * v));
        if (!vs) {
            s[v] = _mm512_loadu_ps(sf + 16 * v);
        } else if (md->kind == SCALE_F32) {
            s[v] = _mm512_maskz_loadu_ps(m, (const float *)md->scales + r + g * md->s_g);
        } else if (md->kind == SCALE_F16) { /* fp16, group-major (GGUF Q4_0's scales): exact conversion */
            s[v] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)md->scales + r + g * md->s_g));
        } else if (md->s_n == 2) { /* dwords (scale, other): the scale is the low half */
            const __m512i d = _mm512_maskz_loadu_epi32(m, (const uint16_t *)md->scales + 2 * r + g * md->s_g);
            s[v] = _mm512_castsi512_ps(_mm512_slli_epi32(d, 16));
        } else {
            const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)md->scales + r + g * md->s_g);
            s[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
    }
}
#endif

#ifdef QG_AVX512
/* A group's offsets (w = scale * q + offset) as vectors in row order, o[v] rows 16v .. 16v+15, 0 past rows: GGUF
   Q4_K's -(dmin * m) from its stored bytes, or md->offs (a vector load where a group's rows are contiguous). With
   Q4_K, s[v] its scales d * sc too (meta_vec reads the other formats' scales). The products llama.cpp's
   dequantization computes, as k_meta / a8_offsets do for the AVX2 code. */
static inline void offs_vec(const int4_meta *md, int64_t row0, int64_t rows, int64_t g, __m512 *s, __m512 *o) {
    for (int v = 0; v < 4; v++) {
        const int64_t left = rows - 16 * v, r = row0 + 16 * v;
        const __mmask16 m = left >= 16 ? 0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1u);
        if (md->ksc) {
            const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, md->kd + (g / 8) * md->k_n + r));
            const __m512 dm = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, md->kdm + (g / 8) * md->k_n + r));
            const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, md->ksc + g * md->k_n + r)));
            const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, md->km + g * md->k_n + r)));
            s[v] = _mm512_mul_ps(d, sc);
            o[v] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dm, mn)), _mm512_set1_epi32((int)0x80000000u)));
        } else if (md->o_n == 1) {
            o[v] = _mm512_maskz_loadu_ps(m, md->offs + r + g * md->o_g);
        } else {
            float t[16];
            for (int i = 0; i < 16; i++) t[i] = i < left ? md->offs[(r + i) * md->o_n + g * md->o_g] : 0.0f;
            o[v] = _mm512_loadu_ps(t);
        }
    }
}
#endif

#ifdef QA8_AVX2
/* One full block of 32 bf16 values -> its codes qb, returning the scale d and the codes' sum (*sum): the scalar
   loop's operations lane by lane (abs, max ignoring NaN, v * (1 / d) rounded to nearest even, clamped to
   +-127, NaN -> 0), so the same bits. Why: the scalar loop cost ~7 cycles a value, ~0.15 ms for a 128 x 576
   prompt: ~20% of an int8 layer's GEMM at M = 128 once the GEMMs lost their output stalls (Zen 5). */
static inline float a8_block_avx2(const void *x, int xf32, int8_t *qb, int32_t *sum) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < 4; i++) {
        v[i] = xf32 ? _mm256_loadu_ps((const float *)x + 8 * i) : ops_bf8((const uint16_t *)x + 8 * i);
        amax = _mm256_max_ps(_mm256_and_ps(v[i], absm), amax); /* a NaN lane leaves amax (max's second operand) */
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float am = _mm_cvtss_f32(h), d = am / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m256 idv = _mm256_set1_ps(id), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    __m256i c[4], tot = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 cl = _mm256_and_ps(_mm256_min_ps(_mm256_max_ps(r, lo), hi), _mm256_cmp_ps(r, r, _CMP_ORD_Q));
        c[i] = _mm256_cvtps_epi32(cl);
        tot = _mm256_add_epi32(tot, c[i]);
    }
    const __m256i w01 = _mm256_packs_epi32(c[0], c[1]), w23 = _mm256_packs_epi32(c[2], c[3]);
    const __m256i b8 = _mm256_packs_epi16(w01, w23); /* dwords in lane order 0, 2, 4, 6, 1, 3, 5, 7 */
    _mm256_storeu_si256((__m256i *)qb, _mm256_permutevar8x32_epi32(b8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(tot), _mm256_extracti128_si256(tot, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
    *sum = _mm_cvtsi128_si32(t);
    return d;
}
#endif

/* x [M, K] bf16, or float32 with xf32 set (the LM head's input: the final norm's unrounded output, quantized as
   llama.cpp quantizes its float32 activations), row stride ldx -> int8 blocks (the arithmetic above). 0, or 2
   when out of memory. */
int a8_quantize(const void *x, int64_t ldx, int xf32, int64_t m_count, int64_t k, int64_t nb, a8_x *a) {
    const size_t qbytes = (size_t)((m_count * nb * A8 + 63) / 64 * 64);
    a->nb = nb;
    a->q = aligned_alloc(64, qbytes);
    a->q4 = NULL, a->qu = NULL; /* only the VNNI paths read them */
#ifdef QA8_VNNI
    const int vnni = 1; /* int4 decodes one row of x with VNNI too; int8's qu costs a xor a block */
    a->q4 = aligned_alloc(64, qbytes), a->qu = aligned_alloc(64, qbytes);
#else
    const int vnni = 0;
#endif
    a->d = malloc(sizeof(float) * (size_t)(m_count * nb));
    a->s = malloc(sizeof(int32_t) * (size_t)(m_count * nb));
    if (!a->q || !a->d || !a->s || (vnni && (!a->q4 || !a->qu))) { a8_free(a); return 2; }
    for (int64_t m = 0; m < m_count; m++)
        for (int64_t b = 0; b < nb; b++) {
            int8_t *qb = a->q + (m * nb + b) * A8;
#ifdef QA8_AVX2
            if ((b + 1) * A8 <= k) { /* a full block */
                int32_t sum;
                a->d[m * nb + b] = a8_block_avx2(xf32 ? (const void *)((const float *)x + m * ldx + b * A8)
                                                      : (const void *)((const uint16_t *)x + m * ldx + b * A8), xf32, qb, &sum);
                a->s[m * nb + b] = sum;
                const __m256i qv = _mm256_loadu_si256((const __m256i *)qb);
                if (a->q4) /* (c, c+2, c+1, c+3) in each 4 */
                    _mm256_storeu_si256((__m256i *)(a->q4 + (m * nb + b) * A8),
                                        _mm256_shuffle_epi8(qv, _mm256_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15,
                                                                                 0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15)));
                if (a->qu)
                    _mm256_storeu_si256((__m256i *)(a->qu + (m * nb + b) * A8), _mm256_xor_si256(qv, _mm256_set1_epi8((char)0x80)));
                continue;
            }
#endif
            float v[A8], amax = 0.0f;
            for (int i = 0; i < A8; i++) {
                const int64_t c = b * A8 + i;
                v[i] = c >= k ? 0.0f : xf32 ? ((const float *)x)[m * ldx + c] : bf(((const uint16_t *)x)[m * ldx + c]);
                const float av = v[i] < 0.0f ? -v[i] : v[i];
                amax = av > amax ? av : amax;
            }
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int32_t sum = 0;
            for (int i = 0; i < A8; i++) {
                float r = nearbyintf(v[i] * id);
                r = r == r ? (r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r)) : 0.0f; /* NaN / inf x: bounded */
                qb[i] = (int8_t)r;
                sum += qb[i];
            }
            a->d[m * nb + b] = d;
            a->s[m * nb + b] = sum;
            if (a->q4) /* (c, c+2, c+1, c+3): the order int4_a8_block's unpacks leave a row's 4 codes in */
                for (int i = 0; i < A8; i += 4) {
                    int8_t *o = a->q4 + (m * nb + b) * A8 + i;
                    o[0] = qb[i], o[1] = qb[i + 2], o[2] = qb[i + 1], o[3] = qb[i + 3];
                }
            if (a->qu)
                for (int i = 0; i < A8; i++) a->qu[(m * nb + b) * A8 + i] = (uint8_t)(qb[i] + 128);
        }
    return 0;
}

/* exact int32 dot of a block of codes (isa.h: tails, and the builds without the AVX2 tiles) */
static inline int32_t dot_block_i8(const int8_t *qx, const int8_t *w, int64_t len) { return isa_dot_i8(qx, w, len); }

#ifdef QA8_AVX2
/* |w| unsigned times x signed by w (isa_x86.h: a weight code of -128 reads as 128; x stays within +-127) */
static inline __m256i dot32_i8(__m256i xv, const int8_t *w) {
    const __m256i wv = _mm256_loadu_si256((const __m256i *)w);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv)), _mm256_set1_epi16(1));
}

/* 8 int32 vectors -> their 8 horizontal sums in order (exact) */
static inline __m256i hsum8_epi32(const __m256i *p) {
    const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
    const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    /* a: [r0 r1 r2 r3 | r0 r1 r2 r3] halves of the 128-bit lanes, b the same for r4..r7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* 8 fp16 block scales (bs[b * bs_ld + n .. n + 7]) as floats, exact */
static inline __m256 bs8(const uint16_t *p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float t[8];
    for (int i = 0; i < 8; i++) t[i] = half_to_f32(p[i]);
    return _mm256_loadu_ps(t);
#endif
}
#endif

/* rows [n0, n1) of the int8 weight against x row m: out[m * ldo + n]. Per-row scales (bs NULL):
   f += float(S_b) * dx[b], out = bf16(f * scale[n]); block scales (bs: fp16 [nb, >= N] group-major,
   row stride bs_ld, GGUF Q8_0's): f += float(S_b) * (bs[b, n] * dx[b]), out = bf16(f). */
static void int8_a8_rows(const a8_x *a, int64_t m, const int8_t *q, int64_t k, const uint16_t *scales,
                         const uint16_t *bs, int64_t bs_ld, qout out, int64_t n0, int64_t n1) {
    const int64_t full = k / A8, nb = a->nb;
    const int8_t *qx = a->q + m * nb * A8;
    const float *dx = a->d + m * nb;
    int64_t n = n0;
#ifdef QA8_AVX2
    for (; n + 8 <= n1; n += 8) {
        __m256 f = _mm256_setzero_ps();
        for (int64_t b = 0; b < full; b++) {
            const __m256i xv = _mm256_load_si256((const __m256i *)(qx + b * A8));
            __m256i p[8];
            /* the 8 rows I8_AHEAD ahead are 8 k contiguous bytes: 256 of them a block, in address order */
            for (int l = 0; l < 4; l++) __builtin_prefetch(q + (n + I8_AHEAD) * k + b * 8 * A8 + 64 * l, 0, PF_LOC);
            if (bs) /* and their block's scales: a line of a group-major row, 32 rows, a miss to RAM each group */
                __builtin_prefetch(bs + b * bs_ld + n + I8_AHEAD, 0, PF_LOC);
            for (int r = 0; r < 8; r++) p[r] = dot32_i8(xv, q + (n + r) * k + b * A8);
            const __m256 sb = _mm256_cvtepi32_ps(hsum8_epi32(p));
            const __m256 db = bs ? _mm256_mul_ps(bs8(bs + b * bs_ld + n), _mm256_set1_ps(dx[b])) : _mm256_set1_ps(dx[b]);
            f = _mm256_add_ps(f, _mm256_mul_ps(sb, db));
        }
        if (full == nb) { /* no K tail: rne(v * bf(scale)) below, 8 at once (the AVX-512 rne16's why) */
            const __m256 sc = bs ? _mm256_set1_ps(1.0f) : ops_bf8(scales + n);
            put8(out, m, n, _mm256_mul_ps(f, sc));
            continue;
        }
        float fr[8];
        _mm256_storeu_ps(fr, f);
        for (int r = 0; r < 8; r++) {
            float v = fr[r];
            if (full < nb) v = v + (float)dot_block_i8(qx + full * A8, q + (n + r) * k + full * A8, k - full * A8)
                                       * (bs ? half_to_f32(bs[full * bs_ld + n + r]) * dx[full] : dx[full]);
            put1(out, m, n + r, bs ? v : v * bf(scales[n + r]));
        }
    }
#else
    for (; n + 8 <= n1; n += 8) { /* the 8 rows' exact block sums from isa.h, then the float steps row by row */
        float f[8] = {0};
        for (int64_t b = 0; b < full; b++) {
            int32_t s[8];
            float db[8];
            for (int l = 0; l < 4; l++) __builtin_prefetch(q + (n + I8_AHEAD) * k + b * 8 * A8 + 64 * l, 0, PF_LOC);
            isa_dot32_i8_x8(qx + b * A8, q + n * k + b * A8, k, s);
            for (int r = 0; r < 8; r++) db[r] = bs ? half_to_f32(bs[b * bs_ld + n + r]) * dx[b] : dx[b];
            for (int r = 0; r < 8; r++) f[r] = f[r] + (float)s[r] * db[r];
        }
        for (int r = 0; r < 8; r++) {
            float v = f[r];
            if (full < nb) v = v + (float)dot_block_i8(qx + full * A8, q + (n + r) * k + full * A8, k - full * A8)
                                       * (bs ? half_to_f32(bs[full * bs_ld + n + r]) * dx[full] : dx[full]);
            put1(out, m, n + r, bs ? v : v * bf(scales[n + r]));
        }
    }
#endif
    for (; n < n1; n++) {
        float f = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t len = b < full ? A8 : k - full * A8;
            f = f + (float)dot_block_i8(qx + b * A8, q + n * k + b * A8, len) * (bs ? half_to_f32(bs[b * bs_ld + n]) * dx[b] : dx[b]);
        }
        put1(out, m, n, bs ? f : f * bf(scales[n]));
    }
}

#ifdef QA8_VNNI
/* Rows of x per pass over decoded weights (int8: a transposed 16-row tile; int4: a column quad's 4
   vectors): the accumulators of that many rows stay in the 32 zmm registers (int8: Zen 4, 2 threads;
   int4: 3 rows = 12 integer sums + 12 float sums + 4 codes + x, where 4 rows spilled: 7-10% faster at
   M = 128 on Zen 5, 2 threads, than 4 rows, 1.2-1.5x than 6 or 8). */
#ifndef I8_MT
#define I8_MT 8
#endif
#ifndef I4_MT
#define I4_MT 3
#endif

/* x rows [mb, mb + mt) against weight rows [n, n + 16) (mt a constant where inlined): each full 32-column
   block's 16 x 8 dwords are transposed once (vector t[j] = dword j of the 16 rows, rows in lane order) for
   the mt rows of x, whose codes enter vpdpbusd as unsigned bytes qx + 128 (an xor): that sum is
   S_b + 128 * (the block's weight sum), taken back exactly. Then the portable float steps in block order
   (the K tail's block last, scalar), so the same bits. */
static inline __attribute__((always_inline)) void int8_a8_vnni_tile(const a8_x *a, int64_t mb, const int mt,
                                                                    const int8_t *q, int64_t k,
                                                                    const uint16_t *scales, const uint16_t *bs,
                                                                    int64_t bs_ld, qout out, int64_t n) {
    const int64_t full = k / A8, nb = a->nb;
    const __m512i ones = _mm512_set1_epi8(1);
    const __m512i lo_idx = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i hi_idx = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    __m512 f[I8_MT];
    for (int m = 0; m < mt; m++) f[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < full; b++) {
        __m512i z[8];
        /* the 16 rows I8_AHEAD ahead: 512 of their 16 k contiguous bytes a block, in address order */
        for (int l = 0; l < 8; l++) __builtin_prefetch(q + (n + I8_AHEAD) * k + b * 16 * A8 + 64 * l, 0, PF_LOC);
        if (bs) __builtin_prefetch(bs + b * bs_ld + n + I8_AHEAD, 0, PF_LOC); /* their block's scales (int8_a8_rows) */
        for (int i = 0; i < 8; i++) /* z[i] = row i's 8 dwords | row i + 8's */
            z[i] = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(q + (n + i) * k + b * A8))),
                _mm256_loadu_si256((const __m256i *)(q + (n + 8 + i) * k + b * A8)), 1);
        /* 8 x 8 dword transposes in each 256-bit half */
        __m512i u[8], v[8], t[8];
        for (int i = 0; i < 4; i++) {
            u[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
            u[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
        }
        /* v[4h + j]: dwords j (lanes 0, 2) and j + 4 (lanes 1, 3) of rows 4h .. 4h + 3 (and + 8) */
        for (int h = 0; h < 2; h++) {
            v[4 * h + 0] = _mm512_unpacklo_epi64(u[4 * h], u[4 * h + 2]);
            v[4 * h + 1] = _mm512_unpackhi_epi64(u[4 * h], u[4 * h + 2]);
            v[4 * h + 2] = _mm512_unpacklo_epi64(u[4 * h + 1], u[4 * h + 3]);
            v[4 * h + 3] = _mm512_unpackhi_epi64(u[4 * h + 1], u[4 * h + 3]);
        }
        for (int j = 0; j < 4; j++) {
            t[j] = _mm512_permutex2var_epi64(v[j], lo_idx, v[4 + j]);
            t[j + 4] = _mm512_permutex2var_epi64(v[j], hi_idx, v[4 + j]);
        }
        __m512i w = _mm512_setzero_si512(); /* the 16 rows' sums of the block's codes */
        for (int j = 0; j < 8; j++) w = _mm512_dpbusd_epi32(w, ones, t[j]);
        const __m512i w128 = _mm512_slli_epi32(w, 7);
        const __m512 bsv = bs ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(bs + b * bs_ld + n))) : _mm512_set1_ps(1.0f);
        for (int m = 0; m < mt; m++) {
            const uint8_t *xu = a->qu + ((mb + m) * nb + b) * A8;
            __m512i acc = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++) {
                int32_t xq;
                memcpy(&xq, xu + 4 * j, 4);
                acc = _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(xq), t[j]);
            }
            const __m512 sb = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, w128));
            const __m512 dv = _mm512_set1_ps(a->d[(mb + m) * nb + b]);
            f[m] = _mm512_add_ps(f[m], _mm512_mul_ps(sb, bs ? _mm512_mul_ps(bsv, dv) : dv));
        }
    }
    const __m512 sc = bs ? _mm512_set1_ps(1.0f)
                         : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(scales + n))), 16));
    for (int m = 0; m < mt; m++) {
        if (full == nb) { /* no K tail: bf16(f * scale) as rne(val * bf(scale)) below, 16 at once */
            put16(out, mb + m, n, bs ? f[m] : _mm512_mul_ps(f[m], sc));
            continue;
        }
        float fr[16];
        _mm512_storeu_ps(fr, f[m]);
        const int8_t *qx = a->q + (mb + m) * nb * A8;
        const float *dx = a->d + (mb + m) * nb;
        for (int r = 0; r < 16; r++) {
            float val = fr[r];
            if (full < nb) val = val + (float)dot_block_i8(qx + full * A8, q + (n + r) * k + full * A8, k - full * A8)
                                           * (bs ? half_to_f32(bs[full * bs_ld + n + r]) * dx[full] : dx[full]);
            put1(out, mb + m, n + r, bs ? val : val * bf(scales[n + r]));
        }
    }
}

/* Weight rows [n0, n1) against x rows [0, m_count): 16-row tiles for 2+ rows of x (one row: the AVX2
   code, whose 8-row blocks cost less than a transpose used once; Zen 4), the rows left one by one. */
void int8_a8_many(const a8_x *a, int64_t m_count, const int8_t *q, int64_t k, const uint16_t *scales,
                         const uint16_t *bs, int64_t bs_ld, qout out, int64_t n0, int64_t n1) {
    int64_t n = n0;
    if (m_count >= I8_VNNI_MIN_M)
        for (; n + 16 <= n1; n += 16)
            for (int64_t mb = 0; mb < m_count;) { /* I8_MT rows at a time, then 4, 2, 1 (constants: inlined) */
                const int64_t left = m_count - mb;
                if (left >= I8_MT) int8_a8_vnni_tile(a, mb, I8_MT, q, k, scales, bs, bs_ld, out, n), mb += I8_MT;
                else if (left >= 4) int8_a8_vnni_tile(a, mb, 4, q, k, scales, bs, bs_ld, out, n), mb += 4;
                else if (left >= 2) int8_a8_vnni_tile(a, mb, 2, q, k, scales, bs, bs_ld, out, n), mb += 2;
                else int8_a8_vnni_tile(a, mb, 1, q, k, scales, bs, bs_ld, out, n), mb += 1;
            }
    for (int64_t m = 0; m < m_count; m++) int8_a8_rows(a, m, q, k, scales, bs, bs_ld, out, n, n1);
}
#else
void int8_a8_many(const a8_x *a, int64_t m_count, const int8_t *q, int64_t k, const uint16_t *scales,
                         const uint16_t *bs, int64_t bs_ld, qout out, int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < m_count; m++) int8_a8_rows(a, m, q, k, scales, bs, bs_ld, out, n0, n1);
}
#endif

static int int8_a8_run(const void *x, int64_t ldx, const int8_t *q, const uint16_t *scales, const uint16_t *bs,
                       void *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads, int io) {
    if (m_count <= 0 || n <= 0 || k <= 0 || ldx < k || ldo < n || io & ~3) return 1;
    a8_x a;
    if (a8_quantize(x, ldx, io & IO_X_F32, m_count, k, (k + A8 - 1) / A8, &a)) return 2;
    const qout o = {out, ldo, (io & IO_OUT_F32) != 0};
    const int64_t step = 64, items = (n + step - 1) / step;
    const int par = threads > 1 && m_count * n * k >= PAR_MIN && items > 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
    for (int64_t it = 0; it < items; it++) {
        const int64_t n0 = it * step, n1 = n0 + step < n ? n0 + step : n;
        int8_a8_many(&a, m_count, q, k, scales, bs, n, o, n0, n1);
    }
    a8_free(&a);
    return 0;
}

/* x [M, K] bf16 (row stride ldx), q int8 [N, K] contiguous, scales bf16 [N] -> out [M, N] bf16 (row stride ldo). */
int llmsys_qgemv_int8_a8(const uint16_t *x, int64_t ldx, const int8_t *q, const uint16_t *scales, uint16_t *out,
                         int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads) {
    return int8_a8_run(x, ldx, q, scales, NULL, out, ldo, m_count, n, k, threads, 0);
}

/* llmsys_qgemv_int8_a8 with io (IO_X_F32: x float32; IO_OUT_F32: out float32, unrounded) */
int llmsys_qgemv_int8_a8_io(const void *x, int64_t ldx, const int8_t *q, const uint16_t *scales, void *out,
                            int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads, int io) {
    return int8_a8_run(x, ldx, q, scales, NULL, out, ldo, m_count, n, k, threads, io);
}

/* The same with a scale per 32-column block (GGUF Q8_0): block_scales fp16 [ceil(K / 32), N] (group-major). */
int llmsys_qgemv_int8g_a8(const uint16_t *x, int64_t ldx, const int8_t *q, const uint16_t *block_scales,
                          uint16_t *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads) {
    return int8_a8_run(x, ldx, q, NULL, block_scales, out, ldo, m_count, n, k, threads, 0);
}

int llmsys_qgemv_int8g_a8_io(const void *x, int64_t ldx, const int8_t *q, const uint16_t *block_scales,
                             void *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads, int io) {
    return int8_a8_run(x, ldx, q, NULL, block_scales, out, ldo, m_count, n, k, threads, io);
}

/* int8 codes with the scales of GGUF K-quants kept as stored, group-major arrays [.., >= N] (row stride f_ld),
   K a multiple of 32, per 32-column block b of x:
   - ksc set (Q6_K: codes q - 32, int8 scales sc per 16 columns ksc [K / 16, N], fp16 d per 256 kd [K / 256, N];
     h(j) = d * sc(j), the float32 product llama.cpp's dequantization rounds): S_lo, S_hi = the exact integer dots
     of the block's columns 0-15 and 16-31, f = f + (float(S_lo) * (h(2b) * dx[b]) + float(S_hi) * (h(2b + 1) * dx[b]));
   - else (Q5_K: 5-bit codes, float32 scales d * sc and offsets -(dmin * m) per 32 columns, fs / fo [K / 32, N]):
     f = f + (float(S_b) * (fs[b, n] * dx[b]) + float(sx[b]) * (fo[b, n] * dx[b]));
   out = bf16(f). AVX2: the 8 int32 lanes vpmaddwd leaves per row hold 4 columns each, lanes 0-3 the block's
   first 16 columns (the low 128 bits), 4-7 the next 16: two rounds of vphaddd keep the halves apart. */
void int8k_a8_rows(const a8_x *a, int64_t m, const int8_t *q, int64_t k, const float *fs, const float *fo,
                          const int8_t *ksc, const uint16_t *kd, int64_t f_ld, qout out,
                          int64_t n0, int64_t n1) {
    const int64_t nb = k / A8;
    const int8_t *qx = a->q + m * a->nb * A8;
    const float *dx = a->d + m * a->nb;
    const int32_t *sx = a->s + m * a->nb;
    int64_t n = n0;
#ifdef QA8_AVX2
    for (; n + 8 <= n1; n += 8) {
        __m256 f = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const __m256i xv = _mm256_load_si256((const __m256i *)(qx + b * A8));
            __m256i p[8];
            /* the 8 rows I8_AHEAD ahead in address order (int8_a8_rows' why), and their group-major scales */
            for (int l = 0; l < 4; l++) __builtin_prefetch(q + (n + I8_AHEAD) * k + b * 8 * A8 + 64 * l, 0, PF_LOC);
            if (!ksc) {
                __builtin_prefetch(fs + b * f_ld + n + I8_AHEAD, 0, PF_LOC);
                __builtin_prefetch(fo + b * f_ld + n + I8_AHEAD, 0, PF_LOC);
            } else {
                __builtin_prefetch(ksc + 2 * b * f_ld + n + I8_AHEAD, 0, PF_LOC);
                __builtin_prefetch(ksc + (2 * b + 1) * f_ld + n + I8_AHEAD, 0, PF_LOC);
                if (!(b & 7)) __builtin_prefetch(kd + (b / 8) * f_ld + n + I8_AHEAD, 0, PF_LOC);
            }
            for (int r = 0; r < 8; r++) p[r] = dot32_i8(xv, q + (n + r) * k + b * A8);
            const __m256 dv = _mm256_set1_ps(dx[b]);
            if (!ksc) {
                const __m256 sb = _mm256_cvtepi32_ps(hsum8_epi32(p));
                const __m256 sd = _mm256_mul_ps(_mm256_loadu_ps(fs + b * f_ld + n), dv);
                const __m256 od = _mm256_mul_ps(_mm256_loadu_ps(fo + b * f_ld + n), dv);
                f = _mm256_add_ps(f, _mm256_add_ps(_mm256_mul_ps(sb, sd), _mm256_mul_ps(_mm256_set1_ps((float)sx[b]), od)));
                continue;
            }
            const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
            const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
            const __m256i u = _mm256_hadd_epi32(h01, h23), v = _mm256_hadd_epi32(h45, h67);
            /* u: rows 0-3's first halves | their second halves; v: the same for rows 4-7 */
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(u, v, 0x20));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(u, v, 0x31));
            const __m256 d8 = bs8(kd + (b / 8) * f_ld + n);
            const __m256 hlo = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(ksc + 2 * b * f_ld + n)))));
            const __m256 hhi = _mm256_mul_ps(d8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)(ksc + (2 * b + 1) * f_ld + n)))));
            f = _mm256_add_ps(f, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_mul_ps(hlo, dv)),
                                               _mm256_mul_ps(hi, _mm256_mul_ps(hhi, dv))));
        }
        float fr[8];
        _mm256_storeu_ps(fr, f);
        for (int r = 0; r < 8; r++) put1(out, m, n + r, fr[r]);
    }
#endif
    for (; n < n1; n++) {
        float f = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *w = q + n * k + b * A8, *xb = qx + b * A8;
            if (!ksc) {
                f = f + ((float)dot_block_i8(xb, w, A8) * (fs[b * f_ld + n] * dx[b])
                         + (float)sx[b] * (fo[b * f_ld + n] * dx[b]));
                continue;
            }
            const float d = half_to_f32(kd[(b / 8) * f_ld + n]);
            const float hlo = d * (float)ksc[2 * b * f_ld + n], hhi = d * (float)ksc[(2 * b + 1) * f_ld + n];
            f = f + ((float)dot_block_i8(xb, w, 16) * (hlo * dx[b]) + (float)dot_block_i8(xb + 16, w + 16, 16) * (hhi * dx[b]));
        }
        put1(out, m, n, f);
    }
}

static int int8k_a8_run(const void *x, int64_t ldx, const int8_t *q, const float *fs, const float *fo,
                        const int8_t *ksc, const uint16_t *kd, void *out, int64_t ldo, int64_t m_count,
                        int64_t n, int64_t k, int threads, int io) {
    if (m_count <= 0 || n <= 0 || k <= 0 || k % A8 || ldx < k || ldo < n || (ksc && k % 256) || io & ~3) return 1;
    a8_x a;
    if (a8_quantize(x, ldx, io & IO_X_F32, m_count, k, k / A8, &a)) return 2;
    const qout o = {out, ldo, (io & IO_OUT_F32) != 0};
    const int64_t step = 64, items = (n + step - 1) / step;
    const int par = threads > 1 && m_count * n * k >= PAR_MIN && items > 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
    for (int64_t it = 0; it < items; it++) {
        const int64_t n0 = it * step, n1 = n0 + step < n ? n0 + step : n;
        for (int64_t m = 0; m < m_count; m++) int8k_a8_rows(&a, m, q, k, fs, fo, ksc, kd, n, o, n0, n1);
    }
    a8_free(&a);
    return 0;
}

/* x [M, K] bf16 (row stride ldx), q int8 [N, K] contiguous, float32 scales and offsets [K / 32, N] (Q5_K) -> out
   [M, N] bf16 (row stride ldo); K a multiple of 32 (else 1). */
int llmsys_qgemv_int8o_a8(const uint16_t *x, int64_t ldx, const int8_t *q, const float *scales, const float *offsets,
                          uint16_t *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads) {
    return scales && offsets ? int8k_a8_run(x, ldx, q, scales, offsets, NULL, NULL, out, ldo, m_count, n, k, threads, 0) : 1;
}

int llmsys_qgemv_int8o_a8_io(const void *x, int64_t ldx, const int8_t *q, const float *scales, const float *offsets,
                             void *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads, int io) {
    return scales && offsets ? int8k_a8_run(x, ldx, q, scales, offsets, NULL, NULL, out, ldo, m_count, n, k, threads, io) : 1;
}

/* x [M, K] bf16 (row stride ldx), q int8 [N, K] contiguous, Q6_K's scales as stored: int8 sc [K / 16, N] and fp16
   d [K / 256, N] -> out [M, N] bf16 (row stride ldo); K a multiple of 256 (else 1). */
int llmsys_qgemv_int8h_a8(const uint16_t *x, int64_t ldx, const int8_t *q, const int8_t *sc, const uint16_t *d,
                          uint16_t *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads) {
    return sc && d ? int8k_a8_run(x, ldx, q, NULL, NULL, sc, d, out, ldo, m_count, n, k, threads, 0) : 1;
}

int llmsys_qgemv_int8h_a8_io(const void *x, int64_t ldx, const int8_t *q, const int8_t *sc, const uint16_t *d,
                             void *out, int64_t ldo, int64_t m_count, int64_t n, int64_t k, int threads, int io) {
    return sc && d ? int8k_a8_run(x, ldx, q, NULL, NULL, sc, d, out, ldo, m_count, n, k, threads, io) : 1;
}

/* Slot s of an int4 a8 block's accumulators holds row a8_row(s): the AVX2 unpacks interleave
   8-row groups as 0, 16, 8, 24 (low nibbles), then the same + 32 (high nibbles). */
static inline int a8_row(int s) {
#if defined(QA8_AVX2)
    static const int base[8] = {0, 16, 8, 24, 32, 48, 40, 56};
    return base[s / 8] + s % 8;
#else
    return s;
#endif
}

/* A group's Q4_K scales (neg 0) or offsets (neg 1) from md->ksc / km, kd / kdm, rows of a 64-row block in
   a8_row's slot order, 0 past `rows`: d * sc, -(dmin * m) (float32, as llama.cpp's dequantization). */
static void k_meta(const int4_meta *md, int64_t row0, int64_t rows, int64_t g, int neg, float *out) {
    const uint8_t *c = (neg ? md->km : md->ksc) + g * md->k_n;
    const uint16_t *d = (neg ? md->kdm : md->kd) + (g / 8) * md->k_n;
#ifdef QA8_AVX2
    if (rows == 64) {
        const __m256 sign = _mm256_set1_ps(neg ? -0.0f : 0.0f);
        for (int v = 0; v < 8; v++) {
            const int64_t r = row0 + a8_row(8 * v);
            const __m256 cf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + r))));
            _mm256_store_ps(out + 8 * v, _mm256_xor_ps(_mm256_mul_ps(bs8(d + r), cf), sign));
        }
        return;
    }
#endif
    for (int s = 0; s < 64; s++) {
        const int64_t j = a8_row(s);
        const float p = j < rows ? half_to_f32(d[row0 + j]) * (float)c[row0 + j] : 0.0f;
        out[s] = neg ? -p : p;
    }
}

/* A group's offsets (md->offs set) for the rows of a 64-row block in a8_row's slot order, 0 past `rows`. */
static void a8_offsets(const int4_meta *md, int64_t row0, int64_t rows, int64_t g, float *os) {
    if (md->ksc) {
        k_meta(md, row0, rows, g, 1, os);
        return;
    }
#ifdef QA8_AVX2
    if (rows == 64 && md->o_n == 1) {
        for (int v = 0; v < 8; v++)
            _mm256_store_ps(os + 8 * v, _mm256_loadu_ps(md->offs + row0 + a8_row(8 * v) + g * md->o_g));
        return;
    }
#endif
    for (int s = 0; s < 64; s++) {
        const int j = a8_row(s);
        os[s] = j < rows ? md->offs[(row0 + j) * md->o_n + g * md->o_g] : 0.0f;
    }
}

/* A group's zero points and scales for the rows of a 64-row block, in a8_row's slot order. Vector
   loads where the block is full and the rows lie contiguously (Int4Linear's group-major zeros, z_n = 1;
   bf16 scales with s_n = 2, its scales_zeros [G, Np, 2], or s_n = 1; float32 / fp16 scales with s_n = 1,
   its group-major scales_orig), else meta_scalar's gather. With offsets the zeros are not read (0). */
static void a8_meta(const int4_meta *md, int64_t row0, int64_t rows, int64_t g, int32_t *zs, float *ss) {
    if (md->ksc) {
        for (int s = 0; s < 64; s++) zs[s] = 0;
        k_meta(md, row0, rows, g, 0, ss);
        return;
    }
#ifdef QA8_AVX2
    if (rows == 64 && (md->z_n == 1 || md->offs) && ((md->kind == SCALE_BF16 && (md->s_n == 2 || md->s_n == 1)) || (md->kind != SCALE_BF16 && md->s_n == 1))) {
        for (int v = 0; v < 8; v++) {
            const int64_t r = row0 + a8_row(8 * v);
            _mm256_store_si256((__m256i *)(zs + 8 * v), md->offs ? _mm256_setzero_si256() :
                               _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(md->zeros + r + g * md->z_g))));
            if (md->kind == SCALE_F32) { /* float32, group-major */
                _mm256_store_ps(ss + 8 * v, _mm256_loadu_ps((const float *)md->scales + r + g * md->s_g));
                continue;
            }
            const uint16_t *sp = (const uint16_t *)md->scales + r * md->s_n + g * md->s_g;
            if (md->kind == SCALE_F16) { /* fp16, group-major (GGUF Q4_0's scales): exact conversion */
                _mm256_store_ps(ss + 8 * v, bs8(sp));
                continue;
            }
            const __m256i w = md->s_n == 2 ? _mm256_loadu_si256((const __m256i *)sp)
                                           : _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)sp));
            _mm256_store_ps(ss + 8 * v, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
        return;
    }
#endif
    float zr[64], sr[64];
    meta_scalar(md, row0, rows, g, zr, sr);
    for (int s = 0; s < 64; s++) { zs[s] = md->offs ? 0 : (int32_t)zr[a8_row(s)]; ss[s] = sr[a8_row(s)]; }
}

/* One 64-row block of the CPU int4 tiling against x rows [m0, m1): out[m, row0 + j]. */
static void int4_a8_block(const a8_x *a, int64_t m0, int64_t m1, const uint8_t *blk, const int4_meta *md,
                          int64_t n_groups, int64_t gs, int64_t row0, int64_t n_rows, qout out) {
    const int64_t rows = n_rows - row0 < 64 ? n_rows - row0 : 64, per_g = gs / A8, nb = a->nb;
    enum { MT8 = 8 };
    float acc[MT8][64] __attribute__((aligned(32)));
    for (int64_t mb = m0; mb < m1; mb += MT8) {
        const int mt = m1 - mb < MT8 ? (int)(m1 - mb) : MT8;
        for (int m = 0; m < mt; m++)
            for (int s = 0; s < 64; s++) acc[m][s] = 0.0f;
        for (int64_t g = 0; g < n_groups; g++) {
            int32_t zs[64] __attribute__((aligned(32)));
            float ss[64] __attribute__((aligned(32))), os[64] __attribute__((aligned(32)));
            a8_meta(md, row0, rows, g, zs, ss);
            meta_prefetch(md, row0 + 64, g);
            if (has_offsets(md)) a8_offsets(md, row0, rows, g, os);
            for (int64_t bi = 0; bi < per_g; bi++) {
                const int64_t b = g * per_g + bi;
                const uint8_t *p = blk + b * A8 * 32;
                for (int l = 0; l < A8 * 32; l += 64) __builtin_prefetch(p + A8_AHEAD + l, 0, 2); /* L2; never faults */
                for (int m = 0; m < mt; m++) {
                    const int8_t *qx = a->q + ((mb + m) * nb + b) * A8;
                    const float dxb = a->d[(mb + m) * nb + b];
                    const int32_t sxb = a->s[(mb + m) * nb + b];
#ifdef QA8_AVX2
                    const __m256i low4 = _mm256_set1_epi8(15);
                    __m256i s32[8];
                    for (int v = 0; v < 8; v++) s32[v] = _mm256_setzero_si256();
                    for (int h16 = 0; h16 < 2; h16++) {
                        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
                        const uint8_t *pc = p + h16 * 16 * 32;
                        const int8_t *xc = qx + h16 * 16;
#pragma GCC unroll 2
                        for (int pr = 0; pr < 8; pr++) {
                            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(pc + 64 * pr));
                            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(pc + 64 * pr + 32));
                            /* the two columns' bytes interleaved first (2 shuffles, not 4): each word's low
                               nibbles are one row's (code c, code c + 1), its high nibbles row + 32's */
                            const __m256i ul = _mm256_unpacklo_epi8(v0, v1), uh = _mm256_unpackhi_epi8(v0, v1);
                            int16_t pw; /* the pair (qx[c], qx[c + 1]) as one little-endian word */
                            memcpy(&pw, xc + 2 * pr, 2);
                            const __m256i xp = _mm256_set1_epi16(pw);
                            a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(_mm256_and_si256(ul, low4), xp));
                            a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(_mm256_and_si256(uh, low4), xp));
                            a2 = _mm256_add_epi16(a2, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(ul, 4), low4), xp));
                            a3 = _mm256_add_epi16(a3, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(uh, 4), low4), xp));
                        }
                        /* a0: rows 0-7 | 16-23, a1: 8-15 | 24-31, a2, a3: the same + 32 */
                        const __m256i a16[4] = {a0, a1, a2, a3};
                        for (int v = 0; v < 4; v++) {
                            s32[2 * v] = _mm256_add_epi32(s32[2 * v], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(a16[v])));
                            s32[2 * v + 1] = _mm256_add_epi32(s32[2 * v + 1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(a16[v], 1)));
                        }
                    }
                    /* s32 order: 0-7, 16-23, 8-15, 24-31, 32-39, 48-55, 40-47, 56-63 = a8_row's slots */
                    const __m256i sxv = _mm256_set1_epi32(sxb);
                    const __m256 dv = _mm256_set1_ps(dxb);
                    if (has_offsets(md)) { /* f + (float(S_b) * (scale * d_b) + float(sum qx_b) * (offset * d_b)) */
                        const __m256 sxf = _mm256_set1_ps((float)sxb);
                        for (int v = 0; v < 8; v++) {
                            const __m256 sd = _mm256_mul_ps(_mm256_load_ps(ss + 8 * v), dv);
                            const __m256 od = _mm256_mul_ps(_mm256_load_ps(os + 8 * v), dv);
                            const __m256 prod = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s32[v]), sd),
                                                              _mm256_mul_ps(sxf, od));
                            _mm256_store_ps(acc[m] + 8 * v, _mm256_add_ps(_mm256_load_ps(acc[m] + 8 * v), prod));
                        }
                        continue;
                    }
                    for (int v = 0; v < 8; v++) {
                        const __m256i t = _mm256_sub_epi32(s32[v], _mm256_mullo_epi32(_mm256_load_si256((const __m256i *)(zs + 8 * v)), sxv));
                        const __m256 sd = _mm256_mul_ps(_mm256_load_ps(ss + 8 * v), dv);
                        const __m256 prod = _mm256_mul_ps(_mm256_cvtepi32_ps(t), sd);
                        _mm256_store_ps(acc[m] + 8 * v, _mm256_add_ps(_mm256_load_ps(acc[m] + 8 * v), prod));
                    }
#else
                    int32_t S[64] __attribute__((aligned(16)));
                    isa_i4_dot64(p, qx, S); /* isa.h: the 64 rows' exact sums, in natural order (a8_row) */
                    for (int s = 0; s < 64; s++) {
                        if (has_offsets(md)) {
                            acc[m][s] = acc[m][s] + ((float)S[s] * (ss[s] * dxb) + (float)sxb * (os[s] * dxb));
                            continue;
                        }
                        const int32_t t = S[s] - zs[s] * sxb;
                        acc[m][s] = acc[m][s] + (float)t * (ss[s] * dxb);
                    }
#endif
                }
            }
        }
        for (int m = 0; m < mt; m++)
            for (int s8 = 0; s8 < 64; s8 += 8) { /* 8 slots are 8 consecutive rows (a8_row) */
                const int j = a8_row(s8);
#ifdef QA8_AVX2
                if (j + 8 <= rows) { /* 8 at once: a float read back after the vector store stalled (see rne16) */
                    put8(out, mb + m, row0 + j, _mm256_load_ps(acc[m] + s8));
                    continue;
                }
#endif
                for (int i = 0; i < 8 && j + i < rows; i++) put1(out, mb + m, row0 + j + i, acc[m][s8 + i]);
            }
    }
}

#ifdef QA8_VNNI

/* Slot s of int4_a8_block_vnni's accumulators (4 vectors of 16 slots) holds row
   (s / 16 >= 2 ? 32 : 0) + (s / 16 odd ? 4 : 0) + 0, 16, 8, 24 for each 4 lanes, + the lane within them. */

/* int4_a8_block with vpdpbusd: 4 columns at a time, each row's 4 codes brought into one dword by two
   rounds of unpacks (bytes of columns c, c+2, then words of the (c, c+2) and (c+1, c+3) pairs), decoded
   once for up to I4_MT rows of x, whose codes (a->q4) lie in the same order. The integer sums are exact
   and the float steps per row those of the other builds, so the same bits. Every row count: with the
   next block's metadata prefetched (meta_prefetch), one row of x from RAM is 1.08-1.39x the AVX2 code's
   pairs on Zen 5 (2 threads; cache-warm 1.4x); on Zen 4 the cache-warm decode was 0.8-0.9x for one row,
   1.35-1.7x from 4. */
/* x rows [mb, mb + mt) of int4_a8_block_vnni, mt a constant where inlined (the accumulators stay in registers) */
static inline __attribute__((always_inline)) void int4_a8_vnni_tile(
        const a8_x *a, int64_t mb, const int mt, const uint8_t *blk, const int4_meta *md, int64_t n_groups,
        int64_t gs, int64_t row0, int64_t rows, qout out) {
    const int64_t per_g = gs / A8, nb = a->nb;
    const __m512i low4 = _mm512_set1_epi8(15);
    /* slot vector v of a half (rows 0-31 or 32-63) from that half's two row-order vectors */
    const __m512i ie = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    const __m512i io = _mm512_add_epi32(ie, _mm512_set1_epi32(4));
    __m512 acc[I4_MT][4];
    for (int m = 0; m < mt; m++)
        for (int v = 0; v < 4; v++) acc[m][v] = _mm512_setzero_ps();
    const int offsets = has_offsets(md);
    for (int64_t g = 0; g < n_groups; g++) {
        __m512i zr[4], zs[4];
        __m512 sr[4], ss[4], orow[4], os[4];
        if (md->ksc) {
            for (int v = 0; v < 4; v++) zr[v] = _mm512_setzero_si512();
        } else {
            meta_vec(md, row0, rows, g, zr, sr);
        }
        if (offsets) offs_vec(md, row0, rows, g, sr, orow); /* (Q4_K: its scales too) */
        meta_prefetch(md, row0 + 64, g);
        for (int h = 0; h < 2; h++) {
            zs[2 * h] = _mm512_permutex2var_epi32(zr[2 * h], ie, zr[2 * h + 1]);
            zs[2 * h + 1] = _mm512_permutex2var_epi32(zr[2 * h], io, zr[2 * h + 1]);
            ss[2 * h] = _mm512_permutex2var_ps(sr[2 * h], ie, sr[2 * h + 1]);
            ss[2 * h + 1] = _mm512_permutex2var_ps(sr[2 * h], io, sr[2 * h + 1]);
            if (offsets) {
                os[2 * h] = _mm512_permutex2var_ps(orow[2 * h], ie, orow[2 * h + 1]);
                os[2 * h + 1] = _mm512_permutex2var_ps(orow[2 * h], io, orow[2 * h + 1]);
            }
        }
        for (int64_t bi = 0; bi < per_g; bi++) {
            const int64_t b = g * per_g + bi;
            const uint8_t *p = blk + b * A8 * 32;
            for (int l = 0; l < A8 * 32; l += 64) __builtin_prefetch(p + A8_AHEAD + l, 0, 2); /* L2; never faults */
            __m512i S[I4_MT][4];
            for (int m = 0; m < mt; m++)
                for (int v = 0; v < 4; v++) S[m][v] = _mm512_setzero_si512();
            for (int qd = 0; qd < A8 / 4; qd++) {
                /* columns 4qd .. 4qd+3: 32 bytes each, byte j = rows j (low nibble) and j + 32 (high) */
                const __m512i z01 = _mm512_loadu_si512((const void *)(p + qd * 128));
                const __m512i z23 = _mm512_loadu_si512((const void *)(p + qd * 128 + 64));
                /* per 128-bit lane: (c, c+2) byte pairs; lanes 0, 1 from c / c+2, lanes 2, 3 c+1 / c+3 */
                const __m512i u = _mm512_unpacklo_epi8(z01, z23), w = _mm512_unpackhi_epi8(z01, z23);
                const __m512i pa = _mm512_shuffle_i64x2(u, w, 0x44), pb = _mm512_shuffle_i64x2(u, w, 0xEE);
                /* dwords (c, c+2, c+1, c+3) of rows 0-3 | 16-19 | 8-11 | 24-27, and the same + 4 */
                const __m512i r0 = _mm512_unpacklo_epi16(pa, pb), r1 = _mm512_unpackhi_epi16(pa, pb);
                const __m512i c0 = _mm512_and_si512(r0, low4), c1 = _mm512_and_si512(r1, low4);
                const __m512i c2 = _mm512_and_si512(_mm512_srli_epi16(r0, 4), low4);
                const __m512i c3 = _mm512_and_si512(_mm512_srli_epi16(r1, 4), low4);
                for (int m = 0; m < mt; m++) {
                    int32_t xq;
                    memcpy(&xq, a->q4 + ((mb + m) * nb + b) * A8 + 4 * qd, 4);
                    const __m512i xb = _mm512_set1_epi32(xq);
                    S[m][0] = _mm512_dpbusd_epi32(S[m][0], c0, xb);
                    S[m][1] = _mm512_dpbusd_epi32(S[m][1], c1, xb);
                    S[m][2] = _mm512_dpbusd_epi32(S[m][2], c2, xb);
                    S[m][3] = _mm512_dpbusd_epi32(S[m][3], c3, xb);
                }
            }
            for (int m = 0; m < mt; m++) {
                const __m512i sx = _mm512_set1_epi32(a->s[(mb + m) * nb + b]);
                const __m512 dv = _mm512_set1_ps(a->d[(mb + m) * nb + b]);
                if (offsets) { /* f + (float(S_b) * (scale * d_b) + float(sum qx_b) * (offset * d_b)) */
                    const __m512 sxf = _mm512_set1_ps((float)a->s[(mb + m) * nb + b]);
                    for (int v = 0; v < 4; v++) {
                        const __m512 prod = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(S[m][v]), _mm512_mul_ps(ss[v], dv)),
                                                          _mm512_mul_ps(sxf, _mm512_mul_ps(os[v], dv)));
                        acc[m][v] = _mm512_add_ps(acc[m][v], prod);
                    }
                    continue;
                }
                for (int v = 0; v < 4; v++) {
                    const __m512i t = _mm512_sub_epi32(S[m][v], _mm512_mullo_epi32(zs[v], sx));
                    const __m512 prod = _mm512_mul_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(ss[v], dv));
                    acc[m][v] = _mm512_add_ps(acc[m][v], prod);
                }
            }
        }
    }
    for (int m = 0; m < mt; m++) { /* slots back into row order (ie, io: the inverse of vnni_row's order) */
        const __m512 r[4] = {_mm512_permutex2var_ps(acc[m][0], ie, acc[m][1]), _mm512_permutex2var_ps(acc[m][0], io, acc[m][1]),
                             _mm512_permutex2var_ps(acc[m][2], ie, acc[m][3]), _mm512_permutex2var_ps(acc[m][2], io, acc[m][3])};
        put_rows(out, mb + m, row0, r, rows);
    }
}

static void int4_a8_block_vnni(const a8_x *a, int64_t m0, int64_t m1, const uint8_t *blk, const int4_meta *md,
                               int64_t n_groups, int64_t gs, int64_t row0, int64_t n_rows, qout out) {
    const int64_t rows = n_rows - row0 < 64 ? n_rows - row0 : 64;
    for (int64_t mb = m0; mb < m1;) { /* I4_MT rows at a time, then 2, 1 (constants: inlined) */
        const int64_t left = m1 - mb;
        if (left >= I4_MT) int4_a8_vnni_tile(a, mb, I4_MT, blk, md, n_groups, gs, row0, rows, out), mb += I4_MT;
        else if (left >= 2) int4_a8_vnni_tile(a, mb, 2, blk, md, n_groups, gs, row0, rows, out), mb += 2;
        else int4_a8_vnni_tile(a, mb, 1, blk, md, n_groups, gs, row0, rows, out), mb += 1;
    }
}
#endif

/* A 64-row block of the tiling against x rows [m0, m1): the VNNI code where built (offsets included), else AVX2 / isa.h. */
void int4_a8_rows(const a8_x *a, int64_t m0, int64_t m1, const uint8_t *blk, const int4_meta *md,
                         int64_t n_groups, int64_t gs, int64_t row0, int64_t n_rows, qout out) {
#ifdef QA8_VNNI
    int4_a8_block_vnni(a, m0, m1, blk, md, n_groups, gs, row0, n_rows, out);
    return;
#endif
    int4_a8_block(a, m0, m1, blk, md, n_groups, gs, row0, n_rows, out);
}

#define I4_SPLIT_MIN_M 16 /* rows of x from which a block's rows are split between the threads */

/* The int4 a8 GEMV over every 64-row block (threads split the blocks), arguments checked by the caller. */
static int int4_a8_run(const void *x, int64_t ldx, const uint8_t *packed, const int4_meta *md, void *out,
                       int64_t ldo, int64_t m_count, int64_t n, int64_t kp, int64_t k, int64_t gs, int threads, int io) {
    if (io & ~3) return 1;
    a8_x a;
    if (a8_quantize(x, ldx, io & IO_X_F32, m_count, k, kp / A8, &a)) return 2;
    const qout o = {out, ldo, (io & IO_OUT_F32) != 0};
    const int64_t blocks = (n + 63) / 64, n_groups = kp / gs;
    const int par = threads > 1 && m_count * n * kp >= PAR_MIN && blocks > 1;
    /* Prompts: a block count the threads do not divide (576 rows: 9 blocks, 5 + 4 on 2 threads) leaves a thread
       idle for the last block; with many rows of x, each block's rows are split too (each output is computed
       alone, so the same bits). */
    const int64_t parts = par && m_count >= I4_SPLIT_MIN_M && blocks % threads ? threads : 1;
    const int64_t per = (m_count + parts - 1) / parts;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
    for (int64_t it = 0; it < blocks * parts; it++) {
        const int64_t b = it / parts, m0 = it % parts * per, m1 = m0 + per < m_count ? m0 + per : m_count;
        if (m0 < m1) int4_a8_rows(&a, m0, m1, packed + b * kp * 32, md, n_groups, gs, b * 64, n, o);
    }
    a8_free(&a);
    return 0;
}

/* x [M, K] (row stride ldx; bf16, float32 with IO_X_F32) against the CPU int4 tiling of [Np, Kp] (packed:
   bytes [Np/64, Kp, 32], kernels/cpu_int4.py), zero points zeros[n * z_n + g * z_g] and scales of scale_kind
   (enum scale_kind) at scales[n * s_n + g * s_g], groups of gs columns (Kp = G * gs), x quantized
   per 32 columns (the a8 arithmetic above) -> out [M, N] (row stride ldo); offs: float32 offsets
   [n * o_n + g * o_g] (w = scale * q + offset, zeros not read), or NULL. */
int llmsys_qgemv_int4o_a8_io(const void *x, int64_t ldx, const uint8_t *packed, const void *scales, int64_t s_n,
                             int64_t s_g, int scale_kind, const uint8_t *zeros, int64_t z_n, int64_t z_g, const float *offs,
                             int64_t o_n, int64_t o_g, void *out, int64_t ldo, int64_t m_count, int64_t n, int64_t kp,
                             int64_t k, int64_t gs, int threads, int io) {
    if (m_count <= 0 || n <= 0 || gs % A8 || gs > 256 || kp % gs || k <= kp - gs || k > kp || ldx < k || ldo < n)
        return 1;
    const int4_meta md = {zeros, z_n, z_g, scales, s_n, s_g, scale_kind, offs, o_n, o_g, NULL, NULL, NULL, NULL, 0};
    return int4_a8_run(x, ldx, packed, &md, out, ldo, m_count, n, kp, k, gs, threads, io);
}

int llmsys_qgemv_int4o_a8(const uint16_t *x, int64_t ldx, const uint8_t *packed, const void *scales, int64_t s_n,
                          int64_t s_g, int scale_kind, const uint8_t *zeros, int64_t z_n, int64_t z_g, const float *offs,
                          int64_t o_n, int64_t o_g, uint16_t *out, int64_t ldo, int64_t m_count, int64_t n, int64_t kp,
                          int64_t k, int64_t gs, int threads) {
    return llmsys_qgemv_int4o_a8_io(x, ldx, packed, scales, s_n, s_g, scale_kind, zeros, z_n, z_g, offs, o_n, o_g, out,
                                    ldo, m_count, n, kp, k, gs, threads, 0);
}

/* llmsys_qgemv_int4o_a8 with GGUF Q4_K's scales as stored (int4_meta.ksc ..; group size 32): sc, m uint8
   [G, k_n], d, dmin fp16 [G / 8, k_n], group-major. */
int llmsys_qgemv_int4k_a8_io(const void *x, int64_t ldx, const uint8_t *packed, const uint8_t *ksc, const uint8_t *km,
                             const uint16_t *kd, const uint16_t *kdm, int64_t k_n, void *out, int64_t ldo,
                             int64_t m_count, int64_t n, int64_t kp, int64_t k, int threads, int io) {
    const int64_t gs = A8;
    if (m_count <= 0 || n <= 0 || kp % 256 || k <= kp - gs || k > kp || ldx < k || ldo < n || k_n < n) return 1;
    const int4_meta md = {NULL, 0, 0, NULL, 0, 0, 1, NULL, 0, 0, ksc, km, kd, kdm, k_n};
    return int4_a8_run(x, ldx, packed, &md, out, ldo, m_count, n, kp, k, gs, threads, io);
}

int llmsys_qgemv_int4k_a8(const uint16_t *x, int64_t ldx, const uint8_t *packed, const uint8_t *ksc, const uint8_t *km,
                          const uint16_t *kd, const uint16_t *kdm, int64_t k_n, uint16_t *out, int64_t ldo,
                          int64_t m_count, int64_t n, int64_t kp, int64_t k, int threads) {
    return llmsys_qgemv_int4k_a8_io(x, ldx, packed, ksc, km, kd, kdm, k_n, out, ldo, m_count, n, kp, k, threads, 0);
}

/* llmsys_qgemv_int4o_a8 with integer zero points (no offsets). */
int llmsys_qgemv_int4_a8(const uint16_t *x, int64_t ldx, const uint8_t *packed, const void *scales, int64_t s_n,
                         int64_t s_g, int scale_kind, const uint8_t *zeros, int64_t z_n, int64_t z_g, uint16_t *out,
                         int64_t ldo, int64_t m_count, int64_t n, int64_t kp, int64_t k, int64_t gs, int threads) {
    return llmsys_qgemv_int4o_a8(x, ldx, packed, scales, s_n, s_g, scale_kind, zeros, z_n, z_g, NULL, 0, 0, out, ldo,
                                 m_count, n, kp, k, gs, threads);
}

int llmsys_qgemv_int4_a8_io(const void *x, int64_t ldx, const uint8_t *packed, const void *scales, int64_t s_n,
                            int64_t s_g, int scale_kind, const uint8_t *zeros, int64_t z_n, int64_t z_g, void *out,
                            int64_t ldo, int64_t m_count, int64_t n, int64_t kp, int64_t k, int64_t gs, int threads, int io) {
    return llmsys_qgemv_int4o_a8_io(x, ldx, packed, scales, s_n, s_g, scale_kind, zeros, z_n, z_g, NULL, 0, 0, out, ldo,
                                    m_count, n, kp, k, gs, threads, io);
}
