"""Carrying out a plan: what the loader skips, and the per-layer hook at run time (offload never imports the engine).

1. ``OffloadRuntime(plan, ...)`` before loading: per tensor the loader asks ``skip(name)`` (streamed
   straight from the checkpoint) and ``device_for(name, default)`` (CPU RAM for CPU layers of a GPU
   machine), and calls ``loaded(name, model)`` after placing one (a streamed layer converted in memory is
   written to the offload file once complete, then dropped: peak memory is one layer, not the model).
2. ``install(model)`` after loading: streamed layers get disk locations and a reader ring; when
   :attr:`OffloadRuntime.runs_layers` the forward runs layers through :meth:`OffloadRuntime.run_layer`
   (tensors bound to buffer views, no copy, released after); an on-disk embedding / LM head becomes
   modules that read rows / stream chunks.
3. ``close()`` stops the reader and removes scratch files. Streamed tensors are a layer module's
   parameters and buffers, so quantized layers stream quantized.
"""

from __future__ import annotations

import copy
import os
import shutil
import warnings
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from llmsys import kernels
from llmsys.offload.budgets import scratch_offload_dir
from llmsys.offload.experts import (DiskExperts, ExpertCache, ExpertReport, ExpertWeights, NextRouter, Repacked,
                                    ResidentExperts, SlotTensor, StoredTensor)
from llmsys.offload.plan import Plan
from llmsys.offload.streamer import (ALIGN, Binding as _Binding, CudaStager, MappedUnits, ReaderRing, StreamItem, StreamUnit,
                                     TensorSource, pread_full)

# locate(name) -> (file path, info with .dtype .shape .offset .nbytes) or None (not streamable from the file); the
# info may be a StoredTensor (stored in another form: only experts read it, offload/experts.py's Repacked)
Locate = Callable[[str], "tuple[str, Any] | None"]
CONVERT_CHUNK = 16 << 20  # bytes per read/convert/write step when writing the offload file


def _tensor_slots(module: nn.Module) -> list[tuple[nn.Module, str, bool, torch.Tensor]]:
    """Every (owner, leaf, is_param, tensor) a module owns, recursively (None entries skipped)."""
    out = []
    for _, mod in module.named_modules():
        for leaf, t in mod._parameters.items():
            if t is not None:
                out.append((mod, leaf, True, t))
        for leaf, t in mod._buffers.items():
            if t is not None:
                out.append((mod, leaf, False, t))
    return out


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, n = [], 1
    for s in reversed(shape):
        out.append(n)
        n *= max(s, 1)
    return tuple(reversed(out))


def _read_sources(srcs: tuple[TensorSource, ...]) -> list[torch.Tensor]:
    """Each source's bytes, ``uint8 [nbytes]`` (a template's expert, read once at install)."""
    out = []
    for s in srcs:
        buf = torch.empty(s.nbytes, dtype=torch.uint8)
        fd = os.open(s.path, os.O_RDONLY)
        try:
            if pread_full(fd, [memoryview(buf.numpy())], s.offset) != s.nbytes:
                raise OSError(f"{s.path}: unexpected end of file before byte {s.offset + s.nbytes}; the file is truncated")
        finally:
            os.close(fd)
        out.append(buf)
    return out


def _template(built: nn.Module) -> tuple[nn.Module, list[SlotTensor]]:
    """A built layer made a template: its tensors' slot layout (one :class:`SlotTensor` per tensor slot, in
    :func:`_tensor_slots` order, offsets from 0, a tensor held twice laid out once) and the module itself with
    meta placeholders, to be copied per expert."""
    layout: list[SlotTensor] = []
    at: dict[int, SlotTensor] = {}
    off = 0
    for owner, leaf, is_param, t in _tensor_slots(built):
        st = at.get(id(t))
        if st is None:
            st = at[id(t)] = SlotTensor(t.dtype, tuple(t.shape), tuple(t.stride()), off, SlotTensor.span_of(t))
            off += -(-st.nbytes // ALIGN) * ALIGN
        layout.append(st)
        (owner._parameters if is_param else owner._buffers)[leaf] = _meta_like(t, is_param)
    return built, layout


def _leaves(meta: nn.Module) -> list[str] | None:
    """A template's buffer names in :func:`_tensor_slots` order (None when two share a name)."""
    names = [leaf for _, leaf, _, _ in _tensor_slots(meta)]
    return names if len(set(names)) == len(names) else None


def _fill_checked(info: Any, raw: torch.Tensor, meta: nn.Module, layout: list[SlotTensor], want: list[torch.Tensor],
                  what: str) -> bool:
    """May an expert's layer be written by ``info.fill`` (:class:`StoredTensor`) in place of being built? Only where
    it writes, for the template's expert, exactly the bytes the built layer holds (``want``, in ``layout``): a
    fill that does not know this layout says so and the layer is built, as one that disagrees (with a warning)."""
    names = _leaves(meta) if isinstance(info, StoredTensor) and info.fill is not None else None
    if names is None:
        return False
    size = max(t.offset + t.nbytes for t in layout)
    built, filled = torch.zeros(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
    for st, t in zip(layout, want):
        st.put(built, t, what)
    if not info.fill(raw, {n: st.view(filled) for n, st in zip(names, layout)}):
        return False
    if torch.equal(built, filled):
        return True
    warnings.warn(f"{what}: the loader's one-pass repack differs from the layer it builds; experts read at run "
                  f"time are built the slow way", RuntimeWarning, stacklevel=2)
    return False


def _slot_fill(info: StoredTensor, meta: nn.Module) -> Callable[[list[torch.Tensor], list[torch.Tensor]], bool]:
    """:attr:`Repacked.fill` of one expert's layer: its stored weight bytes and slot views -> ``info.fill``."""
    names = _leaves(meta)
    return lambda raws, views: info.fill(raws[0], dict(zip(names, views)))


def _meta_like(t: torch.Tensor, is_param: bool) -> torch.Tensor:
    m = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return nn.Parameter(m, requires_grad=False) if is_param else m


class OffloadWriter:
    """Appends tensors to one offload file, aligned, and drops them from the page cache."""

    def __init__(self, folder: Path, name: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / name
        self._f = open(self.path, "wb")
        self._off = 0

    def _write(self, data: memoryview) -> None:
        self._f.write(data)
        self._off += len(data)

    def _pad(self) -> None:
        pad = -self._off % ALIGN
        if pad:
            self._write(memoryview(bytes(pad)))

    def add(self, t: torch.Tensor) -> TensorSource:
        self._pad()
        start = self._off
        t = t.detach().contiguous().cpu()
        if t.numel():
            self._write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self._flush()
        return TensorSource(str(self.path), start, self._off - start)

    def add_converted(self, path: str, info: Any, dtype: torch.dtype) -> TensorSource:
        """Copy a checkpoint tensor into the file in ``dtype``, a few MiB at a time."""
        self._pad()
        start = self._off
        shape = tuple(info.shape)
        row_elems = 1
        for s in shape[1:]:
            row_elems *= s
        src_elt = info.nbytes // max(1, _numel(shape)) if _numel(shape) else 1
        rows = shape[0] if shape else 1
        step = max(1, CONVERT_CHUNK // max(row_elems * src_elt, 1))
        fd = os.open(path, os.O_RDONLY)
        try:
            for a in range(0, rows, step):
                b = min(rows, a + step)
                n = (b - a) * row_elems if shape else 1
                buf = torch.empty(n, dtype=info.dtype)
                os.preadv(fd, [memoryview(buf.view(torch.uint8).numpy())], info.offset + a * row_elems * src_elt)
                self._write(memoryview(buf.to(dtype).view(torch.uint8).numpy()))
            os.posix_fadvise(fd, info.offset, info.nbytes, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        self._flush()
        return TensorSource(str(self.path), start, self._off - start)

    def _flush(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        os.posix_fadvise(self._f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if not self._f.closed:
            self._flush()
            self._f.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class DiskEmbedding(nn.Module):
    """An embedding table left on disk: a step reads only the rows of its tokens.

    ``stored``: the file's dtype when it is not ``dtype`` (a checkpoint read in
    place); rows are converted with the same elementwise ``Tensor.to`` the loader
    applies to the whole table, so a lookup gives the bits of the converted table.
    ``drop_cache=False`` leaves read pages in the page cache (a table that stays
    on disk only so its tied head can be prepacked: ``DecoderModel.prepack_linears``).
    The file is opened once, here: lookups keep reading the file that was loaded
    even if its path is later replaced (a re-download) or removed.
    """

    def __init__(self, src: TensorSource, vocab: int, hidden: int, dtype: torch.dtype, device: torch.device,
                 stored: torch.dtype | None = None, drop_cache: bool = True):
        super().__init__()
        self.src, self.vocab, self.hidden, self.dtype, self.device = src, vocab, hidden, dtype, device
        self.stored = stored or dtype
        self.drop_cache = drop_cache
        self.row_bytes = src.nbytes // vocab
        self._fd = os.open(src.path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        buf = torch.empty(ids.shape[0], self.hidden, dtype=self.stored)
        view = memoryview(buf.view(torch.uint8).numpy()).cast("B")
        fd, n = self._fd, self.row_bytes
        for j, tok in enumerate(ids.tolist()):
            if not 0 <= tok < self.vocab:
                raise IndexError(f"token id {tok} is outside the embedding table ({self.vocab} rows)")
            off = self.src.offset + tok * n
            if os.preadv(fd, [view[j * n : (j + 1) * n]], off) != n:
                raise OSError(f"{self.src.path}: short read of embedding row {tok}; the file is truncated")
            if self.drop_cache:
                os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
        return buf.to(device=self.device, dtype=self.dtype)


class StreamedLMHead(nn.Module):
    """The LM head in row chunks streamed through the ring: logits[:, a:b] = h @ W[a:b].T."""

    def __init__(self, runtime: "OffloadRuntime", chunks: list[tuple[int, int, int]], vocab: int,
                 packed_when_resident: bool = True):
        super().__init__()
        self._rt = [runtime]  # a list: not registered as a submodule
        self.chunks = chunks  # (first row, end row, ring unit index)
        self.vocab = vocab
        self.packed_when_resident = packed_when_resident  # False: a tied head that is never prepacked

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        return self._run(h, h.dtype, kernels.linear)

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [N, hidden] float32 -> [N, vocab] float32
        """The resident head's ``logits`` chunk by chunk (``kernels.linear_logits``: float32 sums, each row's
        independent of the chunking), so a streamed head gives the resident head's bits."""
        return self._run(h, torch.float32, kernels.linear_logits)

    def _run(self, h: torch.Tensor, dtype: torch.dtype, fn) -> torch.Tensor:
        rt = self._rt[0]
        out = torch.empty(h.shape[0], self.vocab, dtype=dtype, device=h.device)
        for a, b, u in self.chunks:
            (w,) = rt.bring(u)
            try:
                # as the resident head: the same GEMM choice, so the same bits.
                out[:, a:b] = fn(h, w, rows_of=self.vocab, packed_when_resident=self.packed_when_resident)
            finally:
                rt.drop(u)
        return out


class OffloadRuntime:
    def __init__(self, plan: Plan, device: torch.device, dtype: torch.dtype, locate: Locate, quantized: bool = False,
                 drop_cache: bool = True):
        self.plan = plan
        # Drop streamed pages from the page cache (the budget then holds for the whole
        # machine); False lets the kernel cache them, as Accelerate's memmaps do.
        self.drop_cache = drop_cache
        self.device = device
        self.dtype = dtype
        self.locate = locate
        self.quantized = quantized
        self.cuda = device.type == "cuda"
        self.kind = {i: p.kind for i, p in enumerate(plan.layers)}
        # Sparse layers whose experts live apart ("disk": read on demand into the expert cache; "cpu": --cpu-moe).
        self.expert_tier = {i: p.experts for i, p in enumerate(plan.layers) if p.experts}
        self.expert_cache: ExpertCache | None = None
        self._experts: dict[int, DiskExperts | ResidentExperts] = {}  # layer -> the source run_layer hands in
        self.expert_disk_bytes = 0
        self.ring: ReaderRing | MappedUnits | None = None
        self.stager: CudaStager | None = None
        self._scratch: Path | None = None
        self._writer: OffloadWriter | None = None
        self._written: dict[str, list[tuple[_Binding, StreamItem]]] = {}  # unit -> tensors written while loading
        self._pending: dict[str, set[str]] = {}  # unit -> names not loaded yet (in-memory conversion)
        self._direct: set[str] = set()  # units streamed straight from the checkpoint
        self._convert: set[str] = set()  # units converted chunk-wise into the offload file
        # expert units read from the checkpoint as stored and converted / rebuilt into their cache slot: name -> locate
        self._stored: dict[str, dict[str, tuple[str, Any]]] = {}
        self._units: list[StreamUnit] = []
        self._bindings: list[list[_Binding]] = []
        self._layer_unit: dict[int, int] = {}
        self._tokens: dict[int, Any] = {}
        self._resident_cpu: dict[int, tuple[list[_Binding], list[torch.Tensor]]] = {}
        self.disk_bytes = 0
        self.runs_layers = False  # set by install(): some layer streams or crosses devices (run_layer needed)

    # -- which unit a checkpoint tensor belongs to -------------------------
    def unit_of(self, name: str) -> str | None:
        if name.startswith("model.layers."):
            parts = name.split(".")
            i = int(parts[2])
            if self.kind.get(i) == "disk":
                return f"layers.{i}"
            if self.expert_tier.get(i) == "disk" and parts[3:5] == ["mlp", "experts"] and parts[5].isdigit():
                return f"layers.{i}.mlp.experts.{parts[5]}"  # one expert: read on demand (offload/experts.py)
            return None
        head = self.plan.head
        if name == "model.embed_tokens.weight":
            if self.plan.embed is None:
                return "head" if head.kind == "disk" else None
            return "embed" if self.plan.embed.kind == "disk" else None
        if name == "lm_head.weight" and self.plan.embed is not None:
            return "head" if head.kind == "disk" else None
        return None

    def prepare(self, names: list[str]) -> None:
        """Decide per streamed unit how its bytes get to disk (called with every checkpoint name)."""
        by_unit: dict[str, list[str]] = {}
        for n in names:
            u = self.unit_of(n)
            if u is not None:
                by_unit.setdefault(u, []).append(n)
        for u, ns in by_unit.items():
            found = [self.locate(n) for n in ns]
            # (an expert's unit streams as a layer's does: straight from the checkpoint, or written to the offload
            # file once quantized in memory (--quant); one stored in another form than the engine computes on is
            # read as stored and converted or rebuilt in its cache slot, never rewritten)
            quant_here = self.quantized and u.startswith("layers.")
            if not quant_here and ".mlp.experts." in u and all(f is not None for f in found) \
                    and not all(self._as_stored(f[1]) for f in found):
                self._stored[u] = dict(zip(ns, found))
                continue
            if not quant_here and all(f is not None and not isinstance(f[1], StoredTensor) for f in found):
                same = all(f[1].dtype == self.dtype or not f[1].dtype.is_floating_point for f in found)
                (self._direct if same else self._convert).add(u)
            else:
                self._pending[u] = set(ns)

    def _as_stored(self, info: Any) -> bool:
        """Does the engine compute on these stored bytes as they are (no conversion)?"""
        return not isinstance(info, StoredTensor) and (info.dtype == self.dtype or not info.dtype.is_floating_point)

    # -- loader policy -------------------------------------------------------
    def skip(self, name: str) -> bool:
        u = self.unit_of(name)
        return u is not None and (u in self._direct or u in self._convert or u in self._stored)

    def device_for(self, name: str, default: torch.device) -> torch.device:
        if name.startswith("model.layers."):
            parts = name.split(".")
            i = int(parts[2])
            if self.kind.get(i) in ("cpu", "cpu->gpu", "disk"):
                return torch.device("cpu")
            if i in self.expert_tier and parts[3:5] == ["mlp", "experts"]:
                return torch.device("cpu")  # --cpu-moe: the experts stay in CPU RAM
        u = self.unit_of(name)
        if u is not None:
            return torch.device("cpu")
        return default

    def loaded(self, name: str, model: nn.Module) -> None:
        u = self.unit_of(name)
        if u is None or u not in self._pending:
            return
        left = self._pending[u]
        left.discard(name)
        if left:
            return
        del self._pending[u]
        if u.startswith("layers."):
            mod = model.get_submodule("model." + u)
        elif u == "embed" or self.plan.embed is None:  # tied: the head's tensor is the embedding table
            mod = model.get_submodule("model.embed_tokens")
        else:
            mod = model.get_submodule("lm_head")
        self._written[u] = self._write_module(mod)

    def _writer_for(self) -> OffloadWriter:
        if self._writer is None:
            folder = self.plan.budgets.offload_dir
            if folder is None:
                folder = self._scratch = scratch_offload_dir()
            self._writer = OffloadWriter(Path(folder), f"llmsys-offload-{os.getpid()}-{id(self):x}.bin")
        return self._writer

    def _write_module(self, mod: nn.Module) -> list[tuple[_Binding, StreamItem]]:
        out = []
        w = self._writer_for()
        seen: dict[int, StreamItem] = {}
        for owner, leaf, is_param, t in _tensor_slots(mod):
            item = seen.get(id(t))
            if item is None:
                item = seen[id(t)] = StreamItem(t.dtype, tuple(t.shape), w.add(t))
            b = _Binding(owner, leaf, is_param, _meta_like(t, is_param))
            (owner._parameters if is_param else owner._buffers)[leaf] = b.placeholder
            out.append((b, item))
        return out

    # -- after loading ---------------------------------------------------------
    def install(self, model: nn.Module) -> None:
        """Wire streaming into a loaded model (no-op when nothing streams)."""
        sources: dict[str, TensorSource] = {}
        for u in sorted(self._direct | self._convert):
            names = self._names_of(model, u)
            for n in names:
                path, info = self.locate(n)
                if u in self._direct:
                    sources[n] = TensorSource(str(path), info.offset, info.nbytes)
                else:
                    sources[n] = self._writer_for().add_converted(str(path), info, self.dtype)
        if self._writer is not None:
            self._writer.close()
        layers = model.model.layers
        for i, kind in self.kind.items():
            u = f"layers.{i}"
            if kind == "disk":
                pairs = self._written.get(u) or self._bind_direct(layers[i], f"model.layers.{i}.", sources)
                self._add_unit(u, pairs)
                self._layer_unit[i] = len(self._units) - 1
            elif kind == "cpu->gpu" and self.cuda:  # pragma: no cover - GPU only
                slots = _tensor_slots(layers[i])
                binds = [_Binding(o, leaf, p, t.pin_memory()) for o, leaf, p, t in slots]
                self._resident_cpu[i] = (binds, [b.placeholder for b in binds])
        self._install_experts(model, sources)
        self._install_embed_head(model, sources)
        self.disk_bytes = sum(u.nbytes for u in self._units)
        if self._units:
            if self.cuda or self.drop_cache:
                self.ring = ReaderRing(self._units, pin=self.cuda, drop_cache=self.drop_cache)
            else:  # CPU, page cache kept: compute reads the cached pages in place
                self.ring = MappedUnits(self._units)
            if self.cuda:  # pragma: no cover - GPU only
                self.stager = CudaStager(self.ring.slot_bytes, self.device)
        self.runs_layers = bool(self._units or self._resident_cpu or self._experts
                                or any(k == "cpu" for k in self.kind.values()) and self.cuda)

    def _install_experts(self, model: nn.Module, sources: dict[str, TensorSource]) -> None:
        """Each sparse layer whose experts live apart gets its ``ExpertSource``: on disk, one unit per expert
        read into a cache shared by every layer (capacity: the plan's ``ExpertPlan.cache_bytes``); in CPU RAM
        (``--cpu-moe``), a source that only moves the routed rows to the CPU and back."""
        layers = model.model.layers
        disk: dict[int, list[ExpertWeights]] = {}
        templates: dict[tuple[int, str], tuple[nn.Module, list[SlotTensor], bool]] = {}
        for i, tier in sorted(self.expert_tier.items()):
            if tier == "cpu":
                self._experts[i] = ResidentExperts(torch.device("cpu"))
                continue
            ws = []
            for e, mod in enumerate(layers[i].mlp.experts):
                u = f"layers.{i}.mlp.experts.{e}"
                if u in self._stored:
                    ws.append(self._stored_expert(i, mod, u, templates))
                    continue
                pairs = self._written.get(u) or self._bind_direct(mod, f"model.{u}.", sources)
                ws.append(ExpertWeights(StreamUnit(u, [it for _, it in pairs]), tuple(b for b, _ in pairs)))
            disk[i] = ws
        if not disk:
            return
        slot = max(w.nbytes for ws in disk.values() for w in ws)
        self.expert_disk_bytes = sum(w.read_bytes for ws in disk.values() for w in ws)
        ep = self.plan.experts
        capacity = ep.cache_bytes if ep is not None and ep.cache_bytes else slot
        self.expert_cache = ExpertCache(max(capacity, slot), slot, drop_cache=self.drop_cache,
                                        policy=ep.policy if ep is not None else "lfu")
        for i, ws in disk.items():
            self._experts[i] = DiskExperts(i, ws, self.expert_cache)
        holds_all = len(self.expert_cache.slots) >= sum(len(ws) for ws in disk.values())  # nothing left to guess
        if (ep is None or ep.prefetch) and not holds_all:  # pre-gating: each disk layer guesses the next one's experts
            order = sorted(disk)
            for i, j in zip(order, order[1:]):
                moe = layers[j].mlp
                if self.kind.get(j) not in ("disk", "cpu->gpu"):  # its router resident (a streamed one: bound per step)
                    self._experts[i].next = NextRouter(moe.gate, moe.top_k, self._experts[j])

    def _stored_expert(self, i: int, mod: nn.Module, u: str,
                       templates: dict[tuple[int, str], tuple[nn.Module, list[SlotTensor], bool]]) -> ExpertWeights:
        """Expert ``u`` (``mod``, its meta MLP) read from the checkpoint as stored (``self._stored[u]``): tensors the
        engine computes on as stored go straight into the slot; converted ones (F16 for a bf16 engine) and the
        layers a GGUF keeps as block codes are built from their stored bytes in the slot (:class:`Repacked`).
        A rebuilt layer's module comes from a template per (layer, projection), made from the first expert's
        bytes at install (every expert of a stacked GGUF tensor has its type and shape)."""
        found = self._stored[u]
        prefix = f"model.{u}."
        parts: dict[str, dict[str, tuple[str, tuple[str, Any]]]] = {}  # linear -> leaf -> (name, (path, info))
        for name, _ in mod.named_parameters():
            sub, _, leaf = name.rpartition(".")
            parts.setdefault(sub, {})[leaf] = (prefix + name, found[prefix + name])
        direct: list[tuple[_Binding, StreamItem]] = []
        later: list[tuple[str, tuple[TensorSource, ...], Any, list[SlotTensor], list[_Binding]]] = []
        for sub, leaves in parts.items():
            lin = mod.get_submodule(sub)
            _, (wpath, winfo) = leaves["weight"]
            if isinstance(winfo, StoredTensor) and winfo.layer is not None:  # a quantized layer rebuilt from codes
                bias = leaves.get("bias")
                stored = (TensorSource(str(wpath), winfo.offset, winfo.nbytes),) + (
                    (TensorSource(str(bias[1][0]), bias[1][1].offset, bias[1][1].nbytes),) if bias else ())
                make, build = self._layer_maker(winfo, bias[1][1] if bias else None)
                key = (i, sub)
                if key not in templates:
                    raws = _read_sources(stored)
                    built = build(raws)
                    want = [t for *_, t in _tensor_slots(built)]
                    meta, layout = _template(built)
                    fills = bias is None and _fill_checked(winfo, raws[0], meta, layout, want, f"{u}.{sub}")
                    templates[key] = (meta, layout, fills)
                meta, layout, fills = templates[key]
                new = copy.deepcopy(meta)
                owner, _, leaf = sub.rpartition(".")
                setattr(mod.get_submodule(owner) if owner else mod, leaf, new)
                binds = [_Binding(o, lf, p, t) for o, lf, p, t in _tensor_slots(new)]
                later.append((f"{u}.{sub}", stored, make, layout, binds, _slot_fill(winfo, meta) if fills else None))
                continue
            for leaf, (name, (path, info)) in leaves.items():
                p = lin._parameters[leaf]
                b = _Binding(lin, leaf, True, _meta_like(p, True))
                lin._parameters[leaf] = b.placeholder
                if self._as_stored(info):
                    dt = self.dtype if p.is_floating_point() else p.dtype
                    direct.append((b, StreamItem(dt, tuple(p.shape), TensorSource(str(path), info.offset, info.nbytes))))
                    continue
                st = SlotTensor(self.dtype, tuple(p.shape), _contiguous_stride(tuple(p.shape)), 0, p.numel())
                later.append((f"{u}.{sub}.{leaf}", (TensorSource(str(path), info.offset, info.nbytes),),
                              self._tensor_maker(info), [st], [b], None))
        unit = StreamUnit(u, [it for _, it in direct])
        base = -(-unit.nbytes // ALIGN) * ALIGN
        repacked = []
        for name, stored, make, layout, binds, fill in later:
            tensors = tuple(replace(t, offset=base + t.offset) for t in layout)
            base += -(-max(t.offset + t.nbytes for t in layout) // ALIGN) * ALIGN
            repacked.append(Repacked(name, stored, make, tensors, tuple(binds), fill))
        return ExpertWeights(unit, tuple(b for b, _ in direct), tuple(repacked))

    def _tensor_maker(self, info: Any):
        """Stored bytes -> the run-time tensor, as the loader makes it (``Tensor.to``; a GGUF block type's decoder)."""
        dtype = self.dtype
        if isinstance(info, StoredTensor):
            if info.decode is None:
                raise ValueError(f"tensor at offset {info.offset}: stored as a layer's codes, not a tensor")
            return lambda raws: [info.decode(raws[0], dtype)]
        return lambda raws: [raws[0].view(info.dtype).view(info.shape).to(dtype)]

    def _layer_maker(self, winfo: StoredTensor, binfo: Any):
        """(make, build): stored weight (+ bias) bytes -> the layer the loader builds from them (``build``), and
        its tensors in :func:`_tensor_slots` order (``make``, what a cache slot holds)."""
        bias_of = self._tensor_maker(binfo) if binfo is not None else None

        def build(raws: list[torch.Tensor]) -> nn.Module:  # the bias as the loader passes it: in the run dtype
            return winfo.layer(raws[0], bias_of(raws[1:])[0] if bias_of is not None else None)

        return (lambda raws: [t for *_, t in _tensor_slots(build(raws))]), build

    def expert_report(self) -> ExpertReport | None:
        """The experts kept apart from their layers: tier, bytes, cache counters (None: none are)."""
        if not self._experts:
            return None
        c = self.expert_cache
        if c is not None:
            st = c.stats
            return ExpertReport("disk", sum(1 for x in self._experts.values() if isinstance(x, DiskExperts)),
                                self.expert_disk_bytes, c.capacity, c.cached_bytes, st.hits, st.misses, st.bytes_read,
                                st.guess_hits, st.guess_chosen, st.ahead_reads, st.ahead_used, st.ahead_bytes,
                                c.unused_ahead_bytes)
        ep = self.plan.experts
        return ExpertReport("cpu", len(self._experts), ep.expert_bytes if ep is not None else 0, 0, 0, 0, 0, 0)

    def _names_of(self, model: nn.Module, u: str) -> list[str]:
        if u.startswith("layers."):
            return [f"model.{u}.{n}" for n, _ in model.get_submodule("model." + u).named_parameters()]
        if u == "embed" or self.plan.embed is None:
            return ["model.embed_tokens.weight"]
        return ["lm_head.weight"]

    def _bind_direct(self, layer: nn.Module, prefix: str, sources: dict[str, TensorSource]):
        pairs = []
        for name, p in layer.named_parameters():
            mod_name, _, leaf = name.rpartition(".")
            owner = layer.get_submodule(mod_name) if mod_name else layer
            b = _Binding(owner, leaf, True, _meta_like(p, True))
            owner._parameters[leaf] = b.placeholder
            pairs.append((b, StreamItem(self.dtype if p.is_floating_point() else p.dtype, tuple(p.shape), sources[prefix + name])))
        return pairs

    def _add_unit(self, name: str, pairs: list[tuple[_Binding, StreamItem]]) -> None:
        self._units.append(StreamUnit(name, [it for _, it in pairs]))
        self._bindings.append([b for b, _ in pairs])

    def _install_embed_head(self, model: nn.Module, sources: dict[str, TensorSource]) -> None:
        a = model.args
        plan = self.plan
        tied = plan.embed is None
        head_disk = plan.head.kind == "disk"
        embed_disk = head_disk if tied else plan.embed.kind == "disk"
        if embed_disk:
            src = sources.get("model.embed_tokens.weight")
            written = self._written.get("head" if tied else "embed", []) if src is None else []
            if len(written) > 1 and not tied:
                # a quantized embedding (codes and scales: a GGUF's Q4_K table): no row-wise file layout to
                # read rows from, so the module is streamed whole around each lookup, as a quantized head is
                model.model.embed_tokens = self._whole_unit("embed", written, model.model.embed_tokens, "forward")
            else:
                if src is None:  # converted in memory while loading
                    (_, item), = written
                    src = item.src
                model.model.embed_tokens = DiskEmbedding(src, a.vocab_size, a.hidden_size, self.dtype, self.device)
        if head_disk:
            name = "model.embed_tokens.weight" if tied else "lm_head.weight"
            src = sources.get(name)
            if src is None:
                written = self._written["head"]
                if len(written) != 1:  # a quantized head: stream the whole module as one unit
                    # logits: the quantized head's float32 logits (QuantLinear.logits)
                    model.lm_head = self._whole_unit("lm_head", written, model.lm_head, "forward", "logits")
                    return
                src = written[0][1].src
            row = src.nbytes // a.vocab_size
            rows = plan.head_chunk_rows
            chunks = []
            for s in range(0, a.vocab_size, rows):
                e = min(a.vocab_size, s + rows)
                item = StreamItem(self.dtype, (e - s, a.hidden_size), TensorSource(src.path, src.offset + s * row, (e - s) * row))
                self._units.append(StreamUnit(f"lm_head[{s}:{e}]", [item]))
                self._bindings.append([])
                chunks.append((s, e, len(self._units) - 1))
            # A tied head is packed when resident iff its embedding can be served from the
            # checkpoint (DecoderModel.prepack_linears): chunks then pack on the fly, so the
            # streamed head gives the resident head's bits.
            packed = not tied or getattr(model, "embed_file", None) is not None
            model.lm_head = StreamedLMHead(self, chunks, a.vocab_size, packed_when_resident=packed)

    def _whole_unit(self, name: str, written: list, module: nn.Module, *methods: str) -> nn.Module:
        """``module`` streamed as one unit of ``written`` tensors: each of ``methods`` brings it in, runs, drops it."""
        self._add_unit(name, written)
        idx, rt = len(self._units) - 1, self

        def streamed(method: str):
            def call(_self, *args):
                rt.bring(idx)
                try:
                    return getattr(module, method)(*args)
                finally:
                    rt.drop(idx)
            return call

        return type(f"Whole_{name}", (nn.Module,), {m: streamed(m) for m in methods})()

    # -- run time ------------------------------------------------------------------
    def bring(self, u: int) -> list[torch.Tensor]:
        """Make ring unit ``u`` resident on the compute device; its tensors, bound into the model."""
        views = self.ring.acquire(u)
        if self.stager is not None:  # pragma: no cover - GPU only
            unit = self._units[u]
            k = self.stager.copy_in(views, unit.offsets)
            self._tokens[u] = k
            views = self.stager.views(k, unit.items, unit.offsets)
        for b, v in zip(self._bindings[u], views):
            (b.owner._parameters if b.is_param else b.owner._buffers)[b.leaf] = v
        return views

    def drop(self, u: int) -> None:
        for b in self._bindings[u]:
            (b.owner._parameters if b.is_param else b.owner._buffers)[b.leaf] = b.placeholder
        if self.stager is not None:  # pragma: no cover - GPU only
            k = self._tokens.pop(u)
            self.stager.done(k)
            self.stager.wait_copied(k)
        self.ring.release(u)

    def rebinds(self, i: int) -> bool:
        """``LayerRunner``: layer ``i``'s weights are bound per step (a streamed unit, pinned copies for the GPU,
        or computed on the CPU beside a GPU)."""
        return i in self._layer_unit or i in self._resident_cpu or (self.cuda and self.kind.get(i) == "cpu")

    def run_layer(self, i: int, layer: nn.Module, h, residual, positions, rope, attn, meta):
        """``LayerRunner``: layer ``i`` with its weights streamed in (or copied / computed across devices)."""
        ex = self._experts.get(i)
        if ex is not None and not (self.cuda and self.kind.get(i) == "cpu"):
            # Experts apart from the layer (never a streamed one): the MoE block asks for those it routed to.
            return layer(h, residual, positions, rope, attn, meta, experts=ex)
        u = self._layer_unit.get(i)
        if u is not None:
            self.bring(u)
            try:
                return layer(h, residual, positions, rope, attn, meta)
            finally:
                self.drop(u)
        if i in self._resident_cpu:  # pragma: no cover - GPU only: pinned CPU weights copied to the GPU
            binds, srcs = self._resident_cpu[i]
            offsets, off = [], 0
            for t in srcs:
                offsets.append(off)
                off += -(-(t.numel() * t.element_size()) // ALIGN) * ALIGN
            k = self.stager.copy_in(srcs, offsets)
            items = [StreamItem(t.dtype, tuple(t.shape), TensorSource("", 0, t.numel() * t.element_size())) for t in srcs]
            for b, v in zip(binds, self.stager.views(k, items, offsets)):
                (b.owner._parameters if b.is_param else b.owner._buffers)[b.leaf] = v
            try:
                return layer(h, residual, positions, rope, attn, meta)
            finally:
                self.stager.done(k)
        if self.cuda and self.kind.get(i) == "cpu":  # pragma: no cover - GPU only: computed on the CPU
            cpu = torch.device("cpu")
            m = _meta_to(meta, cpu)
            res = residual.to(cpu) if residual is not None else None
            out, res = layer(h.to(cpu), res, positions.to(cpu), rope.to(cpu), attn, m)
            return out.to(self.device, non_blocking=True), res.to(self.device, non_blocking=True)
        return layer(h, residual, positions, rope, attn, meta)

    def place_kv(self, kv: Any) -> None:  # pragma: no cover - GPU only
        """Move the KV tensors of CPU-computed layers to CPU RAM (kv has lists ``k`` and ``v``)."""
        if not self.cuda:
            return
        for i, kind in self.kind.items():
            if kind == "cpu":
                kv.k[i] = kv.k[i].cpu()
                kv.v[i] = kv.v[i].cpu()

    # -- accounting --------------------------------------------------------------
    def weight_bytes(self, model: nn.Module) -> dict[str, int]:
        """Resident weight bytes per tier ("gpu"/"cpu") plus "disk" (streamed units)."""
        out: dict[str, int] = {}
        seen: set[int] = set()
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) in seen or t.device.type == "meta":
                continue
            seen.add(id(t))
            tier = "gpu" if t.device.type == "cuda" else "cpu"
            out[tier] = out.get(tier, 0) + t.numel() * t.element_size()
        for binds, srcs in self._resident_cpu.values():  # pragma: no cover - GPU only
            out["cpu"] = out.get("cpu", 0) + sum(t.numel() * t.element_size() for t in srcs)
        disk = self.disk_bytes + self.expert_disk_bytes
        if disk:
            out["disk"] = disk
        return out

    def staging_bytes(self) -> dict[str, int]:
        out = {}
        if self.ring is not None:
            out["cpu"] = self.ring.slot_bytes * len(self.ring.slots)
        if self.stager is not None:  # pragma: no cover - GPU only
            out["gpu"] = sum(b.numel() for b in self.stager.bufs)
        if self.expert_cache is not None:  # the expert cache's slots (RAM as they fill) and its repack staging
            out["cpu"] = out.get("cpu", 0) + self.expert_cache.capacity + self.expert_cache.staging_bytes
        return out

    def close(self) -> None:
        if self.expert_cache is not None:
            self.expert_cache.close()
            self.expert_cache = None
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self._writer is not None:
            self._writer.close()
            try:
                os.unlink(self._writer.path)
            except OSError:
                pass
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


def _meta_to(meta: Any, device: torch.device) -> Any:  # pragma: no cover - GPU only
    """Copy a dataclass of tensors (attention metadata) to ``device``."""
    from dataclasses import fields, replace

    return replace(meta, **{f.name: getattr(meta, f.name).to(device) for f in fields(meta)
                            if isinstance(getattr(meta, f.name), torch.Tensor)})
