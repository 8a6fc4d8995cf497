"""Request classification with data: every route family of the node's app reaches the
node that owns its session; creates go to placement; the rest to any node."""

from __future__ import annotations

import pytest

from kernelhub.cluster.proxy import sendable_close
from kernelhub.cluster.router import Kind, Target, classify, credential, requested_memory

S = "0123456789abcdef"


@pytest.mark.parametrize(
    ("method", "path", "headers", "target"),
    [
        ("POST", "/v1/sessions", {}, Target(Kind.CREATE)),
        ("POST", "/v1/sessions/", {}, Target(Kind.CREATE)),
        ("GET", "/v1/sessions", {}, Target(Kind.ANY)),
        ("GET", f"/v1/sessions/{S}", {}, Target(Kind.SESSION, S)),
        ("DELETE", f"/v1/sessions/{S}", {}, Target(Kind.SESSION, S)),
        ("GET", f"/v1/sessions/{S}/stream", {}, Target(Kind.SESSION, S)),
        ("PUT", f"/v1/sessions/{S}/files/a/b.txt", {}, Target(Kind.SESSION, S)),
        ("POST", f"/v1/sessions/{S}/executions", {}, Target(Kind.SESSION, S)),
        ("POST", "/v1/executions/e1/interrupt", {}, Target(Kind.EXECUTION, "e1")),
        ("GET", "/v1/executions/e1", {}, Target(Kind.EXECUTION, "e1")),
        ("POST", "/api/kernels", {}, Target(Kind.CREATE)),
        ("GET", "/api/kernels", {}, Target(Kind.ANY)),
        ("GET", "/api/kernels/k-1/channels", {}, Target(Kind.KERNEL, "k-1")),
        ("POST", "/api/kernels/k-1/restart", {}, Target(Kind.KERNEL, "k-1")),
        ("POST", "/e2b/sandboxes", {}, Target(Kind.CREATE)),
        ("POST", "/e2b/v2/sandboxes", {}, Target(Kind.CREATE)),
        ("GET", "/e2b/v2/sandboxes", {}, Target(Kind.ANY)),
        ("DELETE", f"/e2b/sandboxes/{S}", {}, Target(Kind.SESSION, S)),
        ("POST", f"/e2b/v2/sandboxes/{S}/connect", {}, Target(Kind.SESSION, S)),
        ("POST", "/e2b/execute", {"e2b-sandbox-id": S}, Target(Kind.SESSION, S)),
        ("GET", "/e2b/files", {"e2b-sandbox-id": S}, Target(Kind.SESSION, S)),
        (
            "POST",
            "/e2b/filesystem.Filesystem/ListDir",
            {"e2b-sandbox-id": S},
            Target(Kind.SESSION, S),
        ),
        ("POST", "/e2b/execute", {}, Target(Kind.ANY)),  # the node says what is missing
        ("POST", "/v1/batches", {}, Target(Kind.CREATE)),
        ("GET", "/v1/batches/b1", {}, Target(Kind.ANY)),
        ("GET", "/v1/snapshots", {}, Target(Kind.ANY)),
        ("GET", "/v1/admin/sessions", {}, Target(Kind.ANY)),
        ("GET", "/", {}, Target(Kind.ANY)),
        ("GET", "/ui/app.js", {}, Target(Kind.ANY)),
    ],
)
def test_classify(method: str, path: str, headers: dict[str, str], target: Target) -> None:
    assert classify(method, path, headers) == target


@pytest.mark.parametrize(
    ("headers", "query", "token"),
    [
        ({"authorization": "Bearer kh_a"}, "", "kh_a"),
        ({"authorization": "token kh_b"}, "", "kh_b"),  # Jupyter's scheme
        ({"authorization": "Basic eHg="}, "", None),
        ({"x-api-key": "kh_c"}, "", "kh_c"),  # E2B
        ({"e2b-traffic-access-token": "kh_d"}, "", "kh_d"),
        ({}, "since=3&token=kh_e", "kh_e"),
        ({"cookie": "a=1; kh_session=khs_f; kh_csrf=x"}, "", "khs_f"),
        ({}, "", None),
    ],
)
def test_credential_wherever_its_api_puts_it(
    headers: dict[str, str], query: str, token: str | None
) -> None:
    assert credential(headers, query) == token


def test_requested_memory_reads_the_create_body_or_falls_back() -> None:
    assert requested_memory(b'{"limits": {"memory_bytes": 1073741824}}', 5) == 2**30
    for body in (b"", b"not json", b"[]", b'{"limits": 3}', b'{"limits": {"memory_bytes": "x"}}'):
        assert requested_memory(body, 5) == 5


def test_close_codes_pass_through_and_a_vanished_node_says_reconnect() -> None:
    assert [sendable_close(c) for c in (1000, 1008, 4401, 4404, 4410, 1011)] == [
        1000, 1008, 4401, 4404, 4410, 1011,
    ]  # fmt: skip
    assert sendable_close(1006) == 1012
    assert sendable_close(1005) == sendable_close(None) == 1000
