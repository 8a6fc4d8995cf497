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
    │   ├── KernelDiedError      the kernel is gone; carries the reason in words
    │   └── KernelMessageError   a kernel message failed to verify or decode (dropped, logged)
    ├── SessionError             an operation is illegal in the session's current state
    │   └── SessionStateError    refused by the state machine; names the state and the operation
    │       └── SessionClosedError  the caller's session has ended (dead or deleted) for good
    ├── NotFoundError            no such session/execution — or it belongs to someone else
    ├── AuthError                missing, unknown or revoked token; or not an admin
    │   └── ForbiddenError       not allowed from here (a browser origin off the allowlist)
    ├── NodeUnavailableError     a cluster's node agent cannot be reached, or no node can
    │                            take a new session; names the node or the reason
    ├── StoreError               the store failed, or is closed or unreachable (retry later)
    │   └── StoreConflictError   a name or key that must be unique is taken; names it
    ├── EgressRefusedError       the egress proxy will not carry a sandbox's request; the
    │                            sandbox's client gets the reason (never an HTTP route's)
    ├── QuotaError               too many sessions, queued cells or bytes; retry later
    │   └── StorageFullError     a principal's storage quota is used up, or the disk is low
    ├── InvalidRequestError      a request the gateway understood but cannot honour
    │   ├── TooLargeError        a body or file over its size limit
    │   ├── MediaTypeError       a body that is not the JSON the route takes
    │   ├── FrameError           a Jupyter client's frame that is not a Jupyter message
    │   └── UsageError           the command line itself is wrong (the CLI exits with 2)
    ├── AwaitingInput            not a failure: an MCP call returns while its cell waits
    │                            for input, answered by `answer_input`  [agents/mcp_kernels.py]
    └── ClientError              the SDK's own tree  [client/errors.py]

The gateway maps every one of these to one HTTP status and one error kind (the ``error``
of a JSON body and of a WebSocket ``error`` frame) in one table (``gateway/errors.py``);
``tests/unit/test_errors.py`` walks every subclass to prove it, and that the SDK reads
each kind back as one class.
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


class KernelMessageError(KernelError):
    """A message from the kernel is oversized, truncated, forged, replayed or malformed
    (``kernel.codec``). The engine drops it; it never reaches a caller."""


class SessionError(KernelhubError):
    """An operation is illegal in the session's current state."""


class SessionStateError(SessionError):
    """The session's state machine (``session/state.py``) refused an operation; ``state``
    is the state it was in and ``operation`` what was attempted (either may be None when
    raised from outside the state machine)."""

    def __init__(
        self, message: str, *, state: str | None = None, operation: str | None = None
    ) -> None:
        super().__init__(message)
        self.state = state
        self.operation = operation


class SessionClosedError(SessionStateError):
    """The caller's session has ended (its kernel died for good, or it was deleted); only
    its owner learns this, anyone else gets ``NotFoundError``. Create a new one."""


class NotFoundError(KernelhubError):
    """No such thing, or not yours: both answer the same so ids cannot be probed."""


class AuthError(KernelhubError):
    """The caller is not who they must be."""

    def __init__(self, message: str, *, admin_required: bool = False) -> None:
        super().__init__(message)
        self.admin_required = admin_required


class ForbiddenError(AuthError):
    """Whoever the caller is, the request is not allowed (e.g. from this browser origin)."""


class NodeUnavailableError(KernelhubError):
    """A gateway replica (``kernelhub gateway``) cannot reach the node agent that owns a
    session, or placement found no live, undrained node to take a new one. ``node`` is
    the node's id, None when no node was chosen. Retry later: nodes come back, or their
    sessions move."""

    def __init__(self, message: str, *, node: str | None = None) -> None:
        super().__init__(message)
        self.node = node


class StoreError(KernelhubError):
    """The store could not read or write: it is closed, its server is unreachable, or the
    database refused. Not the caller's doing; the message names the store."""


class StoreConflictError(StoreError):
    """A name or key that must be unique is already taken (it names it)."""


class EgressRefusedError(KernelhubError):
    """The egress proxy refuses a request from a sandbox (policy, resolution, quota); the
    proxy answers the sandbox's client with the message and ``status``."""

    def __init__(self, message: str, status: int = 403) -> None:
        super().__init__(message)
        self.status = status


class QuotaError(KernelhubError):
    """A limit on concurrent work was reached; ``retry_after`` seconds is a fair wait."""

    def __init__(self, message: str, *, retry_after: float = 5.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StorageFullError(QuotaError):
    """No room to store more: the principal's storage quota is used up (deleting sessions
    with ``?purge=true`` frees it), or the data directory's disk is below its floor."""

    def __init__(self, message: str, *, retry_after: float = 60.0) -> None:
        super().__init__(message, retry_after=retry_after)


class InvalidRequestError(KernelhubError):
    """A well-formed request that cannot be honoured (a path outside /workspace …)."""


class TooLargeError(InvalidRequestError):
    """Over a size limit; the message names the limit and its setting."""


class MediaTypeError(InvalidRequestError):
    """The body is not ``application/json`` (a form, text, or no Content-Type at all)."""


class FrameError(InvalidRequestError):
    """A Jupyter client's WebSocket frame that is not a Jupyter message (answered by
    dropping it, as Jupyter Server does)."""


class UsageError(InvalidRequestError):
    """The command line itself is wrong (printed as is, exit status 2)."""
