"""Swap space for preempted sequences (llmsys.offload.kv_swap).

Preemption must never change a greedy answer, whether the victim's KV is
swapped out and back or recomputed; the swap copies must be exact; and the
swap-vs-recompute choice must follow the measured costs.
"""

from __future__ import annotations

import pytest
import torch

from llmsys import LLM, SamplingParams
from llmsys.engine.kv_cache import KVCacheSpec, make_kv_pool
from llmsys.offload.kv_swap import KVSwapSpace, make_swap_space
from tiny_models import random_kv_pool

PROMPTS = ["Once upon a time", "The cat sat", "Tom and Sue went to", "One day, a big dog"]
SP = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    from conftest import STORIES_HF, need_shared

    stories_hf = need_shared(STORIES_HF)
    big = LLM(str(stories_hf), dtype="float32", progress=False, kv_cache_tokens=4096, swap_space=0)
    return [o.token_ids for o in big.generate(PROMPTS, SP)]


def _small(stories_hf, tmp_path, **kw):
    # 160 tokens for 4 sequences of up to ~70 tokens: preemption is certain.
    return LLM(str(stories_hf), dtype="float32", progress=False, kv_cache_tokens=160, block_size=8,
               offload_dir=str(tmp_path), **kw)


def test_preempted_sequences_swap_out_and_back_with_identical_tokens(stories_hf, reference, tmp_path):
    llm = _small(stories_hf, tmp_path)
    sw = llm.core.swap
    assert sw is not None and sw.tier == "disk"  # a CPU pool swaps to a file in the offload folder
    out = llm.generate(PROMPTS, SP)
    assert [o.token_ids for o in out] == reference
    st = sw.stats
    assert st.swap_outs > 0 and st.recomputes == 0
    assert st.swapped_out_blocks == st.swapped_in_blocks > 0
    assert llm.core.allocator.num_used == 0 and sw.num_used == 0
    rep = llm.memory_report()
    assert rep.kv_swap_total == {"disk": sw.nbytes()} and rep.kv_swap_used == {"disk": 0}
    assert not list(tmp_path.iterdir())  # the swap file is unlinked: nothing left behind


def test_swap_off_recomputes_with_identical_tokens(stories_hf, reference, tmp_path):
    llm = _small(stories_hf, tmp_path, swap_space=0)
    assert llm.core.swap is None
    assert [o.token_ids for o in llm.generate(PROMPTS, SP)] == reference


def test_full_swap_space_falls_back_to_recompute(stories_hf, reference, tmp_path):
    llm = _small(stories_hf, tmp_path)
    chunk = llm.core.swap.chunk_bytes
    llm = _small(stories_hf, tmp_path, swap_space=chunk)  # room for one block: most victims recompute
    assert llm.core.swap.num_blocks == 1
    assert [o.token_ids for o in llm.generate(PROMPTS, SP)] == reference
    assert llm.core.swap.stats.recomputes > 0


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_copy_out_then_in_is_exact_for_every_layer(tier, tmp_path):
    kv = random_kv_pool()
    before_k = [t.clone() for t in kv.k]
    before_v = [t.clone() for t in kv.v]
    sw = KVSwapSpace(kv, 4, tmp_path, tier=tier)
    ids = sw.allocate(2)
    sw.copy_out([(1, ids[0]), (3, ids[1])])
    for t in kv.k + kv.v:
        t.zero_()
    sw.copy_in([(ids[1], 5), (ids[0], 2)])  # back into different pool blocks
    for layer in range(3):
        assert torch.equal(kv.k[layer][2], before_k[layer][1]) and torch.equal(kv.v[layer][2], before_v[layer][1])
        assert torch.equal(kv.k[layer][5], before_k[layer][3]) and torch.equal(kv.v[layer][5], before_v[layer][3])
        assert torch.count_nonzero(kv.k[layer][[0, 1, 3, 4]]) == 0  # nothing else written
    assert sw.stats.bytes_moved == 4 * sw.chunk_bytes
    assert sw.gbps is not None and sw.gbps > 0  # the copy speed is measured, not assumed
    sw.close()


def test_swap_blocks_freed_by_a_swap_in_wait_for_the_next_step():
    sw = KVSwapSpace(random_kv_pool(), 2)
    ids = sw.allocate(2)
    assert sw.allocate(1) is None
    sw.release(ids)  # copied in by the runner later this step
    assert sw.allocate(1) is None and sw.num_used == 0
    sw.end_step()
    assert sorted(sw.allocate(2)) == sorted(ids)


def test_prefer_swap_follows_the_measured_costs():
    sw = KVSwapSpace(random_kv_pool(), 4, tier="disk")
    assert sw.prefer_swap(2, 8)  # nothing measured yet: keep the computed work
    assert not sw.prefer_swap(5, 20)  # more blocks than the swap space has
    assert not sw.prefer_swap(0, 0)
    sw.gbps = 1.0  # 1 GB/s: moving 2 blocks out and back takes 4 * chunk_bytes ns
    swap_s = sw.swap_seconds(2)
    sw.observe_prefill(seconds=swap_s / 8 * 10, tokens=1)  # recomputing 8 tokens: 10x slower than swapping
    assert sw.prefer_swap(2, 8)
    sw.recompute_s_per_token = None
    sw.observe_prefill(seconds=swap_s / 8 / 10, tokens=1)  # recomputing: 10x faster than swapping
    assert not sw.prefer_swap(2, 8)


def test_quantized_pools_and_zero_budget_have_no_swap_space():
    spec = KVCacheSpec(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                       kv_dtype="int8")
    assert make_swap_space(make_kv_pool(spec, torch.device("cpu")), None, None) is None
    assert make_swap_space(random_kv_pool(), 0, None) is None
    auto = make_swap_space(random_kv_pool(num_blocks=6), None, None)
    assert auto.num_blocks == 6  # auto: as many blocks as the pool


def test_unknown_tier_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="swap tier must be 'cpu' or 'disk', got 'nvme'"):
        KVSwapSpace(random_kv_pool(), 2, tier="nvme")


def test_a_short_read_of_the_swap_file_names_the_block(tmp_path):
    import os

    sw = KVSwapSpace(random_kv_pool(), 2, tmp_path, tier="disk")
    (j,) = sw.allocate(1)
    sw.copy_out([(1, j)])
    os.ftruncate(sw._fd, 0)  # the file lost its data (disk full, someone truncated it)
    with pytest.raises(OSError, match=f"short read of block {j}"):
        sw.copy_in([(j, 2)])
    sw.close()


def test_swap_space_flag_reads_sizes_and_rejects_garbage():
    from llmsys.engine.cli.options import build_engine_config
    from llmsys.kernels.common.errors import InvalidParameterError

    assert build_engine_config("m", {"swap_space": "2GiB"}).swap_space == 2 << 30
    assert build_engine_config("m", {"swap_space": "0"}).swap_space == 0
    with pytest.raises(InvalidParameterError, match="cannot read memory size 'lots'"):
        build_engine_config("m", {"swap_space": "lots"})
