"""Snapshot blobs in an S3-compatible bucket (``KERNELHUB_OBJECTS__*``), so that a
snapshot taken, or a session hibernated, on one node is restored on any other.

The local file stays the fast path: a capture streams into it as on one machine, then
it goes up on a worker thread (a multipart upload above ``part_bytes``; never on the
event loop), and a restore on the node that made it reads it from there. A node that
lacks it downloads it first: streamed to a temporary file beside it, counted against the
snapshot cap, hashed as it arrives and checked against the row's MAC before it takes the
blob's name, so an object edited in the bucket never reaches a sandbox.

boto3 (``pip install 'kernelhub[s3]'``) is imported only when a bucket is configured. Its
clients are thread-safe; one serves every worker thread. Its errors become kernelhub's
here: a missing object is ``NotFoundError``, anything else ``StoreError`` (retry later).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from kernelhub.cluster.settings import ObjectStoreSettings
from kernelhub.errors import NotFoundError, StoreError
from kernelhub.snapshot.blobs import CHUNK, BlobStore, too_large
from kernelhub.snapshot.transfer import algorithm_of, labelled, new_digest

log = logging.getLogger(__name__)

_MISSING = {"NoSuchKey", "404", "NotFound"}
# Parts in flight per upload: enough to keep a link busy, few enough for a 2-core node
# that is also running kernels.
_UPLOAD_THREADS = 4


class S3BlobStore(BlobStore):
    """Blobs in ``s3://<bucket>/<prefix>/snapshots/<id>.blob``, with the local file of
    :class:`BlobStore` as their staging copy and cache (see the module)."""

    def __init__(self, data_dir: Path, objects: ObjectStoreSettings, *, key: bytes) -> None:
        super().__init__(data_dir, key=key)
        assert objects.bucket is not None
        self.objects = objects
        self.bucket = objects.bucket
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._transfer = TransferConfig(
            multipart_threshold=objects.part_bytes,
            multipart_chunksize=objects.part_bytes,
            max_concurrency=_UPLOAD_THREADS,
        )

    def object_key(self, snapshot_id: str) -> str:
        parts = (self.objects.prefix.strip("/"), "snapshots", f"{snapshot_id}.blob")
        return "/".join(p for p in parts if p)

    def client(self) -> Any:
        """The boto3 client, made on first use (on a worker thread: it reads files)."""
        with self._client_lock:
            if self._client is None:
                o = self.objects
                self._client = boto3.session.Session().client(
                    "s3",
                    endpoint_url=o.endpoint_url,
                    region_name=o.region,
                    aws_access_key_id=o.access_key_id.get_secret_value()
                    if o.access_key_id
                    else None,
                    aws_secret_access_key=o.secret_access_key.get_secret_value()
                    if o.secret_access_key
                    else None,
                    config=Config(
                        # A custom endpoint (MinIO, rclone, Ceph) rarely has per-bucket DNS.
                        s3={"addressing_style": "path" if o.endpoint_url else "auto"},
                        connect_timeout=min(o.timeout, 10.0),
                        read_timeout=o.timeout,
                        retries={"max_attempts": 3, "mode": "standard"},
                        # The blob carries its own SHA-256 and MAC; the CRC headers newer
                        # botocore adds by default are refused by some S3-compatible servers.
                        request_checksum_calculation="when_required",
                        response_checksum_validation="when_required",
                    ),
                )
            return self._client

    async def commit(self, snapshot_id: str, *, cache: bool = True) -> None:
        abandoned = threading.Event()
        t0 = time.monotonic()
        try:
            await asyncio.to_thread(self._upload, snapshot_id, abandoned)
        except asyncio.CancelledError:
            abandoned.set()  # the thread runs on: what it stores, no row will name
            raise
        log.debug("snapshot %s uploaded in %.2f s", snapshot_id, time.monotonic() - t0)
        if not cache:
            self.remove(snapshot_id)

    async def fetch(
        self, snapshot_id: str, owner: str, sha256: str, mac: str, max_bytes: int
    ) -> Path:
        target = self.path(snapshot_id)
        if target.is_file():
            return target
        self._secret()
        t0 = time.monotonic()
        path = await asyncio.to_thread(self._download, snapshot_id, owner, sha256, mac, max_bytes)
        log.debug("snapshot %s downloaded in %.2f s", snapshot_id, time.monotonic() - t0)
        return path

    async def delete(self, snapshot_id: str) -> None:
        self.remove(snapshot_id)
        await asyncio.to_thread(self._delete, snapshot_id)

    # -- blocking halves, on worker threads -------------------------------------------

    def _upload(self, snapshot_id: str, abandoned: threading.Event) -> None:
        key = self.object_key(snapshot_id)
        with self._translated("uploading", key):
            self.client().upload_file(
                str(self.path(snapshot_id)), self.bucket, key, Config=self._transfer
            )
        if abandoned.is_set():
            self._delete(snapshot_id)

    def _delete(self, snapshot_id: str) -> None:
        key = self.object_key(snapshot_id)
        with self._translated("deleting", key):
            self.client().delete_object(Bucket=self.bucket, Key=key)

    def _download(
        self, snapshot_id: str, owner: str, sha256: str, mac: str, max_bytes: int
    ) -> Path:
        key = self.object_key(snapshot_id)
        target = self.path(snapshot_id)
        partial = self.root / f".{snapshot_id}.{secrets.token_hex(4)}.part"
        with self._translated("downloading", key):
            answer = self.client().get_object(Bucket=self.bucket, Key=key)
            body = answer["Body"]
            try:
                if int(answer.get("ContentLength") or 0) > max_bytes:
                    raise too_large(max_bytes)
                fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                try:
                    algorithm = algorithm_of(sha256)  # the row's, as the blob was made
                    digest = new_digest(algorithm)
                    size = 0
                    with os.fdopen(fd, "wb") as out:
                        # Counted as it arrives: the length the server announced may lie.
                        for chunk in body.iter_chunks(CHUNK):
                            size += len(chunk)
                            if size > max_bytes:
                                raise too_large(max_bytes)
                            digest.update(memoryview(chunk))
                            out.write(chunk)
                    self.check(snapshot_id, owner, sha256, mac, labelled(algorithm, digest))
                    # Under its name only once checked; a concurrent fetch of the same
                    # blob renames the same bytes.
                    os.replace(partial, target)
                except BaseException:
                    partial.unlink(missing_ok=True)
                    raise
            finally:
                body.close()
        return target

    @contextmanager
    def _translated(self, what: str, key: str) -> Iterator[None]:
        where = f"s3://{self.bucket}/{key}"
        try:
            yield
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _MISSING:
                raise NotFoundError(
                    f"snapshot blob {where} is not in the bucket (deleted, or never uploaded)"
                ) from exc
            raise self._failed(what, where, exc) from exc
        except (BotoCoreError, Boto3Error) as exc:
            raise self._failed(what, where, exc) from exc

    def _failed(self, what: str, where: str, exc: Exception) -> StoreError:
        endpoint = self.objects.endpoint_url or "AWS S3"
        return StoreError(
            f"object storage failed {what} {where} at {endpoint}: {exc}; check "
            "KERNELHUB_OBJECTS__ENDPOINT_URL, KERNELHUB_OBJECTS__BUCKET and the access keys "
            "(KERNELHUB_OBJECTS__ACCESS_KEY_ID), or retry later"
        )
