"""The ``kernelhub`` command. Argument parsing and printing only; the work is elsewhere."""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from kernelhub.config import Settings, load_settings
from kernelhub.errors import KernelhubError
from kernelhub.malloc import pin_mmap_threshold
from kernelhub.models import (
    DisplayEvent,
    ErrorEvent,
    Event,
    FinalEvent,
    NoticeEvent,
    ResultEvent,
    StreamEvent,
    TruncatedEvent,
)

DEMO_CELLS = [
    "import sys, platform\nprint('hello from', platform.node(), 'python', sys.version.split()[0])",
    "x = 21\nx * 2",
    "import numpy as np\nimport matplotlib.pyplot as plt\n"
    "t = np.linspace(0, 2 * np.pi, 200)\nplt.plot(t, np.sin(t))\nplt.title('sin')\nplt.show()",
    "import time\nfor i in range(3):\n    print('tick', i, flush=True)\n    time.sleep(0.3)",
    "print('x is still', x)\n1 / 0",
]


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["mcp"]:
        # The MCP server parses its own options (kernelhub[agents]).
        from kernelhub.agents.mcp_server import main as mcp_main

        mcp_main(args_list[1:])
        return 0
    parser = argparse.ArgumentParser(
        prog="kernelhub",
        description=__doc__,
        epilog="kernelhub mcp [--transport stdio|http] ...: the MCP server (see --help there)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="open a session, run a few cells, stream their output")
    demo.add_argument("--backend", choices=["auto", "docker", "local"])
    demo.add_argument("--out", type=Path, default=Path("."), help="where plots are saved")

    run = sub.add_parser("exec", help="run code on a gateway and stream its output")
    run.add_argument("code", help="the code, or - to read it from stdin")
    run.add_argument("--session", default=None, help="run in this session (default: a new one)")
    run.add_argument("--timeout", type=float, default=None)
    _gateway_args(run)

    sessions = sub.add_parser("sessions", help="your sessions on a gateway")
    sessions_sub = sessions.add_subparsers(dest="sessions_command", required=True)
    _gateway_args(sessions_sub.add_parser("ls", help="list sessions"))
    rm = sessions_sub.add_parser("rm", help="delete sessions")
    rm.add_argument("ids", nargs="+")
    rm.add_argument(
        "--purge", action="store_true", help="delete their events and executions now, too"
    )
    _gateway_args(rm)

    export = sub.add_parser("export", help="save a session's cells and outputs as a notebook")
    export.add_argument("session", help="the session id")
    export.add_argument("-o", "--output", type=Path, default=None, help="default: SESSION.ipynb")
    export.add_argument("--html", action="store_true", help="a self-contained HTML page instead")
    _gateway_args(export)

    image = sub.add_parser("image", help="the kernel image")
    image_sub = image.add_subparsers(dest="image_command", required=True)
    build = image_sub.add_parser("build", help="build the kernel image (offline-capable)")
    build.add_argument("--base", default="auto", help="auto | debootstrap | python-slim | IMAGE")
    build.add_argument("--tag", default=None, help="image name (default: the configured one)")
    build.add_argument("--mirror", default=None, help="Debian mirror for debootstrap")
    gateway = image_sub.add_parser(
        "build-gateway", help="build the gateway's own image, for compose.yaml (offline-capable)"
    )
    gateway.add_argument("--base", default="auto", help="auto | debootstrap | python-slim | IMAGE")
    gateway.add_argument("--tag", default=None, help="default: kernelhub/gateway:VERSION")
    gateway.add_argument("--mirror", default=None, help="Debian mirror for debootstrap")
    gateway.add_argument("--source", type=Path, default=None, help="kernelhub source checkout")

    sub.add_parser("reap", help="remove sandboxes and directories left by a crashed kernelhub")

    serve = sub.add_parser("serve", help="run the gateway (REST + WebSocket)")
    serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default 8765)")
    serve.add_argument("--backend", choices=["auto", "docker", "local"])

    token = sub.add_parser("token", help="bearer tokens (stored hashed)")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    create = token_sub.add_parser("create", help="make a token and print it once")
    create.add_argument("--name", required=True)
    create.add_argument("--admin", action="store_true")
    create.add_argument("--read-only", action="store_true", help="may view and export, never act")
    create.add_argument(
        "--session", help="the one session the token may see (it stands for its owner)"
    )
    create.add_argument("--expires", help="expire after this long: 90s, 15m, 2h, 7d")
    create.add_argument("--owner", help="the principal the token stands for (default: itself)")
    token_sub.add_parser("list", help="list tokens (names, never the secrets)")
    revoke = token_sub.add_parser("revoke", help="revoke a token by name")
    revoke.add_argument("name")

    args = parser.parse_args(argv)
    try:
        overrides = {"backend": args.backend} if getattr(args, "backend", None) else {}
        settings = load_settings(**overrides)
        if args.command == "demo":
            return asyncio.run(_demo(settings, args.out))
        if args.command == "exec":
            code = sys.stdin.read() if args.code == "-" else args.code
            return _exec(args, code)
        if args.command == "sessions":
            return _sessions(args)
        if args.command == "export":
            return _export(args)
        if args.command == "image" and args.image_command == "build-gateway":
            return _image_build_gateway(settings, args)
        if args.command == "image":
            return _image_build(settings, args.base, args.tag, args.mirror)
        if args.command == "reap":
            return asyncio.run(_reap(settings))
        if args.command == "serve":
            return _serve(settings, args.host, args.port)
        if args.command == "token":
            return asyncio.run(_token(settings, args))
    except KernelhubError as exc:
        print(f"kernelhub: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2


def _print_event(event: Event, out: Path | None = None) -> None:
    if isinstance(event, StreamEvent):
        stream = sys.stdout if event.name == "stdout" else sys.stderr
        stream.write(event.text)
        stream.flush()
    elif isinstance(event, ResultEvent):
        print(f"Out[{event.execution_count}]: {event.data.get('text/plain', '')}")
    elif isinstance(event, DisplayEvent):
        png = event.data.get("image/png")
        if png and out is not None:
            path = out / f"plot-{event.seq}.png"
            path.write_bytes(base64.b64decode(png))
            print(f"[image/png saved to {path}]")
        else:
            print(f"[display: {', '.join(event.data)}]")
    elif isinstance(event, ErrorEvent):
        print("\n".join(event.error.traceback) or f"{event.error.name}: {event.error.value}")
    elif isinstance(event, TruncatedEvent):
        print(
            f"[output truncated: {event.dropped_bytes} bytes over the {event.limit_bytes}-byte cap]"
        )
    elif isinstance(event, NoticeEvent):
        print(f"[kernelhub: {event.message}]")
    elif isinstance(event, FinalEvent):
        r = event.record
        extra = f" — {r.reason}" if r.reason else ""
        cpu = f", cpu {r.cpu_seconds:.2f} s" if r.cpu_seconds is not None else ""
        print(f"[{r.status.value} in {r.duration:.3f} s{cpu}{extra}]")


async def _open(settings: Settings):  # type: ignore[no-untyped-def]
    from kernelhub.execution.engine import KernelSession
    from kernelhub.sandbox.backends import make_backend
    from kernelhub.sandbox.base import SandboxSpec

    backend = make_backend(settings)
    spec = SandboxSpec(session_id=uuid.uuid4().hex[:12], limits=settings.limits)
    try:
        session = await KernelSession.start(backend, spec, engine=settings.engine)
    except BaseException:
        await backend.close()
        raise
    return backend, session


async def _demo(settings: Settings, out: Path) -> int:
    backend, session = await _open(settings)
    print(f"session {session.id} on the {backend.name} backend")
    try:
        for code in DEMO_CELLS:
            print(f"\n>>> {code.splitlines()[0]}{' …' if chr(10) in code else ''}")
            async for event in session.stream(code):
                _print_event(event, out)
    finally:
        await session.close()
        await backend.close()
    return 0


def _gateway_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=os.environ.get("KERNELHUB_URL", "http://127.0.0.1:8765"),
        help="gateway address (env KERNELHUB_URL)",
    )  # fmt: skip
    parser.add_argument(
        "--token", default=os.environ.get("KERNELHUB_TOKEN"),
        help="bearer token (env KERNELHUB_TOKEN; make one with `kernelhub token create`)",
    )  # fmt: skip


def _hub(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from kernelhub.client import Hub

    if not args.token:
        raise KernelhubError(
            "no token: pass --token or set KERNELHUB_TOKEN (`kernelhub token create --name me`)"
        )
    return Hub(args.url, args.token)


def _exec(args: argparse.Namespace, code: str) -> int:
    with _hub(args) as hub:
        session = hub.session(args.session) if args.session else hub.create_session()
        try:
            result = session.run(
                code,
                timeout=args.timeout,
                on_event=lambda e: None if isinstance(e, StreamEvent) else _print_event(e),
                on_stdout=lambda text: (sys.stdout.write(text), sys.stdout.flush()),
                on_stderr=lambda text: (sys.stderr.write(text), sys.stderr.flush()),
                on_input=lambda prompt: input(prompt),
            )
        finally:
            if not args.session:
                session.delete()
    return 0 if result.status.value == "completed" else 1


def _sessions(args: argparse.Namespace) -> int:
    with _hub(args) as hub:
        if args.sessions_command == "ls":
            for s in hub.list_sessions():
                print(
                    f"{s.id}\t{s.state.value}\t{s.backend}\t{s.created_at:%Y-%m-%d %H:%M:%S}\t{s.reason or ''}"
                )
        else:
            for sid in args.ids:
                hub.session(sid).delete(purge=args.purge)
                print(f"{'purged' if args.purge else 'deleted'} {sid}")
    return 0


def _export(args: argparse.Namespace) -> int:
    out = args.output or Path(f"{args.session}.{'html' if args.html else 'ipynb'}")
    with _hub(args) as hub:
        out.write_bytes(hub.session(args.session).notebook(html=args.html))
    print(f"wrote {out}")
    return 0


def _image_build(settings: Settings, base: str, tag: str | None, mirror: str | None) -> int:
    from kernelhub.image import DEBIAN_MIRROR
    from kernelhub.image.build import build_image

    info = build_image(
        settings,
        tag=tag,
        base=base,
        mirror=mirror or DEBIAN_MIRROR,
        progress=lambda line: print(line, flush=True),
    )
    print(f"built {info.name} ({info.size_bytes / 2**20:.0f} MiB, python {info.python_version})")
    return 0


def _image_build_gateway(settings: Settings, args: argparse.Namespace) -> int:
    from kernelhub.image import DEBIAN_MIRROR
    from kernelhub.image.gateway import build_gateway_image

    info = build_gateway_image(
        settings,
        tag=args.tag,
        base=args.base,
        mirror=args.mirror or DEBIAN_MIRROR,
        source=args.source,
        progress=lambda line: print(line, flush=True),
    )
    print(f"built {info.name} ({info.size_bytes / 2**20:.0f} MiB, python {info.python_version})")
    return 0


async def _reap(settings: Settings) -> int:
    from kernelhub.datadir import DataDirLock
    from kernelhub.sandbox.backends import make_backend

    # A running gateway's live sandboxes would look like orphans from here.
    lock = DataDirLock.acquire(settings.data_dir)
    try:
        backend = make_backend(
            settings, instance=settings.gateway.instance, gateway_id=lock.gateway_id
        )
        try:
            removed = await backend.reap_orphans()
        finally:
            await backend.close()
    finally:
        lock.release()
    print(f"removed {removed} orphaned sandbox(es)")
    return 0


def _serve(settings: Settings, host: str | None, port: int | None) -> int:
    import logging

    import uvicorn

    from kernelhub.datadir import DataDirLock
    from kernelhub.gateway.app import create_app
    from kernelhub.gateway.connections import fit_descriptor_limit, http_protocol
    from kernelhub.gateway.ws_protocol import websocket_protocol

    gateway = settings.gateway.model_copy(
        update={k: v for k, v in (("host", host), ("port", port)) if v is not None}
    )
    settings = settings.model_copy(update={"gateway": gateway})
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    pin_mmap_threshold()
    # Before anything touches the data directory: a second gateway on it stops here.
    lock = DataDirLock.acquire(settings.data_dir)
    first = asyncio.run(_bootstrap_token(settings))
    if first:
        print(f"no tokens existed; created admin token 'admin' (shown once): {first}", flush=True)
    print(
        f"kernelhub gateway on http://{gateway.host}:{gateway.port} (data in {settings.data_dir})",
        flush=True,
    )
    print(f"review page: http://{gateway.host}:{gateway.port}/ (sign in with a token)", flush=True)
    connections = fit_descriptor_limit(gateway.max_connections)
    uvicorn.run(
        create_app(settings, data_dir_lock=lock),
        host=gateway.host,
        port=gateway.port,
        log_level="warning",
        ws_max_size=4 * 2**20,
        ws_per_message_deflate=gateway.ws_compression,
        ws=websocket_protocol(gateway.stream_stall_timeout, gateway.stream_buffer_bytes),
        http=http_protocol(connections, gateway.header_timeout, gateway.body_timeout),
        limit_concurrency=connections,
    )
    return 0


async def _bootstrap_token(settings: Settings) -> str | None:
    from kernelhub.store.sqlite import SqliteStore

    store = await SqliteStore.open(settings.data_dir / "kernelhub.sqlite3")
    try:
        if await store.list_tokens():
            return None
        return await store.create_token("admin", admin=True)
    finally:
        await store.close()


async def _token(settings: Settings, args: argparse.Namespace) -> int:
    from kernelhub.store.sqlite import SqliteStore

    store = await SqliteStore.open(settings.data_dir / "kernelhub.sqlite3")
    try:
        if args.token_command == "create":
            from kernelhub.tokens import TokenCreate, mint, parse_duration

            spec = TokenCreate(
                name=args.name,
                admin=args.admin,
                read_only=args.read_only,
                session_id=args.session,
                expires_in=parse_duration(args.expires) if args.expires else None,
                owner=args.owner,
            )
            print((await mint(store, spec)).token)
        elif args.token_command == "list":
            for t in await store.list_tokens():
                state = f"revoked {t.revoked_at}" if t.revoked_at else "active"
                scope = ",".join(
                    part
                    for part in (
                        "read-only" if t.read_only else "",
                        f"session={t.session_id}" if t.session_id else "",
                        f"expires={t.expires_at}" if t.expires_at else "",
                        f"for={t.acts_for}" if t.acts_for else "",
                    )
                    if part
                )
                print(
                    f"{t.name}\t{'admin' if t.admin else 'user'}\t{state}\tcreated {t.created_at}"
                    + (f"\t{scope}" if scope else "")
                )
        elif args.token_command == "revoke":
            if not await store.revoke_token(args.name):
                print(f"kernelhub: no active token named {args.name!r}", file=sys.stderr)
                return 1
            print(f"revoked {args.name}")
    finally:
        await store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
