"""The unmodified e2b-code-interpreter SDK against a real kernelhub gateway with real Docker
sandboxes, configured only through its own documented settings (E2B_API_URL,
E2B_SANDBOX_URL, E2B_API_KEY): E2B's quick-start, callbacks, errors,
files, timeouts, lifecycle, and that an E2B sandbox is a kernelhub session like any other."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from tests.conftest import UNIT
from tests.gateway.conftest import Gateway

e2b = pytest.importorskip("e2b")
e2b_ci = pytest.importorskip("e2b_code_interpreter")

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def gw(shared_gateway: Gateway) -> Gateway:
    return shared_gateway


@pytest.fixture(scope="module")
def token(gw: Gateway) -> str:
    return gw.token("e2b-user")


@pytest.fixture(scope="module", autouse=True)
def e2b_env(gw: Gateway, token: str) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("E2B_API_URL", f"{gw.url}/e2b")
        mp.setenv("E2B_SANDBOX_URL", f"{gw.url}/e2b")
        mp.setenv("E2B_API_KEY", token)
        mp.delenv("E2B_DEBUG", raising=False)
        yield


@pytest.fixture(scope="module")
def sbx() -> Iterator[e2b_ci.Sandbox]:
    sandbox = e2b_ci.Sandbox.create()
    yield sandbox
    sandbox.kill()


def test_quick_start_keeps_state(sbx: e2b_ci.Sandbox) -> None:
    sbx.run_code("x = 1")
    execution = sbx.run_code("x += 1; x")
    assert execution.text == "2"
    assert execution.results[0].is_main_result
    assert execution.error is None


def test_plot_png_and_rich_results(sbx: e2b_ci.Sandbox) -> None:
    execution = sbx.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()"
    )
    assert execution.error is None, execution.error
    png = base64.b64decode(execution.results[0].png)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    html = sbx.run_code("from IPython.display import HTML\nHTML('<b>bold</b>')")
    assert html.results[0].html == "<b>bold</b>"
    assert html.results[0].text is not None
    frame = sbx.run_code("{'a': [1, 2]}")
    assert frame.results[0].text == "{'a': [1, 2]}"


def test_callbacks_logs_and_errors(sbx: e2b_ci.Sandbox) -> None:
    seen: dict[str, list[object]] = {"stdout": [], "stderr": [], "result": [], "error": []}
    execution = sbx.run_code(
        "import sys\nprint('out')\nprint('err', file=sys.stderr)\n"
        "from IPython.display import display\ndisplay(42)\n1 / 0",
        on_stdout=lambda m: seen["stdout"].append(m.line),
        on_stderr=lambda m: seen["stderr"].append(m.line),
        on_result=lambda r: seen["result"].append(r.text),
        on_error=lambda e: seen["error"].append(e.name),
    )
    assert seen == {"stdout": ["out\n"], "stderr": ["err\n"], "result": ["42"], "error": ["ZeroDivisionError"]}  # fmt: skip
    assert execution.logs.stdout == ["out\n"] and execution.logs.stderr == ["err\n"]
    assert execution.error is not None
    assert execution.error.name == "ZeroDivisionError"
    assert execution.error.value == "division by zero"
    assert "ZeroDivisionError" in execution.error.traceback
    assert execution.execution_count is not None


def test_files_write_read_list(sbx: e2b_ci.Sandbox) -> None:
    info = sbx.files.write("notes/hello.txt", "hi from e2b")
    assert info.path == "/workspace/notes/hello.txt"
    assert sbx.files.read("notes/hello.txt") == "hi from e2b"
    assert sbx.files.read("/home/user/notes/hello.txt", format="bytes") == b"hi from e2b"
    # The kernel sees the same file in /workspace.
    assert sbx.run_code("open('/workspace/notes/hello.txt').read()").text == "'hi from e2b'"
    sbx.run_code("open('/workspace/notes/big.bin', 'wb').write(b'x' * 1234)")
    entries = {e.name: e for e in sbx.files.list("notes")}
    assert set(entries) == {"hello.txt", "big.bin"}
    assert entries["big.bin"].size == 1234
    assert entries["big.bin"].type == e2b.FileType.FILE
    top = {e.name: e for e in sbx.files.list("/workspace")}
    assert top["notes"].type == e2b.FileType.DIR
    assert sbx.files.exists("notes/hello.txt") and not sbx.files.exists("notes/nope.txt")
    assert sbx.files.get_info("/home/user/notes/big.bin").size == 1234
    written = sbx.files.write_files(
        [{"path": "multi/a.txt", "data": "A"}, {"path": "multi/b.bin", "data": b"\x00\x01"}]
    )
    assert [w.path for w in written] == ["/workspace/multi/a.txt", "/workspace/multi/b.bin"]
    assert sbx.files.read("multi/b.bin", format="bytes") == b"\x00\x01"
    with pytest.raises(e2b.NotFoundException):
        sbx.files.read("missing.txt")
    with pytest.raises(e2b.NotFoundException):
        sbx.files.list("no-such-dir")
    with pytest.raises(e2b.InvalidArgumentException):
        sbx.files.read("/etc/passwd")
    # The listing runs outside the session's history: the next cell's count is unchanged.
    before = sbx.run_code("1").execution_count
    sbx.files.list("notes")
    assert sbx.run_code("1").execution_count == (before or 0) + 1


def test_timeout_raises_the_sdks_exception_and_stops_the_cell(sbx: e2b_ci.Sandbox) -> None:
    t0 = time.monotonic()
    with pytest.raises(e2b.TimeoutException):
        sbx.run_code("import time\nwhile True: time.sleep(0.05)", timeout=2 * UNIT)
    assert time.monotonic() - t0 < 10 * UNIT
    # The gateway interrupted the abandoned cell: the next one does not wait behind it.
    t1 = time.monotonic()
    assert sbx.run_code("'after'", timeout=30 * UNIT).text == "'after'"
    assert time.monotonic() - t1 < 10 * UNIT


def test_lifecycle_list_connect_set_timeout_kill(gw: Gateway, token: str) -> None:
    sandbox = e2b_ci.Sandbox.create(metadata={"purpose": "lifecycle"}, timeout=120)
    sandbox.run_code("kept = 'yes'")
    listed = {s.sandbox_id: s for s in e2b_ci.Sandbox.list().next_items()}
    assert sandbox.sandbox_id in listed
    assert listed[sandbox.sandbox_id].metadata == {"purpose": "lifecycle"}
    query = e2b.SandboxQuery(metadata={"purpose": "lifecycle"})
    assert [s.sandbox_id for s in e2b_ci.Sandbox.list(query=query).next_items()] == [
        sandbox.sandbox_id
    ]
    other = e2b.SandboxQuery(metadata={"purpose": "else"})
    assert e2b_ci.Sandbox.list(query=other).next_items() == []
    again = e2b_ci.Sandbox.connect(sandbox.sandbox_id)
    assert again.run_code("kept").text == "'yes'"
    sandbox.set_timeout(60)  # shorter than the 120 it was created with
    left = (sandbox.get_info().end_at - datetime.now(UTC)).total_seconds()
    assert 50 < left <= 61
    assert sandbox.is_running()

    # The sandbox is a kernelhub session of the key's principal, with its record.
    headers = {"Authorization": f"Bearer {token}"}
    session = httpx.get(f"{gw.url}/v1/sessions/{sandbox.sandbox_id}", headers=headers).json()
    assert session["owner"] == "e2b-user" and session["metadata"]["purpose"] == "lifecycle"
    notebook = httpx.get(f"{gw.url}/v1/sessions/{sandbox.sandbox_id}/notebook", headers=headers)
    assert "kept = 'yes'" in notebook.text

    assert sandbox.kill() is True
    assert not sandbox.is_running()
    assert sandbox.sandbox_id not in {s.sandbox_id for s in e2b_ci.Sandbox.list().next_items()}
    assert e2b_ci.Sandbox.kill(sandbox.sandbox_id) is False


def test_expired_sandbox_is_gone(gw: Gateway, token: str) -> None:
    sandbox = e2b_ci.Sandbox.create(timeout=1)
    url = f"{gw.url}/v1/sessions/{sandbox.sandbox_id}"
    headers = {"Authorization": f"Bearer {token}"}
    deadline = time.monotonic() + 10 * UNIT
    # Untouched through the E2B API, the session is still deleted at its deadline.
    while (r := httpx.get(url, headers=headers)).status_code == 200 and r.json()["state"] != "deleted":  # fmt: skip
        assert time.monotonic() < deadline, "the sandbox outlived its timeout"
        time.sleep(0.2)
    assert r.status_code == 410 or r.json()["state"] == "deleted", r.text
    assert not sandbox.is_running()
    with pytest.raises(e2b.SandboxException):
        sandbox.run_code("1")


def test_another_principal_cannot_reach_the_sandbox(sbx: e2b_ci.Sandbox, gw: Gateway) -> None:
    other = gw.token("e2b-other")
    with pytest.raises(e2b.NotFoundException):
        e2b_ci.Sandbox.connect(sbx.sandbox_id, api_key=other)
    # Sandbox-plane requests need the token too: the header alone is not enough.
    r = httpx.post(
        f"{gw.url}/e2b/execute",
        json={"code": "1"},
        headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"},
    )
    assert r.status_code == 401
    with pytest.raises(e2b.AuthenticationException):
        e2b_ci.Sandbox.create(api_key="not-a-token")


def test_unsupported_options_are_refused_clearly(sbx: e2b_ci.Sandbox, tmp_path: Path) -> None:
    with pytest.raises(e2b.SandboxException, match="Python only"):
        sbx.run_code("1", language="r")
    with pytest.raises(e2b.SandboxException, match="environment variables"):
        sbx.run_code("1", envs={"A": "1"})


async def test_async_sandbox_quick_start() -> None:
    sandbox = await e2b_ci.AsyncSandbox.create()
    try:
        await sandbox.run_code("y = 41")
        seen: list[str] = []
        execution = await sandbox.run_code(
            "print('hi'); y + 1", on_stdout=lambda m: seen.append(m.line)
        )
        assert execution.text == "42" and seen == ["hi\n"]
        await sandbox.files.write("async.txt", "ok")
        assert await sandbox.files.read("async.txt") == "ok"
    finally:
        await sandbox.kill()


# -- the JS SDK (tests/gateway/e2b_js, `npm ci` there) ------------------------------------

JS_DIR = Path(__file__).parent / "e2b_js"


def test_js_sdk_quick_start(gw: Gateway, token: str) -> None:
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    if not (JS_DIR / "node_modules" / "@e2b" / "code-interpreter").is_dir():
        pytest.fail(f"the E2B JS SDK is not installed: run `npm ci` in {JS_DIR}")
    env = {
        **os.environ,
        "E2B_API_URL": f"{gw.url}/e2b",
        "E2B_SANDBOX_URL": f"{gw.url}/e2b",
        "E2B_API_KEY": token,
    }
    out = subprocess.run(
        ["node", "quickstart.mjs"], cwd=JS_DIR, env=env, capture_output=True, text=True,
        timeout=120 * UNIT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {
        "two": "2",
        "png": base64.b64encode(b"\x89PNG\r\n").decode()[:8],
        "stdout": ["plotting\n"],
        "error": ["ZeroDivisionError", "division by zero"],
        "read": "from js",
        "listed": seen["listed"],
        "timeout": "TimeoutError",
        "after": "'after'",
        "running": True,
        "alive": False,
    }
    assert "js.txt" in seen["listed"]


def test_code_contexts(sbx: e2b_ci.Sandbox) -> None:
    context = sbx.create_code_context()
    assert context.language == "python" and context.cwd == "/workspace"
    sbx.run_code("in_context = 3", context=context)
    assert sbx.run_code("in_context").text == "3"  # one kernel per sandbox
    with pytest.raises(e2b.SandboxException, match="Python only"):
        sbx.create_code_context(language="r")
