"""The KV pool costs resident memory for the blocks in use, not for its capacity."""

from __future__ import annotations

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
