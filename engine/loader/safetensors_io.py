"""A small safetensors reader built for low peak memory.

Why not ``safetensors.safe_open``: it memory-maps the file, and every page it
touches stays resident (and counted in RSS) until the map closes, so loading a
model that way peaks near 2x its size. Reading each tensor with ``readinto``
into a buffer we own keeps peak memory at "the model so far + one tensor", and
the same reader serves the offload streamer (read a layer straight into a
preallocated staging buffer). The header is validated up front so a truncated
or corrupt file fails with its name, not deep inside a forward pass.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmsys.kernels.common.errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsFile:
    """Index of one ``.safetensors`` file; tensors are read on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        header, base, size = _read_header(self.path)
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise self._corrupt(f"__metadata__ is a JSON {type(meta).__name__}, not an object")
        self.metadata: dict[str, str] = meta
        self.tensors: dict[str, TensorInfo] = {}
        for name, h in header.items():
            self.tensors[name] = self._entry(name, h, base, size)
        self._check_overlaps()
        self._check_layout(base, size)

    def _corrupt(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: corrupt safetensors header: {what}; re-download it")

    def _entry(self, name: str, h: object, base: int, size: int) -> TensorInfo:
        """One header entry checked against the format and the file: a known dtype, a shape of whole
        non-negative numbers, offsets inside the data area, and a span that the shape and dtype fill exactly."""
        if not isinstance(h, dict) or not {"dtype", "shape", "data_offsets"} <= h.keys():
            raise self._corrupt(f"tensor {name!r} is not an object with dtype, shape and data_offsets")
        dtype = DTYPES.get(h["dtype"]) if isinstance(h["dtype"], str) else None
        if dtype is None:
            raise self._corrupt(f"tensor {name!r} has dtype {h['dtype']!r}; known: {', '.join(DTYPES)}")
        shape, offsets = h["shape"], h["data_offsets"]
        if not isinstance(shape, list) or not all(_whole(s) for s in shape):
            raise self._corrupt(f"tensor {name!r} has shape {shape!r}; a shape is a list of whole numbers >= 0")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_whole(o) for o in offsets):
            raise self._corrupt(f"tensor {name!r} has data_offsets {offsets!r}; expected [start, end], whole numbers")
        start, end = offsets
        if start > end:
            raise self._corrupt(f"tensor {name!r} has data_offsets {offsets!r}; start is after end")
        if base + end > size:
            raise CheckpointError(
                f"{self.path}: truncated: tensor {name!r} ends at byte {base + end} but the file has {size} bytes; "
                "re-download it"
            )
        numel = 1
        for s in shape:
            numel *= s
        elt = torch.tensor([], dtype=dtype).element_size()
        if numel * elt != end - start:
            raise CheckpointError(f"{self.path}: tensor {name!r} size does not match its shape {tuple(shape)}: "
                                  f"{numel} x {elt} bytes of {h['dtype']} but data_offsets span {end - start}; "
                                  "the file is corrupt, re-download it")
        return TensorInfo(name, dtype, tuple(shape), base + start, end - start)

    def _check_overlaps(self) -> None:
        """Two tensors may not share bytes: a writer bug or a crafted file would load one tensor's data as two."""
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values() if t.nbytes)
        for (_, end, a), (start, _, b) in itertools.pairwise(spans):
            if start < end:
                raise self._corrupt(f"tensors {a!r} and {b!r} overlap (bytes {start}-{end})")

    def _check_layout(self, base: int, size: int) -> None:
        """The tensors tile the data area from its first byte to the file's end, as the ``safetensors`` library
        requires of every file it reads ("invalid offset for tensor", "file not fully covered"). Why: each span
        already matches its
        dtype and shape (:meth:`_entry`), so a header whose dtype was changed and whose offsets were made to
        fit -- an F32 tensor relabelled F16 over half its bytes -- is caught only by the bytes it leaves
        belonging to no tensor."""
        pos, prev = base, None
        for t in sorted(self.tensors.values(), key=lambda t: (t.offset, t.nbytes)):
            if t.offset != pos:
                after = "the data area's start" if prev is None else f"the end of tensor {prev!r}"
                raise self._corrupt(f"tensor {t.name!r} starts at byte {t.offset}, {t.offset - pos} bytes after "
                                    f"{after} (byte {pos}); those bytes belong to no tensor")
            pos, prev = t.offset + t.nbytes, t.name
        if pos != size:
            last = "the data area's start" if prev is None else f"its last tensor {prev!r}"
            raise self._corrupt(f"the file has {size - pos} bytes after {last} (which ends at byte {pos}); "
                                "they belong to no tensor")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self) -> list[str]:
        return list(self.tensors)

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read one tensor (into ``out`` when given: same dtype/shape, contiguous, CPU)."""
        return self.read_info(self.tensors[name], out)

    def read_info(self, info: TensorInfo, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read the bytes ``info`` places in this file (a stored tensor, or a piece of one), as :meth:`read`."""
        name = info.name
        if out is None:
            out = torch.empty(info.shape, dtype=info.dtype)
        elif out.dtype != info.dtype or tuple(out.shape) != info.shape:
            raise ValueError(f"buffer {out.dtype}{tuple(out.shape)} does not fit {name} {info.dtype}{info.shape}")
        if info.nbytes:
            view = memoryview(out.view(-1).view(torch.uint8).numpy())
            fd = os.open(self.path, os.O_RDONLY)
            try:
                got = os.preadv(fd, [view], info.offset)
            finally:
                os.close(fd)
            if got != info.nbytes:
                raise CheckpointError(f"{self.path}: short read of tensor {name!r}; the file is truncated")
        return out


def _whole(v: object) -> bool:
    """A JSON integer >= 0 (not a bool, not 512.0: int() would silently accept a float shape)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _read_header(path: Path) -> tuple[dict, int, int]:
    """The header object, the data area's start and the file size (one-line errors for an unreadable one)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("file shorter than its 8-byte header length")
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > size - 8 or hlen > 100 * 1024 * 1024:
                raise ValueError(f"header length {hlen} exceeds the file size {size}")
            header = json.loads(f.read(hlen))
    except RecursionError:  # a header nested thousands deep: json's parser recurses per level
        raise CheckpointError(f"{path}: not a readable safetensors file (its JSON header is nested too deep); "
                              "re-download it") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); re-download it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a readable safetensors file (its header is a JSON "
                              f"{type(header).__name__}, not an object); re-download it")
    return header, 8 + hlen, size


@dataclass(frozen=True)
class DerivedTensor:
    """A tensor the model needs that the checkpoint stores in another layout, made when read
    (:meth:`CheckpointIndex.add_derived`): its ``info`` (name, dtype, shape; no place in a file)
    and the function that reads the stored pieces and makes it."""

    info: TensorInfo
    make: Callable[[], torch.Tensor]


class CheckpointIndex:
    """All tensors of a (possibly sharded) checkpoint, by name."""

    def __init__(self, files: list[SafetensorsFile]):
        self.files = files
        self.where: dict[str, SafetensorsFile] = {}
        for f in files:
            for name in f.tensors:
                self.where[name] = f
        self.derived: dict[str, DerivedTensor] = {}  # add_derived's

    @classmethod
    def open_dir(cls, directory: Path) -> "CheckpointIndex":
        index = directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError, RecursionError):
                raise CheckpointError(f"{index}: corrupt shard index (no weight_map); re-download it") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index}: corrupt shard index (weight_map is not an object of file names); "
                                      "re-download it")
            names = sorted(set(weight_map.values()))
            outside = [n for n in names if Path(n).name != n or n in (".", "..")]
            if outside:  # a shard is a file beside the index, never a path elsewhere
                raise CheckpointError(f"{index}: shard {outside[0]!r} is not a file name in {directory}; "
                                      "re-download it")
            missing = [n for n in names if not (directory / n).exists()]
            if missing:
                raise CheckpointError(f"{directory}: shard {missing[0]} listed in {index.name} is missing")
            return cls([SafetensorsFile(directory / n) for n in names])
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{directory}: no *.safetensors weights found")
        return cls([SafetensorsFile(p) for p in files])

    def __contains__(self, name: str) -> bool:
        return name in self.where or name in self.derived

    def info(self, name: str) -> TensorInfo:
        d = self.derived.get(name)
        return d.info if d is not None else self.where[name].tensors[name]

    def locate(self, name: str) -> tuple[Path, TensorInfo] | None:
        """``name``'s file and TensorInfo (an offloaded layer streams from there), None when absent or
        derived (not stored as such: streamed from the offload file once made, like a quantized layer)."""
        return (self.where[name].path, self.info(name)) if name in self.where else None

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        d = self.derived.get(name)
        if d is None:
            return self.where[name].read(name, out)
        t = d.make()
        if tuple(t.shape) != d.info.shape or t.dtype != d.info.dtype:
            raise ValueError(f"derived tensor {name}: made {t.dtype}{tuple(t.shape)}, declared "
                             f"{d.info.dtype}{d.info.shape}")
        return t if out is None else out.copy_(t)

    def read_piece(self, source: str, first: int, shape: tuple[int, ...]) -> torch.Tensor:
        """``prod(shape)`` elements of the stored tensor ``source`` from its element ``first`` (one expert of a
        fused ``[E, ...]`` tensor), read alone, shaped ``shape``."""
        return self.where[source].read_info(self._piece(source, source, first, shape))

    def _piece(self, name: str, source: str, first: int, shape: tuple[int, ...]) -> TensorInfo:
        """``name``'s TensorInfo as ``prod(shape)`` elements of stored ``source`` from its element ``first``."""
        src = self.info(source)
        elt = torch.tensor([], dtype=src.dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        if first < 0 or (first + numel) * elt > src.nbytes:
            raise ValueError(f"{name} of {source}: elements {first}..{first + numel} pass its {src.shape}")
        return TensorInfo(name, src.dtype, tuple(shape), src.offset + first * elt, numel * elt)

    def add_derived(self, name: str, dtype: torch.dtype, shape: tuple[int, ...],
                    make: Callable[[], torch.Tensor]) -> None:
        """Hold ``name`` as ``make()``: a tensor computed from stored ones when it is read (gpt-oss's
        interleaved gate|up columns of one expert, transposed; MXFP4 blocks dequantized). It is in the index,
        with this dtype and shape, but not locatable (:meth:`locate`)."""
        nbytes = torch.tensor([], dtype=dtype).element_size()
        for s in shape:
            nbytes *= s
        self.derived[name] = DerivedTensor(TensorInfo(name, dtype, tuple(shape), -1, nbytes), make)

    def add_view(self, name: str, source: str, first: int, shape: tuple[int, ...]) -> None:
        """Hold ``name`` as a contiguous piece of the stored tensor ``source``: ``prod(shape)`` elements from its
        element ``first`` (one expert's gate rows of a fused ``[E, 2 I, H]`` tensor). Reading, locating and
        streaming ``name`` then read just those bytes, as for any stored tensor (``engine/loader/experts.py``)."""
        f = self.where[source]
        f.tensors[name] = self._piece(name, source, first, shape)
        self.where[name] = f


def save_file(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write tensors as safetensors one at a time (no whole-state copy)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    items = list(tensors.items())
    for name, t in items:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-len(hbytes) % 8)
    tmp = Path(str(path) + ".part")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for _, t in items:
            t = t.detach().contiguous().cpu()
            if t.numel():
                f.write(t.view(-1).view(torch.uint8).numpy().tobytes())
    os.replace(tmp, path)
