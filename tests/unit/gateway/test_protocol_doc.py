"""docs/protocol.md, the OpenAPI document and the WebSocket schema agree with the gateway.

The document's route table is parsed and held against the app's own OpenAPI (every route,
every status, both ways); its error kinds against the one error table; its JSON examples
against the wire models they name. No gateway process: the app is built, never started.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from kernelhub import wire
from kernelhub.client.errors import ApiError, api_error
from kernelhub.config import Settings
from kernelhub.gateway.app import create_app
from kernelhub.gateway.errors import STATUS_TABLE
from kernelhub.gateway.openapi import STREAM_PATH, WS_SCHEMA_PATH

ROOT = Path(__file__).resolve().parents[3]
DOC = (ROOT / "docs" / "protocol.md").read_text()
ROUTE_ROW = re.compile(r"^\| `(GET|POST|PUT|DELETE|PATCH) (/[^`]*)` \|(.*)$", re.M)
STATUS = re.compile(r"`([1-5]\d\d)`")
# Request bodies: an example may leave optional fields out. Everything else is shown whole.
REQUESTS = {"SessionCreate", "ExecutionCreate", "BatchCreate", "RewindRequest"}


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return create_app(Settings()).openapi()


def documented_routes() -> dict[tuple[str, str], set[str]]:
    routes: dict[tuple[str, str], set[str]] = {}
    for method, path, rest in ROUTE_ROW.findall(DOC):
        cells = rest.split(" | ")
        # Columns after the path: body, answers, refusals. A body example may hold a `|`.
        statuses = set(STATUS.findall(" ".join(cells[-2:])))
        assert (method, path) not in routes, f"{method} {path} is in the table twice"
        routes[(method, path)] = statuses
    return routes


def test_the_route_table_lists_every_route_with_exactly_its_statuses(
    spec: dict[str, Any],
) -> None:
    documented = documented_routes()
    served = {
        (method.upper(), path): set(op["responses"])
        for path, ops in spec["paths"].items()
        for method, op in ops.items()
    }
    assert len(documented) > 20  # the table was found and parsed
    assert sorted(set(served) - set(documented)) == [], "routes missing from docs/protocol.md"
    assert sorted(set(documented) - set(served)) == [], "documented routes the app lacks"
    wrong = {
        f"{m} {p}": {"doc": sorted(documented[(m, p)]), "openapi": sorted(served[(m, p)])}
        for (m, p) in served
        if documented[(m, p)] != served[(m, p)]
    }
    assert wrong == {}


def test_every_error_status_of_the_openapi_is_an_error_body(spec: dict[str, Any]) -> None:
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            for status, answer in op["responses"].items():
                if int(status) < 400 or path == "/readyz":
                    continue
                schema = answer["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorBody"}, (method, path, status)


def test_the_kinds_table_is_the_error_table() -> None:
    section = DOC[DOC.index("## Errors") : DOC.index("## The event stream")]
    documented = set(re.findall(r"^\| `(\w+)` \| `(\d{3})` \|", section, re.M))
    mapped = {(code, str(status)) for _, status, code in STATUS_TABLE}
    # Answered outside the table: an admin route's AuthError, Starlette's 405, FastAPI's 422.
    mapped |= {("forbidden", "403"), ("method_not_allowed", "405"), ("invalid_request", "422")}
    assert documented == mapped


def json_examples() -> list[tuple[str, dict[str, Any]]]:
    """(model name, example) for each ```json block introduced by a line naming a model."""
    found = []
    pattern = re.compile(r"^`(\w+)`(?:(?!\n\n).)*?:\n\n```json\n(.*?)\n```", re.M | re.S)
    for name, body in pattern.findall(DOC):
        if isinstance(getattr(wire, name, None), type):
            found.append((name, json.loads(body)))
    return found


def test_every_documented_body_has_the_fields_of_its_model() -> None:
    examples = json_examples()
    names = {name for name, _ in examples}
    assert {"SessionInfo", "SnapshotInfo", "RestoreReport", "RewindReport", "BatchInfo"} <= names
    for name, example in examples:
        model: type[BaseModel] = getattr(wire, name)
        fields = set(model.model_fields)
        if name in REQUESTS:
            assert set(example) <= fields, name
        else:
            assert set(example) == fields, (name, sorted(set(example) ^ fields))
        if "..." not in json.dumps(example):
            model.model_validate(example)


def test_the_documented_error_body_is_the_error_model() -> None:
    section = DOC[DOC.index("## Errors") :]
    example = json.loads(re.search(r"```json\n(.*?)\n```", section, re.S).group(1))  # type: ignore[union-attr]
    assert set(example) == set(wire.ErrorBody.model_fields)
    wire.ErrorBody.model_validate(example)


def test_the_documented_session_states_are_the_states() -> None:
    section = DOC[DOC.index("`state` is one of") :]
    table = re.findall(r"^\| `(\w+)` \| ", section[section.index("|---|") :], re.M)
    assert table[: len(wire.SessionState)] == [s.value for s in wire.SessionState]


def test_openapi_declares_the_bearer_scheme_on_authenticated_routes(
    spec: dict[str, Any],
) -> None:
    assert spec["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "a kernelhub token (`kernelhub token create --name NAME`)",
    }
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            authenticated = "401" in op["responses"] or path == STREAM_PATH
            assert (op.get("security") == [{"HTTPBearer": []}]) == authenticated, (method, path)


def test_openapi_describes_the_websocket(spec: dict[str, Any]) -> None:
    stream = spec["paths"][STREAM_PATH]["get"]
    assert set(stream["responses"]) == {"101"}
    assert WS_SCHEMA_PATH in stream["description"] and "4410" in stream["description"]
    assert STREAM_PATH in spec["info"]["description"]
    assert WS_SCHEMA_PATH in spec["info"]["description"]


def test_the_committed_frame_schema_is_the_generated_one() -> None:
    committed = (ROOT / "docs" / "ws-frames.schema.json").read_text()
    assert committed == wire.frames_json_schema_text(), "run scripts/ws_schema"
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "ws_schema"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stderr


def test_the_frame_schema_names_every_frame_and_close_code() -> None:
    schema = wire.frames_json_schema()
    client = schema["$defs"]["ClientFrame"]["discriminator"]["mapping"]
    server = schema["$defs"]["ServerFrame"]["discriminator"]["mapping"]
    sent = set(re.findall(r'\{"type": "(\w+)"', DOC))
    assert set(client) | set(server) <= sent | {"event"}
    assert {"execute", "interrupt", "input_reply", "ping", "pause", "resume"} <= set(client)
    assert {"hello", "event", "accepted", "pong", "error", "rewound"} <= set(server)
    for name in ("ExecuteFrame", "HelloFrame", "ErrorFrame"):
        assert schema["$defs"][name]["required"][0] == "type" or name == "ExecuteFrame"
    assert schema["x-close-codes"]["SESSION_ENDED"] == 4410
    assert schema["x-protocol"] == wire.PROTOCOL_VERSION


def frame_validator(kind: str) -> jsonschema.Draft202012Validator:
    schema = wire.frames_json_schema()
    return jsonschema.Draft202012Validator(
        {"$ref": f"#/$defs/{kind}", "$defs": schema["$defs"]},
        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER,
    )


def test_the_documented_frames_are_valid_by_the_schema() -> None:
    section = DOC[DOC.index("## The event stream") : DOC.index("### Refusals and close codes")]
    frames = [json.loads(b) for b in re.findall(r"```json\n(\{.*?\})\n```", section, re.S)]
    client, server = frame_validator("ClientFrame"), frame_validator("ServerFrame")
    kinds = wire.frames_json_schema()["$defs"]["ClientFrame"]["discriminator"]["mapping"]
    assert len(frames) >= 6
    for frame in frames:
        validator = client if frame["type"] in kinds else server
        errors = [e.message for e in validator.iter_errors(frame)]
        assert errors == [], frame


def test_the_schema_agrees_with_the_models_on_good_and_bad_frames() -> None:
    client, server = frame_validator("ClientFrame"), frame_validator("ServerFrame")
    adapter: TypeAdapter[Any] = TypeAdapter(wire.ClientFrame)
    for frame in [
        {"type": "execute", "code": "1", "timeout": 2.5, "request_id": "r"},
        {"type": "rewind", "before_cell": 2},
        {"type": "input_reply", "execution_id": "e", "value": "v"},
    ]:
        assert client.is_valid(frame) and adapter.validate_python(frame)
    for frame in [
        {"type": "execute", "code": "1", "timeout": -1},
        {"type": "execute"},
        {"type": "execute", "code": "1", "colour": "red"},
        {"type": "rewind", "before_cell": 0},
        {"type": "teleport"},
        {"type": "ping", "request_id": "x" * 201},
    ]:
        assert not client.is_valid(frame), frame
        with pytest.raises(ValidationError):
            adapter.validate_python(frame)
    sent = [
        wire.HelloFrame(session_id="s", last_seq=3),
        wire.AcceptedFrame(request_id="r", execution_id="e"),
        wire.ErrorFrame(request_id=None, error="invalid_frame", message="m"),
        wire.PongFrame(),
    ]
    for frame in sent:
        assert server.is_valid(json.loads(frame.model_dump_json())), frame
    assert not server.is_valid({"session_id": "s", "last_seq": 3})  # no type


def test_the_sdk_reads_every_kind_and_status_the_gateway_answers() -> None:
    # On the socket an error frame has only its kind: it must mean what the status means.
    for _, status, kind in [
        *STATUS_TABLE,
        (None, 403, "forbidden"),
        (None, 422, "invalid_request"),
    ]:
        by_status = type(api_error(status, kind, "m"))
        assert by_status is not ApiError, (status, kind)
        assert type(api_error(None, kind, "m")) is by_status, (status, kind)
