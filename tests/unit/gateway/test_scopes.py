"""Scoped tokens, the sign-in cookie and its CSRF token, and CORS: the pure decisions in
gateway/auth.py and tokens.py, the store's sign-in table, and the app's preflight answers
(built, never started: the middleware answers before any route or store)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from kernelhub.config import Settings
from kernelhub.errors import AuthError, ForbiddenError, InvalidRequestError, NotFoundError
from kernelhub.gateway.app import create_app
from kernelhub.gateway.auth import authenticate, check_csrf, check_scope
from kernelhub.store.records import Principal, StoredSession
from kernelhub.store.sqlite import SqliteStore
from kernelhub.tokens import TokenCreate, mint, parse_duration

VIEWER = Principal(name="alice", read_only=True, session_id="s1", token="viewer")


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = await SqliteStore.open(tmp_path / "kh.sqlite3")
    yield s
    await s.close()


@pytest.mark.parametrize(
    ("principal", "act", "session_id", "extra", "refused"),
    [
        (Principal(name="alice"), True, "s2", False, None),  # unscoped: the owner check decides
        (Principal(name="alice"), True, None, False, None),
        (VIEWER, False, "s1", False, None),  # view its own session
        (VIEWER, True, "s1", False, ForbiddenError),  # but not act on it
        (VIEWER, False, "s2", False, NotFoundError),  # another session: as if it did not exist
        (VIEWER, False, None, False, ForbiddenError),  # a route on no session (snapshots...)
        (VIEWER, False, None, True, None),  # GET /v1/sessions, /v1/whoami: filtered to it
        (Principal(name="a", session_id="s1"), True, "s1", False, None),  # scoped, may act
        (Principal(name="a", session_id="s1"), True, "s2", False, NotFoundError),
        (Principal(name="a", read_only=True), False, "s9", False, None),  # read-only, any own
        (Principal(name="a", read_only=True), True, None, False, ForbiddenError),
    ],
)
def test_the_scope_check_per_route_class(
    principal: Principal,
    act: bool,
    session_id: str | None,
    extra: bool,
    refused: type[Exception] | None,
) -> None:
    if refused is None:
        check_scope(principal, act=act, session_id=session_id, extra=extra)
    else:
        with pytest.raises(refused) as info:
            check_scope(principal, act=act, session_id=session_id, extra=extra)
        if refused is ForbiddenError and principal.read_only and act:
            assert "read-only" in str(info.value) and (principal.token or principal.name) in str(
                info.value
            )


def test_csrf_needs_the_exact_token() -> None:
    check_csrf("abc123", "abc123")
    for sent in (None, "", "abc12", "abc1234", "ABC123"):
        with pytest.raises(ForbiddenError, match="wrong x-csrf-token header"):
            check_csrf(sent, "abc123")


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("90s", 90), ("15m", 900), ("2h", 7200), ("7d", 604800),
                          ("1.5h", 5400), (" 2H ", 7200)]
)  # fmt: skip
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "2 hours", "-1h", "0", "2w"])
def test_bad_durations_name_the_value_and_an_example(text: str) -> None:
    with pytest.raises(InvalidRequestError, match=r"e\.g\. 90s, 15m, 2h"):
        parse_duration(text)


def test_a_principal_expires_at_its_moment() -> None:
    at = datetime(2030, 1, 1, tzinfo=UTC)
    p = Principal(name="a", expires_at=at)
    assert not p.expired(at - timedelta(seconds=1)) and p.expired(at)
    assert not Principal(name="a").expired()


async def _session(store: SqliteStore, sid: str, owner: str) -> None:
    await store.insert_session(
        StoredSession(id=sid, owner=owner, backend="docker", state="ready",
                      created_at=datetime.now(UTC), limits={}, metadata={}, reason=None,
                      deleted_at=None)
    )  # fmt: skip


async def test_a_session_scoped_token_stands_for_the_sessions_owner(store: SqliteStore) -> None:
    await _session(store, "s1", "alice")
    minted = await mint(
        store, TokenCreate(name="viewer", read_only=True, session_id="s1", expires_in=3600)
    )
    assert minted.owner == "alice" and minted.expires_at is not None
    p = await store.principal_for(minted.token)
    assert p is not None
    assert (p.name, p.token, p.read_only, p.session_id) == ("alice", "viewer", True, "s1")
    assert p.expires_at == minted.expires_at
    with pytest.raises(NotFoundError, match="no session 'nope'"):
        await mint(store, TokenCreate(name="v2", session_id="nope"))
    with pytest.raises(InvalidRequestError, match="belongs to 'alice', not 'bob'"):
        await mint(store, TokenCreate(name="v3", session_id="s1", owner="bob"))
    with pytest.raises(InvalidRequestError, match="admin token cannot be read-only"):
        await mint(store, TokenCreate(name="v4", admin=True, read_only=True))


async def test_an_expired_token_is_refused_naming_its_expiry(store: SqliteStore) -> None:
    token = await store.create_token("brief", expires_at=datetime(2020, 1, 2, 3, 4, 5, tzinfo=UTC))
    with pytest.raises(AuthError, match=r"token 'brief' expired at 2020-01-02T03:04:05\+00:00"):
        await authenticate(store, token)


async def test_a_sign_in_lasts_its_ttl_and_ends_with_its_token(store: SqliteStore) -> None:
    token = await store.create_token("alice")
    sid, csrf, expires = await store.create_web_session(token, 3600)
    assert sid.startswith("khs_") and token not in sid and len(csrf) >= 24
    assert timedelta(seconds=3590) < expires - datetime.now(UTC) <= timedelta(seconds=3600)
    found = await store.web_session(sid)
    assert found is not None and found[0].name == "alice" and found[1] == csrf
    assert (await store.principal_for(sid)) == found[0]  # the stream and revocation watch
    assert await store.web_session("khs_" + "x" * 43) is None
    await store.revoke_token("alice")
    assert await store.web_session(sid) is None and await store.principal_for(sid) is None


async def test_a_sign_in_never_outlives_its_token_and_sign_out_ends_it(
    store: SqliteStore,
) -> None:
    soon = datetime.now(UTC) + timedelta(seconds=60)
    token = await store.create_token("brief", expires_at=soon)
    sid, _, expires = await store.create_web_session(token, 8 * 3600)
    assert expires == soon
    await store.delete_web_session(sid)
    assert await store.web_session(sid) is None
    sid, _, expires = await store.create_web_session(token, 0.05)
    assert await store.web_session(sid) is not None
    while datetime.now(UTC) <= expires:  # bounded: 50 ms
        await asyncio.sleep(0.01)
    assert await store.web_session(sid) is None  # past its ttl


def _app(origins: list[str]) -> TestClient:
    return TestClient(create_app(Settings(gateway={"allowed_origins": origins})))  # type: ignore[arg-type]


PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type",
}


def test_cors_answers_preflights_for_allowed_origins_only() -> None:
    client = _app(["https://chat.example.com"])
    ok = client.options("/v1/sessions", headers={"Origin": "https://chat.example.com", **PREFLIGHT})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "https://chat.example.com"
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in ok.headers  # bearer only, no cookies
    other = client.options("/v1/sessions", headers={"Origin": "https://evil.example", **PREFLIGHT})
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers
    simple = client.get("/healthz", headers={"Origin": "https://chat.example.com"})
    assert simple.headers["access-control-allow-origin"] == "https://chat.example.com"


def test_cors_is_off_by_default() -> None:
    client = _app([])
    r = client.options("/v1/sessions", headers={"Origin": "https://chat.example.com", **PREFLIGHT})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    own = client.get("/healthz", headers={"Origin": "http://testserver"})
    assert own.status_code == 200 and "access-control-allow-origin" not in own.headers


def test_the_page_is_served_with_its_strict_csp() -> None:
    client = _app([])
    page = client.get("/")
    assert page.status_code == 200 and "/ui/app.js" in page.text
    csp = page.headers["content-security-policy"]
    for part in ("default-src 'self'", "script-src 'self'", "object-src 'none'",
                 "frame-ancestors 'none'"):  # fmt: skip
        assert part in csp
    assert "<script>" not in page.text  # no inline script: only the one file
    assert client.get("/ui/app.js").status_code == 200
    js = client.get("/ui/app.js").text
    assert "innerHTML" not in js and "outerHTML" not in js and "insertAdjacentHTML" not in js
    assert 'sandbox: ""' in js
