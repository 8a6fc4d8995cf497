"""The local backend's refusal without bubblewrap, and its loud unisolated mode (real
kernels; bubblewrap is simply not handed to the backend)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from kernelhub.errors import BackendUnavailableError
from kernelhub.execution.engine import KernelSession
from kernelhub.sandbox.base import SandboxSpec
from kernelhub.sandbox.local import LocalBackend, UnisolatedWarning
from tests.conftest import RUN_INSTANCE


def test_without_bubblewrap_it_refuses_and_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(BackendUnavailableError, match="apt-get install -y bubblewrap"):
        LocalBackend(run_dir=tmp_path, bwrap=None)


async def test_unisolated_mode_runs_but_warns_at_every_start(settings: object) -> None:
    backend = LocalBackend(
        run_dir=Path("/tmp/khrun"), instance=f"{RUN_INSTANCE}u", unisolated=True, bwrap=None
    )
    try:
        for _ in range(2):
            with pytest.warns(UnisolatedWarning, match="unisolated"):
                session = await KernelSession.start(
                    backend, SandboxSpec(session_id=uuid.uuid4().hex[:12])
                )
            try:
                assert (await session.execute("1 + 1")).text == "2"
            finally:
                await session.close()
    finally:
        await backend.close()
