/* The fused decode layers' arguments (kernels/cpu_qgemv.py DecodeWeight, DecodeLayer): fused_layer.c runs
 * them, decode_stack.c chains them. */
#ifndef LLMSYS_FUSED_LAYER_H
#define LLMSYS_FUSED_LAYER_H
#include <stdint.h>

/* A weight's format (kernels/cpu_qgemv.py WeightKind, the same values). */
enum weight_kind {
    WEIGHT_INT8 = 0,       /* int8 codes [N, K], bf16 scales [N] */
    WEIGHT_INT4 = 1,       /* int4 in the CPU tiling (zeros and scales, offsets, or Q4_K's stored scales) */
    WEIGHT_BF16 = 2,       /* bf16 [N, K] (rows kp elements apart) */
    WEIGHT_INT8_BLOCK = 3, /* int8 codes [N, K], fp16 block scales [nb, s_g] (group-major, one per 32 columns) */
    WEIGHT_INT8_Q6K = 4,   /* int8 codes [N, K], GGUF Q6_K's scales as stored: int8 sc per 16 columns (ksc
                              [K / 16, s_g]) times fp16 d per 256 (kd [K / 256, s_g]) */
    WEIGHT_INT8_Q5K = 5,   /* int8 codes [N, K], float32 scales and offsets (offs) [K / 32, s_g] (GGUF Q5_K) */
    WEIGHT_F32 = 6,        /* float32 [N, K] (rows kp elements apart; x and out float32, bias float32) */
};

typedef struct {
    int64_t kind;          /* enum weight_kind */
    int64_t n, k, kp, gs;  /* rows, columns; int4: padded columns Kp = G * gs and the group size */
    const void *q;         /* the codes (bf16: the weight, rows of kp elements apart) */
    const void *scales;    /* int4: scales at [n * s_n + g * s_g] of scale_kind (enum scale_kind) */
    int64_t s_n, s_g, scale_kind;
    const uint8_t *zeros;  /* int4: zero points at [n * z_n + g * z_g] */
    int64_t z_n, z_g;
    const void *bias;      /* bf16 [N] (float32 for WEIGHT_F32), or NULL */
    const float *offs;     /* int4: float32 offsets at [n * o_n + g * o_g] (int4_meta.offs), or NULL */
    int64_t o_n, o_g;
    const uint8_t *ksc, *km; /* int4: GGUF Q4_K's scales as stored (int4_meta.ksc ..; scales, zeros unused), or NULL */
    const uint16_t *kd, *kdm;
    int64_t k_n;
} llmsys_qw;


#define QW_MAX 4 /* weights per projection */

/* One decoder layer's fixed arguments (built once per bound weights, kernels/cpu_qgemv.py DecodeLayer). */
typedef struct {
    const void *ln1, *ln2;     /* input and post-attention RMSNorm weights, [D] in the activations' dtype */
    float eps1, eps2;
    int64_t d, k_o;            /* hidden size; o_proj's input size (Hq D) */
    const llmsys_qw *qkv;      /* q | k | v: n_qkv weights side by side */
    int64_t n_qkv;
    const llmsys_qw *o;        /* one weight */
    const llmsys_qw *gu;       /* gate | up: n_gu weights side by side (NULL, and down NULL: an MoE layer's) */
    int64_t n_gu;
    const llmsys_qw *down;     /* one weight */
    int64_t f32;               /* 1: float32 activations, weights (WEIGHT_F32) and norm weights; 0: bf16 activations */
} llmsys_layer;

/* An MoE layer's routed experts (kernels/cpu_qgemv.py MoEExperts): moe_experts.c runs them. */
/* the experts' gate activation (cpu_ops.h's rows): SwiGLU, or gpt-oss's clamped SwiGLU (alpha, limit) */
enum moe_act { MOE_SILU = 0, MOE_CLAMPED_SWIGLU = 1 };
typedef struct {
    const llmsys_qw *gu;   /* [n_experts * n_gu]: expert e's gate | up weights side by side at gu[e * n_gu ..] */
    int64_t n_gu;
    const llmsys_qw *down; /* [n_experts] */
    int64_t n_experts, d, inter; /* experts, hidden size, each expert's intermediate size */
    int64_t act;           /* enum moe_act */
    int64_t f32;           /* 1: float32 activations and weights (WEIGHT_F32); 0: bf16 activations */
    int64_t max_rows;      /* an expert with more rows of a step is left to the caller (its weights' own forward) */
    float alpha, limit;    /* MOE_CLAMPED_SWIGLU's */
} llmsys_moe;

int llmsys_moe_experts(const llmsys_moe *M, const void *x, int64_t t_count, const int64_t *chosen, int64_t top_k,
                       const void *w, int w_f32, void *rows_out, void *out, int64_t *counts, int threads);

#ifdef LLMSYS_GEMV_COMMON_H /* what fused_layer.c shares with the other GEMV sources (moe_experts.c) */
/* x's a8 block count for w */
QG_HIDDEN int64_t qw_nb(const llmsys_qw *w);
/* 1 when w reads x as it is (bf16, float32), not as a8 blocks */
QG_HIDDEN int qw_plain(const llmsys_qw *w);
/* rows of one work item of w */
QG_HIDDEN int64_t qw_step(const llmsys_qw *w);
/* 0 when w is a weight of k columns the a8 GEMVs take, else 1 */
QG_HIDDEN int qw_check(const llmsys_qw *w, int64_t k);
/* work item `it` of w (rows [qw_step it, ..)) against m_count rows of x (a: its a8 blocks; xs: its lane pairs in the
   AVX512-BF16 build) -> out[m * ldo + n], bias added */
QG_HIDDEN void qw_item(const llmsys_qw *w, const a8_x *a, const void *xv, const uint32_t *xs, int64_t m_count,
                       int64_t it, void *outv, int64_t ldo);
#endif

int llmsys_layer_attn_in(const llmsys_layer *L, const void *x, const void *res, void *out, void *new_res,
                         int64_t m_count, int threads);
int llmsys_layer_post_attn(const llmsys_layer *L, const void *o, const void *res, void *xn, void *new_res,
                           int64_t m_count, int threads);
int llmsys_layer_mlp(const llmsys_layer *L, const void *o, const void *res, void *out, void *new_res,
                     int64_t m_count, int threads);
#endif
