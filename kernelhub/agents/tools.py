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

The text shaping (:func:`truncate`, :func:`strip_ansi`, :func:`trim_traceback`,
:func:`summarize_error`, :func:`render_execution`) is pure and tested with data.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import mimetypes
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import pydantic
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kernelhub.agents import schemas
from kernelhub.client import FileInfo
from kernelhub.client.errors import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    SessionEndedError,
)
from kernelhub.models import (
    CellError,
    DisplayEvent,
    Event,
    Execution,
    ExecutionStatus,
    ResultEvent,
    TruncatedEvent,
    strip_ansi,
)
from kernelhub.wire import SnapshotInfo

__all__ = [
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

DEFAULT_MAX_CHARS = 8000
DEFAULT_MAX_IMAGES = 4
DEFAULT_TRACEBACK_LINES = 15
_RULE = re.compile(r"^-{20,}$")  # IPython's separator above a Context-mode traceback
IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")


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


# -- what a model gets back ----------------------------------------------------------------


@dataclass(frozen=True)
class Attachment:
    """An image for the model: base64 data and its MIME type."""

    mime_type: str
    data_base64: str


@dataclass(frozen=True)
class ToolResult:
    """A tool call's outcome, shaped for a model's context."""

    text: str
    images: list[Attachment] = field(default_factory=list)
    is_error: bool = False

    def _images(self) -> list[schemas.Image]:
        return [(a.mime_type, a.data_base64) for a in self.images]

    def to_openai_message(self, tool_call_id: str) -> dict[str, Any]:
        """The ``role: tool`` message answering ``tool_call_id``. OpenAI tool messages
        carry text only; pass :meth:`openai_image_message` after it for the images."""
        return self.to_openai_messages(tool_call_id)[0]

    def openai_image_message(self) -> dict[str, Any] | None:
        """A ``role: user`` message with the images as data URLs, or None if there are none."""
        messages = self.to_openai_messages("")
        return messages[1] if len(messages) > 1 else None

    def to_openai_messages(self, tool_call_id: str) -> list[dict[str, Any]]:
        """Chat completions: the ``role: tool`` message, then a ``role: user`` message with
        the images if there are any (append both to ``messages``)."""
        return schemas.openai_chat_messages(tool_call_id, self.text, self._images())

    def to_responses_item(self, call_id: str) -> dict[str, Any]:
        """Responses API: the ``function_call_output`` input item, images as ``input_image``."""
        return schemas.openai_responses_output(call_id, self.text, self._images())

    def to_anthropic_block(self, tool_use_id: str) -> dict[str, Any]:
        """The ``tool_result`` content block answering ``tool_use_id`` (text and images)."""
        return schemas.anthropic_tool_result(
            tool_use_id, self.text, self._images(), is_error=self.is_error
        )

    def to_gemini_part(self, name: str, call_id: str | None = None) -> dict[str, Any]:
        """Gemini: a ``Part`` with the ``function_response``, images as inline-data parts."""
        return schemas.gemini_function_response(
            name, call_id, self.text, self._images(), is_error=self.is_error
        )


# -- pure text shaping ---------------------------------------------------------------------

# A frame's first line, in every IPython traceback mode: "Cell In[3], line 2, in f" /
# "File /x.py:12, in g()" (Context, Verbose) or "  Cell In[3], line 2 in f" / "  File /x.py:12
# in g" (Plain, Minimal), and the stdlib's 'File "/x.py", line 12, in g'.
_FRAME = re.compile(r"^\s*(?:Cell In\[\d+\]|File \S|Input In \[\d+\])")
# The user's own code: cells, and files in the sandbox's workspace.
_USER_FRAME = re.compile(
    r"^\s*(?:Cell In\[|Input In \[|File \"?/workspace/|File \"?<ipython-input)"
)
_CURRENT_LINE = re.compile(r"^\s*-*>")  # Context/Verbose mark the running line with an arrow
_SECTION_END = re.compile(
    r"^(?:The above exception was the direct cause|During handling of the above exception)"
)


def trim_traceback(lines: list[str]) -> list[str]:
    """A plain traceback (one line per item) cut down for a reader with little room.

    Each chained traceback keeps its headers, every frame of the user's own code with only
    its current line, its last frame (where it was raised) and the exception lines; a run
    of library frames in between becomes ``… N library frames …``. Lines that are not
    frames (the exception, chain separators, notes) are kept as they are."""
    out: list[str] = []
    sections: list[list[str]] = [[]]
    for line in lines:
        sections[-1].append(line)
        if _SECTION_END.match(line):
            sections.append([])
    for section in sections:
        out.extend(_trim_section(section))
    return out


def _trim_section(lines: list[str]) -> list[str]:
    # Split into: text before the first frame, frames (header + body), text after them.
    head: list[str] = []
    frames: list[list[str]] = []
    for line in lines:
        if _FRAME.match(line):
            frames.append([line])
        elif frames and (line.startswith(" ") or not line.strip() or _CURRENT_LINE.match(line)):
            frames[-1].append(line)
        elif frames:
            break
        else:
            head.append(line)
    consumed = len(head) + sum(len(f) for f in frames)
    tail = lines[consumed:]
    out = list(head)
    dropped = 0
    for index, frame in enumerate(frames):
        last = index == len(frames) - 1
        if not last and not _USER_FRAME.match(frame[0]):
            dropped += 1
            continue
        if dropped:
            out.append(f"… {dropped} library frame{'s' if dropped > 1 else ''} …")
            dropped = 0
        out.extend(_frame_essentials(frame))
    return out + tail


def _frame_essentials(frame: list[str]) -> list[str]:
    """A frame's header and its current line (the arrowed one, or Plain mode's one line)."""
    body = [line for line in frame[1:] if line.strip()]
    current = [line for line in body if _CURRENT_LINE.match(line)]
    return [frame[0], *(current or body[:1])]


def truncate(text: str, max_chars: int) -> str:
    """``text`` if it fits in ``max_chars``; else its head and tail around a marker saying
    how many characters were cut, the whole at most ``max_chars`` long (or the marker alone,
    if even that does not fit)."""
    if len(text) <= max_chars:
        return text
    # The marker's length depends on N; size it for the largest N it can show.
    width = len(f"\n… [truncated {len(text)} characters]\n")
    keep = max(0, max_chars - width)
    head = keep * 3 // 5
    tail = keep - head
    cut = len(text) - head - tail
    return (
        f"{text[:head]}\n… [truncated {cut} characters]\n{text[len(text) - tail :] if tail else ''}"
    )


def summarize_error(error: CellError, traceback_lines: int = DEFAULT_TRACEBACK_LINES) -> str:
    """``ename: evalue`` and the traceback, uncoloured and trimmed (:func:`trim_traceback`);
    if that is still over ``traceback_lines`` lines, its first user frame and its end."""
    lines = trim_traceback(strip_ansi("\n".join(error.traceback)).splitlines())
    lines = [line.rstrip() for line in lines if line.strip() and not _RULE.match(line)]
    head = f"{error.name}: {strip_ansi(error.value)}"
    if not lines:
        return head
    if len(lines) <= traceback_lines:
        return f"{head}\n" + "\n".join(lines)
    # The user's own frame says where to look: keep the first one (header and line) ahead
    # of the tail, which ends with the exception.
    first = next((i for i, line in enumerate(lines) if _USER_FRAME.match(line)), None)
    keep_head = lines[first : first + 2] if first is not None and traceback_lines > 4 else []
    tail = lines[-(traceback_lines - len(keep_head)) :]
    if keep_head and lines.index(keep_head[0]) >= len(lines) - len(tail):
        keep_head = []  # already in the tail
        tail = lines[-traceback_lines:]
    skipped = len(lines) - len(tail) - len(keep_head)
    return f"{head}\n… {skipped} traceback lines omitted …\n" + "\n".join([*keep_head, *tail])


def _share(parts: list[str], budget: int) -> list[str]:
    """Truncate ``parts`` so together they fit ``budget``: short parts stay whole, long ones
    split what is left equally (water-filling)."""
    out = list(parts)
    remaining = budget
    order = sorted(range(len(parts)), key=lambda i: len(parts[i]))
    for rank, i in enumerate(order):
        fair = remaining // (len(parts) - rank)
        out[i] = truncate(parts[i], max(fair, 0))
        remaining -= len(out[i])
    return out


def _image_of(data: dict[str, Any]) -> Attachment | None:
    for mime in IMAGE_TYPES:
        value = data.get(mime)
        if isinstance(value, str) and value:
            return Attachment(mime, value.replace("\n", ""))
    return None


def render_execution(
    execution: Execution,
    *,
    max_chars: int = DEFAULT_MAX_CHARS,
    max_images: int = DEFAULT_MAX_IMAGES,
    traceback_lines: int = DEFAULT_TRACEBACK_LINES,
) -> ToolResult:
    """An execution as a model-ready result: sections ``[stdout]``, ``[stderr]``,
    ``[display]`` (text of non-image displays), ``[result]``, ``[error]``, ``[status]``."""
    images: list[Attachment] = []
    omitted_images = 0
    displays: list[str] = []

    def collect(data: dict[str, Any]) -> str | None:
        nonlocal omitted_images
        image = _image_of(data)
        if image is not None:
            if len(images) < max_images:
                images.append(image)
            else:
                omitted_images += 1
            return None
        text = data.get("text/plain")
        return text if isinstance(text, str) else None

    result_text: str | None = None
    dropped_bytes = 0
    for event in execution.events:
        if isinstance(event, DisplayEvent):
            text = collect(event.data)
            if text is not None:
                displays.append(text)
        elif isinstance(event, ResultEvent):
            result_text = collect(event.data)
        elif isinstance(event, TruncatedEvent) and event.final:
            dropped_bytes = event.dropped_bytes

    sections: list[tuple[str, str]] = []
    for label, body in (
        ("stdout", execution.stdout),
        ("stderr", execution.stderr),
        ("display", "\n".join(displays)),
        ("result", result_text or ""),
    ):
        body = strip_ansi(body)
        if body:
            sections.append((label, body))

    tail: list[str] = []  # short, always kept whole
    record = execution.record
    if record.error is not None:
        tail.append(f"[error]\n{summarize_error(record.error, traceback_lines)}")
    if record.status not in (ExecutionStatus.COMPLETED, ExecutionStatus.FAILED):
        status = f"[status] {record.status.value}"
        if record.reason:
            status += f": {record.reason}"
        if record.state_lost:
            status += " (the kernel was restarted: variables and imports are gone; files are kept)"
        tail.append(status)
    if dropped_bytes:
        tail.append(f"[note] the sandbox dropped {dropped_bytes} bytes of output over its cap")
    if images or omitted_images:
        note = f"[images] {len(images)} attached"
        if omitted_images:
            note += f", {omitted_images} more omitted"
        tail.append(note)

    tail_text = "\n".join(tail)
    headers = sum(len(f"[{label}]\n") + 1 for label, _ in sections)
    budget = max(0, max_chars - len(tail_text) - headers)
    bodies = _share([body for _, body in sections], budget)
    parts = [f"[{label}]\n{body}" for (label, _), body in zip(sections, bodies, strict=True)]
    if tail_text:
        parts.append(tail_text)
    text = "\n".join(parts) if parts else "(no output)"
    is_error = record.status is not ExecutionStatus.COMPLETED or record.error is not None
    return ToolResult(text=text, images=images, is_error=is_error)


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
