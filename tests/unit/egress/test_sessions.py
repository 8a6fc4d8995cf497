"""Which egress policy a session has after a gateway restart: the one in its row (#25)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from kernelhub.config import EgressPolicy, EgressSettings
from kernelhub.egress.sessions import EgressSessions
from kernelhub.store.records import EgressGrants, StoredSession
from kernelhub.store.sqlite import SqliteStore

SETTINGS = EgressSettings(
    enabled=True,
    policies={"wide": EgressPolicy(allow=["*.example"]), "strict": EgressPolicy(allow=[])},
    default_policy="wide",
)


def row(sid: str, policy: str | None, grants: EgressGrants | None) -> StoredSession:
    return StoredSession(
        id=sid, owner="alice", backend="docker", state="ready", created_at=datetime.now(UTC),
        limits={}, metadata={}, reason=None, deleted_at=None, egress_policy=policy,
        egress_grants=grants,
    )  # fmt: skip


async def test_a_recorded_policy_is_kept_and_only_an_unrecorded_row_gets_the_default(
    tmp_path: Path,
) -> None:
    store = await SqliteStore.open(tmp_path / "kh.sqlite3")
    try:
        egress = EgressSessions(SETTINGS, tmp_path, store)
        egress.remember(row("strict", "strict", EgressGrants()))
        egress.remember(row("none", None, EgressGrants()))  # deny-all, recorded as such
        egress.remember(row("old", None, None))  # a row from before v6
        assert egress.policy_name("strict", "alice") == "strict"
        assert egress.policy_name("none", "alice") is None
        assert egress.policy_name("old", "alice") == "wide"
        await egress.unbind("strict", ended=True)
        assert egress.policy_name("strict", "alice") == "wide"  # forgotten with the session
        await egress.close()
    finally:
        await store.close()
