"""Snapshots streamed between a kernel and the host's blob store, never staged in the
sandbox: the kernel binds a unix socket in its socket directory (its side is
``kernel-image/kernelhub_kernel/snapshot/stream.py``), the host connects to it.

The socket directory is writable by the sandbox, so the host treats what it finds there
as hostile, as it does the kernel's ZeroMQ sockets: it opens the name with
``O_PATH|O_NOFOLLOW``, checks it is a socket owned by the sandbox uid, and connects
through ``/proc/self/fd/N``. The bytes are opaque to the host: counted against the cap,
hashed once (the blob's SHA-256, which its MAC binds to its id and owner), written to
the blob file; never parsed, never unpickled.

Everything here blocks and runs in a worker thread (``alongside``), not on the event
loop. The hash runs in a second thread beside the socket and the disk, so the three
overlap (hashlib releases the GIL): the wall time is the slowest of them, not their sum.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import mmap
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from kernelhub.errors import (
    InvalidRequestError,
    KernelhubError,
    SandboxError,
    TooLargeError,
)
from kernelhub.kernel.connection import SessionDir

T = TypeVar("T")
R = TypeVar("R")
CHUNK = 4 << 20
_RING = 6
_POLL_INTERVAL = 0.002
_IO_INTERVAL = 0.25
VERDICT_OK = b"\x01"
VERDICT_REFUSED = b"\x00"


class _Hasher:
    """SHA-256 in its own thread, fed chunks in order; ``free()`` waits for the oldest
    chunk to be hashed before its buffer is reused."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kernelhub-snapshot-hash")
        self._pending: deque[Future[None]] = deque()

    def feed(self, view: memoryview) -> None:
        self._pending.append(self._pool.submit(self.digest.update, view))

    def free(self) -> None:
        if len(self._pending) >= _RING - 1:
            self._pending.popleft().result()

    def hexdigest(self) -> str:
        while self._pending:
            self._pending.popleft().result()
        return self.digest.hexdigest()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def connect(
    session_dir: SessionDir, name: str, deadline: float, stop: threading.Event
) -> socket.socket:
    """Wait for the kernel to bind and listen on ``name`` in the socket directory, check
    the socket, connect. (The name appears at ``bind``, a moment before ``listen``: a
    refused connection is tried again until the deadline.)"""
    target = session_dir.ipc_dir / name
    while True:
        if stop.is_set():
            raise SandboxError("snapshot stream abandoned before the kernel opened it")
        if time.monotonic() > deadline:
            raise SandboxError(f"the kernel did not open its snapshot stream {name!r} in time")
        if os.path.lexists(target):
            fd = session_dir.open_socket(name)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(_IO_INTERVAL)
                sock.connect(f"/proc/self/fd/{fd}")
                return sock
            except ConnectionRefusedError:
                sock.close()
            except OSError as exc:
                sock.close()
                raise SandboxError(
                    f"cannot connect to the kernel's snapshot stream: {exc}"
                ) from exc
            finally:
                os.close(fd)
        time.sleep(_POLL_INTERVAL)


def _check(stop: threading.Event, deadline: float) -> None:
    if stop.is_set():
        raise SandboxError("snapshot stream abandoned")
    if time.monotonic() > deadline:
        raise SandboxError("the snapshot stream did not finish in time")


def receive(
    sock: socket.socket,
    target: Path,
    max_bytes: int,
    stop: threading.Event,
    deadline: float,
) -> tuple[int, str]:
    """Write everything the kernel sends to the new file ``target``; (size, sha256).
    The file is removed on any failure."""
    # Allocated as needed (zeroing 24 MiB up front cost a small snapshot ~10 ms).
    ring: list[bytearray] = []
    hasher = _Hasher()
    size = 0
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        turn = 0
        while True:
            hasher.free()
            if len(ring) < _RING:
                ring.append(bytearray(CHUNK))
            buffer = memoryview(ring[turn % _RING])
            turn += 1
            filled = 0
            while filled < CHUNK:
                try:
                    got = sock.recv_into(buffer[filled:])
                except TimeoutError:
                    _check(stop, deadline)
                    continue
                if not got:
                    break
                filled += got
            if not filled:
                break
            size += filled
            if size > max_bytes:
                raise TooLargeError(
                    f"snapshot is larger than {max_bytes} bytes; raise "
                    "KERNELHUB_GATEWAY__MAX_SNAPSHOT_BYTES or keep less in the namespace"
                )
            view = buffer[:filled]
            hasher.feed(view)
            written = 0
            while written < filled:
                written += os.write(fd, view[written:])
            if filled < CHUNK:
                break
        sha256 = hasher.hexdigest()
    except BaseException:
        os.close(fd)
        fd = -1
        target.unlink(missing_ok=True)
        raise
    finally:
        hasher.close()
        if fd >= 0:
            os.close(fd)
        sock.close()
    return size, sha256


def send(
    sock: socket.socket,
    source: Path,
    accept: Callable[[str], bool],
    stop: threading.Event,
    deadline: float,
) -> int:
    """Send the blob framed for the kernel (length, bytes, verdict); the verdict is
    ``accept(sha256)``. The file goes to the socket with ``sendfile`` (no copy through
    this process) while a second thread hashes it from the page cache. Raises
    ``InvalidRequestError`` when the verdict is no (the kernel then loads nothing)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="kernelhub-snapshot-hash")
    try:
        with open(source, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            hashed = pool.submit(_hash_file, f.fileno(), size)
            _send_all(sock, memoryview(size.to_bytes(8, "big")), stop, deadline)
            sent = 0
            while sent < size:
                try:
                    sent += os.sendfile(
                        sock.fileno(), f.fileno(), sent, min(size - sent, 4 * CHUNK)
                    )
                except BlockingIOError:
                    _check(stop, deadline)
                    select.select([], [sock], [], _IO_INTERVAL)
            ok = accept(hashed.result())
        _send_all(sock, memoryview(VERDICT_OK if ok else VERDICT_REFUSED), stop, deadline)
        sock.shutdown(socket.SHUT_WR)
    except OSError as exc:
        raise SandboxError(f"the kernel's snapshot stream broke: {exc}") from exc
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        sock.close()
    if not ok:
        raise InvalidRequestError(
            "the snapshot failed its integrity check (changed on disk, or not yours);"
            " it was not restored"
        )
    return size


def _hash_file(fd: int, size: int) -> str:
    digest = hashlib.sha256()
    if size:
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                for offset in range(0, size, CHUNK):
                    digest.update(view[offset : offset + CHUNK])
            finally:
                view.release()
    return digest.hexdigest()


def _send_all(
    sock: socket.socket, view: memoryview, stop: threading.Event, deadline: float
) -> None:
    sent = 0
    while sent < view.nbytes:
        try:
            sent += sock.send(view[sent:])
        except TimeoutError:
            _check(stop, deadline)


def pull(
    session_dir: SessionDir, name: str, target: Path, max_bytes: int, timeout: float
) -> Callable[[threading.Event], tuple[int, str]]:
    """The blocking half of a capture, for ``alongside``: the stream ``name`` into the
    new blob file ``target``; (size, sha256)."""
    deadline = time.monotonic() + timeout

    def run(stop: threading.Event) -> tuple[int, str]:
        sock = connect(session_dir, name, deadline, stop)
        return receive(sock, target, max_bytes, stop, deadline)

    return run


def push(
    session_dir: SessionDir,
    name: str,
    source: Path,
    accept: Callable[[str], bool],
    timeout: float,
) -> Callable[[threading.Event], int]:
    """The blocking half of a restore, for ``alongside``: the blob file ``source`` into
    the stream ``name``, with ``accept``'s verdict on its hash; the size sent."""
    deadline = time.monotonic() + timeout

    def run(stop: threading.Event) -> int:
        sock = connect(session_dir, name, deadline, stop)
        return send(sock, source, accept, stop, deadline)

    return run


def mac_check(
    expected_sha256: str, mac_of: Callable[[str], str], mac: str
) -> Callable[[str], bool]:
    """The verdict for ``send``: the streamed bytes hash to what was stored, under a MAC
    that binds that hash to the snapshot's id and owner."""

    def accept(sha256: str) -> bool:
        return hmac.compare_digest(mac_of(sha256), mac) and sha256 == expected_sha256

    return accept


async def alongside(blocking: Callable[[threading.Event], T], call: Awaitable[R]) -> tuple[T, R]:
    """Run ``blocking`` in a worker thread while awaiting ``call`` (the kernel's side of
    the stream). If either fails the other is stopped; the stream's own error (too
    large, refused) wins over the kernel's report of a broken stream."""
    stop = threading.Event()
    worker = asyncio.ensure_future(asyncio.to_thread(blocking, stop))
    try:
        answer = await call
    except BaseException as exc:
        stop.set()
        try:
            await worker
        except KernelhubError as stream_error:
            if isinstance(stream_error, (TooLargeError, InvalidRequestError)):
                raise stream_error from exc
        except BaseException:
            pass
        raise
    try:
        result = await worker
    except BaseException:
        stop.set()
        raise
    return result, answer
