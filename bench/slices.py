"""The longest step of each sliced path for the largest messages the gateway takes, in CPU
time (``time.thread_time()``: what a step costs the loop, whatever the machine's load).

Run alone, a few seconds, no Docker::

    python bench/slices.py

For each document (~8 MiB, the iopub cap): ``json.loads`` and pydantic's
``model_dump_json`` in one call (what held the loop before), and the longest step and the
total of ``jsonslices.loads``, ``jsonslices.dumps`` of ``fanout.plain(event)``, and the
WebSocket frame built whole (a concatenation and an encode) or in pieces. Medians of 3.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from kernelhub import jsonslices
from kernelhub.gateway.stream import _event_frame, event_frame_parts
from kernelhub.models import DisplayEvent
from kernelhub.session.fanout import plain

MiB = 1 << 20
REPEATS = 3
DOCUMENTS: dict[str, Callable[[], Any]] = {
    "8 MiB string": lambda: {"text/plain": "x" * (8 * MiB)},
    "8 MiB non-ASCII string": lambda: {"text/plain": "é" * (4 * MiB)},
    "1M ints": lambda: {"application/json": list(range(1_000_000))},
    "450k floats": lambda: {"application/json": [i / 7 for i in range(450_000)]},
    "200k records": lambda: {
        "application/json": [{"a": i, "b": "xxxxx", "c": [1, 2]} for i in range(200_000)]
    },
    "450k-key dict": lambda: {"application/json": {f"k{i}": i for i in range(450_000)}},
}


def steps(gen: jsonslices.Sliced[Any]) -> tuple[Any, float, float]:
    """Run a sliced computation: (its value, the longest step, the total), CPU seconds."""
    worst = total = 0.0
    while True:
        t0 = time.thread_time()
        try:
            next(gen)
        except StopIteration as done:
            dt = time.thread_time() - t0
            return done.value, max(worst, dt), total + dt
        dt = time.thread_time() - t0
        worst, total = max(worst, dt), total + dt


def cpu(fn: Callable[[], object]) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def _frame_whole(body: str) -> bytes:
    return _event_frame(body).encode()


def measure(data: Any) -> dict[str, float]:
    event = DisplayEvent(execution_id="e", seq=1, data=data)
    raw = json.dumps({"data": data}, ensure_ascii=False).encode()
    got: dict[str, list[float]] = {}
    for _ in range(REPEATS):
        one = {"loads_whole": cpu(lambda: json.loads(raw))}
        _, one["loads_step"], one["loads_total"] = steps(jsonslices.loads(raw))
        one["dumps_whole"] = cpu(event.model_dump_json)
        body, one["dumps_step"], one["dumps_total"] = steps(
            jsonslices.dumps(plain(event), event.model_dump_json)
        )
        one["frame_whole"] = cpu(partial(_frame_whole, body))
        one["frame_pieces"] = cpu(partial(event_frame_parts, body))
        for key, value in one.items():
            got.setdefault(key, []).append(value)
    return {key: statistics.median(v) for key, v in got.items()} | {"bytes": len(raw)}


def main() -> None:
    print(
        "| document | size | json.loads, one call | sliced loads: longest step / total "
        "| model_dump_json, one call | sliced dumps: longest step / total "
        "| frame: concatenated + encoded | frame in pieces |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, make in DOCUMENTS.items():
        m = measure(make())
        print(
            f"| {name} | {m['bytes'] / MiB:.1f} MiB | {m['loads_whole'] * 1e3:.0f} ms "
            f"| {m['loads_step'] * 1e3:.1f} / {m['loads_total'] * 1e3:.0f} ms "
            f"| {m['dumps_whole'] * 1e3:.0f} ms "
            f"| {m['dumps_step'] * 1e3:.1f} / {m['dumps_total'] * 1e3:.0f} ms "
            f"| {m['frame_whole'] * 1e3:.1f} ms | {m['frame_pieces'] * 1e3:.1f} ms |",
            flush=True,
        )


if __name__ == "__main__":
    main()
