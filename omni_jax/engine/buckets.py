"""Shape buckets: the few padded sizes every jitted program is compiled for.

A dimension that varies with the workload (an AR step's token rows and sequences, a generation
stage's rows and codes) is padded up to a size from a closed set: a power of two (:func:`bucket`) or,
where padding is paid in compute, one of a few sizes per octave (:func:`fine_bucket`,
:func:`ladder`). The number of distinct programs is then a small multiple of the logarithm of
the largest size, all compiled at warm-up, so steady-state serving never compiles.
:func:`padded_split` cuts a batch of items into the groups that run most cheaply at such sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MIN_ROWS = 2
"""Steps carry at least two rows. With one row and one token, XLA rewrites the cache scatter
as a dynamic-update-slice and, on CPU, copies every layer's whole cache each step; with two
rows it keeps the scatter, which writes the new slots in place."""


def ceil_div(a: int, b: int) -> int:
    """``a / b`` rounded up (``b > 0``)."""
    return -(-a // b)


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is ``>= n``."""
    return ceil_div(n, multiple) * multiple


def max_sequence_rows(max_num_seqs: int, data: int = 1) -> int:
    """Sequence rows of an AR stage's largest step: ``max_num_seqs`` bucketed, at least
    :data:`MIN_ROWS`, a multiple of the ``data`` mesh axis (each shard the same rows)."""
    return round_up(max(MIN_ROWS, bucket(max_num_seqs)), data)


def max_token_rows(max_num_batched_tokens: int, max_rows: int, held_tokens: int, data: int = 1) -> int:
    """Token rows of an AR stage's largest flat step: the budget's tokens (a prompt step), or
    fewer where the sequences cannot hold that many (``held_tokens``: ``max_num_seqs *
    max_model_len``; no step computes more tokens than its sequences have, so a budget above it
    would only add a program no step fills and a step the memory plan need not hold), or
    ``max_rows`` (a decode step of every sequence), a multiple of ``data``."""
    return round_up(max(min(max_num_batched_tokens, held_tokens), max_rows), data)


def next_pow2(n: int, minimum: int = 1) -> int:
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
    """Smallest power of two ``>= n`` (and ``>= minimum``), capped at ``maximum``."""
    b = next_pow2(n, minimum)
    if maximum is not None:
        if n > maximum:
            raise ValueError(f"size {n} exceeds the largest bucket {maximum}")
        b = min(b, maximum)
    return b


def fine_bucket(n: int, minimum: int = 1, steps: int = 2) -> int:
    """Smallest size ``>= n`` (and ``>= minimum``) of the form ``2^k * (1 + j / steps)``, ``0 <= j < steps``.

    ``steps`` (a power of two) sizes per octave: with 2, ``2^k`` or ``3 * 2^(k-1)``. For lengths
    where padding is paid in compute: with 2 steps at most a third is wasted instead of half,
    for twice the number of programs; with 8 steps at most a ninth. Sizes up to ``steps`` stay
    powers of two.
    """
    p = next_pow2(n, minimum)
    half = p // 2
    if half < steps:
        return p
    need = max(n, minimum)
    for j in range(1, steps):
        if half + j * half // steps >= need:
            return half + j * half // steps
    return p


def ladder(minimum: int, maximum: int, steps: int = 2) -> tuple[int, ...]:
    """Every size :func:`fine_bucket` (``steps`` sizes per octave) gives from ``minimum`` below
    ``maximum``, then ``maximum`` itself: a closed set, ascending, in which the smallest size
    ``>= n`` pads any ``n <= maximum``."""
    sizes, size = [], fine_bucket(1, minimum, steps)
    while size < maximum:
        sizes.append(size)
        size = fine_bucket(size + 1, minimum, steps)
    return (*sizes, maximum)


def padded_split(
    sizes: Sequence[int],
    rows: Callable[[int], int],
    overhead: float,
    fits: Callable[[int, int], bool] | None = None,
) -> list[tuple[int, int]]:
    """Bounds ``[a, b)`` of the contiguous groups that run items of padded ``sizes`` (sorted,
    ascending) most cheaply, one program call each.

    A group of ``k`` items costs ``rows(k) * sizes[b - 1]`` (its rows bucketed, each padded to
    its longest item) plus ``overhead`` per call; the split is exact, a dynamic program over the
    items. Ties go to the earlier cut, so to fewer, larger groups at the front. ``fits(rows,
    size)``: whether a group of that shape may run at all (default: any); it must accept a
    group of one item, so that every split has a way through.
    """
    n = len(sizes)
    row_buckets = [0] + [rows(k) for k in range(1, n + 1)]
    best = [0.0] * (n + 1)
    cut = [0] * (n + 1)
    for b in range(1, n + 1):
        best[b], cut[b] = min(
            (best[a] + row_buckets[b - a] * sizes[b - 1] + overhead, a)
            for a in range(b)
            if fits is None or fits(row_buckets[b - a], sizes[b - 1])
        )
    bounds, b = [], n
    while b:
        bounds.append((cut[b], b))
        b = cut[b]
    return bounds[::-1]
