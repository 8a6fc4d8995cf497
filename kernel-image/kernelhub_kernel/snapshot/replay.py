"""Objects the pickler cannot carry, rebuilt after a restore by re-running the cell that
made them (ElasticNotebook's idea), when that is safe; every other one named, with why.

At capture (``plan``), for each skipped variable X, from the kernel's cell log
(``kernelhub_kernel.cell_log``, recorded as the cells ran):

* the cell D that last bound X (at its top level) must have succeeded, run in at most
  ``MAX_REPLAY_SECONDS``, had no effects outside the session (no file written or
  changed, no process, connection or thread started: the log says), be plain Python
  (no magics), and
* read only state the restore brings back: every name D reads before binding it is a
  saved variable, an import, a builtin, or another object rebuilt before it; and no
  later cell changed any of them (the cell analysis' ``mutated``), nor ran code the
  analysis cannot follow;
* a later cell may have used X only if X is still as D left it, checked on the object:
  a generator not started, a ``re.Match`` (immutable), an SQLite connection with no
  transaction open (its state is the database file, which the workspace brings back).

The plan goes into the manifest (the cells' code, the names each rebuilds). At restore
(``rebuild``), after the groups loaded, each planned cell runs again in a copy of the
namespace (its output discarded); only the names it is to rebuild are taken from it.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import inspect
import io
import re
import sqlite3
from dataclasses import dataclass
from typing import Any

from .analysis import _globals_used_by, analyze_cell

MAX_REPLAY_SECONDS = 5.0
"""A cell that ran longer is not re-run at restore (the user is told to)."""
_WHAT_TO_DO = "re-run the code that made it"


@dataclass
class _Facts:
    code: str | None
    why_not: str | None
    bound: frozenset[str]
    reads: frozenset[str]
    mutated: frozenset[str]
    unknown: bool


def cell_names(code: str) -> tuple[set[str], set[str]]:
    """(names the cell binds at its top level, names it reads before binding them).

    Statements count in order; inside a loop, an ``if`` or a ``try`` a binding may not
    happen, so it does not hide a later read of the name (which then counts as read).
    """
    bound: set[str] = set()
    reads: set[str] = set()
    _block(ast.parse(code).body, set(), bound, reads)
    return bound, reads


def _block(stmts: list[ast.stmt], definite: set[str], bound: set[str], reads: set[str]) -> None:
    """Walk ``stmts`` in order; ``definite`` (updated) holds the names surely bound."""
    for stmt in stmts:
        if isinstance(stmt, (ast.For, ast.AsyncFor)):
            _expr(stmt.iter, definite, bound, reads)
            inner = set(definite)
            _target(stmt.target, inner, bound)
            _block(stmt.body, inner, bound, reads)
            _block(stmt.orelse, set(definite), bound, reads)
        elif isinstance(stmt, (ast.If, ast.While)):
            _expr(stmt.test, definite, bound, reads)
            _block(stmt.body, set(definite), bound, reads)
            _block(stmt.orelse, set(definite), bound, reads)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                _expr(item.context_expr, definite, bound, reads)
                if item.optional_vars is not None:
                    _target(item.optional_vars, definite, bound)
            _block(stmt.body, definite, bound, reads)
        elif isinstance(stmt, ast.Try):
            _block(stmt.body, set(definite), bound, reads)
            for handler in stmt.handlers:
                if handler.type is not None:
                    _expr(handler.type, set(definite), bound, reads)
                inner = set(definite)
                if handler.name:
                    inner.add(handler.name)
                    bound.add(handler.name)
                _block(handler.body, inner, bound, reads)
            _block(stmt.orelse, set(definite), bound, reads)
            _block(stmt.finalbody, set(definite), bound, reads)
        else:
            _expr(stmt, definite, bound, reads)


def _expr(node: ast.AST, definite: set[str], bound: set[str], reads: set[str]) -> None:
    loads: set[str] = set()
    binds: set[str] = set()
    _collect(node, loads, binds)
    reads |= loads - definite
    definite |= binds
    bound |= binds


def _target(node: ast.AST, definite: set[str], bound: set[str]) -> None:
    _expr(node, definite, bound, set())


def _collect(node: ast.AST, loads: set[str], binds: set[str]) -> None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        binds.add(node.name)
        for part in [*node.decorator_list, *getattr(node, "bases", [])]:
            _collect(part, loads, binds)
        # What the body reads is read when it is called: counted as read now.
        loads.update(_free_in(node))
        return
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        for alias in node.names:
            binds.add((alias.asname or alias.name).partition(".")[0])
        return
    if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        loads.update(_free_in(node))
        return
    if isinstance(node, ast.Name):
        (loads if isinstance(node.ctx, ast.Load) else binds).add(node.id)
        return
    for child in ast.iter_child_nodes(node):
        _collect(child, loads, binds)


def _free_in(node: ast.AST) -> set[str]:
    """Names a function, lambda or comprehension reads that it does not bind itself."""
    loads: set[str] = set()
    local: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            (loads if isinstance(n.ctx, ast.Load) else local).add(n.id)
        elif isinstance(n, ast.arg):
            local.add(n.arg)
    return loads - local


def _facts(source: str, ns: dict[str, Any], transform: Any) -> _Facts:
    try:
        code = transform(source) if transform is not None else source
        bound, reads = cell_names(code)
    except Exception:
        return _Facts(None, "its code does not parse", frozenset(), frozenset(), frozenset(), True)
    usage = analyze_cell(source, ns, transform)
    why_not = "it uses IPython magics or shell commands" if "get_ipython()" in code else None
    reads |= _globals_used_by(usage.called, ns)
    return _Facts(
        code, why_not, frozenset(bound), frozenset(reads), frozenset(usage.mutated), usage.unknown
    )


def still_as_made(value: Any) -> bool:
    """Whether a later cell's use cannot have changed what re-running its cell makes."""
    if inspect.isgenerator(value):
        return inspect.getgeneratorstate(value) == inspect.GEN_CREATED
    if isinstance(value, re.Match):
        return True
    if isinstance(value, sqlite3.Connection):
        try:
            return not value.in_transaction
        except sqlite3.ProgrammingError:  # closed
            return False
    return False


class Planner:
    """The capture side; cell facts are cached per cell, across captures."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, str], _Facts] = {}

    def plan(
        self,
        cells: list[Any],
        skipped: dict[str, str],
        available: set[str],
        ns: dict[str, Any],
        transform: Any,
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """(the manifest's ``rebuild`` entry, ``skipped`` with each reason completed)."""
        facts = []
        for cell in cells:
            key = (cell.index, cell.source)
            if key not in self._cache:
                self._cache[key] = _facts(cell.source, ns, transform)
            facts.append(self._cache[key])
        planned: dict[str, int] = {}
        reasons = dict(skipped)
        order = []
        for name in skipped:
            d = next((i for i in range(len(cells) - 1, -1, -1) if name in facts[i].bound), None)
            order.append((d if d is not None else -1, name))
        for d, name in sorted(order):
            why = self._why_not(d, name, cells, facts, available | set(planned), ns)
            if why is None:
                planned[name] = d
                reasons[name] = (
                    f"{skipped[name]}; rebuilt at restore by re-running cell [{cells[d].index + 1}]"
                    " (it reads only restored state and had no effects outside the session)"
                )
            else:
                reasons[name] = f"{skipped[name]}; not rebuilt: {why}; {_WHAT_TO_DO}"
        rebuild: dict[str, Any] = {}
        for name, d in planned.items():
            entry = rebuild.setdefault(
                str(cells[d].index),
                {"code": facts[d].code, "reads": sorted(facts[d].reads), "names": []},
            )
            entry["names"].append(name)
        return rebuild, reasons

    @staticmethod
    def _why_not(
        d: int, name: str, cells: list[Any], facts: list[_Facts], available: set[str], ns: Any
    ) -> str | None:
        if d < 0:
            return "no recorded cell made it"
        cell, fact = cells[d], facts[d]
        label = f"cell [{cell.index + 1}]"
        if fact.why_not or fact.code is None:
            return f"{label}, which made it: {fact.why_not}"
        if not cell.success:
            return f"{label}, which made it, failed"
        if cell.effects:
            return f"{label}, which made it, had effects outside the session ({cell.effects[0]})"
        if cell.duration > MAX_REPLAY_SECONDS:
            return f"{label}, which made it, ran {cell.duration:.1f} s (over {MAX_REPLAY_SECONDS:.0f} s)"
        for later, later_fact in zip(cells[d + 1 :], facts[d + 1 :], strict=True):
            later_label = f"cell [{later.index + 1}]"
            if later_fact.unknown:
                return f"{later_label} ran code whose effects cannot be followed"
            if name in later_fact.mutated and not still_as_made(ns.get(name)):
                return f"{later_label} changed it after it was made"
            changed = sorted(later_fact.mutated & fact.reads)
            if changed:
                return f"{later_label} changed {changed[0]}, which it was made from"
        missing = sorted(r for r in fact.reads if r not in available and not hasattr(builtins, r))
        if missing:
            return f"it was made from {missing[0]}, which cannot be restored"
        return None


def rebuild(plan: dict[str, Any], ns: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """Re-run the planned cells in order; (rebuilt name → how, failed name → why)."""
    rebuilt: dict[str, str] = {}
    failed: dict[str, str] = {}
    for index, entry in sorted(plan.items(), key=lambda item: int(item[0])):
        names = [str(n) for n in entry.get("names", [])]
        label = f"cell [{int(index) + 1}]"
        missing = [r for r in entry.get("reads", []) if r not in ns and not hasattr(builtins, r)]
        if missing:
            for name in names:
                failed[name] = (
                    f"not rebuilt: {missing[0]}, which {label} reads, was not restored; {_WHAT_TO_DO}"
                )
            continue
        scratch = dict(ns)
        try:
            code = compile(str(entry["code"]), f"<rebuild of {label}>", "exec")
            with (
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                exec(code, scratch)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            for name in names:
                failed[name] = (
                    f"not rebuilt: re-running {label} failed ({type(exc).__name__}: {exc}); {_WHAT_TO_DO}"
                )[:500]
            continue
        for name in names:
            if name in scratch:
                ns[name] = scratch[name]
                rebuilt[name] = f"rebuilt by re-running {label}"
            else:
                failed[name] = f"not rebuilt: re-running {label} did not bind it; {_WHAT_TO_DO}"
    return rebuilt, failed
