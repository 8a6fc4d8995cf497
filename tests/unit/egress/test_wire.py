"""The proxy's pure wire parts: DNS messages, the ClientHello's SNI, request heads."""

from __future__ import annotations

import ssl

import pytest

from kernelhub.egress.dns import build_query, parse_answers, parse_pin
from kernelhub.egress.proxy import forwarded_head, parse_head, split_authority
from kernelhub.egress.tls import NEED_MORE, client_hello_sni
from tests.egress_net import dns_answer


def client_hello(server_name: str | None) -> bytes:
    """The real first flight of Python's TLS client for ``server_name``."""
    context = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname=server_name)
    if server_name is None:
        context.check_hostname = False
        tls = context.wrap_bio(incoming, outgoing)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_sni_is_read_from_a_real_client_hello() -> None:
    hello = client_hello("API.Example.com")
    assert client_hello_sni(hello) == "api.example.com"
    for cut in (0, 3, 5, len(hello) // 2, len(hello) - 1):
        assert client_hello_sni(hello[:cut]) == NEED_MORE


def test_a_client_hello_without_sni_has_none() -> None:
    assert client_hello_sni(client_hello(None)) is None


@pytest.mark.parametrize(
    "data", [b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01\x00\x04\x02\x00\x00\x00", b"\x17" * 10]
)
def test_anything_but_a_client_hello_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        client_hello_sni(data)


def test_dns_round_trip_with_the_test_server() -> None:
    query = build_query("evil.good.test", 1, 4242)
    assert parse_answers(dns_answer(query, {"evil.good.test": "127.0.0.1"}), 4242) == ["127.0.0.1"]
    assert parse_answers(dns_answer(query, {}), 4242) == []  # NXDOMAIN
    with pytest.raises(ValueError, match="not the answer"):
        parse_answers(dns_answer(query, {}), 4243)


def test_pins_parse_addresses_with_and_without_ports() -> None:
    assert parse_pin("10.0.0.5:8443") == ("10.0.0.5", 8443)
    assert parse_pin("10.0.0.5") == ("10.0.0.5", None)
    assert parse_pin("[fd00::5]:443") == ("fd00::5", 443)
    with pytest.raises(ValueError):
        parse_pin("mirror.internal:443")  # a pin is an address, not another name


def test_request_heads_and_authorities() -> None:
    head = parse_head(b"CONNECT api.example.com:443 HTTP/1.1\r\nHost: api.example.com:443")
    assert (head.method, head.target) == ("CONNECT", "api.example.com:443")
    assert split_authority("API.example.com.:8443", 443) == ("api.example.com", 8443)
    assert split_authority("[::1]:443", 443) == ("[::1]", 443)
    assert split_authority("example.com", 80) == ("example.com", 80)
    with pytest.raises(ValueError):
        parse_head(b"garbage")
    with pytest.raises(ValueError):
        split_authority("example.com:99999", 80)


def test_the_forwarded_head_replaces_credentials_and_drops_hop_headers() -> None:
    head = parse_head(
        b"GET http://api.example.com/v1?q=1 HTTP/1.1\r\nHost: api.example.com\r\n"
        b"Proxy-Authorization: x\r\nConnection: keep-alive\r\nx-api-key: forged\r\nAccept: */*"
    )
    out = forwarded_head(head, "/v1?q=1", "api.example.com", {"X-Api-Key": "real"}).decode()
    lines = out.split("\r\n")
    assert lines[0] == "GET /v1?q=1 HTTP/1.1"
    assert "X-Api-Key: real" in lines and "x-api-key: forged" not in lines
    assert "Proxy-Authorization: x" not in lines and "Connection: keep-alive" not in lines
    assert "Connection: close" in lines and out.endswith("\r\n\r\n")
