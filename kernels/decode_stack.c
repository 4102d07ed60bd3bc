/* The decode stack.
 *
 * A decode step's decoder layers in one call: per layer llmsys_layer_attn_in, then RoPE + the K/V store +
 * decode attention (cpu_decode.c's llmsys_rope_store_attend_bf16 / _f32, called directly: one library),
 * then llmsys_layer_mlp. The same calls in the same order on the same
 * arguments as the Python loop over DecoderLayer._forward_fused, so the same bits (tests/test_fused_decode.py
 * checks both against the op-by-op decoder). Why: that loop spent ~50 us of Python and ctypes per layer
 * around ~150 us of kernels (SmolLM2-135M int4, 30 layers: ~1.5 ms of a ~7 ms step, profile_decode.py). */
#include <stdlib.h>

#include "cpu_decode.h"
#include "fused_layer.h"

typedef struct {
    const llmsys_layer *layer; /* the layer's fused decode arguments */
    void *k_pool, *v_pool;     /* its K/V pools, [n_slots, Hk, D] in the activations' dtype */
    int64_t table, tables;     /* it rotates with table `table` of the `tables` stacked in the RoPE cache */
    int64_t hq, hk, hd;        /* heads of q and of k/v, head dim */
    float scale;               /* attention's softmax scale */
} llmsys_stack_layer;

typedef struct {
    const llmsys_stack_layer *layers;
    int64_t n_layers;
    const int64_t *positions;      /* [M] RoPE rows of the step's tokens in the first table */
    const int64_t *slot_mapping;   /* [M] pool slot of each new token */
    int64_t n_slots;
    const float *cache;            /* the RoPE table [max_pos, rotary dim] */
    int64_t max_pos;
    const int64_t *gather_slots;   /* [M, l_max] context slots of each token */
    const int64_t *lens;           /* [M] context lengths */
    int64_t l_max;
} llmsys_stack;

/* h [M, D]: the embeddings -> out [M, D] the last layer's MLP output, res [M, D] its residual (the model's
 * hidden state is out + res, normed by the caller); bf16, or float32 when the layers are (f32). 0; 1 bad
 * arguments; 2 no memory; 100 * (layer + 1) + the attention's code when it rejects a layer's step. */
int llmsys_decode_stack(const llmsys_stack *S, const void *h, void *out, void *res, int64_t m_count, int threads) {
    if (!S || S->n_layers < 1 || m_count <= 0) return 1;
    const int64_t d = S->layers[0].layer->d, f32 = S->layers[0].layer->f32;
    const size_t es = f32 ? 4 : 2;
    int64_t qkv_max = 0, o_max = 0;
    for (int64_t i = 0; i < S->n_layers; i++) {
        const llmsys_stack_layer *s = &S->layers[i];
        if (s->layer->d != d || s->layer->f32 != f32 || s->layer->k_o != s->hq * s->hd || s->tables < 1
            || s->table < 0 || s->table >= s->tables)
            return 1;
        int64_t rows = 0;
        for (int64_t j = 0; j < s->layer->n_qkv; j++) rows += s->layer->qkv[j].n;
        if (rows != (s->hq + 2 * s->hk) * s->hd) return 1;
        if (rows > qkv_max) qkv_max = rows;
        if (s->hq * s->hd > o_max) o_max = s->hq * s->hd;
    }
    /* qkv, attention output, one hidden state and two residuals used in turn: no call writes what it reads */
    char *buf = malloc(es * (size_t)(m_count * (qkv_max + o_max + 3 * d)));
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)m_count); /* a later table's rows */
    if (!buf || !pos) { free(buf); free(pos); return 2; }
    int64_t pos_table = -1;
    char *qkv = buf, *o = qkv + es * (size_t)(m_count * qkv_max), *hb = o + es * (size_t)(m_count * o_max);
    char *rs[2] = {hb + es * (size_t)(m_count * d), hb + 2 * es * (size_t)(m_count * d)};
    const void *x = h, *r = NULL;
    int rc = 0;
    for (int64_t i = 0; i < S->n_layers; i++) {
        const llmsys_stack_layer *s = &S->layers[i];
        const int last = i == S->n_layers - 1;
        char *r_in = r == rs[0] ? rs[1] : rs[0]; /* never the residual it reads */
        void *r_out = last ? res : (r_in == rs[0] ? rs[1] : rs[0]), *h_out = last ? out : hb;
        rc = llmsys_layer_attn_in(s->layer, x, r, qkv, r_in, m_count, threads);
        if (rc) break;
        r = r ? r_in : x; /* layer 0: the residual is the embeddings themselves (attn_in does not write it) */
        const int64_t rows = (s->hq + 2 * s->hk) * s->hd;
        if (s->table && s->table != pos_table) { /* Attention.rope_positions: + table * rows per table */
            for (int64_t t = 0; t < m_count; t++) pos[t] = S->positions[t] + s->table * (S->max_pos / s->tables);
            pos_table = s->table;
        }
        const int64_t *p = s->table ? pos : S->positions;
        rc = f32 ? llmsys_rope_store_attend_f32(qkv, rows, s->k_pool, s->v_pool, S->slot_mapping, S->n_slots, p, S->cache,
                                                S->max_pos, m_count, s->hq, s->hk, s->hd, S->gather_slots, S->lens,
                                                S->l_max, s->scale, o, threads)
                 : llmsys_rope_store_attend_bf16(qkv, rows, s->k_pool, s->v_pool, S->slot_mapping, S->n_slots, p,
                                                 S->cache, S->max_pos, m_count, s->hq, s->hk, s->hd, S->gather_slots,
                                                 S->lens, S->l_max, s->scale, o, threads);
        if (rc) { rc += 100 * (int)(i + 1); break; }
        rc = llmsys_layer_mlp(s->layer, o, r, h_out, r_out, m_count, threads);
        if (rc) break;
        x = h_out;
        r = r_out;
    }
    free(buf);
    free(pos);
    return rc;
}
