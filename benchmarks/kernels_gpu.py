"""Check, then time, every ``llmsys.kernels`` op and one 8B-shaped decode step on a CUDA GPU.

    python benchmarks/kernels_gpu.py [--quick] [--out results.md] [--only w4a16,paged_decode]

Why one script: GPU time is scarce, so one run does everything and records it.
For each kernel at the decode shapes of an 8B Llama (hidden 4096, 32/8 heads,
head_dim 128, intermediate 14336) it first compares ``impl="triton"`` with
``impl="reference"`` (the stated tolerance is on ``max|a - b| / max|b|``),
then times the Triton kernel, the torch eager reference and the baselines that
do the same job (bf16 ``F.linear``, bitsandbytes nf4 if importable, SDPA on a
contiguous KV). Timing: median over samples of CUDA-event time; each sample
replays a CUDA graph of many calls (or an eager loop when the op syncs the
host, marked ``*``), cycling through enough input copies to defeat the L2.
``floor`` = bytes read + written / measured device-to-device copy bandwidth;
``%floor`` = floor / kernel time. The decode-step row times batch-1 decoding
through the model's forward exactly as the engine runs it (metadata built on
the host, greedy token synced back every step); a second row replays that step as
a CUDA graph (the kernels' ceiling without Python launch overhead).

On a device machine: ``python benchmarks/kernels_gpu.py --out $OUT/`` writes
``kernels_gpu_<gpu>.md`` there (rewritten after every row, so a timeout keeps
what was measured). Rows with targets and the decode step run first; later
rows are skipped past ``--max-seconds``. Expected: ~1-2 min full (mostly
Triton compiles), under 1 min ``--quick`` (4-layer model); not yet measured.

Exit codes: 0 ran and every correctness check passed (with ``--strict`` also
every target met); 1 a check failed or a case errored (``--strict``: or a
target was missed); 2 nothing measured: no CUDA GPU or triton (one line on stderr).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

MIB = 1 << 20
FLUSH_BYTES = 256 * MIB  # input copies cycled per case: well past any GPU's L2 (H100/H200: 50 MiB)


# ------------------------------------------------------------------ shapes (pure)


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder's dimensions (default: Llama 3 8B)."""

    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    layers: int = 32

    def layer_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o, k, v
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden  # + MLP + 2 norms

    def params(self) -> int:
        """All parameters (untied embedding and LM head)."""
        return self.layers * self.layer_params() + 2 * self.vocab * self.hidden + self.hidden

    def decode_step_bytes(self, batch: int, ctx: int, itemsize: int = 2) -> int:
        """Least bytes one decode step moves: every weight once except the embedding
        table (only ``batch`` rows are read), each sequence's K/V, the logits written."""
        weights = self.layers * self.layer_params() + self.vocab * self.hidden + self.hidden
        kv = batch * ctx * self.layers * 2 * self.kv_heads * self.head_dim
        return (weights + batch * self.hidden + kv + batch * self.vocab) * itemsize


LLAMA_8B = ModelShape()


@dataclass(frozen=True)
class Target:
    """A row's pass criterion: % of the bandwidth floor and/or speedup over baseline 1."""

    min_floor_pct: float | None = None
    min_speedup: float | None = None

    def describe(self, baseline: str = "baseline") -> str:
        parts = []
        if self.min_floor_pct is not None:
            parts.append(f">={self.min_floor_pct:g}% floor")
        if self.min_speedup is not None:
            parts.append(f">={self.min_speedup:g}x {baseline}")
        return ", ".join(parts)

    def met(self, floor_pct: float | None, speedup: float | None) -> bool:
        if self.min_floor_pct is not None and (floor_pct is None or floor_pct < self.min_floor_pct):
            return False
        return self.min_speedup is None or (speedup is not None and speedup >= self.min_speedup)


@dataclass(frozen=True)
class Spec:
    """One kernel row: op name, dims (a name -> int table), target, run order."""

    op: str  # rms_norm | rope | silu_mul | w8a16 | w4a16 | kv_store | paged_decode | paged_prefill
    label: str
    dims: tuple[tuple[str, int], ...]
    target: Target | None = None
    priority: int = 1  # 0 = rows with targets: measured first in case the time budget runs out

    def d(self) -> dict[str, int]:
        return dict(self.dims)

    @property
    def shape(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.dims)

    @property
    def key(self) -> str:  # unique per row (labels repeat across token counts)
        return f"{self.label} {self.shape}"


# max|triton - reference| / max|reference|. A bf16 ulp is 2^-7 of a value's leading power of
# two, so two differently placed roundings stay under 2 * 2^-7 = 1.6e-2 of the max; indexing
# bugs give errors of order 1. int8 KV compares dequantized caches: one code step is 1/127.
TOLERANCE = {
    "rms_norm": 2e-2, "rope": 2e-2, "silu_mul": 2e-2, "w8a16": 2e-2, "w4a16": 2e-2,
    "kv_store": 0.0, "kv_store_int8": 1e-2, "paged_decode": 2e-2,
}


def kernel_specs(m: ModelShape = LLAMA_8B, quick: bool = False, batch: int = 16,
                 ctx: int = 8192, prefill_tokens: int = 4096, block: int = 16) -> list[Spec]:
    """Rows in display order. Decode shapes use ``batch`` tokens; full runs add a
    ``prefill_tokens`` row per elementwise op (bandwidth-bound, unlike decode)."""
    H, I, D, Hq, Hk = m.hidden, m.intermediate, m.head_dim, m.heads, m.kv_heads
    w4_target = Target(min_floor_pct=70, min_speedup=2.0)
    attn = (("B", batch), ("ctx", ctx), ("Hq", Hq), ("Hk", Hk), ("D", D), ("block", block))
    specs: list[Spec] = []
    for t in (batch,) if quick else (batch, prefill_tokens):
        specs += [
            Spec("rms_norm", "rms_norm", (("T", t), ("D", H))),
            Spec("rms_norm", "rms_norm+residual", (("T", t), ("D", H), ("residual", 1))),
            Spec("rope", "rope", (("T", t), ("Hq", Hq), ("Hk", Hk), ("D", D))),
            Spec("silu_mul", "silu_mul", (("T", t), ("I", I))),
        ]
    specs += [
        Spec("w8a16", "w8a16 GEMV", (("M", 1), ("N", I), ("K", H))),
        Spec("w8a16", "w8a16 GEMM", (("M", 128), ("N", I), ("K", H))),
        Spec("w4a16", "w4a16 GEMV up", (("M", 1), ("N", I), ("K", H), ("g", 64)), w4_target, 0),
    ]
    if not quick:
        specs += [Spec("w4a16", "w4a16 GEMV down", (("M", 1), ("N", H), ("K", I), ("g", 64)), w4_target, 0)]
    specs += [Spec("w4a16", "w4a16 GEMM", (("M", 128), ("N", I), ("K", H), ("g", 64)))]
    for t in (batch,) if quick else (batch, prefill_tokens):
        for bits in (16, 8):
            specs.append(Spec("kv_store", f"kv_store {'bf16' if bits == 16 else 'int8'}",
                              (("T", t), ("Hk", Hk), ("D", D), ("block", block), ("kv_bits", bits))))
    specs += [
        Spec("paged_decode", "paged_decode_attention bf16", attn + (("kv_bits", 16),), Target(70), 0),
        Spec("paged_decode", "paged_decode_attention int8", attn + (("kv_bits", 8),), None, 0),
        Spec("paged_prefill", "paged_prefill_attention (torch)",
             (("B", 2), ("new", ctx // 16), ("ctx", ctx // 4), ("Hq", Hq), ("Hk", Hk), ("D", D),
              ("block", block))),
    ]
    return specs


# -------------------------------------------------------- bytes-moved floor (pure)


def rms_norm_bytes(t: int, d: int, itemsize: int = 2, residual: bool = False) -> int:
    """Read x (+ residual) and the weight, write out (+ the new residual)."""
    return (4 if residual else 2) * t * d * itemsize + d * itemsize


def rope_bytes(t: int, hq: int, hk: int, d: int, itemsize: int = 2) -> int:
    """Read and write q and k; read positions (int64) and one f32 cos|sin row per token."""
    return 2 * t * (hq + hk) * d * itemsize + t * 8 + t * d * 4


def silu_mul_bytes(t: int, inter: int, itemsize: int = 2) -> int:
    return 3 * t * inter * itemsize  # read [T, 2I], write [T, I]


def linear_bytes(m: int, n: int, k: int, itemsize: int = 2) -> int:
    return (n * k + m * k + m * n) * itemsize


def w8a16_bytes(m: int, n: int, k: int, itemsize: int = 2) -> int:
    return n * k + n * itemsize + (m * k + m * n) * itemsize  # int8 codes + per-channel scales


def w4a16_bytes(m: int, n: int, k: int, group: int, itemsize: int = 2) -> int:
    groups = -(-k // group)
    kp = groups * group
    return n * kp // 2 + 2 * n * groups * itemsize + (m * k + m * n) * itemsize  # nibbles, scales+zeros


def kv_store_bytes(t: int, hk: int, d: int, itemsize: int = 2, kv_bits: int = 16) -> int:
    """Read k, v and the slots; write both caches (int8: codes + one f32 scale per token-head)."""
    written = 2 * t * hk * (d if kv_bits == 8 else d * itemsize)
    if kv_bits == 8:
        written += 2 * t * hk * 4
    return 2 * t * hk * d * itemsize + t * 8 + written


def kv_read_bytes(tokens: int, hk: int, d: int, itemsize: int = 2, kv_bits: int = 16) -> int:
    """K and V of ``tokens`` cached tokens (int8: codes + f32 scales)."""
    per = hk * d * itemsize if kv_bits == 16 else hk * (d + 4)
    return 2 * tokens * per


def paged_decode_bytes(b: int, ctx: int, hq: int, hk: int, d: int, block: int,
                       itemsize: int = 2, kv_bits: int = 16) -> int:
    """q in, out written, every sequence's K/V and block table read once."""
    table = b * (-(-ctx // block)) * 4 + b * 4
    return 2 * b * hq * d * itemsize + kv_read_bytes(b * ctx, hk, d, itemsize, kv_bits) + table


def paged_prefill_bytes(b: int, new: int, ctx: int, hq: int, hk: int, d: int, block: int,
                        itemsize: int = 2) -> int:
    table = b * (-(-ctx // block)) * 4 + b * 8
    return 2 * b * new * hq * d * itemsize + kv_read_bytes(b * ctx, hk, d, itemsize) + table


def floor_bytes(s: Spec, itemsize: int = 2) -> int:
    """Bytes the op must read + write at least, for a spec's dims."""
    d = s.d()
    if s.op == "rms_norm":
        return rms_norm_bytes(d["T"], d["D"], itemsize, bool(d.get("residual")))
    if s.op == "rope":
        return rope_bytes(d["T"], d["Hq"], d["Hk"], d["D"], itemsize)
    if s.op == "silu_mul":
        return silu_mul_bytes(d["T"], d["I"], itemsize)
    if s.op == "w8a16":
        return w8a16_bytes(d["M"], d["N"], d["K"], itemsize)
    if s.op == "w4a16":
        return w4a16_bytes(d["M"], d["N"], d["K"], d["g"], itemsize)
    if s.op == "kv_store":
        return kv_store_bytes(d["T"], d["Hk"], d["D"], itemsize, d["kv_bits"])
    if s.op == "paged_decode":
        return paged_decode_bytes(d["B"], d["ctx"], d["Hq"], d["Hk"], d["D"], d["block"], itemsize,
                                  d["kv_bits"])
    if s.op == "paged_prefill":
        return paged_prefill_bytes(d["B"], d["new"], d["ctx"], d["Hq"], d["Hk"], d["D"], d["block"],
                                   itemsize)
    raise ValueError(f"floor_bytes: unknown op {s.op!r}")


def floor_us(nbytes: int, bandwidth: float) -> float:
    """Time to move ``nbytes`` at ``bandwidth`` bytes/s, in microseconds."""
    return nbytes / bandwidth * 1e6


def copies_needed(case_bytes: int, flush_bytes: int = FLUSH_BYTES, cap: int = 16) -> int:
    """Input copies to cycle so that consecutive calls never find their data in L2."""
    return max(1, min(cap, -(-flush_bytes // max(case_bytes, 1))))


def inner_calls(est_us: float, sample_us: float = 1000.0, lo: int = 5, hi: int = 200) -> int:
    """Calls per timed sample: enough that a sample lasts ~``sample_us``."""
    return int(min(hi, max(lo, math.ceil(sample_us / max(est_us, 1e-3)))))


# ------------------------------------------------------------ report (pure)


@dataclass
class Row:
    kernel: str
    shape: str
    triton_us: float | None  # the llmsys implementation (Triton, or torch where there is no kernel)
    eager_us: float | None = None
    baselines: list[tuple[str, float]] = field(default_factory=list)
    floor_us: float | None = None
    target: Target | None = None
    note: str = ""
    looped: tuple[str, ...] = ()  # columns ("triton", "eager") timed as an eager loop, not a graph

    @property
    def floor_pct(self) -> float | None:
        if self.floor_us is None or not self.triton_us:
            return None
        return 100.0 * self.floor_us / self.triton_us

    @property
    def speedup(self) -> float | None:
        if not self.baselines or not self.triton_us:
            return None
        return self.baselines[0][1] / self.triton_us

    @property
    def passed(self) -> bool | None:
        return None if self.target is None else self.target.met(self.floor_pct, self.speedup)


@dataclass
class Check:
    kernel: str
    shape: str
    err: float | None  # None: not comparable (no Triton kernel)
    tol: float | None
    ok: bool
    note: str = ""


def _us(v: float | None, mark: bool = False) -> str:
    """Microseconds for the table; ``mark`` adds ``*`` (timed as an eager loop)."""
    if v is None:
        return "-"
    s = f"{v:.1f}" if v >= 10 else f"{v:.2f}"
    return s + ("*" if mark else "")


def format_table(rows: list[Row]) -> str:
    head = "| kernel | shape | triton us | eager us | baseline us | floor us | %floor | target | pass |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        base = "; ".join(f"{n} {_us(u)}" for n, u in r.baselines) or "-"
        pct = "-" if r.floor_pct is None else f"{r.floor_pct:.0f}%"
        tgt = r.target.describe(r.baselines[0][0].rstrip("*") if r.baselines else "baseline") if r.target else "-"
        ok = {None: "-", True: "yes", False: "NO"}[r.passed]
        kernel = r.kernel + (f" ({r.note})" if r.note else "")
        tri, eag = _us(r.triton_us, "triton" in r.looped), _us(r.eager_us, "eager" in r.looped)
        lines.append(f"| {kernel} | {r.shape} | {tri} | {eag} | {base} | "
                     f"{_us(r.floor_us)} | {pct} | {tgt} | {ok} |")
    return "\n".join(lines)


def format_checks(checks: list[Check]) -> str:
    lines = ["| check | shape | max err / max ref | tol | ok |", "|---|---|---|---|---|"]
    for c in checks:
        err = "-" if c.err is None else f"{c.err:.2e}"
        tol = "-" if c.tol is None else f"{c.tol:g}"
        name = c.kernel + (f" ({c.note})" if c.note else "")
        lines.append(f"| {name} | {c.shape} | {err} | {tol} | {'yes' if c.ok else 'NO'} |")
    return "\n".join(lines)


def format_report(env: dict[str, str], rows: list[Row], checks: list[Check]) -> str:
    head = [f"# llmsys kernels on {env.get('gpu', '?')}", ""]
    head += [f"- {k}: {v}" for k, v in env.items() if k != "gpu"]
    notes = ("Times: median of CUDA-event samples, microseconds per call, each sample a CUDA graph "
             "of many calls; `*` = an eager loop instead (the op syncs the host: launch overhead "
             "included). floor = bytes read + written / copy bandwidth; %floor = floor / triton us "
             "(the torch path where there is no Triton kernel). Decode-shape elementwise rows move "
             "kilobytes: they are launch-bound, so their %floor is low by nature.")
    return "\n".join(head + ["", notes, "", format_table(rows), "", "## Correctness (triton vs reference)",
                             "", format_checks(checks), ""])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Check then time every llmsys kernel on a CUDA GPU.")
    p.add_argument("--quick", action="store_true", help="decode shapes only, fewer samples, 4-layer model")
    p.add_argument("--out", default=None,
                   help="also write the Markdown report here (a directory: kernels_gpu_<gpu>.md in it)")
    p.add_argument("--only", default="", help="comma-separated substrings of row names to run")
    p.add_argument("--layers", type=int, default=None, help="decode-step model layers (32; --quick 4)")
    p.add_argument("--samples", type=int, default=None, help="timed samples per measurement (25; --quick 10)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="skip remaining rows after this long (200; --quick 60)")
    p.add_argument("--no-e2e", action="store_true", help="skip the 8B-shaped decode step")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    a = p.parse_args(argv)
    if a.layers is None:
        a.layers = 4 if a.quick else 32
    if a.samples is None:
        a.samples = 10 if a.quick else 25
    if a.max_seconds is None:
        a.max_seconds = 60.0 if a.quick else 200.0
    if a.layers < 1 or a.samples < 1:
        p.error("--layers and --samples must be >= 1")
    a.only = [s.strip() for s in a.only.split(",") if s.strip()]
    return a


def report_path(out: str, gpu: str) -> Path:
    """``--out`` as given, or ``kernels_gpu_<gpu>.md`` inside it when it is (or ends like) a directory."""
    if Path(out).is_dir() or out.endswith("/"):
        slug = "".join(c if c.isalnum() else "_" for c in gpu.lower()).strip("_") or "gpu"
        return Path(out) / f"kernels_gpu_{slug}.md"
    return Path(out)


def selected(name: str, only: list[str]) -> bool:
    return not only or any(s in name for s in only)


def plan_jobs(specs: list[Spec], e2e: bool) -> list[Spec | str]:
    """Run order: rows with targets, then the decode step ("e2e"), then the rest,
    so a run cut short by ``--max-seconds`` still measured what the targets judge."""
    jobs: list[Spec | str] = sorted(specs, key=lambda s: s.priority)  # stable: keeps display order
    if e2e:
        jobs.insert(sum(s.priority == 0 for s in specs), "e2e")
    return jobs


def rel_err(got: Any, want: Any) -> float:
    """max|got - want| / max|want| over tensors (or tuples of tensors)."""
    if isinstance(got, (tuple, list)):
        return max(rel_err(g, w) for g, w in zip(got, want))
    g, w = got.float(), want.float()
    return float((g - w).abs().max() / w.abs().max().clamp_min(1e-6))


def cuda_unavailable_reason() -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available (torch.cuda.is_available() is False)"
    from llmsys.kernels import triton_available

    return None if triton_available() else "triton does not import"


# ------------------------------------------------------------------ GPU parts



@dataclass
class Case:
    """One spec's inputs and callables on a device (see :func:`build_case`)."""

    make: Callable[[], dict]  # a fresh input copy
    run: Callable[[dict, str], Any]  # (inputs, impl) -> output
    has_triton: bool = True
    ref_graphable: bool = True  # the reference never syncs the host
    # each: inputs -> (name, call); the call does the same job another way
    baselines: list[Callable[[dict], tuple[str, Callable[[], Any]]]] = field(default_factory=list)
    compare: Callable[[dict, Any], Any] = lambda a, out: out  # (inputs after run, output) -> tensors


def _linear_baseline(n: int, k: int):
    def setup(a: dict) -> tuple[str, Callable[[], Any]]:
        x = a["x"]
        w = torch.randn(n, k, device=x.device, dtype=x.dtype) * 0.02
        return "F.linear bf16", lambda: torch.nn.functional.linear(x, w)
    return setup


def _bnb_baseline(n: int, k: int, device: torch.device):
    """bitsandbytes nf4 (blocksize 64) matmul, when it imports (CUDA only)."""
    if device.type != "cuda":
        return []
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnbf
    except Exception:
        return []

    def setup(a: dict) -> tuple[str, Callable[[], Any]]:
        x = a["x"]
        qw, state = bnbf.quantize_4bit(torch.randn(n, k, device=x.device, dtype=x.dtype) * 0.02,
                                       blocksize=64, quant_type="nf4")
        return "bnb-nf4", lambda: bnb.matmul_4bit(x, qw.t(), quant_state=state)
    return [setup]


def _sdpa_baseline(b: int, hq: int, hk: int, new: int, ctx: int, d: int):
    """SDPA over a contiguous [B, H, ctx, D] KV (GQA natively if this torch can, else expanded)."""
    F = torch.nn.functional

    def setup(a: dict) -> tuple[str, Callable[[], Any]]:
        q = a["q"].view(b, new, hq, d).transpose(1, 2)  # [B, Hq, new, D]
        k = torch.randn(b, hk, ctx, d, device=q.device, dtype=q.dtype)
        v = torch.randn_like(k)
        mask = None  # decode: the one query sees everything
        if new > 1:  # query i sits at position ctx - new + i: causal, bottom-right aligned
            mask = torch.ones(new, ctx, dtype=torch.bool, device=q.device).tril(ctx - new)
        try:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            return "SDPA", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        except Exception:  # older torch / backend without GQA: expand KV heads (4x the bytes)
            ke, ve = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
            return "SDPA(expanded KV)", lambda: F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask)
    return setup


def build_case(s: Spec, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Case:
    """Random inputs at a spec's dims plus the calls to check and time."""
    from llmsys import kernels as K

    d = s.d()
    F = torch.nn.functional

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    if s.op == "rms_norm":
        t, dim, res = d["T"], d["D"], bool(d.get("residual"))
        base = []
        if hasattr(F, "rms_norm"):
            base = [lambda a: ("F.rms_norm", (lambda x, w, r: lambda: F.rms_norm(
                x if r is None else x + r, (dim,), w, 1e-5))(a["x"], a["w"], a["r"]))]
        return Case(lambda: {"x": rnd(t, dim), "w": 1 + 0.1 * rnd(dim), "r": rnd(t, dim) if res else None},
                    lambda a, impl: K.rms_norm(a["x"], a["w"], 1e-5, a["r"], impl=impl), baselines=base)
    if s.op == "rope":
        t, hq, hk, hd = d["T"], d["Hq"], d["Hk"], d["D"]
        cache = K.build_rope_cache(hd, 8192, 500000.0, None, device)
        return Case(lambda: {"q": rnd(t, hq, hd), "k": rnd(t, hk, hd),
                             "pos": torch.randint(0, 8192, (t,), device=device)},
                    lambda a, impl: K.rope(a["q"], a["k"], a["pos"], cache, impl=impl))
    if s.op == "silu_mul":
        return Case(lambda: {"x": rnd(d["T"], 2 * d["I"])}, lambda a, impl: K.silu_mul(a["x"], impl=impl))
    if s.op == "w8a16":
        m, n, k = d["M"], d["N"], d["K"]
        return Case(lambda: {"x": rnd(m, k), "q": torch.randint(-127, 128, (n, k), device=device,
                                                                dtype=torch.int8),
                             "s": (torch.rand(n, device=device) * 0.01 + 1e-3).to(dtype)},
                    lambda a, impl: K.w8a16_matmul(a["x"], a["q"], a["s"], impl=impl),
                    baselines=[_linear_baseline(n, k)])
    if s.op == "w4a16":
        m, n, k, g = d["M"], d["N"], d["K"], d["g"]
        groups = -(-k // g)

        def make_w4() -> dict:
            codes = torch.randint(0, 16, (n, groups * g), device=device, dtype=torch.uint8)
            return {"x": rnd(m, k), "q": K.pack_int4(codes),
                    "s": (torch.rand(n, groups, device=device) * 0.01 + 1e-3).to(dtype),
                    "z": torch.randint(0, 16, (n, groups), device=device).to(dtype)}
        return Case(make_w4, lambda a, impl: K.w4a16_matmul(a["x"], a["q"], a["s"], a["z"], g, impl=impl),
                    baselines=[_linear_baseline(n, k)] + _bnb_baseline(n, k, device))
    if s.op == "kv_store":
        t, hk, hd, bs, int8 = d["T"], d["Hk"], d["D"], d["block"], d["kv_bits"] == 8
        nblk = -(-t // bs)
        nb = 2 * nblk + 1

        def make_kv() -> dict:
            blocks = torch.randperm(nb - 1, device=device)[:nblk] + 1
            tok = torch.arange(t, device=device)
            cdt = torch.int8 if int8 else dtype
            sc = (lambda: torch.zeros(nb, bs, hk, device=device)) if int8 else (lambda: None)
            return {"k": rnd(t, hk, hd), "v": rnd(t, hk, hd), "slots": blocks[tok // bs] * bs + tok % bs,
                    "kc": torch.zeros(nb, bs, hk, hd, device=device, dtype=cdt),
                    "vc": torch.zeros(nb, bs, hk, hd, device=device, dtype=cdt), "ks": sc(), "vs": sc()}

        def deq(c: torch.Tensor, sc: torch.Tensor | None) -> torch.Tensor:
            return c.float() if sc is None else c.float() * sc[..., None]
        return Case(make_kv, lambda a, impl: K.kv_store(a["k"], a["v"], a["kc"], a["vc"], a["slots"],
                                                        a["ks"], a["vs"], impl=impl),
                    ref_graphable=False,  # boolean-mask indexing syncs
                    compare=lambda a, _: (deq(a["kc"], a["ks"]), deq(a["vc"], a["vs"])))
    if s.op in ("paged_decode", "paged_prefill"):
        b, ctx, hq, hk, hd, bs = d["B"], d["ctx"], d["Hq"], d["Hk"], d["D"], d["block"]
        new = d.get("new", 1)
        int8 = d.get("kv_bits", 16) == 8
        nblk = -(-ctx // bs)
        nb = b * nblk + 1  # block 0 stays unused, like the engine's scratch block

        def make_attn() -> dict:
            a = {"q": rnd(b * new, hq, hd), "ks": None, "vs": None,
                 "tables": (torch.randperm(nb - 1, device=device) + 1).view(b, nblk).to(torch.int32),
                 "lens": torch.full((b,), ctx, device=device, dtype=torch.int32),
                 "qsl": torch.arange(b + 1, device=device, dtype=torch.int32) * new}
            for c, sc in (("kc", "ks"), ("vc", "vs")):
                if int8:
                    a[c] = torch.randint(-127, 128, (nb, bs, hk, hd), device=device, dtype=torch.int8)
                    a[sc] = torch.rand(nb, bs, hk, device=device) * 0.02
                else:
                    a[c] = rnd(nb, bs, hk, hd)
            return a
        base = [_sdpa_baseline(b, hq, hk, new, ctx, hd)]
        if s.op == "paged_decode":
            return Case(make_attn, lambda a, impl: K.paged_decode_attention(
                a["q"], a["kc"], a["vc"], a["tables"], a["lens"], hd ** -0.5, a["ks"], a["vs"], impl=impl),
                ref_graphable=False, baselines=base)  # the reference loops over sequences on the host
        return Case(make_attn, lambda a, impl: K.paged_prefill_attention(
            a["q"], a["kc"], a["vc"], a["tables"], a["lens"], a["qsl"], hd ** -0.5, impl=impl),
            has_triton=False, ref_graphable=False, baselines=base)
    raise ValueError(f"build_case: unknown op {s.op!r}")


def _clone(a: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in a.items()}


def check_case(s: Spec, case: Case, inputs: dict) -> Check:
    """Triton vs reference on clones of one input copy."""
    if not case.has_triton:
        return Check(s.label, s.shape, None, None, True, "no Triton kernel: torch path")
    key = "kv_store_int8" if s.op == "kv_store" and s.d()["kv_bits"] == 8 else s.op
    a_t, a_r = _clone(inputs), _clone(inputs)
    got = case.compare(a_t, case.run(a_t, "triton"))
    want = case.compare(a_r, case.run(a_r, "reference"))
    err, tol = rel_err(got, want), TOLERANCE[key]
    return Check(s.label, s.shape, err, tol, err <= tol)


def _capture(calls: list[Callable[[], Any]]) -> Callable[[], None] | None:
    """A CUDA graph replaying ``calls`` (None when an op cannot be captured)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            calls[0]()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in calls:
                f()
        graph.replay()
        torch.cuda.synchronize()
        return graph.replay
    except Exception:
        torch.cuda.synchronize()
        return None


def time_calls(fns: list[Callable[[], Any]], samples: int, graph: bool = True) -> tuple[float, bool]:
    """(median microseconds per call, whether a CUDA graph was used). Calls cycle
    through ``fns`` (one per input copy) so the L2 never holds the next call's data."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for f in fns:
        f()
    end.record()
    end.synchronize()
    inner = inner_calls(start.elapsed_time(end) * 1000 / len(fns))
    calls = [fns[i % len(fns)] for i in range(inner)]
    run = _capture(calls) if graph else None
    used_graph = run is not None
    if run is None:
        def run() -> None:
            for f in calls:
                f()
    return _median_event_us(run, samples) / inner, used_graph


def _median_event_us(run: Callable[[], None], samples: int) -> float:
    """Median GPU time of ``run()`` over ``samples`` calls, from CUDA events (us)."""
    events = []
    for _ in range(samples):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        run()
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1000 for s, e in events)


def measure_copy_bandwidth(nbytes: int, samples: int) -> float:
    """Bytes/s of a device-to-device copy (counting the read and the write)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us, _ = time_calls([lambda: dst.copy_(src)], samples, graph=False)
    return 2 * nbytes / (us * 1e-6)


def measure_spec(s: Spec, device: torch.device, bw: float, samples: int) -> tuple[Row, Check]:
    case = build_case(s, device)
    nbytes = floor_bytes(s)
    copies = [case.make() for _ in range(copies_needed(nbytes))]
    chk = check_case(s, case, copies[0])
    impl = "triton" if case.has_triton else "auto"
    t_us, t_graph = time_calls([lambda a=a: case.run(a, impl) for a in copies], samples, case.has_triton)
    e_us, notes, looped = None, [], [] if t_graph else ["triton"]
    if case.has_triton:
        e_us, e_graph = time_calls([lambda a=a: case.run(a, "reference") for a in copies], samples,
                                   case.ref_graphable)
        looped += [] if e_graph else ["eager"]
    else:
        notes.append("torch path, no Triton kernel")
    bases = []
    for setup in case.baselines:
        try:
            pairs = [setup(a) for a in copies]
            us, g = time_calls([c for _, c in pairs], samples)
            bases.append((pairs[0][0] + ("" if g else "*"), us))
        except Exception as e:  # a baseline library failing must not lose the row
            notes.append(f"baseline failed: {type(e).__name__}")
    row = Row(s.label, s.shape, t_us, e_us, bases, floor_us(nbytes, bw), s.target, "; ".join(notes),
              tuple(looped))
    return row, chk


# -------------------------------------------------------------- decode step


def build_random_model(m: ModelShape, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A llmsys DecoderModel of shape ``m`` with random weights made on ``device``
    (meta skeleton, then each parameter created in place: no float32 copy)."""
    from llmsys.engine.loader.common import set_tensor, skip_init
    from llmsys.engine.models.base import DecoderModel, TransformerArgs, rope_cache

    args = TransformerArgs(
        vocab_size=m.vocab, hidden_size=m.hidden, intermediate_size=m.intermediate,
        num_hidden_layers=m.layers, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
        head_dim=m.head_dim, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192)
    with torch.device("meta"), skip_init():
        model = DecoderModel(args)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in list(model.named_parameters()):
        t = torch.empty(p.shape, device=device, dtype=dtype)
        set_tensor(model, name, t.fill_(1.0) if name.endswith("norm.weight") else t.normal_(0, 0.02, generator=gen))
    model.rope_cache = rope_cache(args, device)
    return model.eval()


class DecodeHarness:
    """Prefill then greedy-decode one sequence the way the engine's runner does."""

    def __init__(self, model, device: torch.device, max_ctx: int, block: int = 16):
        from llmsys.engine.attention import make_backend
        from llmsys.engine.kv_cache import KVCacheSpec, make_kv_pool

        a = model.args
        self.model, self.device, self.block = model, device, block
        nblk = -(-max_ctx // block)
        dtype = model.lm_head.weight.dtype
        self.kv = make_kv_pool(KVCacheSpec(a.num_hidden_layers, nblk + 1, block, a.num_key_value_heads,
                                           a.head_dim, dtype), device)
        self.attn = make_backend(self.kv, device, block)
        self.table = list(range(1, nblk + 1))
        self.len = 0
        self.logits: torch.Tensor | None = None

    def inputs(self, ids: list[int]):
        """(input ids, positions, metadata) for appending ``ids`` to the sequence."""
        n, total = len(ids), self.len + len(ids)
        meta = self.attn.metadata([n], [total], [self.table[: -(-total // self.block)]])
        pos = torch.arange(self.len, total, device=self.device)
        return torch.tensor(ids, device=self.device), pos, meta

    @torch.inference_mode()
    def feed(self, ids: list[int]) -> int:
        """Run ``ids`` (a prompt, or one decoded token); return the greedy next token."""
        x, pos, meta = self.inputs(ids)
        h = self.model(x, pos, self.attn, meta)
        self.logits = self.model.compute_logits(h[-1:]).float()  # [1, V]
        self.len += len(ids)
        return int(self.logits.argmax(-1)[0])


def _graph_step_us(h: DecodeHarness, tok: int, samples: int) -> float:
    """One decode step replayed as a CUDA graph (same metadata each replay)."""
    x, pos, meta = h.inputs([tok])
    with torch.inference_mode():
        run = _capture([lambda: h.model.compute_logits(h.model(x, pos, h.kv, meta))])
        if run is None:
            raise RuntimeError("the decode step could not be captured")
        return _median_event_us(run, samples)


def measure_decode(m: ModelShape, device: torch.device, bw: float, steps: int, samples: int,
                   prompt: int = 128) -> tuple[list[Row], list[Check]]:
    model = build_random_model(m, device, torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    checks = [Check("model params == ModelShape.params()", f"L={m.layers}", None, None, n == m.params(),
                    f"{n} vs {m.params()}")]
    h = DecodeHarness(model, device, prompt + steps + 8)
    tok = h.feed(torch.randint(0, m.vocab, (prompt,)).tolist())
    for _ in range(3):
        tok = h.feed([tok])
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tok = h.feed([tok])  # ends in a host sync (the greedy token), like the engine
        times.append(time.perf_counter() - t0)
    checks.append(Check("decode step logits finite", f"L={m.layers}", None, None,
                        bool(torch.isfinite(h.logits).all())))
    step_us = statistics.median(times) * 1e6
    fl = floor_us(m.decode_step_bytes(1, h.len), bw)
    shape = f"B=1 ctx={h.len} L={m.layers} H={m.hidden} I={m.intermediate} V={m.vocab}"
    rows = [Row(f"decode step {m.layers}L bf16 (llmsys eager)", shape, step_us, None, [], fl, Target(75),
                f"{1e6 / step_us:.0f} tok/s, floor {1e6 / fl:.0f} tok/s")]
    try:
        g_us = _graph_step_us(h, tok, samples)
        rows.append(Row("decode step (CUDA graph replay)", shape, g_us, None, [], fl, None,
                        f"{1e6 / g_us:.0f} tok/s"))
    except Exception as e:
        rows.append(Row("decode step (CUDA graph replay)", shape, None, note=f"failed: {type(e).__name__}"))
    return rows, checks


# -------------------------------------------------------------------- driver


def environment(args: argparse.Namespace) -> dict[str, str]:
    import triton

    p = torch.cuda.get_device_properties(0)
    try:
        import bitsandbytes
        bnb = bitsandbytes.__version__
    except Exception:
        bnb = "not importable"
    return {"gpu": torch.cuda.get_device_name(0), "capability": f"sm_{p.major}{p.minor}",
            "memory": f"{p.total_memory / 2**30:.0f} GiB", "torch": torch.__version__,
            "cuda": str(torch.version.cuda), "triton": triton.__version__, "bitsandbytes": bnb,
            "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
            "mode": "quick" if args.quick else "full"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reason = cuda_unavailable_reason()
    if reason:
        print(f"kernels_gpu: {reason}; nothing measured (run on an NVIDIA GPU machine)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    env = environment(args)
    out = report_path(args.out, env["gpu"]) if args.out else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
    bw = measure_copy_bandwidth((512 if args.quick else 1024) * MIB, args.samples)
    env["copy bandwidth"] = f"{bw / 1e9:.0f} GB/s (device-to-device copy, read + write counted)"
    specs = [s for s in kernel_specs(quick=args.quick) if selected(s.key, args.only)]
    e2e = not args.no_e2e and selected("decode step", args.only)
    jobs = plan_jobs(specs, e2e)
    done: dict[str, list[Row]] = {}
    checks: list[Check] = []

    def report() -> str:
        order = [s.key for s in specs] + ["e2e"]
        return format_report(env, [r for k in order for r in done.get(k, [])], checks)

    for job in jobs:
        key = "e2e" if job == "e2e" else job.key
        name, shape = ("decode step", "") if job == "e2e" else (job.label, job.shape)
        if time.perf_counter() - t0 > args.max_seconds:
            done[key] = [Row(name, shape, None, note="skipped: --max-seconds")]
            continue
        try:
            if job == "e2e":
                m = ModelShape(layers=args.layers)
                rows, cks = measure_decode(m, dev, bw, 16 if args.quick else 64, args.samples)
                done[key] = rows
                checks.extend(cks)
            else:
                row, chk = measure_spec(job, dev, bw, args.samples)
                done[key] = [row]
                checks.append(chk)
        except Exception as e:
            traceback.print_exc(limit=3)
            msg = f"error: {type(e).__name__}: {e}".replace("|", "/").replace("\n", " ")[:160]
            done[key] = [Row(name, shape, None, note=msg)]
            checks.append(Check(name, shape, None, None, False, msg))
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        for r in done[key]:
            print(f"[{time.perf_counter() - t0:6.1f}s] {r.kernel}: {_us(r.triton_us)} us, "
                  f"%floor {'-' if r.floor_pct is None else f'{r.floor_pct:.0f}'} {r.note}", file=sys.stderr)
        if out:
            out.write_text(report())  # partial results survive a timeout
    text = report()
    print(text)
    if out:
        out.write_text(text)
        print(f"kernels_gpu: report written to {out}", file=sys.stderr)
    rows = [r for rs in done.values() for r in rs]
    failed = any(not c.ok for c in checks)
    missed = any(r.passed is False for r in rows)
    return 1 if failed or (args.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
