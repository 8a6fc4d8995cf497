"""The kernelhub tools for LLMs: defined once, rendered for each provider, run against a session.

Each tool is one pydantic model (its arguments) plus a name and a description in
:data:`TOOLS`; :func:`openai_tools` and :func:`anthropic_tools` are generated from them,
and the same models validate the arguments a model sends. :class:`ToolRunner` is the
adapter between a model's tool call and an :class:`~kernelhub.client.AsyncSession`:

- ``await runner.run(name, arguments)`` never raises for anything the model can fix (an
  unknown tool, bad JSON, a missing field, a file that does not exist): it returns a
  :class:`ToolResult` with ``is_error=True`` and a message saying what to change. Failures
  of kernelhub itself (gateway unreachable, session gone) raise, as everywhere in the SDK.
- The result is ready for a model's context: text bounded by a character budget (head and
  tail kept, an explicit ``… [truncated N characters]`` marker between), PNG/JPEG displays
  as image attachments (capped in number), a failing cell summarized as
  ``ename: evalue`` plus its plain traceback trimmed for a reader (:func:`trim_traceback`):
  the user's own frames (``Cell In[1], line 3``) and every exception line are kept, the
  library frames between them become one ``… N library frames …`` line.

The result and its text shaping (:func:`truncate`, :func:`strip_ansi`,
:func:`trim_traceback`, :func:`summarize_error`, :func:`render_execution`) are pure and
tested with data, in :mod:`kernelhub.agents.results`; they are re-exported here.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import mimetypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import pydantic
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kernelhub.agents import schemas
from kernelhub.agents.results import (
    DEFAULT_MAX_CHARS,
    DEFAULT_MAX_IMAGES,
    DEFAULT_TRACEBACK_LINES,
    IMAGE_TYPES,
    Attachment,
    ToolResult,
    render_execution,
    strip_ansi,
    summarize_error,
    trim_traceback,
    truncate,
)
from kernelhub.client import FileInfo
from kernelhub.client.errors import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    SessionEndedError,
)
from kernelhub.models import Event, Execution
from kernelhub.wire import SnapshotInfo

__all__ = [
    "DEFAULT_MAX_CHARS",
    "TOOLS",
    "Attachment",
    "DownloadFileArgs",
    "ExecutePythonArgs",
    "InterruptArgs",
    "SnapshotArgs",
    "ToolResult",
    "ToolRunner",
    "ToolSession",
    "ToolSpec",
    "UploadFileArgs",
    "anthropic_tools",
    "gemini_tools",
    "openai_responses_tools",
    "openai_tools",
    "render_execution",
    "strip_ansi",
    "summarize_error",
    "trim_traceback",
    "truncate",
]

# -- the tools, defined once ---------------------------------------------------------------


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ExecutePythonArgs(_Args):
    code: str = Field(
        min_length=1,
        description="Python source to run as one notebook cell. The last expression's value is shown.",
    )
    timeout: float | None = Field(
        None,
        gt=0,
        le=3600,
        description="Seconds before the cell is interrupted; omit for the session's default.",
    )


class UploadFileArgs(_Args):
    path: str = Field(
        min_length=1, description="Destination path, relative to the /workspace directory."
    )
    text: str | None = Field(
        None, description="File content as UTF-8 text. Give this or content_base64."
    )
    content_base64: str | None = Field(
        None, description="File content as base64, for binary files. Give this or text."
    )

    @model_validator(mode="after")
    def _exactly_one_content(self) -> UploadFileArgs:
        if (self.text is None) == (self.content_base64 is None):
            raise ValueError("give exactly one of `text` or `content_base64`")
        return self


class DownloadFileArgs(_Args):
    path: str = Field(min_length=1, description="Path of the file, relative to /workspace.")


class InterruptArgs(_Args):
    pass


class SnapshotArgs(_Args):
    pass


@dataclass(frozen=True)
class ToolSpec:
    """One tool: the name the model calls, what it is for, and its arguments' model."""

    name: str
    description: str
    args: type[_Args]

    def json_schema(self) -> dict[str, Any]:
        """The arguments as a plain JSON schema object, as both providers accept it."""
        return schemas.plain_schema(self.args.model_json_schema())


TOOLS: dict[str, ToolSpec] = {
    spec.name: spec
    for spec in (
        ToolSpec(
            "execute_python",
            "Run Python code in a persistent, sandboxed IPython kernel. Variables, imports and "
            "functions survive between calls. Returns stdout, stderr, the value of the last "
            "expression, images from plots (matplotlib figures are shown automatically) and, if "
            "the code raised, the exception and the end of its traceback. The sandbox has no "
            "network; files live in /workspace.",
            ExecutePythonArgs,
        ),
        ToolSpec(
            "upload_file",
            "Write a file into the sandbox's /workspace directory, from text or base64.",
            UploadFileArgs,
        ),
        ToolSpec(
            "download_file",
            "Read a file from the sandbox's /workspace: text comes back as text, images as "
            "images, other binary files as (truncated) base64.",
            DownloadFileArgs,
        ),
        ToolSpec(
            "interrupt",
            "Interrupt the Python code that is running now (KeyboardInterrupt); variables are kept.",
            InterruptArgs,
        ),
        ToolSpec(
            "snapshot",
            "Save the kernel's variables and /workspace files as a snapshot; returns its id and "
            "which variables could not be saved.",
            SnapshotArgs,
        ),
    )
}


def _rendered(render: Callable[[str, str, dict[str, Any]], dict[str, Any]]) -> list[dict[str, Any]]:
    return [render(s.name, s.description, s.args.model_json_schema()) for s in TOOLS.values()]


def openai_tools() -> list[dict[str, Any]]:
    """The tools for OpenAI chat completions (``tools=``; nested ``function`` objects)."""
    return _rendered(schemas.openai_chat_tool)


def openai_responses_tools(*, strict: bool = True) -> list[dict[str, Any]]:
    """The tools for the OpenAI Responses API (flat ``FunctionToolParam``), strict by default."""
    return _rendered(functools.partial(schemas.openai_responses_tool, strict=strict))


def anthropic_tools() -> list[dict[str, Any]]:
    """The tools for Anthropic tool use (``tools=`` of the Messages API)."""
    return _rendered(schemas.anthropic_tool)


def gemini_tools() -> list[dict[str, Any]]:
    """The tools as Gemini function declarations: pass
    ``[{"function_declarations": gemini_tools()}]`` as ``tools=`` of google-genai."""
    return _rendered(schemas.gemini_function_declaration)


# -- running calls -------------------------------------------------------------------------


class ToolSession(Protocol):
    """What :class:`ToolRunner` needs of a session; :class:`~kernelhub.client.AsyncSession`
    is one."""

    async def run(
        self,
        code: str,
        *,
        timeout: float | None = None,
        on_event: Callable[[Event], object] | None = None,
    ) -> Execution: ...

    async def upload(self, path: str, data: bytes) -> FileInfo: ...

    async def download(self, path: str) -> bytes: ...

    async def interrupt(self, execution_id: str) -> None: ...

    async def snapshot(self) -> SnapshotInfo: ...


def _invalid(name: str, exc: pydantic.ValidationError) -> str:
    problems = []
    for problem in exc.errors(include_url=False, include_input=False):
        where = ".".join(map(str, problem["loc"]))
        message = problem["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {message}" if where else message)
    fields = ", ".join(TOOLS[name].args.model_fields) or "no arguments"
    return (
        f"invalid arguments for {name}: {'; '.join(problems)}. "
        f"It takes: {fields}. Fix the arguments and call it again."
    )


class ToolRunner:
    """Runs the model's tool calls against one session.

    ``max_chars`` bounds the text of each result, ``max_images`` the images attached,
    ``traceback_lines`` how much of a traceback is kept. Calls may overlap (a model's
    parallel calls, or ``interrupt`` while ``execute_python`` runs): the runner tracks the
    executions it has in flight, which is what ``interrupt`` interrupts.
    """

    def __init__(
        self,
        session: ToolSession,
        *,
        max_chars: int = DEFAULT_MAX_CHARS,
        max_images: int = DEFAULT_MAX_IMAGES,
        traceback_lines: int = DEFAULT_TRACEBACK_LINES,
    ) -> None:
        self.session = session
        self.max_chars = max_chars
        self.max_images = max_images
        self.traceback_lines = traceback_lines
        self._running: set[str] = set()

    async def run(self, name: str, arguments: dict[str, Any] | str | None) -> ToolResult:
        """Run tool ``name`` with ``arguments`` (a dict, or the JSON string a model sent)."""
        spec = TOOLS.get(name)
        if spec is None:
            return self._error(f"unknown tool {name!r}; the tools are: {', '.join(TOOLS)}")
        if arguments is None or arguments == "":
            arguments = {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                return self._error(
                    f"the arguments for {name} are not valid JSON ({exc}); send a JSON object"
                )
        if not isinstance(arguments, dict):
            return self._error(
                f"the arguments for {name} must be a JSON object, got {type(arguments).__name__}"
            )
        try:
            args = spec.args.model_validate(arguments)
        except pydantic.ValidationError as exc:
            return self._error(_invalid(name, exc))
        try:
            return await self._dispatch(args)
        except SessionEndedError:
            raise
        except (InvalidRequestError, NotFoundError, ConflictError) as exc:
            return self._error(f"{name} was refused: {exc.message}")

    # The model's call in each API's own shape (an SDK object or its dict), answered in
    # that API's own result shape; the call is run with :meth:`run`.

    async def run_openai_chat(self, tool_call: Any) -> list[dict[str, Any]]:
        """A chat completions ``tool_calls`` entry -> messages to append (tool, then images)."""
        function = schemas.field(tool_call, "function")
        result = await self.run(
            schemas.field(function, "name"), schemas.field(function, "arguments")
        )
        return result.to_openai_messages(schemas.field(tool_call, "id"))

    async def run_responses(self, function_call: Any) -> dict[str, Any]:
        """A Responses ``function_call`` output item -> its ``function_call_output`` item."""
        result = await self.run(
            schemas.field(function_call, "name"), schemas.field(function_call, "arguments")
        )
        return result.to_responses_item(schemas.field(function_call, "call_id"))

    async def run_anthropic(self, tool_use: Any) -> dict[str, Any]:
        """An Anthropic ``tool_use`` block -> its ``tool_result`` block."""
        result = await self.run(schemas.field(tool_use, "name"), schemas.field(tool_use, "input"))
        return result.to_anthropic_block(schemas.field(tool_use, "id"))

    async def run_gemini(self, function_call: Any) -> dict[str, Any]:
        """A Gemini ``FunctionCall`` -> a ``Part`` with its ``function_response``."""
        name = schemas.field(function_call, "name")
        result = await self.run(name, schemas.field(function_call, "args"))
        return result.to_gemini_part(name, schemas.field(function_call, "id", None))

    async def _dispatch(self, args: _Args) -> ToolResult:
        match args:
            case ExecutePythonArgs():
                return await self._execute(args)
            case UploadFileArgs():
                return await self._upload(args)
            case DownloadFileArgs():
                return await self._download(args)
            case InterruptArgs():
                return await self._interrupt()
            case SnapshotArgs():
                return await self._snapshot()
        raise AssertionError(f"no handler for {type(args).__name__}")

    def _error(self, message: str) -> ToolResult:
        return ToolResult(text=truncate(message, self.max_chars), is_error=True)

    async def _execute(self, args: ExecutePythonArgs) -> ToolResult:
        mine: set[str] = set()

        def seen(event: Event) -> None:
            if event.execution_id not in mine:
                mine.add(event.execution_id)
                self._running.add(event.execution_id)

        try:
            execution = await self.session.run(args.code, timeout=args.timeout, on_event=seen)
        finally:
            self._running.difference_update(mine)
        return render_execution(
            execution,
            max_chars=self.max_chars,
            max_images=self.max_images,
            traceback_lines=self.traceback_lines,
        )

    async def _upload(self, args: UploadFileArgs) -> ToolResult:
        if args.content_base64 is not None:
            try:
                data = base64.b64decode(args.content_base64, validate=True)
            except (binascii.Error, ValueError) as exc:
                return self._error(
                    f"content_base64 is not valid base64 ({exc}); send standard base64 "
                    "(A-Z a-z 0-9 + /, padded with =), or use `text` for text files"
                )
        else:
            assert args.text is not None
            data = args.text.encode()
        info = await self.session.upload(args.path, data)
        return ToolResult(text=f"wrote {info.size} bytes to {info.path}")

    async def _download(self, args: DownloadFileArgs) -> ToolResult:
        data = await self.session.download(args.path)
        mime, _ = mimetypes.guess_type(args.path)
        if mime in IMAGE_TYPES:
            image = Attachment(mime, base64.b64encode(data).decode())
            return ToolResult(text=f"{args.path}: {mime}, {len(data)} bytes", images=[image])
        try:
            text = data.decode()
        except UnicodeDecodeError:
            encoded = base64.b64encode(data).decode()
            header = f"{args.path}: binary, {len(data)} bytes; base64:\n"
            return ToolResult(text=header + truncate(encoded, self.max_chars - len(header)))
        header = f"{args.path} ({len(data)} bytes):\n"
        return ToolResult(text=header + truncate(text, max(0, self.max_chars - len(header))))

    async def _interrupt(self) -> ToolResult:
        running = sorted(self._running)
        if not running:
            return ToolResult(text="nothing is running; there is nothing to interrupt")
        for execution_id in running:
            await self.session.interrupt(execution_id)
        return ToolResult(
            text=f"sent KeyboardInterrupt to {len(running)} running execution(s); "
            "their results will show how they ended"
        )

    async def _snapshot(self) -> ToolResult:
        info = await self.session.snapshot()
        saved = ", ".join(info.saved) or "no variables"
        lines = [f"snapshot {info.id}: saved {saved} ({info.size_bytes} bytes)"]
        if info.skipped:
            lines.append(
                "not saved: " + "; ".join(f"{name} ({why})" for name, why in info.skipped.items())
            )
        return ToolResult(text=truncate("\n".join(lines), self.max_chars))
