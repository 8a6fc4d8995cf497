"""gateway/metrics.py's own registry, fed with data: what each hook counts, and which
series the two expositions carry. Read back through prometheus_client's own parser."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kernelhub.gateway.metrics import Metrics
from kernelhub.models import EndedBy, ExecutionRecord, ExecutionStatus

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _record(status: ExecutionStatus, *, wait: float | None, run: float) -> ExecutionRecord:
    started = None if wait is None else T0 + timedelta(seconds=wait)
    return ExecutionRecord(
        execution_id="e", status=status, ended_by=EndedBy.REPLY, queued_at=T0,
        started_at=started, finished_at=(started or T0) + timedelta(seconds=run), duration=run,
    )  # fmt: skip


RECORDS = [
    (ExecutionStatus.COMPLETED, 0.5, 2.0),
    (ExecutionStatus.COMPLETED, 0.0, 0.004),
    (ExecutionStatus.FAILED, 1.5, 0.2),
    (ExecutionStatus.CANCELLED, None, 0.0),  # never started: no run time, no queue wait
]


def test_finished_executions_are_counted_by_status_and_timed_when_they_ran() -> None:
    m = Metrics()
    for status, wait, run in RECORDS:
        m.on_final(_record(status, wait=wait, run=run))
    got = _samples(m.exposition(per_session=False))
    for status in {s for s, _, _ in RECORDS}:
        want = sum(1 for s, _, _ in RECORDS if s == status)
        assert got[("kernelhub_executions_total", (("status", status.value),))] == want
    ran = [(w, r) for _, w, r in RECORDS if w is not None]
    assert got[("kernelhub_execution_seconds_count", ())] == len(ran)
    assert got[("kernelhub_execution_seconds_sum", ())] == pytest.approx(sum(r for _, r in ran))
    assert got[("kernelhub_queue_wait_seconds_sum", ())] == pytest.approx(sum(w for w, _ in ran))
    # Buckets are cumulative: the 5 ms one holds only the 4 ms cell.
    fast = sum(1 for _, r in ran if r <= 0.005)
    assert got[("kernelhub_execution_seconds_bucket", (("le", "0.005"),))] == fast


def test_start_and_batch_hooks() -> None:
    m = Metrics()
    starts = [0.3, 1.2, 7.0]
    for s in starts:
        m.on_start(s)
    m.on_batch_wait(0.25)
    items = [ExecutionStatus.COMPLETED, ExecutionStatus.COMPLETED, ExecutionStatus.TIMED_OUT]
    for status in items:
        m.on_batch_item(status)
    got = _samples(m.exposition(per_session=False))
    assert got[("kernelhub_session_start_seconds_count", ())] == len(starts)
    assert got[("kernelhub_session_start_seconds_sum", ())] == pytest.approx(sum(starts))
    assert got[("kernelhub_batch_queue_wait_seconds_sum", ())] == pytest.approx(0.25)
    for status in set(items):
        key = ("kernelhub_batch_items_total", (("status", status.value),))
        assert got[key] == items.count(status)


@dataclass
class _Runner:
    """What the batch collector reads from a BatchRunner at scrape time."""

    queue_length: int
    running: int


def test_the_batch_gauges_are_read_at_scrape_time() -> None:
    m = Metrics()
    runner = _Runner(queue_length=4, running=2)
    m.watch_batches(runner)  # type: ignore[arg-type]
    first = _samples(m.exposition(per_session=False))
    assert first[("kernelhub_batch_queue_length", ())] == 4
    assert first[("kernelhub_batch_items_running", ())] == 2
    runner.queue_length, runner.running = 0, 3
    later = _samples(m.exposition(per_session=False))
    assert (
        later[("kernelhub_batch_queue_length", ())],
        later[("kernelhub_batch_items_running", ())],
    ) == (0, 3)


def test_the_registries_are_the_apps_own() -> None:
    # Two gateways in one process (the tests make many) must not collide on a global registry.
    a, b = Metrics(), Metrics()
    a.on_start(1.0)
    got_b = _samples(b.exposition(per_session=True))
    assert got_b[("kernelhub_session_start_seconds_count", ())] == 0


async def test_the_loop_lag_probe_sees_a_callback_that_held_the_loop() -> None:
    import asyncio
    import time

    m = Metrics()
    probe = asyncio.create_task(m.watch_loop(0.001))
    try:
        for _ in range(5):
            await asyncio.sleep(0.002)
        # A callback holding the loop for 30 ms, as one 8 MiB encode did.
        asyncio.get_running_loop().call_soon(time.sleep, 0.03)
        for _ in range(5):
            await asyncio.sleep(0.002)
    finally:
        probe.cancel()
    s = _samples(m.exposition(per_session=False))
    count = s[("kernelhub_loop_lag_seconds_count", ())]
    under_10ms = s[("kernelhub_loop_lag_seconds_bucket", (("le", "0.01"),))]
    assert count >= 3 and count - under_10ms >= 1  # the held turn, counted over 10 ms
    assert s[("kernelhub_loop_lag_max_seconds", ())] >= 0.02
