"""Capture a kernel's state into a directory, and restore it into a fresh kernel.

Runs inside the sandbox kernel, never on the host. A snapshot is data made by untrusted
code: only a sandbox ever unpickles it (``restore``), and the host treats the files as an
opaque blob it moves and stores. Loading a snapshot runs whatever code its pickles name,
with exactly the rights the sandbox's user code already has; the sha256 sums in the
manifest detect corruption, not tampering (whoever made the blob also wrote the sums).

The calling contract (the host, through a *silent* execute: no execution count is taken,
no ``post_run_cell`` hook runs, and ``user_expressions`` are evaluated after the code)::

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

import ast
import builtins
import contextlib
import enum
import functools
import gc
import hashlib
import importlib
import io
import json
import logging
import os
import pickle
import pickletools
import re
import shutil
import stat
import sys
import tarfile
import threading
import time
import types
import typing
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

FORMAT = "kernelhub-snapshot/1"
WORKSPACE_ENV = "KERNELHUB_WORKSPACE"
DEFAULT_WORKSPACE = "/workspace"
MANIFEST = "manifest.json"
GROUPS_DIR = "groups"
WORKSPACE_TAR = "workspace.tar"

SMALL_GROUP_BYTES = 1 << 20
"""Groups smaller than this are re-pickled at every capture and compared by digest."""
MAX_REACH_OBJECTS = 2_000_000
"""Per variable, how many objects the sharing analysis visits before giving up (noted)."""
SCAN_LIMIT_BYTES = 64 << 20
"""In-band pickles larger than this are not opcode-scanned for ``__main__`` references."""
_PARALLEL_HASH_BYTES = 8 << 20
_COPY_CHUNK = 1 << 20

_RESULT: dict[str, Any] | None = None
_SESSION: _Session | None = None
_MISSING = object()


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------


def capture(path: str, base: str | None = None) -> dict[str, Any]:
    """Write a snapshot of this kernel to the new or empty directory ``path``.

    With ``base`` (the directory of this kernel's previous capture or restore, files
    still in place), unchanged groups are hard-linked from it instead of written again.
    Returns the result dict (see the module docstring) and keeps it for ``last_result``.
    """
    global _RESULT
    shell = _shell()
    session = _session_for(shell)
    session.tracker.mark_own_execute()
    started = time.perf_counter()
    session.tracker.settle()
    with _gc_paused(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = _Capture(shell, session, os.path.abspath(path), base).run()
    result["duration"] = time.perf_counter() - started
    _RESULT = result
    return result


def restore(path: str, *, workspace: bool = True) -> dict[str, Any]:
    """Load the snapshot in ``path`` into this (fresh) kernel; returns the result dict.

    Order: workspace files (unless ``workspace=False``), imports, groups, execution count.
    A group that fails to load is reported member by member in ``failed``; the others
    load regardless. Must run inside the sandbox: loading executes the pickles.
    """
    global _RESULT
    shell = _shell()
    session = _session_for(shell)
    session.tracker.mark_own_execute()
    started = time.perf_counter()
    with _gc_paused(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = _Restore(shell, session, os.path.abspath(path), workspace).run()
    result["duration"] = time.perf_counter() - started
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


# --------------------------------------------------------------------------------------
# Per-kernel state and the cell tracker
# --------------------------------------------------------------------------------------


@dataclass
class _Group:
    """One group as written: the manifest entry plus what incremental capture needs."""

    names: tuple[str, ...]
    file: str
    sha256: str
    size_bytes: int
    pickler: str
    pickle_bytes: int
    buffers: list[int]
    reach: frozenset[int] | None = None

    def entry(self, reused: bool) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "file": self.file,
            "sha256": self.sha256,
            "size_bytes": self.size_bytes,
            "pickler": self.pickler,
            "pickle_bytes": self.pickle_bytes,
            "buffers": list(self.buffers),
            "reused": reused,
        }


class _Session:
    """What this kernel remembers between captures: the last snapshot and its groups."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.tracker = _Tracker(shell)
        self.snapshot_id: str | None = None
        self.groups: list[_Group] = []
        self.ids: dict[str, int] = {}
        self.workspace: dict[str, Any] | None = None


def _session_for(shell: Any) -> _Session:
    global _SESSION
    if _SESSION is None or _SESSION.shell is not shell:
        _SESSION = _Session(shell)
        _SESSION.tracker.install()
        _SESSION.tracker.seed_from_history()
    return _SESSION


def _shell() -> Any:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("kernelhub_kernel.snapshot runs inside an IPython kernel")
    return shell


class _Tracker:
    """IPython event hooks that collect the names each cell may have changed.

    ``pre_run_cell``/``post_run_cell`` fire for ordinary cells only; ``pre_execute`` and
    ``post_execute`` for every execute, silent ones included. An execute that ran code we
    did not see (silent, and not our own capture/restore) makes everything dirty.
    """

    def __init__(self, shell: Any) -> None:
        self._shell = shell
        self.names: set[str] = set()
        self.all_dirty = False
        self.from_imports: dict[str, tuple[str, str]] = {}
        self._saw_cell = False
        self._own = False
        # Cells not analyzed yet: the analysis (~1-3 ms a cell, IPython's transform and an
        # AST walk) runs at the next capture, between cells, not inside each cell.
        self._pending: list[str] = []

    def install(self) -> None:
        events = self._shell.events
        events.register("pre_execute", self._pre_execute)
        events.register("pre_run_cell", self._pre_run_cell)
        events.register("post_execute", self._post_execute)
        events.register("post_run_cell", self._post_run_cell)

    def seed_from_history(self) -> None:
        """Learn the ``from module import name`` of the cells that ran before we were
        installed, from IPython's in-session input history (the first capture is full
        anyway, so only the imports matter)."""
        history = getattr(getattr(self._shell, "history_manager", None), "input_hist_raw", [])
        for raw in list(history):
            with contextlib.suppress(Exception):
                usage = analyze_cell(raw, None, self._shell.transform_cell)
                self.from_imports.update(usage.from_imports)

    def mark_own_execute(self) -> None:
        self._own = True

    def reset(self) -> None:
        self.names = set()
        self.all_dirty = False
        self._pending = []

    def settle(self) -> None:
        """Analyze the cells that ran since the last call (``capture`` calls it first).
        Against the namespace as it is now: a name a later cell rebound is caught by its
        ``id()`` anyway."""
        pending, self._pending = self._pending, []
        ns = self._shell.user_ns
        for raw in pending:
            try:
                usage = analyze_cell(raw, ns, self._shell.transform_cell)
                if usage.unknown:
                    self.all_dirty = True
                self.names |= usage.mutated
                self.names |= _globals_used_by(usage.called, ns)
                self.from_imports.update(usage.from_imports)
            except Exception:
                self.all_dirty = True

    def _pre_execute(self) -> None:
        self._saw_cell = False

    def _pre_run_cell(self, info: Any) -> None:
        self._saw_cell = True

    def _post_execute(self) -> None:
        if not (self._saw_cell or self._own):
            self.all_dirty = True
        self._own = False

    def _post_run_cell(self, result: Any) -> None:
        info = getattr(result, "info", None)
        raw = getattr(info, "raw_cell", None)
        if not isinstance(raw, str):
            self.all_dirty = True
            return
        self._pending.append(raw)
        if len(self._pending) >= 256:  # no capture for a long while: keep memory bounded
            self.settle()


# --------------------------------------------------------------------------------------
# Cell analysis (pure: source in, names out)
# --------------------------------------------------------------------------------------


@dataclass
class CellUsage:
    """What one cell may have changed.

    ``mutated``: names the cell binds or may mutate. ``called``: names it calls or passes
    on (their cell-defined code is followed for the globals it uses). ``from_imports``:
    ``name -> (module, attribute)`` bound by ``from module import attribute``.
    ``unknown``: the cell did something we cannot follow (everything may have changed).
    """

    mutated: set[str]
    called: set[str]
    from_imports: dict[str, tuple[str, str]]
    unknown: bool


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


_PURE_BUILTINS = _words(
    "print len repr str int float complex bool bytes type isinstance issubclass id hash "
    "sorted list tuple set frozenset dict sum min max any all enumerate zip range abs round "
    "format divmod pow hasattr getattr dir callable chr ord bin hex oct ascii reversed "
    # vars()/iter()/next() are not pure: vars() is the namespace, next() advances.
    "display"
)
_READ_ONLY_METHODS = _words(
    # numpy / pandas / builtin containers and strings: methods that return a new object
    # or a value and leave the receiver alone (unless passed inplace=True).
    "head tail describe info groupby agg aggregate mean median sum prod min max std var sem "
    "count nunique unique value_counts copy to_csv to_json to_dict to_records to_numpy "
    "to_list tolist to_string to_markdown to_html to_parquet to_pickle to_excel to_frame "
    "corr cov quantile isna isnull notna notnull any all query merge join pivot pivot_table "
    "melt stack unstack explode sort_values sort_index reset_index set_index rename drop "
    "dropna fillna drop_duplicates duplicated astype apply map applymap transform filter "
    "select_dtypes sample nlargest nsmallest idxmax idxmin argmax argmin argsort cumsum "
    "cumprod cummax cummin diff pct_change rolling expanding ewm resample round abs clip "
    "where mask equals items iterrows itertuples keys values get isin between shift rank "
    "reindex reindex_like align combine_first compare assign pipe squeeze transpose "
    "memory_usage nbytes dot reshape ravel flatten view take repeat searchsorted nonzero "
    "compress diagonal trace conj real imag all_equal replace split strip lower upper "
    "startswith endswith find index rfind rindex encode decode join format isdigit isalpha "
    "splitlines partition rpartition zfill ljust rjust center title capitalize casefold "
    "plot hist boxplot interpolate ffill bfill first last first_valid_index "
    "last_valid_index"
)
_READ_ONLY_MODULES = frozenset({"numpy", "pandas", "math", "statistics", "matplotlib", "seaborn"})
_MUTATING_LIBRARY_FUNCTIONS = _words(
    "shuffle copyto put place putmask fill_diagonal put_along_axis at seed"
)
_LINE_MAGICS_WITH_CODE = frozenset({"time", "timeit", "prun"})
_HARMLESS_LINE_MAGICS = _words(
    "matplotlib pinfo pinfo2 pdoc pdef psource pfile psearch who whos who_ls pwd ls lsmagic "
    "magic history hist page pycat pip conda mamba micromamba uv cd dhist env set_env "
    "precision config load_ext reload_ext unload_ext colors xmode automagic autocall alias "
    "unalias rehashx sx system bookmark killbgscripts notebook save pastebin recall "
    "doctest_mode quickref"
)
_CELL_MAGICS_WITH_CODE = frozenset({"time", "timeit", "prun", "capture"})
_HARMLESS_CELL_MAGICS = _words(
    "writefile file bash sh script html HTML javascript js markdown latex svg perl ruby "
    "python python2 python3 pypy sx system"
)
_NAMESPACE_BUILTINS = frozenset({"globals", "locals", "exec", "eval", "execfile"})


def analyze_cell(
    source: str,
    ns: dict[str, Any] | None = None,
    transform: Callable[[str], str] | None = None,
) -> CellUsage:
    """The names a cell may change, from its source (IPython syntax allowed via
    ``transform``, normally ``shell.transform_cell``). ``ns`` (the namespace the cell
    ran in) refines method calls: read-only methods only count as such on numpy, pandas
    and builtin objects. Pure: tested with data.
    """
    usage = CellUsage(set(), set(), {}, False)
    _analyze_into(usage, source, ns or {}, transform, depth=0)
    return usage


def _analyze_into(
    usage: CellUsage,
    source: str,
    ns: dict[str, Any],
    transform: Callable[[str], str] | None,
    depth: int,
) -> None:
    if depth > 3:
        usage.unknown = True
        return
    try:
        code = transform(source) if transform is not None else source
        tree = ast.parse(code)
    except Exception:
        # A cell that does not parse did not run: nothing changed.
        return
    parents: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    understood_ipython: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            _magic_call(node, usage, ns, transform, depth, understood_ipython)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if (
                node.id == "get_ipython" and id(node) not in understood_ipython
            ) or node.id == "__main__":
                usage.unknown = True
            _classify_name_use(node, parents, ns, usage)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            usage.mutated.add(node.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                usage.mutated.add(alias.asname or alias.name.partition(".")[0])
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    continue  # new names are new; rebound ones change id()
                bound = alias.asname or alias.name
                usage.mutated.add(bound)
                if node.level == 0 and node.module:
                    usage.from_imports[bound] = (node.module, alias.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            usage.mutated.update(node.names)
        elif (isinstance(node, ast.ExceptHandler) and node.name) or (
            isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name
        ):
            usage.mutated.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            usage.mutated.add(node.rest)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and (
                func.id in _NAMESPACE_BUILTINS
                or (func.id == "vars" and not node.args and not node.keywords)
            ):
                usage.unknown = True


def _magic_call(
    node: ast.Call,
    usage: CellUsage,
    ns: dict[str, Any],
    transform: Callable[[str], str] | None,
    depth: int,
    understood: set[int],
) -> None:
    """Handle ``get_ipython().<method>(...)``, which is what IPython turns magics into."""
    func = node.func
    if not (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Call)
        and isinstance(func.value.func, ast.Name)
        and func.value.func.id == "get_ipython"
        and not func.value.args
    ):
        return
    args = [a.value if isinstance(a, ast.Constant) else None for a in node.args]
    method = func.attr
    if method in ("system", "getoutput"):
        understood.add(id(func.value.func))
        return
    if method == "run_line_magic" and len(args) == 2 and all(isinstance(a, str) for a in args):
        magic, line = str(args[0]), str(args[1])
        if magic in _LINE_MAGICS_WITH_CODE:
            understood.add(id(func.value.func))
            _analyze_into(usage, _strip_magic_options(line), ns, transform, depth + 1)
        elif magic in _HARMLESS_LINE_MAGICS:
            understood.add(id(func.value.func))
        return
    if method == "run_cell_magic" and len(args) == 3 and all(isinstance(a, str) for a in args):
        magic, line, body = str(args[0]), str(args[1]), str(args[2])
        if magic in _CELL_MAGICS_WITH_CODE:
            understood.add(id(func.value.func))
            if magic == "capture":
                usage.mutated.update(t for t in line.split() if t.isidentifier())
            _analyze_into(usage, body, ns, transform, depth + 1)
        elif magic in _HARMLESS_CELL_MAGICS:
            understood.add(id(func.value.func))


def _strip_magic_options(line: str) -> str:
    """``-n 10 -r 3 f(x)`` -> ``f(x)`` (timeit/prun options), best effort."""
    words = line.split()
    while words and words[0].startswith("-"):
        flag = words.pop(0)
        if flag in ("-n", "-r", "-p", "-s", "-T", "-D", "-l") and words:
            words.pop(0)
    return " ".join(words)


def _classify_name_use(
    name: ast.Name, parents: dict[int, ast.AST], ns: dict[str, Any], usage: CellUsage
) -> None:
    """Decide whether one occurrence of a name may mutate what it names."""
    if isinstance(name.ctx, (ast.Store, ast.Del)):
        usage.mutated.add(name.id)
        return
    # Climb the chain name.attr[...].attr: the top is what the name's object flows into.
    top: ast.AST = name
    parent = parents.get(id(top))
    while isinstance(parent, (ast.Attribute, ast.Subscript)) and parent.value is top:
        if isinstance(parent, ast.Attribute) and isinstance(parents.get(id(parent)), ast.Call):
            call = parents[id(parent)]
            assert isinstance(call, ast.Call)
            if call.func is parent:
                # A method call on the object (or on one of its parts).
                usage.called.add(name.id)
                if isinstance(ns.get(name.id), types.ModuleType):
                    return  # np.random.shuffle(a): a module is re-imported, never saved
                if _is_read_only_method(name.id, parent.attr, call, ns):
                    return
                usage.mutated.add(name.id)
                return
        top = parent
        parent = parents.get(id(top))
    if isinstance(top, (ast.Attribute, ast.Subscript)) and isinstance(
        top.ctx, (ast.Store, ast.Del)
    ):
        usage.mutated.add(name.id)
        return
    while isinstance(parent, (ast.Starred, ast.keyword)):
        top = parent
        parent = parents.get(id(top))
    if isinstance(parent, ast.Call):
        if parent.func is top:
            usage.called.add(name.id)
            value = ns.get(name.id)
            if not isinstance(top, ast.Name) or _is_cell_instance(value):
                usage.mutated.add(name.id)  # obj[...](), or a callable object
            elif isinstance(value, types.FunctionType) and value.__globals__ is ns:
                # Its defaults, attributes and closure cells may change when it runs.
                usage.mutated.add(name.id)
            return
        # An argument: the callee may mutate it, unless it is known not to.
        usage.called.add(name.id)
        if not _is_pure_call(parent, ns):
            usage.mutated.add(name.id)
        return
    if isinstance(parent, ast.AugAssign) and parent.target is top:
        usage.mutated.add(name.id)
        return
    if isinstance(parent, (ast.For, ast.AsyncFor, ast.comprehension)) and parent.iter is top:
        if not _is_plain_data(ns.get(name.id, _MISSING)):
            usage.mutated.add(name.id)  # iterating an iterator advances it
        return
    if isinstance(parent, ast.withitem) and parent.context_expr is top:
        usage.mutated.add(name.id)
        return
    if isinstance(parent, ast.Assign) and any(t is top for t in parent.targets):
        usage.mutated.add(name.id)
        return
    # Otherwise: read (an expression, a condition, a right-hand side).
    # Decorators and bases are calls of a sort: follow their code.
    if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        usage.called.add(name.id)


def _is_read_only_method(owner: str, method: str, call: ast.Call, ns: dict[str, Any]) -> bool:
    if method not in _READ_ONLY_METHODS:
        return False
    for kw in call.keywords:
        if kw.arg == "inplace" and not (isinstance(kw.value, ast.Constant) and not kw.value.value):
            return False
        if kw.arg == "out":
            return False
    value = ns.get(owner, _MISSING)
    return value is _MISSING or _is_library_data(value)


def _is_pure_call(call: ast.Call, ns: dict[str, Any]) -> bool:
    func = call.func
    if any(kw.arg == "out" for kw in call.keywords):
        return False
    if isinstance(func, ast.Name):
        value = ns.get(func.id, _MISSING)
        return func.id in _PURE_BUILTINS and (
            value is _MISSING or getattr(builtins, func.id, None) is value or func.id == "display"
        )
    if isinstance(func, ast.Attribute):
        root: ast.AST = func
        while isinstance(root, (ast.Attribute, ast.Subscript)):
            root = root.value
        if not isinstance(root, ast.Name):
            return False
        value = ns.get(root.id, _MISSING)
        if isinstance(value, types.ModuleType):
            top = value.__name__.partition(".")[0]
            return top in _READ_ONLY_MODULES and func.attr not in _MUTATING_LIBRARY_FUNCTIONS
        if func.attr in _READ_ONLY_METHODS and (value is _MISSING or _is_library_data(value)):
            return True
    return False


def _is_library_data(value: Any) -> bool:
    """numpy, pandas and builtin data: the objects ``_READ_ONLY_METHODS`` describes."""
    module = type(value).__module__ or ""
    return module == "builtins" or module.partition(".")[0] in ("numpy", "pandas")


def _is_plain_data(value: Any) -> bool:
    return (
        value is _MISSING
        or isinstance(value, (list, tuple, dict, set, frozenset, str, bytes, range))
        or (type(value).__module__ or "").partition(".")[0] in ("numpy", "pandas")
    )


def _is_cell_instance(value: Any) -> bool:
    return value is not None and getattr(type(value), "__module__", None) == "__main__"


def _globals_used_by(names: Iterable[str], ns: dict[str, Any]) -> set[str]:
    """The global names read or written by cell-defined code reachable from ``names``.

    Follows functions defined in this namespace (``__globals__ is ns``), classes and
    instances of classes defined in cells, partials, lru_cache wrappers, bound methods
    and the callables held by small containers, transitively through the globals found.
    """
    found: set[str] = set()
    queue = list(names)
    visited: set[str] = set()
    while queue:
        name = queue.pop()
        if name in visited:
            continue
        visited.add(name)
        for code in _codes_of(ns.get(name), ns, depth=0):
            for used in _code_names(code):
                if used not in visited:
                    found.add(used)
                    queue.append(used)
    return found


def _codes_of(value: Any, ns: dict[str, Any], depth: int) -> Iterator[types.CodeType]:
    if depth > 2 or value is None:
        return
    if isinstance(value, types.FunctionType):
        if value.__globals__ is ns:
            yield value.__code__
    elif isinstance(value, types.MethodType):
        yield from _codes_of(value.__func__, ns, depth + 1)
    elif isinstance(value, functools.partial):
        yield from _codes_of(value.func, ns, depth + 1)
    elif isinstance(value, type):
        if value.__module__ == "__main__":
            for klass in value.__mro__:
                if klass.__module__ != "__main__":
                    continue
                for attr in vars(klass).values():
                    if isinstance(attr, (staticmethod, classmethod)):
                        attr = attr.__func__
                    if isinstance(attr, property):
                        for part in (attr.fget, attr.fset, attr.fdel):
                            yield from _codes_of(part, ns, depth + 1)
                    elif isinstance(attr, types.FunctionType):
                        yield from _codes_of(attr, ns, depth + 1)
    elif isinstance(value, functools._lru_cache_wrapper):
        yield from _codes_of(value.__wrapped__, ns, depth + 1)
    elif isinstance(value, (list, tuple, set, frozenset)) and len(value) <= 256:
        for item in value:
            if callable(item):
                yield from _codes_of(item, ns, depth + 1)
    elif isinstance(value, dict) and len(value) <= 256:
        for item in value.values():
            if callable(item):
                yield from _codes_of(item, ns, depth + 1)
    elif _is_cell_instance(value):
        yield from _codes_of(type(value), ns, depth + 1)


@functools.lru_cache(maxsize=4096)
def _code_names(code: types.CodeType) -> frozenset[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return frozenset(names)


# --------------------------------------------------------------------------------------
# Capture
# --------------------------------------------------------------------------------------


_IPYTHON_NAME = re.compile(r"_+|_i+|_i\d+|_\d+|_ih|_oh|_dh|In|Out|_exit_code")
_MODULE_DUNDERS = frozenset(
    {"__builtins__", "__builtin__", "__name__", "__doc__", "__package__", "__loader__", "__spec__"}
)


class _Refused(Exception):
    """An object that must not or cannot travel; ``reason`` names it for the user."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _NeedsDill(Exception):
    """The C pickler met code defined in a cell: the group goes through dill instead."""


class _MemberFailed(Exception):
    def __init__(self, index: int, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.index = index
        self.cause = cause


@dataclass
class _Pickled:
    data: bytes
    buffers: list[memoryview]
    pickler: str
    sha256: str | None = None

    @property
    def size(self) -> int:
        return len(self.data) + sum(b.nbytes for b in self.buffers)

    def digest(self) -> str:
        if self.sha256 is None:
            digest = hashlib.sha256(self.data)
            for buffer in self.buffers:
                digest.update(buffer)
            self.sha256 = digest.hexdigest()
        return self.sha256


class _Capture:
    """One capture: classify the namespace, group, pickle what changed, write, report."""

    @functools.cached_property
    def reacher(self) -> _Reacher:
        return _Reacher(self.shell, self.refs)

    @functools.cached_property
    def reducers(self) -> dict[bool, _Reducer]:
        return {mode: _Reducer(self.shell, self.refs, dill_mode=mode) for mode in (False, True)}

    def __init__(self, shell: Any, session: _Session, path: str, base: str | None) -> None:
        self.shell = shell
        self.session = session
        self.path = path
        self.base = os.path.abspath(base) if base else None
        self.ns: dict[str, Any] = shell.user_ns
        self.refs = _Refs()
        self.session_key = _session_key(shell)
        self.warnings: list[str] = []
        self.written_bytes = 0
        # Set by _plan: the object ids each planned group reaches (kept for the next
        # capture), and the variables that reach a namespace dict (dill maps those).
        self._reach_of: dict[tuple[str, ...], frozenset[int]] = {}
        self._force_dill: set[str] = set()
        # Set by _dirty: small clean groups (by id), pickled again to compare digests.
        self._recheck: set[int] = set()
        self._verified = {g.sha256 for g in session.groups}

    def run(self) -> dict[str, Any]:
        clock = _Clock()
        _prepare_dir(self.path)
        variables, imports, skipped = self._classify()
        incremental, full_reason = self._check_base()
        tracker = self.session.tracker
        dirty = self._dirty(variables, incremental)
        clock.lap("classify")
        plan = self._plan(variables, dirty, incremental)
        clock.lap("group")
        groups: list[tuple[_Group, bool]] = []
        for names, reuse in plan:
            if reuse is not None:
                if id(reuse) not in self._recheck and self._link(reuse):
                    groups.append((reuse, True))
                    continue
                names = [n for n in variables if n in set(reuse.names)]
                if reuse.reach is not None:
                    self._reach_of[tuple(names)] = reuse.reach
            written, failures = self._write_group(names, variables)
            skipped.update(failures)
            if written is not None:
                groups.append(written)
        clock.lap("pickle_and_write")
        workspace = self._workspace(incremental)
        clock.lap("workspace")
        snapshot_id = uuid.uuid4().hex
        manifest = {
            "format": FORMAT,
            "snapshot_id": snapshot_id,
            "base_snapshot_id": self.session.snapshot_id if incremental else None,
            "created": time.time(),
            "python": sys.version.split()[0],
            "execution_count": int(self.shell.execution_count),
            "imports": imports,
            "groups": [g.entry(reused) for g, reused in groups],
            "skipped": skipped,
            "workspace": workspace,
        }
        manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode()
        _write_atomic(os.path.join(self.path, MANIFEST), manifest_bytes)
        self.written_bytes += len(manifest_bytes)

        self.session.snapshot_id = snapshot_id
        self.session.groups = [g for g, _ in groups]
        self.session.ids = {n: id(v) for n, v in variables.items()}
        self.session.workspace = workspace
        tracker.reset()
        self.refs.clear()

        group_bytes = sum(g.size_bytes for g, _ in groups)
        workspace_bytes = workspace["size_bytes"] if workspace else 0
        saved = [n for g, _ in groups for n in g.names]
        files = [MANIFEST, *sorted({g.file for g, _ in groups})]
        if workspace:
            files.append(workspace["file"])
        return {
            "format": FORMAT,
            "snapshot_id": snapshot_id,
            "path": self.path,
            "base": self.base,
            "incremental": incremental,
            "full_reason": full_reason,
            "saved": saved,
            "imports": imports,
            "skipped": skipped,
            "execution_count": manifest["execution_count"],
            "size_bytes": group_bytes + workspace_bytes + len(manifest_bytes),
            "written_bytes": self.written_bytes,
            "sizes": {
                "groups": group_bytes,
                "workspace": workspace_bytes,
                "manifest": len(manifest_bytes),
            },
            "groups": [g.entry(reused) for g, reused in groups],
            "workspace": workspace,
            "files": files,
            "warnings": self.warnings,
            "timings": clock.laps,
        }

    # --- what to save -------------------------------------------------------------------

    def _classify(self) -> tuple[dict[str, Any], dict[str, dict[str, str]], dict[str, str]]:
        """Split the namespace into variables to pickle, imports, and skipped names."""
        hidden = self.shell.user_ns_hidden
        from_imports = self.session.tracker.from_imports
        variables: dict[str, Any] = {}
        imports: dict[str, dict[str, str]] = {}
        skipped: dict[str, str] = {}
        for name, value in list(self.ns.items()):
            if name in _MODULE_DUNDERS or _IPYTHON_NAME.fullmatch(name):
                continue
            if name in hidden and hidden[name] is value:
                continue
            if getattr(builtins, name, _MISSING) is value:
                continue  # confirm, print...: the restoring kernel has them as builtins
            if isinstance(value, types.ModuleType):
                module_name = getattr(value, "__name__", None)
                if isinstance(module_name, str) and sys.modules.get(module_name) is value:
                    imports[name] = {"module": module_name}
                else:
                    skipped[name] = (
                        "module object that is not importable by name (made at run time);"
                        " modules come back by import only"
                    )
                continue
            ref = _import_ref(value)
            if ref is None and name in from_imports:
                module_name, attr = from_imports[name]
                module = sys.modules.get(module_name)
                if module is not None and getattr(module, attr, _MISSING) is value:
                    ref = (module_name, attr)
            if ref is not None:
                imports[name] = {"module": ref[0], "attr": ref[1]}
                continue
            if self.session_key and isinstance(value, (bytes, str)):
                raw = value.encode() if isinstance(value, str) else value
                if raw == self.session_key:
                    skipped[name] = "the kernel's session key: a snapshot never carries it"
                    continue
            variables[name] = value
        return variables, imports, skipped

    def _check_base(self) -> tuple[bool, str | None]:
        if self.base is None:
            return False, "no base"
        if self.session.snapshot_id is None:
            return False, "this kernel has no previous snapshot"
        try:
            with open(os.path.join(self.base, MANIFEST), "rb") as f:
                base_id = json.load(f).get("snapshot_id")
        except (OSError, ValueError, AttributeError) as exc:
            return False, f"cannot read the base manifest: {exc}"
        if base_id != self.session.snapshot_id:
            return False, "base is not this kernel's latest snapshot"
        if os.path.samefile(self.base, self.path):
            return False, "base is the target directory"
        return True, None

    def _dirty(self, variables: dict[str, Any], incremental: bool) -> set[str]:
        tracker = self.session.tracker
        if not incremental:
            return set(variables)
        if tracker.all_dirty:
            self.warnings.append(
                "a cell did something the tracker cannot follow (exec, globals(), an unknown"
                " magic, a foreign silent execute): every group was pickled again"
            )
            return set(variables)
        dirty = tracker.names & variables.keys()
        ids = self.session.ids
        dirty.update(n for n, v in variables.items() if ids.get(n) != id(v))
        for group in self.session.groups:
            members = [n for n in group.names if n in variables]
            if len(members) != len(group.names) or dirty.intersection(members):
                dirty.update(members)
            elif group.size_bytes < SMALL_GROUP_BYTES and not all(
                _is_code(variables[n]) for n in members
            ):
                # Not seen changing, but cheap to check: pickled again, and reused if
                # the digest did not change (its grouping is kept: see _plan). Code
                # (functions, classes) changes only in ways the tracker sees.
                self._recheck.add(id(group))
        return dirty

    def _plan(
        self, variables: dict[str, Any], dirty: set[str], incremental: bool
    ) -> list[tuple[list[str], _Group | None]]:
        """Group the variables: connected components of shared objects.

        Units are dirty variables (traversed now) and clean groups (their object sets
        from the last capture). A component that is exactly one clean group is reused.
        """
        units: list[tuple[list[str], _Group | None, set[int] | frozenset[int]]] = []
        force_dill: set[str] = set()
        for name in variables:
            if name in dirty:
                found = self.reacher.reach(variables[name])
                if found.truncated:
                    self.warnings.append(
                        f"{name}: more than {MAX_REACH_OBJECTS} objects; sharing with other"
                        " variables beyond them is not checked"
                    )
                if found.namespace:
                    force_dill.add(name)
                units.append(([name], None, found.ids))
        if incremental:
            for group in self.session.groups:
                if dirty.intersection(group.names):
                    continue
                if group.reach is None:
                    ids: set[int] = set()
                    for name in group.names:
                        ids |= self.reacher.reach(variables[name]).ids
                    group.reach = frozenset(ids)
                units.append((list(group.names), group, group.reach))
        parent = list(range(len(units)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        owner: dict[int, int] = {}
        all_ids: set[int] = set()
        for index, (_, _, ids_) in enumerate(units):
            for shared in ids_ & all_ids:
                a, b = find(index), find(owner[shared])
                if a != b:
                    parent[a] = b
            owner.update(dict.fromkeys(ids_, index))
            all_ids |= ids_
        components: dict[int, list[int]] = {}
        for index in range(len(units)):
            components.setdefault(find(index), []).append(index)
        order = {name: i for i, name in enumerate(variables)}
        plan: list[tuple[list[str], _Group | None]] = []
        self._force_dill = force_dill
        for members in components.values():
            if len(members) == 1 and units[members[0]][1] is not None:
                plan.append((units[members[0]][0], units[members[0]][1]))
                continue
            names = sorted((n for m in members for n in units[m][0]), key=order.__getitem__)
            reach: set[int] = set()
            for m in members:
                reach |= units[m][2]
            self._reach_of[tuple(names)] = frozenset(reach)
            plan.append((names, None))
        plan.sort(key=lambda item: order.get(item[0][0], 0) if item[0] else 0)
        return plan

    # --- writing groups -----------------------------------------------------------------

    def _link(self, group: _Group) -> bool:
        """Reuse an unchanged group's file from base: hard link, else copy."""
        assert self.base is not None
        source = os.path.join(self.base, group.file)
        target = os.path.join(self.path, group.file)
        if os.path.exists(target):
            return True
        try:
            os.link(source, target)
        except FileNotFoundError:
            return False
        except OSError:
            try:
                shutil.copyfile(source, target)
            except OSError:
                return False
            self.written_bytes += group.size_bytes
        return True

    def _write_group(
        self, names: list[str], variables: dict[str, Any]
    ) -> tuple[tuple[_Group, bool] | None, dict[str, str]]:
        """Pickle ``names`` together; members that cannot be pickled are dropped, named."""
        pending = list(names)
        failures: dict[str, str] = {}
        use_dill = bool(self._force_dill.intersection(pending))
        # The C pickler's message is usually the clearer one when dill fails too.
        c_errors: dict[str, str] = {}
        while pending:
            try:
                pickled = self._pickle([variables[n] for n in pending], use_dill)
            except _MemberFailed as exc:
                name = pending[exc.index]
                cause = exc.cause
                if not isinstance(cause, _Refused) and not use_dill:
                    if not isinstance(cause, _NeedsDill):
                        c_errors[name] = _describe_error(cause)
                    use_dill = True
                    continue
                failures[name] = c_errors.get(name) or _describe_error(cause)
                pending.pop(exc.index)
                use_dill = bool(self._force_dill.intersection(pending))
                continue
            # A pickle identical to one written before was verified then.
            known = pickled.size < _PARALLEL_HASH_BYTES and pickled.digest() in self._verified
            problems = [] if known else self._verify(pickled.data)
            if problems:
                bad = self._attribute_problems(pending, variables, use_dill)
                if not bad:
                    bad = dict.fromkeys(pending, problems[0])
                failures.update(bad)
                pending = [n for n in pending if n not in bad]
                continue
            return self._store(tuple(pending), pickled, names), failures
        return None, failures

    def _pickle(self, values: list[Any], use_dill: bool) -> _Pickled:
        out = io.BytesIO()
        buffers: list[pickle.PickleBuffer] = []
        reducer = self.reducers[use_dill]
        if use_dill:
            pickler: Any = _dill_pickler(out, buffers, reducer, self.shell.user_module)
        else:
            pickler = _CPickler(out, buffers, reducer)
        dill_warning = _dill_warning_class() if use_dill else None
        with warnings.catch_warnings():
            if dill_warning is not None:
                # dill warns, then falls back to a by-reference global that fails at load.
                warnings.simplefilter("error", dill_warning)
            for index, value in enumerate(values):
                try:
                    pickler.dump(value)
                except Exception as exc:
                    raise _MemberFailed(index, exc) from exc
        raws = []
        for buffer in buffers:
            try:
                raws.append(buffer.raw())
            except BufferError:
                # Not contiguous: numpy only hands out contiguous buffers, but be safe.
                raws.append(memoryview(bytes(buffer)))
        return _Pickled(out.getvalue(), raws, "dill" if use_dill else "pickle")

    def _verify(self, raw: bytes) -> list[str]:
        """Problems that would make the pickle fail or leak at restore (cheap checks)."""
        problems: list[str] = []
        if self.session_key and len(self.session_key) >= 16 and raw.find(self.session_key) >= 0:
            problems.append("contains the kernel's session key: a snapshot never carries it")
        if raw.find(b"__main__") >= 0:
            if len(raw) > SCAN_LIMIT_BYTES:
                self.warnings.append(
                    f"a {len(raw)}-byte pickle was not scanned for __main__ references"
                    " (reducers still refuse them)"
                )
            else:
                for module, name in _global_refs(raw):
                    if module == "__main__" and name != "__dict__":
                        problems.append(
                            f"refers to __main__.{name} by reference, which will not exist"
                            " when the snapshot is loaded in a fresh kernel"
                        )
        return problems

    def _attribute_problems(
        self, names: list[str], variables: dict[str, Any], use_dill: bool
    ) -> dict[str, str]:
        bad: dict[str, str] = {}
        for name in names:
            try:
                alone = self._pickle([variables[name]], use_dill)
            except _MemberFailed as exc:
                bad[name] = _describe_error(exc.cause)
                continue
            problems = self._verify(alone.data)
            if problems:
                bad[name] = problems[0]
        return bad

    def _store(
        self, names: tuple[str, ...], pickled: _Pickled, planned: list[str]
    ) -> tuple[_Group, bool]:
        """Hash, then write unless an identical file exists in base or here already."""
        parts = [memoryview(pickled.data), *pickled.buffers]
        size = pickled.size
        tmp = os.path.join(self.path, GROUPS_DIR, f".tmp-{uuid.uuid4().hex}")
        writer: threading.Thread | None = None
        write_error: list[BaseException] = []
        if size >= _PARALLEL_HASH_BYTES:
            # Write while hashing: both release the GIL, and the sha256 names the file.
            def write() -> None:
                try:
                    _write_parts(tmp, parts)
                except BaseException as exc:
                    write_error.append(exc)

            writer = threading.Thread(target=write, name="kernelhub-snapshot-write")
            writer.start()
        sha = pickled.digest()
        if writer is not None:
            writer.join()
            if write_error:
                raise write_error[0]
        group = _Group(
            names=names,
            file=f"{GROUPS_DIR}/{sha[:32]}.pkl",
            sha256=sha,
            size_bytes=size,
            pickler=pickled.pickler,
            pickle_bytes=len(pickled.data),
            buffers=[b.nbytes for b in pickled.buffers],
            reach=self._reach_of.get(tuple(planned)),
        )
        target = os.path.join(self.path, group.file)
        reused = False
        if os.path.exists(target):
            reused = True
        elif self.base is not None and os.path.exists(os.path.join(self.base, group.file)):
            # Content-addressed: a file of that name in base has this very content.
            reused = self._link(group)
        if reused:
            if writer is not None:
                os.unlink(tmp)
            return group, True
        if writer is None:
            _write_parts(tmp, parts)
        os.replace(tmp, target)
        self.written_bytes += size
        return group, False

    # --- workspace ----------------------------------------------------------------------

    def _workspace(self, incremental: bool) -> dict[str, Any] | None:
        root = workspace_root()
        if not os.path.isdir(root):
            return None
        entries, skipped = _scan_workspace(root, exclude=self.path)
        fingerprint = hashlib.sha256(json.dumps(entries).encode()).hexdigest()
        previous = self.session.workspace
        target = os.path.join(self.path, WORKSPACE_TAR)
        if incremental and previous and previous.get("fingerprint") == fingerprint:
            assert self.base is not None
            try:
                os.link(os.path.join(self.base, WORKSPACE_TAR), target)
                return {**previous, "reused": True}
            except OSError:
                pass
        tmp = target + ".tmp"
        sha, files, size, more_skipped = _write_workspace_tar(tmp, root, entries)
        os.replace(tmp, target)
        self.written_bytes += size
        return {
            "file": WORKSPACE_TAR,
            "sha256": sha,
            "size_bytes": size,
            "files": files,
            "fingerprint": fingerprint,
            "skipped": skipped + more_skipped,
            "reused": False,
        }


def _is_code(value: Any) -> bool:
    return isinstance(value, (type, types.FunctionType, functools._lru_cache_wrapper))


def _prepare_dir(path: str) -> None:
    os.makedirs(os.path.join(path, GROUPS_DIR), mode=0o700, exist_ok=True)
    leftovers = [n for n in os.listdir(path) if n != GROUPS_DIR]
    leftovers += os.listdir(os.path.join(path, GROUPS_DIR))
    if leftovers:
        raise FileExistsError(
            f"snapshot directory {path} is not empty ({len(leftovers)} entries);"
            " pass a new directory for each snapshot"
        )


def _write_parts(path: str, parts: list[memoryview]) -> None:
    with open(path, "wb") as f:
        for part in parts:
            f.write(part)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, _Refused):
        return exc.reason
    if isinstance(exc, RecursionError):
        return "cannot be pickled: nested too deeply (RecursionError)"
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"cannot be pickled: {type(exc).__name__}: {message}"[:500]


def _session_key(shell: Any) -> bytes:
    try:
        key = shell.kernel.session.key
    except AttributeError:
        return b""
    return bytes(key) if isinstance(key, (bytes, bytearray)) else b""


def _global_refs(data: bytes) -> Iterator[tuple[str, str]]:
    """(module, name) of every global a pickle stream (several pickles in a row) loads."""
    stream = io.BytesIO(data)
    memo: dict[int, Any] = {}
    recent: list[Any] = [None, None]
    pushes = {
        "SHORT_BINUNICODE",
        "BINUNICODE",
        "BINUNICODE8",
        "UNICODE",
        "SHORT_BINSTRING",
        "BINSTRING",
        "STRING",
    }
    while stream.tell() < len(data):
        for op, arg, _ in pickletools.genops(stream):
            name = op.name
            if name in pushes:
                recent = [recent[-1], arg]
            elif name == "MEMOIZE":
                memo[len(memo)] = recent[-1]
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo[int(str(arg))] = recent[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                recent = [recent[-1], memo.get(int(str(arg)))]
            elif name == "STACK_GLOBAL":
                module, qualname = recent
                if isinstance(module, str) and isinstance(qualname, str):
                    yield module, qualname
                recent = [recent[-1], None]
            elif name in ("GLOBAL", "INST"):
                module, _, qualname = str(arg).partition(" ")
                yield module, qualname
                recent = [recent[-1], None]
            elif name not in ("FRAME", "PROTO", "STOP"):
                recent = [recent[-1], None]


# --------------------------------------------------------------------------------------
# Sharing analysis
# --------------------------------------------------------------------------------------


@dataclass
class _Reach:
    ids: set[int]
    namespace: bool
    truncated: bool


_ATOMIC_TYPES: frozenset[type] = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        range,
        slice,
        type(Ellipsis),
        type(NotImplemented),
        types.CodeType,
        types.WrapperDescriptorType,
        types.MethodDescriptorType,
        types.GetSetDescriptorType,
        types.MemberDescriptorType,
    }
)
_K_PLAIN, _K_ATOM, _K_FUNCTION, _K_CLASS, _K_SKIP, _K_ARRAY, _K_BUILTIN, _K_BLOCK = range(8)


class _Refs:
    """Whether a function/class is importable by reference; cached for one capture."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[Any, bool]] = {}

    def importable(self, obj: Any) -> bool:
        hit = self._cache.get(id(obj))
        if hit is not None and hit[0] is obj:
            return hit[1]
        result = _import_ref(obj, strict=True) is not None
        self._cache[id(obj)] = (obj, result)
        return result

    def clear(self) -> None:
        self._cache.clear()


def _import_ref(value: Any, strict: bool = False) -> tuple[str, str] | None:
    """(module, qualname) if ``value`` is that module's attribute, found without importing.

    Only for functions, classes and builtins (``strict`` accepts any object with the
    attributes). Never ``__main__``: that is what a cell defines.
    """
    if not strict and not isinstance(
        value,
        (types.FunctionType, types.BuiltinFunctionType, type, functools._lru_cache_wrapper),
    ):
        return None
    try:
        module_name = getattr(value, "__module__", None)
        qualname = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    except Exception:
        return None
    if not isinstance(module_name, str) or not isinstance(qualname, str):
        return None
    if module_name == "__main__":
        return None
    target: Any = sys.modules.get(module_name)
    if target is None:
        return None
    for part in qualname.split("."):
        if part.startswith("<"):
            return None
        try:
            target = getattr(target, part, _MISSING)
        except Exception:
            return None
        if target is _MISSING:
            return None
    return (module_name, qualname) if target is value else None


class _Reacher:
    """Finds the objects reachable from a variable, to put sharers in one group.

    Follows ``gc.get_referents``, except: atoms and immutable values (numbers, strings,
    dtypes, dates, members of importable Enums) are no nodes; modules, importable
    classes and functions are pickled by reference, so sharing them means nothing;
    namespaces (this kernel's globals, module dicts) and kernel internals are barriers;
    functions are followed into closures and defaults, not globals; numpy arrays into
    their ``base`` and, for object arrays, their items. Weak references link nothing.

    pandas: frames derived from one another share column arrays, Index objects and
    Copy-on-Write bookkeeping, and CoW makes that sharing invisible (a write copies
    first). So a pandas Block contributes only the items of object columns (a cell-class
    instance stored in a frame still links the frame to its class), and Index objects
    (immutable) are values.
    """

    def __init__(self, shell: Any, refs: _Refs) -> None:
        self.refs = refs
        self._atoms: set[type] = set(_ATOMIC_TYPES)
        self._kinds: dict[type, int] = {}
        self._namespaces = {id(shell.user_ns), id(builtins.__dict__), id(sys.modules)}
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if isinstance(namespace, dict):
                self._namespaces.add(id(namespace))
        self._barriers = set(self._namespaces) | {id(()), id(shell)}
        kernel = getattr(shell, "kernel", None)
        if kernel is not None:
            self._barriers.add(id(kernel))
        for stream in _std_streams().values():
            self._barriers.add(id(stream))
        self._value_types = _value_types()
        self._internal = _InternalTypes()
        np = sys.modules.get("numpy")
        self._ndarray: Any = np.ndarray if np is not None else None
        pandas_internals = sys.modules.get("pandas._libs.internals")
        self._block: type | None = getattr(pandas_internals, "Block", None)
        skip: list[type] = [weakref.ReferenceType, weakref.ProxyType, weakref.CallableProxyType]
        refs_type = getattr(pandas_internals, "BlockValuesRefs", None)
        if isinstance(refs_type, type):
            skip.append(refs_type)
        self._skip_types = tuple(skip)

    def reach(self, root: Any) -> _Reach:
        seen: set[int] = set()
        stack = [root]
        atoms = self._atoms
        barriers = self._barriers
        kinds = self._kinds
        namespace = truncated = False
        get_referents = gc.get_referents
        while stack:
            obj = stack.pop()
            t = type(obj)
            if t in atoms:
                continue
            oid = id(obj)
            if oid in seen:
                continue
            if oid in barriers:
                namespace = namespace or oid in self._namespaces
                continue
            kind = kinds.get(t)
            if kind is None:
                kind = kinds[t] = self._kind_of(t)
                if kind == _K_ATOM:
                    atoms.add(t)
                    continue
            if kind == _K_SKIP:
                continue
            if kind == _K_FUNCTION:
                if self.refs.importable(obj):
                    continue
                seen.add(oid)
                skip = (id(obj.__globals__), id(obj.__builtins__), id(obj.__code__))
                stack.extend(r for r in get_referents(obj) if id(r) not in skip)
                continue
            if kind == _K_CLASS and self.refs.importable(obj):
                continue
            if kind == _K_BLOCK:
                values = obj.values
                items: Any = values if self._ndarray and isinstance(values, self._ndarray) else None
                items = getattr(values, "_ndarray", None) if items is None else items
                if self._ndarray and isinstance(items, self._ndarray) and items.dtype.hasobject:
                    stack.extend(self._drop_atoms(items.ravel().tolist()))
                continue
            if kind == _K_BUILTIN:
                # len, math.sqrt: nothing to share; [].append: its list is.
                owner = obj.__self__
                if owner is not None and not isinstance(owner, types.ModuleType):
                    stack.append(owner)
                continue
            seen.add(oid)
            if len(seen) > MAX_REACH_OBJECTS:
                truncated = True
                break
            if kind == _K_ARRAY:
                base = obj.base
                if base is not None:
                    stack.append(base)
                if obj.dtype.hasobject:
                    stack.extend(self._drop_atoms(obj.ravel().tolist()))
            refs = get_referents(obj)
            if len(refs) > 16:
                refs = self._drop_atoms(refs)
            stack.extend(refs)
        return _Reach(seen, namespace, truncated)

    def _drop_atoms(self, items: list[Any]) -> list[Any]:
        atoms = self._atoms
        if set(map(type, items)) <= atoms:
            return []
        return [i for i in items if type(i) not in atoms]

    def _kind_of(self, t: type) -> int:
        if t is types.FunctionType:
            return _K_FUNCTION
        if t is types.BuiltinFunctionType:
            return _K_BUILTIN
        if issubclass(t, type):
            return _K_CLASS
        if issubclass(t, types.ModuleType) or issubclass(t, self._skip_types):
            return _K_SKIP
        if self._block is not None and issubclass(t, self._block):
            return _K_BLOCK
        if self._ndarray is not None and issubclass(t, self._ndarray):
            return _K_ARRAY
        if issubclass(t, self._value_types):
            return _K_ATOM
        if issubclass(t, enum.Enum) and self.refs.importable(t):
            return _K_ATOM
        if self._internal.reason(t) is not None:
            return _K_SKIP
        return _K_PLAIN


def _value_types() -> tuple[type, ...]:
    """Immutable value types whose identity nobody relies on: never grouping links."""
    import datetime

    found: list[type] = [datetime.date, datetime.time, datetime.timedelta, datetime.tzinfo]
    found.append(re.Pattern)
    for module_name, attrs in (
        ("decimal", ("Decimal",)),
        ("fractions", ("Fraction",)),
        ("uuid", ("UUID",)),
        ("pathlib", ("PurePath",)),
        ("numpy", ("dtype", "generic")),
        ("pandas.core.dtypes.base", ("ExtensionDtype",)),
        ("pandas.core.indexes.base", ("Index",)),
        ("pandas._libs.internals", ("BlockPlacement",)),
        ("pandas._libs.missing", ("NAType",)),
        ("pandas._libs.tslibs.nattype", ("NaTType",)),
        ("pandas._libs.tslibs.offsets", ("BaseOffset",)),
        ("pandas._libs.tslibs.period", ("Period",)),
    ):
        module = sys.modules.get(module_name)
        for attr in attrs:
            value = getattr(module, attr, None) if module is not None else None
            if isinstance(value, type):
                found.append(value)
    return tuple(found)


# --------------------------------------------------------------------------------------
# Pickling: what pickle gets wrong, what must not travel
# --------------------------------------------------------------------------------------


class _InternalTypes:
    """The kernel's own objects: never pickled, whatever path leads to them."""

    _PREFIXES = ("ipykernel", "zmq", "jupyter_client", "comm", "tornado", "debugpy")

    def __init__(self) -> None:
        bases: list[type] = []
        for module_name, attr in (
            ("traitlets.config.configurable", "Configurable"),
            ("IPython.core.autocall", "ExitAutocall"),
        ):
            module = sys.modules.get(module_name)
            value = getattr(module, attr, None) if module is not None else None
            if isinstance(value, type):
                bases.append(value)
        self._bases = tuple(bases)
        self._cache: dict[type, str | None] = {}

    def reason(self, t: type) -> str | None:
        if t in self._cache:
            return self._cache[t]
        module = getattr(t, "__module__", "") or ""
        top = module.partition(".")[0]
        result: str | None = None
        if (
            top in self._PREFIXES
            or top == "kernelhub_kernel"
            or (self._bases and issubclass(t, self._bases))
        ):
            result = (
                f"kernel internals ({module}.{t.__qualname__}): a snapshot never carries"
                " the kernel's shell, sockets, session or streams"
            )
        self._cache[t] = result
        return result


def _std_streams() -> dict[str, Any]:
    streams = {}
    for name in ("stdout", "stderr", "stdin", "__stdout__", "__stderr__", "__stdin__"):
        stream = getattr(sys, name, None)
        if stream is not None:
            streams[name] = stream
    return streams


def _refusals() -> list[tuple[type, str]]:
    """Kinds of objects that cannot be carried to another process, with the reason."""
    table: list[tuple[type, str]] = [
        (types.GeneratorType, "running generator: its suspended frame cannot be saved"),
        (types.CoroutineType, "coroutine: its suspended frame cannot be saved"),
        (types.AsyncGeneratorType, "async generator: its suspended frame cannot be saved"),
        (types.FrameType, "frame object: execution state cannot be saved"),
        (types.TracebackType, "traceback object: execution state cannot be saved"),
        (threading.Thread, "thread: a running thread cannot be carried; start it again"),
        (re.Match, "match object (re.Match): match again after restore"),
        (weakref.ref, "weak reference: its referent is not carried"),
        (weakref.ProxyType, "weak proxy: its referent is not carried"),
        (weakref.CallableProxyType, "weak proxy: its referent is not carried"),
        (threading.local, "thread-local storage"),
    ]
    optional = [
        ("socket", "socket", "open socket: connections cannot be carried; reconnect"),
        (
            "concurrent.futures",
            "Executor",
            "executor: its worker threads/processes cannot be carried",
        ),
        ("sqlite3", "Connection", "database connection (sqlite3): reconnect after restore"),
        ("sqlite3", "Cursor", "database cursor (sqlite3): reconnect after restore"),
        ("subprocess", "Popen", "subprocess: a running process cannot be carried"),
        ("asyncio", "AbstractEventLoop", "event loop"),
        ("asyncio", "Future", "asyncio future/task: pending work cannot be carried"),
        ("selectors", "BaseSelector", "selector over open file descriptors"),
        ("mmap", "mmap", "memory map"),
        ("multiprocessing.pool", "Pool", "process pool"),
        ("multiprocessing.process", "BaseProcess", "process"),
        ("ssl", "SSLContext", "SSL context"),
    ]
    for module_name, attr, reason in optional:
        module = sys.modules.get(module_name)
        value = getattr(module, attr, None) if module is not None else None
        if isinstance(value, type):
            table.append((value, reason))
    hash_types = {type(hashlib.sha256()), type(hashlib.md5()), type(hashlib.blake2b())}
    for name in ("sha1", "sha512", "sha3_256", "blake2s"):
        with contextlib.suppress(Exception):
            hash_types.add(type(getattr(hashlib, name)()))
    for t in hash_types:
        table.append(
            (t, f"hash object ({t.__module__}.{t.__qualname__}): its state cannot be saved")
        )
    return table


_LOCK_TYPE = type(threading.Lock())
_RLOCK_TYPE = type(threading.RLock())
_FILE_TYPES = (io.TextIOWrapper, io.BufferedReader, io.BufferedWriter, io.BufferedRandom, io.FileIO)


class _Reducer:
    """``reducer_override`` for both picklers: returns NotImplemented for the default.

    Decisions are cached per type; per-object work happens only for the types that need
    it (functions, classes, files, locks, loggers, streams).
    """

    def __init__(self, shell: Any, refs: _Refs, dill_mode: bool) -> None:
        self.refs = refs
        self.dill_mode = dill_mode
        self._handlers: dict[type, Callable[[Any], Any] | None] = {}
        self._internal = _InternalTypes()
        self._refusals = _refusals()
        self._streams = {id(s): name for name, s in _std_streams().items()}
        self._stream_types = {type(s) for s in _std_streams().values()}
        np = sys.modules.get("numpy")
        self._ndarray: type | None = np.ndarray if np is not None else None

    def __call__(self, obj: Any) -> Any:
        t = type(obj)
        try:
            handler = self._handlers[t]
        except KeyError:
            handler = self._handlers[t] = self._handler_for(t)
        if handler is None:
            return NotImplemented
        return handler(obj)

    def _handler_for(self, t: type) -> Callable[[Any], Any] | None:
        if t in self._stream_types:
            inner = self._handler_for_non_stream(t)

            def stream_or(obj: Any) -> Any:
                name = self._streams.get(id(obj))
                if name is not None:
                    return (_std_stream, (name,))
                return NotImplemented if inner is None else inner(obj)

            return stream_or
        return self._handler_for_non_stream(t)

    def _handler_for_non_stream(self, t: type) -> Callable[[Any], Any] | None:
        internal = self._internal.reason(t)
        if internal is not None:
            return _raiser(internal)
        for kind, reason in self._refusals:
            if issubclass(t, kind):
                return _raiser(reason)
        if t is _LOCK_TYPE:
            return _reduce_lock
        if t is _RLOCK_TYPE:
            return _reduce_rlock
        if issubclass(t, _FILE_TYPES):
            return _reduce_file
        if issubclass(t, logging.Logger):
            return _reduce_logger
        if t is types.FunctionType:
            return self._reduce_function
        if issubclass(t, type):
            return self._reduce_class
        if t is functools._lru_cache_wrapper:
            return self._reduce_lru_cache
        if issubclass(t, types.ModuleType):
            return _reduce_module
        if self._ndarray is not None and t is self._ndarray:
            return self._reduce_array
        if t is _TYPEVAR_TYPE:
            return _reduce_typevar
        if self.dill_mode and t in (list, dict, set, frozenset, tuple):
            return _reduce_atomic_container
        if not self.dill_mode and _defined_in_cell(t):
            return _raise_needs_dill
        return None

    def _reduce_function(self, fn: types.FunctionType) -> Any:
        if self.refs.importable(fn):
            return NotImplemented
        if not self.dill_mode:
            raise _NeedsDill(fn.__qualname__)
        return NotImplemented

    def _reduce_class(self, cls: type) -> Any:
        if self.refs.importable(cls):
            return NotImplemented
        if not self.dill_mode:
            raise _NeedsDill(cls.__qualname__)
        if isinstance(cls, enum.EnumMeta):
            return _reduce_enum(cls)
        return NotImplemented

    def _reduce_array(self, array: Any) -> Any:
        if array.dtype.hasobject:
            return _reduce_object_array(array)
        if self.dill_mode:
            # dill's own numpy support pickles the data in-band; keep it out of band.
            return array.__reduce_ex__(5)
        return NotImplemented

    def _reduce_lru_cache(self, wrapper: Any) -> Any:
        if self.refs.importable(wrapper):
            return NotImplemented
        params = wrapper.cache_parameters()
        return (_rebuild_lru_cache, (wrapper.__wrapped__, params["maxsize"], params["typed"]))


def _raiser(reason: str) -> Callable[[Any], Any]:
    def refuse(obj: Any) -> Any:
        raise _Refused(reason)

    return refuse


def _defined_in_cell(t: type) -> bool:
    """A class from a cell (or local to a function of one): pickle cannot refer to it."""
    return getattr(t, "__module__", None) == "__main__" or "<locals>" in getattr(
        t, "__qualname__", ""
    )


def _raise_needs_dill(obj: Any) -> Any:
    raise _NeedsDill(type(obj).__qualname__)


class _CPickler(pickle.Pickler):
    """The C pickler, protocol 5, buffers out of band, with our reducer."""

    def __init__(self, file: Any, buffers: list[pickle.PickleBuffer], reducer: _Reducer) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffers.append)
        self._reducer = reducer

    def reducer_override(self, obj: Any) -> Any:
        return self._reducer(obj)


@functools.cache
def _dill_pickler_class() -> type:
    import dill

    class _DillPickler(dill.Pickler):  # type: ignore[misc]
        _kh_reducer: _Reducer

        def reducer_override(self, obj: Any) -> Any:
            return self._kh_reducer(obj)

    return _DillPickler


def _dill_warning_class() -> type[Warning]:
    import dill

    warning: type[Warning] = dill.PicklingWarning
    return warning


def _dill_pickler(
    file: Any, buffers: list[pickle.PickleBuffer], reducer: _Reducer, main: Any
) -> Any:
    """dill by value, globals by reference to the restoring kernel's namespace.

    ``recurse=False`` on purpose: with ``recurse=True`` dill copies each function's
    globals into the pickle, so a restored function would see a private copy of ``df``
    (pickled again, 500 MB) instead of the namespace's, and no later rebinding.
    """
    pickler = _dill_pickler_class()(
        file, protocol=5, buffer_callback=buffers.append, byref=False, recurse=False
    )
    pickler._kh_reducer = reducer
    pickler._main = main
    return pickler


_TYPEVAR_TYPE = type(typing.TypeVar("_T"))
_ATOMIC_ITEMS = frozenset({type(None), bool, int, float, complex, str, bytes})
_BLOB_MIN_ITEMS = 1024
_C_CONTAINER_MIN_ITEMS = 4096


def _reduce_typevar(tv: Any) -> Any:
    """A TypeVar made in a cell pickles as ``__main__.T``: rebuild it by value instead."""
    if getattr(tv, "__module__", None) != "__main__":
        return NotImplemented
    return (
        _make_typevar,
        (tv.__name__, tv.__constraints__, tv.__bound__, tv.__covariant__, tv.__contravariant__),
    )


def _reduce_atomic_container(obj: Any) -> Any:
    """dill pickles in Python, object by object; a big container of numbers and strings
    has no identity inside to keep, so the C pickler does it, much faster."""
    if len(obj) < _C_CONTAINER_MIN_ITEMS or (isinstance(obj, dict) and "__name__" in obj):
        return NotImplemented  # (a module's namespace is saved by reference)
    items = list(obj.keys()) + list(obj.values()) if isinstance(obj, dict) else obj
    if not set(map(type, items)) <= _ATOMIC_ITEMS:
        return NotImplemented
    return (pickle.loads, (pickle.dumps(obj, protocol=5),))


def _reduce_object_array(array: Any) -> Any:
    """A large object array of strings (a pandas string or object column) as one UTF-8
    blob, out of band: pickle memoizes each string, which is slow both ways.

    The strings are joined with a separator that none of them contains (checked), so
    restoring is one ``str.split``. Only when the strings are not shared objects
    (sampled), so nothing grows at restore; non-string items (NaN, None, NA: missing
    values) travel apart, by position.
    """
    if array.size < _BLOB_MIN_ITEMS or not (array.flags.c_contiguous or array.flags.f_contiguous):
        return NotImplemented
    order = "C" if array.flags.c_contiguous else "F"
    items = array.ravel(order=order).tolist()
    sample = items[:: max(1, len(items) // 4096)]
    if len(set(map(id, sample))) < 0.9 * len(sample):
        return NotImplemented
    others: list[int] = []
    extras: list[Any] = []
    if set(map(type, items)) != {str}:
        others = [i for i, item in enumerate(items) if type(item) is not str]
        if len(others) > len(items) // 10:
            return NotImplemented
        extras = [items[i] for i in others]
        for i in others:
            items[i] = ""
    for separator in _BLOB_SEPARATORS:
        joined = separator.join(items)
        if joined.count(separator) == len(items) - 1:
            blob = joined.encode("utf-8", "surrogatepass")
            return (
                _rebuild_object_array,
                (pickle.PickleBuffer(blob), separator, array.shape, order, others, extras),
            )
    return NotImplemented


_BLOB_SEPARATORS = ("\x00", "\x1f", "\ufdd0", "\U0010fffe")


def _reduce_module(module: types.ModuleType) -> Any:
    name = getattr(module, "__name__", None)
    if isinstance(name, str) and sys.modules.get(name) is module:
        return (importlib.import_module, (name,))
    raise _Refused("module object that is not importable by name (made at run time)")


def _reduce_lock(lock: Any) -> Any:
    return (_make_lock, (lock.locked(),))


_RLOCK_REPR = re.compile(r"owner=(\d+) count=(\d+)")


def _reduce_rlock(lock: Any) -> Any:
    match = _RLOCK_REPR.search(repr(lock))
    if match is None:
        raise _Refused("RLock whose state cannot be read")
    owner, count = int(match.group(1)), int(match.group(2))
    if count == 0:
        return (_make_rlock, (0,))
    if owner == threading.get_ident():
        return (_make_rlock, (count,))
    raise _Refused(
        "RLock held by another thread, which will not exist after restore;"
        " release it first (or keep it unheld between cells)"
    )


def _reduce_logger(logger: logging.Logger) -> Any:
    return (
        _restore_logger,
        (
            logger.name,
            logger.level,
            logger.propagate,
            logger.disabled,
            list(logger.handlers),
            list(logger.filters),
        ),
    )


def _reduce_file(f: Any) -> Any:
    if isinstance(f, io.TextIOWrapper):
        kind, raw = "text", getattr(f.buffer, "raw", None)
    elif isinstance(f, io.FileIO):
        kind, raw = "raw", f
    else:
        kind, raw = "buffered", f.raw
    mode = str(getattr(f, "mode", None) or getattr(raw, "mode", "r"))
    if kind == "text" and "b" in mode:
        mode = mode.replace("b", "")
    encoding = getattr(f, "encoding", None) if kind == "text" else None
    errors = getattr(f, "errors", None) if kind == "text" else None
    name = getattr(f, "name", None)
    if f.closed:
        return (_closed_file, (name, mode, kind, encoding))
    if not isinstance(raw, io.FileIO):
        raise _Refused(f"open file object over {type(raw).__name__}, not an OS file")
    fd = raw.fileno()
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise _Refused(
            f"open pipe, terminal, socket or device ({name!r}): only regular files are reopened"
        )
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        path = os.path.abspath(name) if isinstance(name, str) else ""
    if not path or path.endswith(" (deleted)"):
        raise _Refused(f"open file {name!r} whose path no longer exists")
    if f.writable():
        f.flush()
    try:
        position = f.tell()
    except OSError as exc:
        raise _Refused(f"open file {name!r} whose position cannot be read ({exc})") from exc
    root = os.path.realpath(workspace_root())
    relative = os.path.relpath(path, root) if path.startswith(root + os.sep) else None
    spec = {
        "path": None if relative is not None else path,
        "workspace_path": relative,
        "name": name,
        "mode": mode,
        "kind": kind,
        "position": position,
        "encoding": encoding,
        "errors": errors,
        "line_buffering": bool(getattr(f, "line_buffering", False)),
    }
    return (_reopen_file, (spec,))


def _reduce_enum(cls: enum.EnumMeta) -> Any:
    """Rebuild a cell-defined Enum through its metaclass (dill's by-value path breaks).

    Members are passed by value; methods, properties and other descriptors in the class
    body; attributes set after creation are set again after.
    """
    user_new = vars(cls).get("_new_member_")
    if isinstance(user_new, types.FunctionType):
        raise _Refused(
            f"Enum {cls.__qualname__} with a custom __new__: its members cannot be rebuilt"
            " from their values"
        )
    members = [(name, member._value_) for name, member in cls._member_map_.items()]
    member_names = set(cls._member_map_)
    body: dict[str, Any] = {}
    later: dict[str, Any] = {}
    internal = {
        "_member_names_",
        "_member_map_",
        "_value2member_map_",
        "_unhashable_values_",
        "_member_type_",
        "_value_repr_",
        "_new_member_",
        "_use_args_",
        "_boundary_",
        "_flag_mask_",
        "_all_bits_",
        "_singles_mask_",
        "_inverted_",
        "_numeric_repr_",
        "__new__",
        "__module__",
        "__qualname__",
        "__dict__",
        "__weakref__",
    }
    for key, value in vars(cls).items():
        if key in member_names or key in internal:
            continue
        if key == "_generate_next_value_" and not isinstance(
            value, (types.FunctionType, staticmethod)
        ):
            continue
        sunder = key.startswith("_") and key.endswith("_") and not key.startswith("__")
        if sunder and key not in ("_missing_", "_generate_next_value_"):
            later[key] = value
            continue
        if key.startswith("__") or hasattr(value, "__get__") or hasattr(value, "__set__"):
            body[key] = value
        else:
            later[key] = value
    extras = {
        name: {k: v for k, v in vars(member).items() if not k.startswith("_")}
        for name, member in cls._member_map_.items()
        if hasattr(member, "__dict__")
    }
    boundary = getattr(cls, "_boundary_", None) if issubclass(cls, enum.Flag) else None
    return (
        _rebuild_enum,
        (
            type(cls),
            cls.__name__,
            cls.__bases__,
            members,
            body,
            later,
            extras,
            cls.__qualname__,
            boundary,
        ),
    )


# --------------------------------------------------------------------------------------
# Rebuilders: referenced by the pickles, called at restore (in the sandbox)
# --------------------------------------------------------------------------------------


def _std_stream(name: str) -> Any:
    return getattr(sys, name)


def _make_lock(locked: bool) -> Any:
    lock = threading.Lock()
    if locked:
        lock.acquire()
    return lock


def _make_rlock(count: int) -> Any:
    """Held ``count`` times by the thread that restores, the one that runs cells."""
    lock = threading.RLock()
    for _ in range(count):
        lock.acquire()
    return lock


def _restore_logger(
    name: str,
    level: int,
    propagate: bool,
    disabled: bool,
    handlers: list[logging.Handler],
    filters: list[Any],
) -> logging.Logger:
    logger = logging.getLogger() if name == "root" else logging.getLogger(name)
    logger.setLevel(level)
    logger.propagate = propagate
    logger.disabled = disabled
    logger.handlers = list(handlers)
    logger.filters = list(filters)
    return logger


def _make_typevar(
    name: str, constraints: tuple[Any, ...], bound: Any, covariant: bool, contravariant: bool
) -> Any:
    tv = typing.TypeVar(  # type: ignore[misc]
        name, *constraints, bound=bound, covariant=covariant, contravariant=contravariant
    )
    tv.__module__ = "__main__"
    return tv


def _rebuild_object_array(
    blob: Any,
    separator: str,
    shape: tuple[int, ...],
    order: str,
    others: list[int],
    extras: list[Any],
) -> Any:
    import numpy as np

    items = str(blob, "utf-8", "surrogatepass").split(separator)
    array = np.empty(len(items), dtype=object)
    array[:] = items
    for index, value in zip(others, extras, strict=True):
        array[index] = value
    return array.reshape(shape, order=order)  # type: ignore[call-overload]


def _rebuild_lru_cache(func: Callable[..., Any], maxsize: int | None, typed: bool) -> Any:
    return functools.lru_cache(maxsize=maxsize, typed=typed)(func)


def _open_flags(mode: str) -> int:
    """os.open flags for reopening: never O_CREAT/O_TRUNC, the file keeps its content."""
    if "+" in mode:
        flags = os.O_RDWR
    elif "r" in mode:
        flags = os.O_RDONLY
    else:
        flags = os.O_WRONLY
    if "a" in mode:
        flags |= os.O_APPEND
    return flags | os.O_CLOEXEC


def _open_fd(
    fd: int,
    mode: str,
    kind: str,
    encoding: str | None,
    errors: str | None,
    line_buffering: bool,
) -> Any:
    if kind == "raw":
        return open(fd, mode, buffering=0, closefd=True)
    if kind == "buffered":
        return open(fd, mode, closefd=True)
    return open(fd, mode, buffering=1 if line_buffering else -1, encoding=encoding, errors=errors)


def _raw_of(f: Any, kind: str) -> Any:
    if kind == "raw":
        return f
    if kind == "text":
        return f.buffer.raw
    return f.raw


def _reopen_file(spec: dict[str, Any]) -> Any:
    """Reopen a file at its position, same mode, without truncating or creating it."""
    path = spec["path"]
    if spec.get("workspace_path") is not None:
        path = os.path.join(workspace_root(), spec["workspace_path"])
    fd = os.open(path, _open_flags(spec["mode"]))
    try:
        f = _open_fd(
            fd, spec["mode"], spec["kind"], spec["encoding"], spec["errors"], spec["line_buffering"]
        )
    except BaseException:
        os.close(fd)
        raise
    if spec["name"] is not None:
        _raw_of(f, spec["kind"]).name = spec["name"]
    f.seek(spec["position"])
    return f


def _closed_file(name: Any, mode: str, kind: str, encoding: str | None) -> Any:
    """A closed file object with the same name and mode (what ``with open(...)`` left)."""
    fd = os.open(os.devnull, _open_flags(mode))
    f = _open_fd(fd, mode, kind, encoding, None, False)
    if name is not None:
        _raw_of(f, kind).name = name
    f.close()
    return f


def _rebuild_enum(
    metaclass: type,
    name: str,
    bases: tuple[type, ...],
    members: list[tuple[str, Any]],
    body: dict[str, Any],
    later: dict[str, Any],
    extras: dict[str, dict[str, Any]],
    qualname: str,
    boundary: Any,
) -> type:
    classdict = metaclass.__prepare__(name, bases)
    classdict["__module__"] = "__main__"
    classdict["__qualname__"] = qualname
    for key, value in body.items():
        classdict[key] = value
    for key, value in members:
        classdict[key] = value
    kwargs = {"boundary": boundary} if boundary is not None else {}
    cls: type = metaclass(name, bases, classdict, **kwargs)
    for key, value in later.items():
        setattr(cls, key, value)
    for member_name, attrs in extras.items():
        member = getattr(cls, member_name)
        for key, value in attrs.items():
            with contextlib.suppress(AttributeError, TypeError):
                setattr(member, key, value)
    return cls


# --------------------------------------------------------------------------------------
# Restore
# --------------------------------------------------------------------------------------


@functools.cache
def _dill_unpickler_class() -> type:
    import dill

    class _DillUnpickler(dill.Unpickler):  # type: ignore[misc]
        """dill's unpickler, rebuilding cell classes without re-running their hooks."""

        def find_class(self, module: str, name: str) -> Any:
            if (module, name) == ("dill._dill", "_create_type"):
                return _create_type_without_hooks
            return super().find_class(module, name)

    return _DillUnpickler


def _create_type_without_hooks(metaclass: type, *args: Any) -> type:
    """dill's ``_create_type``, minus the ``__init_subclass__`` of cell-defined bases.

    The class's attributes, and whatever its creation changed elsewhere (a registry the
    hook appended to), are in the snapshot already: running the hook again would do it
    twice. Hooks of library bases (``typing.Generic``...) still run: they set up the
    class itself.
    """
    bases: tuple[type, ...] = args[1] if len(args) > 1 else ()
    muted = []
    for klass in {k for base in bases for k in base.__mro__}:
        hook = vars(klass).get("__init_subclass__")
        if hook is not None and klass.__module__ == "__main__":
            with contextlib.suppress(AttributeError, TypeError):
                setattr(klass, "__init_subclass__", classmethod(_no_hook))  # noqa: B010
                muted.append((klass, hook))
    try:
        created: type = metaclass(*args)
        return created
    finally:
        for klass, hook in muted:
            setattr(klass, "__init_subclass__", hook)  # noqa: B010


def _no_hook(cls: type, /, **kwargs: Any) -> None:
    pass


_GROUP_FILE = re.compile(r"groups/[0-9a-f]{16,64}\.pkl")


class _Restore:
    def __init__(self, shell: Any, session: _Session, path: str, workspace: bool) -> None:
        self.shell = shell
        self.session = session
        self.path = path
        self.with_workspace = workspace

    def run(self) -> dict[str, Any]:
        clock = _Clock()
        manifest = _read_manifest(self.path)
        ns = self.shell.user_ns
        failed: dict[str, str] = {}
        restored: list[str] = []
        workspace = None
        if self.with_workspace and manifest.get("workspace"):
            workspace = _extract_workspace(self.path, manifest["workspace"])
        clock.lap("workspace")
        imported: list[str] = []
        for name, spec in manifest["imports"].items():
            attr = spec.get("attr") or ""
            try:
                value: Any = importlib.import_module(spec["module"])
                for part in attr.split(".") if attr else []:
                    value = getattr(value, part)
            except Exception as exc:
                failed[name] = f"cannot import {spec.get('module')}: {type(exc).__name__}: {exc}"
                continue
            ns[name] = value
            imported.append(name)
            if attr and "." not in attr:
                self.session.tracker.from_imports[name] = (spec["module"], attr)
        clock.lap("imports")
        adopted: list[_Group] = []
        for entry in manifest["groups"]:
            values, failures = self._load_group(entry)
            failed.update(failures)
            restored.extend(values)
            if not failures:
                adopted.append(
                    _Group(
                        names=tuple(entry["names"]),
                        file=entry["file"],
                        sha256=entry["sha256"],
                        size_bytes=int(entry["size_bytes"]),
                        pickler=entry["pickler"],
                        pickle_bytes=int(entry["pickle_bytes"]),
                        buffers=[int(b) for b in entry["buffers"]],
                    )
                )
        clock.lap("groups")
        self.shell.execution_count = int(manifest["execution_count"])
        # The next capture may use this directory as its base.
        self.session.snapshot_id = manifest["snapshot_id"]
        self.session.groups = adopted
        self.session.ids = {n: id(ns[n]) for g in adopted for n in g.names}
        self.session.workspace = manifest.get("workspace")
        self.session.tracker.reset()
        return {
            "format": FORMAT,
            "snapshot_id": manifest["snapshot_id"],
            "path": self.path,
            "restored": restored,
            "imports": imported,
            "failed": failed,
            "skipped": manifest.get("skipped", {}),
            "execution_count": self.shell.execution_count,
            "workspace": workspace,
            "timings": clock.laps,
        }

    def _load_group(self, entry: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        names: list[str] = list(entry["names"])
        try:
            data, buffers, digest = _read_group_file(self.path, entry)
        except Exception as exc:
            reason = f"group file {entry.get('file')!r} unusable: {exc}"
            return {}, dict.fromkeys(names, reason)
        values, failures = self._unpickle(entry, names, data, buffers)
        try:
            digest.check()
        except ValueError as exc:
            ns = self.shell.user_ns
            for name in values:
                ns.pop(name, None)
            reason = f"group file {entry.get('file')!r} unusable: {exc}"
            return {}, dict.fromkeys(names, reason)
        return values, failures

    def _unpickle(
        self, entry: dict[str, Any], names: list[str], data: bytes, buffers: list[bytearray]
    ) -> tuple[dict[str, Any], dict[str, str]]:
        stream = io.BytesIO(data)
        if entry["pickler"] == "dill":
            unpickler: Any = _dill_unpickler_class()(stream, buffers=iter(buffers), ignore=True)
            unpickler._main = self.shell.user_module
        else:
            unpickler = pickle.Unpickler(stream, buffers=iter(buffers))
        values: dict[str, Any] = {}
        ns = self.shell.user_ns
        for index, name in enumerate(names):
            try:
                values[name] = ns[name] = unpickler.load()
                # Bound at once, as when the cells ran: rebuilding a later member (a
                # subclass's __init_subclass__, a default argument) may look it up.
            except Exception as exc:
                reason = f"cannot be loaded: {type(exc).__name__}: {exc}"[:500]
                failures = {name: reason}
                for later in names[index + 1 :]:
                    failures[later] = f"not loaded: {name} before it in the same group failed"
                return values, failures
        return values, {}


def _read_manifest(path: str) -> dict[str, Any]:
    with open(os.path.join(path, MANIFEST), "rb") as f:
        manifest = json.load(f)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path}/{MANIFEST} is not a {FORMAT} manifest")
    for key, kind in (
        ("snapshot_id", str),
        ("execution_count", int),
        ("imports", dict),
        ("groups", list),
    ):
        if not isinstance(manifest.get(key), kind):
            raise ValueError(f"{path}/{MANIFEST}: {key!r} missing or not a {kind.__name__}")
    return manifest


def _read_group_file(path: str, entry: dict[str, Any]) -> tuple[bytes, list[bytearray], _Digest]:
    """The pickle and its buffers, and the check of their sha256 against the manifest.

    A large file is hashed from its own file descriptor in a thread, while it is read and
    unpickled here (both release the GIL): ``_Digest.check`` waits for it.
    """
    name = entry["file"]
    if not isinstance(name, str) or not _GROUP_FILE.fullmatch(name):
        raise ValueError("not a group file name")
    pickle_bytes = int(entry["pickle_bytes"])
    lengths = [int(n) for n in entry["buffers"]]
    file_path = os.path.join(path, name)
    with open(file_path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != pickle_bytes + sum(lengths):
            raise ValueError(f"{size} bytes, the manifest says {pickle_bytes + sum(lengths)}")
        digest = _Digest(entry["sha256"], file_path if size >= _PARALLEL_HASH_BYTES else None)
        data = f.read(pickle_bytes)
        digest.update(data)
        buffers = []
        for length in lengths:
            buffer = bytearray(length)
            view = memoryview(buffer)
            done = 0
            while done < length:
                n = f.readinto(view[done:])
                if not n:
                    raise ValueError("file ends early")
                done += n
            digest.update(buffer)
            buffers.append(buffer)
    return data, buffers, digest


class _Digest:
    """sha256 of a group file: computed inline for a small one, in a thread for a large
    one (from the file, not from the buffers the unpickled objects now own)."""

    def __init__(self, expected: str, path: str | None) -> None:
        self._expected = expected
        self._hash = hashlib.sha256()
        self._thread: threading.Thread | None = None
        if path is not None:
            self._thread = threading.Thread(
                target=self._hash_file, args=(path,), name="kernelhub-snapshot-hash"
            )
            self._thread.start()

    def _hash_file(self, path: str) -> None:
        with open(path, "rb") as f:
            while chunk := f.read(_COPY_CHUNK * 4):
                self._hash.update(chunk)

    def update(self, data: bytes | bytearray) -> None:
        if self._thread is None:
            self._hash.update(data)

    def check(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._hash.hexdigest() != self._expected:
            raise ValueError("content does not match its sha256 (corrupted or altered)")


# --------------------------------------------------------------------------------------
# Workspace
# --------------------------------------------------------------------------------------


def workspace_root() -> str:
    """``KERNELHUB_WORKSPACE``, default ``/workspace``; read at each call, not at import."""
    return os.environ.get(WORKSPACE_ENV, DEFAULT_WORKSPACE)


def _scan_workspace(
    root: str, exclude: str
) -> tuple[list[tuple[str, str, int, int, int, str]], list[dict[str, str]]]:
    """Every directory, regular file and symlink under root (no link is followed):
    (relpath, kind, size, mtime_ns, mode, link target). Other kinds are skipped, named."""
    entries: list[tuple[str, str, int, int, int, str]] = []
    skipped: list[dict[str, str]] = []
    real_exclude = os.path.realpath(exclude)

    def walk(directory: str, prefix: str) -> None:
        try:
            listing = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as exc:
            skipped.append({"path": prefix or ".", "reason": f"cannot list: {exc}"})
            return
        for item in listing:
            rel = f"{prefix}{item.name}"
            try:
                st = item.stat(follow_symlinks=False)
            except OSError as exc:
                skipped.append({"path": rel, "reason": f"cannot stat: {exc}"})
                continue
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(item.path)
                entries.append((rel, "link", 0, st.st_mtime_ns, st.st_mode & 0o777, target))
            elif stat.S_ISDIR(st.st_mode):
                if os.path.realpath(item.path) == real_exclude:
                    continue
                entries.append((rel, "dir", 0, st.st_mtime_ns, st.st_mode & 0o777, ""))
                walk(item.path, rel + "/")
            elif stat.S_ISREG(st.st_mode):
                entries.append((rel, "file", st.st_size, st.st_mtime_ns, st.st_mode & 0o777, ""))
            else:
                skipped.append({"path": rel, "reason": "not a regular file, directory or symlink"})

    walk(root, "")
    return entries, skipped


class _PaddedReader:
    """Reads exactly ``size`` bytes from a file that may shrink while being archived."""

    def __init__(self, f: Any, size: int) -> None:
        self._f = f
        self._left = size
        self.short = False

    def read(self, n: int = -1) -> bytes:
        n = self._left if n < 0 else min(n, self._left)
        data: bytes = self._f.read(n)
        if len(data) < n:
            self.short = True
            data += b"\0" * (n - len(data))
        self._left -= len(data)
        return data


def _write_workspace_tar(
    path: str, root: str, entries: list[tuple[str, str, int, int, int, str]]
) -> tuple[str, int, int, list[dict[str, str]]]:
    skipped: list[dict[str, str]] = []
    files = 0
    real_root = os.path.realpath(root)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for rel, kind, _, mtime_ns, mode, target in entries:
            info = tarfile.TarInfo(rel)
            info.mtime = mtime_ns / 1e9
            info.mode = mode
            if kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif kind == "link":
                info.type = tarfile.SYMTYPE
                if os.path.isabs(target) and (
                    target == real_root or target.startswith(real_root + os.sep)
                ):
                    # Absolute links into the workspace become relative: the restoring
                    # workspace may live elsewhere, and absolute links are refused there.
                    target = os.path.relpath(target, os.path.join(real_root, os.path.dirname(rel)))
                info.linkname = target
                tar.addfile(info)
            else:
                try:
                    with open(os.path.join(root, rel), "rb") as f:
                        info.size = os.fstat(f.fileno()).st_size
                        reader = _PaddedReader(f, info.size)
                        tar.addfile(info, reader)
                except OSError as exc:
                    skipped.append({"path": rel, "reason": f"cannot read: {exc}"})
                    continue
                if reader.short:
                    skipped.append({"path": rel, "reason": "shrank while archived; padded"})
                files += 1
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            digest.update(chunk)
    return digest.hexdigest(), files, os.path.getsize(path), skipped


def _extract_workspace(path: str, entry: dict[str, Any]) -> dict[str, Any]:
    """Extract the tar into the workspace, refusing absolute paths, ``..``, links that
    point outside, and special files (tarfile's ``data`` filter, member by member)."""
    root = workspace_root()
    os.makedirs(root, exist_ok=True)
    refused: list[dict[str, str]] = []

    files = 0

    def only_safe(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
        nonlocal files
        # tarfile's data filter would strip a leading "/" and allow "a/../b": refuse both.
        if member.name.startswith("/") or ".." in member.name.split("/"):
            refused.append({"path": member.name, "reason": "absolute path or '..'"})
            return None
        if not hasattr(tarfile, "data_filter"):
            # The image's Python (3.11.2) predates extraction filters: the same rules,
            # by hand. Regular files and directories only; links are refused.
            if not (member.isfile() or member.isdir()):
                refused.append({"path": member.name, "reason": "not a regular file or directory"})
                return None
            member.mode = (member.mode or 0o600) & 0o755
            member.uid = member.gid = 0
            member.uname = member.gname = ""
            files += member.isfile()
            return member
        try:
            safe = tarfile.data_filter(member, dest)
        except tarfile.FilterError as exc:
            refused.append({"path": member.name, "reason": f"{type(exc).__name__}: {exc}"})
            return None
        files += safe.isfile()
        return safe

    with tarfile.open(os.path.join(path, WORKSPACE_TAR)) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(root, filter=only_safe)
        else:
            for member in tar:
                kept = only_safe(member, root)
                if kept is not None:
                    tar.extract(kept, root, set_attrs=False)
    return {"root": root, "files": files, "refused": refused}


class _Clock:
    """Seconds spent in each phase, reported as ``timings`` (for the host's logs)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = now - self._last
        self._last = now


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic GC passes while pickling or unpickling: millions of new containers
    would trigger many, for nothing (nothing becomes garbage meanwhile)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
