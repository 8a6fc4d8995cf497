"""What a sandboxed kernel driven by an agent needs that stock ipykernel does not do.

Each public function is one change; ``launch`` applies them in order. They reach into
ipykernel 7.4 and IPython 9.18 internals (the image pins both): the component tests in
``tests/component/test_inkernel.py`` prove every change against a real kernel, so an
upgrade that breaks one fails there rather than in a chat.

Where a stream message gets its cell: ipykernel keeps the parent header (the execute
request an output answers) in ContextVars, one per OutStream, one for the display
publisher, one for the displayhook, one in the kernel, each set at every shell request,
with a process-wide "last value set" fallback for threads where the variable is unset.
"""

import builtins
import codecs
import concurrent.futures
import contextlib
import contextvars
import fcntl
import os
import select
import stat
import struct
import sys
import tempfile
import termios
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

from ipykernel.iostream import OutStream
from traitlets.config import Config

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


def stream_output_live(config: Config, flush_interval: float) -> None:
    """Make ``SandboxOutStream`` the kernel's stdout/stderr, batching by ``flush_interval``.

    ipykernel publishes writes at most every 0.2 s, so a chat waits 200 ms for each print
    of a slow loop. Here a line written after a quiet interval leaves at once; under load,
    writes made between two flushes travel in one message, so a flood costs few messages.
    """
    SandboxOutStream.flush_interval = flush_interval
    config.IPKernelApp.outstream_class = f"{__name__}.SandboxOutStream"
    config.IPKernelApp.capture_fd_output = True


def run_threads_in_starting_context() -> None:
    """Run each new thread, and each thread-pool task, in a copy of its starter's context.

    The parent headers live in ContextVars, and a new thread starts with an empty context,
    so a thread that prints or ``display()``s after its cell finished falls back to the
    parent of the *current* cell: cell A's output shows under cell B. With a copy of the
    starting thread's context, the thread keeps cell A's headers for its whole life.
    ipykernel's own threads start before any cell, so they get a copy of a context with
    no cell in it. Pool tasks (``ThreadPoolExecutor.submit``, hence ``map`` and asyncio's
    ``run_in_executor``) are wrapped the same way, as ``asyncio.to_thread`` already does,
    because a pool's worker threads serve the cells after the one that started them.
    Threads that take work from a queue of their own (``multiprocessing.pool.ThreadPool``)
    still print under the cell that started them.
    """
    start_thread = threading.Thread.start
    submit = concurrent.futures.ThreadPoolExecutor.submit

    def start(self: threading.Thread) -> None:
        context = contextvars.copy_context()
        run = self.run

        def run_in_context() -> None:
            try:
                context.run(run)
            finally:
                del vars(self)["run"]  # drop the thread -> run -> thread cycle

        vars(self)["run"] = run_in_context
        try:
            start_thread(self)
        except BaseException:
            vars(self).pop("run", None)
            raise

    def submit_in_context(
        self: concurrent.futures.ThreadPoolExecutor,
        fn: Callable[..., Any],
        /,
        *args: Any,
        **kwargs: Any,
    ) -> concurrent.futures.Future[Any]:
        return submit(self, contextvars.copy_context().run, fn, *args, **kwargs)

    threading.Thread.start = start  # type: ignore[method-assign]
    concurrent.futures.ThreadPoolExecutor.submit = submit_in_context  # type: ignore[method-assign]


def deliver_fd_output_in_its_cell(shell: Any, streams: list[SandboxOutStream]) -> None:
    """Publish a cell's fd output in that cell, before its reply; between cells, in none.

    A subprocess's output sits in the pipe until the watcher thread reads it, which may
    be after the kernel sent the execute_reply: the output then lands after the cell ended
    (or, in stock ipykernel, in the next cell). At the end of each cell we write a marker
    to each fd and wait, at most ``FD_SYNC_TIMEOUT``, until the watcher has read up to it;
    when the pipe is empty and the watcher holds no unpublished bytes (most cells: nothing
    was written to fd 1/2), there is nothing to wait for and no marker is written.
    No flush of our own: ipykernel's ``execute_request`` flushes both streams after
    ``do_execute`` (which runs this hook) and before it sends the reply, and each flush is
    a round trip to the IOPub thread, two per cell that stock ipykernel does not pay.
    """

    def pre_execute() -> None:
        for stream in streams:
            stream.begin_cell()

    def post_execute() -> None:
        try:
            pending = [(stream, stream.sync_fd()) for stream in streams]
            deadline = time.monotonic() + FD_SYNC_TIMEOUT
            for stream, done in pending:
                if done is not None:
                    done.wait(max(0.0, deadline - time.monotonic()))
                stream.end_cell()
        except KeyboardInterrupt:
            # An interrupt meant for the cell that just ended; IPython would print its
            # traceback as an error in the hook.
            for stream in streams:
                stream.end_cell()

    shell.events.register("pre_execute", pre_execute)
    shell.events.register("post_execute", post_execute)


def confirm(question: str) -> bool:
    """Ask the human at the other end a yes/no question; True only for "y" or "yes".

    Sent as a Jupyter input_request, so it needs a client that allows stdin; otherwise
    ipykernel raises StdinNotImplementedError, and the code does not go ahead.
    """
    # Looked up at call time: ipykernel replaces builtins.input for each cell.
    try:
        answer = builtins.input(f"{question} [y/N] ")
    except EOFError:
        # The host answers EOF when nobody replied before the deadline: the safe answer.
        return False
    return answer.strip().lower() in {"y", "yes"}


def install_confirm() -> None:
    """Make ``confirm(question)`` a builtin, so agent code can ask before doing harm.

    A builtin rather than a name in the user namespace: it survives ``%reset`` and
    needs no import.
    """
    builtins.confirm = confirm  # type: ignore[attr-defined]


def keep_state_out_of_home(environ: MutableMapping[str, str]) -> str | None:
    """Point IPYTHONDIR at a private directory under the temp dir, unless the host set it.

    HOME is the workspace (the user's files, persisted and snapshotted), where IPython
    would create ``.ipython/``; in the unisolated local mode HOME is a real home whose
    IPython startup scripts and config must not run in an agent's kernel. Returns the
    directory for other state (see ``relocate_jedi_cache``), or None if there is none.
    """
    path = os.path.join(tempfile.gettempdir(), f"kernelhub-kernel-{os.getuid()}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            # Not ours alone (another user made it first, or a symlink): a fresh one.
            path = tempfile.mkdtemp(prefix="kernelhub-kernel-")
    except OSError:
        return None
    environ.setdefault("IPYTHONDIR", os.path.join(path, "ipython"))
    return path


def relocate_jedi_cache(cache_dir: str) -> None:
    """Keep jedi's parse cache out of ``~/.cache``, i.e. out of the workspace.

    Completions make jedi parse the libraries they touch and pickle the trees to
    ``$XDG_CACHE_HOME`` or ``~/.cache``. Setting ``XDG_CACHE_HOME`` would move the
    caches of every program the user runs, so we configure jedi itself, when IPython
    first imports it (lazily: importing jedi at start costs time).
    """
    from IPython.core import completer

    get_jedi = getattr(completer, "_get_jedi", None)
    if get_jedi is None:
        return

    def get_configured_jedi() -> Any:
        jedi = get_jedi()
        jedi.settings.cache_directory = cache_dir
        return jedi

    completer._get_jedi = get_configured_jedi  # type: ignore[attr-defined]


def coalesce_clear_output(session_class: Any, publisher_class: Any) -> None:
    """Send a ``clear_output`` only if something was sent since the last one for the cell.

    Clearing an output that is already clear changes nothing a frontend shows, but 100k
    ``clear_output()`` calls in a loop were 100k messages: each flushed, signed and sent
    here (about 1 ms of this kernel's CPU), received, decoded and counted by the host, for
    30-95 s while the neighbours' kernels shared the CPU with it. Any other message sent
    by this session in between (output, status, a reply) makes the next one count again;
    a repeat with no stream text pending returns before the flush, which waits for the
    IOPub thread.
    """
    send = session_class.send

    def coalescing_send(self: Any, stream: Any, msg_or_type: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(msg_or_type, dict):
            msg_type = msg_or_type.get("msg_type") or msg_or_type.get("header", {}).get("msg_type")
            parent = _msg_id(msg_or_type.get("parent_header"))
        else:
            msg_type = msg_or_type
            parent = _msg_id(kwargs.get("parent", args[1] if len(args) > 1 else None))
        key = (msg_type, parent)
        if msg_type == "clear_output" and getattr(self, "_kernelhub_last_sent", None) == key:
            return None
        self._kernelhub_last_sent = key
        return send(self, stream, msg_or_type, *args, **kwargs)

    clear_output = publisher_class.clear_output

    def quick_clear_output(self: Any, wait: bool = False) -> None:
        repeat = ("clear_output", _msg_id(self.parent_header))
        pending = any(getattr(s, "_buffers", True) for s in (sys.stdout, sys.stderr))
        if not pending and getattr(self.session, "_kernelhub_last_sent", None) == repeat:
            return
        clear_output(self, wait)

    session_class.send = coalescing_send
    publisher_class.clear_output = quick_clear_output


def _msg_id(parent: Any) -> Any:
    """The msg_id of a parent given as a message or as its header."""
    if not isinstance(parent, dict):
        return None
    head = parent.get("header")
    return (head if isinstance(head, dict) else parent).get("msg_id")


def disable_history(config: Config) -> None:
    """No SQLite history: it lives in IPYTHONDIR, costs a thread and a write per cell,
    and nobody reads past sessions of a sandbox. In-session history (``In``, ``_i``,
    ``%history``) still works."""
    config.HistoryManager.enabled = False


def plain_tracebacks(config: Config) -> None:
    """Format tracebacks in IPython's ``Plain`` mode: each frame's location and its one
    current line, like the standard library, ``Cell In[1], line 3`` for cells.

    IPython's default (``Context``) reads every frame's source through stack_data to show
    context lines and highlight them: a pandas KeyError takes 0.7 s on a warm host and
    1.3-2.6 s in a sandbox's first traceback, against about 13 ms in ``Plain`` (see
    bench/tracebacks.py). A user wanting context types ``%xmode Context``.
    """
    config.InteractiveShell.xmode = "Plain"


def warm_tracebacks(shell: Any) -> threading.Thread:
    """Pay the first traceback's one-time costs off the critical path, on a thread.

    Even in ``Plain`` mode a kernel's first traceback took 73 ms against 1.3 ms for the
    next: most of it importing pygments' terminal formatter, which IPython loads on first
    use and caches on the colour theme. A throwaway formatter of the same theme, used once
    on a thread at startup, leaves both cached without delaying the kernel's readiness.
    """

    def warm() -> None:
        from IPython.core import ultratb

        formatter = ultratb.AutoFormattedTB(mode="Plain", theme_name=shell.colors)
        try:
            raise LookupError("kernelhub: warming up the traceback formatter")
        except LookupError as exc:
            formatter.structured_traceback(type(exc), exc, exc.__traceback__)

    thread = threading.Thread(target=warm, name="kernelhub-warm-tracebacks", daemon=True)
    thread.start()
    return thread


def stop_output_history(shell: Any) -> None:
    """Stop IPython from keeping a copy of everything a cell prints.

    IPython 9 wraps ``sys.stdout.write`` during each cell and appends every write to
    ``history_manager.outputs``, in memory, for the life of the kernel (with history
    disabled, too): a cell that prints 300 MB keeps 300 MB, and a long agent session
    grows without bound. Nothing in a kernelhub kernel reads it.
    """
    if hasattr(shell, "_tee"):
        shell._tee = lambda channel: contextlib.nullcontext()


def never_drop_output(app_class: Any) -> None:
    """Make the iopub socket queue instead of drop.

    ZeroMQ's PUB/XPUB socket silently drops messages once 1000 are queued for a slow
    subscriber, so a burst of output could vanish without a trace. With no high-water mark
    the backlog waits in this process instead, where the sandbox's memory limit bounds it,
    and the host's output cap turns anything excessive into an explicit truncation.

    The option must be set before ``bind`` and before the IOPub thread owns the socket
    (zmq sockets are not thread-safe), so this is ipykernel 7.4's ``init_iopub`` with that
    one line added.
    """
    import zmq
    from ipykernel.iostream import IOPubThread

    def init_iopub(self: Any, context: Any) -> None:
        self.iopub_socket = context.socket(zmq.XPUB)
        self.iopub_socket.linger = 1000
        self.iopub_socket.sndhwm = 0
        self._apply_curve_server_options(self.iopub_socket)
        self.iopub_port = self._bind_socket(self.iopub_socket, self.iopub_port)
        self.log.debug("iopub PUB Channel on port: %i", self.iopub_port)
        self.configure_tornado_logger()
        self.iopub_thread = IOPubThread(self.iopub_socket, pipe=True, session=self.session)
        self.iopub_thread.start()
        self.iopub_socket = self.iopub_thread.background_socket

    app_class.init_iopub = init_iopub
