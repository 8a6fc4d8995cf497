"""The kernel process: ``python -m kernelhub_kernel.launch -f CONNECTION_FILE``.

Started by the supervisor, never by the host directly. Applies ``patches``, then runs
ipykernel's ``IPKernelApp`` with the command line as given.

Environment read here:

* ``KERNELHUB_FLUSH_INTERVAL``: seconds between two publications of buffered output
  (default 0.005).
* ``PYTEST_CURRENT_TEST`` is removed: it leaks in from a test run on the host, and user
  code should not believe it runs under pytest.
* ``IPYTHONDIR`` is kept if set, otherwise pointed at a private temp directory.
* ``KERNELHUB_SNAPSHOTS``, ``KERNELHUB_SPOOL_BYTES``: where and how much of the running
  cell's messages ``spool`` keeps for a gateway that restarts mid-cell.
* ``KERNELHUB_KERNEL_CALLS=0``: no ``kernelhub_call_request`` (see ``calls``).
"""

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from kernelhub_kernel import bounds, calls, cell_log, outstream, packages, patches, spool

FLUSH_INTERVAL_ENV = "KERNELHUB_FLUSH_INTERVAL"


def skip_debugger() -> None:
    """Start ipykernel without its debugger.

    ``ipykernel.debugger`` imports debugpy (and pydevd behind it) when the kernel is
    built, about 90 ms of CPU on every cold start, for a feature kernelhub does not offer
    (the gateway answers ``debug_request`` with an error). With ``debugpy`` unimportable
    while that module loads, it records the debugger as unavailable: no Debugger object,
    no debug stream handling, ``kernel_info`` says ``debugger: false``. The block is lifted
    right after, so user code can still ``import debugpy``."""
    blocked = "debugpy" not in sys.modules
    if blocked:
        sys.modules["debugpy"] = None  # type: ignore[assignment]  # import raises ImportError
    try:
        import ipykernel.debugger  # noqa: F401
    finally:
        if blocked and sys.modules.get("debugpy", 0) is None:
            del sys.modules["debugpy"]


def drop_debug_records(app: Any) -> None:
    """Stop building log records that every handler then drops.

    traitlets gives the application's logger (the kernel's ``self.log``) level DEBUG and
    filters at its handlers (WARNING unless ``--debug``), so each shell message made two
    or three ``LogRecord``s, formatting its whole content, only to throw them away: about
    3% of a ``1+1``'s CPU. The logger's level becomes the lowest level any handler emits,
    so nothing that was written before is lost. A logger that also propagates to the
    root's handlers is left alone.
    """
    log = getattr(app, "log", None)
    if not isinstance(log, logging.Logger) or log.propagate or not log.handlers:
        return
    lowest = min(handler.level for handler in log.handlers)
    if lowest > logging.NOTSET and lowest > log.level:
        log.setLevel(lowest)


def flush_interval_from(environ: Mapping[str, str]) -> float:
    """KERNELHUB_FLUSH_INTERVAL in seconds; exits with a message naming it if invalid."""
    raw = environ.get(FLUSH_INTERVAL_ENV)
    if raw is None:
        return outstream.DEFAULT_FLUSH_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise SystemExit(
            f"{FLUSH_INTERVAL_ENV} must be a number of seconds, 0 or more, such as 0.005;"
            f" got {raw!r}"
        )
    return value


def main(argv: Sequence[str] | None = None) -> None:
    """Run the kernel until it shuts down; argv (default sys.argv[1:]) goes to IPKernelApp."""
    flush_interval = flush_interval_from(os.environ)
    os.environ.pop("PYTEST_CURRENT_TEST", None)
    state_dir = patches.keep_state_out_of_home(os.environ)
    if state_dir is not None:
        patches.relocate_jedi_cache(os.path.join(state_dir, "jedi"))
    patches.run_threads_in_starting_context()
    patches.install_confirm()
    packages.activate()

    # Imported after the environment is settled: IPython reads some of it at import.
    skip_debugger()
    from ipykernel.kernelapp import IPKernelApp
    from jupyter_client.session import Session
    from traitlets.config import Config

    bounds.bound_messages(Session)
    cell_spool = spool.spool_from(os.environ)
    if cell_spool is not None:
        spool.install(Session, cell_spool)
    patches.never_drop_output(IPKernelApp)
    config = Config()
    patches.stream_output_live(config, flush_interval)
    patches.disable_history(config)
    patches.plain_tracebacks(config)
    from ipykernel.zmqshell import ZMQDisplayPublisher

    patches.coalesce_clear_output(Session, ZMQDisplayPublisher)
    # What IPKernelApp.launch_instance() does, with our hooks between init and start.
    app = IPKernelApp.instance(config=config)
    app.initialize(None if argv is None else list(argv))
    drop_debug_records(app)
    streams = [s for s in (sys.stdout, sys.stderr) if isinstance(s, outstream.SandboxOutStream)]
    patches.deliver_fd_output_in_its_cell(app.shell, streams)
    patches.stop_output_history(app.shell)
    patches.warm_tracebacks(app.shell)
    # Before the first cell: what a cell did outside the session is seen only as it runs.
    cell_log.install(app.shell)
    # IPython's own %pip runs `python -m pip`, which the image does not have.
    app.shell.register_magic_function(packages.pip_magic, "line", "pip")
    calls.install(app.kernel, os.environ)
    app.start()


if __name__ == "__main__":
    main()
