"""How an encoder's inputs are cut into calls: a fixed ladder of call sizes, and the cheapest split
of a run of items into calls whose sizes come from that ladder.

Every encoder call is padded to a size of its ladder, so the encoder has one compiled program per
ladder size and no more; the split may choose among those sizes (by a cost the encoder gives),
never invent one. Items keep their order: each call takes a consecutive run of them.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence


def size_ladder(unit: int, largest: int, per_octave: int = 1) -> tuple[int, ...]:
    """Sizes ``unit * 2^k * (1 + j / per_octave)`` (multiples of ``unit`` only), from ``unit`` up to
    the first that is ``>= largest``.

    ``per_octave`` (a power of two) sizes per doubling: 1 gives powers of two times ``unit`` (up
    to half of a call is padding), 2 adds the sizes halfway (up to a third), for twice the programs.
    """
    if unit < 1 or per_octave < 1 or per_octave & (per_octave - 1):
        raise ValueError(
            f"size_ladder needs unit >= 1 and per_octave a power of two, got {unit}, {per_octave}"
        )
    sizes = [unit]
    octave = unit
    while sizes[-1] < largest:
        for j in range(1, per_octave + 1):
            size = octave + octave * j // per_octave
            if size % unit == 0 and size > sizes[-1]:
                sizes.append(size)
                if size >= largest:
                    break
        octave *= 2
    return tuple(sizes)


def smallest_fit(sizes: Sequence[int], n: int) -> int:
    """The smallest of ``sizes`` (ascending) that holds ``n``."""
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"{n} exceeds the largest call size {sizes[-1]}")
    return sizes[i]


@dataclasses.dataclass(frozen=True)
class CallPlan:
    """One call: items ``start:stop`` of the run, padded to ``size``."""

    start: int
    stop: int
    size: int


def plan_calls(sizes: Sequence[int], ladder: Sequence[int], cost: Callable[[int], float]) -> list[CallPlan]:
    """The cheapest cut of items of ``sizes`` (in order) into calls of ``ladder`` sizes.

    A call holding items whose sizes sum to ``n`` is padded to ``smallest_fit(ladder, n)`` and
    costs ``cost`` of that size (the caller's cost includes what one more call costs). Exact: a
    dynamic program over the cut points; among equal costs the fewer calls win. An item larger
    than the largest size raises ``ValueError`` (callers refuse such inputs before any work).
    """
    largest = ladder[-1]
    for i, n in enumerate(sizes):
        if n > largest:
            raise ValueError(f"item {i} has size {n}, more than the largest call size {largest}")
    best: list[tuple[float, int]] = [(0.0, 0)]
    back: list[CallPlan] = []
    for stop in range(1, len(sizes) + 1):
        total, choice, plan = 0, None, None
        for start in range(stop - 1, -1, -1):
            total += sizes[start]
            if total > largest:
                break
            size = smallest_fit(ladder, total)
            candidate = (best[start][0] + cost(size), best[start][1] + 1)
            if choice is None or candidate < choice:
                choice, plan = candidate, CallPlan(start, stop, size)
        assert choice is not None and plan is not None  # every item fits alone (checked above)
        best.append(choice)
        back.append(plan)
    plans: list[CallPlan] = []
    stop = len(sizes)
    while stop:
        plans.append(back[stop - 1])
        stop = plans[-1].start
    return plans[::-1]
