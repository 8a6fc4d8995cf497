"""The picklers (the C pickler and dill, both with our reducer), the pickle of one
group, the opcode scan for globals, and dill's unpickler for cell classes."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import pickle
import pickletools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .reducers import _Reducer


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
