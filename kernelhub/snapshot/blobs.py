"""Snapshot blobs on disk: written once, read back verbatim, never parsed.

Each blob is bound to its id and owner by an HMAC-SHA256 under a key only this host has
(``<data_dir>/snapshot.key``), over the blob's SHA-256. A blob edited on disk, or claimed
by someone else, fails verification and is refused before any sandbox sees it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

from kernelhub.errors import InvalidRequestError, NotFoundError, TooLargeError

CHUNK = 1 << 20


class BlobStore:
    def __init__(self, data_dir: Path) -> None:
        self.root = data_dir / "snapshots"
        self._key_path = data_dir / "snapshot.key"
        self._key: bytes | None = None

    def _secret(self) -> bytes:
        if self._key is None:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                fd = os.open(self._key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                self._key = self._key_path.read_bytes()
            else:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(secrets.token_bytes(32))
                self._key = self._key_path.read_bytes()
        return self._key

    def mac(self, snapshot_id: str, owner: str, sha256: str) -> str:
        message = f"{snapshot_id}\0{owner}\0{sha256}".encode()
        return hmac.new(self._secret(), message, hashlib.sha256).hexdigest()

    def path(self, snapshot_id: str) -> Path:
        return self.root / f"{snapshot_id}.blob"

    async def write(
        self, snapshot_id: str, chunks: AsyncIterator[bytes], max_bytes: int
    ) -> tuple[int, str]:
        """Store the stream; returns (size, sha256). A partial blob is removed on failure."""
        self._secret()
        digest = hashlib.sha256()
        size = 0
        target = self.path(snapshot_id)
        try:
            with open(target, "xb") as out:  # noqa: ASYNC230 - local disk, MiB chunks
                async for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise TooLargeError(
                            f"snapshot is larger than {max_bytes} bytes (KERNELHUB_GATEWAY__MAX_SNAPSHOT_BYTES)"
                        )
                    digest.update(chunk)
                    out.write(chunk)
        except BaseException:
            target.unlink(missing_ok=True)
            raise
        return size, digest.hexdigest()

    def prepare(self, snapshot_id: str) -> Path:
        """The path a new blob is to be written at (``transfer.receive`` creates it)."""
        self._secret()
        return self.path(snapshot_id)

    def existing(self, snapshot_id: str) -> Path:
        """The blob's path; ``NotFoundError`` if this host has no data for it."""
        target = self.path(snapshot_id)
        if not target.is_file():
            raise NotFoundError(f"snapshot {snapshot_id} has no data on this host")
        return target

    def verify(self, snapshot_id: str, owner: str, sha256: str, mac: str) -> None:
        """Refuse a blob that is missing, edited, or not this owner's."""
        target = self.path(snapshot_id)
        if not target.is_file():
            raise NotFoundError(f"snapshot {snapshot_id} has no data on this host")
        digest = hashlib.sha256()
        with open(target, "rb") as fh:
            while chunk := fh.read(CHUNK):
                digest.update(chunk)
        ok = hmac.compare_digest(self.mac(snapshot_id, owner, digest.hexdigest()), mac)
        if not ok or digest.hexdigest() != sha256:
            raise InvalidRequestError(
                f"snapshot {snapshot_id} failed its integrity check (changed on disk, or not "
                "yours); it will not be restored"
            )

    async def read(self, snapshot_id: str) -> AsyncIterator[bytes]:
        with open(self.path(snapshot_id), "rb") as fh:  # noqa: ASYNC230 - local disk
            while chunk := fh.read(CHUNK):
                yield chunk

    def remove(self, snapshot_id: str) -> None:
        self.path(snapshot_id).unlink(missing_ok=True)
