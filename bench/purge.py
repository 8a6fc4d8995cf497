"""Purging a big session from the store: how long it takes, how far the file shrinks, how
big the WAL gets meanwhile, and how long another session's store writes wait.

    python bench/purge.py [--mib 200] [--dir /tmp/kh-purge]

A session with ``--mib`` one-MiB event rows and a neighbour writing one small event every
10 ms; the purge is :meth:`RetentionSweeper.purge` on a real SQLite file (no gateway, no
sandbox: this measures the store). Local disk only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sqlite3
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from kernelhub.config import StorageSettings
from kernelhub.snapshot.blobs import BlobStore
from kernelhub.store.records import StoredSession
from kernelhub.store.retention import RetentionSweeper
from kernelhub.store.sqlite import SqliteStore


def _session(sid: str) -> StoredSession:
    return StoredSession(
        id=sid, owner="bench", backend="docker", state="ready", created_at=datetime.now(UTC),
        limits={}, metadata={}, reason=None, deleted_at=None,
    )  # fmt: skip


async def measure(root: Path, mib: int) -> dict[str, float]:
    path = root / "kh.sqlite3"
    wal = path.with_name(path.name + "-wal")
    store = await SqliteStore.open(path)
    try:
        for sid in ("big", "neighbour"):
            await store.insert_session(_session(sid))
        body = '{"text":"' + "x" * 2**20 + '"}'
        for seq in range(1, mib + 1):
            await store.append_event("big", seq, "e", body, lambda error: None)
        with contextlib.closing(sqlite3.connect(path)) as other:  # the file's real size
            other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

        def size() -> int:
            return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)

        before, peak_wal, waits, done = size(), 0, [], False

        async def neighbour() -> None:
            nonlocal peak_wal
            seq = 0
            while not done:
                seq += 1
                t0 = time.perf_counter()
                await store.append_event("neighbour", seq, "e", "{}", lambda error: None)
                waits.append(time.perf_counter() - t0)
                peak_wal = max(peak_wal, wal.stat().st_size if wal.exists() else 0)
                await asyncio.sleep(0.01)

        task = asyncio.create_task(neighbour())
        t0 = time.perf_counter()
        await RetentionSweeper(store, BlobStore(root), StorageSettings()).purge("big")
        took = time.perf_counter() - t0
        done = True
        await task
        waits.sort()
        return {
            "before_mb": before / 1e6,
            "after_mb": size() / 1e6,
            "purge_s": took,
            "peak_wal_mb": peak_wal / 1e6,
            "neighbour_p50_ms": waits[len(waits) // 2] * 1e3,
            "neighbour_max_ms": waits[-1] * 1e3,
        }
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=200)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        result = asyncio.run(measure(Path(root), args.mib))
    print("  ".join(f"{k} {v:.2f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
