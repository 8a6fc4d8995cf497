"""The ``kernelhub`` command. Argument parsing and printing only; the work is elsewhere."""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from kernelhub.config import Settings, load_settings
from kernelhub.errors import KernelhubError
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
    parser = argparse.ArgumentParser(prog="kernelhub", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="open a session, run a few cells, stream their output")
    demo.add_argument("--backend", choices=["auto", "docker", "local"])
    demo.add_argument("--out", type=Path, default=Path("."), help="where plots are saved")

    run = sub.add_parser("exec", help="run code in a fresh session and stream its output")
    run.add_argument("code", help="the code, or - to read it from stdin")
    run.add_argument("--backend", choices=["auto", "docker", "local"])
    run.add_argument("--timeout", type=float, default=None)

    image = sub.add_parser("image", help="the kernel image")
    image_sub = image.add_subparsers(dest="image_command", required=True)
    build = image_sub.add_parser("build", help="build the kernel image (offline-capable)")
    build.add_argument("--base", default="auto", help="auto | debootstrap | python-slim | IMAGE")
    build.add_argument("--tag", default=None, help="image name (default: the configured one)")
    build.add_argument("--mirror", default=None, help="Debian mirror for debootstrap")

    sub.add_parser("reap", help="remove sandboxes and directories left by a crashed kernelhub")

    args = parser.parse_args(argv)
    try:
        overrides = {"backend": args.backend} if getattr(args, "backend", None) else {}
        settings = load_settings(**overrides)
        if args.command == "demo":
            return asyncio.run(_demo(settings, args.out))
        if args.command == "exec":
            code = sys.stdin.read() if args.code == "-" else args.code
            return asyncio.run(_exec(settings, code, args.timeout))
        if args.command == "image":
            return _image_build(settings, args.base, args.tag, args.mirror)
        if args.command == "reap":
            return asyncio.run(_reap(settings))
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


async def _exec(settings: Settings, code: str, timeout: float | None) -> int:
    backend, session = await _open(settings)
    status = 1
    try:
        async for event in session.stream(code, timeout=timeout):
            _print_event(event)
            if isinstance(event, FinalEvent):
                status = 0 if event.record.status.value == "completed" else 1
    finally:
        await session.close()
        await backend.close()
    return status


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


async def _reap(settings: Settings) -> int:
    from kernelhub.sandbox.backends import make_backend

    backend = make_backend(settings)
    try:
        removed = await backend.reap_orphans()
    finally:
        await backend.close()
    print(f"removed {removed} orphaned sandbox(es)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
