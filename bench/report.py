"""The benchmark report: rows, number formatting, the machine description, Markdown.

Every section of ``bench/suite.py`` returns :class:`Row` objects; this module turns them
and the machine they ran on into ``docs/benchmarks.md``.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from targets import Measured, Target, verdict

import kernelhub

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20


class Unavailable(Exception):
    """A measurement this gateway or machine cannot make; the message says why, and the
    report shows it in place of the number."""


@dataclass(frozen=True)
class Row:
    """One line of the table. ``value`` is kernelhub's number, ``floor`` what it is
    compared with (measured in the same run), ``ratio`` value / floor. ``target`` is the
    issue's bound (``targets.at_most(1.15)``), ``measured`` the number judged against it
    (the ratio's or the value's spread, in the target's unit): the "met" column is
    computed from the two (``targets.verdict``)."""

    section: str
    measurement: str
    value: str
    floor: str = ""
    ratio: str = ""
    target: Target | str = ""
    measured: Measured | None = None

    @property
    def verdict(self) -> str:
        return verdict(self.target, self.measured)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def seconds(value: float) -> str:
    return ms(value) if value < 1 else f"{value:.2f} s"


def mib(nbytes: float) -> str:
    return f"{nbytes / MiB:.1f} MiB"


def ratio(value: float, floor: float) -> str:
    return f"{value / floor:.2f}×"


def spread(value: Any, unit: Callable[[float], str] = ms) -> str:
    """A :class:`rounds.Spread` as ``median [min–max]`` in ``unit``; the unit is written
    once when all three share it (``7.44 ms [7.10–7.90]``)."""
    mid, lo, hi = unit(value.median), unit(value.lo), unit(value.hi)
    suffix = mid.rpartition(" ")[2] if " " in mid else ""
    if suffix and lo.endswith(" " + suffix) and hi.endswith(" " + suffix):
        lo, hi = lo.rpartition(" ")[0], hi.rpartition(" ")[0]
    return f"{mid} [{lo}–{hi}]"


def times(value: Any) -> str:
    """A ratio :class:`rounds.Spread`: ``1.34× [1.20–1.51]``."""
    return f"{value.median:.2f}× [{value.lo:.2f}–{value.hi:.2f}]"


def per_second(value: float) -> str:
    return f"{value:.0f}/s"


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def quantile(samples: Sequence[float], q: float) -> float:
    """The sample at rank ``q`` (nearest rank: with few samples, a real observation)."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_total() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) * 1024 / 2**30:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def _git_revision() -> str:
    # A run from an exported tree (no .git) says which commit it was exported from.
    if tree := os.environ.get("BENCH_TREE"):
        return tree
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    return f"{head}{' with uncommitted changes' if dirty else ''}"


def describe_machine(
    docker_info: dict[str, Any], docker_version: dict[str, Any], *, runtime: str, image: str
) -> list[tuple[str, str]]:
    """What the numbers were measured on, as (name, value) pairs. ``docker_info`` and
    ``docker_version`` are the daemon's ``/info`` and ``/version`` answers."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    cgroup = docker_info.get("CgroupVersion") or (
        "2" if Path("/sys/fs/cgroup/cgroup.controllers").exists() else "1"
    )
    return [
        ("CPU", f"{_cpu_model()}, {os.cpu_count()} cores ({platform.machine()})"),
        ("memory", _memory_total()),
        ("Linux kernel", platform.release()),
        ("cgroup", f"v{cgroup} ({docker_info.get('CgroupDriver', 'unknown driver')})"),
        ("Docker", f"{docker_version.get('Version')} (API {docker_version.get('ApiVersion')})"),
        ("runtime", f"{runtime} (daemon default: {docker_info.get('DefaultRuntime')})"),
        ("kernel image", image),
        ("Python (host)", f"{platform.python_implementation()} {platform.python_version()}"),
        ("kernelhub", f"{kernelhub.__version__}, {_git_revision()}"),
        ("date", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())),
        ("cores", f"{os.cpu_count()}, shared with the other work on this machine"),
        ("load average at start", f"{load} (1, 5, 15 min)"),
    ]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Markdown table lines."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows],
    ]


RESULT_HEADER = ["section", "measurement", "kernelhub", "floor (same run)", "ratio", "target",
                 "met"]  # fmt: skip


def result_cells(row: Row) -> list[str]:
    return [row.section, row.measurement, row.value, row.floor, row.ratio, str(row.target),
            row.verdict]  # fmt: skip


def markdown(
    *,
    title: str,
    preamble: Sequence[str],
    machine: Sequence[tuple[str, str]],
    rows: Sequence[Row],
    notes: Sequence[tuple[str, str]],
    charts: Sequence[tuple[str, str]] = (),
    sections: Sequence[tuple[str, float, str]] = (),
) -> str:
    """The whole report: preamble, machine, each section's time and the load average
    before it (name, seconds, load), one table of every row, the charts (title, path
    relative to the report), per-section notes."""
    lines = [f"# {title}", "", *preamble, "", "## Machine", ""]
    lines += table(["", ""], [[name, value] for name, value in machine])
    if sections:
        lines += ["", "## Sections", ""]
        lines += table(
            ["section", "took", "load average before it (1, 5, 15 min)"],
            [[name, f"{took:.0f} s", load] for name, took, load in sections],
        )
    lines += ["", "## Results", ""]
    lines += table(RESULT_HEADER, [result_cells(r) for r in rows])
    if charts:
        lines += ["", "## Charts", ""]
        for chart_title, path in charts:
            lines += [f"![{chart_title}]({path})", ""]
    lines += ["", "## Notes", ""]
    for section, note in notes:
        lines += [f"**{section}.** {note}", ""]
    return "\n".join(lines)


BLOCK_START = "<!-- bench:start -->"
BLOCK_END = "<!-- bench:end -->"


def headline(rows: Sequence[Row], source: str) -> str:
    """The README's block: every row with a target, its number, ratio and verdict, under
    one line saying which run they come from (``source``)."""
    targeted = [r for r in rows if r.target]
    met = sum(r.verdict.startswith("met") for r in targeted)
    lines = [f"{source} {met} of {len(targeted)} targets met.", ""]
    lines += table(
        ["measurement", "kernelhub", "ratio", "target", "met"],
        [[f"{r.section}: {r.measurement}", r.value, r.ratio, str(r.target), r.verdict]
         for r in targeted],
    )  # fmt: skip
    return "\n".join(lines)


def rewrite_block(text: str, block: str) -> str:
    """``text`` with what lies between :data:`BLOCK_START` and :data:`BLOCK_END` replaced
    by ``block`` (the markers stay, each on its own line)."""
    start, end = text.find(BLOCK_START), text.find(BLOCK_END)
    if text.count(BLOCK_START) != 1 or text.count(BLOCK_END) != 1 or end < start:
        raise ValueError(
            f"expected one {BLOCK_START} followed by one {BLOCK_END}; add them where the"
            " benchmark numbers go"
        )
    head = text[: start + len(BLOCK_START)]
    return f"{head}\n{block.strip()}\n{text[end:]}"
