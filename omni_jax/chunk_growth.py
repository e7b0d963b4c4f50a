"""How streamed chunks grow, for both code2wav families' chunk plans.

Every streamed chunk decodes some context again (Qwen2.5-Omni's DiT its past and future frames,
Qwen3-Omni's ConvNet its left context), so fixed chunks pay that context once per chunk. Doubling
chunks keep the first audio as early (the first chunks stay small) while the context becomes a
small share of the work; the cost is buffer margin: the next chunk needs about as many new codes
as all chunks before it voiced, so the talker must run that much faster than real time for
playback not to wait.
"""

from __future__ import annotations


def doubling(chunk: int, largest: int) -> list[int]:
    """The sizes ``chunk, 2 * chunk, 4 * chunk, ...`` below ``largest`` (empty when ``chunk``
    is not below it): the growing chunks, each later one of ``largest``."""
    sizes = []
    while chunk * 2 ** len(sizes) < largest:
        sizes.append(chunk * 2 ** len(sizes))
    return sizes


def grown_size(index: int, first: int, chunk: int, largest: int) -> int:
    """The size of chunk ``index`` when it is not its request's last: ``first``, then the
    :func:`doubling` sizes from ``chunk``, then ``largest``."""
    if index == 0:
        return first
    growing = doubling(chunk, largest)
    return growing[index - 1] if index <= len(growing) else largest
