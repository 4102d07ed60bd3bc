/* The grouped expert kernel: an MoE layer's routed experts for every token of a step in one call.
 *
 * Why: run expert by expert, a Qwen3-30B-A3B decode step is 8 experts x 3 projections x 48 layers of small
 * GEMVs, each with its Python, dispatch and thread fork around a few tens of microseconds of arithmetic (the
 * loop was the cost, not the bytes). Here one call (llmsys_moe_experts) takes the routed rows of every expert:
 *   1. the tokens' rows grouped by expert (each expert's rows in token order), and x as a8 blocks once;
 *   2. every routed expert's gate | up rows as one parallel loop over (expert, weight, row block) items, so both
 *      threads stay busy at batch 1 (8 experts x 24 blocks, not 24 blocks 8 times over);
 *   3. the activation on each row (SwiGLU, or gpt-oss's clamped SwiGLU), its a8 blocks, then every expert's down rows as one parallel loop the same way;
 *   4. the weighted sum of each token's k rows.
 *
 * Arithmetic: the fused decode layers' (fused_layer.c): each projection through qw_item (the a8 GEMVs, bf16 and
 * float32 rows, a bf16 bias as bf16(y + b)), cpu_ops.h's activation rows, then engine/models/moe.py's sum: a row's
 * product p = y * w (bf16 routing weights: float product rounded to bf16; float32 weights or activations:
 * float32), a token's k products added in float32 in slot order, rounded once to the activations' dtype. Every
 * output row is computed alone, so the bits are the per-expert path's for any batch or grouping
 * (tests/test_moe_grouped.py).
 *
 * An expert with more rows than M->max_rows (a long prompt's popular expert) is left to the caller, which runs its
 * projections' own forward (the kernels those take for many rows) and completes the sum from rows_out.
 */
#include "gemv_common.h"
#include "fused_layer.h"

#define MOE_MAX_EXPERTS 1024 /* experts a layer at most (the per-call tables live on the stack) */

/* A parallel work item: weight j of expert e (gate | up: j < n_gu; down: j = n_gu), its row block it. */
typedef struct {
    int32_t e, j;
    int64_t it;
} moe_item;

/* 0 when expert e's weights fit the layer's shapes and formats, the same block counts as expert 0's; else 1 */
static int expert_check(const llmsys_moe *M, int64_t e) {
    int64_t two_i = 0;
    for (int64_t j = 0; j < M->n_gu; j++) {
        const llmsys_qw *w = &M->gu[e * M->n_gu + j], *w0 = &M->gu[j];
        if (qw_check(w, M->d) || (w->kind == WEIGHT_F32) != (M->f32 != 0) || qw_plain(w) != qw_plain(w0)
            || qw_nb(w) != qw_nb(w0) || w->n != w0->n)
            return 1;
        two_i += w->n;
    }
    const llmsys_qw *dn = &M->down[e];
    return two_i != 2 * M->inter || qw_check(dn, M->inter) || dn->n != M->d || (dn->kind == WEIGHT_F32) != (M->f32 != 0)
           || qw_plain(dn) != qw_plain(&M->down[0]) || qw_nb(dn) != qw_nb(&M->down[0]);
}

/* rows [0, m) of x [m, k] (es bytes an element) as the weights read them: a8 blocks (distinct block counts of the
   n weights), and lane pairs for bf16 weights in the AVX512-BF16 build. 0, or 2 with no memory. */
static int prep_x(const llmsys_qw *ws, int64_t n, const void *x, int64_t m, int64_t k, a8_x *a, int *made,
                  int64_t *which, uint32_t **xs) {
    for (int64_t j = 0; j < n; j++) {
        which[j] = -1;
#if defined(QG_AVX512) && defined(__AVX512BF16__)
        if (ws[j].kind == WEIGHT_BF16 && !*xs && !(*xs = lane_pairs(x, k, m, k, (k + 31) / 32))) return 2;
#else
        (void)xs;
#endif
        if (qw_plain(&ws[j])) continue;
        for (int i = 0; i < *made; i++)
            if (a[i].nb == qw_nb(&ws[j])) which[j] = i;
        if (which[j] < 0) {
            if (a8_quantize(x, k, 0, m, k, qw_nb(&ws[j]), &a[*made])) return 2;
            which[j] = (*made)++;
        }
    }
    return 0;
}

/* a view of a from row r0 */
static a8_x a8_from(const a8_x *a, int64_t r0) {
    a8_x v = *a;
    v.q = a->q + r0 * a->nb * A8;
    v.q4 = a->q4 ? a->q4 + r0 * a->nb * A8 : NULL;
    v.qu = a->qu ? a->qu + r0 * a->nb * A8 : NULL;
    v.d = a->d + r0 * a->nb;
    v.s = a->s + r0 * a->nb;
    return v;
}

/* The items over experts [0, E) with rows (n[e] > 0) of weights j in [j0, j1) (expert e's weight j at
   ws[e * stride + j]) into items; their count. */
static int64_t make_items(const llmsys_qw *ws, int64_t stride, int64_t j0, int64_t j1, int32_t tag, const int64_t *n,
                          const uint8_t *run, int64_t n_experts, moe_item *items) {
    int64_t c = 0;
    for (int64_t e = 0; e < n_experts; e++) {
        if (!n[e] || !run[e]) continue;
        for (int64_t j = j0; j < j1; j++) {
            const llmsys_qw *w = &ws[e * stride + j];
            const int64_t its = (w->n + qw_step(w) - 1) / qw_step(w);
            for (int64_t it = 0; it < its; it++) items[c++] = (moe_item){(int32_t)e, tag < 0 ? (int32_t)j : tag, it};
        }
    }
    return c;
}

/* One MoE layer's routed experts (the file's comment): x [T, D] (bf16, or float32 with M->f32), chosen [T, k] int64
 * expert ids (distinct within a token), w [T, k] routing weights (bf16, float32 with w_f32) ->
 *   out [T, D] in x's dtype, the sum over each token's k experts of y * w (written when no expert was left over);
 *   rows_out (or NULL) [T * k, D] in the products' dtype (float32 when w_f32 or M->f32, else bf16): row t k + j the
 *     product of token t's slot j, for the experts run here (the caller fills the rest, then sums);
 *   counts (or NULL) [n_experts]: each expert's rows this step.
 * Returns 0; -n: n experts had more than M->max_rows rows and were left to the caller (out not written); 1 bad
 * arguments (shapes, formats, an id outside the experts); 2 no memory. */
int llmsys_moe_experts(const llmsys_moe *M, const void *x, int64_t t_count, const int64_t *chosen, int64_t top_k,
                       const void *w, int w_f32, void *rows_out, void *out, int64_t *counts, int threads) {
    const int64_t E = M->n_experts, D = M->d, I = M->inter, T = t_count, K = top_k, f32 = M->f32 != 0;
    if (T <= 0 || K <= 0 || E <= 0 || E > MOE_MAX_EXPERTS || D <= 0 || I <= 0 || M->n_gu < 1 || M->n_gu > QW_MAX
        || K > E || (M->act != MOE_SILU && M->act != MOE_CLAMPED_SWIGLU) || (f32 && !w_f32))
        return 1;
    const size_t es = f32 ? 4 : 2;
    const int pf32 = f32 || w_f32; /* the products' dtype: float32, else bf16 */
    int64_t n[MOE_MAX_EXPERTS], off[MOE_MAX_EXPERTS + 1];
    uint8_t run[MOE_MAX_EXPERTS];
    for (int64_t e = 0; e < E; e++) n[e] = 0;
    for (int64_t r = 0; r < T * K; r++) {
        if (chosen[r] < 0 || chosen[r] >= E) return 1;
        n[chosen[r]]++;
    }
    int64_t left = 0, R = 0;
    for (int64_t e = 0; e < E; e++) {
        if (counts) counts[e] = n[e];
        run[e] = n[e] > 0 && n[e] <= M->max_rows;
        if (n[e] && !run[e]) left++;
        if (run[e] && expert_check(M, e)) return 1;
        off[e] = R;
        R += run[e] ? n[e] : 0;
    }
    off[E] = R;
    if (left && !rows_out) return -(int)left;

    /* rows grouped by expert, each expert's in token order: src[i] = the (token, slot) row t k + j */
    int64_t *src = malloc(sizeof(int64_t) * (size_t)(R + 1)), *pos = malloc(sizeof(int64_t) * (size_t)(T * K));
    int64_t fill[MOE_MAX_EXPERTS];
    const int gather = T > 1; /* one token: every expert reads x's one row in place */
    const int64_t xr = gather ? R : 1;
    void *xg = gather ? malloc(es * (size_t)(R * D)) : (void *)x;
    char *g = malloc(es * (size_t)(R * 2 * I) + 64), *y = malloc(es * (size_t)(R * I) + 64),
         *o = malloc(es * (size_t)(R * D) + 64);
    const int64_t gu_items_max = E * M->n_gu * ((2 * I + 31) / 32 + 1), dn_items_max = E * ((D + 31) / 32 + 1);
    moe_item *items = malloc(sizeof(moe_item) * (size_t)(gu_items_max > dn_items_max ? gu_items_max : dn_items_max));
    a8_x ax[QW_MAX], ay[1];
    int madex = 0, madey = 0, rc = 0;
    int64_t whichx[QW_MAX], whichy[1];
    uint32_t *xs = NULL, *ys = NULL;
    if (!src || !pos || !xg || !g || !y || !o || !items) { rc = 2; goto done; }
    for (int64_t e = 0; e < E; e++) fill[e] = off[e];
    for (int64_t r = 0; r < T * K; r++) {
        const int64_t e = chosen[r];
        pos[r] = run[e] ? fill[e] : -1;
        if (run[e]) src[fill[e]++] = r;
    }
    if (gather)
        for (int64_t i = 0; i < R; i++) memcpy((char *)xg + es * (size_t)(i * D), (const char *)x + es * (size_t)(src[i] / K * D), es * (size_t)D);

    /* gate | up of every routed expert: one parallel loop over (expert, weight, row block) */
    int64_t col[QW_MAX], two_i = 0;
    for (int64_t j = 0; j < M->n_gu; j++) col[j] = two_i, two_i += M->gu[j].n;
    if (R && (rc = prep_x(M->gu, M->n_gu, xg, xr, D, ax, &madex, whichx, &xs))) goto done;
    int64_t ni = make_items(M->gu, M->n_gu, 0, M->n_gu, -1, n, run, E, items);
    int par = threads > 1 && ni > 1 && R * 2 * I * D >= PAR_MIN;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
    for (int64_t i = 0; i < ni; i++) {
        const int64_t e = items[i].e, j = items[i].j, x0 = gather ? off[e] : 0;
        a8_x av;
        if (whichx[j] >= 0) av = a8_from(&ax[whichx[j]], x0);
        const uint32_t *xsv = xs ? xs + x0 * ((D + 31) / 32) * 16 : NULL;
        qw_item(&M->gu[e * M->n_gu + j], whichx[j] >= 0 ? &av : NULL, (const char *)xg + es * (size_t)(x0 * D), xsv,
                n[e], items[i].it, g + es * (size_t)(off[e] * two_i + col[j]), two_i);
    }
    /* the activation on each row: silu * mul, or the clamped SwiGLU */
    par = threads > 1 && R > 1 && R * I >= PAR_MIN / 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
    for (int64_t i = 0; i < R; i++) {
        if (M->act == MOE_CLAMPED_SWIGLU) {
            ops_cswiglu_row(g + es * (size_t)(i * two_i), g + es * (size_t)(i * two_i + I), y + es * (size_t)(i * I), I,
                            M->alpha, M->limit, (int)f32);
        } else if (f32) {
            const float *gi = (const float *)g + i * two_i;
            ops_silu_mul_row_f32(gi, gi + I, (float *)y + i * I, I);
        } else {
            const uint16_t *gi = (const uint16_t *)g + i * two_i;
            ops_silu_mul_row(gi, gi + I, (uint16_t *)y + i * I, I);
        }
    }
    /* down of every routed expert: the same loop */
    if (R && (rc = prep_x(M->down, 1, y, R, I, ay, &madey, whichy, &ys))) goto done;
    ni = make_items(M->down, 1, 0, 1, -1, n, run, E, items);
    par = threads > 1 && ni > 1 && R * I * D >= PAR_MIN;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
    for (int64_t i = 0; i < ni; i++) {
        const int64_t e = items[i].e;
        a8_x av;
        if (whichy[0] >= 0) av = a8_from(&ay[0], off[e]);
        const uint32_t *ysv = ys ? ys + off[e] * ((I + 31) / 32) * 16 : NULL;
        qw_item(&M->down[e], whichy[0] >= 0 ? &av : NULL, y + es * (size_t)(off[e] * I), ysv, n[e], items[i].it,
                o + es * (size_t)(off[e] * D), D);
    }
    /* products (rows_out) and each token's sum in slot order (out) */
    par = threads > 1 && T > 1 && T * K * D >= PAR_MIN / 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t c0 = 0; c0 < D; c0 += 256) {
            const int64_t c1 = c0 + 256 < D ? c0 + 256 : D;
            float acc[256];
            for (int64_t c = 0; c < c1 - c0; c++) acc[c] = 0.0f;
            for (int64_t j = 0; j < K; j++) {
                const int64_t r = t * K + j, i = pos[r];
                if (i < 0) continue; /* the caller's expert: out is not written */
                const float wf = w_f32 ? ((const float *)w)[r] : bf(((const uint16_t *)w)[r]);
                int64_t c = c0;
#ifdef QA8_AVX2
                if (!f32 && !pf32) {
                    const __m256 wv = _mm256_set1_ps(wf);
                    for (; c + 8 <= c1; c += 8) {
                        const __m128i p = ops_rne8(_mm256_mul_ps(ops_bf8((const uint16_t *)o + i * D + c), wv));
                        if (rows_out) _mm_storeu_si128((__m128i *)((uint16_t *)rows_out + r * D + c), p);
                        const __m256 pf = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(p), 16));
                        _mm256_storeu_ps(acc + (c - c0), _mm256_add_ps(_mm256_loadu_ps(acc + (c - c0)), pf));
                    }
                }
#endif
                for (; c < c1; c++) {
                    const float yv = f32 ? ((const float *)o)[i * D + c] : bf(((const uint16_t *)o)[i * D + c]);
                    float p = yv * wf;
                    if (!pf32) {
                        const uint16_t pb = rne(p);
                        if (rows_out) ((uint16_t *)rows_out)[r * D + c] = pb;
                        p = bf(pb);
                    } else if (rows_out) {
                        ((float *)rows_out)[r * D + c] = p;
                    }
                    acc[c - c0] = acc[c - c0] + p;
                }
            }
            if (left) continue;
            if (f32)
                memcpy((float *)out + t * D + c0, acc, sizeof(float) * (size_t)(c1 - c0));
            else
                for (int64_t c = c0; c < c1; c++) ((uint16_t *)out)[t * D + c] = rne(acc[c - c0]);
        }
    }
done:
    for (int i = 0; i < madex; i++) a8_free(&ax[i]);
    for (int i = 0; i < madey; i++) a8_free(&ay[i]);
    free(xs), free(ys), free(src), free(pos), free(g), free(y), free(o), free(items);
    if (gather) free(xg);
    return rc ? rc : left ? -(int)left : 0;
}
