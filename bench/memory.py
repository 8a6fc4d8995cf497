"""Memory of a process tree on the host, and of a container as its cgroup counts it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil


def process_memory(pid: int) -> tuple[int, int | None]:
    """(RSS, PSS) in bytes; PSS is None where ``smaps_rollup`` cannot be read."""
    rss = int(psutil.Process(pid).memory_info().rss)
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return rss, int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, None


def container_usage(container: Any) -> tuple[int, int]:
    """(usage less inactive file cache, raw usage) in bytes from the docker stats API:
    the first is what ``docker stats`` shows (cgroup v1 and v2 alike)."""
    stats = container.stats(stream=False)["memory_stats"]
    usage = int(stats["usage"])
    extra = stats.get("stats", {})
    inactive = extra.get("total_inactive_file", extra.get("inactive_file", 0))
    return usage - int(inactive), usage


def container_pss(container: Any) -> int | None:
    """Sum of the PSS of the container's processes, read from the host's /proc (needs the
    same pid namespace as the daemon, and root); None when that is not possible."""
    top = container.top(ps_args="-o pid")
    total = 0
    for proc in top.get("Processes") or []:
        try:
            _, pss = process_memory(int(proc[0]))
        except psutil.Error:
            return None
        if pss is None:
            return None
        total += pss
    return total
