"""Capture a kernel's state into a directory, and restore it into a fresh kernel.

Runs inside the sandbox kernel, never on the host. A snapshot is data made by untrusted
code: only a sandbox ever unpickles it (``restore``), and the host treats the files as an
opaque blob it moves and stores. Loading a snapshot runs whatever code its pickles name,
with exactly the rights the sandbox's user code already has; the sha256 sums in the
manifest detect corruption, not tampering (whoever made the blob also wrote the sums).

The calling contract: the host sends a ``kernelhub_call_request`` naming the operation
(``kernelhub_kernel.calls``: no ``run_cell`` at all). Under an image or a kernel without
it, through a *silent* execute (no execution count is taken, no ``post_run_cell`` hook
runs, and ``user_expressions`` are evaluated after the code)::

    code = ("__import__('kernelhub_kernel.snapshot', fromlist=['capture'])"
            ".capture('/tmp/.kernelhub/snap-2', base='/tmp/.kernelhub/snap-1')")
    user_expressions = {"snapshot": "__import__('kernelhub_kernel.snapshot',"
                        " fromlist=['last_result']).last_result()"}

The reply carries the result as ``user_expressions["snapshot"]["data"]["application/json"]``
(``last_result_json()`` returns the same as a JSON string). ``restore(path)`` is called
the same way. Both return the dict they publish; a reply with status "error" means
kernelhub failed (an unwritable directory, a missing manifest), never that user data did:
user data that cannot travel is reported by name in ``skipped`` (capture) and ``failed``
(restore), with the reason. No variable disappears without being named. Both results
carry ``timings`` (seconds per phase) for the host's logs. Nothing else needs calling:
the first ``capture`` installs the cell tracking (and is always full).

A snapshot directory holds, and the host must move, every file listed in ``files``:

* ``manifest.json``: format, ids, execution count, imports, skipped names, and the groups
  (names, file, sha256, pickler, byte layout); see ``_Capture.run``.
* ``groups/<sha256 prefix>.pkl``: one group of variables. The in-band pickle
  (``pickle_bytes`` long), then each out-of-band buffer in order (``buffers`` lengths).
  Content-addressed: a file that did not change keeps its name from one snapshot to the
  next, so the host can store it once.
* ``workspace.tar``: the workspace (``KERNELHUB_WORKSPACE``, default ``/workspace``).

What is kept, and how:

* The user namespace, in GROUPS: variables whose object graphs share an object are
  pickled together by one pickler, so after restore ``ax.figure is fig``, an instance is
  still an instance of the class restored with it, and ``best in runs`` still holds. A
  group is the unit of incremental writing and of failure: an object that cannot be
  loaded takes down its own group only.
* Data goes through the C pickler, protocol 5, with numpy/pandas buffers out of band
  (written raw after the pickle, never copied into it; hashed while written). Large
  object arrays of strings (pandas string and object columns) travel as one UTF-8 blob
  instead of millions of memoized pickle strings. A group that contains code
  defined in a cell (functions, classes, lambdas, closures, their instances) goes through
  dill, by value, with the functions' globals bound to the restoring kernel's namespace
  (dill's ``recurse=False``): a restored function sees the names of the namespace it
  lives in, as it did before, and a later ``df = ...`` is visible to it. Every pickle is
  then checked for by-reference ``__main__`` globals, which would only fail in the new
  kernel. At restore, members are bound as they load (a later member's rebuilding may
  look an earlier one up, as the cells did), and a cell-defined ``__init_subclass__``
  does not run again: what it did (a registry entry) is in the snapshot already.
* Modules come back by re-import (``np -> numpy``), and so do functions and classes
  imported from modules (``from os.path import join``) and names bound by
  ``from module import name`` to the module's own object.
* What pickle gets silently wrong is carried by our own reducers: open files (path,
  mode, position; never truncated on reopen), locks (held state; an RLock held by the
  kernel's thread comes back held by it, one held by another thread is refused),
  ``logging.Logger`` (level, handlers, filters, propagate), ``functools.lru_cache``
  wrappers (without their cache), Enums and TypeVars defined in cells (rebuilt by
  value), and the kernel's standard streams (as references to the restoring kernel's
  streams), this kernel's ``globals()`` and modules' namespaces (as references). What
  cannot be carried is refused, named: sockets, database connections,
  generators, threads, executors, subprocesses, frames, match and hash objects, and the
  kernel's own internals (shell, kernel, session, ZeroMQ sockets), whatever path leads
  there.

Incremental capture (``capture(dir, base=previous_dir)``): only groups whose members may
have changed are pickled again; the others are hard-linked from ``base`` (copied if
linking fails), so every snapshot directory is self-contained. ``base`` must be the
directory of this kernel's latest capture or restore, and must still hold its files;
otherwise the capture is full (``incremental: false`` and ``full_reason``). Deciding what
may have changed must be cheap, so nothing large is hashed or re-pickled to find out. A
variable is re-pickled when:

* it is new, deleted, or bound to another object (``id()`` changed), or
* a cell since the last capture may have mutated it: the cell's AST assigns to it or to
  one of its attributes/items, calls a method on it (except read-only methods of numpy,
  pandas and builtin objects), calls it (a cell function's defaults and closure may
  change), or passes it to a call (except to builtins, display and read-only
  numpy/pandas/plotting functions); a global name used by a cell-defined function the
  cell refers to (transitively) counts as mutated, or
* its group is small (< 1 MiB pickled) and holds data: such groups are re-pickled at
  every capture and compared by sha256, which catches what the heuristic misses for
  them (groups of only functions and classes change only in ways the tracker sees), or
* something ran that we could not read: ``exec``/``eval``/``globals()``, an unknown
  magic, a silent execute that is not ours. Then everything is re-pickled.

What the heuristic can miss (for groups of 1 MiB or more, and code-only groups): changes
made outside the cells (background threads, callbacks, timers, asyncio tasks, code the
host evaluates in ``user_expressions``); mutations through a reference the cell does not
name and that is not shared inside the namespace (an object also held by a module
attribute, or by a library that keeps it and mutates it later); methods named like
read-only numpy/pandas methods that mutate anyway; memory shared without a Python
reference (an array wrapping another's buffer via C code or mmap, a frame built on a
numpy array without copying). Pickle itself does not keep numpy views as views: a view
comes back as a copy. Grouping ignores what pandas' Copy-on-Write shares between frames
(column arrays, Index objects): a write copies first, so that sharing is invisible.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

from .analysis import CellUsage, _globals_used_by, analyze_cell  # noqa: F401 (API, tests)
from .capture import _Capture
from .common import _gc_paused
from .restore import _Restore, read_stream
from .session import _session_for, _shell, end_own_call  # noqa: F401 (API)
from .stream import TarReader, TarWriter, accept, take_pipe
from .workspace import workspace_root  # noqa: F401 (API)

_RESULT: dict[str, Any] | None = None


def capture(path: str, base: str | None = None) -> dict[str, Any]:
    """Write a snapshot of this kernel to the new or empty directory ``path``.

    With ``base`` (the directory of this kernel's previous capture or restore, files
    still in place), unchanged groups are hard-linked from it instead of written again.
    Returns the result dict (see the module docstring) and keeps it for ``last_result``.
    """
    return _run(lambda shell, session: _Capture(shell, session, os.path.abspath(path), base).run())


def restore(
    path: str, *, workspace: bool = True, execution_count: int | None = None
) -> dict[str, Any]:
    """Load the snapshot in ``path`` into this (fresh) kernel; returns the result dict.

    Order: workspace files (unless ``workspace=False``), imports, groups, execution count
    (``execution_count`` if given: a checkpoint that also covers later cells that changed
    nothing, restored as the state after the last of them).
    A group that fails to load is reported member by member in ``failed``; the others
    load regardless. Must run inside the sandbox: loading executes the pickles.
    """

    def run(shell: Any, session: Any) -> dict[str, Any]:
        result = _Restore(shell, session, os.path.abspath(path), workspace).run()
        if execution_count is not None:
            shell.execution_count = int(execution_count)
        return result

    return _run(run)


def capture_stream(name: str) -> dict[str, Any]:
    """A full snapshot sent to the host over the socket ``name`` in the kernel's socket
    directory (see ``stream``), nothing staged in the sandbox. It does not change what
    the next ``capture(dir, base=...)`` is incremental on. Returns the result dict."""

    def run(shell: Any, session: Any) -> dict[str, Any]:
        with contextlib.closing(accept(name)) as sock:
            writer = TarWriter(sock, take_pipe(sock))
            try:
                return _Capture(shell, session, "", None, stream=writer).run()
            finally:
                writer.abandon()

    return {**_run(run), "path": None}


def restore_stream(name: str, *, workspace: bool = True) -> dict[str, Any]:
    """Receive a snapshot from the host over the socket ``name`` and load it into this
    (fresh) kernel, once the host's verdict on the blob is yes; as ``restore``."""

    def run(shell: Any, session: Any) -> dict[str, Any]:
        with contextlib.closing(accept(name)) as sock:
            received = read_stream(TarReader(sock))
        try:
            return _Restore(shell, session, None, workspace, streamed=received).run()
        finally:
            if received.workspace is not None:
                received.workspace.close()

    return {**_run(run), "path": None}


def _run(operation: Callable[[Any, Any], dict[str, Any]]) -> dict[str, Any]:
    """One capture or restore: no GC passes, no warnings, timed, kept for last_result."""
    global _RESULT
    shell = _shell()
    session = _session_for(shell)
    session.tracker.mark_own_execute()
    started = time.perf_counter()
    # Wall clock (the host's too: one kernel clock), so the host can tell the time its
    # call took to reach this line, and the reply to come back, from the work itself.
    started_at = time.time()
    session.tracker.settle()  # cells analyzed now, not while they ran (restore: harmless)
    with _gc_paused(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = operation(shell, session)
    result["duration"] = time.perf_counter() - started
    result["started_at"], result["ended_at"] = started_at, time.time()
    _RESULT = result
    return result


def last_result() -> _JSONResult:
    """The last capture/restore result, shown as ``application/json`` in user_expressions."""
    return _JSONResult(_RESULT)


def last_result_json() -> str:
    """The last capture/restore result as a JSON string (``null`` before the first)."""
    return json.dumps(_RESULT)


def install_tracking() -> None:
    """Start recording what each cell may change; idempotent.

    ``capture`` and ``restore`` call it, and the first capture is always full, so a
    launcher does not need to: calling it at start only makes the hooks visible earlier.
    """
    _session_for(_shell())


class _JSONResult:
    """Lets a user expression return the result dict as ``application/json``."""

    def __init__(self, data: dict[str, Any] | None) -> None:
        self.data = data

    def _repr_json_(self) -> dict[str, Any] | None:
        return self.data

    def __repr__(self) -> str:
        return json.dumps(self.data)


# Snapshots made before the package split name their rebuilders by this module's path
# (``kernelhub_kernel.snapshot._make_lock``): keep those names loadable here.
from .rebuilders import (  # noqa: E402, F401
    _closed_file,
    _make_lock,
    _make_rlock,
    _make_typevar,
    _rebuild_enum,
    _rebuild_lru_cache,
    _rebuild_object_array,
    _reopen_file,
    _restore_logger,
    _std_stream,
)
