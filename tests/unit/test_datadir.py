"""One gateway per data directory: the lock, the pid it names, the identity it keeps."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernelhub.datadir import DataDirLock
from kernelhub.errors import DataDirLockedError


def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path: Path) -> None:
    first = DataDirLock.acquire(tmp_path / "data")
    try:
        with pytest.raises(DataDirLockedError, match=rf"pid {os.getpid()}\b.*KERNELHUB_DATA_DIR"):
            DataDirLock.acquire(tmp_path / "data")
    finally:
        first.release()
    again = DataDirLock.acquire(tmp_path / "data")
    assert again.gateway_id == first.gateway_id  # kept in the directory
    again.release()
    other = DataDirLock.acquire(tmp_path / "other")
    assert other.gateway_id != first.gateway_id
    other.release()


def test_a_dead_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from kernelhub.datadir import DataDirLock;"
            f"DataDirLock.acquire(Path({str(tmp_path)!r})); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(DataDirLockedError, match=f"pid {holder.pid}"):
            DataDirLock.acquire(tmp_path)
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    deadline = time.monotonic() + 5
    while True:
        try:
            DataDirLock.acquire(tmp_path).release()
            break
        except DataDirLockedError:
            assert time.monotonic() < deadline
            time.sleep(0.01)
