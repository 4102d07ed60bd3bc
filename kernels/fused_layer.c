/* The fused decode layers.
 *
 * A decode step's layer in two calls instead of ~10: llmsys_layer_attn_in (input RMSNorm with its
 * residual add, then the q|k|v projection) and llmsys_layer_mlp (o_proj, the post-attention RMSNorm,
 * gate|up, silu * mul, down). Why: with the a8 GEMVs a SmolLM2-135M int4 decode step spent more time in
 * the Python and dispatch around the kernels (per linear call ~25-35 us of wrappers and module calls)
 * than in the kernels (benchmarks/profile_decode.py). The arithmetic is that of the separate kernels: the
 * RMSNorm and silu * mul rows of cpu_ops.h (what llmsys_rms_norm_bf16 and llmsys_silu_mul_bf16 run), the
 * a8 GEMVs (a8_gemv.c), a bias added as bf16(y + b): a layer computed fused or op by op gives the same bits
 * (tests/test_fused_layer.py), so which one runs never depends on the memory budget's answers.
 *
 * A projection is 1-4 weights (llmsys_qw) whose outputs lie side by side (q | k | v, gate | up: fused
 * into one weight or not, the same bits: each output row depends on its own weight row only).
 *
 * A float32 model's layer (llmsys_layer.f32) runs the same calls on float32 rows: float32 weights (WEIGHT_F32,
 * f32_rows), biases and norm weights, cpu_ops.h's float32 RMSNorm and silu * mul rows.
 */
#include "gemv_common.h"
#include "fused_layer.h"


int64_t qw_nb(const llmsys_qw *w) { return w->kind == WEIGHT_INT4 ? w->kp / A8 : (w->k + A8 - 1) / A8; }

/* weights that read x as it is (bf16 or float32), not as a8 blocks */
int qw_plain(const llmsys_qw *w) { return w->kind == WEIGHT_BF16 || w->kind == WEIGHT_F32; }

/* Rows of a work item: 32 for weights read a row at a time (bf16, float32), so a 576-row matrix splits 9 / 9
   between 2 threads, not 5 / 4 items of 64 (one thread idle a ninth of each o_proj and down_proj: measured as
   ~0.4 ms of a SmolLM2-135M bf16 decode step); 64 else (int4's blocks; int8's 16- or 32-row items measured no
   faster in the decode stack). */
int64_t qw_step(const llmsys_qw *w) { return qw_plain(w) ? 32 : 64; }

/* 0 when w is a weight of k columns the a8 GEMVs take (their own argument checks), else 1 */
int qw_check(const llmsys_qw *w, int64_t k) {
    if (w->n <= 0 || w->k != k || !w->q) return 1;
    if (w->kind == WEIGHT_BF16 || w->kind == WEIGHT_F32) return w->kp < k;
    if (w->kind == WEIGHT_INT4 && w->ksc) /* Q4_K's scales as stored: group 32, whole super-blocks */
        return !w->km || !w->kd || !w->kdm || w->gs != A8 || w->kp % 256 || k <= w->kp - w->gs || k > w->kp
               || w->k_n < w->n;
    if (w->kind == WEIGHT_INT8_Q6K) return w->s_g < w->n || k % 256 || !w->ksc || !w->kd; /* Q6_K's stored scales */
    if (!w->scales) return 1;
    if (w->kind == WEIGHT_INT8) return 0;
    if (w->kind == WEIGHT_INT8_BLOCK) return w->s_g < w->n;
    if (w->kind == WEIGHT_INT8_Q5K) return w->s_g < w->n || k % A8 || !w->offs || !w->scales;
    if (w->kind != WEIGHT_INT4 || w->gs <= 0 || w->gs % A8 || w->gs > 256 || w->kp % w->gs || k <= w->kp - w->gs || k > w->kp
        || !w->zeros || w->scale_kind < SCALE_BF16 || w->scale_kind > SCALE_F16)
        return 1;
    return 0;
}

/* Rows [step it, step it + step) of w (step = qw_step(w)) against the m_count rows of x (contiguous bf16, read by bf16 weights; a: its
   a8 blocks, read by int8 / int4 weights; float32 for a float32 weight): out[m * ldo + n], bias added. */
void qw_item(const llmsys_qw *w, const a8_x *a, const void *xv, const uint32_t *xs, int64_t m_count,
                    int64_t it, void *outv, int64_t ldo) {
    const int64_t step = qw_step(w), n0 = it * step, n1 = n0 + step < w->n ? n0 + step : w->n;
    if (w->kind == WEIGHT_F32) {
        float *out = outv;
        f32_rows(xv, w->k, m_count, w->k, (const float *)w->q, w->kp, out, ldo, n0, n1);
        if (w->bias)
            for (int64_t m = 0; m < m_count; m++)
                for (int64_t n = n0; n < n1; n++) out[m * ldo + n] = out[m * ldo + n] + ((const float *)w->bias)[n];
        return;
    }
    const uint16_t *x = xv;
    uint16_t *out = outv;
    const qout o = {outv, ldo, 0}; /* the layers' activations: bf16 */
    if (w->kind == WEIGHT_BF16) {
#if defined(QG_AVX512) && defined(__AVX512BF16__)
        (void)x;
        bf16_rows_lanes(xs, (w->k + 31) / 32, m_count, w->k, (const uint16_t *)w->q, w->kp, o, n0, n1);
#else
        (void)xs;
        bf16_rows(x, w->k, m_count, w->k, (const uint16_t *)w->q, w->kp, o, n0, n1);
#endif
    } else if (w->kind == WEIGHT_INT8) {
        int8_a8_many(a, m_count, (const int8_t *)w->q, w->k, (const uint16_t *)w->scales, NULL, 0, o, n0, n1);
    } else if (w->kind == WEIGHT_INT8_BLOCK) {
        int8_a8_many(a, m_count, (const int8_t *)w->q, w->k, NULL, (const uint16_t *)w->scales, w->s_g, o, n0, n1);
    } else if (w->kind == WEIGHT_INT8_Q6K || w->kind == WEIGHT_INT8_Q5K) { /* Q6_K: its stored scales (ksc, kd); Q5_K: scales and offsets */
        const int q6 = w->kind == WEIGHT_INT8_Q6K;
        for (int64_t m = 0; m < m_count; m++)
            int8k_a8_rows(a, m, (const int8_t *)w->q, w->k, (const float *)w->scales, w->offs,
                          q6 ? (const int8_t *)w->ksc : NULL, q6 ? w->kd : NULL, w->s_g, o, n0, n1);
    } else {
        const int4_meta md = {w->zeros, w->z_n, w->z_g, w->scales, w->s_n, w->s_g, (int)w->scale_kind, w->offs,
                              w->o_n, w->o_g, w->ksc, w->km, w->kd, w->kdm, w->k_n};
        int4_a8_rows(a, 0, m_count, (const uint8_t *)w->q + it * w->kp * 32, &md, w->kp / w->gs, w->gs, n0, w->n, o);
    }
    if (w->bias)
        for (int64_t m = 0; m < m_count; m++)
            for (int64_t n = n0; n < n1; n++)
                out[m * ldo + n] = rne(bf(out[m * ldo + n]) + bf(((const uint16_t *)w->bias)[n]));
}

/* out [M, sum of n] = x [M, K] (contiguous) times each weight, side by side; x and out float32 (f32) or bf16:
   float32 weights then, no float32 weight else. 0, 1 bad weights, 2 no memory. */
static int proj_run(const llmsys_qw *ws, int64_t nw, const void *x, int64_t m_count, int64_t k, void *out, int f32,
                    int threads) {
    if (nw < 1 || nw > QW_MAX) return 1;
    a8_x a[QW_MAX];
    const a8_x *use[QW_MAX];
    int64_t first[QW_MAX + 1], col[QW_MAX], ldo = 0, work = 0;
    int made = 0, rc = 0;
    uint32_t *xs = NULL; /* x as lane pairs, for bf16 weights in the AVX512-BF16 build */
    first[0] = 0;
    for (int64_t j = 0; j < nw; j++) {
        if (qw_check(&ws[j], k) || (ws[j].kind == WEIGHT_F32) != f32) { rc = 1; break; }
        use[j] = NULL;
#if defined(QG_AVX512) && defined(__AVX512BF16__)
        if (ws[j].kind == WEIGHT_BF16 && !xs && !(xs = lane_pairs(x, k, m_count, k, (k + 31) / 32))) { rc = 2; break; }
#endif
        if (!qw_plain(&ws[j])) {
            for (int64_t i = 0; i < j; i++) /* x's blocks are shared by weights with the same block count */
                if (!qw_plain(&ws[i]) && qw_nb(&ws[i]) == qw_nb(&ws[j])) { use[j] = use[i]; break; }
            if (!use[j]) {
                if (a8_quantize(x, k, 0, m_count, k, qw_nb(&ws[j]), &a[made])) { rc = 2; break; }
                use[j] = &a[made++];
            }
        }
        col[j] = ldo;
        ldo += ws[j].n;
        first[j + 1] = first[j] + (ws[j].n + qw_step(&ws[j]) - 1) / qw_step(&ws[j]);
        work += ws[j].n * (ws[j].kind == WEIGHT_INT4 ? ws[j].kp : ws[j].k);
    }
    if (!rc) {
        const int64_t items = first[nw];
        const int par = threads > 1 && items > 1 && m_count * work >= PAR_MIN;
#pragma omp parallel for num_threads(threads) schedule(static) if (par)
        for (int64_t it = 0; it < items; it++) {
            int64_t j = 0;
            while (it >= first[j + 1]) j++;
            qw_item(&ws[j], use[j], x, xs, m_count, it - first[j], (char *)out + (f32 ? 4 : 2) * col[j], ldo);
        }
    }
    free(xs);
    for (int i = 0; i < made; i++) a8_free(&a[i]);
    return rc;
}

/* rows of x [M, D] (+ res) RMSNormed into xn; with res, new_res = bf16(x + res) (float32 rows: x + res) */
static int norm_rows(const void *xv, const void *resv, const void *wv, float eps, void *xnv, void *new_resv,
                     int64_t m_count, int64_t d, int f32) {
    if (f32) {
        const float *x = xv, *res = resv;
        float *new_res = new_resv;
        for (int64_t t = 0; t < m_count; t++)
            ops_rms_norm_row_f32(x + t * d, res ? res + t * d : NULL, wv, (float *)xnv + t * d,
                                 res ? new_res + t * d : NULL, d, eps);
        return 0;
    }
    const uint16_t *x = xv, *res = resv, *w = wv;
    uint16_t *xn = xnv, *new_res = new_resv;
    float *h = malloc(sizeof(float) * (size_t)d);
    if (!h) return 2;
    for (int64_t t = 0; t < m_count; t++)
        ops_rms_norm_row(x + t * d, res ? res + t * d : NULL, w, xn + t * d, res ? new_res + t * d : NULL, d, eps, h);
    free(h);
    return 0;
}


/* 0 when the layer's shapes fit together (what proj_run does not check itself), else 1 */
static int layer_check(const llmsys_layer *L, int64_t m_count) {
    if (m_count <= 0 || L->d <= 0 || L->d > (1 << 20) || L->o->n != L->d)
        return 1;
    if (!L->gu && !L->down && !L->n_gu) return 0; /* an MoE layer's: attention only (llmsys_layer_post_attn) */
    if (!L->gu || !L->down || L->down->n != L->d || L->n_gu < 1 || L->n_gu > QW_MAX)
        return 1;
    int64_t two_i = 0;
    for (int64_t j = 0; j < L->n_gu; j++) two_i += L->gu[j].n;
    return two_i % 2 || L->down->k != two_i / 2;
}

/* The attention input: x [M, D] (the previous layer's MLP output; the embeddings with res NULL), res [M, D]
 * or NULL -> out [M, sum of q|k|v rows] = RMSNorm(x + res) times the q|k|v weights (+ bias), new_res [M, D]
 * = bf16(x + res) (not written when res is NULL). 0, 1 bad arguments, 2 no memory. */
int llmsys_layer_attn_in(const llmsys_layer *L, const void *x, const void *res, void *out, void *new_res,
                         int64_t m_count, int threads) {
    if (layer_check(L, m_count)) return 1;
    const int64_t d = L->d, f32 = L->f32 != 0;
    void *xn = malloc((f32 ? 4 : 2) * (size_t)(m_count * d));
    int rc = xn ? norm_rows(x, res, L->ln1, L->eps1, xn, new_res, m_count, d, f32) : 2;
    if (!rc) rc = proj_run(L->qkv, L->n_qkv, xn, m_count, d, out, f32, threads);
    free(xn);
    return rc;
}

/* The attention output to the MLP output: o [M, K_o] (attention heads side by side), res [M, D]
 * -> a = o times o; x = RMSNorm(a + res) (ln2); new_res = bf16(a + res);
 * out [M, D] = down(silu(gate(x)) * up(x)), gate | up the gu weights' outputs side by side (2 I).
 * 0, 1 bad arguments, 2 no memory. */
int llmsys_layer_mlp(const llmsys_layer *L, const void *o, const void *res, void *out, void *new_res,
                     int64_t m_count, int threads) {
    if (layer_check(L, m_count) || !L->gu) return 1;
    const int64_t d = L->d, f32 = L->f32 != 0;
    const size_t es = f32 ? 4 : 2;
    int64_t two_i = 0;
    for (int64_t j = 0; j < L->n_gu; j++) two_i += L->gu[j].n;
    const int64_t inter = two_i / 2;
    char *a = malloc(es * (size_t)(m_count * (2 * d + two_i + inter)));
    if (!a) return 2;
    char *xn = a + es * (size_t)(m_count * d), *g = xn + es * (size_t)(m_count * d),
         *y = g + es * (size_t)(m_count * two_i);
    int rc = proj_run(L->o, 1, o, m_count, L->k_o, a, f32, threads);
    if (!rc) rc = norm_rows(a, res, L->ln2, L->eps2, xn, new_res, m_count, d, f32);
    if (!rc) rc = proj_run(L->gu, L->n_gu, xn, m_count, d, g, f32, threads);
    if (!rc) {
        for (int64_t t = 0; t < m_count; t++) {
            if (f32) {
                const float *gt = (const float *)g + t * two_i;
                ops_silu_mul_row_f32(gt, gt + inter, (float *)y + t * inter, inter);
            } else {
                const uint16_t *gt = (const uint16_t *)g + t * two_i;
                ops_silu_mul_row(gt, gt + inter, (uint16_t *)y + t * inter, inter);
            }
        }
        rc = proj_run(L->down, 1, y, m_count, inter, out, f32, threads);
    }
    free(a);
    return rc;
}

/* An MoE layer's attention output to its MoE block's input: o [M, K_o], res [M, D] -> a = o times o;
 * xn [M, D] = RMSNorm(a + res) (ln2), new_res = bf16(a + res): the first half of llmsys_layer_mlp (the experts run
 * in one call of their own: moe_experts.c). 0, 1 bad arguments, 2 no memory. */
int llmsys_layer_post_attn(const llmsys_layer *L, const void *o, const void *res, void *xn, void *new_res,
                           int64_t m_count, int threads) {
    if (layer_check(L, m_count)) return 1;
    const int64_t d = L->d, f32 = L->f32 != 0;
    void *a = malloc((f32 ? 4 : 2) * (size_t)(m_count * d));
    int rc = a ? proj_run(L->o, 1, o, m_count, L->k_o, a, f32, threads) : 2;
    if (!rc) rc = norm_rows(a, res, L->ln2, L->eps2, xn, new_res, m_count, d, f32);
    free(a);
    return rc;
}
