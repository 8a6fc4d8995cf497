"""Workspace files over REST, the SDK's side: paths, streamed upload bodies, streamed
downloads into a (sync or async) file object."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Iterable
from typing import Protocol
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from kernelhub.client.errors import GatewayUnreachableError, api_error

CHUNK_BYTES = 64 * 1024


class FileInfo(BaseModel):
    """What ``PUT /v1/sessions/{sid}/files/{path}`` answers."""

    path: str
    size: int


class Readable(Protocol):
    """A binary file object, sync (``open(..., 'rb')``) or async (aiofiles)."""

    def read(self, size: int, /) -> bytes | Awaitable[bytes]: ...


class Writable(Protocol):
    def write(self, data: bytes, /) -> object: ...


UploadData = bytes | bytearray | memoryview | AsyncIterable[bytes] | Iterable[bytes] | Readable


def file_path(session_path: str, path: str) -> str:
    """The REST path of ``path`` in the workspace of the session at ``session_path``."""
    relative = path.lstrip("/")
    if not relative:
        raise api_error(None, "invalid_request", f"a file path is required, got {path!r}")
    return f"{session_path}/files/{quote(relative, safe='/')}"


def upload_body(data: UploadData) -> bytes | AsyncIterable[bytes]:
    """Bytes as they are; anything else streamed chunk by chunk, never buffered whole."""
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    return _chunks(data)


async def _chunks(data: AsyncIterable[bytes] | Iterable[bytes] | Readable) -> AsyncIterator[bytes]:
    if hasattr(data, "read"):  # before AsyncIterable: async files iterate by line
        while True:
            got = data.read(CHUNK_BYTES)
            chunk = await got if inspect.isawaitable(got) else got
            if not chunk:
                return
            yield bytes(chunk)
    elif isinstance(data, AsyncIterable):
        async for chunk in data:
            yield bytes(chunk)
    else:
        for chunk in data:
            yield bytes(chunk)


async def save(response: httpx.Response, file: Writable, what: str) -> int:
    """Copy a streamed response into ``file`` and close it; returns the bytes written.
    ``what`` names the download in the error if the connection breaks off."""
    size = 0
    try:
        async for chunk in response.aiter_bytes(CHUNK_BYTES):
            written = file.write(chunk)
            if inspect.isawaitable(written):
                await written
            size += len(chunk)
    except httpx.TransportError as exc:
        raise GatewayUnreachableError(
            f"downloading {what} broke off after {size} bytes: "
            f"{type(exc).__name__}: {exc}; try again"
        ) from exc
    finally:
        await response.aclose()
    return size
