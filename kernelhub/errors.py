"""Every exception kernelhub raises.

User code failing is *data* (``kernelhub.models.CellError``); these are for kernelhub
itself failing, or for a caller asking for something impossible. Foreign errors (docker,
zmq, OS) are translated where they enter, with ``raise ... from exc``.

    KernelhubError
    ├── ConfigError              a setting is invalid; names the variable and a valid example
    │   └── DataDirLockedError   another gateway holds the data directory; names its pid
    ├── BackendUnavailableError  the chosen sandbox backend cannot run on this machine
    ├── ImageError               the kernel image is missing, or built for another protocol
    │   └── ImageBuildError      `kernelhub image build` failed
    ├── SandboxError             creating, starting or controlling a sandbox failed
    │   ├── SandboxStartError    the kernel did not come up; carries the sandbox log tail
    │   └── UnsafeSocketError    the socket directory holds something that is not our socket
    ├── KernelError              the kernel misbehaved at the protocol level
    │   └── KernelDiedError      the kernel is gone; carries the reason in words
    ├── SessionError             an operation is illegal in the session's current state
    │   └── SessionClosedError   the session was closed
    ├── NotFoundError            no such session/execution — or it belongs to someone else
    ├── AuthError                missing, unknown or revoked token; or not an admin
    ├── QuotaError               too many sessions, queued cells or bytes; retry later
    └── InvalidRequestError      a request the gateway understood but cannot honour
        └── TooLargeError        a body or file over its size limit

The gateway maps these to HTTP in one table (``gateway/errors.py``).
"""

from __future__ import annotations


class KernelhubError(Exception):
    """Root of every exception kernelhub raises."""


class ConfigError(KernelhubError):
    """A setting is invalid."""


class DataDirLockedError(ConfigError):
    """Another gateway process holds the data directory's lock."""


class BackendUnavailableError(KernelhubError):
    """The requested sandbox backend cannot run here."""


class ImageError(KernelhubError):
    """The kernel image is missing or incompatible."""


class ImageBuildError(ImageError):
    """Building the kernel image failed."""


class SandboxError(KernelhubError):
    """Creating, starting or controlling a sandbox failed."""


class SandboxStartError(SandboxError):
    """The sandbox started but its kernel never became ready."""

    def __init__(self, message: str, *, log_tail: str = "") -> None:
        if log_tail:
            message = f"{message}\n--- sandbox log (last lines) ---\n{log_tail}"
        super().__init__(message)
        self.log_tail = log_tail


class UnsafeSocketError(SandboxError):
    """The sandbox planted something other than its own socket where we connect."""


class KernelError(KernelhubError):
    """The kernel broke the messaging protocol."""


class KernelDiedError(KernelError):
    """The kernel process is gone."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"kernel died: {reason}")
        self.reason = reason


class SessionError(KernelhubError):
    """An operation is illegal in the session's current state."""


class SessionClosedError(SessionError):
    """The session was closed; create a new one."""


class NotFoundError(KernelhubError):
    """No such thing, or not yours: both answer the same so ids cannot be probed."""


class AuthError(KernelhubError):
    """The caller is not who they must be."""

    def __init__(self, message: str, *, admin_required: bool = False) -> None:
        super().__init__(message)
        self.admin_required = admin_required


class QuotaError(KernelhubError):
    """A limit on concurrent work was reached; ``retry_after`` seconds is a fair wait."""

    def __init__(self, message: str, *, retry_after: float = 5.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class InvalidRequestError(KernelhubError):
    """A well-formed request that cannot be honoured (a path outside /workspace …)."""


class TooLargeError(InvalidRequestError):
    """Over a size limit; the message names the limit and its setting."""
