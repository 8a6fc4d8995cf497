"""The issues' targets as data, and the verdict each row's number earns against its target.

A row of the report carries a :class:`Target` (``≤ 1.15×``, ``≤ 100 ms``, ``≥ 0.9×``) and
the number it is judged on (a ratio or a time: a float, or a spread over rounds with
``median``, ``lo`` and ``hi``). :func:`verdict` compares the two: the median decides, and a
median that meets a target some round did not is said so. Nothing here is typed by hand
into a table: a "met" in docs/benchmarks.md or the README is this module's answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

MiB = 2**20
UNITS = ("×", "s", "bytes")


class Ranged(Protocol):
    """A spread over rounds (``rounds.Spread``): the median and the range."""

    @property
    def median(self) -> float: ...
    @property
    def lo(self) -> float: ...
    @property
    def hi(self) -> float: ...


Measured = float | Ranged


@dataclass(frozen=True)
class Target:
    """``measured op bound``: ``op`` is ``≤`` or ``≥``; ``unit`` says how ``bound`` (and
    the measured number) are expressed: ``×`` a ratio, ``s`` seconds, ``bytes``. ``why``
    follows the bound in the table (``2× pickle.load + 0.3 s``); ``issue`` names where the
    target was set (``#20``)."""

    op: str
    bound: float
    unit: str = "×"
    why: str = ""
    issue: str = ""

    def __post_init__(self) -> None:
        if self.op not in ("≤", "≥"):
            raise ValueError(f"a target's op is ≤ or ≥, not {self.op!r}")
        if self.unit not in UNITS:
            raise ValueError(f"a target's unit is one of {', '.join(UNITS)}, not {self.unit!r}")

    def met(self, value: float) -> bool:
        return value <= self.bound if self.op == "≤" else value >= self.bound

    def __str__(self) -> str:
        text = f"{self.op} {_bound(self.bound, self.unit)}"
        extra = ", ".join(x for x in (self.why, self.issue) if x)
        return f"{text} ({extra})" if extra else text


def at_most(bound: float, unit: str = "×", *, why: str = "", issue: str = "") -> Target:
    return Target("≤", bound, unit, why, issue)


def at_least(bound: float, unit: str = "×", *, why: str = "", issue: str = "") -> Target:
    return Target("≥", bound, unit, why, issue)


def _bound(value: float, unit: str) -> str:
    if unit == "×":
        return f"{value:g}×"
    if unit == "bytes":
        return f"{value / MiB:g} MiB"
    return f"{value * 1000:.4g} ms" if value < 1 else f"{value:.3g} s"


def verdict(target: Target | str, measured: Measured | None) -> str:
    """``met`` / ``not met`` for a row, from its median; ``met (not every round)`` when the
    median meets the target and the worst round did not. A target given as text, or with
    no number to judge, reads ``not checked``; no target, nothing."""
    if not target:
        return ""
    if not isinstance(target, Target) or measured is None:
        return "not checked"
    if isinstance(measured, float | int):
        return "met" if target.met(float(measured)) else "not met"
    if not target.met(measured.median):
        return "not met"
    worst = measured.hi if target.op == "≤" else measured.lo
    return "met" if target.met(worst) else "met (not every round)"
