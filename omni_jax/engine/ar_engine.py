"""One AR stage's engine: a scheduler deciding steps and a runner executing them."""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Sequence
from typing import Generic

from omni_jax.engine.ar_runner import ARRunner, Dispatched
from omni_jax.engine.kv_cache import PageAllocator
from omni_jax.engine.sampling import MIN_TEMPERATURE, SamplingParams
from omni_jax.engine.scheduler import ARRequest, Scheduler, SchedulerConfig
from omni_jax.engine.step import S, StepRow
from omni_jax.parallel.distributed import request_seed
from omni_jax.profiling import scope

log = logging.getLogger(__name__)


class AREngine(Generic[S]):
    """Continuous batching over an :class:`ARRunner`; model-agnostic. By default the host
    schedules each step while the device runs the one before (``overlap``).

    ``S`` is the stage's per-request state type: the engine carries it, typed, from
    :meth:`add_request` to the stage's step inputs (the runner's
    :class:`~omni_jax.engine.step.StepInputs`) without reading it.
    """

    def __init__(
        self,
        runner: ARRunner,
        *,
        max_num_batched_tokens: int,
        eos_token_ids: Sequence[int] = (),
        name: str = "ar",
        overlap: bool = True,
    ):
        """``name`` (the stage's) prefixes the engine's profiler spans: ``<name>/schedule``,
        ``<name>/prefill`` or ``<name>/decode`` (a step with any prompt row is a prefill: its
        dispatch), ``<name>/update`` (reading a step's results, waiting for the device, and
        applying them).

        ``overlap``: schedule and dispatch each step while the device still runs the one
        before, reading that one's results after (vLLM's async scheduling): the host's work of
        a step then hides behind the device's (a :class:`~omni_jax.engine.step.DrawHook`'s
        feedback, what the next step reads of a drawn token beyond it, comes from the device
        too). Off, each step is read as soon as it is dispatched. Both give the same tokens."""
        self.name = name
        self.runner = runner
        self.inputs = runner.step_inputs
        self.eos_token_ids = tuple(eos_token_ids)
        self.scheduler: Scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=runner.max_num_seqs,  # the rows of its id table the scheduler hands out
                max_num_batched_tokens=max_num_batched_tokens,
                max_prefill_chunk=max_num_batched_tokens,
                cache=runner.cache_cfg.geometry,
                row_edges=runner.row_edges(),
            ),
            PageAllocator(runner.cache_cfg.num_pages),
            self.inputs.positions,
            self.inputs.available,
        )
        self._arrivals = 0
        self.overlap = overlap
        self._unread: collections.deque[_InFlight[S]] = collections.deque()
        """Steps dispatched and not read yet, oldest first: one after a step that read the one
        before it, two when a step without ``block`` found that one unfinished."""
        self._read: list[ARRequest[S]] = []  # finished in a step an abort read, for the next step()
        self._touched: dict[int, ARRequest[S]] = {}  # with a row in a step read since step() returned

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        state: S | None = None,
        *,
        suppress_ids: Sequence[int] = (),
        capture_hidden: bool = False,
    ) -> ARRequest[S]:
        """Queue a request; ``state`` is the stage's record of it, which its step inputs read.
        ``suppress_ids`` are never sampled; ``capture_hidden`` keeps each computed token's final
        hidden state and input embedding (what a later stage reads; the runner must return
        them, :attr:`ARRunner.capture_hidden`)."""
        if capture_hidden and not self.runner.capture_hidden:
            raise ValueError(
                f"request {request_id!r} asks stage {self.name!r} for hidden states it does not capture"
            )
        if 0 < params.temperature < MIN_TEMPERATURE:
            log.warning(
                "request %r: temperature %s is below %s, where sampling comes out NaN; it draws at %s",
                request_id,
                params.temperature,
                MIN_TEMPERATURE,
                MIN_TEMPERATURE,
            )
        seed = request_seed(params.seed)
        req: ARRequest[S] = ARRequest(
            request_id=request_id,
            arrival=self._arrivals,
            prompt_ids=list(prompt_ids),
            params=params,
            seed=seed,
            eos_token_ids=self.eos_token_ids,
            state=state,
            suppress_ids=tuple(suppress_ids),
            capture_hidden=capture_hidden,
        )
        self._arrivals += 1
        self.scheduler.add(req)
        return req

    def warmup(self) -> int:
        """Compile every program a step can run (:meth:`ARRunner.warmup`); returns how many."""
        return self.runner.warmup()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._unread) or bool(self._read)

    def abort(self, request_id: str) -> bool:
        """End the request (``finish_reason="abort"``) wherever it is queued or running; its
        pages go back to the allocator at once: when a row of it is in flight (it still writes
        them), that step is read first, and what it finished is returned by the next
        :meth:`step` (the aborted request not among it, even if it ended there). False when
        the engine does not hold it."""
        if any(req.request_id == request_id for flight in self._unread for req, _ in flight.step):
            while self._unread:  # every unread step, in order (the scheduler reads steps in order)
                self._read += self._resolve(self._unread.popleft())
        aborted = self.scheduler.abort(request_id)
        ended = [aborted] if aborted is not None else [r for r in self._read if r.request_id == request_id]
        for r in ended:
            if aborted is None:
                self._read.remove(r)
            # not reported by the next step(), and not held until one: an idle engine takes none
            self._touched.pop(id(r), None)
        return bool(ended)

    def step(self, block: bool = True) -> EngineStep[S]:
        """Schedule and dispatch one step, then read the step dispatched before it (or this one,
        when steps do not overlap); return the requests that finished in the steps read, and
        every request with a row in them (or in one an abort read since the last call).

        Without ``block`` no read waits for the device: the step before is left unread when the
        device has not finished it, and read first by the next call, which schedules nothing
        until it can (the next step's rows take their pending tokens from the step before on
        the device, never from one further back); a call that can do nothing without waiting
        returns at once, ``idle``. Why: the engine core steps every stage from one thread, and
        a read that waited for this stage's device held the other stages' dispatches back,
        even where they run on devices of their own. Either way the tokens are the same."""
        done, self._read = self._read, []
        read = bool(done)
        while self._unread and (len(self._unread) > 1 or self.scheduler.may_preempt()):
            if not block and not self.runner.done(self._unread[0].dispatched):
                return self._stepped(done, idle=not read)
            done += self._resolve(self._unread.popleft())
            read = True
        with scope(f"{self.name}/schedule"):
            step = self.scheduler.schedule()
        failed = self.inputs.prepare([row for _, row in step]) if step else {}
        for i, message in failed.items():  # e.g. an encoder fault: only that request ends
            self.scheduler.fail(step[i][0], message)
            done.append(step[i][0])
        step = [s for i, s in enumerate(step) if i not in failed]
        if step:
            sources = self._sources(step)
            self.scheduler.commit(step)
            rows = [row for _, row in step]
            kind = "decode" if all(len(r.token_ids) == 1 for r in rows) else "prefill"
            with scope(f"{self.name}/{kind}", rows=len(rows)):
                self._unread.append(_InFlight(step, self.runner.dispatch(rows, sources)))
        keep = 1 if self.overlap and step else 0  # the step just dispatched stays in flight
        while len(self._unread) > keep and (
            block or not self.overlap or self.runner.done(self._unread[0].dispatched)
        ):
            done += self._resolve(self._unread.popleft())
            read = True
        return self._stepped(done, idle=not (read or step or failed))

    def _stepped(self, done: list[ARRequest[S]], idle: bool) -> EngineStep[S]:
        """The call's :class:`EngineStep`: ``done`` and the requests the steps it read touched."""
        read = sorted(self._touched.values(), key=lambda r: r.arrival)
        self._touched = {}
        return EngineStep(done, read, idle)

    def _sources(self, step: list[tuple[ARRequest[S], StepRow[S]]]) -> list[int]:
        """For each row of ``step`` with a pending token, its request's row in the step in flight
        (whose draw holds the token), else -1."""
        if not self._unread:
            return [-1] * len(step)
        drew = {id(req): i for i, (req, row) in enumerate(self._unread[-1].step) if row.sample}
        return [drew[id(req)] if row.pending_token else -1 for req, row in step]

    def _resolve(self, flight: _InFlight[S]) -> list[ARRequest[S]]:
        """Read a dispatched step's results and apply them; the requests it finished."""
        with scope(f"{self.name}/update"):
            update = self.scheduler.update(flight.step, self.runner.fetch(flight.dispatched))
        for req, _ in flight.step:
            self._touched[id(req)] = req
        if update.scrub:  # a failed request's pages may hold NaN: zero them before reuse
            self.runner.scrub(update.scrub)
        return update.finished


@dataclasses.dataclass
class EngineStep(Generic[S]):
    """What one :meth:`AREngine.step` read: the requests that ``finished``, and every request
    with a row in the steps it read (``read``, each once, oldest first), the only ones whose
    tokens or captured states can have grown. A stage reports those and need not look at the
    requests still waiting, however many are queued."""

    finished: list[ARRequest[S]]
    read: list[ARRequest[S]]
    idle: bool = False


@dataclasses.dataclass
class _InFlight(Generic[S]):
    """A step dispatched and not yet read: its rows with their requests, and the runner's
    handle on its outputs."""

    step: list[tuple[ARRequest[S], StepRow[S]]]
    dispatched: Dispatched
