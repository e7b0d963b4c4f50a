"""``AsyncOmniJaxPipeline`` on a tiny Qwen2 checkpoint: the engine thread, streaming, arrivals
while others run, abort and cancellation, refusals and faults.

Every result is held to ``OmniJaxPipeline.run`` on the same prompt with greedy params (a
separate pipeline of the same sizes), which ``tests/test_run_greedy.py`` holds to transformers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
import pytest

from omni_jax import AsyncOmniJaxPipeline, OmniJaxPipeline, OmniRequestOutput, SamplingParams
from omni_jax.async_pipeline import QueueFullError
from omni_jax.stages.base import StageStep

SIZES = dict(max_num_seqs=4, page_size=8, max_model_len=256)
T = TypeVar("T")


def run_async(make: Callable[[], Awaitable[T]], timeout: float = 300) -> T:
    """Run a coroutine on a fresh event loop, bounded in time so a hang fails the test."""

    async def bounded() -> T:
        return await asyncio.wait_for(make(), timeout)

    return asyncio.run(bounded())


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def ids(n: int, seed: int) -> dict[str, Any]:
    rs = np.random.RandomState(seed)
    return {"prompt_token_ids": [int(t) for t in rs.randint(3, 200, size=n)]}


async def collect(
    pipe: AsyncOmniJaxPipeline, prompt: Any, params: Any = None, **kw: Any
) -> list[OmniRequestOutput]:
    return [out async for out in pipe.generate(prompt, params, **kw)]


@pytest.fixture(scope="module")
def sync(qwen2_dir) -> OmniJaxPipeline:
    return OmniJaxPipeline.from_pretrained(qwen2_dir, **SIZES)


@pytest.fixture(scope="module")
def pipe(qwen2_dir):
    with_engine = AsyncOmniJaxPipeline.from_pretrained(qwen2_dir, **SIZES)
    yield with_engine
    with_engine.close()


def allocator(pipe: AsyncOmniJaxPipeline) -> Any:
    return pipe.pipeline.stages[0].engine.scheduler.allocator


def check_stream(updates: list[OmniRequestOutput]) -> OmniRequestOutput:
    """The last update is the whole output, and the deltas of all updates add up to it."""
    *before, last = updates
    assert last.finished and not any(u.finished for u in before)
    assert len({u.request_id for u in updates}) == 1
    assert [t for u in updates for t in u.token_ids_delta] == last.token_ids
    assert [lp for u in updates for lp in u.logprobs_delta] == (last.logprobs or [])
    assert "".join(u.text_delta for u in updates) == (last.text or "")
    return last


def test_generate_equals_run_and_streams_every_token(pipe, sync) -> None:
    for prompt in ["hello world the model", ids(30, 1)]:
        (ref,) = sync.run(prompt, greedy(12), progress=False)
        updates = run_async(lambda prompt=prompt: collect(pipe, prompt, greedy(12)))
        out = check_stream(updates)
        assert (out.token_ids, out.text, out.finish_reason) == (ref.token_ids, ref.text, "length")
        assert out.prompt_token_ids == ref.prompt_token_ids
        # one update per decode step, each with the token sampled in it
        assert [len(u.token_ids_delta) for u in updates] == [1] * 12


def test_each_update_carries_its_tokens_logprobs(pipe, sync) -> None:
    """Requests asking for none, the sampled token's alone and the top 3: each one alone gives
    ``run``'s log-probabilities exactly (the same steps compute them); all three at once, each
    token's come in the update that brings the token, for the same tokens and alternatives
    (their values then come from steps of another batch shape, whose float32 sums may differ in
    the last bits from a lone request's)."""
    asks = [None, 0, 3]
    prompts = [ids(9 + 7 * i, 20 + i) for i in range(len(asks))]
    params = [dataclasses.replace(greedy(10), logprobs=n) for n in asks]
    refs = [sync.run(prompt, p, progress=False)[0] for prompt, p in zip(prompts, params, strict=True)]
    for prompt, p, ref in zip(prompts, params, refs, strict=True):
        out = check_stream(run_async(lambda prompt=prompt, p=p: collect(pipe, prompt, p)))
        assert (out.token_ids, out.logprobs) == (ref.token_ids, ref.logprobs)

    async def all_at_once() -> list[list[OmniRequestOutput]]:
        return await asyncio.gather(*(collect(pipe, p, s) for p, s in zip(prompts, params, strict=True)))

    for n, ref, updates in zip(asks, refs, run_async(all_at_once), strict=True):
        out = check_stream(updates)
        assert out.token_ids == ref.token_ids
        for u in updates:
            assert len(u.logprobs_delta) == (0 if n is None else len(u.token_ids_delta))
            for tok, lp in zip(u.token_ids_delta, u.logprobs_delta, strict=False):
                assert next(iter(lp)) == tok and len(lp) == max(n, 1)  # greedy: the top token
        if n is None:
            assert out.logprobs is None and ref.logprobs is None
        else:
            assert [list(lp) for lp in out.logprobs] == [list(lp) for lp in ref.logprobs]


def test_text_deltas_are_the_text_of_the_tokens_so_far(pipe) -> None:
    """Each update's text is what its tokens complete; pieces of a character wait for the rest."""
    updates = run_async(lambda: collect(pipe, "the model stream request", greedy(20)))
    out = check_stream(updates)
    tokens: list[int] = []
    sent = ""
    for u in updates:
        tokens += u.token_ids_delta
        sent += u.text_delta
        assert pipe.pipeline.tokenizer.decode(tokens, skip_special_tokens=True).startswith(sent)
    assert sent == out.text and out.text


def test_concurrent_requests_all_complete_unmixed(pipe, sync) -> None:
    """Eight requests of different prompts and lengths at once (more than max_num_seqs=4)."""
    lengths = [3, 40, 11, 25, 7, 60, 18, 2]
    prompts = [ids(5 + 9 * i, 10 + i) for i in range(8)]
    params = [greedy(n) for n in lengths]
    refs = sync.run(prompts, params, progress=False)

    async def all_at_once() -> list[list[OmniRequestOutput]]:
        return await asyncio.gather(
            *(
                collect(pipe, p, s, request_id=f"r{i}")
                for i, (p, s) in enumerate(zip(prompts, params, strict=True))
            )
        )

    for i, (updates, ref) in enumerate(zip(run_async(all_at_once), refs, strict=True)):
        out = check_stream(updates)
        assert out.request_id == f"r{i}"
        assert out.prompt_token_ids == ref.prompt_token_ids
        assert out.token_ids == ref.token_ids and len(out.token_ids) == lengths[i]
    assert allocator(pipe).num_free == allocator(pipe).num_pages


def test_request_sent_while_others_decode_joins_them(pipe, sync) -> None:
    """A short request sent once two long ones are decoding finishes before either of them."""
    long_prompt, short_prompt = ids(20, 3), ids(6, 4)
    long_ref, short_ref = sync.run([long_prompt, short_prompt], [greedy(80), greedy(4)], progress=False)
    finished: list[str] = []

    async def scenario() -> list[list[OmniRequestOutput]]:
        decoding = asyncio.Event()

        async def send(prompt: Any, params: SamplingParams, rid: str) -> list[OmniRequestOutput]:
            updates = []
            async for out in pipe.generate(prompt, params, request_id=rid):
                updates.append(out)
                if len(updates) == 5:
                    decoding.set()
            finished.append(rid)
            return updates

        longs = [asyncio.create_task(send(long_prompt, greedy(80), rid)) for rid in ("long1", "long2")]
        await decoding.wait()
        short = await send(short_prompt, greedy(4), "short")
        return [short, *await asyncio.gather(*longs)]

    short, *longs = run_async(scenario)
    assert finished[0] == "short", finished
    assert check_stream(short).token_ids == short_ref.token_ids
    for updates in longs:
        assert check_stream(updates).token_ids == long_ref.token_ids


async def first_updates(gen: Any, n: int) -> list[OmniRequestOutput]:
    return [await gen.__anext__() for _ in range(n)]


def test_abort_mid_decode_frees_its_pages_and_the_others_finish(pipe, sync) -> None:
    pages = allocator(pipe)
    others = [ids(12, 5), ids(33, 6)]
    refs = sync.run(others, greedy(30), progress=False)

    async def scenario() -> tuple[list[OmniRequestOutput], list[list[OmniRequestOutput]]]:
        asks = dataclasses.replace(greedy(200), logprobs=2)
        doomed = pipe.generate(ids(40, 7), asks, request_id="doomed")
        seen = await first_updates(doomed, 5)
        assert pages.num_free < pages.num_pages  # it holds pages while it decodes
        await pipe.abort("doomed")  # alone in the engine: once this returns the engine idles
        assert pages.num_free == pages.num_pages
        rest = [out async for out in doomed]
        tasks = [asyncio.create_task(collect(pipe, p, greedy(30))) for p in others]
        victim = pipe.generate(ids(40, 8), greedy(200), request_id="victim")
        await first_updates(victim, 3)
        await pipe.abort("victim")
        await victim.aclose()
        return seen + rest, await asyncio.gather(*tasks)

    doomed, finished = run_async(scenario)
    out = check_stream(doomed)
    assert out.finish_reason == "abort" and 5 <= len(out.token_ids) < 200
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)  # as streamed
    for updates, ref in zip(finished, refs, strict=True):
        assert check_stream(updates).token_ids == ref.token_ids
    assert pages.num_free == pages.num_pages


@pytest.mark.parametrize("how", ["cancel", "aclose"])
def test_a_consumer_that_goes_away_aborts_its_request(pipe, how) -> None:
    pages = allocator(pipe)

    async def scenario() -> None:
        generated = pipe.pipeline.core.generated_tokens  # grows when a request finishes, not on abort
        gen = pipe.generate(ids(40, 9), greedy(200), request_id=how)
        if how == "aclose":
            await first_updates(gen, 3)
            await gen.aclose()
        else:
            task = asyncio.create_task(first_updates(gen, 1000))
            while pages.num_free == pages.num_pages:  # until it decodes
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        # Commands run in order: once this abort (of nothing) is done, the consumer's has run.
        await pipe.abort("no such request")
        assert pages.num_free == pages.num_pages
        assert not pipe.pipeline.core.has_work() and pipe.pipeline.core.generated_tokens == generated

    run_async(scenario)


def test_abort_while_the_request_is_admitted_ends_it(pipe, monkeypatch) -> None:
    """An abort that comes while ``generate`` still admits its request (the prompt processed, the
    media decoded, on the intake thread) is not lost: the request ends ``"abort"`` as the engine
    takes it in, with no token, and holds no page."""
    pages = allocator(pipe)
    started, release = threading.Event(), threading.Event()
    admit = pipe.pipeline.intake.admit

    def slow_admit(*args: Any) -> Any:
        started.set()
        release.wait(60)
        return admit(*args)

    monkeypatch.setattr(pipe.pipeline.intake, "admit", slow_admit)

    async def scenario() -> list[OmniRequestOutput]:
        generated = pipe.pipeline.core.generated_tokens
        task = asyncio.create_task(collect(pipe, ids(40, 10), greedy(200), request_id="early"))
        while not started.is_set():
            await asyncio.sleep(0.01)
        await pipe.abort("early")
        release.set()
        updates = await task
        await pipe.abort("no such request")  # commands run in order: the engine is idle after it
        assert not pipe.pipeline.core.has_work() and pipe.pipeline.core.generated_tokens == generated
        return updates

    out = check_stream(run_async(scenario))
    assert out.finish_reason == "abort" and out.token_ids == []
    assert pages.num_free == pages.num_pages


BAD = [
    ({"prompt_token_ids": []}, None, "request 0: empty prompt"),
    ({"prompt_token_ids": [1, 2, 10**6]}, None, "request 0: token id 1000000 outside the vocabulary"),
    (
        {"prompt": "x", "multi_modal_data": {"image": [1]}},
        None,
        "request 0: this model takes no image: its stage 'llm' reads no multi_modal_data",
    ),
    ("hello", SamplingParams(temperature=-1.0), "request 0: stage 'llm': temperature"),
    ("hello", "greedy", "sampling params must be one SamplingParams"),
    (["hello"], None, "request 0: a prompt is a str or a dict, got list"),
]


@pytest.mark.parametrize("prompt,params,match", BAD)
def test_bad_input_is_refused_before_queueing(pipe, sync, prompt, params, match) -> None:
    stage = pipe.pipeline.stages[0]

    async def scenario() -> list[OmniRequestOutput]:
        with pytest.raises(ValueError, match=match):
            await collect(pipe, prompt, params)
        assert not pipe.pipeline.core.has_work() and not stage._submitted
        return await collect(pipe, "hello world", greedy(3))

    out = check_stream(run_async(scenario))
    assert out.token_ids == sync.run("hello world", greedy(3), progress=False)[0].token_ids


def test_request_id_in_use_is_refused(pipe) -> None:
    async def scenario() -> None:
        first = pipe.generate(ids(10, 11), greedy(50), request_id="same")
        await first_updates(first, 1)
        with pytest.raises(ValueError, match="request_id must be a str not in use"):
            await collect(pipe, ids(10, 12), greedy(2), request_id="same")
        await first.aclose()
        assert check_stream(await collect(pipe, ids(10, 12), greedy(2), request_id="same")).finished

    run_async(scenario)


def test_a_fault_no_stage_contains_ends_the_requests_in_flight_only(pipe, sync, monkeypatch) -> None:
    stage = pipe.pipeline.stages[0]
    step = stage.step
    calls = {"n": 0}

    def faulty(block: bool = True) -> StageStep:
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected fault")
        return step(block)

    monkeypatch.setattr(stage, "step", faulty)
    out = check_stream(run_async(lambda: collect(pipe, ids(10, 13), greedy(20))))
    assert out.finish_reason == "error" and "injected fault" in out.error
    assert pipe.running and allocator(pipe).num_free == allocator(pipe).num_pages
    again = check_stream(run_async(lambda: collect(pipe, ids(10, 13), greedy(20))))
    assert again.token_ids == sync.run(ids(10, 13), greedy(20), progress=False)[0].token_ids


def test_the_admitted_event_is_set_by_the_first_update(pipe, sync) -> None:
    """``admitted`` is set once the engine holds the request, by the time its first update is
    handed over (the server admits a request's several replies on it, without waiting for each
    one's first token), and a request never admitted leaves it unset."""

    async def scenario() -> tuple[bool, list[OmniRequestOutput], bool]:
        admitted, refused = asyncio.Event(), asyncio.Event()
        updates = pipe.generate(ids(7, 60), greedy(6), admitted=admitted)
        first = await anext(updates)
        was_set = admitted.is_set()
        rest = [out async for out in updates]
        with pytest.raises(ValueError, match="empty prompt"):
            await collect(pipe, {"prompt_token_ids": []}, greedy(6), admitted=refused)
        return was_set, [first, *rest], refused.is_set()

    was_set, outs, refused_set = run_async(scenario)
    assert was_set and not refused_set
    assert check_stream(outs).token_ids == sync.run(ids(7, 60), greedy(6), progress=False)[0].token_ids


@pytest.mark.parametrize("bound", [0, -1, True, 1.5])
def test_a_queue_bound_that_could_take_no_request_is_refused(bound: object) -> None:
    """``max_waiting=0`` would refuse every request as queue-full: refused at construction, before
    the pipeline is touched."""
    with pytest.raises(ValueError, match=rf"^max_waiting={bound!r} must be a positive int or None$"):
        AsyncOmniJaxPipeline(None, max_waiting=bound)  # type: ignore[arg-type]


def test_a_burst_the_batch_has_room_for_is_not_refused_by_the_queue_bound(pipe, sync) -> None:
    """``max_waiting=1`` with four places in the batch: of six requests arriving at once at an
    idle engine, four take a place, one waits, and only the sixth is refused; the five complete."""

    async def scenario() -> list[list[OmniRequestOutput] | BaseException]:
        calls = [collect(pipe, ids(6 + i, 40 + i), greedy(8)) for i in range(6)]
        return await asyncio.gather(*calls, return_exceptions=True)

    pipe.max_waiting = 1
    try:
        results = run_async(scenario)
    finally:
        pipe.max_waiting = None
    *served, refused = results
    assert isinstance(refused, QueueFullError) and "max_waiting=1" in str(refused)
    expected = sync.run([ids(6 + i, 40 + i) for i in range(5)], greedy(8), progress=False)
    for updates, ref in zip(served, expected, strict=True):
        assert check_stream(updates).token_ids == ref.token_ids


def test_close_ends_running_requests_and_refuses_new_ones(qwen2_dir) -> None:
    async def scenario() -> tuple[OmniRequestOutput, AsyncOmniJaxPipeline]:
        async with AsyncOmniJaxPipeline.from_pretrained(qwen2_dir, **SIZES) as pipe:
            gen = pipe.generate(ids(10, 14), greedy(200))
            await first_updates(gen, 2)
            closing = asyncio.create_task(asyncio.to_thread(pipe.close))
            rest = [out async for out in gen]
            await closing
        return rest[-1], pipe

    last, pipe = run_async(scenario)
    assert last.finished and last.finish_reason == "abort"
    assert not pipe.running
    with pytest.raises(RuntimeError, match="closed"):
        run_async(lambda: collect(pipe, "hello", greedy(2)))


def test_a_failed_engine_thread_ends_its_requests_and_says_so(qwen2_dir, monkeypatch) -> None:
    """A bug in the engine itself (here: abort fails while ending the requests of a failed step):
    the consumers get a last update with the error instead of waiting forever."""
    broken = AsyncOmniJaxPipeline.from_pretrained(qwen2_dir, **SIZES)
    stage, core = broken.pipeline.stages[0], broken.pipeline.core

    def fail(*_: Any, **__: Any) -> None:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(stage, "step", fail)
    monkeypatch.setattr(core, "abort", fail)
    try:
        (last,) = run_async(lambda: collect(broken, ids(10, 15), greedy(5)))
        assert last.finished and last.finish_reason == "error"
        assert "engine thread failed" in last.error and "injected fault" in last.error
        assert not broken.running
        with pytest.raises(RuntimeError, match="closed"):
            run_async(lambda: collect(broken, "hello", greedy(2)))
    finally:
        broken.close()


def test_serving_several_processes_is_refused_before_anything_loads(monkeypatch, tmp_path) -> None:
    """``JAX_NUM_PROCESSES=2`` (a server started as one of two processes) is refused before the
    runtime is joined or a weight read: the path need not even exist."""
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    with pytest.raises(ValueError, match="^AsyncOmniJaxPipeline serves from one process"):
        AsyncOmniJaxPipeline.from_pretrained(tmp_path / "not read")
