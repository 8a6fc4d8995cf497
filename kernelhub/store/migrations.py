"""The store's schema versions and the forward migrations between them.

``schema_version`` holds one row: the version the database is at. Version 1 is the
schema of ``sqlite.SCHEMA`` as it stood before versioning (every database made before
this module counts as version 1); each later version is one function here, applied in
order, each in its own transaction with the version bump, so a crash leaves the database
at a version it fully reached. A database newer than this code is refused, not guessed at.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime

from kernelhub.errors import ConfigError

log = logging.getLogger(__name__)
AUTO_VACUUM_INCREMENTAL = 2  # PRAGMA auto_vacuum value


def _storage(db: sqlite3.Connection) -> None:
    """Version 2: what storage quotas, retention and the bounded audit log need."""
    # One statement at a time: executescript would commit the migration's transaction.
    for sql in (
        "ALTER TABLE sessions ADD COLUMN ended_at TEXT",
        "ALTER TABLE sessions ADD COLUMN stored_bytes INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE audit ADD COLUMN code_bytes INTEGER",
        "ALTER TABLE audit ADD COLUMN code_sha256 TEXT",
        "CREATE INDEX IF NOT EXISTS sessions_ended ON sessions(ended_at)",
        "CREATE INDEX IF NOT EXISTS audit_at ON audit(at)",
        "CREATE INDEX IF NOT EXISTS snapshots_session ON snapshots(session_id)",
    ):
        db.execute(sql)
    # Sessions that ended before retention existed get a full retention period from now.
    db.execute(
        "UPDATE sessions SET ended_at = COALESCE(deleted_at, ?) WHERE state IN ('dead', 'deleted')",
        (datetime.now(UTC).isoformat(),),
    )
    # The one scan of the events there will ever be: from here on usage is counted as
    # rows are written (see quota.StorageLedger).
    db.execute(
        "UPDATE sessions SET stored_bytes ="
        " (SELECT COALESCE(SUM(length(body)), 0) FROM events WHERE session_id = sessions.id)"
        " + (SELECT COALESCE(SUM(length(code) + COALESCE(length(record), 0)), 0)"
        "    FROM executions WHERE session_id = sessions.id)"
    )


def _scoped_tokens(db: sqlite3.Connection) -> None:
    """Version 3: scoped tokens (read-only, one session, an expiry, standing for another
    principal) and the review page's sign-in sessions."""
    for sql in (
        "ALTER TABLE tokens ADD COLUMN read_only INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE tokens ADD COLUMN session_id TEXT",
        "ALTER TABLE tokens ADD COLUMN expires_at TEXT",
        "ALTER TABLE tokens ADD COLUMN acts_for TEXT",
        # A sign-in names its token by hash, so revoking the token ends the sign-in too.
        "CREATE TABLE IF NOT EXISTS web_sessions (id_hash TEXT PRIMARY KEY,"
        " token_hash TEXT NOT NULL, csrf TEXT NOT NULL, created_at TEXT NOT NULL,"
        " expires_at TEXT NOT NULL)",
        "CREATE INDEX IF NOT EXISTS audit_principal ON audit(principal)",
    ):
        db.execute(sql)


def _hibernation_column(db: sqlite3.Connection) -> None:
    """Version 4: a hibernated session's snapshot in a column of its own, no longer
    encoded in the free-text reason as ``hibernation:<id>``."""
    db.execute("ALTER TABLE sessions ADD COLUMN hibernation_snapshot TEXT")
    db.execute(
        "UPDATE sessions SET hibernation_snapshot = substr(reason, 13), reason = NULL"
        " WHERE state = 'hibernated' AND reason LIKE 'hibernation:%'"
    )


# Version N+1 is reached by MIGRATIONS[N - 1]; append, never edit or reorder.
MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [
    _storage,
    _scoped_tokens,
    _hibernation_column,
]
LATEST = 1 + len(MIGRATIONS)


def version(db: sqlite3.Connection) -> int:
    db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    row = db.execute("SELECT version FROM schema_version").fetchone()
    return int(row[0]) if row else 1


def migrate(db: sqlite3.Connection, path: object) -> int:
    """Bring the database (already holding the version 1 tables) to :data:`LATEST`;
    returns the version it was at. ``db`` is in autocommit mode (isolation_level None)."""
    start = version(db)
    if start > LATEST:
        raise ConfigError(
            f"the store {path} is at schema version {start}, newer than this kernelhub "
            f"(version {LATEST}); upgrade kernelhub or point KERNELHUB_DATA_DIR elsewhere"
        )
    for at in range(start, LATEST):
        with db:
            db.execute("BEGIN")
            MIGRATIONS[at - 1](db)
            db.execute("DELETE FROM schema_version")
            db.execute("INSERT INTO schema_version (version) VALUES (?)", (at + 1,))
    if db.execute("PRAGMA auto_vacuum").fetchone()[0] != AUTO_VACUUM_INCREMENTAL:
        # A database made before version 2: auto_vacuum takes effect only through a full
        # VACUUM, done once here (at start-up, before the gateway serves anything).
        db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        try:
            db.execute("VACUUM")
        except sqlite3.OperationalError as exc:
            # VACUUM needs room for a copy of the file; without it purges still delete
            # rows (their pages are reused, not returned), and the next start tries again.
            log.warning(
                "could not convert %s to incremental vacuum (%s); free disk space and "
                "restart to return purged space to the filesystem",
                path,
                exc,
            )
    return start
