"""The egress proxy served for real: its Unix socket, CONNECT and absolute-URI requests
from asyncio clients, HTTPS upstreams on 127.0.0.1 signed by a test CA (tests/egress_net).

Destinations are pinned (``KERNELHUB_EGRESS__HOSTS``) to loopback servers, or resolved by
the loopback test DNS server; nothing leaves the machine."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import stat
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kernelhub.config import EgressPolicy, EgressSettings
from kernelhub.egress.policy import Answer
from kernelhub.egress.proxy import SOCKET_NAME, EgressProxy, EgressSession
from kernelhub.errors import EgressRefusedError
from tests import egress_net
from tests.conftest import UNIT, eventually
from tests.egress_net import Seen, dns_server, https_server, make_ca

WAIT = 10 * UNIT


@dataclass
class Net:
    """The test internet: a CA, an HTTPS and a plain HTTP server, a short socket dir."""

    ca: egress_net.TestCA
    https_port: int
    https_seen: Seen
    http_port: int
    http_seen: Seen
    ipc: Path


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    # Unix socket paths are limited to 108 bytes: pytest's tmp_path can be longer.
    root = Path(tempfile.mkdtemp(prefix="khp", dir="/tmp"))
    try:
        ca = make_ca(root / "ca")
        with (
            https_server(ca, root) as (https_port, https_seen),
            https_server(None, root) as (http_port, http_seen),
        ):
            yield Net(ca, https_port, https_seen, http_port, http_seen, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Gate:
    """The human at the gate: answers in order, and who was asked."""

    answers: list[Answer | Exception] = field(default_factory=list)
    asked: list[tuple[str, int]] = field(default_factory=list)
    release: asyncio.Event | None = None

    async def __call__(self, host: str, port: int) -> Answer:
        self.asked.append((host, port))
        if self.release is not None:
            await self.release.wait()
        answer = self.answers.pop(0) if self.answers else Answer.DENY
        if isinstance(answer, Exception):
            raise answer
        return answer


@dataclass
class Rig:
    proxy: EgressProxy
    session: EgressSession
    gate: Gate
    audit: list[tuple[str, dict[str, object]]]
    net: Net

    @property
    def path(self) -> str:
        return str(self.net.ipc / SOCKET_NAME)

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_unix_connection(self.path)

    async def request(self, head: str) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
        """Send a proxy request head; the proxy's status line and headers."""
        reader, writer = await self.connect()
        writer.write(head.encode())
        await writer.drain()
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        return answer, reader, writer

    def actions(self, name: str) -> list[dict[str, object]]:
        return [detail for action, detail in self.audit if action == name]


Make = Callable[..., Awaitable[Rig]]


@pytest.fixture
async def make_rig(net: Net) -> AsyncIterator[Make]:
    made: list[EgressProxy] = []

    async def make(
        policy: EgressPolicy | None,
        *,
        intercept: bool = False,
        hosts: dict[str, str] | None = None,
        **overrides: object,
    ) -> Rig:
        pins = {
            "api.good.test": f"127.0.0.1:{net.https_port}",
            "plain.good.test": f"127.0.0.1:{net.http_port}",
            "other.good.test": f"127.0.0.1:{net.https_port}",
        }
        settings = EgressSettings(
            policies={"p": policy} if policy else {},
            hosts=pins | (hosts or {}),
            ca_cert_file=net.ca.cert_file if intercept else None,
            ca_key_file=net.ca.key_file if intercept else None,
            upstream_ca_file=net.ca.cert_file,
            connect_timeout=2 * UNIT,
            **overrides,  # type: ignore[arg-type]
        )
        proxy = EgressProxy(settings, net.ipc)
        made.append(proxy)
        gate = Gate()
        audit: list[tuple[str, dict[str, object]]] = []
        session = EgressSession(
            "s1", policy, "p" if policy else None, gate, lambda a, d: audit.append((a, d))
        )
        await proxy.open(session, net.ipc)
        return Rig(proxy, session, gate, audit, net)

    yield make
    for proxy in made:
        await proxy.close()


def client_tls(ca: egress_net.TestCA) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca.cert_file))


async def https_get(rig: Rig, host: str, path: str, *, sni: str | None = None) -> bytes:
    """CONNECT to host:443, TLS inside the tunnel (SNI ``sni`` or host), one GET."""
    answer, reader, writer = await rig.request(f"CONNECT {host}:443 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    context = client_tls(rig.net.ca)
    await asyncio.wait_for(writer.start_tls(context, server_hostname=sni or host), WAIT)
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: mine\r\n"
        "Connection: close\r\n\r\n".encode()
    )
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), WAIT)
    writer.close()
    return data


async def bytes_until_cut(reader: asyncio.StreamReader) -> int:
    """Read until the proxy cuts the connection (no clean TLS close); bytes read."""
    got = 0
    with pytest.raises((ConnectionError, ssl.SSLError)):
        while chunk := await asyncio.wait_for(reader.read(65536), WAIT):
            got += len(chunk)
        raise ConnectionError("closed")
    return got


ALLOW = EgressPolicy(allow=["*.good.test"], ask=False)


async def test_an_allowed_tunnel_carries_tls_end_to_end_and_is_metered(make_rig: Make) -> None:
    rig = await make_rig(ALLOW)
    data = await https_get(rig, "api.good.test", "/through")
    assert data.startswith(b"HTTP/1.1 200"), data
    assert b"hello from api.good.test /through" in data
    # Passed through: the upstream saw the client's own header, nothing added.
    _, path, headers = rig.net.https_seen.requests[-1]
    assert path == "/through" and headers["authorization"] == "mine"
    assert rig.session.meter.used_bytes >= len(data)
    await eventually(lambda: not rig.session.open_connections, WAIT)


async def test_the_socket_is_world_connectable_and_replaces_a_stale_file(net: Net) -> None:
    (net.ipc / SOCKET_NAME).unlink(missing_ok=True)
    (net.ipc / SOCKET_NAME).write_text("planted by the sandbox")
    proxy = EgressProxy(EgressSettings(), net.ipc)
    session = EgressSession("s2", None, None, Gate(), lambda a, d: None)
    try:
        await proxy.open(session, net.ipc)
        mode = os.stat(net.ipc / SOCKET_NAME).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o666
        assert proxy.session("s2") is session and proxy.session("nope") is None
        await proxy.close_session("s2")
        assert proxy.session("s2") is None
        await proxy.close_session("s2")  # twice: nothing to do
    finally:
        await proxy.close()


@pytest.mark.parametrize(
    ("head", "status", "words"),
    [
        ("CONNECT evil.test:443 HTTP/1.1\r\n\r\n", b"403", b"evil.test"),
        ("CONNECT 127.0.0.1:443 HTTP/1.1\r\n\r\n", b"403", b"127.0.0.1"),
        ("CONNECT api.good.test:22 HTTP/1.1\r\n\r\n", b"403", b"22"),
        ("GET /local HTTP/1.1\r\nHost: x\r\n\r\n", b"400", b"not a proxy request"),
        ("GET ftp://plain.good.test/ HTTP/1.1\r\n\r\n", b"400", b"not a proxy request"),
    ],
)
async def test_refusals_are_http_errors_that_say_why(
    make_rig: Make, head: str, status: bytes, words: bytes
) -> None:
    rig = await make_rig(ALLOW)
    answer, reader, writer = await rig.request(head)
    line = answer.split(b"\r\n")[0]
    assert line.startswith(b"HTTP/1.1 " + status + b" egress refused"), line
    body = await asyncio.wait_for(reader.read(), WAIT)
    assert words in line and words in body
    writer.close()


async def test_a_session_without_a_policy_refuses_everything_and_audits_it(
    make_rig: Make,
) -> None:
    rig = await make_rig(None)
    answer, _, writer = await rig.request("CONNECT api.good.test:443 HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 403 "), answer
    assert rig.actions("egress.deny")[0]["host"] == "api.good.test"
    assert rig.gate.asked == []
    writer.close()


async def test_plain_http_is_forwarded_with_operator_headers_and_without_hop_headers(
    make_rig: Make,
) -> None:
    policy = EgressPolicy(
        allow=["plain.good.test"], ask=False, headers={"plain.good.test": {"X-Key": "k1"}}
    )
    # Headers need a CA for HTTPS; plain HTTP gets them without one.
    rig = await make_rig(policy)
    reader, writer = await rig.connect()
    writer.write(
        b"GET http://plain.good.test/p?q=1 HTTP/1.1\r\nHost: plain.good.test\r\n"
        b"Proxy-Authorization: secret\r\nX-Key: forged\r\nKeep-Alive: 5\r\n\r\n"
    )
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), WAIT)
    assert data.startswith(b"HTTP/1.") and b"hello from plain.good.test /p?q=1" in data
    host, path, headers = rig.net.http_seen.requests[-1]
    assert (host, path) == ("plain.good.test", "/p?q=1")
    assert headers["x-key"] == "k1" and headers["connection"] == "close"
    assert "proxy-authorization" not in headers and "keep-alive" not in headers
    writer.close()


async def test_a_tunnel_for_one_name_cannot_carry_tls_for_another(make_rig: Make) -> None:
    rig = await make_rig(ALLOW)
    with pytest.raises((ConnectionError, ssl.SSLError, asyncio.IncompleteReadError)):
        await https_get(rig, "api.good.test", "/fronted", sni="other.good.test")
    await eventually(lambda: bool(rig.actions("egress.deny")), WAIT)
    reason = str(rig.actions("egress.deny")[0]["reason"])
    assert "other.good.test" in reason and "api.good.test" in reason
    assert all(path != "/fronted" for _, path, _ in rig.net.https_seen.requests)


async def test_a_tunnel_that_does_not_start_with_tls_is_closed(make_rig: Make) -> None:
    rig = await make_rig(ALLOW)
    answer, reader, writer = await rig.request("CONNECT api.good.test:443 HTTP/1.1\r\n\r\n")
    assert b" 200 " in answer
    writer.write(b"GET / HTTP/1.1\r\nHost: api.good.test\r\n\r\n")
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), WAIT) == b""
    writer.close()
    assert "not a TLS handshake" in str(rig.actions("egress.deny")[0]["reason"])


async def test_an_unreachable_upstream_is_a_502(make_rig: Make) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    closed_port = probe.getsockname()[1]
    probe.close()  # nobody listens there now
    rig = await make_rig(ALLOW, hosts={"down.good.test": f"127.0.0.1:{closed_port}"})
    answer, _, writer = await rig.request("GET http://down.good.test/ HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 502 egress refused: cannot connect to down.good.test")
    writer.close()


async def test_names_are_resolved_by_the_proxy_and_private_answers_refused(
    make_rig: Make,
) -> None:
    with dns_server({"inside.good.test": "10.1.2.3"}) as port:
        rig = await make_rig(ALLOW, nameserver=f"127.0.0.1:{port}")
        answer, _, writer = await rig.request("CONNECT inside.good.test:443 HTTP/1.1\r\n\r\n")
        writer.close()
        answer2, _, writer2 = await rig.request("CONNECT nowhere.good.test:443 HTTP/1.1\r\n\r\n")
        writer2.close()
    assert answer.startswith(b"HTTP/1.1 403 ") and b"10.1.2.3" in answer, answer
    assert not answer2.startswith(b"HTTP/1.1 200"), answer2
    hosts = [d["host"] for d in rig.actions("egress.deny")]
    assert hosts == ["inside.good.test", "nowhere.good.test"]


ASK = EgressPolicy(allow=[], ask=True)


async def test_a_session_answer_is_asked_once_and_kept(make_rig: Make) -> None:
    rig = await make_rig(ASK)
    rig.gate.answers = [Answer.SESSION]
    for _ in range(2):
        data = await https_get(rig, "api.good.test", "/asked")
        assert b"hello from api.good.test /asked" in data
    assert rig.gate.asked == [("api.good.test", 443)]
    assert rig.session.granted == {("api.good.test", 443)}


async def test_a_once_answer_asks_again_next_time(make_rig: Make) -> None:
    rig = await make_rig(ASK)
    rig.gate.answers = [Answer.ONCE, Answer.ONCE]
    for _ in range(2):
        assert b"hello from" in await https_get(rig, "api.good.test", "/once")
    assert rig.gate.asked == [("api.good.test", 443)] * 2 and not rig.session.granted


async def test_a_deny_answer_refuses_now_and_later_without_asking(make_rig: Make) -> None:
    rig = await make_rig(ASK)
    rig.gate.answers = [Answer.DENY]
    for _ in range(2):
        answer, _, writer = await rig.request("CONNECT api.good.test:443 HTTP/1.1\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 403 "), answer
        writer.close()
    assert rig.gate.asked == [("api.good.test", 443)]
    assert rig.session.denied == {("api.good.test", 443)}


async def test_nobody_to_ask_is_a_refusal_that_says_so(make_rig: Make) -> None:
    rig = await make_rig(ASK)
    rig.gate.answers = [RuntimeError("no cell is running")]
    answer, _, writer = await rig.request("CONNECT api.good.test:443 HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 403 ") and b"no cell is running" in answer
    assert "no cell is running" in str(rig.actions("egress.deny")[0]["reason"])
    writer.close()


async def test_concurrent_requests_for_one_destination_share_one_question(
    make_rig: Make,
) -> None:
    rig = await make_rig(ASK)
    rig.gate.release = asyncio.Event()
    rig.gate.answers = [Answer.DENY]
    conns = [await rig.connect() for _ in range(3)]
    for _, writer in conns:
        writer.write(b"CONNECT api.good.test:443 HTTP/1.1\r\n\r\n")
        await writer.drain()
    await eventually(lambda: rig.gate.asked != [], WAIT)
    await eventually(lambda: len(rig.session.open_connections) == 3, WAIT)
    rig.gate.release.set()
    for reader, writer in conns:
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        assert answer.startswith(b"HTTP/1.1 403 ")
        writer.close()
    assert rig.gate.asked == [("api.good.test", 443)]
    assert rig.session.pending == {}


async def test_closing_the_session_cuts_connections_and_abandons_questions(
    make_rig: Make,
) -> None:
    rig = await make_rig(ASK)
    rig.gate.release = asyncio.Event()  # never set: the human never answers
    reader, writer = await rig.connect()
    writer.write(b"CONNECT api.good.test:443 HTTP/1.1\r\n\r\n")
    await writer.drain()
    await eventually(lambda: bool(rig.session.pending), WAIT)
    await rig.proxy.close_session("s1")
    data = await asyncio.wait_for(reader.read(), WAIT)
    assert b" 200 " not in data
    writer.close()
    with pytest.raises((ConnectionRefusedError, FileNotFoundError)):
        await rig.connect()


async def test_past_the_quota_connections_are_cut_and_new_ones_refused(make_rig: Make) -> None:
    rig = await make_rig(EgressPolicy(allow=["*.good.test"], ask=False, quota_bytes=200_000))
    answer, reader, writer = await rig.request("CONNECT api.good.test:443 HTTP/1.1\r\n\r\n")
    await writer.start_tls(client_tls(rig.net.ca), server_hostname="api.good.test")
    writer.write(b"GET /flood/1000000 HTTP/1.1\r\nHost: api.good.test\r\n\r\n")
    await writer.drain()
    got = await bytes_until_cut(reader)
    writer.close()
    assert got < 1_000_000
    assert rig.session.cut and rig.session.meter.exhausted
    (quota,) = rig.actions("egress.quota")
    assert quota["quota_bytes"] == 200_000
    answer, _, writer = await rig.request("CONNECT api.good.test:443 HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 403 ") and b"quota of 200000 bytes" in answer
    writer.close()


async def test_connections_past_the_limit_get_a_429(make_rig: Make) -> None:
    rig = await make_rig(ALLOW, max_connections=1)
    _, holder = await rig.connect()
    holder.write(b"CONNECT api.good.test:443 HTTP/1.1\r\n")  # head not finished: stays open
    await holder.drain()
    await eventually(lambda: len(rig.session.open_connections) == 1, WAIT)
    answer, _, writer = await rig.request("CONNECT api.good.test:443 HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 429 ") and b"MAX_CONNECTIONS" in answer
    holder.close()
    writer.close()


async def test_an_intercepted_domain_gets_the_operator_headers_over_verified_tls(
    make_rig: Make,
) -> None:
    policy = EgressPolicy(
        allow=["*.good.test"], ask=False, headers={"api.good.test": {"Authorization": "op"}}
    )
    rig = await make_rig(policy, intercept=True)
    data = await https_get(rig, "api.good.test", "/injected")
    assert b"hello from api.good.test /injected" in data
    _, path, headers = rig.net.https_seen.requests[-1]
    assert path == "/injected" and headers["authorization"] == "op"
    # Another domain of the same policy passes through untouched.
    await https_get(rig, "other.good.test", "/plain")
    assert rig.net.https_seen.requests[-1][2]["authorization"] == "mine"
    assert rig.proxy.authority is not None
    assert set(rig.proxy.authority._contexts) == {"api.good.test"}


async def test_a_malformed_head_is_closed_without_an_answer(make_rig: Make) -> None:
    rig = await make_rig(ALLOW)
    for head in (b"CONNECT api.good.test:443 HTTP/1.1\r\nno colon\r\n\r\n", b"HELLO\r\n\r\n"):
        reader, writer = await rig.connect()
        writer.write(head)
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), WAIT) == b""
        writer.close()
    assert rig.gate.asked == [] and rig.session.meter.used_bytes == 0


async def test_a_plain_request_without_host_gets_the_destination_as_host(
    make_rig: Make,
) -> None:
    rig = await make_rig(ALLOW)
    reader, writer = await rig.connect()
    writer.write(b"GET http://user@plain.good.test/nohost HTTP/1.0\r\n\r\n")
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), WAIT)
    writer.close()
    assert b"hello from plain.good.test /nohost" in data
    host, path, _ = rig.net.http_seen.requests[-1]
    assert (host, path) == ("plain.good.test", "/nohost")


async def test_a_gate_refusal_is_passed_on_as_it_is(make_rig: Make) -> None:
    rig = await make_rig(ASK)
    rig.gate.answers = [EgressRefusedError("the session is being deleted", 410)]
    answer, _, writer = await rig.request("CONNECT api.good.test:443 HTTP/1.1\r\n\r\n")
    writer.close()
    assert answer.startswith(b"HTTP/1.1 410 egress refused: the session is being deleted")
    assert rig.actions("egress.deny") == []


async def test_an_intercepted_connection_is_cut_at_the_quota_too(make_rig: Make) -> None:
    policy = EgressPolicy(
        allow=["*.good.test"],
        ask=False,
        quota_bytes=150_000,
        headers={"api.good.test": {"Authorization": "op"}},
    )
    rig = await make_rig(policy, intercept=True)
    _, reader, writer = await rig.request("CONNECT api.good.test:443 HTTP/1.1\r\n\r\n")
    await writer.start_tls(client_tls(rig.net.ca), server_hostname="api.good.test")
    writer.write(b"GET /flood/1000000 HTTP/1.1\r\nHost: api.good.test\r\n\r\n")
    await writer.drain()
    got = await bytes_until_cut(reader)
    writer.close()
    assert got < 1_000_000 and rig.session.cut
    assert rig.net.https_seen.requests[-1][2]["authorization"] == "op"
