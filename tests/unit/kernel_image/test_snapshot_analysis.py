"""Cell analysis (``kernelhub_kernel/snapshot/analysis.py``), with data: a cell's source
(and the namespace it ran in) in, the names it may have changed out."""

from __future__ import annotations

import functools
import types
from typing import Any

import pytest

from tests.unit.snapshot import kernel_side

snapshot = kernel_side.load()
analysis = snapshot.analysis
analyze_cell = analysis.analyze_cell


class _Cell:
    """Stands for a class defined in a cell."""

    def __call__(self) -> None:
        pass


_Cell.__module__ = "__main__"


# (source, ns, mutated must include, mutated must exclude, unknown)
CASES: list[tuple[str, dict[str, Any], set[str], set[str], bool]] = [
    ("x = 1", {}, {"x"}, set(), False),
    ("a, (b, *c) = 1, (2, 3)", {}, {"a", "b", "c"}, set(), False),
    ("del y", {}, {"y"}, set(), False),
    ("n += 1", {}, {"n"}, set(), False),
    ("d['k'] = 1", {}, {"d"}, set(), False),
    ("obj.attr = 1", {}, {"obj"}, set(), False),
    ("lst.append(1)", {"lst": []}, {"lst"}, set(), False),
    ("print(len(lst))", {"lst": []}, set(), {"lst", "print", "len"}, False),
    ("df.head()", {}, set(), {"df"}, False),
    ("df.drop('a', inplace=True)", {}, {"df"}, set(), False),
    ("df.drop('a', inplace=False)", {}, set(), {"df"}, False),
    ("arr.cumsum(out=arr)", {}, {"arr"}, set(), False),
    ("np.random.shuffle(a)", {"np": types}, {"a"}, {"np"}, False),
    ("math.sqrt(v)", {"math": __import__("math")}, set(), {"v", "math"}, False),
    ("random.shuffle(v)", {"random": __import__("random")}, {"v"}, set(), False),
    ("f(v)", {}, {"v"}, set(), False),
    ("def g(): pass\nclass K: pass", {}, {"g", "K"}, set(), False),
    ("import os.path as p, json", {}, {"p", "json"}, {"os"}, False),
    ("import os.path", {}, {"os"}, set(), False),
    ("for i in it: pass", {"it": iter([])}, {"i", "it"}, set(), False),
    ("for i in seq: pass", {"seq": [1]}, {"i"}, {"seq"}, False),
    ("with cm as h: pass", {}, {"cm", "h"}, set(), False),
    ("try:\n  pass\nexcept E as err:\n  pass", {}, {"err"}, {"E"}, False),
    (
        "match v:\n case [a, *rest]: pass\n case {'k': b, **others}: pass",
        {},
        {"a", "rest", "b", "others"},
        {"v"},
        False,
    ),
    ("def f():\n  global G\n  G = 1", {}, {"G", "f"}, set(), False),
    ("exec('z = 1')", {}, set(), set(), True),
    ("globals()['q'] = 1", {}, set(), set(), True),
    ("vars()", {}, set(), set(), True),
    ("vars(o)", {}, {"o"}, set(), False),
    ("import __main__\n__main__.x = 1", {}, set(), set(), True),
    ("get_ipython().user_ns['w'] = 1", {}, set(), set(), True),
    ("this is not python (", {}, set(), {"this"}, False),
    ("inst()", {"inst": _Cell()}, {"inst"}, set(), False),
    ("len = 3", {}, {"len"}, set(), False),
    ("print(v)", {"print": lambda *a: None}, {"v"}, set(), False),
]


@pytest.mark.parametrize(("source", "ns", "must", "must_not", "unknown"), CASES)
def test_what_a_cell_may_change(
    source: str, ns: dict[str, Any], must: set[str], must_not: set[str], unknown: bool
) -> None:
    usage = analyze_cell(source, ns)
    assert must <= usage.mutated, usage
    assert not (must_not & usage.mutated), usage
    assert usage.unknown is unknown


def test_a_function_of_the_namespace_is_changed_by_calling_it() -> None:
    ns: dict[str, Any] = {}
    exec("def counter():\n  counter.n = getattr(counter, 'n', 0) + 1", ns)
    usage = analyze_cell("counter()", ns)
    assert "counter" in usage.mutated and "counter" in usage.called
    # A library function is only called.
    usage = analyze_cell("sorted([])", ns)
    assert usage.mutated == set()


def test_from_imports_are_recorded_with_their_module() -> None:
    usage = analyze_cell("from os.path import join as j, sep\nfrom . import rel\nfrom m import *")
    assert usage.from_imports == {"j": ("os.path", "join"), "sep": ("os.path", "sep")}
    assert {"j", "sep", "rel"} <= usage.mutated


IPY = "get_ipython()"


@pytest.mark.parametrize(
    ("source", "must", "unknown"),
    [
        (f"{IPY}.run_line_magic('time', 'x = f()')", {"x"}, False),
        (f"{IPY}.run_line_magic('timeit', '-n 10 -r 3 y = g()')", {"y"}, False),
        (f"{IPY}.run_line_magic('matplotlib', 'inline')", set(), False),
        (f"{IPY}.run_line_magic('load', 'file.py')", set(), True),
        (f"{IPY}.run_cell_magic('capture', 'out', 'z = 1')", {"out", "z"}, False),
        (f"{IPY}.run_cell_magic('writefile', 'a.txt', 'x = 1')", set(), False),
        (f"{IPY}.run_cell_magic('mystery', '', '')", set(), True),
        (f"{IPY}.system('ls')", set(), False),
        (f"files = {IPY}.getoutput('ls')", {"files"}, False),
    ],
)
def test_magics_are_followed_into_their_code_or_flagged(
    source: str, must: set[str], unknown: bool
) -> None:
    usage = analyze_cell(source)
    assert must <= usage.mutated
    assert usage.unknown is unknown


def test_the_transform_is_applied_and_nesting_is_bounded() -> None:
    def transform(cell: str) -> str:
        return f"{IPY}.run_line_magic('time', {cell[6:]!r})" if cell.startswith("%time ") else cell

    usage = analyze_cell("%time a = 1", transform=transform)
    assert usage.mutated == {"a"} and not usage.unknown
    deep = "b = 1"
    for _ in range(5):
        deep = f"{IPY}.run_line_magic('time', {deep!r})"
    assert analyze_cell(deep).unknown


@pytest.mark.parametrize(
    ("line", "code"),
    [("-n 10 -r 3 f(x)", "f(x)"), ("-q f(x)", "f(x)"), ("f(x)", "f(x)"), ("-n", "")],
)
def test_magic_options_are_stripped(line: str, code: str) -> None:
    assert analysis._strip_magic_options(line) == code


def test_globals_used_by_follows_cell_code_transitively() -> None:
    ns: dict[str, Any] = {}
    exec(
        "def leaf():\n  return CONST\n"
        "def mid():\n  return leaf() + OTHER\n"
        "def unrelated():\n  return NEVER\n"
        "class Klass:\n  def method(self):\n    return HELPER\n"
        "  @property\n  def prop(self):\n    return PROP\n",
        ns,
    )
    ns["part"] = functools.partial(ns["mid"])
    ns["cached"] = functools.lru_cache(ns["leaf"])
    ns["table"] = {"f": ns["mid"]}
    ns["Klass"].__module__ = "__main__"
    ns["inst"] = ns["Klass"]()
    assert analysis._globals_used_by(["mid"], ns) >= {"leaf", "CONST", "OTHER"}
    assert "NEVER" not in analysis._globals_used_by(["mid"], ns)
    for name in ("part", "table"):
        assert {"leaf", "CONST", "OTHER"} <= analysis._globals_used_by([name], ns)
    assert "CONST" in analysis._globals_used_by(["cached"], ns)
    assert {"HELPER", "PROP"} <= analysis._globals_used_by(["Klass"], ns)
    assert {"HELPER", "PROP"} <= analysis._globals_used_by(["inst"], ns)
    # A library function's globals are not ours to follow.
    assert analysis._globals_used_by(["sorted"], {"sorted": sorted}) == set()
