"""Files in and out of a sandbox's ``/workspace``, through ``kernelhub_kernel/files.py``.

Both backends run that one small program to touch the workspace (inside the container for
docker, as a host process rooted at the workspace directory for local), so the rule "no
``..``, no absolute paths, never follow a symlink the sandbox planted" lives in one place.

The program is run so that nothing the sandbox wrote can stand in for it: by absolute
path, in isolated mode (``-I``: no ``PYTHON*`` variables, neither the script's directory
nor the working directory on ``sys.path``), from ``/`` (read-only in the container). And
the host trusts none of its answers: paths are checked here before they are sent (every
malformed one is an ``InvalidRequestError``, a 400), downloads are counted as they stream
against the cap whatever the program claimed, and an exit status it should not give is a
sandbox failure, not a client error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from kernelhub.errors import (
    InvalidRequestError,
    KernelhubError,
    NotFoundError,
    SandboxError,
    TooLargeError,
)
from kernelhub.image import KERNEL_PACKAGE_ROOT

#: Arguments to the kernel's python, before the verb (the image's copy of the program).
FILES_PROGRAM = ["-I", "-S", f"{KERNEL_PACKAGE_ROOT}/kernelhub_kernel/files.py"]
FILES_CWD = "/"
MAX_PATH_BYTES = 1024
MAX_NAME_BYTES = 255
_MAX_MESSAGE = 300


def checked_path(verb: str, path: str) -> str:
    """``path`` if it is a workspace-relative path (``put``/``get``) or a single name
    (``pack``/``unpack``) the program can be given; ``InvalidRequestError`` naming the
    problem otherwise."""
    if not path:
        raise InvalidRequestError("the file path is empty; name a file under /workspace")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise InvalidRequestError(
            f"file path {path!r} contains a NUL or control character; use printable names"
        )
    if "%00" in path:
        raise InvalidRequestError(f"file path {path!r} contains an encoded NUL ('%00')")
    try:
        size = len(path.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidRequestError(f"file path {path!r} is not valid UTF-8") from None
    if size > MAX_PATH_BYTES:
        raise InvalidRequestError(
            f"file path is {size} bytes long; the limit is {MAX_PATH_BYTES} bytes"
        )
    if path.startswith("/"):
        raise InvalidRequestError(f"file path {path!r} is absolute; give it relative to /workspace")
    parts = path.split("/")
    if ".." in parts:
        raise InvalidRequestError(f"file path {path!r} contains '..'; stay inside /workspace")
    for part in parts:
        if len(part.encode("utf-8")) > MAX_NAME_BYTES:
            raise InvalidRequestError(
                f"a name in file path {path[:64]!r}... is longer than {MAX_NAME_BYTES} bytes"
            )
    if verb in ("pack", "unpack") and (len(parts) != 1 or path == "."):
        raise InvalidRequestError(f"snapshot name {path!r} must be a single path component")
    return path


def file_error(exit_code: int | None, stderr: str) -> KernelhubError | None:
    """Translate the program's exit code (see ``kernelhub_kernel/files.py``)."""
    lines = stderr.strip().splitlines()
    message = lines[-1][:_MAX_MESSAGE] if lines else "file transfer failed"
    if exit_code == 0:
        return None
    if exit_code == 3:
        return NotFoundError(message)
    if exit_code == 4:
        return TooLargeError(message + " (KERNELHUB_GATEWAY__MAX_FILE_BYTES)")
    if exit_code in (2, 5):
        return InvalidRequestError(message)
    return SandboxError(f"file transfer failed (exit {exit_code}): {message}")


async def capped(
    chunks: AsyncIterator[bytes],
    max_bytes: int,
    what: str,
    knob: str = "KERNELHUB_GATEWAY__MAX_FILE_BYTES",
) -> AsyncIterator[bytes]:
    """``chunks`` as they come, refused (``TooLargeError``) as soon as they add up to more
    than ``max_bytes``: the program inside may lie about a size, the count does not."""
    total = 0
    try:
        async for chunk in chunks:
            total += len(chunk)
            if total > max_bytes:
                raise TooLargeError(f"{what} is larger than {max_bytes} bytes ({knob})")
            yield chunk
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


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
