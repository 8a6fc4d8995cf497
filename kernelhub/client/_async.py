"""The async SDK: :class:`AsyncHub` (one gateway) and :class:`AsyncSession` (one kernel).

REST goes through one ``httpx.AsyncClient`` and one request loop (``AsyncHub._request``,
in :mod:`._hub`); live output over the session's WebSocket stream (:mod:`._stream`),
which reconnects on its own and resumes with ``since=<last seq seen>``, so a caller sees
every event exactly once, in order (the dedupe is :mod:`kernelhub.replay`'s). ``run``
with callbacks is :mod:`._run`; workspace files :mod:`._files`; what they share
:mod:`._rest`. The sync twin (:mod:`._sync`) is derived from these classes.

No background tasks: every socket and request belongs to the call that opened it.
"""

from kernelhub.client._files import FileInfo
from kernelhub.client._hub import AsyncHub, batch_item
from kernelhub.client._rest import DEFAULT_URL, TOKEN_ENV, URL_ENV
from kernelhub.client._session import AsyncSession

__all__ = [
    "DEFAULT_URL",
    "TOKEN_ENV",
    "URL_ENV",
    "AsyncHub",
    "AsyncSession",
    "FileInfo",
    "batch_item",
]
