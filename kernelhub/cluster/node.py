"""``kernelhub node``: a node agent, the gateway app run in node mode (issue #24).

It is the single-machine gateway, unchanged (the same SessionManager, Docker backend with
all its hardening, freezer, pool and local ipc sockets), with three differences:

- it serves over **mutual TLS only**: a client whose certificate does not chain to the
  cluster CA (``KERNELHUB_CLUSTER__CA_FILE``) never completes the handshake, so only the
  cluster's gateway replicas reach it. Clients still send their bearer token, and the node
  checks it (the token table is in the shared store) and enforces everything it does on
  one machine;
- it uses the shared store (``KERNELHUB_STORE__URL``, PostgreSQL) under its own node id
  (``KERNELHUB_STORE__NODE``), and holds only the sessions whose row names it;
- it runs the **node tasks** beside the app: the heartbeat (its row and its sessions'
  leases every ``cluster.heartbeat_interval`` seconds) and whatever else is appended to
  :data:`NODE_TASKS` (the node-loss sweep). Each task gets a :class:`NodeContext` once
  the app is up, runs until cancelled at shutdown, and is awaited there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI

from kernelhub.cluster.heartbeat import Heartbeat
from kernelhub.config import Settings
from kernelhub.datadir import DataDirLock
from kernelhub.errors import ConfigError
from kernelhub.session.manager import SessionManager
from kernelhub.store.base import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeContext:
    """What a node task is given: the running app's parts and the node's identity."""

    settings: Settings
    node_id: str
    store: Store
    manager: SessionManager
    app: FastAPI
    heartbeat: Heartbeat


NodeTask = Callable[[NodeContext], Coroutine[Any, Any, None]]


async def _heartbeat(ctx: NodeContext) -> None:
    await ctx.heartbeat.run()


async def _sweep(ctx: NodeContext) -> None:
    """Node loss and draining: the failover sweep (kernelhub.cluster.sweep)."""
    await ctx.manager.failover.run()


#: Started in order once the app is up (after the first beat), cancelled in reverse order.
NODE_TASKS: list[NodeTask] = [_heartbeat, _sweep]


def check_node_settings(settings: Settings) -> None:
    """A node agent needs its address, its TLS files and the shared store; each missing
    one is named with its variable."""
    cluster = settings.cluster
    missing = [
        var
        for var, value in (
            ("KERNELHUB_CLUSTER__ADDRESS (e.g. https://10.0.0.5:8766)", cluster.address),
            ("KERNELHUB_CLUSTER__CA_FILE", cluster.ca_file),
            ("KERNELHUB_CLUSTER__CERT_FILE", cluster.cert_file),
            ("KERNELHUB_CLUSTER__KEY_FILE", cluster.key_file),
            ("KERNELHUB_STORE__URL (postgresql://...)", settings.store.url),
            ("KERNELHUB_STORE__NODE (this node's id)", settings.store.node),
        )
        if value is None
    ]
    if missing:
        raise ConfigError(
            "a node agent needs " + ", ".join(missing) + " (`kernelhub cluster certs` makes "
            "the TLS files; docs/scale-out.md, `## Running a cluster`)"
        )
    if not str(cluster.address).startswith("https://"):
        raise ConfigError(
            f"KERNELHUB_CLUSTER__ADDRESS is {cluster.address!r}: a node agent serves mutual "
            "TLS only, so its address is https://HOST:PORT"
        )
    for var, path in (
        ("KERNELHUB_CLUSTER__CA_FILE", cluster.ca_file),
        ("KERNELHUB_CLUSTER__CERT_FILE", cluster.cert_file),
        ("KERNELHUB_CLUSTER__KEY_FILE", cluster.key_file),
    ):
        if path is not None and not path.is_file():
            raise ConfigError(f"{var} names {str(path)!r}, which is not a file")


def tls_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's options for mutual TLS: our certificate, and a client certificate signed
    by the cluster CA required of every connection."""
    cluster = settings.cluster
    return {
        "ssl_certfile": str(cluster.cert_file),
        "ssl_keyfile": str(cluster.key_file),
        "ssl_ca_certs": str(cluster.ca_file),
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
    }


def create_node_app(
    settings: Settings,
    *,
    data_dir_lock: DataDirLock | None = None,
    tasks: list[NodeTask] | None = None,
) -> FastAPI:
    """The gateway app with the node tasks run in its lifespan."""
    from kernelhub.gateway.app import create_app

    app = create_app(settings, data_dir_lock=data_dir_lock)
    serving = app.router.lifespan_context
    node_id = settings.store.node or ""
    address = settings.cluster.address or ""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with serving(app):
            heartbeat = Heartbeat(
                app.state.store, app.state.manager, node_id=node_id, address=address,
                interval=settings.cluster.heartbeat_interval,
                lease_ttl=settings.cluster.lease_ttl, started_at=datetime.now(UTC),
            )  # fmt: skip
            # Beat once before serving: a replica places sessions here only after that.
            await heartbeat.beat()
            ctx = NodeContext(settings, node_id, app.state.store, app.state.manager, app, heartbeat)
            running = [asyncio.create_task(task(ctx)) for task in tasks or NODE_TASKS]
            log.info("node %s beating every %gs", node_id, settings.cluster.heartbeat_interval)
            try:
                yield
            finally:
                for task in reversed(running):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    app.router.lifespan_context = lifespan
    return app


def serve_node(settings: Settings, *, build: bool = True) -> int:
    """``kernelhub node``: check the settings, then serve like ``serve`` does (backend
    choice, kernel image on first use) over mutual TLS."""
    from kernelhub.cli.serve import serve

    check_node_settings(settings)
    return serve(
        settings,
        build=build,
        app_factory=lambda s, lock: create_node_app(s, data_dir_lock=lock),
        tls=tls_options(settings),
    )
