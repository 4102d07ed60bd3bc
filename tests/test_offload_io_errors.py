"""One I/O error must not fail every in-flight request (issue #23, part 2).

A full offload disk is simulated by making the write function of the swap
space (``offload.kv_swap.write_block``) or of the cold KV tier
(``offload.kv_tier.write_at``) raise ``ENOSPC`` after ``N`` writes. Then:
requests that never needed the failed write finish with exactly a plain run's
tokens; a sequence whose swap-out failed is re-prefilled (the same greedy
tokens); blocks whose demotion failed are kept in RAM (the same tokens), the
tier takes no more demotions, and only a request that no longer fits the hot
pool ends with ``finish_reason == "error"`` and a one-line ``error``; the
engine then serves a new request as before. The tier and the swap space
retry after a backoff (tests/test_fault_recovery.py); the tests here whose
disk recovers (a failed read, the writes still work) freeze the retry clock,
so what they check is the state before any retry.

A failing read (``offload.kv_swap.read_block``, ``offload.kv_tier.pread_full``
raising EIO) loses only the blocks it could not read: the sequences holding
them are re-prefilled (the same greedy tokens), the others run on. A step
that raises for another reason (a kernel fault) is retried one sequence at a
time, so only the request whose step fails alone ends with an error; so does
a request whose output constraint raises.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch
from llmsys import LLM, SamplingParams
from llmsys.offload import kv_swap, kv_tier
from llmsys.offload.kv_swap import KVSwapSpace
from llmsys.offload.kv_tier import KVTier
from tiny_models import random_kv_pool

PROMPTS = ["Once upon a time", "The cat sat", "Tom and Sue went to", "One day, a big dog"]
LATER = "Lily had a red ball"
LONG = "Once upon a time there was a little girl named Lily. She loved to play outside in the sun."
SP = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


def _disk_full_after(monkeypatch, module, name: str, writes: int, err: int = errno.ENOSPC) -> list[int]:
    """Let ``writes`` calls of ``module.name`` through, then raise ``err`` (ENOSPC: a full disk; EIO:
    a failing one); returns [calls so far]."""
    real, calls = getattr(module, name), [0]

    def write(*args):
        calls[0] += 1
        if calls[0] > writes:
            raise OSError(err, os.strerror(err))
        return real(*args)

    monkeypatch.setattr(module, name, write)
    return calls


def _drive(llm, prompts, sp):
    """Run every prompt through the core; per request: (tokens, finish_reason, error)."""
    core = llm.core
    ids = [core.add_request(llm.encode(p), s) for p, s in zip(prompts, sp)]
    toks = {rid: [] for rid in ids}
    final = {}
    while len(final) < len(ids):
        for ch in core.step():
            toks[ch.request_id].extend(ch.token_ids)
            if ch.finished:
                final[ch.request_id] = (ch.finish_reason, ch.error)
    return [(toks[rid], *final[rid]) for rid in ids]


@pytest.fixture(scope="module")
def plain():
    """Greedy tokens of an engine with room for everything (no swap, no tier): the reference."""
    from conftest import STORIES_HF, need_shared

    llm = LLM(str(need_shared(STORIES_HF)), dtype="float32", progress=False, kv_cache_tokens=2048, swap_space=0,
              max_num_batched_tokens=32)
    sps = [SP] * len(PROMPTS) + [SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)]
    runs = [o.token_ids for o in llm.generate([*PROMPTS, LONG], sps)]
    return {"prompts": runs[:4], "long": runs[4], "later": llm.generate(LATER, SP)[0].token_ids}


# -- the swap space: a failed swap-out recomputes ------------------------------------------------


@pytest.mark.parametrize("writes", [0, 3])  # the first write fails / a few blocks are written first
def test_a_failed_swap_out_recomputes_with_the_same_tokens(stories_hf, tmp_path, monkeypatch, plain, writes):
    llm = LLM(str(stories_hf), dtype="float32", progress=False, kv_cache_tokens=160, block_size=8,
              offload_dir=str(tmp_path))
    sw = llm.core.swap
    calls = _disk_full_after(monkeypatch, kv_swap, "write_block", writes)
    out = llm.generate(PROMPTS, SP)
    assert [o.token_ids for o in out] == plain["prompts"]
    assert {o.finish_reason for o in out} == {"length"}
    assert calls[0] > writes  # a write did fail
    assert sw.write_error is not None and "No space left on device" in sw.write_error
    assert sw.stats.lost_swap_outs >= 1 and sw.stats.swapped_out_blocks == writes
    assert not sw.prefer_swap(1, 1000)  # no more swap-outs: later preemptions recompute directly
    assert llm.core.allocator.num_used == 0 and sw.num_used == 0
    assert llm.generate(LATER, SP)[0].token_ids == plain["later"]  # the engine goes on serving


def test_lost_swap_blocks_are_named_and_freed_with_their_step():
    sw = KVSwapSpace(random_kv_pool(), 4, tier="disk")
    ids = sw.allocate(3)
    real = kv_swap.write_block
    try:
        kv_swap.write_block = lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))
        sw.copy_out([(1, ids[0]), (2, ids[1])])
    finally:
        kv_swap.write_block = real
    assert sw.lost([ids[1]]) and not sw.lost([ids[2]])
    assert sw.stats.swapped_out_blocks == 0 and "No space left on device" in sw.write_error
    sw.release(ids)
    sw.end_step()
    assert not sw.lost(ids)  # back in the free list: nothing is lost any more
    sw.close()


def test_a_short_write_is_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(kv_swap.os, "pwrite", lambda fd, data, off: len(data) // 2)
    with pytest.raises(OSError) as e:
        kv_swap.write_block(0, b"12345678", 0)
    assert e.value.errno == errno.ENOSPC


# -- the cold tier: a failed demotion keeps its blocks in RAM -----------------------------------


def test_a_failed_demotion_keeps_the_blocks_exact_in_ram(tmp_path):
    kv = random_kv_pool()
    tier = KVTier(kv, 5, tmp_path, tier="disk")
    first = tier.first
    tier.demote([(1, first + 0)])  # written to the file
    real = kv_tier.write_at
    try:
        kv_tier.write_at = lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))
        tier.demote([(2, first + 1), (4, first + 2)])
    finally:
        kv_tier.write_at = real
    assert not tier.accepts_demotions and "No space left on device" in tier.write_error
    assert tier.stats.spilled_blocks == 2
    want = {first: 1, first + 1: 2, first + 2: 4}
    cold = tier.cold_blocks(sorted(want))
    tier.begin_step()
    for layer in range(3):
        for cache in (kv.k[layer], kv.v[layer]):
            rows = tier.rows(cache)
            for j, c in enumerate(cold.ids.tolist()):
                assert torch.equal(rows[j * 4 : j * 4 + 4], cache[want[c]])
    tier.end_step()
    k_rows, v_rows = tier.read(kv.k[1], [first + 2])  # Quest's synchronous read sees the RAM copy too
    assert torch.equal(k_rows[:4], kv.k[1][4]) and torch.equal(v_rows[:4], kv.v[1][4])
    tier.close()


def test_a_failed_demotion_fails_only_the_request_that_outgrew_the_hot_pool(stories_hf, tmp_path, monkeypatch,
                                                                             plain):
    llm = LLM(str(stories_hf), dtype="float32", progress=False, kv_cache_tokens=128, kv_offload_tokens=2048,
              offload_dir=str(tmp_path), max_num_batched_tokens=32)
    tier = llm.core.tier
    _disk_full_after(monkeypatch, kv_tier, "write_at", 25)  # 10 writes per demoted run: fails in the 3rd
    sps = [SP] * len(PROMPTS) + [SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)]
    got = _drive(llm, [*PROMPTS, LONG], sps)
    assert tier.write_error is not None and "No space left on device" in tier.write_error
    assert tier.stats.spilled_blocks > 0 and not tier.accepts_demotions
    # The short requests fit the hot pool: they finish, with the plain run's tokens.
    assert [g[0] for g in got[:4]] == plain["prompts"] and {g[1:] for g in got[:4]} == {("length", None)}
    # The long one (~320 tokens, the hot pool holds 128) can no longer run: a clean error, its own.
    toks, reason, error = got[4]
    assert reason == "error" and "\n" not in error
    assert "does not fit the 128-token KV pool" in error and "No space left on device" in error
    assert toks == plain["long"][: len(toks)]  # what it streamed before was right
    assert llm.core.allocator.num_used == 0
    assert _drive(llm, [LATER], [SP]) == [(plain["later"], "length", None)]  # and the engine serves on


# -- failed reads: the swap space and the cold tier ------------------------------------------------


def test_a_failed_swap_in_recomputes_with_the_same_tokens(stories_hf, tmp_path, monkeypatch, plain):
    llm = LLM(str(stories_hf), dtype="float32", progress=False, kv_cache_tokens=160, block_size=8,
              offload_dir=str(tmp_path))
    sw = llm.core.swap
    sw.recovery.clock = lambda: 0.0  # no retry here: its probe write would bring swapping back
    calls = _disk_full_after(monkeypatch, kv_swap, "read_block", 2, errno.EIO)
    out = llm.generate(PROMPTS, SP)
    assert calls[0] > 2  # a read did fail
    assert [o.token_ids for o in out] == plain["prompts"]
    assert {o.finish_reason for o in out} == {"length"}
    assert sw.read_error is not None and "Input/output error" in sw.read_error
    assert sw.stats.lost_swap_in_blocks >= 1 and sw.stats.swapped_in_blocks == 2
    assert not sw.prefer_swap(1, 1000)  # no more swap-outs after a failed read
    assert llm.core.allocator.num_used == 0 and sw.num_used == 0
    assert llm.generate(LATER, SP)[0].token_ids == plain["later"]


def test_a_failed_swap_read_names_the_pool_blocks_and_copies_the_rest():
    from llmsys.kernels.common.errors import KVReadError

    kv = random_kv_pool()
    sw = KVSwapSpace(kv, 4, tier="disk")
    ids = sw.allocate(2)
    sw.copy_out([(1, ids[0]), (2, ids[1])])
    want = kv.k[0][2].clone()
    for t in kv.k + kv.v:
        t[4:6].zero_()
    real, n = kv_swap.read_block, [0]

    def first_fails(*a):
        n[0] += 1
        if n[0] == 1:
            raise OSError(errno.EIO, "Input/output error")
        return real(*a)

    kv_swap.read_block = first_fails
    try:
        with pytest.raises(KVReadError) as e:
            sw.copy_in([(ids[0], 4), (ids[1], 5)])
    finally:
        kv_swap.read_block = real
    assert e.value.blocks == (4,) and "Input/output error" in str(e.value)
    assert torch.equal(kv.k[0][5], want)  # the block that could be read is in place
    assert sw.stats.swapped_in_blocks == 1 and sw.stats.lost_swap_in_blocks == 1
    sw.close()


def test_a_failed_cold_read_recomputes_only_its_holders(stories_hf, tmp_path, monkeypatch, plain):
    llm = LLM(str(stories_hf), dtype="float32", progress=False, kv_cache_tokens=128, kv_offload_tokens=2048,
              offload_dir=str(tmp_path), max_num_batched_tokens=32)
    tier = llm.core.tier
    tier.recovery.clock = lambda: 0.0  # no retry here: its probe write would bring the tier back
    calls = _disk_full_after(monkeypatch, kv_tier, "pread_full", 40, errno.EIO)
    sps = [SP] * len(PROMPTS) + [SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)]
    got = _drive(llm, [*PROMPTS, LONG], sps)
    assert calls[0] > 40
    assert tier.read_error is not None and "Input/output error" in tier.read_error
    assert tier.stats.lost_blocks > 0 and not tier.accepts_demotions
    assert [g[0] for g in got[:4]] == plain["prompts"] and {g[1:] for g in got[:4]} == {("length", None)}
    # The long one needed the tier, which no longer takes blocks: a clean error of its own, naming the read.
    toks, reason, error = got[4]
    assert reason == "error" and "\n" not in error and "a read failed" in error and "Input/output error" in error
    assert toks == plain["long"][: len(toks)]
    assert llm.core.allocator.num_used == 0 and llm.core.allocator.num_cold_used == 0
    assert _drive(llm, [LATER], [SP]) == [(plain["later"], "length", None)]


def test_unreadable_blocks_leave_the_prefix_cache():
    from llmsys.engine.kv_cache import BlockAllocator

    a = BlockAllocator(6, num_cold=3)
    b = a.allocate(2)
    a.register(b[0], b"k0")
    a.register(b[1], b"k1")
    c = a.demote(b[1])
    a.free([b[0], c])  # both wait, registered, in their cached lists
    assert a.num_cached == 1 and a.num_cold_cached == 1
    a.unregister({b[0], c})
    assert a.lookup([b"k0"]) == [] and a.lookup([b"k1"]) == []
    assert a.num_cached == 0 and a.num_cold_cached == 0 and a.num_free == 5 and a.num_cold_free == 3


# -- a fault in one request's work fails that request only ------------------------------------------


def test_a_step_fault_fails_only_the_request_that_faults_alone(stories_hf, monkeypatch, plain):
    llm = LLM(str(stories_hf), dtype="float32", progress=False, kv_cache_tokens=2048, swap_space=0,
              max_num_batched_tokens=32)
    poison = "The dragon roared"
    bad = llm.encode(poison)  # the fault fires on a step that feeds this prompt
    runner, real, calls = llm.core.runner, llm.core.runner.forward_pooled, []

    def faulty(batch):
        ids = batch.input_ids.tolist()
        hit = any(ids[i : i + len(bad)] == bad for i in range(len(ids)))
        calls.append((len(ids), hit))
        if hit:
            raise RuntimeError("kernel fault on a poisoned row")
        return real(batch)

    monkeypatch.setattr(runner, "forward_pooled", faulty)
    got = _drive(llm, [PROMPTS[0], poison, *PROMPTS[1:]], [SP] * 5)
    toks, reason, error = got[1]
    assert reason == "error" and toks == []
    assert error == "the engine failed on this request: RuntimeError: kernel fault on a poisoned row"
    assert [g[0] for g in got[:1] + got[2:]] == plain["prompts"]
    assert {g[1:] for g in got[:1] + got[2:]} == {("length", None)}
    faults = [n for n, hit in calls if hit]
    assert len(faults) == 2 and faults[0] > faults[1] == len(bad)  # in the batch, then alone
    assert not llm.core.scheduler._suspects and llm.core.allocator.num_used == 0
    assert _drive(llm, [LATER], [SP]) == [(plain["later"], "length", None)]


def test_a_failing_constraint_fails_only_its_request(stories_hf, plain):
    llm = LLM(str(stories_hf), dtype="float32", progress=False, kv_cache_tokens=2048, swap_space=0,
              max_num_batched_tokens=32)

    class Broken:
        def __init__(self, fail_in: str):
            self.fail_in, self.n = fail_in, 0

        def allowed(self, vocab):
            if self.fail_in == "allowed" and self.n == 3:
                raise ValueError("grammar state lost")
            return torch.ones(vocab, dtype=torch.bool)

        def advance(self, token_id):
            self.n += 1
            if self.fail_in == "advance" and self.n == 5:
                raise ValueError("grammar rejected the token")

        def prefetch(self):  # nothing to compute ahead: allowed() is immediate
            pass

    core = llm.core
    rids = [core.add_request(llm.encode(p), SP) for p in PROMPTS[:2]]
    rids += [core.add_request(llm.encode(PROMPTS[2]), SP, constraint=Broken("allowed")),
             core.add_request(llm.encode(PROMPTS[3]), SP, constraint=Broken("advance"))]
    toks, final = {r: [] for r in rids}, {}
    while len(final) < len(rids):
        for ch in core.step():
            toks[ch.request_id].extend(ch.token_ids)
            if ch.finished:
                final[ch.request_id] = (ch.finish_reason, ch.error)
    assert [toks[r] for r in rids[:2]] == plain["prompts"][:2]
    assert final[rids[2]] == ("error", "the request's output constraint failed: ValueError: grammar state lost")
    assert toks[rids[2]] == plain["prompts"][2][:3]
    assert final[rids[3]] == ("error", "the request's output constraint failed: ValueError: grammar rejected the token")
    assert toks[rids[3]] == plain["prompts"][3][:4]
    assert core.allocator.num_used == 0


def test_a_lost_block_nobody_holds_is_raised_not_retried_forever(stories_hf, monkeypatch):
    """KVReadError names blocks no running sequence holds (a bug, not a disk): re-running the step would fail
    the same way every time, so the step raises it (the server's guard then fails the step's requests)."""
    from llmsys.kernels.common.errors import KVReadError

    llm = LLM(str(stories_hf), dtype="float32", progress=False, kv_cache_tokens=256, swap_space=0)
    core = llm.core

    def lost(sched, pooled=()):
        raise KVReadError("KV offload file x: short read of layer 0 block 99999", [99999])

    monkeypatch.setattr(core.runner, "execute", lost)
    core.add_request(llm.encode(PROMPTS[0]), SP)
    with pytest.raises(KVReadError, match="short read of layer 0 block 99999"):
        core.step()
