"""Read a container's CPU and memory accounting straight from its cgroup.

Docker's stats API samples for a second per call; these files answer in microseconds,
cheap enough to read around every cell. Works on cgroup v1 (cpuacct + memory
controllers) and v2 (unified). Where a file is missing the value is None, never a guess.

Each file is opened once and read with ``pread`` at offset 0 (cgroup files answer afresh
at every read from the start): about 1 µs a read instead of 15 µs for open/read/close.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from kernelhub.models import ResourceUsage


@dataclass(frozen=True)
class CgroupFiles:
    cpu_usage: Path | None  # v1 cpuacct.usage (ns) or v2 cpu.stat (usage_usec)
    memory_current: Path | None
    memory_peak: Path | None  # v1 memory.max_usage_in_bytes, v2 memory.peak
    v2: bool
    _fds: dict[tuple[Path, int], int] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def for_pid(
        cls, pid: int, root: Path = Path("/sys/fs/cgroup"), *, must_contain: str | None = None
    ) -> CgroupFiles | None:
        """``must_contain``: a container id the cgroup path must name. In another pid
        namespace (kernelhub itself in a container) the host pid may be some other process;
        then we report nothing rather than someone else's numbers."""
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return None
        if must_contain and not any(must_contain in line for line in lines):
            return None
        return cls.from_proc_cgroup(lines, root)

    @classmethod
    def from_proc_cgroup(cls, lines: list[str], root: Path) -> CgroupFiles | None:
        """Pure: map the lines of ``/proc/<pid>/cgroup`` to accounting files under root."""
        v1: dict[str, str] = {}
        unified: str | None = None
        for line in lines:
            parts = line.split(":", 2)
            if len(parts) != 3:
                continue
            _, controllers, path = parts
            if controllers == "":
                unified = path
            for controller in controllers.split(","):
                if controller:
                    v1[controller] = path
        if "memory" in v1:
            cpu_path = v1.get("cpuacct") or v1.get("cpu,cpuacct")
            cpu_dir = next(
                (
                    root / name / cpu_path.lstrip("/")
                    for name in ("cpuacct", "cpu,cpuacct", "cpu")
                    if cpu_path and (root / name).exists()
                ),
                None,
            )
            mem_dir = root / "memory" / v1["memory"].lstrip("/")
            return cls(
                cpu_usage=cpu_dir / "cpuacct.usage" if cpu_dir else None,
                memory_current=mem_dir / "memory.usage_in_bytes",
                memory_peak=mem_dir / "memory.max_usage_in_bytes",
                v2=False,
            )
        if unified is not None:
            base = root / unified.lstrip("/")
            return cls(
                cpu_usage=base / "cpu.stat",
                memory_current=base / "memory.current",
                memory_peak=base / "memory.peak",
                v2=True,
            )
        return None

    def read(self) -> ResourceUsage:
        return ResourceUsage(
            cpu_seconds=self._cpu_seconds(),
            memory_bytes=self._read_int(self.memory_current),
            peak_memory_bytes=self._read_int(self.memory_peak),
        )

    def reset_peak(self) -> None:
        """Start a new peak window (v1 always; v2 on kernels ≥ 6.12)."""
        if self.memory_peak is None:
            return
        with contextlib.suppress(OSError):
            os.pwrite(
                self._fd(self.memory_peak, os.O_WRONLY), b"0" if not self.v2 else b"reset\n", 0
            )

    def close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def _fd(self, path: Path, mode: int) -> int:
        fd = self._fds.get((path, mode))
        if fd is None:
            fd = self._fds[(path, mode)] = os.open(path, mode | os.O_CLOEXEC)
        return fd

    def _read(self, path: Path) -> str:
        return os.pread(self._fd(path, os.O_RDONLY), 4096, 0).decode()

    def _read_int(self, path: Path | None) -> int | None:
        if path is None:
            return None
        try:
            return int(self._read(path).strip())
        except (OSError, ValueError):
            return None

    def _cpu_seconds(self) -> float | None:
        if self.cpu_usage is None:
            return None
        if not self.v2:
            ns = self._read_int(self.cpu_usage)
            return ns / 1e9 if ns is not None else None
        try:
            for line in self._read(self.cpu_usage).splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
        except (OSError, ValueError):
            return None
        return None
