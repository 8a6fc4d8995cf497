"""What a model gets back from a kernelhub tool: a :class:`ToolResult` (text bounded by a
character budget, images as attachments, an error flag), rendered for each provider.

The text shaping (:func:`truncate`, :func:`trim_traceback`, :func:`summarize_error`,
:func:`render_execution`) is pure and tested with data: head and tail kept with an
explicit ``… [truncated N characters]`` marker between, PNG/JPEG displays as image
attachments (capped in number), a failing cell as ``ename: evalue`` plus its plain
traceback trimmed for a reader: the user's own frames (``Cell In[1], line 3``) and every
exception line are kept, the library frames between them become one
``… N library frames …`` line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kernelhub.agents import schemas
from kernelhub.models import (
    CellError,
    DisplayEvent,
    Execution,
    ExecutionStatus,
    ResultEvent,
    TruncatedEvent,
    strip_ansi,
)

__all__ = [
    "DEFAULT_MAX_CHARS",
    "DEFAULT_MAX_IMAGES",
    "DEFAULT_TRACEBACK_LINES",
    "IMAGE_TYPES",
    "Attachment",
    "ToolResult",
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
