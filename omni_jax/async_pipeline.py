"""``AsyncOmniJaxPipeline``: requests arriving at any time, their output streamed to asyncio.

One engine thread (:class:`~omni_jax.engine_thread.EngineThread`) steps the same engine core
``OmniJaxPipeline.run`` uses; callers on an asyncio loop never wait on it. A request is admitted
(tokenized, prepared, validated: :mod:`omni_jax.intake`) on a worker thread of its own, so a bad
one raises ``ValueError`` before anything is queued and a large one does not stall the loop;
then it joins the running batch at the engine's next step, and its updates come back through
``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Self

import jax

from omni_jax.engine.compilation import CompileCounter
from omni_jax.engine_core import EngineStats
from omni_jax.engine_thread import EngineThread
from omni_jax.intake import Prompt, SamplingParamsList
from omni_jax.outputs import OmniRequestOutput, WarmupReport
from omni_jax.parallel.distributed import process_count_asked
from omni_jax.pipeline import OmniJaxPipeline

ONE_PROCESS = (
    "AsyncOmniJaxPipeline serves from one process: requests arrive in one process only, while a "
    "multi-process pipeline steps every process through the same schedule"
)


class QueueFullError(RuntimeError):
    """``generate`` refused a request: ``max_waiting`` requests already wait (a server's 429)."""


class AsyncOmniJaxPipeline:
    """An :class:`OmniJaxPipeline` served to asyncio callers (the public API).

    ``async with AsyncOmniJaxPipeline.from_pretrained(path) as pipe:`` (or :meth:`close`) stops
    the engine thread at the end, ending the requests still running. ``pipeline`` is the wrapped
    pipeline, for what does not touch the stages (its tokenizer, :meth:`OmniJaxPipeline.chat_prompt`);
    its ``run`` must not be called while this one serves.

    ``max_waiting``: at most this many requests wait for the first stage (:attr:`waiting`:
    queued for a place in its batch, or being admitted when its batch has no place left);
    ``generate`` refuses more with :class:`QueueFullError` before taking anything in. ``None``:
    no bound.
    """

    def __init__(self, pipeline: OmniJaxPipeline, max_waiting: int | None = None):
        if max_waiting is not None and (
            isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1
        ):
            raise ValueError(f"max_waiting={max_waiting!r} must be a positive int or None")
        if jax.process_count() > 1:
            raise ValueError(ONE_PROCESS)
        self.pipeline = pipeline
        self._engine = EngineThread(pipeline.core)
        self._intake = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-jax-intake")
        self._ids = itertools.count()
        self._live: set[str] = set()
        self._admitting = 0
        self._unheld: set[str] = set()  # claimed, still being admitted: the engine holds none
        self._aborted_unheld: set[str] = set()  # of those, aborted: ended as the engine takes them
        self.max_waiting = max_waiting
        self._compiles = CompileCounter().__enter__()  # until close(): what serving compiled
        self._counting = True

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *args: Any, max_waiting: int | None = None, **kwargs: Any
    ) -> AsyncOmniJaxPipeline:
        """Build with :meth:`OmniJaxPipeline.from_pretrained`'s arguments, and start the engine;
        ``ValueError`` before anything loads when several processes are asked for."""
        if process_count_asked() > 1:
            raise ValueError(ONE_PROCESS)
        return cls(OmniJaxPipeline.from_pretrained(path, *args, **kwargs), max_waiting=max_waiting)

    @property
    def stats(self) -> EngineStats:
        """The engine's stats after its latest step (requests per stage, free KV pages)."""
        return self._engine.stats

    @property
    def xla_compilations(self) -> int:
        """XLA programs built in this process since the pipeline started serving (warm-up's
        included), compiled or loaded from the persistent compilation cache: after
        :meth:`warmup` it must stay put, whatever the traffic."""
        return self._compiles.programs

    @property
    def waiting(self) -> int:
        """Requests waiting for the first stage: queued for a place in its batch, and those being
        admitted beyond the places it has free (the others take a place as they arrive)."""
        first = self._engine.stats.first
        if first.capacity is None:
            return first.waiting + self._admitting
        return max(first.waiting, first.running + first.waiting + self._admitting - first.capacity)

    @property
    def running(self) -> bool:
        """Whether the engine thread runs and takes requests."""
        return self._engine.alive

    async def warmup(self, progress: bool = False) -> WarmupReport:
        """:meth:`OmniJaxPipeline.warmup` on the engine thread, between steps (``progress``: its
        bar, on stderr)."""
        return await asyncio.wrap_future(self._engine.call(lambda: self.pipeline.warmup(progress=progress)))

    async def generate(
        self,
        prompt: Prompt,
        sampling_params_list: SamplingParamsList = None,
        request_id: str | None = None,
        *,
        within_context: bool = False,
        admitted: asyncio.Event | None = None,
    ) -> AsyncIterator[OmniRequestOutput]:
        """Updates of one request as it runs (see :class:`OmniRequestOutput`), the last one
        ``finished``. ``prompt`` and ``sampling_params_list`` are as for one prompt of
        :meth:`OmniJaxPipeline.run`, and refused the same way (``ValueError`` naming request 0);
        ``request_id``: unique among the requests running (default: one is made);
        ``within_context``: also refuse a first stage's ``max_tokens`` that does not fit in its
        context after the prompt (the server's rule for an explicit ``max_tokens``, as vLLM's;
        else the reply stops at the context's end, ``finish_reason="length"``); ``admitted``: set
        once the engine has taken the request in, before its first update (a server admitting
        several requests as one need not wait for their first tokens). Closing the
        generator or cancelling its consumer before the last update aborts the request.
        ``RuntimeError`` once the pipeline is closed; :class:`QueueFullError` when
        ``max_waiting`` requests wait already (both before anything is taken in)."""
        if not self.running:
            raise RuntimeError("the engine is closed")
        if self.max_waiting is not None and self.waiting >= self.max_waiting:
            raise QueueFullError(f"{self.waiting} requests wait already (max_waiting={self.max_waiting})")
        request_id = self._claim(request_id)
        self._unheld.add(request_id)
        self._admitting += 1
        admitting = True
        try:
            loop = asyncio.get_running_loop()
            (admission,) = await loop.run_in_executor(
                self._intake,
                self.pipeline.intake.admit,
                [prompt],
                sampling_params_list,
                [request_id],
                within_context,
            )
            updates: asyncio.Queue[OmniRequestOutput] = asyncio.Queue()

            def sink(out: OmniRequestOutput) -> None:
                loop.call_soon_threadsafe(updates.put_nowait, out)

            finished = False
            try:
                added = self._engine.add(admission, sink)
                self._unheld.discard(request_id)
                if request_id in self._aborted_unheld:  # the engine runs commands in order
                    self._engine.abort(request_id)
                await asyncio.wrap_future(added)
                self._admitting -= 1  # the engine's stats count it from here
                admitting = False
                if admitted is not None:
                    admitted.set()
                while not finished:
                    out = await updates.get()
                    finished = out.finished
                    yield out
            finally:
                if not finished:
                    self._engine.abort(request_id)
        finally:
            self._live.discard(request_id)
            self._unheld.discard(request_id)
            self._aborted_unheld.discard(request_id)
            if admitting:
                self._admitting -= 1

    async def prompt_token_ids(self, prompt: Prompt) -> list[int]:
        """:meth:`OmniJaxPipeline.prompt_token_ids`, on the thread that admits requests (the
        processors are not shared between threads)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._intake, self.pipeline.prompt_token_ids, prompt)

    async def abort(self, request_id: str) -> None:
        """Take the request out of whichever stage holds it, freeing its KV pages or its place in
        the solve queue; its ``generate`` ends with ``finish_reason="abort"``. A request still
        being admitted (its prompt processed, its media decoded) is ended the moment the engine
        takes it in, before it runs a step. Nothing happens for a request that is not running."""
        if request_id in self._unheld:
            self._aborted_unheld.add(request_id)
            return
        await asyncio.wrap_future(self._engine.abort(request_id))

    def close(self) -> None:
        """End the running requests (``finish_reason="abort"``) and stop the engine thread."""
        self._engine.close()
        self._intake.shutdown(wait=True, cancel_futures=True)
        if self._counting:  # close() may come twice (explicitly, then leaving ``async with``)
            self._counting = False
            self._compiles.__exit__(None, None, None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)

    def _claim(self, request_id: str | None) -> str:
        """``request_id``, or a fresh one, reserved for one ``generate``."""
        if request_id is None:
            request_id = next(i for i in map(str, self._ids) if i not in self._live)
        elif not isinstance(request_id, str) or request_id in self._live:
            raise ValueError(f"request_id must be a str not in use by a running request, got {request_id!r}")
        self._live.add(request_id)
        return request_id
