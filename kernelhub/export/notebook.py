"""A session's history as a Jupyter notebook (nbformat v4), and as static HTML. Pure: data
in, a notebook or a string out; no I/O.

:func:`to_notebook` replays each execution's events the way a Jupyter front end applies
IOPub messages: consecutive stream text of one name is merged, ``clear_output`` drops the
cell's earlier outputs (with ``wait=True``, only when the next output arrives), and an
``update_display_data`` rewrites every earlier output with the same ``display_id``, in any
cell. Whatever kernelhub knows beyond that (status, how it ended, timings, resources,
``input()`` answers, truncation, notices) goes into the cell's ``metadata.kernelhub``.

A cell that did not complete is marked where a reader cannot miss it: a markdown cell just
before it, and a ``[kernelhub: …]`` line on stderr (unless a traceback already shows it).
What happened to the session between cells (a crashed kernel recovered in a fresh
sandbox: the notices that belong to no execution) is a marked markdown cell of its own, in
its place. Execution counts keep counting up across such restarts: a fresh kernel counts
from 1 again, so its counts are shifted past the last one shown (the kernel's own count is
kept in ``metadata.kernelhub.kernel_execution_count``).

Re-running an export (``nbclient``, ``jupyter nbconvert --execute``): cells tagged
``kernelhub-skip-rerun`` did not complete, or needed an ``input()`` answer, so a re-run
cannot reproduce them; remove them (and the ``kernelhub-marker`` markdown cells) first.
Cells whose code raised carry the standard ``raises-exception`` tag, so a re-run expects
their error instead of stopping.

:func:`to_html` renders a notebook as one self-contained page for people. Agent output is
untrusted: every text is escaped, markdown is rendered by a small safe renderer
(:mod:`kernelhub.export.markdown`: links only to http(s)/mailto), ``text/html`` is shown only inside a sandboxed
``<iframe srcdoc>`` (no scripts, no same-origin), images only from validated base64, and a
strict Content-Security-Policy forbids scripts and any network fetch.
"""

from __future__ import annotations

import base64
import binascii
import html
import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol, cast

import nbformat
from nbformat import NotebookNode

from kernelhub.export.markdown import render_markdown
from kernelhub.models import (
    ClearOutputEvent,
    DisplayEvent,
    EndedBy,
    ErrorEvent,
    Event,
    ExecutionRecord,
    ExecutionStatus,
    FinalEvent,
    InputReplyEvent,
    InputRequestEvent,
    NoticeEvent,
    ResultEvent,
    StatusEvent,
    StreamEvent,
    TruncatedEvent,
)
from kernelhub.wire import SessionInfo

_Json = dict[str, Any]
# nbformat's own constructors are untyped; the notebook is built as plain JSON and
# converted once.
_from_dict = cast("Callable[[_Json], NotebookNode]", nbformat.from_dict)

RERUN_SKIP_TAG = "kernelhub-skip-rerun"
MARKER_TAG = "kernelhub-marker"
RAISES_TAG = "raises-exception"  # understood by nbclient: this cell's error is expected

_CELL_ID = re.compile(r"[^A-Za-z0-9_-]")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
_JSON_MIME = re.compile(r"^application/(.*\+)?json$")
_IMAGES = ("image/png", "image/jpeg", "image/gif")
_PREFERENCE = (
    *_IMAGES,
    "image/svg+xml",
    "text/html",
    "text/markdown",
    "text/latex",
    "application/json",
    "text/plain",
)
_HEADLINES = {
    ExecutionStatus.FAILED: "failed",
    ExecutionStatus.INTERRUPTED: "interrupted",
    ExecutionStatus.TIMED_OUT: "timed out",
    ExecutionStatus.CANCELLED: "cancelled (never ran)",
    ExecutionStatus.KERNEL_DIED: "the kernel died",
}


class ExecutionLike(Protocol):
    """What the export needs of an execution (``store.sqlite.StoredExecution`` fits)."""

    @property
    def id(self) -> str: ...
    @property
    def code(self) -> str: ...
    @property
    def status(self) -> ExecutionStatus: ...
    @property
    def created_at(self) -> datetime: ...
    @property
    def record(self) -> ExecutionRecord | None: ...


# -- notebook --------------------------------------------------------------------------


def to_notebook(
    session: SessionInfo,
    executions: Sequence[tuple[ExecutionLike, Sequence[Event]]],
    session_events: Sequence[Event] = (),
) -> NotebookNode:
    """The session's executions, in the given order, as a valid nbformat v4 notebook.
    ``session_events`` are the session's events that belong to no execution (recovery
    notices): each becomes a marked cell where its ``seq`` falls among the executions'."""
    cells: list[_Json] = [
        _markdown(
            f"session-{session.id}",
            f"# kernelhub session `{_md_code(session.id)}`\n\n"
            f"Exported from the {_md_code(session.backend)} backend; "
            f"created {session.created_at:%Y-%m-%d %H:%M:%S} UTC by `{_md_code(session.owner)}`.",
        )
    ]
    displays: dict[str, list[_Json]] = {}
    between = sorted((e for e in session_events if isinstance(e, NoticeEvent)), key=lambda e: e.seq)
    counter = _Counter()
    for execution, events in executions:
        first_seq = min((e.seq for e in events), default=None)
        while between and first_seq is not None and between[0].seq < first_seq:
            cells.append(_session_note(between.pop(0)))
        cell = _cell(execution, events, displays)
        counter.renumber(cell)
        marker = _marker(execution, cell)
        if marker is not None:
            cells.append(marker)
        cells.append(cell)
    cells.extend(_session_note(notice) for notice in between)
    metadata = {
        "kernelspec": {
            "name": "python3",
            "display_name": "Python 3 (ipykernel)",
            "language": "python",
        },
        "language_info": {"name": "python"},
        "kernelhub": {
            "session_id": session.id,
            "owner": session.owner,
            "backend": session.backend,
            "state": session.state.value,
            "reason": session.reason,
            "created_at": _iso(session.created_at),
            "limits": session.limits,
            "metadata": session.metadata,
        },
    }
    return _from_dict({"nbformat": 4, "nbformat_minor": 5, "metadata": metadata, "cells": cells})


def _cell(
    execution: ExecutionLike, events: Sequence[Event], displays: dict[str, list[_Json]]
) -> _Json:
    outputs: list[_Json] = []
    clear_pending = False
    inputs: list[dict[str, Any]] = []
    notices: list[str] = []
    truncation: dict[str, Any] | None = None
    late = 0
    record = execution.record
    result_count: int | None = None

    def add(output: _Json) -> None:
        nonlocal clear_pending
        if clear_pending:
            outputs.clear()
            clear_pending = False
        if (
            output["output_type"] == "stream"
            and outputs
            and outputs[-1]["output_type"] == "stream"
            and outputs[-1]["name"] == output["name"]
        ):
            outputs[-1]["text"] += output["text"]
        else:
            outputs.append(output)

    for event in events:
        if isinstance(event, StreamEvent):
            late += event.late
            add(_stream(event.name, event.text))
        elif isinstance(event, DisplayEvent):
            late += event.late
            if event.update:
                for shown in displays.get(event.display_id or "", []):
                    shown["data"] = _bundle(event.data)
                    shown["metadata"] = dict(event.metadata)
                continue
            output = {
                "output_type": "display_data",
                "data": _bundle(event.data),
                "metadata": dict(event.metadata),
            }
            add(output)
            if event.display_id:
                displays.setdefault(event.display_id, []).append(output)
        elif isinstance(event, ResultEvent):
            result_count = event.execution_count
            add(
                {
                    "output_type": "execute_result",
                    "data": _bundle(event.data),
                    "metadata": dict(event.metadata),
                    "execution_count": event.execution_count,
                }
            )
        elif isinstance(event, ErrorEvent):
            add(
                {
                    "output_type": "error",
                    "ename": event.error.name,
                    "evalue": event.error.value,
                    "traceback": list(event.error.traceback_ansi or event.error.traceback),
                }
            )
        elif isinstance(event, ClearOutputEvent):
            if event.wait:
                clear_pending = True
            else:
                outputs.clear()
                clear_pending = False
        elif isinstance(event, InputRequestEvent):
            inputs.append({"prompt": event.prompt, "password": event.password, "value": None})
        elif isinstance(event, InputReplyEvent):
            pending = [i for i in inputs if "answered_by" not in i]
            entry: dict[str, Any] = (
                pending[0] if pending else {"prompt": None, "password": event.password}
            )
            if not pending:
                inputs.append(entry)
            entry["value"] = event.value
            entry["answered_by"] = event.answered_by
            # What a Jupyter front end leaves behind once input() was answered.
            echoed = "········" if event.password else event.value
            add(_stream("stdout", f"{entry['prompt'] or ''}{echoed}\n"))
        elif isinstance(event, TruncatedEvent):
            if truncation is None:
                add(_note(f"output truncated at the {event.limit_bytes}-byte cap"))
            truncation = {"limit_bytes": event.limit_bytes, "dropped_bytes": event.dropped_bytes}
        elif isinstance(event, NoticeEvent):
            notices.append(event.message)
            add(_note(event.message))
        elif isinstance(event, FinalEvent):
            record = event.record
        elif isinstance(event, StatusEvent):
            pass  # the record says how it ended; transitions add nothing for a reader

    status = record.status if record is not None else execution.status
    failed_visibly = any(o["output_type"] == "error" for o in outputs)
    if status is not ExecutionStatus.COMPLETED and not (
        status is ExecutionStatus.FAILED and failed_visibly
    ):
        add(_note(_headline(status, record)))

    tags: list[str] = []
    if status is not ExecutionStatus.COMPLETED or inputs:
        tags.append(RERUN_SKIP_TAG)
    if status is ExecutionStatus.FAILED and failed_visibly:
        tags.append(RAISES_TAG)
    metadata: dict[str, Any] = {
        "kernelhub": {
            "execution_id": execution.id,
            "status": status.value,
            "ended_by": record.ended_by.value if record else None,
            "state_lost": record.state_lost if record else False,
            "reason": record.reason if record else None,
            "timings": _timings(execution, record),
            "resources": _resources(record),
            "inputs": inputs,
            "truncation": truncation,
            "notices": notices,
            "late_outputs": late,
        }
    }
    if tags:
        metadata["tags"] = tags
    if record is not None and record.started_at is not None:
        metadata["execution"] = {
            "iopub.execute_input": _iso(record.started_at),
            "shell.execute_reply": _iso(record.finished_at),
        }
    count = record.execution_count if record and record.execution_count else result_count
    return {
        "cell_type": "code",
        "id": _cell_id(execution.id),
        "metadata": metadata,
        "execution_count": count,
        "source": execution.code,
        "outputs": outputs,
    }


class _Counter:
    """Execution counts that only go up. A kernel restarted (recovered after a crash, or
    restarted by a timeout) counts from 1 again; its counts are shifted to continue after
    the last count shown, which is what a reader of ``In [n]`` expects."""

    def __init__(self) -> None:
        self.last = 0
        self.shift = 0

    def renumber(self, cell: _Json) -> None:
        count = cell["execution_count"]
        if count is None:
            return
        cell["metadata"]["kernelhub"]["kernel_execution_count"] = count
        if count + self.shift <= self.last:
            self.shift = self.last - count + 1
        shown = count + self.shift
        self.last = shown
        cell["execution_count"] = shown
        for output in cell["outputs"]:
            if output["output_type"] == "execute_result":
                output["execution_count"] = shown


def _session_note(notice: NoticeEvent) -> _Json:
    return _markdown(f"notice-{notice.seq}", f"**⚠ kernelhub — {_md_escape(notice.message)}**")


def _marker(execution: ExecutionLike, cell: _Json) -> _Json | None:
    info = cell["metadata"]["kernelhub"]
    status = ExecutionStatus(info["status"])
    if status is ExecutionStatus.COMPLETED:
        return None
    text = f"**⚠ kernelhub — the cell below: {_headline_text(status, info)}.**"
    if info["reason"]:
        text += f"\n\n{_md_escape(info['reason'])}"
    return _markdown(f"{execution.id}-marker", text)


def _markdown(cell_id: str, text: str) -> _Json:
    return {
        "cell_type": "markdown",
        "id": _cell_id(cell_id),
        "metadata": {"tags": [MARKER_TAG]},
        "source": text,
    }


def _headline(status: ExecutionStatus, record: ExecutionRecord | None) -> str:
    info = {
        "ended_by": record.ended_by.value if record else None,
        "reason": record.reason if record else None,
        "timings": {"duration": record.duration if record else None},
    }
    text = _headline_text(status, info)
    reason = f": {record.reason}" if record and record.reason else ""
    return f"{text}{reason}"


def _headline_text(status: ExecutionStatus, info: Mapping[str, Any]) -> str:
    if not status.is_final:
        return f"was still {status.value} when exported"
    text = _HEADLINES.get(status, status.value)
    duration = info["timings"].get("duration")
    if status is ExecutionStatus.TIMED_OUT and duration is not None:
        text += f" after {duration:.1f} s"
    ended_by = info["ended_by"]
    obvious = {EndedBy.REPLY.value, EndedBy.CANCEL.value}
    if status is ExecutionStatus.INTERRUPTED:
        obvious.add(EndedBy.INTERRUPT.value)
    if ended_by and ended_by not in obvious:
        text += f" (ended by {ended_by})"
    return text


def _stream(name: str, text: str) -> _Json:
    return {"output_type": "stream", "name": name, "text": text}


def _note(message: str) -> _Json:
    return _stream("stderr", f"[kernelhub: {message}]\n")


def _timings(execution: ExecutionLike, record: ExecutionRecord | None) -> dict[str, Any]:
    if record is None:
        return {"queued_at": _iso(execution.created_at), "started_at": None, "finished_at": None}
    return {
        "queued_at": _iso(record.queued_at),
        "started_at": _iso(record.started_at) if record.started_at else None,
        "finished_at": _iso(record.finished_at),
        "duration": record.duration,
        "paused_seconds": record.paused_seconds,
    }


def _resources(record: ExecutionRecord | None) -> dict[str, Any]:
    if record is None:
        return {}
    return {
        "cpu_seconds": record.cpu_seconds,
        "peak_memory_bytes": record.peak_memory_bytes,
        "output_bytes": record.output_bytes,
        "dropped_bytes": record.dropped_bytes,
    }


def _bundle(data: Mapping[str, Any]) -> dict[str, Any]:
    """A MIME bundle nbformat accepts: JSON types as they are, everything else as text."""
    out: dict[str, Any] = {}
    for mime, value in data.items():
        if _JSON_MIME.match(mime) or isinstance(value, str):
            out[mime] = value
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            out[mime] = "".join(value)
        else:
            out[mime] = json.dumps(value)
    return out


def _iso(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def _cell_id(raw: str) -> str:
    return _CELL_ID.sub("-", raw)[:64] or "cell"


def _md_code(text: str) -> str:
    return text.replace("`", "'")


def _md_escape(text: str) -> str:
    return re.sub(r"([\\`*_{}\[\]<>()#+!|])", r"\\\1", text)


# -- HTML ------------------------------------------------------------------------------

_CSP = (
    "default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
    "base-uri 'none'; form-action 'none'"
)
_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:60em;padding:0 1em;color:#222}
pre{white-space:pre-wrap;word-break:break-word;margin:0;font:13px/1.4 ui-monospace,monospace}
.cell{margin:1em 0}.code{background:#f5f5f5;border-left:3px solid #888;padding:.5em}
.count{color:#888;font:12px ui-monospace,monospace}.out{padding:.3em .5em}
.stderr{background:#fff3f3}.error{background:#fdd;color:#700}
.bad{border-left:4px solid #c00;padding-left:.5em}.banner{background:#c00;color:#fff;padding:.3em .6em;font-weight:bold}
.md{color:#333}.md pre{background:#f5f5f5;padding:.5em}.md code{font:13px ui-monospace,monospace}
.marker{border-left:4px solid #c00;padding-left:.5em}.meta{color:#666;font-size:12px}
iframe{width:100%;height:20em;border:1px solid #ddd;resize:vertical}
img{max-width:100%}
"""


def to_html(notebook: Mapping[str, Any]) -> str:
    """One self-contained, script-free HTML page showing the notebook's cells and outputs."""
    info = notebook.get("metadata", {}).get("kernelhub", {})
    title = f"kernelhub session {info.get('session_id', '')}".strip()
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">',
        '<meta name="referrer" content="no-referrer">',
        f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>",
    ]
    for cell in notebook.get("cells", []):
        parts.append(_html_cell(cell))
    parts.append("</body></html>")
    return "\n".join(parts)


def _html_cell(cell: Mapping[str, Any]) -> str:
    source = _text(cell.get("source", ""))
    if cell.get("cell_type") != "code":
        marked = MARKER_TAG in cell.get("metadata", {}).get("tags", [])
        css = "cell md marker" if marked and "⚠" in source else "cell md"
        return f'<div class="{css}">{render_markdown(source)}</div>'
    info = cell.get("metadata", {}).get("kernelhub", {})
    status = info.get("status", "completed")
    count = cell.get("execution_count")
    parts = [f'<div class="cell{" bad" if status != "completed" else ""}">']
    if status != "completed":
        parts.append(f'<div class="banner">{_e(status.replace("_", " "))}</div>')
    parts.append(f'<div class="count">In [{_e(str(count) if count is not None else " ")}]:</div>')
    parts.append(f'<pre class="code">{_e(source)}</pre>')
    for output in cell.get("outputs", []):
        parts.append(_html_output(output))
    timings = info.get("timings", {})
    if timings.get("duration") is not None:
        parts.append(
            f'<div class="meta">{_e(status)} · {timings["duration"]:.3f} s'
            f"{_e(' · ended by ' + info['ended_by']) if info.get('ended_by') else ''}</div>"
        )
    parts.append("</div>")
    return "\n".join(parts)


def _html_output(output: Mapping[str, Any]) -> str:
    kind = output.get("output_type")
    if kind == "stream":
        css = "out stderr" if output.get("name") == "stderr" else "out"
        return f'<pre class="{css}">{_e(_plain(_text(output.get("text", ""))))}</pre>'
    if kind == "error":
        lines = output.get("traceback") or [f"{output.get('ename')}: {output.get('evalue')}"]
        return f'<pre class="out error">{_e(_plain(chr(10).join(lines)))}</pre>'
    if kind in ("display_data", "execute_result"):
        return f'<div class="out">{_html_bundle(output.get("data", {}))}</div>'
    return ""


def _html_bundle(data: Mapping[str, Any]) -> str:
    for mime in _PREFERENCE:
        if mime not in data:
            continue
        value = data[mime]
        if mime in _IMAGES:
            b64 = re.sub(r"\s", "", _text(value))
            if _valid_base64(b64):
                return f'<img alt="{_e(mime)}" src="data:{mime};base64,{b64}">'
            continue
        if mime == "image/svg+xml":
            encoded = base64.b64encode(_text(value).encode()).decode()
            return f'<img alt="svg" src="data:image/svg+xml;base64,{encoded}">'
        if mime == "text/html":
            # Untrusted: only inside a sandboxed frame (no scripts, an opaque origin); the
            # page's CSP applies to srcdoc frames too.
            return f'<iframe sandbox="" referrerpolicy="no-referrer" srcdoc="{_e(_text(value))}"></iframe>'
        if mime == "application/json":
            return f"<pre>{_e(json.dumps(value, indent=2))}</pre>"
        return f"<pre>{_e(_plain(_text(value)))}</pre>"
    return f'<pre class="meta">[{_e(", ".join(data))}]</pre>'


def _valid_base64(text: str) -> bool:
    if not text or not _BASE64.fullmatch(text):
        return False
    try:
        base64.b64decode(text, validate=True)
    except binascii.Error:
        return False
    return True


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "".join(str(v) for v in value)
    return value if isinstance(value, str) else json.dumps(value)


def _plain(text: str) -> str:
    return _ANSI.sub("", text)


def _e(text: str) -> str:
    return html.escape(text, quote=True)
