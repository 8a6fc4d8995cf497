"""Snapshots as a stream over a unix socket in the kernel's socket directory, instead of
files staged in the sandbox's small state tmpfs.

The host picks a name (one path component); the kernel binds ``<socket dir>/<name>``,
the host connects to it (checking it is a socket the sandbox owns, never following a
link: see ``kernelhub.snapshot.transfer``), and the bytes go straight between the
pickler's buffers and the host's blob file. The socket directory is the one the kernel's
ZeroMQ sockets live in (``ip`` of its connection file).

What travels is a tar of the same members a snapshot directory holds (``groups/*.pkl``,
``workspace.tar``, then ``manifest.json``), so a blob made from a directory (by the
files program's ``pack``) and a streamed one read back the same way. Capture writes it
and closes. Restore reads a frame from the host: 8 bytes of length (big-endian), that
many bytes of tar, then one verdict byte, ``1`` if the host's check of the blob's MAC
passed while it streamed (one hash, on the host) and anything else if not: only then
is anything loaded.

Capture goes faster through a pipe the host hands over (``take_pipe``): right after it
connects, the host sends one byte (``OFFER``) carrying the write end of a pipe as
SCM_RIGHTS. The kernel answers ``PIPE_TAKEN`` on the socket and writes the tar into the
pipe instead, big buffers with ``vmsplice`` (their pages go into the pipe by reference,
not copied: the host's ``splice`` into the blob file is the only copy), so it keeps them
alive and unchanged until the host confirms it has them all: after closing the pipe the
kernel sends ``DONE`` and the byte count on the socket, and waits for one byte back. An
old gateway offers nothing: the kernel waits ``OFFER_TIMEOUT`` for the offer, then
writes to the socket as before (so a new image under an old gateway pays that once per
capture, no more).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import os
import select
import socket
import tarfile
import time
from typing import Any

BLOCK = 512
LAYOUT = "KERNELHUB.parts"
_ACCEPT_TIMEOUT = 60.0
_CHUNK = 4 << 20
_SOCKET_BUFFER_BYTES = 4 << 20
OFFER = b"P"
MARKER = b"PIPE_TAKEN"
DONE = b"DONE"
OFFER_TIMEOUT = 0.25
_CONFIRM_TIMEOUT = 600.0
# Below this a plain write costs less than pinning pages.
_VMSPLICE_MIN = 64 << 10


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc: Any = None


def _vmsplice(fd: int, view: memoryview) -> bool:
    """All of ``view`` into the pipe ``fd`` by reference; False when it cannot be
    (read-only buffer, no libc call, refused by the sandbox's filter) and nothing went."""
    global _libc
    if view.readonly or not view.c_contiguous:
        return False
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.vmsplice.restype = ctypes.c_ssize_t
            _libc.vmsplice.argtypes = [
                ctypes.c_int,
                ctypes.POINTER(_IoVec),
                ctypes.c_ulong,
                ctypes.c_uint,
            ]
        except (OSError, AttributeError):
            _libc = False
    if _libc is False:
        return False
    flat = view.cast("B")
    base = ctypes.addressof(ctypes.c_char.from_buffer(flat))
    done = 0
    while done < flat.nbytes:
        iov = _IoVec(base + done, flat.nbytes - done)
        got = _libc.vmsplice(fd, ctypes.byref(iov), 1, 0)  # releases the GIL
        if got < 0:
            err = ctypes.get_errno()
            if err == 4:  # EINTR
                continue
            if done == 0 and err in (1, 22, 38):  # EPERM, EINVAL, ENOSYS
                _libc = False
                return False
            raise OSError(err, os.strerror(err))
        done += got
    return True


def take_pipe(conn: socket.socket, timeout: float = OFFER_TIMEOUT) -> int | None:
    """The pipe the host offers right after connecting (its write end), acknowledged
    with ``MARKER``; None when no offer came within ``timeout`` (an old gateway)."""
    ready, _, _ = select.select([conn], [], [], timeout)
    if not ready:
        return None
    fds = array.array("i")
    data, ancdata, _, _ = conn.recvmsg(len(OFFER), socket.CMSG_SPACE(fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if data != OFFER or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise OSError("the host's pipe offer was malformed")
    conn.sendall(MARKER)
    return fds[0]


def socket_dir() -> str:
    """Where this kernel's ZeroMQ ipc sockets are (its connection file's ``ip``)."""
    from ipykernel.kernelapp import IPKernelApp

    if not IPKernelApp.initialized():
        raise RuntimeError("snapshot streams need an ipykernel started by a connection file")
    app = IPKernelApp.instance()
    if app.transport != "ipc":
        raise RuntimeError(f"snapshot streams need the ipc transport, not {app.transport!r}")
    return os.path.dirname(app.ip)


def accept(name: str, timeout: float = _ACCEPT_TIMEOUT) -> socket.socket:
    """Bind ``name`` in the socket directory and wait for the host to connect."""
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"stream name {name!r} must be a single path component")
    path = os.path.join(socket_dir(), name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(path)
        server.listen(1)
        server.settimeout(timeout)
        try:
            conn, _ = server.accept()
        except TimeoutError:
            raise TimeoutError(f"the host did not connect to {path} in {timeout:.0f} s") from None
    finally:
        server.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
    conn.settimeout(None)
    # A unix stream socket holds what its sender's buffer allows (208 KiB by default):
    # each fill is a round of context switches. At 4 MiB a 100 MiB capture moved in about
    # the time a write of it to a tmpfs takes (71 ms against 92 ms with the default, on
    # the project's 2-core host). The kernel caps it at net.core.wmem_max; never fatal.
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER_BYTES)
    return conn


class TarWriter:
    """Tar members written straight to a socket: headers from tarfile, data from the
    caller's buffers (never copied into a pickle or a file first)."""

    def __init__(self, sock: socket.socket, pipe: int | None = None) -> None:
        self.sock = sock
        self.pipe = pipe
        self.written = 0

    def _header(self, name: str, size: int, layout: list[int] | None = None) -> None:
        info = tarfile.TarInfo(name)
        info.size = size
        info.mode = 0o600
        info.mtime = int(time.time())
        if layout is not None:
            info.pax_headers = {LAYOUT: ",".join(map(str, layout))}
        self._send(info.tobuf(tarfile.PAX_FORMAT))

    def _send(self, data: Any) -> None:
        view = memoryview(data)
        if self.pipe is None:
            self.sock.sendall(view)
        elif view.nbytes < _VMSPLICE_MIN or not _vmsplice(self.pipe, view):
            flat = view.cast("B") if view.ndim != 1 or view.format != "B" else view
            done = 0
            while done < flat.nbytes:
                done += os.write(self.pipe, flat[done:])
        self.written += view.nbytes

    def _pad(self, size: int) -> None:
        if size % BLOCK:
            self._send(bytes(BLOCK - size % BLOCK))

    def add_parts(self, name: str, parts: list[memoryview]) -> int:
        """One member from ``parts``; their lengths go in its pax header, so the reader
        can give each part a buffer of its own (aligned, as numpy wants its arrays)."""
        size = sum(p.nbytes for p in parts)
        self._header(name, size, [p.nbytes for p in parts] if len(parts) > 1 else None)
        for part in parts:
            self._send(part)
        self._pad(size)
        return size

    def add_file(self, name: str, f: Any) -> int:
        size = os.fstat(f.fileno()).st_size
        self._header(name, size)
        f.seek(0)
        if self.pipe is None:
            sent = self.sock.sendfile(f, 0, size)
        else:
            sent = 0
            while sent < size:
                got = os.splice(f.fileno(), self.pipe, size - sent, offset_src=sent)
                if not got:
                    break
                sent += got
        self.written += sent
        if sent != size:
            raise OSError(f"{name}: sent {sent} of {size} bytes")
        self._pad(size)
        return size

    def close(self) -> None:
        self._send(bytes(2 * BLOCK))
        if self.pipe is not None:
            self.abandon()
            # The count lets the host tell a finished stream from a writer that died
            # (both close the pipe); the wait keeps vmspliced pages unchanged until then.
            self.sock.sendall(DONE + self.written.to_bytes(8, "big"))
            self.sock.settimeout(_CONFIRM_TIMEOUT)
            if self.sock.recv(1) != b"\x01":
                raise OSError("the host did not confirm the snapshot stream")
        self.sock.shutdown(socket.SHUT_WR)

    def abandon(self) -> None:
        """Close the pipe (the host then sees its end); idempotent."""
        if self.pipe is not None:
            pipe, self.pipe = self.pipe, None
            os.close(pipe)


class TarReader:
    """Reads the host's restore frame: tar members in order, then the verdict."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.left = int.from_bytes(self._exact(8), "big")
        self.total = self.left

    def _exact(self, n: int) -> bytearray:
        buffer = bytearray(n)
        self._into(memoryview(buffer))
        return buffer

    def _into(self, view: memoryview) -> None:
        done = 0
        while done < view.nbytes:
            got = self.sock.recv_into(view[done:])
            if not got:
                raise EOFError("the snapshot stream ended early")
            done += got

    def _take(self, n: int) -> None:
        if n > self.left:
            raise ValueError("a tar member runs past the end of the snapshot")
        self.left -= n

    def read(self, n: int) -> bytearray:
        self._take(n)
        return self._exact(n)

    def read_into(self, view: memoryview) -> None:
        self._take(view.nbytes)
        self._into(view)

    def copy_to(self, f: Any, size: int) -> None:
        buffer = bytearray(min(_CHUNK, max(size, 1)))
        left = size
        while left:
            view = memoryview(buffer)[: min(left, len(buffer))]
            self.read_into(view)
            f.write(view)
            left -= view.nbytes

    def skip(self, n: int) -> None:
        while n:
            step = min(n, _CHUNK)
            self.read(step)
            n -= step

    def members(self) -> Any:
        """Yields (name, size, part lengths or None) of each regular file (``./``
        stripped); the caller reads exactly ``size`` bytes before asking for the next."""
        pax: dict[str, str] = {}
        while self.left >= BLOCK:
            block = self.read(BLOCK)
            if not any(block):
                break
            info = tarfile.TarInfo.frombuf(bytes(block), "utf-8", "surrogateescape")
            size = int(pax.get("size", info.size))
            if info.type in (tarfile.XHDTYPE, tarfile.XGLTYPE):
                records = self.read(size)
                self.skip(-size % BLOCK)
                if info.type == tarfile.XHDTYPE:
                    pax = _pax_records(bytes(records))
                continue
            name = pax.get("path", info.name)
            if name.startswith("./"):
                name = name[2:]
            parts = [int(n) for n in pax[LAYOUT].split(",")] if LAYOUT in pax else None
            if info.isreg():
                yield name, size, parts
            elif size:
                self.skip(size)
            self.skip(-size % BLOCK)
            pax = {}

    def verdict(self) -> bool:
        """Drain what is left of the tar (its zero padding), then the host's verdict."""
        self.skip(self.left)
        return bytes(self._exact(1)) == b"\x01"


def _pax_records(data: bytes) -> dict[str, str]:
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        records[key.decode()] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records
