"""Property-based tests (hypothesis) of the AR scheduler's invariants, without a model.

``Scheduler`` and ``PageAllocator`` are driven directly by a fake runner that keeps a host
"KV cache" of token ids per page slot: it writes each row's tokens where the row's pages
say, reads the row's whole context back from the cache, and draws the next token as a
hash of that context. A page handed to two requests, a page freed while still read, or a
preempted request not recomputed therefore shows up as a wrong context (checked) or a
wrong token (compared with each request run alone). Random prompt lengths, ``max_tokens``,
``min_tokens``, EOS and stop ids, arrivals over time and aborts meet page budgets down to
one sequence, so preemption is constant.

Two scheduler faults these tests found are covered at the end: a newer request preempting an
older one, and a livelock with prompt chunks below the token budget (two recomputing requests
preempting each other while the oldest one's decode row never ran). The scheduler now preempts
only requests newer than the one asking and admits a waiting request only into pages no
running request needs next.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from omni_jax.engine.kv_cache import CacheGeometry, PageAllocator, pages_needed
from omni_jax.engine.sampling import SamplingParams
from omni_jax.engine.scheduler import ARRequest, Scheduler, SchedulerConfig, Status
from omni_jax.engine.step import StepResult, StepRow

VOCAB = 12
EOS = 1
SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclasses.dataclass(frozen=True)
class Spec:
    prompt: tuple[int, ...]
    params: SamplingParams
    seed: int
    eos_at: int | None  # the draw index at which the fake model emits EOS (None: never)
    arrive_step: int


def scheduler_config(
    *,
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    page_size: int,
    max_prefill_chunk: int,
    row_edges: tuple[int, ...] = (),
) -> SchedulerConfig:
    """A scheduler's limits over a cache of ``page_size``-token pages and ``max_model_len``-token
    sequences (its layers and heads, which the scheduler never reads, one of each)."""
    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_prefill_chunk=max_prefill_chunk,
        row_edges=row_edges,
        cache=CacheGeometry(
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            dtype=np.float32,
            page_size=page_size,
            max_model_len=max_model_len,
        ),
    )


def fake_token(seed: int, context: list[int], draw: int, eos_at: int | None, suppress: set[int]) -> int:
    """The "model": a token that depends on the request's seed and its whole context."""
    tok = EOS if draw == eos_at else 2 + hash((seed, *context)) % (VOCAB - 2)
    while tok in suppress:  # the sampler never draws a suppressed id
        tok = (tok + 1) % VOCAB
    return tok


def stop_ids(spec: Spec) -> set[int]:
    ids = set(spec.params.stop_token_ids or [])
    if not spec.params.ignore_eos:
        ids.add(EOS)
    return ids


def alone(spec: Spec, max_model_len: int) -> tuple[list[int], str]:
    """The request's tokens and finish reason run on its own, with no scheduler."""
    out: list[int] = []
    stops = stop_ids(spec)
    while True:
        suppress = stops if len(out) < spec.params.min_tokens else set()
        tok = fake_token(spec.seed, [*spec.prompt, *out], len(out), spec.eos_at, suppress)
        out.append(tok)
        if tok in stops:
            return out, "stop"
        if spec.params.max_tokens is not None and len(out) >= spec.params.max_tokens:
            return out, "length"
        if len(spec.prompt) + len(out) >= max_model_len:
            return out, "length"


class FakeRunner:
    """Writes rows into a host page cache and samples from what it reads back; a row's pending
    token (see ``omni_jax.engine.scheduler``) is read from the step before's draw, as the
    device does."""

    def __init__(self, num_pages: int, cfg: SchedulerConfig, specs: dict[str, Spec]):
        page_size = cfg.cache.page_size
        self.cache = np.full((num_pages, page_size), -1, np.int64)
        # The runner's id table: a row per running request, which the penalties read.
        self.ids = np.full((cfg.max_num_seqs, cfg.cache.max_model_len), -1, np.int64)
        self.page_size = page_size
        self.specs = specs
        self.drawn = np.zeros(0, np.int64)  # the last step's tokens

    def slots(self, pages: list[int], start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        idx = np.arange(start, end)
        return np.asarray(pages, np.int64)[idx // self.page_size], idx % self.page_size

    def execute(self, step: list[tuple[ARRequest, StepRow]], sources: list[int]) -> StepResult:
        """The step's results (before the scheduler commits it); ``sources``: each pending
        token's row in the step before."""
        tokens = np.zeros(len(step), np.int64)
        wants = []
        for (req, row), source in zip(step, sources, strict=True):
            assert row.start == req.num_computed and row.end <= req.num_tokens
            assert len(row.pages) * self.page_size >= row.end, "row writes past its pages"
            np.testing.assert_array_equal(row.positions, np.arange(row.start, row.end))
            ids = list(row.token_ids)
            assert row.pending_token == (source >= 0)
            if row.pending_token:
                ids[-1] = int(self.drawn[source])
            self.cache[self.slots(list(row.pages), row.start, row.end)] = ids
            self.ids[row.id_row, row.start : row.end] = ids
            wants.append((req.prompt_ids + req.output_ids)[: row.start] + ids)
        for i, (req, row) in enumerate(step):  # reads after every row of the step has written
            context = self.cache[self.slots(list(row.pages), 0, row.end)].tolist()
            assert context == wants[i], f"{req.request_id}: KV cache context corrupted"
            assert self.ids[row.id_row, : row.end].tolist() == context, f"{req.request_id}: id table differs"
            if row.sample:
                spec = self.specs[req.request_id]
                tokens[i] = fake_token(spec.seed, context, row.draw_index, spec.eos_at, set(row.suppress))
        n = len(step)
        outputs = {f.name: None for f in dataclasses.fields(StepResult)}  # hidden states etc.: none
        outputs.update(
            tokens=tokens, finite=np.ones(n, bool), logprob_ids=np.zeros((n, 1)), logprobs=np.zeros((n, 1))
        )
        self.drawn = tokens
        return StepResult(**outputs)


def check_pages(sched: Scheduler, alloc: PageAllocator, reqs: list[ARRequest]) -> None:
    """Every page is either free or held by exactly one running request, or by a finished one
    with a row still in flight; nobody else holds any."""
    held: list[int] = []
    for r in sched.running:
        assert r.status is Status.RUNNING
        assert len(r.pages) >= pages_needed(r.num_computed, sched.cfg.cache.page_size)
        held += r.pages
    for r in reqs:
        if r.status is Status.FINISHED and r.pending:
            held += r.pages
        elif r not in sched.running:
            assert r.pages == [], f"{r.request_id} ({r.status}) holds pages {r.pages}"
            assert not r.pending, f"{r.request_id} ({r.status}) has a pending token"
    assert len(held) == len(set(held)), f"a page is held by two requests: {sorted(held)}"
    assert set(held) == alloc._used
    assert not set(held) & set(alloc._free)
    assert alloc.num_free + len(held) == alloc.num_pages
    assert len(sched.running) <= sched.cfg.max_num_seqs
    rows = [r.id_row for r in sched.running]
    assert len(rows) == len(set(rows)) and all(0 <= k < sched.cfg.max_num_seqs for k in rows), rows
    assert all(r.id_row == -1 for r in reqs if r not in sched.running)


def check_step(sched: Scheduler, step: list[tuple[ARRequest, StepRow]]) -> None:
    """Within ``max_num_seqs`` rows and the token budget, in a shape warm-up compiled."""
    cfg = sched.cfg
    reqs = [r for r, _ in step]
    assert len(reqs) == len({id(r) for r in reqs}), "a request has two rows in one step"
    assert len(step) <= cfg.max_num_seqs
    assert all(r.status is Status.RUNNING and r in sched.running for r in reqs)
    lengths = [len(row.token_ids) for _, row in step]
    assert all(1 <= n <= cfg.max_prefill_chunk for n in lengths)
    # Flat steps: every decoding request runs, prompt chunks fill what is left of the budget,
    # so a step passes the budget only with decode rows alone (ARRunner.step_shapes covers
    # token rows up to the larger of the budget and the row bucket of max_num_seqs).
    decodes = sum(1 for n in lengths if n == 1)
    assert sum(lengths) <= max(cfg.max_num_batched_tokens, decodes), (lengths, cfg.max_num_batched_tokens)
    max_len = cfg.cache.max_model_len
    idle = [
        r.request_id
        for r in sched.running
        if r.remaining == 1 and all(r is not q for q in reqs) and not r.ends_by_length(max_len)
    ]
    assert not idle, f"decoding requests left out of the step: {idle}"
    ended = [r.request_id for r in reqs if r.ends_by_length(max_len) and r.remaining == 1]
    assert not ended, f"requests whose pending tokens end them scheduled again: {ended}"
    # Counted from the params, not through ARRequest.ends_by_length (which the check above
    # trusts): a row draws token ``draw_index``, so it must be one the request can still take.
    for r, row in step:
        if row.sample:
            assert r.params.max_tokens is None or row.draw_index < r.params.max_tokens, (
                f"{r.request_id} draws token {row.draw_index} past max_tokens={r.params.max_tokens}"
            )
            assert row.prompt_len + row.draw_index < max_len, f"{r.request_id} draws past max_model_len"
    check_exact_pages(sched, step)


def check_exact_pages(sched: Scheduler, step: list[tuple[ARRequest, StepRow]]) -> None:
    """Every running request holds exactly the pages of the tokens written so far: those its row
    in ``step`` writes up to, else those it has computed. A page more (say, taken when the tokens
    just fill the pages held) is a page no other request can have, and over a batch of requests
    it preempts ones that fit."""
    ends = {id(r): row.end for r, row in step}
    page_size = sched.cfg.cache.page_size
    for r in sched.running:
        end = ends.get(id(r), r.num_computed)
        assert len(r.pages) == pages_needed(end, page_size), (
            f"{r.request_id} holds {len(r.pages)} pages for {end} tokens of {page_size}"
        )


def check_preemptions(
    before: dict[int, int], sched: Scheduler, step: list[tuple[ARRequest, StepRow]]
) -> None:
    """Pages go to older requests first: a request that grew its pages this step is older
    than every request preempted in it."""
    preempted = [r for r in sched.waiting if id(r) in before]
    grew = [r for r, _ in step if len(r.pages) > before.get(id(r), 0)]
    if preempted and grew:
        newest = max(grew, key=lambda r: r.arrival)
        oldest = min(preempted, key=lambda r: r.arrival)
        assert newest.arrival < oldest.arrival, (
            f"{newest.request_id} took pages while the older {oldest.request_id} was preempted"
        )


def describe(sched: Scheduler) -> str:
    def show(r: ARRequest) -> str:
        return f"{r.request_id}(computed {r.num_computed}/{r.num_tokens}, pages {len(r.pages)})"

    running = ", ".join(show(r) for r in sched.running)
    waiting = ", ".join(show(r) for r in sched.waiting)
    return f"running [{running}], waiting [{waiting}], {sched.allocator.num_free} pages free"


def drive(
    cfg: SchedulerConfig,
    num_pages: int,
    specs: list[Spec],
    aborts: dict[int, list[int]] | None = None,
    check_priority: bool = False,
    step_tokens: list[int] | None = None,
    overlap: bool = False,
) -> tuple[list[ARRequest], Scheduler, dict[str, ARRequest]]:
    """Run every request to the end as ``AREngine`` + the pipeline loop do, checking each step.

    ``aborts``: ``{step: [request index]}`` aborted before that step (when still unfinished).
    ``step_tokens``: when given, each step's number of tokens is appended to it. ``overlap``:
    each step is scheduled before the one before it is read, as ``AREngine(overlap=True)``
    does (reading it first when :meth:`Scheduler.may_preempt`).
    """
    aborts = aborts or {}
    alloc = PageAllocator(num_pages)
    sched = Scheduler(cfg, alloc)
    by_id = {f"r{i}": s for i, s in enumerate(specs)}
    runner = FakeRunner(num_pages, cfg, by_id)
    reqs = [
        ARRequest(f"r{i}", i, list(s.prompt), s.params, s.seed, eos_token_ids=(EOS,))
        for i, s in enumerate(specs)
    ]
    finished: dict[str, ARRequest] = {}
    submitted = 0
    # Without preemption a request needs at most max_model_len steps; a run that samples no
    # token beyond any request's high-water mark for this long goes round in circles.
    stall_limit = 2 * len(specs) * cfg.cache.max_model_len + 50
    high_water, last_progress = [0] * len(reqs), 0
    in_flight: tuple[list[tuple[ARRequest, StepRow]], StepResult] | None = None
    draws = {r.request_id: 0 for r in reqs}  # each request's sampling rows dispatched

    def read(flight: tuple[list[tuple[ARRequest, StepRow]], StepResult]) -> None:
        for r in sched.update(*flight).finished:
            assert r.request_id not in finished, f"{r.request_id} finished twice"
            assert r.status is Status.FINISHED and (r.pages == []) == (r.pending == 0)
            finished[r.request_id] = r

    clock = 0
    for clock in range(10**6):
        if clock - last_progress > stall_limit:
            raise AssertionError(f"no new token in {stall_limit} steps (livelock): {describe(sched)}")
        while submitted < len(reqs) and specs[submitted].arrive_step <= clock:
            sched.add(reqs[submitted])
            submitted += 1
        for j in aborts.get(clock, []):
            r = reqs[j]
            if j < submitted and r.request_id not in finished:
                assert sched.abort(r.request_id) is r
                finished[r.request_id] = r
        check_pages(sched, alloc, reqs)
        if not sched.has_work() and in_flight is None:
            if submitted == len(reqs):
                break
            last_progress = clock  # idle until the next arrival
            continue
        if in_flight is not None and sched.may_preempt():
            read(in_flight)
            in_flight = None
        before = {id(r): len(r.pages) for r in sched.running}
        queued = {id(r): r.num_preemptions for r in sched.waiting}
        step = sched.schedule()
        readmitted = [
            r.request_id for r in sched.waiting if queued.get(id(r), r.num_preemptions) < r.num_preemptions
        ]
        assert not readmitted, f"admitted and preempted in one schedule(): {readmitted}"
        for r, row in step:
            draws[r.request_id] += row.sample
        # An early read (may_preempt) can finish every request: the step is then rightly empty.
        assert step or in_flight or not sched.has_work(), (
            "the scheduler has work but scheduled nothing (the run would spin forever)"
        )
        check_step(sched, step)
        if step_tokens is not None and step:
            step_tokens.append(sum(len(row.token_ids) for _, row in step))
        if check_priority:
            check_preemptions(before, sched, step)
        check_pages(sched, alloc, reqs)
        previous = in_flight
        if step:
            drew = (
                {} if previous is None else {id(r): i for i, (r, row) in enumerate(previous[0]) if row.sample}
            )
            result = runner.execute(step, [drew[id(r)] if row.pending_token else -1 for r, row in step])
            sched.commit(step)
            in_flight = (step, result)
        else:
            in_flight = None
        if previous is not None:
            read(previous)
        if in_flight is not None and not overlap:
            read(in_flight)
            in_flight = None
        for i, r in enumerate(reqs):
            if len(r.output_ids) > high_water[i]:
                high_water[i], last_progress = len(r.output_ids), clock
    assert alloc.num_free == num_pages, "pages not returned at the end of the run"
    assert not alloc._used
    assert set(finished) == {r.request_id for r in reqs}
    # Every row dispatched for a request that ran to its length gave it a token; only a stop
    # (EOS, a stop id, an abort) read while a row was in flight drops that row's token.
    for r in reqs:
        wasted = draws[r.request_id] - len(r.output_ids)
        assert 0 <= wasted <= (0 if r.finish_reason == "length" else 1), (
            r.request_id,
            r.finish_reason,
            wasted,
        )
    return reqs, sched, finished


@st.composite
def workloads(draw: st.DrawFn, with_aborts: bool = False, chunked: bool = False):
    """A scheduler configuration, a page budget and requests arriving over time.

    ``chunked``: prompt chunks smaller than the token budget (``AREngine`` always uses the
    budget as the chunk; the scheduler takes any). Half the configurations cut steps at row
    edges (any ascending sizes up to the budget, not only the runner's).
    """
    page_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    max_model_len = draw(st.integers(4, 96))
    budget = draw(st.sampled_from([16, 32, 64]))
    edges = draw(st.one_of(st.just(()), st.sets(st.integers(1, budget), max_size=6)))
    cfg = scheduler_config(
        max_num_seqs=draw(st.integers(1, 8)),
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        page_size=page_size,
        max_prefill_chunk=draw(st.sampled_from([2, 3, 5, 8])) if chunked else budget,
        row_edges=tuple(sorted(edges)),
    )
    per_seq = pages_needed(max_model_len, page_size)
    # From one sequence's worth of pages (constant preemption) to enough for everyone.
    num_pages = per_seq + draw(st.integers(0, per_seq * cfg.max_num_seqs))
    n = draw(st.integers(1, 12))
    arrivals = sorted(draw(st.lists(st.integers(0, 30), min_size=n, max_size=n)))
    specs = []
    for i in range(n):
        max_tokens = draw(st.one_of(st.none(), st.integers(1, 40)))
        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, min(3, max_tokens or 3))),
            stop_token_ids=draw(st.one_of(st.none(), st.lists(st.integers(2, VOCAB - 1), max_size=2))),
            ignore_eos=draw(st.booleans()),
        )
        length = draw(st.integers(1, max_model_len - 1))
        prompt = tuple(draw(st.lists(st.integers(0, VOCAB - 1), min_size=length, max_size=length)))
        eos_at = draw(st.one_of(st.none(), st.integers(0, 30)))
        specs.append(Spec(prompt, params, seed=i, eos_at=eos_at, arrive_step=arrivals[i]))
    aborts: dict[int, list[int]] = {}
    if with_aborts:
        for step, j in draw(st.lists(st.tuples(st.integers(0, 60), st.integers(0, n - 1)), max_size=4)):
            aborts.setdefault(step, []).append(j)
    return cfg, num_pages, specs, aborts


@SETTINGS
@given(workloads(), st.booleans())
def test_every_request_ends_as_if_run_alone(workload, overlap) -> None:
    """Pages never shared, all returned, limits kept, and each request's tokens and finish
    reason equal its solo run, whatever preemption happened on the way, with each step read
    before the next is scheduled or after (``overlap``: pending tokens, requests ending while a
    row of theirs is in flight)."""
    cfg, num_pages, specs, _ = workload
    reqs, _, finished = drive(cfg, num_pages, specs, overlap=overlap)
    for req, spec in zip(reqs, specs, strict=True):
        want, reason = alone(spec, cfg.cache.max_model_len)
        assert req.output_ids == want, req.request_id
        assert req.finish_reason == reason
        assert req.prompt_ids == list(spec.prompt)
    # Collected in submission order whatever order they finished in.
    assert [finished[r.request_id] for r in reqs] == reqs


@SETTINGS
@given(workloads(with_aborts=True), st.booleans())
def test_aborts_free_their_pages_and_leave_the_others_untouched(workload, overlap) -> None:
    cfg, num_pages, specs, aborts = workload
    reqs, _, _ = drive(cfg, num_pages, specs, aborts, overlap=overlap)
    for req, spec in zip(reqs, specs, strict=True):
        want, reason = alone(spec, cfg.cache.max_model_len)
        if req.finish_reason == "abort":
            assert want[: len(req.output_ids)] == req.output_ids
        else:
            assert (req.output_ids, req.finish_reason) == (want, reason)


def test_an_early_read_that_finishes_everyone_leaves_nothing_to_schedule() -> None:
    """Overlapped steps, pages short: the engine reads the step in flight before scheduling the
    next (``may_preempt``), and that read finishes both running requests (one by EOS, one by
    length), so the next step is empty while a request is yet to arrive; it then runs as
    usual. (Hypothesis found this run: the harness took the empty step for a stall.)"""
    cfg = scheduler_config(
        max_num_seqs=2, max_model_len=12, max_num_batched_tokens=16, page_size=2, max_prefill_chunk=16
    )
    greedy = SamplingParams(temperature=0.0)
    prompts = [(0,), (0,), (0, 0), (0, 0, 0, 0, 0), (0,)]
    specs = [
        Spec(prompt, greedy, seed=i, eos_at=8 if i == 2 else None, arrive_step=22 if i == 4 else 0)
        for i, prompt in enumerate(prompts)
    ]
    reqs, _, _ = drive(cfg, 11, specs, overlap=True)
    for req, spec in zip(reqs, specs, strict=True):
        assert (req.output_ids, req.finish_reason) == alone(spec, cfg.cache.max_model_len)
    assert [r.finish_reason for r in reqs] == ["length", "length", "stop", "length", "length"]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(1, 60), min_size=2, max_size=10), st.integers(1, 24))
def test_one_sequence_of_pages_still_finishes_everyone(max_num_seqs, lengths, max_tokens) -> None:
    """The smallest legal budget (one max_model_len sequence): requests run nearly one at a
    time, preempting each other, and all finish with exactly the tokens their params imply."""
    cfg = scheduler_config(
        max_num_seqs=max_num_seqs,
        max_model_len=64,
        max_num_batched_tokens=32,
        page_size=4,
        max_prefill_chunk=32,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    specs = [Spec(tuple(range(n)), params, seed=i, eos_at=None, arrive_step=0) for i, n in enumerate(lengths)]
    reqs, _, _ = drive(cfg, pages_needed(64, 4), specs)
    for req, n in zip(reqs, lengths, strict=True):
        assert len(req.output_ids) == min(max_tokens, 64 - n)
        assert req.finish_reason == "length"


def tiny(n: int) -> list[Spec]:
    """``n`` one-token prompts that run to ``max_model_len``."""
    params = SamplingParams(temperature=0.0, max_tokens=None)
    return [Spec((0,), params, seed=i, eos_at=None, arrive_step=0) for i in range(n)]


def test_a_newer_request_never_preempts_an_older_one() -> None:
    cfg = scheduler_config(
        max_num_seqs=3, max_model_len=5, max_num_batched_tokens=16, page_size=1, max_prefill_chunk=16
    )
    drive(cfg, 5, tiny(3), check_priority=True)


def test_small_prefill_chunks_do_not_livelock() -> None:
    cfg = scheduler_config(
        max_num_seqs=4, max_model_len=4, max_num_batched_tokens=32, page_size=1, max_prefill_chunk=2
    )
    drive(cfg, 4, tiny(4))


@settings(max_examples=300, deadline=None, derandomize=True, phases=[Phase.generate])
@given(workloads(chunked=True), st.booleans())
def test_chunked_prefill_keeps_priority_and_finishes(workload, overlap) -> None:
    """The properties above plus strict priority, with prompt chunks below the token budget.
    Fixed examples, no shrinking: fast and deterministic."""
    cfg, num_pages, specs, _ = workload
    reqs, _, _ = drive(cfg, num_pages, specs, check_priority=True, overlap=overlap)
    for req, spec in zip(reqs, specs, strict=True):
        assert (req.output_ids, req.finish_reason) == alone(spec, cfg.cache.max_model_len)


def test_a_step_just_past_a_row_edge_defers_its_newest_prompt_tokens() -> None:
    """The AR suite's case in small: a step of 1317 prompt tokens beside 20 decode rows ran as
    2048 rows. With row edges a step just past one (nearer it than the next) leaves its newest
    prompt tokens to the next step, an admission cut to nothing goes back to the front of the
    waiting queue, and every request still ends with its own tokens."""
    cfg = scheduler_config(
        max_num_seqs=4,
        max_model_len=64,
        max_num_batched_tokens=64,
        page_size=4,
        max_prefill_chunk=64,
        row_edges=(4, 8, 16, 32, 64),
    )
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    specs = [Spec(tuple(range(20)), params, seed=i, eos_at=None, arrive_step=0) for i in range(2)]
    tokens: list[int] = []
    reqs, _, _ = drive(cfg, 64, specs, step_tokens=tokens)
    # 40 tokens: 8 past 32, 24 short of 64, so 32 now (the second prompt's newest 8 wait);
    # then 1 decode + 8 = 9, 1 past 8: 8 now, the second prompt's last token beside the
    # first's third and last decode row, then the second's two decode rows alone.
    assert tokens == [32, 8, 2, 1, 1]
    for req, spec in zip(reqs, specs, strict=True):
        assert (req.output_ids, req.finish_reason) == alone(spec, cfg.cache.max_model_len)

    sched = Scheduler(cfg, PageAllocator(64))
    first, second, third = (
        ARRequest(f"r{i}", i, list(range(n)), params, i, eos_token_ids=(EOS,))
        for i, n in enumerate((32, 1, 5))
    )
    for r in (first, second, third):
        sched.add(r)
    step = sched.schedule()  # 32 + 1 + 5 = 38: 6 past 32, so both newcomers wait
    assert [(r.request_id, len(row.token_ids)) for r, row in step] == [("r0", 32)]
    assert list(sched.waiting) == [second, third]
    assert second.status is third.status is Status.WAITING and second.pages == third.pages == []
    assert sched.running == [first]


def test_a_request_is_itself_whatever_its_fields() -> None:
    """Requests compare by identity. Ending one looked it up in the running list and the waiting
    queue, and those lookups compared it, field by field (a dataclass ``__eq__``), with every
    request queued before it: an offline batch of 16384 requests made 2302 tokens/s where one of
    4096 made 8860 (RESULTS.md). Two requests alike in every field stay two: ending one, queued
    or running, leaves the other where it was."""
    params = SamplingParams(temperature=0.0, max_tokens=4)
    running, waiting, twin = (ARRequest("same", 0, [3, 4], params, 0) for _ in range(3))
    assert running == running and running != waiting and waiting != twin
    cfg = scheduler_config(
        max_num_seqs=1, max_model_len=64, max_num_batched_tokens=64, page_size=4, max_prefill_chunk=64
    )
    sched = Scheduler(cfg, PageAllocator(8))
    for r in (running, waiting, twin):
        sched.add(r)
    sched.schedule()
    assert sched.running == [running] and list(sched.waiting) == [waiting, twin]
    sched.fail(twin, "ended while queued")
    assert list(sched.waiting) == [waiting] and twin.status is Status.FINISHED
    sched.fail(running, "ended while running")
    assert sched.running == [] and list(sched.waiting) == [waiting] and waiting.status is Status.WAITING


def drawn(tokens: list[int]) -> StepResult:
    """A step's results with these sampled ``tokens``, all finite (nothing else captured)."""
    n = len(tokens)
    outputs: dict[str, object] = {f.name: None for f in dataclasses.fields(StepResult)}
    outputs.update(
        tokens=np.asarray(tokens, np.int64),
        finite=np.ones(n, bool),
        logprob_ids=np.zeros((n, 1)),
        logprobs=np.zeros((n, 1)),
    )
    return StepResult(**outputs)


def test_a_request_holds_exactly_the_pages_its_tokens_fill() -> None:
    """A prompt that exactly fills a page takes that page and no more, and each decode row takes a
    page only when its token starts one. A page taken early (at a page's last token instead of past
    it) leaves a request one page ahead all its life: a page no other request can have, so a full
    batch preempts requests that fit."""
    cfg = scheduler_config(
        max_num_seqs=1, max_model_len=16, max_num_batched_tokens=16, page_size=4, max_prefill_chunk=16
    )
    sched = Scheduler(cfg, PageAllocator(4))
    req = ARRequest("r0", 0, [0, 1, 2, 3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), 0)
    sched.add(req)
    held: list[tuple[int, int]] = []  # (tokens written up to, pages held) per step
    while sched.has_work():
        step = sched.schedule()
        ((r, row),) = step
        held.append((row.end, len(r.pages)))
        sched.commit(step)
        sched.update(step, drawn([2]))
    assert held == [(4, 1), (5, 2), (6, 2), (7, 2), (8, 2), (9, 3)]
    assert req.finish_reason == "length" and len(req.output_ids) == 6


def test_no_row_is_scheduled_once_the_pending_tokens_reach_max_tokens() -> None:
    """Overlapped steps (each scheduled before the one before it is read): a request whose pending
    tokens reach ``max_tokens`` gets no further row. One more would draw a token past its limit
    that is thrown away when the step before is read: a wasted decode row per request, every
    request, in the engine's default mode; its tokens stay right, so only the rows show it."""
    cfg = scheduler_config(
        max_num_seqs=1, max_model_len=16, max_num_batched_tokens=16, page_size=4, max_prefill_chunk=16
    )
    sched = Scheduler(cfg, PageAllocator(4))
    req = ARRequest("r0", 0, [0, 1, 2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), 0)
    sched.add(req)
    prefill = sched.schedule()
    sched.commit(prefill)  # draws token 0, not read yet
    decode = sched.schedule()
    assert [(row.draw_index, row.pending_token) for _, row in decode] == [(1, True)]
    sched.commit(decode)  # draws token 1, the last one max_tokens allows
    assert sched.schedule() == []
    assert sched.update(prefill, drawn([5])).finished == []
    assert sched.update(decode, drawn([6])).finished == [req]
    assert req.output_ids == [5, 6] and req.finish_reason == "length" and not sched.has_work()


def test_a_newcomer_is_not_admitted_into_the_page_a_running_request_needs_next() -> None:
    """One page free, and the running request's next token starts a page: a waiting request is
    not admitted into it (the running one would take it back by preempting the newcomer in the
    same ``schedule()``: a preemption, a recomputation and a lost id row for nothing)."""
    cfg = scheduler_config(
        max_num_seqs=2, max_model_len=16, max_num_batched_tokens=16, page_size=2, max_prefill_chunk=16
    )
    alloc = PageAllocator(2)
    sched = Scheduler(cfg, alloc)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    old, new = ARRequest("old", 0, [0, 1], params, 0), ARRequest("new", 1, [0], params, 1)
    sched.add(old)
    step = sched.schedule()
    sched.commit(step)
    sched.update(step, drawn([2]))  # the old request's third token starts its second page
    assert (len(old.pages), alloc.num_free) == (1, 1)
    sched.add(new)
    step = sched.schedule()
    assert [(r.request_id, row.end) for r, row in step] == [("old", 3)]
    assert list(sched.waiting) == [new] and new.status is Status.WAITING
    assert new.num_preemptions == 0 and new.pages == [] and new.id_row == -1
    assert len(old.pages) == 2 and alloc.num_free == 0
