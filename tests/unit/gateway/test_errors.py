"""What the gateway answers to bodies it cannot read: the real app over ASGI, with a real
store for the tokens, and no backend (nothing here reaches a session)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kernelhub.config import Settings
from kernelhub.errors import StoreConflictError
from kernelhub.gateway.app import create_app
from kernelhub.gateway.errors import json_problem, status_for
from kernelhub.store.sqlite import SqliteStore
from kernelhub.wire import ErrorBody, request_id_of


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    app = create_app(Settings())
    store = await SqliteStore.open(tmp_path / "kh.sqlite3")
    app.state.store = store
    token = await store.create_token("alice")
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield http, token
    finally:
        await store.close()


def error_body(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == set(ErrorBody.model_fields), body
    return dict(body)


@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/v1/sessions", "application/x-www-form-urlencoded"),
        ("/v1/sessions/s1/executions", "application/x-www-form-urlencoded"),
        ("/v1/batches", "text/plain"),
        ("/v1/sessions", None),
    ],
)
async def test_a_body_that_is_not_json_is_415_send_application_json(
    client: tuple[httpx.AsyncClient, str], path: str, content_type: str | None
) -> None:
    http, token = client
    headers = {"Authorization": f"Bearer {token}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    r = await http.post(path, content=b"code=print(1)", headers=headers)
    assert r.status_code == 415, r.text
    body = error_body(r)
    assert body["error"] == "unsupported_media_type"
    assert body["message"].startswith("send application/json")
    assert (content_type or "no Content-Type") in body["message"]


async def test_a_form_from_httpx_data_is_415(client: tuple[httpx.AsyncClient, str]) -> None:
    http, token = client
    r = await http.post(
        "/v1/sessions", data={"code": "1"}, headers={"Authorization": f"Bearer {token}"}
    )
    assert r.status_code == 415 and "send application/json" in r.json()["message"]


@pytest.mark.parametrize(
    "text",
    ['{"limits": {} "metadata": {}}', '{\n  "code": "1",\n  "wait": tru\n}', "", "{"],
)
async def test_malformed_json_is_422_with_the_parsers_reason_line_and_column(
    client: tuple[httpx.AsyncClient, str], text: str
) -> None:
    http, token = client
    r = await http.post(
        "/v1/sessions",
        content=text.encode() or b" ",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    assert r.status_code == 422, r.text
    body = error_body(r)
    with pytest.raises(json.JSONDecodeError) as parsed:
        json.loads(text or " ")
    e = parsed.value
    expected = f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
    assert body["error"] == "invalid_request"
    assert body["message"] == expected
    assert body["detail"] == [{"field": "body", "problem": expected}]


async def test_a_valid_body_with_a_wrong_field_still_names_the_field(
    client: tuple[httpx.AsyncClient, str],
) -> None:
    http, token = client
    r = await http.post(
        "/v1/sessions", json={"limts": {}}, headers={"Authorization": f"Bearer {token}"}
    )
    assert r.status_code == 422
    assert error_body(r)["message"] == "fix the request: limts: Extra inputs are not permitted"


async def test_a_non_bearer_scheme_is_our_401_not_fastapis_403(
    client: tuple[httpx.AsyncClient, str],
) -> None:
    http, _ = client
    r = await http.get("/v1/sessions", headers={"Authorization": "Basic eDp5"})
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    assert "kernelhub token create" in error_body(r)["message"]


async def test_the_frame_schema_is_served_without_a_token(
    client: tuple[httpx.AsyncClient, str],
) -> None:
    http, _ = client
    r = await http.get("/v1/ws-schema.json")
    assert r.status_code == 200 and "ClientFrame" in r.json()["$defs"]


def test_json_problem_without_the_document_still_gives_the_reason() -> None:
    assert json_problem(None, None, "Expecting value") == (
        "request body is not valid JSON: Expecting value"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"type": "execute", "timeout": -1, "request_id": "r1"}', "r1"),
        ('{"type": "nope", "request_id": "r2"}', "r2"),
        ('{"request_id": "r3"}', "r3"),
        ('{"type": "execute", "request_id": 7}', None),
        ('{"type": "ping", "request_id": "' + "x" * 201 + '"}', None),
        ('["request_id", "r4"]', None),
        ("not json", None),
        ('{"request_id": "r5", ', None),
    ],
)
def test_request_id_of_reads_a_bad_frame_leniently(text: str, expected: str | None) -> None:
    assert request_id_of(text) == expected


async def test_a_closed_store_is_503_store_unavailable_and_a_taken_name_409(
    tmp_path: Path,
) -> None:
    app = create_app(Settings())
    store = await SqliteStore.open(tmp_path / "kh.sqlite3")
    app.state.store = store
    token = await store.create_token("alice")
    with pytest.raises(StoreConflictError) as taken:
        await store.create_token("alice")
    assert status_for(taken.value) == (409, "conflict")
    await store.close()  # as while the gateway stops
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        r = await http.get("/v1/sessions", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 503, r.text
    assert error_body(r)["error"] == "store_unavailable"
    assert "closed" in error_body(r)["message"]
