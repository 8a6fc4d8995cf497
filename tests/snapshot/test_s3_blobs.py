"""Snapshot blobs in a real S3-compatible server (``rclone serve s3``, tests/objects.py):
two nodes, each with its own data directory and the cluster's key, sharing one bucket.
What one commits the other fetches; what was edited in the bucket, claimed by another
owner, or signed with another key is refused, and nothing of it is left on disk."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kernelhub.config import load_settings
from kernelhub.errors import InvalidRequestError, NotFoundError, StoreError, TooLargeError
from kernelhub.snapshot.blobs import BlobStore, blob_store
from kernelhub.snapshot.s3 import S3BlobStore
from kernelhub.snapshot.transfer import default_algorithm, labelled, new_digest
from tests.conftest import eventually
from tests.objects import S3Server

pytestmark = pytest.mark.s3

LIMIT = 1 << 30


async def chunks(data: bytes, size: int = 1 << 20) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


@pytest.fixture
def node(tmp_path: Path, s3_server: S3Server) -> object:
    """``node(name)``: a node's blob store, on its own data dir, the shared bucket and key."""
    bucket = s3_server.fresh_bucket()
    key_file = tmp_path / "cluster.key"
    key_file.write_bytes(os.urandom(32))

    def make(name: str, key: Path = key_file, in_bucket: str = bucket) -> S3BlobStore:
        settings = load_settings(
            data_dir=tmp_path / name,
            objects=s3_server.settings(in_bucket),
            cluster={"snapshot_key_file": key},
        )
        store = blob_store(settings)
        assert isinstance(store, S3BlobStore)
        return store

    return make


def local_files(store: BlobStore) -> list[str]:
    return sorted(p.name for p in store.root.iterdir()) if store.root.exists() else []


async def committed(store: S3BlobStore, snapshot_id: str, data: bytes) -> tuple[str, str]:
    size, sha256 = await store.write(snapshot_id, chunks(data), LIMIT)
    algorithm = default_algorithm()  # BLAKE3 where installed, as the streamed path
    expected = new_digest(algorithm)
    expected.update(data)
    assert (size, sha256) == (len(data), labelled(algorithm, expected))
    await store.commit(snapshot_id)
    return sha256, store.mac(snapshot_id, "alice", sha256)


async def test_a_multipart_blob_committed_on_one_node_is_fetched_on_another(
    node: object, s3_server: S3Server
) -> None:
    a, b = node("a"), node("b")  # type: ignore[operator]
    data = os.urandom(20 * 2**20 + 12345)  # over the 16 MiB part size: two parts
    parts: list[int] = []
    a.client().meta.events.register(
        "before-parameter-build.s3.UploadPart",
        lambda params, **_: parts.append(len(params["Body"])),
    )
    sha256, mac = await committed(a, "blob1", data)
    assert sorted(parts) == [len(data) - 16 * 2**20, 16 * 2**20]
    key = a.object_key("blob1")
    assert s3_server.keys(a.bucket) == {key: len(data)}
    assert local_files(b) == []
    path = await b.fetch("blob1", "alice", sha256, mac, LIMIT)
    assert path == b.path("blob1") and path.read_bytes() == data
    assert local_files(b) == ["blob1.blob"]  # no partial file left beside it
    # The node that made it restores from its own file, even with the bucket emptied.
    s3_server.client().delete_object(Bucket=a.bucket, Key=key)
    assert (await a.fetch("blob1", "alice", sha256, mac, LIMIT)).read_bytes() == data
    await a.commit("blob1")
    await b.delete("blob1")
    assert s3_server.keys(a.bucket) == {} and local_files(b) == []
    a.remove("blob1")
    with pytest.raises(NotFoundError, match="not in the bucket"):
        await a.fetch("blob1", "alice", sha256, mac, LIMIT)


async def test_a_blake3_blob_like_a_kernel_capture_verifies_on_either_node(
    node: object, s3_server: S3Server
) -> None:
    """A capture spliced from the kernel is stored with a ``blake3:<hex>`` digest; the
    node that downloads it, and one that checks its own file, hash with that algorithm
    (they used SHA-256 for every blob: each such wake on another node was refused)."""
    if default_algorithm() != "blake3":
        pytest.skip("the blake3 package is not installed: new blobs are SHA-256")
    a, b = node("a"), node("b")  # type: ignore[operator]
    data = os.urandom(2 * 2**20 + 7)
    a.prepare("blob3").write_bytes(data)  # as transfer.receive writes it
    digest = new_digest("blake3")
    digest.update(memoryview(data))
    blake = labelled("blake3", digest)
    assert blake.startswith("blake3:")
    await a.commit("blob3")
    mac = a.mac("blob3", "alice", blake)
    a.verify("blob3", "alice", blake, mac)
    assert (await b.fetch("blob3", "alice", blake, mac, LIMIT)).read_bytes() == data
    b.verify("blob3", "alice", blake, mac)
    b.remove("blob3")
    s3_server.client().put_object(Bucket=a.bucket, Key=a.object_key("blob3"), Body=data[:-1])
    with pytest.raises(InvalidRequestError, match="integrity check"):
        await b.fetch("blob3", "alice", blake, mac, LIMIT)
    assert local_files(b) == []


async def test_a_blob_edited_in_the_bucket_or_claimed_by_another_is_refused(
    node: object, s3_server: S3Server
) -> None:
    a, b = node("a"), node("b")  # type: ignore[operator]
    data = os.urandom(3 * 2**20)
    sha256, mac = await committed(a, "blob2", data)
    # Another owner's row pointing at alice's blob (alice's MAC, or one it made up).
    for owner, claimed in (("mallory", mac), ("mallory", b.mac("blob2", "alice", "0" * 64))):
        with pytest.raises(InvalidRequestError, match="integrity check"):
            await b.fetch("blob2", owner, sha256, claimed, LIMIT)
    # A node with a key of its own (a per-host key) refuses the cluster's blobs.
    other = tmp_key(a.root.parent.parent / "other.key")
    with pytest.raises(InvalidRequestError, match="integrity check"):
        await node("c", other).fetch("blob2", "alice", sha256, mac, LIMIT)  # type: ignore[operator]
    # One byte changed in the bucket.
    edited = bytearray(data)
    edited[len(data) // 2] ^= 1
    s3_server.client().put_object(Bucket=a.bucket, Key=a.object_key("blob2"), Body=bytes(edited))
    with pytest.raises(InvalidRequestError, match="integrity check"):
        await b.fetch("blob2", "alice", sha256, mac, LIMIT)
    assert local_files(b) == []
    # Over the snapshot cap: refused as it downloads.
    with pytest.raises(TooLargeError, match="KERNELHUB_GATEWAY__MAX_SNAPSHOT_BYTES"):
        await b.fetch("blob2", "alice", sha256, mac, len(data) - 1)
    assert local_files(b) == []


def tmp_key(path: Path) -> Path:
    path.write_bytes(os.urandom(32))
    return path


async def test_an_unreachable_bucket_is_a_store_error_naming_the_knob(
    node: object, s3_server: S3Server
) -> None:
    a = node("a", in_bucket="no-such-bucket")  # type: ignore[operator]
    await a.write("blob3", chunks(b"x" * 100), LIMIT)
    with pytest.raises(StoreError, match="KERNELHUB_OBJECTS__BUCKET"):
        await a.commit("blob3")


async def test_a_hibernation_blob_is_not_cached_and_an_abandoned_upload_leaves_nothing(
    node: object, s3_server: S3Server
) -> None:
    a = node("a")  # type: ignore[operator]
    await a.write("hib", chunks(b"h" * 1000), LIMIT)
    await a.commit("hib", cache=False)
    assert s3_server.keys(a.bucket) == {a.object_key("hib"): 1000} and local_files(a) == []
    # A capture cancelled while its blob goes up (the gateway stopping): it gets no row,
    # so the object must not stay behind either.
    await a.write("cut", chunks(os.urandom(40 * 2**20)), LIMIT)
    seen: list[str] = []
    events = a.client().meta.events
    events.register("before-call.s3.UploadPart", lambda **_: seen.append("part"))
    events.register("after-call.s3.CompleteMultipartUpload", lambda **_: seen.append("done"))
    upload = asyncio.ensure_future(a.commit("cut"))
    await eventually(lambda: "part" in seen, 30)  # under way in its thread
    upload.cancel()
    with pytest.raises(asyncio.CancelledError):
        await upload
    await eventually(lambda: "done" in seen, 30)  # the thread ran on to the end
    await eventually(lambda: a.object_key("cut") not in s3_server.keys(a.bucket), 10)
