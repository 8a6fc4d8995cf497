"""The pure parts of what a client may hold open: stream limits and revocation sweeps,
the Origin rule, the descriptor budget, the raw refusals; and the settings they read."""

from __future__ import annotations

import resource

import h11
import pytest

from kernelhub.config import load_settings
from kernelhub.errors import ForbiddenError, QuotaError
from kernelhub.gateway.auth import check_origin
from kernelhub.gateway.connections import (
    FD_RESERVE,
    StreamRegistry,
    connection_budget,
    raw_response,
)


async def test_stream_limits_per_session_then_per_principal_and_places_come_back() -> None:
    streams = StreamRegistry(per_session=2, per_principal=3)
    a1 = streams.open("alice", "s1", "t-a")
    streams.open("alice", "s1", "t-a")
    with pytest.raises(QuotaError, match="MAX_STREAMS_PER_SESSION") as full:
        streams.open("alice", "s1", "t-a")
    assert "s1 has 2 open streams" in str(full.value)
    streams.open("bob", "s2", "t-b")  # another session, another principal: unaffected
    streams.open("alice", "s3", "t-a")
    with pytest.raises(QuotaError, match="MAX_STREAMS_PER_PRINCIPAL"):
        streams.open("alice", "s4", "t-a")
    streams.close(a1)
    streams.close(a1)  # twice is harmless: the count is not taken twice
    assert len(streams) == 3
    streams.open("alice", "s1", "t-a")
    with pytest.raises(QuotaError):
        streams.open("alice", "s1", "t-a")


async def test_a_sweep_revokes_exactly_the_streams_of_invalid_tokens_asking_once_each() -> None:
    streams = StreamRegistry(per_session=10, per_principal=10)
    kept = [streams.open("alice", "s1", "good"), streams.open("alice", "s2", "good")]
    gone = [streams.open("alice", "s1", "revoked"), streams.open("alice", "s3", "revoked")]
    asked: list[str] = []

    async def valid(token: str) -> bool:
        asked.append(token)
        return token == "good"

    assert await streams.sweep(valid) == 2
    assert sorted(asked) == ["good", "revoked"]
    assert all(s.revoked.done() for s in gone) and not any(s.revoked.done() for s in kept)
    assert await streams.sweep(valid) == 0  # already revoked: resolved once


@pytest.mark.parametrize(
    ("origin", "host", "allowed", "ok"),
    [
        (None, "127.0.0.1:8765", [], True),  # not a browser
        ("http://127.0.0.1:8765", "127.0.0.1:8765", [], True),  # the gateway's own page
        ("https://gw.example.com", "gw.example.com", [], True),
        ("HTTP://127.0.0.1:8765/", "127.0.0.1:8765", [], True),
        ("http://127.0.0.1:9999", "127.0.0.1:8765", [], False),  # another port is another origin
        ("http://evil.test", "127.0.0.1:8765", [], False),
        ("null", "127.0.0.1:8765", [], False),  # sandboxed iframes, file:// pages
        ("https://app.example.com", "127.0.0.1:8765", ["https://app.example.com/"], True),
        ("https://app.example.com.evil.test", "x", ["https://app.example.com"], False),
        ("http://anything.test", "x", ["*"], True),
        ("http://evil.test", None, [], False),
    ],
)
def test_origin_rule(origin: str | None, host: str | None, allowed: list[str], ok: bool) -> None:
    if ok:
        check_origin(origin, host, allowed)
    else:
        with pytest.raises(ForbiddenError, match="KERNELHUB_GATEWAY__ALLOWED_ORIGINS"):
            check_origin(origin, host, allowed)


@pytest.mark.parametrize(
    ("wanted", "soft", "hard", "expected"),
    [
        (1024, 1024, 1_048_576, (1024 + FD_RESERVE, 1024)),  # raised to fit
        (1024, 65536, 65536, (65536, 1024)),  # already enough: left alone
        (1024, 1024, 1024, (1024, 1024 - FD_RESERVE)),  # the hard limit caps it
        (1024, 1024, resource.RLIM_INFINITY, (1024 + FD_RESERVE, 1024)),
        (1024, 256, 256, (256, 8)),  # never below a handful
    ],
)
def test_descriptor_budget(wanted: int, soft: int, hard: int, expected: tuple[int, int]) -> None:
    assert connection_budget(wanted, soft, hard) == expected


@pytest.mark.parametrize("status", [408, 503])
def test_raw_refusals_are_complete_http_answers_that_close(status: int) -> None:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(raw_response(status, "Why", "too_many", 'limit "x" reached'))
    response = conn.next_event()
    assert isinstance(response, h11.Response) and response.status_code == status
    headers = dict(response.headers)
    assert headers[b"connection"] == b"close"
    assert (b"retry-after" in headers) == (status == 503)
    body = conn.next_event()
    assert isinstance(body, h11.Data) and b'limit \\"x\\" reached' in body.data
    assert isinstance(conn.next_event(), h11.EndOfMessage)


def test_connection_settings_are_read_from_the_environment_and_secrets_stay_hidden(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KERNELHUB_GATEWAY__ALLOWED_ORIGINS", '["https://app.example.com"]')
    monkeypatch.setenv("KERNELHUB_GATEWAY__METRICS_TOKEN", "kh_scraper-secret")
    monkeypatch.setenv("KERNELHUB_GATEWAY__MAX_STREAMS_PER_SESSION", "3")
    gateway = load_settings().gateway
    assert gateway.allowed_origins == ["https://app.example.com"]
    assert gateway.max_streams_per_session == 3
    assert gateway.metrics_token is not None
    assert gateway.metrics_token.get_secret_value() == "kh_scraper-secret"
    assert "kh_scraper-secret" not in repr(load_settings())
