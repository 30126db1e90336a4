"""What a shard will hold, known before it loads: weight bytes per recipe, and the memory it may use.

Rules: computed from the artifact's header alone (no tensor is read), with the same arithmetic the
loaders use, so `Shard.weight_bytes` after loading equals `weight_bytes` before (a test holds it).
A daemon refuses up front a range that does not fit its `--memory` or its cgroup's hard limit,
rather than being killed by the kernel half-way through loading.
"""

from __future__ import annotations

from pathlib import Path

from meshd.shard import blocks, quant, rope
from meshd.shard.families import FAMILIES

STAGING_BYTES_PER_CODE = 6


class MemoryRefused(ValueError):
    """The asked range does not fit the memory this daemon may use."""


def _tensor_bytes(artifact, name: str, recipe, role: str) -> int:
    """role: "matrix" (a weight matmuls run on), "vector" (norms, biases) or "table" (embedding)."""
    n = artifact.tensor_elements(name)
    if role == "vector":  # norms stay float32; biases take the compute dtype
        is_norm = "norm" in name or "ln_" in name
        return 4 * n if is_norm else n * recipe.torch_compute.itemsize
    if recipe.weight_dtype == "float32" or (role == "table" and recipe.weight_dtype == "int8"):
        return 4 * n
    if recipe.weight_dtype == "int8":
        conv1d = artifact.kind == "hf" and (".attn.c_" in name or ".mlp.c_" in name)  # GPT-2's [in, out]
        shape = artifact.tensor_shape(name)
        rows = shape[-1] if conv1d else n // shape[-1]
        return n + rows * recipe.torch_compute.itemsize
    # stored: GGUF quantized tensors repack (or stay raw for a table); floats stay as stored
    if artifact.kind == "gguf":
        qtype, shape = artifact.tensor_qtype(name), artifact.tensor_shape(name)
        if qtype in quant.STORED_FLOATS:  # a float table is widened to float32 for lookups
            return 4 * n if role == "table" else artifact.stored_bytes(name)
        if role == "table" or blocks.available(qtype):  # kept as its GGUF blocks
            return artifact.stored_bytes(name)
        return quant.native_bytes(qtype, shape, recipe.torch_matmul.itemsize)
    return 4 * n if role == "table" else artifact.stored_bytes(name)


def table_is_lm_head(artifact, recipe, name: str) -> bool:
    """Whether a tied embedding table serves as the LM head too (`llama.lm_head`): in float32, and in
    the native lane where the table stays as GGUF blocks the kernel multiplies."""
    if recipe.weight_dtype == "float32":
        return True
    if recipe.weight_dtype != "stored" or artifact.kind != "gguf":
        return False
    qtype = artifact.tensor_qtype(name)
    return qtype not in (None, *quant.STORED_FLOATS) and blocks.available(qtype)


def _globals(family, artifact) -> dict[str, str]:
    if artifact.config.family == "gpt2":
        return family.global_names(artifact)
    return family.global_names(artifact.kind, artifact.config)


def layer_bytes(artifact, recipe, i: int) -> int:
    """Bytes one layer holds under this recipe."""
    family = FAMILIES[artifact.config.family]
    names = family.tensor_names(artifact.kind, artifact.config, i)
    return sum(_tensor_bytes(artifact, n, recipe, "matrix" if len(artifact.tensor_shape(n)) >= 2 else "vector")
               for n in names)


def weight_bytes(artifact, recipe, start: int, end: int) -> int:
    """Bytes of weights a shard over [start, end) holds: its layers, the embedding at the head,
    the final norm and LM head at the tail (a tied LM head on a shard that is both is the table itself)."""
    family, cfg = FAMILIES[artifact.config.family], artifact.config
    total = sum(layer_bytes(artifact, recipe, i) for i in range(start, end))
    total += sum(4 * artifact.tensor_elements(n) for n in rope.tensor_names(cfg.rope_scaling))  # every hop's
    g = _globals(family, artifact)
    if start == 0:
        total += _tensor_bytes(artifact, g["embed"], recipe, "table")
        if "pos_embed" in g:
            total += 4 * artifact.tensor_elements(g["pos_embed"])
    if end == cfg.n_layers:
        norms = [g[k] for k in ("final_norm", "norm_w", "norm_b") if k in g]
        total += sum(4 * artifact.tensor_elements(n) for n in norms)
        if not (start == 0 and g["lm_head"] == g["embed"] and table_is_lm_head(artifact, recipe, g["embed"])):
            total += _tensor_bytes(artifact, g["lm_head"], recipe, "matrix")
    return total


def owned_artifact_bytes(artifact, start: int, end: int) -> int:
    """Bytes the artifact stores for what a shard owns (the yardstick of the memory goal)."""
    family, cfg = FAMILIES[artifact.config.family], artifact.config
    names = [n for i in range(start, end) for n in family.tensor_names(artifact.kind, cfg, i)]
    names += rope.tensor_names(cfg.rope_scaling)  # every hop that runs attention holds them
    g = _globals(family, artifact)
    if start == 0:
        names += [g["embed"]] + ([g["pos_embed"]] if "pos_embed" in g else [])
    if end == cfg.n_layers:
        names += [g[k] for k in ("final_norm", "norm_w", "norm_b", "lm_head") if k in g]
    return sum(artifact.stored_bytes(n) for n in dict.fromkeys(names))  # a tied table is stored once


def staging_bytes(artifact) -> int:
    """Transient bytes while repacking the costliest tensor: its raw copy plus one packing chunk
    (codes, their int4 halves and the kernel's int32 input: 6 bytes a code)."""
    def cost(name: str) -> int:
        shape, qtype = artifact.tensor_shape(name), artifact.tensor_qtype(name)
        halves = 1 if qtype in (quant.QT.Q4_0, quant.QT.Q4_1, quant.QT.Q4_K) else 2
        rows = artifact.tensor_elements(name) // shape[-1]  # experts stacked in 3-D count as rows too
        chunk = min(quant.PACK_ROWS, rows) * shape[-1] * halves * STAGING_BYTES_PER_CODE if len(shape) >= 2 else 0
        return artifact.stored_bytes(name) + chunk

    return max(cost(n) for n in artifact.tensor_names())


def cgroup_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The hard memory limit of this process's cgroup (v2 `memory.max`, v1 `memory.limit_in_bytes`)."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hier, controllers, path = line.split(":", 2)
        if hier == "0" and controllers == "":
            candidates = [Path(root) / path.lstrip("/") / "memory.max"]
        elif "memory" in controllers.split(","):
            candidates = [Path(root) / "memory" / path.lstrip("/") / "memory.limit_in_bytes"]
        else:
            continue
        for c in candidates:
            try:
                text = c.read_text().strip()
            except OSError:
                continue
            if text != "max" and int(text) < (1 << 60):
                return int(text)
    return None


def rss_bytes() -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def check_fits(artifact, recipe, start: int, end: int, memory: int = 0, limit: int | None = None,
               used: int | None = None) -> int:
    """Weight bytes of [start, end); MemoryRefused if they exceed `memory` (--memory) or, with the
    staging while loading, what is left under `limit` (default: the cgroup's) above `used` (RSS)."""
    need = weight_bytes(artifact, recipe, start, end)
    mb = lambda b: f"{b / 1e6:.0f} MB"  # noqa: E731
    what = f"layers {start}:{end} of {artifact.name} need {mb(need)} of weights in the {recipe.name} recipe"
    if memory and need > memory:
        raise MemoryRefused(f"{what}, more than --memory allows ({mb(memory)}); serve fewer layers")
    limit = cgroup_limit() if limit is None else limit
    if limit:
        used = rss_bytes() if used is None else used
        peak = need + staging_bytes(artifact)
        if used + peak > limit:
            raise MemoryRefused(f"{what} (about {mb(peak)} while loading), but this process's memory limit"
                                f" is {mb(limit)} with {mb(used)} in use; serve fewer layers")
    return need


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
HEAP_MMAP_BYTES = 1 << 20  # a block this big or bigger is mapped alone, and unmapped when freed
HEAP_TRIM_BYTES = 2 << 20  # free heap past this at the top of an arena goes back at the next free


def _libc():
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def pin_heap_thresholds() -> bool:
    """Fix glibc malloc's mmap and trim thresholds for the process's life (a daemon calls this first).

    By default each freed mapped block of N bytes raises them to N and 2N (up to 32 and 64 MiB): after
    one burst of large frames (zstd bombs, half-sent frames) blocks that size come from the arenas,
    and every thread's arena (trio's, the decode workers') keeps up to 64 MiB free at its top, which
    `malloc_trim` hands back for the main arena only. Measured on a daemon: 20 zstd frames of 16 MiB
    left +16 MiB in a decode worker's arena through gc and trims, none once pinned (the cost: blocks
    of 1 MiB and more are mapped and unmapped each time, a page fault a page). False without glibc."""
    try:
        libc = _libc()
        return bool(libc.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_BYTES) and libc.mallopt(M_TRIM_THRESHOLD,
                                                                                     HEAP_TRIM_BYTES))
    except (OSError, AttributeError):
        return False


def trim_heap() -> None:
    """Give freed heap pages back to the kernel (glibc keeps them after repacking's staging
    buffers are freed: about 40% on top of a layer's weights). No-op where there is no glibc."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass
