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
    const llmsys_qw *gu;       /* gate | up: n_gu weights side by side */
    int64_t n_gu;
    const llmsys_qw *down;     /* one weight */
    int64_t f32;               /* 1: float32 activations, weights (WEIGHT_F32) and norm weights; 0: bf16 activations */
} llmsys_layer;

int llmsys_layer_attn_in(const llmsys_layer *L, const void *x, const void *res, void *out, void *new_res,
                         int64_t m_count, int threads);
int llmsys_layer_mlp(const llmsys_layer *L, const void *o, const void *res, void *out, void *new_res,
                     int64_t m_count, int threads);
#endif
