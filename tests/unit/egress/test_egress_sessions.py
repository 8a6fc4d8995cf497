"""The gateway's side of egress (``EgressSessions``): settings checked closed, policies
chosen within what the operator allows, and a bound session's gate answered for real
through its Unix socket, the answers kept in a real SqliteStore row across rebinds and a
restart. The kernel is a stand-in with only what ``bind`` uses: a question's answer and
the session's ipc directory."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from kernelhub.config import EgressPolicy, EgressSettings
from kernelhub.egress.proxy import SOCKET_NAME
from kernelhub.egress.sessions import EgressSessions, check_settings
from kernelhub.errors import ConfigError, ForbiddenError
from kernelhub.execution.engine import KernelSession
from kernelhub.store.records import EgressGrants
from kernelhub.store.sqlite import SqliteStore
from tests.conftest import UNIT
from tests.egress_net import make_ca
from tests.unit.egress.test_sessions import row

WAIT = 10 * UNIT
POLICIES = {
    "open": EgressPolicy(allow=["api.test"], ask=False),
    "ask": EgressPolicy(allow=[]),
    "none": EgressPolicy(allow=[], ask=False),
}


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"default_policy": "nope"}, "KERNELHUB_EGRESS__DEFAULT_POLICY names the egress policy"),
        ({"principal_policies": {"ci": "gone"}}, "KERNELHUB_EGRESS__PRINCIPAL_POLICIES"),
        ({"allowed_policies": {"*": ["open", "x"]}}, "KERNELHUB_EGRESS__ALLOWED_POLICIES"),
        ({"ca_cert_file": Path("/ca.pem")}, "set both KERNELHUB_EGRESS__CA_CERT_FILE"),
        ({"ca_key_file": Path("/ca.key")}, "set both KERNELHUB_EGRESS__CA_CERT_FILE"),
        (
            {"policies": {"h": EgressPolicy(headers={"api.test": {"X": "1"}})}},
            "headers for ['api.test']",
        ),
    ],
)
def test_settings_that_name_nothing_or_half_a_ca_are_refused(
    overrides: dict[str, Any], words: str
) -> None:
    settings = EgressSettings(**({"policies": POLICIES} | overrides))
    with pytest.raises(ConfigError) as info:
        check_settings(settings)
    assert words in str(info.value)


def test_consistent_settings_pass() -> None:
    check_settings(
        EgressSettings(
            policies=POLICIES,
            default_policy="ask",
            principal_policies={"ci": "open"},
            allowed_policies={"*": ["none"], "admin": ["open"]},
        )
    )


CHOOSING = EgressSettings(
    policies=POLICIES,
    default_policy="ask",
    principal_policies={"ci": "open"},
    allowed_policies={"*": ["none"], "admin": ["open"]},
)


@pytest.mark.parametrize(
    ("principal", "asked", "fixed", "chosen"),
    [
        ("alice", None, None, "ask"),  # the default
        ("ci", None, None, "open"),  # the principal's default
        ("ci", "open", None, "open"),  # asking for one's default is always fine
        ("alice", "none", None, "none"),  # allowed for "*"
        ("admin", "open", None, "open"),  # allowed for this principal
        ("alice", "ask", None, "ask"),  # the default, asked by name
        ("alice", None, "none", "none"),  # a trust tier's fixed policy
        ("admin", "none", "none", "none"),
    ],
)
async def test_the_policy_chosen(
    tmp_path: Path,
    store: SqliteStore,
    principal: str,
    asked: str | None,
    fixed: str | None,
    chosen: str,
) -> None:
    egress = EgressSessions(CHOOSING, tmp_path, store)
    assert egress.choose(principal, asked, fixed=fixed) == chosen


@pytest.mark.parametrize(
    ("principal", "asked", "fixed", "words"),
    [
        ("alice", "open", None, "'open' is not allowed for 'alice'"),
        ("ci", "ask", None, "'ask' is not allowed for 'ci'"),
        ("admin", "open", "none", "fixes its egress policy to 'none'"),
    ],
)
async def test_a_policy_beyond_what_the_operator_allows_is_forbidden(
    tmp_path: Path, store: SqliteStore, principal: str, asked: str, fixed: str | None, words: str
) -> None:
    egress = EgressSessions(CHOOSING, tmp_path, store)
    with pytest.raises(ForbiddenError, match=words):
        egress.choose(principal, asked, fixed=fixed)


@dataclass
class Kernel:
    """What ``bind`` uses of a KernelSession: ``ask`` and the sandbox's ipc directory."""

    ipc_dir: Path
    answers: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sandbox = SimpleNamespace(session_dir=SimpleNamespace(ipc_dir=self.ipc_dir))

    def ask(self, prompt: str) -> asyncio.Future[str]:
        self.prompts.append(prompt)
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        future.set_result(self.answers.pop(0) if self.answers else "\x04")
        return future

    def real(self) -> KernelSession:
        return cast(KernelSession, self)


@pytest.fixture
def ipc() -> Iterator[Path]:
    # Unix socket paths are limited to 108 bytes: pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="khs", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    store = await SqliteStore.open(tmp_path / "kh.sqlite3")
    yield store
    await store.close()


SETTINGS = EgressSettings(
    policies=POLICIES, default_policy="ask", hosts={"api.test": "127.0.0.1:9"}
)


async def connect_status(ipc: Path, host: str) -> bytes:
    """CONNECT through the session's socket; the proxy's status line."""
    reader, writer = await asyncio.open_unix_connection(str(ipc / SOCKET_NAME))
    try:
        writer.write(f"CONNECT {host}:443 HTTP/1.1\r\n\r\n".encode())
        await writer.drain()
        return (await asyncio.wait_for(reader.readuntil(b"\r\n"), WAIT)).strip()
    finally:
        writer.close()


async def test_a_session_answer_is_stored_audited_and_survives_a_rebind_and_a_restart(
    tmp_path: Path, ipc: Path, store: SqliteStore
) -> None:
    await store.insert_session(row("s1", "ask", EgressGrants()))
    egress = EgressSessions(SETTINGS, tmp_path, store)
    kernel = Kernel(ipc, answers=["session"])
    egress.remember(row("s1", "ask", EgressGrants()))
    await egress.bind("s1", "alice", kernel.real())
    assert await connect_status(ipc, "api.test") == b"HTTP/1.1 200 Connection established"
    assert kernel.prompts == ["allow network access to api.test:443 for this session? "
                              "answer once, session or deny [deny] "]  # fmt: skip
    stored = await store.get_session("s1")
    assert stored is not None and stored.egress_grants is not None
    assert [tuple(g) for g in stored.egress_grants.granted] == [("api.test", 443)]

    async def actions() -> list[str]:
        return [r["action"] for r in await store.audit_log("s1")]

    deadline = asyncio.get_running_loop().time() + WAIT
    while (got := await actions()) != ["egress.ask", "egress.answer"]:
        assert asyncio.get_running_loop().time() < deadline, got
        await asyncio.sleep(0.01)

    # A new kernel for the same session: nobody is asked again.
    second = Kernel(ipc)
    await egress.bind("s1", "alice", second.real())
    assert await connect_status(ipc, "api.test") == b"HTTP/1.1 200 Connection established"
    assert second.prompts == []
    await egress.close()

    # A restarted gateway reads the row back.
    restarted = EgressSessions(SETTINGS, tmp_path, store)
    stored = await store.get_session("s1")
    assert stored is not None
    restarted.remember(stored)
    third = Kernel(ipc)
    await restarted.bind("s1", "alice", third.real())
    assert await connect_status(ipc, "api.test") == b"HTTP/1.1 200 Connection established"
    assert third.prompts == []
    await restarted.close()


async def test_a_question_past_its_deadline_is_a_deny_kept_for_the_session(
    tmp_path: Path, ipc: Path, store: SqliteStore
) -> None:
    await store.insert_session(row("s2", "ask", EgressGrants()))
    egress = EgressSessions(SETTINGS, tmp_path, store)
    egress.remember(row("s2", "ask", EgressGrants()))
    kernel = Kernel(ipc, answers=["\x04"])  # what KernelSession.ask gives at its deadline
    await egress.bind("s2", "alice", kernel.real())
    status = await connect_status(ipc, "api.test")
    assert status.startswith(b"HTTP/1.1 403 ") and b"denied by a human" in status
    stored = await store.get_session("s2")
    assert stored is not None and stored.egress_grants is not None
    assert [tuple(d) for d in stored.egress_grants.denied] == [("api.test", 443)]
    assert (await connect_status(ipc, "api.test")).startswith(b"HTTP/1.1 403 ")
    assert len(kernel.prompts) == 1  # the second request was not asked
    await egress.close()


async def test_the_policy_decides_before_anyone_is_asked(
    tmp_path: Path, ipc: Path, store: SqliteStore
) -> None:
    egress = EgressSessions(SETTINGS, tmp_path, store)
    egress.remember(row("open", "open", EgressGrants()))
    kernel = Kernel(ipc)
    await egress.bind("open", "alice", kernel.real())
    assert await connect_status(ipc, "api.test") == b"HTTP/1.1 200 Connection established"
    egress.remember(row("none", "none", EgressGrants()))
    await egress.bind("none", "alice", kernel.real())  # the same directory: replaced
    assert (await connect_status(ipc, "api.test")).startswith(b"HTTP/1.1 403 ")
    assert kernel.prompts == []
    await egress.unbind("none", ended=True)
    assert egress.proxy.session("none") is None
    with pytest.raises(ConnectionRefusedError):
        await connect_status(ipc, "api.test")
    await egress.close()


async def test_an_unservable_socket_leaves_the_session_without_egress(
    tmp_path: Path, store: SqliteStore
) -> None:
    egress = EgressSessions(SETTINGS, tmp_path, store)
    await egress.bind("s3", "alice", Kernel(tmp_path / "no" / "such" / "dir").real())
    assert egress.proxy.session("s3") is None
    await egress.close()


async def test_a_ca_is_loaded_when_both_files_are_set(tmp_path: Path, store: SqliteStore) -> None:
    ca = make_ca(tmp_path / "ca")
    egress = EgressSessions(
        EgressSettings(ca_cert_file=ca.cert_file, ca_key_file=ca.key_file), tmp_path, store
    )
    assert egress.proxy.authority is not None
    assert egress.proxy.authority.cert.subject == ca.cert.subject
    await egress.close()
