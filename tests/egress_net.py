""" "The internet" for egress tests, all on 127.0.0.1: a test CA, an HTTPS server whose
certificate it signs (for any ``*.good.test`` name), a DNS server with test-only answers,
and a tiny wheel for a test wheelhouse. Used by tests/gateway/test_egress.py and
bench/egress.py; never reaches anything but loopback."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import http.server
import socket
import socketserver
import ssl
import struct
import threading
import zipfile
from base64 import urlsafe_b64encode
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass
class TestCA:
    cert_file: Path
    key_file: Path
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    def issue(self, directory: Path, names: list[str]) -> Path:
        """A server certificate for ``names``, with its key, in one PEM file."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), False)
            .sign(self.key, hashes.SHA256())
        )
        path = directory / "server.pem"
        path.write_bytes(
            cert.public_bytes(serialization.Encoding.PEM)
            + key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return path


def make_ca(directory: Path) -> TestCA:
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kernelhub egress test CA")])
    now = datetime.datetime.now(datetime.UTC)
    usage = x509.KeyUsage(
        digital_signature=True, key_cert_sign=True, crl_sign=True,
        content_commitment=False, key_encipherment=False, data_encipherment=False,
        key_agreement=False, encipher_only=False, decipher_only=False,
    )  # fmt: skip
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "ca.pem", directory / "ca.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_file.chmod(0o600)
    return TestCA(cert_file, key_file, key, cert)


@dataclass
class Seen:
    """What the HTTPS server received: (host header, path, headers) per request."""

    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body are two writes: with Nagle on, a keep-alive client waits for a
    # delayed ACK (40 ms) on every request.
    disable_nagle_algorithm = True
    seen: Seen
    files: dict[str, bytes]

    def do_GET(self) -> None:
        self.seen.requests.append(
            (
                self.headers.get("Host", ""),
                self.path,
                {k.lower(): v for k, v in self.headers.items()},
            )
        )
        if self._file(body=True):
            return
        if self.path.startswith("/flood/"):
            size = int(self.path.rsplit("/", 1)[1])
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            chunk = b"x" * 65536
            with contextlib.suppress(OSError):
                for start in range(0, size, len(chunk)):
                    self.wfile.write(chunk[: size - start])
            return
        body = f"hello from {self.headers.get('Host', '?')} {self.path}\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self) -> None:
        self._file(body=False)

    def _file(self, *, body: bool) -> bool:
        """Serve ``files`` (and 404 the rest of an index); False for other paths."""
        data = self.files.get(self.path)
        if data is None:
            if not self.path.startswith(("/simple/", "/files/")) and body:
                return False
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return True
        self.send_response(200)
        kind = "text/html" if self.path.endswith("/") else "application/octet-stream"
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)
        return True

    def log_message(self, format: str, *args: object) -> None:
        pass


class _TLSServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


@contextlib.contextmanager
def https_server(
    ca: TestCA | None, directory: Path, files: dict[str, bytes] | None = None
) -> Iterator[tuple[int, Seen]]:
    """An HTTPS server on 127.0.0.1 for ``*.good.test`` (plain HTTP if ``ca`` is None);
    yields (port, what it saw). ``files``: path -> bytes it serves as they are (a package
    index, for one)."""
    seen = Seen()
    handler = type("Handler", (_Handler,), {"seen": seen, "files": files or {}})
    server = _TLSServer(("127.0.0.1", 0), handler)
    if ca is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(ca.issue(directory, ["good.test", "*.good.test"]))
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()


def dns_answer(query: bytes, table: dict[str, str]) -> bytes:
    """A DNS response to ``query`` from ``table`` (name -> IPv4; others: NXDOMAIN)."""
    qid = query[:2]
    offset, labels = 12, []
    while query[offset]:
        length = query[offset]
        labels.append(query[offset + 1 : offset + 1 + length].decode())
        offset += 1 + length
    question = query[12 : offset + 5]
    qtype = struct.unpack("!H", query[offset + 1 : offset + 3])[0]
    address = table.get(".".join(labels).lower())
    if address is None:
        return qid + struct.pack("!HHHHH", 0x8183, 1, 0, 0, 0) + question
    if qtype != 1:
        return qid + struct.pack("!HHHHH", 0x8180, 1, 0, 0, 0) + question
    answer = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 60, 4) + socket.inet_aton(address)
    return qid + struct.pack("!HHHHH", 0x8180, 1, 1, 0, 0) + question + answer


@contextlib.contextmanager
def dns_server(table: dict[str, str]) -> Iterator[int]:
    """A UDP DNS server on 127.0.0.1 answering from ``table``; yields its port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                data, peer = sock.recvfrom(512)
            except TimeoutError:
                continue
            except OSError:
                return
            with contextlib.suppress(Exception):
                sock.sendto(dns_answer(data, table), peer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        sock.close()


def make_wheel(directory: Path, name: str, version: str, code: str) -> Path:
    """A minimal pure-Python wheel: one module ``name`` whose source is ``code``."""
    directory.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": code.encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = [
        f"{path},sha256={urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for path, data in files.items()
    ]
    files[f"{dist}/RECORD"] = ("\n".join([*record, f"{dist}/RECORD,,"]) + "\n").encode()
    path = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in files.items():
            zf.writestr(member, data)
    return path


def simple_index(wheels: list[Path]) -> dict[str, bytes]:
    """A PEP 503 simple index of ``wheels``: the paths ``https_server`` serves for it."""
    files: dict[str, bytes] = {}
    projects: dict[str, list[Path]] = {}
    for wheel in wheels:
        files[f"/files/{wheel.name}"] = wheel.read_bytes()
        project = wheel.name.split("-", 1)[0].lower().replace("_", "-")
        projects.setdefault(project, []).append(wheel)
    for project, members in projects.items():
        links = "".join(f'<a href="/files/{w.name}">{w.name}</a>\n' for w in members)
        files[f"/simple/{project}/"] = f"<html><body>\n{links}</body></html>\n".encode()
    return files
