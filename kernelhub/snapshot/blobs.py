"""Snapshot blobs: written once, read back verbatim, never parsed.

Each blob is bound to its id and owner by an HMAC-SHA256 over the blob's SHA-256, under
a key only kernelhub has: this host's (``<data_dir>/snapshot.key``, made on first use),
or the cluster's (``KERNELHUB_CLUSTER__SNAPSHOT_KEY_FILE``, the same file on every node).
A blob edited on disk or in the bucket, or claimed by someone else, fails verification
and is refused before any sandbox loads it.

Two stores behind one interface. :class:`BlobStore` is local disk, the single-machine
default: the file the kernel's stream was written to *is* the blob.
:class:`~kernelhub.snapshot.s3.S3BlobStore` keeps that file as the staging copy and
cache of the fast path, and the blob itself in an S3-compatible bucket, so any node can
restore it. :func:`blob_store` picks one from the settings.

The calling contract (``session.continuity``, ``store.retention``):

- ``prepare(id)`` names the new file a capture streams into (``transfer.receive``);
  then ``await commit(id, cache=...)`` makes it durable. A snapshot counts as stored, and gets its
  row, only once ``commit`` returned: a node that dies right after still leaves it
  readable by the others.
- ``await fetch(id, owner, sha256, mac, max_bytes)`` is the local file a restore sends,
  brought from the bucket first if this host lacks it (and checked before it is
  returned); ``NotFoundError`` if there is no data for it anywhere.
- ``await delete(id)`` removes the blob everywhere (retention, rewind, session delete);
  ``remove(id)`` only this host's copy (a capture that failed half way); ``prune`` (the
  retention sweep, now and then) the local copies of snapshots whose rows are gone.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kernelhub.errors import ConfigError, InvalidRequestError, NotFoundError, TooLargeError
from kernelhub.snapshot.transfer import algorithm_of, labelled, new_digest

if TYPE_CHECKING:
    from kernelhub.config import Settings

CHUNK = 1 << 20
KEY_FILE_KNOB = "KERNELHUB_CLUSTER__SNAPSHOT_KEY_FILE"
MIN_KEY_BYTES = 32


class BlobStore:
    """Blobs on this host's disk, in ``<data_dir>/snapshots/``. ``key``: the MAC key
    (the cluster's); None: this host's own, made on first use."""

    def __init__(self, data_dir: Path, *, key: bytes | None = None) -> None:
        self.root = data_dir / "snapshots"
        self._key_path = data_dir / "snapshot.key"
        self._key = key

    def _secret(self) -> bytes:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self._key is None:
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
                        raise too_large(max_bytes)
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

    async def commit(self, snapshot_id: str, *, cache: bool = True) -> None:
        """The blob written at ``prepare(id)`` is durable once this returns. On local
        disk it already is. ``cache=False``: the local file is not worth keeping once the
        blob is stored elsewhere (a hibernation's: the wake here restores from the capture
        kept in the state directory)."""

    def existing(self, snapshot_id: str) -> Path:
        """The blob's path; ``NotFoundError`` if this host has no data for it."""
        target = self.path(snapshot_id)
        if not target.is_file():
            raise NotFoundError(f"snapshot {snapshot_id} has no data on this host")
        return target

    async def fetch(
        self, snapshot_id: str, owner: str, sha256: str, mac: str, max_bytes: int
    ) -> Path:
        """The blob's local path, for a restore to send (``transfer.send`` checks the MAC
        as it streams: a local file is hashed once, not twice)."""
        return self.existing(snapshot_id)

    def verify(self, snapshot_id: str, owner: str, sha256: str, mac: str) -> None:
        """Refuse a blob that is missing, edited, or not this owner's."""
        target = self.existing(snapshot_id)
        algorithm = algorithm_of(sha256)
        digest = new_digest(algorithm)
        with open(target, "rb") as fh:
            while chunk := fh.read(CHUNK):
                digest.update(memoryview(chunk))
        self.check(snapshot_id, owner, sha256, mac, labelled(algorithm, digest))

    def check(self, snapshot_id: str, owner: str, sha256: str, mac: str, actual: str) -> None:
        """Refuse bytes hashing to ``actual`` unless they are the blob the row describes,
        under a MAC that binds that hash to the snapshot's id and owner."""
        ok = hmac.compare_digest(self.mac(snapshot_id, owner, actual), mac)
        if not ok or actual != sha256:
            raise InvalidRequestError(
                f"snapshot {snapshot_id} failed its integrity check (changed on disk or in "
                "the bucket, or not yours); it will not be restored"
            )

    async def read(self, snapshot_id: str) -> AsyncIterator[bytes]:
        with open(self.path(snapshot_id), "rb") as fh:  # noqa: ASYNC230 - local disk
            while chunk := fh.read(CHUNK):
                yield chunk

    def remove(self, snapshot_id: str) -> None:
        """This host's copy only."""
        self.path(snapshot_id).unlink(missing_ok=True)

    async def delete(self, snapshot_id: str) -> None:
        """The blob, wherever it is kept."""
        self.remove(snapshot_id)

    async def prune(self, has_row: Callable[[str], Awaitable[bool]], older_than: float) -> int:
        """Remove this host's files that no snapshot row names any more (one deleted by
        another node, a capture or download a crash cut short), untouched for
        ``older_than`` seconds (a capture and its upload write the file before its row).
        Returns how many went."""
        if not self.root.is_dir():
            return 0
        cutoff = time.time() - older_than
        removed = 0
        for entry in list(os.scandir(self.root)):
            name = entry.name
            with contextlib.suppress(FileNotFoundError):
                if entry.stat().st_mtime > cutoff:
                    continue
                if name.endswith(".part") or (
                    name.endswith(".blob") and not await has_row(name.removesuffix(".blob"))
                ):
                    os.unlink(entry.path)
                    removed += 1
        return removed


def too_large(max_bytes: int) -> TooLargeError:
    return TooLargeError(
        f"snapshot is larger than {max_bytes} bytes; raise "
        "KERNELHUB_GATEWAY__MAX_SNAPSHOT_BYTES or keep less in the namespace"
    )


def cluster_key(path: Path) -> bytes:
    """The cluster's MAC key: the bytes of ``path`` as they are (the same file on every
    node; not stripped, which would shorten a random key ending in a whitespace byte)."""
    try:
        key = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the snapshot key file {str(path)!r} ({exc.strerror or exc}); "
            f"set {KEY_FILE_KNOB} to a readable file of {MIN_KEY_BYTES}+ random bytes, "
            "e.g. made with `head -c 32 /dev/urandom > snapshot.key`"
        ) from exc
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"the snapshot key file {str(path)!r} holds {len(key)} bytes, fewer than "
            f"{MIN_KEY_BYTES}; put {MIN_KEY_BYTES}+ random bytes in it ({KEY_FILE_KNOB})"
        )
    return key


def blob_store(settings: Settings) -> BlobStore:
    """The blob store the settings ask for. With object storage on, a cluster-wide key is
    required: a per-host one would make every other node refuse this node's blobs."""
    key_file = settings.cluster.snapshot_key_file
    key = cluster_key(key_file) if key_file is not None else None
    if settings.objects.endpoint_url and not settings.objects.enabled:
        raise ConfigError(
            f"KERNELHUB_OBJECTS__ENDPOINT_URL is {settings.objects.endpoint_url!r} but no bucket "
            "is named: set KERNELHUB_OBJECTS__BUCKET (e.g. kernelhub-snapshots), or unset the "
            "endpoint to keep snapshots on local disk"
        )
    if not settings.objects.enabled:
        return BlobStore(settings.data_dir, key=key)
    if key is None:
        raise ConfigError(
            f"object storage is on (bucket {settings.objects.bucket!r}) but {KEY_FILE_KNOB} "
            "is not set: every node must sign snapshots with the same key; set it to a file "
            "of 32+ random bytes shared by all nodes, e.g. /etc/kernelhub/snapshot.key"
        )
    try:
        from kernelhub.snapshot.s3 import S3BlobStore
    except ImportError as exc:
        raise ConfigError(
            f"object storage is on (KERNELHUB_OBJECTS__BUCKET={settings.objects.bucket!r}) "
            f"but boto3 is not installed ({exc}); pip install 'kernelhub[s3]'"
        ) from exc

    return S3BlobStore(settings.data_dir, settings.objects, key=key)
