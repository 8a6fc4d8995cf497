"""Sharing analysis: which objects each variable reaches (variables that share one
are pickled together), what is importable by reference, what must be refused."""

from __future__ import annotations

import builtins
import contextlib
import enum
import functools
import gc
import hashlib
import re
import sys
import threading
import types
import weakref
from dataclasses import dataclass
from typing import Any

from .common import _MISSING, MAX_REACH_OBJECTS


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
        self._namespaces.update(_module_namespaces())
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


# The ids of the loaded modules' namespaces, and the dicts themselves: held, so that no
# id here can be reused by another object while it is cached. Walking sys.modules (~900
# modules with numpy and pandas) cost 0.5 ms of each ~3 ms checkpoint (a _Reacher now
# takes 0.05 ms); it is walked again only when the number of modules changed. A module
# replaced in place (same count) leaves its old namespace a barrier and its new one a
# plain dict until then: that only makes sharing through the new module's dict group
# more together, never less.
_MODULE_NAMESPACES: tuple[int, dict[int, dict[str, Any]]] = (-1, {})


def _module_namespaces() -> dict[int, dict[str, Any]]:
    global _MODULE_NAMESPACES
    count = len(sys.modules)
    if _MODULE_NAMESPACES[0] != count:
        found: dict[int, dict[str, Any]] = {}
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if isinstance(namespace, dict):
                found[id(namespace)] = namespace
        _MODULE_NAMESPACES = (count, found)
    return _MODULE_NAMESPACES[1]


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
