"""How the stream endpoint and the session routes refuse, with the real app (its
lifespan, a real SqliteStore in a temporary data directory, the local backend, which
starts nothing here: no request reaches a kernel). Sessions are rows written before
the gateway starts: one dead, one deleted, one of another owner's; and their snapshots."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketDenialResponse, WebSocketTestSession
from starlette.websockets import WebSocketDisconnect

from kernelhub.config import Settings, load_settings
from kernelhub.gateway.app import create_app
from kernelhub.snapshot.blobs import BlobStore
from kernelhub.store.records import StoredSession, StoredSnapshot
from kernelhub.store.sqlite import SqliteStore
from kernelhub.wire import CloseCode
from tests.conftest import UNIT


def _row(sid: str, owner: str, state: str) -> StoredSession:
    return StoredSession(
        id=sid, owner=owner, backend="local", state=state, created_at=datetime.now(UTC),
        limits={}, metadata={}, reason="the kernel died (exit 137)" if state == "dead" else None,
        deleted_at=None,
    )  # fmt: skip


# (id, owner, session, kind): a user's snapshot, an internal one, another owner's.
SNAPSHOTS = [
    ("snap-a", "alice", "dead1", "snapshot"),
    ("hib-a", "alice", "dead1", "hibernation"),
    ("snap-b", "bob", "bobs1", "snapshot"),
]


async def _seed(settings: Settings) -> dict[str, str]:
    store = await SqliteStore.open(settings.data_dir / "kernelhub.sqlite3")
    try:
        tokens = {
            "alice": await store.create_token("alice"),
            "bob": await store.create_token("bob"),
            "reader": await store.create_token("reader", read_only=True),
        }
        await store.insert_session(_row("dead1", "alice", "ready"))
        await store.update_session("dead1", state="dead", reason="the kernel died (exit 137)")
        await store.insert_session(_row("gone1", "alice", "ready"))
        await store.update_session("gone1", state="deleted", deleted=True)
        await store.insert_session(_row("bobs1", "bob", "ready"))
        await store.update_session("bobs1", state="dead", reason="oom")
        blobs = BlobStore(settings.data_dir)
        for snap_id, owner, sid, kind in SNAPSHOTS:
            blobs.path(snap_id).parent.mkdir(parents=True, exist_ok=True)
            blobs.path(snap_id).write_bytes(b"blob")
            await store.insert_snapshot(
                StoredSnapshot(
                    id=snap_id, session_id=sid, owner=owner, created_at=datetime.now(UTC),
                    size=4, sha256="0", mac="0", metadata={"kind": kind},
                )
            )  # fmt: skip
        return tokens
    finally:
        await store.close()


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[TestClient, dict[str, str]]]:
    data = tmp_path_factory.mktemp("gw") / "data"
    data.mkdir()
    settings = load_settings(backend="local", data_dir=data, run_dir=data.parent / "run")
    tokens = asyncio.run(_seed(settings))
    with TestClient(create_app(settings)) as client:
        yield client, tokens


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _closed(client: TestClient, path: str, token: str | None) -> tuple[int, str]:
    """How the stream at ``path`` ends: its close code and reason, or the HTTP status and
    message of a refused handshake. Fails if it is still open after a few seconds."""
    headers = _auth(token) if token else {}
    got: list[tuple[int, str]] = []

    def read(ws: WebSocketTestSession) -> None:
        try:
            while True:
                ws.receive_text()
        except WebSocketDisconnect as exc:
            got.append((exc.code, exc.reason))
        except Exception:  # the test gave up and closed it: nothing to report
            pass

    try:
        with client.websocket_connect(path, headers=headers) as ws:
            reader = threading.Thread(target=read, args=(ws,), daemon=True)
            reader.start()
            reader.join(2 * UNIT)
            assert got, f"{path}: the stream is still open"
    except WebSocketDenialResponse as denied:
        return denied.status_code, denied.json()["message"]
    return got[0]


@pytest.mark.parametrize(
    ("path", "who", "code", "reason"),
    [
        ("/v1/sessions/nope/stream", "alice", CloseCode.NOT_FOUND, "no such session (or not yours)"),
        ("/v1/sessions/bobs1/stream", "alice", CloseCode.NOT_FOUND, "no such session (or not yours)"),
        ("/v1/sessions/gone1/stream", "alice", CloseCode.SESSION_ENDED, "the session has ended; create a new session"),
    ],
)  # fmt: skip
def test_a_stream_of_a_session_that_is_not_there_is_closed_saying_why(
    gateway: tuple[TestClient, dict[str, str]], path: str, who: str, code: int, reason: str
) -> None:
    client, tokens = gateway
    assert _closed(client, path, tokens[who]) == (code, reason)


def test_another_owners_session_and_a_missing_one_look_the_same(
    gateway: tuple[TestClient, dict[str, str]],
) -> None:
    """Ids cannot be probed: bob's session and one that never existed answer alike, over
    REST as over the stream."""
    client, tokens = gateway
    mine = client.get("/v1/sessions/bobs1", headers=_auth(tokens["alice"]))
    never = client.get("/v1/sessions/never", headers=_auth(tokens["alice"]))
    assert mine.status_code == never.status_code == 404
    assert mine.json() == never.json() | {"message": mine.json()["message"]}
    assert "bobs1" in mine.json()["message"] and "never" in never.json()["message"]
    # Bob himself sees his dead session, with its reason.
    own = client.get("/v1/sessions/bobs1", headers=_auth(tokens["bob"]))
    assert own.status_code == 200 and own.json()["state"] == "dead"
    assert own.json()["reason"] == "oom"


@pytest.mark.parametrize("since", ["-1", "x", "1.5"])
def test_a_bad_since_is_a_policy_close(
    gateway: tuple[TestClient, dict[str, str]], since: str
) -> None:
    client, tokens = gateway
    got = _closed(client, f"/v1/sessions/dead1/stream?since={since}", tokens["alice"])
    assert got == (CloseCode.POLICY, "since must be a non-negative integer")


@pytest.mark.parametrize("token", [None, "kh_not-a-token"])
def test_no_token_or_a_wrong_one_is_refused_before_the_handshake(
    gateway: tuple[TestClient, dict[str, str]], token: str | None
) -> None:
    client, _ = gateway
    status, _message = _closed(client, "/v1/sessions/dead1/stream", token)
    assert status == 401


def test_a_dead_sessions_stream_closes_with_4410(
    gateway: tuple[TestClient, dict[str, str]],
) -> None:
    client, tokens = gateway
    code, _reason = _closed(client, "/v1/sessions/dead1/stream", tokens["alice"])
    assert code == CloseCode.SESSION_ENDED


def test_a_dead_session_cannot_run_code_and_says_why(
    gateway: tuple[TestClient, dict[str, str]],
) -> None:
    client, tokens = gateway
    r = client.post(
        "/v1/sessions/dead1/executions", json={"code": "1"}, headers=_auth(tokens["alice"])
    )
    assert r.status_code == 410, r.text
    assert "dead" in r.json()["message"]


def test_a_read_only_token_cannot_create_a_session(
    gateway: tuple[TestClient, dict[str, str]],
) -> None:
    client, tokens = gateway
    r = client.post("/v1/sessions", json={}, headers=_auth(tokens["reader"]))
    assert r.status_code == 403, r.text
    assert r.json()["error"] == "forbidden"


# Every session route, for a session that is not there: (method, path under the session,
# JSON body or None).
SESSION_ROUTES = [
    ("POST", "/pause", None),
    ("POST", "/resume", None),
    ("POST", "/restart", None),
    ("POST", "/snapshots", None),
    ("POST", "/rewind", {"before_cell": 1}),
    ("POST", "/executions", {"code": "1"}),
    ("PUT", "/files/a.txt", None),
    ("GET", "/files/a.txt", None),
]


@pytest.mark.parametrize(("method", "tail", "body"), SESSION_ROUTES)
def test_each_session_route_refuses_others_and_missing_alike_and_the_owner_with_410(
    gateway: tuple[TestClient, dict[str, str]], method: str, tail: str, body: object
) -> None:
    client, tokens = gateway
    alice = _auth(tokens["alice"])

    def call(sid: str) -> tuple[int, str]:
        r = client.request(method, f"/v1/sessions/{sid}{tail}", json=body, headers=alice)
        return r.status_code, r.json()["error"]

    assert call("bobs1") == call("never") == (404, "not_found")
    status, kind = call("dead1")
    assert (status, kind) == (410, "session_ended"), (method, tail)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/admin/sessions"),
        ("POST", "/v1/admin/stop-all"),
        ("GET", "/v1/admin/audit"),
    ],
)
def test_admin_routes_refuse_an_ordinary_token(
    gateway: tuple[TestClient, dict[str, str]], method: str, path: str
) -> None:
    client, tokens = gateway
    r = client.request(method, path, headers=_auth(tokens["alice"]))
    assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text


@pytest.mark.parametrize(
    "path", ["/v1/executions/nope", "/v1/batches/nope", "/v1/sessions/bobs1/notebook"]
)
def test_unknown_executions_batches_and_others_notebooks_are_404(
    gateway: tuple[TestClient, dict[str, str]], path: str
) -> None:
    client, tokens = gateway
    r = client.get(path, headers=_auth(tokens["alice"]))
    assert r.status_code == 404 and r.json()["error"] == "not_found", r.text


def test_whoami_and_the_session_list_are_the_callers_own(
    gateway: tuple[TestClient, dict[str, str]],
) -> None:
    client, tokens = gateway
    me = client.get("/v1/whoami", headers=_auth(tokens["reader"]))
    assert me.status_code == 200 and me.json()["name"] == "reader"
    listed = client.get("/v1/sessions", headers=_auth(tokens["bob"])).json()["sessions"]
    assert [s["id"] for s in listed] == ["bobs1"]


def test_snapshots_are_listed_and_deleted_by_their_owner_only(
    gateway: tuple[TestClient, dict[str, str]],
) -> None:
    """A user sees the snapshots they took (not the internal ones hibernation keeps);
    another owner's is 404 to them, as a missing one is; deleting one's own removes its
    blob too."""
    client, tokens = gateway
    alice, bob = _auth(tokens["alice"]), _auth(tokens["bob"])
    blobs = BlobStore(client.app.state.settings.data_dir)  # type: ignore[attr-defined]

    def listed(headers: dict[str, str]) -> list[str]:
        return [s["id"] for s in client.get("/v1/snapshots", headers=headers).json()["snapshots"]]

    assert listed(alice) == ["snap-a"] and listed(bob) == ["snap-b"]
    for snap_id in ("snap-b", "hib-nope"):
        r = client.delete(f"/v1/snapshots/{snap_id}", headers=alice)
        assert r.status_code == 404 and r.json()["error"] == "not_found", r.text
    assert blobs.path("snap-b").exists() and listed(bob) == ["snap-b"]
    assert client.delete("/v1/snapshots/snap-a", headers=alice).status_code == 204
    assert listed(alice) == [] and not blobs.path("snap-a").exists()
    assert client.delete("/v1/snapshots/snap-a", headers=alice).status_code == 404
