"""The one table from kernelhub's exceptions to HTTP answers.

Handlers deep in the stack raise kernelhub errors; only this module knows HTTP. Each class
gets one status and one error kind (the ``error`` of the JSON body, and of a WebSocket
``error`` frame); a refused WebSocket gets the close code of that status. Anything
unexpected becomes a 500 with a generic message (the traceback goes to the log, never to
the client). ``tests/unit/test_errors.py`` proves every class of the tree maps to exactly
one row, and that the SDK reads each kind back as one class.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kernelhub.errors import (
    AuthError,
    BackendUnavailableError,
    ConfigError,
    ForbiddenError,
    ImageError,
    InvalidRequestError,
    KernelhubError,
    MediaTypeError,
    NodeUnavailableError,
    NotFoundError,
    QuotaError,
    SandboxError,
    SessionClosedError,
    SessionError,
    SessionStateError,
    StorageFullError,
    StoreConflictError,
    StoreError,
    TooLargeError,
)
from kernelhub.wire import CloseCode

log = logging.getLogger(__name__)

# Most specific first: the first matching class decides.
STATUS_TABLE: list[tuple[type[KernelhubError], int, str]] = [
    (NotFoundError, 404, "not_found"),
    (ForbiddenError, 403, "forbidden"),
    (AuthError, 401, "unauthorized"),
    (StorageFullError, 507, "storage_full"),
    (QuotaError, 429, "too_many"),
    (TooLargeError, 413, "too_large"),
    (MediaTypeError, 415, "unsupported_media_type"),
    (InvalidRequestError, 400, "invalid_request"),
    (SessionClosedError, 410, "session_ended"),
    (SessionStateError, 409, "conflict"),
    (SessionError, 409, "conflict"),
    (StoreConflictError, 409, "conflict"),
    # The store closed (shutdown) or its server went away: the request may work later.
    (StoreError, 503, "store_unavailable"),
    (NodeUnavailableError, 503, "node_unavailable"),
    (ImageError, 503, "image_unavailable"),
    (BackendUnavailableError, 503, "backend_unavailable"),
    (SandboxError, 503, "sandbox_failed"),
    (ConfigError, 500, "misconfigured"),
    (KernelhubError, 500, "internal"),
]


# A WebSocket refused after its handshake: the close code for the status (docs/protocol.md).
CLOSE_CODE_FOR_STATUS: dict[int, int] = {
    401: CloseCode.UNAUTHORIZED,
    403: CloseCode.UNAUTHORIZED,
    404: CloseCode.NOT_FOUND,
    410: CloseCode.SESSION_ENDED,
}


def row_for(cls: type[KernelhubError]) -> tuple[int, str]:
    """The status and error kind of ``cls``: its first row in the table."""
    for row, status, code in STATUS_TABLE:
        if issubclass(cls, row):
            return status, code
    return 500, "internal"


def status_for(exc: KernelhubError) -> tuple[int, str]:
    if isinstance(exc, AuthError) and exc.admin_required:
        return 403, "forbidden"
    return row_for(type(exc))


def close_code_for(exc: KernelhubError) -> int:
    """The close code of a WebSocket refused with ``exc`` (1008 where no code is closer)."""
    return CLOSE_CODE_FOR_STATUS.get(status_for(exc)[0], CloseCode.POLICY)


def error_response(
    status: int,
    error: str,
    message: str,
    detail: object = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        {"error": error, "message": message, "detail": detail}, status_code=status, headers=headers
    )


def json_problem(doc: object, position: object, reason: object) -> str:
    """'Expecting ',' delimiter at line 1 column 12', from what FastAPI keeps of a
    ``JSONDecodeError`` (the document, the offset and the reason)."""
    if not isinstance(doc, str) or not isinstance(position, int):
        return f"request body is not valid JSON: {reason}"
    line = doc.count("\n", 0, position) + 1
    column = position - doc.rfind("\n", 0, position)
    return f"request body is not valid JSON: {reason} at line {line} column {column}"


def response_for(exc: KernelhubError) -> JSONResponse:
    """The answer to ``exc``: its status from the table, its message, and the headers that
    go with it (``Retry-After``, ``WWW-Authenticate``). Also a refused WebSocket handshake's."""
    status, code = status_for(exc)
    headers = {}
    if isinstance(exc, QuotaError):
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    if isinstance(exc, AuthError) and status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return error_response(status, code, str(exc), headers=headers)


def install(app: FastAPI) -> None:
    def answer(request: Request, exc: KernelhubError) -> JSONResponse:
        response = response_for(exc)
        if response.status_code >= 500:
            log.error("request %s %s failed: %s", request.method, request.url.path, exc)
        return response

    @app.exception_handler(KernelhubError)
    async def kernelhub_error(request: Request, exc: KernelhubError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        if isinstance(exc.body, bytes):
            # FastAPI hands a route's model the raw bytes only when the Content-Type was
            # not JSON (or missing): that is the problem to name, not the model's fields.
            sent = request.headers.get("content-type") or "no Content-Type"
            return answer(
                request,
                MediaTypeError(
                    f"send application/json: this route takes a JSON body, and got {sent}"
                    " (set the header `Content-Type: application/json`)"
                ),
            )
        problems = []
        for err in exc.errors():
            if err.get("type") == "json_invalid":
                loc = err.get("loc", ())
                message = json_problem(
                    exc.body, loc[-1] if loc else None, err.get("ctx", {}).get("error")
                )
                detail = [{"field": "body", "problem": message}]
                return error_response(422, "invalid_request", message, detail)
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            problems.append({"field": where, "problem": err.get("msg", "invalid")})
        summary = "; ".join(f"{p['field']}: {p['problem']}" for p in problems[:5])
        return error_response(422, "invalid_request", f"fix the request: {summary}", problems)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(
            exc.status_code, "http_error"
        )
        return error_response(
            exc.status_code, code, str(exc.detail), headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(500, "internal", "internal error; the gateway logged the details")
