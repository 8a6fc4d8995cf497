"""Rebuilders: referenced by the pickles, called at restore (in the sandbox). Their
names are part of the snapshot format: the package re-exports them under their old
path, so snapshots made before the package split still load."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import typing
from collections.abc import Callable
from typing import Any

from .workspace import workspace_root


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
