"""A lean GGUF reader: metadata and tensor index from the header, tensor bytes memory-mapped.

Why not `gguf.GGUFReader`: it turns every element of the tokenizer arrays into its own numpy view,
which costs seconds per open; a daemon opens its model at every start. Dequantization is still the
`gguf` package's. Rules: nothing is read from the data section until a tensor is asked for, so a
shard touches only its own tensors; and tensors are read with `pread` into memory the caller owns,
never through a lasting mapping, so the file's pages do not stay in the daemon's resident memory
after the shard has repacked them (the page cache is told it may drop them).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

GGUF_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first), i.e. GGUF dims reversed
    qtype: GGMLQuantizationType
    offset: int  # absolute file offset
    nbytes: int


class _Cursor:
    def __init__(self, data: memoryview) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        value = bytes(self.data[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return value

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            itype, count = self.take("<I"), self.take("<Q")
            if itype in _NUMPY:
                arr = np.frombuffer(self.data, dtype=_NUMPY[itype], count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr
            return [self.value(itype) for _ in range(count)]
        raise GGUFError(f"unknown GGUF value type {vtype}")


class GGUFFile:
    """An open GGUF file: `metadata` (dict), `tensors` (name -> TensorInfo), `read(name)`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.size = self.path.stat().st_size
        header = np.memmap(self.path, dtype=np.uint8, mode="r")
        try:
            self._parse(header)
        finally:
            mm = getattr(header, "_mmap", None)
            del header
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # a view is still alive somewhere; the collector will close it
                    pass

    def _parse(self, header: np.ndarray) -> None:
        cur = _Cursor(memoryview(header))
        if bytes(cur.data[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (bad magic)")
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported")
        n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            value = cur.value(cur.take("<I"))
            # arrays are views of the mapping: copy them, so the mapping can be closed
            self.metadata[key] = value.copy() if isinstance(value, np.ndarray) else value
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
            qtype, offset = GGMLQuantizationType(cur.take("<I")), cur.take("<Q")
            infos.append((name, tuple(reversed(dims)), qtype, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape)) if shape else 1
            self.tensors[name] = TensorInfo(name, shape, qtype, data_start + offset, n // block * type_size)
        for info in self.tensors.values():
            if info.offset + info.nbytes > self.size:
                raise GGUFError(f"{self.path}: tensor {info.name} runs past the end of the file")

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes, in a new array, shaped (rows, bytes per row)."""
        info = self.tensors[name]
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        out = np.empty(info.nbytes, np.uint8)
        view, done = memoryview(out), 0
        fd = os.open(self.path, os.O_RDONLY)
        try:
            while done < info.nbytes:
                n = os.preadv(fd, [view[done:]], info.offset + done)
                if n <= 0:
                    raise GGUFError(f"{self.path}: short read in tensor {name}")
                done += n
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, info.offset, info.nbytes, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return out.reshape(rows, -1)

    def read(self, name: str) -> np.ndarray:
        """The tensor as float32 (dequantized when stored quantized), numpy shape order."""
        info = self.tensors[name]
        if info.qtype == GGMLQuantizationType.F32:
            out = self.raw(name).view(np.float32)
        elif info.qtype == GGMLQuantizationType.F16:
            out = self.raw(name).view(np.float16).astype(np.float32)
        elif info.qtype == GGMLQuantizationType.BF16:
            out = (self.raw(name).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            try:
                out = dequantize(self.raw(name), info.qtype)
            except NotImplementedError:
                raise GGUFError(f"{self.path}: tensor {name} uses {info.qtype.name}, which cannot be dequantized") from None
        return np.asarray(out, dtype=np.float32).reshape(info.shape)
