"""The egress resolver against a real DNS server on loopback (a few lines of UDP below):
its answers are parsed, a name with any private answer is refused whole (rebinding),
pins win, a foreign or garbled datagram does not stand in for the answer, silence times
out; and the wire helpers with data."""

from __future__ import annotations

import asyncio
import ipaddress
import struct
from collections.abc import AsyncIterator, Callable
from typing import cast

import pytest

from kernelhub.egress.dns import Resolver, Upstream, build_query, parse_answers, parse_pin
from kernelhub.errors import EgressRefusedError

A, AAAA = 1, 28


def response(query: bytes, addresses: list[str], *, query_id: int | None = None) -> bytes:
    """A DNS response to ``query`` answering with ``addresses`` of the asked type (the name
    compressed to a pointer at the question, as real servers do)."""
    qid = struct.unpack("!H", query[:2])[0] if query_id is None else query_id
    qtype = struct.unpack("!H", query[-4:-2])[0]
    wanted = [a for a in addresses if ipaddress.ip_address(a).version == (4 if qtype == A else 6)]
    flags = 0x8180 if wanted or addresses else 0x8183  # NXDOMAIN when it knows nothing
    header = struct.pack("!HHHHHH", qid, flags, 1, len(wanted), 0, 0)
    answers = b"".join(
        b"\xc0\x0c"
        + struct.pack("!HHIH", qtype, 1, 60, len(packed := ipaddress.ip_address(a).packed))
        + packed
        for a in wanted
    )
    return header + query[12:] + answers


class Server(asyncio.DatagramProtocol):
    """Answers each question from ``zone`` (name -> addresses); ``before`` may send junk
    first; names in ``silent`` get no answer."""

    def __init__(self) -> None:
        self.zone: dict[str, list[str]] = {}
        self.silent: set[str] = set()
        self.before: Callable[[bytes], list[bytes]] = lambda query: []
        self.asked: list[tuple[str, int]] = []
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        labels, offset = [], 12
        while data[offset]:
            labels.append(data[offset + 1 : offset + 1 + data[offset]].decode())
            offset += 1 + data[offset]
        name = ".".join(labels)
        self.asked.append((name, struct.unpack("!H", data[-4:-2])[0]))
        if name in self.silent:
            return
        assert self.transport is not None
        for junk in self.before(data):
            self.transport.sendto(junk, addr)
        self.transport.sendto(response(data, self.zone.get(name, [])), addr)


@pytest.fixture
async def server() -> AsyncIterator[tuple[Server, str]]:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_datagram_endpoint(Server, local_addr=("127.0.0.1", 0))
    port = transport.get_extra_info("sockname")[1]
    yield protocol, f"127.0.0.1:{port}"
    transport.close()


async def test_public_answers_of_both_families_are_used(server: tuple[Server, str]) -> None:
    dns, address = server
    dns.zone["api.example.com"] = ["93.184.216.34", "2606:2800:220:1::248", "93.184.216.34"]
    upstream = await Resolver(nameserver=address).resolve("api.example.com")
    # A first, then AAAA; a repeated address once.
    assert upstream == Upstream(("93.184.216.34", "2606:2800:220:1::248"))
    assert dns.asked == [("api.example.com", A), ("api.example.com", AAAA)]


@pytest.mark.parametrize("private", ["10.1.2.3", "127.0.0.1", "169.254.169.254", "fd00::1"])
async def test_one_private_answer_refuses_the_name(
    server: tuple[Server, str], private: str
) -> None:
    dns, address = server
    dns.zone["rebind.example.com"] = ["93.184.216.34", private]
    with pytest.raises(EgressRefusedError, match=r"rebind\.example\.com resolves to .*refused"):
        await Resolver(nameserver=address).resolve("rebind.example.com")


async def test_an_unknown_name_does_not_resolve(server: tuple[Server, str]) -> None:
    _, address = server
    with pytest.raises(EgressRefusedError, match=r"nowhere\.example\.com does not resolve"):
        await Resolver(nameserver=address).resolve("nowhere.example.com")


async def test_a_pin_wins_without_asking(server: tuple[Server, str]) -> None:
    dns, address = server
    dns.zone["internal.example.com"] = ["93.184.216.34"]
    resolver = Resolver({"Internal.Example.com.": "10.0.0.5:8443"}, nameserver=address)
    upstream = await resolver.resolve("internal.example.com")
    assert upstream == Upstream(("10.0.0.5",), 8443, pinned=True)
    assert dns.asked == []


async def test_foreign_and_garbled_datagrams_do_not_answer(server: tuple[Server, str]) -> None:
    """An off-path datagram with another id (or junk) arrives first: it is ignored, and the
    real answer is used, not an attacker's address."""
    dns, address = server
    dns.zone["api.example.com"] = ["93.184.216.34"]
    dns.before = lambda query: [
        response(query, ["6.6.6.6"], query_id=(struct.unpack("!H", query[:2])[0] + 1) % 65536),
        b"\x00\x01garbage",
        query[:2] + b"\x81\x80\x00\x01\x00\x05",  # truncated: claims answers it lacks
    ]
    upstream = await Resolver(nameserver=address).resolve("api.example.com")
    assert upstream.addresses == ("93.184.216.34",)


async def test_a_silent_server_times_out_with_the_name(server: tuple[Server, str]) -> None:
    dns, address = server
    dns.silent.add("slow.example.com")
    with pytest.raises(EgressRefusedError, match=r"cannot resolve slow\.example\.com"):
        await Resolver(nameserver=address, timeout=0.2).resolve("slow.example.com")


async def test_a_timeout_says_it_timed_out(server: tuple[Server, str]) -> None:
    dns, address = server
    dns.silent.add("slow.example.com")
    with pytest.raises(EgressRefusedError, match=r"cannot resolve slow\.example\.com: timed out"):
        await Resolver(nameserver=address, timeout=0.2).resolve("slow.example.com")


async def test_the_hosts_resolver_is_used_without_a_nameserver() -> None:
    # "localhost" resolves through the host's resolver, always to loopback: refused.
    with pytest.raises(EgressRefusedError, match="localhost resolves to"):
        await Resolver().resolve("localhost")


@pytest.mark.parametrize(
    ("value", "pin"),
    [
        ("10.0.0.5:8443", ("10.0.0.5", 8443)),
        ("10.0.0.5", ("10.0.0.5", None)),
        ("[fd00::5]:443", ("fd00::5", 443)),
        ("[fd00::5]", ("fd00::5", None)),
        ("fd00::5", ("fd00::5", None)),
    ],
)
def test_pins_parse(value: str, pin: tuple[str, int | None]) -> None:
    assert parse_pin(value) == pin


@pytest.mark.parametrize("value", ["example.com", "10.0.0.5:http", "[fd00::5]:x", "1.2.3"])
def test_a_pin_that_is_not_an_address_is_refused(value: str) -> None:
    with pytest.raises(ValueError):
        parse_pin(value)


def test_a_query_is_a_dns_question() -> None:
    query = build_query("api.example.com.", AAAA, 0x1234)
    assert query[:12] == struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
    assert query[12:] == b"\x03api\x07example\x03com\x00" + struct.pack("!HH", AAAA, 1)


def test_answers_are_checked_against_the_query() -> None:
    query = build_query("a.example.com", A, 7)
    assert parse_answers(response(query, ["1.2.3.4", "5.6.7.8"]), 7) == ["1.2.3.4", "5.6.7.8"]
    assert parse_answers(response(query, []), 7) == []
    with pytest.raises(ValueError, match="not the answer"):
        parse_answers(response(query, ["1.2.3.4"]), 8)
    with pytest.raises(ValueError, match="not the answer"):
        parse_answers(query, 7)  # a question, not a response
    with pytest.raises(ValueError, match="short"):
        parse_answers(b"\x00\x07", 7)
