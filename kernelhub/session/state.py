"""The session state machine: the only place that decides what state a session is in,
which way it may move, and what each state lets a caller do. Pure: no I/O, no clock.

A session has a *lifecycle phase* (what the manager did to it, persisted in the store)
and a kernel (alive or not, paused or not, running a cell or not). The state clients
see is derived from both by :func:`observe`::

                 started                 hibernate
    starting ───────────────▶ ready ─────────────────▶ hibernated
       │                  ▲ ▲   │ ▲   ◀───────────────      │
       │ failed/died      │ │   │ │          woke           │
       ▼                  │ │   │ └── busy    (a cell runs) │
     dead ◀─── died ──────┘ │   └──── paused  (frozen)      │
       ▲                    │ recovered                     │
       │ failed         recovering ◀─── crashed (revived: its checkpoint, or empty)
       └────────────────────┘
    every state but deleted ── delete ──▶ deleted

``busy`` and ``paused`` are never a phase: they are what ``ready`` looks like while the
kernel runs a cell or is frozen. :func:`check` answers, for a state and an operation,
whether it runs now, waits for the state to change (starting, recovering), wakes the
session first (hibernated), or is refused: then with a :class:`SessionStateError` (or,
for a session that has ended, :class:`SessionClosedError`) naming both.
"""

from __future__ import annotations

from enum import Enum, StrEnum

from kernelhub.errors import SessionClosedError, SessionStateError
from kernelhub.wire import SessionState

__all__ = [
    "LIFECYCLE",
    "TRANSITIONS",
    "Operation",
    "SessionState",
    "Transition",
    "Verdict",
    "advance",
    "check",
    "closed_error",
    "observe",
    "verdict",
]


class Operation(StrEnum):
    """Everything a caller (or the manager itself) may ask of a session."""

    EXECUTE = "execute"
    INTERRUPT = "interrupt"
    CANCEL = "cancel"
    INPUT = "input"
    PAUSE = "pause"
    RESUME = "resume"
    SNAPSHOT = "snapshot"
    RESTORE = "restore"
    REWIND = "rewind"
    RESTART = "restart"
    HIBERNATE = "hibernate"
    WAKE = "wake"
    FILES = "files"
    CALL = "call"  # kernelhub's own code in the kernel (the E2B drop-in's listing)
    INFO = "info"
    STREAM = "stream"
    DELETE = "delete"
    PURGE = "purge"


class Transition(StrEnum):
    """What moves a session from one lifecycle phase to another."""

    STARTED = "started"  # its kernel answered
    FAILED = "failed"  # starting, or recovering, did not work
    DIED = "died"  # its kernel is gone and nothing brings it back
    CRASHED = "crashed"  # its kernel is gone; recovery brings it back (see session.recovery)
    RECOVERED = "recovered"
    HIBERNATE = "hibernate"  # snapshotted; its sandbox is being removed
    WOKE = "woke"
    DELETE = "delete"


class Verdict(Enum):
    RUN = "run"  # go ahead with the kernel it has
    WAIT = "wait"  # the state will change on its own shortly: wait, then check again
    WAKE = "wake"  # wake it from hibernation, then check again


S, Op, T = SessionState, Operation, Transition

# The phases a session moves between; busy and paused are derived (see observe).
LIFECYCLE = frozenset({S.STARTING, S.READY, S.HIBERNATED, S.RECOVERING, S.DEAD, S.DELETED})

TRANSITIONS: dict[tuple[SessionState, Transition], SessionState] = {
    (S.STARTING, T.STARTED): S.READY,
    (S.STARTING, T.FAILED): S.DEAD,
    (S.STARTING, T.DIED): S.DEAD,
    (S.READY, T.DIED): S.DEAD,
    (S.READY, T.CRASHED): S.RECOVERING,
    (S.READY, T.HIBERNATE): S.HIBERNATED,
    (S.HIBERNATED, T.WOKE): S.READY,
    (S.RECOVERING, T.RECOVERED): S.READY,
    (S.RECOVERING, T.FAILED): S.DEAD,
    **{(s, T.DELETE): S.DELETED for s in LIFECYCLE - {S.DELETED}},
}

_KERNEL_WORK = {Op.EXECUTE, Op.SNAPSHOT, Op.RESTORE, Op.REWIND, Op.RESTART, Op.FILES, Op.CALL}
_ALWAYS = {Op.INFO, Op.STREAM, Op.DELETE}
_AWAKE = _KERNEL_WORK | _ALWAYS | {Op.INTERRUPT, Op.CANCEL, Op.INPUT, Op.PAUSE}

_RULES: dict[SessionState, dict[Operation, Verdict]] = {
    S.STARTING: {
        **{op: Verdict.WAIT for op in _KERNEL_WORK | {Op.PAUSE}},
        **{op: Verdict.RUN for op in _ALWAYS},
    },
    S.RECOVERING: {
        **{op: Verdict.WAIT for op in _KERNEL_WORK | {Op.PAUSE}},
        **{op: Verdict.RUN for op in _ALWAYS},
    },
    S.READY: {**{op: Verdict.RUN for op in _AWAKE | {Op.HIBERNATE}}},
    S.BUSY: {**{op: Verdict.RUN for op in _AWAKE}},
    # Frozen: nothing that needs the kernel to answer; cancelling a queued cell does not.
    S.PAUSED: {**{op: Verdict.RUN for op in _ALWAYS | {Op.RESUME, Op.CANCEL, Op.FILES}}},
    S.HIBERNATED: {
        **{op: Verdict.WAKE for op in _KERNEL_WORK | {Op.PAUSE, Op.WAKE}},
        **{op: Verdict.RUN for op in _ALWAYS},
    },
    S.DEAD: {**{op: Verdict.RUN for op in _ALWAYS | {Op.PURGE}}},
    S.DELETED: {Op.PURGE: Verdict.RUN},
}

# What a refused caller can do about it, by the state that refused it.
_HINTS: dict[SessionState, str] = {
    S.STARTING: "its kernel is not up yet; retry shortly",
    S.RECOVERING: "its kernel is coming back from its last checkpoint; retry shortly",
    S.READY: "nothing is running or paused in it",
    S.BUSY: "a cell is running; wait for it or interrupt it",
    S.PAUSED: "resume it first",
    S.HIBERNATED: "nothing is running in it; any use of its kernel wakes it",
}


def advance(state: SessionState, transition: Transition) -> SessionState:
    """The phase ``transition`` leads to from ``state``; ``SessionStateError`` naming both
    if there is no such move."""
    try:
        return TRANSITIONS[(state, transition)]
    except KeyError:
        raise SessionStateError(
            f"a {state.value} session cannot take the transition {transition.value!r}",
            state=state.value,
            operation=transition.value,
        ) from None


def observe(
    phase: SessionState,
    *,
    alive: bool,
    paused: bool,
    running: bool,
    recoverable: bool,
    hibernating: bool = False,
) -> SessionState:
    """The state a session is in, from its phase and its kernel (``alive``: it has one
    and it is running). A ready session whose kernel died a moment ago is recovering or
    dead already, whatever the watcher has not written yet. One whose sandbox is being
    removed for hibernation (``hibernating``) is listed as hibernated only once it is
    gone: until then it is ready, and what needs its kernel waits."""
    if phase != S.READY:
        return phase
    if not alive and hibernating:
        return S.READY
    if not alive:
        return S.RECOVERING if recoverable else S.DEAD
    if paused:
        return S.PAUSED
    return S.BUSY if running else S.READY


def verdict(state: SessionState, operation: Operation) -> Verdict | None:
    """What ``operation`` does in ``state``: run, wait, wake first; None if refused."""
    return _RULES[state].get(operation)


def check(
    session_id: str, state: SessionState, operation: Operation, reason: str | None = None
) -> Verdict:
    """:func:`verdict`, raising the refusal: ``SessionClosedError`` (410) for a session
    that has ended, ``SessionStateError`` (409) otherwise; both name the state and the
    operation. ``reason`` is why a dead session died."""
    found = verdict(state, operation)
    if found is not None:
        return found
    if state in (S.DEAD, S.DELETED):
        raise closed_error(session_id, state, reason, operation)
    raise SessionStateError(
        f"session {session_id} is {state.value}: cannot {operation.value} ({_HINTS[state]})",
        state=state.value,
        operation=operation.value,
    )


def closed_error(
    session_id: str,
    state: SessionState,
    reason: str | None,
    operation: Operation | None = None,
) -> SessionClosedError:
    """The refusal of a session that has ended (dead or deleted) for good."""
    op = operation.value if operation is not None else None
    what = f": cannot {op}" if op is not None else ""
    if state == S.DELETED:
        message = f"session {session_id} was deleted{what}; create a new session"
    else:
        why = reason.splitlines()[0] if reason else "its kernel is gone"
        what = f": it is {state.value} and cannot {op}" if op is not None else ""
        message = f"session {session_id} has ended ({why}){what}; create a new session"
    return SessionClosedError(message, state=state.value, operation=op)
