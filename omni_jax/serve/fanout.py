"""Several replies read as one HTTP response: a request's ``n`` choices, and a completion's
prompts, each an engine request of its own (:meth:`~omni_jax.serve.convert.ServeRequest.choices`).

They run side by side in the engine (batched like any other requests). A request is admitted
when all of its replies are: one refused closes the others (aborting them) and its refusal is
the request's. A streamed response interleaves their events as they come, each with its
choice's index; a whole one waits for all of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

from omni_jax.serve.reply import End, Piece, Usage

Replies = Sequence[AsyncIterator[Piece | End]]


async def firsts(replies: Replies) -> list[Piece | End]:
    """Each reply's first event (it comes once the stages admitted it), awaited together; when
    any is refused (or all are cancelled), every reply is closed and the first refusal raised."""
    got = await asyncio.gather(*(anext(r) for r in replies), return_exceptions=True)
    refused = [g for g in got if isinstance(g, BaseException)]
    if refused:
        await close(replies)
        raise refused[0]
    return got  # type: ignore[return-value]


async def close(replies: Replies) -> None:
    """Close every reply: those still running are aborted in the engine."""
    for r in replies:
        await r.aclose()  # type: ignore[attr-defined]


async def merged(replies: Replies, first: list[Piece | End]) -> AsyncIterator[tuple[int, Piece | End]]:
    """``(choice index, event)`` as the replies make them, their first events first, until every
    reply has ended. Closed early (the client gone), it closes every reply."""
    queue: asyncio.Queue[tuple[int, Piece | End | BaseException]] = asyncio.Queue()

    async def pump(index: int, events: AsyncIterator[Piece | End]) -> None:
        try:
            async for event in events:
                await queue.put((index, event))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((index, e))

    pumps: list[asyncio.Task[None]] = []
    try:
        for index, event in enumerate(first):
            yield index, event
        running = [i for i, event in enumerate(first) if not isinstance(event, End)]
        pumps = [asyncio.create_task(pump(i, replies[i])) for i in running]
        left = len(running)
        while left:
            index, event = await queue.get()
            if isinstance(event, BaseException):
                raise event
            left -= isinstance(event, End)
            yield index, event
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        await close(replies)


@dataclasses.dataclass(frozen=True)
class Gathered:
    """A whole reply: its text, its audio pieces, its tokens' log-probabilities (when asked) and
    its end."""

    text: str
    audio: list[Piece]
    logprobs: list[dict[int, float]]
    end: End


async def gathered(replies: Replies, first: list[Piece | End]) -> list[Gathered]:
    """Every reply read to its end, side by side."""
    return list(await asyncio.gather(*(_gather(r, f) for r, f in zip(replies, first, strict=True))))


async def _gather(events: AsyncIterator[Piece | End], first: Piece | End) -> Gathered:
    text, audio, entries = [], [], []
    event = first
    while not isinstance(event, End):
        text.append(event.text)
        entries += event.logprobs
        if event.audio is not None:
            audio.append(event)
        event = await anext(events)
    return Gathered("".join(text), audio, entries, event)


def total_usage(ends: dict[int, End], n: int) -> Usage:
    """A request's usage from its replies' ends by choice index: each prompt's tokens once (its
    ``n`` replies read the same prompt, as vLLM counts them), and every reply's own."""
    prompt = sum(e.usage.prompt_tokens for i, e in ends.items() if i % n == 0)
    return Usage(prompt, sum(e.usage.completion_tokens for e in ends.values()))
