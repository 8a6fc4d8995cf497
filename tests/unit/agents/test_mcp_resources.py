"""The MCP resources of a request's kernels (kernelhub/agents/mcp_resources.py): which
URIs name something, text vs binary contents, and the workspace listing. The listing
cell is really run (in this interpreter, over a temporary /workspace stand-in)."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Any
from urllib.parse import quote

import mcp_types as types
import pytest
from mcp.shared.exceptions import MCPError

from kernelhub.agents.mcp_kernels import Kernel
from kernelhub.agents.mcp_resources import (
    _LIST_FILES,
    _MAX_LISTED,
    list_resources,
    read_resource,
    templates,
)
from kernelhub.client.errors import ApiError, NotFoundError
from kernelhub.models import Execution
from tests.unit.agents._cells import run_here

PREFIX = "kernelhub://sessions/"


class Session:
    """A session whose workspace is a local directory and whose cells run here."""

    def __init__(self, sid: str, root: Path, *, fail_cells: bool = False) -> None:
        self.id = sid
        self.root = root
        self.fail_cells = fail_cells
        self.downloads: list[str] = []

    async def run(self, code: str, *, timeout: float | None = None, **_: Any) -> Execution:
        if self.fail_cells:
            code = "raise PermissionError('denied')"
        # the cell names /workspace; here that is this session's root
        return run_here(code.replace("'/workspace'", repr(str(self.root))), "e")

    async def download(self, path: str) -> bytes:
        self.downloads.append(path)
        target = self.root / path
        if not target.is_file():
            raise NotFoundError(404, "not_found", f"no file {path!r}")
        return target.read_bytes()

    async def notebook(self) -> bytes:
        return b'{"cells": [], "nbformat": 4}'


def kernel(sid: str, root: Path, **options: Any) -> Kernel:
    return Kernel(Session(sid, root, **options), None, "")  # type: ignore[arg-type]


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    (tmp_path / "sub dir").mkdir()
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "sub dir" / "b é.bin").write_bytes(b"\xff\x00\xfe")
    return tmp_path


async def test_each_kernel_lists_its_notebook_then_its_files(workspace: Path) -> None:
    listed = await list_resources([kernel("s1", workspace)])
    uris = [str(r.uri) for r in listed.resources]
    assert uris == [
        f"{PREFIX}s1/notebook.ipynb",
        f"{PREFIX}s1/workspace/a.txt",
        f"{PREFIX}s1/workspace/{quote('sub dir/b é.bin')}",
    ]
    assert listed.resources[2].name == "sub dir/b é.bin"


async def test_a_listing_that_fails_lists_only_the_notebook(workspace: Path) -> None:
    listed = await list_resources([kernel("s1", workspace, fail_cells=True)])
    assert [str(r.uri) for r in listed.resources] == [f"{PREFIX}s1/notebook.ipynb"]


def test_the_listing_cell_caps_its_output(tmp_path: Path) -> None:
    for i in range(_MAX_LISTED + 5):
        (tmp_path / f"f{i:04}").touch()
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        exec(_LIST_FILES.replace("'/workspace'", repr(str(tmp_path))), {})
    names = __import__("json").loads(buffer.getvalue())
    assert len(names) == _MAX_LISTED and names == sorted(os.listdir(tmp_path))[:_MAX_LISTED]


async def test_text_files_are_text_binary_files_are_base64(workspace: Path) -> None:
    kernels = [kernel("s1", workspace)]
    text = await read_resource(kernels, f"{PREFIX}s1/workspace/a.txt")
    assert isinstance(text.contents[0], types.TextResourceContents)
    assert text.contents[0].text == "hello"
    blob = await read_resource(kernels, f"{PREFIX}s1/workspace/{quote('sub dir/b é.bin')}")
    assert isinstance(blob.contents[0], types.BlobResourceContents)
    assert __import__("base64").b64decode(blob.contents[0].blob) == b"\xff\x00\xfe"
    assert kernels[0].session.downloads == ["a.txt", "sub dir/b é.bin"]  # type: ignore[attr-defined]


async def test_the_notebook_is_ipynb_json(workspace: Path) -> None:
    got = await read_resource([kernel("s1", workspace)], f"{PREFIX}s1/notebook.ipynb")
    assert got.contents[0].mime_type == "application/x-ipynb+json"
    assert '"nbformat": 4' in got.contents[0].text  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "uri",
    [
        "file:///etc/passwd",
        f"{PREFIX}other/notebook.ipynb",  # a session this request may not use
        f"{PREFIX}s1/secrets",
        f"{PREFIX}s1",
        f"{PREFIX}s1/notebook.ipynbx",
        f"{PREFIX}/notebook.ipynb",
    ],
)
async def test_uris_naming_nothing_are_no_such_resource(workspace: Path, uri: str) -> None:
    k = kernel("s1", workspace)
    with pytest.raises(MCPError) as raised:
        await read_resource([k], uri)
    assert raised.value.error.code == types.INVALID_PARAMS
    assert (
        repr(uri) in raised.value.error.message and "resources/list" in raised.value.error.message
    )
    assert k.session.downloads == []  # type: ignore[attr-defined]


async def test_a_gateway_refusal_says_which_uri_and_why(workspace: Path) -> None:
    uri = f"{PREFIX}s1/workspace/missing.txt"
    with pytest.raises(MCPError) as raised:
        await read_resource([kernel("s1", workspace)], uri)
    assert raised.value.error.code == types.INVALID_PARAMS
    assert repr(uri) in raised.value.error.message and "no file 'missing.txt'" in str(
        raised.value.error.message
    )
    assert isinstance(raised.value.__cause__, ApiError)


def test_templates_match_the_uris_that_resolve() -> None:
    found = {t.name: t.uri_template for t in templates().resource_templates}
    assert found == {
        "workspace file": PREFIX + "{session}/workspace/{+path}",
        "notebook": PREFIX + "{session}/notebook.ipynb",
    }
