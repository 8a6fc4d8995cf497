"""What a kernel remembers between captures (its last snapshot, its groups), and the
IPython hooks that record which names each cell may have changed."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from . import unchanged
from .analysis import _globals_used_by, analyze_cell
from .replay import Planner

_SESSION: _Session | None = None


@dataclass
class _Group:
    """One group as written: the manifest entry plus what incremental capture needs."""

    names: tuple[str, ...]
    file: str
    sha256: str
    size_bytes: int
    pickler: str
    pickle_bytes: int
    buffers: list[int]
    reach: frozenset[int] | None = None

    def entry(self, reused: bool) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "file": self.file,
            "sha256": self.sha256,
            "size_bytes": self.size_bytes,
            "pickler": self.pickler,
            "pickle_bytes": self.pickle_bytes,
            "buffers": list(self.buffers),
            "reused": reused,
        }


class _Session:
    """What this kernel remembers between captures: the last snapshot and its groups."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.tracker = _Tracker(shell)
        self.snapshot_id: str | None = None
        # The directory of the last capture or restore that ``snapshot_id`` names (None
        # after a streamed one): what ``kernelhub_unchanged_since`` reports.
        self.capture_path: str | None = None
        self.groups: list[_Group] = []
        self.ids: dict[str, int] = {}
        self.workspace: dict[str, Any] | None = None
        self.planner = Planner()


def _session_for(shell: Any) -> _Session:
    global _SESSION
    if _SESSION is None or _SESSION.shell is not shell:
        _SESSION = _Session(shell)
        _SESSION.tracker.install()
        _SESSION.tracker.seed_from_history()
        unchanged.install(shell)
    return _SESSION


def end_own_call() -> None:
    """After a capture or restore that no execute carried (``kernelhub_kernel.calls``)."""
    if _SESSION is not None:
        _SESSION.tracker.end_own_execute()


def _shell() -> Any:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("kernelhub_kernel.snapshot runs inside an IPython kernel")
    return shell


class _Tracker:
    """IPython event hooks that collect the names each cell may have changed.

    ``pre_run_cell``/``post_run_cell`` fire for ordinary cells only; ``pre_execute`` and
    ``post_execute`` for every execute, silent ones included. An execute that ran code we
    did not see (silent, and not our own capture/restore) makes everything dirty.
    """

    def __init__(self, shell: Any) -> None:
        self._shell = shell
        self.names: set[str] = set()
        self.all_dirty = False
        self.from_imports: dict[str, tuple[str, str]] = {}
        self._saw_cell = False
        self._own = False
        # Cells not analyzed yet: the analysis (~1-3 ms a cell, IPython's transform and an
        # AST walk) runs at the next capture, between cells, not inside each cell.
        self._pending: list[str] = []

    def install(self) -> None:
        events = self._shell.events
        events.register("pre_execute", self._pre_execute)
        events.register("pre_run_cell", self._pre_run_cell)
        events.register("post_execute", self._post_execute)
        events.register("post_run_cell", self._post_run_cell)

    def seed_from_history(self) -> None:
        """Learn the ``from module import name`` of the cells that ran before we were
        installed, from IPython's in-session input history (the first capture is full
        anyway, so only the imports matter)."""
        history = getattr(getattr(self._shell, "history_manager", None), "input_hist_raw", [])
        for raw in list(history):
            with contextlib.suppress(Exception):
                usage = analyze_cell(raw, None, self._shell.transform_cell)
                self.from_imports.update(usage.from_imports)

    def mark_own_execute(self) -> None:
        self._own = True

    def end_own_execute(self) -> None:
        """Our call ran without an execute (``kernelhub_kernel.calls``): no
        ``post_execute`` will clear the mark, and the next execute is not ours."""
        self._own = False

    def reset(self) -> None:
        self.names = set()
        self.all_dirty = False
        self._pending = []

    def settle(self) -> None:
        """Analyze the cells that ran since the last call (every capture calls it first).
        Against the namespace as it is now: a name a later cell rebound is caught by its
        ``id()`` anyway."""
        pending, self._pending = self._pending, []
        ns = self._shell.user_ns
        for raw in pending:
            try:
                usage = analyze_cell(raw, ns, self._shell.transform_cell)
                if usage.unknown:
                    self.all_dirty = True
                self.names |= usage.mutated
                self.names |= _globals_used_by(usage.called, ns)
                self.from_imports.update(usage.from_imports)
            except Exception:
                self.all_dirty = True

    def _pre_execute(self) -> None:
        self._saw_cell = False

    def _pre_run_cell(self, info: Any) -> None:
        self._saw_cell = True

    def _post_execute(self) -> None:
        if not (self._saw_cell or self._own):
            self.all_dirty = True
        self._own = False

    def _post_run_cell(self, result: Any) -> None:
        info = getattr(result, "info", None)
        raw = getattr(info, "raw_cell", None)
        if not isinstance(raw, str):
            self.all_dirty = True
            return
        self._pending.append(raw)
        if len(self._pending) >= 256:  # no capture for a long while: keep memory bounded
            self.settle()
