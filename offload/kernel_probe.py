"""The kernel probe: what one stored weight format costs on the matmul kernels the engine runs for it.

A roofline (bytes / RAM bandwidth, FLOPs / GEMM peak) is no prediction for kernels that unpack int4 codes,
quantize activations per 32 columns or tile prompts their own way: per format the same weights cost
several times more or less than their bytes say. So the planner's figures come from timing the real
layers (``quant``'s ``QuantLinear`` formats, ``kernels.run_linear`` for dense weights), each on one row
(a decode step), on :attr:`ProbeSettings.kernel_rows` rows (a prompt chunk) and on a tiny matrix (the
fixed cost of a call), over a working set of :attr:`ProbeSettings.kernel_bytes` copies so the weights
come from beyond the core's own caches. :func:`probe_kernels` returns the fit
``seconds = call_s + s_per_byte * bytes + s_per_flop * flops of the rows after the first`` per format; ``offload.bandwidth`` keeps it
in the machine record under :func:`kernel_key`.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import torch

from llmsys.offload import bandwidth
from llmsys.offload.bandwidth import FormatCost, KernelCosts, ProbeSettings, torch_threads

# The probe's matrix: a mid-size projection, K a multiple of 256 (the K-quants' super-blocks).
PROBE_N, PROBE_K = 2048, 1024
TINY_N, TINY_K = 64, 256  # a call's fixed cost: a matrix too small for its bytes to count
MAX_COPIES = 64  # a format whose layer is tiny still runs at most this many calls per timing
PASS_S = 0.004  # seconds one timed one-row pass over the copies may take, about

Runner = Callable[[torch.Tensor], torch.Tensor]


def _dense(dtype: torch.dtype) -> Callable[[torch.Tensor], tuple[Runner, int, str]]:
    """A plain weight in ``dtype`` through the kernel ``Linear`` picks for it (oneDNN prepacked for float32,
    the C bf16 GEMV for bfloat16)."""
    from llmsys import kernels

    def build(w: torch.Tensor) -> tuple[Runner, int, str]:
        wt = w.to(dtype).contiguous()
        nbytes = wt.numel() * wt.element_size()
        packed = kernels.prepack(wt)
        wt = packed if packed is not None else wt
        kern = kernels.linear_kernel(wt)
        return (lambda x: kernels.run_linear(kern, x, wt)), nbytes, kern.value

    return build


def _quant(make: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], tuple[Runner, int, str]]:
    """A ``QuantLinear`` built by ``make(weight)``, run through its own ``forward`` (what a projection calls)."""

    def build(w: torch.Tensor) -> tuple[Runner, int, str]:
        layer = make(w)
        return layer, layer.nbytes(), layer.kernel.name

    return build


def _int4(w: torch.Tensor):
    from llmsys.quant import Int4Linear

    return Int4Linear.from_float(w, group_size=64)


def _int4_offset(w: torch.Tensor):
    """GGUF Q4_1 as kept: codes, float32 scales and offsets per 32 columns."""
    from llmsys.quant import Int4Linear
    from llmsys.quant.int4 import quantize_int4

    q, s, _ = quantize_int4(w, 32)
    return Int4Linear.from_quantized({"qweight": q, "scales": s.float(), "zeros": torch.zeros_like(s, dtype=torch.float32),
                                      "offsets": -8 * s.float()})


def _int4_k(w: torch.Tensor):
    """GGUF Q4_K as kept: codes with the super-blocks' 6-bit scales and fp16 factors (``kernels.KScales``)."""
    from llmsys.quant import Int4Linear
    from llmsys.quant.int4 import quantize_int4

    q, s, _ = quantize_int4(w, 32)
    n, g = s.shape
    gen = torch.Generator().manual_seed(1)
    sc = torch.randint(1, 64, (g, n), dtype=torch.uint8, generator=gen)
    d = torch.full((g // 8, n), 1e-4, dtype=torch.float16)
    return Int4Linear.from_quantized({"qweight": q, "zeros": torch.zeros(n, g), "k_sc": sc, "k_m": sc.clone(),
                                      "k_d": d, "k_dmin": d.clone()})


def _int8(w: torch.Tensor):
    from llmsys.quant import Int8Linear

    return Int8Linear.from_float(w)


def _int8_g32(w: torch.Tensor):
    from llmsys.quant import Int8BlockLinear

    return Int8BlockLinear.from_float(w)


def _int8_g16(w: torch.Tensor):
    """GGUF Q6_K as kept: int8 codes, int8 scales per 16 columns, fp16 factors per 256."""
    from llmsys.quant import Int8BlockLinear
    from llmsys.quant.int8_block import quantize_int8_block

    q, d = quantize_int8_block(w)
    n, k = q.shape
    return Int8BlockLinear(q, torch.ones(k // 16, n, dtype=torch.int8), None,
                           super_scales=d[: k // 256].to(torch.float16))


def _int8_g32_offset(w: torch.Tensor):
    """GGUF Q5_K as kept: int8 codes with float32 scales and offsets per 32 columns."""
    from llmsys.quant import Int8BlockLinear
    from llmsys.quant.int8_block import quantize_int8_block

    q, d = quantize_int8_block(w)
    return Int8BlockLinear(q, d.float(), None, offsets=torch.zeros_like(d, dtype=torch.float32))


def _nf4(w: torch.Tensor):
    from llmsys.quant import NF4Linear

    return NF4Linear.from_float(w)


def _fp8(w: torch.Tensor):
    from llmsys.quant import FP8Linear

    return FP8Linear.from_float(w)


# Format name (the planner's key: ``offload.plan.UnitShape.formats``) -> how to build its layer.
BUILDERS: dict[str, Callable[[torch.Tensor], tuple[Runner, int, str]]] = {
    "float32": _dense(torch.float32),
    "bfloat16": _dense(torch.bfloat16),
    "int8": _quant(_int8),
    "int8:g32": _quant(_int8_g32),
    "int8:g16": _quant(_int8_g16),
    "int8:g32+offset": _quant(_int8_g32_offset),
    "int4": _quant(_int4),
    "int4+offset": _quant(_int4_offset),
    "int4:k": _quant(_int4_k),
    "nf4": _quant(_nf4),
    "fp8": _quant(_fp8),
}


def _best(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm-up: the first call's allocations, packing, page faults
    best = float("inf")
    for _ in range(max(repeat, 1)):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return max(best, 1e-9)


def _per_call(runners: list[Runner], x: torch.Tensor, repeat: int) -> float:
    """The mean over ``runners`` of each one's fastest call on ``x`` in ``repeat`` passes (after a warm-up pass).

    Why per call: on a machine other programs keep busy, a pass's best still holds a stall or two; a call's
    best over a few passes rarely does, and the calls still run in order, each reading its own copy."""
    best = [float("inf")] * len(runners)
    for r in runners:
        r(x)
    for _ in range(max(repeat, 1)):
        for i, r in enumerate(runners):
            t = time.perf_counter()
            r(x)
            best[i] = min(best[i], time.perf_counter() - t)
    return max(sum(best) / len(best), 1e-9)


def probe_format(name: str, probe: ProbeSettings, gen: torch.Generator) -> FormatCost:
    """Time format ``name`` on one row, on ``probe.kernel_rows`` rows and on a tiny matrix; fit the costs."""
    build = BUILDERS[name]
    n, k = probe.kernel_shape
    w = torch.randn(n, k, generator=gen) * 0.02
    first, nbytes, kernel = build(w)
    act = torch.float32 if name == "float32" else torch.bfloat16
    x1 = torch.randn(1, k, generator=gen).to(act)
    with torch.inference_mode():
        single = _best(lambda: first(x1), 1)
    # Copies enough to reach beyond the core's caches, few enough that a pass stays short (a format that
    # dequantizes per call is bound by that work, not by where its bytes come from).
    copies = max(1, min(MAX_COPIES, probe.kernel_bytes // max(nbytes, 1), int(PASS_S / single)))
    runners = [first] + [_copy(first, build, w) for _ in range(copies - 1)]
    del w
    tiny, _, _ = build(torch.randn(TINY_N, TINY_K, generator=gen) * 0.02)
    rows = max(2, probe.kernel_rows)
    xp = torch.randn(rows, k, generator=gen).to(act)
    xt = torch.randn(1, TINY_K, generator=gen).to(act)
    with torch.inference_mode():
        call = _per_call(16 * [tiny], xt, probe.repeat)
        one = _per_call(runners, x1, max(probe.repeat, 3))
        many = _per_call(runners, xp, max(1, probe.repeat // 2))
    # The first row is priced by the bytes it reads, each further row by its FLOPs: no difference of noisy
    # timings is subtracted from the one-row figure (a busy machine inflates the long calls most).
    s_per_flop = max(0.0, many - one) / (2.0 * n * k * (rows - 1))
    s_per_byte = max(one - call, one / 2) / nbytes  # (a call's fixed cost never more than half the row)
    return FormatCost(s_per_byte=s_per_byte, s_per_flop=s_per_flop, call_s=call,
                      bytes_per_weight=nbytes / (n * k), kernel=kernel)


def _copy(first: Runner, build, w: torch.Tensor) -> Runner:
    """Another layer like ``first`` at another address (a deep copy: no second quantization)."""
    if isinstance(first, torch.nn.Module):
        return copy.deepcopy(first)
    runner, _, _ = build(w)
    return runner


def probe_kernels(probe: ProbeSettings, formats: tuple[str, ...] | None = None) -> KernelCosts:
    """Every format's :class:`FormatCost` (``formats``: those only) on ``probe.thread_count()`` threads."""
    threads = probe.thread_count()
    gen = torch.Generator().manual_seed(0)
    others, start = bandwidth.others_cpu_seconds(), time.perf_counter()
    out: dict[str, FormatCost] = {}
    with torch_threads(threads):
        for name in formats or tuple(BUILDERS):
            out[name] = probe_format(name, probe, gen)
    elapsed = time.perf_counter() - start
    load = max(0.0, bandwidth.others_cpu_seconds() - others) / elapsed if elapsed >= bandwidth.LOAD_MIN_SECONDS else 0.0
    return KernelCosts(key=bandwidth.kernel_key(threads), formats=out, probe_load=round(load, 2), seconds=round(elapsed, 2))
