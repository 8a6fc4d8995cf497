"""CPU per request of the gateway's server layer alone: each HTTP parser (httptools, h11)
on each event loop (uvloop, asyncio), serving a small Starlette app with the gateway's
own guarded protocol and WebSocket protocol (issue #20).

The gateway's per-cell CPU mixes this layer with the engine, the store and the kernel
client; here only the layer differs between contenders, so its share shows. Each
contender is a child process; they take turns (A B C D, then D C B A, ...) and each
block's server CPU (user + system, psutil) is divided by its requests. A load on the
machine inflates every contender alike; the ratios are what carries over.

    PYTHONPATH=$PWD python bench/http_layer.py --requests 2000 --blocks 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

COMBOS = [("httptools", "uvloop"), ("httptools", "asyncio"), ("h11", "uvloop"), ("h11", "asyncio")]
BODY = b'{"code": "1+1", "wait": true}'


def serve(parser: str, loop: str, fd: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route, WebSocketRoute
    from starlette.websockets import WebSocket, WebSocketDisconnect

    from kernelhub.cli.serve import loop_factory
    from kernelhub.gateway.connections import http_protocol
    from kernelhub.gateway.ws_protocol import websocket_protocol

    async def execute(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"id": "e1", "status": "ok", "code": body["code"], "result": "2"})

    async def echo(ws: WebSocket) -> None:
        await ws.accept()
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                await ws.send_text(await ws.receive_text())

    app = Starlette(routes=[Route("/x", execute, methods=["POST"]), WebSocketRoute("/ws", echo)])
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        http=http_protocol(1024, 10.0, 30.0, parser),
        ws=websocket_protocol(30.0, 2**20),
        ws_per_message_deflate=False,
    )
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        runner.run(uvicorn.Server(config).serve(sockets=[socket.socket(fileno=fd)]))


def listening() -> socket.socket:
    """Bound and listening here, served by the child that inherits it: no port race."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    return s


def rest_block(port: int, n: int) -> None:
    """``n`` POSTs on one kept-alive connection, each answer read before the next."""
    request = (
        b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer kh_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
    )
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = b""
        for _ in range(n):
            s.sendall(request)
            while b"\r\n\r\n" not in buf:
                buf += s.recv(65536)
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            while len(buf) < length:
                buf += s.recv(65536)
            buf = buf[length:]


def ws_block(port: int, n: int) -> None:
    from websockets.sync.client import connect

    with connect(f"ws://127.0.0.1:{port}/ws", compression=None) as ws:
        for _ in range(n):
            ws.send('{"type": "execute", "code": "1+1"}')
            ws.recv()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests (or frames) a block")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--serve", nargs=3, metavar=("PARSER", "LOOP", "FD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve[0], args.serve[1], int(args.serve[2]))
        return 0
    procs: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    try:
        for parser, loop in COMBOS:
            sock = listening()
            proc = subprocess.Popen(
                [sys.executable, __file__, "--serve", parser, loop, str(sock.fileno())],
                env=os.environ,
                pass_fds=[sock.fileno()],
            )
            procs[f"{parser}+{loop}"] = (proc, sock.getsockname()[1])
            sock.close()
        for _proc, port in procs.values():
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port)).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "a server did not start"
                    time.sleep(0.1)
        samples: dict[str, dict[str, list[float]]] = {k: {"rest": [], "ws": []} for k in procs}
        names = list(procs)
        for block in range(args.blocks + 1):  # the first is a warm-up
            order = names if block % 2 == 0 else names[::-1]
            for kind, run in (("rest", rest_block), ("ws", ws_block)):
                for name in order:
                    proc, port = procs[name]
                    ps = psutil.Process(proc.pid)
                    t0 = ps.cpu_times()
                    run(port, args.requests)
                    t1 = ps.cpu_times()
                    if block:
                        used = (t1.user - t0.user) + (t1.system - t0.system)
                        samples[name][kind].append(used / args.requests * 1e6)
        print(
            f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end; "
            f"{args.requests} requests a block, {args.blocks} blocks; server CPU us/request, "
            "median [min-max] over blocks"
        )
        base = samples["h11+asyncio"]
        for name, kinds in samples.items():
            cells: list[Any] = []
            for kind in ("rest", "ws"):
                xs = kinds[kind]
                ratio = statistics.median(xs) / statistics.median(base[kind])
                cells.append(
                    f"{kind} {statistics.median(xs):7.1f} [{min(xs):.1f}-{max(xs):.1f}] "
                    f"({ratio:.2f}x h11+asyncio)"
                )
            print(f"  {name:18s} " + "   ".join(cells))
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            proc.wait(10)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
