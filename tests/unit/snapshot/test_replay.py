"""The replay planner (``kernelhub_kernel/snapshot/replay.py``), with data: which skipped
objects a restore may rebuild by re-running the cell that made them, and why not."""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.unit.snapshot.kernel_side import load

replay = load().replay


@dataclass
class Cell:
    index: int
    source: str
    success: bool = True
    duration: float = 0.01
    effects: list[str] = field(default_factory=list)


@pytest.mark.parametrize(
    ("code", "bound", "reads"),
    [
        ("x = 1", {"x"}, set()),
        ("y = f(x)", {"y"}, {"f", "x"}),
        ("x = 1\ny = x + z", {"x", "y"}, {"z"}),
        ("x = x + 1", {"x"}, {"x"}),
        ("a, (b, *c) = t", {"a", "b", "c"}, {"t"}),
        ("import os.path as p, re\nfrom json import loads", {"p", "re", "loads"}, set()),
        ("g = (i * k for i in r)", {"g"}, {"k", "r"}),
        ("f = lambda v: v + w", {"f"}, {"w"}),
        ("def h(a):\n    b = a + c\n    return b", {"h"}, {"c"}),
        ("for i in items:\n    total = i", {"i", "total"}, {"items"}),
        ("for i in items:\n    last = i\nprint(last)", {"i", "last"}, {"items", "print", "last"}),
        ("try:\n    v = f()\nexcept E as e:\n    v = e", {"v", "e"}, {"f", "E"}),
        ("with open(p) as fh:\n    data = fh.read()", {"fh", "data"}, {"open", "p"}),
        ("if (n := len(s)) > 2:\n    big = n", {"n", "big"}, {"len", "s"}),
    ],
)
def test_cell_names(code: str, bound: set[str], reads: set[str]) -> None:
    assert replay.cell_names(code) == (bound, reads)


def plan(
    cells: list[Cell], skipped: dict[str, str], available: set[str], ns: dict[str, Any]
) -> Any:
    from IPython.core.inputtransformer2 import TransformerManager

    transform = TransformerManager().transform_cell
    return replay.Planner().plan(cells, skipped, available, ns, transform)


def test_a_pure_defining_cell_is_planned_and_the_reason_says_so() -> None:
    cells = [Cell(0, "import re"), Cell(1, "m = re.match('(a)', s)")]
    rebuild, reasons = plan(cells, {"m": "match object"}, {"re", "s"}, {})
    assert rebuild == {
        "1": {"code": "m = re.match('(a)', s)\n", "reads": ["re", "s"], "names": ["m"]}
    }
    assert reasons["m"].startswith("match object; rebuilt at restore by re-running cell [2]")


def always_lost(cells: list[Cell], ns: dict[str, Any], available: set[str] | None = None) -> str:
    rebuild, reasons = plan(cells, {"x": "cannot be pickled"}, available or {"s", "g"}, ns)
    assert rebuild == {}
    assert reasons["x"].startswith("cannot be pickled; not rebuilt: ")
    assert reasons["x"].endswith("; re-run the code that made it")
    return reasons["x"]


@pytest.mark.parametrize(
    ("cells", "why"),
    [
        ([Cell(0, "y = 1")], "no recorded cell made it"),
        ([Cell(0, "x = open(s)", effects=["changed /w/a.db"])], "had effects outside the session"),
        ([Cell(0, "x = g(s)", success=False)], "failed"),
        ([Cell(0, "x = g(s)", duration=60.0)], "ran 60.0 s"),
        ([Cell(0, "x = g(s)\n%matplotlib inline")], "magics"),
        ([Cell(0, "x = g(s)"), Cell(1, "s = 2")], "cell [2] changed s, which it was made from"),
        ([Cell(0, "x = g(s)"), Cell(1, "exec('s = 3')")], "cannot be followed"),
        ([Cell(0, "x = g(s)"), Cell(1, "x.send(1)")], "cell [2] changed it after it was made"),
        ([Cell(0, "x = g(q)")], "made from q, which cannot be restored"),
    ],
)
def test_what_is_not_rebuilt_is_named_with_why(cells: list[Cell], why: str) -> None:
    assert why in always_lost(cells, {"g": len})


def test_later_use_is_fine_when_the_object_is_still_as_made() -> None:
    conn = sqlite3.connect(":memory:")
    fresh = (i for i in range(3))
    cells = [
        Cell(0, "x = make(s)"),
        Cell(1, "rows = x.execute('select 1').fetchall()"),
    ]
    for value, ok in [(conn, True), (fresh, True), (re.match("a", "a"), True), (object(), False)]:
        rebuild, _ = plan(cells, {"x": "no"}, {"make", "s"}, {"x": value})
        assert bool(rebuild) is ok, value
    conn.execute("create table t(a)")
    conn.execute("insert into t values (1)")  # a transaction is open now
    assert plan(cells, {"x": "no"}, {"make", "s"}, {"x": conn})[0] == {}
    next(fresh)
    assert plan(cells, {"x": "no"}, {"make", "s"}, {"x": fresh})[0] == {}


def test_an_object_made_from_another_rebuilt_one_waits_for_it() -> None:
    cells = [Cell(0, "a = make(s)"), Cell(1, "b = a.child()")]
    rebuild, _ = plan(cells, {"b": "no", "a": "no"}, {"make", "s"}, {"a": object()})
    # Cell 1 called a method of a, a plain object that may have changed since: a is not
    # rebuilt, so b, made from it, cannot be either.
    assert rebuild == {}
    cells = [Cell(0, "a = make(s)"), Cell(1, "b = [a]")]
    rebuild, _ = plan(cells, {"b": "no", "a": "no"}, {"make", "s"}, {})
    assert [e["names"] for _, e in sorted(rebuild.items())] == [["a"], ["b"]]


def test_rebuild_re_runs_in_a_copy_and_takes_only_its_names() -> None:
    ns: dict[str, Any] = {"s": "ab", "keep": 1}
    rebuilt, failed = replay.rebuild(
        {
            "3": {
                "code": "keep = 99\nprint('hidden')\nm = s.upper()",
                "reads": ["s"],
                "names": ["m"],
            },
            "5": {"code": "raise ValueError('boom')", "reads": [], "names": ["bad"]},
            "7": {"code": "z = 1", "reads": ["missing"], "names": ["z"]},
        },
        ns,
    )
    assert ns["m"] == "AB" and ns["keep"] == 1
    assert rebuilt == {"m": "rebuilt by re-running cell [4]"}
    assert "ValueError: boom" in failed["bad"] and "missing" in failed["z"]
