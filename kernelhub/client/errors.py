"""Every exception the SDK raises, under the one root :class:`kernelhub.errors.KernelhubError`.

A cell failing is *data* (``Execution.error``), never one of these. These mean the gateway
refused a request, could not be reached, or broke the protocol.

    KernelhubError
    └── ClientError                 the SDK could not do what was asked
        ├── ApiError                the gateway said no: status, error (kind), message, detail
        │   ├── InvalidRequestError 400 / 422, close 1008: fix the request
        │   │   ├── TooLargeError   413: a body or file over its limit
        │   │   └── MediaTypeError  415: a body that is not JSON
        │   ├── AuthError           401, close 4401: check the token
        │   │   └── ForbiddenError  403: not an admin, or not allowed from here
        │   ├── NotFoundError       404, close 4404: no such id, or not yours
        │   ├── ConflictError       409: the session or execution is in the wrong state
        │   │   └── SessionEndedError  410, close 4410: the session is gone for good
        │   ├── RateLimitedError    429: slow down; ``retry_after`` in seconds, or None
        │   ├── StorageFullError    507: the storage quota is used up, or the gateway's disk is low
        │   └── ServerError         5xx: the gateway failed
        ├── GatewayUnreachableError no HTTP answer at all (refused, reset, timed out)
        ├── StreamLostError         the WebSocket kept dropping; reconnecting gave up
        └── ProtocolError           the gateway sent something this SDK does not understand

Where the server has the same notion, the client class also derives from it, so
``except kernelhub.errors.NotFoundError`` catches both: :class:`InvalidRequestError`,
:class:`TooLargeError`, :class:`MediaTypeError`, :class:`AuthError`,
:class:`ForbiddenError`, :class:`NotFoundError`,
:class:`ConflictError` (``SessionError``) and :class:`SessionEndedError`
(``SessionClosedError``). :class:`RateLimitedError` does not derive from ``QuotaError``,
whose ``retry_after`` is always known.

:func:`api_error` is the one table from an HTTP status, a WebSocket close code or a socket
``error`` frame's kind to these classes.
"""

from __future__ import annotations

from typing import Any

from kernelhub import errors as core
from kernelhub.errors import KernelhubError


class ClientError(KernelhubError):
    """Root of the SDK's own exceptions."""


class ApiError(ClientError):
    """The gateway refused a request. ``status`` is None for an ``error`` frame on the socket."""

    hint = "see `message` and `detail`"

    def __init__(self, status: int | None, error: str, message: str, detail: Any = None) -> None:
        where = f"HTTP {status}" if status is not None else "gateway"
        super().__init__(f"{where} {error}: {message} — {self.hint}")
        self.status = status
        self.error = error
        self.message = message
        self.detail = detail


class InvalidRequestError(ApiError, core.InvalidRequestError):
    hint = "fix the request (see `detail` for the offending field); retrying it unchanged will fail again"


class TooLargeError(InvalidRequestError, core.TooLargeError):
    hint = "send less: the message names the limit and the setting that raises it"


class MediaTypeError(InvalidRequestError, core.MediaTypeError):
    hint = "send the body as application/json"


class AuthError(ApiError, core.AuthError):
    hint = "check the token given to Hub(token=...): it is missing, wrong, revoked, or lacks this permission"

    def __init__(self, status: int | None, error: str, message: str, detail: Any = None) -> None:
        super().__init__(status, error, message, detail)
        self.admin_required = status == 403 or error == "forbidden"


class ForbiddenError(AuthError, core.ForbiddenError):
    hint = "this token may not do this (an admin route, a scoped token) or not from here (origin)"


class NotFoundError(ApiError, core.NotFoundError):
    hint = (
        "the id is wrong, was deleted, or belongs to another token; hub.list_sessions() shows yours"
    )


class ConflictError(ApiError, core.SessionError):
    hint = "the session or execution is not in a state that allows this; check session.info() or get_execution()"


class SessionEndedError(ConflictError, core.SessionClosedError):
    hint = (
        "the session has ended and cannot be used again; create a new one with hub.create_session()"
    )


class RateLimitedError(ApiError):
    hint = (
        "slow down: wait `retry_after` seconds, or raise Hub(max_retries=...) to let the SDK wait"
    )

    def __init__(
        self,
        status: int | None,
        error: str,
        message: str,
        detail: Any = None,
        *,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(status, error, message, detail)
        self.retry_after = retry_after
        if retry_after is not None:
            self.args = (f"{self.args[0]} (Retry-After: {retry_after:g} s)",)


class StorageFullError(ApiError):
    hint = (
        "free space: delete sessions with purge=True (or ask the operator to raise the "
        "quota or free disk); retrying unchanged will fail again"
    )


class ServerError(ApiError):
    hint = "the gateway failed; retry later, and report it with the gateway log if it persists"


class GatewayUnreachableError(ClientError):
    """No HTTP answer: connection refused or reset, DNS failure, or a timeout."""


class StreamLostError(ClientError):
    """The event stream dropped and did not come back within the allowed reconnects."""

    def __init__(self, message: str, *, last_seq: int) -> None:
        super().__init__(message)
        self.last_seq = last_seq


class ProtocolError(ClientError):
    """The gateway answered with something this SDK cannot read (a version mismatch?)."""


_BY_STATUS: dict[int, type[ApiError]] = {
    400: InvalidRequestError,
    401: AuthError,
    403: ForbiddenError,
    404: NotFoundError,
    409: ConflictError,
    410: SessionEndedError,
    413: TooLargeError,
    415: MediaTypeError,
    422: InvalidRequestError,
    429: RateLimitedError,
    507: StorageFullError,
}

# The gateway's ``error`` kinds (``gateway/errors.py``), for an ``error`` frame on the
# socket, which has no HTTP status. An unknown kind is a plain ApiError.
_BY_KIND: dict[str, type[ApiError]] = {
    "invalid_request": InvalidRequestError,
    "invalid_frame": InvalidRequestError,
    "too_large": TooLargeError,
    "unsupported_media_type": MediaTypeError,
    "unauthorized": AuthError,
    "forbidden": ForbiddenError,
    "not_found": NotFoundError,
    "conflict": ConflictError,
    "session_ended": SessionEndedError,
    "too_many": RateLimitedError,
    "storage_full": StorageFullError,
    "image_unavailable": ServerError,
    "backend_unavailable": ServerError,
    "sandbox_failed": ServerError,
    "store_unavailable": ServerError,
    "node_unavailable": ServerError,
    "misconfigured": ServerError,
    "internal": ServerError,
}

# WebSocket close codes that end a stream for good: (the HTTP status they stand for, kind).
CLOSE_CODES: dict[int, tuple[int, str]] = {
    1008: (400, "policy"),  # the gateway refused the request (e.g. a negative `since`)
    4401: (401, "unauthorized"),
    4404: (404, "not_found"),
    4410: (410, "session_ended"),
}


def api_error(
    status: int | None,
    error: str,
    message: str,
    detail: Any = None,
    *,
    retry_after: float | None = None,
) -> ApiError:
    """The exception for a refusal: by HTTP status when there is one, else by error kind."""
    if status is not None:
        cls = _BY_STATUS.get(status) or (ServerError if status >= 500 else ApiError)
    else:
        cls = _BY_KIND.get(error, ApiError)
    if cls is RateLimitedError:
        return RateLimitedError(status, error, message, detail, retry_after=retry_after)
    return cls(status, error, message, detail)
