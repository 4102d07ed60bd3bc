/* cpu_decode.c's entry points that other kernel sources call directly (the decode stack: decode_stack.c). */
#ifndef LLMSYS_CPU_DECODE_H
#define LLMSYS_CPU_DECODE_H
#include <stdint.h>

/* RoPE on q and k, the K/V store, then decode attention, on bf16 (_bf16) or float32 (_f32) activations and
 * pools: 0, or the attention's error code (cpu_decode.c). */
int llmsys_rope_store_attend_bf16(const void *qkv, int64_t ld, void *k_pool, void *v_pool, const int64_t *slot_mapping,
                                  int64_t n_slots, const int64_t *pos, const float *cache, int64_t max_pos,
                                  int64_t t_count, int64_t hq, int64_t hk, int64_t d, const int64_t *gather_slots,
                                  const int64_t *lens, int64_t l_max, float scale, void *out, int threads);
int llmsys_rope_store_attend_f32(const void *qkv, int64_t ld, void *k_pool, void *v_pool, const int64_t *slot_mapping,
                                 int64_t n_slots, const int64_t *pos, const float *cache, int64_t max_pos,
                                 int64_t t_count, int64_t hq, int64_t hk, int64_t d, const int64_t *gather_slots,
                                 const int64_t *lens, int64_t l_max, float scale, void *out, int threads);
#endif
