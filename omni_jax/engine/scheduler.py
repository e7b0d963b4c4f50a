"""AR continuous batching: waiting/running queues, a token budget, paging, preemption.

Prefill and decode are one mechanism: each step a running request computes the tokens of
its id list that are not yet in the cache (a prompt chunk, a recomputation after
preemption, or the one token sampled last step). A row whose chunk reaches the end of its
list samples the next token. When pages run out, the newest running request is preempted:
its pages are freed and it re-enters the waiting queue at the front, to be recomputed from
its prompt plus what it had generated, so its results equal an unconstrained run.

A step is committed when it is dispatched (:meth:`Scheduler.commit`: its tokens count as
computed, and each sampling row's token as *pending*, drawn on the device but not yet read)
and updated when its results reach the host (:meth:`Scheduler.update`). The engine may
schedule the next step in between, while the device still runs this one: a pending token is
then the input of its request's next row (:attr:`~omni_jax.engine.step.StepRow.pending_token`,
the runner reads it on the device), a request whose pending token ends it by length is not
scheduled again, and one that turns out to have stopped (EOS, a stop id, an abort) while a
row of it was in flight keeps its pages until that row's results are read, then drops them.
Preemption never meets a pending token: the engine reads the step in flight first whenever
the next one might preempt (:meth:`Scheduler.may_preempt`).

A running request holds one of ``max_num_seqs`` rows of the runner's token-id table, where its
steps write the ids they compute and the penalties read them (:attr:`StepRow.id_row`). The row
goes back when the request stops running; a later owner's steps overwrite the ids its draws
read (those up to its own length) before any draw reads them, since the device runs the steps
in dispatch order and a recomputed request starts from its first token.

A request's tokens run only as far as their inputs are there (the stage's
:meth:`~omni_jax.engine.step.StepInputs.available`): a request of a stage fed by another,
taken while that stage still generates, waits, running, for the rows of it its next token reads.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic

import numpy as np

from omni_jax.engine.kv_cache import CacheGeometry, PageAllocator, pages_needed
from omni_jax.engine.sampling import SamplingParams
from omni_jax.engine.step import PENDING_TOKEN, S, StepResult, StepRow, all_available, text_positions


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class ARRequest(Generic[S]):
    """Host-side state of one request inside one AR stage; compared by identity (a request is
    itself, whatever its fields: the queues' membership tests and removals compare pointers,
    not every field of every request queued before it).

    ``state``: the stage's own record of the request (e.g. its multimodal inputs and rotary
    positions), typed by the stage and opaque here; it reaches the stage's step inputs on each
    :class:`StepRow`. ``capture_hidden``: keep every computed token's final hidden state and
    input embedding, for a later stage that reads them (set per request by the pipeline, through
    the stage's input, when the request goes on to such a stage).
    """

    request_id: str
    arrival: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...] = ()
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None  # why it ended with finish_reason "error"
    num_preemptions: int = 0
    first_token_time: float | None = None  # perf_counter() when the first output token arrived
    pending: int = 0  # tokens drawn by dispatched steps whose values the host has not read
    state: S | None = None
    suppress_ids: tuple[int, ...] = ()  # never sampled (e.g. a codec's BOS a stage reads but never draws)
    capture_hidden: bool = False
    captured: list[tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=list)
    captured_start: int = 0  # the computed token of the first row ``captured`` holds (earlier ones released)
    id_row: int = -1  # its row of the runner's token-id table while running (StepRow.id_row), else -1
    _stop: frozenset[int] | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def num_known(self) -> int:
        """How many ids the host knows: the prompt's and every output token read back."""
        return len(self.prompt_ids) + len(self.output_ids)

    def ids(self, start: int, end: int) -> list[int]:
        """Known ids ``[start, end)`` (``end`` at most :attr:`num_known`), sliced from the prompt
        and the outputs without joining them."""
        prompt = len(self.prompt_ids)
        if end <= prompt:
            return self.prompt_ids[start:end]
        if start >= prompt:
            return self.output_ids[start - prompt : end - prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - prompt]

    @property
    def num_tokens(self) -> int:
        """The request's tokens, its pending ones included."""
        return self.num_known + self.pending

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed

    def captured_states(self) -> tuple[np.ndarray, np.ndarray]:
        """``(hidden [N, D], embeds [N, D])`` of the ``N`` computed tokens, in sequence order
        (the last sampled token was never computed); ``ValueError`` once rows were released."""
        if self.captured_start:
            raise ValueError(f"request {self.request_id!r}: rows before {self.captured_start} were released")
        hidden, embeds = zip(*self.captured, strict=True)
        return np.concatenate(hidden), np.concatenate(embeds)

    def captured_since(self, row: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``(hidden [K, D], embeds [K, D])`` of the computed tokens from ``row`` on, as captured
        so far; ``None`` when there are none past it. After a preemption the rows are captured
        afresh from the first token, and those before ``row`` are not returned again.
        ``ValueError`` when rows from ``row`` on were released."""
        have = self.captured_start + sum(len(h) for h, _ in self.captured)
        if have <= row:
            return None
        if row < self.captured_start:
            raise ValueError(f"request {self.request_id!r}: rows before {self.captured_start} were released")
        blocks = []
        for block in reversed(self.captured):
            blocks.append(block)
            have -= len(block[0])
            if have <= row:
                break
        hidden, embeds = (np.concatenate(part[::-1]) for part in zip(*blocks, strict=True))
        return hidden[row - have :], embeds[row - have :]

    def capture(self, hidden: np.ndarray, embeds: np.ndarray, start: int) -> None:
        """Keep a step's rows of the tokens from ``start`` on; rows computed afresh from the first
        token (after a preemption too) replace every earlier one, released or not."""
        if start == 0:
            self.captured, self.captured_start = [], 0
        self.captured.append((hidden, embeds))

    def release_captured(self, row: int) -> None:
        """Forget the captured blocks wholly before computed token ``row``: a stage that reads
        them as they come (a stage fed by this one, started early) took them, and a long multimodal prompt's
        rows are held once, not twice. The last block keeps its widths (no rows), so the rows
        from ``row`` on can be empty."""
        start, blocks = self.captured_start, self.captured
        while len(blocks) > 1 and start + len(blocks[0][0]) <= row:
            start += len(blocks.pop(0)[0])
        if len(blocks) == 1 and start + len(blocks[0][0]) <= row:
            hidden, embeds = blocks[0]
            start += len(hidden)
            blocks[0] = (hidden[:0].copy(), embeds[:0].copy())
        self.captured_start = start

    def ends_by_length(self, max_model_len: int) -> bool:
        """Its tokens, the pending ones included, reach ``max_tokens`` or ``max_model_len``: it
        finishes when they are read, so it has no further row to run."""
        drawn = len(self.output_ids) + self.pending
        if self.params.max_tokens is not None and drawn >= self.params.max_tokens:
            return True
        return len(self.prompt_ids) + drawn >= max_model_len

    def stop_ids(self) -> frozenset[int]:
        """The ids that end it (its stop ids, and its EOS ids unless it ignores them); built once,
        as it is read every step while it is under ``min_tokens`` and for every token it draws."""
        if self._stop is None:
            ids = set(self.params.stop_token_ids or [])
            if not self.params.ignore_eos:
                ids.update(self.eos_token_ids)
            self._stop = frozenset(ids)
        return self._stop


PositionFn = Callable[[S | None, int, int], np.ndarray]
"""A request's rotary positions of tokens ``[start, end)`` from its stage state
(:meth:`~omni_jax.engine.step.StepInputs.positions`)."""

AvailableFn = Callable[[S | None], int | None]
"""How many of a request's tokens have their inputs now, ``None``: all
(:meth:`~omni_jax.engine.step.StepInputs.available`)."""


@dataclasses.dataclass
class StepUpdate(Generic[S]):
    """What :meth:`Scheduler.update` decided for one step: the requests that finished in it,
    and the pages of those that failed on non-finite logits, which may hold NaN and must be
    zeroed before the allocator hands them out again."""

    finished: list[ARRequest[S]]
    scrub: list[int]


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """A step's limits (sequences, tokens, tokens of one prompt chunk) over the stage's cache,
    whose page size pages requests and whose ``max_model_len`` ends them.

    ``row_edges``: ascending token-row sizes of the runner's programs at which a step holding
    prompt tokens is better cut than padded (the runner's sizes from its decode rows up,
    :meth:`~omni_jax.engine.ar_runner.ARRunner.row_edges`). A step of ``n`` tokens between two
    edges ``lo < n < hi`` runs as ``hi`` rows; when its newest prompt tokens past ``lo`` are
    fewer than the ``hi - n`` rows of padding, they wait for the next step instead, which
    computes them beside rows it runs anyway. Empty: steps are never cut.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_chunk: int
    cache: CacheGeometry
    row_edges: tuple[int, ...] = ()


class Scheduler:
    """Decides each step's rows; owns the page allocator; applies sampled tokens."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        allocator: PageAllocator,
        positions: PositionFn = text_positions,
        available: AvailableFn = all_available,
    ):
        self.cfg = cfg
        self.allocator = allocator
        self.positions = positions
        self.available = available
        self.waiting: deque[ARRequest] = deque()
        self.running: list[ARRequest] = []
        self._free_id_rows = list(range(cfg.max_num_seqs - 1, -1, -1))  # popped from the end: 0 first

    # -- queue management -------------------------------------------------------------
    def add(self, req: ARRequest) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def may_preempt(self) -> bool:
        """Whether the next :meth:`schedule` could preempt: the running requests' next chunks
        (each as long as one may be) need more pages than are free. An upper bound: the token
        budget only shortens chunks, and admissions take only pages nobody running needs. The
        engine then reads the step in flight first: a request with a pending token is never
        preempted."""
        cfg, free = self.cfg, self.allocator.num_free
        need = 0
        for r in self.running:
            if not r.ends_by_length(cfg.cache.max_model_len):
                need += self._growth(r, min(r.remaining, cfg.max_prefill_chunk))
                if need > free:  # the answer, whatever the rest need
                    return True
        return False

    def abort(self, request_id: str) -> ARRequest | None:
        for req in list(self.running) + list(self.waiting):
            if req.request_id == request_id:
                self._finish(req, "abort")
                return req
        return None

    def fail(self, req: ARRequest, message: str) -> None:
        """End ``req`` with ``finish_reason="error"`` and ``message`` (a fault outside a step's
        computation, e.g. its encoder at admission); its pages go back to the allocator."""
        req.error = message
        self._finish(req, "error")

    def _finish(self, req: ARRequest, reason: str) -> None:
        """End ``req``; its pages go back to the allocator, or, while a row of it that samples
        is still in flight, when that row's results are read (:meth:`update`): the row still
        writes to them, and its logits may prove them non-finite."""
        if req.status is Status.RUNNING:
            self._leave(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        if not req.pending:
            self.allocator.free(req.pages)
            req.pages = []
        req.status = Status.FINISHED
        req.finish_reason = reason

    def _preempt(self, req: ARRequest) -> None:
        if req.pending:
            raise RuntimeError(
                f"request {req.request_id!r} preempted with a token in flight: the engine reads the "
                "step in flight first when a step may preempt (Scheduler.may_preempt)"
            )
        self._leave(req)
        self.allocator.free(req.pages)
        req.pages, req.num_computed = [], 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _leave(self, req: ARRequest) -> None:
        """Take ``req`` out of the running requests; its token-id row goes back."""
        self.running.remove(req)
        self._free_id_rows.append(req.id_row)
        req.id_row = -1

    def _reserve(self, req: ARRequest, chunk: int, step: Sequence[tuple[ARRequest, StepRow]]) -> bool:
        """Give ``req`` pages for its next ``chunk`` tokens, preempting newer requests if needed
        (never one already in ``step``). The rows already placed are looked at only when pages
        run short, not for every row (which would make scheduling quadratic in the step's rows)."""
        need = self._growth(req, chunk)
        while need > self.allocator.num_free:
            placed = {id(r) for r, _ in step}
            victims = [r for r in self.running if r.arrival > req.arrival and id(r) not in placed]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda r: r.arrival))
        if need > 0:
            req.pages.extend(self.allocator.allocate(need))
        return True

    # -- one step ---------------------------------------------------------------------
    def schedule(self) -> list[tuple[ARRequest, StepRow]]:
        """The next step's rows with their requests (empty when there is nothing to do).

        Steps are flat (see :mod:`omni_jax.engine.ar_runner`): a row costs its tokens and
        nothing more, so every decoding request runs each step, and prompt chunks (running
        requests' first, then admissions in FIFO order) share what is left of the
        ``max_num_batched_tokens`` budget, a long prompt in chunks. A step that would pad far
        past its tokens is cut at a row edge (:class:`SchedulerConfig`'s ``row_edges``).
        """
        cfg = self.cfg
        # One pass over the running requests, each one's remaining tokens counted once: every
        # step visits every running request, so what this loop does per request is paid by each
        # row of every decode step.
        decode: list[tuple[ARRequest, int]] = []
        chunks: list[tuple[ARRequest, int]] = []  # (request, its remaining tokens) of the others
        for r in self.running:
            remaining = r.remaining
            if remaining != 1:
                chunks.append((r, remaining))
            elif not r.ends_by_length(cfg.cache.max_model_len) and self._inputs(r, 1) > 0:
                decode.append((r, 1))
        budget = cfg.max_num_batched_tokens - len(decode)
        prompt: list[tuple[ARRequest, int]] = []
        for req, remaining in chunks:
            if budget < 1:
                break
            chunk = min(remaining, cfg.max_prefill_chunk, budget, self._inputs(req, remaining))
            if chunk < 1:  # its inputs are not there yet
                continue
            prompt.append((req, chunk))
            budget -= chunk
        # A waiting request is admitted only into pages no running request needs for its next
        # tokens (those may preempt newer requests; a newcomer may not).
        spare = self.allocator.num_free - sum(self._growth(r, c) for r, c in decode + prompt)
        admitted: list[ARRequest] = []
        while self.waiting and len(self.running) < cfg.max_num_seqs and budget > 0:
            req = self.waiting[0]
            chunk = min(req.remaining, cfg.max_prefill_chunk, budget, self._inputs(req, req.remaining))
            need = pages_needed(chunk, cfg.cache.page_size)
            if chunk < 1 or need > spare:
                break
            prompt.append((req, chunk))
            budget -= chunk
            spare -= need
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.id_row = self._free_id_rows.pop()
            self.running.append(req)
            admitted.append(req)
        plan = decode + self._cut_at_edge(len(decode), prompt, admitted)
        plan.sort(key=lambda rc: rc[0].arrival)
        step: list[tuple[ARRequest, StepRow]] = []
        for req, chunk in plan:
            if req.status is not Status.RUNNING:  # preempted for an older row this step
                continue
            if self._reserve(req, chunk, step):
                step.append((req, self._row(req, chunk)))
            else:
                self._preempt(req)
        return step

    def _cut_at_edge(
        self, decode: int, prompt: list[tuple[ARRequest, int]], admitted: list[ARRequest]
    ) -> list[tuple[ARRequest, int]]:
        """The ``prompt`` chunks (running requests', then the ``admitted``, oldest first) of a
        step beside ``decode`` one-token rows, less the newest prompt tokens when a row edge
        below the step's tokens is nearer than the one above (see :class:`SchedulerConfig`).
        A chunk cut to nothing leaves the step; an admission cut to nothing goes back to the
        front of the waiting queue, as if never admitted."""
        edges = self.cfg.row_edges
        n = decode + sum(c for _, c in prompt)
        i = bisect.bisect_left(edges, n)
        if i == 0 or i == len(edges) or edges[i] == n:
            return prompt
        defer = n - edges[i - 1]
        if defer >= edges[i] - n or defer > n - decode:
            return prompt
        kept = list(prompt)
        while defer:
            req, chunk = kept.pop()
            take = min(chunk, defer)
            defer -= take
            if take < chunk:
                kept.append((req, chunk - take))
            elif any(req is a for a in admitted):
                self._leave(req)
                req.status = Status.WAITING
                self.waiting.appendleft(req)
        return kept

    def _inputs(self, req: ARRequest, remaining: int) -> int:
        """How many of ``req``'s ``remaining`` next tokens have their inputs (:attr:`available`)."""
        limit = self.available(req.state)
        return remaining if limit is None else max(0, min(remaining, limit - req.num_computed))

    def _growth(self, req: ARRequest, chunk: int) -> int:
        """Pages ``req`` lacks for its next ``chunk`` tokens (none, most steps: a decode row
        needs a page once every ``page_size`` tokens)."""
        end, held, page_size = req.num_computed + chunk, len(req.pages), self.cfg.cache.page_size
        return 0 if end <= held * page_size else pages_needed(end, page_size) - held

    def _row(self, req: ARRequest, chunk: int) -> StepRow:
        """The row of ``req``'s next ``chunk`` tokens. A pending token (its decode row's input
        in a step scheduled before the one drawing it was read) is the placeholder
        :data:`PENDING_TOKEN`, which the runner replaces on the device."""
        start, end = req.num_computed, req.num_computed + chunk
        known = req.num_known
        sample = end == req.num_tokens
        drawn = len(req.output_ids) + req.pending
        suppress: Sequence[int] = ()
        if sample and (req.suppress_ids or drawn < req.params.min_tokens):
            held = req.stop_ids() if drawn < req.params.min_tokens else frozenset()
            suppress = sorted(held.union(req.suppress_ids))
        return StepRow(
            token_ids=req.ids(start, min(end, known)) + [PENDING_TOKEN] * (end - max(start, known)),
            positions=self.positions(req.state, start, end),
            pages=req.pages,
            start=start,
            sample=sample,
            params=req.params,
            seed=req.seed,
            draw_index=drawn,
            id_row=req.id_row,
            prompt_len=len(req.prompt_ids),
            suppress=suppress,
            capture_hidden=req.capture_hidden,
            state=req.state,
            pending_token=end > known,
        )

    def commit(self, step: Sequence[tuple[ARRequest[S], StepRow[S]]]) -> None:
        """``step`` is dispatched: its rows' tokens are computed, and each sampling row's next
        token is pending until :meth:`update` reads it."""
        for req, row in step:
            req.num_computed = row.end
            req.pending += row.sample

    def update(self, step: Sequence[tuple[ARRequest[S], StepRow[S]]], result: StepResult) -> StepUpdate[S]:
        """Apply a committed step's sampled tokens (and captured states), in dispatch order;
        return what finished and what must be scrubbed. The rows of a request that finished
        while they were in flight are dropped, and its pages released with its last one."""
        done: list[ARRequest[S]] = []
        scrub: list[int] = []
        tokens, finite = result.tokens.tolist(), result.finite.tolist()  # Python ints and bools, once
        for i, (req, row) in enumerate(step):
            if req.status is Status.FINISHED:
                if row.sample:
                    self._drop_pending(req, finite[i], scrub)
                continue
            if req.capture_hidden and result.hidden is not None and result.embeds is not None:
                req.capture(result.hidden[i], result.embeds[i], row.start)
            if not row.sample:
                continue
            req.pending -= 1
            if not finite[i]:
                scrub += req.pages
                self.fail(req, f"non-finite logits at output token {len(req.output_ids)}")
                done.append(req)
                continue
            tok = tokens[i]
            req.output_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = time.perf_counter()
            if req.params.logprobs is not None:
                n = req.params.logprobs + 1
                ids, lps = result.logprob_ids[i, :n], result.logprobs[i, :n]
                req.logprobs.append({int(a): float(b) for a, b in zip(ids, lps, strict=True)})
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self._finish(req, reason)
                done.append(req)
        return StepUpdate(done, scrub)

    def _drop_pending(self, req: ARRequest, finite: bool, scrub: list[int]) -> None:
        """A finished request's in-flight row is read: its token is dropped, its pages are
        scrubbed when its logits were not finite, and released with its last pending token."""
        req.pending -= 1
        if not finite:
            scrub += req.pages
        if not req.pending:
            self.allocator.free(req.pages)
            req.pages = []

    def _stop_reason(self, req: ARRequest, tok: int) -> str | None:
        if tok in req.stop_ids():  # stop ids were suppressed while under min_tokens
            return "stop"
        if req.params.max_tokens is not None and len(req.output_ids) >= req.params.max_tokens:
            return "length"
        if len(req.prompt_ids) + len(req.output_ids) >= self.cfg.cache.max_model_len:
            return "length"
        return None
