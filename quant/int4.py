"""Asymmetric group-wise int4 (W4A16) in the canonical llmsys layout.

Canonical layout (shared with ``llmsys.kernels`` and the AWQ/GPTQ converters) of ``W [N, K]``, group ``g``
in {32, 64, 128}, K zero-padded to ``Kp = G * g``: ``qweight uint8 [N, Kp/2]`` (byte j of row n: k = 2j in
the low nibble, 2j+1 in the high), ``scales`` / ``zeros [N, G]`` (bf16 ours, fp16 AWQ/GPTQ; zeros
integer-valued), ``w[n, k] = (q - zeros[n, k // g]) * scales[n, k // g]``; or float32 ``offsets [N, G]``
with float32 scales and zeros 0, ``w = q * scale + offset``, keeping GGUF Q4_K / Q4_1 exact. On the CPU
the codes sit in llmsys's 64-row tiling (``kernels.cpu_int4.pack_cpu_int4``: the same bytes on every
CPU, unlike torch's int4pack), a nibble permutation, so ``state_dict()`` round-trips exactly. Every row of
x takes the C a8 GEMV (``int4_gemv_a8``: x to int8 per 32 columns, integer dots; docs/benchmarks.md), so
a row's bits never depend on its batch, chunk or step (``KernelFamily``); without the C kernels every
batch dequantizes to bf16 and GEMMs in torch (slower; the engine's notice says so).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmsys.kernels import CPU_INT4_BLOCK_N as CPU_BLOCK_N  # the CPU layout tiles rows in blocks of 64
from llmsys.kernels import (
    DecodeWeight,
    KScales,
    int4_decode_weight,
    int4k_decode_weight,
    int4k_gemv_a8,
    dequant_cpu_int4,
    int4_gemv_a8,
    mm_bf16,
    pack_cpu_int4,
    pack_int4,  # the canonical layout lives with its kernels
    quant_matmul_support,
    transpose_bf16,
    unpack_cpu_int4,
    unpack_int4,
    w4a16_matmul,
)
from llmsys.kernels.common.errors import CheckpointError
from llmsys.quant import base
from llmsys.quant.base import (
    TORCH_DEQUANT,
    KernelFamily,
    MatmulKernel,
    QuantLinear,
    check_weight,
    quantize_rows,
    require,
)

GROUP_SIZES = (32, 64, 128)
# The most rows of x the fused decode layers take for int4 weights (more run layer by layer, through
# the same a8 GEMV: every row of a C-kernel int4 layer does, cpu_qgemv.int4_gemv_a8).
PACKED_MAX_ROWS = 28
# Without the C kernels every batch dequantizes and GEMMs. Bigger weights (a 151936-row LM head when every position is scored) dequantize
# in row chunks of at most this many bf16 bytes, so the transient copy stays small.
DEQUANT_CHUNK_BYTES = 16 << 20


def quantize_int4(weight: torch.Tensor, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric int4: ``[N, K] -> (qweight, scales bf16 [N,G], zeros bf16 [N,G])``.

    Rows are quantized independently, in chunks of bounded size (:func:`quantize_rows`).
    """
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    return quantize_rows(weight, lambda rows: _quantize_int4_rows(rows, group_size))


def _quantize_int4_rows(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`quantize_int4` on one chunk of rows.

    Range per group is [min(w, 0), max(w, 0)] (as GPTQ does) so the integer
    zero point is always in 0..15; the scale is rounded to bf16 first and q is
    computed against the rounded scale, so the stored tensors reproduce the
    grid exactly; it is rounded *up* so the grid still spans the range.
    Worst-case error per element: scale/2 ~= (max - min)/30.
    """
    n, k = weight.shape
    g = group_size
    n_groups = -(-k // g)
    w = F.pad(weight.float(), (0, n_groups * g - k)).view(n, n_groups, g)  # [N, G, g]
    wmin = w.amin(dim=2).clamp(max=0.0)
    wmax = w.amax(dim=2).clamp(min=0.0)
    scales = bf16_ceil((wmax - wmin).clamp_min(1e-8) / 15)  # [N, G]
    s = scales.float()
    zeros = torch.round(-wmin / s).clamp_(0, 15)  # [N, G]
    q = (torch.round(w / s[..., None]) + zeros[..., None]).clamp_(0, 15)  # [N, G, g]
    return pack_int4(q.view(n, n_groups * g)), scales, zeros.to(torch.bfloat16)


def bf16_ceil(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 up to a bf16 value >= x (x > 0), so 15 (or 127) steps still cover the range."""
    return (x * (1 + 2**-8)).to(torch.bfloat16)  # bf16 rounding error <= 2^-9 relative


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    in_features: int | None = None, dtype: torch.dtype = torch.float32,
                    offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Canonical reference dequantization: ``-> [N, in_features]`` (defaults to Kp)."""
    n, n_groups = scales.shape
    q = unpack_int4(qweight).float().view(n, n_groups, -1)  # [N, G, g]
    if offsets is not None:  # w = q * scale + offset (float32, GGUF's order: the product rounded, then added)
        w = q * scales.float()[..., None] + offsets.float()[..., None]
    else:
        w = (q - zeros.float()[..., None]) * scales.float()[..., None]
    w = w.reshape(n, -1)
    return w[:, : (in_features or w.shape[1])].to(dtype)


def int4_kernel(packed_cpu: bool, device: torch.device, offsets: bool = False) -> MatmulKernel:
    """The kernel family of an int4 layer, from its layout, its device and the C kernels' build.

    CPU tiling: the C a8 GEMV for every row where the C kernel is loaded, else the torch
    dequantization + bf16 GEMM. Canonical layout: Triton on CUDA (not for float offsets, which its
    kernel does not read), dequantize + ``F.linear`` elsewhere.
    """
    if packed_cpu:
        c = quant_matmul_support()
        if not c.available:
            return MatmulKernel(KernelFamily.TORCH_INT4_DENSE)
        return MatmulKernel(KernelFamily.C_INT4, c.level)
    return MatmulKernel(KernelFamily.TRITON_W4A16) if device.type == "cuda" and not offsets else TORCH_DEQUANT


class Int4Linear(QuantLinear):
    """W4A16 linear in the canonical int4 layout (see module docstring).

    Two modes, chosen at construction from the tensors' device (with the kernel family, :func:`int4_kernel`,
    kept in ``kernel``). ``packed_cpu``: ``packed uint8`` (the CPU tiling, rows padded to 64),
    ``scales_zeros bf16 [G, Np, 2]`` = (scale, (8 - zero) * scale) for bf16 scales (else ``scales_orig [N, G]``
    only), ``zeros_u8 [N, G]`` and, with the C GEMV, ``zeros_gm [G, N]``; it computes in bf16 (float32 cast in
    and out): every row the C a8 GEMV where built, else ``dequant_cpu_int4`` (exactly
    ``dequantize(torch.bfloat16)``) and a bf16 GEMM. ``canonical`` (GPU, or ``prefer_packed=False``):
    ``qweight``/``scales``/``zeros``, dequantize + GEMM in the input dtype. ``kscales`` (GGUF Q4_K,
    :class:`~llmsys.kernels.KScales`): scales and offsets made from them; the packed mode holds only those
    (``k_sc`` ...). ``offsets`` (GGUF Q4_K / Q4_1): kept group-major (``offsets_gm [G, N]``) beside
    ``scales_orig``, the zero points a stride-0 view of one 0. ``state_dict()`` always yields the canonical
    tensors (``qweight``, ``scales``, ``zeros``, ``offsets`` when present, ``bias``).
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor | None, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None, in_features: int | None = None,
                 prefer_packed: bool = True, perm: torch.Tensor | None = None,
                 input_scale: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                 kscales: KScales | None = None) -> None:
        if kscales is not None:  # the float scales and offsets are Q4_K's stored ones multiplied out
            scales, offsets = kscales.scales(), kscales.offsets()
        n, half_kp = qweight.shape
        kp = 2 * half_kp
        n_groups = scales.shape[1]
        if tuple(scales.shape) != (n, n_groups) or tuple(zeros.shape) != (n, n_groups) or kp % n_groups:
            raise CheckpointError(
                f"int4 tensors disagree: qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)}, "
                f"zeros {tuple(zeros.shape)}; expected qweight [N, Kp/2], scales/zeros [N, Kp/group]"
            )
        if offsets is not None and (tuple(offsets.shape) != (n, n_groups) or offsets.dtype != torch.float32
                                    or scales.dtype != torch.float32 or bool(torch.any(zeros != 0))):
            raise CheckpointError(
                f"int4 offsets {offsets.dtype} {tuple(offsets.shape)} need float32 [N, G] = [{n}, {n_groups}] "
                f"beside float32 scales (got {scales.dtype}) and zeros 0")
        group_size = kp // n_groups
        if group_size not in GROUP_SIZES:
            raise CheckpointError(f"int4 group size {group_size} unsupported; expected one of {GROUP_SIZES}")
        k = kp if in_features is None else int(in_features)
        if not kp - group_size < k <= kp:
            raise CheckpointError(f"int4 in_features {k} does not fit padded width {kp} (group {group_size})")
        zeros_int = bool(torch.all((zeros == torch.round(zeros)) & (zeros >= 0) & (zeros <= 15)))
        packed_cpu = prefer_packed and qweight.device.type == "cpu" and zeros_int
        super().__init__(k, n, bias, int4_kernel(packed_cpu, qweight.device, offsets is not None))
        self.mode = "packed_cpu" if packed_cpu else "canonical"
        # A dequantization buffer shared by the model's layers (kernels.cpu_int4.Scratch), set by
        # an inference engine (DecoderModel.share_scratch); None: a fresh tensor per prefill GEMM.
        self.scratch = None
        self.group_size = group_size
        self.padded_in_features = kp
        # Act-order (GPTQ desc_act) checkpoints: stored column j is input feature
        # perm[j]; forward gathers x[..., perm] so groups are contiguous.
        if perm is not None and tuple(perm.shape) != (k,):
            raise CheckpointError(f"int4 perm has shape {tuple(perm.shape)}, expected ({k},)")
        self.register_buffer("perm", None if perm is None else perm.to(torch.int32).contiguous())
        # AWQ scales that had no preceding op to fold into: forward multiplies
        # the input (original feature order) by input_scale [K] first.
        if input_scale is not None and tuple(input_scale.shape) != (k,):
            raise CheckpointError(f"int4 input_scale has shape {tuple(input_scale.shape)}, expected ({k},)")
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().contiguous())
        if self.mode == "canonical":
            self.register_buffer("qweight", qweight.to(torch.uint8).contiguous())  # [N, Kp/2]
            self.register_buffer("scales", scales.contiguous())  # [N, G]
            self.register_buffer("zeros", zeros.contiguous())  # [N, G]
            self.register_buffer("offsets", None if offsets is None else offsets.contiguous())  # [N, G]
            return
        self._scale_dtype = scales.dtype
        np_ = -(-n // CPU_BLOCK_N) * CPU_BLOCK_N
        packed = _pack_cpu_int4(qweight, np_)  # uint8 [Np, Kp/2]
        self.register_buffer("packed", packed)
        # bf16 scales live in scales_zeros (the kernels read them in place); scales of another dtype
        # (fp16: AWQ, GPTQ, GGUF Q4_0) only in scales_orig, which the kernels read as they are --
        # a bf16 copy beside them would cost 4 bytes per group (25% of the codes at g32) for nothing.
        sz = None
        if scales.dtype == torch.bfloat16:
            s = F.pad(scales.float(), (0, 0, 0, np_ - n))  # [Np, G]
            z = F.pad(zeros.float(), (0, 0, 0, np_ - n), value=8.0)
            sz = torch.stack([s.t(), ((8.0 - z) * s).t()], dim=-1).to(torch.bfloat16).contiguous()  # [G, Np, 2]
        self.register_buffer("scales_zeros", sz)
        c_kernels = self.kernel.family is not KernelFamily.TORCH_INT4_DENSE
        if offsets is not None:  # zeros all 0 and never read: one byte, viewed at every [n, g]
            nothing = torch.zeros(1, dtype=torch.uint8)
            self.register_buffer("zeros_u8", nothing.expand(n, n_groups), persistent=False)  # no weight bytes
            self.register_buffer("zeros_gm", nothing.expand(n_groups, n), persistent=False)
        else:
            self.register_buffer("zeros_u8", zeros.to(torch.uint8).contiguous())  # [N, G]
            # The decode GEMV reads one group's zeros for 64 rows at once: a group-major copy
            # (N * G bytes, ~3% of the codes at g=64) lets it load them as one vector (~1.4x faster).
            self.register_buffer("zeros_gm", self.zeros_u8.t().contiguous() if c_kernels else None)  # [G, N]
        # GGUF Q4_K's scales as stored (kernels.KScales: 6-bit sc / m per group, fp16 d / dmin per 8 groups):
        # held instead of the float32 scales and offsets they multiply out to (0.58 bytes a weight, not 0.75).
        compact = kscales is not None and group_size == 32 and kp % 256 == 0 and c_kernels
        for name, t in zip(("k_sc", "k_m", "k_d", "k_dmin"), (kscales.sc, kscales.m, kscales.d, kscales.dmin)
                           if compact else (None,) * 4):
            self.register_buffer(name, None if t is None else t.contiguous())  # [G, N] / [G / 8, N]
        self.register_buffer("offsets_gm", None if offsets is None or compact else offsets.t().contiguous())  # [G, N]
        # The canonical scales' exact values: bf16 scales are recoverable from scales_zeros; any other
        # dtype (fp16: AWQ, GPTQ, GGUF Q4_0) is kept as it is, group-major (an [N, G] view of a [G, N]
        # tensor), so the C kernels load a group's scales for 16/64 rows as one vector: in the row-major
        # layout they gathered and converted them one by one, 3x slower decode (Qwen2.5-0.5B shape, g32).
        self.register_buffer(
            "scales_orig", None if scales.dtype == torch.bfloat16 or compact else scales.t().contiguous().t()
        )

    # --- constructors -------------------------------------------------------
    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, spec=None,
                   group_size: int | None = None) -> "Int4Linear":
        check_weight(weight, bias)
        g = group_size or (spec.group_size if spec is not None else 64)
        qweight, scales, zeros = quantize_int4(weight, g)
        return cls(qweight, scales, zeros, bias, in_features=weight.shape[1])

    @classmethod
    def from_quantized(cls, tensors: dict[str, torch.Tensor], in_features: int | None = None,
                       prefer_packed: bool = True) -> "Int4Linear":
        """Rebuild from canonical tensors; ``in_features`` defaults to the padded width."""
        if "k_sc" in tensors:  # GGUF Q4_K's stored scales, group-major: the float scales are made from them
            (qweight, zeros), ks = require(tensors, ("qweight", "zeros"), "int4"), KScales(
                *require(tensors, ("k_sc", "k_m", "k_d", "k_dmin"), "int4"))
            scales = None
        else:
            (qweight, scales, zeros), ks = require(tensors, ("qweight", "scales", "zeros"), "int4"), None
        return cls(qweight, scales, zeros, tensors.get("bias"), in_features, prefer_packed, tensors.get("perm"),
                   tensors.get("input_scale"), tensors.get("offsets"), ks)

    @classmethod
    def cat_rows(cls, layers: list[QuantLinear]) -> "Int4Linear | None":
        """Rows concatenated, for CPU-packed layers of one group size, input width, column
        permutation and input scale whose row counts are multiples of 64: the packed layout
        tiles rows in blocks of 64, and the C GEMV and the dequantization compute each row alone."""
        first = layers[0]
        same = all(
            type(m) is cls and m.mode == "packed_cpu" and m.out_features % CPU_BLOCK_N == 0
            and (m.group_size, m.in_features, m.padded_in_features) == (first.group_size, first.in_features,
                                                                          first.padded_in_features)
            and _same_or_none(m.perm, first.perm) and _same_or_none(m.input_scale, first.input_scale)
            and (m.bias is None) == (first.bias is None) and m.has_offsets() == first.has_offsets()
            and (m.kscales() is None) == (first.kscales() is None)
            for m in layers
        )
        if not same:
            return None
        parts = [m.canonical_tensors() for m in layers]
        if any(p["scales"].dtype != parts[0]["scales"].dtype for p in parts):
            return None
        cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}  # qweight, scales, zeros (, offsets)
        bias = torch.cat([m.bias for m in layers]) if first.bias is not None else None
        ks = [m.kscales() for m in layers]
        kscales = None
        if all(k is not None for k in ks):  # Q4_K's stored scales side by side (group-major: along dim 1)
            kscales = KScales(*(torch.cat([getattr(k, f) for k in ks], dim=1) for f in ("sc", "m", "d", "dmin")))
        return cls(cat["qweight"], None if kscales else cat["scales"], cat["zeros"], bias, first.in_features, True,
                   first.perm, first.input_scale, None if kscales else cat.get("offsets"), kscales)

    # --- canonical view -----------------------------------------------------
    def canonical_tensors(self) -> dict[str, torch.Tensor]:
        """``{"qweight", "scales", "zeros"}`` (and ``"offsets"`` when the layer has them) in the canonical
        layout (exact)."""
        if self.mode == "canonical":
            out = {"qweight": self.qweight, "scales": self.scales, "zeros": self.zeros}
            return out if self.offsets is None else {**out, "offsets": self.offsets}
        n, kp = self.out_features, self.padded_in_features
        np_ = self.packed.shape[0]
        q = unpack_cpu_int4(self.packed, np_, kp)[:n]  # [N, Kp]
        ks = self.kscales()
        if ks is not None:
            return {"qweight": pack_int4(q), "scales": ks.scales().contiguous(), "zeros": self.zeros_u8.float(),
                    "offsets": ks.offsets().contiguous()}
        if self.scales_orig is not None:
            scales = self.scales_orig.contiguous()
        else:
            scales = self.scales_zeros[:, :n, 0].t().contiguous()  # bf16, exact
        out = {"qweight": pack_int4(q), "scales": scales, "zeros": self.zeros_u8.to(scales.dtype)}
        return out if self.offsets_gm is None else {**out, "offsets": self.offsets_gm.t().contiguous()}

    def has_offsets(self) -> bool:
        """Packed mode with a float minimum per group (``w = q * scale + offset``: Q4_1's floats or Q4_K's
        stored scales) instead of integer zero points."""
        return self._buffers.get("offsets_gm") is not None or self._buffers.get("k_sc") is not None

    def kscales(self) -> KScales | None:
        """GGUF Q4_K's scales as this layer holds them (packed mode), or None."""
        b = self._buffers
        if b.get("k_sc") is None:
            return None
        return KScales(b["k_sc"], b["k_m"], b["k_d"], b["k_dmin"])

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: D401 - torch hook
        """Write the canonical tensors, whatever the run-time layout is."""
        for name, t in self.canonical_tensors().items():
            destination[prefix + name] = t if keep_vars else t.detach()
        for name in ("bias", "perm", "input_scale"):
            t = getattr(self, name)
            if t is not None:
                destination[prefix + name] = t if keep_vars else t.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        raise NotImplementedError(
            "Int4Linear cannot load_state_dict in place (its run-time layout depends on the device); "
            "use Int4Linear.from_quantized(tensors, in_features=K)"
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = self.canonical_tensors()
        w = dequantize_int4(t["qweight"], t["scales"], t["zeros"], self.in_features, dtype,
                            t.get("offsets"))  # [N, K] stored order
        if self.perm is not None:
            out = torch.empty_like(w)
            out[:, self.perm.long()] = w  # back to the original input-feature order
            w = out
        if self.input_scale is not None:
            w = (w.float() * self.input_scale).to(dtype)
        return w

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids [M] -> [M, K]`` straight from the run-time layout (embedding lookup)."""
        if self.perm is not None or self.input_scale is not None:
            return self.dequantize(dtype)[ids]
        ids = ids.long()
        g, kp = self.group_size, self.padded_in_features
        m = ids.numel()
        if self.mode == "packed_cpu":
            # the CPU int4 tiling: bytes [Np/64, Kp, 32]; row 64b+j sits at (b, :, j % 32),
            # low nibble for j < 32, high nibble otherwise (see unpack_cpu_int4).
            p3 = self.packed.view(-1, kp, CPU_BLOCK_N // 2)
            j = ids % CPU_BLOCK_N
            byte = p3[ids // CPU_BLOCK_N, :, j % (CPU_BLOCK_N // 2)]  # [M, Kp]
            shift = torch.where(j < CPU_BLOCK_N // 2, 0, 4).to(torch.uint8)[:, None]
            q = ((byte >> shift) & 15).float().view(m, -1, g)  # [M, G, g]
            ks = self.kscales()
            if ks is not None:  # w = q * scale + offset, from Q4_K's stored scales
                k_rows = ks.rows(ids)
                w = q * k_rows.scales()[..., None] + k_rows.offsets()[..., None]
            elif self.offsets_gm is not None:  # w = q * scale + offset
                w = q * self.scales_orig[ids].float()[..., None] + self.offsets_gm[:, ids].t()[..., None]
            elif self.scales_zeros is None:  # scales_orig [N, G] (not bf16): the canonical formula
                z = self.zeros_u8[ids].float()[..., None]  # [M, G, 1]
                w = (q - z) * self.scales_orig[ids].float()[..., None]
            else:
                sz = self.scales_zeros[:, ids].float()  # [G, M, 2]: w = (q - 8) * scale + zero_t
                w = (q - 8.0) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]
        else:
            q = unpack_int4(self.qweight[ids]).float().view(m, -1, g)  # [M, G, g]
            if self.offsets is not None:
                w = q * self.scales[ids].float()[..., None] + self.offsets[ids][..., None]
            else:
                w = (q - self.zeros[ids].float()[..., None]) * self.scales[ids].float()[..., None]
        return w.reshape(m, kp)[:, : self.in_features].to(dtype)

    DECODE_MAX_ROWS = PACKED_MAX_ROWS

    def decode_weight(self) -> DecodeWeight | None:
        """The C a8 weight when :meth:`_matmul` on decode-sized bf16 inputs runs ``int4_gemv_a8``."""
        buf = self._buffers
        bias = buf["bias"]
        if (self.mode != "packed_cpu" or buf["input_scale"] is not None
                or buf["perm"] is not None or (bias is not None and bias.dtype != torch.bfloat16)
                or self._kernel.family is not KernelFamily.C_INT4):
            return None
        ks = self.kscales()
        if ks is not None:
            return int4k_decode_weight(buf["packed"], ks, self.in_features, bias)
        scales = buf["scales_orig"]
        if scales is None:
            scales = buf["scales_zeros"]
        packed, zeros, offs = buf["packed"], buf["zeros_gm"], buf["offsets_gm"]
        offsets = None if offs is None else offs.t()
        return int4_decode_weight(packed, scales, zeros.t(), self.group_size, self.in_features, bias, offsets)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        k = self.in_features
        buf = self._buffers  # read directly: nn.Module.__getattr__ costs ~1 us a buffer on the decode path
        if buf["input_scale"] is not None:
            x2 = (x2.float() * buf["input_scale"]).to(x2.dtype)
        if buf["perm"] is not None:
            x2 = x2.index_select(1, buf["perm"])
        family = self._kernel.family
        if self.mode == "packed_cpu":
            if family is KernelFamily.C_INT4:  # every row: the a8 GEMV (each row's bits independent of the batch)
                xb = self._a8_input(x2)
                if buf["k_sc"] is not None:  # Q4_K's stored scales
                    y = int4k_gemv_a8(xb, buf["packed"], self.kscales(), self.in_features, check=False)
                    return y if x2.dtype == torch.bfloat16 else y.to(x2.dtype)
                scales = buf["scales_orig"]
                if scales is None:
                    scales = buf["scales_zeros"]  # [G, Np, 2]: the kernel reads the bf16 scales in place
                offs = buf["offsets_gm"]
                y = int4_gemv_a8(xb, buf["packed"], scales, buf["zeros_gm"].t(), self.group_size,
                                 offsets=None if offs is None else offs.t(),
                                 check=False)  # [M, N]; the buffers were checked at construction
                return y if x2.dtype == torch.bfloat16 else y.to(x2.dtype)
            xb = x2 if x2.dtype == torch.bfloat16 else x2.to(torch.bfloat16)
            return self._dequant_matmul(xb).to(x2.dtype)  # prefill without the native GEMM; no C kernels
        if family is KernelFamily.TRITON_W4A16:  # masks K < Kp itself, no padding copy
            return w4a16_matmul(x2.contiguous(), self.qweight, self.scales, self.zeros, self.group_size)
        w = dequantize_int4(self.qweight, self.scales, self.zeros, k, x2.dtype, self.offsets)  # [N, K] stored order
        return F.linear(x2, w)

    def _logits(self, x2: torch.Tensor) -> torch.Tensor:
        """The LM head's float32 logits: the C a8 GEMV on float32 x (AWQ's input scale applied in float32)
        writing float32 sums, or the Triton kernel on float32 x, else the reference (the stored column order)."""
        buf = self._buffers
        if buf["input_scale"] is not None:
            x2 = x2.float() * buf["input_scale"]
        if buf["perm"] is not None:
            x2 = x2.index_select(1, buf["perm"])
        family = self._kernel.family
        if self.mode == "packed_cpu" and family is KernelFamily.C_INT4:
            xf = self._a8_f32_input(x2)
            if buf["k_sc"] is not None:  # Q4_K's stored scales
                return int4k_gemv_a8(xf, buf["packed"], self.kscales(), self.in_features, out_dtype=torch.float32,
                                     check=False)
            scales = buf["scales_orig"]
            if scales is None:
                scales = buf["scales_zeros"]
            offs = buf["offsets_gm"]
            return int4_gemv_a8(xf, buf["packed"], scales, buf["zeros_gm"].t(), self.group_size,
                                offsets=None if offs is None else offs.t(), out_dtype=torch.float32, check=False)
        if self.mode != "packed_cpu" and family is KernelFamily.TRITON_W4A16:
            return w4a16_matmul(x2.float().contiguous(), self.qweight, self.scales, self.zeros, self.group_size)
        return self._dequant_logits(x2)

    def _logit_rows(self):
        """The canonical weight's rows (``w = (q - zero) * scale``, or ``q * scale + offset``), stored column
        order: the kernels' weight (:meth:`rows` rounds torch's packed zero terms to bf16, for lookups)."""
        t = self.canonical_tensors()
        offs = t.get("offsets")
        return lambda ids: dequantize_int4(t["qweight"][ids], t["scales"][ids], t["zeros"][ids], self.in_features,
                                           torch.float32, None if offs is None else offs[ids])

    def _canonical_scales(self) -> torch.Tensor:
        """The canonical scales ``[N, G]`` (packed_cpu mode): a view into ``scales_zeros`` when they are bf16."""
        if self.scales_orig is not None:
            return self.scales_orig
        return self.scales_zeros[:, : self.out_features, 0].t()

    def _dequant_matmul(self, xb: torch.Tensor) -> torch.Tensor:
        """``xb`` bf16 ``[M, K]`` (stored column order) ``-> [M, N]`` bf16 via the dequantized bf16 weight.

        Computed as ``(W @ xb^T)^T``: oneDNN reads its first operand in place but
        reorders the second on every call, so the weight goes first and only the
        small activation is reordered. That costs the same as the prepacked bf16
        GEMM; ``F.linear`` on the plain weight costs 7-18% more (M = 128, 2 threads).
        Where oneDNN has no bf16 (AVX2), ``cpu_linear.mm_bf16`` runs it as float32 sgemm.
        """
        n, k = self.out_features, self.in_features
        offsets = self.has_offsets()
        scales = None if offsets else self._canonical_scales()
        step = max(CPU_BLOCK_N, DEQUANT_CHUNK_BYTES // (2 * k) // CPU_BLOCK_N * CPU_BLOCK_N)
        xt = xb.t()
        ws = self.scratch

        def weight(r0: int, r1: int) -> torch.Tensor:  # rows r0..r1-1 dequantized, [r1 - r0, K] bf16
            if offsets:  # the C dequantization reads integer zeros only
                return self.rows(torch.arange(r0, r1), torch.bfloat16)
            out = None if ws is None else ws.take(r1 - r0, k)
            return dequant_cpu_int4(self.packed, scales, self.zeros_u8, k, self.group_size, (r0, r1), out=out)

        if step >= n:
            yt = mm_bf16(weight(0, n), xt)
        else:
            yt = torch.empty(n, xb.shape[0], dtype=torch.bfloat16)
            for r0 in range(0, n, step):
                r1 = min(n, r0 + step)
                mm_bf16(weight(r0, r1), xt, out=yt[r0:r1])
        return transpose_bf16(yt)  # [M, N]


def _pack_cpu_int4(qweight: torch.Tensor, np_: int) -> torch.Tensor:
    """The CPU int4 tiling of the canonical codes ``qweight [N, Kp/2]``, rows padded to ``np_``
    with code 8 (padded rows: (8 - 8) * 0 = 0) ``-> uint8 [Np, Kp/2]``.

    Built in chunks of whole 64-row tiles (the tiling never crosses one), so the unpacked
    copy stays within ``QUANT_CHUNK_BYTES`` instead of a byte per code of the whole weight."""
    n, half = qweight.shape
    step = max(CPU_BLOCK_N, base.QUANT_CHUNK_BYTES // (2 * half) // CPU_BLOCK_N * CPU_BLOCK_N)
    packed = torch.empty(np_, half, dtype=torch.uint8)
    for r0 in range(0, np_, step):
        r1 = min(np_, r0 + step)
        q = unpack_int4(qweight[r0 : min(r1, n)])  # [rows, Kp] uint8
        q = F.pad(q, (0, 0, 0, r1 - r0 - q.shape[0]), value=8)
        packed[r0:r1] = pack_cpu_int4(q)
        del q
    return packed


def _same_or_none(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
