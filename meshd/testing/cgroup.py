"""Capped process groups for tests and benchmarks: a child cgroup with a hard limit, removed on exit.

Rule: the group is made under this process's own cgroup of the controller (memory: v2 `memory.max`,
or v1 `memory.limit_in_bytes`; cpu: v2 `cpu.max`, or v1 `cpu.cfs_quota_us`), processes enter it from
`preexec_fn` (or are moved in by pid), and `open_memory_cgroup` / `open_cpu_cgroup` remove it when
the block ends, also on failure (its processes must have ended by then: it waits a little, then
leaves the directory and says so).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


class CgroupUnavailable(RuntimeError):
    """No writable cgroup of that controller here (not root, or no such controller)."""


def _own_dir(controller: str) -> tuple[Path, str]:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hier, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return ROOT / controller / path.lstrip("/"), "v1"
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hier, controllers, path = line.split(":", 2)
        if hier == "0" and (ROOT / "cgroup.controllers").exists():
            return ROOT / path.lstrip("/"), "v2"
    raise CgroupUnavailable(f"no {controller} cgroup controller is mounted")


class Cgroup:
    def __init__(self, path: Path, version: str) -> None:
        self.path, self.version = path, version

    def enter(self) -> None:
        """Move the calling process into the group (use as a Popen preexec_fn)."""
        self.add(os.getpid())

    def add(self, pid: int) -> None:
        """Move a running process, every thread of it, into the group."""
        (self.path / "cgroup.procs").write_text(str(pid))


class CpuCgroup(Cgroup):
    def limit_cores(self, cores: float, period_us: int = 10_000) -> None:
        """At most `cores` CPUs' worth of time per period (a short period: a pass is throttled in small
        slices, as on a slower machine, rather than stopped for tens of milliseconds)."""
        quota = max(1000, int(cores * period_us))
        if self.version == "v2":
            (self.path / "cpu.max").write_text(f"{quota} {period_us}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(period_us))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))


class MemoryCgroup(Cgroup):
    def limit(self, nbytes: int) -> None:
        name = "memory.max" if self.version == "v2" else "memory.limit_in_bytes"
        (self.path / name).write_text(str(nbytes))

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
    with _open_cgroup("memory", MemoryCgroup, name) as group:
        group.limit(limit_bytes)
        yield group


@contextlib.contextmanager
def open_cpu_cgroup(cores: float, name: str = "meshd-bench"):
    """A new cpu cgroup allowed `cores` CPUs' worth of time (a machine of that size, on a bigger box)."""
    with _open_cgroup("cpu", CpuCgroup, name) as group:
        group.limit_cores(cores)
        yield group


@contextlib.contextmanager
def _open_cgroup(controller: str, kind, name: str):
    parent, version = _own_dir(controller)
    if version == "v2":
        controllers = (parent / "cgroup.subtree_control")
        if controller not in controllers.read_text().split():
            raise CgroupUnavailable(f"the {controller} controller is not delegated under {parent}")
    path = parent / f"{name}-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
    except OSError as exc:
        raise CgroupUnavailable(f"cannot create a cgroup under {parent}: {exc}") from None
    group = kind(path, version)
    try:
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
