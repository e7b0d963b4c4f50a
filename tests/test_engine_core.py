"""``EngineCore`` stepped by hand (no thread): what each step reports, with the AR engine's steps
overlapped (a step read during the next call) and not, and abort from an AR stage (its KV pages
back at once) and from the code2wav queue."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from omni_jax import OmniJaxPipeline, SamplingParams, Token2WavParams
from omni_jax.engine_core import EngineCore
from omni_jax.stages.base import StageStep
from omni_jax.stages.config import StageConfig


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def pipe(qwen2_dir) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(qwen2_dir, max_num_seqs=4, page_size=8, max_model_len=256)


def prompt(n: int, seed: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": [int(t) for t in np.random.RandomState(seed).randint(3, 200, size=n)]}


@pytest.mark.parametrize("overlap", [True, False])
def test_streamed_requests_report_each_step_others_only_their_end(pipe, monkeypatch, overlap) -> None:
    core = pipe.core
    monkeypatch.setattr(pipe.stages[0].engine, "overlap", overlap)
    # 16 prompt tokens, a row edge: both prompts in the first step (18 would be cut back to 16).
    streamed, whole = pipe.intake.admit([prompt(8, 0), prompt(8, 0)], greedy(6), ["s", "w"])
    core.add(streamed, stream=True)
    core.add(whole)
    steps = []
    while core.has_work():
        steps.append({u.request_id: u for u in core.step()})
    # Overlapped, the first call only dispatches its step; the call that dispatches the sixth
    # token's step reads the fifth, and the next one, with nothing left to schedule, the sixth.
    lag = [[]] if overlap else []
    assert [sorted(s) for s in steps] == lag + [["s"]] * 5 + [["s", "w"]]
    steps = steps[len(lag) :]
    last_s, last_w = steps[-1]["s"], steps[-1]["w"]
    assert last_s.finished and last_w.finished and not any(s["s"].finished for s in steps[:-1])
    assert [s["s"].token_ids_delta for s in steps] == [[t] for t in last_w.token_ids]
    assert last_s.token_ids == last_w.token_ids and last_w.token_ids_delta == []


def test_abort_frees_the_requests_pages_at_once(pipe) -> None:
    core = pipe.core
    scheduler = pipe.stages[0].engine.scheduler
    doomed, other = pipe.intake.admit([prompt(40, 1), prompt(17, 2)], greedy(30), ["doomed", "other"])
    core.add(doomed, stream=True)
    core.add(other, stream=True)
    streamed, streamed_by = [], []
    for _ in range(4):
        updates = core.step()
        streamed_by += updates
        streamed += [t for u in updates if u.request_id == "doomed" for t in u.token_ids_delta]
    (request,) = [r for r in scheduler.running if r.request_id == "doomed"]
    held, free = len(request.pages), scheduler.allocator.num_free
    assert request.pending == 1  # its fourth token's step is in flight, still writing its pages
    out = core.abort("doomed")
    assert out is not None and out.finished and out.finish_reason == "abort"
    # The abort read that step first: the pages are back at once.
    assert held > 0 and request.pages == [] and scheduler.allocator.num_free == free + held
    # One token a call after the first (which only dispatched), the first with the prompts.
    assert out.token_ids == streamed and len(streamed) == 3
    rest = []
    while core.has_work():
        rest += core.step()
    assert {u.request_id for u in rest} == {"other"}
    assert rest[-1].token_ids == pipe.run(prompt(17, 2), greedy(30), progress=False)[0].token_ids
    # The step the abort read held the other's row too: its token is streamed with the next step's.
    others = [t for u in streamed_by if u.request_id == "other" for t in u.token_ids_delta]
    assert others + [t for u in rest for t in u.token_ids_delta] == rest[-1].token_ids
    assert scheduler.allocator.num_free == scheduler.allocator.num_pages


@pytest.mark.parametrize("overlap", [True, False])
def test_an_engine_step_reads_out_the_requests_it_ran_and_no_queued_one(pipe, monkeypatch, overlap) -> None:
    """``AREngine.step``'s ``read`` is what a stage reports from: every request whose tokens grew
    in the call, each once, oldest first, and none of those still queued (four run at once
    here, ten wait their turn)."""
    engine = pipe.stages[0].engine
    monkeypatch.setattr(engine, "overlap", overlap)
    scheduler = engine.scheduler
    requests = [
        engine.add_request(f"q{k}", prompt(5 + k, k)["prompt_token_ids"], greedy(3 + k % 4))
        for k in range(14)
    ]
    queued_calls = 0
    while engine.has_work():
        before = {id(r): len(r.output_ids) for r in requests}
        waiting = {id(r) for r in scheduler.waiting}
        stepped = engine.step()
        read = {id(r) for r in stepped.read}
        assert {id(r) for r in requests if len(r.output_ids) > before[id(r)]} <= read
        assert {id(r) for r in stepped.finished} <= read
        arrivals = [r.arrival for r in stepped.read]
        assert arrivals == sorted(set(arrivals))  # each once, oldest first
        queued = waiting & {id(r) for r in scheduler.waiting}  # waiting before the call and after
        assert not queued & read
        queued_calls += bool(queued)
    assert queued_calls > 3  # calls with requests queued throughout did happen
    assert all(r.finish_reason == "length" and len(r.output_ids) == 3 + k % 4 for k, r in enumerate(requests))


def test_ids_in_use_are_refused(pipe) -> None:
    core = pipe.core
    first, again = pipe.intake.admit([prompt(5, 3), prompt(5, 4)], greedy(2), ["same", "same"])
    core.add(first)
    with pytest.raises(ValueError, match="request id 'same' is already in use"):
        core.add(again)
    while core.has_work():
        core.step()
    assert not pipe.stages[0].has_work()


def test_an_aborted_request_is_not_held_once_the_engine_is_idle(pipe) -> None:
    """A lone request aborted while its step is unread: the abort reads that step, and nothing
    in the engine keeps the request afterwards (it once waited, with its tokens and states, for
    a next step that an idle engine never takes)."""
    core, engine = pipe.core, pipe.stages[0].engine
    (lone,) = pipe.intake.admit([prompt(9, 3)], greedy(30), ["lone"])
    core.add(lone, stream=True)
    for _ in range(3):
        core.step()
    assert engine._unread
    (request,) = engine.scheduler.running
    held = weakref.ref(request)
    del request
    assert core.abort("lone").finish_reason == "abort"
    assert not core.has_work()
    gc.collect()
    assert held() is None


def test_abort_drops_a_request_from_the_code2wav_queue(omni_dir) -> None:
    pipe = OmniJaxPipeline.from_pretrained(omni_dir, stages=["code2wav"])
    core = pipe.core
    params = Token2WavParams(num_steps=2, seed=0)
    codes = {"prompt_token_ids": [1, 2, 3, 4, 5]}
    kept, dropped = pipe.intake.admit([codes, dict(codes, speaker="Ethan")], params, ["kept", "dropped"])
    core.add(kept, stream=True)
    core.add(dropped, stream=True)
    out = core.abort("dropped")
    assert out is not None and out.finish_reason == "abort" and out.audio is None
    updates = []
    while core.has_work():
        updates += core.step()
    (last,) = updates
    assert last.request_id == "kept" and last.finished and last.metrics["code2wav"]["batch_size"] == 1
    np.testing.assert_array_equal(last.audio_delta, last.audio)
    assert last.token_ids_delta == last.token_ids == codes["prompt_token_ids"]
    np.testing.assert_array_equal(last.audio, pipe.run(codes, params, progress=False)[0].audio)


class Waiting:
    """A stage with work that, unless told to block, finds it all on an unfinished device."""

    def __init__(self, name: str):
        self.config = StageConfig(name=name, kind="ar", input="prompt")
        self.blocks: list[bool] = []

    def has_work(self) -> bool:
        return True

    def step(self, block: bool = True) -> StageStep:
        self.blocks.append(block)
        return StageStep([], idle=not block)


def test_a_step_in_which_every_stage_was_idle_makes_the_next_one_block() -> None:
    """While others have work a stage steps without ``block``; when every stage came back
    ``idle`` (nothing done: all of it on the device), the next step blocks them, so the loop
    waits for a device instead of spinning, and then goes back to not blocking."""
    stages = [Waiting("first"), Waiting("second")]
    core = EngineCore(stages, tokenizer=None)
    for _ in range(4):
        assert core.step() == []
    assert [s.blocks for s in stages] == [[False, True, False, True]] * 2


def test_without_overlap_every_step_blocks() -> None:
    """``EngineCore.overlap`` off (several processes in lockstep, or a benchmark's
    ``--sequential-steps``): every stage steps with ``block``, other stages' work or not."""
    stages = [Waiting("first"), Waiting("second")]
    core = EngineCore(stages, tokenizer=None)
    assert core.overlap
    core.overlap = False
    for _ in range(3):
        assert core.step() == []
    assert [s.blocks for s in stages] == [[True, True, True]] * 2
