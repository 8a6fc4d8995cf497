"""Cell analysis (pure: source in, names out): which names a cell may have bound or
mutated, decided from its AST."""

from __future__ import annotations

import ast
import builtins
import functools
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .common import _MISSING


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
