"""Holding CPython's cyclic garbage collector off while the gateway builds and relays one
huge JSON document (a display of 200k records, 1M numbers).

Parsing such a message creates hundreds of thousands of containers at once; past a
quarter of the heap's long-lived objects, CPython runs a *full* collection in whatever
callback allocates next: one 130-170 ms step of the loop (bench/slices.py, 200k records
over a 300k-object heap), while parsing itself is sliced into ~3 ms steps. JSON values
hold no cycles and are freed by reference counting once the event is stored and sent, so
the collector has nothing to find in them: it is held off from the first slice of the
parse until the fan-out has serialized the event (and let it go).

Holds are counted; the collector is on again when the last is released. What it would
have freed meanwhile (other code's cycles) waits at most ``MAX_HOLD_SECONDS``: a hold
taken (or :func:`keep_bounded` called) later than that after the collector went off
collects once first, so a kernel sending huge messages back to back costs one pause per
interval, not unbounded memory. Only code that started with the collector on turns it off
or on again.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Iterator

MAX_HOLD_SECONDS = 2.0

_holds = 0
_since = 0.0  # when we turned the collector off (monotonic), while _holds > 0
_ours = False  # whether we did (gc was on when the first hold came)


def hold() -> None:
    """Keep the collector off until a matching :func:`release`."""
    global _holds, _since, _ours
    if _holds == 0:
        _ours = gc.isenabled()
        if _ours:
            gc.disable()
            _since = time.monotonic()
    else:
        keep_bounded()
    _holds += 1


def keep_bounded() -> None:
    """Collect once if the collector has been held off longer than ``MAX_HOLD_SECONDS``
    (see the module): called on every further hold, and by a holder that keeps its hold
    across many documents (the fan-out, once per event it slices)."""
    global _since
    if _holds and _ours and time.monotonic() - _since > MAX_HOLD_SECONDS:
        gc.collect()
        _since = time.monotonic()


def release() -> None:
    global _holds, _ours
    if _holds <= 0:
        raise RuntimeError("gcpause.release() without a hold")
    _holds -= 1
    if _holds == 0 and _ours:
        _ours = False
        gc.enable()


@contextlib.contextmanager
def held() -> Iterator[None]:
    hold()
    try:
        yield
    finally:
        release()


def hold_this_turn() -> None:
    """A hold released once the current loop callback returns: for a value handed on
    synchronously (the pump gives a parsed message to the fan-out in the same step)."""
    hold()
    asyncio.get_running_loop().call_soon(release)


def holds() -> int:
    """How many holds are taken now (tests)."""
    return _holds
