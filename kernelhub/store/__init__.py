"""Persistence behind one interface (base.py): SQLite by default, PostgreSQL when
``KERNELHUB_STORE__URL`` names a server."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kernelhub.config import Settings
    from kernelhub.store.base import Store


def node_name(settings: Settings) -> str:
    """This machine's name in the store: ``KERNELHUB_STORE__NODE``, or the host name."""
    return settings.store.node or socket.gethostname()


async def open_store(settings: Settings) -> Store:
    """The store the settings name, open (schema migrated); the caller closes it."""
    node = node_name(settings)
    code_bytes = settings.storage.audit_code_bytes
    if settings.store.url is None:
        from kernelhub.store.sqlite import SqliteStore

        path = settings.data_dir / "kernelhub.sqlite3"
        return await SqliteStore.open(path, audit_code_bytes=code_bytes, node=node)
    from kernelhub.store.postgres import PostgresStore

    url = settings.store.url.get_secret_value()
    return await PostgresStore.open(url, audit_code_bytes=code_bytes, node=node)
