"""JSON with big strings or many values, decoded and encoded a slice at a time, no I/O.

A large Jupyter message is a few big strings (an image, a long line, a traceback, a
metadata value) in a small structure. ``json.loads`` and ``json.dumps`` handle it in one C
call that holds the GIL throughout: 10-20 ms for 8 MiB on a quiet machine, 30-120 ms at a
load of 8 (measured; a thread does not help, the loop waits for the GIL), and every
other tenant's stream stalls behind it. Here the structure is walked in Python (it is
small) and each big string goes through json's own C code ``SLICE`` characters at a time.

:func:`loads` and :func:`dumps` are generators: they yield ``None`` between slices and
return the value (``StopIteration.value``); :func:`drive` runs one on the event loop,
letting other callbacks run at each yield. Their results equal ``json.loads`` and a
compact ``json.dumps`` (non-finite floats become ``null``, as pydantic writes them).

Many small values (a plotly figure's number arrays, a list of records, a big dict) are
read a run at a time: a regular expression finds, in C, the longest run of whole members
of the container being read within ``RUN_BYTES`` (members nested at most two deep), and
json parses that run, wrapped in the container's brackets, in one C call (~1 ms). A wrong
cut could not parse (it would leave a string or a bracket open), and a run that does not
parse is read member by member instead, so the values are json's own. What is left for
Python to walk value by value is bounded by ``MAX_TOKENS``: past it (structures nested
deeper than runs reach, many times over) the document goes through json in one call, as
every document did before, bounded by the message cap.

Encoding has the same bound: a document of more than ``MAX_TOKENS`` values is dumped in
one call.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import re
from collections.abc import Callable, Generator
from json.decoder import scanstring  # type: ignore[attr-defined]
from typing import Any, TypeVar

T = TypeVar("T")
Sliced = Generator[None, None, T]

SLICE = 128 * 1024  # characters (or bytes) per step: ~0.3 ms of json's C code, quiet
# Documents (and strings) under two slices go through json in one call.
MAX_TOKENS = 10_000
# Small members are parsed half a slice of bytes per step (RUN_BYTES for SLICE): ~1 ms of
# regex and json for numbers or records (measured: 9 MiB of ints, 7 MiB of records, 8 MiB
# of a dict in 64 KiB runs took 170-330 ms in all, 1.2-2.6 ms a run, at load 3; json.loads
# took 86-509 ms of them in one call).
RUN_BYTES = SLICE // 2

_WS = re.compile(rb"[ \t\n\r]*")
_TOKEN = re.compile(rb"[^,:\]}\[{\" \t\n\r]*")
_HIGH = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}")
_LOW = re.compile(rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_DECODER = json.JSONDecoder()
_scan_once = _DECODER.scan_once  # type: ignore[attr-defined]


def _runs() -> tuple[re.Pattern[bytes], re.Pattern[bytes]]:
    """Patterns matching a run of whole members of an array, and of an object, each
    followed by a comma or (not consumed) the container's end; members may nest two deep.
    Possessive and atomic (Python 3.11): no backtracking into a member."""
    ws = rb"[ \t\n\r]*+"
    string = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
    atom = rb'[^,:\[\]{}" \t\n\r]++'

    def container(v: bytes) -> bytes:
        items = rb"(?:" + v + ws + rb"(?:," + ws + v + ws + rb")*+)?"
        pair = string + ws + b":" + ws + v + ws
        pairs = rb"(?:" + pair + rb"(?:," + ws + pair + rb")*+)?"
        return rb"(?>\[" + ws + items + rb"\]|\{" + ws + pairs + rb"\})"

    v0 = rb"(?:" + string + b"|" + atom + b")"
    v1 = rb"(?:" + v0 + b"|" + container(v0) + b")"
    v2 = rb"(?:" + v1 + b"|" + container(v1) + b")"
    end = rb"(?:,|(?=" + ws + rb"[\]}]))"
    array = re.compile(rb"(?:" + ws + v2 + ws + end + rb")*+")
    obj = re.compile(rb"(?:" + ws + string + ws + b":" + ws + v2 + ws + end + rb")*+")
    return array, obj


_ARRAY_RUN, _OBJECT_RUN = _runs()


# Raised (this one instance, never another) when Python would walk too many values one
# by one: json then takes the whole document. A signal inside this module, not an error.
_CROWDED = OverflowError("more values than jsonslices walks one by one")


def _crowded() -> OverflowError:
    return _CROWDED.with_traceback(None)


async def drive(gen: Sliced[T]) -> T:
    """Run a sliced computation, one loop turn per slice."""
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        await asyncio.sleep(0)


def run(gen: Sliced[T]) -> T:
    """Run a sliced computation at once (tests, and callers off the loop)."""
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


# -- in ------------------------------------------------------------------------------


def loads(data: bytes | memoryview, slice_bytes: int | None = None) -> Sliced[Any]:
    """``json.loads(data)`` of UTF-8 JSON, sliced. Raises ``ValueError`` where
    ``json.loads`` does (with another message). The text is never decoded as a whole:
    the structure is read from the bytes, and each string from its own bytes."""
    n = slice_bytes or SLICE
    if len(data) < 2 * n or bytes(data[:3]) == b"\xef\xbb\xbf":
        return json.loads(bytes(data))
    raw = bytes(data)
    if json.detect_encoding(raw[:4]) != "utf-8":
        return json.loads(raw)
    pos = _WS.match(raw).end()  # type: ignore[union-attr]
    try:
        value, pos = yield from _value(raw, pos, n, [MAX_TOKENS])
    except OverflowError as exc:
        if exc is not _CROWDED:
            raise
        return json.loads(raw)  # see the module
    pos = _WS.match(raw, pos).end()  # type: ignore[union-attr]
    if pos != len(raw):
        raise ValueError(f"extra data after the JSON value at byte {pos}")
    return value


def _value(s: bytes, pos: int, n: int, budget: list[int]) -> Generator[None, None, tuple[Any, int]]:
    """The value at ``pos`` and the index after it. ``budget``: how many more values
    Python may walk one by one (a run counts as one)."""
    budget[0] -= 1
    if budget[0] < 0:
        raise _crowded()
    char = s[pos : pos + 1]
    if char == b'"':
        return (yield from _string(s, pos + 1, n))
    if char == b"{":
        return (yield from _object(s, pos + 1, n, budget))
    if char == b"[":
        return (yield from _array(s, pos + 1, n, budget))
    # A number, true, false, null (or NaN, Infinity: json.loads takes them too).
    token = _TOKEN.match(s, pos).end()  # type: ignore[union-attr]
    text = s[pos:token].decode("utf-8", "surrogatepass")
    try:
        value, end = _scan_once(text, 0)
    except StopIteration:
        raise ValueError(f"expecting a JSON value at byte {pos}") from None
    if end != len(text):
        raise ValueError(f"expecting ',' or the end of a value at byte {pos + end}")
    return value, token


def _run(
    s: bytes, pos: int, n: int, pattern: re.Pattern[bytes], brackets: bytes
) -> tuple[Any, int, bool] | None:
    """The members of a run starting at ``pos`` (a member's start), parsed by json:
    (the list or dict of them, the index after the run, whether a comma ended it), or
    None if no whole member fits in ``n // 2`` bytes or the run does not parse."""
    end = pattern.match(s, pos, pos + n // 2).end()  # type: ignore[union-attr]
    if end == pos:
        return None
    comma = s[end - 1] == 0x2C  # ","
    body = s[pos : end - 1] if comma else s[pos:end]
    try:
        members = json.loads(brackets[:1] + body + brackets[1:])
    except ValueError:
        return None  # read member by member: the error, if any, is found there
    return members, end, comma


def _object(
    s: bytes, pos: int, n: int, budget: list[int]
) -> Generator[None, None, tuple[dict[str, Any], int]]:
    obj: dict[str, Any] = {}
    pos = _WS.match(s, pos).end()  # type: ignore[union-attr]
    if s[pos : pos + 1] == b"}":
        return obj, pos + 1
    while True:
        run = _run(s, pos, n, _OBJECT_RUN, b"{}")
        if run is not None:
            members, pos, comma = run
            obj.update(members)  # as json: a repeated key keeps its place, takes the last value
            yield
            if comma:
                pos = _WS.match(s, pos).end()  # type: ignore[union-attr]
                continue
            done, pos = _next_member(s, pos, b"}")
            if done:
                return obj, pos
            continue
        if s[pos : pos + 1] != b'"':
            raise ValueError(f"expecting a property name in double quotes at byte {pos}")
        key, pos = yield from _string(s, pos + 1, n)
        pos = _WS.match(s, pos).end()  # type: ignore[union-attr]
        if s[pos : pos + 1] != b":":
            raise ValueError(f"expecting ':' at byte {pos}")
        pos = _WS.match(s, pos + 1).end()  # type: ignore[union-attr]
        obj[key], pos = yield from _value(s, pos, n, budget)
        done, pos = _next_member(s, pos, b"}")
        if done:
            return obj, pos


def _array(
    s: bytes, pos: int, n: int, budget: list[int]
) -> Generator[None, None, tuple[list[Any], int]]:
    items: list[Any] = []
    pos = _WS.match(s, pos).end()  # type: ignore[union-attr]
    if s[pos : pos + 1] == b"]":
        return items, pos + 1
    while True:
        run = _run(s, pos, n, _ARRAY_RUN, b"[]")
        if run is not None:
            members, pos, comma = run
            items.extend(members)
            yield
            if comma:
                pos = _WS.match(s, pos).end()  # type: ignore[union-attr]
                continue
            done, pos = _next_member(s, pos, b"]")
            if done:
                return items, pos
            continue
        item, pos = yield from _value(s, pos, n, budget)
        items.append(item)
        done, pos = _next_member(s, pos, b"]")
        if done:
            return items, pos


def _next_member(s: bytes, pos: int, close: bytes) -> tuple[bool, int]:
    """After a member of an object or array: (True, past ``close``) at its end, or
    (False, the next member's start) after a comma."""
    pos = _WS.match(s, pos).end()  # type: ignore[union-attr]
    char = s[pos : pos + 1]
    if char == close:
        return True, pos + 1
    if char != b",":
        raise ValueError(f"expecting ',' at byte {pos}")
    return False, _WS.match(s, pos + 1).end()  # type: ignore[union-attr]


def _string(s: bytes, start: int, n: int) -> Generator[None, None, tuple[str, int]]:
    """The string literal whose opening quote is just before ``start``, and the index
    after its closing quote: its bytes decoded and unescaped (json's scanstring) a safe
    slice at a time."""
    pieces = []
    a = start
    while True:
        short = s.find(b'"', a, a + 4096)
        if short >= 0 and s.rfind(b"\\", a, short) < 0:  # it ends there: no escape before
            pieces.append(scanstring(s[a : short + 1].decode("utf-8", "surrogatepass"), 0)[0])
            return "".join(pieces), short + 1
        last = len(s) - a <= 2 * n
        if last:
            b = len(s)
        else:
            b = safe_cut(s, a, a + n)
            while s[b] & 0xC0 == 0x80:  # not inside a UTF-8 sequence either
                b -= 1
        piece = s[a:b].decode("utf-8", "surrogatepass")
        text, end = scanstring(piece if last else piece + '"', 0, True)
        pieces.append(text)
        if last or end <= len(piece):  # closed by its own quote
            return "".join(pieces), a + len(piece[:end].encode("utf-8", "surrogatepass"))
        a = b
        yield


def safe_cut(s: bytes, a: int, b: int) -> int:
    """A position in ``(a, b]`` where a string literal's bytes may be cut: not inside
    an escape, nor between the two escapes of a surrogate pair. ``a`` is such a position
    (or the literal's start) and ``b - a`` at least 32."""
    k = s.rfind(b"\\", b - 6, b)
    if k < 0:
        return b  # every escape ends within 6 characters of its backslash
    head = s[a : k + 1]
    r = a + len(head.rstrip(b"\\"))  # the start of the backslash run that ends at k
    if r == a:
        # Backslashes since a, which is not inside an escape: they pair up from there.
        return a + (k + 1 - a) // 2 * 2
    # s[r - 1] is not a backslash, so no escape spans r; but it may part a surrogate pair.
    if r - 6 >= a and _HIGH.fullmatch(s, r - 6, r) and _LOW.match(s, r):
        before = s[a : r - 5]
        if (len(before) - len(before.rstrip(b"\\"))) % 2 == 1:  # a real \\u escape
            return r - 6
    return r


# -- out -----------------------------------------------------------------------------


def dumps(
    obj: Any, whole: Callable[[], str] | None = None, slice_chars: int | None = None
) -> Sliced[str]:
    """A compact ``json.dumps(obj, ensure_ascii=False)``, sliced: big strings (values or
    keys) are escaped ``slice_chars`` at a time, and the members of a container are
    written by json in groups of about ``RUN_BYTES`` (the group's size adapts to what the
    last one wrote). Strings that cannot be UTF-8 (lone surrogates) are written with
    ``\\u`` escapes, non-finite floats as ``null``. ``whole``: what to return for a
    document Python would walk value by value past ``MAX_TOKENS`` (small containers
    nested in small containers, many times), made in one call; by default json's."""
    n = slice_chars or SLICE
    out: list[str] = []
    try:
        yield from _dump(obj, out, n, [MAX_TOKENS])
    except OverflowError as exc:
        if exc is not _CROWDED:
            raise
        return whole() if whole is not None else json.dumps(obj, separators=(",", ":"))
    return "".join(out)


_CONTAINER = (dict, list, tuple)
_MANY = 1000  # members: a container with more is written a group at a time, not in one
_GROUP = 16  # members in a container's first group


def _dump(value: Any, out: list[str], n: int, budget: list[int]) -> Sliced[None]:
    budget[0] -= 1
    if budget[0] < 0:
        raise _crowded()
    if isinstance(value, str):
        if len(value) < 2 * n:
            out.append(_compact(value))
            return
        out.append('"')
        for i in range(0, len(value), n):
            out.append(_escaped(value[i : i + n]))
            yield
        out.append('"')
        return
    if isinstance(value, dict | list | tuple):
        yield from _container(value, out, n, budget)
    else:
        out.append(_compact(_finite(value)))


_FLAT = frozenset({int, float, bool, type(None), str})


def _flat(values: Any, n: int) -> bool:
    """Whether these are all numbers, booleans, nulls or strings under two slices: json
    writes a group of them with no member to look at first (checked in C: no Python step
    per member, which cost ~10x json's own time for 1M numbers)."""
    kinds = set(map(type, values))
    if not kinds <= _FLAT:
        return False
    if str in kinds:
        return max(len(v) for v in values if type(v) is str) < 2 * n
    return True


def _container(value: Any, out: list[str], n: int, budget: list[int]) -> Sliced[None]:
    """Flat chunks of members while they last (:func:`_flat`), then member by member."""
    keyed = isinstance(value, dict)
    out.append("{" if keyed else "[")
    items = iter(value.items()) if keyed else iter(value)
    size, first = _GROUP, True
    if len(value) > _MANY:
        while True:
            chunk = list(itertools.islice(items, size))
            flat = (
                _flat([v for _, v in chunk], n) and _flat([k for k, _ in chunk], n)
                if keyed
                else _flat(chunk, n)
            )
            if not flat or not chunk:
                break
            text = _written(dict(chunk) if keyed else chunk)
            out.append(text if first else "," + text)
            first = False
            size = _resized(size, len(text), n)
            yield
        pairs: Any = chunk if keyed else [(None, v) for v in chunk]
        rest: Any = itertools.chain(pairs, items if keyed else ((None, v) for v in items))
    else:
        rest = items if keyed else ((None, v) for v in items)
    yield from _members(rest, keyed, out, n, budget, first)
    out.append("}" if keyed else "]")


def _resized(size: int, written: int, n: int) -> int:
    """The next group's size: about a run's worth (json's own C code for ~1 ms)."""
    if written > n // 2:
        return max(1, size // 2)
    if written < n // 8:
        return min(size * 2, 1 << 16)
    return size


def _members(
    items: Any, keyed: bool, out: list[str], n: int, budget: list[int], first: bool
) -> Sliced[None]:
    """A container's members, ``(key, value)`` pairs (key None in an array), after its
    opening bracket (``first``: none written yet): small ones by json, a group at a time,
    big ones (:func:`_big`) on their own, sliced."""
    group: list[tuple[Any, Any]] = []
    size = _GROUP
    for key, value in items:
        small = not _big(value, n) and not (keyed and isinstance(key, str) and len(key) >= 2 * n)
        if small:
            group.append((key, value))
            if len(group) < size:
                continue
        if group:
            text = _group(group, keyed)
            out.append(text if first else "," + text)
            first = False
            size = _resized(size, len(text), n)
            group = []
            yield
            if small:
                continue  # it was the group's last
        if not first:
            out.append(",")
        first = False
        if keyed:
            if isinstance(key, str):
                yield from _dump(key, out, n, budget)
            else:  # json's own conversion of a key that is not a string
                out.append(_compact({key: None})[1:-6])
            out.append(":")
        yield from _dump(value, out, n, budget)
    if group:
        text = _group(group, keyed)
        out.append(text if first else "," + text)


def _group(group: list[tuple[Any, Any]], keyed: bool) -> str:
    """Members written by json, without the container's brackets."""
    return _written(dict(group) if keyed else [v for _, v in group])


def _written(container: Any) -> str:
    """A container's members written by json, without its brackets."""
    try:
        text = _compact(container)
    except ValueError:  # a NaN or an infinity: null, as pydantic writes them
        text = _compact(_finite(container))
    return text[1:-1]


def _big(value: Any, n: int) -> bool:
    """Whether a member is written on its own, sliced, rather than in a group: a string
    of two slices, a container of many members, or one holding either one level down
    (deeper, json writes it within its group)."""
    if isinstance(value, str):
        return len(value) >= 2 * n
    if not isinstance(value, _CONTAINER):
        return False
    if len(value) > _MANY:
        return True
    for inner in value.items() if isinstance(value, dict) else ((None, v) for v in value):
        for v in inner:
            if isinstance(v, str):
                if len(v) >= 2 * n:
                    return True
            elif isinstance(v, _CONTAINER) and len(v) > _MANY:
                return True
    return False


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _compact(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text if text.isascii() else _escaped_if_needed(text, value)


def _escaped_if_needed(text: str, value: Any) -> str:
    try:
        text.encode()
    except UnicodeEncodeError:  # lone surrogates somewhere: escape every non-ASCII
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    return text


def _escaped(text: str) -> str:
    piece = json.dumps(text, ensure_ascii=False)[1:-1]
    if not piece.isascii():
        try:
            piece.encode()
        except UnicodeEncodeError:  # lone surrogates: escaped, as JSON allows
            piece = json.dumps(text)[1:-1]
    return piece
