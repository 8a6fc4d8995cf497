"""The commands that talk to a gateway through the SDK: ``exec``, ``sessions ...``,
``export``. Each takes the parsed arguments and a :class:`~kernelhub.cli.output.Console`
and returns the exit status; errors propagate as :class:`KernelhubError` and the caller
prints them with :func:`~kernelhub.cli.output.describe_error`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelhub.cli.output import (
    TOKEN_HINT,
    Console,
    describe_error,
    session_detail,
    sessions_table,
    to_json,
)
from kernelhub.errors import KernelhubError, UsageError

if TYPE_CHECKING:
    from kernelhub.client import Hub


def _hub(args: argparse.Namespace) -> Hub:
    from kernelhub.client import Hub

    if not args.token:
        raise UsageError(f"no token: pass --token or set KERNELHUB_TOKEN ({TOKEN_HINT})")
    return Hub(args.url, args.token)


def run_exec(args: argparse.Namespace, console: Console) -> int:
    """``kernelhub exec``: run code in a new session (deleted after, unless ``--keep``) or
    in ``--session ID``, streaming its output."""
    if args.session and args.keep:
        raise UsageError("--keep is for the new session exec makes; --session ID is kept anyway")
    code = sys.stdin.read() if args.code == "-" else args.code
    with _hub(args) as hub:
        session = hub.session(args.session) if args.session else hub.create_session()
        if args.keep:
            console.say(f"session {session.id}", err=args.json)
        stream = not args.json
        try:
            result = session.run(
                code,
                timeout=args.timeout,
                on_event=(lambda e: None if _streamed(e) else console.event(e)) if stream else None,
                on_stdout=(lambda text: console.sandbox(text)) if stream else None,
                on_stderr=(lambda text: console.sandbox(text, err=True)) if stream else None,
                on_input=lambda prompt: input(console.clean(prompt)),
            )
        finally:
            if not args.session and not args.keep:
                session.delete()
    if args.json:
        console.say(to_json({"session_id": session.id, **result.model_dump(mode="json")}))
    return 0 if result.status.value == "completed" else 1


def _streamed(event: Any) -> bool:
    from kernelhub.models import StreamEvent

    return isinstance(event, StreamEvent)


def run_sessions(args: argparse.Namespace, console: Console) -> int:
    command = args.sessions_command
    if command == "export":
        return run_export(args, console)
    with _hub(args) as hub:
        if command == "new":
            session = hub.create_session(
                limits=_pairs(args.limit, "--limit"),
                metadata=_pairs(args.meta, "--meta"),
                from_snapshot=args.from_snapshot,
            )
            console.say(to_json(session.last_info) if args.json else session.id)
        elif command == "ls":
            sessions = hub.list_sessions()
            console.say(to_json(sessions) if args.json else console.clean(sessions_table(sessions)))
        elif command == "show":
            info = hub.session(args.id).last_info
            console.say(to_json(info) if args.json else console.clean(session_detail(info)))
        elif command == "rm":
            return _remove(hub, args, console)
    return 0


def _remove(hub: Hub, args: argparse.Namespace, console: Console) -> int:
    """Delete each id; one failing does not stop the others, and each failure is a line."""
    status = 0
    for sid in args.ids:
        try:
            hub.session(sid).delete(purge=args.purge)
        except KernelhubError as exc:
            console.say(f"kernelhub: {sid}: {describe_error(exc, args.url)}", err=True)
            status = 1
        else:
            console.say(f"{'purged' if args.purge else 'deleted'} {sid}")
    return status


def run_export(args: argparse.Namespace, console: Console) -> int:
    """``kernelhub sessions export ID`` (and its older spelling ``kernelhub export ID``)."""
    sid = args.session
    out: Path = args.output or Path(f"{sid}.{'html' if args.html else 'ipynb'}")
    with _hub(args) as hub:
        out.write_bytes(hub.session(sid).notebook(html=args.html))
    console.say(f"wrote {out}")
    return 0


def _pairs(items: list[str] | None, flag: str) -> dict[str, Any]:
    """``--limit memory_bytes=1073741824 --limit cell_timeout=60`` as a dict; numbers
    become numbers, the rest stays text."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag} {item!r}: expected NAME=VALUE, e.g. {flag} cell_timeout=60")
        out[key] = _number(value)
    return out


def _number(value: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value
