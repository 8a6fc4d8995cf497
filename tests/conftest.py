"""Shared test helpers: one scalable time unit, deadline polling, per-run labels."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kernelhub.config import Settings, load_settings
from tests import objects, postgres

# Every wait in the suite is a multiple of this; slow CI machines set KERNELHUB_TEST_UNIT=2.
UNIT = float(os.environ.get("KERNELHUB_TEST_UNIT", "1"))
# Every sandbox this run makes carries this instance label, so the finalizer finds them all.
RUN_INSTANCE = f"t{uuid.uuid4().hex[:8]}"


async def eventually(predicate: Callable[[], bool], timeout: float, interval: float = 0.01) -> None:
    """Poll ``predicate`` until true, failing after ``timeout`` × UNIT seconds."""
    deadline = time.monotonic() + timeout * UNIT
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout * UNIT:g} s")
        await asyncio.sleep(interval)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return load_settings(
        data_dir=tmp_path / "data",
        run_dir=Path("/tmp/khrun") if os.geteuid() else Path("/run/kernelhub-test"),
    )


def docker_problem(image: str) -> str | None:
    """Why the Docker tier cannot run here, or None if it can."""
    try:
        import docker

        client = docker.from_env(timeout=10)
        try:
            client.ping()
            labels = client.images.get(image).labels or {}
        finally:
            client.close()
    except Exception as exc:  # any failure means "not available"; the reason is reported
        return f"Docker or the kernel image {image} is unavailable: {exc}"
    from kernelhub import KERNEL_PROTOCOL_VERSION

    if labels.get("org.kernelhub.protocol") != KERNEL_PROTOCOL_VERSION:
        return f"kernel image {image} is for another protocol; run `kernelhub image build`"
    return None


_docker_checked: list[str | None] = []


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Docker tests skip on a laptop without Docker; with KERNELHUB_REQUIRE_DOCKER=1 (CI)
    they fail instead, so CI can never pass without running them. The same for the
    PostgreSQL tests and a PostgreSQL server."""
    if item.get_closest_marker("postgres") is not None:
        _require(postgres.problem())
    if item.get_closest_marker("s3") is not None:
        _require(objects.problem())
    if item.get_closest_marker("docker") is None:
        return
    if not _docker_checked:
        _docker_checked.append(docker_problem(load_settings().docker.image))
    _require(_docker_checked[0])


def _require(problem: str | None) -> None:
    if problem is None:
        return
    if os.environ.get("KERNELHUB_REQUIRE_DOCKER") == "1":
        pytest.fail(f"KERNELHUB_REQUIRE_DOCKER=1 but {problem}", pytrace=False)
    pytest.skip(problem)


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[postgres.PostgresCluster]:
    """The run's one PostgreSQL server (tests that use it carry the ``postgres`` marker)."""
    cluster = postgres.PostgresCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[objects.S3Server]:
    """The run's one S3-compatible server (tests that use it carry the ``s3`` marker)."""
    server = objects.S3Server()
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session", autouse=True)
def _remove_everything_this_run_made() -> object:
    """Session finalizer: every container and directory labelled with this run goes."""
    yield
    try:
        import docker

        client = docker.from_env(timeout=30)
        for c in client.containers.list(all=True, filters={"label": "org.kernelhub.instance"}):
            if c.labels.get("org.kernelhub.instance", "").startswith(RUN_INSTANCE):
                c.remove(force=True)
        client.close()
    except Exception:
        pass
    from kernelhub.kernel.connection import SessionDir
    from kernelhub.sandbox.hostdirs import remove_tree
    from kernelhub.sandbox.state import drop_state_dir

    for base in (Path("/tmp/khrun"), Path("/run/kernelhub-test")):
        for child in base.glob(f"{RUN_INSTANCE}*"):
            for state in child.glob("*.state"):  # tmpfs mounts when root: unmount first
                drop_state_dir(state)
            for session in child.iterdir():  # and the socket directories' tmpfs
                if session.is_dir() and not session.is_symlink():
                    SessionDir.remove_root(session)
            with contextlib.suppress(OSError):
                remove_tree(child)
