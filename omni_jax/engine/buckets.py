"""Shape buckets: the few padded sizes every jitted step is compiled for.

Padding each dimension up to a power of two bounds the number of distinct programs to a
logarithm of the largest size, so steady-state serving never compiles.
"""

from __future__ import annotations


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


def bucket_sizes(minimum: int, maximum: int) -> list[int]:
    """Every bucket between ``minimum`` and ``maximum`` (for warm-up)."""
    sizes, b = [], next_pow2(minimum)
    while b < maximum:
        sizes.append(b)
        b *= 2
    sizes.append(maximum)
    return sizes
