"""Sharing analysis (``snapshot/grouping.py``) and the shared helpers (``common.py``):
which objects a variable reaches, what is importable by reference, what is internal."""

from __future__ import annotations

import collections
import datetime
import functools
import gc
import json
import os
import pickle
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.unit.snapshot import kernel_side

snapshot = kernel_side.load()
common = snapshot.common
grouping = snapshot.grouping


@pytest.fixture
def reacher() -> Any:
    shell = types.SimpleNamespace(user_ns={})
    return grouping._Reacher(shell, grouping._Refs()), shell


def shares(reacher: Any, a: Any, b: Any) -> bool:
    return bool(reacher.reach(a).ids & reacher.reach(b).ids)


def test_variables_that_share_an_object_are_linked(reacher: Any) -> None:
    r, _ = reacher
    common_list = [1, 2]
    a, b, c = {"x": common_list}, [common_list], [[3]]
    assert shares(r, a, b)
    assert not shares(r, a, c)


def test_atoms_values_modules_and_importable_code_link_nothing(reacher: Any) -> None:
    r, _ = reacher
    for shared in ("text", 10**30, datetime.date(2020, 1, 1), os, os.path.join, np.dtype("f8")):
        assert not shares(r, [shared], (shared,)), shared


def test_a_closure_links_what_it_closes_over_not_its_globals(reacher: Any) -> None:
    r, _ = reacher
    box: list[int] = []
    ns: dict[str, Any] = {"box": box}
    exec("def make(b):\n  def f():\n    return b\n  return f\ndef g():\n  return box", ns)
    f, g = ns["make"](box), ns["g"]
    assert shares(r, f, [box])
    assert not shares(r, g, [box])  # g reads box through its globals: not a link


def test_the_user_namespace_is_a_barrier_and_noted(reacher: Any) -> None:
    r, shell = reacher
    reach = r.reach([shell.user_ns])
    assert reach.namespace and not reach.truncated
    assert id(shell.user_ns) not in reach.ids


def test_numpy_views_share_their_base_and_object_arrays_their_items(reacher: Any) -> None:
    r, _ = reacher
    base = np.arange(10)
    assert shares(r, base[2:5], base[5:])
    item = ["shared"]
    objects = np.empty(2, dtype=object)
    objects[0] = item
    assert shares(r, objects, [item])


def test_a_bound_builtin_method_links_its_owner(reacher: Any) -> None:
    r, _ = reacher
    owner: list[int] = []
    assert shares(r, owner.append, [owner])
    assert not shares(r, [len], [len])


def test_reach_gives_up_past_its_budget(monkeypatch: pytest.MonkeyPatch, reacher: Any) -> None:
    r, _ = reacher
    monkeypatch.setattr(grouping, "MAX_REACH_OBJECTS", 50)
    big = [[i] for i in range(200)]
    assert r.reach(big).truncated
    assert not r.reach([[1]]).truncated


@pytest.mark.parametrize(
    ("value", "ref"),
    [
        (os.path.join, ("posixpath", "join")),
        (collections.OrderedDict, ("collections", "OrderedDict")),
        (len, ("builtins", "len")),
        (functools.reduce, ("_functools", "reduce")),
        (lambda: None, None),  # a <lambda> in a local scope
        (42, None),  # not a function or class
    ],
)
def test_import_ref_finds_code_by_module_and_qualname(value: Any, ref: Any) -> None:
    assert grouping._import_ref(value) == ref


def test_import_ref_refuses_main_and_impostors() -> None:
    def f() -> None:
        pass

    f.__module__, f.__qualname__ = "os.path", "join"  # names os.path.join, is not it
    assert grouping._import_ref(f) is None
    f.__module__, f.__qualname__ = "__main__", "f"
    assert grouping._import_ref(f) is None
    f.__module__ = "no.such.module"
    assert grouping._import_ref(f) is None
    refs = grouping._Refs()
    assert refs.importable(os.path.join) and not refs.importable(f)
    refs.clear()
    assert refs.importable(os.path.join)


def test_kernel_internals_are_named_and_user_types_are_not() -> None:
    internal = grouping._InternalTypes()
    fake = type("Session", (), {"__module__": "jupyter_client.session"})
    assert "kernel internals (jupyter_client.session.Session)" in internal.reason(fake)
    ours = type("Thing", (), {"__module__": "kernelhub_kernel.spool"})
    assert internal.reason(ours) is not None
    assert internal.reason(dict) is None
    assert internal.reason(collections.OrderedDict) is None


def test_describe_error_names_the_cause_briefly() -> None:
    assert common._describe_error(common._Refused("nope")) == "nope"
    assert "RecursionError" in common._describe_error(RecursionError("deep"))
    text = common._describe_error(TypeError("cannot pickle 'x'\nmore lines"))
    assert text == "cannot be pickled: TypeError: cannot pickle 'x'"
    assert common._describe_error(ValueError()) == "cannot be pickled: ValueError: "
    assert len(common._describe_error(ValueError("y" * 2000))) == 500


def test_session_key_is_bytes_or_empty() -> None:
    kernel = types.SimpleNamespace(session=types.SimpleNamespace(key=b"secret"))
    assert common._session_key(types.SimpleNamespace(kernel=kernel)) == b"secret"
    kernel.session.key = "not bytes"
    assert common._session_key(types.SimpleNamespace(kernel=kernel)) == b""
    assert common._session_key(object()) == b""


def test_gc_is_paused_inside_and_restored_after() -> None:
    assert gc.isenabled()
    with common._gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with common._gc_paused():
            pass
        assert not gc.isenabled()  # was off: stays off
    finally:
        gc.enable()
    with pytest.raises(KeyError), common._gc_paused():
        raise KeyError
    assert gc.isenabled()


def test_clock_laps_name_each_phase() -> None:
    clock = common._Clock()
    clock.lap("one")
    clock.lap("two")
    assert list(clock.laps) == ["one", "two"] and all(v >= 0 for v in clock.laps.values())


def test_a_snapshot_directory_must_be_new(tmp_path: Path) -> None:
    common._prepare_dir(str(tmp_path / "snap"))
    assert (tmp_path / "snap" / common.GROUPS_DIR).is_dir()
    common._prepare_dir(str(tmp_path / "snap"))  # still empty: fine
    (tmp_path / "snap" / common.GROUPS_DIR / "x.pkl").write_bytes(b"")
    with pytest.raises(FileExistsError, match="1 entries"):
        common._prepare_dir(str(tmp_path / "snap"))


def test_files_are_written_whole(tmp_path: Path) -> None:
    target = tmp_path / common.MANIFEST
    common._write_atomic(str(target), json.dumps({"format": common.FORMAT}).encode())
    assert json.loads(target.read_text()) == {"format": common.FORMAT}
    assert not (tmp_path / f"{common.MANIFEST}.tmp").exists()
    parts = [memoryview(pickle.dumps(1)), memoryview(b"tail")]
    common._write_parts(str(tmp_path / "g.pkl"), parts)
    assert (tmp_path / "g.pkl").read_bytes() == pickle.dumps(1) + b"tail"


def test_a_module_loaded_after_a_capture_is_a_barrier_at_the_next(reacher: Any) -> None:
    # The module namespaces are cached between captures (walking sys.modules was a fixed
    # cost of each checkpoint): a module imported since must still be a barrier.
    import sys

    grouping._Reacher(types.SimpleNamespace(user_ns={}), grouping._Refs())  # fills it
    module = types.ModuleType("kernelhub_test_late_module")
    module.shared = [1, 2]  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        fresh = grouping._Reacher(types.SimpleNamespace(user_ns={}), grouping._Refs())
        found = fresh.reach({"ns": module.__dict__})
        assert found.namespace
        assert id(module.shared) not in found.ids  # type: ignore[attr-defined]
    finally:
        del sys.modules[module.__name__]
    again = grouping._Reacher(types.SimpleNamespace(user_ns={}), grouping._Refs())
    assert not again.reach({"ns": module.__dict__}).namespace  # gone: a plain dict again
