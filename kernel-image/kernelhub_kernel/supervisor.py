"""The sandbox's first process: runs the kernel, reaps zombies, turns host signals into actions.

Run as ``python -m kernelhub_kernel.supervisor --connection-file PATH``. The kernel is
``python -m kernelhub_kernel.launch -f PATH`` in its own session (so its own process group),
with our environment and working directory.

Signals, the host's way to reach the kernel when the kernel itself does not answer:

* SIGINT: forwarded to the kernel's process group. Interrupts the running cell and, like
  Ctrl-C in a terminal, the subprocesses the cell started.
* SIGHUP: restart. SIGKILL everything but us, reap, start a fresh kernel on the same
  connection file. For a cell that ignores interrupts: variables are lost, files survive.
* SIGTERM: SIGKILL everything but us, exit 0.

When the kernel exits on its own, the supervisor exits with its status: the exit code, or
128 + the signal number when a signal killed it (137 for SIGKILL, usually the OOM killer;
139 for SIGSEGV), after one line on stderr saying so.

"Everything" depends on where we run. As pid 1 of a pid namespace (the container, or
bubblewrap with ``--as-pid-1``), ``kill(-1, SIGKILL)`` reaches every other process of the
namespace, including daemons that left the kernel's process group, and orphans are
re-parented to us, so we reap them. Otherwise (the unisolated local mode) ``kill(-1)`` would
hit every process of the user on the host, so we only kill the kernel's process group.
"""

# Only what every start needs is imported up here: argparse (for an unusual command line)
# and shutil (bz2, lzma; for the matplotlib cache copy) load when used, since pid 1's
# imports sit in front of the kernel's on every cold start.
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence

PREBUILT_MPLCONFIG = "/opt/kernelhub/mplconfig"

_HANDLED_SIGNALS = {signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGCHLD}
_PR_SET_PDEATHSIG = 1
_LOG_PREFIX = "kernelhub-supervisor:"


class Supervisor:
    """Runs one kernel at a time and handles the signals listed in the module docstring."""

    def __init__(self, connection_file: str) -> None:
        self._kernel_argv = [
            sys.executable,
            "-m",
            "kernelhub_kernel.launch",
            "-f",
            connection_file,
        ]
        self._pid = os.getpid()
        self._is_namespace_init = self._pid == 1
        self._kernel_pid: int | None = None
        # The kernel's process group outlives the kernel when its subprocesses do.
        self._kernel_group: int | None = None
        # Resolved before fork: the child should only make the call.
        self._prctl = _load_prctl()

    def run(self) -> int:
        """Start the kernel and handle signals until it exits or we are told to stop.

        Returns the process exit status for the supervisor.
        """
        # The handled signals are blocked and taken one at a time with sigwaitinfo: no code
        # runs in a signal handler, so a SIGHUP that arrives during a restart waits its turn
        # instead of re-entering it, and no SIGCHLD is lost between fork and wait. (Blocked
        # signals are queued even for a pid 1 that has no handler for them.)
        signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED_SIGNALS)
        # After the mask: the forwarder's thread inherits it and never takes our signals.
        start_egress(os.environ)
        self._spawn_kernel()
        while True:
            # Interrupted by another signal, Python retries the call (PEP 475).
            signum = signal.sigwaitinfo(_HANDLED_SIGNALS).si_signo
            if signum == signal.SIGCHLD:
                status = self._reap_exited()
                if status is not None:
                    code = _exit_code(status)
                    print(
                        f"{_LOG_PREFIX} kernel exited with status {code}{_describe(status)}",
                        file=sys.stderr,
                        flush=True,
                    )
                    self._kill_all()
                    return code
            elif signum == signal.SIGINT:
                self._interrupt_kernel()
            elif signum == signal.SIGHUP:
                self._kill_all()
                self._spawn_kernel()
            elif signum == signal.SIGTERM:
                self._kill_all()
                return 0

    def _spawn_kernel(self) -> None:
        pid = os.fork()
        if pid == 0:
            self._exec_kernel()
        self._kernel_pid = self._kernel_group = pid

    def _exec_kernel(self) -> None:
        """In the forked child: become the kernel. Never returns."""
        try:
            # Own session and process group: the SIGINT we forward reaches the kernel and
            # the subprocesses of its cell, never us.
            os.setsid()
            # Outside a pid namespace nothing else kills the kernel if the supervisor is
            # SIGKILLed (jupyter_client does so when a shutdown times out): die with it.
            if self._prctl is not None:
                self._prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
                if os.getppid() != self._pid:
                    os._exit(1)  # the supervisor died before prctl took effect
            # The signal mask survives exec; the kernel needs these signals delivered. A
            # SIGINT already pending would raise KeyboardInterrupt here, so ignore it until
            # ipykernel installs its own handling (it ignores SIGINT outside cells anyway).
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            os.execv(self._kernel_argv[0], self._kernel_argv)
        except BaseException as exc:
            print(f"{_LOG_PREFIX} cannot start the kernel: {exc}", file=sys.stderr, flush=True)
        finally:
            os._exit(127)

    def _interrupt_kernel(self) -> None:
        if self._kernel_group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._kernel_group, signal.SIGINT)

    def _reap_exited(self) -> int | None:
        """Reap every exited child; returns the kernel's wait status if it was among them.

        One SIGCHLD may stand for several exits (standard signals do not queue), and as
        pid 1 our children include every orphan of the namespace, so reap until none is left.
        """
        kernel_status = None
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == self._kernel_pid:
                kernel_status = status
                self._kernel_pid = None
        return kernel_status

    def _kill_all(self) -> None:
        """SIGKILL every process but us (see the module docstring for what that means) and reap."""
        if self._is_namespace_init:
            with contextlib.suppress(ProcessLookupError):
                os.kill(-1, signal.SIGKILL)
        elif self._kernel_group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._kernel_group, signal.SIGKILL)
        # Blocking waits: everything we wait for has just been sent SIGKILL. Outside a pid
        # namespace only the kernel is our child; its orphans go to the host's reaper.
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
        self._kernel_pid = self._kernel_group = None


def _load_prctl() -> Callable[[int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl: Callable[[int, int], int] = libc.prctl
    except (OSError, AttributeError):
        return None
    return prctl


def _exit_code(status: int) -> int:
    """The shell's convention: the exit code, or 128 + the number of the killing signal."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


def _describe(status: int) -> str:
    if not os.WIFSIGNALED(status):
        return ""
    signum = os.WTERMSIG(status)
    try:
        return f" ({signal.Signals(signum).name})"
    except ValueError:
        return f" (signal {signum})"


def seed_mplconfig(environ: Mapping[str, str], prebuilt: str = PREBUILT_MPLCONFIG) -> None:
    """Copy the image's pre-built matplotlib cache to MPLCONFIGDIR if that is missing or empty.

    The root filesystem is read-only, so the image points MPLCONFIGDIR at the /tmp tmpfs,
    which starts empty: without this copy the first ``import matplotlib.pyplot`` of every
    sandbox spends seconds building the font cache. Failing to copy only costs that time.
    """
    target = environ.get("MPLCONFIGDIR")
    if not target or not os.path.isdir(prebuilt):
        return
    if os.path.isdir(target) and os.listdir(target):
        return
    import shutil

    try:
        shutil.copytree(prebuilt, target, dirs_exist_ok=True)
    except OSError as exc:
        print(
            f"{_LOG_PREFIX} not copying {prebuilt} to MPLCONFIGDIR={target}: {exc}",
            file=sys.stderr,
            flush=True,
        )


def start_egress(environ: Mapping[str, str]) -> None:
    """The loopback port HTTP_PROXY points at, forwarded to the gateway's egress proxy
    (``kernelhub_kernel.egress``); imported only when the host asked for it: asyncio
    costs start-up time."""
    if not environ.get("KERNELHUB_EGRESS_PORT"):
        return
    from kernelhub_kernel import egress

    egress.write_bundle(environ)
    egress.start_forwarder(environ)


def connection_file_from(argv: Sequence[str]) -> str:
    """The connection file of the command line; argparse only for any other shape of it
    (its help, its errors)."""
    if len(argv) == 2 and argv[0] == "--connection-file" and not argv[1].startswith("-"):
        return argv[1]
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m kernelhub_kernel.supervisor",
        description="Run an IPython kernel as the first process of a kernelhub sandbox.",
    )
    parser.add_argument(
        "--connection-file", required=True, help="the kernel's Jupyter connection file"
    )
    return str(parser.parse_args(argv).connection_file)


def main(argv: Sequence[str] | None = None) -> int:
    connection_file = connection_file_from(sys.argv[1:] if argv is None else argv)
    seed_mplconfig(os.environ)
    return Supervisor(connection_file).run()


if __name__ == "__main__":
    sys.exit(main())
