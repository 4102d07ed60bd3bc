"""A GGUF file's header: metadata and tensor table, parsed in one pass, with no tensor data read.

Why not ``gguf.GGUFReader`` (llama.cpp's own Python reader, which llmsys uses to *write* files
and in tests): it builds a numpy view per array element, so opening a file with a 151,936-token
vocabulary and as many merges took 7.2 s on this project's VM -- once for the model and once more
for the tokenizer, longer than loading the weights -- and it reads tensors through a memory map,
which counts every weight page in the process's RSS while the weights are copied out (a 0.5B
model's f16 file peaked at 2.8 GB against 1.5 GB for its safetensors folder). The format is small
(a key/value list and a tensor table, little-endian; the spec is ggml's ``docs/gguf.md``), so it is
parsed here with ``struct`` over one read-only map of the header (~0.3 s for that vocabulary), and
tensor bytes are read with ``os.preadv`` into fresh buffers (:func:`read_bytes`), as the
safetensors reader does: no page of the file stays mapped.
"""

from __future__ import annotations

import itertools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmsys.kernels.common.errors import CheckpointError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types (ggml's gguf_type): struct format of the scalars; 8 string, 9 array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9
_U64 = struct.Struct("<Q")
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_NESTING = 4  # arrays of arrays: none of llama.cpp's keys nests deeper than 2; a crafted file nests without end
# The fewest bytes one key/value pair and one tensor-table entry take (empty name; a scalar of 1 byte; one dim):
# a count that needs more bytes than the file holds is rejected before the loop that would read it.
MIN_KV_BYTES, MIN_TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the table. ``shape`` is ggml's ``ne`` (fastest dimension first: ``[in, out]`` for a
    matrix); ``offset`` is absolute in the file; ``qtype`` ggml's type number (``gguf.GGMLQuantizationType``)."""

    name: str
    shape: tuple[int, ...]
    qtype: int
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class GGUFHeader:
    """``fields``: every key -> its value (scalars as Python values, strings as str, arrays of strings as
    lists of str, numeric arrays as numpy arrays); ``tensors`` in file order; ``size``: the file's bytes;
    ``alignment``: ``general.alignment`` (checked)."""

    path: Path
    version: int
    fields: dict[str, Any]
    tensors: tuple[TensorEntry, ...]
    size: int
    alignment: int


class _Cursor:
    """Sequential little-endian reads over the header map, failing with the file's name on a short read."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def take(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise self.truncated()
        v = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return v[0] if len(v) == 1 else v

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > self.size:
            raise self.truncated()
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.bad_utf8(str(e)) from None

    def strings(self, count: int) -> list[str]:
        """``count`` length-prefixed strings (a vocabulary, its merges), decoded in one go.

        Why not :meth:`string` per element: a 150k-token vocabulary and as many merges are ~300k
        Python-level reads and decodes (0.2-0.4 s). Here one loop finds where each string starts
        (the lengths chain, so that part stays sequential but does nothing else), numpy drops the
        length fields, the text is decoded once, and each element is a slice of it.
        """
        start, size, buf = self.pos, self.size, self.buf
        firsts: list[int] = []  # where each string's bytes begin
        mark, unpack = firsts.append, _U64.unpack_from
        pos = start
        try:
            for _ in range(count):
                pos += 8
                mark(pos)
                pos += unpack(buf, pos - 8)[0]
        except (struct.error, OverflowError):  # a length field past the end / absurdly large
            self.pos = min(pos, size)
            raise self.truncated() from None
        if pos > size:
            self.pos = size
            raise self.truncated()
        self.pos = pos
        if count == 0:
            return []
        keep = np.ones(pos - start, dtype=bool)
        first = np.array(firsts, dtype=np.int64) - start
        keep[(first[:, None] - 8 + np.arange(8)).ravel()] = False  # the length fields
        # A copy: no view of the map may outlive this line (the map is closed when the header is read).
        data = np.frombuffer(buf, dtype=np.uint8, count=pos - start, offset=start)[keep]
        # Byte offsets of each string in the length-less text, then character offsets in its decoding.
        lens = np.diff(first, append=pos - start + 8) - 8
        ends = np.cumsum(lens)
        begins = ends - lens
        lead = (data & 0xC0) != 0x80  # the first byte of each character
        chars = np.concatenate(([0], np.cumsum(lead)))
        nonempty = lens > 0
        # Every string must start on a character boundary: then the whole decoding being valid UTF-8
        # means each string is (a string cut mid-character would not start at a lead byte, or its tail
        # would leave the next string starting on a continuation byte).
        if not lead[begins[nonempty]].all():
            raise self.bad_utf8("a string starts inside a UTF-8 character")
        try:
            text = data.tobytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.bad_utf8(str(e)) from None
        cb, ce = chars[begins].tolist(), chars[ends].tolist()
        return [text[a:b] for a, b in zip(cb, ce)]

    def bad_utf8(self, why: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: a metadata string is not UTF-8 ({why}); the file is corrupt")

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            etype, count = self.take("I"), self.take("Q")
            if etype in _NUMPY:
                width = np.dtype(_NUMPY[etype]).itemsize
                if self.pos + count * width > self.size:
                    raise self.truncated()
                arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=count, offset=self.pos).copy()
                self.pos += count * width
                return arr
            if depth >= MAX_NESTING:
                raise CheckpointError(f"{self.path}: metadata arrays nested deeper than {MAX_NESTING} levels; "
                                      "the file is corrupt, download it again")
            self.room(count, 8, "array elements")  # each string or array element takes 8 bytes or more
            if etype == STRING:
                return self.strings(count)
            return [self.value(etype, depth + 1) for _ in range(count)]
        raise CheckpointError(f"{self.path}: unknown GGUF value type {vtype} in the metadata; the file is corrupt "
                              "or newer than this reader")

    def room(self, count: int, each: int, what: str) -> None:
        """``count`` items of at least ``each`` bytes must fit in what is left of the file (a corrupt count
        would otherwise loop, or allocate, for as long as it says)."""
        if count * each > self.size - self.pos:
            raise CheckpointError(f"{self.path}: the header claims {count} {what}, more than its "
                                  f"{self.size} bytes can hold; the file is corrupt, download it again")

    def truncated(self) -> CheckpointError:
        return CheckpointError(f"{self.path}: the GGUF header ends early (at byte {self.pos} of {self.size}); "
                               "the file is truncated or corrupt, download it again")


def read_header(path: str | Path) -> GGUFHeader:
    """Parse ``path``'s header and tensor table (one-line :class:`CheckpointError` for a bad file)."""
    p = Path(path)
    try:
        with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            size = len(buf)
            c = _Cursor(buf, p)
            if c.take("4s") != MAGIC:
                raise CheckpointError(f"{p}: not a GGUF file (no GGUF magic)")
            version = c.take("I")
            if version not in (2, 3):
                raise CheckpointError(f"{p}: GGUF version {version} is not supported (2 and 3 are); re-convert the file")
            n_tensors, n_kv = c.take("Q"), c.take("Q")
            c.room(n_kv, MIN_KV_BYTES, "metadata keys")
            c.room(n_tensors, MIN_TENSOR_BYTES, "tensors")
            fields: dict[str, Any] = {}
            for _ in range(n_kv):
                key = c.string()
                fields[key] = c.value(c.take("I"))
            infos = []
            for _ in range(n_tensors):
                name = c.string()
                n_dims = c.take("I")
                if not 1 <= n_dims <= MAX_DIMS:
                    raise CheckpointError(f"{p}: tensor {name} has {n_dims} dimensions; GGUF tensors have 1 to "
                                          f"{MAX_DIMS}; the file is corrupt, download it again")
                dims = tuple(int(c.take("Q")) for _ in range(n_dims))
                infos.append((name, dims, c.take("I"), c.take("Q")))
            align = _alignment(fields, p)
            start = -(-c.pos // align) * align
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{p}: cannot read it as GGUF ({e})") from None
    tensors = [_entry(p, name, dims, qtype, start + rel, size, align) for name, dims, qtype, rel in infos]
    _check_overlaps(p, tensors)
    _check_layout(p, tensors, start, align)
    return GGUFHeader(p, version, fields, tuple(tensors), size, align)


def _alignment(fields: dict[str, Any], p: Path) -> int:
    """``general.alignment``: a power of two (the data area and every tensor start on a multiple of it)."""
    align = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise CheckpointError(f"{p}: general.alignment is {align!r}; it must be a power of two (default "
                              f"{DEFAULT_ALIGNMENT}); the file is corrupt, convert or download it again")
    return align


def _entry(p: Path, name: str, dims: tuple[int, ...], qtype: int, offset: int, size: int, align: int) -> TensorEntry:
    """One tensor-table entry checked: a known type, whole blocks along the first dimension, no zero or
    absurd dimension, and its bytes at an aligned place inside the file."""
    import gguf  # only for the block sizes of the tensor types

    try:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        raise CheckpointError(f"{p}: tensor {name} has unknown ggml type {qtype}; the file is newer than this "
                              "reader or corrupt") from None
    n = 1
    for d in dims:
        n *= d
    if n == 0 or n >= 1 << 62 or dims[0] % block:
        raise CheckpointError(f"{p}: tensor {name} has dimensions {list(dims)}; each must be at least 1, their product "
                              f"below 2^62, and the first a multiple of the type's block of {block}; the file is "
                              "corrupt, download it again")
    t = TensorEntry(name, dims, qtype, offset, n // block * type_size)
    if offset % align:
        raise CheckpointError(f"{p}: tensor {name} starts at byte {offset}, not a multiple of the alignment {align}; "
                              "the file is corrupt, download it again")
    if t.offset + t.nbytes > size:
        raise CheckpointError(f"{p}: tensor {name} ends at byte {t.offset + t.nbytes} but the file has {size}; "
                              "the file is truncated or corrupt, download it again")
    return t


def _check_overlaps(p: Path, tensors: list[TensorEntry]) -> None:
    """No two tensors share bytes (one tensor's data read as another's is a corrupt table)."""
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors)
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise CheckpointError(f"{p}: tensors {a} and {b} overlap (bytes {start}-{end}); the file is corrupt, "
                                  "download it again")


def _described(t: TensorEntry) -> str:
    """``blk.0.attn_norm.weight (F16 [576], 1152 bytes)``: what the table says a tensor is."""
    import gguf

    return f"{t.name} ({gguf.GGMLQuantizationType(t.qtype).name} {list(t.shape)}, {t.nbytes} bytes)"


def _padded(nbytes: int, align: int) -> int:
    return -(-nbytes // align) * align


def _check_layout(p: Path, tensors: list[TensorEntry], start: int, align: int) -> None:
    """The tensors' bytes follow one another in table order from the data area's start, as llama.cpp's reader
    requires (``gguf.cpp``: each tensor at the previous one's end rounded up to the alignment).

    Why: the table's type and shape fix each tensor's size, so a type or shape that disagrees with the bytes
    written -- an F32 tensor relabelled F16 reads as half its bytes and decodes to noise ('--------') -- leaves a
    gap before the next tensor (after the last one: :func:`check_end`), and two swapped offsets put a tensor
    where another should be. Every file llama.cpp's writer, converter and quantizer (and the ``gguf`` package)
    makes passes; llama.cpp refuses the rest. Header only: no tensor byte is read. A tensor of at most ``align``
    bytes relabelled to a type just as padded (F32 [8] as F16) moves no offset and is not caught."""
    expect, prev = start, None
    for t in tensors:
        if t.offset != expect:
            what = (f"the data area starts at byte {start}" if prev is None else
                    f"the one before it in the table, {_described(prev)}, ends at byte {prev.offset + prev.nbytes}, "
                    f"so it should start at byte {expect}")
            raise CheckpointError(f"{p}: tensor {t.name} starts at byte {t.offset}, but {what} (alignment {align}); "
                                  "a type or shape in the table disagrees with the bytes written, or an offset is "
                                  "corrupt; convert or download the file again")
        expect, prev = t.offset + _padded(t.nbytes, align), t


def check_end(h: GGUFHeader) -> None:
    """A model file ends with its last tensor (and that tensor's padding), checked before the model is loaded.

    Why: the last tensor has no next offset to betray a wrong size (:func:`_check_layout`), so an F32 last
    tensor relabelled F16 shows only as bytes after it. llama.cpp's writer and converter end the file there;
    llama.cpp itself does not look. Not part of :func:`read_header`: a listing of models reads headers of files
    it does not load (an Ollama store's blob may be longer than its GGUF)."""
    if not h.tensors:
        return
    last = max(h.tensors, key=lambda t: t.offset)
    end, limit = last.offset + last.nbytes, last.offset + _padded(last.nbytes, h.alignment)
    if h.size > limit:
        raise CheckpointError(f"{h.path}: the file has {h.size - end} bytes after its last tensor, {_described(last)}, "
                              f"which ends at byte {end} (at most {limit - end} of padding belong there); its type or "
                              "shape disagrees with the bytes written, or the file is corrupt; convert or download "
                              "it again")


def read_bytes(path: Path, t: TensorEntry, start: int = 0, length: int | None = None) -> np.ndarray:
    """``length`` bytes of a tensor from byte ``start`` of it (default: all), ``uint8``, read into a fresh
    buffer (no mapping kept)."""
    size = t.nbytes - start if length is None else length
    out = np.empty(size, dtype=np.uint8)
    with open(path, "rb", buffering=0) as f:
        got = 0
        while got < size:
            n = os.preadv(f.fileno(), [memoryview(out)[got:]], t.offset + start + got)
            if n <= 0:
                raise CheckpointError(f"{path}: short read of tensor {t.name}; the file is truncated")
            got += n
    return out
