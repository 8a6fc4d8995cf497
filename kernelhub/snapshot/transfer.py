"""Snapshots streamed between a kernel and the host's blob store, never staged in the
sandbox: the kernel binds a unix socket in its socket directory (its side is
``kernel-image/kernelhub_kernel/snapshot/stream.py``), the host connects to it.

The socket directory is writable by the sandbox, so the host treats what it finds there
as hostile, as it does the kernel's ZeroMQ sockets: it opens the name with
``O_PATH|O_NOFOLLOW``, checks it is a socket owned by the sandbox uid, and connects
through ``/proc/self/fd/N``. The bytes are opaque to the host: counted against the cap,
hashed once (the blob's digest, which its MAC binds to its id and owner), written to
the blob file; never parsed, never unpickled.

Everything here blocks and runs in a worker thread (``alongside``), not on the event
loop. The hash runs in a second thread beside the socket and the disk, so they overlap
(both hashes release the GIL): the wall time is the slowest of them, not their sum. The
bytes go from the socket to the file with ``splice`` (kernel to kernel, never through
this process), and the hash reads them back from the page cache.

The digest is BLAKE3 when the ``blake3`` package is installed (``blake3:<hex>``), else
SHA-256 (bare hex, as every blob made before): measured on this project's 2-core host,
SHA-256 hashed 100 MiB in 130-170 ms, three to five times the ``pickle.dump`` the
snapshot is measured against; BLAKE3 (AVX2, and threads when a core is free) in half
that or less. A blob is verified with the algorithm its stored digest names.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
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
from typing import Protocol, TypeVar

try:
    import blake3
except ImportError:  # pragma: no cover - an install without the optional speed-up
    blake3 = None  # type: ignore[assignment]

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
_PIPE_BYTES = 1 << 20
_SOCKET_BUFFER_BYTES = 4 << 20
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
# The wait for the kernel's socket: short polls first (an idle kernel binds it 2-4 ms
# after the call is sent; a fixed 2 ms poll came ~1 ms late on average, 5% of a 10 MiB
# snapshot), growing to _POLL_INTERVAL for a call queued behind a long cell.
_POLL_FIRST = 0.0002
_POLL_GROWTH = 1.5
_POLL_INTERVAL = 0.002
_IO_INTERVAL = 0.25
VERDICT_OK = b"\x01"
VERDICT_REFUSED = b"\x00"


class _Digest(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...
    def hexdigest(self) -> str: ...


def default_algorithm() -> str:
    """The digest new blobs get: BLAKE3 if installed, else SHA-256."""
    return "blake3" if blake3 is not None else "sha256"


def algorithm_of(digest: str) -> str:
    """The algorithm a stored digest names (a bare hex digest is SHA-256)."""
    return digest.split(":", 1)[0] if ":" in digest else "sha256"


def new_digest(algorithm: str) -> _Digest:
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake3" and blake3 is not None:
        return blake3.blake3(max_threads=blake3.blake3.AUTO)
    raise InvalidRequestError(
        f"the snapshot's digest is {algorithm}, which this gateway cannot compute; "
        "install the blake3 package (pip install blake3) to restore it"
    )


def labelled(algorithm: str, digest: _Digest) -> str:
    """The stored form of a digest: bare hex for SHA-256, ``algorithm:hex`` otherwise."""
    hexdigest = digest.hexdigest()
    return hexdigest if algorithm == "sha256" else f"{algorithm}:{hexdigest}"


class _Hasher:
    """The blob's digest in its own thread, fed regions of the file in order (read back
    through ``mmap`` from the page cache, where ``splice`` put them)."""

    def __init__(self, fd: int, algorithm: str) -> None:
        self.fd = fd
        self.algorithm = algorithm
        self.digest = new_digest(algorithm)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kernelhub-snapshot-hash")
        self._pending: deque[Future[None]] = deque()
        self.busy = 0.0

    def feed(self, offset: int, length: int) -> None:
        """Hash ``length`` bytes of the file at ``offset`` (a multiple of the page size),
        after what was fed before."""
        if length:
            self._pending.append(self._pool.submit(self._hash_region, offset, length))
        while self._pending and self._pending[0].done():
            self._pending.popleft().result()  # raises what the thread raised

    def _hash_region(self, offset: int, length: int) -> None:
        t0 = time.monotonic()
        with mmap.mmap(self.fd, length, access=mmap.ACCESS_READ, offset=offset) as mapped:
            view = memoryview(mapped)
            try:
                self.digest.update(view)
            finally:
                view.release()
        self.busy += time.monotonic() - t0

    def hexdigest(self) -> str:
        while self._pending:
            self._pending.popleft().result()
        return labelled(self.algorithm, self.digest)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def connect(
    session_dir: SessionDir, name: str, deadline: float, stop: threading.Event
) -> socket.socket:
    """Wait for the kernel to bind and listen on ``name`` in the socket directory, check
    the socket, connect. (The name appears at ``bind``, a moment before ``listen``: a
    refused connection is tried again until the deadline.)"""
    target = session_dir.ipc_dir / name
    interval = _POLL_FIRST
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
                # A restore's bytes wait in the sender's buffer: see the kernel's side
                # (stream.py) for why 4 MiB. Capped by net.core.wmem_max; never fatal.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER_BYTES)
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
        time.sleep(interval)
        interval = min(interval * _POLL_GROWTH, _POLL_INTERVAL)


def _check(stop: threading.Event, deadline: float) -> None:
    if stop.is_set():
        raise SandboxError("snapshot stream abandoned")
    if time.monotonic() > deadline:
        raise SandboxError("the snapshot stream did not finish in time")


OFFER = b"P"
MARKER = b"PIPE_TAKEN"
DONE = b"DONE"
# Off only to exercise the kernel's socket fallback (what an old gateway gets).
OFFER_PIPE = True


def receive(
    sock: socket.socket,
    target: Path,
    max_bytes: int,
    stop: threading.Event,
    deadline: float,
    spans: dict[str, object] | None = None,
) -> tuple[int, str]:
    """Write everything the kernel sends to the new file ``target``; (size, digest).
    The file is removed on any failure. ``spans`` gets the host's timings.

    First a pipe is offered (its write end passed over the socket as SCM_RIGHTS, see
    the kernel's ``stream.py``): a kernel that takes it answers ``MARKER`` and writes
    the tar into the pipe, which goes to the file with one ``splice`` per chunk; then
    ``DONE`` and its byte count on the socket, which must match, and one byte back to
    confirm. An old image never reads the offer: what it sends first is the tar itself
    (a tar header never starts with ``MARKER``), so the socket path goes on from there."""
    t0 = time.monotonic()
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    hasher = _Hasher(fd, default_algorithm())
    progress = _Progress(fd, hasher, max_bytes)
    pipes: list[int] = []
    mode = "socket"
    try:
        head = b""
        if OFFER_PIPE:
            pipe_r, pipe_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            pipes.append(pipe_r)
            try:
                with contextlib.suppress(OSError):
                    fcntl.fcntl(pipe_w, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
                rights = array.array("i", [pipe_w])
                sock.sendmsg([OFFER], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])
            except (BrokenPipeError, ConnectionResetError):
                # An old image that already sent a small tar and hung up: what it sent
                # is still in our receive queue, so the socket path reads it.
                pass
            finally:
                os.close(pipe_w)
            head = _recv_exact(sock, len(MARKER), stop, deadline, eof_ok=True)
        if head == MARKER:
            mode = "pipe"
            while progress.take(pipe_r, stop, deadline):
                pass
            trailer = _recv_exact(sock, len(DONE) + 8, stop, deadline, eof_ok=True)
            if trailer != DONE + progress.size.to_bytes(8, "big"):
                raise SandboxError(
                    f"the kernel's snapshot stream broke off after {progress.size} bytes"
                )
            # Every byte is in the file (splice copied it out of the pipe), so the kernel
            # may let go of its buffers now, while the hash's tail runs here: its reply to
            # the capture call overlaps that, instead of waiting for it.
            sock.sendall(VERDICT_OK)
        else:
            progress.put(head)
            pipe_r, pipe_w = os.pipe()
            pipes += [pipe_r, pipe_w]
            with contextlib.suppress(OSError):
                fcntl.fcntl(pipe_w, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
            while progress.take(sock.fileno(), stop, deadline, via=(pipe_r, pipe_w)):
                pass
        t_received = time.monotonic()
        digest = progress.finish()
        t_hashed = time.monotonic()
    except BaseException:
        hasher.close()
        os.close(fd)
        fd = -1
        target.unlink(missing_ok=True)
        raise
    finally:
        hasher.close()
        for pipe in pipes:
            os.close(pipe)
        if fd >= 0:
            os.close(fd)
        sock.close()
    if spans is not None:
        spans.update(
            mode=mode,
            # receive: first offer to the last byte in the file (splice is the write);
            # hash: the hash thread's busy time, hash_tail: what it added after.
            receive=round(t_received - t0, 6),
            hash=round(hasher.busy, 6),
            hash_tail=round(t_hashed - t_received, 6),
            fsync=0.0,  # local blobs are not fsynced: see BlobStore.commit
        )
    return progress.size, digest


class _Progress:
    """Bytes into the blob file, counted against the cap and fed to the hash one
    ``CHUNK`` at a time (behind the writes)."""

    def __init__(self, fd: int, hasher: _Hasher, max_bytes: int) -> None:
        self.fd = fd
        self.hasher = hasher
        self.max_bytes = max_bytes
        self.size = self.hashed = 0

    def _grew(self, got: int) -> None:
        self.size += got
        if self.size > self.max_bytes:
            raise TooLargeError(
                f"snapshot is larger than {self.max_bytes} bytes; raise "
                "KERNELHUB_GATEWAY__MAX_SNAPSHOT_BYTES or keep less in the namespace"
            )
        if self.size - self.hashed >= CHUNK:
            step = (self.size - self.hashed) // CHUNK * CHUNK
            self.hasher.feed(self.hashed, step)
            self.hashed += step

    def put(self, data: bytes) -> None:
        if data:
            os.pwrite(self.fd, data, self.size)
            os.lseek(self.fd, len(data), os.SEEK_CUR)
            self._grew(len(data))

    def take(
        self,
        source: int,
        stop: threading.Event,
        deadline: float,
        via: tuple[int, int] | None = None,
    ) -> bool:
        """One splice from ``source`` (a pipe, or a socket ``via`` a pipe) into the file;
        False at the end of the stream."""
        try:
            got = os.splice(source, via[1] if via else self.fd, _PIPE_BYTES, flags=_SPLICE_FLAGS)
        except BlockingIOError:
            _check(stop, deadline)
            select.select([source], [], [], _IO_INTERVAL)
            return True
        except ConnectionResetError:
            # An old image closing with our unread offer in its queue: the tar is
            # complete or not, the kernel's own answer to the capture call says which.
            return False
        if not got:
            return False
        if via:
            left = got
            while left:
                left -= os.splice(via[0], self.fd, left)
        self._grew(got)  # after the bytes are in the file: the hash maps them
        return True

    def finish(self) -> str:
        self.hasher.feed(self.hashed, self.size - self.hashed)
        return self.hasher.hexdigest()


def _recv_exact(
    sock: socket.socket, n: int, stop: threading.Event, deadline: float, eof_ok: bool = False
) -> bytes:
    """``n`` bytes from the socket, or fewer at its end when ``eof_ok``."""
    buffer = bytearray()
    while len(buffer) < n:
        try:
            got = sock.recv(n - len(buffer))
        except TimeoutError:
            _check(stop, deadline)
            continue
        except ConnectionResetError:
            got = b""
        if not got:
            if eof_ok:
                break
            raise SandboxError("the kernel's snapshot stream ended early")
        buffer += got
    return bytes(buffer)


def send(
    sock: socket.socket,
    source: Path,
    accept: Callable[[str], bool],
    stop: threading.Event,
    deadline: float,
    algorithm: str = "sha256",
) -> int:
    """Send the blob framed for the kernel (length, bytes, verdict); the verdict is
    ``accept(digest)``, the digest computed with ``algorithm``. The file goes to the socket with ``sendfile`` (no copy through
    this process) while a second thread hashes it from the page cache. Raises
    ``InvalidRequestError`` when the verdict is no (the kernel then loads nothing)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="kernelhub-snapshot-hash")
    try:
        with open(source, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            hashed = pool.submit(_hash_file, f.fileno(), size, algorithm)
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


def _hash_file(fd: int, size: int, algorithm: str) -> str:
    digest = new_digest(algorithm)
    if size:
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                for offset in range(0, size, CHUNK):
                    digest.update(view[offset : offset + CHUNK])
            finally:
                view.release()
    return labelled(algorithm, digest)


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
    session_dir: SessionDir,
    name: str,
    target: Path,
    max_bytes: int,
    timeout: float,
    spans: dict[str, object] | None = None,
) -> Callable[[threading.Event], tuple[int, str]]:
    """The blocking half of a capture, for ``alongside``: the stream ``name`` into the
    new blob file ``target``; (size, digest). ``spans`` gets the host's timings."""
    deadline = time.monotonic() + timeout

    def run(stop: threading.Event) -> tuple[int, str]:
        t0 = time.monotonic()
        sock = connect(session_dir, name, deadline, stop)
        if spans is not None:
            spans["connect"] = round(time.monotonic() - t0, 6)
        return receive(sock, target, max_bytes, stop, deadline, spans)

    return run


def push(
    session_dir: SessionDir,
    name: str,
    source: Path,
    accept: Callable[[str], bool],
    timeout: float,
    algorithm: str = "sha256",
) -> Callable[[threading.Event], int]:
    """The blocking half of a restore, for ``alongside``: the blob file ``source`` into
    the stream ``name``, with ``accept``'s verdict on its ``algorithm`` digest; the size
    sent."""
    deadline = time.monotonic() + timeout

    def run(stop: threading.Event) -> int:
        sock = connect(session_dir, name, deadline, stop)
        return send(sock, source, accept, stop, deadline, algorithm)

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
