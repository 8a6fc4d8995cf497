"""Interleaved rounds and their spread: how every comparison of the suite is sampled.

A shared 2-core machine drifts by tens of percent within a minute, so two numbers are only
comparable when they were taken side by side. :func:`interleave` runs every contender once
per turn, several turns per round, and rotates who goes first from one round to the next,
after untimed warm-up turns. A row then reports the median of the rounds' own medians with
their [min–max] (:class:`Spread`), and a ratio as the median of the rounds' own ratios: a
slow patch that hits one round shows in the spread instead of deciding the figure.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from report import median

Stat = Callable[[Sequence[float]], float]


def rotated(names: Sequence[str], shift: int) -> list[str]:
    """``names`` starting at ``shift`` (mod its length): round ``r`` starts with the r-th."""
    k = shift % len(names)
    return [*names[k:], *names[:k]]


@dataclass(frozen=True)
class Spread:
    """The median of per-round values and their range."""

    median: float
    lo: float
    hi: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("a spread of no values")
        return cls(median(values), min(values), max(values))


@dataclass(frozen=True)
class Rounds:
    """Samples per contender, per round: ``samples[name][round]`` is a list of seconds."""

    samples: dict[str, list[list[float]]]

    @property
    def names(self) -> list[str]:
        return list(self.samples)

    def spread(self, name: str, stat: Stat = median) -> Spread:
        """``stat`` of each round of ``name``, as a spread over the rounds."""
        return Spread.of([stat(r) for r in self.samples[name]])

    def ratio(self, name: str, floor: str, stat: Stat = median) -> Spread:
        """``name`` over ``floor``, round by round (both measured in the same turns)."""
        return Spread.of(
            [
                stat(a) / stat(b)
                for a, b in zip(self.samples[name], self.samples[floor], strict=True)
            ]
        )

    def pooled(self, name: str) -> list[float]:
        return [x for r in self.samples[name] for x in r]


async def interleave(
    runners: dict[str, Callable[[], Awaitable[float]]],
    *,
    rounds: int,
    per_round: int,
    warmup: int = 0,
) -> Rounds:
    """Each runner once per turn, ``per_round`` turns a round, the first runner rotating
    from round to round; ``warmup`` untimed turns first."""
    names = list(runners)
    for _ in range(warmup):
        for name in names:
            await runners[name]()
    samples: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(rounds):
        batch: dict[str, list[float]] = {name: [] for name in names}
        order = rotated(names, r)
        for _ in range(per_round):
            for name in order:
                batch[name].append(await runners[name]())
        for name in names:
            samples[name].append(batch[name])
    return Rounds(samples)
