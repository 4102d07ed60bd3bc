"""Experts on disk read ahead of the router (pre-gating) and rebuilt from GGUF blocks in one pass.

Pre-gating: once a sparse layer has routed, the next sparse layer's router runs on the same input and the experts it
names are read ahead into the expert cache; the next layer picks the reads up. Checked: the tokens and logprobs of
every expert resident and of pre-gating off, bit for bit; the guess's hit rate counted from what the layers really
chose (right, wrong and half-right guesses); no expert read twice; a failed read ahead reported, as one line, by
the layer that routes to that expert, with every slot kept. The GGUF repack: ``kernels.repack_q4k`` /
``repack_q6k`` write the bytes of the torch definitions (rows padded to 64 included), and a Q4_K_M file's experts
read at run time go through them.
"""

from __future__ import annotations

import tempfile
import time

import pytest
import torch
import torch.nn.functional as F

from tiny_models import make_hf_model

GREEDY = dict(temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 200, 31, 7, 8], [300, 12, 4]]


def _generate(path, **kw):
    from llmsys import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", device="cpu", kv_cache_tokens=256, max_num_batched_tokens=64, max_num_seqs=4,
              progress=False, threads=2, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, logprobs=0, **GREEDY))
    return llm, [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


def test_pregating_gives_the_resident_tokens(tmp_path):
    """A Qwen3-MoE (16 experts, 4 a token, sparse layers 0, 2, 3) with its experts on disk and a cache of a fifth
    of them: pre-gating on and off both give the all-resident run's tokens and logprobs bit for bit; on, layers
    0 and 2 guess their successors' experts (every routed expert of layers 2 and 3 counted), reads ahead happen
    and are reported by memory_report and /metrics; off, nothing is guessed nor read ahead."""
    from llmsys.engine.server.metrics import Metrics, parse_metrics
    from llmsys.offload.experts import DiskExperts

    path = make_hf_model("qwen3_moe", tmp_path / "m", seed=3, hidden_size=128, intermediate_size=256,
                         moe_intermediate_size=128, num_hidden_layers=4, num_experts=16, num_experts_per_tok=4)
    _, ref = _generate(path)
    disk = {"experts": "disk", "expert_cache": 2 * 2**20}
    on, got_on = _generate(path, cpu_mem="12MiB", placement=disk)
    off, got_off = _generate(path, cpu_mem="12MiB", placement={**disk, "expert_prefetch": False})
    assert got_on == ref and got_off == ref
    src = on.offload._experts
    assert sorted(src) == [0, 2, 3] and all(isinstance(s, DiskExperts) for s in src.values())
    assert src[0].next.experts is src[2] and src[2].next.experts is src[3] and src[3].next is None
    assert all(s.next is None for s in off.offload._experts.values())
    r_on, r_off = on.offload.expert_report(), off.offload.expert_report()
    routed = r_on.hits + r_on.misses  # every routed expert of every layer ...
    assert 0 < r_on.guess_chosen < routed  # ... of which layers 2 and 3's had a guess, layer 0's none
    assert 0 <= r_on.guess_hits <= r_on.guess_chosen and r_on.ahead_reads > 0
    assert r_on.ahead_used <= r_on.ahead_reads and r_on.ahead_bytes > 0
    assert (r_off.guess_chosen, r_off.ahead_reads, r_off.ahead_bytes) == (0, 0, 0)
    assert r_off.hits + r_off.misses == routed  # the same experts routed to either way
    mem = on.memory_report()
    assert mem.experts == r_on
    m = Metrics()
    m.add_engine().set_memory(mem)
    scraped = parse_metrics(m.render())
    assert scraped["llmsys_expert_pregate_hits_total"] == r_on.guess_hits
    assert scraped["llmsys_expert_pregate_chosen_total"] == r_on.guess_chosen
    assert scraped["llmsys_expert_prefetch_reads_total"] == r_on.ahead_reads
    assert scraped["llmsys_expert_prefetch_bytes_total"] == r_on.ahead_bytes
    assert scraped["llmsys_expert_prefetch_unused_bytes"] == r_on.ahead_unused_bytes


# -- the cache alone: two sparse layers of 8 experts ([4, 4] float32 weights each) over one file --------------------

E, BYTES = 8, 64


class _Layers:
    """Two layers' DiskExperts over a temp file (expert e of layer l at offset (l * E + e) * 64; ``missing`` of
    layer 1's experts lie past its end), layer 0's ``next`` a router whose logits favour ``guess``."""

    def __init__(self, guess: list[int], slots: int = 12, missing: tuple[int, ...] = ()):
        from llmsys.offload.experts import DiskExperts, ExpertCache, ExpertWeights, NextRouter
        from llmsys.offload.streamer import Binding, StreamItem, StreamUnit, TensorSource

        self.file = tempfile.NamedTemporaryFile()
        data = torch.arange(2 * E * 16, dtype=torch.float32).view(2 * E, 16)
        self.file.write(data[: E + min(missing, default=E)].numpy().tobytes())  # layer 1's cut from the first missing
        self.file.flush()
        self.data, self.mods = data, [[torch.nn.Linear(4, 4, bias=False) for _ in range(E)] for _ in range(2)]
        ws = []
        for layer in range(2):
            row = []
            for e, m in enumerate(self.mods[layer]):
                meta = torch.nn.Parameter(torch.empty(4, 4, device="meta"), requires_grad=False)
                b = Binding(m, "weight", True, meta)
                b.unbind()
                src = TensorSource(self.file.name, (layer * E + e) * BYTES, BYTES)
                unit = StreamUnit(f"layers.{layer}.experts.{e}", [StreamItem(torch.float32, (4, 4), src)])
                row.append(ExpertWeights(unit, (b,)))
            ws.append(row)
        self.cache = ExpertCache(slots * BYTES, BYTES)
        self.reads: list[int] = []
        pread = self.cache._pread

        def counted(path, off, bufs, name):
            self.reads.append(off)
            return pread(path, off, bufs, name)

        self.cache._pread = counted
        logits = torch.full((E,), -1.0)
        logits[guess] = torch.arange(len(guess), 0, -1, dtype=torch.float32)  # guess[0] most likely
        self.src = [DiskExperts(l, ws[l], self.cache) for l in range(2)]
        self.src[0].next = NextRouter(lambda x: logits.expand(x.shape[0], E), len(guess), self.src[1])

    def step(self, chosen0: list[int], chosen1: list[int]) -> None:
        """One token through both layers as MoE.forward drives a source: route, prefetch_next, each."""
        x = torch.zeros(1, 4)
        for layer, chosen in ((0, chosen0), (1, chosen1)):
            s = self.src[layer]
            s.prefetch_next(x)
            for e in s.each(chosen):
                assert torch.equal(self.mods[layer][e].weight.view(-1), self.data[layer * E + e])

    def close(self) -> None:
        self.cache.close()
        self.file.close()


@pytest.mark.parametrize("guess,chosen,rate", [([4, 5, 6, 7], [4, 5, 6, 7], 1.0), ([0, 1, 2, 3], [4, 5, 6, 7], 0.0),
                                                ([4, 5, 0, 1], [5, 4, 6, 7], 0.5)],
                         ids=["right", "wrong", "half"])
def test_guess_rate_counts_what_the_layer_chose(guess, chosen, rate):
    """Layer 0's guess of layer 1's experts scored against what layer 1 routed to (guessed and chosen / chosen);
    each guessed expert read ahead once, used exactly when layer 1 chose it, its bytes counted unused otherwise
    (until it is routed to later); every expert read once in all (a read in flight is picked up, not repeated)."""
    t = _Layers(guess)
    try:
        t.step([0, 1, 2, 3], chosen)
        st = t.cache.stats
        assert (st.guess_hits, st.guess_chosen) == (round(rate * 4), 4) and st.guess_rate == rate
        assert st.ahead_reads == 4  # the whole guess: none of layer 1's experts was cached
        used = len(set(guess) & set(chosen))
        assert st.ahead_used == used and st.ahead_bytes == 4 * BYTES
        assert t.cache.unused_ahead_bytes == (4 - used) * BYTES
        offsets = sorted(t.reads)
        assert offsets == sorted(set(offsets))  # no expert read twice
        assert set(offsets) == {e * BYTES for e in (0, 1, 2, 3)} | {(E + e) * BYTES for e in set(guess) | set(chosen)}
        assert st.misses == 8 and st.hits == 0
        t.step([0, 1, 2, 3], chosen)  # all cached now: no read, the guess scored again
        assert len(t.reads) == len(offsets) and t.cache.stats.hits == 8
        assert t.cache.stats.guess_chosen == 8 and t.cache.stats.guess_hits == 2 * round(rate * 4)
    finally:
        t.close()


def test_read_ahead_never_evicts_what_the_layer_needs():
    """A full cache of 8 slots (4 reads in flight + the computing one + 2 ahead at most): the guess of layer 1 is
    read into slots of experts layer 0 no longer needs, each of layer 0's experts computes on its own weights
    (``step`` checks them at every yield), and every slot is accounted for after the step."""
    t = _Layers([4, 5, 6, 7], slots=8)
    try:
        c = t.cache
        assert c._ahead_max == 2
        nxt, t.src[0].next = t.src[0].next, None
        t.step([4, 5, 6, 7], [0, 1, 2, 3])  # fill every slot, no guess
        assert not c._free and c.stats.ahead_reads == 0
        for e in (4, 5, 6, 7):
            c._uses[(1, e)] = 5  # routed to often lately (then evicted): worth a read ahead over a full cache
        t.src[0].next = nxt
        t.step([0, 1, 2, 3], [4, 5, 6, 7])
        assert c.stats.ahead_reads == 2 and c.stats.ahead_used == 2 and c.stats.guess_hits == 4
        assert len(c._lru) + len(c._free) == 8 and not c._ahead and not c._stale
    finally:
        t.close()


def test_read_ahead_over_a_full_cache_only_for_a_more_popular_guess():
    """Over a full cache, a guess never routed to (or less often than every expert it could evict) is not read
    ahead: a wrong guess would land unused, be the next guess's victim and be read again every step. The layer
    still routes to its experts, read on demand."""
    t = _Layers([4, 5, 6, 7], slots=8)
    try:
        c = t.cache
        nxt, t.src[0].next = t.src[0].next, None
        t.step([4, 5, 6, 7], [0, 1, 2, 3])
        t.src[0].next = nxt
        t.step([0, 1, 2, 3], [4, 5, 6, 7])
        assert c.stats.ahead_reads == 0 and c.stats.guess_hits == 4 and c.stats.misses == 16
    finally:
        t.close()


def test_failed_read_ahead_is_the_using_layers_one_line_error():
    """Layer 1's expert 5 lies past the end of the file: its read ahead fails on a reader thread without a
    trace; the layer that routes to it gets the read's one-line error naming the file and the expert, every
    slot stays usable, and a guess that fails but is never routed to costs nothing."""
    t = _Layers([5, 6], missing=(5,))
    try:
        with pytest.raises(OSError) as err:
            t.step([0, 1], [5, 2])
        msg = str(err.value)
        assert "\n" not in msg and t.file.name in msg and "layers.1.experts.5" in msg and "end of file" in msg
        c = t.cache
        assert not c._ahead and len(c._lru) + len(c._free) + len(c._stale) == 12
        c._settle()
        t.step([0, 1], [2, 3])  # the failed guess (5) not routed to: no error, and the layers run
        for _ in range(500):  # let the second step's failed reads ahead land (reader threads), then settle them
            c._settle()
            if not c._stale:
                break
            time.sleep(0.01)
        assert len(c._lru) + len(c._free) == 12 and (1, 5) not in c._lru
        assert c.stats.guess_chosen == 4
    finally:
        t.close()


# -- GGUF blocks rebuilt in one pass -------------------------------------------------------------------------------

def test_repack_kernels_write_the_torch_definitions_bytes():
    """Random Q4_K, Q6_K, Q4_0 and Q8_0 blocks (100 rows: the int4 tiling pads them to 128 with code 8): the C
    repacks give the torch block parsers' codes and scales and the CPU int4 tiling of those codes, byte for byte."""
    from llmsys.engine.loader.gguf_io import _q4k_parts, _q6k_parts
    from llmsys.kernels import pack_cpu_int4, repack_q4_0, repack_q4k, repack_q6k, repack_q8_0

    g = torch.Generator().manual_seed(0)
    n, k = 100, 512
    blocks = torch.randint(0, 256, (n, k // 256, 144), dtype=torch.uint8, generator=g)
    codes, sc, m, d, dmin = _q4k_parts(blocks)
    want = pack_cpu_int4(F.pad(codes, (0, 0, 0, 28), value=8))
    out = [torch.empty(128, k // 2, dtype=torch.uint8), torch.empty(k // 32, n, dtype=torch.uint8),
           torch.empty(k // 32, n, dtype=torch.uint8), torch.empty(k // 256, n, dtype=torch.float16),
           torch.empty(k // 256, n, dtype=torch.float16)]
    if not repack_q4k(blocks.reshape(-1), n, k, *out):
        pytest.skip("the C kernel library is not loaded (LLMSYS_NO_CKERNELS or no compiler)")
    for got, ref in zip(out, (want, sc.t(), m.t(), d.t(), dmin.t())):
        assert torch.equal(got.view(torch.uint8), ref.contiguous().view(torch.uint8))
    blocks6 = torch.randint(0, 256, (n, k // 256, 210), dtype=torch.uint8, generator=g)
    q, sc6, d6 = _q6k_parts(blocks6)
    out6 = [torch.empty(n, k, dtype=torch.int8), torch.empty(k // 16, n, dtype=torch.int8),
            torch.empty(k // 256, n, dtype=torch.float16)]
    assert repack_q6k(blocks6.reshape(-1), n, k, *out6)
    for got, ref in zip(out6, (q, sc6.t(), d6.t())):
        assert torch.equal(got.view(torch.uint8), ref.contiguous().view(torch.uint8))
    with pytest.raises(ValueError, match="repack_q4k: K=300 is not a multiple of 256"):
        repack_q4k(blocks.reshape(-1), n, 300, *out)
    # Q4_0: fp16 d, byte i of 16 holding column i (low nibble) and i + 16 (high); Q8_0: fp16 d, 32 int8 codes
    b4 = torch.randint(0, 256, (n, k // 32, 18), dtype=torch.uint8, generator=g)
    codes4 = torch.cat([b4[..., 2:] & 15, b4[..., 2:] >> 4], dim=-1).reshape(n, k)
    d4 = b4[..., :2].contiguous().view(torch.float16).view(n, k // 32)
    got4 = [torch.empty(128, k // 2, dtype=torch.uint8), torch.empty(k // 32, n, dtype=torch.float16)]
    assert repack_q4_0(b4.reshape(-1), n, k, *got4)
    assert torch.equal(got4[0], pack_cpu_int4(F.pad(codes4, (0, 0, 0, 28), value=8)))
    assert torch.equal(got4[1].view(torch.int16), d4.t().contiguous().view(torch.int16))
    b8 = torch.randint(0, 256, (n, k // 32, 34), dtype=torch.uint8, generator=g)
    got8 = [torch.empty(n, k, dtype=torch.int8), torch.empty(k // 32, n, dtype=torch.float16)]
    assert repack_q8_0(b8.reshape(-1), n, k, *got8)
    assert torch.equal(got8[0], b8[..., 2:].contiguous().view(torch.int8).reshape(n, k))
    assert torch.equal(got8[1].view(torch.int16), b8[..., :2].contiguous().view(torch.int16).view(n, k // 32).t())


@pytest.mark.parametrize("fmt", ["q4_K_M", "q4_0", "q8_0"])
def test_gguf_experts_are_filled_in_one_pass(fmt):
    """Converter-made Qwen3-MoE files with their experts on disk: every expert's projection (Q4_K and Q6_K, Q4_0,
    Q8_0) is written by the one-pass fill (checked against the built layer at install), and the tokens are the
    resident run's with pre-gating on."""
    pytest.importorskip("gguf", reason="reading GGUF needs the gguf package (a dependency of llmsys)")
    from gguf_families import cache_root, converted

    from llmsys.kernels import repack

    if not repack.available():
        pytest.skip("the C kernel library is not loaded (LLMSYS_NO_CKERNELS or no compiler)")
    path = cache_root() / "qwen3moe" / f"qwen3moe.{fmt}.gguf"
    path = path if path.exists() else converted("qwen3moe", fmt)
    _, ref = _generate(path)
    llm, got = _generate(path, placement={"experts": "disk", "expert_cache": 1 << 20}, cpu_mem="64MiB")
    assert got == ref
    parts = [r for s in llm.offload._experts.values() for w in s.weights for r in w.repacked]
    assert parts and all(r.fill is not None for r in parts)
    assert llm.offload.expert_report().guess_chosen > 0
