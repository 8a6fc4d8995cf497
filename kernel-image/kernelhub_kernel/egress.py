"""The sandbox's way out: a loopback port forwarded to the gateway's egress proxy.

The sandbox has no network interface but loopback (``--network none``). The gateway puts a
Unix socket in the sandbox's socket directory (``/run/kernelhub/ipc/egress.sock``) whose
other end is its policy proxy; ``HTTP_PROXY``/``HTTPS_PROXY`` point at
``127.0.0.1:$KERNELHUB_EGRESS_PORT``, where this forwarder listens and copies bytes both
ways. It decides nothing: every check is the proxy's, outside the sandbox, and code that
connects to the socket itself meets the same proxy.

Started by the supervisor in a thread of its own (it survives kernel restarts) when
``KERNELHUB_EGRESS_PORT`` is set. It also writes the CA bundle the sandbox's TLS clients
trust (``SSL_CERT_FILE``): the image's roots plus the operator's egress CA, mounted at
``EGRESS_CA``, with which the proxy signs the domains it adds credentials to.
"""

import asyncio
import contextlib
import glob
import os
import sys
import threading
from collections.abc import Mapping

SOCKET = "/run/kernelhub/ipc/egress.sock"
EGRESS_CA = "/run/kernelhub/egress-ca.pem"
PORT_ENV = "KERNELHUB_EGRESS_PORT"
BUNDLE_ENV = "SSL_CERT_FILE"
_ROOTS = (
    "/etc/ssl/certs/ca-certificates.crt",
    *sorted(glob.glob("/opt/kernel/lib/python3*/site-packages/certifi/cacert.pem")),
)
_CHUNK = 65536
_LOG_PREFIX = "kernelhub-egress:"


def write_bundle(environ: Mapping[str, str], roots: tuple[str, ...] = _ROOTS) -> None:
    """Write the trust bundle ``SSL_CERT_FILE`` names: the first root store found, then
    the operator's egress CA. Failing costs only TLS to the domains the proxy signs."""
    target = environ.get(BUNDLE_ENV)
    if not target or not os.path.isfile(EGRESS_CA):
        return
    parts: list[bytes] = []
    for path in roots:
        if os.path.isfile(path):
            with open(path, "rb") as f:
                parts.append(f.read())
            break
    try:
        with open(EGRESS_CA, "rb") as f:
            parts.append(f.read())
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(b"\n".join(parts))
    except OSError as exc:
        print(f"{_LOG_PREFIX} cannot write {target}: {exc}", file=sys.stderr, flush=True)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(_CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.transport.abort()


async def _forward(
    client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter, socket_path: str
) -> None:
    try:
        proxy_reader, proxy_writer = await asyncio.open_unix_connection(socket_path)
    except OSError:
        # No proxy for this sandbox (yet): the client sees its connection closed.
        client_writer.transport.abort()
        return
    try:
        await asyncio.gather(_pump(client_reader, proxy_writer), _pump(proxy_reader, client_writer))
    finally:
        for writer in (client_writer, proxy_writer):
            with contextlib.suppress(OSError):
                writer.close()


async def _serve(port: int, socket_path: str, ready: threading.Event) -> None:
    server = await asyncio.start_server(
        lambda r, w: _forward(r, w, socket_path), "127.0.0.1", port, reuse_address=True
    )
    ready.set()
    async with server:
        await server.serve_forever()


def start_forwarder(environ: Mapping[str, str], socket_path: str = SOCKET) -> bool:
    """Listen on ``127.0.0.1:$KERNELHUB_EGRESS_PORT`` in a daemon thread; True once
    listening, False if the variable is unset or the port cannot be bound."""
    raw = environ.get(PORT_ENV)
    if not raw:
        return False
    try:
        port = int(raw)
    except ValueError:
        print(f"{_LOG_PREFIX} {PORT_ENV}={raw!r} is not a port", file=sys.stderr, flush=True)
        return False
    ready = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(_serve(port, socket_path, ready))
        except BaseException as exc:
            failed.append(exc)
            ready.set()

    threading.Thread(target=run, name="egress-forwarder", daemon=True).start()
    ready.wait(10.0)
    if failed:
        print(f"{_LOG_PREFIX} not forwarding: {failed[0]}", file=sys.stderr, flush=True)
    return ready.is_set() and not failed
