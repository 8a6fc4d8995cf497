"""Name resolution for the egress proxy: it resolves names itself, never the sandbox.

:class:`Resolver` answers ``resolve(name)`` with the addresses to connect to: an operator's
pinned upstream (``KERNELHUB_EGRESS__HOSTS``, trusted as declared), or DNS answers, every
one of which must be a public address (:func:`~kernelhub.egress.policy.address_problem`):
a name with any private, loopback or link-local answer is refused whole, so a rebinding
name cannot hand the proxy a private address on a later try.

DNS goes to the host's resolver (``getaddrinfo``), or, with a ``nameserver``, straight to
that server over UDP with the small stub client below (A and AAAA questions; the pure
:func:`build_query` / :func:`parse_answers` are tested with data).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import secrets
import socket
import struct
from dataclasses import dataclass

from kernelhub.egress.policy import address_problem
from kernelhub.errors import EgressRefusedError

_TYPE_A = 1
_TYPE_AAAA = 28
_CLASS_IN = 1


@dataclass(frozen=True)
class Upstream:
    """Where to connect for a name: addresses (tried in order) and an optional port
    replacing the requested one (a pin's)."""

    addresses: tuple[str, ...]
    port: int | None = None
    pinned: bool = False


def parse_pin(value: str) -> tuple[str, int | None]:
    """``"10.0.0.5:8443"``, ``"10.0.0.5"``, ``"[fd00::5]:443"`` -> (address, port)."""
    if value.startswith("["):
        address, _, rest = value[1:].partition("]")
        port = rest.removeprefix(":")
    elif value.count(":") == 1:
        address, _, port = value.partition(":")
    else:
        address, port = value, ""
    ipaddress.ip_address(address)  # ValueError for anything else
    return address, int(port) if port else None


def build_query(name: str, qtype: int, query_id: int) -> bytes:
    header = struct.pack("!HHHHHH", query_id, 0x0100, 1, 0, 0, 0)  # recursion desired
    labels = b"".join(
        bytes([len(part)]) + part for part in (p.encode("idna") for p in name.split(".")) if part
    )
    return header + labels + b"\x00" + struct.pack("!HH", qtype, _CLASS_IN)


def _skip_name(data: bytes, offset: int) -> int:
    while True:
        length = data[offset]
        if length & 0xC0 == 0xC0:
            return offset + 2
        if length == 0:
            return offset + 1
        offset += 1 + length


def parse_answers(data: bytes, query_id: int) -> list[str]:
    """The A/AAAA addresses in a DNS response to ``query_id``; [] for NXDOMAIN or none.
    Raises ValueError for a malformed or foreign response."""
    if len(data) < 12:
        raise ValueError("short DNS response")
    rid, flags, qdcount, ancount, _, _ = struct.unpack("!HHHHHH", data[:12])
    if rid != query_id or not flags & 0x8000:
        raise ValueError("not the answer to our query")
    offset = 12
    for _ in range(qdcount):
        offset = _skip_name(data, offset) + 4
    found: list[str] = []
    for _ in range(ancount):
        offset = _skip_name(data, offset)
        rtype, _, _, length = struct.unpack("!HHIH", data[offset : offset + 10])
        offset += 10
        rdata = data[offset : offset + length]
        offset += length
        if rtype == _TYPE_A and length == 4:
            found.append(str(ipaddress.IPv4Address(rdata)))
        elif rtype == _TYPE_AAAA and length == 16:
            found.append(str(ipaddress.IPv6Address(rdata)))
    return found


class _Exchange(asyncio.DatagramProtocol):
    def __init__(self, query_id: int) -> None:
        self.query_id = query_id
        self.answer: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: object) -> None:
        if self.answer.done():
            return
        # Not ours, or garbage: keep waiting for the real answer.
        with contextlib.suppress(ValueError, struct.error, IndexError):
            self.answer.set_result(parse_answers(data, self.query_id))

    def error_received(self, exc: Exception) -> None:
        if not self.answer.done():
            self.answer.set_exception(exc)


class Resolver:
    """Resolves names for the proxy. ``pins``: name -> "address[:port]" (the operator's
    ``hosts``); ``nameserver``: "address:port" of a DNS server, or None for the host's."""

    def __init__(
        self,
        pins: dict[str, str] | None = None,
        nameserver: str | None = None,
        *,
        timeout: float = 5.0,
    ) -> None:
        self.pins = {
            name.lower().removesuffix("."): parse_pin(v) for name, v in (pins or {}).items()
        }
        self.nameserver = parse_pin(nameserver) if nameserver else None
        self.timeout = timeout

    async def resolve(self, name: str) -> Upstream:
        """Where to connect for ``name``; raises
        :class:`~kernelhub.errors.EgressRefusedError` saying why not (the client sees it)."""
        pin = self.pins.get(name)
        if pin is not None:
            return Upstream((pin[0],), pin[1], pinned=True)
        try:
            answers = await asyncio.wait_for(self._lookup(name), self.timeout)
        except (OSError, TimeoutError) as exc:
            why = str(exc) or "timed out"
            raise EgressRefusedError(f"cannot resolve {name}: {why}") from exc
        if not answers:
            raise EgressRefusedError(f"{name} does not resolve")
        for address in answers:
            problem = address_problem(address)
            if problem is not None:
                raise EgressRefusedError(f"{name} resolves to {problem}; refused")
        return Upstream(tuple(dict.fromkeys(answers)))

    async def _lookup(self, name: str) -> list[str]:
        if self.nameserver is None:
            infos = await asyncio.get_running_loop().getaddrinfo(
                name, None, type=socket.SOCK_STREAM
            )
            return [str(info[4][0]) for info in infos]
        found: list[str] = []
        for qtype in (_TYPE_A, _TYPE_AAAA):
            found += await self._ask(name, qtype)
        return found

    async def _ask(self, name: str, qtype: int) -> list[str]:
        assert self.nameserver is not None
        address, port = self.nameserver
        query_id = secrets.randbelow(65536)
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.create_datagram_endpoint(
            lambda: _Exchange(query_id), remote_addr=(address, port or 53)
        )
        try:
            transport.sendto(build_query(name, qtype, query_id))
            return await protocol.answer
        finally:
            transport.close()
