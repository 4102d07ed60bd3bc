/* Dequantize the CPU int4 tiling to a row-major bfloat16 weight.
 *
 * Built for each ISA level and loaded for the running CPU by kernels/_cbuild.py
 * (gcc -O3 -march=<level> -fopenmp -shared); the torch function in
 * kernels/cpu_int4.py, `dequant_cpu_int4_ref`, is the definition this matches bit for bit.
 *
 * Input (llmsys's CPU int4 tiling, kernels/cpu_int4.py pack_cpu_int4, N padded to 64;
 * the same on every CPU):
 *   packed  uint8 [Np/64, Kp, 32]: byte (b, k, j) holds row 64b+j in its low
 *           nibble and row 64b+32+j in its high nibble, column k; q in 0..15.
 *   scales  [N, G] read at scales[n * s_n + g * s_g]: bfloat16 bits
 *           (scale_f32 = 0) or float32 (scale_f32 = 1).
 *   zeros   uint8 [N, G], integer zero points 0..15.
 * Output:   out bfloat16 [N, ldo], columns 0..K-1 written:
 *           out[n, k] = bf16_rne((float)(q - zero[n, g]) * scale[n, g]), g = k / gs.
 *
 * How: within one (row, group) the output takes one of 16 values, so the
 * kernel builds that 16-entry bf16 table once per row and group (one float
 * multiply and round-to-nearest-even per entry, exactly torch's arithmetic:
 * q - zero is an integer and the product is a single float32 rounding) and
 * then only looks codes up. A work item is one 64-row block times up to 512
 * columns: its [columns, 32] bytes are transposed to [32, columns] (32x32
 * tiles: four rounds of AVX2 byte unpacks and a lane swap; without AVX2, 8x8
 * transposes in 64-bit registers), so the codes of rows j and j+32 lie in one
 * contiguous run and each output row is written front to back; with
 * AVX-512BW 32 lookups are one vpermw, and with AVX512-BF16 the tables are
 * rounded by vcvtneps2bf16 (also round-to-nearest-even; used only for normal
 * finite scales, where no product is subnormal). Outputs of 16 MiB and more
 * (bigger than the L3 cache) are written with streaming stores.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h" /* bf(), rne(): torch's bf16 conversions */
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LLMSYS_AVX512 1
#endif

/* ------------------------------------------------------------ byte transpose */

#if defined(__AVX2__)
/* In each 128-bit lane, transpose the n x n elements held by x[0..n-1] (row r = x[r]): 16x16
   bytes with the epi8 unpacks, 8x8 16-bit values with the epi16 ones. A round on register
   bit i pairs x[r], x[r | 2^i]: unpacklo/hi move that bit into the lowest element-position
   bit and the top position bit into the register bit; rounds on every register bit, highest
   first, swap the register and position bits completely. */
#define LANE_TRANSPOSE(name, n, unpacklo, unpackhi)                 \
    static inline void name(__m256i *x) {                           \
        _Pragma("GCC unroll 4") for (int bit = n / 2; bit; bit >>= 1) \
            _Pragma("GCC unroll 16") for (int r = 0; r < n; ++r)    \
                if (!(r & bit)) {                                   \
                    const __m256i lo = unpacklo(x[r], x[r | bit]);  \
                    x[r | bit] = unpackhi(x[r], x[r | bit]);        \
                    x[r] = lo;                                      \
                }                                                   \
    }
LANE_TRANSPOSE(transpose16_lanes, 16, _mm256_unpacklo_epi8, _mm256_unpackhi_epi8)
LANE_TRANSPOSE(transpose8_lanes_u16, 8, _mm256_unpacklo_epi16, _mm256_unpackhi_epi16)
#endif

/* src: 32 rows (columns k of the weight) of 32 bytes, contiguous; dst[j * ds + kk] = src[kk * 32 + j]. */
static inline void transpose32(const uint8_t *src, uint8_t *dst, int64_t ds) {
#if defined(__AVX2__)
    for (int half = 0; half < 32; half += 16) { /* rows 0..15, then 16..31 (16 live registers) */
        __m256i a[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) a[i] = _mm256_loadu_si256((const __m256i *)(src + (half + i) * 32));
        transpose16_lanes(a);
        /* now a[c] lane L holds these 16 rows of column 16L + c */
#pragma GCC unroll 16
        for (int c = 0; c < 16; ++c) {
            _mm_storeu_si128((__m128i *)(dst + c * ds + half), _mm256_castsi256_si128(a[c]));
            _mm_storeu_si128((__m128i *)(dst + (16 + c) * ds + half), _mm256_extracti128_si256(a[c], 1));
        }
    }
#else
    for (int r = 0; r < 32; r += 8)
        for (int c = 0; c < 32; c += 8) {  /* 8x8 blocks, transposed in 64-bit registers */
            uint64_t x[8], t;
            for (int i = 0; i < 8; ++i) memcpy(&x[i], src + (r + i) * 32 + c, 8);
            for (int i = 0; i < 8; i += 2) {  /* swap bytes inside 2x2 blocks */
                t = ((x[i] >> 8) ^ x[i + 1]) & 0x00ff00ff00ff00ffull;
                x[i + 1] ^= t;
                x[i] ^= t << 8;
            }
            for (int i = 0; i < 8; i += 4)  /* swap 2-byte pairs inside 4x4 blocks */
                for (int j = i; j < i + 2; ++j) {
                    t = ((x[j] >> 16) ^ x[j + 2]) & 0x0000ffff0000ffffull;
                    x[j + 2] ^= t;
                    x[j] ^= t << 16;
                }
            for (int j = 0; j < 4; ++j) {  /* swap 4-byte halves */
                t = ((x[j] >> 32) ^ x[j + 4]) & 0x00000000ffffffffull;
                x[j + 4] ^= t;
                x[j] ^= t << 32;
            }
            for (int i = 0; i < 8; ++i) memcpy(dst + (c + i) * ds + r, &x[i], 8);
        }
#endif
}

/* ------------------------------------------------------------ tables and lookups */

#ifdef LLMSYS_AVX512
typedef __m512i lut_t; /* the 16 bf16 entries in the low half of a zmm */

static inline lut_t make_lut(float s, float z) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 v = _mm512_mul_ps(_mm512_sub_ps(q, _mm512_set1_ps(z)), _mm512_set1_ps(s));
#if defined(__AVX512BF16__)
    if (isfinite(s) && (s == 0.0f || fabsf(s) >= FLT_MIN))  /* no subnormal product: same as RNE below */
        return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v));
#endif
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_castsi256_si512(_mm512_cvtepi32_epi16(r));
}

static inline void store32(uint16_t *o, __m512i v, int64_t m, int stream) {
    if (m < 32) /* masked stores are slow on some CPUs: only for the K tail */
        _mm512_mask_storeu_epi16(o, (__mmask32)((1u << m) - 1u), v);
    else if (stream && ((uintptr_t)o & 63) == 0)
        _mm512_stream_si512((void *)o, v);
    else
        _mm512_storeu_si512((void *)o, v);
}

/* Columns [0, kn) of rows j (low nibbles, -> lo) and j + 32 (high nibbles, -> hi, unless NULL)
   from the codes at idx. stream: non-temporal stores for outputs bigger than the cache. */
static inline void lookup_pair(const uint8_t *idx, lut_t lut_lo, lut_t lut_hi, uint16_t *lo, uint16_t *hi,
                               int64_t kn, int stream) {
    const __m512i nib = _mm512_set1_epi16(15);
    for (int64_t c = 0; c < kn; c += 32) {
        const int64_t m = kn - c < 32 ? kn - c : 32;
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(idx + c)));
        store32(lo + c, _mm512_permutexvar_epi16(_mm512_and_si512(v, nib), lut_lo), m, stream);
        if (hi) store32(hi + c, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), lut_hi), m, stream);
    }
}
#define STORE_FENCE() _mm_sfence()
#else
typedef struct { uint16_t v[16]; } lut_t;

static inline lut_t make_lut(float s, float z) {
    lut_t t;
    for (int q = 0; q < 16; ++q) t.v[q] = rne(((float)q - z) * s);
    return t;
}

static inline void lookup_pair(const uint8_t *idx, lut_t lut_lo, lut_t lut_hi, uint16_t *lo, uint16_t *hi,
                               int64_t kn, int stream) {
    (void)stream;
    for (int64_t c = 0; c < kn; ++c) lo[c] = lut_lo.v[idx[c] & 15];
    if (hi)
        for (int64_t c = 0; c < kn; ++c) hi[c] = lut_hi.v[idx[c] >> 4];
}
#define STORE_FENCE() ((void)0)
#endif

/* ------------------------------------------------------------ bf16 transpose */

/* dst[c * rows + r] = src[r * cols + c] for 16-bit elements. */
int llmsys_u16_transpose(const uint16_t *src, uint16_t *dst, int64_t rows, int64_t cols, int nthreads) {
    if (rows <= 0 || cols <= 0) return 1;
    const int64_t rt = (rows + 15) / 16, ct = (cols + 15) / 16;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t w = 0; w < rt * ct; ++w) {
        const int64_t r0 = (w / ct) * 16, c0 = (w % ct) * 16;
#if defined(__AVX2__)
        if (r0 + 16 <= rows && c0 + 16 <= cols) {
            for (int half = 0; half < 16; half += 8) { /* source rows r0..r0+7, then r0+8..r0+15 */
                __m256i x[8];
#pragma GCC unroll 8
                for (int i = 0; i < 8; ++i)
                    x[i] = _mm256_loadu_si256((const __m256i *)(src + (r0 + half + i) * cols + c0));
                transpose8_lanes_u16(x);
                /* x[c] lane L: these 8 rows of column c0 + 8L + c */
#pragma GCC unroll 8
                for (int c = 0; c < 8; ++c) {
                    _mm_storeu_si128((__m128i *)(dst + (c0 + c) * rows + r0 + half), _mm256_castsi256_si128(x[c]));
                    _mm_storeu_si128((__m128i *)(dst + (c0 + 8 + c) * rows + r0 + half),
                                     _mm256_extracti128_si256(x[c], 1));
                }
            }
            continue;
        }
#endif
        for (int64_t c = c0; c < c0 + 16 && c < cols; ++c)
            for (int64_t r = r0; r < r0 + 16 && r < rows; ++r) dst[c * rows + r] = src[r * cols + c];
    }
    return 0;
}

/* ------------------------------------------------------------ entry point */

#define CHUNK 512 /* columns per work item (a multiple of every group size) */

int llmsys_int4_cpu_dequant(const uint8_t *packed, const void *scales, int64_t s_n, int64_t s_g,
                            int scale_f32, const uint8_t *zeros, uint16_t *out, int64_t ldo,
                            int64_t n_rows, int64_t kp, int64_t k, int64_t gs, int nthreads) {
    if (gs % 32 || gs > 128 || kp % gs || n_rows <= 0 || k <= 0 || k > kp || ldo < k) return 1;
    const int64_t n_blocks = (n_rows + 63) / 64;
    const int64_t n_groups = kp / gs;
    const int64_t n_chunks = (k + CHUNK - 1) / CHUNK;
    const int64_t work = n_blocks * n_chunks;
    /* Streaming stores write the dequantized weight faster (4864x896, Zen 4: 1.0 vs 2.2 ms
       alone) but leave it out of the cache, and the GEMM that follows then reads it from
       DRAM: dequantize + GEMM at 128 rows took 6.2 ms with them, 4.2-4.8 ms with plain
       stores (896x4864: 5.7 vs 3.8 ms). So plain stores up to 16 MiB (within this L3). */
    const int stream = n_rows * ldo * 2 >= ((int64_t)16 << 20);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
    for (int64_t w = 0; w < work; ++w) {
        const int64_t b = w / n_chunks, k0 = (w % n_chunks) * CHUNK;
        const int64_t kn = k - k0 < CHUNK ? k - k0 : CHUNK;  /* columns written */
        const int64_t kc = (kn + gs - 1) / gs * gs;          /* columns decoded (whole groups, <= Kp) */
        /* codes[j * kc + c]: byte for rows 64b+j (low nibble) and 64b+32+j (high), column k0+c */
        uint8_t codes[32 * CHUNK];
        const uint8_t *src = packed + (b * kp + k0) * 32;
        for (int64_t c = 0; c < kc; c += 32) transpose32(src + c * 32, codes + c, kc);
        for (int j = 0; j < 32; ++j) {
            const int64_t n = b * 64 + j, n2 = n + 32;
            if (n >= n_rows) break;
            for (int64_t c = 0; c < kn; c += gs) {
                const int64_t g = (k0 + c) / gs;
                lut_t lut[2];
                for (int h = 0; h < 2 && (h == 0 || n2 < n_rows); ++h) {
                    const int64_t row = h ? n2 : n, at = row * s_n + g * s_g;
                    const float s = scale_f32 ? ((const float *)scales)[at]
                                              : bf(((const uint16_t *)scales)[at]);
                    lut[h] = make_lut(s, (float)zeros[row * n_groups + g]);
                }
                lookup_pair(codes + j * kc + c, lut[0], lut[n2 < n_rows], out + n * ldo + k0 + c,
                            n2 < n_rows ? out + n2 * ldo + k0 + c : NULL, kn - c < gs ? kn - c : gs, stream);
            }
        }
    }
    STORE_FENCE(); /* streamed stores are visible before the caller reads the weight */
    }
    return 0;
}
