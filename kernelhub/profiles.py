"""Trust tiers: which profile a new session runs in, and what that means for its sandbox.

Pure decisions over the settings (``KERNELHUB_PROFILES__*``); the session manager calls
:func:`choose_profile` at creation and passes the result on: the runtime to its backend
(:func:`runtime_for`), the limits to its limit resolution, the egress policy to its
egress collaborator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kernelhub.config import EgressSettings, Limits, Profile, ProfileSettings, Settings
from kernelhub.errors import ConfigError, ForbiddenError, InvalidRequestError
from kernelhub.store.records import EgressGrants
from kernelhub.wire import LimitsIn

#: OCI runtimes behind each Docker isolation.
RUNTIMES = {"docker": "runc", "gvisor": "runsc"}


@dataclass(frozen=True)
class Chosen:
    name: str
    profile: Profile


def check_profiles(settings: ProfileSettings, egress: EgressSettings) -> None:
    """Fail closed on a profile that names a missing policy or profile."""
    for name, profile in settings.tiers.items():
        if profile.egress is not None and profile.egress not in egress.policies:
            raise ConfigError(
                f"profile {name!r} names the egress policy {profile.egress!r}, which "
                "KERNELHUB_EGRESS__POLICIES does not define"
            )
    named: list[tuple[str, str | None]] = [("KERNELHUB_PROFILES__DEFAULT", settings.default)]
    named += [
        ("KERNELHUB_PROFILES__TOKENS", n) for names in settings.tokens.values() for n in names
    ]
    for variable, wanted in named:
        if wanted is not None and wanted not in settings.tiers:
            raise ConfigError(
                f"{variable} names the profile {wanted!r}, which KERNELHUB_PROFILES__TIERS "
                f"does not define (it has: {sorted(settings.tiers) or 'none'})"
            )
    for token, names in settings.tokens.items():
        if not names:
            raise ConfigError(
                f"KERNELHUB_PROFILES__TOKENS restricts {token!r} to no profile at all; "
                'list at least one, e.g. {"ci-bot": ["untrusted"]}'
            )


def choose_profile(settings: ProfileSettings, token: str, asked: str | None) -> Chosen | None:
    """The profile a session made with ``token`` (its name) runs in, or None for none.
    A restricted token gets one of its profiles (the first by default); ForbiddenError
    for one it may not use, InvalidRequestError for one that does not exist."""
    allowed = settings.tokens.get(token)
    name = asked or (allowed[0] if allowed else settings.default)
    if name is None:
        return None
    if name not in settings.tiers:
        raise InvalidRequestError(
            f"no profile {name!r}; the operator's profiles are "
            f"{sorted(settings.tiers) or 'none'} (KERNELHUB_PROFILES__TIERS)"
        )
    if allowed is not None and name not in allowed:
        raise ForbiddenError(
            f"token {token!r} may use the profiles {allowed} only, not {name!r} "
            "(KERNELHUB_PROFILES__TOKENS)"
        )
    return Chosen(name, settings.tiers[name])


def runtime_for(chosen: Chosen | None, backend: str, runtimes: frozenset[str]) -> str | None:
    """The OCI runtime for a sandbox of ``chosen`` on a gateway whose backend is
    ``backend`` (Docker daemon's ``runtimes``); None: the backend's own. Raises
    InvalidRequestError when this gateway cannot give that isolation."""
    if chosen is None or chosen.profile.isolation is None:
        return None
    isolation = chosen.profile.isolation
    needs = "local" if isolation == "local" else "docker"
    if backend != needs:
        raise InvalidRequestError(
            f"profile {chosen.name!r} needs the {needs} backend ({isolation}); this gateway "
            f"runs {backend} (KERNELHUB_BACKEND)"
        )
    if isolation == "local":
        return None
    runtime = RUNTIMES[isolation]
    if runtime not in runtimes:
        raise InvalidRequestError(
            f"profile {chosen.name!r} asks for {isolation} (OCI runtime {runtime}), which "
            f"this Docker daemon does not have (it has {sorted(runtimes)}); install it and "
            "register it with dockerd, or change the profile's isolation"
        )
    return runtime


def recorded(chosen: Chosen | None, runtime: str | None, egress: str | None) -> dict[str, Any]:
    """A new session's row fields for its tier: what a restarted gateway reads back (at
    re-adoption, wake-up and recovery) so the session keeps exactly its isolation and
    egress policy, never its owner's defaults of the day."""
    return {
        "profile": chosen.name if chosen else None,
        "runtime": runtime,
        "egress_policy": egress,
        "egress_grants": EgressGrants(),
    }


def resolve_limits(settings: Settings, requested: LimitsIn, tier: Limits | None = None) -> Limits:
    """The limits a session gets: the defaults, with what was asked for within the
    operator's maximum (``InvalidRequestError`` names the one above it). ``tier``: a
    profile's limits, both the defaults and the maximum."""
    base = tier or settings.limits
    cap = tier or settings.gateway.max_limits
    values = base.model_dump()
    asked = {
        "memory_bytes": requested.memory_bytes,
        "cpus": requested.cpus,
        "pids": requested.pids,
        "workspace_bytes": requested.disk_bytes,
        "cell_timeout": requested.cell_timeout,
        "output_bytes": requested.output_bytes,
        "output_events": requested.output_events,
    }
    for name, value in asked.items():
        if value is None:
            continue
        most = getattr(cap, name)
        if most is not None and value > most:
            wire_name = "disk_bytes" if name == "workspace_bytes" else name
            raise InvalidRequestError(
                f"limits.{wire_name}={value} is above the maximum {most}; ask for less"
            )
        values[name] = value
    return Limits(**values)
