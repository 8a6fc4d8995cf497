"""Which blob store the settings make, and the MAC key it signs with: the cluster's key
file when set (the same MACs on every node), a per-host key otherwise, and no object
storage without the cluster's key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kernelhub.config import load_settings
from kernelhub.errors import ConfigError, StoreError
from kernelhub.snapshot.blobs import BlobStore, blob_store
from kernelhub.snapshot.s3 import S3BlobStore

# Nothing listens here; making a store must not connect anywhere.
BUCKET = {"endpoint_url": "http://127.0.0.1:9", "bucket": "snaps"}


def key_file(path: Path, size: int = 32) -> Path:
    path.write_bytes(os.urandom(size))
    return path


def test_object_storage_without_the_cluster_key_refuses_to_start(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path, objects=BUCKET)
    with pytest.raises(ConfigError, match="KERNELHUB_CLUSTER__SNAPSHOT_KEY_FILE") as err:
        blob_store(settings)
    assert "snaps" in str(err.value)
    assert not (tmp_path / "snapshot.key").exists()  # no per-host key was made instead


@pytest.mark.parametrize(("size", "said"), [(None, "cannot read"), (16, "holds 16 bytes")])
def test_an_unusable_key_file_names_itself_and_the_knob(
    tmp_path: Path, size: int | None, said: str
) -> None:
    path = tmp_path / "cluster.key"
    if size is not None:
        key_file(path, size)
    settings = load_settings(data_dir=tmp_path, cluster={"snapshot_key_file": path})
    with pytest.raises(ConfigError, match="KERNELHUB_CLUSTER__SNAPSHOT_KEY_FILE") as err:
        blob_store(settings)
    assert said in str(err.value) and str(path) in str(err.value)


def test_the_cluster_key_gives_every_node_the_same_macs(tmp_path: Path) -> None:
    shared = key_file(tmp_path / "cluster.key")
    nodes = [
        blob_store(
            load_settings(
                data_dir=tmp_path / name, objects=BUCKET, cluster={"snapshot_key_file": shared}
            )
        )
        for name in ("a", "b")
    ]
    assert all(isinstance(n, S3BlobStore) for n in nodes)
    macs = {n.mac("s1", "alice", "ab" * 32) for n in nodes}
    assert len(macs) == 1
    assert nodes[0].mac("s1", "bob", "ab" * 32) not in macs  # bound to the owner
    # Without object storage the key file still replaces the per-host key.
    local = blob_store(
        load_settings(data_dir=tmp_path / "c", cluster={"snapshot_key_file": shared})
    )
    assert type(local) is BlobStore and local.mac("s1", "alice", "ab" * 32) in macs
    assert not (tmp_path / "c" / "snapshot.key").exists()


def test_without_a_key_file_each_host_has_its_own_key(tmp_path: Path) -> None:
    a, b = (blob_store(load_settings(data_dir=tmp_path / n)) for n in ("a", "b"))
    assert type(a) is BlobStore
    assert a.mac("s1", "alice", "00") != b.mac("s1", "alice", "00")
    assert (tmp_path / "a" / "snapshot.key").stat().st_mode & 0o077 == 0


@pytest.mark.parametrize(
    ("prefix", "key"),
    [
        ("kernelhub/", "kernelhub/snapshots/s1.blob"),
        ("team-a", "team-a/snapshots/s1.blob"),
        ("/a/b/", "a/b/snapshots/s1.blob"),
        ("", "snapshots/s1.blob"),
    ],
)
def test_object_keys_are_under_the_prefix_with_or_without_its_slash(
    tmp_path: Path, prefix: str, key: str
) -> None:
    settings = load_settings(
        data_dir=tmp_path,
        objects={**BUCKET, "prefix": prefix},
        cluster={"snapshot_key_file": key_file(tmp_path / "k")},
    )
    store = blob_store(settings)
    assert isinstance(store, S3BlobStore) and store.object_key("s1") == key


async def test_a_bucket_out_of_reach_is_a_store_error_naming_the_endpoint(tmp_path: Path) -> None:
    settings = load_settings(
        data_dir=tmp_path,
        objects={**BUCKET, "timeout": 2},
        cluster={"snapshot_key_file": key_file(tmp_path / "k")},
    )
    store = blob_store(settings)
    store.prepare("s1").write_bytes(b"blob")
    with pytest.raises(StoreError, match=r"127\.0\.0\.1:9.*KERNELHUB_OBJECTS__ENDPOINT_URL"):
        await store.commit("s1")
    with pytest.raises(StoreError, match="downloading"):
        await store.fetch("s2", "alice", "0" * 64, "0" * 64, 1 << 20)
    assert sorted(p.name for p in store.root.iterdir()) == ["s1.blob"]  # nothing partial


def test_an_endpoint_without_a_bucket_is_refused_not_ignored(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path, objects={"endpoint_url": "http://127.0.0.1:9"})
    with pytest.raises(ConfigError, match="KERNELHUB_OBJECTS__BUCKET"):
        blob_store(settings)


def test_the_object_storage_secret_never_shows_in_the_settings_repr(tmp_path: Path) -> None:
    secret = "s3cr3t-" + os.urandom(8).hex()
    settings = load_settings(
        data_dir=tmp_path,
        objects={**BUCKET, "access_key_id": "AKIDEXAMPLE", "secret_access_key": secret},
    )
    assert secret not in repr(settings) and secret not in str(settings.model_dump())
    assert settings.objects.secret_access_key is not None
    assert settings.objects.secret_access_key.get_secret_value() == secret
