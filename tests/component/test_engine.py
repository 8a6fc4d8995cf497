"""The engine end to end, on every backend: real kernels, real sandboxes, no mocks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import psutil
import pytest

from kernelhub.errors import InvalidRequestError, NotFoundError, SessionError, TooLargeError
from kernelhub.execution import ops
from kernelhub.execution.collector import marker
from kernelhub.malloc import pin_mmap_threshold
from kernelhub.models import (
    DisplayEvent,
    EndedBy,
    Event,
    Execution,
    ExecutionStatus,
    FinalEvent,
    InputReplyEvent,
    InputRequestEvent,
    StatusEvent,
    StreamEvent,
    TruncatedEvent,
)
from tests.component.conftest import SessionFactory
from tests.conftest import UNIT, eventually

MiB = 2**20


async def test_state_persists_and_user_errors_are_data(open_session: SessionFactory) -> None:
    s = await open_session()
    first = await s.execute("x = 20\ndef f(a):\n    return a + 1\nimport math")
    assert first.status == ExecutionStatus.COMPLETED
    second = await s.execute("f(x) + 1 + int(math.sqrt(0))")
    assert second.text == "22" and second.record.execution_count == 2
    failed = await s.execute("1 / 0")
    assert failed.status == ExecutionStatus.FAILED
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"
    assert any("ZeroDivisionError" in line for line in failed.error.traceback)
    after = await s.execute("print(x)")
    assert after.stdout == "20\n"
    assert after.record.cpu_seconds is not None and after.record.duration > 0


async def test_plot_is_png_and_dataframe_is_html(open_session: SessionFactory) -> None:
    s = await open_session()
    plot = await s.execute(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()"
    )
    assert plot.status == ExecutionStatus.COMPLETED, plot.error
    pngs = [d for d in plot.displays() if "image/png" in d.data]
    assert pngs and pngs[0].data["image/png"].startswith("iVBOR")
    frame = await s.execute("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
    assert frame.result is not None and "<table" in frame.result["text/html"]


async def test_events_stream_in_order_and_end_with_one_final(open_session: SessionFactory) -> None:
    s = await open_session()
    seen: list[Event] = []
    s.add_listener(seen.append)
    events = [e async for e in s.stream("for i in range(5):\n    print(i, flush=True)")]
    assert isinstance(events[-1], FinalEvent)
    assert sum(isinstance(e, FinalEvent) for e in events) == 1
    assert [e.seq for e in events] == sorted({e.seq for e in events})
    statuses = [e.status for e in events if isinstance(e, StatusEvent)]
    assert statuses[:1] == [ExecutionStatus.RUNNING]  # nothing ahead of it: no `queued`
    text = "".join(e.text for e in events if isinstance(e, StreamEvent))
    assert text == "0\n1\n2\n3\n4\n"
    assert [e.seq for e in seen] == [e.seq for e in events]


async def test_cells_queue_in_order(open_session: SessionFactory) -> None:
    s = await open_session()
    handles = [
        await s.submit(
            f"import time; time.sleep(0.05); log = globals().get('log', []) + [{i}]; log"
        )
        for i in range(4)
    ]
    results = [await h.wait() for h in handles]
    assert results[-1].text == "[0, 1, 2, 3]"
    starts = [r.record.started_at for r in results]
    assert starts == sorted(starts)
    statuses = [[e.status for e in r.events if isinstance(e, StatusEvent)] for r in results]
    assert statuses[0][0] == ExecutionStatus.RUNNING  # started at once
    for later in statuses[1:]:  # waited behind the first
        assert later[:2] == [ExecutionStatus.QUEUED, ExecutionStatus.RUNNING]


async def test_a_background_call_never_makes_the_kernel_busy(
    open_session: SessionFactory,
) -> None:
    """The automatic checkpoint (a background call) never makes a session read busy; a
    user's cell waiting behind it does, and so does any other internal call."""
    s = await open_session()
    call = asyncio.ensure_future(
        s.call("import time; time.sleep(0.5)", {}, timeout=10, background=True)
    )
    await eventually(lambda: s.running is not None, 5)
    assert not s.user_busy  # only the background call runs
    queued = await s.submit("1 + 1")
    assert s.user_busy  # a user's cell waits behind it
    await call
    assert (await queued.wait()).text == "2"
    await eventually(lambda: not s.user_busy, 5)
    other = asyncio.ensure_future(s.call("import time; time.sleep(0.3)", {}, timeout=10))
    await eventually(lambda: s.user_busy, 5)  # a snapshot or hibernation capture shows
    await other


async def test_cancel_a_queued_cell(open_session: SessionFactory) -> None:
    s = await open_session()
    running = await s.submit("import time; time.sleep(1)")
    queued = await s.submit("ran = True")
    assert s.cancel(queued.id)
    assert (await queued.wait()).status == ExecutionStatus.CANCELLED
    await running.wait()
    check = await s.execute("'ran' in globals()")
    assert check.text == "False"


async def test_interrupt_returns_fast_and_keeps_variables(open_session: SessionFactory) -> None:
    s = await open_session()
    await s.execute("kept = 'yes'")
    handle = await s.submit("import time\ntime.sleep(60)")
    await eventually(lambda: handle.status == ExecutionStatus.RUNNING, 10)
    await asyncio.sleep(0.2)  # let the cell actually enter sleep()
    t0 = time.monotonic()
    assert await s.interrupt()
    result = await asyncio.wait_for(handle.wait(), 10 * UNIT)
    assert time.monotonic() - t0 < 2 * UNIT
    assert result.status == ExecutionStatus.INTERRUPTED
    assert result.record.ended_by == EndedBy.INTERRUPT and not result.record.state_lost
    assert (await s.execute("kept")).text == "'yes'"


async def test_timeout_ends_with_interrupt_when_the_cell_obeys(
    open_session: SessionFactory,
) -> None:
    s = await open_session()
    await s.execute("kept = 1")
    result = await s.execute("import time\ntime.sleep(60)", timeout=1.0 * UNIT)
    assert result.status == ExecutionStatus.TIMED_OUT
    assert result.record.ended_by == EndedBy.INTERRUPT and not result.record.state_lost
    assert "KERNELHUB_LIMITS__CELL_TIMEOUT" in (result.record.reason or "")
    assert (await s.execute("kept")).text == "1"


async def test_timeout_escalates_to_restart_when_interrupt_is_swallowed(
    open_session: SessionFactory,
) -> None:
    s = await open_session()
    await s.execute("lost = 1\nopen('kept.txt', 'w').write('file survives')")
    stubborn = (
        "import time\n"
        "while True:\n"
        "    try:\n"
        "        time.sleep(10)\n"
        "    except KeyboardInterrupt:\n"
        "        pass\n"
    )
    result = await s.execute(stubborn, timeout=1.0 * UNIT)
    assert result.status == ExecutionStatus.TIMED_OUT
    assert result.record.ended_by == EndedBy.RESTART and result.record.state_lost
    after = await s.execute("print(open('kept.txt').read())\nlost")
    assert after.stdout == "file survives\n"
    assert after.error is not None and after.error.name == "NameError"


async def test_kernel_exit_is_reported_fast_and_session_stays_dead(
    open_session: SessionFactory,
) -> None:
    s = await open_session()
    t0 = time.monotonic()
    result = await s.execute("import os\nos._exit(3)")
    assert time.monotonic() - t0 < 2 * UNIT
    assert result.status == ExecutionStatus.KERNEL_DIED
    assert result.record.reason == "kernel exited with status 3"
    assert result.record.state_lost
    again = await s.execute("1 + 1")
    assert again.status == ExecutionStatus.KERNEL_DIED


async def test_segfault_is_kernel_died_with_the_signal(open_session: SessionFactory) -> None:
    s = await open_session()
    result = await s.execute("import ctypes\nctypes.string_at(0)")
    assert result.status == ExecutionStatus.KERNEL_DIED
    assert "SIGSEGV" in (result.record.reason or "")


async def test_print_flood_is_capped_and_host_memory_stays_bounded(
    open_session: SessionFactory,
) -> None:
    pin_mmap_threshold()  # as `kernelhub serve` does: RSS then measures what is held
    s = await open_session(output_bytes=1 * MiB, memory_bytes=2048 * MiB)
    me = psutil.Process()
    rss_before = me.memory_info().rss
    big = await s.execute("print('x' * 300_000_000)", timeout=120 * UNIT)
    many = await s.execute("for i in range(2_000_000):\n    print(i)", timeout=120 * UNIT)
    growth = me.memory_info().rss - rss_before
    for result in (big, many):
        assert result.status == ExecutionStatus.COMPLETED, result.record
        assert result.record.output_bytes <= 1 * MiB
        assert result.record.dropped_bytes > 0
        cuts = [e for e in result.events if isinstance(e, TruncatedEvent)]
        assert [c.final for c in cuts] == [False, True]
        assert cuts[-1].dropped_bytes == result.record.dropped_bytes
        # head, the marker, the tail: what is kept is charged, the marker is not
        mark = marker(result.record.dropped_bytes)
        assert mark in result.stdout
        assert len(result.stdout.encode()) == result.record.output_bytes + len(mark)
    assert big.record.output_bytes + big.record.dropped_bytes == 300_000_001
    assert many.stdout.endswith("1999998\n1999999\n"), "the last lines are kept"
    assert growth < 64 * MiB, f"host RSS grew by {growth / MiB:.0f} MiB"
    assert (await s.execute("1 + 1")).text == "2"


async def test_two_sessions_share_nothing(open_session: SessionFactory) -> None:
    a = await open_session()
    b = await open_session()
    await a.execute("secret = 42\nopen('a.txt', 'w').write('a')")
    seen = await b.execute("import os\nprint('a.txt' in os.listdir('.'))\nsecret")
    assert seen.stdout == "False\n"
    assert seen.error is not None and seen.error.name == "NameError"


async def test_fd_output_of_subprocesses_lands_in_its_cell(open_session: SessionFactory) -> None:
    s = await open_session()
    for i in range(10):
        result = await s.execute(f"import os\nos.system('echo hi-{i}')")
        assert f"hi-{i}" in result.stdout, result.events


async def test_late_thread_output_never_lands_in_a_later_cell(open_session: SessionFactory) -> None:
    s = await open_session()
    late: list[Event] = []
    s.add_listener(late.append)
    a = await s.execute(
        "import threading, time\n"
        "def chatter():\n"
        "    for i in range(40):\n"
        "        print('A-late', i, flush=True)\n"
        "        time.sleep(0.05)\n"
        "threading.Thread(target=chatter).start()"
    )
    later = [await s.execute(f"import time\nprint('cell', {i})\ntime.sleep(0.2)") for i in range(8)]
    for result in later:
        assert "A-late" not in result.stdout, result.stdout
    await eventually(
        lambda: any(isinstance(e, StreamEvent) and "A-late 39" in e.text for e in late), 10
    )
    a_late = [e for e in late if isinstance(e, StreamEvent) and "A-late" in e.text]
    assert all(e.execution_id == a.record.execution_id for e in a_late)


async def test_input_request_is_answered(open_session: SessionFactory) -> None:
    s = await open_session()
    handle = await s.submit("name = input('name? ')\nprint('hello', name)")
    await eventually(lambda: handle.status == ExecutionStatus.AWAITING_INPUT, 10)
    s.send_input("ada")
    result = await handle.wait()
    assert result.stdout.endswith("hello ada\n")
    assert any(e.type == "input_request" and e.prompt == "name? " for e in result.events)


async def test_display_update_and_clear_output_arrive(open_session: SessionFactory) -> None:
    s = await open_session()
    result = await s.execute(
        "from IPython.display import display, clear_output, HTML\n"
        "h = display(HTML('<b>one</b>'), display_id=True)\n"
        "h.update(HTML('<b>two</b>'))\n"
        "clear_output()"
    )
    displays = [e for e in result.events if isinstance(e, DisplayEvent)]
    assert [d.update for d in displays] == [False, True]
    assert displays[0].display_id and displays[0].display_id == displays[1].display_id
    assert any(e.type == "clear_output" for e in result.events)


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def test_files_round_trip_and_refuse_traversal_and_planted_symlinks(
    open_session: SessionFactory,
) -> None:
    s = await open_session()
    box = s.sandbox
    size = await box.write_file("data/in.csv", _chunks(b"a,b\n", b"1,2\n"), 1024)
    assert size == 8
    seen = await s.execute("import pandas as pd\nprint(pd.read_csv('data/in.csv').a.sum())")
    assert seen.stdout == "1\n"
    await s.execute("open('out.bin', 'wb').write(bytes(range(256)) * 100)")
    got = b"".join([c async for c in box.read_file("out.bin", 1 << 20)])
    assert got == bytes(range(256)) * 100
    for bad in ("../etc/passwd", "/etc/passwd", "a/../../x", ""):
        with pytest.raises(InvalidRequestError):
            await box.write_file(bad, _chunks(b"x"), 10)
    # The sandbox plants symlinks pointing outside the workspace; neither direction follows.
    await s.execute("import os\nos.symlink('/etc/passwd', 'link')\nos.symlink('/etc', 'dirlink')")
    with pytest.raises(InvalidRequestError):
        [c async for c in box.read_file("link", 1 << 20)]
    with pytest.raises(InvalidRequestError):
        [c async for c in box.read_file("dirlink/passwd", 1 << 20)]
    with pytest.raises(InvalidRequestError):
        await box.write_file("link", _chunks(b"owned"), 10)
    with pytest.raises(NotFoundError):
        [c async for c in box.read_file("missing.txt", 1 << 20)]
    with pytest.raises(TooLargeError):
        await box.write_file("big.bin", _chunks(b"x" * 600, b"x" * 600), 1000)
    with pytest.raises(TooLargeError):
        [c async for c in box.read_file("out.bin", 100)]


async def test_pause_freezes_the_cell_and_resume_continues_without_gap(
    open_session: SessionFactory,
) -> None:
    s = await open_session()
    handle = await s.submit(
        "import time\nfor i in range(150):\n    print(i, flush=True)\n    time.sleep(0.01)",
        timeout=5.0 * UNIT,
    )
    await eventually(lambda: any(isinstance(e, StreamEvent) for e in handle.events), 10)
    await s.pause()
    assert handle.status == ExecutionStatus.PAUSED
    with pytest.raises(SessionError, match="paused"):
        await s.submit("1")
    with pytest.raises(SessionError, match="paused"):
        await s.interrupt()
    # Output already on its way when the sandbox froze may still arrive; then silence.
    await asyncio.sleep(0.3 * UNIT)
    cpu_before = s.sandbox.usage().cpu_seconds
    printed = len(handle.events)
    await asyncio.sleep(6.0 * UNIT)  # longer than the cell's timeout: paused time is free
    assert len(handle.events) == printed, "a paused cell produced output"
    if cpu_before is not None and s.sandbox.usage().cpu_seconds is not None:
        assert s.sandbox.usage().cpu_seconds == pytest.approx(cpu_before, abs=0.05)
    await s.resume()
    result = await handle.wait()
    assert result.status == ExecutionStatus.COMPLETED, result.record
    assert result.stdout == "".join(f"{i}\n" for i in range(150))
    assert result.record.paused_seconds >= 6.0 * UNIT
    statuses = [e.status for e in result.events if isinstance(e, StatusEvent)]
    assert ExecutionStatus.PAUSED in statuses and statuses[-1] == ExecutionStatus.RUNNING


async def test_confirm_yes_no_and_the_deadline(open_session: SessionFactory) -> None:
    s = await open_session(input_timeout=1.0 * UNIT)

    async def ask(answer: str | None) -> tuple[Execution, list[Event]]:
        handle = await s.submit("print(confirm('Delete file A?'))")
        await eventually(lambda: handle.status == ExecutionStatus.AWAITING_INPUT, 10)
        if answer is not None:
            s.send_input(answer, answered_by="alice")
        result = await handle.wait()
        return result, result.events

    yes, _ = await ask("yes")
    assert yes.stdout.strip().endswith("True")
    no, _ = await ask("n")
    assert no.stdout.strip().endswith("False")
    late, events = await ask(None)
    assert late.stdout.strip().endswith("False")
    replies = [e for e in events if isinstance(e, InputReplyEvent)]
    assert [r.answered_by for r in replies] == ["deadline"]
    prompt = next(e for e in events if isinstance(e, InputRequestEvent))
    assert "Delete file A?" in prompt.prompt
    handle = await s.submit("x = input('name? ')")
    result = await handle.wait()
    assert result.error is not None and result.error.name == "EOFError"


async def test_snapshot_moves_out_as_an_opaque_blob_and_restores_in_a_fresh_sandbox(
    open_session: SessionFactory,
) -> None:
    from kernelhub.snapshot import calls

    a = await open_session()
    await a.execute("import numpy as np\nkept = np.arange(4)\ndef f(x):\n    return x + 1")
    saved = await ops.run(a, calls.capture("snap-t", result=True), timeout=60 * UNIT)
    assert {"kept", "f"} <= set(saved["saved"])
    blob = b"".join([c async for c in a.sandbox.pack_snapshot("snap-t", 1 << 30)])
    assert blob  # opaque bytes: never opened here
    b = await open_session()

    async def chunks() -> AsyncIterator[bytes]:
        yield blob

    await b.sandbox.unpack_snapshot("restore-t", chunks(), 1 << 30)
    report = await ops.run(b, calls.restore("restore-t"), timeout=60 * UNIT)
    assert report["failed"] == {}
    assert (await b.execute("f(int(kept.sum()))")).text == "7"
    with pytest.raises(InvalidRequestError):
        await b.sandbox.unpack_snapshot("../escape", chunks(), 1 << 30)


async def test_the_kernel_spools_its_running_cell_bounded_by_the_sessions_output_cap(
    open_session: SessionFactory,
) -> None:
    # Both backends: the spool a restarted gateway collects (session/salvage.py) is on
    # the host, holds the latest user cell with its reply, and is bounded by this
    # session's own cap (KERNELHUB_SPOOL_BYTES from the sandbox's environment).
    from kernelhub.sandbox.state import SPOOL_FILE, spool_bytes, state_dir
    from kernelhub.session.salvage import parse, read_from

    s = await open_session(output_bytes=50_000)
    bound = await s.execute("import os; print(os.environ['KERNELHUB_SPOOL_BYTES'])")
    assert bound.stdout.strip() == str(spool_bytes(50_000))
    await s.execute("print('spooled-' * 3)")
    path = state_dir(s.sandbox.session_dir.root.parent, s.id) / SPOOL_FILE
    data = read_from(path, 0, 1 << 20)
    assert data is not None, f"no spool at {path}"
    lines, _ = parse(data)
    texts = [m["content"].get("text", "") for m in lines.messages]
    types = [m["header"]["msg_type"] for m in lines.messages]
    assert "spooled-spooled-spooled-\n" in texts and "execute_reply" in types
    assert not any("KERNELHUB_SPOOL_BYTES" in t for t in texts)  # only the latest cell
