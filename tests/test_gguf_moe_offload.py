"""MoE GGUFs with their experts on disk, read from the GGUF file itself (issue #42).

A GGUF stacks each projection's experts in one tensor; under ``--cpu-mem`` (``placement={"experts": "disk"}``)
the offload runtime reads each routed expert from its own offset in the file into the RAM expert cache: as
stored, then rebuilt in the cache slot into the tensors the resident load holds (Q4_K / Q4_0 / Q8_0 / Q6_K
codes kept, F16 converted to the run dtype, MXFP4 dequantized), never rewritten to an offload file. Checked
on converter-made files (``gguf_families``): the greedy tokens and logprobs of every layer resident, bit for
bit; bytes read only from the GGUF path; the cache's hits and misses reported; each slot's tensors equal to
the resident layer's (values and strides); the planner counting the experts' bytes as the file stores them;
``--cpu-moe`` keeping them resident in CPU RAM beside the other layers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from gguf_families import MXFP4, cache_root, converted

gguf = pytest.importorskip("gguf", reason="reading GGUF needs the gguf package (a dependency of llmsys)")

PROMPTS = [[5, 17, 99, 200, 31, 7, 8], [300, 12, 4]]
GREEDY = dict(temperature=0, ignore_eos=True)
# (family, file type) runs: the two families the issue names at F16 and quantized, plus the other MoE layouts
RUNS = [("qwen3moe", "f16"), ("qwen3moe", "q4_K_M"), ("qwen3moe", "q4_0"), ("qwen3moe", "q8_0"),
        ("gpt-oss", "f16"), ("gpt-oss", "q4_K_M"), ("gpt-oss", MXFP4), ("qwen2moe", "f16"), ("mixtral", "q4_K_M")]
_EXPS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)$")


def gguf_file(name: str, fmt: str) -> Path:
    """The cached converter-made file, else made now (skipped, saying why, without llama.cpp's converter)."""
    path = cache_root() / name / f"{name}.{fmt}.gguf"
    return path if path.exists() else converted(name, fmt)


def stored_expert_bytes(path: Path) -> tuple[int, dict[int, int]]:
    """Bytes of every stacked expert tensor in the file, in all and per layer (what reading them takes)."""
    from llmsys.engine.loader.gguf_header import read_header

    per: dict[int, int] = {}
    for t in read_header(path).tensors:
        m = _EXPS.match(t.name)
        if m:
            per[int(m.group(1))] = per.get(int(m.group(1)), 0) + t.nbytes
    return sum(per.values()), per


def _run(path: Path, dtype: str = "bfloat16", **kw):
    from llmsys import LLM, SamplingParams

    llm = LLM(str(path), dtype=dtype, device="cpu", kv_cache_tokens=256, max_num_batched_tokens=64, max_num_seqs=4,
              progress=False, threads=2, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, logprobs=0, **GREEDY))
    return llm, [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


def _disk_sources(llm) -> set[str]:
    """Every file an expert on disk is read from."""
    from llmsys.offload.experts import DiskExperts

    paths = set()
    for src in llm.offload._experts.values():
        assert isinstance(src, DiskExperts)
        for w in src.weights:
            paths |= {it.src.path for it in w.unit.items} | {s.path for r in w.repacked for s in r.stored}
    return paths


@pytest.mark.parametrize("name,fmt", RUNS, ids=[f"{n}-{f}" for n, f in RUNS])
def test_experts_read_from_the_gguf_give_the_resident_tokens(name, fmt, tmp_path):
    """Experts on disk with a cache of about half of them: the resident run's tokens and logprobs bit for bit;
    nothing written to the offload folder, every expert byte read from the GGUF path (the file's stacked expert
    tensors, as stored, no more per read), hits and misses counted and reported by memory_report."""
    path = gguf_file(name, fmt)
    total, per_layer = stored_expert_bytes(path)
    ref_llm, ref = _run(path)
    experts = ref_llm.loaded.model.model.layers[0].mlp.experts
    slot = 1.1 * max(sum(t.numel() * t.element_size() for t in (*e.parameters(), *e.buffers()))
                     for layer in ref_llm.loaded.model.model.layers for e in layer.mlp.experts)  # + alignment
    del ref_llm
    off = tmp_path / "off"
    llm, got = _run(path, cpu_mem="64MiB", offload_dir=str(off),  # a cache of ~60% of the experts
                    placement={"experts": "disk", "expert_cache": int(0.6 * len(per_layer) * len(experts) * slot)})
    plan = llm.plan
    assert plan.experts is not None and plan.experts.tier == "disk" and set(plan.layer_kinds()) == {"cpu"}
    assert got == ref
    rt = llm.offload
    assert rt._writer is None and not (off.exists() and any(off.iterdir()))  # no offload file, nothing rewritten
    assert _disk_sources(llm) == {str(path)}
    rep = rt.expert_report()
    st = rt.expert_cache.stats
    assert rep.expert_bytes == total  # the experts' bytes on disk: the file's own
    assert st.files == {str(path): rep.bytes_read} and rep.bytes_read > 0
    each = [b // len(experts) for b in per_layer.values()]  # one expert's stored bytes per layer (Q4_K_M: Q6_K in some)
    reads = rep.misses + rep.ahead_reads - rep.ahead_used  # a miss reads one expert, no more; so does a guess unused
    assert reads * min(each) <= rep.bytes_read <= reads * max(each)
    assert rep.hits > 0 and rep.misses > 0 and 0 < rep.hit_rate < 1
    assert llm.memory_report().experts == rep and llm.memory_report().weights["disk"] >= total
    # between uses the experts hold no weight: meta placeholders of the resident module's kind
    moe = llm.loaded.model.model.layers[0].mlp
    assert all(t.device.type == "meta" for e in moe.experts for t in (*e.parameters(), *e.buffers()))
    if fmt in ("q4_K_M", "q4_0", "q8_0"):
        kinds = {type(m).__name__ for e in moe.experts for m in e.modules() if m is not e}
        assert kinds <= {"Int4Linear", "Int8BlockLinear"}, kinds
    llm.offload.close()


@pytest.mark.parametrize("name,fmt", [("qwen3moe", "q4_K_M"), ("qwen3moe", "q4_0"), ("gpt-oss", "q4_0"),
                                      ("qwen3moe", "f16")])
def test_each_slot_holds_the_resident_layers_tensors(name, fmt):
    """Every expert of every sparse layer, read into a cache slot and bound: each tensor equals the resident
    load's (values, dtype, shape and strides: Q4_0's fp16 scales stay a group-major view, Q4_K's stored scales
    stay stored), so the GEMMs read what they read resident."""
    from llmsys.engine.loader import load_model
    from llmsys.offload.runtime import _tensor_slots

    path = gguf_file(name, fmt)
    resident = load_model(path, dtype="bfloat16", device="cpu", progress=False)
    llm, _ = _run(path, placement={"experts": "disk", "expert_cache": 1 << 20}, cpu_mem="64MiB")
    rt = llm.offload
    for i, src in rt._experts.items():
        mine = llm.loaded.model.model.layers[i].mlp.experts
        theirs = resident.model.model.layers[i].mlp.experts
        for e in range(len(mine)):
            for _ in rt.expert_cache.each(i, [e], src.weights):
                a, b = _tensor_slots(mine[e]), _tensor_slots(theirs[e])
                assert [(type(o).__name__, leaf) for o, leaf, _, _ in a] == [(type(o).__name__, leaf) for o, leaf, _, _ in b]
                for (_, leaf, _, x), (_, _, _, y) in zip(a, b):
                    assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride(), (i, e, leaf)
                    assert torch.equal(x, y), (i, e, leaf)
    rt.close()


def test_plan_counts_the_experts_bytes_as_stored(tmp_path):
    """``llmsys plan FILE --cpu-mem``: the experts planned on disk at the bytes the Q4_K_M file stores (a read per
    expert: Q4_K / Q6_K blocks as they are), held in RAM at their run-time size, and the explanation says both;
    the engine's own plan agrees."""
    import subprocess
    import sys

    path = gguf_file("qwen3moe", "q4_K_M")
    total, per_layer = stored_expert_bytes(path)
    llm, _ = _run(path, cpu_mem="2500KiB")  # below the model: the planner's own choice keeps the experts on disk
    ep = llm.plan.experts
    n = len(llm.loaded.model.model.layers[0].mlp.experts)
    assert ep is not None and ep.tier == "disk"
    assert ep.read_bytes_per_expert == max(per_layer.values()) // n  # a read: the largest layer's expert as stored
    assert ep.bytes_per_expert > ep.read_bytes_per_expert  # int4 codes + scales + zeros in RAM vs Q4_K's 4.5 bits
    assert llm.plan.bytes_in("disk") - sum(p.nbytes for p in (llm.plan.embed, llm.plan.head)
                                             if p is not None and p.kind == "disk") == total
    assert llm.offload.expert_report().expert_bytes == total
    llm.offload.close()
    out = subprocess.run([sys.executable, "-m", "llmsys.engine.cli.main", "plan", str(path), "--cpu-mem", "6MiB",
                          "--dtype", "bfloat16", "--explain"], capture_output=True, text=True, check=True).stdout
    from llmsys.kernels.common.units import format_bytes

    assert "as stored" in out and f"experts stay on disk ({format_bytes(total)})" in out, out


@pytest.mark.parametrize("fmt", ["f16", "q4_K_M"])
def test_cpu_moe_keeps_gguf_experts_in_cpu_ram(fmt):
    """``--cpu-moe`` / ``--n-cpu-moe 1`` on a GGUF: the experts stay resident in CPU RAM (the loaded layers, kept
    codes and all) and run through the resident expert source, with the plain run's tokens; on this CPU-only
    machine the device trip is a no-op, the path is the CUDA engine's."""
    from llmsys.offload.experts import ResidentExperts

    path = gguf_file("qwen3moe", fmt)
    _, ref = _run(path)
    for n in (-1, 1):
        llm, got = _run(path, cpu_moe=n)
        assert got == ref
        srcs = llm.offload._experts
        want = len(llm.loaded.model.model.layers) if n == -1 else 1
        assert len(srcs) == want and all(isinstance(s, ResidentExperts) and s.uses > 0 for s in srcs.values())
        assert llm.plan.experts.tier == "cpu" and llm.offload.expert_report().tier == "cpu"
        moe = llm.loaded.model.model.layers[0].mlp
        assert all(t.device.type == "cpu" for e in moe.experts for t in (*e.parameters(), *e.buffers()))
        llm.offload.close()
