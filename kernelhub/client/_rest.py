"""What the SDK's hub, sessions and runs share: the gateway's address, request bodies
checked before they are sent, answers read as models, and user callbacks that may be
sync or async. Pure, but for reading ``KERNELHUB_URL`` / ``KERNELHUB_TOKEN`` when a hub
is made without them."""

from __future__ import annotations

import inspect
import os
import uuid
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import pydantic
from pydantic import BaseModel

from kernelhub.client.errors import ClientError, ProtocolError, api_error
from kernelhub.models import Execution
from kernelhub.wire import ExecutionInfo

URL_ENV = "KERNELHUB_URL"
TOKEN_ENV = "KERNELHUB_TOKEN"
DEFAULT_URL = "http://127.0.0.1:8765"  # the gateway's default bind (GatewaySettings.port)
POLL_INTERVAL_MAX = 1.0  # polling a batch or an execution backs off up to this

M = TypeVar("M", bound=BaseModel)


def hub_address(base_url: str | None, token: str | None) -> tuple[str, str | None]:
    """The gateway URL and token a hub uses: the arguments, else ``KERNELHUB_URL`` /
    ``KERNELHUB_TOKEN``, else the local default and no token (only ``health`` works then)."""
    url = base_url if base_url is not None else os.environ.get(URL_ENV) or DEFAULT_URL
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        source = "base_url" if base_url is not None else URL_ENV
        raise ClientError(f"{source} must look like http://host:port or https://host, got {url!r}")
    return url, token if token is not None else os.environ.get(TOKEN_ENV) or None


def new_id() -> str:
    return uuid.uuid4().hex


async def call(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a user callback that may be sync or async."""
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


def parse(model: type[M], response: httpx.Response) -> M:
    try:
        return model.model_validate_json(response.content)
    except pydantic.ValidationError as exc:
        raise ProtocolError(
            f"{response.request.method} {response.request.url.path} answered {response.status_code} "
            f"with a body that is not a {model.__name__}: {exc.errors()[:3]}; "
            "check that the SDK and gateway versions match"
        ) from exc


def build(model: type[M], **fields: Any) -> M:
    """A request body, checked before sending: a bad argument is the caller's to fix."""
    try:
        return model(**fields)
    except pydantic.ValidationError as exc:
        problems = exc.errors(include_url=False, include_input=False)
        where = "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in problems)
        raise api_error(None, "invalid_request", f"{model.__name__}: {where}", problems) from exc


def to_execution(info: ExecutionInfo) -> Execution:
    if info.record is None or info.events is None:
        raise ProtocolError(
            f"execution {info.id} has status {info.status} but came without its record and events"
        )
    return Execution(record=info.record, events=info.events)
