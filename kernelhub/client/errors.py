"""Every exception the SDK raises, under the one root :class:`kernelhub.errors.KernelhubError`.

A cell failing is *data* (``Execution.error``), never one of these. These mean the gateway
refused a request, could not be reached, or broke the protocol.

    KernelhubError
    └── ClientError                 the SDK could not do what was asked
        ├── ApiError                the gateway answered with an error (status, error, message, detail)
        │   ├── InvalidRequestError 400 / 413 / 422: fix the request
        │   ├── AuthError           401 / 403, WebSocket 4401 / 1008: check the token
        │   ├── NotFoundError       404, WebSocket 4404: no such id, or not yours
        │   ├── ConflictError       409: the session or execution is in the wrong state
        │   ├── SessionEndedError   410, WebSocket 4410: the session is gone; create a new one
        │   ├── RateLimitedError    429: slow down; carries ``retry_after`` (seconds or None)
        │   └── ServerError         5xx: the gateway failed
        ├── GatewayUnreachableError no HTTP answer at all (refused, reset, timed out)
        ├── StreamLostError         the WebSocket kept dropping; reconnecting gave up
        └── ProtocolError           the gateway sent something this SDK does not understand

Every HTTP status, WebSocket close code and socket ``error`` frame is turned into one of
these by :func:`api_error` — the one table.
"""

from __future__ import annotations

from typing import Any

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


class InvalidRequestError(ApiError):
    hint = "fix the request (see `detail` for the offending field); retrying it unchanged will fail again"


class AuthError(ApiError):
    hint = "check the token given to Hub(token=...): it is missing, wrong, expired, or lacks this permission"


class NotFoundError(ApiError):
    hint = (
        "the id is wrong, was deleted, or belongs to another token; hub.list_sessions() shows yours"
    )


class ConflictError(ApiError):
    hint = "the session or execution is not in a state that allows this; check session.info() or get_execution()"


class SessionEndedError(ApiError):
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
    403: AuthError,
    404: NotFoundError,
    409: ConflictError,
    410: SessionEndedError,
    413: InvalidRequestError,
    422: InvalidRequestError,
    429: RateLimitedError,
}

# The ``error`` kinds of ``ErrorBody`` / ``ErrorFrame``; used when there is no HTTP status
# (an ``error`` frame on the socket).
_BY_KIND: dict[str, type[ApiError]] = {
    "invalid_request": InvalidRequestError,
    "validation_error": InvalidRequestError,
    "too_large": InvalidRequestError,
    "unauthorized": AuthError,
    "forbidden": AuthError,
    "not_found": NotFoundError,
    "conflict": ConflictError,
    "busy": ConflictError,
    "session_ended": SessionEndedError,
    "rate_limited": RateLimitedError,
    "internal": ServerError,
    "unavailable": ServerError,
}

# WebSocket close codes that end a stream for good, as the HTTP status they stand for.
CLOSE_CODE_STATUS: dict[int, int] = {
    1008: 401,  # policy violation: the gateway's answer to a bad or missing token
    4401: 401,
    4404: 404,
    4410: 410,
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
