"""The operations kernelhub runs in a kernel to capture or restore it
(``kernelhub_kernel.snapshot`` in the image). Pure: each builder returns a
:class:`~kernelhub.execution.ops.KernelOp`, the operation by name for an image that takes
``kernelhub_call_request`` and as source for one that does not; ``ops.run`` picks, and
reads the answer."""

from __future__ import annotations

from typing import Any

from kernelhub.execution.ops import KernelOp

_MODULE = "__import__('kernelhub_kernel.snapshot', fromlist=['capture'])"
_RESULT = f"{_MODULE}.last_result()"
_DIR = "__import__('os').path.join(__import__('os').environ.get('KERNELHUB_SNAPSHOTS', '/tmp/.kernelhub'), {name!r})"


def _check(name: str) -> str:
    if not name.replace("-", "").isalnum():
        raise ValueError(f"snapshot directory name {name!r} must be alphanumeric with dashes")
    return name


# An exception out of a capture or restore is raised again from the call's own line, with
# the inner frames as plain text: IPython's highlighted traceback of the deep stack through
# the helper module took 2-10 s of CPU on a loaded host, past the interrupt grace, so a
# capture interrupted at its deadline restarted the kernel (its variables lost) instead.
_GUARD = """\
try:
    {call}
except KeyboardInterrupt:
    raise KeyboardInterrupt from None
except BaseException as exc:
    raise RuntimeError(''.join(__import__('traceback').format_exception(exc, limit=-4))) from None
"""


def capture(name: str, base: str | None = None, *, result: bool = False) -> KernelOp:
    """A capture into the directory ``name``, incremental on ``base``; its result only
    if asked for (a checkpoint wants none, and it is most of the reply)."""
    base_arg = _DIR.format(name=_check(base)) if base else "None"
    call = f"{_MODULE}.capture({_DIR.format(name=_check(name))}, base={base_arg})"
    args = {"name": name, "base": base}
    return KernelOp("capture", args, _GUARD.format(call=call), _RESULT if result else None)


def restore(name: str, execution_count: int | None = None) -> KernelOp:
    """``execution_count``: the next cell's number, when it is not the capture's own (a
    checkpoint shared by cells that changed nothing; only images that report those)."""
    extra = "" if execution_count is None else f", execution_count={int(execution_count)}"
    code = _GUARD.format(call=f"{_MODULE}.restore({_DIR.format(name=_check(name))}{extra})")
    count = None if execution_count is None else int(execution_count)
    return KernelOp("restore", {"name": name, "execution_count": count}, code, _RESULT)


def capture_stream(name: str) -> KernelOp:
    """Capture straight into the socket ``name`` the kernel binds in its socket directory
    (the host reads it with ``transfer.pull``)."""
    code = _GUARD.format(call=f"{_MODULE}.capture_stream({_check(name)!r})")
    return KernelOp("capture_stream", {"name": name}, code, _RESULT)


def restore_stream(name: str) -> KernelOp:
    """Restore from the socket ``name`` (the host writes it with ``transfer.push``)."""
    code = _GUARD.format(call=f"{_MODULE}.restore_stream({_check(name)!r})")
    return KernelOp("restore_stream", {"name": name}, code, _RESULT)


def remove(name: str) -> KernelOp:
    code = f"__import__('shutil').rmtree({_DIR.format(name=_check(name))}, ignore_errors=True)"
    return KernelOp("remove", {"name": name}, code)


def call_spans(result: dict[str, Any], called_at: float, answered_at: float) -> dict[str, float]:
    """``call``: the capture call, sent to answered; ``to_kernel``: from the call to the
    kernel starting the capture; ``from_kernel``: from its end to the answer here (the
    execute's messaging and the kernel's own handling of it). Wall clock: the sandbox
    shares the host's. An old image reports no start and end: ``call`` alone."""
    started, ended = result.get("started_at"), result.get("ended_at")
    spans = {"call": round(answered_at - called_at, 6)}
    if not isinstance(started, (int, float)) or not isinstance(ended, (int, float)):
        return spans
    return {
        **spans,
        "to_kernel": round(started - called_at, 6),
        "from_kernel": round(answered_at - ended, 6),
    }


def kernel_timings(kernel: object) -> dict[str, float]:
    """The kernel's reported phases (an old image's or a broken report: whatever is a number)."""
    if not isinstance(kernel, dict):
        return {}
    laps = kernel.get("timings")
    laps = laps if isinstance(laps, dict) else {}
    out = {str(k): round(float(v), 6) for k, v in laps.items() if isinstance(v, (int, float))}
    if isinstance(kernel.get("duration"), (int, float)):
        out["total"] = round(float(kernel["duration"]), 6)
    return out
