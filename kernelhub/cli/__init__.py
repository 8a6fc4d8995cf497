"""The ``kernelhub`` command: argument parsing and dispatch; the work is elsewhere.

__init__.py  the parser (every option has its help) and main()
output.py    pure formatting: tables, --json, one-line reasons, events, errors in CLI words
remote.py    exec, sessions new|ls|show|rm|export: a gateway, through the SDK
host.py      image build, reap, token, demo: this machine
serve.py     serve: backend choice, kernel image on first use, token after bind
cluster.py   node, gateway, cluster certs: many machines (issue #24)
progress.py  the quiet build display (stages, spinner, output folded into a log file)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kernelhub import __version__
from kernelhub.errors import KernelhubError, UsageError

if TYPE_CHECKING:
    from kernelhub.cli.output import Console
    from kernelhub.config import Settings

DEFAULT_URL = "http://127.0.0.1:8765"
#: Top-level modules of the ``server`` extra: without them the SDK-only install still has a
#: ``kernelhub`` command, and server commands say what to install.
SERVER_MODULES = frozenset(
    [
        "pydantic_settings",
        "jupyter_client",
        "ipykernel",
        "zmq",
        "docker",
        "dill",
        "psutil",
        "pyseccomp",
        "seccomp",
        "fastapi",
        "uvicorn",
        "prometheus_client",
        "nbformat",
    ]
)

DESCRIPTION = """\
Stateful, sandboxed IPython kernels for LLM agents: one locked-down container per session,
output streamed as it happens.

On the machine that runs the gateway:
  kernelhub serve                  start it (builds the kernel image on first use)
  kernelhub token create --name N  a token for a client

From anywhere (set KERNELHUB_URL and KERNELHUB_TOKEN, or pass --url and --token):
  kernelhub exec 'print(6 * 7)'    run code in a throwaway session
  kernelhub sessions new           a session that stays; then exec --session ID
"""

EPILOG = f"""\
environment:
  KERNELHUB_URL    gateway address for client commands (default {DEFAULT_URL})
  KERNELHUB_TOKEN  bearer token for client commands
  KERNELHUB_*      server settings, nested with __ (e.g. KERNELHUB_BACKEND=local,
                   KERNELHUB_LIMITS__CELL_TIMEOUT=60); see kernelhub/config.py

`kernelhub COMMAND --help` describes each command.
"""


def _client_options(parent: argparse.ArgumentParser, *, top: bool = False) -> None:
    """--url and --token: on every command that talks to a gateway, and before the command
    (``kernelhub --url URL sessions ls``); :func:`_resolve_client` merges them."""
    group = parent.add_argument_group("gateway")
    group.add_argument(
        "--url",
        dest="top_url" if top else "url",
        default=None,
        help=f"the gateway's address (default: $KERNELHUB_URL, else {DEFAULT_URL})",
    )
    group.add_argument(
        "--token",
        dest="top_token" if top else "token",
        default=None,
        help="bearer token (default: $KERNELHUB_TOKEN); make one with "
        "`kernelhub token create --name NAME` where the gateway runs",
    )


def _resolve_client(args: argparse.Namespace) -> None:
    """The command's own --url/--token, else the ones before it, else the environment."""
    if not hasattr(args, "url"):
        return
    args.url = args.url or args.top_url or os.environ.get("KERNELHUB_URL") or DEFAULT_URL
    args.token = args.token or args.top_token or os.environ.get("KERNELHUB_TOKEN")


def _flag(parent: argparse.ArgumentParser, *names: str, help: str) -> argparse.ArgumentParser:
    parent.add_argument(*names, action="store_true", help=help)
    return parent


def build_parser() -> argparse.ArgumentParser:
    client = argparse.ArgumentParser(add_help=False)
    _client_options(client)
    as_json = _flag(
        argparse.ArgumentParser(add_help=False), "--json", help="print JSON instead of text"
    )
    raw = _flag(
        argparse.ArgumentParser(add_help=False),
        "--raw",
        help="write sandbox output exactly as produced; by default a terminal gets its text "
        "and colours only (no cursor moves, screen clears, clipboard writes or links)",
    )
    verbose = _flag(
        argparse.ArgumentParser(add_help=False),
        "-v",
        "--verbose",
        help="show the tools' output (debootstrap, pip, docker build) instead of a status line; "
        "it always goes to the build log too",
    )
    backend = argparse.ArgumentParser(add_help=False)
    backend.add_argument(
        "--backend",
        choices=["auto", "docker", "local"],
        help="sandbox backend (default: $KERNELHUB_BACKEND, else auto: docker when a daemon "
        "answers, else local with bubblewrap)",
    )

    parser = argparse.ArgumentParser(
        prog="kernelhub",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kernelhub {__version__}")
    _client_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    listen = argparse.ArgumentParser(add_help=False)
    listen.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    listen.add_argument("--port", type=int, default=None, help="port (default 8765)")
    no_build = _flag(
        argparse.ArgumentParser(add_help=False),
        "--no-build",
        help="fail instead of building a missing kernel image",
    )
    sub.add_parser(
        "serve",
        parents=[backend, listen, no_build],
        help="run the gateway (REST + WebSocket) in the foreground",
        description="Run the gateway. Says which backend it uses and why, builds the kernel "
        "image when it is missing, and prints a first admin token once it is serving.",
    )

    run = sub.add_parser(
        "exec",
        parents=[client, raw, as_json],
        help="run code on a gateway and stream its output",
        description="Run code in a new session (deleted afterwards unless --keep) or in an "
        "existing one (--session ID). Exit status 0 when the cell completed, 1 otherwise.",
    )
    run.add_argument("code", help="the code, or - to read it from stdin")
    run.add_argument("--session", default=None, metavar="ID", help="run in this session")
    run.add_argument(
        "--keep",
        action="store_true",
        help="keep the new session and print its id (for --session ID, sessions show/rm/export)",
    )
    run.add_argument(
        "--timeout", type=float, default=None, help="seconds for this cell (default: the gateway's)"
    )

    _sessions_parser(sub, client, as_json)
    _export_parser(
        sub.add_parser(
            "export",
            parents=[client],
            help="the same as `sessions export`",
            description="Save a session's cells and outputs as a notebook (or HTML page).",
        )
    )

    image = sub.add_parser("image", help="build the kernel image (and the gateway's)")
    image_sub = image.add_subparsers(dest="image_command", required=True, metavar="COMMAND")
    build = image_sub.add_parser(
        "build",
        parents=[verbose],
        help="build the kernel image (serve does it on first use)",
        description="Build the kernel image: a Debian base (debootstrap, Debian packages from "
        "the mirror), wheels downloaded on the host with pip, then docker build with the "
        "network disabled.",
    )
    gateway = image_sub.add_parser(
        "build-gateway",
        parents=[verbose],
        help="build the gateway's own image, for compose.yaml",
        description="Build the gateway image that compose.yaml runs.",
    )
    for p in (build, gateway):
        p.add_argument(
            "--base",
            default="auto",
            help="auto (the local base, else debootstrap) | debootstrap (remake it) | "
            "python-slim (pulled from its registry) | IMAGE (a local image)",
        )
        p.add_argument("--mirror", default=None, help="Debian mirror for debootstrap")
    build.add_argument("--tag", default=None, help="image name (default: $KERNELHUB_DOCKER__IMAGE)")
    build.add_argument(
        "--profile",
        default="slim",
        choices=["slim", "data-science"],
        help="slim: numpy, pandas, matplotlib; data-science: adds scipy, scikit-learn, "
        "statsmodels, seaborn, polars, duckdb, pyarrow, openpyxl ... (docs/egress.md)",
    )
    build.add_argument(
        "--requirements",
        type=Path,
        default=None,
        metavar="FILE",
        help="your own lock (name==version lines) installed on top of the profile",
    )
    build.add_argument(
        "--wheelhouse",
        type=Path,
        default=None,
        metavar="FILE",
        help="a requirements file whose wheels (and dependencies) seed the image's "
        "wheelhouse: `pip install` in a cell installs them with no network",
    )
    gateway.add_argument(
        "--tag", default=None, help="image name (default: kernelhub/gateway:VERSION)"
    )
    gateway.add_argument(
        "--source",
        type=Path,
        default=None,
        help="kernelhub source checkout to build the wheel from",
    )

    token = sub.add_parser("token", help="bearer tokens, on the gateway's machine (stored hashed)")
    token_sub = token.add_subparsers(dest="token_command", required=True, metavar="COMMAND")
    create = token_sub.add_parser("create", help="make a token and print it (only this once)")
    create.add_argument("--name", required=True, help="a name to list and revoke it by")
    create.add_argument("--admin", action="store_true", help="may use the /v1/admin routes")
    create.add_argument("--read-only", action="store_true", help="may view and export, never act")
    create.add_argument(
        "--session", help="the one session the token may see (it stands for its owner)"
    )
    create.add_argument("--expires", help="expire after this long: 90s, 15m, 2h, 7d")
    create.add_argument("--owner", help="the principal the token stands for (default: itself)")
    token_sub.add_parser("list", parents=[as_json], help="list tokens (names, never the secrets)")
    revoke = token_sub.add_parser("revoke", help="revoke a token by name")
    revoke.add_argument("name", help="the token's name (see `token list`)")

    from kernelhub.cli import cluster

    cluster.add_parsers(sub, [backend, listen, no_build], [listen])
    sub.add_parser(
        "reap", help="remove sandboxes and directories left by a crashed kernelhub on this machine"
    )
    demo = sub.add_parser(
        "demo",
        parents=[backend, raw],
        help="no gateway: run a few cells in-process and stream their output",
    )
    demo.add_argument("--out", type=Path, default=Path("."), help="where plots are saved")
    sub.add_parser(
        "mcp",
        add_help=False,
        help="serve kernelhub's tools over MCP (extra kernelhub[agents]; `kernelhub mcp --help`)",
    )
    return parser


def _sessions_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    client: argparse.ArgumentParser,
    as_json: argparse.ArgumentParser,
) -> None:
    sessions = sub.add_parser("sessions", help="your sessions on a gateway")
    ss = sessions.add_subparsers(dest="sessions_command", required=True, metavar="COMMAND")
    new = ss.add_parser("new", parents=[client, as_json], help="start a session and print its id")
    new.add_argument(
        "--limit",
        action="append",
        metavar="NAME=VALUE",
        help="a limit, capped by the gateway's maximum; repeatable: memory_bytes, cpus, pids, "
        "disk_bytes, cell_timeout, output_bytes",
    )
    new.add_argument(
        "--meta", action="append", metavar="KEY=VALUE", help="metadata to tag it with; repeatable"
    )
    new.add_argument(
        "--from-snapshot", default=None, metavar="ID", help="start from this snapshot of yours"
    )
    ss.add_parser(
        "ls", parents=[client, as_json], help="list your sessions (reasons cut to one line)"
    )
    show = ss.add_parser(
        "show", parents=[client, as_json], help="one session in full, its whole reason included"
    )
    show.add_argument("id", help="the session id")
    rm = ss.add_parser("rm", parents=[client], help="delete sessions (ended ones too)")
    rm.add_argument("ids", nargs="+", metavar="ID", help="session ids")
    rm.add_argument(
        "--purge", action="store_true", help="delete their events and executions now, too"
    )
    _export_parser(
        ss.add_parser(
            "export",
            parents=[client],
            help="save a session's cells and outputs as a notebook (or HTML)",
        )
    )


def _export_parser(export: argparse.ArgumentParser) -> None:
    export.add_argument("session", metavar="ID", help="the session id")
    export.add_argument(
        "-o", "--output", type=Path, default=None, help="the file (default: ID.ipynb or ID.html)"
    )
    export.add_argument(
        "--html", action="store_true", help="a self-contained HTML page instead of .ipynb"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["mcp"]:
        # The MCP server parses its own options (extra kernelhub[agents]).
        from kernelhub.agents.mcp_server import main as mcp_main

        mcp_main(args_list[1:])
        return 0
    args = build_parser().parse_args(args_list)
    _resolve_client(args)
    from kernelhub.cli.output import Console, describe_error

    console = Console(raw=getattr(args, "raw", False))
    try:
        return _dispatch(args, console)
    except KernelhubError as exc:
        message = describe_error(exc, args.url) if hasattr(args, "url") else str(exc)
        console.say(f"kernelhub: {message}", err=True)
        return 2 if isinstance(exc, UsageError) else 1
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] not in SERVER_MODULES:
            raise
        console.say(
            f"kernelhub: `kernelhub {args.command}` needs the server extra ({exc.name} is "
            "missing); install it with `pip install 'kernelhub[server]'`",
            err=True,
        )
        return 1
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace, console: Console) -> int:
    from kernelhub.cli import host, remote
    from kernelhub.config import load_settings

    command = args.command
    if command == "exec":
        return remote.run_exec(args, console)
    if command == "sessions":
        return remote.run_sessions(args, console)
    if command == "export":
        return remote.run_export(args, console)
    overrides = {"backend": args.backend} if getattr(args, "backend", None) else {}
    settings = load_settings(**overrides)
    if command == "serve":
        return _serve(settings, args)
    if command in ("node", "gateway", "cluster"):
        from kernelhub.cli import cluster

        return cluster.run(settings, args, console)
    if command == "image" and args.image_command == "build-gateway":
        return host.image_build_gateway(settings, args)
    if command == "image":
        return host.image_build(settings, args)
    if command == "token":
        return asyncio.run(host.token(settings, args, console))
    if command == "reap":
        return asyncio.run(host.reap(settings))
    if command == "demo":
        return asyncio.run(host.demo(settings, args.out, console))
    return 2


def _serve(settings: Settings, args: argparse.Namespace) -> int:
    import logging

    from kernelhub.cli.serve import serve
    from kernelhub.malloc import pin_mmap_threshold

    gateway = settings.gateway.model_copy(
        update={k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    )
    settings = settings.model_copy(update={"gateway": gateway})
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    pin_mmap_threshold()
    return serve(settings, build=not args.no_build)
