"""``1+1`` over the Jupyter kernel WebSocket (``/api/kernels/{id}/channels``) against
kernelhub's own stream (``/v1/sessions/{id}/stream``), on one gateway and one session,
in interleaved rounds so that drift on a shared machine hits both alike.

A Jupyter round trip is what nbclient waits for: ``execute_request`` sent to its
``execute_reply`` and the ``idle`` status after it; kernelhub's is ``execute`` to the
cell's ``final`` event. TCP_NODELAY is set on both client sockets. Not a timed test:
run it by hand (``python bench/jupyter_ws.py --rounds 200``); the issue's target is a
ratio of at most 1.3.

    cd bench && python jupyter_ws.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from gateway import Gateway, WsSession, create_session, delete_session
from websockets.asyncio.client import ClientConnection, connect

from kernelhub.jupyter import messages


def nodelay(conn: ClientConnection) -> None:
    sock = conn.transport.get_extra_info("socket")
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


class JupyterChannels:
    def __init__(self, gw: Gateway, sid: str) -> None:
        self.url = f"{gw.ws_url}/api/kernels/{messages.kernel_id(sid)}/channels"
        self.headers = gw.headers
        self.session = uuid.uuid4().hex
        self.conn: ClientConnection | None = None

    async def __aenter__(self) -> JupyterChannels:
        self.conn = await connect(self.url, additional_headers=self.headers, max_size=2**26)
        nodelay(self.conn)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.conn is not None:
            await self.conn.close()

    async def run(self, code: str = "1+1") -> float:
        assert self.conn is not None
        msg = messages.message("shell", "execute_request", {"code": code}, {}, self.session)
        msg_id = msg["header"]["msg_id"]
        t0 = time.perf_counter()
        await self.conn.send(messages.to_json_frame(msg))
        replied = idle = False
        while not (replied and idle):
            got = json.loads(await self.conn.recv())
            if got["parent_header"].get("msg_id") != msg_id:
                continue
            kind = got["header"]["msg_type"]
            if kind == "execute_reply":
                assert got["content"]["status"] == "ok", got["content"]
                replied = True
            elif kind == "status" and got["content"]["execution_state"] == "idle":
                idle = True
        return time.perf_counter() - t0


async def main(rounds: int, warmup: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        gw = await Gateway.launch(
            Path(tmp),
            instance=f"bench-jws-{uuid.uuid4().hex[:6]}",
            env={"KERNELHUB_POOL__SIZE": "0"},
        )
        try:
            async with gw.client() as http:
                sid = await create_session(http)
                try:
                    async with WsSession(gw, sid) as own, JupyterChannels(gw, sid) as jup:
                        assert own.conn is not None
                        nodelay(own.conn)
                        ours: list[float] = []
                        theirs: list[float] = []
                        for i in range(warmup + rounds):
                            # Interleaved, alternating which goes first.
                            pair = (own.run(), jup.run()) if i % 2 else (jup.run(), own.run())
                            a = await pair[0]
                            b = await pair[1]
                            if i >= warmup:
                                own_t, jup_t = (a, b) if i % 2 else (b, a)
                                ours.append(own_t)
                                theirs.append(jup_t)
                finally:
                    await delete_session(http, sid)
        finally:
            await gw.stop()
    med_own, med_jup = statistics.median(ours), statistics.median(theirs)
    print(f"rounds: {rounds} (after {warmup} warm-up), 1+1, one session, TCP_NODELAY on both")
    print(f"kernelhub /v1 stream      median {med_own * 1e3:.2f} ms  p90 {_p90(ours) * 1e3:.2f} ms")
    print(
        f"jupyter /api channels     median {med_jup * 1e3:.2f} ms  p90 {_p90(theirs) * 1e3:.2f} ms"
    )
    print(f"ratio (jupyter / kernelhub) {med_jup / med_own:.2f} (target <= 1.3)")


def _p90(values: list[float]) -> float:
    return sorted(values)[int(len(values) * 0.9)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.warmup))
