"""Several replies read as one HTTP response: a request's ``n`` choices, and a completion's
prompts, each an engine request of its own (:meth:`~omni_jax.serve.convert.ServeRequest.choices`).

They run side by side in the engine (batched like any other requests). A request is admitted
when all of its replies are (:func:`admit`: each taken in by the engine, not yet its first
token, so that a reply queued behind a full batch does not hold back the others): one refused
closes the others (aborting them) and its refusal is the request's (:class:`Refused`, naming
the reply, so that a refusal of one of several prompts can say which). A streamed response
interleaves their events as they come, each with its choice's index (:func:`merged`); a whole one
waits for all of them, or for the first that fails (:func:`gathered`), which ends the others.

Closing is shielded from cancellation: a client gone cancels the response's task at every
await, and the replies still running must be aborted all the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

import anyio

from omni_jax.serve.reply import End, Piece, Usage

Replies = Sequence[AsyncIterator[Piece | End]]
Firsts = list["asyncio.Future[Piece | End]"]
"""Each reply's first event, being awaited since its admission."""


class Refused(Exception):
    """Reply ``index`` (its choice's index) raised ``error`` before it was admitted: what the
    engine refuses it with (``ValueError``, ``QueueFullError``), or what failed."""

    def __init__(self, index: int, error: BaseException):
        super().__init__(f"reply {index}: {error}")
        self.index = index
        self.error = error


async def admit(replies: Replies, admitted: Sequence[asyncio.Event]) -> Firsts:
    """Start every reply and return once each is admitted (its ``admitted`` set) or has ended
    early; when any is refused (or this is cancelled), every reply is closed and the first
    refusal, in the replies' order, raised as :class:`Refused`."""
    firsts: Firsts = [asyncio.ensure_future(anext(r)) for r in replies]  # type: ignore[arg-type]
    try:
        for index, (first, signal) in enumerate(zip(firsts, admitted, strict=True)):
            waiting = asyncio.ensure_future(signal.wait())
            try:
                await asyncio.wait({first, waiting}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiting.cancel()
            error = first.exception() if first.done() and not first.cancelled() else None
            if error is not None:
                raise Refused(index, error) from error
    except BaseException:
        await end(firsts, replies)
        raise
    return firsts


async def end(tasks: Sequence[asyncio.Future], replies: Replies) -> None:  # type: ignore[type-arg]
    """Cancel what still reads the replies (``tasks``), then close every reply: those still
    running are aborted in the engine."""
    for task in tasks:
        task.cancel()
    with anyio.CancelScope(shield=True):
        await asyncio.gather(*tasks, return_exceptions=True)
        for r in replies:
            await r.aclose()  # type: ignore[attr-defined]


async def merged(replies: Replies, firsts: Firsts) -> AsyncIterator[tuple[int, Piece | End]]:
    """``(choice index, event)`` as the replies make them, until every reply has ended. Closed
    early (the client gone), it ends every reply."""
    queue: asyncio.Queue[tuple[int, Piece | End | BaseException]] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            event = await firsts[index]
            await queue.put((index, event))
            while not isinstance(event, End):
                event = await anext(replies[index])
                await queue.put((index, event))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((index, e))

    pumps = [asyncio.ensure_future(pump(i)) for i in range(len(replies))]
    try:
        left = len(replies)
        while left:
            index, event = await queue.get()
            if isinstance(event, BaseException):
                raise event
            left -= isinstance(event, End)
            yield index, event
    finally:
        await end([*pumps, *firsts], replies)


@dataclasses.dataclass(frozen=True)
class Gathered:
    """A whole reply (choice ``index``): its text, its audio pieces, its tokens'
    log-probabilities (when asked) and its end."""

    index: int
    text: str
    audio: list[Piece]
    logprobs: list[dict[int, float]]
    end: End


async def gathered(replies: Replies, firsts: Firsts) -> list[Gathered]:
    """Every reply read to its end, side by side, in choice order; or, as soon as one fails
    (``finish_reason`` ``"error"``), that one alone, the others ended at once."""
    jobs = [
        asyncio.ensure_future(_gather(i, r, f)) for i, (r, f) in enumerate(zip(replies, firsts, strict=True))
    ]
    try:
        pending: set[asyncio.Future[Gathered]] = set(jobs)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = [job.result() for job in done if job.result().end.finish_reason == "error"]
            if failed:
                return failed
        return [job.result() for job in jobs]
    finally:
        await end([*jobs, *firsts], replies)


async def _gather(
    index: int, events: AsyncIterator[Piece | End], first: asyncio.Future[Piece | End]
) -> Gathered:
    text, audio, entries = [], [], []
    event = await first
    while not isinstance(event, End):
        text.append(event.text)
        entries += event.logprobs
        if event.audio is not None:
            audio.append(event)
        event = await anext(events)
    return Gathered(index, "".join(text), audio, entries, event)


def total_usage(ends: dict[int, End], n: int) -> Usage:
    """A request's usage from its replies' ends by choice index: each prompt's tokens once (its
    ``n`` replies read the same prompt, as vLLM counts them), and every reply's own."""
    prompt = sum(e.usage.prompt_tokens for i, e in ends.items() if i % n == 0)
    return Usage(prompt, sum(e.usage.completion_tokens for e in ends.values()))
