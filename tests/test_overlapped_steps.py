"""The AR engine's overlapped steps (``AREngine.overlap``: each step scheduled and dispatched
before the one before it is read, a pending token taken from that step's draw on the device)
give exactly the tokens and log-probabilities of steps read one at a time.

The workload mixes what overlap must handle: greedy and seeded sampled requests, penalties
(which read a pending token on the device too), log-probabilities, EOS and stop ids
ending requests while their next row is already in flight (a dropped row), ``min_tokens``, and
more requests than ``max_num_seqs``. The greedy tests against transformers
(``test_run_greedy.py``, ``test_omni_pipeline.py``) run overlapped too, the default.
"""

from __future__ import annotations

import numpy as np
import pytest

from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.engine.ar_runner import ARRunner, Dispatched
from omni_jax.engine.scheduler import Scheduler

LENGTHS = (5, 33, 12, 1, 20, 9, 48, 3, 17, 26)


@pytest.fixture(scope="module")
def pipe(qwen2_dir) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(qwen2_dir, max_num_seqs=4, page_size=8, max_model_len=128)


def workload(pipe: OmniJaxPipeline) -> tuple[list[dict[str, list[int]]], list[SamplingParams]]:
    """The prompts and their params; every fifth request is greedy with a stop id that its
    reply reaches (its fifth token, or a later one not drawn before it), so it stops early."""
    rs = np.random.RandomState(11)
    vocab = pipe.stages[0].vocab_size
    prompts = [{"prompt_token_ids": [int(t) for t in rs.randint(3, vocab, size=n)]} for n in LENGTHS]
    free = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)
    replies = [o.token_ids for o in pipe.run(prompts[4::5], free, progress=False)]
    stops = iter([next(t for i, t in enumerate(r) if i >= 4 and t not in r[:i]) for r in replies])
    params = []
    for i in range(len(LENGTHS)):
        kind = i % 5
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=12))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.9, top_k=20, seed=100 + i, max_tokens=10, logprobs=3))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=i, max_tokens=9))
        elif kind == 3:
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=14, min_tokens=4))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=11, stop_token_ids=[next(stops)]))
    return prompts, params


def run(
    pipe: OmniJaxPipeline,
    requests: tuple[list[dict[str, list[int]]], list[SamplingParams]],
    overlap: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list, int, int]:
    """The outputs, how many rows read a pending token, and how many rows of requests that
    ended while they were in flight were dropped."""
    engine = pipe.stages[0].engine
    monkeypatch.setattr(engine, "overlap", overlap)
    pending, dropped = [0], [0]
    dispatch, drop = ARRunner.dispatch, Scheduler._drop_pending

    def counted(self: ARRunner, rows, sources=()) -> Dispatched:  # noqa: ANN001
        pending[0] += sum(r.pending_token for r in rows)
        return dispatch(self, rows, sources)

    def dropping(self: Scheduler, *args) -> None:  # noqa: ANN002
        dropped[0] += 1
        drop(self, *args)

    monkeypatch.setattr(ARRunner, "dispatch", counted)
    monkeypatch.setattr(Scheduler, "_drop_pending", dropping)
    outs = pipe.run(*requests, progress=False)
    monkeypatch.undo()
    return outs, pending[0], dropped[0]


def test_overlapped_steps_give_the_tokens_of_steps_read_one_at_a_time(pipe, monkeypatch) -> None:
    requests = workload(pipe)
    one_at_a_time, *none = run(pipe, requests, False, monkeypatch)
    overlapped, pending, dropped = run(pipe, requests, True, monkeypatch)
    for a, b in zip(overlapped, one_at_a_time, strict=True):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), a.request_id
        assert a.logprobs == b.logprobs
    assert none == [0, 0]
    # Rows read their token on the device, and requests stopped with a row in flight.
    assert pending > 20 and dropped > 0
    reasons = {o.finish_reason for o in overlapped}
    assert reasons == {"stop", "length"}  # some requests end on a stop id while overlapped
    scheduler = pipe.stages[0].engine.scheduler
    assert scheduler.allocator.num_free == scheduler.allocator.num_pages
    assert not pipe.stages[0].engine.has_work()


def test_a_penalised_request_reads_its_pending_token_on_the_device(pipe, monkeypatch) -> None:
    """Penalties read a request's ids, its pending token included: the sampler adds it to them
    on the device, and the tokens are those of steps read one at a time (where the host has
    it), greedy and sampled."""
    engine = pipe.stages[0].engine
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=3.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0, max_tokens=16),
        SamplingParams(temperature=1.0, repetition_penalty=2.0, seed=5, max_tokens=16),
    ]
    prompts = [prompt] * len(params)
    runs, pending = [], []
    dispatch = ARRunner.dispatch

    def counted(self: ARRunner, rows, sources=()) -> Dispatched:  # noqa: ANN001
        pending[-1] += sum(r.pending_token for r in rows)
        return dispatch(self, rows, sources)

    monkeypatch.setattr(ARRunner, "dispatch", counted)
    for overlap in (False, True):
        monkeypatch.setattr(engine, "overlap", overlap)
        pending.append(0)
        runs.append([o.token_ids for o in pipe.run(prompts, params, progress=False)])
    assert runs[1] == runs[0]
    assert pending == [0, 45]  # every decode row after the first of each request


def test_steps_left_unread_without_block_give_the_same_tokens(pipe, monkeypatch) -> None:
    """``AREngine.step(block=False)``, as the engine core asks while another stage has work:
    a step the device has not finished (each held here for its first two looks) is left unread,
    a second one is dispatched behind it, and a call that can do nothing but wait returns
    ``idle``. The tokens, log-probabilities and finish reasons are those of steps read one at a
    time, and every page comes back."""
    requests = workload(pipe)
    one_at_a_time, *_ = run(pipe, requests, False, monkeypatch)
    stage = pipe.stages[0]
    engine = stage.engine
    looks: dict[int, int] = {}
    unread, idle = [], [0]
    done, step = ARRunner.done, type(stage).step

    def slow(self: ARRunner, dispatched: Dispatched) -> bool:
        looks[id(dispatched)] = looks.get(id(dispatched), 0) + 1
        return looks[id(dispatched)] > 2 and done(self, dispatched)

    def unblocked(block: bool = True):  # noqa: ANN202
        stepped = step(stage, block=False)
        unread.append(len(engine._unread))
        idle[0] += stepped.idle
        return stepped

    monkeypatch.setattr(ARRunner, "done", slow)
    monkeypatch.setattr(stage, "step", unblocked)
    left = pipe.run(*requests, progress=False)
    monkeypatch.undo()
    for a, b in zip(left, one_at_a_time, strict=True):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), a.request_id
        assert a.logprobs == b.logprobs
    assert max(unread) == 2 and idle[0] > 10
    assert not engine.has_work()
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_pages


def test_an_abort_reads_both_unread_steps_first(pipe, monkeypatch) -> None:
    """With two steps unread (``block=False``, the device not done with the first), aborting a
    request with rows in them reads both, in order: its pages are back at once, and the other
    requests end with the tokens of a run without the abort."""
    stage = pipe.stages[0]
    engine, core = stage.engine, pipe.core
    prompts = [
        {"prompt_token_ids": [int(t) for t in np.random.RandomState(s).randint(3, 200, 9)]} for s in (1, 2)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = pipe.run(prompts[1], greedy, progress=False)[0].token_ids
    step = type(stage).step
    monkeypatch.setattr(stage, "step", lambda block=True: step(stage, block=False))
    monkeypatch.setattr(ARRunner, "done", lambda self, dispatched: False)
    for admission in pipe.intake.admit(prompts, greedy, ["doomed", "other"]):
        core.add(admission)
    for _ in range(3):
        core.step()
    assert len(engine._unread) == 2 and core.step() == [] and len(engine._unread) == 2
    (doomed,) = [r for r in engine.scheduler.running if r.request_id == "doomed"]
    free = engine.scheduler.allocator.num_free
    held = len(doomed.pages)
    assert core.abort("doomed").finish_reason == "abort"
    assert not engine._unread and doomed.pages == [] and engine.scheduler.allocator.num_free == free + held
    monkeypatch.undo()
    rest = []
    while core.has_work():
        rest += core.step()
    assert [u.request_id for u in rest] == ["other"] and rest[0].token_ids == want
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_pages
