"""Everything a sandbox sends for a cell is charged to its output cap, end to end: real
gateway, real Docker sandboxes, attacks written as a hostile cell would write them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.conftest import UNIT
from tests.gateway.conftest import Gateway
from tests.gateway.test_gateway import auth, new_session, run, stdout

pytestmark = pytest.mark.docker

MiB = 2**20


@pytest.fixture(scope="module")
def token(shared_gateway: Gateway) -> str:
    return shared_gateway.token("mallory")


@pytest.fixture
async def http(shared_gateway: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=shared_gateway.url, timeout=180 * UNIT) as client:
        yield client


async def record_size(http: httpx.AsyncClient, token: str, eid: str) -> int:
    r = await http.get(f"/v1/executions/{eid}?events=false", headers=auth(token))
    assert r.status_code == 200
    return len(r.content)


def displays(count: int, junk: str) -> str:
    """A cell showing ``count`` small displays, each with ``junk`` as its metadata."""
    return (
        "from IPython.display import display\n"
        f"for i in range({count}):\n"
        f"    display({{'text/plain': f'shown {{i}}'}}, raw=True, metadata={{'junk': {junk}}})"
    )


def events_size(execution: dict[str, Any]) -> int:
    return sum(len(json.dumps(e)) for e in execution["events"])


async def ws_events(gateway: Gateway, token: str, sid: str, code: str) -> list[dict[str, Any]]:
    """The events of one cell as a WebSocket client sees them, up to its ``final``."""
    from websockets.asyncio.client import connect

    url = f"{gateway.ws_url}/v1/sessions/{sid}/stream"
    async with connect(f"{url}?since=0", additional_headers=auth(token), max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "hello"
        await ws.send(json.dumps({"type": "execute", "code": code, "request_id": "r1"}))
        events: list[dict[str, Any]] = []
        while not events or events[-1]["type"] != "final":
            frame = json.loads(await ws.recv())
            if frame["type"] == "event":
                events.append(frame["event"])
    return events


async def test_display_metadata_is_charged_and_the_record_stays_small(
    http: httpx.AsyncClient, token: str
) -> None:
    sid = await new_session(http, token, limits={"output_bytes": 8 * MiB})
    result = await run(http, token, sid, displays(10, "'m' * 3_000_000") + "\nprint('after')")
    record = result["record"]
    assert result["status"] == "completed", record
    assert record["output_bytes"] <= 8 * MiB
    assert record["dropped_bytes"] >= 5 * 3_000_000 and record["dropped_events"] >= 5
    assert events_size(result) < 8 * MiB + 64 * 1024, "stored events stay within the cap"
    shown = [e for e in result["events"] if e["type"] == "display"]
    assert any("dropped" in e["data"]["text/plain"] for e in shown), "a visible marker"
    assert any(e["type"] == "truncated" and e["final"] for e in result["events"])
    assert await record_size(http, token, result["id"]) < 4096
    assert stdout(result) == "after\n"


async def test_the_sandbox_cuts_a_message_over_the_limit_before_sending_it(
    http: httpx.AsyncClient, token: str
) -> None:
    sid = await new_session(http, token, limits={"output_bytes": 64 * MiB})
    result = await run(http, token, sid, displays(1, "'m' * 40_000_000 + 'END'"))
    (display,) = [e for e in result["events"] if e["type"] == "display"]
    junk = display["metadata"]["junk"]
    assert "bytes dropped ...]" in junk and junk.endswith("END") and len(junk) < 9 * MiB
    assert display["data"] == {"text/plain": "shown 0"}
    assert result["record"]["output_bytes"] < 9 * MiB
    assert result["record"]["dropped_bytes"] > 30_000_000, "the sandbox's cut is counted"


async def test_a_20_mb_exception_is_cut_with_a_marker_and_the_record_is_bounded(
    http: httpx.AsyncClient, token: str
) -> None:
    sid = await new_session(http, token)
    result = await run(http, token, sid, "raise Exception('x' * 20_000_000 + 'LAST')")
    record = result["record"]
    assert result["status"] == "failed"
    assert record["error"]["name"] == "Exception"
    assert "bytes dropped ...]" in record["error"]["value"]
    assert record["error"]["value"].endswith("LAST")
    assert await record_size(http, token, result["id"]) < 256 * 1024
    assert events_size(result) < 512 * 1024
    assert (await run(http, token, sid, "1 + 1"))["status"] == "completed"


async def test_20k_clear_output_calls_store_a_bounded_number_of_events(
    http: httpx.AsyncClient, token: str
) -> None:
    sid = await new_session(http, token)  # the default cap: 10,000 events
    # Each clear after some output: back to back, the kernel sends only the first.
    code = (
        "from IPython.display import clear_output\n"
        "for i in range(15_000):\n"
        "    print(i, end='', flush=True)\n"
        "    clear_output()\n"
        "print('done')"
    )
    result = await run(http, token, sid, code)
    record = result["record"]
    assert result["status"] == "completed", record
    assert len(result["events"]) <= 10_000 + 10
    assert record["dropped_events"] >= 5_000  # the clears alone are 15,000 messages
    assert stdout(result).endswith("done\n"), "the end survives the event cap"


async def test_a_big_stdout_flood_keeps_its_head_and_its_last_lines(
    http: httpx.AsyncClient, token: str
) -> None:
    sid = await new_session(http, token, limits={"output_bytes": 1 * MiB})
    result = await run(http, token, sid, "for i in range(1_000_000):\n    print(i)")
    record = result["record"]
    text = stdout(result)
    assert text.startswith("0\n1\n2\n")
    assert text.endswith("999998\n999999\n"), "the last line is present"
    assert f"[... {record['dropped_bytes']} bytes dropped ...]" in text
    assert record["output_bytes"] <= 1 * MiB


HOSTILE = """
import json
k = get_ipython().kernel
s = k.session
msg = s.msg('display_data', {'data': {'text/plain': 'x'}, 'metadata': {}}, parent=k.get_parent('shell'))
parts = [s.pack(msg['header']), s.pack(msg['parent_header']), s.pack({}), s.pack(msg['content'])]
"""


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param("[s.sign(parts), *parts[:3], b'{\"junk\": \"' + b'z' * 20_000_000 + b'\"}']", id="one-20MB-frame"),
        pytest.param("[s.sign(parts), *parts, *[b'b' * 4_000_000] * 6]", id="6-frames-of-4MB"),
    ],
)  # fmt: skip
async def test_an_oversized_raw_message_becomes_a_named_truncation(
    http: httpx.AsyncClient, token: str, frames: str
) -> None:
    sid = await new_session(http, token, limits={"cell_timeout": 60.0})
    code = HOSTILE + f"k.iopub_socket.send_multipart([b'display_data', b'<IDS|MSG>', *{frames}])\n"
    code += "import time; time.sleep(0.5); print('still here')"
    result = await run(http, token, sid, code)
    record = result["record"]
    assert result["status"] == "completed", record
    notices = [e["message"] for e in result["events"] if e["type"] == "notice"]
    assert any("message limit" in n for n in notices), notices
    assert record["dropped_events"] >= 1
    assert record["duration"] < 30
    after = await run(http, token, sid, "print('next cell')")
    assert stdout(after) == "next cell\n", "the session keeps working"


async def test_big_messages_stream_whole_and_in_order_through_the_sliced_codec(
    shared_gateway: Gateway, http: httpx.AsyncClient, token: str
) -> None:
    """A 3M-character display (~5.5 MB of JSON) and a 2 MB exception are decoded and encoded a slice at a
    time on the gateway (kernelhub.jsonslices): their frames still arrive whole, in order
    between the small ones around them, escapes and non-ASCII intact."""
    sid = await new_session(http, token, limits={"output_bytes": 32 * MiB})
    code = (
        "from IPython.display import display\n"
        "print('before')\n"
        "blob = ('iVBOR\\\\\"\\n\\té€😀' * 400_000)[:3_000_000]\n"
        "display({'text/html': blob, 'text/plain': 'img'}, raw=True,"
        " metadata={'note': '\\x01' + blob[:300_000]})\n"
        "print('between')\n"
        "raise ValueError('v' * 2_000_000)\n"
    )
    events = await ws_events(shared_gateway, token, sid, code)
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    kinds = [
        (e["type"], e.get("text")) for e in events if e["type"] in {"stream", "display", "error"}
    ]
    assert kinds == [("stream", "before\n"), ("display", None), ("stream", "between\n"),
                     ("error", None)]  # fmt: skip
    blob = ('iVBOR\\"\n\té€😀' * 400_000)[:3_000_000]
    (shown,) = (e for e in events if e["type"] == "display")
    assert shown["data"]["text/html"] == blob, sorted(shown["data"])
    assert shown["metadata"]["note"] == "\x01" + blob[:300_000]
    (error,) = (e for e in events if e["type"] == "error")
    assert error["error"]["value"].startswith("v" * 4096)  # cut to its cap, in its place


async def test_a_flood_relayed_under_back_pressure_arrives_whole_and_in_order(
    shared_gateway: Gateway, http: httpx.AsyncClient
) -> None:
    """30 MB of stdout, faster than the gateway stores and sends it: the kernel's pumps
    wait for the fan-out (``SessionFanout.room``) instead of the gateway holding the
    backlog, and nothing is lost or reordered, live over the WebSocket or in the store."""
    token = shared_gateway.token("flooder")  # its own: this module's sessions stay
    sid = await new_session(http, token, limits={"output_bytes": 64 * MiB})
    code = (
        "import sys\nfor i in range(300):\n    sys.stdout.write(f'{i:05d}' + 'z' * 100_000 + '\\n')"
    )
    expected = "".join(f"{i:05d}" + "z" * 100_000 + "\n" for i in range(300))
    events = await ws_events(shared_gateway, token, sid, code)
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    live = "".join(e["text"] for e in events if e["type"] == "stream")
    assert live == expected, (len(live), len(expected))
    record = events[-1]["record"]
    assert record["dropped_bytes"] == 0 and record["output_bytes"] == len(expected)
    r = await http.get(f"/v1/executions/{record['execution_id']}", headers=auth(token))
    assert r.status_code == 200
    stored = "".join(e["text"] for e in r.json()["events"] if e["type"] == "stream")
    assert stored == expected


async def test_a_100k_record_display_arrives_whole_live_stored_and_exported(
    shared_gateway: Gateway, http: httpx.AsyncClient
) -> None:
    """~6.5 MB of small records in one display (under the sandbox's 8 MiB cut): the
    gateway parses and writes it a slice at a time with the garbage collector held off
    (``gcpause``); the same value reaches a WebSocket client, the stored execution and
    the notebook export, charged in full."""
    token = shared_gateway.token("recorder")  # its own: this module's sessions stay
    sid = await new_session(http, token, limits={"output_bytes": 32 * MiB})
    code = (
        "from IPython.display import display\n"
        "rows = [{'a': i, 'b': 'xé\\\\\"', 'c': [i / 7, None, True]} for i in range(100_000)]\n"
        "display({'application/json': rows, 'text/plain': 'rows'}, raw=True,"
        " metadata={'application/json': {'expanded': False}})\n"
    )
    rows = [{"a": i, "b": 'xé\\"', "c": [i / 7, None, True]} for i in range(100_000)]
    events = await ws_events(shared_gateway, token, sid, code)
    (shown,) = (e for e in events if e["type"] == "display")
    assert shown["data"] == {"application/json": rows, "text/plain": "rows"}
    assert shown["metadata"] == {"application/json": {"expanded": False}}
    record = events[-1]["record"]
    assert record["status"] == "completed" and record["dropped_bytes"] == 0
    assert record["output_bytes"] > 4 * MiB
    r = await http.get(f"/v1/executions/{record['execution_id']}", headers=auth(token))
    (stored,) = (e for e in r.json()["events"] if e["type"] == "display")
    assert stored == shown
    nb = (await http.get(f"/v1/sessions/{sid}/notebook", headers=auth(token))).json()
    outputs = [o for cell in nb["cells"] for o in cell.get("outputs", [])]
    (exported,) = (o for o in outputs if o["output_type"] == "display_data")
    assert exported["data"]["application/json"] == rows
