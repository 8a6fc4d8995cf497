"""A heartbeat's row from what the node measured (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from kernelhub.cluster.heartbeat import Sample, node_info
from kernelhub.cluster.models import NodeInfo

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
GiB = 2**30


def row(**sample: float) -> NodeInfo:
    base = {"sessions": 3, "committed_bytes": 2 * GiB, "budget_bytes": 8 * GiB,
            "available_bytes": 20 * GiB, "load_1m": 3.0, "cpus": 4}  # fmt: skip
    return node_info(
        "n1",
        "https://10.0.0.5:8766",
        Sample(**{**base, **sample}),  # type: ignore[arg-type]
        started_at=NOW - timedelta(hours=1),
        now=NOW,
        lease_ttl=10.0,
        version="9.9",
    )


def test_the_row_names_the_node_its_load_and_a_lease() -> None:
    info = row()
    assert info.id == "n1" and info.address == "https://10.0.0.5:8766"
    assert info.heartbeat_at == NOW and info.lease_expires_at == NOW + timedelta(seconds=10)
    assert info.sessions == 3 and info.memory_total_bytes == 8 * GiB
    assert info.memory_free_bytes == 6 * GiB  # the budget less what was promised
    assert info.cpu_load == 0.75 and info.version == "9.9"  # per core


def test_free_memory_is_never_more_than_the_machine_has_nor_negative() -> None:
    assert row(available_bytes=GiB).memory_free_bytes == GiB
    assert row(committed_bytes=9 * GiB).memory_free_bytes == 0
    assert row(cpus=0, load_1m=1.5).cpu_load == 1.5
