"""The session state machine, with data: every state × operation, every transition."""

from __future__ import annotations

import itertools

import pytest

from kernelhub.errors import SessionClosedError, SessionError, SessionStateError
from kernelhub.gateway.errors import status_for
from kernelhub.session.state import (
    LIFECYCLE,
    TRANSITIONS,
    Operation,
    SessionState,
    Transition,
    Verdict,
    advance,
    check,
    closed_error,
    observe,
    verdict,
)

# What each operation does in each state, written out by hand: R runs, W waits for the
# state to change, K wakes the session first, x is refused (409), E has ended (410).
MATRIX = """
            starting  ready  busy  paused  hibernated  recovering  dead  deleted
execute        W        R     R      x        K           W         E      E
interrupt      x        R     R      x        x           x         E      E
cancel         x        R     R      R        x           x         E      E
input          x        R     R      x        x           x         E      E
pause          W        R     R      x        K           W         E      E
resume         x        x     x      R        x           x         E      E
snapshot       W        R     R      x        K           W         E      E
restore        W        R     R      x        K           W         E      E
rewind         W        R     R      x        K           W         E      E
restart        W        R     R      x        K           W         E      E
hibernate      x        R     x      x        x           x         E      E
wake           x        x     x      x        K           x         E      E
files          W        R     R      R        K           W         E      E
call           W        R     R      x        K           W         E      E
info           R        R     R      R        R           R         R      E
stream         R        R     R      R        R           R         R      E
delete         R        R     R      R        R           R         R      E
purge          x        x     x      x        x           x         R      R
"""
_CODES = {"R": Verdict.RUN, "W": Verdict.WAIT, "K": Verdict.WAKE, "x": None, "E": None}


def _cases() -> list[tuple[SessionState, Operation, str]]:
    header, *rows = MATRIX.strip().splitlines()
    states = [SessionState(s) for s in header.split()]
    out = []
    for row in rows:
        op, *codes = row.split()
        assert len(codes) == len(states), row
        out += [(state, Operation(op), code) for state, code in zip(states, codes, strict=True)]
    return out


CASES = _cases()


def test_the_matrix_covers_every_state_and_every_operation() -> None:
    assert {(s, o) for s, o, _ in CASES} == set(itertools.product(SessionState, Operation))


@pytest.mark.parametrize(("state", "operation", "code"), CASES)
def test_each_state_allows_or_refuses_each_operation(
    state: SessionState, operation: Operation, code: str
) -> None:
    assert verdict(state, operation) is _CODES[code]
    if _CODES[code] is not None:
        assert check("s1", state, operation) is _CODES[code]
        return
    with pytest.raises(SessionStateError) as refused:
        check("s1", state, operation, reason="out of memory\nmore detail")
    err = refused.value
    # The refusal names the current and the attempted state, in words and as data.
    assert err.state == state.value and err.operation == operation.value
    assert operation.value in str(err) and "s1" in str(err)
    ended = code == "E"
    assert isinstance(err, SessionClosedError) is ended
    assert status_for(err) == ((410, "session_ended") if ended else (409, "conflict"))
    if state == SessionState.DEAD:
        assert str(err).startswith("session s1 has ended (out of memory)")
        assert "more detail" not in str(err)
    elif not ended:
        assert f"is {state.value}" in str(err)


def test_a_session_that_ended_says_how_without_an_operation() -> None:
    assert str(closed_error("s1", SessionState.DELETED, None)) == (
        "session s1 was deleted; create a new session"
    )
    assert str(closed_error("s1", SessionState.DEAD, None)) == (
        "session s1 has ended (its kernel is gone); create a new session"
    )
    err = closed_error("s1", SessionState.DEAD, "killed", Operation.PAUSE)
    assert (
        str(err)
        == "session s1 has ended (killed): it is dead and cannot pause; create a new session"
    )
    assert isinstance(err, SessionError) and err.operation == "pause"


MOVES = """
starting   started    ready
starting   failed     dead
starting   died       dead
ready      died       dead
ready      crashed    recovering
ready      hibernate  hibernated
hibernated woke       ready
recovering recovered  ready
recovering failed     dead
starting   delete     deleted
ready      delete     deleted
hibernated delete     deleted
recovering delete     deleted
dead       delete     deleted
"""
LEGAL = {
    (SessionState(a), Transition(t)): SessionState(b)
    for a, t, b in (line.split() for line in MOVES.strip().splitlines())
}


def test_the_transition_table_is_exactly_the_drawn_one() -> None:
    assert TRANSITIONS == LEGAL


@pytest.mark.parametrize(("state", "transition"), list(itertools.product(SessionState, Transition)))
def test_every_move_from_every_state(state: SessionState, transition: Transition) -> None:
    if (state, transition) in LEGAL:
        assert advance(state, transition) == LEGAL[(state, transition)]
        return
    with pytest.raises(SessionStateError) as refused:
        advance(state, transition)
    assert refused.value.state == state.value and refused.value.operation == transition.value
    assert state.value in str(refused.value) and transition.value in str(refused.value)


def test_only_lifecycle_phases_are_moved_between() -> None:
    ends = {b for b in TRANSITIONS.values()} | {a for a, _ in TRANSITIONS}
    assert ends == LIFECYCLE
    assert SessionState.BUSY not in LIFECYCLE and SessionState.PAUSED not in LIFECYCLE


KERNELS = """
phase       alive paused running recoverable hibernating  state
ready       1     0      0       0           0            ready
ready       1     0      1       0           0            busy
ready       1     1      1       0           0            paused
ready       1     1      0       1           0            paused
ready       0     0      1       1           0            recovering
ready       0     1      0       0           0            dead
ready       0     0      0       1           1            ready
ready       1     0      1       0           1            busy
starting    0     0      0       1           0            starting
recovering  1     0      0       1           0            recovering
hibernated  0     0      0       1           0            hibernated
dead        1     0      1       1           1            dead
deleted     0     0      0       0           0            deleted
"""


@pytest.mark.parametrize("row", KERNELS.strip().splitlines()[1:])
def test_the_state_is_observed_from_the_phase_and_the_kernel(row: str) -> None:
    phase, alive, paused, running, recoverable, hibernating, state = row.split()
    seen = observe(
        SessionState(phase),
        alive=alive == "1",
        paused=paused == "1",
        running=running == "1",
        recoverable=recoverable == "1",
        hibernating=hibernating == "1",
    )
    assert seen == SessionState(state)
