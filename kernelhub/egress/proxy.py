"""The egress proxy: the only way out of a sandbox, one Unix socket per session.

The gateway listens on ``<session dir>/ipc/egress.sock`` for each live Docker session
(:meth:`EgressProxy.open`); inside the sandbox a forwarder makes it the loopback port that
``HTTP_PROXY``/``HTTPS_PROXY`` name (``kernel-image/kernelhub_kernel/egress.py``). Whatever
connects speaks HTTP proxy requests: ``CONNECT host:port`` for a tunnel (HTTPS), or an
absolute-URI request (``GET http://host/path``) for plain HTTP.

For each connection, in order:

1. the destination is decided (``policy.decide``): IP literals refused, the session's
   answers and the policy's rules applied, and an unknown name put to a human through the
   running cell (:attr:`EgressSession.ask`: once / session / deny);
2. the name is resolved here (``dns.Resolver``), refusing private and loopback answers;
3. a tunnel's first bytes must be a TLS ClientHello whose SNI is the CONNECT host;
4. for a domain with operator headers the proxy terminates TLS (its CA, trusted by the
   sandbox), adds the headers to the request and forwards it over its own verified TLS
   connection; every other tunnel is copied byte for byte, end to end encrypted;
5. every byte both ways counts against the session's quota; past it, every connection of
   the session is cut and new ones are refused.

Refusals before a tunnel exists are HTTP errors whose reason phrase says why (Python's
``http.client`` shows it: ``Tunnel connection failed: 403 egress refused: ...``); after
it, the connection is closed and the audit log says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from kernelhub.config import EgressPolicy, EgressSettings
from kernelhub.egress.dns import Resolver, Upstream
from kernelhub.egress.policy import (
    Answer,
    Meter,
    Rule,
    Verdict,
    decide,
    header_values,
    normalize_host,
    rules_of,
)
from kernelhub.egress.tls import (
    MAX_HELLO_BYTES,
    NEED_MORE,
    CertificateAuthority,
    ServerSideTls,
    client_hello_sni,
)
from kernelhub.errors import EgressRefusedError

log = logging.getLogger(__name__)
SOCKET_NAME = "egress.sock"
MAX_HEAD_BYTES = 32 * 1024
HEAD_TIMEOUT = 30.0
_CHUNK = 65536
# Hop-by-hop and proxy headers never forwarded (RFC 9110 7.6.1).
_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "te", "upgrade"}
)

Gate = Callable[[str, int], Awaitable[Answer]]
Audit = Callable[[str, dict[str, object]], None]


@dataclass(eq=False)
class EgressSession:
    """One session's egress state. ``ask`` puts a destination to a human (the manager
    asks through the running cell); ``audit`` records a decision."""

    session_id: str
    policy: EgressPolicy | None
    policy_name: str | None
    ask: Gate
    audit: Audit
    granted: set[tuple[str, int]] = field(default_factory=set)
    denied: set[tuple[str, int]] = field(default_factory=set)
    meter: Meter = field(init=False)
    rules: tuple[Rule, ...] = field(init=False)
    open_connections: set[asyncio.StreamWriter] = field(default_factory=set)
    pending: dict[tuple[str, int], asyncio.Future[Answer]] = field(default_factory=dict)
    cut: bool = False

    def __post_init__(self) -> None:
        self.meter = Meter(self.policy.quota_bytes if self.policy else 0)
        self.rules = rules_of(self.policy) if self.policy else ()

    def count(self, size: int) -> bool:
        """Count bytes moved; False (after cutting every connection once) past the quota."""
        if self.meter.add(size):
            return True
        if not self.cut:
            self.cut = True
            self.audit(
                "egress.quota",
                {"used_bytes": self.meter.used_bytes, "quota_bytes": self.meter.quota_bytes},
            )
            for writer in list(self.open_connections):
                writer.transport.abort()
        return False


@dataclass(frozen=True)
class RequestHead:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]


def parse_head(data: bytes) -> RequestHead:
    """An HTTP/1.x request head (up to and without the blank line); ValueError if not."""
    lines = data.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x request line: {lines[0][:80]!r}")
    headers = []
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ValueError(f"malformed header line {line[:80]!r}")
        headers.append((name, value.strip()))
    return RequestHead(parts[0].upper(), parts[1], parts[2], headers)


def split_authority(authority: str, default_port: int) -> tuple[str, int]:
    """``host:port`` / ``[v6]:port`` / ``host`` -> (host, port); ValueError if malformed."""
    if authority.startswith("["):
        host, _, rest = authority[1:].partition("]")
        host = f"[{host}]"
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = authority.rpartition(":") if ":" in authority else (authority, "", "")
    port = int(port_text) if port_text else default_port
    if not host or not 0 < port < 65536:
        raise ValueError(f"bad destination {authority!r}")
    return normalize_host(host), port


def forwarded_head(head: RequestHead, path: str, host: str, extra: dict[str, str]) -> bytes:
    """The head to send upstream: origin-form target, hop-by-hop headers and any the
    operator sets dropped, the operator's added, one request per connection."""
    replaced = {name.lower() for name in extra}
    lines = [f"{head.method} {path} {head.version}"]
    has_host = False
    for name, value in head.headers:
        low = name.lower()
        if low in _HOP or low in replaced:
            continue
        has_host = has_host or low == "host"
        lines.append(f"{name}: {value}")
    if not has_host:
        lines.append(f"Host: {host}")
    lines += [f"{name}: {value}" for name, value in extra.items()]
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@dataclass(frozen=True)
class _Tunnel:
    """A CONNECT the proxy has agreed to: the client's streams and where it goes."""

    session: EgressSession
    host: str
    port: int
    upstream: Upstream
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


def _reason(text: str) -> str:
    return "".join(c if 32 <= ord(c) < 127 else " " for c in text)[:400]


class EgressProxy:
    """Serves every live session's egress socket. Created by the gateway (one per
    process); the manager calls :meth:`open` when a session's sandbox is bound and
    :meth:`close_session` when it goes; :meth:`close` at shutdown."""

    def __init__(
        self,
        settings: EgressSettings,
        work_dir: Path,
        *,
        resolver: Resolver | None = None,
    ) -> None:
        self.settings = settings
        self.resolver = resolver or Resolver(settings.hosts, settings.nameserver)
        self.authority: CertificateAuthority | None = None
        if settings.ca_cert_file is not None and settings.ca_key_file is not None:
            self.authority = CertificateAuthority(
                settings.ca_cert_file, settings.ca_key_file, work_dir / "egress-certs"
            )
        self._upstream_tls = ssl.create_default_context(
            cafile=str(settings.upstream_ca_file) if settings.upstream_ca_file else None
        )
        self._servers: dict[str, tuple[asyncio.Server, EgressSession]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def session(self, session_id: str) -> EgressSession | None:
        entry = self._servers.get(session_id)
        return entry[1] if entry else None

    async def open(self, session: EgressSession, ipc_dir: Path) -> None:
        """Listen on ``ipc_dir/egress.sock`` for ``session`` (replacing what is there:
        the sandbox can write that directory, and nothing of its making is trusted)."""
        await self.close_session(session.session_id)
        path = ipc_dir / SOCKET_NAME
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        server = await asyncio.start_unix_server(
            lambda r, w: self._accept(session, r, w), path=str(path), limit=MAX_HEAD_BYTES
        )
        # The directory (0700, the sandbox's) is the access check; the sandbox's uid
        # must be able to connect whoever we are.
        os.chmod(path, 0o666)
        self._servers[session.session_id] = (server, session)

    async def close_session(self, session_id: str) -> None:
        entry = self._servers.pop(session_id, None)
        if entry is None:
            return
        server, session = entry
        server.close()
        for writer in list(session.open_connections):
            writer.transport.abort()
        for fut in session.pending.values():
            fut.cancel()

    async def close(self) -> None:
        for session_id in list(self._servers):
            await self.close_session(session_id)
        for task in list(self._tasks):
            task.cancel()

    # -- one connection -----------------------------------------------------------------

    async def _accept(
        self, session: EgressSession, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if len(session.open_connections) >= self.settings.max_connections:
            await self._refuse(
                writer,
                EgressRefusedError(
                    f"{self.settings.max_connections} egress connections are open, the most "
                    "per session (KERNELHUB_EGRESS__MAX_CONNECTIONS)",
                    429,
                ),
            )
            return
        session.open_connections.add(writer)
        try:
            await self._serve(session, reader, writer)
        except EgressRefusedError as exc:
            await self._refuse(writer, exc)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass
        except TimeoutError:
            pass
        finally:
            session.open_connections.discard(writer)
            writer.transport.abort()

    async def _refuse(self, writer: asyncio.StreamWriter, exc: EgressRefusedError) -> None:
        text = f"egress refused: {exc}"
        body = (text + "\n").encode()
        with contextlib.suppress(OSError):
            writer.write(
                f"HTTP/1.1 {exc.status} {_reason(text)}\r\nContent-Type: text/plain\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        writer.transport.abort()

    async def _serve(
        self, session: EgressSession, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
        head = parse_head(raw[:-4])
        if head.method == "CONNECT":
            host, port = split_authority(head.target, 443)
        else:
            url = urlsplit(head.target)
            if url.scheme != "http" or not url.netloc:
                raise EgressRefusedError(
                    f"{head.target[:80]!r} is not a proxy request (http://host/...)", 400
                )
            host, port = split_authority(url.netloc.rpartition("@")[2], 80)
        if session.cut or session.meter.exhausted:
            raise EgressRefusedError(
                f"the session's egress quota of {session.meter.quota_bytes} bytes is used up"
            )
        await self._authorize(session, host, port)
        upstream = await self._resolve(session, host)
        if head.method == "CONNECT":
            writer.write(f"{head.version} 200 Connection established\r\n\r\n".encode())
            await writer.drain()
            await self._tunnel(_Tunnel(session, host, port, upstream, reader, writer))
        else:
            url = urlsplit(head.target)
            path = (url.path or "/") + (f"?{url.query}" if url.query else "")
            extra = header_values(session.policy, host)
            up_reader, up_writer = await self._connect(upstream, port, host, tls=False)
            try:
                up_writer.write(forwarded_head(head, path, host, extra))
                await self._relay(session, reader, writer, up_reader, up_writer)
            finally:
                up_writer.transport.abort()

    async def _authorize(self, session: EgressSession, host: str, port: int) -> None:
        decision = decide(
            session.policy,
            host,
            port,
            rules=session.rules,
            granted=frozenset(session.granted),
            denied=frozenset(session.denied),
            policy_name=session.policy_name,
        )
        if decision.verdict is Verdict.ALLOW:
            return
        if decision.verdict is Verdict.DENY:
            session.audit("egress.deny", {"host": host, "port": port, "reason": decision.reason})
            raise EgressRefusedError(decision.reason)
        key = (host, port)
        fut = session.pending.get(key)
        if fut is None:
            fut = session.pending[key] = asyncio.ensure_future(session.ask(host, port))
            fut.add_done_callback(lambda _: session.pending.pop(key, None))
        try:
            answer = await asyncio.shield(fut)
        except EgressRefusedError:
            raise
        except Exception as exc:  # nobody to ask (no cell running), the session closing
            session.audit("egress.deny", {"host": host, "port": port, "reason": str(exc)})
            raise EgressRefusedError(
                f"{decision.reason}, and nobody could be asked: {exc}"
            ) from exc
        if answer is Answer.SESSION:
            session.granted.add(key)
        elif answer is Answer.DENY:
            session.denied.add(key)
            raise EgressRefusedError(f"{host}:{port} was denied by a human for this session")

    async def _resolve(self, session: EgressSession, host: str) -> Upstream:
        try:
            return await self.resolver.resolve(host)
        except EgressRefusedError as exc:
            session.audit("egress.deny", {"host": host, "reason": str(exc)})
            raise

    async def _connect(
        self, upstream: Upstream, port: int, host: str, *, tls: bool
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        last: Exception | None = None
        for address in upstream.addresses:
            try:
                return await asyncio.wait_for(
                    asyncio.open_connection(
                        address,
                        upstream.port or port,
                        ssl=self._upstream_tls if tls else None,
                        server_hostname=host if tls else None,
                    ),
                    self.settings.connect_timeout,
                )
            except (OSError, TimeoutError) as exc:
                last = exc
        raise EgressRefusedError(f"cannot connect to {host}:{port}: {last}", 502)

    async def _tunnel(self, t: _Tunnel) -> None:
        session, host, port, reader, writer = t.session, t.host, t.port, t.reader, t.writer
        hello = b""
        while True:
            try:
                sni = client_hello_sni(hello)
            except ValueError as exc:
                session.audit("egress.deny", {"host": host, "port": port, "reason": str(exc)})
                return
            if sni != NEED_MORE:
                break
            chunk = await asyncio.wait_for(reader.read(MAX_HELLO_BYTES), HEAD_TIMEOUT)
            if not chunk:
                return
            hello += chunk
        if sni != host:
            session.audit(
                "egress.deny",
                {"host": host, "port": port, "reason": f"TLS server name {sni!r} is not {host}"},
            )
            return
        extra = header_values(session.policy, host)
        if extra and self.authority is not None:
            await self._intercept(t, hello, extra)
            return
        up_reader, up_writer = await self._connect(t.upstream, port, host, tls=False)
        try:
            if not session.count(len(hello)):
                return
            up_writer.write(hello)
            await self._relay(session, reader, writer, up_reader, up_writer)
        finally:
            up_writer.transport.abort()

    async def _intercept(self, t: _Tunnel, hello: bytes, extra: dict[str, str]) -> None:
        assert self.authority is not None
        session, host = t.session, t.host
        client = ServerSideTls(self.authority.context_for(host), t.reader, t.writer, hello)
        await asyncio.wait_for(client.handshake(), HEAD_TIMEOUT)
        buffered = b""
        while b"\r\n\r\n" not in buffered:
            chunk = await client.read()
            if not chunk or len(buffered) > MAX_HEAD_BYTES:
                return
            buffered += chunk
        raw, _, rest = buffered.partition(b"\r\n\r\n")
        head = parse_head(raw)
        up_reader, up_writer = await self._connect(t.upstream, t.port, host, tls=True)
        try:
            up_writer.write(forwarded_head(head, head.target, host, extra) + rest)
            if not session.count(len(buffered)):
                return

            async def upward() -> None:
                while chunk := await client.read():
                    if not session.count(len(chunk)):
                        return
                    up_writer.write(chunk)
                    await up_writer.drain()

            async def downward() -> None:
                while chunk := await up_reader.read(_CHUNK):
                    if not session.count(len(chunk)):
                        return
                    await client.write(chunk)

            await _until_first_done(upward(), downward())
        finally:
            up_writer.transport.abort()
            client.close()

    async def _relay(
        self,
        session: EgressSession,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up_reader: asyncio.StreamReader,
        up_writer: asyncio.StreamWriter,
    ) -> None:
        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while chunk := await src.read(_CHUNK):
                if not session.count(len(chunk)):
                    return
                dst.write(chunk)
                await dst.drain()
            if dst.can_write_eof():
                with contextlib.suppress(OSError):
                    dst.write_eof()

        # Half-closes pass through: a client that shuts its side still gets the answer.
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))


async def _until_first_done(*coros: Awaitable[None]) -> None:
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
