"""Memory-capped process groups for tests: a child cgroup with a hard limit, removed on exit.

Rule: the group is made under this process's own memory cgroup (v2 `memory.max`, or v1
`memory.limit_in_bytes`), processes enter it from `preexec_fn`, and `open_memory_cgroup` removes it
when the block ends, also on failure (its processes must have ended by then: it waits a little,
then leaves the directory and says so).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


class CgroupUnavailable(RuntimeError):
    """No writable memory cgroup here (not root, or no memory controller)."""


def _own_memory_dir() -> tuple[Path, str]:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hier, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return ROOT / "memory" / path.lstrip("/"), "v1"
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hier, controllers, path = line.split(":", 2)
        if hier == "0" and (ROOT / "cgroup.controllers").exists():
            return ROOT / path.lstrip("/"), "v2"
    raise CgroupUnavailable("no memory cgroup controller is mounted")


class MemoryCgroup:
    def __init__(self, path: Path, version: str) -> None:
        self.path, self.version = path, version

    def limit(self, nbytes: int) -> None:
        name = "memory.max" if self.version == "v2" else "memory.limit_in_bytes"
        (self.path / name).write_text(str(nbytes))

    def enter(self) -> None:
        """Move the calling process into the group (use as a Popen preexec_fn)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int | None:
        name = "memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        """How many processes the kernel killed in this group for memory (0 where it cannot tell)."""
        name = "memory.events" if self.version == "v2" else "memory.oom_control"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0


@contextlib.contextmanager
def open_memory_cgroup(limit_bytes: int, name: str = "meshd-test"):
    """A new memory cgroup capped at `limit_bytes`; removed at the end."""
    parent, version = _own_memory_dir()
    if version == "v2":
        controllers = (parent / "cgroup.subtree_control")
        if "memory" not in controllers.read_text().split():
            raise CgroupUnavailable(f"the memory controller is not delegated under {parent}")
    path = parent / f"{name}-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
    except OSError as exc:
        raise CgroupUnavailable(f"cannot create a cgroup under {parent}: {exc}") from None
    group = MemoryCgroup(path, version)
    try:
        group.limit(limit_bytes)
        yield group
    finally:
        deadline = time.monotonic() + 10
        while True:
            try:
                path.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)  # processes still leaving
