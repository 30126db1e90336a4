"""Named, typed tensors as they travel: raw little-endian bytes plus name, shape and dtype.

Rule: a `Tensor` always holds the raw (uncompressed) bytes; the wire encoding (raw or zstd) is the
codec's business. Conversions to and from torch and numpy never go through a wider dtype: bfloat16
stays two bytes per element all the way.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

# wire dtype name -> (itemsize, numpy dtype string or None when numpy has no such type); numpy itself
# is imported where arrays are made, so a client that moves only text (meshctl) never loads it
DTYPES: dict[str, tuple[int, Any]] = {
    "bfloat16": (2, None),
    "float16": (2, "<f2"),
    "float32": (4, "<f4"),
    "int32": (4, "<i4"),
    "int64": (8, "<i8"),
}
BYTE_ORDER = "<"


@dataclass(frozen=True, slots=True)
class Tensor:
    """A named tensor: `data` is exactly prod(shape) * itemsize raw little-endian bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    data: bytes

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported tensor dtype {self.dtype!r}; known: {sorted(DTYPES)}")
        expected = math.prod(self.shape) * DTYPES[self.dtype][0]
        if len(self.data) != expected:
            raise ValueError(
                f"tensor {self.name!r}: {len(self.data)} bytes for shape {self.shape} {self.dtype}"
                f" (expected {expected})"
            )

    @property
    def nbytes(self) -> int:
        return len(self.data)

    @classmethod
    def from_numpy(cls, name: str, array) -> "Tensor":
        """Wrap a numpy array (float16/32, int32/64); bfloat16 must come from torch."""
        import numpy as np

        for dtype_name, (_, spec) in DTYPES.items():
            np_dtype = None if spec is None else np.dtype(spec)
            if np_dtype is not None and array.dtype.kind == np_dtype.kind and array.dtype.itemsize == np_dtype.itemsize:
                data = np.ascontiguousarray(array, dtype=np_dtype).tobytes()
                return cls(name, tuple(int(d) for d in array.shape), dtype_name, data)
        raise ValueError(f"numpy dtype {array.dtype} has no wire dtype")

    def to_numpy(self):
        """A read-only numpy view; bfloat16 is widened to float32 (numpy has no bfloat16)."""
        import numpy as np

        if self.dtype == "bfloat16":
            bits = np.frombuffer(self.data, dtype="<u2").astype(np.uint32) << 16
            return bits.view(np.float32).reshape(self.shape)
        return np.frombuffer(self.data, dtype=DTYPES[self.dtype][1]).reshape(self.shape)

    @classmethod
    def from_torch(cls, name: str, tensor: Any) -> "Tensor":
        """Wrap a torch tensor, keeping its dtype (bfloat16 goes through an int16 view, not float32)."""
        import torch

        names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                 torch.int32: "int32", torch.int64: "int64"}
        if tensor.dtype not in names:
            raise ValueError(f"torch dtype {tensor.dtype} has no wire dtype")
        t = tensor.detach().contiguous().cpu()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.view(torch.int16)
        array = t.numpy()
        if sys.byteorder != "little":  # pragma: no cover - meshd peers all run little-endian today
            array = array.byteswap()
        return cls(name, tuple(tensor.shape), names[tensor.dtype], array.tobytes())

    def to_torch(self) -> Any:
        """A new torch tensor with this tensor's dtype and shape."""
        import torch

        dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                  "int32": torch.int32, "int64": torch.int64}
        if not self.data:
            return torch.empty(self.shape, dtype=dtypes[self.dtype])
        flat = torch.frombuffer(bytearray(self.data), dtype=dtypes[self.dtype])
        return flat.reshape(self.shape)
