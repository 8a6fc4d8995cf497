"""The REST routes, auth, the review page's sign-in and /metrics, through the real app
(its lifespan, a real SqliteStore in a temporary data directory, the local backend, which
starts nothing here). Tokens and session rows are written before the gateway starts; no
request reaches a kernel."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from kernelhub.config import Settings
from kernelhub.gateway.auth import CSRF_HEADER, SESSION_COOKIE
from kernelhub.store.records import AuditEntry
from kernelhub.store.sqlite import SqliteStore
from tests.unit.gateway.app_rig import Gateway, row, serve

METRICS_SECRET = "scrape-me-please"
AUDITS = 5  # audit rows seeded for alice's session "dead1"


async def _seed(store: SqliteStore) -> dict[str, str]:
    tokens = {
        "admin": await store.create_token("root", admin=True),
        "alice": await store.create_token("alice"),
        "bob": await store.create_token("bob"),
        "reader": await store.create_token("alice-ro", read_only=True, acts_for="alice"),
        "scoped": await store.create_token("alice-one", session_id="dead1", acts_for="alice"),
        "expired": await store.create_token(
            "alice-old", expires_at=datetime.now(UTC) - timedelta(hours=1), acts_for="alice"
        ),
    }
    for sid, owner in (
        ("dead1", "alice"),
        ("dead2", "alice"),
        ("dead3", "alice"),
        ("bobs1", "bob"),
    ):
        await store.insert_session(row(sid, owner))
        await store.update_session(sid, state="dead", reason="the kernel died (exit 137)")
    for i in range(AUDITS):
        await store.audit(
            AuditEntry(principal="alice", action=f"probe_{i % 2}", session_id="dead1",
                       detail={"n": i, "word": "needle" if i == 3 else "hay"})
        )  # fmt: skip
    return tokens


def _with_metrics_token(settings: Settings) -> None:
    settings.gateway.metrics_token = SecretStr(METRICS_SECRET)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    yield from serve(tmp_path_factory, _seed, _with_metrics_token)


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_health_and_readiness(gateway: Gateway) -> None:
    client, _ = gateway
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert (ready.status_code, ready.json()) == (200, {"ready": True})


@pytest.mark.parametrize(
    ("header", "needle"),
    [
        (None, "missing bearer token"),
        ("Basic abc", "missing bearer token"),
        ("Bearer kh_not_a_token", "unknown or revoked token"),
        ("Bearer {expired}", "'alice-old' expired at"),  # names the token and its expiry
    ],
)
def test_refused_without_a_valid_token(gateway: Gateway, header: str | None, needle: str) -> None:
    client, tokens = gateway
    headers = {} if header is None else {"Authorization": header.format(**tokens)}
    r = client.get("/v1/whoami", headers=headers)
    assert r.status_code == 401
    assert needle in r.json()["message"]


def test_whoami_names_the_principal(gateway: Gateway) -> None:
    client, tokens = gateway
    assert client.get("/v1/whoami", headers=_auth(tokens["alice"])).json()["name"] == "alice"
    body = client.get("/v1/whoami", headers=_auth(tokens["scoped"])).json()
    assert (body["name"], body["session_id"]) == ("alice", "dead1")


def test_sessions_are_listed_per_owner(gateway: Gateway) -> None:
    client, tokens = gateway

    def ids(token: str, path: str = "/v1/sessions") -> set[str]:
        r = client.get(path, headers=_auth(token))
        assert r.status_code == 200, r.text
        return {s["id"] for s in r.json()["sessions"]}

    assert ids(tokens["alice"]) >= {"dead1", "dead2"}
    assert "bobs1" not in ids(tokens["alice"])
    assert ids(tokens["bob"]) == {"bobs1"}
    assert ids(tokens["scoped"]) == {"dead1"}  # a one-session token sees its one
    assert ids(tokens["admin"], "/v1/admin/sessions") >= {"dead1", "dead2", "bobs1"}


@pytest.mark.parametrize("who", ["bob", "scoped"])
def test_another_owners_session_is_not_found(gateway: Gateway, who: str) -> None:
    client, tokens = gateway
    sid = "dead2" if who == "scoped" else "dead1"
    r = client.get(f"/v1/sessions/{sid}", headers=_auth(tokens[who]))
    assert r.status_code == 404, r.text


def test_a_dead_session_reads_as_dead_with_its_reason(
    gateway: Gateway,
) -> None:
    client, tokens = gateway
    body = client.get("/v1/sessions/dead1", headers=_auth(tokens["alice"])).json()
    assert (body["state"], body["owner"]) == ("dead", "alice")
    assert "exit 137" in (body.get("reason") or "")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("DELETE", "/v1/sessions/dead1"),
        ("POST", "/v1/sessions/dead1/pause"),
        ("POST", "/v1/sessions"),
        ("POST", "/v1/batches"),
    ],
)
def test_a_read_only_token_may_not_act(gateway: Gateway, method: str, path: str) -> None:
    client, tokens = gateway
    r = client.request(method, path, headers=_auth(tokens["reader"]), json={})
    assert r.status_code == 403, r.text
    assert "read-only" in r.json()["message"]


def test_a_scoped_token_is_refused_routes_on_no_one_session(
    gateway: Gateway,
) -> None:
    client, tokens = gateway
    r = client.get("/v1/snapshots", headers=_auth(tokens["scoped"]))
    assert r.status_code == 403
    assert "scoped to session 'dead1'" in r.json()["message"]


def test_admin_routes_need_an_admin(gateway: Gateway) -> None:
    client, tokens = gateway
    for path in ("/v1/admin/sessions", "/v1/admin/audit"):
        r = client.get(path, headers=_auth(tokens["alice"]))
        assert r.status_code == 403, (path, r.text)
        assert "admin" in r.json()["message"]


def test_audit_pages_newest_first_and_filters(
    gateway: Gateway,
) -> None:
    client, tokens = gateway
    headers = _auth(tokens["admin"])
    seen: list[int] = []
    before: int | None = None
    for _ in range(AUDITS):  # pages of 2 until no next_before
        params: dict[str, str | int] = {"session_id": "dead1", "principal": "alice", "limit": 2}
        if before is not None:
            params["before"] = before
        page = client.get("/v1/admin/audit", headers=headers, params=params).json()
        seen += [
            json.loads(e["detail"])["n"]
            for e in page["entries"]
            if e["action"].startswith("probe_")
        ]
        before = page["next_before"]
        if before is None:
            break
    assert seen == sorted(range(AUDITS), reverse=True)
    one = client.get("/v1/admin/audit", headers=headers, params={"action": "probe_1"}).json()
    assert sorted(json.loads(e["detail"])["n"] for e in one["entries"]) == [1, 3]
    found = client.get("/v1/admin/audit", headers=headers, params={"text": "needle"}).json()
    assert [json.loads(e["detail"])["n"] for e in found["entries"]] == [3]
    r = client.get("/v1/admin/audit", headers=headers, params={"limit": 0})
    assert r.status_code == 422


def test_an_admin_mints_a_scoped_token_that_works_and_is_audited(
    gateway: Gateway,
) -> None:
    client, tokens = gateway
    body = {"name": "alice-browser", "read_only": True, "session_id": "dead2", "expires_in": 3600}
    r = client.post("/v1/admin/tokens", headers=_auth(tokens["admin"]), json=body)
    assert r.status_code == 201, r.text
    minted = r.json()["token"]
    me = client.get("/v1/whoami", headers=_auth(minted)).json()
    assert (me["name"], me["read_only"], me["session_id"]) == ("alice", True, "dead2")
    assert client.delete("/v1/sessions/dead2", headers=_auth(minted)).status_code == 403
    log = client.get(
        "/v1/admin/audit", headers=_auth(tokens["admin"]), params={"action": "token_create"}
    ).json()["entries"]
    assert any(e["session_id"] == "dead2" and e["principal"] == "root" for e in log)


def test_execution_lookups_of_unknown_ids_are_not_found(
    gateway: Gateway,
) -> None:
    client, tokens = gateway
    for method, path in [
        ("GET", "/v1/executions/nope"),
        ("POST", "/v1/executions/nope/cancel"),
        ("GET", "/v1/batches/nope"),
    ]:
        r = client.request(method, path, headers=_auth(tokens["alice"]))
        assert r.status_code == 404, (path, r.text)


def test_the_notebook_of_a_dead_session_exports(
    gateway: Gateway,
) -> None:
    client, tokens = gateway
    r = client.get("/v1/sessions/dead1/notebook", headers=_auth(tokens["reader"]))
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ipynb+json")
    assert 'filename="dead1.ipynb"' in r.headers["content-disposition"]
    assert r.json()["nbformat"] == 4
    html = client.get(
        "/v1/sessions/dead1/notebook", headers=_auth(tokens["alice"]), params={"format": "html"}
    )
    assert html.headers["content-type"].startswith("text/html")
    assert "<script" not in html.text.lower()
    bad = client.get(
        "/v1/sessions/dead1/notebook", headers=_auth(tokens["alice"]), params={"format": "pdf"}
    )
    assert bad.status_code == 422
    other = client.get("/v1/sessions/bobs1/notebook", headers=_auth(tokens["alice"]))
    assert other.status_code == 404


def test_metrics_totals_for_any_token_sessions_for_admins(
    gateway: Gateway,
) -> None:
    client, tokens = gateway
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=_auth("wrong-secret")).status_code == 401
    for token in (METRICS_SECRET, tokens["alice"]):
        r = client.get("/metrics", headers=_auth(token))
        assert r.status_code == 200
        assert "kernelhub_sessions{" in r.text and "kernelhub_pool_size" in r.text
        assert "kernelhub_sandbox_cpu_seconds" not in r.text
    admin = client.get("/metrics", headers=_auth(tokens["admin"])).text
    assert "kernelhub_sandbox_cpu_seconds" in admin
    dead = [
        line for line in admin.splitlines() if line.startswith('kernelhub_sessions{state="dead"}')
    ]
    assert dead, admin
    assert float(dead[0].split()[-1]) >= 0


def test_the_review_page_carries_its_policy(gateway: Gateway) -> None:
    client, _ = gateway
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY"


def test_cookie_sign_in_needs_csrf_to_act_and_ends_on_sign_out(
    gateway: Gateway,
) -> None:
    client, tokens = gateway
    assert client.post("/v1/auth/session", json={"token": "kh_bogus"}).status_code == 401
    r = client.post("/v1/auth/session", json={"token": tokens["bob"]})
    assert r.status_code == 201, r.text
    signed = r.json()
    assert signed["principal"]["name"] == "bob"
    cookie = r.cookies[SESSION_COOKIE]
    assert cookie != tokens["bob"]  # the token itself never becomes the cookie
    jar = {SESSION_COOKIE: cookie}
    browser = TestClient(client.app, cookies=jar)
    assert browser.get("/v1/whoami").json()["name"] == "bob"
    # Acting by cookie without (or with a wrong) CSRF header is refused before anything runs.
    for headers in ({}, {CSRF_HEADER: "guess"}):
        refused = browser.delete("/v1/sessions/bobs1", headers=headers)
        assert refused.status_code == 403, refused.text
        assert CSRF_HEADER in refused.json()["message"]
    assert browser.delete("/v1/auth/session").status_code == 403  # sign-out needs it too
    out = browser.delete("/v1/auth/session", headers={CSRF_HEADER: signed["csrf_token"]})
    assert out.status_code == 204
    after = TestClient(client.app, cookies=jar).get("/v1/whoami")
    assert after.status_code == 401
    assert "sign-in has ended" in after.json()["message"]


def test_sign_in_with_the_bearer_header(gateway: Gateway) -> None:
    client, tokens = gateway
    r = client.post("/v1/auth/session", headers=_auth(tokens["alice"]), json={})
    assert r.status_code == 201
    assert r.json()["principal"]["name"] == "alice"
    assert r.headers["cache-control"] == "no-store"
    assert client.post("/v1/auth/session", json={}).status_code == 401


def test_a_scoped_token_reaches_executions_of_its_session_only(
    gateway: Gateway,
) -> None:
    client, tokens = gateway
    # Unknown execution: the scope falls back to the token's own session, the route says 404.
    for who in ("scoped", "reader"):
        r = client.get("/v1/executions/nope", headers=_auth(tokens[who]))
        assert r.status_code == 404, r.text
    r = client.post("/v1/executions/nope/interrupt", headers=_auth(tokens["reader"]))
    assert r.status_code == 403 and "read-only" in r.json()["message"]


def test_empty_lists_and_unknown_snapshots_and_batches(
    gateway: Gateway,
) -> None:
    client, tokens = gateway
    h = _auth(tokens["bob"])
    assert client.get("/v1/snapshots", headers=h).json() == {"snapshots": []}
    assert client.get("/v1/batches", headers=h).json() == {"batches": []}
    assert client.delete("/v1/snapshots/nope", headers=h).status_code == 404
    assert client.post("/v1/batches/nope/cancel", headers=h).status_code == 404


def test_deleting_a_dead_session_with_purge_ends_it(
    gateway: Gateway,
) -> None:
    client, tokens = gateway
    h = _auth(tokens["alice"])
    assert client.delete("/v1/sessions/dead3", headers=_auth(tokens["bob"])).status_code == 404
    r = client.delete("/v1/sessions/dead3", headers=h, params={"purge": "true"})
    assert r.status_code == 204, r.text
    after = client.get("/v1/sessions/dead3", headers=h)
    assert after.status_code == 404, after.text  # purged: not even its row is kept
    assert "dead3" not in {
        s["id"] for s in client.get("/v1/sessions", headers=h).json()["sessions"]
    }
    log = client.get(
        "/v1/admin/audit", headers=_auth(tokens["admin"]), params={"session_id": "dead3"}
    ).json()["entries"]
    assert log and log[0]["principal"] == "alice"


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"name": "x1", "admin": True, "read_only": True}, 400, "admin token cannot be"),
        ({"name": "x2", "session_id": "nope"}, 404, "'nope'"),
        ({"name": "x3", "session_id": "dead1", "owner": "bob"}, 400, "belongs to 'alice'"),
        ({"name": "alice"}, 409, "'alice' exists"),
    ],
)
def test_minting_refusals(
    gateway: Gateway, body: dict[str, object], status: int, needle: str
) -> None:
    client, tokens = gateway
    r = client.post("/v1/admin/tokens", headers=_auth(tokens["admin"]), json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["message"]


def test_a_body_over_the_limit_is_refused_before_it_is_read(gateway: Gateway) -> None:
    client, tokens = gateway
    limit = client.app.state.settings.gateway.max_body_bytes  # type: ignore[attr-defined]
    big = json.dumps({"code": "x" * (limit + 1)})
    r = client.post("/v1/sessions/dead1/executions", content=big, headers=_auth(tokens["alice"]))
    assert r.status_code == 413, r.text
    assert r.json()["error"] == "too_large" and "KERNELHUB_GATEWAY__MAX_BODY_BYTES" in r.text
    bad = {**_auth(tokens["alice"]), "Content-Length": "many"}
    r = client.post("/v1/sessions/dead1/executions", content=b"{}", headers=bad)
    assert r.status_code == 400 and "Content-Length" in r.text
    # Under the limit the route answers (a dead session: 410), the middleware let it pass.
    r = client.post(
        "/v1/sessions/dead1/executions", json={"code": "1"}, headers=_auth(tokens["alice"])
    )
    assert r.status_code == 410, r.text
