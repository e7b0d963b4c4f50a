"""Compile once, for the thinker's encoders: every encoder call has a size from a fixed set
(``EncoderBuckets``), warm-up compiles all of them, and no mix of images, videos and clips
compiles an encoder after it; what no call can hold is refused at validation."""

from __future__ import annotations

import itertools
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flax import nnx
from omni_reference import frames, picture, tone
from stage_yamls import Whole, edited_stages

from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.engine.compilation import CompileCounter
from omni_jax.engine.step import StepRow
from omni_jax.models.qwen2_5_omni.encoder_calls import plan_calls, size_ladder, smallest_fit
from omni_jax.models.qwen2_5_omni.thinker import PromptMerge
from omni_jax.stages.base import StageInput
from omni_jax.stages.thinker import (
    EncoderBuckets,
    MediaLimits,
    ThinkerFrontend,
    ThinkerRequest,
    ThinkerStepInputs,
)

AUDIO_BUCKETS = (1, 2, 4, 8, 16)
"""A 30 s clip (the feature extractor's chunk_length) is 3000 mel frames: 15 chunks of 200."""

VISION_LADDER = (64, 128, *(64 * m * 2**k for k in range(9) for m in (3, 4)))
"""The band tile (a 112-pixel window is 64 patches) times 1, 2, 3, 4, 6, 8, ... up to 65536
patches, the image processor's max_pixels (28 * 28 * 16384) in 14-pixel patches."""
PROCESSOR_VISION_BUCKETS = VISION_LADDER[3:]
"""The ladder from 256 patches (a 224x224 image; smaller ones pad to it): 17 sizes."""
VISION_BUCKETS = PROCESSOR_VISION_BUCKETS[:7]
"""The tiny thinker's: up to 2048 patches, a frame of its 512 positions (4 patches a token)."""


def user(*items: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*items, {"type": "text", "text": "what is this"}]}]


def image(h: int, w: int, seed: int) -> dict[str, Any]:
    return {"type": "image", "image": picture(h, w, seed)}


def audio(seconds: float, seed: int) -> dict[str, Any]:
    return {"type": "audio", "audio": tone(seconds, 200 + 50 * seed, seed)}


MEDIA = [
    user(image(28, 28, 0)),  # tiny: resized up to the processor's 56x56 minimum
    user(image(56, 84, 1)),
    user(image(300, 90, 2)),  # non-square both ways
    user(image(90, 500, 3)),
    user(image(480, 640, 4)),  # 34x46 patches: most of the 2048 a prompt of 512 tokens can hold
    user(image(100, 100, 5), image(200, 120, 6), image(64, 300, 7)),  # several images in one prompt
    user({"type": "video", "video": frames(6, 60, 80, 8)}),
    user({"type": "video", "video": frames(2, 448, 448, 9)}),  # 256 tokens: a larger video is refused unread
    user(audio(0.7, 10)),
    user(audio(3.0, 11)),
    user(audio(12.0, 12)),
    user(audio(18.0, 13)),  # 9 chunks, the largest call (16): one filling 512 tokens is refused unread
    user(audio(2.0, 14), image(150, 150, 15)),
]
"""What one step may admit (every frame within what the tiny thinker's 512 positions hold, some
prompts beyond them: the encoders are called directly)."""


@pytest.fixture(scope="module")
def warm(omni_dir) -> tuple[OmniJaxPipeline, int, CompileCounter]:
    """A thinker pipeline whose encoders (only) are warmed up."""
    pipe = OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker"], max_num_seqs=4)
    with CompileCounter() as counter:
        programs = pipe.stages[0].frontend.warmup()
    return pipe, programs, counter


def frontend_of(pipe: OmniJaxPipeline) -> ThinkerFrontend:
    return pipe.stages[0].frontend


def prepared(pipe: OmniJaxPipeline, messages: list[dict[str, Any]], index: int = 0) -> ThinkerRequest:
    prompt = pipe.chat_prompt(messages)
    request = StageInput(list(pipe.tokenizer(prompt["prompt"])["input_ids"]), prompt)
    return frontend_of(pipe).prepare(index, request).state


def test_size_ladder_and_smallest_fit() -> None:
    assert size_ladder(64, 65536, per_octave=2) == VISION_LADDER
    assert size_ladder(64, 65536) == tuple(64 * 2**k for k in range(11))
    assert size_ladder(1, 15) == AUDIO_BUCKETS
    assert size_ladder(16, 100, per_octave=2) == (16, 32, 48, 64, 96, 128)
    assert smallest_fit(AUDIO_BUCKETS, 5) == 8 and smallest_fit(AUDIO_BUCKETS, 16) == 16
    with pytest.raises(ValueError, match="17 exceeds the largest call size 16"):
        smallest_fit(AUDIO_BUCKETS, 17)


def test_plan_calls_is_the_cheapest_cut() -> None:
    """Against every cut of small runs: the plan's cost is the least, its calls hold every
    item once, in order, in a size of the ladder that holds them."""
    ladder = (2, 4, 8)
    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = [int(s) for s in rng.integers(1, 9, rng.integers(1, 7))]
        overhead = float(rng.choice([0.5, 2.0, 9.0]))

        def cost(size: int, overhead: float = overhead) -> float:
            return size**1.5 + overhead

        plan = plan_calls(sizes, ladder, cost)
        assert [p.start for p in plan] == [0] + [p.stop for p in plan[:-1]] and plan[-1].stop == len(sizes)
        assert all(p.size == smallest_fit(ladder, sum(sizes[p.start : p.stop])) for p in plan)
        best = min(
            sum(
                cost(smallest_fit(ladder, sum(sizes[a:b])))
                for a, b in itertools.pairwise((0, *cuts, len(sizes)))
            )
            for k in range(len(sizes))
            for cuts in itertools.combinations(range(1, len(sizes)), k)
            if all(sum(sizes[a:b]) <= 8 for a, b in itertools.pairwise((0, *cuts, len(sizes))))
        )
        assert sum(cost(p.size) for p in plan) == pytest.approx(best)
    with pytest.raises(ValueError, match="item 1 has size 9, more than the largest call size 8"):
        plan_calls([1, 9], ladder, float)


def test_warmup_compiles_every_encoder_program(warm) -> None:
    """The program count is the bucket count, bounded whatever the traffic: 5 audio and 7
    vision programs for the tiny checkpoint (Qwen2.5-Omni's processor, 512 positions); a second
    warm-up compiles nothing."""
    pipe, programs, counter = warm
    buckets = frontend_of(pipe).step_inputs.buckets
    assert buckets == EncoderBuckets(AUDIO_BUCKETS, VISION_BUCKETS)
    assert programs == len(AUDIO_BUCKETS) + len(VISION_BUCKETS) == 12
    assert (counter.traces, counter.programs) == (12, 12)  # compiled, or loaded from the cache
    with CompileCounter() as again:
        assert frontend_of(pipe).warmup() == 12
    assert (again.traces, again.compiles) == (0, 0)


def test_encoder_programs_compile_side_by_side(warm) -> None:
    """A frontend's warm-up compiles its encoder programs on :func:`compile_ahead`'s threads
    (each traced and compiled there, none on the caller's), and the calls after it compile
    nothing: the programs compiled ahead are the ones the encoders run."""
    pipe, _, _ = warm
    frontend = frontend_of(pipe)
    runner = pipe.stages[0].engine.runner
    fresh = ThinkerFrontend(
        frontend.processor, nnx.merge(runner.graphdef, runner.state), EncoderBuckets((1, 2), (64, 256))
    )
    threads: list[str] = []
    with CompileCounter(on_count=lambda _: threads.append(threading.current_thread().name)) as counter:
        assert fresh.warmup() == 4
    assert (counter.traces, counter.programs) == (4, 4)
    # a trace and a compilation a program, and a load before the latter where the cache had it
    assert len(threads) == 8 + counter.loads and all(name.startswith("compile") for name in threads), threads
    request = prepared(pipe, user(audio(3.0, 11), image(56, 84, 1)))
    with CompileCounter() as after:
        fresh.step_inputs.encode([request])
    assert (after.traces, after.compiles) == (0, 0)


def test_default_buckets_take_what_the_processor_emits_and_a_prompt_holds(warm) -> None:
    """The largest buckets hold the longest clip and the largest frame the processor emits, or,
    where ``max_model_len`` is less, the largest frame a prompt can hold: a prompt with a frame
    past that is refused at validation for its length (Qwen2.5-Omni-7B's default 4096 tokens:
    vision calls up to 16384 patches, 4 fewer programs than the processor's 65536)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    pipe, _, _ = warm
    frontend = frontend_of(pipe)
    processor = frontend.processor
    (features,) = processor.audio_features([np.zeros(30 * 16_000, np.float32)])
    assert -(-features.shape[1] // 200) <= AUDIO_BUCKETS[-1]
    edge = processor.image_processor.size["longest_edge"]
    for h, w in ((20_000, 20_000), (3584, 3584), (100, 19_000), (4000, 3000)):
        rh, rw = smart_resize(h, w, 28, 56 * 56, edge)
        assert rh * rw // 14**2 <= PROCESSOR_VISION_BUCKETS[-1]
    assert EncoderBuckets.for_processor(processor, frontend.spec) == EncoderBuckets(
        AUDIO_BUCKETS, PROCESSOR_VISION_BUCKETS
    )
    for max_model_len, largest in ((512, 2048), (4096, 16384), (16384, 65536), (32768, 65536)):
        buckets = EncoderBuckets.for_processor(processor, frontend.spec, max_model_len=max_model_len)
        assert (
            buckets.vision_tokens == PROCESSOR_VISION_BUCKETS[: PROCESSOR_VISION_BUCKETS.index(largest) + 1]
        )
    assert pipe.stages[0].max_model_len == 512
    big = pipe.chat_prompt(user(image(720, 1280, 4)))  # 52x92 = 4784 patches, 1196 tokens
    with pytest.raises(ValueError, match=r"request 1: prompt has \d+ tokens \(.*\), max_model_len is 512"):
        pipe.run(["hello", big], progress=False)


def test_no_encoder_compiles_after_warmup(warm) -> None:
    """Images of many sizes, several in a prompt, videos and clips up to the largest call,
    encoded in one step together and each alone: nothing traces or compiles, and a request's
    rows are the same either way."""
    pipe, _, _ = warm
    step_inputs = frontend_of(pipe).step_inputs
    requests = [prepared(pipe, m, i) for i, m in enumerate(MEDIA)]
    with CompileCounter() as counter:
        step_inputs.encode(requests)
        together = [r.rows for r in requests]
        for r in requests:
            step_inputs.encode([r])
    assert (counter.traces, counter.compiles) == (0, 0)
    for r, rows in zip(requests, together, strict=True):
        for token, got in rows.items():
            assert len(got) == int(r.before[token][-1])
            np.testing.assert_allclose(got, r.rows[token], rtol=1e-5, atol=1e-5 * np.abs(got).max(initial=1))


def test_split_video_rows_equal_whole(warm) -> None:
    """With a ladder too small for two frames in one call, a video's frames go to separate
    calls; its rows, put back together, equal those of the default ladder's single call."""
    pipe, _, _ = warm
    frontend = frontend_of(pipe)
    messages = user({"type": "video", "video": frames(6, 60, 80, 8)}, image(56, 84, 1))
    whole = prepared(pipe, messages)
    frontend.step_inputs.encode([whole])
    (t, h, w) = whole.inputs.video_grid_thw[0]
    assert t > 1
    runner = pipe.stages[0].engine.runner
    frame = -(-h * w // 64) * 64  # one frame a call (64: the band tile)
    small = ThinkerFrontend(
        frontend.processor, nnx.merge(runner.graphdef, runner.state), EncoderBuckets((1,), (64, frame))
    )
    cut = prepared(pipe, messages)
    small.step_inputs.encode([cut])
    for token, rows in whole.rows.items():
        np.testing.assert_allclose(cut.rows[token], rows, rtol=1e-5, atol=1e-5 * np.abs(rows).max(initial=1))


def test_thinker_run_compiles_no_encoder_after_encoder_warmup(warm, monkeypatch) -> None:
    """Through the stage (the AR steps may compile; the encoders may not): requests of
    different media, four audio requests admitted in the same step."""
    pipe, _, _ = warm
    step_inputs = frontend_of(pipe).step_inputs
    encode = step_inputs.encode
    calls: list[tuple[int, int, int]] = []

    def counted(requests):  # noqa: ANN001, ANN202 - ThinkerStepInputs.encode's
        with CompileCounter() as c:
            encode(requests)
        calls.append((len(requests), c.traces, c.compiles))

    monkeypatch.setattr(step_inputs, "encode", counted)
    prompts = [pipe.chat_prompt(user(audio(s, i))) for i, s in enumerate((0.5, 2.5, 6.0, 9.0))]
    prompts += [pipe.chat_prompt(m) for m in (MEDIA[2], MEDIA[3], MEDIA[5], MEDIA[6], MEDIA[12])]
    outs = pipe.run(prompts, SamplingParams(temperature=0.0, max_tokens=2), progress=False)
    assert all(o.error is None for o in outs)
    assert calls[0][0] == 4 and sum(n for n, _, _ in calls) == len(prompts)
    assert all((traces, compiles) == (0, 0) for _, traces, compiles in calls), calls


def test_what_no_call_holds_is_refused_at_validation(warm, monkeypatch) -> None:
    """With smaller buckets (the largest a call of 2 chunks, 128 patches), a longer clip, a
    larger image or video frame is refused before any work, naming the request and the
    limit; the pipeline stays usable."""
    pipe, _, _ = warm
    step_inputs = frontend_of(pipe).step_inputs
    monkeypatch.setattr(step_inputs, "buckets", EncoderBuckets((1, 2), (64, 128)))
    cases = [
        (user(audio(5.0, 0)), r"request 1: audio 0 has 500 mel frames, .* \(2 chunks of 200 frames = 400"),
        (user(image(300, 300, 1)), r"request 1: image 0 is 22x22 = 484 patches a frame, .* \(128 patches\)"),
        (user(image(56, 56, 2), image(200, 200, 3)), r"request 1: image 1 is 14x14 = 196 patches"),
        (
            user({"type": "video", "video": frames(2, 60, 80, 4)}),
            r"request 1: video 0 is \d+x\d+ = \d+ patches",
        ),
    ]
    for messages, match in cases:
        with pytest.raises(ValueError, match=match):
            pipe.run(["hello", pipe.chat_prompt(messages)], progress=False)
    (out,) = pipe.run(pipe.chat_prompt(user(audio(3.0, 5), image(56, 56, 6))), progress=False)
    assert out.error is None


def test_whole_thinker_stage_compiles_nothing_after_warmup(omni_dir) -> None:
    """``pipe.warmup()`` (AR steps and encoders), then a mix of text and media requests,
    greedy and sampled, several admitted in the same step: nothing traces or compiles."""
    pipe = OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker"], max_num_seqs=4)
    pipe.warmup()
    prompts: list[Any] = ["a text prompt", "another, longer text prompt than the first one"]
    prompts += [pipe.chat_prompt(m) for m in (*MEDIA[:4], MEDIA[5], MEDIA[6], *MEDIA[8:11], MEDIA[12])]
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=3 + i % 4)
        for i in range(len(prompts))
    ]
    with CompileCounter() as counter:
        outs = pipe.run(prompts, params, progress=False)
    assert all(o.error is None for o in outs)
    assert (counter.traces, counter.compiles) == (0, 0)


def test_pack_reads_rows_and_prepare_drops_them_past_the_prompt(warm) -> None:
    """Encoder rows live on the request's ThinkerRequest: ``prepare`` encodes them for a prompt
    chunk, ``pack`` only reads them (a chunk ending the prompt leaves them in place), and the
    request's first step past its prompt drops them."""
    pipe, _, _ = warm
    step_inputs = frontend_of(pipe).step_inputs
    state = prepared(pipe, user(image(56, 84, 3)))
    n = len(state.inputs.input_ids)

    def row(start: int, end: int) -> StepRow[ThinkerRequest]:
        ids = list(range(end))
        return StepRow(
            token_ids=ids[start:end],
            positions=step_inputs.positions(state, start, end),
            pages=[],
            start=start,
            sample=end == n,
            params=SamplingParams(),
            seed=0,
            draw_index=0,
            id_row=0,
            prompt_len=n,
            suppress=[],
            state=state,
        )

    prompt = row(0, n)
    assert step_inputs.prepare([prompt]) == {} and state.rows is not None
    rows = state.rows
    merge = step_inputs.pack([prompt], [0], n)
    assert state.rows is rows
    assert int(np.asarray(merge.limit).sum()) == n
    image_rows = rows[step_inputs.token_ids[1]]
    assert len(image_rows) > 0
    np.testing.assert_array_equal(np.asarray(merge.rows)[: len(image_rows)], image_rows)
    assert_merges_each_placeholder(step_inputs, state, merge, n)
    ids = np.asarray(state.inputs.input_ids)
    cut = int(np.flatnonzero(ids == step_inputs.token_ids[1])[len(image_rows) // 2])  # mid-image
    split = step_inputs.pack([row(0, cut), row(cut, n), row(n, n + 1)], [0, cut, n], n + 3)
    np.testing.assert_array_equal(np.asarray(split.limit), [1] * n + [0] * 3)
    assert_merges_each_placeholder(step_inputs, state, split, n)
    assert step_inputs.prepare([row(n, n + 1)]) == {} and state.rows is None


def assert_merges_each_placeholder(
    step_inputs: ThinkerStepInputs, state: ThinkerRequest, merge: PromptMerge, n: int
) -> None:
    """Token row ``p`` holding prompt token ``p`` (a flat step of the prompt's chunks in order):
    each placeholder's row of ``merge`` (its kind's ``first_row``, as the model gathers it) is
    its encoder row, the ``before``-th of its kind in the prompt."""
    ids = state.inputs.input_ids
    merged, first = np.asarray(merge.rows), np.asarray(merge.first_row)
    found = 0
    for p in range(n):
        for k, token in enumerate(step_inputs.token_ids):
            if ids[p] == token:
                want = state.rows[token][state.before[token][p]]
                np.testing.assert_array_equal(merged[first[k, p], : want.shape[-1]], want)
                found += 1
    assert found == sum(len(r) for r in state.rows.values())


def limited_yaml(tmp_path: Path, limits: dict[str, int]) -> Path:
    """The shipped stage YAML with the thinker's ``engine.limit_mm_per_prompt`` set to ``limits``."""
    thinker = {"engine": {"limit_mm_per_prompt": Whole(limits)}}
    return edited_stages(tmp_path / "limited.yaml", "qwen2_5_omni", thinker=thinker)


def limited(omni_dir: Path, tmp_path: Path, limits: dict[str, int]) -> OmniJaxPipeline:
    """The thinker alone, its stage YAML's ``engine.limit_mm_per_prompt`` set to ``limits``."""
    path = limited_yaml(tmp_path, limits)
    return OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker"], max_num_seqs=4, stage_config=path)


def test_media_turned_off_compile_no_encoder(omni_dir, tmp_path: Path) -> None:
    """With every kind limited to 0 the thinker's warm-up compiles no encoder program, a text
    prompt still runs, and a prompt with media is refused before any work, naming the limit."""
    pipe = limited(omni_dir, tmp_path, {"audio": 0, "image": 0, "video": 0})
    frontend = frontend_of(pipe)
    assert frontend.step_inputs.buckets == EncoderBuckets((), ())
    with CompileCounter() as counter:
        assert frontend.warmup() == 0
    assert counter.programs == 0
    (out,) = pipe.run([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=2), False)
    assert out.finish_reason == "length"
    with pytest.raises(ValueError, match=r"request 0: 1 image item\(s\), more than the 0 a prompt may hold"):
        pipe.run([pipe.chat_prompt(user(image(56, 84, 1)))], SamplingParams(max_tokens=2), False)
    with pytest.raises(ValueError, match=r"request 0: 1 audio item\(s\), more than the 0"):
        prepared(pipe, user(audio(1.0, 1)))


def test_media_limits_count_items(omni_dir, tmp_path: Path) -> None:
    """A kind limited to 1: its encoder stays (the vision buckets while images are on, videos
    off), one item is taken and two are refused; kinds not named are unlimited."""
    pipe = limited(omni_dir, tmp_path, {"image": 1, "video": 0})
    assert frontend_of(pipe).step_inputs.buckets == EncoderBuckets(AUDIO_BUCKETS, VISION_BUCKETS)
    assert prepared(pipe, user(image(56, 84, 1), audio(1.0, 2), audio(2.0, 3))).has_media
    with pytest.raises(ValueError, match=r"request 0: 2 image item\(s\), more than the 1"):
        prepared(pipe, user(image(56, 84, 1), image(90, 90, 2)))
    with pytest.raises(ValueError, match=r"request 0: 1 video item\(s\), more than the 0"):
        prepared(pipe, user({"type": "video", "video": frames(6, 60, 80, 8)}))


@pytest.mark.parametrize(
    "given,match",
    [
        ([0], "engine.limit_mm_per_prompt must be a mapping"),
        (
            {"images": 0},
            r"engine.limit_mm_per_prompt has unknown kinds \['images'\] "
            r"\(known: \['audio', 'image', 'video'\]\)",
        ),
        ({"audio": -1}, "engine.limit_mm_per_prompt.audio=-1 must be a non-negative integer"),
        ({"video": True}, "engine.limit_mm_per_prompt.video=True must be a non-negative integer"),
    ],
)
def test_media_limits_are_checked(given: Any, match: str) -> None:
    assert MediaLimits.from_engine("thinker", {}) == MediaLimits()
    assert MediaLimits.from_engine("thinker", {"limit_mm_per_prompt": {"image": 2}}) == MediaLimits(image=2)
    with pytest.raises(ValueError, match=f"stage 'thinker': {match}"):
        MediaLimits.from_engine("thinker", {"limit_mm_per_prompt": given})


def test_from_pretrained_limits_replace_the_yaml(
    omni_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``from_pretrained(limit_mm_per_prompt=...)`` (and ``omni-jax serve --limit-mm-per-prompt``)
    sets the thinker's limits over its YAML's, and a mistake in them is refused before any
    weight is read: one line and exit 2 on the command line."""
    pipe = OmniJaxPipeline.from_pretrained(
        omni_dir, stages=["thinker"], max_num_seqs=4, limit_mm_per_prompt={"audio": 0, "video": 0}
    )
    assert frontend_of(pipe).step_inputs.buckets == EncoderBuckets((), VISION_BUCKETS)
    assert frontend_of(pipe).limits == MediaLimits(audio=0, video=0)
    replaced = OmniJaxPipeline.from_pretrained(
        omni_dir,
        stages=["thinker"],
        max_num_seqs=4,
        stage_config=limited_yaml(tmp_path, {"image": 0}),
        limit_mm_per_prompt={"audio": 1},
    )
    assert frontend_of(replaced).limits == MediaLimits(audio=1)

    import omni_jax.pipeline as pipeline_module
    from omni_jax.cli import main as cli_main

    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights were read before the limits were checked")

    monkeypatch.setattr(pipeline_module, "load_part", no_loading)
    with pytest.raises(
        ValueError, match=r"stage 'thinker': engine.limit_mm_per_prompt must be a mapping, got \[0\]"
    ):
        OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker"], limit_mm_per_prompt=[0])  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"stage 'thinker': engine.limit_mm_per_prompt has unknown kinds \['images'\]"
    ):
        OmniJaxPipeline.from_pretrained(omni_dir, stages=["thinker"], limit_mm_per_prompt={"images": 0})
    assert cli_main(["serve", str(omni_dir), "--limit-mm-per-prompt", '{"image": -1}']) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "limit_mm_per_prompt.image=-1 must be a non-negative integer" in err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve", str(omni_dir), "--limit-mm-per-prompt", "image=0"])
    assert exit_info.value.code == 2 and "must be a JSON object" in capsys.readouterr().err


def test_the_encoder_benchmark_measures_a_step_after_warm_up(omni_dir) -> None:
    """``python -m benchmarks.encoder_buckets``'s measured part runs: the media no context holds
    are left out with the stage's reason (a video refused before its frames are resized ended
    the script with a traceback), and the mixed step compiles nothing after ``warmup()``."""
    from benchmarks.encoder_buckets import measured

    lines = measured(omni_dir)
    (left_out,) = [line for line in lines if line.startswith("longer than max_model_len")]
    assert "request 3 (prompt has at least" in left_out  # the 16-frame video
    assert re.fullmatch(
        r"a step of [1-9]\d* media requests encoded in [\d.]+ s: 0 traces, 0 compilations", lines[-1]
    )
