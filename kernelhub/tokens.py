"""Minting tokens, scoped or not: one path for ``kernelhub token create`` and
``POST /v1/admin/tokens``, so both refuse the same nonsense with the same words."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from pydantic import BaseModel, ConfigDict, Field

from kernelhub.errors import InvalidRequestError, NotFoundError
from kernelhub.store.base import Store

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNIT = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """``"90"``, ``"90s"``, ``"15m"``, ``"2h"``, ``"7d"`` in seconds."""
    m = _DURATION.match(text.lower())
    if m is None or float(m.group(1)) <= 0:
        raise InvalidRequestError(
            f"expiry {text!r} is not a duration; write e.g. 90s, 15m, 2h or 7d"
        )
    return float(m.group(1)) * _UNIT[m.group(2)]


class TokenCreate(BaseModel):
    """A token to mint. A session-scoped token stands for the session's owner (or for
    ``owner``), so it sees that session; a read-only one may view and export only."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    admin: bool = False
    read_only: bool = False
    session_id: str | None = Field(None, description="the one session the token may see")
    expires_in: float | None = Field(None, gt=0, description="seconds until it expires")
    owner: str | None = Field(None, description="the principal it stands for (default: itself)")


class TokenCreated(BaseModel):
    name: str
    token: str = Field(description="shown this once; only its hash is stored")
    owner: str
    admin: bool
    read_only: bool
    session_id: str | None
    expires_at: datetime | None


async def mint(store: Store, spec: TokenCreate) -> TokenCreated:
    if spec.admin and (spec.read_only or spec.session_id or spec.owner):
        raise InvalidRequestError(
            "an admin token cannot be read-only, scoped to a session or stand for someone; "
            "drop --admin (admin=false)"
        )
    owner = spec.owner
    if spec.session_id is not None:
        session = await store.get_session(spec.session_id)
        if session is None:
            raise NotFoundError(f"no session {spec.session_id!r} to scope the token to")
        if owner is not None and owner != session.owner:
            raise InvalidRequestError(
                f"session {spec.session_id!r} belongs to {session.owner!r}, not {owner!r}"
            )
        owner = session.owner
    expires_at = datetime.now(UTC) + timedelta(seconds=spec.expires_in) if spec.expires_in else None
    token = await store.create_token(
        spec.name,
        admin=spec.admin,
        read_only=spec.read_only,
        session_id=spec.session_id,
        expires_at=expires_at,
        acts_for=owner if owner != spec.name else None,
    )
    return TokenCreated(
        name=spec.name,
        token=token,
        owner=owner or spec.name,
        admin=spec.admin,
        read_only=spec.read_only,
        session_id=spec.session_id,
        expires_at=expires_at,
    )
