"""The talker started on the thinker's first tokens (``engine.early_start``, the default): the
thinker streams its hidden states to the talker as it computes them, the talker is submitted once
the rows its prompt reads are there and each of its steps waits for the thinker row it reads
(:meth:`~omni_jax.engine.step.StepInputs.available`). What it says must not change: text, codes
and audio equal those of the talker started when the thinker has finished (``early_start:
false``, the hand-off transformers' ``generate`` makes), for Qwen2.5-Omni and Qwen3-Omni, greedy
and sampled, with a talker that finishes before the thinker does, a reply too short to voice,
and an abort while both run. (The greedy equality with ``generate`` itself runs early in
``test_omni_pipeline.py`` and ``test_qwen3_omni_pipeline.py``.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from parity import rel_err
from stage_yamls import edited_stages

from omni_jax import OmniJaxPipeline, SamplingParams, Token2WavParams
from omni_jax.stages.ar import check_engine_options
from omni_jax.stages.base import HiddenHandoff, StageStep
from omni_jax.stages.config import StageConfig
from omni_jax.stages.rows import GrowingRows

THINKER_TOKENS = 12


def early_and_late(model_dir: Path, tmp_path: Path, family: str) -> tuple[OmniJaxPipeline, OmniJaxPipeline]:
    """The checkpoint's pipeline as shipped (the talker started early) and with its stage YAML
    ``family`` starting the talker when the thinker has finished."""
    late = edited_stages(tmp_path / f"{family}.yaml", family, talker={"engine": {"early_start": False}})
    return (
        OmniJaxPipeline.from_pretrained(model_dir, max_num_seqs=8),
        OmniJaxPipeline.from_pretrained(model_dir, max_num_seqs=8, stage_config=late),
    )


def watch_starts(pipe: OmniJaxPipeline, monkeypatch: pytest.MonkeyPatch) -> dict[str, int | None]:
    """Request id -> the thinker's drawn tokens when the talker took it (``None``: the thinker
    had finished it)."""
    thinker, talker = pipe.stages[0], pipe.stages[1]
    starts: dict[str, int | None] = {}
    submit = talker.submit

    def spy(request_id: str, request: Any, params: Any) -> None:
        held = thinker._submitted.get(request_id)
        starts[request_id] = None if held is None else len(held.request.output_ids)
        submit(request_id, request, params)

    monkeypatch.setattr(talker, "submit", spy)
    return starts


def watch_stage_ends(pipe: OmniJaxPipeline, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """``(request id, stage index)`` in the order stages finish requests."""
    ends: list[tuple[str, int]] = []
    done = pipe.core._stage_done

    def spy(flight: Any, stage_index: int, result: Any) -> None:
        ends.append((result.request_id, stage_index))
        done(flight, stage_index, result)

    monkeypatch.setattr(pipe.core, "_stage_done", spy)
    return ends


def slow_thinker(pipe: OmniJaxPipeline, monkeypatch: pytest.MonkeyPatch, every: int = 3) -> list[int]:
    """Step the thinker in one engine step of ``every`` only, so the talker catches up with it and
    must wait for its rows; returns a one-item list counting the talker's steps that ran no row
    while it held a request (its waits)."""
    thinker, talker = pipe.stages[0], pipe.stages[1]
    calls, waits = [0], [0]
    step, schedule = thinker.step, talker.engine.scheduler.schedule

    def every_few(block: bool = True) -> StageStep:
        calls[0] += 1
        return step(block) if calls[0] % every == 0 else StageStep([])

    def counted() -> list[Any]:
        rows = schedule()
        waits[0] += not rows and bool(talker.engine.scheduler.running)
        return rows

    monkeypatch.setattr(thinker, "step", every_few)
    monkeypatch.setattr(talker.engine.scheduler, "schedule", counted)
    return waits


def check_idle(pipe: OmniJaxPipeline) -> None:
    """Nothing left anywhere: no work, every KV page free, no fed request waiting, none opened or
    queued in code2wav."""
    assert not pipe.core.has_work() and not pipe.core.request_ids
    for stage in pipe.stages[:2]:
        allocator = stage.engine.scheduler.allocator
        assert allocator.num_free == allocator.num_pages and not stage._fed and not stage._submitted
    code2wav = pipe.stages[2]
    assert not code2wav._streamed and not code2wav._submitted and code2wav.decoder.num_streaming == 0


def same_speech(early: Any, late: Any) -> None:
    assert early.token_ids == late.token_ids and early.text == late.text
    assert early.stage_outputs["talker"].token_ids == late.stage_outputs["talker"].token_ids
    assert early.audio.shape == late.audio.shape and early.audio.size > 0
    assert rel_err(early.audio, late.audio) < 1e-5


# --- Qwen2.5-Omni ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def omni_pipes(omni_dir, tmp_path_factory) -> tuple[OmniJaxPipeline, OmniJaxPipeline]:
    return early_and_late(omni_dir, tmp_path_factory.mktemp("late"), "qwen2_5_omni")


def omni_prompts(pipe: OmniJaxPipeline) -> list[dict[str, Any]]:
    questions = ("tell me a story about a cat", "what is the weather like", "count to ten")
    return [
        dict(pipe.chat_prompt([{"role": "user", "content": q}]), speaker=("Chelsie", "Ethan")[i % 2])
        for i, q in enumerate(questions)
    ]


def omni_params(n: int, talker_tokens: int = 24, sampled: bool = True) -> list[list[Any]]:
    thinker = SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS, ignore_eos=True)
    talker = [
        SamplingParams(temperature=0.9, top_k=40, top_p=0.8, seed=7 + j, max_tokens=talker_tokens)
        if sampled
        else SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=talker_tokens)
        for j in range(n)
    ]
    return [[thinker] * n, talker, [Token2WavParams(num_steps=2, seed=3 + j) for j in range(n)]]


@pytest.mark.parametrize(
    "sampled,slow", [(True, False), (False, False), (True, True)], ids=["sampled", "greedy", "slow-thinker"]
)
def test_omni_early_talker_says_the_same(omni_pipes, monkeypatch, sampled: bool, slow: bool) -> None:
    """Every talker starts while its thinker still writes (after its second token, before its
    last), and the speech is what the late start gives; also when the thinker steps once in
    three engine steps, so the talker waits for its rows."""
    early, late = omni_pipes
    starts = watch_starts(early, monkeypatch)
    waits = slow_thinker(early, monkeypatch) if slow else [0]
    prompts = omni_prompts(early)
    got = early.run(prompts, omni_params(len(prompts), sampled=sampled), progress=False)
    want = late.run(prompts, omni_params(len(prompts), sampled=sampled), progress=False)
    assert len(starts) == len(prompts)
    assert all(n is not None and 2 <= n < THINKER_TOKENS for n in starts.values()), starts
    for g, w in zip(got, want, strict=True):
        assert g.error is None and len(g.token_ids) == THINKER_TOKENS
        same_speech(g, w)
    assert (waits[0] > 0) == slow, waits
    check_idle(early)


def test_omni_talker_may_finish_first(omni_pipes, monkeypatch) -> None:
    """A talker cut at 3 codes ends before its thinker: code2wav voices them, and the request
    ends only with the thinker's whole reply."""
    early, late = omni_pipes
    ends = watch_stage_ends(early, monkeypatch)
    prompts = omni_prompts(early)[:1]
    (got,) = early.run(prompts, omni_params(1, talker_tokens=3), progress=False)
    (want,) = late.run(prompts, omni_params(1, talker_tokens=3), progress=False)
    order = [stage for _, stage in ends]
    assert order.index(1) < order.index(0), order  # the talker's end came first
    assert got.finished and len(got.token_ids) == THINKER_TOKENS
    assert len(got.stage_outputs["talker"].token_ids) == 3
    same_speech(got, want)
    check_idle(early)


def test_omni_talker_without_codes_leaves_the_thinker_running(omni_pipes, monkeypatch) -> None:
    """A talker whose first code is codec EOS (this seed) ends before its thinker with nothing
    to voice: the request goes on to the thinker's whole reply and ends with empty audio."""
    early, late = omni_pipes
    ends = watch_stage_ends(early, monkeypatch)
    params = omni_params(1)
    params[1] = [SamplingParams(temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05, seed=0)]
    prompts = omni_prompts(early)[:1]
    (got,) = early.run(prompts, params, progress=False)
    (want,) = late.run(prompts, params, progress=False)
    assert [stage for _, stage in ends] == [1, 0]
    assert got.finish_reason == want.finish_reason == "length" and got.error is None
    assert got.token_ids == want.token_ids and len(got.token_ids) == THINKER_TOKENS
    assert got.stage_outputs["talker"].token_ids == want.stage_outputs["talker"].token_ids == [74]
    assert got.audio.size == want.audio.size == 0
    check_idle(early)


@pytest.mark.parametrize("stream", [False, True], ids=["offline", "streamed"])
def test_omni_reply_too_short_to_voice(omni_pipes, stream: bool) -> None:
    """A one-token reply: the talker never starts (the reference voices no reply shorter than
    two), the request ends with empty audio and nothing is left waiting; streamed too, where
    code2wav took the request fed from the start (it was left waiting for codes that would
    never come, the request never ending)."""
    early, _ = omni_pipes
    params = omni_params(1)
    params[0] = [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)]
    params[2] = [Token2WavParams(num_steps=2, seed=3, stream=stream)]
    (out,) = early.run(omni_prompts(early)[:1], params, progress=False)
    assert out.error is None and len(out.token_ids) == 1 and out.audio.size == 0
    assert out.stage_outputs["talker"].token_ids == []
    check_idle(early)


def test_omni_two_token_reply_starts_the_talker_at_the_end(omni_pipes, monkeypatch) -> None:
    """A two-token reply ends before the talker can start (it needs two drawn tokens and the
    first one's rows): the talker is built from the rows the thinker streamed and those of its
    last step (the thinker released the others), and says what the late start says."""
    early, late = omni_pipes
    starts = watch_starts(early, monkeypatch)
    params = omni_params(1)
    params[0] = [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)]
    prompts = omni_prompts(early)[:1]
    (got,) = early.run(prompts, params, progress=False)
    (want,) = late.run(prompts, params, progress=False)
    assert list(starts.values()) == [None]  # the thinker had finished it
    same_speech(got, want)
    check_idle(early)


def test_thinker_keeps_no_row_the_talker_took(omni_pipes, monkeypatch) -> None:
    """While the talker reads the thinker's rows as they come, the thinker releases each step's
    rows once reported: after every step it holds none (a long multimodal prompt's rows are not
    held twice); the speech is unchanged."""
    early, late = omni_pipes
    thinker, held = early.stages[0], []
    step = thinker.step

    def spy(block: bool = True) -> StageStep:
        done = step(block)
        streamed = [s.request for s in thinker._submitted.values() if s.stream_hidden]
        held.extend(sum(len(h) for h, _ in r.captured) for r in streamed)
        return done

    monkeypatch.setattr(thinker, "step", spy)
    prompts = omni_prompts(early)
    got = early.run(prompts, omni_params(len(prompts)), progress=False)
    want = late.run(prompts, omni_params(len(prompts)), progress=False)
    assert len(held) >= len(prompts) * (THINKER_TOKENS - 1) and set(held) == {0}, held
    for g, w in zip(got, want, strict=True):
        same_speech(g, w)
    check_idle(early)


def test_omni_abort_while_both_run(omni_pipes, monkeypatch) -> None:
    """Aborted once the talker runs beside the thinker (streamed code2wav open too): every stage
    drops it and frees its pages at once."""
    early, _ = omni_pipes
    starts = watch_starts(early, monkeypatch)
    params = omni_params(1)
    params[2] = [Token2WavParams(num_steps=2, seed=3, stream=True)]
    (admission,) = early.intake.admit(omni_prompts(early)[:1], params, ["x"])
    early.core.add(admission, stream=True)
    while "x" not in starts:
        early.core.step()
    early.core.step()
    assert early.stages[1]._submitted and early.stages[0]._submitted  # both hold it
    assert early.stages[2].decoder.num_streaming == 1
    out = early.core.abort("x")
    assert out is not None and out.finish_reason == "abort" and out.finished
    assert early.stages[2].decoder.num_streaming == 0
    check_idle(early)


# --- Qwen3-Omni ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_pipes(qwen3_omni_dir, tmp_path_factory) -> tuple[OmniJaxPipeline, OmniJaxPipeline]:
    return early_and_late(qwen3_omni_dir, tmp_path_factory.mktemp("late3"), "qwen3_omni")


@pytest.mark.parametrize(
    "sampled,slow", [(True, False), (False, False), (False, True)], ids=["sampled", "greedy", "slow-thinker"]
)
def test_qwen3_early_talker_says_the_same(qwen3_pipes, monkeypatch, sampled: bool, slow: bool) -> None:
    """Qwen3-Omni's talker (its text rows are the thinker's reply embeddings, one a frame) starts
    while the thinker writes and draws the same frames, also waiting for a slow thinker;
    streamed audio equals too."""
    early, late = qwen3_pipes
    starts = watch_starts(early, monkeypatch)
    waits = slow_thinker(early, monkeypatch) if slow else [0]
    prompts = [
        dict(early.chat_prompt([{"role": "user", "content": q}]), speaker=s)
        for q, s in (("tell me a story", "Ethan"), ("what is two plus two", "Chelsie"))
    ]
    thinker = SamplingParams(temperature=0.0, max_tokens=THINKER_TOKENS, ignore_eos=True)
    talker = (
        SamplingParams(temperature=0.9, top_k=50, seed=11, max_tokens=16)
        if sampled
        else SamplingParams(temperature=0.0, repetition_penalty=1.05, max_tokens=16)
    )
    params = [thinker, talker, Token2WavParams(stream=True)]
    got = early.run(prompts, params, progress=False)
    want = late.run(prompts, params, progress=False)
    assert len(starts) == 2 and all(n is not None and 2 <= n < THINKER_TOKENS for n in starts.values())
    for g, w in zip(got, want, strict=True):
        assert g.error is None
        same_speech(g, w)
    assert (waits[0] > 0) == slow, waits
    check_idle(early)


def test_qwen3_reply_too_short_to_voice_streamed(qwen3_pipes) -> None:
    """Qwen3-Omni's one-token reply, its audio streamed: code2wav, open from the start, drops the
    request with the talker, which never starts; it ends with empty audio, nothing left."""
    early, _ = qwen3_pipes
    prompt = dict(early.chat_prompt([{"role": "user", "content": "tell me a story"}]), speaker="Ethan")
    thinker = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    talker = SamplingParams(temperature=0.0, max_tokens=16)
    (out,) = early.run([prompt], [thinker, talker, Token2WavParams(stream=True)], progress=False)
    assert out.finished and out.error is None and len(out.token_ids) == 1 and out.audio.size == 0
    assert out.stage_outputs["talker"].token_ids == []
    check_idle(early)


# --- the pieces -------------------------------------------------------------------------------


def test_captured_rows_are_reported_once_across_a_preemption() -> None:
    """``ARRequest.captured_since``: the rows past the ones reported, whatever blocks they were
    captured in; after a preemption the rows are captured afresh from the first token, and only
    those past the reported ones come back."""
    from omni_jax.engine.sampling import SamplingParams as Params
    from omni_jax.engine.scheduler import ARRequest

    rows = np.arange(20, dtype=np.float32).reshape(10, 2)
    req = ARRequest("r", 0, [1, 2, 3], Params(), 0)
    assert req.captured_since(0) is None
    for lo, hi in ((0, 3), (3, 4), (4, 7)):
        req.captured.append((rows[lo:hi], -rows[lo:hi]))
    hidden, embeds = req.captured_since(2)
    np.testing.assert_array_equal(hidden, rows[2:7])
    np.testing.assert_array_equal(embeds, -rows[2:7])
    assert req.captured_since(7) is None
    req.captured = [(rows[0:5], -rows[0:5])]  # preempted: recomputed from the first token
    assert req.captured_since(7) is None
    req.captured.append((rows[5:9], -rows[5:9]))
    hidden, _ = req.captured_since(7)
    np.testing.assert_array_equal(hidden, rows[7:9])


def test_released_rows_are_gone_and_refused() -> None:
    """``ARRequest.release_captured``: blocks wholly before the row go (the last keeps its widths,
    no rows), rows past it are still returned, released ones are refused; a preemption captures
    afresh from the first token."""
    from omni_jax.engine.sampling import SamplingParams as Params
    from omni_jax.engine.scheduler import ARRequest

    rows = np.arange(20, dtype=np.float32).reshape(10, 2)
    req = ARRequest("r", 0, [1, 2, 3], Params(), 0)
    for lo, hi in ((0, 3), (3, 4), (4, 7)):
        req.captured.append((rows[lo:hi], -rows[lo:hi]))
    req.release_captured(5)  # 0-3 and 3-4 go; 4-7 holds row 5
    assert req.captured_start == 4 and [len(h) for h, _ in req.captured] == [3]
    np.testing.assert_array_equal(req.captured_since(5)[0], rows[5:7])
    with pytest.raises(ValueError, match="request 'r': rows before 4 were released"):
        req.captured_since(3)
    with pytest.raises(ValueError, match="rows before 4 were released"):
        req.captured_states()
    req.release_captured(7)
    assert req.captured_start == 7 and [h.shape for h, _ in req.captured] == [(0, 2)]
    assert req.captured_since(7) is None
    req.captured.append((rows[7:9], -rows[7:9]))
    np.testing.assert_array_equal(req.captured_since(7)[1], -rows[7:9])
    req.release_captured(9)
    assert req.captured_start == 9 and [h.shape for h, _ in req.captured] == [(0, 2)]
    req.capture(rows[0:6], -rows[0:6], 0)  # preempted: recomputed from the first token
    assert req.captured_start == 0 and req.captured_since(9) is None
    req.capture(rows[6:10], -rows[6:10], 6)
    np.testing.assert_array_equal(req.captured_since(9)[0], rows[9:10])


def test_growing_rows_and_handoff_parts() -> None:
    """``GrowingRows`` reads as the rows appended so far (the buffer doubling underneath);
    ``HiddenHandoff.since`` returns a part's rows from a token on and refuses rows it lacks."""
    table = GrowingRows(np.zeros((2, 3), np.float32))
    for k in range(1, 8):
        table.extend(np.full((k, 3), k, np.float32))
    assert len(table) == 2 + sum(range(1, 8)) and table.array.shape == (30, 3)
    np.testing.assert_array_equal(table[np.array([0, 2, 29])][:, 0], [0, 1, 7])
    part = HiddenHandoff([1, 2], [3, 4], np.ones((3, 2)), np.zeros((3, 2)), start=4)
    assert part.end == 7 and len(part.since(5)[0]) == 2
    with pytest.raises(ValueError, match="rows from token 3 were never handed on"):
        part.since(3)


@pytest.mark.parametrize(
    "engine,match",
    [
        (
            {"early_strat": True},
            r"stage 'talker': unknown engine keys \['early_strat'\] "
            r"\(known: \['early_start', 'limit_mm_per_prompt', 'output_hidden_states', 'max_num_seqs', "
            r"'max_model_len', 'max_num_batched_tokens'\]\)",
        ),
        ({"early_start": "yes"}, "stage 'talker': engine.early_start='yes' must be true or false"),
    ],
)
def test_ar_engine_options_are_checked(engine: dict, match: str) -> None:
    """An AR stage's YAML ``engine`` is refused at build time for a key it does not read or an
    ``early_start`` that is not a bool."""
    check_engine_options(StageConfig("talker", "ar", "thinker", engine={"early_start": False}))
    with pytest.raises(ValueError, match=match):
        check_engine_options(StageConfig("talker", "ar", "thinker", engine=engine))
