"""A real cluster on loopback, once per test run: a private PostgreSQL server (the shared
store), a cluster CA with certificates, 3 node agents (`kernelhub node`) on 127.0.0.2-4,
each with its own data dir, run dir, instance name and port, and 2 gateway replicas
(`kernelhub gateway`) on 127.0.0.1. The nodes use the Docker backend on the host's
daemon, each under its own instance label (their reapers never touch each other's
sandboxes); a private dockerd per node would need the kernel image loaded into each, which
costs more than the whole tier's budget here (README, "Many machines")."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kernelhub.cluster.certs import make_certs
from tests import objects, postgres
from tests.conftest import RUN_INSTANCE, UNIT
from tests.gateway.conftest import kill9, stop

NODE_HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
HEARTBEAT = 0.5  # seconds: placement sees new sessions within a beat


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def tls_context(certs: Path, name: str) -> ssl.SSLContext:
    """A client context with ``name``'s certificate that trusts ``certs``' CA."""
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    ctx.load_cert_chain(str(certs / f"{name}.pem"), str(certs / f"{name}.key"))
    return ctx


class Process:
    """One `kernelhub` process of the cluster, its log beside its data."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.args, self.env, self.log = args, env, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kernelhub.cli", *self.args],
                env=self.env, stdout=log, stderr=log,
            )  # fmt: skip

    def wait_ready(self, url: str, verify: ssl.SSLContext | bool = False) -> None:
        deadline = time.monotonic() + 150 * UNIT
        assert self.proc is not None
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.args} exited: {self.log.read_text()[-3000:]}"
            try:
                if httpx.get(url, timeout=2, verify=verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"{url} not ready: {self.log.read_text()[-3000:]}")

    def kill9(self) -> None:
        kill9(self.proc)

    def stop(self) -> None:
        stop(self.proc)


class Node(Process):
    def __init__(self, cluster: Cluster, index: int, host: str) -> None:
        self.id = f"n{index}"
        self.host = host
        self.port = free_port(host)
        self.address = f"https://{host}:{self.port}"
        self.instance = f"{RUN_INSTANCE}-n{index}"
        base = cluster.root / self.id
        run_base = Path("/run/kernelhub-test") if os.geteuid() == 0 else Path("/tmp/khrun")
        env = {
            **cluster.env,
            "KERNELHUB_DATA_DIR": str(base / "data"),
            "KERNELHUB_RUN_DIR": str(run_base / self.instance),
            "KERNELHUB_BACKEND": "docker",
            "KERNELHUB_POOL__SIZE": "0",
            "KERNELHUB_GATEWAY__HOST": host,
            "KERNELHUB_GATEWAY__PORT": str(self.port),
            "KERNELHUB_GATEWAY__INSTANCE": self.instance,
            "KERNELHUB_STORE__NODE": self.id,
            "KERNELHUB_CLUSTER__ADDRESS": self.address,
            "KERNELHUB_CLUSTER__CERT_FILE": str(cluster.certs / f"node-{self.id}.pem"),
            "KERNELHUB_CLUSTER__KEY_FILE": str(cluster.certs / f"node-{self.id}.key"),
        }
        base.mkdir(parents=True)
        cluster.share_snapshots(base / "data")
        super().__init__(["node", "--no-build"], env, base / "node.log")


class Replica(Process):
    def __init__(self, cluster: Cluster, name: str) -> None:
        self.name = name
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **cluster.env,
            "KERNELHUB_GATEWAY__PORT": str(self.port),
            "KERNELHUB_CLUSTER__CERT_FILE": str(cluster.certs / f"gateway-{name}.pem"),
            "KERNELHUB_CLUSTER__KEY_FILE": str(cluster.certs / f"gateway-{name}.key"),
        }
        super().__init__(["gateway"], env, cluster.root / f"gateway-{name}.log")

    def start_ready(self) -> Replica:
        self.start()
        self.wait_ready(f"{self.url}/readyz")
        return self


class Cluster:
    """``nodes`` node agents (at most 3: one per loopback address) and ``replicas``
    gateway replicas ("ga", "gb"), sharing ``store_url``."""

    def __init__(
        self,
        root: Path,
        store_url: str,
        *,
        nodes: int = 3,
        replicas: int = 2,
        objects: dict[str, str] | None = None,
        export_interval: float = 0,
    ) -> None:
        self.root = root
        # ``objects``: a bucket's KERNELHUB_OBJECTS__* variables (S3Server.env), so the nodes
        # share snapshots as a real cluster does, under one cluster-wide MAC key file.
        self.objects = objects
        self.store_url = store_url
        self.certs = root / "certs"
        self.env = {
            **{k: v for k, v in os.environ.items() if k != "PYTHONTRACEMALLOC"},
            "PYTHONUNBUFFERED": "1",  # the logs say how far a process got
            "KERNELHUB_STORE__URL": store_url,
            "KERNELHUB_CLUSTER__CA_FILE": str(self.certs / "ca.pem"),
            "KERNELHUB_CLUSTER__HEARTBEAT_INTERVAL": str(HEARTBEAT),
            "KERNELHUB_CLUSTER__LEASE_TTL": str(10 * UNIT),
            # After every cell: a node killed right after one still has its state exported.
            # (A benchmark passes the operator's default instead.)
            "KERNELHUB_CLUSTER__CHECKPOINT_EXPORT_INTERVAL": str(export_interval),
        }
        if objects is not None:
            key = root / "snapshot.key"
            key.write_bytes(os.urandom(32))
            key.chmod(0o600)
            self.env |= {**objects, "KERNELHUB_CLUSTER__SNAPSHOT_KEY_FILE": str(key)}
        make_certs(self.certs, ["n1", "n2", "n3"], ["ga", "gb", "gc", "bench"], list(NODE_HOSTS))
        self.nodes = [Node(self, i + 1, host) for i, host in enumerate(NODE_HOSTS[:nodes])]
        self.replicas = [Replica(self, name) for name in ("ga", "gb")[:replicas]]

    def share_snapshots(self, data_dir: Path) -> None:
        """Without a bucket (bench/cluster.py), every node's blob directory and snapshot MAC
        key are one: what one node exports, another restores."""
        data_dir.mkdir(parents=True)
        if self.objects is not None:
            return
        shared = self.root / "shared-snapshots"
        if not shared.exists():
            (shared / "snapshots").mkdir(parents=True, mode=0o700)
            (shared / "snapshot.key").write_bytes(os.urandom(32))
        (data_dir / "snapshots").symlink_to(shared / "snapshots", target_is_directory=True)
        (data_dir / "snapshot.key").symlink_to(shared / "snapshot.key")

    def gateway_tls(self) -> ssl.SSLContext:
        return tls_context(self.certs, "gateway-gc")

    def token(self, name: str, *, admin: bool = False) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "kernelhub.cli", "token", "create", "--name", name,
             *(["--admin"] if admin else [])],
            env={**self.env, "KERNELHUB_DATA_DIR": str(self.root / "cli")},
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        return out.stdout.strip()

    def start(self) -> None:
        for node in self.nodes:  # started together: their startups overlap
            node.start()
        tls = self.gateway_tls()
        for node in self.nodes:
            node.wait_ready(f"{node.address}/readyz", verify=tls)
        for replica in self.replicas:
            replica.start_ready()

    def stop(self) -> None:
        for p in [*self.replicas, *self.nodes]:
            p.stop()
        remove_sandboxes([n.instance for n in self.nodes])


def remove_sandboxes(instances: list[str]) -> None:
    import docker

    client = docker.from_env()
    for instance in instances:
        label = f"org.kernelhub.instance={instance}"
        for container in client.containers.list(all=True, filters={"label": label}):
            container.remove(force=True)
    client.close()


@pytest.fixture(scope="session")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_cluster: postgres.PostgresCluster,
    s3_server: objects.S3Server,
) -> Iterator[Cluster]:
    """The tier's one cluster: snapshots, exported checkpoints and hibernated sessions live
    in a bucket of the run's real S3-compatible server (rclone), under one cluster key."""
    bucket = s3_server.env(s3_server.fresh_bucket())
    c = Cluster(tmp_path_factory.mktemp("cluster"), postgres_cluster.fresh_url(), objects=bucket)
    try:
        c.start()
        c.alice = c.token("alice")  # type: ignore[attr-defined]
        yield c
    finally:
        c.stop()
