"""The review page's routes: ``/`` (the page), ``/ui/...`` (its assets), and
``/v1/auth/session`` (sign in with a token for a cookie; sign out).

The cookie holds a random sign-in id (its hash is stored, bound to the token's hash), so
the token itself never reaches a URL or the page's storage, and revoking the token ends
the sign-in. The page's state-changing requests carry ``X-CSRF-Token`` (gateway/auth.py
checks it)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field

from kernelhub.gateway.auth import (
    CSRF_COOKIE,
    CSRF_HEADER,
    SESSION_COOKIE,
    BearerDeclared,
    authenticate,
    bearer,
    check_csrf,
)
from kernelhub.store.base import Store
from kernelhub.store.records import Principal
from kernelhub.wire import ErrorBody

STATIC = Path(__file__).parent / "static"
# The page's own policy: its script and style only, from here; no plugins; never framed.
# Sandbox output goes into `sandbox=""` iframes (srcdoc) with a stricter policy of its own.
PAGE_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "frame-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": PAGE_CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}

router = APIRouter()


class SignIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token: str | None = Field(
        None, min_length=1, max_length=500, description="else the bearer header's"
    )


class SignedIn(BaseModel):
    principal: Principal
    csrf_token: str = Field(
        description=f"send it as {CSRF_HEADER} on requests that change something"
    )
    expires_at: datetime


def _refusals(*statuses: int) -> dict[int | str, dict[str, object]]:
    return {code: {"model": ErrorBody} for code in sorted({401, *statuses})}


@router.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)


@router.post(
    "/v1/auth/session", status_code=201, responses=_refusals(400, 413, 415, 422), tags=["tokens"]
)
async def sign_in(
    body: SignIn, request: Request, response: Response, _: BearerDeclared = None
) -> SignedIn:
    """Exchange a token (in the body, or the bearer header) for a short-lived HttpOnly,
    SameSite=Strict cookie: the review page's sign-in. Answers the CSRF token to send
    with requests that change something."""
    store: Store = request.app.state.store
    token = body.token or bearer(request.headers.get("authorization"))
    principal = await authenticate(store, token)  # 401 naming an expiry
    assert token is not None
    ttl = request.app.state.settings.gateway.web_session_ttl
    sid, csrf, expires = await store.create_web_session(token, ttl)
    secure = request.url.scheme == "https"
    age = max(1, int((expires - datetime.now(expires.tzinfo)).total_seconds()))
    response.set_cookie(
        SESSION_COOKIE, sid, max_age=age, httponly=True, samesite="strict", secure=secure, path="/"
    )
    response.set_cookie(
        CSRF_COOKIE, csrf, max_age=age, httponly=False, samesite="strict", secure=secure, path="/"
    )
    response.headers["Cache-Control"] = "no-store"
    return SignedIn(principal=principal, csrf_token=csrf, expires_at=expires)


@router.delete("/v1/auth/session", status_code=204, responses=_refusals(403), tags=["tokens"])
async def sign_out(request: Request, _: BearerDeclared = None) -> Response:
    """End the cookie's sign-in (needs the CSRF header) and clear the cookies."""
    store: Store = request.app.state.store
    sid = request.cookies.get(SESSION_COOKIE)
    signed_in = await store.web_session(sid) if sid else None
    if sid is not None and signed_in is not None:
        check_csrf(request.headers.get(CSRF_HEADER), signed_in[1])
        await store.delete_web_session(sid)
    response = Response(status_code=204)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    response.delete_cookie(CSRF_COOKIE, path="/", samesite="strict")
    return response


def install(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/ui", StaticFiles(directory=STATIC), name="ui")
