"""Live KV offload: a cold tier beyond the hot pool (llmsys.offload.kv_tier).

A sequence whose KV outgrows the hot blocks keeps running: full blocks move to
the cold tier (a file in the offload folder for a CPU pool) and attention reads
them back per layer. That must never change a single bit: greedy tokens and
logprobs (float32) equal an all-hot run's, alone, batched with chunked prefill,
and with prefix caching; Quest reads only the cold pages it selects.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmsys import LLM, SamplingParams
from llmsys.kernels.common.errors import InvalidParameterError
from llmsys.engine.kv_cache import BlockAllocator, KVCacheSpec, make_kv_pool
from llmsys.engine.scheduler import Scheduler, SchedulerOutput
from llmsys.engine.sequence import Sequence, SeqStatus
from llmsys.offload.kv_tier import KVTier, make_kv_tier
from tiny_models import random_kv_pool

LONG = "Once upon a time there was a little girl named Lily. She loved to play outside in the sun."
PROMPTS = ["Once upon a time", "The cat sat on the mat and looked at the big red ball", "Tom and Sue went to",
           "One day, a big dog ran into the park. It was happy and wanted to play with the kids."]


def _llm(model, **kw):
    kw.setdefault("max_num_batched_tokens", 32)
    return LLM(str(model), dtype="float32", progress=False, **kw)


def _outputs(llm, prompts, sp):
    return [(o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs]) for o in llm.generate(prompts, sp)]


def _tiered(model, tmp_path, hot, cold=2048, **kw):
    return _llm(model, kv_cache_tokens=hot, kv_offload_tokens=cold, offload_dir=str(tmp_path), **kw)


# -- end to end: bit-identical to an all-hot run ---------------------------------------------------


@pytest.mark.parametrize("inline_below", [None, 0])  # stories260k's reads are small (inline); 0: reader thread
def test_long_sequence_past_the_hot_blocks_is_bit_identical(stories_hf, tmp_path, inline_below, monkeypatch):
    if inline_below is not None:
        monkeypatch.setattr("llmsys.offload.kv_tier.INLINE_READ_BYTES", inline_below)
    sp = SamplingParams(temperature=0, max_tokens=380, ignore_eos=True, logprobs=3)
    ref = _outputs(_llm(stories_hf, kv_cache_tokens=1024), LONG, sp)
    llm = _tiered(stories_hf, tmp_path, hot=64)
    tier = llm.core.tier
    assert tier is not None and tier.tier == "disk" and llm.core.allocator.num_blocks == 5  # 4 hot + scratch
    assert _outputs(llm, LONG, sp) == ref
    st = tier.stats
    n_tokens = len(llm.encode(LONG)) + 380
    assert st.demoted_blocks >= n_tokens // 16 - 4  # everything but the last hot blocks went cold
    assert st.blocks_read > 0 and st.bytes_read == st.blocks_read * tier.layer_block_bytes
    if inline_below == 0:
        assert tier._pool is not None and st.read_s > 0  # the reads ran on the reader thread
    assert llm.core.allocator.num_used == 0 and llm.core.allocator.num_cold_used == 0  # all returned
    assert not list(tmp_path.iterdir())  # the cold file is unlinked: nothing left behind


def test_batch_with_chunked_prefill_and_continuous_batching_is_bit_identical(stories_hf, tmp_path):
    sps = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (60, 90, 40, 70)]

    def drive(llm):
        core, out, ids = llm.core, {}, []
        pending = list(zip(PROMPTS, sps))
        step = 0
        while pending or core.has_unfinished():
            if pending and step % 5 == 0:  # requests arrive while others decode
                p, sp = pending.pop(0)
                ids.append(core.add_request(llm.encode(p), sp))
            for ch in core.step():
                out.setdefault(ch.request_id, []).extend((t, lp.logprob) for t, lp in zip(ch.token_ids, ch.logprobs))
            step += 1
        return [out[i] for i in ids]

    ref = drive(_llm(stories_hf, kv_cache_tokens=2048))
    llm = _tiered(stories_hf, tmp_path, hot=128)
    assert drive(llm) == ref
    assert llm.core.tier.stats.demoted_blocks > 0
    assert llm.core.swap.stats.swap_outs == llm.core.swap.stats.recomputes == 0  # demoted, never preempted


def test_prefix_cache_finds_blocks_in_the_cold_tier(stories_hf, tmp_path):
    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, logprobs=2)
    prompt = LONG + " " + LONG
    follow = prompt + " Then she went home."

    def run(llm):
        a = _outputs(llm, prompt, sp)
        cold_cached = llm.core.allocator.num_cold_cached
        b = llm.generate(follow, sp)[0]
        return (a, b.token_ids, [lp.logprob for lp in b.logprobs], b.usage.cached_tokens), cold_cached

    ref, _ = run(_llm(stories_hf, kv_cache_tokens=2048))
    got, cold_cached = run(_tiered(stories_hf, tmp_path, hot=64))
    assert got == ref and ref[3] >= 32
    # The prompt's blocks went cold while it decoded (oldest first) and stayed findable there once
    # it finished, so the follow-up's hit was read from the cold tier.
    assert cold_cached >= ref[3] // 16


def test_chunks_are_capped_to_what_the_hot_pool_holds(stories_hf, tmp_path):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    prompt = " ".join([LONG] * 6)  # ~130 tokens, one 512-token chunk would need 9 hot blocks
    ref = _outputs(_llm(stories_hf, kv_cache_tokens=1024, max_num_batched_tokens=64), prompt, sp)
    llm = _tiered(stories_hf, tmp_path, hot=64, max_num_batched_tokens=512)
    assert _outputs(llm, prompt, sp) == ref  # chunks of 64 tokens, as the reference's budget makes them


def test_a_full_cold_tier_preempts_and_recomputes_with_identical_tokens(stories_hf, tmp_path):
    sp = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    ref = [o.token_ids for o in _llm(stories_hf, kv_cache_tokens=2048).generate(PROMPTS, sp)]
    llm = _tiered(stories_hf, tmp_path, hot=128, cold=64)
    assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == ref
    assert llm.core.swap.stats.recomputes + llm.core.swap.stats.swap_outs > 0
    assert llm.core.allocator.num_used == 0 and llm.core.allocator.num_cold_used == 0


def _logits_recorder(llm):
    rec = []
    run = llm.core.runner.execute

    def execute(sched, pooled=()):
        res = run(sched, pooled)
        rec.append(res.logits.clone())
        return res

    llm.core.runner.execute = execute
    return rec


def test_quest_reads_only_the_cold_pages_it_selects(stories_hf, tmp_path):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = " ".join([LONG] * 12)  # ~260 tokens: 17 pages, top 4 attended

    def run(llm):
        rec = _logits_recorder(llm)
        core = llm.core
        core.add_request(llm.encode(prompt), sp)
        marks = []
        while core.has_unfinished():
            core.step()
            if core.tier is not None and rec[-1].shape[0] and not marks:  # first token: decode steps follow
                marks = [core.tier.stats.blocks_read, core.kv_policy.quest.stats.cold_pages_read]
        return rec, marks

    ref, _ = run(_llm(stories_hf, kv_cache_tokens=1024, kv_policy="quest:4"))
    llm = _tiered(stories_hf, tmp_path, hot=64, kv_policy="quest:4")
    got, (read0, quest0) = run(llm)
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
    tier, qs = llm.core.tier, llm.core.kv_policy.quest.stats
    decode_reads = tier.stats.blocks_read - read0
    assert decode_reads == qs.cold_pages_read - quest0 > 0  # every decode read is a selected page
    layers, hk = llm.loaded.args.num_hidden_layers, llm.loaded.args.num_key_value_heads
    assert decode_reads <= 39 * layers * 4 * hk  # at most K pages per KV head, layer and step
    assert qs.cold_bytes_read == qs.cold_pages_read * tier.layer_block_bytes
    cold_blocks_each_step = (len(llm.encode(prompt)) - 64) // 16
    assert decode_reads < 39 * layers * cold_blocks_each_step  # far less than reading every cold page


# -- the engine around it ------------------------------------------------------------------------


def test_default_engine_has_no_cold_tier(stories_hf):
    llm = _llm(stories_hf, kv_cache_tokens=256)
    assert llm.core.tier is None and llm.core.allocator.num_cold == 0
    rep = llm.memory_report()
    assert set(rep.kv_total) == {"cpu"} and rep.kv_cold_blocks_total == 0


def test_memory_report_shows_hot_and_cold_blocks_per_tier(stories_hf, tmp_path):
    llm = _tiered(stories_hf, tmp_path, hot=64, cold=320)
    core = llm.core
    core.add_request(llm.encode(" ".join([LONG] * 6)), SamplingParams(temperature=0, max_tokens=20))
    for _ in range(4):
        core.step()
    rep = llm.memory_report()
    per_block = core.kv.spec.bytes_per_token * 16
    assert rep.kv_cold_blocks_total == 20 and rep.kv_cold_blocks_used == core.allocator.num_cold_used > 0
    assert rep.kv_total == {"cpu": core.kv.spec.nbytes, "disk": 20 * per_block}
    assert rep.kv_used == {"cpu": core.allocator.num_used * per_block, "disk": rep.kv_cold_blocks_used * per_block}
    assert rep.staging["cpu"] == core.tier.staging_bytes() == 2 * 20 * per_block // core.kv.spec.num_layers
    assert rep.kv_blocks_by_tier == {"cpu": (core.allocator.num_used, 4), "disk": (rep.kv_cold_blocks_used, 20)}
    from llmsys.engine.server.metrics import Metrics, parse_metrics
    from llmsys.engine.server.worker import EngineWorker

    worker = EngineWorker(core, Metrics(), 4, 4)  # not started: only its gauges are read
    worker._update_gauges()
    m = parse_metrics(worker.metrics.render())
    assert m['llmsys_kv_blocks_used{tier="cpu"}'] == core.allocator.num_used
    assert m['llmsys_kv_blocks_used{tier="disk"}'] == rep.kv_cold_blocks_used
    assert m["llmsys_kv_cold_blocks_total"] == 20 and m["llmsys_kv_blocks_total"] == 4


def test_max_model_len_counts_hot_and_cold_tokens(stories_hf, tmp_path):
    assert _llm(stories_hf, kv_cache_tokens=64).max_model_len == 64
    assert _tiered(stories_hf, tmp_path, hot=64, cold=300).max_model_len == 364


def test_unwritable_offload_folder_is_a_one_line_error(stories_hf, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(InvalidParameterError) as e:
        _tiered(stories_hf, blocker / "kv", hot=64)
    msg = str(e.value)
    assert "\n" not in msg and str(blocker / "kv") in msg and "--offload-dir" in msg


def test_flag_takes_tokens_or_a_size():
    from llmsys.engine.cli.options import build_engine_config

    assert build_engine_config("m", {"kv_offload_tokens": "4096"}).kv_offload_tokens == 4096
    cfg = build_engine_config("m", {"kv_offload_tokens": "1MiB"})
    assert cfg.offload_tokens(1024) == 1024
    assert build_engine_config("m", {}).offload_tokens(1024) == 0
    with pytest.raises(InvalidParameterError, match="cannot read memory size 'lots'"):
        build_engine_config("m", {"kv_offload_tokens": "lots"})


def test_negative_offload_tokens_is_an_error():
    from llmsys.engine.config import EngineConfig

    with pytest.raises(InvalidParameterError, match="kv_offload_tokens must be >= 0, got -5"):
        EngineConfig(model="m", kv_offload_tokens=-5)


def test_quantized_pool_refuses_a_cold_tier():
    spec = KVCacheSpec(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                       kv_dtype="int8")
    with pytest.raises(InvalidParameterError, match="needs a float KV pool"):
        make_kv_tier(make_kv_pool(spec, torch.device("cpu")), 64, None)


# -- units: the tier's copies, the allocator, the scheduler's choice -----------------------------


@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_demoted_blocks_read_back_exactly_per_layer(where, tmp_path):
    kv = random_kv_pool()
    tier = KVTier(kv, 5, tmp_path, tier=where)
    first = tier.first
    tier.demote([(1, first + 3), (2, first + 0), (4, first + 1), (5, first + 3)])  # cold 3 reused: last write wins
    want = {first: 2, first + 1: 4, first + 3: 5}
    cold = tier.cold_blocks(sorted(want))
    tier.begin_step()
    for layer in range(3):
        for cache, kind in ((kv.k[layer], 0), (kv.v[layer], 1)):
            rows = tier.rows(cache)
            for j, c in enumerate(cold.ids.tolist()):
                got = rows[j * 4 : j * 4 + 4]  # staged block j: rows j * bs ..
                assert torch.equal(got, cache[want[c]])
    tier.end_step()
    assert tier.stats.blocks_read == 3 * 3 and tier.stats.demoted_blocks == 3
    k_rows, v_rows = tier.read(kv.k[2], [first + 3])  # Quest: just one page of one layer
    assert torch.equal(k_rows[:4], kv.k[2][5]) and torch.equal(v_rows[:4], kv.v[2][5])
    tier.close()


@pytest.mark.parametrize("inline_below", [None, 0])  # read inline, or on the reader thread
def test_a_short_read_of_the_cold_file_names_the_layer_and_block(tmp_path, inline_below, monkeypatch):
    import os

    if inline_below is not None:
        monkeypatch.setattr("llmsys.offload.kv_tier.INLINE_READ_BYTES", inline_below)
    kv = random_kv_pool()
    tier = KVTier(kv, 2, tmp_path, tier="disk")
    tier.demote([(1, tier.first)])
    os.ftruncate(tier._fd, 0)
    tier.cold_blocks([tier.first])
    with pytest.raises(OSError, match=f"short read of layer 0 block {tier.first}"):
        tier.begin_step()  # an inline read fails here, a threaded one when attention waits for it
        tier.rows(kv.k[0])
    tier.end_step()  # the failed read is not raised twice
    tier.close()


def test_allocator_demotion_moves_references_and_prefix_registrations():
    a = BlockAllocator(4, num_cold=2)  # hot 1..3, cold 4..5
    b1, b2, b3 = a.allocate(3)
    a.register(b1, b"k1")
    c = a.demote(b1)
    assert c == 4 and a.is_cold(c) and a.refs(c) == 1 and a.refs(b1) == 0
    assert a.num_free == 1 and a.num_cold_used == 1
    assert a.lookup([b"k1"]) == [c] and a.refs(c) == 2  # the prefix is found under its cold id
    a.free([c])
    a.free([c])  # last reference: a registered cold block stays findable
    assert a.num_cold_cached == 1 and a.num_cold_used == 0
    assert a.demote(b2) == 5
    assert a.demote(b3) == 4 and a.lookup([b"k1"]) == []  # the cached cold block was reused: unregistered
    b4 = a.allocate(1)[0]
    assert a.demote(b4) is None  # cold tier full
    with pytest.raises(ValueError):
        a.demote(5)  # already cold


def _running(sched, n_tokens, arrival, table):
    s = Sequence(f"r{arrival}", list(range(n_tokens)), SamplingParams(), 1000, arrival=arrival)
    s.output_ids = [0]
    s.num_computed = n_tokens
    s.block_table = table
    s.status = SeqStatus.RUNNING
    sched.running.append(s)
    return s


def test_scheduler_demotes_oldest_positions_first_never_open_or_shared_blocks():
    alloc = BlockAllocator(9, num_cold=16)  # 8 hot blocks
    # a stand-in tier: the scheduler only lists the moves, and asks whether the tier still takes blocks
    sched = Scheduler(alloc, 4, 8, 64, tier=SimpleNamespace(accepts_demotions=True))
    a = _running(sched, 12, 1.0, alloc.allocate(4))  # 3 full blocks + the open one
    b = _running(sched, 11, 2.0, alloc.allocate(3))  # 2 full blocks + the open one
    c = _running(sched, 3, 3.0, alloc.allocate(1))
    shared = a.block_table[0]
    alloc.register(shared, b"p")
    alloc.lookup([b"p"])  # a block shared with another sequence stays hot
    assert alloc.num_free == 0
    out = sched.schedule()  # every decode fits its open block
    assert [s.request_id for s in out.scheduled] == [a.request_id, b.request_id, c.request_id] and not out.demote
    c.output_ids.append(0)
    c.num_computed = 4  # c's next token opens a block: one hot block must go cold first
    out = sched.schedule()
    assert len(out.demote) == 1 and not out.preempted
    hot, cold = out.demote[0]
    assert b.block_table[0] == cold and alloc.is_cold(cold)  # position 0 of b (a's position 0 is shared)
    assert c.block_table == [c.block_table[0], hot]  # the freed hot block holds c's new token
    out = SchedulerOutput()
    sched._demote(10, c, out)
    assert len(out.demote) == 4  # positions 0 (c), 1 (a, b), 2 (a); never an open block
    assert [alloc.is_cold(x) for x in a.block_table] == [False, True, True, False]
    assert [alloc.is_cold(x) for x in b.block_table] == [True, True, False]
    assert [alloc.is_cold(x) for x in c.block_table] == [True, False]
    assert [p[0] for p in out.demote][0] not in c.block_table  # c's position-0 block went first


class _Staged:
    """A stand-in reader: every cold block's rows, staged in ``ids`` order (block j at rows j * bs ..)."""

    def __init__(self, k: torch.Tensor, ids: list[int], first: int):
        self.rows_ = torch.cat([k[c - first] for c in ids])  # k: [C, bs, Hk, D] cold blocks

    def rows(self, cache):
        return self.rows_


@pytest.mark.parametrize("max_runs", [64, 1])  # slice copies per run, or one index_copy_ (many runs)
def test_gather_plan_reads_cold_positions_from_staging(max_runs, monkeypatch):
    from llmsys.kernels import cpu_attention as ca

    monkeypatch.setattr(ca, "MAX_COLD_RUNS", max_runs)
    g = torch.Generator().manual_seed(1)
    bs, hot, n_cold = 4, 6, 5
    pool = torch.randn(hot, bs, 2, 8, generator=g)
    cold = torch.randn(n_cold, bs, 2, 8, generator=g)
    everything = torch.cat([pool, cold])  # block ids as the tables use them: hot 0..5, cold 6..10
    tables = [[6, 1, 7, 2, 8], [3, 9, 4], [10]]  # cold blocks between hot ones, several sequences
    ctx, qlens = [19, 12, 3], [1, 2, 1]
    ids = sorted({b for t in tables for b in t if b >= hot})
    cb = ca.ColdBlocks(hot, torch.tensor(ids), _Staged(cold, ids, hot), bs)
    plan = ca.make_gather_plan(qlens, ctx, tables, bs, torch.device("cpu"), cb)
    ref = ca.make_gather_plan(qlens, ctx, tables, bs, torch.device("cpu"))
    assert (plan.cold_runs is None) == (max_runs == 1)
    assert torch.equal(ca.gather_rows(pool, plan), ca.gather_rows(everything, ref))
    for sub, sub_ref in zip(plan.split[::2], ref.split[::2]):  # the decode and prompt-chunk batches too
        assert torch.equal(ca.gather_rows(pool, sub), ca.gather_rows(everything, sub_ref))
