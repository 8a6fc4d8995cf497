"""The egress proxy's added latency per request, against a direct loopback request.

    python bench/egress.py [--requests 300]

"The internet" is the HTTPS test server of tests/egress_net.py on 127.0.0.1 (a test CA,
``*.good.test`` names). The proxy (kernelhub/egress/proxy.py, with its policy check, its
resolver and SNI check) runs in its own process on a Unix socket, as the gateway runs it
for a session; the client is one blocking ``http.client`` in this process. Modes:

* ``new connection``: each request opens TCP + TLS and closes (what ``urllib`` does).
  Direct: to 127.0.0.1. Proxied: Unix socket, ``CONNECT``, then TLS end to end.
* ``keep-alive``: requests on one open connection (what a ``requests.Session`` does).
  Proxied, the tunnel only copies bytes.
* ``injected header``: proxied, the proxy terminates TLS with the operator CA, adds a
  header, and opens its own verified TLS connection upstream, one per request.

The floor is the direct request to the same server: the fastest honest way to do the same
work. In a sandbox, add one loopback hop (the forwarder from HTTP_PROXY's port to the
socket), not measured here.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import socket
import ssl
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.synchronize import Event
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernelhub.config import EgressPolicy, EgressSettings
from kernelhub.egress.policy import Answer
from kernelhub.egress.proxy import SOCKET_NAME, EgressProxy, EgressSession
from tests.egress_net import https_server, make_ca

HOST = "api.good.test"
SECRET_HOST = "secret.good.test"


def _serve_proxy(directory: str, settings_json: str, ready: Event) -> None:
    settings = EgressSettings.model_validate_json(settings_json)

    async def main() -> None:
        proxy = EgressProxy(settings, Path(directory))

        async def never(host: str, port: int) -> Answer:
            return Answer.DENY

        policy = settings.policies["bench"]
        session = EgressSession("bench", policy, "bench", never, lambda action, detail: None)
        await proxy.open(session, Path(directory))
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def _direct(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    # As the proxy's own upstream sockets (asyncio sets it): no Nagle wait on small writes.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _tls(sock: socket.socket, context: ssl.SSLContext, name: str) -> ssl.SSLSocket:
    return context.wrap_socket(sock, server_hostname=name)


def _tunnel(path: str, host: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(f"CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("the proxy closed the tunnel")
        head += chunk
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        raise ConnectionError(head.decode(errors="replace"))
    return sock


def _get(conn: http.client.HTTPConnection, path: str) -> None:
    conn.request("GET", path)
    response = conn.getresponse()
    response.read()
    if response.status != 200:
        raise RuntimeError(f"status {response.status}")


def _connection(sock: ssl.SSLSocket, host: str) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection(host)
    conn.sock = sock
    return conn


def _timed(n: int, once: Callable[[], None]) -> list[float]:
    for _ in range(min(20, n)):
        once()  # warm-up: certificate minting, caches
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        once()
        samples.append(time.perf_counter() - t0)
    return samples


def measure(n: int) -> dict[str, dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="kh-egress-bench-") as tmp:
        root = Path(tmp)
        ca = make_ca(root / "ca")
        context = ssl.create_default_context(cafile=str(ca.cert_file))
        with https_server(ca, root) as (port, _seen):
            settings = EgressSettings(
                policies={
                    "bench": EgressPolicy(
                        allow=[HOST, SECRET_HOST],
                        quota_bytes=None,
                        headers={SECRET_HOST: {"X-Api-Key": "bench"}},
                    )
                },
                hosts={HOST: f"127.0.0.1:{port}", SECRET_HOST: f"127.0.0.1:{port}"},
                ca_cert_file=ca.cert_file,
                ca_key_file=ca.key_file,
                upstream_ca_file=ca.cert_file,
            )
            ready = multiprocessing.get_context("spawn").Event()
            settings_json = json.dumps(settings.model_dump(mode="json"))
            # SecretStr dumps masked; the bench header is not a secret.
            settings_json = settings_json.replace('"**********"', '"bench"')
            proc = multiprocessing.get_context("spawn").Process(
                target=_serve_proxy, args=(tmp, settings_json, ready), daemon=True
            )
            proc.start()
            try:
                if not ready.wait(30):
                    raise RuntimeError("the proxy did not start")
                path = str(root / SOCKET_NAME)

                def direct_new() -> None:
                    with _tls(_direct(port), context, HOST) as tls:
                        _get(_connection(tls, HOST), "/")

                def proxied_new() -> None:
                    with _tls(_tunnel(path, HOST), context, HOST) as tls:
                        _get(_connection(tls, HOST), "/")

                def injected_new() -> None:
                    with _tls(_tunnel(path, SECRET_HOST), context, SECRET_HOST) as tls:
                        _get(_connection(tls, SECRET_HOST), "/")

                direct = _connection(_tls(_direct(port), context, HOST), HOST)
                tunnelled = _connection(_tls(_tunnel(path, HOST), context, HOST), HOST)
                results = {
                    "new connection, direct": _timed(n, direct_new),
                    "new connection, proxied": _timed(n, proxied_new),
                    "keep-alive, direct": _timed(n, lambda: _get(direct, "/")),
                    "keep-alive, proxied": _timed(n, lambda: _get(tunnelled, "/")),
                    "injected header, proxied": _timed(n, injected_new),
                }
            finally:
                proc.kill()
                proc.join(10)
    return {
        name: {
            "median_ms": statistics.median(s) * 1000,
            "p95_ms": statistics.quantiles(s, n=20)[18] * 1000,
        }
        for name, s in results.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    results = measure(args.requests)
    for name, r in results.items():
        print(f"{name:28} median {r['median_ms']:7.3f} ms   p95 {r['p95_ms']:7.3f} ms")
    for mode in ("new connection", "keep-alive"):
        added = results[f"{mode}, proxied"]["median_ms"] - results[f"{mode}, direct"]["median_ms"]
        print(f"added by the proxy, {mode}: {added:.3f} ms per request (median)")


if __name__ == "__main__":
    main()
