"""The longest loop callback, in CPU time, while the gateway's own code takes one huge
display (200k small records, ~7 MiB of JSON) from a kernel socket to the store: receive,
verify, sliced parse, event, sliced serialization, commit. No Docker: the message comes
signed through an inproc ZeroMQ socket.

    python bench/relay_gc.py [--rounds 3]

A heap of ``--heap`` small containers stands for a running gateway's (CPython's full
collection walks all of them). Every callback is timed with ``time.thread_time()`` by
``loop_cpu``; printed: the longest, the full collections seen (``gc.callbacks``) and the
load average. Run it with ``PYTHONPATH`` pointing at each tree to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import loop_cpu
import zmq

from kernelhub.kernel.client import Receiver
from kernelhub.kernel.codec import Codec
from kernelhub.models import DisplayEvent
from kernelhub.session.fanout import SessionFanout
from kernelhub.store.sqlite import SqliteStore

RECORDS = 200_000


async def one(store: SqliteStore, seq: int, logdir: Path) -> tuple[float, list[float]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    url = f"inproc://relay-gc-{seq}"
    pull.bind(url)
    push.connect(url)
    codec = Codec(b"k" * 32, max_message_bytes=64 << 20)
    data = {"application/json": [{"a": i, "b": "xxxxx", "c": [1, 2]} for i in range(RECORDS)]}
    _, frames = codec.encode("display_data", {"data": data, "metadata": {}})
    del data
    gc.collect()
    full: list[float] = []
    t0 = [0.0]

    def watch(phase: str, info: dict[str, int]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                t0[0] = time.thread_time()
            else:
                full.append(time.thread_time() - t0[0])

    gc.callbacks.append(watch)
    await asyncio.sleep(0)  # building the message above is not the gateway's step
    start = time.time()
    try:
        receiver = Receiver(pull, codec, url)
        fanout = SessionFanout("s1", store)
        push.send_multipart(frames)
        msg = await receiver.recv()
        content = msg["content"]
        fanout.publish(DisplayEvent(execution_id="e1", seq=seq, data=content["data"]))
        del msg, content
        await fanout.flush()
        await asyncio.sleep(0.05)
    finally:
        gc.callbacks.remove(watch)
        receiver.close()
        push.close(0)
        pull.close(0)
    await asyncio.sleep(0.05)  # this step's own line is written when it returns
    mine = [c.cpu for c in loop_cpu.read(logdir, os.getpid()) if c.end >= start]
    return max(mine, default=0.0), full


async def main(rounds: int, heap: int) -> None:
    ballast = [{"x": [i]} for i in range(heap)]  # noqa: F841 (kept alive on purpose)
    with tempfile.TemporaryDirectory() as root:
        loop_cpu.install(root)
        store = await SqliteStore.open(Path(root) / "kh.sqlite3")
        worst = []
        try:
            for r in range(rounds):
                w, full = await one(store, r + 1, Path(root))
                worst.append(w)
                print(f"round {r}: longest callback {w * 1e3:.1f} ms CPU; full collections"
                      f" {[round(f * 1e3, 1) for f in full]} ms")  # fmt: skip
        finally:
            await store.close()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"median longest callback {statistics.median(worst) * 1e3:.1f} ms CPU (load {load})")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--heap", type=int, default=300_000)
    a = p.parse_args()
    asyncio.run(main(a.rounds, a.heap))
