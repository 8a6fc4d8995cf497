"""Sliced JSON against json itself: the same values, whatever the cuts fall on."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest

from kernelhub import jsonslices as js

N = 64  # slice size in the tests: many cuts in small documents

# What a cut may fall on or next to: escapes of every length, surrogate pairs and lone
# halves, backslash runs, quotes, non-ASCII of every UTF-8 width, control characters.
ATOMS = [
    "a", "z", " ", '"', "\\", "\\\\", "\n", "\t", "\x00", "\x1f", "é", "€", "\U0001f600",
    "\ud83d", "\ude00", "/", "u", "d83d", "\\u", "0",
]  # fmt: skip


def _text(rng: random.Random, size: int) -> str:
    return "".join(rng.choice(ATOMS) for _ in range(size))


def _loads(raw: bytes, n: int = N) -> Any:
    gen = js.loads(raw, slice_bytes=n)
    steps = 0
    while True:
        try:
            next(gen)
            steps += 1
        except StopIteration as done:
            return done.value, steps


@pytest.mark.parametrize("seed", range(40))
def test_loads_equals_json_loads_wherever_the_cuts_fall(seed: int) -> None:
    rng = random.Random(seed)
    doc = {
        "data": {"text/plain": _text(rng, rng.randint(200, 3000)), "image/png": "QUJD" * 100},
        "metadata": {_text(rng, 300): [1, 2.5, None, True, False, {"k": _text(rng, 500)}]},
        "n": -12.5e3,
    }
    for ensure_ascii in (True, False):
        raw = json.dumps(doc, ensure_ascii=ensure_ascii, indent=rng.choice([None, 1])).encode(
            "utf-8", "surrogatepass" if not ensure_ascii else "strict"
        )
        try:
            expected = json.loads(raw)
        except ValueError:
            with pytest.raises(ValueError):
                _loads(raw)
            continue
        value, steps = _loads(raw)
        assert value == expected
        assert steps > 2  # it really went a slice at a time


def test_safe_cut_never_parts_an_escape_or_a_surrogate_pair() -> None:
    rng = random.Random(7)
    for _ in range(300):
        literal = json.dumps(_text(rng, 80))[1:-1].encode()
        whole = json.loads(b'"' + literal + b'"')
        for b in range(40, len(literal)):
            c = js.safe_cut(literal, 0, b)
            assert 0 < c <= b
            head, tail = (json.loads(b'"' + part + b'"') for part in (literal[:c], literal[c:]))
            assert head + tail == whole, (literal, c)


@pytest.mark.parametrize("seed", range(20))
def test_dumps_round_trips_like_json_and_writes_utf8(seed: int) -> None:
    rng = random.Random(seed)
    big = _text(rng, 2000)
    doc = {"a": big, big[:300]: [big, 1, 2.0, None], "nan": float("nan"), "e": ""}
    text = js.run(js.dumps(doc, slice_chars=N))
    text.encode()  # lone surrogates were escaped, so it is UTF-8
    back = json.loads(text)
    # What json itself reads back (two lone surrogate halves, escaped, read as one pair).
    like_json = json.loads(json.dumps({**doc, "nan": None}))
    assert back == like_json and back["nan"] is None and back["e"] == ""


def _dumps(obj: Any, n: int = N, whole: Any = None) -> tuple[str, int]:
    gen = js.dumps(obj, whole, slice_chars=n)
    steps = 0
    while True:
        try:
            next(gen)
            steps += 1
        except StopIteration as done:
            return done.value, steps


def test_small_documents_take_one_call_and_crowds_go_in_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert js.run(js.dumps({"x": "y"})) == '{"x":"y"}'
    crowded = {str(i): i for i in range(js.MAX_TOKENS + 5)}
    text, steps = _dumps(crowded, 1024, whole=lambda: "whole")
    assert text == json.dumps(crowded, separators=(",", ":")) and steps > 10
    raw = json.dumps(crowded).encode()
    assert _loads(raw, 1024)[0] == crowded
    deep = [[[[[i]]]] for i in range(js.MAX_TOKENS)]  # small members: json, in groups
    assert _dumps([deep], 1024)[0] == json.dumps([deep], separators=(",", ":"))
    # Python would walk too many members one by one (each too big for a group): one call.
    monkeypatch.setattr(js, "MAX_TOKENS", 50)
    assert _dumps([[0] * 1001] * 60, 1024, whole=lambda: "whole")[0] == "whole"


@pytest.mark.parametrize("seed", range(8))
def test_many_values_are_dumped_in_groups_equal_to_json(seed: int) -> None:
    rng = random.Random(seed)
    big = _text(rng, 700)
    doc = {
        "figure": [_many(rng, rng.randint(0, 4)) for _ in range(400)],
        "x": [rng.random() for _ in range(3000)] + [float("inf"), float("nan")],
        big: {big: [big, {"k": big}], 7: 1, None: 2, 1.5: 3, True: 4},  # keys json converts
        "tuple": tuple(range(50)),
    }
    expected = json.dumps(_finite(doc), ensure_ascii=False, separators=(",", ":"))
    for n in (64, 256, 4096):
        text, steps = _dumps(doc, n)
        text.encode()  # lone surrogates escaped
        # What json reads back of its own escaped form (adjacent lone halves: one pair).
        assert json.loads(text) == json.loads(json.dumps(_finite(doc)))
        if all(ord(c) < 0xD800 or ord(c) > 0xDFFF for c in expected):
            assert text == expected  # byte for byte where json's own is UTF-8
        assert steps > len(expected) // (4 * n)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def test_bad_json_is_a_value_error() -> None:
    for raw in (b'{"a": "' + b"x" * 500, b'{"a": 1,}' + b" " * 500, b"[1 2]" + b" " * 500,
                b'"\\q' + b"x" * 500 + b'"', b'{"a": "b"} extra' + b" " * 500):  # fmt: skip
        with pytest.raises(ValueError):
            _loads(raw)
        with pytest.raises(ValueError):
            json.loads(raw)


def _many(rng: random.Random, depth: int) -> Any:
    """Many small values, nested up to ``depth``: numbers, strings with escapes, records."""
    pick = rng.random()
    if depth == 0 or pick < 0.4:
        return rng.choice(
            [rng.randint(-10**6, 10**6), rng.random() * 1e3, None, True, False, -0.0, 1e300,
             _text(rng, rng.randint(0, 12)), ""]
        )  # fmt: skip
    size = rng.randint(0, 6)
    if pick < 0.7:
        return [_many(rng, depth - 1) for _ in range(size)]
    return {_text(rng, rng.randint(0, 4)): _many(rng, depth - 1) for _ in range(size)}


@pytest.mark.parametrize("seed", range(8))
def test_many_values_are_read_in_runs_equal_to_json(seed: int) -> None:
    rng = random.Random(seed)
    doc = {
        "data": {"application/json": [_many(rng, rng.randint(0, 5)) for _ in range(300)]},
        "x": [rng.random() for _ in range(500)],
        "records": [{"a": i, "b": _text(rng, 3), "c": [i, None]} for i in range(100)],
        # Repeated keys (a member may be in one run, its repeat in another): json keeps the
        # first place and the last value.
    }
    for ensure_ascii, indent in ((True, None), (False, 1), (False, None)):
        text = json.dumps(doc, ensure_ascii=ensure_ascii, indent=indent)
        text = text.replace('"x":', '"records": 7, "x":', 1)
        raw = text.encode("utf-8", "surrogatepass")
        expected = json.loads(raw)
        for n in (64, 256, 4096):
            value, steps = _loads(raw, n)
            assert value == expected and list(value) == list(expected)
            assert json.dumps(value) == json.dumps(expected)  # -0.0, key order
            assert steps > len(raw) // (8 * n)  # a run at a time, not one call


def test_runs_take_no_wrong_cut() -> None:
    # Commas, brackets and quotes inside strings, and escaped quotes before them.
    tricky = ["a,b", "],[", '"}', "\\", '\\",', "{[", ",]", "x\\\\", '\\"]']
    doc = [[t, {t: [t, 1]}, [[t]]] for t in tricky * 40]
    raw = json.dumps(doc).encode()
    for n in (32, 50, 64, 100, 256):
        assert _loads(raw, n)[0] == doc


def test_deep_crowds_go_to_json_in_one_call() -> None:
    deep = [[[[[i]]]] for i in range(js.MAX_TOKENS)]  # deeper than runs reach, many times
    raw = json.dumps(deep).encode()
    assert _loads(raw, 256)[0] == deep


def test_bad_many_value_documents_are_value_errors() -> None:
    body = b",".join(b"%d" % i for i in range(400))
    for raw in (b"[" + body + b",]", b"[" + body + b"}", b'{"a":[' + body + b"]", b"[" + body,
                b"[" + body + b",tru]", b'[' + body + b',"\x01"]', b"[" + body + b"]]"):  # fmt: skip
        with pytest.raises(ValueError):
            json.loads(raw)
        with pytest.raises(ValueError):
            _loads(raw, 64)
