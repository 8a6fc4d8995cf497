"""Whether a new session may be created, pure: the gateway's and its principal's session
counts, the host's memory budget and the size of its metadata.

The session manager calls :func:`admit` before it takes a sandbox, with the sessions it
holds; a refusal is the error to answer with (``QuotaError`` with a retry hint, or
``InvalidRequestError``), naming the limit and its knob.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from kernelhub.config import GatewaySettings, Limits
from kernelhub.errors import InvalidRequestError, QuotaError
from kernelhub.session.live import LiveSession
from kernelhub.session.state import SessionState
from kernelhub.wire import MAX_METADATA_BYTES


def alive(sessions: Iterable[LiveSession]) -> list[LiveSession]:
    """The sessions that hold (or are getting) a sandbox."""
    return [s for s in sessions if s.phase not in (SessionState.DEAD, SessionState.DELETED)]


def admit(
    g: GatewaySettings,
    sessions: Iterable[LiveSession],
    owner: str,
    limits: Limits,
    metadata: dict[str, Any],
    memory_budget: int,
) -> None:
    """Raise if a session of ``owner`` with ``limits`` and ``metadata`` may not start now."""
    held = list(sessions)
    running = alive(held)
    if len(running) >= g.max_sessions:
        raise QuotaError(
            f"the gateway runs its maximum of {g.max_sessions} sessions; retry later",
            retry_after=10,
        )
    # Dead sessions hold no sandbox any more, but they count until deleted: a principal
    # cannot pile them up by crashing kernels.
    mine = [s for s in held if s.stored.owner == owner and s.phase != SessionState.DELETED]
    if len(mine) >= g.max_sessions_per_principal:
        dead = sum(s.phase == SessionState.DEAD for s in mine)
        raise QuotaError(
            f"you have {len(mine)} sessions ({dead} of them dead), the most allowed per "
            "token (KERNELHUB_GATEWAY__MAX_SESSIONS_PER_PRINCIPAL); delete one first "
            "(DELETE /v1/sessions/{id}, `kernelhub sessions rm`)",
            retry_after=10,
        )
    # Pooled sandboxes give way to sessions: they are not counted here, and a cold start
    # that needs their memory stops one.
    committed = sum(s.limits.memory_bytes for s in running)
    if committed + limits.memory_bytes > memory_budget:
        raise QuotaError(
            "the host's memory budget is committed to other sessions; retry later or ask for less memory",
            retry_after=10,
        )
    # Measured as stored: the JSON text's bytes.
    size = len(json.dumps(metadata).encode())
    if size > MAX_METADATA_BYTES:
        raise InvalidRequestError(
            f"metadata is {size} bytes of JSON, larger than {MAX_METADATA_BYTES // 1024} KiB; "
            "store less"
        )
