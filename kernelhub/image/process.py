"""Running a host command (pip, debootstrap) while streaming its output lines."""

from __future__ import annotations

import subprocess
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from kernelhub.errors import ImageBuildError

#: How many output lines an error message carries.
TAIL_LINES = 40


def run_streaming(
    argv: Sequence[str],
    progress: Callable[[str], None],
    *,
    env: Mapping[str, str] | None = None,
) -> tuple[int, list[str]]:
    """Run ``argv`` to completion, passing each line of its stdout and stderr to ``progress``.

    Returns the exit status and the last :data:`TAIL_LINES` lines, for the caller's error
    message. Raises :class:`ImageBuildError` only if the program cannot be started. If
    ``progress`` raises (Ctrl-C included), the process is killed before the error propagates.
    """
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=dict(env) if env is not None else None,
        )
    except OSError as exc:
        raise ImageBuildError(f"cannot run {argv[0]}: {exc}") from exc
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    with proc:
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.rstrip("\n")
                tail.append(line)
                progress(line)
        except BaseException:
            proc.kill()
            raise
    return proc.returncode, list(tail)


def format_tail(lines: Sequence[str]) -> str:
    """The output tail as an error message suffix (empty when there is no output)."""
    if not lines:
        return ""
    return "\n--- output (last lines) ---\n" + "\n".join(lines)
