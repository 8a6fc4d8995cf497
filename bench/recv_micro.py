"""CPU per kernel message through ``kernel.client.Receiver`` (zmq read, HMAC check, JSON
frames), with no kernel and no gateway: a peer socket on inproc sends the messages of a
`1+1` cell (status busy, execute_input, execute_result, status idle, execute_reply), each
once the reader waits for it, as a kernel's arrive. Prints the best of ``--repeat`` runs
of µs of CPU per message. Run it with two trees' ``PYTHONPATH`` in turn (A B A B) to
compare a change of the receive path without the machine's load in the number::

    for t in /tmp/before $PWD /tmp/before $PWD; do PYTHONPATH=$t python bench/recv_micro.py; done
"""

from __future__ import annotations

import argparse
import asyncio
import time

import zmq

import kernelhub
from kernelhub.kernel.client import MAX_MESSAGE_BYTES, Receiver
from kernelhub.kernel.codec import Codec

KEY = b"k" * 32


def cell_messages(codec: Codec) -> list[list[bytes]]:
    parent = codec.header("execute_request")
    out = []
    for msg_type, content in (
        ("status", {"execution_state": "busy"}),
        ("execute_input", {"code": "1+1", "execution_count": 7}),
        ("execute_result", {"data": {"text/plain": "2"}, "metadata": {}, "execution_count": 7}),
        ("status", {"execution_state": "idle"}),
        ("execute_reply", {"status": "ok", "execution_count": 7, "user_expressions": {}}),
    ):
        out.append(codec.encode(msg_type, content, parent=parent)[1])
    return out


async def run(messages: int) -> float:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    reader = ctx.socket(zmq.PAIR)
    writer = ctx.socket(zmq.PAIR)
    reader.bind("inproc://recv-micro")
    writer.connect("inproc://recv-micro")
    sender = Codec(KEY, max_message_bytes=MAX_MESSAGE_BYTES)
    receiver = Receiver(reader, Codec(KEY, max_message_bytes=MAX_MESSAGE_BYTES), "")
    loop = asyncio.get_running_loop()
    spent = 0.0
    try:
        for _ in range(messages // 5):
            batch = cell_messages(sender)  # new msg_ids: no replay refusal
            t0 = time.process_time()
            for frames in batch:
                # Sent from the loop once the reader waits, as a kernel's message arrives.
                loop.call_soon(writer.send_multipart, frames)
                await receiver.recv()
            spent += time.process_time() - t0
    finally:
        receiver.close()
        reader.close(0)
        writer.close(0)
        ctx.term()
    return spent / (messages // 5 * 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    best = min(asyncio.run(run(args.messages)) for _ in range(args.repeat))
    print(f"{kernelhub.__file__}: {best * 1e6:.1f} µs CPU per message (best of {args.repeat})")


if __name__ == "__main__":
    main()
