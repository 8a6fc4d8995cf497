"""Say in words why a kernel ended. Pure."""

from __future__ import annotations

import signal

from kernelhub.sandbox.base import ExitInfo


def describe_exit(
    exit_code: int | None, *, oom_killed: bool = False, memory_limit: int | None = None
) -> ExitInfo:
    """``exit_code`` is the supervisor's: the kernel's own code, or 128 + signal number."""
    if oom_killed:
        limit = f": limit {memory_limit // 2**20} MiB" if memory_limit else ""
        return ExitInfo(exit_code=exit_code, oom_killed=True, reason=f"out of memory{limit}")
    if exit_code is None:
        return ExitInfo(reason="the sandbox stopped")
    if exit_code > 128:
        try:
            name = signal.Signals(exit_code - 128).name
        except ValueError:
            name = f"signal {exit_code - 128}"
        return ExitInfo(exit_code=exit_code, reason=f"kernel killed by {name}")
    if exit_code < 0:  # a local process killed by a signal reports -signum
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        return ExitInfo(exit_code=exit_code, reason=f"kernel killed by {name}")
    return ExitInfo(exit_code=exit_code, reason=f"kernel exited with status {exit_code}")
