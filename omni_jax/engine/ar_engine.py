"""One AR stage's engine: a scheduler deciding steps and a runner executing them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic

from omni_jax.engine.ar_runner import ARRunner
from omni_jax.engine.kv_cache import PageAllocator
from omni_jax.engine.sampling import SamplingParams
from omni_jax.engine.scheduler import ARRequest, Scheduler, SchedulerConfig
from omni_jax.engine.step import S
from omni_jax.parallel.distributed import random_seed
from omni_jax.profiling import scope


class AREngine(Generic[S]):
    """Continuous batching over an :class:`ARRunner`; model-agnostic.

    ``S`` is the stage's per-request state type: the engine carries it, typed, from
    :meth:`add_request` to the stage's step inputs (the runner's
    :class:`~omni_jax.engine.step.StepInputs`) without reading it.
    """

    def __init__(
        self,
        runner: ARRunner,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: Sequence[int] = (),
        name: str = "ar",
    ):
        """``name`` (the stage's) prefixes the engine's profiler spans: ``<name>/schedule``,
        ``<name>/prefill`` or ``<name>/decode`` (a step with any prompt row is a prefill),
        ``<name>/update``."""
        self.name = name
        self.runner = runner
        self.inputs = runner.step_inputs
        self.eos_token_ids = tuple(eos_token_ids)
        self.scheduler: Scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_prefill_chunk=max_num_batched_tokens,
                cache=runner.cache_cfg.geometry,
                row_edges=runner.row_edges(),
            ),
            PageAllocator(runner.cache_cfg.num_pages),
            self.inputs.positions,
        )
        self._arrivals = 0

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
        seed = params.seed if params.seed is not None else random_seed()
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
        return self.scheduler.has_work()

    def abort(self, request_id: str) -> bool:
        """End the request (``finish_reason="abort"``) wherever it is queued or running; its
        pages go back to the allocator at once. False when the engine does not hold it."""
        return self.scheduler.abort(request_id) is not None

    def step(self) -> list[ARRequest[S]]:
        """Run one step; return the requests that finished in it."""
        with scope(f"{self.name}/schedule"):
            step = self.scheduler.schedule()
        if not step:
            return []
        failed = self.inputs.prepare([row for _, row in step])
        done: list[ARRequest[S]] = []
        for i, message in failed.items():  # e.g. an encoder fault: only that request ends
            self.scheduler.fail(step[i][0], message)
            done.append(step[i][0])
        step = [s for i, s in enumerate(step) if i not in failed]
        if not step:
            return done
        rows = [row for _, row in step]
        kind = "decode" if all(len(r.token_ids) == 1 for r in rows) else "prefill"
        with scope(f"{self.name}/{kind}", rows=len(rows)):
            result = self.runner.execute(rows)
        with scope(f"{self.name}/update"):
            update = self.scheduler.update(step, result)
        if update.scrub:  # a failed request's pages may hold NaN: zero them before reuse
            self.runner.scrub(update.scrub)
        return done + update.finished
