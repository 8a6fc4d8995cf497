"""Our reductions (``snapshot/reducers.py``, ``rebuilders.py``, ``picklers.py``) through
the real C pickler and back: what pickle gets wrong comes back right, what cannot travel
is refused by name."""

from __future__ import annotations

import enum
import functools
import io
import logging
import os
import pickle
import re
import socket
import sys
import threading
import types
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.unit.snapshot import kernel_side

snapshot = kernel_side.load()
common = snapshot.common
grouping = snapshot.grouping
picklers = snapshot.picklers
reducers = snapshot.reducers


def dumps(obj: Any, *, dill_mode: bool = False) -> tuple[bytes, list[pickle.PickleBuffer]]:
    reducer = reducers._Reducer(None, grouping._Refs(), dill_mode)
    out, buffers = io.BytesIO(), list[pickle.PickleBuffer]()
    if dill_mode:
        picklers._dill_pickler(out, buffers, reducer, None).dump(obj)
    else:
        picklers._CPickler(out, buffers, reducer).dump(obj)
    return out.getvalue(), buffers


def roundtrip(obj: Any, **kwargs: Any) -> Any:
    data, buffers = dumps(obj, **kwargs)
    return pickle.loads(data, buffers=buffers)


def refusal(obj: Any) -> str:
    with pytest.raises(common._Refused) as info:
        dumps(obj)
    return str(info.value.reason)


@pytest.mark.parametrize("held", [False, True])
def test_a_lock_comes_back_in_its_state(held: bool) -> None:
    lock = threading.Lock()
    if held:
        lock.acquire()
    assert roundtrip(lock).locked() is held


def test_an_rlock_held_by_this_thread_comes_back_held_as_often() -> None:
    lock = threading.RLock()
    assert "count=0" in repr(roundtrip(lock))
    lock.acquire()
    lock.acquire()
    back = roundtrip(lock)
    assert "count=2" in repr(back)
    back.release()
    back.release()
    with pytest.raises(RuntimeError):
        back.release()


def test_an_rlock_held_by_another_thread_is_refused() -> None:
    lock = threading.RLock()
    taken, done = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            done.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert taken.wait(10)
        assert "held by another thread" in refusal(lock)
    finally:
        done.set()
        t.join(10)


@pytest.mark.parametrize(("mode", "kind"), [("r", "text"), ("rb", "buffered"), ("r+b", "buffered")])
def test_an_open_file_is_reopened_at_its_position_without_truncating(
    tmp_path: Path, mode: str, kind: str
) -> None:
    path = tmp_path / "data.txt"
    path.write_text("line one\nline two\n")
    with open(path, mode) as f:
        f.readline()
        data, buffers = dumps(f)
        opened_as = f.mode
    back = pickle.loads(data, buffers=buffers)
    try:
        assert back.mode == opened_as and back.name == str(path)
        assert back.tell() == len("line one\n")
        assert back.read() in ("line two\n", b"line two\n")
    finally:
        back.close()
    assert path.read_text() == "line one\nline two\n"


def test_a_file_opened_for_writing_is_flushed_and_appended_to_not_truncated(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.txt"
    f = open(path, "w")  # noqa: SIM115 (kept open across the pickle)
    f.write("kept")
    back = roundtrip(f)
    f.close()
    back.write("+more")
    back.close()
    assert path.read_text() == "kept+more"


def test_a_workspace_file_travels_relative_to_the_workspace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    for root in (old, new):
        (root / "sub").mkdir(parents=True)
        (root / "sub" / "f.txt").write_text(f"from {root.name}")
    monkeypatch.setenv(common.WORKSPACE_ENV, str(old))
    with open(old / "sub" / "f.txt") as f:
        data, buffers = dumps(f)
    monkeypatch.setenv(common.WORKSPACE_ENV, str(new))
    with pickle.loads(data, buffers=buffers) as back:
        assert back.read() == "from new"


def test_a_closed_file_comes_back_closed_with_its_name(tmp_path: Path) -> None:
    with open(tmp_path / "x.txt", "w") as f:
        pass
    back = roundtrip(f)
    assert back.closed and back.name == str(tmp_path / "x.txt") and back.mode == "w"


def test_pipes_and_deleted_files_are_refused(tmp_path: Path) -> None:
    r, w = os.pipe()
    with open(r, "rb") as pipe, open(w, "wb"):
        assert "only regular files" in refusal(pipe)
    path = tmp_path / "gone.txt"
    path.write_text("x")
    with open(path) as f:
        path.unlink()
        assert "no longer exists" in refusal(f)
    assert "not an OS file" in refusal(io.TextIOWrapper(io.BytesIO(b"x")))


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: (i for i in range(3)), "generator"),
        (lambda: threading.Thread(target=print), "thread"),
        (lambda: re.match("a", "a"), "match object"),
        (lambda: socket.socket(), "socket"),
        (lambda: __import__("hashlib").sha256(b"x"), "hash object"),
        (lambda: threading.local(), "thread-local"),
    ],
)
def test_what_cannot_travel_is_refused_by_name(make: Any, words: str) -> None:
    obj = make()
    try:
        assert words in refusal(obj)
    finally:
        if isinstance(obj, socket.socket):
            obj.close()


def test_modules_travel_by_name_and_runtime_modules_are_refused() -> None:
    assert roundtrip(os) is os
    import types

    assert "not importable by name" in refusal(types.ModuleType("made_here"))


def test_a_logger_is_restored_with_its_settings() -> None:
    logger = logging.getLogger("kernelhub.test.reducers")
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    back = roundtrip(logger)
    assert back is logger
    # What the pickle carried is re-applied to the live logger on load.
    data, buffers = dumps(logger)
    logger.setLevel(logging.DEBUG)
    logger.propagate = True
    pickle.loads(data, buffers=buffers)
    assert logger.level == logging.WARNING and logger.propagate is False


def test_a_cell_typevar_travels_by_value() -> None:
    T = typing.TypeVar("T", int, str)
    T.__module__ = "__main__"
    back = roundtrip(T)
    assert back.__name__ == "T" and back.__constraints__ == (int, str)
    assert back.__module__ == "__main__"


def test_cell_classes_and_functions_need_dill() -> None:
    class Local:
        pass

    with pytest.raises(common._NeedsDill):
        dumps(Local())

    def inner() -> None:
        pass

    with pytest.raises(common._NeedsDill):
        dumps(inner)
    # An importable function goes by reference.
    assert roundtrip(os.path.join) is os.path.join


def test_a_big_string_object_array_travels_as_one_blob_with_missing_values_apart() -> None:
    items: list[Any] = [f"s{i}\x00" if i % 7 == 0 else f"s{i}" for i in range(3000)]
    items[5] = None
    items[9] = 1.5
    array = np.array(items, dtype=object).reshape(1000, 3)
    data, buffers = dumps(array)
    assert len(buffers) == 1  # the blob, out of band
    back = pickle.loads(data, buffers=buffers)
    assert back.shape == (1000, 3) and back.dtype == object
    assert back.tolist() == array.tolist()
    # Small arrays and shared strings take pickle's own path.
    small = np.array(["a", "b"], dtype=object)
    assert roundtrip(small).tolist() == ["a", "b"]
    shared = np.array(["same"] * 2000, dtype=object)
    assert dumps(shared)[1] == []


def test_numeric_arrays_keep_their_buffers_out_of_band() -> None:
    array = np.arange(10_000, dtype=np.float64)
    data, buffers = dumps(array)
    assert len(buffers) == 1 and len(data) < 1000
    assert (pickle.loads(data, buffers=buffers) == array).all()


def test_dill_mode_pickles_big_atomic_containers_in_c_and_cell_functions_by_value() -> None:
    big = list(range(5000))
    data, _ = dumps(big, dill_mode=True)
    assert pickle.loads(data) == big
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec("def twice(x):\n  return 2 * x", ns)
    data, _ = dumps(ns["twice"], dill_mode=True)
    import dill

    assert dill.loads(data)(21) == 42


def test_an_lru_cache_of_an_importable_function_goes_by_reference() -> None:
    wrapped = functools.lru_cache(maxsize=8)(os.path.basename)
    back = roundtrip(wrapped)
    assert back("/a/b") == "b"
    assert back.cache_parameters() == {"maxsize": 8, "typed": False}


def test_a_cell_enum_is_rebuilt_with_members_methods_and_extras() -> None:
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec(
        "import enum\n"
        "class Color(enum.Enum):\n"
        "  RED = 1\n  GREEN = 2\n"
        "  def shout(self):\n    return self.name.upper() + '!'\n",
        ns,
    )
    color = ns["Color"]
    color.RED.note = "warm"
    rebuilt = reducers._reduce_enum(color)
    cls = rebuilt[0](*rebuilt[1])
    assert [m.name for m in cls] == ["RED", "GREEN"]
    assert cls(2).shout() == "GREEN!"
    assert cls.RED.note == "warm"
    assert issubclass(cls, enum.Enum)


def test_an_enum_with_a_custom_new_is_refused() -> None:
    class Coded(enum.Enum):
        def __new__(cls, value: int) -> Coded:
            obj = object.__new__(cls)
            obj._value_ = value
            return obj

        A = 1

    with pytest.raises(common._Refused, match="custom __new__"):
        reducers._reduce_enum(Coded)


def test_global_refs_names_every_global_a_stream_loads() -> None:
    data = pickle.dumps([os.path.join, collections_ordered()], protocol=5)
    data += pickle.dumps(logging.Logger, protocol=2)
    refs = set(picklers._global_refs(data))
    assert ("posixpath", "join") in refs
    assert ("collections", "OrderedDict") in refs
    assert ("logging", "Logger") in refs
    assert set(picklers._global_refs(pickle.dumps([1, "a"]))) == set()


def collections_ordered() -> Any:
    import collections

    return collections.OrderedDict(a=1)


def test_a_pickled_group_digests_its_pickle_and_buffers() -> None:
    import hashlib

    a = picklers._Pickled(b"abc", [memoryview(b"def")], "pickle")
    assert a.size == 6
    assert a.digest() == hashlib.sha256(b"abcdef").hexdigest()
    b = picklers._Pickled(b"abcd", [memoryview(b"ef")], "pickle")
    assert b.digest() == a.digest()  # the file's bytes are what is hashed


def test_a_cell_class_is_unpickled_without_rerunning_its_bases_init_subclass() -> None:
    import dill

    main = types.ModuleType("__main__")
    exec(
        "class Base:\n"
        "  calls = []\n"
        "  def __init_subclass__(cls, **kw):\n"
        "    super().__init_subclass__(**kw)\n"
        "    for k in cls.__mro__:\n"
        "      if 'calls' in vars(k):\n"
        "        k.calls.append(cls.__name__)\n"
        "class Child(Base):\n"
        "  x = 1\n",
        main.__dict__,
    )
    assert main.Base.calls == ["Child"]
    reducer = reducers._Reducer(None, grouping._Refs(), True)
    out, buffers = io.BytesIO(), list[pickle.PickleBuffer]()
    picklers._dill_pickler(out, buffers, reducer, main).dump(main.Child)

    def load(unpickler: Any) -> Any:
        saved = sys.modules["__main__"]
        sys.modules["__main__"] = main
        try:
            return unpickler(io.BytesIO(out.getvalue()), buffers=buffers).load()
        finally:
            sys.modules["__main__"] = saved

    child = load(picklers._dill_unpickler_class())
    base = child.__mro__[1]
    assert child.x == 1 and base is not main.Base
    assert base.calls == ["Child"]  # what the hook did is in the snapshot: not done twice
    assert load(dill.Unpickler).__mro__[1].calls == ["Child", "Child"]  # plain dill re-runs it
    type("Later", (base,), {})
    assert base.calls == ["Child", "Later"]  # the hook is back for classes made after
