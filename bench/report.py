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

import kernelhub

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20


class Unavailable(Exception):
    """A measurement this gateway or machine cannot make; the message says why, and the
    report shows it in place of the number."""


@dataclass(frozen=True)
class Row:
    """One line of the table. ``value`` is kernelhub's number, ``floor`` what it is
    compared with (measured in the same run), ``ratio`` value / floor."""

    section: str
    measurement: str
    value: str
    floor: str = ""
    ratio: str = ""
    target: str = ""


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


def markdown(
    *,
    title: str,
    preamble: Sequence[str],
    machine: Sequence[tuple[str, str]],
    rows: Sequence[Row],
    notes: Sequence[tuple[str, str]],
    charts: Sequence[tuple[str, str]] = (),
) -> str:
    """The whole report: preamble, machine, one table of every row, the charts (title,
    path relative to the report), per-section notes."""
    lines = [f"# {title}", "", *preamble, "", "## Machine", ""]
    lines += table(["", ""], [[name, value] for name, value in machine])
    lines += ["", "## Results", ""]
    lines += table(
        ["section", "measurement", "kernelhub", "floor (same run)", "ratio", "target"],
        [[r.section, r.measurement, r.value, r.floor, r.ratio, r.target] for r in rows],
    )
    if charts:
        lines += ["", "## Charts", ""]
        for chart_title, path in charts:
            lines += [f"![{chart_title}]({path})", ""]
    lines += ["", "## Notes", ""]
    for section, note in notes:
        lines += [f"**{section}.** {note}", ""]
    return "\n".join(lines)
