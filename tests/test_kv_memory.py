"""The KV pool costs resident memory for the blocks in use, not for its capacity."""

from __future__ import annotations

import math

import pytest
import torch

from llmsys.engine.kv_cache import KVCacheSpec, make_kv_pool
from llmsys.kernels.common.memory import zeros_on_demand


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_zeros_on_demand_is_zeros_and_writable():
    for shape in [(3, 5), (1024, 1024)]:  # plain allocation below 1 MiB, a mapping above
        t = zeros_on_demand(shape, torch.bfloat16)
        assert t.shape == shape and t.dtype == torch.bfloat16
        assert torch.equal(t, torch.zeros(shape, dtype=torch.bfloat16))
        t[1, 2] = 7
        assert t[1, 2].item() == 7 and t.sum().item() == 7


def test_pool_resident_memory_follows_blocks_in_use():
    # 4 layers x K,V x 4096 blocks x 16 tokens x 4 heads x 64 dims x 2 bytes = 512 MiB reserved
    spec = KVCacheSpec(num_layers=4, num_blocks=4096, block_size=16, num_kv_heads=4, head_dim=64,
                       dtype=torch.bfloat16)
    for kv_dtype in ("auto", "int8", "int4"):
        before = _rss_bytes()
        pool = make_kv_pool(KVCacheSpec(**{**spec.__dict__, "kv_dtype": kv_dtype}), torch.device("cpu"))
        assert pool.nbytes() >= 64 << 20
        k = torch.randn(32, 4, 64).to(torch.bfloat16)
        for layer in range(4):
            pool.store(layer, k, k, torch.arange(16, 48))  # blocks 1 and 2
        grown = _rss_bytes() - before
        assert grown < 32 << 20, f"{kv_dtype}: {grown >> 20} MiB resident for 2 blocks of a {pool.nbytes() >> 20} MiB pool"
        del pool


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4"])
def test_the_planners_kv_bytes_per_token_are_the_pools(kv_dtype):
    """The offload planner sizes KV with the pool's own formula, ``--kv-dtype`` included (it once
    counted every pool at the model's dtype: an int8 pool planned at twice its size)."""
    from llmsys.engine.builder import kv_probe
    from llmsys.engine.cli.plan_cmd import meta_model
    from llmsys.engine.config import EngineConfig
    from llmsys.offload.bandwidth import Bandwidths
    from llmsys.offload.budgets import Budgets
    from llmsys.offload.plan import Workload
    from llmsys.offload.prepare import plan_for

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    meta = meta_model(cfg)
    config = EngineConfig(model="unused", kv_dtype=kv_dtype, block_size=16)
    spec = kv_probe(meta.args, config, torch.bfloat16)  # the spec the engine's pool is built from
    bw = Bandwidths(mem_gbps=10.0, disk_read_gbps=1.0, cpu_gflops={"bfloat16": 50.0})
    plan, shape = plan_for(meta, torch.bfloat16, Budgets(1 << 30, None, None, True), Workload(kv_tokens=1000),
                           bandwidths=bw, kv_dtype=kv_dtype, block_size=16)
    want = {"auto": 2 * 2 * 64 * 2, "int8": 2 * 2 * (64 + 4), "int4": 2 * 2 * 64 // 2 + 4 * 2 * 64 / 16 + 4 * 2}[kv_dtype]
    assert shape.kv_bytes_per_token_layer == spec.layer_bytes_per_token == want
    assert plan.kv_bytes == math.ceil(1000 * want * 3)
    if kv_dtype != "int4":  # (the int4 pool also keeps a full-precision window of the open block)
        pool = make_kv_pool(KVCacheSpec(3, 8, 16, 2, 64, torch.bfloat16, kv_dtype), torch.device("cpu"))
        assert pool.nbytes() == want * 8 * 16 * 3
