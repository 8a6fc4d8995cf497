"""kernelhub's own operations in a real sandbox go as ``kernelhub_call_request``, never
through IPython's ``run_cell``; and an image that does not advertise it still gets them as
a silent execute (the same image with ``KERNELHUB_KERNEL_CALLS=0``).

What proves which way a call went: an IPython ``pre_execute`` hook counts every execute
the kernel runs, silent ones included; a call that is not an execute leaves it alone.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import AsyncIterator, Iterator

import docker
import pytest

from kernelhub.config import EngineSettings, Limits, Settings
from kernelhub.errors import KernelError
from kernelhub.execution import ops
from kernelhub.execution.engine import KernelSession
from kernelhub.sandbox.base import SandboxSpec
from kernelhub.sandbox.docker import DockerBackend
from kernelhub.snapshot import calls
from tests.conftest import RUN_INSTANCE, UNIT

pytestmark = pytest.mark.docker

# On builtins: a restore rebinds the user namespace, the hook must outlive it.
COUNT_EXECUTES = (
    "import builtins\nbuiltins._executes = []\n"
    "get_ipython().events.register('pre_execute', lambda: builtins._executes.append(1))"
)
EXECUTES = "print(len(__import__('builtins')._executes))"  # counts itself too


@pytest.fixture(scope="module")
def image_without_calls() -> Iterator[str]:
    """The configured kernel image with ``KERNELHUB_KERNEL_CALLS=0``: the same code, as an
    image from before ``kernelhub_call_request`` (nothing but the switch is different)."""
    from kernelhub.config import load_settings

    base = load_settings().docker.image
    tag = f"kernelhub/kernel:test-nocalls-{uuid.uuid4().hex[:8]}"
    client = docker.from_env()
    dockerfile = f"FROM {base}\nENV KERNELHUB_KERNEL_CALLS=0\n".encode()
    client.images.build(fileobj=io.BytesIO(dockerfile), tag=tag, pull=False, rm=True)
    try:
        yield tag
    finally:
        client.images.remove(tag, force=True)
        client.close()


async def _backend(image: str, settings: Settings) -> DockerBackend:
    return DockerBackend(image=image, run_dir=settings.run_dir, instance=RUN_INSTANCE)


@pytest.fixture
async def kernels() -> AsyncIterator[list[KernelSession]]:
    """Kernels a test started, closed before its backend (``_closed``)."""
    made: list[KernelSession] = []
    yield made
    await _close(made)


async def _close(made: list[KernelSession]) -> None:
    while made:
        await made.pop().close()


async def _start(backend: DockerBackend, made: list[KernelSession]) -> KernelSession:
    spec = SandboxSpec(session_id=uuid.uuid4().hex[:12], owner="tests", limits=Limits())
    kernel = await KernelSession.start(
        backend, spec, engine=EngineSettings(start_timeout=60 * UNIT)
    )
    made.append(kernel)
    return kernel


async def _cell(kernel: KernelSession, code: str) -> tuple[str, int | None]:
    result = await kernel.execute(code, timeout=60 * UNIT)
    assert result.error is None, result.error
    return result.stdout, result.record.execution_count


async def _roundtrip(a: KernelSession, b: KernelSession) -> tuple[dict, dict]:
    """x in ``a``, captured with its result, moved, restored in ``b``; checkpoint-style
    captures and removals in between."""
    await _cell(a, "x = list(range(1000))")
    captured = await ops.run(a, calls.capture("snap", result=True), timeout=60 * UNIT)
    assert await ops.run(a, calls.capture("ckpt-1"), timeout=60 * UNIT) == {}
    assert await ops.run(a, calls.remove("ckpt-1"), timeout=60 * UNIT) == {}
    blob = b"".join([c async for c in a.sandbox.pack_snapshot("snap", 1 << 30)])

    async def chunks() -> AsyncIterator[bytes]:
        yield blob

    await b.sandbox.unpack_snapshot("snap", chunks(), 1 << 30)
    restored = await ops.run(b, calls.restore("snap"), timeout=60 * UNIT)
    return captured, restored


async def test_capture_restore_and_remove_never_run_an_execute(
    settings: Settings, kernels: list[KernelSession]
) -> None:
    backend = await _backend(settings.docker.image, settings)
    try:
        a, b = await _start(backend, kernels), await _start(backend, kernels)
        assert a.kernel_info.get(ops.INFO_KEY) == 1, a.kernel_info
        await _cell(a, COUNT_EXECUTES)
        await _cell(b, COUNT_EXECUTES)
        _, count_before = await _cell(a, "pass")
        captured, restored = await _roundtrip(a, b)
        assert captured["skipped"] == {} and captured["files"], captured
        assert restored["failed"] == {}, restored
        # Only the counting cells themselves ran an execute, in each kernel.
        out, count_after = await _cell(a, EXECUTES)
        assert out == "3\n"  # "pass", "x = ...", this one
        assert count_after == (count_before or 0) + 2  # the calls took no execution count
        out, _ = await _cell(b, EXECUTES + "\nprint(x[-1])")
        assert out == "1\n999\n", out
    finally:
        await _close(kernels)
        await backend.close()


async def test_a_stalled_capture_is_interrupted_and_the_kernel_keeps_its_state(
    settings: Settings, kernels: list[KernelSession]
) -> None:
    backend = await _backend(settings.docker.image, settings)
    try:
        a = await _start(backend, kernels)
        await _cell(
            a,
            "import time\nclass Stall:\n    def __reduce__(self):\n        time.sleep(3600)\n"
            "        return (Stall, ())\nstall = Stall()\ny = 41",
        )
        with pytest.raises(KernelError, match="timed_out"):
            await ops.run(a, calls.capture("stalled"), timeout=2 * UNIT)
        out, _ = await _cell(a, "del stall\nprint(y + 1)")  # the same kernel: not restarted
        assert out == "42\n"
        assert await ops.run(a, calls.remove("stalled"), timeout=60 * UNIT) == {}
        again = await ops.run(a, calls.capture("after", result=True), timeout=60 * UNIT)
        assert "y" in str(again), again
    finally:
        await _close(kernels)
        await backend.close()


async def test_an_operation_that_fails_is_a_kernel_error_with_the_kernels_traceback(
    settings: Settings, kernels: list[KernelSession]
) -> None:
    backend = await _backend(settings.docker.image, settings)
    try:
        a = await _start(backend, kernels)
        with pytest.raises(KernelError) as failed:
            await ops.run(a, calls.restore("no-such-snapshot"), timeout=60 * UNIT)
        text = str(failed.value)
        assert "FileNotFoundError" in text and "manifest" in text, text
        assert "\x1b[" not in text  # plain text, not IPython's colours
        out, _ = await _cell(a, "print('still here')")
        assert out == "still here\n"
    finally:
        await _close(kernels)
        await backend.close()


async def test_an_image_that_does_not_advertise_calls_gets_them_as_executes(
    settings: Settings, kernels: list[KernelSession], image_without_calls: str
) -> None:
    backend = await _backend(image_without_calls, settings)
    try:
        a, b = await _start(backend, kernels), await _start(backend, kernels)
        assert ops.INFO_KEY not in a.kernel_info, a.kernel_info
        await _cell(a, COUNT_EXECUTES)
        await _cell(b, COUNT_EXECUTES)
        await _cell(a, "pass")
        _, restored = await _roundtrip(a, b)
        assert restored["failed"] == {}, restored
        out, _ = await _cell(a, EXECUTES)
        assert out == "6\n"  # "pass", "x = ...", 3 silent executes (captures, remove), this
        out, _ = await _cell(b, EXECUTES + "\nprint(x[-1])")
        assert out == "2\n999\n", out  # the restore's execute, this one
    finally:
        await _close(kernels)
        await backend.close()
