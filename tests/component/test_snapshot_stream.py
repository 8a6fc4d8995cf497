"""Snapshots streamed over a socket in the kernel's socket directory
(``kernelhub.snapshot.transfer`` on the host, ``kernelhub_kernel/snapshot/stream.py`` in
the kernel), between real kernels: nothing is staged in the sandbox, the host only
counts, hashes and stores, and the kernel loads nothing the host's verdict refused."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kernelhub.errors import InvalidRequestError, TooLargeError
from kernelhub.execution import ops
from kernelhub.execution.engine import KernelSession
from kernelhub.snapshot import calls, transfer
from tests.component.conftest import SessionFactory
from tests.conftest import UNIT

TIMEOUT = 60 * UNIT


async def capture(kernel: KernelSession, target: Path, max_bytes: int = 1 << 31) -> dict:
    name = f"snap-{os.urandom(6).hex()}"
    (size, sha256), result = await transfer.alongside(
        transfer.pull(kernel.sandbox.session_dir, name, target, max_bytes, TIMEOUT),
        ops.run(kernel, calls.capture_stream(name), timeout=TIMEOUT),
    )
    result["host"] = {"size": size, "sha256": sha256}
    return result


async def restore(kernel: KernelSession, source: Path, verdict: bool = True) -> dict:
    name = f"restore-{os.urandom(6).hex()}"
    _, result = await transfer.alongside(
        transfer.push(kernel.sandbox.session_dir, name, source, lambda sha: verdict, TIMEOUT),
        ops.run(kernel, calls.restore_stream(name), timeout=TIMEOUT),
    )
    return result


SETUP = (
    "import numpy as np, pandas as pd\n"
    "big = np.arange(3_000_000, dtype=np.float64)\n"
    "view_of_same = {'ref': big}\n"
    "df = pd.DataFrame({'a': range(1000), 's': [str(i) for i in range(1000)]})\n"
    "def f(x):\n    return x + 1\n"
    "open('kept.txt', 'w').write('on disk')\n"
)


async def test_a_streamed_snapshot_round_trips_and_stages_nothing(
    open_session: SessionFactory, tmp_path: Path
) -> None:
    a = await open_session()
    assert (await a.execute(SETUP)).error is None
    blob = tmp_path / "a.blob"
    captured = await capture(a, blob)
    assert {"big", "view_of_same", "df", "f"} <= set(captured["saved"])
    # One hash, the host's, over exactly the bytes it stored.
    assert captured["host"]["size"] == blob.stat().st_size > 24_000_000
    digest = captured["host"]["sha256"]
    expected = transfer.new_digest(transfer.algorithm_of(digest))
    expected.update(memoryview(blob.read_bytes()))
    assert digest == transfer.labelled(transfer.algorithm_of(digest), expected)
    assert all(g["sha256"] == "" for g in captured["groups"])
    # Nothing was written to the sandbox's snapshot directory (but the running cell's
    # spool, kernelhub_kernel.spool), and the socket is gone.
    left = await a.execute(
        "import os; d = os.environ.get('KERNELHUB_SNAPSHOTS', '/tmp/.kernelhub');"
        " print(sorted(set(os.listdir(d)) - {'iopub.spool'}) if os.path.isdir(d) else [])"
    )
    assert left.stdout.strip() == "[]", left.stdout
    assert not [n for n in os.listdir(a.sandbox.session_dir.ipc_dir) if n.startswith("snap-")]

    b = await open_session()
    restored = await restore(b, blob)
    assert restored["failed"] == {}, restored["failed"]
    check = await b.execute(
        "print(float(big.sum()), view_of_same['ref'] is big, df.s.iloc[-1], f(1),"
        " open('kept.txt').read())"
    )
    assert check.stdout == f"{float(sum(range(3_000_000)))} True 999 2 on disk\n", check.stdout


async def test_a_refused_verdict_loads_nothing(
    open_session: SessionFactory, tmp_path: Path
) -> None:
    a = await open_session()
    await a.execute("secret_value = 41 + 1")
    blob = tmp_path / "a.blob"
    await capture(a, blob)
    b = await open_session()
    with pytest.raises(InvalidRequestError, match="integrity"):
        await restore(b, blob, verdict=False)
    assert (await b.execute("print('secret_value' in globals())")).stdout.strip() == "False"
    # The kernel is fine, and the same blob loads once the verdict is yes.
    assert (await restore(b, blob))["failed"] == {}
    assert (await b.execute("print(secret_value)")).stdout.strip() == "42"


async def test_a_snapshot_over_the_cap_is_a_typed_error_and_leaves_no_blob(
    open_session: SessionFactory, tmp_path: Path
) -> None:
    a = await open_session()
    await a.execute("import numpy as np\nbig = np.ones(4_000_000)")
    blob = tmp_path / "a.blob"
    with pytest.raises(TooLargeError, match="KERNELHUB_GATEWAY__MAX_SNAPSHOT_BYTES"):
        await capture(a, blob, max_bytes=8 << 20)
    assert not blob.exists()
    assert (await a.execute("print(big.size)")).stdout.strip() == "4000000"
    assert (await capture(a, blob))["saved"] == ["big"]


async def test_a_blob_packed_from_a_directory_restores_over_the_stream(
    open_session: SessionFactory, tmp_path: Path
) -> None:
    """Blobs stored before streaming (a tar of the snapshot directory) still restore."""
    a = await open_session()
    await a.execute("import numpy as np\nkept = np.arange(5)\ndef g(x):\n    return x * 3")
    await ops.run(a, calls.capture("snap-old"), timeout=TIMEOUT)
    blob = tmp_path / "old.blob"
    blob.write_bytes(b"".join([c async for c in a.sandbox.pack_snapshot("snap-old", 1 << 30)]))
    b = await open_session()
    assert (await restore(b, blob))["failed"] == {}
    assert (await b.execute("print(g(int(kept.sum())))")).stdout.strip() == "30"


async def chunks_of(data: bytes) -> AsyncIterator[bytes]:
    yield data
