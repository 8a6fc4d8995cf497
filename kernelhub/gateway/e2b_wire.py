"""What the E2B SDK expects on the wire, as pure functions: kernelhub events to the code
interpreter's NDJSON lines, sessions to E2B sandbox records, E2B paths to /workspace paths,
directory listings to envd's Connect-RPC ``EntryInfo`` JSON.

Facts from the ``e2b`` / ``e2b-code-interpreter`` 2.x sources (``e2b_code_interpreter/
models.py::_parse_output``, ``e2b/api/client/models/*.py``, ``e2b/envd/filesystem/
filesystem_pb.py``):

- ``POST /execute`` answers one JSON object per line: ``{"type": "stdout"|"stderr", "text",
  "timestamp"}``, ``{"type": "result", <format>: ..., "is_main_result"}``, ``{"type":
  "error", "name", "value", "traceback"}`` (the traceback one string),
  ``{"type": "number_of_executions", "execution_count"}``.
- The control plane speaks camelCase (``sandboxID``, ``envdVersion``, ``endAt``) and
  answers errors as ``{"code": <status>, "message"}``.
- Connect's JSON codec is proto3 JSON: camelCase fields, enums by name, int64 as strings,
  timestamps as RFC 3339; errors are ``{"code": "not_found", "message"}``.
"""

from __future__ import annotations

import ast
import json
import posixpath
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qsl, unquote

from kernelhub.errors import InvalidRequestError, KernelError
from kernelhub.models import (
    DisplayEvent,
    ErrorEvent,
    Event,
    ExecutionStatus,
    FinalEvent,
    ResultEvent,
    StreamEvent,
)

# The envd version kernelhub answers as. 0.4.0 and later: no ``username`` on file calls;
# under 0.5.7: uploads are multipart (the only upload kind served here).
ENVD_VERSION = "0.5.6"
WORKSPACE = "/workspace"
# The E2B sandbox user's home is the default directory of SDK calls; here it is /workspace.
HOME = "/home/user"

# MIME type -> the attribute of ``e2b_code_interpreter.models.Result``.
RESULT_FORMATS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "application/vnd.dataresource+json": "data",
}

# Connect error codes for the HTTP statuses kernelhub's error table produces.
CONNECT_CODES = {
    400: "invalid_argument",
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    409: "failed_precondition",
    410: "not_found",
    413: "resource_exhausted",
    429: "resource_exhausted",
    503: "unavailable",
    507: "resource_exhausted",
}


def _stamp(when: datetime | None = None) -> str:
    return (when or datetime.now(UTC)).astimezone(UTC).isoformat().replace("+00:00", "Z")


def result_line(data: dict[str, Any], *, main: bool) -> dict[str, Any]:
    """A display or execute_result bundle as an E2B ``result`` line."""
    line: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra: dict[str, Any] = {}
    for mime, value in data.items():
        name = RESULT_FORMATS.get(mime)
        if name is None:
            extra[mime] = value
        elif name in ("png", "jpeg") and isinstance(value, str):
            line[name] = value.replace("\n", "")
        else:
            line[name] = value
    if extra:
        line["extra"] = extra
    return line


def execute_lines(event: Event) -> list[dict[str, Any]]:
    """The NDJSON objects one kernelhub event becomes (none for bookkeeping events)."""
    match event:
        case StreamEvent():
            return [{"type": event.name, "text": event.text, "timestamp": _stamp()}]
        case DisplayEvent() if not event.update:
            return [result_line(event.data, main=False)]
        case ResultEvent():
            return [result_line(event.data, main=True)]
        case ErrorEvent():
            e = event.error
            return [{"type": "error", "name": e.name, "value": e.value, "traceback": "\n".join(e.traceback)}]  # fmt: skip
        case FinalEvent():
            record = event.record
            lines: list[dict[str, Any]] = []
            if record.error is None and record.status not in (
                ExecutionStatus.COMPLETED,
                ExecutionStatus.FAILED,
            ):
                # Timed out, interrupted, the kernel died: E2B has only errors to say so.
                reason = record.reason or record.status.value
                lines.append(
                    {"type": "error", "name": record.status.value, "value": reason, "traceback": reason}
                )  # fmt: skip
            if record.execution_count is not None:
                lines.append(
                    {"type": "number_of_executions", "execution_count": record.execution_count}
                )
            return lines
    return []


def workspace_path(path: str) -> str:
    """An E2B path (absolute under /workspace or /home/user, or relative to them) as the
    path relative to /workspace that kernelhub's file calls take; "" for /workspace."""
    for root in (WORKSPACE, HOME):
        if path == root or path.startswith(root + "/"):
            path = path[len(root) :]
            break
    else:
        if path.startswith("/"):
            raise InvalidRequestError(
                f"path {path!r} is outside the sandbox's files; kernelhub serves {WORKSPACE} "
                f"(and {HOME} as its alias): give a path under them or a relative one"
            )
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidRequestError(f"path {path!r} has '..'; give a path inside {WORKSPACE}")
    return "/".join(parts)


# One entry, as the kernel reports it: ``p`` its path, ``s`` its lstat.
_ENTRY = (
    "dict(path=p, name=os.path.basename(p), dir=stat.S_ISDIR(s.st_mode), "
    "link=stat.S_ISLNK(s.st_mode), size=s.st_size, mode=s.st_mode, mtime=s.st_mtime, "
    "uid=s.st_uid, gid=s.st_gid)"
)


def _in_kernel(body: str, root: str, depth: int) -> str:
    return (
        f"(lambda os, json, stat, root, depth: json.dumps({body}))"
        f"(__import__('os'), __import__('json'), __import__('stat'), {root!r}, {int(depth)})"
    )


def _root(relpath: str) -> str:
    return posixpath.join(WORKSPACE, relpath) if relpath else WORKSPACE


def list_expression(relpath: str, depth: int) -> str:
    """A Python expression that, evaluated in the kernel, lists ``/workspace/<relpath>`` to
    ``depth`` levels as JSON (None if it is not a directory). Symlinks are not followed."""
    return _in_kernel(
        "None if not os.path.isdir(root) or os.path.islink(root) else "
        f"[{_ENTRY} for d, dirs, files in os.walk(root) if d[len(root):].count('/') < depth "
        "for p in sorted(os.path.join(d, n) for n in dirs + files) for s in [os.lstat(p)]]",
        _root(relpath),
        depth,
    )


def stat_expression(relpath: str) -> str:
    """Like :func:`list_expression`, for the one entry at ``/workspace/<relpath>`` (a list
    of one, or None if nothing is there)."""
    return _in_kernel(
        f"None if not os.path.lexists(root) else [{_ENTRY} for p in [root] for s in [os.lstat(p)]]",
        _root(relpath),
        0,
    )


def metadata_filter(query: str | None) -> dict[str, str]:
    """The SDK's ``metadata`` list filter (``k=v&k2=v2``, each part URL-quoted)."""
    if not query:
        return {}
    return {unquote(k): unquote(v) for k, v in parse_qsl(query, keep_blank_values=True)}


def listing(answers: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The kernel's answer to :func:`list_expression` (``user_expressions``) as entries."""
    answer = answers.get("ls")
    if not isinstance(answer, dict) or answer.get("status") != "ok":
        detail = answer.get("evalue") if isinstance(answer, dict) else answer
        raise KernelError(f"listing the directory failed in the kernel: {detail}")
    text = answer.get("data", {}).get("text/plain")
    value = json.loads(ast.literal_eval(text)) if isinstance(text, str) else None
    if value is not None and not isinstance(value, list):
        raise KernelError("the kernel's directory listing is not a list")
    return value


def _permissions(mode: int) -> str:
    kind = "d" if mode & 0o040000 else "l" if mode & 0o120000 == 0o120000 else "-"
    bits = "".join(flag if mode & (1 << (8 - i)) else "-" for i, flag in enumerate("rwxrwxrwx"))
    return kind + bits


def entry_info(entry: dict[str, Any]) -> dict[str, Any]:
    """One listed entry as envd's ``filesystem.EntryInfo`` in proto3 JSON."""
    kind = "FILE_TYPE_DIRECTORY" if entry["dir"] else "FILE_TYPE_FILE"
    mode = int(entry["mode"])
    info: dict[str, Any] = {
        "name": entry["name"],
        "type": kind,
        "path": entry["path"],
        "size": str(int(entry["size"])),
        "mode": mode & 0o7777,
        "permissions": _permissions(mode),
        "owner": str(entry["uid"]),
        "group": str(entry["gid"]),
        "modifiedTime": _stamp(datetime.fromtimestamp(float(entry["mtime"]), UTC)),
    }
    if entry["link"]:
        info["isSymlink"] = True
    return info


def write_info(relpath: str) -> dict[str, Any]:
    """What envd's ``POST /files`` answers for one written file."""
    path = posixpath.join(WORKSPACE, relpath)
    return {"name": posixpath.basename(path), "type": "file", "path": path}


def sandbox_record(
    *,
    sandbox_id: str,
    template: str,
    started_at: datetime,
    end_at: datetime,
    limits: dict[str, Any],
    metadata: dict[str, str],
    token: str,
    state: str = "running",
) -> dict[str, Any]:
    """A session as the E2B API's sandbox (fields of ``NewSandbox``'s answer, ``ListedSandbox``
    and ``SandboxDetail`` at once: the SDK ignores what it does not read). The access
    tokens are the caller's own kernelhub token, so the SDK sends it on sandbox requests."""
    memory = limits.get("memory_bytes") or 0
    disk = limits.get("disk_bytes") or 0
    return {
        "templateID": template,
        "sandboxID": sandbox_id,
        "clientID": "kernelhub",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": token,
        "trafficAccessToken": token,
        "startedAt": _stamp(started_at),
        "endAt": _stamp(end_at),
        "cpuCount": max(1, round(float(limits.get("cpus") or 1))),
        "memoryMB": int(memory) // 2**20,
        "diskSizeMB": int(disk) // 2**20,
        "state": state,
        "metadata": metadata,
    }
