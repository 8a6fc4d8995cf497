"""TLS for the egress proxy: the ClientHello's server name, and terminating TLS for the
domains the proxy adds credentials to.

:func:`client_hello_sni` is pure: the bytes a client sent after CONNECT in, its SNI (or
why there is none) out. The proxy compares it with the CONNECT host, so a tunnel opened
to an allowed name cannot carry a TLS session for another one (domain fronting).

:class:`CertificateAuthority` signs short-lived leaf certificates with the operator's CA
(``KERNELHUB_EGRESS__CA_CERT_FILE``) for the few domains that get injected headers; the
sandbox trusts that CA and nothing here is used for any other domain, whose TLS passes
through the proxy end to end. :class:`ServerSideTls` runs the proxy's side of such a
session over asyncio streams with a memory BIO, because the ClientHello was already read
to check its SNI and a transport-level ``start_tls`` would lose it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ssl
import struct
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

_HANDSHAKE = 22
_CLIENT_HELLO = 1
_SNI = 0
MAX_HELLO_BYTES = 16 * 1024 + 5


#: What :func:`client_hello_sni` answers for a prefix of a ClientHello: read more bytes.
NEED_MORE = "\x00need-more"


def client_hello_sni(data: bytes) -> str | None:
    """The host name in a TLS ClientHello (``data``: the first bytes of the stream), None
    if it carries none, or :data:`NEED_MORE` for a prefix of one (no host name can hold a
    NUL). Raises ValueError for anything that is not a ClientHello."""
    if len(data) < 5:
        return NEED_MORE
    content_type, _, length = struct.unpack("!BHH", data[:5])
    if content_type != _HANDSHAKE:
        raise ValueError("not a TLS handshake")
    if len(data) < 5 + length:
        if 5 + length > MAX_HELLO_BYTES:
            raise ValueError("ClientHello too large")
        return NEED_MORE
    body = data[5 : 5 + length]
    if len(body) < 4 or body[0] != _CLIENT_HELLO:
        raise ValueError("not a ClientHello")
    hello_length = int.from_bytes(body[1:4], "big")
    hello = body[4 : 4 + hello_length]
    if len(hello) < hello_length:
        raise ValueError("a ClientHello split over records")
    try:
        offset = 2 + 32  # version, random
        offset += 1 + hello[offset]  # session id
        offset += 2 + int.from_bytes(hello[offset : offset + 2], "big")  # cipher suites
        offset += 1 + hello[offset]  # compression methods
        if offset >= len(hello):
            return None
        end = offset + 2 + int.from_bytes(hello[offset : offset + 2], "big")
        offset += 2
        while offset + 4 <= end:
            kind, size = struct.unpack("!HH", hello[offset : offset + 4])
            offset += 4
            if kind == _SNI:
                names = hello[offset : offset + size]
                pos = 2
                while pos + 3 <= len(names):
                    name_type, name_len = (
                        names[pos],
                        int.from_bytes(names[pos + 1 : pos + 3], "big"),
                    )
                    pos += 3
                    if name_type == 0:
                        return names[pos : pos + name_len].decode("ascii").lower()
                    pos += name_len
                return None
            offset += size
    except (IndexError, UnicodeDecodeError) as exc:
        raise ValueError("malformed ClientHello") from exc
    return None


class CertificateAuthority:
    """The operator's CA; :meth:`context_for` gives a server context for one host name,
    with a leaf certificate made on first use and kept for the process's life."""

    def __init__(self, cert_file: Path, key_file: Path, work_dir: Path) -> None:
        self.cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
            raise ValueError(f"{key_file}: the CA key must be EC or RSA")
        self.key = key
        self.cert_pem = cert_file.read_bytes()
        self.work_dir = work_dir
        self._contexts: dict[str, ssl.SSLContext] = {}

    def context_for(self, host: str) -> ssl.SSLContext:
        context = self._contexts.get(host)
        if context is None:
            context = self._contexts[host] = self._make(host)
        return context

    def _make(self, host: str) -> ssl.SSLContext:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        pem = cert.public_bytes(serialization.Encoding.PEM) + self.cert_pem
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.set_alpn_protocols(["http/1.1"])
        self.work_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # load_cert_chain reads files only; they live just long enough to be read.
        with tempfile.NamedTemporaryFile(dir=self.work_dir, suffix=".pem") as f:
            f.write(pem + key_pem)
            f.flush()
            context.load_cert_chain(f.name)
        return context


class ServerSideTls:
    """The proxy's end of a client's TLS session, over the client's plain streams; the
    bytes already read from it (the ClientHello) are fed first."""

    def __init__(
        self,
        context: ssl.SSLContext,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        already_read: bytes,
    ) -> None:
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._in.write(already_read)
        self._tls = context.wrap_bio(self._in, self._out, server_side=True)
        self._reader = reader
        self._writer = writer

    async def _flush(self) -> None:
        data = self._out.read()
        if data:
            self._writer.write(data)
            await self._writer.drain()

    async def _fill(self) -> bool:
        data = await self._reader.read(65536)
        if not data:
            self._in.write_eof()
            return False
        self._in.write(data)
        return True

    async def handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
                await self._flush()
                return
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    raise ConnectionError("the client closed during the TLS handshake") from None

    async def read(self, size: int = 65536) -> bytes:
        """Up to ``size`` plaintext bytes; b"" at the end of the stream."""
        while True:
            try:
                return self._tls.read(size)
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    return b""
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    async def write(self, data: bytes) -> None:
        self._tls.write(data)
        await self._flush()

    def close(self) -> None:
        with contextlib.suppress(ssl.SSLError, ssl.SSLWantReadError):
            self._tls.unwrap()
        data = self._out.read()
        if data and not self._writer.is_closing():
            self._writer.write(data)
        self._writer.close()
