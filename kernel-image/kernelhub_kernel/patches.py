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
import concurrent.futures
import contextlib
import contextvars
import os
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, MutableMapping
from typing import Any

from traitlets.config import Config

from kernelhub_kernel.outstream import FD_SYNC_TIMEOUT, SandboxOutStream


def stream_output_live(config: Config, flush_interval: float) -> None:
    """Make ``SandboxOutStream`` the kernel's stdout/stderr, batching by ``flush_interval``.

    ipykernel publishes writes at most every 0.2 s, so a chat waits 200 ms for each print
    of a slow loop. Here a line written after a quiet interval leaves at once; under load,
    writes made between two flushes travel in one message, so a flood costs few messages.
    """
    SandboxOutStream.flush_interval = flush_interval
    config.IPKernelApp.outstream_class = f"{SandboxOutStream.__module__}.SandboxOutStream"
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
