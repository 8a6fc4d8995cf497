"""The snapshot corpus through real sandboxes: each realistic agent session runs in one
container, is captured there, leaves as opaque bytes, and is restored in a brand-new
container; every check must hold there. Reports the share of variables restored."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import pytest

from kernelhub.config import EngineSettings, Limits, Settings
from kernelhub.execution import ops
from kernelhub.execution.engine import KernelSession
from kernelhub.sandbox.base import SandboxSpec
from kernelhub.sandbox.docker import DockerBackend
from kernelhub.snapshot import calls
from tests.component.snapshot_corpus import SESSIONS, Session
from tests.conftest import RUN_INSTANCE, UNIT

pytestmark = pytest.mark.docker

CHECK = """
import json as _json
_results = {}
for _name, _expr in %s.items():
    try:
        _results[_name] = "ok" if eval(_expr) else "false"
    except Exception as _exc:
        _results[_name] = f"{type(_exc).__name__}: {_exc}"
print(_json.dumps(_results))
"""


async def _start(backend: DockerBackend) -> KernelSession:
    spec = SandboxSpec(
        session_id=uuid.uuid4().hex[:12], owner="tests", limits=Limits(memory_bytes=1024 * 2**20)
    )
    return await KernelSession.start(backend, spec, engine=EngineSettings(start_timeout=60 * UNIT))


async def _roundtrip(backend: DockerBackend, session: Session) -> tuple[int, int, list[str]]:
    a = await _start(backend)
    b = await _start(backend)
    try:
        for cell in session.cells:
            result = await a.execute(cell, timeout=120 * UNIT)
            assert result.error is None, (session.name, cell, result.error)
        captured = await ops.run(a, calls.capture("snap", result=True), timeout=300 * UNIT)
        blob = b"".join([c async for c in a.sandbox.pack_snapshot("snap", 1 << 31)])

        async def chunks() -> AsyncIterator[bytes]:
            yield blob

        await b.sandbox.unpack_snapshot("snap", chunks(), 1 << 31)
        await ops.run(b, calls.restore("snap"), timeout=300 * UNIT)
        out = await b.execute(CHECK % json.dumps(session.checks), timeout=120 * UNIT)
        results = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        await a.close()
        await b.close()
    named = [n for n, reason in session.skipped.items() if reason in captured["skipped"].get(n, "")]
    losses = [
        f"{session.name}.{n}: expected skipped for {r!r}, got {captured['skipped'].get(n)!r}"
        for n, r in session.skipped.items()
        if n not in named
    ]
    losses += [f"{session.name}.{n}: {v}" for n, v in results.items() if v != "ok"]
    ok = sum(1 for v in results.values() if v == "ok") + len(named)
    return len(results) + len(session.skipped), ok, losses


@pytest.mark.timeout(1200)
async def test_corpus_restores_in_fresh_sandboxes(
    settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    backend = DockerBackend(
        image=settings.docker.image, run_dir=settings.run_dir, instance=RUN_INSTANCE
    )
    total = correct = 0
    problems: list[str] = []
    lines = []
    try:
        for session in SESSIONS:
            n, ok, losses = await _roundtrip(backend, session)
            total, correct = total + n, correct + ok
            problems += losses
            lines.append(f"  {session.name:22} {ok:3}/{n:<3}")
    finally:
        await backend.close()
    percent = 100.0 * correct / total
    with capsys.disabled():
        print("\nsnapshot corpus in Docker sandboxes:\n" + "\n".join(lines))
        print(f"  all {correct}/{total} = {percent:.1f}% restored correctly; problems: {problems}")
    assert percent >= 99.0, problems
