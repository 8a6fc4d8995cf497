"""Prometheus metrics, on a registry of the app's own (never the global one)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kernelhub.models import ExecutionRecord, ExecutionStatus
from kernelhub.wire import SessionState

if TYPE_CHECKING:
    from kernelhub.session.batches import BatchRunner
    from kernelhub.session.manager import SessionManager

_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics:
    """``registry`` holds what anyone with a token may read; ``session_registry`` the
    series labelled with session ids (admins only)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.session_registry = CollectorRegistry(auto_describe=True)
        self.executions = Counter(
            "kernelhub_executions",
            "Finished executions by status",
            ["status"],
            registry=self.registry,
        )
        self.execution_seconds = Histogram(
            "kernelhub_execution_seconds",
            "Execution run time",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_wait_seconds = Histogram(
            "kernelhub_queue_wait_seconds", "Time executions waited in their session's queue",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.start_seconds = Histogram(
            "kernelhub_session_start_seconds", "Session start latency (sandbox + kernel ready)",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.batch_wait_seconds = Histogram(
            "kernelhub_batch_queue_wait_seconds", "Time batch items waited for a slot",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.ws_executes = Counter(
            "kernelhub_ws_executes", "Executions submitted over WebSocket streams, by path: "
            "fast (to the kernel from the frame's own receive callback) or queued (ASGI)",
            ["path"], registry=self.registry,
        )  # fmt: skip
        self.loop_lag_seconds = Histogram(
            "kernelhub_loop_lag_seconds", "How late the event loop ran a timer (see "
            "KERNELHUB_GATEWAY__LOOP_LAG_INTERVAL): the time one callback held the loop",
            buckets=_LAG_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.loop_lag_max = 0.0
        Gauge(
            "kernelhub_loop_lag_max_seconds", "The longest loop lag seen since the gateway "
            "started", registry=self.registry,
        ).set_function(lambda: self.loop_lag_max)  # fmt: skip
        self.batch_items = Counter(
            "kernelhub_batch_items", "Finished batch items by status", ["status"],
            registry=self.registry,
        )  # fmt: skip

    async def watch_loop(self, interval: float) -> None:
        """Until cancelled: sleep ``interval``, and record how much later than asked the
        loop woke us (a callback that held it: an 8 MiB encode was one, issue #16)."""
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + interval
            await asyncio.sleep(interval)
            lag = max(loop.time() - asked, 0.0)
            self.loop_lag_seconds.observe(lag)
            self.loop_lag_max = max(self.loop_lag_max, lag)

    def on_final(self, record: ExecutionRecord) -> None:
        self.executions.labels(record.status.value).inc()
        if record.started_at is not None:
            self.execution_seconds.observe(record.duration)
            self.queue_wait_seconds.observe((record.started_at - record.queued_at).total_seconds())

    def on_start(self, seconds: float) -> None:
        self.start_seconds.observe(seconds)

    def watch(self, manager: SessionManager) -> None:
        self.registry.register(_LiveCollector(manager))
        self.session_registry.register(_SessionCollector(manager))

    def exposition(self, *, per_session: bool) -> bytes:
        """The Prometheus text: the totals, and with ``per_session`` the per-session series."""
        text = generate_latest(self.registry)
        return text + generate_latest(self.session_registry) if per_session else text

    def on_batch_wait(self, seconds: float) -> None:
        self.batch_wait_seconds.observe(seconds)

    def on_batch_item(self, status: ExecutionStatus) -> None:
        self.batch_items.labels(status.value).inc()

    def watch_batches(self, runner: BatchRunner) -> None:
        self.registry.register(_BatchCollector(runner))


class _BatchCollector(Collector):
    """Read at scrape time: batch items waiting for a slot, and running."""

    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "kernelhub_batch_queue_length", "Batch items waiting for a slot, all batches",
            value=self.runner.queue_length,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "kernelhub_batch_items_running", "Batch items running (KERNELHUB_BATCH__CONCURRENCY at most)",
            value=self.runner.running,
        )  # fmt: skip


class _LiveCollector(Collector):
    """Read at scrape time: sessions by state, queue lengths, the pool."""

    def __init__(self, manager: SessionManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        by_state: dict[str, int] = {}
        queued = GaugeMetricFamily("kernelhub_queue_length", "Executions waiting, all sessions")
        total_queued = 0
        for live in self.manager.sessions.values():
            state = live.state.value  # the state machine's, as GET /v1/sessions/{id} says
            by_state[state] = by_state.get(state, 0) + 1
            if live.kernel is not None and live.kernel.alive:
                total_queued += live.kernel.queue_length
        sessions = GaugeMetricFamily(
            "kernelhub_sessions", "Live sessions by state", labels=["state"]
        )
        for state in SessionState:
            if state != SessionState.DELETED:  # deleted sessions are not held
                sessions.add_metric([state.value], by_state.get(state.value, 0))
        queued.add_metric([], total_queued)
        yield sessions
        yield queued
        pool = self.manager.pool
        yield GaugeMetricFamily(
            "kernelhub_pool_ready", "Warm sandboxes ready for new sessions", value=pool.ready
        )
        yield GaugeMetricFamily(
            "kernelhub_pool_size", "Warm sandboxes the pools keep (KERNELHUB_POOL__SIZE, KERNELHUB_POOL__PROFILES)",
            value=pool.size,
        )  # fmt: skip
        takes = CounterMetricFamily(
            "kernelhub_pool_takes", "Sessions created with the pool on, by whether a warm "
            "sandbox was ready", labels=["result"],
        )  # fmt: skip
        takes.add_metric(["hit"], pool.hits)
        takes.add_metric(["miss"], pool.misses)
        yield takes


class _SessionCollector(Collector):
    """Read at scrape time: each sandbox's CPU and memory, labelled with its session id."""

    def __init__(self, manager: SessionManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[GaugeMetricFamily]:
        cpu = GaugeMetricFamily(
            "kernelhub_sandbox_cpu_seconds", "Sandbox CPU time", labels=["session"]
        )
        mem = GaugeMetricFamily(
            "kernelhub_sandbox_memory_bytes", "Sandbox memory in use", labels=["session"]
        )
        for live in self.manager.sessions.values():
            if live.kernel is not None and live.kernel.alive:
                usage = live.kernel.usage()
                if usage.cpu_seconds is not None:
                    cpu.add_metric([live.id], usage.cpu_seconds)
                if usage.memory_bytes is not None:
                    mem.add_metric([live.id], usage.memory_bytes)
        yield cpu
        yield mem
