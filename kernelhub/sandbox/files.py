"""Files in and out of a sandbox's ``/workspace``, through ``kernelhub_kernel.files``.

Both backends run that one small program to touch the workspace (inside the container for
docker, as a host process rooted at the workspace directory for local), so the rule "no
``..``, no absolute paths, never follow a symlink the sandbox planted" lives in one place.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from kernelhub.errors import InvalidRequestError, KernelhubError, NotFoundError, TooLargeError

FILES_MODULE = ["-S", "-m", "kernelhub_kernel.files"]


def file_error(exit_code: int | None, stderr: str) -> KernelhubError | None:
    """Translate the program's exit code (see ``kernelhub_kernel/files.py``)."""
    message = stderr.strip().splitlines()[-1] if stderr.strip() else "file transfer failed"
    if exit_code == 0:
        return None
    if exit_code == 3:
        return NotFoundError(message)
    if exit_code == 4:
        return TooLargeError(message + " (KERNELHUB_GATEWAY__MAX_FILE_BYTES)")
    if exit_code in (2, 5):
        return InvalidRequestError(message)
    return KernelhubError(f"file transfer failed (exit {exit_code}): {message}")


async def pump_upload(
    chunks: AsyncIterator[bytes], write: Callable[[bytes], Awaitable[None]], max_bytes: int
) -> int:
    """Feed ``chunks`` to ``write`` until exhausted; the size, or TooLargeError."""
    total = 0
    async for chunk in chunks:
        total += len(chunk)
        if total > max_bytes:
            raise TooLargeError(
                f"upload is larger than {max_bytes} bytes (KERNELHUB_GATEWAY__MAX_FILE_BYTES)"
            )
        try:
            await write(chunk)
        except (BrokenPipeError, ConnectionResetError):
            break  # the program refused the path and exited; its exit code says why
    return total


def demux(buffer: bytearray) -> Iterator[tuple[int, bytes]]:
    """Pop complete Docker attach frames (8-byte header: stream, 0, 0, 0, size) off the
    front of ``buffer``; stream 1 is stdout, 2 is stderr."""
    while len(buffer) >= 8:
        stream, size = buffer[0], int.from_bytes(buffer[4:8], "big")
        if len(buffer) < 8 + size:
            return
        payload = bytes(buffer[8 : 8 + size])
        del buffer[: 8 + size]
        yield stream, payload
