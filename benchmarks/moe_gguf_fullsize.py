"""A Qwen3-30B-A3B-shaped GGUF at full size, run with its experts read from the file under a memory cap.

``make``: writes the model's 48 layers as the Q4_K_M file people download (~17 GB), with llama.cpp's
``qwen3moe`` metadata, tensor names and Q4_K_M's choice of type per tensor (Q4_K; Q6_K for the head and for
attn_v / ffn_down of the layers llama.cpp gives more bits), its blocks drawn at random directly (no float
copy of 30B weights, and no llama.cpp quantizer: its Q4_K search took 148 s for one layer's 1.2B weights on
this 2-core machine, about an hour for the whole model). Made once, here, never by a test.

``run``: greedy decoding of a fixed prompt (``--prompt-len``, 128 by default) by llmsys in a fresh process, optionally
inside a memory cgroup (``offload.memcap``) with ``--cpu-mem`` (experts read from the GGUF's own offsets into the
RAM expert cache, pre-gating on unless ``--no-prefetch``), the page cache dropped first; prints as one JSON line the
tokens, decode tok/s, the process's peak RSS, the cgroup's peak charge, the bytes read from storage in all and
during the decode (per token and per second), the expert cache's and the pre-gating guess's hit rates, and the
disk-bound roof: a cold sequential read of ``--probe`` bytes of the file gives the disk's rate, and that rate over
the bytes read per decoded token is the decode speed a disk-bound engine could reach (``pct_of_roof``: the share
reached). ``--engine llama.cpp`` runs llama.cpp on the same file (its default mmap) the same way.

    python benchmarks/moe_gguf_fullsize.py make --out /work/big/qwen3-30b-a3b.Q4_K_M.gguf [--layers 48]
    python benchmarks/moe_gguf_fullsize.py run FILE [--cap 10GiB] [--cpu-mem 8GiB] [--new 32] [--prompt-len 128]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

# Qwen3-30B-A3B (config.json of the release): 48 layers, hidden 2048, 32 query / 4 KV heads of 128, 128 experts
# of 768, 8 active, vocabulary 151936, untied head.
SHAPE = dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, active=8, expert_ff=768,
             vocab=151936, ff=6144)
PROMPT = [9707, 11, 1879, 0, 3555, 374, 264, 1273, 13, 576, 3974, 13876]  # ids below 151936; any text would do
STD = 0.02  # weights' standard deviation (codes uniform in [-127, 127]: std 73 codes)


def _q4_k(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """``rows x cols`` random weights as Q4_K super-blocks ``uint8 [rows, cols / 256 * 144]``: fp16 ``d``, ``dmin``,
    12 bytes of 6-bit scales ``sc`` and minimums ``m``, 128 bytes of nibbles ``q``; ``w = d sc q - dmin m``. Each
    sub-block's minimum is its scale (``m = sc``, ``dmin = 7.5 d``), so every block of 32 weights centres on 0 as
    trained weights do (independent random minimums shift whole blocks, and 48 such layers overflow llama.cpp's
    f16 KV cache); ``d`` sized so the weights' spread is about ``std``."""
    sb = cols // 256
    out = np.empty((rows, sb, 144), dtype=np.uint8)
    d = std / (31 * 4.6)
    out[..., 0:4] = np.array([d, 7.5 * d], dtype=np.float16).view(np.uint8)
    sc = rng.integers(1, 64, size=(rows, sb, 8), dtype=np.uint8)  # [rows, S, 8 sub-blocks]
    lo, hi = sc[..., :4], sc[..., 4:]
    packed = (lo & 63) | ((hi >> 4) << 6)  # sub-blocks 0-3 in the low 6 bits, 4-7's top 2 bits above (get_scale_min_k4)
    out[..., 4:8] = packed  # sc
    out[..., 8:12] = packed  # m = sc
    out[..., 12:16] = (hi & 15) | ((hi & 15) << 4)  # sub-blocks 4-7: low nibble sc, high nibble m
    out[..., 16:] = rng.integers(0, 256, size=(rows, sb, 128), dtype=np.uint8)
    return out.reshape(rows, sb * 144)


def _q6_k(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """``rows x cols`` random weights as Q6_K super-blocks ``uint8 [rows, cols / 256 * 210]``: 192 bytes of 6-bit
    codes, 16 int8 scales (1..63 here), fp16 ``d``."""
    sb = cols // 256
    out = np.empty((rows, sb, 210), dtype=np.uint8)
    out[..., :192] = rng.integers(0, 256, size=(rows, sb, 192), dtype=np.uint8)
    out[..., 192:208] = rng.integers(1, 64, size=(rows, sb, 16), dtype=np.uint8)
    out[..., 208:210] = np.array([std / (32 * 18.5)], dtype=np.float16).view(np.uint8)
    return out.reshape(rows, sb * 210)


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers whose attn_v / ffn_down Q4_K_M stores as Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def make(out: Path, layers: int = SHAPE["layers"]) -> None:
    """Write the Q4_K_M-typed file of :data:`SHAPE` (``layers`` of them) at ``out``, one tensor at a time."""
    import gguf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from gguf_families import converted  # a converter-made qwen3moe file: its tokenizer metadata, padded

    s = dict(SHAPE, layers=layers)
    tiny = gguf.GGUFReader(str(converted("qwen3moe", "f16")))
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "qwen3moe")
    w.add_block_count(s["layers"])
    w.add_context_length(4096)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ff"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(s["experts"])
    w.add_expert_used_count(s["active"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_expert_feed_forward_length(s["expert_ff"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tokens = list(tiny.fields["tokenizer.ggml.tokens"].contents())
    types = list(tiny.fields["tokenizer.ggml.token_type"].contents())
    pad = s["vocab"] - len(tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens + [f"<|filler_{i}|>" for i in range(pad)])
    w.add_token_types(types + [gguf.TokenType.UNUSED] * pad)
    w.add_token_merges(list(tiny.fields["tokenizer.ggml.merges"].contents()))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    h, d, L, E, F = s["hidden"], s["head_dim"], s["layers"], s["experts"], s["expert_ff"]
    plan: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (s["vocab"], h), "Q4_K")]
    for i in range(L):
        b, more = f"blk.{i}.", "Q6_K" if _more_bits(i, L) else "Q4_K"
        plan += [(b + "attn_norm.weight", (h,), "one"), (b + "attn_q.weight", (s["heads"] * d, h), "Q4_K"),
                 (b + "attn_k.weight", (s["kv_heads"] * d, h), "Q4_K"), (b + "attn_v.weight", (s["kv_heads"] * d, h), more),
                 (b + "attn_output.weight", (h, s["heads"] * d), "Q4_K"), (b + "attn_q_norm.weight", (d,), "one"),
                 (b + "attn_k_norm.weight", (d,), "one"), (b + "ffn_norm.weight", (h,), "one"),
                 (b + "ffn_gate_inp.weight", (E, h), "F32"), (b + "ffn_gate_exps.weight", (E, F, h), "Q4_K"),
                 (b + "ffn_up_exps.weight", (E, F, h), "Q4_K"), (b + "ffn_down_exps.weight", (E, h, F), more)]
    plan += [("output_norm.weight", (h,), "one"), ("output.weight", (s["vocab"], h), "Q6_K")]
    blocks = {"Q4_K": (_q4_k, 144), "Q6_K": (_q6_k, 210)}
    for name, shape, kind in plan:
        if kind in blocks:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) // 256 * blocks[kind][1],
                              raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    rng = np.random.default_rng(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.time()
    for name, shape, kind in plan:  # one tensor at a time: the largest (an expert stack) is 113 MB of blocks
        if kind in blocks:
            w.write_tensor_data(blocks[kind][0](rng, int(np.prod(shape[:-1])), shape[-1], STD))
        elif kind == "one":
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
        else:
            w.write_tensor_data(rng.normal(0, STD, size=shape).astype(np.float32))
    w.close()
    tmp.replace(out)
    print(f"wrote {out} ({out.stat().st_size / 1e9:.1f} GB) in {time.time() - t0:.0f} s", file=sys.stderr)


# The measured child: one fresh process per run, so peak RSS is this run's alone. Bytes read from storage (the
# process's /proc/self/io read_bytes: page-cache misses, which is what mmap faults and preads cost) are sampled when
# the first token is out (the prompt done) and at the end: the decode's share alone.
_CHILD = r"""
import json, os, resource, sys, time
args = json.loads(sys.argv[1])

def io_read():
    with open(f"/proc/{os.getpid()}/io") as f:
        return int(next(ln for ln in f if ln.startswith("read_bytes")).split()[1])

t0 = time.time()
if args["engine"] == "llmsys":
    from llmsys import LLM, SamplingParams
    llm = LLM(args["file"], cpu_mem=args["cpu_mem"], threads=args["threads"], max_model_len=args["ctx"],
              progress=False, kv_cache_tokens=args["ctx"],
              placement=None if args["prefetch"] else {"expert_prefetch": False})
    load = time.time() - t0
    sp = SamplingParams(max_tokens=args["new"], temperature=0, ignore_eos=True)
    toks, first, timings = [], None, None
    for ch in llm.stream(args["prompt"], sp):
        toks += ch.token_ids
        if first is None and ch.token_ids:  # the prompt is done: the decode starts here
            first = (time.perf_counter(), io_read(), llm.offload.expert_report() if llm.offload else None)
        timings = ch.timings or timings
    end = (time.perf_counter(), io_read(), llm.offload.expert_report() if llm.offload else None)
    res = dict(tokens=toks, decode_tok_s=timings.decode_tok_s, prefill_s=timings.prefill_s, load_s=load)
    rep0, rep = first[2], end[2]
    if rep is not None:
        d = lambda f: getattr(rep, f) - getattr(rep0, f)
        res.update(expert_hit_rate=rep.hit_rate, expert_bytes_read=rep.bytes_read,
                   expert_cache_bytes=rep.cache_capacity,
                   decode_expert_hit_rate=d("hits") / max(d("hits") + d("misses"), 1),
                   pregate_hit_rate=rep.guess_rate if rep.guess_chosen else None,
                   decode_pregate_hit_rate=d("guess_hits") / d("guess_chosen") if d("guess_chosen") else None,
                   prefetch_reads=rep.ahead_reads, prefetch_used=rep.ahead_used, prefetch_bytes=rep.ahead_bytes,
                   prefetch_unused_bytes=rep.ahead_unused_bytes)
        st = llm.offload.expert_cache.stats
        res.update(expert_read_s=st.read_s, expert_wait_s=st.wait_s, expert_repack_s=st.repack_s)
else:
    import llama_cpp
    import llama_cpp.llama_cpp as lib
    if args["no_repack"]:  # llama.cpp's --no-repack: weights stay in the mapped file (no anonymous repacked copy)
        default = lib.llama_model_default_params
        def no_repack():
            p = default()
            p.use_extra_bufts = False
            return p
        lib.llama_model_default_params = no_repack
    m = llama_cpp.Llama(args["file"], n_ctx=args["ctx"], n_batch=args["ctx"], n_threads=args["threads"], verbose=False)
    load = time.time() - t0
    t1 = time.time()
    m.eval(args["prompt"])
    prefill = time.time() - t1
    toks = [int(m.scores[m.n_tokens - 1].argmax())]  # the prompt's token, as llmsys's first
    first = (time.perf_counter(), io_read(), None)
    for _ in range(args["new"] - 1):
        m.eval([toks[-1]])
        toks.append(int(m.scores[m.n_tokens - 1].argmax()))
    end = (time.perf_counter(), io_read(), None)
    res = dict(tokens=toks, decode_tok_s=(args["new"] - 1) / (end[0] - first[0]), prefill_s=prefill, load_s=load)
steps = len(res["tokens"]) - 1  # decode steps after the first token
res.update(decode_wall_s=end[0] - first[0], decode_read_bytes=end[1] - first[1],
           decode_read_bytes_per_token=(end[1] - first[1]) / max(steps, 1),
           decode_read_rate=(end[1] - first[1]) / max(end[0] - first[0], 1e-9))
res["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
res["read_bytes"] = io_read()
print("RESULT " + json.dumps(res))
"""


def _size(text: str | None) -> int | None:
    if text is None:
        return None
    from llmsys.kernels.common.units import parse_size

    return parse_size(text)


def drop_page_cache() -> None:
    """Write back, then drop the page cache (root only): each run and the disk probe start cold."""
    import os

    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        raise SystemExit(f"dropping the page cache needs root (/proc/sys/vm/drop_caches: {exc.strerror}); "
                         f"run as root or pass --no-drop-cache") from None


def disk_read_rate(file: Path, nbytes: int, chunk: int = 8 << 20) -> float:
    """Bytes per second of a cold sequential read of ``nbytes`` of ``file`` (from the middle, where the expert
    tensors are) in ``chunk`` preads: the disk's bandwidth, the roof a disk-bound decode divides."""
    import os

    size = file.stat().st_size
    nbytes = min(nbytes, size)
    start = (size - nbytes) // 2 // 4096 * 4096
    buf = bytearray(chunk)
    fd = os.open(file, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, start, nbytes, os.POSIX_FADV_DONTNEED)
        t, done = time.perf_counter(), 0
        while done < nbytes:
            done += os.preadv(fd, [memoryview(buf)[: min(chunk, nbytes - done)]], start + done)
        dt = time.perf_counter() - t
        os.posix_fadvise(fd, start, nbytes, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return done / dt


def _busy_cpu_s() -> float:
    """CPU seconds every core of the machine has spent busy since boot (``/proc/stat``)."""
    import os

    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and its finished children (the measured run, the probe)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def prompt_ids(n: int) -> list[int]:
    """``n`` fixed token ids (the first 12 are :data:`PROMPT`, then a fixed stride through the vocabulary)."""
    return (PROMPT + [(1000 + 7919 * i) % 150000 for i in range(max(n - len(PROMPT), 0))])[:n]


def run(file: Path, engine: str, cap: str | None, cpu_mem: str | None, new: int, threads: int,
        no_repack: bool = False, prompt_len: int = 128, prefetch: bool = True, drop: bool = True,
        probe_bytes: int = 2 << 30) -> dict:
    """One measured run in a fresh process (inside a memory cgroup of ``cap`` when given), the page cache dropped
    first, and the disk's cold sequential read rate probed before it; its JSON result with the disk-bound roof
    (probe bytes per second / bytes read per decoded token) and the share of it the decode reached."""
    import os
    import subprocess

    ctx = max(256, prompt_len + new)
    bw = None
    if probe_bytes:
        if drop:
            drop_page_cache()
        bw = disk_read_rate(file, probe_bytes)
    if drop:
        drop_page_cache()
    args = dict(file=str(file), engine=engine, cpu_mem=_size(cpu_mem), new=new, threads=threads,
                prompt=prompt_ids(prompt_len), no_repack=no_repack, prefetch=prefetch, ctx=ctx)
    cmd = [sys.executable, "-c", _CHILD, json.dumps(args)]
    load_before = os.getloadavg()[0]  # the machine's 1-minute load: a run beside other work says so
    busy0, mine0 = _busy_cpu_s(), _own_cpu_s()
    if cap:
        from llmsys.offload.memcap import run_capped

        r = run_capped(cmd, _size(cap), timeout=3600)
        out, err, peak, rc = r.stdout, r.stderr, r.peak_bytes, (137 if r.oom_killed else r.returncode)
    else:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        out, err, peak, rc = p.stdout, p.stderr, None, p.returncode
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    if rc != 0 or line is None:
        raise SystemExit(f"{engine} run failed (rc {rc}): {(err.strip().splitlines() or [''])[-1]}")
    res = json.loads(line[7:])
    here = Path(__file__).resolve().parent
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=here).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=here).stdout.split()[1::2]
    if dirty:  # the tree ran with uncommitted edits: name the files
        commit += " + uncommitted " + ", ".join(dirty)
    res.update(engine=engine, cap=cap, cpu_mem=cpu_mem, no_repack=no_repack, cgroup_peak=peak, prompt_len=prompt_len,
               new=new, threads=threads, commit=commit, prefetch=prefetch if engine == "llmsys" else None,
               disk_read_rate=bw, loadavg_before=load_before, loadavg_after=os.getloadavg()[0],
               # CPU seconds the rest of the machine used while this run went (0 on a quiet machine)
               other_cpu_s=round((_busy_cpu_s() - busy0) - (_own_cpu_s() - mine0), 1))
    per_tok = res["decode_read_bytes_per_token"]
    if bw and per_tok:
        res["roof_tok_s"] = bw / per_tok
        res["pct_of_roof"] = 100 * res["decode_tok_s"] / res["roof_tok_s"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make")
    mk.add_argument("--out", type=Path, required=True)
    mk.add_argument("--layers", type=int, default=SHAPE["layers"], help="fewer for a quick check of the script")
    rn = sub.add_parser("run")
    rn.add_argument("file", type=Path)
    rn.add_argument("--engine", choices=("llmsys", "llama.cpp"), default="llmsys")
    rn.add_argument("--cap", help="memory cgroup limit, e.g. 10GiB")
    rn.add_argument("--cpu-mem", help="llmsys --cpu-mem, e.g. 8GiB")
    rn.add_argument("--new", type=int, default=32, help="tokens generated (the first comes out of the prompt)")
    rn.add_argument("--prompt-len", type=int, default=128)
    rn.add_argument("--threads", type=int, default=2)
    rn.add_argument("--no-prefetch", action="store_true", help="llmsys: pre-gating off (placement expert_prefetch)")
    rn.add_argument("--no-drop-cache", action="store_true", help="keep the page cache (dropping it needs root)")
    rn.add_argument("--probe", default="2GiB", help="cold sequential read of the file for the disk's rate (0: none)")
    rn.add_argument("--no-repack", action="store_true", help="llama.cpp: keep the weights in the mapped file "
                    "(its default repacks Q4_K into anonymous memory, the whole model, which no cap below it survives)")
    a = ap.parse_args()
    if a.cmd == "make":
        make(a.out, a.layers)
    else:
        print(json.dumps(run(a.file, a.engine, a.cap, a.cpu_mem, a.new, a.threads, a.no_repack, a.prompt_len,
                             not a.no_prefetch, not a.no_drop_cache, _size(a.probe) if a.probe != "0" else 0)))


if __name__ == "__main__":
    main()
