"""Settings: one model, nested per area, read from ``KERNELHUB_*`` variables on demand.

Nothing here runs at import: call :func:`load_settings` (the CLI and app factories do)
and pass the result down.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import platformdirs
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from kernelhub import KERNEL_PROTOCOL_VERSION
from kernelhub.cluster.settings import ClusterSettings, ObjectStoreSettings

# Re-exported: the egress settings live beside the proxy, and config is where callers look.
from kernelhub.egress.settings import EgressPolicy as EgressPolicy
from kernelhub.egress.settings import EgressSettings as EgressSettings
from kernelhub.errors import ConfigError

MiB = 1024 * 1024


class Limits(BaseModel):
    """Per-session resource limits. Every field has a safe default; all are enforced."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_bytes: int = Field(512 * MiB, ge=32 * MiB, description="memory limit, no extra swap")
    cpus: float = Field(1.0, gt=0, le=64, description="CPU quota in cores")
    pids: int = Field(256, ge=16, description="maximum processes and threads")
    workspace_bytes: int = Field(256 * MiB, ge=MiB, description="size of /workspace")
    tmp_bytes: int = Field(128 * MiB, ge=MiB, description="size of /tmp")
    cell_timeout: float | None = Field(
        300.0, gt=0, description="seconds a cell may run; None means no limit"
    )
    output_bytes: int = Field(
        10 * MiB,
        ge=1024,
        description="bytes a cell's output may take: everything the kernel sends for it "
        "(streams, display data and metadata, errors, prompts, clear_output, comm messages). "
        "Past it the start and the last eighth (at most 256 KiB) of its streams are kept, with "
        "a marker between",
    )
    output_events: int = Field(
        10_000,
        ge=16,
        description="output events (stream chunks, displays, clear_output …) kept per cell; "
        "past it stream text goes to the kept tail and the rest is dropped and counted",
    )
    input_timeout: float | None = Field(
        600.0,
        gt=0,
        description="seconds an input()/confirm() waits for a human; then input() raises "
        "EOFError and confirm() returns False. None waits forever",
    )


class DockerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    image: str = f"kernelhub/kernel:p{KERNEL_PROTOCOL_VERSION}"
    runtime: str = Field("runc", description="OCI runtime: runc, or runsc for gVisor")
    base_url: str | None = Field(None, description="Docker Engine address; None = environment")
    run_dir_max_bytes: int | None = Field(
        256 * MiB,
        ge=0,
        description="where the gateway may not mount a capped tmpfs per session (not root, "
        "or a container without CAP_SYS_ADMIN, as under compose), the largest filesystem "
        "KERNELHUB_RUN_DIR may be on: sandboxes can write into their socket directories "
        "there, so on a larger one (the host's /run, a disk) serve refuses to start. Mount "
        "a small tmpfs on it instead; None starts anyway",
    )


class LocalSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    unisolated: bool = Field(
        False,
        description="run kernels as plain host processes when bubblewrap is missing (unsafe)",
    )


class EngineSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    start_timeout: float = Field(60.0, gt=0, description="seconds for a kernel to come up")
    interrupt_grace: float = Field(3.0, gt=0, description="seconds an interrupt may take")
    restart_grace: float = Field(20.0, gt=0, description="seconds a kernel restart may take")
    retain_finished: int = Field(
        64,
        ge=0,
        description="finished executions (with their outputs) an engine keeps in memory; "
        "the gateway keeps none, its store is the record",
    )


class GatewaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="bind address; loopback by default")
    port: int = Field(8765, ge=1, le=65535)
    instance: str = Field(
        "default",
        pattern=r"^[a-z0-9-]{1,20}$",
        description="label value that marks this gateway's sandboxes for re-adoption and cleanup",
    )
    max_sessions: int = Field(32, ge=1, description="sessions alive at once, all principals")
    max_sessions_per_principal: int = Field(8, ge=1)
    max_queued_per_session: int = Field(64, ge=1)
    memory_budget_bytes: int | None = Field(
        None, description="sum of session memory limits allowed; None = 80% of host memory"
    )
    max_body_bytes: int = Field(2 * MiB, ge=1024, description="largest JSON request body")
    max_file_bytes: int = Field(100 * MiB, ge=1024, description="largest upload/download")
    max_snapshot_bytes: int = Field(4 * 1024 * MiB, ge=MiB, description="largest snapshot")
    hibernate_after: float | None = Field(
        1800.0,
        gt=0,
        description="seconds idle before a session is snapshotted and its sandbox removed "
        "(it wakes on next use); None keeps sandboxes up",
    )
    hibernate_timeout: float = Field(
        300.0,
        gt=0,
        description="seconds a hibernation snapshot may take (snapshot_timeout if lower); "
        "past it the capture is interrupted and the session stays awake until its next try",
    )
    hibernate_concurrency: int = Field(
        3, ge=1, le=16, description="idle sessions hibernated at once"
    )
    hibernate_standby: bool = Field(
        True,
        description="start a fresh, empty sandbox for a session as soon as it hibernates, "
        "so that it wakes without a cold start (its namespace restored from the capture "
        "kept in its state directory); costs an idle kernel's memory per hibernated session",
    )
    hibernate_keep_state: bool = Field(
        True,
        description="keep a hibernated session's state directory on its node: the capture "
        "it wakes from fastest and its checkpoints for rewind, in host memory (a tmpfs) about "
        "the size of its namespace; false: the node keeps nothing for it (for many hibernated "
        "sessions per node, with object storage): it wakes from its blob, and rewind reaches "
        "back only to the wake",
    )
    recover_crashed: bool = Field(
        True,
        description="bring a session whose kernel died (out of memory, a segfault, any "
        "death) back in a fresh sandbox: from its last checkpoint, or empty when it has "
        "none, saying so on its stream and in its info. False: the session ends dead",
    )
    checkpoints: Literal["off", "every_cell"] | float = Field(
        "every_cell",
        description="the checkpoint policy of a session created without one: every_cell, "
        "a number (at most one every that many seconds), or off. Checkpoints are what "
        "crash recovery and rewind restore from",
    )
    checkpoint_timeout: float = Field(
        30.0,
        gt=0,
        description="seconds an automatic checkpoint may take; past it the capture is "
        "interrupted and the session's checkpoints are turned off (an object whose "
        "pickling stalls would otherwise hold up every cell), with a notice saying so",
    )
    checkpoint_grace: float = Field(
        0.0,
        ge=0,
        description="seconds a session must be idle after a cell before its automatic "
        "checkpoint starts. 0: right after each cell, and a cell sent while it runs waits "
        "for it (every cell is a point crash recovery and rewind come back to). More "
        "(e.g. 0.05): cells sent back to back are checkpointed together once the burst "
        "ends and none waits for a checkpoint, but a crash in a burst comes back to the "
        "checkpoint before it (the recovery names the burst's cells) and rewind reaches "
        "only the cells that were followed by that much idle time",
    )
    crash_loop_limit: int = Field(
        5,
        ge=1,
        description="kernel deaths of one session within crash_loop_window seconds after "
        "which it is not revived again and ends dead",
    )
    crash_loop_window: float = Field(
        300.0, gt=0, description="seconds over which crash_loop_limit counts deaths"
    )
    snapshot_timeout: float = Field(
        600.0, gt=0, description="seconds a capture or restore may take"
    )
    stream_stall_timeout: float = Field(
        30.0, gt=0, description="seconds one frame may wait on a client that stopped reading"
    )
    stream_buffer_bytes: int = Field(
        MiB,
        ge=64 * 1024,
        description="per WebSocket client: one further behind catches up from the store "
        "(as fast as it reads), and one that takes nothing for stream_stall_timeout with "
        "more than this unsent is cut. Jupyter channels (no replay) keep at least 8 MiB",
    )
    coalesce_window: float = Field(
        0.02,
        ge=0,
        le=1,
        description="seconds a cell's state changes (`accepted`, `status`, `result`, `error`) "
        "may wait for the frame that follows, to leave in the same write and store commit: a "
        "short cell costs its clients one wake-up and the store one commit. Output and `final` "
        "never wait. 0: nothing waits",
    )
    max_streams_per_session: int = Field(
        32, ge=1, description="open WebSocket streams on one session; the next is refused (429)"
    )
    max_streams_per_principal: int = Field(
        64, ge=1, description="open WebSocket streams of one principal, all its sessions"
    )
    max_connections: int = Field(
        1024,
        ge=8,
        description="TCP connections open at once (HTTP and WebSocket); beyond it a new "
        "connection gets a 503 and is closed. Kept below the process's file-descriptor limit",
    )
    header_timeout: float = Field(
        10.0, gt=0, description="seconds a client has to send a request's head (slowloris)"
    )
    body_timeout: float = Field(
        30.0,
        gt=0,
        description="seconds a request body may go without a byte arriving while the "
        "gateway waits for it",
    )
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto",
        description="the gateway's event loop: uvloop (libuv; less CPU per cell on every "
        "socket and timer), asyncio (the standard library's), or auto: uvloop when it is "
        "installed",
    )
    http_parser: Literal["httptools", "h11"] = Field(
        "httptools",
        description="how the gateway parses HTTP/1.1: httptools (llhttp, in C) or h11 (pure "
        "Python, slower); both with the same connection limit and head/body timeouts",
    )
    revocation_check_interval: float = Field(
        2.0, gt=0, description="seconds between checks that open streams' tokens are still valid"
    )
    loop_lag_interval: float = Field(
        0.01,
        ge=0,
        description="seconds between the event loop's lag probes (kernelhub_loop_lag_seconds "
        "on /metrics: how late a timer fires, i.e. how long something held the loop); 0: off",
    )
    allowed_origins: list[str] = Field(
        default_factory=list,
        description="browser origins (`https://app.example.com`) allowed to call the gateway; "
        "empty: none but the gateway's own. Requests without an Origin (non-browser "
        "clients) are always allowed. The same list answers CORS preflights and gets "
        "Access-Control-Allow-Origin (for chat frontends on another origin)",
    )
    web_session_ttl: float = Field(
        8 * 3600.0,
        gt=0,
        description="seconds a review-page sign-in (its cookie) lasts; never past its "
        "token's own expiry, and revoking the token ends it",
    )
    metrics_token: SecretStr | None = Field(
        None,
        description="a token that may read /metrics (and nothing else), for a scraper; "
        "admin tokens may always read it",
    )
    ws_compression: bool = Field(
        False,
        description="permessage-deflate on the WebSocket: saves bandwidth on slow links at "
        "a CPU cost on every frame (off: clients are usually on loopback or a fast network)",
    )
    max_limits: Limits = Field(
        default_factory=lambda: Limits(
            memory_bytes=8 * 1024 * MiB,
            cpus=float(os.cpu_count() or 1),
            pids=4096,
            workspace_bytes=4 * 1024 * MiB,
            tmp_bytes=1024 * MiB,
            cell_timeout=24 * 3600.0,
            output_bytes=100 * MiB,
            output_events=100_000,
        ),
        description="the most a client may ask for",
    )


class PoolSettings(BaseModel):
    """Warm pool: sandboxes started ahead of demand, each handed to exactly one session."""

    model_config = ConfigDict(extra="forbid")

    size: int = Field(
        2,
        ge=0,
        le=64,
        description="ready sandboxes with running kernels kept for new sessions with the "
        "default limits; 0 turns the pool off",
    )
    refill_concurrency: int = Field(
        1, ge=1, le=8, description="sandboxes started at once while refilling"
    )
    profiles: dict[str, int] = Field(
        default_factory=dict,
        description="a warm pool for each named profile (KERNELHUB_PROFILES__TIERS), with "
        'its limits and isolation, by size, e.g. {"untrusted": 2}',
    )
    miss: Literal["starting", "wait"] = Field(
        "starting",
        description="a create that finds its pool empty: starting answers at once with the "
        "session starting (its cells wait for its kernel; a failed start leaves it dead with "
        "the reason); wait answers once its sandbox is up, as with no pool",
    )


class BatchSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    concurrency: int = Field(
        4, ge=1, le=256, description="batch items running at once, all batches together"
    )
    principal_concurrency: int | None = Field(
        None,
        ge=1,
        le=256,
        description="batch items one principal runs at once, all its batches together; "
        "None: half of KERNELHUB_BATCH__CONCURRENCY, rounded up, so another principal's "
        "batch always finds a free slot",
    )
    max_queued_items: int = Field(
        1000, ge=1, description="items waiting to run, all batches; beyond it: 429"
    )
    max_items: int = Field(500, ge=1, description="items in one batch")
    poll_interval: float = Field(
        1.0,
        gt=0,
        description="seconds between looks at the shared queue for items submitted through "
        "other nodes (a submission or a freed slot here looks at once)",
    )
    lease_ttl: float = Field(
        30.0,
        gt=0,
        description="seconds a node's claim on a running batch item lasts unrenewed (renewed "
        "every third of it): after it a lost node's item runs elsewhere, or ends if its code "
        "had started",
    )

    @model_validator(mode="after")
    def _renewed_in_time(self) -> BatchSettings:
        # Claims are renewed once per pass: a lease shorter than a few passes would lapse
        # under an item that is still running.
        if self.lease_ttl < 3 * self.poll_interval:
            raise ValueError(
                f"KERNELHUB_BATCH__LEASE_TTL ({self.lease_ttl:g} s) must be at least three "
                f"times KERNELHUB_BATCH__POLL_INTERVAL ({self.poll_interval:g} s), e.g. "
                f"KERNELHUB_BATCH__LEASE_TTL={max(30.0, 3 * self.poll_interval):g}"
            )
        return self


class StorageSettings(BaseModel):
    """What the store may hold, for how long, and the disk it needs (docs/protocol.md)."""

    model_config = ConfigDict(extra="forbid")

    quota_bytes: int | None = Field(
        1024 * MiB,
        ge=0,
        description="stored events and execution records (code, final record) per principal, "
        "counted as they are written; past it new cells and sessions answer 507. None: no quota",
    )
    quotas: dict[str, int | None] = Field(
        default_factory=dict,
        description='per-principal overrides of quota_bytes, e.g. {"ci": 10737418240, '
        '"admin": null}; null means no quota for that principal',
    )
    retention: float = Field(
        24 * 3600.0,
        ge=0,
        description="seconds a deleted or dead session's events, executions and internal "
        "snapshots are kept before the sweeper purges them; 0: at once (on delete)",
    )
    sweep_interval: float = Field(
        60.0, gt=0, description="seconds between retention sweeps (sessions and audit)"
    )
    min_free_bytes: int = Field(
        1024 * MiB,
        ge=0,
        description="free space the data directory's filesystem must keep; below it new "
        "cells and sessions answer 507. 0 turns the check off",
    )
    min_free_fraction: float = Field(
        0.0,
        ge=0,
        le=1,
        description="the same floor as a fraction of the filesystem's size (0.05 = 5%); "
        "the larger of the two floors applies",
    )
    disk_check_interval: float = Field(
        2.0, gt=0, description="seconds a free-space reading (statvfs) is reused"
    )
    audit_code_bytes: int = Field(
        4096,
        ge=0,
        description="bytes of a cell's code kept in the audit log; the entry also keeps "
        "the code's full length and SHA-256",
    )
    audit_retention: float | None = Field(
        90 * 24 * 3600.0,
        gt=0,
        description="seconds audit entries are kept; None keeps them forever",
    )


class StoreSettings(BaseModel):
    """Where the store lives: SQLite in the data directory (the default), or a shared
    PostgreSQL server (``pip install 'kernelhub[postgres]'``)."""

    model_config = ConfigDict(extra="forbid")

    url: SecretStr | None = Field(
        None,
        description="a PostgreSQL URL, e.g. postgresql://kernelhub:secret@db:5432/kernelhub "
        "or postgresql:///kernelhub?host=/run/postgresql; unset: SQLite at "
        "<data_dir>/kernelhub.sqlite3",
    )
    node: str | None = Field(
        None,
        description="this machine's name in the store (each session's row names the node "
        "that runs it); unset: the host name",
    )

    @field_validator("url")
    @classmethod
    def _postgres_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().startswith(
            ("postgresql://", "postgres://")
        ):
            raise ValueError(
                "KERNELHUB_STORE__URL must be a PostgreSQL URL such as "
                "postgresql://kernelhub:secret@127.0.0.1:5432/kernelhub (leave it unset for SQLite)"
            )
        return value


class Profile(BaseModel):
    """A trust tier: the isolation, limits and egress policy a session runs with."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    isolation: Literal["docker", "gvisor", "local"] | None = Field(
        None,
        description="docker (runc), gvisor (Docker with runsc, where installed), local "
        "(bubblewrap, on a local-backend gateway); None: the gateway's backend as configured",
    )
    limits: Limits | None = Field(
        None,
        description="the session's limits (a request may ask for less, never more); "
        "None: the gateway's defaults and maximum",
    )
    egress: str | None = Field(
        None, description="the egress policy (a name in KERNELHUB_EGRESS__POLICIES)"
    )
    description: str = ""


class ProfileSettings(BaseModel):
    """Trust tiers in one place (docs/egress.md): named profiles, and which tokens may use
    which."""

    model_config = ConfigDict(extra="forbid")

    tiers: dict[str, Profile] = Field(
        default_factory=dict,
        description='named profiles, e.g. {"untrusted": {"isolation": "gvisor", "limits": '
        '{"memory_bytes": 268435456}, "egress": "pypi"}}',
    )
    default: str | None = Field(
        None, description="the profile of a session that names none; None: no profile"
    )
    tokens: dict[str, list[str]] = Field(
        default_factory=dict,
        description='tokens (by name) restricted to profiles, e.g. {"ci-bot": ["untrusted"]}: '
        "such a token creates sessions only with these (the first is its default)",
    )


class Settings(BaseSettings):
    """Everything kernelhub can be told. Variables: ``KERNELHUB_<FIELD>``, nested with ``__``
    (``KERNELHUB_LIMITS__CELL_TIMEOUT=60``)."""

    model_config = SettingsConfigDict(
        env_prefix="KERNELHUB_", env_nested_delimiter="__", extra="forbid"
    )

    backend: Literal["auto", "docker", "local"] = "auto"
    data_dir: Path = Field(default_factory=lambda: _default_data_dir())
    run_dir: Path = Field(
        default_factory=lambda: _default_run_dir(),
        description="where per-session socket directories live (unix socket paths are short)",
    )
    limits: Limits = Field(default_factory=Limits)
    docker: DockerSettings = Field(default_factory=DockerSettings)
    local: LocalSettings = Field(default_factory=LocalSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    pool: PoolSettings = Field(default_factory=PoolSettings)
    batch: BatchSettings = Field(default_factory=BatchSettings)
    storage: StorageSettings = Field(default_factory=StorageSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    egress: EgressSettings = Field(default_factory=EgressSettings)
    profiles: ProfileSettings = Field(default_factory=ProfileSettings)
    objects: ObjectStoreSettings = Field(default_factory=ObjectStoreSettings)
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)

    @field_validator("run_dir")
    @classmethod
    def _short_enough(cls, value: Path) -> Path:
        # "<run_dir>/<12-hex session>/ipc/k-NNNNN" must fit in sun_path (108 bytes).
        if len(str(value)) > 70:
            raise ValueError(
                f"run_dir {str(value)!r} is too long for unix socket paths; "
                "use a short path such as /run/kernelhub"
            )
        return value


def _default_data_dir() -> Path:
    # platformdirs: $XDG_DATA_HOME/kernelhub, else ~/.local/share/kernelhub on Linux.
    return platformdirs.user_data_path("kernelhub", appauthor=False)


# Not platformdirs.user_runtime_path: a root gateway wants /run/kernelhub (the host's
# tmpfs, where the sandboxes' socket directories go), and without XDG_RUNTIME_DIR it would
# name /run/user/<uid>, which may not exist for a service account.


def _default_run_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/run/kernelhub")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "kernelhub" if runtime else Path(f"/tmp/kernelhub-{os.getuid()}")


def load_settings(**overrides: object) -> Settings:
    """Build settings from the environment plus explicit overrides, failing closed."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = "; ".join(
            f"KERNELHUB_{'__'.join(str(p).upper() for p in err['loc'])}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(
            f"invalid settings: {problems} (example: KERNELHUB_LIMITS__CELL_TIMEOUT=60)"
        ) from exc
