"""The proxy's TLS pieces for real: leaf certificates from an operator CA (EC and RSA),
verified by Python's own client, and :class:`ServerSideTls` serving a TLS session over
plain asyncio streams on 127.0.0.1 after the ClientHello was already read."""

from __future__ import annotations

import asyncio
import datetime
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa
from cryptography.x509.oid import NameOID

from kernelhub.egress.tls import CertificateAuthority, ServerSideTls
from tests import egress_net
from tests.conftest import UNIT
from tests.egress_net import make_ca

WAIT = 10 * UNIT
TRADITIONAL = serialization.PrivateFormat.TraditionalOpenSSL


def rsa_ca(directory: Path) -> tuple[Path, Path]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rsa test CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = x509.CertificateBuilder(
        issuer_name=name,
        subject_name=name,
        public_key=key.public_key(),
        serial_number=x509.random_serial_number(),
        not_valid_before=now - datetime.timedelta(hours=1),
        not_valid_after=now + datetime.timedelta(days=1),
        extensions=[
            x509.Extension(x509.BasicConstraints.oid, True, x509.BasicConstraints(True, 0))
        ],
    ).sign(key, hashes.SHA256())
    directory.mkdir(parents=True, exist_ok=True)
    cert_file, key_file = directory / "rsa.pem", directory / "rsa.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    # The older "BEGIN RSA PRIVATE KEY" form, as many operators' CAs still are.
    pem = key.private_bytes(serialization.Encoding.PEM, TRADITIONAL, serialization.NoEncryption())
    key_file.write_bytes(pem)
    return cert_file, key_file


def handshake(server: ssl.SSLContext, client: ssl.SSLContext, name: str) -> x509.Certificate:
    """A TLS handshake between two contexts over memory BIOs; the server's leaf."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    tls_client = client.wrap_bio(c_in, c_out, server_hostname=name)
    tls_server = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for side, tls, out, peer_in in (
            ("client", tls_client, c_out, s_in),
            ("server", tls_server, s_out, c_in),
        ):
            if not done[side]:
                try:
                    tls.do_handshake()
                    done[side] = True
                except ssl.SSLWantReadError:
                    pass
            peer_in.write(out.read())
        if all(done.values()):
            break
    der = tls_client.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def test_leaves_are_signed_for_their_host_and_verified_by_a_client_trusting_the_ca(
    tmp_path: Path,
) -> None:
    ca = make_ca(tmp_path / "ca")
    authority = CertificateAuthority(ca.cert_file, ca.key_file, tmp_path / "certs")
    client = ssl.create_default_context(cafile=str(ca.cert_file))
    leaf = handshake(authority.context_for("api.example.test"), client, "api.example.test")
    assert leaf.issuer == ca.cert.subject
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["api.example.test"]
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    lifetime = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert datetime.timedelta(days=1) < lifetime <= datetime.timedelta(days=8)
    # A leaf for one name is no good for another.
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(authority.context_for("api.example.test"), client, "other.example.test")
    # The key and certificate were on disk only while being loaded.
    assert list((tmp_path / "certs").iterdir()) == []
    assert (tmp_path / "certs").stat().st_mode & 0o777 == 0o700


def test_contexts_are_made_once_per_host(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "ca")
    authority = CertificateAuthority(ca.cert_file, ca.key_file, tmp_path / "certs")
    first = authority.context_for("a.test")
    assert authority.context_for("a.test") is first
    assert authority.context_for("b.test") is not first


def test_an_rsa_ca_works_and_another_key_kind_is_refused(tmp_path: Path) -> None:
    cert_file, key_file = rsa_ca(tmp_path)
    authority = CertificateAuthority(cert_file, key_file, tmp_path / "certs")
    client = ssl.create_default_context(cafile=str(cert_file))
    assert handshake(authority.context_for("r.test"), client, "r.test").issuer.rfc4514_string()
    ed_key = tmp_path / "ed.key"
    ed_key.write_bytes(
        ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(ValueError, match="EC or RSA"):
        CertificateAuthority(cert_file, ed_key, tmp_path / "certs")


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Site:
    """An operator CA, the proxy's authority made from it, and a client trusting it."""

    ca: egress_net.TestCA
    authority: CertificateAuthority

    async def serve(self, handler: Handler) -> tuple[asyncio.Server, int]:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        return server, server.sockets[0].getsockname()[1]

    async def client(
        self, port: int, name: str
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        context = ssl.create_default_context(cafile=str(self.ca.cert_file))
        return await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname=name)


@pytest.fixture
def site(tmp_path: Path) -> Site:
    ca = make_ca(tmp_path / "ca")
    return Site(ca, CertificateAuthority(ca.cert_file, ca.key_file, tmp_path / "certs"))


async def test_server_side_tls_serves_after_the_hello_was_already_read(site: Site) -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await reader.read(7)  # part of the ClientHello, as the proxy reads it
        tls = ServerSideTls(site.authority.context_for("echo.test"), reader, writer, first)
        await tls.handshake()
        while chunk := await tls.read():
            seen.append(chunk)
            await tls.write(chunk.upper())
            if chunk.endswith(b"\n"):
                break
        tls.close()

    server, port = await site.serve(handler)
    async with server:
        reader, writer = await site.client(port, "echo.test")
        writer.write(b"hello tls\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.readline(), WAIT)
        # After the reply the proxy closes cleanly: the client sees the end of the stream.
        rest = await asyncio.wait_for(reader.read(), WAIT)
        writer.close()
    assert answer == b"HELLO TLS\n" and rest == b""
    assert b"".join(seen) == b"hello tls\n"


async def test_a_client_gone_during_the_handshake_is_a_connection_error(site: Site) -> None:
    outcome: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tls = ServerSideTls(site.authority.context_for("gone.test"), reader, writer, b"")
        try:
            await tls.handshake()
            outcome.set_result(None)
        except BaseException as exc:
            outcome.set_result(exc)
        finally:
            writer.close()

    server, port = await site.serve(handler)
    async with server:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()  # not one byte of TLS
        await writer.wait_closed()
        exc = await asyncio.wait_for(outcome, WAIT)
    assert isinstance(exc, ConnectionError) and "during the TLS handshake" in str(exc)


async def test_reading_after_the_client_closes_is_the_end_of_the_stream(site: Site) -> None:
    got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tls = ServerSideTls(site.authority.context_for("eof.test"), reader, writer, b"")
        await tls.handshake()
        data = b""
        while chunk := await tls.read():
            data += chunk
        got.set_result(data)
        tls.close()

    server, port = await site.serve(handler)
    async with server:
        _, writer = await site.client(port, "eof.test")
        writer.write(b"last words")
        await writer.drain()
        writer.close()
        assert await asyncio.wait_for(got, WAIT) == b"last words"
