"""The capture stream through a pipe the host passes to the kernel (SCM_RIGHTS), end to
end through a real gateway: the pipe path, the socket fallback when the kernel does not
take the pipe (as an old image would not), and a stream that breaks off is a typed error
that leaves no blob and a usable session."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.gateway import test_gateway
from tests.gateway.conftest import Gateway
from tests.gateway.test_gateway import auth, new_session, run, stdout

pytestmark = pytest.mark.docker
http = test_gateway.http

MAKE = (
    "import numpy as np, hashlib\n"
    "rng = np.random.default_rng(3)\n"
    "arr = rng.random(24 * 2**20 // 8)\n"
    "small = {'k': [1, 2, 3], 'b': b'x' * 1000}\n"
    "print(hashlib.md5(memoryview(arr)).hexdigest())"
)
CHECK = "import hashlib\nprint(hashlib.md5(memoryview(arr)).hexdigest())\nprint(small['k'])"


async def _snapshot_and_restore(
    http: httpx.AsyncClient, token: str, sid: str, digest: str
) -> dict[str, object]:
    h = auth(token)
    r = await http.post(f"/v1/sessions/{sid}/snapshots", headers=h)
    assert r.status_code == 201, r.text
    snap = r.json()
    r = await http.post("/v1/sessions", json={"from_snapshot": snap["id"]}, headers=h)
    assert r.status_code == 201, r.text
    assert r.json()["restore"]["failed"] == {}, r.json()
    back = await run(http, token, r.json()["id"], CHECK)
    assert stdout(back) == f"{digest}\n[1, 2, 3]\n", back
    timings: dict[str, object] = snap["host_timings"]
    kernel: dict[str, float] = snap["kernel_timings"]
    # The answer says where the call went: the kernel's phases inside the host's call.
    assert {"total", "classify", "group", "pickle_and_write", "manifest"} <= set(kernel), snap
    call, total = float(timings["call"]), kernel["total"]  # type: ignore[arg-type]
    assert 0 < total < call, snap
    for span in ("to_kernel", "from_kernel", "connect", "commit"):
        assert 0 <= float(timings[span]) < call, (span, snap)  # type: ignore[arg-type]
    return timings


async def test_a_capture_goes_through_the_pipe_and_restores(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    token = gateway.token("alice")
    sid = await new_session(http, token)
    digest = stdout(await run(http, token, sid, MAKE)).strip()
    timings = await _snapshot_and_restore(http, token, sid, digest)
    assert timings["mode"] == "pipe", timings
    assert {"receive", "hash", "hash_tail", "fsync"} <= set(timings)


async def test_a_kernel_that_does_not_take_the_pipe_streams_over_the_socket(
    gateway: Gateway, http: httpx.AsyncClient
) -> None:
    """What a new gateway gets from an old image: the offer is never read."""
    token = gateway.token("alice")
    sid = await new_session(http, token)
    digest = stdout(await run(http, token, sid, MAKE)).strip()
    made = await run(
        http, token, sid,
        "import kernelhub_kernel.snapshot as _s\n"
        "_s.take_pipe = lambda sock, timeout=0: None",
    )  # fmt: skip
    assert made["status"] == "completed", made
    timings = await _snapshot_and_restore(http, token, sid, digest)
    assert timings["mode"] == "socket", timings


@pytest.mark.parametrize("lie", ["short", "corrupt"])
async def test_a_stream_that_breaks_off_is_a_typed_error_and_leaves_no_blob(
    gateway: Gateway, http: httpx.AsyncClient, lie: str
) -> None:
    """The kernel closes its pipe early (a writer that died) or claims a byte count that
    is not what came through the pipe."""
    token = gateway.token("alice")
    sid = await new_session(http, token)
    digest = stdout(await run(http, token, sid, MAKE)).strip()
    trailer = "b''" if lie == "short" else "b'DONE' + (self.written + 7).to_bytes(8, 'big')"
    made = await run(
        http, token, sid,
        "from kernelhub_kernel.snapshot import stream as _st\n"
        "def _close(self):\n"
        "    self.abandon()\n"
        f"    self.sock.sendall({trailer})\n"
        "    self.sock.shutdown(2)\n"
        "_st.TarWriter.close = _close",
    )  # fmt: skip
    assert made["status"] == "completed", made
    r = await http.post(f"/v1/sessions/{sid}/snapshots", headers=auth(token))
    assert r.status_code >= 400 and r.status_code != 500, r.text
    assert "snapshot stream" in r.json()["message"], r.text
    assert not list((Path(gateway.env["KERNELHUB_DATA_DIR"]) / "snapshots").glob("*.blob"))
    after = await run(http, token, sid, CHECK)
    assert stdout(after) == f"{digest}\n[1, 2, 3]\n", after
