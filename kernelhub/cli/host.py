"""The commands that act on this machine, without a gateway: ``image build``,
``image build-gateway``, ``reap``, ``token ...`` and ``demo``."""

from __future__ import annotations

import argparse
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernelhub.cli.output import Console, nodes_table, to_json, tokens_table
from kernelhub.cli.progress import BuildDisplay
from kernelhub.config import Settings
from kernelhub.store.records import AuditEntry

if TYPE_CHECKING:
    import docker

    from kernelhub.image.build import ImageInfo

DEMO_CELLS = [
    "import sys, platform\nprint('hello from', platform.node(), 'python', sys.version.split()[0])",
    "x = 21\nx * 2",
    "import numpy as np\nimport matplotlib.pyplot as plt\n"
    "t = np.linspace(0, 2 * np.pi, 200)\nplt.plot(t, np.sin(t))\nplt.title('sin')\nplt.show()",
    "import time\nfor i in range(3):\n    print('tick', i, flush=True)\n    time.sleep(0.3)",
    "print('x is still', x)\n1 / 0",
]


def build_log_path(settings: Settings, what: str) -> Path:
    return settings.data_dir / "logs" / f"{what}-{time.strftime('%Y%m%d-%H%M%S')}.log"


def build_kernel_image(
    settings: Settings,
    *,
    client: docker.DockerClient | None = None,
    tag: str | None = None,
    base: str = "auto",
    mirror: str | None = None,
    verbose: bool = False,
    profile: str = "slim",
    requirements: Path | None = None,
    wheelhouse: Path | None = None,
) -> ImageInfo:
    """``kernelhub image build`` and ``serve``'s first start: the build behind a
    :class:`BuildDisplay`; the tools' output goes to a log file named on failure."""
    from kernelhub.image import DEBIAN_MIRROR
    from kernelhub.image.build import build_image

    with BuildDisplay(build_log_path(settings, "image-build"), verbose=verbose) as show:
        info = build_image(
            settings,
            tag=tag,
            base=base,
            mirror=mirror or DEBIAN_MIRROR,
            progress=show,
            client=client,
            profile=profile,
            requirements=requirements,
            wheelhouse=wheelhouse,
        )
    _say_built(info, show)
    return info


def _say_built(info: Any, display: BuildDisplay) -> None:
    print(
        f"built {info.name} ({info.size_bytes / 2**20:.0f} MiB, python {info.python_version}) "
        f"in {display.elapsed:.0f} s; build log: {display.log_path}",
        flush=True,
    )


def image_build(settings: Settings, args: argparse.Namespace) -> int:
    build_kernel_image(
        settings,
        tag=args.tag,
        base=args.base,
        mirror=args.mirror,
        verbose=args.verbose,
        profile=args.profile,
        requirements=args.requirements,
        wheelhouse=args.wheelhouse,
    )
    return 0


def image_build_gateway(settings: Settings, args: argparse.Namespace) -> int:
    from kernelhub.image import DEBIAN_MIRROR
    from kernelhub.image.gateway import build_gateway_image

    display = BuildDisplay(build_log_path(settings, "gateway-build"), verbose=args.verbose)
    with display as show:
        info = build_gateway_image(
            settings,
            tag=args.tag,
            base=args.base,
            mirror=args.mirror or DEBIAN_MIRROR,
            source=args.source,
            progress=show,
        )
    _say_built(info, display)
    return 0


async def reap(settings: Settings) -> int:
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


async def nodes(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    """``kernelhub node ls|drain|undrain``: on the store every node agent shares."""
    from datetime import UTC, datetime

    from kernelhub.store import open_store

    store = await open_store(settings)
    try:
        if args.node_command == "ls":
            found = await store.list_nodes()
            console.say(to_json(found) if args.json else nodes_table(found, datetime.now(UTC)))
            return 0
        draining = args.node_command == "drain"
        if not await store.set_draining(args.id, draining):
            console.say(f"kernelhub: no node {args.id!r}; `kernelhub node ls` lists them", err=True)
            return 1
        await store.audit(
            AuditEntry(principal=None, action=f"admin.{args.node_command}", client="cli",
                       detail={"node": args.id})
        )  # fmt: skip
        console.say(f"{args.id}: {'draining' if draining else 'takes sessions'}")
        return 0
    finally:
        await store.close()


async def token(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    from kernelhub.store import open_store

    store = await open_store(settings)
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
            console.say((await mint(store, spec)).token)
        elif args.token_command == "list":
            tokens = await store.list_tokens()
            console.say(to_json(tokens) if args.json else tokens_table(tokens))
        elif args.token_command == "revoke":
            if not await store.revoke_token(args.name):
                console.say(
                    f"kernelhub: no active token named {args.name!r}; "
                    "`kernelhub token list` shows them",
                    err=True,
                )
                return 1
            console.say(f"revoked {args.name}")
    finally:
        await store.close()
    return 0


async def _open(settings: Settings) -> tuple[Any, Any]:
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


async def demo(settings: Settings, out: Path, console: Console) -> int:
    """No gateway: the engine in-process, a few cells, a plot saved under ``out``."""
    backend, session = await _open(settings)
    console.say(f"session {session.id} on the {backend.name} backend")
    try:
        for code in DEMO_CELLS:
            console.say(f"\n>>> {code.splitlines()[0]}{' …' if chr(10) in code else ''}")
            async for event in session.stream(code):
                console.event(event, out)
    finally:
        await session.close()
        await backend.close()
    return 0
