"""Qwen3-Omni's code2wav stage end to end: ``from_pretrained(path, stages=["code2wav"])`` on the tiny
Qwen3-Omni, against transformers' ``model.code2wav`` of the same checkpoint (float32).

Offline requests are whole decodes (``Qwen3OmniMoeCode2Wav.forward``), or longer than an offline
piece, ``chunked_decode`` (as ``generate`` decodes them); streamed ones are the reference's chunk
loop (``forward`` on each window, the new frames' samples kept, as ``chunked_decode`` does, and
the samples the chunk before fell short by, which ``chunked_decode`` skips) with a smaller first
chunk. The stage YAML is the shipped one with small sizes: 4 rows, offline pieces of
at most 23 new frames after up to 25 of context (buckets 16, 24, 32 and 48), streamed chunks of 2
new frames first, then 5 doubling up to 10 (2, 5, 10, 10, ...), after up to 3 frames of context
(windows of 2 for first chunks, 8 and 13 for the others). The pipeline is warmed once: 4 x 3
offline programs and 3 x 3 chunk programs, and nothing compiles after.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
from parity import rel_err
from stage_yamls import Whole, edited_stages, shipped_config
from stand_ins import on_an_accelerator, rows_nearly_free

from benchmarks.stream_suite import stall_seconds
from omni_jax import OmniJaxPipeline, SamplingParams, Token2WavParams
from omni_jax.engine.compilation import CompileCounter
from omni_jax.models.qwen3_omni.code2wav import code2wav_chunk_compiled, code2wav_compiled
from omni_jax.outputs import WarmupReport
from omni_jax.stages.base import StageResult
from omni_jax.stages.config import StageConfig
from omni_jax.stages.qwen3_code2wav import solve_bytes, stream_plan
from omni_jax.stages.qwen3_code2wav_stream import StreamPlan
from omni_jax.testing_qwen3_omni import CODEBOOK_SIZE, NUM_CODE_GROUPS

Q = NUM_CODE_GROUPS
HOP, SHORTFALL = 48, 15  # the tiny code2wav: 2 * 2 * 4 * 3 samples a frame, (4 + 4 * 3) - 1 short
CHUNK, FIRST, LEFT, MAX_CHUNK = 5, 2, 3, 10
MAX_FRAMES = 23


def frames(seed: int, n: int) -> np.ndarray:
    """``[n, Q]`` random codes: frame ``t`` is row ``t``."""
    return np.random.default_rng(seed).integers(0, CODEBOOK_SIZE, (n, Q)).astype(np.int64)


def prompt(seed: int, n: int) -> dict:
    return {"prompt_token_ids": frames(seed, n).reshape(-1).tolist()}


@pytest.fixture(scope="module")
def warmed(qwen3_omni_dir, tmp_path_factory) -> tuple[OmniJaxPipeline, WarmupReport]:
    stream = {
        "chunk_frames": CHUNK,
        "first_chunk_frames": FIRST,
        "left_context_frames": LEFT,
        "max_chunk_frames": MAX_CHUNK,
    }
    engine = Whole(max_batch=4, max_frames=MAX_FRAMES, stream=stream)
    path = edited_stages(
        tmp_path_factory.mktemp("qwen3_code2wav") / "stages.yaml", "qwen3_omni", code2wav={"engine": engine}
    )
    pipe = OmniJaxPipeline.from_pretrained(qwen3_omni_dir, stages=["code2wav"], stage_config=path)
    # Earlier tests' decodes of the same shapes would be hits (the code2wav_qwen3 benchmark smoke
    # test decodes this checkpoint's code2wav, the same graph).
    code2wav_compiled.clear_cache()
    code2wav_chunk_compiled.clear_cache()
    return pipe, pipe.warmup(progress=False)


@pytest.fixture(scope="module")
def pipe(warmed) -> OmniJaxPipeline:
    return warmed[0]


@pytest.fixture(scope="module")
def reference(qwen3_omni_dir) -> torch.nn.Module:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(qwen3_omni_dir, dtype=torch.float32)
    return model.code2wav.eval()


def forward(reference: torch.nn.Module, f: np.ndarray) -> np.ndarray:
    """transformers' whole decode of frames ``f [n, Q]``."""
    with torch.no_grad():
        return reference(torch.from_numpy(f.T[None].copy()))[0, 0].numpy()


def chunk_loop(reference: torch.nn.Module, f: np.ndarray, plan: StreamPlan) -> tuple[np.ndarray, int]:
    """``chunked_decode``'s loop with ``plan``'s chunk sizes (the first, its ramp, then doubling
    from ``plan.chunk`` up to ``plan.largest_chunk``): ``forward`` on each window, the samples of its
    new frames kept, and before them the ``SHORTFALL`` samples the previous window came out short
    by (``chunked_decode`` skips those: a gap at every join). Returns the waveform and the number
    of chunks."""
    pieces, start = [], 0
    while start < len(f):
        end = min(start + plan.chunk_size(len(pieces)), len(f))
        context = min(plan.left_context, start)
        pieces.append(
            forward(reference, f[start - context : end])[context * HOP - (SHORTFALL if context else 0) :]
        )
        start = end
    return np.concatenate(pieces), len(pieces)


def padded(plan: StreamPlan, n: int) -> tuple[int, int]:
    """The chunks of a finished ``n``-frame request and the frames their solves decode, each
    window padded to the smallest of the plan's that holds it."""
    chunks, frames_decoded, start = 0, 0, 0
    while start < n:
        w = plan.window(chunks, start, n, True)
        frames_decoded += min(x for x in plan.windows if x >= w.frames)
        chunks, start = chunks + 1, w.end
    return chunks, frames_decoded


def test_shipped_chunks_grow_from_vllm_omnis() -> None:
    """The shipped YAML's plan: vLLM-omni's first chunk of 1 frame, then a ramp doubling from 2
    frames while below 25 (no chunk asks for more than twice the frames voiced before it: a
    jump from 1 to 25 left a listener 0.2 s of silence on an H200), then 25 after 25 of context,
    doubling up to 100; its windows (a solve pads to the smallest holding its chunks) are the
    first chunk's and a context before each size, which the ramp's chunks fit. A 125-frame (10 s)
    reply is 8 chunks decoding 376 padded frames (1; 2, 4, 8 and 16 after what precedes them and
    25 after 25, each -> 50; 25 + 50; 25 + 19 -> 50), against 9 decoding 401 with vLLM-omni's
    fixed chunks after the same ramp; 375 frames, 10 chunks and 701 against 19 and 901. A
    request's own chunk fixes every chunk after the ramp."""
    plan = stream_plan(StageConfig(**shipped_config("qwen3_omni")["stages"][2]), 8000)
    assert (plan.first_chunk, plan.chunk, plan.left_context, plan.largest_chunk) == (1, 25, 25, 100)
    assert plan.ramp == [2, 4, 8, 16]
    assert [plan.chunk_size(i) for i in range(10)] == [1, 2, 4, 8, 16, 25, 50, 100, 100, 100]
    assert plan.windows == [1, 50, 75, 125] and plan.window_frames == 125
    assert (padded(plan, 125), padded(plan, 375)) == ((8, 376), (10, 701))
    fixed = plan.with_chunk(25)
    assert (padded(fixed, 125), padded(fixed, 375)) == ((9, 401), (19, 901))
    assert [fixed.chunk_size(i) for i in range(7)] == [1, 2, 4, 8, 16, 25, 25] and fixed.windows == [1, 50]
    small = plan.with_chunk(4)
    assert (small.first_chunk, small.ramp, small.chunk_size(1), small.chunk_size(3), small.windows) == (
        1,
        [2],
        2,
        4,
        [1, 29],
    )
    # a first chunk larger than the request's own is cut to it (none is longer than the rest)
    late = dataclasses.replace(plan, first_chunk=8).with_chunk(2)
    assert (late.first_chunk, late.chunk_size(0), late.chunk_size(1)) == (2, 2, 2)


def test_a_talker_at_twice_real_time_keeps_playback_fed() -> None:
    """Frames coming at twice the speech rate (25 a second) and decoded at once, a listener
    playing each chunk as it comes never waits with the shipped plan (375 frames), where
    vLLM-omni's schedule (1 frame, then 25 at a time) leaves it waiting for the second chunk."""
    rate, speech = 25.0, 12.5

    def stalled(sizes: list[int]) -> float:
        ends = np.cumsum(sizes)
        return stall_seconds([(end / rate, size) for end, size in zip(ends, sizes, strict=True)], 1 / speech)

    plan = stream_plan(StageConfig(**shipped_config("qwen3_omni")["stages"][2]), 8000)
    sizes, start = [], 0
    while start < 375:
        w = plan.window(len(sizes), start, 375, True)
        sizes.append(w.end - start)
        start = w.end
    assert sizes[:6] == [1, 2, 4, 8, 16, 25] and stalled(sizes) < 1e-9  # at the bound: the ramp's sizes
    assert stalled([1] + [25] * 14 + [24]) > 0.9


@pytest.mark.parametrize(
    "stream,match",
    [
        (
            {"max_chunk_frames": 20},
            r"max_chunk=20 must be at least chunk=25 "
            r"\(chunk is chunk_frames, max_chunk is max_chunk_frames\)$",
        ),
        ({"chunk_codes": 5}, r"unknown engine.stream keys \['chunk_codes'\]"),
        ({"max_chunk_frames": 1000}, r"the widest chunk window, 1025 frames, exceeds the transformer's"),
    ],
)
def test_stream_settings_are_checked(stream: dict, match: str) -> None:
    """The stage YAML's ``engine.stream`` is refused naming the stage: a largest chunk under the
    chunk, an unknown key, a window past the transformer's positions (1024 here)."""
    config = StageConfig("code2wav", "generation", "talker", engine={"stream": stream})
    with pytest.raises(ValueError, match=f"stage 'code2wav': .*{match}"):
        stream_plan(config, 1024)


def test_offline_batch_matches_transformers(pipe, reference, monkeypatch) -> None:
    """Four requests of different lengths share one solve (rows padded on the right); each equals
    transformers' whole decode of its frames alone (measured: rel err 1.1e-6 at most)."""
    rows_nearly_free(pipe.stages[0].runner.cost, monkeypatch)  # one solve
    lengths = [7, 23, 1, 13]
    outs = pipe.run([prompt(n, n) for n in lengths], Token2WavParams(), progress=False)
    for n, out in zip(lengths, outs, strict=True):
        want = forward(reference, frames(n, n))
        assert (out.finish_reason, out.error, out.sample_rate) == ("stop", None, 24_000)
        assert out.audio.dtype == np.float32 and out.audio.shape == want.shape == (n * HOP - SHORTFALL,)
        assert np.abs(want).max() < 1.0, "the test model saturates the clamp"
        err = rel_err(out.audio, want)
        assert err < 1e-5, (n, err)
        assert out.token_ids == out.prompt_token_ids == prompt(n, n)["prompt_token_ids"]
        metrics = out.metrics["code2wav"]
        assert (metrics["batch_size"], metrics["num_frames"], metrics["num_samples"]) == (4, n, len(want))
        assert metrics["padded_length"] == pipe.stages[0].runner.buckets.length_for(max(lengths))


def test_long_offline_requests_are_transformers_chunked_decode(pipe, reference, monkeypatch) -> None:
    """An offline request longer than ``max_frames`` is decoded in pieces as ``generate`` decodes a
    long reply, ``chunked_decode(codes, max_frames, 25)``: a piece's window is its new frames after
    up to 25 of the previous ones, whose samples are dropped. The pieces are rows of the solves,
    batched with a whole request; the request ends once, with the whole waveform (measured: rel
    err 1.0e-6 at most)."""
    rows_nearly_free(pipe.stages[0].runner.cost, monkeypatch)
    lengths = [24, 9, 60]  # 2 pieces (23 + 1 after 23 of context), whole, 3 (23, 23, 14)
    outs = pipe.run([prompt(n, n) for n in lengths], Token2WavParams(), progress=False)
    for n, out in zip(lengths, outs, strict=True):
        with torch.no_grad():
            codes = torch.from_numpy(frames(n, n).T[None].copy())
            want = reference.chunked_decode(codes, MAX_FRAMES, 25)[0, 0].numpy()
        pieces = -(-n // MAX_FRAMES)
        assert (out.finish_reason, out.error) == ("stop", None)
        assert out.audio.shape == want.shape == (n * HOP - pieces * SHORTFALL,)
        err = rel_err(out.audio, want)
        assert err < 1e-5, (n, err)
        assert out.token_ids == prompt(n, n)["prompt_token_ids"]
        metrics = out.metrics["code2wav"]
        assert (metrics["num_frames"], metrics["num_samples"]) == (n, len(want))
    stage = pipe.stages[0]
    assert not stage.has_work() and not stage._splits and not stage._submitted


def test_abort_drops_every_piece(pipe) -> None:
    """An abort of a request decoded in pieces, some landed, drops the rest: nothing is left. The
    stage's load counts the request once, not a piece at a time."""
    stage = pipe.stages[0]
    (admission,) = pipe.intake.admit([prompt(4, 70)], Token2WavParams(), ["long"])
    pipe.core.add(admission)
    assert (stage.load().running, stage.load().waiting) == (0, 1)  # four pieces waiting
    stage.step(block=True)  # one solve: some pieces, not all four
    assert stage._splits["long"].landed and stage.has_work()
    assert (stage.load().running, stage.load().waiting) == (0, 1)
    out = pipe.core.abort("long")
    assert out is not None and out.finish_reason == "abort"
    assert not stage.has_work() and not stage._splits and not stage._submitted


STREAMED = [(1, None), (2, None), (8, None), (13, 3), (30, None)]
"""``(frames, chunk_codes)`` of the streamed requests: one frame, exactly the first chunk, a short
last chunk, a fixed chunk asked for, and more frames than an offline request may hold (chunks of
2, 4 (the ramp), 5, 10 and 9 frames)."""


def test_streamed_matches_the_chunk_loop(pipe, reference) -> None:
    """Streamed requests run together (their chunks batched, 4 rows a solve) and each equals the
    reference's chunk loop at its plan (measured: rel err 7.5e-7 at most); its audio is as long as
    the whole decode's (``chunked_decode``'s is shorter by the samples it skips at each join)."""
    params = [Token2WavParams(stream=True, chunk_codes=c) for _, c in STREAMED]
    outs = pipe.run([prompt(n, n) for n, _ in STREAMED], params, progress=False)
    decoder = pipe.stages[0].decoder
    for (n, chunk), out in zip(STREAMED, outs, strict=True):
        want, chunks = chunk_loop(reference, frames(n, n), decoder.plan_for(chunk))
        assert (out.finish_reason, out.error, out.sample_rate) == ("stop", None, 24_000)
        assert out.audio.shape == want.shape == (n * HOP - SHORTFALL,)
        err = rel_err(out.audio, want)
        assert err < 1e-5, (n, err)
        metrics = out.metrics["code2wav"]
        assert (metrics["chunks"], metrics["num_frames"]) == (chunks, n)
    assert [o.metrics["code2wav"]["chunks"] for o in outs] == [1, 1, 3, 5, 5]


def test_first_chunk_as_large_is_transformers_chunked_decode_without_its_gaps(pipe, reference) -> None:
    """A request whose chunk is no larger than the first (``chunk_codes=2``: both 2) is cut as
    transformers' own ``chunked_decode(codes, 2, 3)``: with the ``SHORTFALL`` samples each of its
    chunks after the first begins with taken out, it is ``chunked_decode``'s audio (measured: rel
    err 9.0e-7), whose chunks skip those samples (a gap at every join)."""
    f = frames(5, 11)
    out = pipe.run(prompt(5, 11), Token2WavParams(stream=True, chunk_codes=2), progress=False)[0]
    with torch.no_grad():
        want = reference.chunked_decode(torch.from_numpy(f.T[None].copy()), 2, LEFT)[0, 0].numpy()
    joins = [k * 2 * HOP - SHORTFALL for k in range(1, 6)]  # where chunks 1-5 begin in our audio
    gapped = np.delete(out.audio, [j + i for j in joins for i in range(SHORTFALL)])
    assert out.audio.shape == (11 * HOP - SHORTFALL,) and gapped.shape == want.shape
    err = rel_err(gapped, want)
    assert err < 1e-5, err


def test_streamed_is_the_offline_decode(pipe) -> None:
    """Where every chunk's context reaches back to the first frame (requests of two chunks here:
    the second's context, up to 3 frames, holds the 2 before it), streamed audio is the offline decode
    of the same frames, sample for sample: the second chunk keeps what the first fell short by, so
    no sample is skipped or repeated at the join (measured: rel err 6.0e-7 at most; a longer
    request's later chunks see 3 frames of context where the offline decode sees all)."""
    for n in (4, 6):
        offline, streamed = pipe.run(
            [prompt(n, n)] * 2, [Token2WavParams(), Token2WavParams(stream=True)], progress=False
        )
        assert streamed.metrics["code2wav"]["chunks"] > 1
        assert streamed.audio.shape == offline.audio.shape == (n * HOP - SHORTFALL,)
        err = rel_err(streamed.audio, offline.audio)
        assert err < 1e-5, (n, err)


def test_batched_stream_equals_alone(pipe, monkeypatch) -> None:
    """A request's chunks give the same audio in a solve of four rows as alone (one row): rows do
    not mix (measured: rel err 6.2e-7 at most: another row count, other XLA kernels)."""
    rows_nearly_free(pipe.stages[0].decoder.cost, monkeypatch)
    lengths = [9, 4, 17, 12]
    params = Token2WavParams(stream=True)
    together = pipe.run([prompt(n, n) for n in lengths], params, progress=False)
    for n, out in zip(lengths, together, strict=True):
        alone = pipe.run(prompt(n, n), params, progress=False)[0]
        assert out.audio.shape == alone.audio.shape
        err = rel_err(out.audio, alone.audio)
        assert err < 2e-6, (n, err)


def test_nothing_compiles_after_warmup(warmed) -> None:
    """Warm-up compiles 4 frame buckets (up to a piece and its context) x 3 row counts offline
    and 3 chunk windows (a first chunk's, a whole context before each chunk size) x 3 row
    counts; a mix of offline (whole and in pieces) and streamed requests then compiles nothing."""
    pipe, report = warmed
    stage = pipe.stages[0]
    assert stage.runner.buckets.shapes() == [(r, n) for r in (1, 2, 4) for n in (16, 24, 32, 48)]
    windows = (FIRST, LEFT + CHUNK, LEFT + MAX_CHUNK)
    assert stage.decoder.buckets.shapes() == [(r, n) for r in (1, 2, 4) for n in windows]
    assert report.programs == report.compiles + report.loads == 21
    lengths = [3, 24, 50, 40, 1, 37]
    params = [Token2WavParams(stream=i % 2 == 1, chunk_codes=4 if i == 3 else None) for i in range(6)]
    with CompileCounter() as counted:
        outs = pipe.run([prompt(n, n) for n in lengths], params, progress=False)
    assert [o.finish_reason for o in outs] == ["stop"] * 6
    assert (counted.traces, counted.compiles) == (0, 0)


FOUR = {"prompt_token_ids": [1, 2, 3, 4]}
BAD_REQUESTS = [
    ({"prompt_token_ids": [1, 2, 3, 4, 5, 6]}, None, "6 codec ids are not whole frames of 4 codes"),
    ({"prompt_token_ids": [1, 2, 3, CODEBOOK_SIZE]}, None, r"codec id 32 outside the vocabulary \[0, 32\)"),
    ({"prompt_token_ids": [-1, 2, 3, 4]}, None, "codec id -1 outside"),
    ({"prompt_token_ids": []}, None, "empty prompt"),
    ({**FOUR, "speaker": "Ethan"}, None, "this code2wav takes no speaker: the voice is in the codes"),
    (
        FOUR,
        Token2WavParams(stream=True, chunk_codes=11),
        "stage 'code2wav': chunk_codes=11 exceeds the stage's largest chunk of 10 frames",
    ),
    (FOUR, Token2WavParams(chunk_codes=3), "stage 'code2wav': chunk_codes=3 needs stream=True"),
    (FOUR, Token2WavParams(stream=True, chunk_codes=0), "stage 'code2wav': chunk_codes=0 must be"),
    (FOUR, SamplingParams(), "stage 'code2wav' needs Token2WavParams"),
    ({"prompt": "hello"}, None, "the 'code2wav' stage takes token ids in 'prompt_token_ids'"),
]


@pytest.mark.parametrize("bad,params,match", BAD_REQUESTS)
def test_bad_request_refused_before_work(pipe, bad, params, match) -> None:
    good = prompt(1, 3)
    per_prompt = None if params is None else [Token2WavParams(), params]
    with pytest.raises(ValueError, match="request 1: " + match):
        pipe.run([good, bad], per_prompt, progress=False)
    assert not pipe.stages[0].has_work()
    assert pipe.run(good, progress=False)[0].finish_reason == "stop"


def talker_result(request_id: str, codes: list[int]) -> StageResult:
    """What a talker hands on when a request ends (its stop token already cut)."""
    return StageResult(request_id, codes, "stop", {})


def drain(stage) -> tuple[list[np.ndarray], StageResult]:
    """Step the stage until it has no work: the audio pieces it emitted and the result."""
    pieces, results = [], []
    while stage.has_work():
        step = stage.step()
        pieces += list(step.new_audio.values())
        results += step.finished
    (result,) = results
    return pieces, result


def test_a_chunk_waits_for_a_frame_due_soon(pipe, monkeypatch) -> None:
    """On an accelerator, a later chunk ready while another request's is one frame short waits
    (its listener has two chunks to hear) and then shares its solve
    (``StreamedDecoder.gathering`` with the frames ``FrameDecoder.short_of`` counts); first
    chunks, and a chunk whose listener has only the last to hear, run at once."""
    dec = pipe.stages[0].decoder
    on_an_accelerator(dec, monkeypatch, solve_s=1e-5)
    a, b = dec.add("a"), dec.add("b")
    f = frames(5, 40).reshape(-1).tolist()

    def step(**upto: int) -> list[tuple[str, int]]:
        for rid, n in upto.items():
            have = len(dec._requests[rid].codes)
            dec.extend(rid, f[have : n * Q])
        return [(o.request_id, o.batch_size) for o in dec.step()]

    second = FIRST + a.plan.chunk_size(1)
    assert step(a=FIRST, b=FIRST) == [("a", 2), ("b", 2)]  # first chunks
    assert step(a=second) == [("a", 1)]  # one chunk to hear
    third = second + a.plan.chunk_size(2)
    assert step(a=third, b=second - 1) == [] and (dec.short_of(a), dec.short_of(b)) == (None, 1)
    assert step(b=second) == [("a", 2), ("b", 2)]
    assert dec.remove("a") and dec.remove("b")


def test_fed_frames_stream_as_they_come(pipe, monkeypatch) -> None:
    """Fed as a talker feeds it (one frame and a half at a time, so a feed may end inside a frame),
    the stage voices chunks as they complete and ends with the same audio as the request submitted
    whole; a last feed with no new codes after every frame was voiced ends it with no more audio.
    The first chunk's solve decodes its own frames only (the first-chunk program), the later ones
    pad to the smallest window holding them (the ramp's to the first chunk size's)."""
    stage = pipe.stages[0]
    f = frames(3, 21).reshape(-1).tolist()
    whole = pipe.run({"prompt_token_ids": f}, Token2WavParams(stream=True), progress=False)[0]
    solve, widths = stage.decoder.solve, []

    def spy(graph, state, codes, context, num_frames, *, join):
        widths.append(codes.shape[-1])
        return solve(graph, state, codes, context, num_frames, join=join)

    monkeypatch.setattr(stage.decoder, "solve", spy)
    stage.open("fed", {}, Token2WavParams(stream=True))
    pieces = []
    for i in range(0, len(f), 6):
        assert stage.feed(0, "fed", f[i : i + 6], None)
        while stage.has_work():
            pieces += list(stage.step().new_audio.values())
    assert len(pieces) == 4  # frames 0-2, 2-6, 6-11 and 11-21, each as soon as its frames are there
    assert widths == [FIRST, LEFT + CHUNK, LEFT + CHUNK, LEFT + MAX_CHUNK]
    assert stage.feed(0, "fed", [], talker_result("fed", f))
    more, result = drain(stage)
    assert more == [] and result.finish_reason == "stop"
    np.testing.assert_array_equal(np.concatenate(pieces), whole.audio)
    np.testing.assert_array_equal(result.audio, whole.audio)
    assert result.token_ids == f and result.metrics["chunks"] == 4


def test_fed_codes_checked(pipe) -> None:
    """A feed of codes outside the codebook, or a last feed ending inside a frame, is refused
    naming the request; a talker that made no frame leaves nothing to voice (dropped)."""
    stage = pipe.stages[0]
    stage.open("bad", {}, Token2WavParams(stream=True))
    with pytest.raises(ValueError, match=r"request 3: codec id 40 outside the vocabulary \[0, 32\)"):
        stage.feed(3, "bad", [1, 40], None)
    stage.feed(3, "bad", [1, 2, 3, 4, 5], None)
    with pytest.raises(ValueError, match="request 3: 6 codec ids are not whole frames of 4 codes"):
        stage.feed(3, "bad", [6], talker_result("bad", [1, 2, 3, 4, 5, 6]))
    assert stage.abort("bad")
    stage.open("silent", {}, Token2WavParams(stream=True))
    assert not stage.feed(0, "silent", [], talker_result("silent", []))
    assert stage.load().running == 0 and not stage.has_work()


def test_abort_drops_a_streamed_request(pipe) -> None:
    """An abort after the first audio drops the streamed request: nothing of it is left to decode."""
    stage = pipe.stages[0]
    (admission,) = pipe.intake.admit([prompt(2, 30)], Token2WavParams(stream=True), ["aborted"])
    pipe.core.add(admission, stream=True)
    while not any(u.audio_delta is not None for u in pipe.core.step()):
        pass
    assert stage.load().running == 1
    out = pipe.core.abort("aborted")
    assert out is not None and (out.finish_reason, out.finished) == ("abort", True)
    assert (stage.load().running, stage.load().waiting) == (0, 0)
    assert not stage.has_work() and not pipe.core.has_work()


def test_chunk_faults_end_only_their_request(pipe, reference, monkeypatch) -> None:
    """A device error in a batched chunk solve is retried one request at a time, so only the
    request that fails alone ends with the error; a non-finite chunk fails only its request. The
    request beside them still equals the chunk loop."""
    decoder = pipe.stages[0].decoder
    rows_nearly_free(decoder.cost, monkeypatch)  # the three requests' chunks solve together
    solve = decoder.solve

    def faulty(graph, state, codes, context, frames, *, join):
        rows = np.asarray(frames)
        if 3 in rows.tolist():  # the second window of the 3-frame request (of 2 + 1 frames)
            raise jax.errors.JaxRuntimeError("device fault")
        wave, kept = solve(graph, state, codes, context, frames, join=join)
        # the second window of the 4-frame request (2 + 2 frames); the 9-frame one's are 2, 6, 6
        return np.where((rows == 4)[:, None], np.nan, np.asarray(wave)), kept

    monkeypatch.setattr(decoder, "solve", faulty)
    params = Token2WavParams(stream=True)
    fault, nan, good = pipe.run([prompt(1, 3), prompt(2, 4), prompt(3, 9)], params, progress=False)
    assert (fault.finish_reason, fault.audio) == ("error", None) and "device fault" in fault.error
    assert (nan.finish_reason, nan.audio) == ("error", None) and "non-finite waveform" in nan.error
    assert good.finish_reason == "stop"
    want, _ = chunk_loop(reference, frames(3, 9), decoder.plan)
    assert rel_err(good.audio, want) < 1e-5
    assert decoder.num_streaming == 0


@pytest.mark.parametrize("widths", ["tiny", "released"])
def test_solve_estimate_covers_xla(pipe, widths: str) -> None:
    """The start-up check's estimate of a decode's temporaries is at least XLA's own and not far
    above it, for the test model and at the released model's widths (transformers' default
    ``Qwen3OmniMoeCode2WavConfig``, traced from shapes, no weights; measured on CPU: 1.1x and
    1.4x)."""
    from flax import nnx
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

    from omni_jax.jit import StaticGraph
    from omni_jax.models.qwen3_omni.code2wav import Code2Wav
    from omni_jax.models.qwen3_omni.code2wav_layers import Code2WavSpec

    if widths == "tiny":
        spec, graph, state = pipe.stages[0].spec, pipe.stages[0].runner.graph, pipe.stages[0].runner.state
    else:
        spec = Code2WavSpec.from_hf(Qwen3OmniMoeCode2WavConfig())
        assert (spec.hidden_size, spec.decoder_dim) == (1024, 1536)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Code2Wav(spec, rngs=nnx.Rngs(0))))
        graph = StaticGraph(graphdef)
    rows, length = 4, 512
    compiled = code2wav_compiled.lower(
        graph,
        state,
        jax.ShapeDtypeStruct((rows, spec.num_quantizers, length), np.int32),
        jax.ShapeDtypeStruct((rows,), np.int32),
    ).compile()
    xla = compiled.memory_analysis().temp_size_in_bytes
    assert xla <= solve_bytes(spec, rows, length) <= 3 * xla


def test_converted_checkpoint_serves_the_same_audio(pipe, qwen3_omni_dir, tmp_path) -> None:
    """``checkpoints_convert`` keeps every stage; the converted directory decodes
    bit-identically to the HF one."""
    from omni_jax.weights import convert, read_manifest

    converted = convert(qwen3_omni_dir, tmp_path / "conv", progress=False)
    assert read_manifest(converted)["stages"] == ["thinker", "talker", "code2wav"]
    served = OmniJaxPipeline.from_pretrained(converted, stages=["code2wav"])
    request = prompt(4, 10)
    ours, theirs = (p.run(request, progress=False)[0] for p in (served, pipe))
    np.testing.assert_array_equal(ours.audio, theirs.audio)
