"""The sandbox's egress forwarder (``kernelhub_kernel/egress.py``) on real sockets: a
loopback port copied both ways to a Unix socket standing in for the gateway's proxy."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.kernel_image.loader import load

egress = load("egress")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[tuple[str, list[bytes]]]:
    """A Unix socket server that answers each connection with what it read, upper-cased,
    after the client half-closes (so EOF must travel through the forwarder)."""
    path = str(tmp_path / "egress.sock")
    seen: list[bytes] = []
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                data = b""
                while chunk := conn.recv(65536):
                    data += chunk
                seen.append(data)
                conn.sendall(data.upper())

    threading.Thread(target=serve, daemon=True).start()
    yield path, seen
    server.close()


def roundtrip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(payload)
        c.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := c.recv(65536):
            out += chunk
        return out


def test_bytes_go_both_ways_with_eof_and_large_payloads(proxy: tuple[str, list[bytes]]) -> None:
    path, seen = proxy
    port = free_port()
    assert egress.start_forwarder({egress.PORT_ENV: str(port)}, socket_path=path)
    assert roundtrip(port, b"CONNECT example.org:443 http/1.1\r\n\r\n") == (
        b"CONNECT EXAMPLE.ORG:443 HTTP/1.1\r\n\r\n"
    )
    big = b"abc" * 300_000  # many chunks each way
    assert roundtrip(port, big) == big.upper()
    assert seen[-1] == big
    # Connections are independent: two at once both complete.
    results: list[bytes] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(roundtrip(port, b"n%d" % i)))
        for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(results) == [b"N0", b"N1"]


def test_without_a_proxy_socket_the_client_is_closed(tmp_path: Path) -> None:
    port = free_port()
    assert egress.start_forwarder({egress.PORT_ENV: str(port)}, str(tmp_path / "none.sock"))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(b"GET / HTTP/1.1\r\n\r\n")
        with contextlib.suppress(ConnectionResetError):  # aborted: as good as closed
            assert c.recv(10) == b""


@pytest.mark.parametrize("env", [{}, {egress.PORT_ENV: ""}, {egress.PORT_ENV: "http"}])
def test_no_port_or_a_bad_one_means_no_forwarder(
    env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert egress.start_forwarder(env, "/nonexistent.sock") is False
    if env.get(egress.PORT_ENV):
        assert "is not a port" in capsys.readouterr().err


def test_a_port_already_taken_is_reported_not_raised(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert egress.start_forwarder({egress.PORT_ENV: str(port)}, str(tmp_path / "s")) is False
    assert "not forwarding" in capsys.readouterr().err


def test_write_bundle_needs_both_a_target_and_the_egress_ca(tmp_path: Path) -> None:
    # EGRESS_CA is a fixed sandbox path; outside a sandbox it is absent, so nothing is written.
    target = tmp_path / "bundle.pem"
    egress.write_bundle({egress.BUNDLE_ENV: str(target)}, roots=())
    assert not target.exists()
    egress.write_bundle({}, roots=())
    assert not target.exists()


def test_the_bundle_is_written_where_ssl_cert_file_says_or_the_failure_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ca, first, second = tmp_path / "ca.pem", tmp_path / "r1.pem", tmp_path / "r2.pem"
    ca.write_bytes(b"CA")
    second.write_bytes(b"SECOND")
    monkeypatch.setattr(egress, "EGRESS_CA", str(ca))
    target = tmp_path / "deep" / "er" / "bundle.pem"
    # The first root store that exists, only that one, then the operator's CA.
    egress.write_bundle({egress.BUNDLE_ENV: str(target)}, roots=(str(first), str(second)))
    assert target.read_bytes() == b"SECOND\nCA"
    blocker = tmp_path / "file"
    blocker.write_text("")
    egress.write_bundle({egress.BUNDLE_ENV: str(blocker / "bundle.pem")}, roots=())
    assert "cannot write" in capsys.readouterr().err
