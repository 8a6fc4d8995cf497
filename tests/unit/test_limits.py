"""``resolve_limits`` with data: what a session asks for replaces the default within the
operator's maximum (or a profile's tier, which is both); above it, the error names the
wire field, the value and the maximum."""

from __future__ import annotations

from typing import Any

import pytest

from kernelhub.config import Limits, Settings, load_settings
from kernelhub.errors import InvalidRequestError
from kernelhub.profiles import resolve_limits
from kernelhub.wire import LimitsIn

MiB = 2**20
MAX = Limits(
    memory_bytes=1024 * MiB, cpus=2.0, pids=512, workspace_bytes=512 * MiB,
    cell_timeout=600.0, output_bytes=8 * MiB, output_events=1000,
)  # fmt: skip


@pytest.fixture(scope="module")
def operator() -> Settings:
    return load_settings(gateway={"max_limits": MAX.model_dump()})


def test_nothing_asked_gives_the_defaults(operator: Settings) -> None:
    assert resolve_limits(operator, LimitsIn()) == operator.limits


@pytest.mark.parametrize(
    ("asked", "field", "value"),
    [
        ({"memory_bytes": 1024 * MiB}, "memory_bytes", 1024 * MiB),  # the maximum itself
        ({"cpus": 0.5}, "cpus", 0.5),
        ({"pids": 64}, "pids", 64),
        ({"disk_bytes": 64 * MiB}, "workspace_bytes", 64 * MiB),  # the wire name differs
        ({"cell_timeout": 5.0}, "cell_timeout", 5.0),
        ({"output_bytes": 4096}, "output_bytes", 4096),
        ({"output_events": 16}, "output_events", 16),
    ],
)
def test_what_is_asked_within_the_maximum_is_given(
    operator: Settings, asked: dict[str, Any], field: str, value: object
) -> None:
    limits = resolve_limits(operator, LimitsIn(**asked))
    assert getattr(limits, field) == value
    # Everything else stays the default.
    others = {k: v for k, v in limits.model_dump().items() if k != field}
    assert others == {k: v for k, v in operator.limits.model_dump().items() if k != field}


@pytest.mark.parametrize(
    ("asked", "message"),
    [
        ({"memory_bytes": 1024 * MiB + 1}, f"limits.memory_bytes={1024 * MiB + 1} is above the maximum {1024 * MiB}"),
        ({"cpus": 2.5}, "limits.cpus=2.5 is above the maximum 2.0"),
        ({"disk_bytes": 513 * MiB}, f"limits.disk_bytes={513 * MiB} is above the maximum {512 * MiB}"),
        ({"cell_timeout": 601.0}, "limits.cell_timeout=601.0 is above the maximum 600.0"),
        ({"output_events": 1001}, "limits.output_events=1001 is above the maximum 1000"),
    ],
)  # fmt: skip
def test_above_the_maximum_is_refused_naming_field_value_and_maximum(
    operator: Settings, asked: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        resolve_limits(operator, LimitsIn(**asked))
    assert message in str(caught.value)


def test_no_maximum_means_any_value(operator: Settings) -> None:
    uncapped = operator.model_copy(
        update={"gateway": operator.gateway.model_copy(
            update={"max_limits": MAX.model_copy(update={"cell_timeout": None})}
        )}
    )  # fmt: skip
    assert resolve_limits(uncapped, LimitsIn(cell_timeout=10**7)).cell_timeout == 10**7


def test_a_tier_is_both_the_defaults_and_the_maximum(operator: Settings) -> None:
    tier = Limits(memory_bytes=256 * MiB, cpus=0.5, pids=128, output_events=100)
    assert resolve_limits(operator, LimitsIn(), tier) == tier
    assert resolve_limits(operator, LimitsIn(pids=64), tier).pids == 64
    # The operator's maximum would allow 2 cpus; the tier does not.
    with pytest.raises(InvalidRequestError, match=r"limits\.cpus=1\.0 is above the maximum 0\.5"):
        resolve_limits(operator, LimitsIn(cpus=1.0), tier)
