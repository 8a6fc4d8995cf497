"""The CPU time of each event-loop callback of a process, for benchmarks (never the service).

"A few ms per slice" is a claim about the CPU a callback takes, and a loop's lag on a
loaded 2-core machine is mostly the scheduler's (a callback preempted for 40 ms took 40 ms
of wall time and 0.3 ms of CPU). :func:`install` wraps ``asyncio.Handle._run`` (every
callback of the pure-Python loop: ``call_soon``, timers, reader callbacks, each step of a
task) with ``time.thread_time()`` and ``time.perf_counter()``, and appends one line per
callback whose CPU passed ``LOG_CPU`` (or whose wall time passed ``LOG_WALL``) to a file:
``<end, epoch seconds> <cpu s> <wall s> <what>``. :func:`read` gives them back.

Installed in a child process by a ``sitecustomize`` on its ``PYTHONPATH`` that imports
this module (``bench/neighbours.py`` does that for its gateway): :data:`ENV` names the
directory, the file is ``loopcpu-<pid>.log`` in it. Costs ~1 us per callback.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = "KH_BENCH_LOOP_CPU_DIR"
LOG_CPU = 0.001  # seconds of CPU
LOG_WALL = 0.010  # seconds of wall time

SITECUSTOMIZE = f"""\
import os
if os.environ.get({ENV!r}):
    import loop_cpu
    loop_cpu.install(os.environ[{ENV!r}])
"""


@dataclass(frozen=True)
class Callback:
    end: float  # time.time() when it returned
    cpu: float  # its thread's CPU seconds
    wall: float  # seconds, start to end
    what: str


def log_path(directory: str | Path, pid: int) -> Path:
    return Path(directory) / f"loopcpu-{pid}.log"


def _describe(callback: object) -> str:
    """The callback, or for a task's step the innermost coroutine it is now suspended in
    (where the step ended: the work was just before it)."""
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        coro: Any = owner.get_coro()
        inner = coro
        while hasattr(getattr(inner, "cr_await", None), "cr_frame"):
            inner = inner.cr_await
        frame = getattr(inner, "cr_frame", None)
        where = ""
        if frame is not None:
            file = frame.f_code.co_filename.rsplit("/", 1)[-1]
            where = f" in {inner.__qualname__} ({file}:{frame.f_lineno})"
        return f"task {getattr(coro, '__qualname__', repr(coro))}{where}"
    return str(getattr(callback, "__qualname__", None) or repr(callback))[:160]


def install(directory: str | Path) -> Callable[[], None]:
    """Time every callback of this process's asyncio loops from now on; returns the
    function that stops it (tests)."""
    path = log_path(directory, os.getpid())
    out = path.open("a", buffering=1)
    original = asyncio.events.Handle._run
    thread_time, perf, now = time.thread_time, time.perf_counter, time.time

    def _run(self: asyncio.Handle) -> None:
        callback = self._callback  # type: ignore[attr-defined]  # cancel() clears it
        c0, w0 = thread_time(), perf()
        original(self)
        cpu, wall = thread_time() - c0, perf() - w0
        if cpu > LOG_CPU or wall > LOG_WALL:
            out.write(f"{now():.4f} {cpu:.6f} {wall:.6f} {_describe(callback)}\n")

    asyncio.events.Handle._run = _run  # type: ignore[method-assign]

    def uninstall() -> None:
        asyncio.events.Handle._run = original  # type: ignore[method-assign]
        out.close()

    return uninstall


def read(
    directory: str | Path, pid: int, since: float = 0.0, until: float = float("inf")
) -> list[Callback]:
    """The logged callbacks of process ``pid`` that ended in ``[since, until]``."""
    path = log_path(directory, pid)
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        parts: list[Any] = line.split(" ", 3)
        if len(parts) < 4:
            continue
        end = float(parts[0])
        if since <= end <= until:
            found.append(Callback(end, float(parts[1]), float(parts[2]), parts[3]))
    return found
