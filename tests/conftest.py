"""Shared test helpers: one scalable time unit, deadline polling, per-run labels."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from kernelhub.config import Settings, load_settings

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
