"""The kernel's stdout/stderr: SandboxOutStream

``patches.stream_output_live`` installs it in place of ipykernel's OutStream.

A line written after a quiet interval leaves at once and writes made between two flushes
travel in one message; writes to fd 1/2 (C extensions, subprocesses) are read by a
watcher thread and published in the cell that made them (the end-of-cell sync, skipped
when nothing is waiting). Proven against a real kernel in
``tests/component/test_inkernel.py``.
"""

import codecs
import contextlib
import fcntl
import os
import select
import struct
import sys
import termios
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from ipykernel.iostream import OutStream

DEFAULT_FLUSH_INTERVAL = 0.005
MAX_STREAM_MESSAGE_BYTES = 1 << 20
FD_SYNC_TIMEOUT = 0.5

# Written to fd 1/2 at the end of a cell, followed by a random token: when the fd watcher
# reads it, everything written to the fd before the cell ended has been read.
_SYNC_PREFIX = b"\x00kernelhub-fd-sync:"
_SYNC_TOKEN_BYTES = 32  # uuid4().hex
_FD_READ_BYTES = 1 << 16


class SandboxOutStream(OutStream):
    """ipykernel's OutStream (``sys.stdout``/``sys.stderr``), made fit for a sandbox.

    * Live: a line written after a quiet ``flush_interval`` leaves at once (``stream_output_live``).
    * Bounded: one ``stream`` message carries at most ``MAX_STREAM_MESSAGE_BYTES`` of
      UTF-8 text; more is split into several messages, in order. A single
      ``print('x' * 300_000_000)`` would otherwise be one 300 MB message that the IOPub
      socket, the host and the chat all have to swallow whole. Pending text is kept as
      references to the written strings, not copied into a StringIO.
    * fd output (subprocesses, C code, ``os.system``) is read from the pipe that replaces
      fd 1/2 and attributed to the running cell, or to no cell between cells; the base
      class echoes it to the original fd (the container log) and gives it the parent of
      whatever cell ran last. ``sync_fd`` lets a cell's end wait until the fd output the
      cell wrote has been read.
    * The fds are watched even when ``PYTEST_CURRENT_TEST`` is set, which makes the base
      class skip watching: a test run on the host leaks it into our environment.
    """

    flush_interval = DEFAULT_FLUSH_INTERVAL
    _last_flush = 0.0  # time.monotonic() of the last flush that sent text
    _line_end = _flush_now = False
    _sending = False  # the IOPub thread is sending text it took out of the buffers

    def __init__(self, *args: Any, watchfd: bool | str = True, **kwargs: Any) -> None:
        # Set before the base __init__, which starts the fd watcher thread that reads them.
        self._fd_parent: dict[str, Any] = {}
        self._sync_lock = threading.Lock()
        self._sync_token: bytes | None = None
        self._sync_done = threading.Event()
        # True from the moment the watcher takes bytes out of the pipe until it has
        # published them (under _sync_lock): with it False and the pipe empty, every byte
        # written to the fd so far is published and a cell's end has nothing to wait for.
        self._fd_busy = False
        self._pipe_id: tuple[int, int] | None = None
        super().__init__(*args, watchfd="force" if watchfd else False, **kwargs)
        with self._buffer_lock:
            written, self._buffers = self._buffers, defaultdict(_PendingText)
            for parent, buffer in written.items():
                self._buffers[parent].write(buffer.getvalue())

    # --- bounded messages -------------------------------------------------------------

    def _rotate_buffers(self) -> dict[frozenset[tuple[str, Any]], "_PendingText"]:
        with self._buffer_lock:
            pending, self._buffers = self._buffers, defaultdict(_PendingText)
            self._sending = bool(pending)
        return pending

    def flush(self) -> None:
        """Send what was written, and wait until it is sent; at once if nothing was.

        The base class always makes a round trip to the IOPub thread (two wake-ups
        through its event pipe and a wait on an Event), and ipykernel flushes both
        streams three times per cell (before dispatching, after the displayhook, before
        the reply): six round trips for a ``1+1`` that printed nothing. With no text in
        the buffers and none being sent, there is nothing for the wait to order.
        """
        if self._is_master_process():
            with self._buffer_lock:
                if not self._buffers and not self._sending:
                    return
        super().flush()

    def write(self, string: str) -> int | None:
        self._line_end = string.endswith("\n")
        return super().write(string)

    def _schedule_flush(self) -> None:
        # The base always waits flush_interval (5 ms on a cell's first print). After a quiet
        # interval, a write that ends a line leaves at once; writes under load batch.
        now = self._line_end and time.monotonic() - self._last_flush >= self.flush_interval
        if now and not self._flush_now:
            self._flush_now = True
            self.pub_thread.schedule(self._flush)
        elif not self._flush_pending:
            self._flush_pending = True
            self.pub_thread.schedule(
                lambda: self._io_loop.call_later(self.flush_interval, self._flush)
            )

    def _flush(self) -> None:
        """Send what was written since the last flush: per parent, in order, in chunks.

        Runs in the IOPub thread, like the base version it replaces.
        """
        self._flush_pending = self._flush_now = False
        self._subprocess_flush_pending = False
        if self.echo is not None:
            with contextlib.suppress(OSError):
                self.echo.flush()
        written = self._rotate_buffers()
        if written:  # ipykernel also flushes before each cell: that is no load
            self._last_flush = time.monotonic()
        try:
            self._send_pending(written)
        finally:
            with self._buffer_lock:
                self._sending = False

    def _send_pending(self, written: dict[frozenset[tuple[str, Any]], "_PendingText"]) -> None:
        for frozen_parent, pending in written.items():
            parent = dict(frozen_parent)
            for text in pending.chunks(MAX_STREAM_MESSAGE_BYTES):
                # As in the base class: pub_thread is fork-safe, the Session check is not.
                self.session.pid = os.getpid()
                msg = self.session.msg("stream", {"name": self.name, "text": text}, parent)
                for hook in self._hooks:
                    msg = hook(msg)
                    if msg is None:  # the hook consumed the message (e.g. an Output widget)
                        break
                if msg is not None:
                    self.session.send(self.pub_thread, msg, ident=self.topic)

    # --- fd output ----------------------------------------------------------------------

    def _setup_stream_redirects(self, name: str) -> None:
        super()._setup_stream_redirects(name)
        st = os.fstat(self._original_stdstream_fd)
        self._pipe_id = (st.st_dev, st.st_ino)

    def _watch_pipe_fd(self) -> None:
        """Publish what is written to fd 1/2, which the base class turned into a pipe.

        Unlike the base version: no echo to the original fd, a UTF-8 decoder that keeps a
        character cut in two by a read, big reads, and the sync markers taken out.
        """
        if self._fid is None:
            return
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        unread = b""
        # Wait for bytes before taking the lock, so that sync_fd never sees the pipe
        # emptied by a read whose bytes are not yet published.
        poller = select.poll()
        poller.register(self._fid, select.POLLIN)
        try:
            while True:
                poller.poll()
                with self._sync_lock:
                    self._fd_busy = True
                data = os.read(self._fid, _FD_READ_BYTES)
                if not data or not self._should_watch:  # close() writes a byte to wake us
                    return
                unread = self._consume_fd_bytes(unread + data, decoder)
                with self._sync_lock:
                    # Bytes kept back (a possible marker start) are not published yet.
                    self._fd_busy = bool(unread)
        except Exception:
            self._exc = sys.exc_info()

    def _consume_fd_bytes(self, data: bytes, decoder: codecs.IncrementalDecoder) -> bytes:
        """Publish data up to any sync marker, handle the markers; returns the bytes kept
        back because they may be the start of a marker that the next read completes."""
        while True:
            at = data.find(_SYNC_PREFIX)
            if at < 0:
                keep = _marker_start_len(data)
                self._publish_fd_text(decoder.decode(data[: len(data) - keep]))
                return data[len(data) - keep :]
            end = at + len(_SYNC_PREFIX) + _SYNC_TOKEN_BYTES
            if len(data) < end:
                self._publish_fd_text(decoder.decode(data[:at]))
                return data[at:]
            self._publish_fd_text(decoder.decode(data[:at], final=True))
            self._reached_sync(data[at + len(_SYNC_PREFIX) : end])
            data = data[end:]

    def _publish_fd_text(self, text: str) -> None:
        if text:
            # Sets the ContextVar of this (the watcher) thread only; write() reads it.
            self._parent_header.set(self._fd_parent)
            self.write(text)

    def _reached_sync(self, token: bytes) -> None:
        with self._sync_lock:
            if token == self._sync_token:
                # All the cell wrote is published; what follows arrives between cells.
                self._fd_parent = {}
                self._sync_token = None
                self._sync_done.set()

    def begin_cell(self) -> None:
        """Attribute fd output to the cell that starts now. Main thread, pre_execute."""
        self._fd_parent = self.parent_header

    def sync_fd(self) -> threading.Event | None:
        """Mark the end of the cell in the fd's byte stream. Main thread, post_execute.

        Returns an event set once the watcher has published everything before the mark,
        or None when there is nothing to wait for (not watching, or user code pointed the
        fd elsewhere). Call ``end_cell`` after waiting, whether the event was set or not.
        """
        if not self._should_watch or not self.watch_fd_thread.is_alive():
            return None
        try:
            st = os.fstat(self._original_stdstream_fd)
        except OSError:
            return None
        if (st.st_dev, st.st_ino) != self._pipe_id:
            return None
        with self._sync_lock:
            if not self._fd_busy and _unread_bytes(self._fid) == 0:
                # Most cells write nothing to the fd: no marker, no wait for the watcher
                # (two thread wake-ups per stream per cell, ~10% of a `1+1`).
                return None
            token = uuid.uuid4().hex.encode()
            done = threading.Event()
            self._sync_token, self._sync_done = token, done
        try:
            # Shorter than PIPE_BUF, so written atomically between other writers' bytes.
            os.write(self._original_stdstream_fd, _SYNC_PREFIX + token)
        except OSError:
            return None
        return done

    def end_cell(self) -> None:
        """Attribute fd output to no cell until the next ``begin_cell``.

        After a timed-out sync, the late marker is ignored and the cell's remaining fd
        output goes to no cell rather than to the next one.
        """
        with self._sync_lock:
            self._sync_token = None
            self._fd_parent = {}


class _PendingText:
    """The text written for one parent since the last flush.

    References to the written strings rather than a StringIO copy of them: a 300 MB print
    costs no second 300 MB in the kernel, only the 1 MiB slices being sent.
    """

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[str] = []

    def write(self, text: str) -> None:
        self._parts.append(text)

    def getvalue(self) -> str:
        return "".join(self._parts)

    def chunks(self, limit: int) -> Iterator[str]:
        """The text in order, in as few pieces of at most ``limit`` UTF-8 bytes as fit."""
        batch: list[str] = []
        size = 0
        for part in self._parts:
            for piece, piece_size in _split_utf8(part, limit):
                if batch and size + piece_size > limit:
                    yield "".join(batch)
                    batch, size = [], 0
                batch.append(piece)
                size += piece_size
        if batch:
            yield "".join(batch)


def _split_utf8(text: str, limit: int) -> Iterator[tuple[str, int]]:
    """Cut text into consecutive pieces of at most ``limit`` UTF-8 bytes, with their sizes."""
    if text.isascii():
        for start in range(0, len(text), limit):
            piece = text[start : start + limit]
            yield piece, len(piece)
        return
    start = 0
    while start < len(text):
        end = min(len(text), start + limit)
        size = _utf8_size(text[start:end])
        while size > limit:
            # Shrink in proportion; repeat, since the bytes per character vary.
            end = start + max(1, (end - start) * limit // size)
            size = _utf8_size(text[start:end])
        yield text[start:end], size
        start = end


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _unread_bytes(fd: int | None) -> int:
    """Bytes waiting in the pipe ``fd`` (FIONREAD); 1 if that cannot be told."""
    if fd is None:
        return 0
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])
    except OSError:
        return 1


def _marker_start_len(data: bytes) -> int:
    """The length of the longest proper prefix of the sync marker that data ends with."""
    for size in range(min(len(_SYNC_PREFIX) - 1, len(data)), 0, -1):
        if data.endswith(_SYNC_PREFIX[:size]):
            return size
    return 0
