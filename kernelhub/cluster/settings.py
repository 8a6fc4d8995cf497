"""The cluster's settings (issue #24), kept beside the code that reads them; config.py
nests them as ``Settings.objects`` and ``Settings.cluster``."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr


class ObjectStoreSettings(BaseModel):
    """Where snapshots and hibernated sessions live when several nodes share them (issue
    #24): an S3-compatible bucket. Unset ``endpoint_url`` and ``bucket``: local disk, the
    single-machine default."""

    model_config = ConfigDict(extra="forbid")

    endpoint_url: str | None = Field(
        None, description="the S3 API's URL, e.g. https://s3.eu-west-1.amazonaws.com"
    )
    bucket: str | None = Field(None, description="the bucket snapshot blobs go to")
    prefix: str = Field("kernelhub/", description="key prefix inside the bucket")
    region: str = Field("us-east-1")
    access_key_id: SecretStr | None = Field(
        None, description="unset: boto3's own chain (AWS_* variables, an instance role)"
    )
    secret_access_key: SecretStr | None = None
    part_bytes: int = Field(
        16 * 2**20,
        ge=5 * 2**20,
        le=5 * 2**30,
        description="a blob larger than this goes up as a multipart upload in parts of this "
        "size (S3 allows 5 MiB to 5 GiB, at most 10,000 parts)",
    )
    timeout: float = Field(
        60.0, gt=0, description="seconds one request to the object storage may take"
    )

    @property
    def enabled(self) -> bool:
        return self.bucket is not None


class ClusterSettings(BaseModel):
    """Node agents and gateway replicas (issue #24). A node agent (``kernelhub node``)
    serves its sandboxes to the cluster's gateways over mutual TLS; a gateway replica
    (``kernelhub gateway``) places and routes. Both read the shared store."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(
        None,
        description="the URL gateways reach this node agent at, e.g. https://10.0.0.5:8766 "
        "(a node agent's own advertised address)",
    )
    ca_file: Path | None = Field(None, description="the cluster CA certificate (PEM)")
    cert_file: Path | None = Field(None, description="this process's certificate (PEM)")
    key_file: Path | None = Field(None, description="this process's private key (PEM)")
    snapshot_key_file: Path | None = Field(
        None,
        description="the cluster-wide snapshot MAC key (32+ random bytes), the same file on "
        "every node; unset: a per-host key in the data dir (one machine only)",
    )
    heartbeat_interval: float = Field(2.0, gt=0, description="seconds between heartbeats")
    lease_ttl: float = Field(
        10.0, gt=0, description="seconds without a heartbeat before a node counts as lost"
    )
    checkpoint_export_interval: float | None = Field(
        30.0,
        ge=0,
        description="seconds between copies of a running session's state to the shared "
        "snapshot storage, the checkpoint another node restores it from if this node is "
        "lost (a full capture, queued between cells); 0: after every cell; None: never",
    )
    release_hibernated: bool = Field(
        True,
        description="a session hibernated on a node agent gives up its node (and its standby "
        "sandbox) within a heartbeat interval, so its next call wakes it wherever placement "
        "puts it; false: it stays its node's and wakes there",
    )
    adopt_concurrency: int = Field(
        4, ge=1, description="a lost node's sessions this node restores at once"
    )
    drain_concurrency: int = Field(
        2, ge=1, description="sessions a draining node hibernates at once"
    )
