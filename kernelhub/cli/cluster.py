"""node, gateway, cluster certs: the many-machine commands (issue #24); the work is in
kernelhub/cluster."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from kernelhub.errors import UsageError

if TYPE_CHECKING:
    from kernelhub.cli.output import Console
    from kernelhub.config import Settings


def add_parsers(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    node_options: list[argparse.ArgumentParser],
    gateway_options: list[argparse.ArgumentParser],
) -> None:
    """``node`` takes ``serve``'s options (``node_options``: backend, --host/--port,
    --no-build); ``gateway`` only where to listen."""
    node = sub.add_parser(
        "node",
        parents=node_options,
        help="run a node agent: this machine's sandboxes, served to the cluster's gateways "
        "over mutual TLS",
        description="Run a node agent (issue #24): the gateway app for this machine's "
        "sandboxes, reachable only by clients with a certificate from the cluster CA. Needs "
        "KERNELHUB_STORE__URL, KERNELHUB_STORE__NODE, KERNELHUB_CLUSTER__ADDRESS and "
        "KERNELHUB_CLUSTER__{CA,CERT,KEY}_FILE (docs/scale-out.md).",
    )
    sub.add_parser(
        "gateway",
        parents=gateway_options,
        help="run a stateless gateway replica that places and routes to the node agents",
        description="Run a gateway replica: the kernelhub API for clients, each request "
        "forwarded to the node agent that owns its session (new sessions: the least loaded "
        "node). Needs KERNELHUB_STORE__URL and KERNELHUB_CLUSTER__{CA,CERT,KEY}_FILE.",
    )
    # With no command, `node` runs the agent; its commands act on the shared store.
    node_sub = node.add_subparsers(dest="node_command", required=False, metavar="COMMAND")
    node_sub.add_parser("ls", help="list nodes with their heartbeat numbers").add_argument(
        "--json", action="store_true", help="print JSON instead of a table"
    )
    for verb, text in (("drain", "move its sessions away (hibernate, wake elsewhere)"),
                       ("undrain", "let it take sessions again")):  # fmt: skip
        node_sub.add_parser(verb, help=text).add_argument("id", help="the node's id")
    cluster = sub.add_parser("cluster", help="cluster set-up: certificates")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True, metavar="COMMAND")
    certs = cluster_sub.add_parser(
        "certs",
        help="make a cluster CA and certificates for node agents and gateway replicas",
        description="Write ca.pem/ca.key (kept if DIR has them), node-ID.pem/.key per node "
        "(server and client auth, SANs: --hosts, its id, localhost) and gateway-ID.pem/.key "
        "per replica (client auth). Private keys are 0600.",
    )
    certs.add_argument("--out", required=True, metavar="DIR", help="where to write them")
    certs.add_argument("--nodes", default="", metavar="N1,N2", help="node ids")
    certs.add_argument("--gateways", default="", metavar="G1,G2", help="gateway replica names")
    certs.add_argument(
        "--hosts",
        default="",
        metavar="H1,H2",
        help="IP addresses and DNS names the nodes are dialled at (every node cert gets all)",
    )


def _listen(settings: Settings, args: argparse.Namespace) -> Settings:
    gateway = settings.gateway.model_copy(
        update={k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    )
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return settings.model_copy(update={"gateway": gateway})


def run(settings: Settings, args: argparse.Namespace, console: Console) -> int:
    if args.command == "node" and args.node_command is not None:
        import asyncio

        from kernelhub.cli.host import nodes

        return asyncio.run(nodes(settings, args, console))
    if args.command == "node":
        from kernelhub.cluster.node import serve_node
        from kernelhub.malloc import pin_mmap_threshold

        pin_mmap_threshold()
        return serve_node(_listen(settings, args), build=not args.no_build)
    if args.command == "gateway":
        from kernelhub.cluster.proxy import serve_replica

        return serve_replica(_listen(settings, args))
    return certs(args, console)


def _names(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def certs(args: argparse.Namespace, console: Console) -> int:
    from pathlib import Path

    from kernelhub.cluster.certs import make_certs

    nodes, gateways = _names(args.nodes), _names(args.gateways)
    if not nodes and not gateways and (Path(args.out) / "ca.key").exists():
        raise UsageError("nothing to make: the CA exists; name --nodes and/or --gateways")
    written = make_certs(Path(args.out), nodes, gateways, _names(args.hosts))
    for stem, issued in written.items():
        console.say(f"{stem}: {issued.cert} {issued.key}")
    return 0
