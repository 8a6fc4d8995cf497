"""``kernelhub_call_request``: kernelhub's own calls into this kernel, answered by a shell
handler of their own instead of IPython's ``run_cell``.

Each capture, restore or removal of a checkpoint directory used to be a silent
``execute_request`` of Python source: it paid for all of ``run_cell`` (transform,
compile, AST walk, hooks, ``user_expressions`` formatting), about 60% of a checkpoint's
kernel CPU and 10-15 ms of an API snapshot under load. The request names one operation of
the fixed table ``OPERATIONS`` and its arguments: it carries no code.

The calling contract (the host, on the shell channel)::

    kernelhub_call_request  {"op": "capture", "args": {"name": "ck-2", "base": "ck-1"},
                             "result": false}
    kernelhub_call_reply    {"status": "ok", "result": {...}}      # {} if "result" is false
                            {"status": "error", "ename": "RuntimeError", "evalue": "...",
                             "traceback": ["plain text", ...]}

It runs on the shell queue, in turn with cells. ipykernel's ``dispatch_shell`` publishes
``busy`` and ``idle`` around it with the request as their parent (how the host knows it
ended) and installs Python's SIGINT handler for it, so an interrupt raises
KeyboardInterrupt inside the operation; the reply then says ``KeyboardInterrupt``. No
execution count is taken, nothing enters the history, no IPython hook runs, nothing is
published but what the operation prints (its parent is the request, so the host never
shows it as a cell's output). ``kernel_info_reply`` carries ``kernelhub_calls: 1``; with
``KERNELHUB_KERNEL_CALLS=0`` the kernel neither handles nor advertises the request, as an
image from before it, which is how the host's fallback to the execute is tested.
"""

from __future__ import annotations

import json
import os
import shutil
import traceback
from collections.abc import Callable, Mapping
from typing import Any

REQUEST = "kernelhub_call_request"
REPLY = "kernelhub_call_reply"
INFO_KEY = "kernelhub_calls"
VERSION = 1
ENABLE_ENV = "KERNELHUB_KERNEL_CALLS"


def _checked(name: object, what: str) -> str:
    """A name the host sent, never a path: alphanumeric with dashes."""
    if not isinstance(name, str) or not name.replace("-", "").isalnum():
        raise ValueError(f"{what} name {name!r} must be alphanumeric with dashes")
    return name


def _directory(name: object) -> str:
    """A snapshot directory by name, under ``KERNELHUB_SNAPSHOTS``: the host names them, it
    never sends a path."""
    directory = _checked(name, "snapshot directory")
    return os.path.join(os.environ.get("KERNELHUB_SNAPSHOTS", "/tmp/.kernelhub"), directory)


def _snapshot(function: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``kernelhub_kernel.snapshot.<function>``. Each marks the next execute's hooks as
    its own (the one that carried it, before); no execute carried this one."""
    from kernelhub_kernel import snapshot

    try:
        result: dict[str, Any] = getattr(snapshot, function)(*args, **kwargs)
        return result
    finally:
        snapshot.end_own_call()


def _capture(name: str, base: str | None = None) -> dict[str, Any]:
    return _snapshot("capture", _directory(name), base=None if base is None else _directory(base))


def _restore(name: str, execution_count: int | None = None) -> dict[str, Any]:
    count = None if execution_count is None else int(execution_count)
    return _snapshot("restore", _directory(name), execution_count=count)


def _capture_stream(name: str) -> dict[str, Any]:
    return _snapshot("capture_stream", _checked(name, "socket"))


def _restore_stream(name: str) -> dict[str, Any]:
    return _snapshot("restore_stream", _checked(name, "socket"))


def _remove(name: str) -> dict[str, Any]:
    shutil.rmtree(_directory(name), ignore_errors=True)
    return {}


OPERATIONS: dict[str, Callable[..., dict[str, Any]]] = {
    "capture": _capture,
    "restore": _restore,
    "capture_stream": _capture_stream,
    "restore_stream": _restore_stream,
    "remove": _remove,
}


def answer(content: Mapping[str, Any]) -> dict[str, Any]:
    """The reply's content for a request's content: runs the operation. Never raises but
    for what ``BaseException`` means to stop (SystemExit, GeneratorExit)."""
    op = content.get("op")
    args = content.get("args")
    try:
        operation = OPERATIONS.get(op) if isinstance(op, str) else None
        if operation is None:
            raise ValueError(f"unknown kernelhub call {op!r}; known: {', '.join(OPERATIONS)}")
        if not isinstance(args, Mapping):
            raise TypeError(f"kernelhub call {op!r}: args must be an object, got {args!r}")
        result = operation(**args)
        if not content.get("result", True):
            return {"status": "ok", "result": {}}
        json.dumps(result)  # what cannot travel fails here, as an error reply
        return {"status": "ok", "result": result}
    except (Exception, KeyboardInterrupt) as exc:
        # Plain text, the innermost frames: IPython's highlighted traceback of a deep
        # stack took seconds of CPU on a loaded host (see the host's snapshot/calls.py).
        return {
            "status": "error",
            "ename": type(exc).__name__,
            "evalue": str(exc),
            "traceback": traceback.format_exception(exc, limit=-4),
        }


def install(kernel: Any, environ: Mapping[str, str]) -> bool:
    """Handle ``kernelhub_call_request`` on ``kernel``'s shell and say so in its
    kernel_info, unless ``KERNELHUB_KERNEL_CALLS=0``. Returns whether it did."""
    if environ.get(ENABLE_ENV, "1") == "0":
        return False

    def kernelhub_call_request(stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        content = parent.get("content")
        reply = answer(content if isinstance(content, Mapping) else {})
        kernel.session.send(stream, REPLY, reply, parent, ident)

    kernel.shell_handlers[REQUEST] = kernelhub_call_request
    cls = type(kernel)
    if INFO_KEY not in kernel.kernel_info:  # once per class
        info = cls.kernel_info
        cls.kernel_info = property(lambda self: {**info.fget(self), INFO_KEY: VERSION})
    return True
