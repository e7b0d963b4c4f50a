"""One AR stage's engine: a scheduler deciding steps and a runner executing them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omni_jax.engine.ar_runner import ARRunner
from omni_jax.engine.kv_cache import PageAllocator
from omni_jax.engine.sampling import SamplingParams
from omni_jax.engine.scheduler import ARRequest, PositionFn, Scheduler, SchedulerConfig, text_positions
from omni_jax.parallel.distributed import random_seed
from omni_jax.profiling import scope


class AREngine:
    """Continuous batching over an :class:`ARRunner`; model-agnostic."""

    def __init__(
        self,
        runner: ARRunner,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: Sequence[int] = (),
        positions: PositionFn = text_positions,
        name: str = "ar",
    ):
        """``name`` (the stage's) prefixes the engine's profiler spans: ``<name>/schedule``,
        ``<name>/prefill`` or ``<name>/decode`` (a step with any prompt row is a prefill),
        ``<name>/update``."""
        c = runner.cache_cfg
        self.name = name
        self.runner = runner
        self.eos_token_ids = tuple(eos_token_ids)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_model_len=c.max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
                page_size=c.page_size,
                max_prefill_chunk=max_num_batched_tokens,
            ),
            PageAllocator(c.num_pages),
            positions,
        )
        self._arrivals = 0

    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        extra: Any = None,
        *,
        suppress_ids: Sequence[int] = (),
        capture_hidden: bool = False,
    ) -> ARRequest:
        """Queue a request; ``extra`` is what the stage's model-specific hooks (positions, step
        inputs) read for it. ``suppress_ids`` are never sampled; ``capture_hidden`` keeps each
        computed token's final hidden state and input embedding (what a later stage reads)."""
        seed = params.seed if params.seed is not None else random_seed()
        req = ARRequest(
            request_id=request_id,
            arrival=self._arrivals,
            prompt_ids=list(prompt_ids),
            params=params,
            seed=seed,
            eos_token_ids=self.eos_token_ids,
            extra=extra,
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

    def step(self) -> list[ARRequest]:
        """Run one step; return the requests that finished in it."""
        with scope(f"{self.name}/schedule"):
            step = self.scheduler.schedule()
        if not step:
            return []
        failed = self.runner.prepare([row for _, row in step])
        done = []
        for i, message in failed.items():  # e.g. an encoder fault: only that request ends
            self.scheduler.fail(step[i][0], message)
            done.append(step[i][0])
        step = [s for i, s in enumerate(step) if i not in failed]
        if not step:
            return done
        capture = any(req.capture_hidden for req, _ in step)
        rows = [row for _, row in step]
        kind = "decode" if all(len(r.token_ids) == 1 for r in rows) else "prefill"
        with scope(f"{self.name}/{kind}", rows=len(rows)):
            result = self.runner.execute(rows, capture_hidden=capture)
        with scope(f"{self.name}/update"):
            done += self.scheduler.update(step, result)
        if self.scheduler.to_scrub:  # a failed request's pages may hold NaN: zero them first
            self.runner.scrub(self.scheduler.to_scrub)
            self.scheduler.to_scrub = []
        return done
