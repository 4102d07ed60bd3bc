/* The x86 family's primitives (x86-64-v2 and up: SSSE3 + SSE4.1, with AVX2 where the build has it; isa.h's
 * ISA_X86): the bits of isa_scalar.h's definitions.
 *
 * How:
 *   - int8 dots: |w| (pabsb: -128 reads as unsigned 128) times x with w's signs (psignb: activation codes
 *     stay within +-127, so negating one never overflows; negating a weight code of -128 would), pairs of
 *     int16 products summed to int32 by pmaddwd with ones (2 * 128 * 127 < 2^15). Exact.
 *   - int4 dots: two columns' bytes interleaved (punpck{l,h}bw) hold each row's (code c, code c + 1) pair,
 *     pmaddubsw against the broadcast activation pair sums both products, int16 sums of 8 column pairs
 *     (8 * 2 * 15 * 127 < 2^15), then widened. Exact.
 *   - float dots: 16 lanes in one AVX-512 register, two AVX2 or four SSE ones, multiply then add, the tail
 *     and the tree as the definition.
 * The kernels' AVX2 / AVX-512 tiles that keep many rows' sums in registers across blocks stay in the kernels:
 * they are wider than one primitive call.
 */
#ifndef LLMSYS_ISA_X86_H
#define LLMSYS_ISA_X86_H
#include <smmintrin.h>
#if defined(__AVX2__)
#include <immintrin.h>
#define ISA_NAME "x86-avx2"
#else
#define ISA_NAME "x86-ssse3"
#endif

static inline int32_t isa_dot_i8(const int8_t *x, const int8_t *w, int64_t len) {
    __m128i acc = _mm_setzero_si128();
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m128i xv = _mm_loadu_si128((const __m128i *)(x + i)), wv = _mm_loadu_si128((const __m128i *)(w + i));
        acc = _mm_add_epi32(acc, _mm_madd_epi16(_mm_maddubs_epi16(_mm_abs_epi8(wv), _mm_sign_epi8(xv, wv)),
                                                _mm_set1_epi16(1)));
    }
    acc = _mm_add_epi32(acc, _mm_srli_si128(acc, 8));
    acc = _mm_add_epi32(acc, _mm_srli_si128(acc, 4));
    int32_t s = _mm_cvtsi128_si32(acc);
    for (; i < len; i++) s += (int32_t)x[i] * (int32_t)w[i];
    return s;
}

static inline void isa_dot32_i8_x8(const int8_t *qx, const int8_t *q, int64_t ldq, int32_t s[8]) {
#if defined(__AVX2__)
    const __m256i xv = _mm256_loadu_si256((const __m256i *)qx);
    __m256i p[8];
    for (int r = 0; r < 8; r++) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(q + r * ldq));
        p[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv)),
                                 _mm256_set1_epi16(1));
    }
    const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
    const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
    const __m256i a = _mm256_hadd_epi32(h01, h23), b = _mm256_hadd_epi32(h45, h67);
    _mm256_storeu_si256((__m256i *)s, _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31)));
#else
    for (int r = 0; r < 8; r++) s[r] = isa_dot_i8(qx, q + r * ldq, 32);
#endif
}

static inline void isa_i4_dot64(const uint8_t *p, const int8_t *qx, int32_t s[64]) {
    const __m128i low4 = _mm_set1_epi8(15);
    __m128i s32[16];
    for (int v = 0; v < 16; v++) s32[v] = _mm_setzero_si128();
    for (int h16 = 0; h16 < 2; h16++) {
        __m128i a16[8]; /* a16[i]: rows 8i .. 8i + 7 (i < 4: low nibbles; i >= 4: the high nibbles' rows + 32) */
        for (int v = 0; v < 8; v++) a16[v] = _mm_setzero_si128();
        const uint8_t *pc = p + h16 * 16 * 32;
        const int8_t *xc = qx + h16 * 16;
        for (int pr = 0; pr < 8; pr++) {
            const uint8_t *c0 = pc + 64 * pr;
            const __m128i v0l = _mm_loadu_si128((const __m128i *)c0), v0h = _mm_loadu_si128((const __m128i *)(c0 + 16));
            const __m128i v1l = _mm_loadu_si128((const __m128i *)(c0 + 32)), v1h = _mm_loadu_si128((const __m128i *)(c0 + 48));
            int16_t pw; /* the pair (qx[c], qx[c + 1]) as one little-endian word */
            memcpy(&pw, xc + 2 * pr, 2);
            const __m128i xp = _mm_set1_epi16(pw);
            const __m128i u[4] = {_mm_unpacklo_epi8(v0l, v1l), _mm_unpackhi_epi8(v0l, v1l),
                                  _mm_unpacklo_epi8(v0h, v1h), _mm_unpackhi_epi8(v0h, v1h)};
            for (int i = 0; i < 4; i++) {
                a16[i] = _mm_add_epi16(a16[i], _mm_maddubs_epi16(_mm_and_si128(u[i], low4), xp));
                a16[i + 4] = _mm_add_epi16(a16[i + 4], _mm_maddubs_epi16(_mm_and_si128(_mm_srli_epi16(u[i], 4), low4), xp));
            }
        }
        for (int v = 0; v < 8; v++) { /* rows 8v .. 8v + 7 as int32 */
            s32[2 * v] = _mm_add_epi32(s32[2 * v], _mm_cvtepi16_epi32(a16[v]));
            s32[2 * v + 1] = _mm_add_epi32(s32[2 * v + 1], _mm_cvtepi16_epi32(_mm_srli_si128(a16[v], 8)));
        }
    }
    for (int v = 0; v < 16; v++) _mm_storeu_si128((__m128i *)(s + 4 * v), s32[v]);
}

/* 4 bf16 -> 4 floats (exact) */
static inline __m128 isa_x86_bf4(const uint16_t *p) {
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)p)), 16));
}

/* 16 elements at p (float32, or bf16 when b is set) as float32 lanes, in the widest registers the build has */
#if defined(__AVX512F__)
typedef __m512 isa_x86_v16;
static inline isa_x86_v16 isa_x86_ld16(const void *p, int b) {
    return b ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16))
             : _mm512_loadu_ps((const float *)p);
}
static inline isa_x86_v16 isa_x86_zero16(void) { return _mm512_setzero_ps(); }
static inline isa_x86_v16 isa_x86_mac16(isa_x86_v16 a, isa_x86_v16 x, isa_x86_v16 y) { return _mm512_add_ps(a, _mm512_mul_ps(x, y)); }
static inline void isa_x86_st16(float *p, isa_x86_v16 v) { _mm512_storeu_ps(p, v); }
static inline __m128 isa_x86_fold4(isa_x86_v16 v) { /* lanes i + (i+8), then i + (i+4) */
    const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
}
#elif defined(__AVX2__)
typedef struct {
    __m256 lo, hi;
} isa_x86_v16;
static inline __m256 isa_x86_ld8(const void *p, int b) {
    return b ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16))
             : _mm256_loadu_ps((const float *)p);
}
static inline isa_x86_v16 isa_x86_ld16(const void *p, int b) {
    return (isa_x86_v16){isa_x86_ld8(p, b), isa_x86_ld8((const char *)p + (b ? 16 : 32), b)};
}
static inline isa_x86_v16 isa_x86_zero16(void) { return (isa_x86_v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline isa_x86_v16 isa_x86_mac16(isa_x86_v16 a, isa_x86_v16 x, isa_x86_v16 y) {
    return (isa_x86_v16){_mm256_add_ps(a.lo, _mm256_mul_ps(x.lo, y.lo)), _mm256_add_ps(a.hi, _mm256_mul_ps(x.hi, y.hi))};
}
static inline void isa_x86_st16(float *p, isa_x86_v16 v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
static inline __m128 isa_x86_fold4(isa_x86_v16 v) {
    const __m256 t8 = _mm256_add_ps(v.lo, v.hi);
    return _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
}
#else
typedef struct {
    __m128 v[4];
} isa_x86_v16;
static inline isa_x86_v16 isa_x86_ld16(const void *p, int b) {
    isa_x86_v16 r;
    for (int i = 0; i < 4; i++) r.v[i] = b ? isa_x86_bf4((const uint16_t *)p + 4 * i) : _mm_loadu_ps((const float *)p + 4 * i);
    return r;
}
static inline isa_x86_v16 isa_x86_zero16(void) { return (isa_x86_v16){{_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()}}; }
static inline isa_x86_v16 isa_x86_mac16(isa_x86_v16 a, isa_x86_v16 x, isa_x86_v16 y) {
    for (int i = 0; i < 4; i++) a.v[i] = _mm_add_ps(a.v[i], _mm_mul_ps(x.v[i], y.v[i]));
    return a;
}
static inline void isa_x86_st16(float *p, isa_x86_v16 v) {
    for (int i = 0; i < 4; i++) _mm_storeu_ps(p + 4 * i, v.v[i]);
}
static inline __m128 isa_x86_fold4(isa_x86_v16 v) { return _mm_add_ps(_mm_add_ps(v.v[0], v.v[2]), _mm_add_ps(v.v[1], v.v[3])); }
#endif

/* x (float32 or, xb set, bf16) times y (float32 or, w set, bf16): the 16 lanes, the tail, the tree (in registers
   when there is no tail: i + (i+8), i + (i+4), i + (i+2), i + (i+1)) */
static inline __attribute__((always_inline)) float isa_x86_dot(const float *x, const uint16_t *xb, const float *y, const uint16_t *w, int64_t n) {
    isa_x86_v16 a = isa_x86_zero16();
    int64_t i = 0;
    for (; i + ISA_LANES <= n; i += ISA_LANES)
        a = isa_x86_mac16(a, isa_x86_ld16(xb ? (const void *)(xb + i) : (const void *)(x + i), xb != NULL),
                          isa_x86_ld16(w ? (const void *)(w + i) : (const void *)(y + i), w != NULL));
    if (i == n) {
        const __m128 t4 = isa_x86_fold4(a), t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
        return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
    }
    float l[ISA_LANES];
    isa_x86_st16(l, a);
    for (int j = 0; i + j < n; j++) l[j] = l[j] + (xb ? bf(xb[i + j]) : x[i + j]) * (w ? bf(w[i + j]) : y[i + j]);
    return ops_tree(l);
}

static inline float isa_dot_f32(const float *x, const float *y, int64_t n) { return isa_x86_dot(x, NULL, y, NULL, n); }
static inline float isa_dot_f32_bf16(const float *x, const uint16_t *w, int64_t n) { return isa_x86_dot(x, NULL, NULL, w, n); }
static inline float isa_dot_bf16(const uint16_t *x, const uint16_t *w, int64_t n) { return isa_x86_dot(NULL, x, NULL, w, n); }

static inline void isa_axpy(float *acc, float p, const void *v, int f32, int64_t n) {
    const __m128 pv = _mm_set1_ps(p);
    int64_t e = 0;
#if defined(__AVX2__)
    const __m256 pv8 = _mm256_set1_ps(p);
    for (; e + 8 <= n; e += 8) {
        const __m256 vv = f32 ? _mm256_loadu_ps((const float *)v + e)
                              : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)v + e))), 16));
        _mm256_storeu_ps(acc + e, _mm256_add_ps(_mm256_loadu_ps(acc + e), _mm256_mul_ps(pv8, vv)));
    }
#endif
    for (; e + 4 <= n; e += 4) {
        const __m128 vv = f32 ? _mm_loadu_ps((const float *)v + e) : isa_x86_bf4((const uint16_t *)v + e);
        _mm_storeu_ps(acc + e, _mm_add_ps(_mm_loadu_ps(acc + e), _mm_mul_ps(pv, vv)));
    }
    isa_ref_axpy(acc + e, p, f32 ? (const void *)((const float *)v + e) : (const void *)((const uint16_t *)v + e), f32, n - e);
}

static inline void isa_exp_sub(float *s, int64_t n, float m) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256 mv = _mm256_set1_ps(m);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, ops_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv)));
#endif
    isa_ref_exp_sub(s + i, n - i, m);
}

static inline void isa_widen_bf16(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) _mm_storeu_ps(dst + i, isa_x86_bf4(src + i));
    isa_ref_widen_bf16(src + i, dst + i, n - i);
}

#endif
