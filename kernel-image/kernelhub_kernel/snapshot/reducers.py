"""``reducer_override`` for both picklers: what pickle gets silently wrong (files,
locks, loggers, lru_cache, cell Enums and TypeVars, big object arrays), carried by
our own reductions, and what cannot travel, refused by name."""

from __future__ import annotations

import enum
import functools
import importlib
import io
import logging
import os
import pickle
import re
import stat
import sys
import threading
import types
import typing
from collections.abc import Callable
from typing import Any

from .common import _NeedsDill, _Refused
from .grouping import _InternalTypes, _Refs, _refusals, _std_streams
from .rebuilders import (
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
from .workspace import workspace_root

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
