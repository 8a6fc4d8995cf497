"""The code kernelhub runs in a kernel for snapshots, run here against a stand-in helper
module: what a failure inside it looks like to IPython."""

from __future__ import annotations

import sys
import traceback
import types
from collections.abc import Iterator

import pytest

from kernelhub.snapshot import calls


def _deep(n: int, exc: BaseException) -> None:
    if n == 0:
        raise exc
    _deep(n - 1, exc)


@pytest.fixture
def helper() -> Iterator[types.ModuleType]:
    """``kernelhub_kernel.snapshot`` as the calls import it; its functions are set per test."""
    package = types.ModuleType("kernelhub_kernel")
    module = types.ModuleType("kernelhub_kernel.snapshot")
    package.snapshot = module  # type: ignore[attr-defined]
    saved = {k: sys.modules.get(k) for k in ("kernelhub_kernel", "kernelhub_kernel.snapshot")}
    sys.modules.update({"kernelhub_kernel": package, "kernelhub_kernel.snapshot": module})
    yield module
    for key, value in saved.items():
        if value is None:
            sys.modules.pop(key, None)
        else:
            sys.modules[key] = value


def run_cell(code: str) -> BaseException:
    try:
        exec(compile(code, "<cell>", "exec"), {})
    except BaseException as exc:
        return exc
    raise AssertionError("the call did not fail")


def cell_frames(exc: BaseException) -> list[str]:
    return [f.filename for f in traceback.extract_tb(exc.__traceback__)][1:]  # past exec


def test_a_failure_deep_in_the_helper_reaches_ipython_shallow(
    helper: types.ModuleType,
) -> None:
    helper.capture = lambda path, base: _deep(50, ValueError("bad group"))
    helper.restore = lambda path: _deep(50, KeyboardInterrupt())
    failed = run_cell(calls.capture("snap-1", base="snap-0").code)
    assert isinstance(failed, RuntimeError) and failed.__suppress_context__
    assert cell_frames(failed) == ["<cell>"]  # nothing for IPython to highlight
    assert "ValueError: bad group" in str(failed) and "_deep" in str(failed)  # kept as text
    interrupted = run_cell(calls.restore("snap-1").code)
    assert type(interrupted) is KeyboardInterrupt and interrupted.__suppress_context__
    assert cell_frames(interrupted) == ["<cell>"]


def test_a_call_that_succeeds_is_left_alone(helper: types.ModuleType) -> None:
    seen: list[tuple[str, str | None]] = []
    helper.capture = lambda path, base: seen.append((path, base))
    exec(compile(calls.capture("snap-2").code, "<cell>", "exec"), {})
    assert seen == [("/tmp/.kernelhub/snap-2", None)]
    with pytest.raises(ValueError, match="alphanumeric"):
        calls.capture("../x")


def test_call_spans_split_the_call_around_the_kernels_own_clock() -> None:
    result = {"started_at": 100.004, "ended_at": 100.020}
    spans = calls.call_spans(result, called_at=100.0, answered_at=100.023)
    assert spans == pytest.approx({"call": 0.023, "to_kernel": 0.004, "from_kernel": 0.003})


def test_call_spans_of_an_old_image_are_only_the_call() -> None:
    assert calls.call_spans({"duration": 0.01}, 5.0, 5.5) == {"call": 0.5}
    assert calls.call_spans({"started_at": "x", "ended_at": 1}, 5.0, 5.5) == {"call": 0.5}


def test_kernel_timings_keep_the_numbers_and_the_total() -> None:
    report = {"duration": 0.0151, "timings": {"classify": 0.0002, "group": 0.0007, "bad": "x"}}
    assert calls.kernel_timings(report) == {"classify": 0.0002, "group": 0.0007, "total": 0.0151}
    assert calls.kernel_timings({"duration": None, "timings": ["not", "a", "dict"]}) == {}
    assert calls.kernel_timings(None) == {}
