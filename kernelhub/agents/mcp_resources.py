"""MCP resources of the kernels a request may use: each session's notebook
(``kernelhub://sessions/{id}/notebook.ipynb``, the ``.ipynb`` export) and its workspace
files (``kernelhub://sessions/{id}/workspace/{path}``).

The caller (:mod:`kernelhub.agents.mcp_server`) passes the kernels the request may see;
a URI naming any other session is "no such resource".
"""

from __future__ import annotations

import base64
import json
from urllib.parse import quote, unquote

import mcp_types as types
from mcp.shared.exceptions import MCPError

from kernelhub.agents.mcp_kernels import Kernel
from kernelhub.client.errors import ApiError

__all__ = ["list_resources", "read_resource", "templates"]

PREFIX = "kernelhub://sessions/"
NOTEBOOK = "notebook.ipynb"
WORKSPACE = "workspace/"
_IPYNB = "application/x-ipynb+json"
_MAX_LISTED = 500
# Lists /workspace from inside the kernel without leaving a name behind: the gateway has
# no listing endpoint. It shows in the session's history like any cell.
_LIST_FILES = (
    "print(__import__('json').dumps(sorted(__import__('os').path.relpath("
    "__import__('os').path.join(d, f), '/workspace') for d, _, fs in "
    f"__import__('os').walk('/workspace') for f in fs)[:{_MAX_LISTED}]))"
)


async def _files(kernel: Kernel) -> list[str]:
    try:
        listing = await kernel.session.run(_LIST_FILES, timeout=30)
        paths = json.loads(listing.stdout) if listing.error is None else []
    except (ApiError, ValueError):
        return []
    return [p for p in paths if isinstance(p, str)]


async def list_resources(kernels: list[Kernel]) -> types.ListResourcesResult:
    resources = []
    for kernel in kernels:
        base = f"{PREFIX}{kernel.handle}/"
        resources.append(
            types.Resource(
                uri=base + NOTEBOOK,
                name=f"{kernel.handle} notebook",
                description="the session's executions so far, as a Jupyter notebook",
                mime_type=_IPYNB,
            )
        )
        resources += [
            types.Resource(uri=base + WORKSPACE + quote(p), name=p) for p in await _files(kernel)
        ]
    return types.ListResourcesResult(resources=resources)


def templates() -> types.ListResourceTemplatesResult:
    return types.ListResourceTemplatesResult(
        resource_templates=[
            types.ResourceTemplate(
                uri_template=PREFIX + "{session}/" + WORKSPACE + "{+path}",
                name="workspace file",
                description="a file in the session's /workspace",
            ),
            types.ResourceTemplate(
                uri_template=PREFIX + "{session}/" + NOTEBOOK, name="notebook", mime_type=_IPYNB
            ),
        ]
    )


def _missing(uri: str) -> MCPError:
    return MCPError(types.INVALID_PARAMS, f"no such resource {uri!r}; see resources/list")


async def read_resource(kernels: list[Kernel], uri: str) -> types.ReadResourceResult:
    if not uri.startswith(PREFIX):
        raise _missing(uri)
    handle, _, rest = uri.removeprefix(PREFIX).partition("/")
    kernel = next((k for k in kernels if k.handle == handle), None)
    if kernel is None or (rest != NOTEBOOK and not rest.startswith(WORKSPACE)):
        raise _missing(uri)
    try:
        if rest == NOTEBOOK:
            notebook = (await kernel.session.notebook()).decode()
            contents = types.TextResourceContents(uri=uri, mime_type=_IPYNB, text=notebook)
            return types.ReadResourceResult(contents=[contents])
        data = await kernel.session.download(unquote(rest.removeprefix(WORKSPACE)))
    except ApiError as exc:
        raise MCPError(types.INVALID_PARAMS, f"cannot read {uri!r}: {exc.message}") from exc
    try:
        text = data.decode()
    except UnicodeDecodeError:
        blob = base64.b64encode(data).decode()
        return types.ReadResourceResult(contents=[types.BlobResourceContents(uri=uri, blob=blob)])
    return types.ReadResourceResult(contents=[types.TextResourceContents(uri=uri, text=text)])
