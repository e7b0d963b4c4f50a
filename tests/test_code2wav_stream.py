"""Streamed (chunked) code2wav against the chunked reference built from transformers' own modules.

The reference (:func:`omni_reference.chunked_reference`) is Qwen's streaming loop (vLLM fork
``process_chunk`` and ``process_chunk_for_50hz``) written with
``Qwen2_5OmniToken2WavDiTModel.sample`` and the BigVGAN of transformers, its ``torch.randn``
replaced by the slice of the request's noise at the chunk's window; it does not use our planner.
Chunked output only approximates the offline one, so offline is the reference only where one
chunk covers the request. Tiny random-weight models, float32, the tolerance of
``test_code2wav_parity.py``; relative error is ``max|ours - ref| / max|ref|``.

The tiny model streams with Qwen's constants scaled to its block of 4 frames (Qwen's is 24):
chunk 3 blocks, past 2, future 1, and an overlap of 4 frames. At Qwen's own sizes (72, 48, 24,
20 frames) the tiny model's receptive fields fit inside the context, so its streamed audio is
its offline audio to float32 rounding (6e-7) and a test could not tell chunking from offline;
at these sizes they differ by about 3e-3, which the batched test checks. The planner's own
tests use Qwen2.5-Omni's constants.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from omni_reference import chunked_reference
from parity import rel_err
from stand_ins import Gate, held, on_an_accelerator, rows_nearly_free
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
    Qwen2_5OmniBigVGANConfig,
    Qwen2_5OmniDiTConfig,
    Qwen2_5OmniToken2WavConfig,
)
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavModel

from omni_jax.engine.compilation import CompileCounter
from omni_jax.jit import StaticGraph
from omni_jax.models.loading import build_model, torch_state_items
from omni_jax.models.qwen2_5_omni.chunk_plan import ChunkKind, ChunkPlanner
from omni_jax.models.qwen2_5_omni.token2wav import (
    TOKEN2WAV_IGNORE,
    TOKEN2WAV_RULES,
    Token2Wav,
    token2wav_compiled,
)
from omni_jax.models.qwen2_5_omni.token2wav_chunk import token2wav_chunk_compiled
from omni_jax.stages.chunk_loop import SLACK
from omni_jax.stages.code2wav import SAMPLE_RATE, stream_planner
from omni_jax.stages.code2wav_params import Token2WavParams
from omni_jax.stages.code2wav_stream import ChunkedDecoder, ChunkOutput, NoiseRows
from omni_jax.stages.config import StageConfig
from omni_jax.testing import TINY_BIGVGAN_CONFIG, TINY_DIT_CONFIG, randomize_weights

NUM_EMBEDS = TINY_DIT_CONFIG["num_embeds"]
MEL = TINY_DIT_CONFIG["mel_dim"]
SPK = TINY_DIT_CONFIG["enc_emb_dim"]
REPEATS = TINY_DIT_CONFIG["repeats"]
HOP = math.prod(TINY_BIGVGAN_CONFIG["upsample_rates"])
REF_FRAMES = 19
C, P, F, V = 12, 8, 4, 4

PLANNER = ChunkPlanner(
    repeats=REPEATS,
    block_size=4,
    look_backward_blocks=2,
    look_ahead_blocks=1,
    hop=HOP,
    chunk=C,
    past=P,
    future=F,
    overlap=V,
)
"""The tiny DiT (block 4, look-back layers 0 and 2, look-ahead layer 1) at the scaled sizes."""

QWEN = ChunkPlanner(repeats=2, block_size=24, look_backward_blocks=2, look_ahead_blocks=1, hop=240)
"""Qwen2.5-Omni-7B's constants: chunk 72, past 48, future 24, overlap 20 frames."""

GROWING = dataclasses.replace(QWEN, first=48, max_chunk=288)
"""The shipped stage YAML's: a first chunk of 48 frames, then 72, 144, 288, 288, ..."""

TINY_GROWING = dataclasses.replace(PLANNER, first=8, max_chunk=48)
"""The tiny sizes growing: a first chunk of 8 frames, then 12, 24, 48, 48, ..."""

COUNTS = (3, 8, 9, 14, 15, 77)
"""Code counts: little (3; 8 at its upper edge, C + F frames), first + final (9: the final keeps 6
frames; 14: 16, the upper edge), first + middle + final (15), first + 11 middles + final (77)."""

SMALL = 40
"""A request streamed with ``chunk_codes=4`` (8 frames, ``2 * V``): ten chunks."""

KNOBS = {
    3: dict(num_steps=4, guidance_scale=0.5, sway_coefficient=-1.0),
    8: dict(num_steps=3, guidance_scale=-0.5, sway_coefficient=0.0),
    9: dict(num_steps=4, guidance_scale=1.5, sway_coefficient=-0.5),
    14: dict(num_steps=5, guidance_scale=0.5, sway_coefficient=-1.0),
    15: dict(num_steps=4, guidance_scale=0.0, sway_coefficient=-1.0),
    77: dict(num_steps=4, guidance_scale=0.5, sway_coefficient=-1.0),
    SMALL: dict(num_steps=6, guidance_scale=0.7, sway_coefficient=-1.0),
}
"""Per-request step knobs (8 and 15: below the guidance threshold, the reference's unguided path)."""


@pytest.fixture(scope="module")
def reference() -> Qwen2_5OmniToken2WavModel:
    torch.manual_seed(0)
    config = Qwen2_5OmniToken2WavConfig(
        dit_config=Qwen2_5OmniDiTConfig(**TINY_DIT_CONFIG).to_dict(),
        bigvgan_config=Qwen2_5OmniBigVGANConfig(**TINY_BIGVGAN_CONFIG).to_dict(),
    )
    model = Qwen2_5OmniToken2WavModel(config).float().eval()
    randomize_weights(model.code2wav_dit_model, 1.0)
    # Halved so the vocoder's output stays mostly inside its [-1, 1] clamp, which would hide errors.
    randomize_weights(model.code2wav_bigvgan_model, 0.5)
    return model


@pytest.fixture(scope="module")
def ours(reference: Qwen2_5OmniToken2WavModel) -> Token2Wav:
    return build_model(
        lambda: Token2Wav(reference.config, rngs=nnx.Rngs(0)),
        torch_state_items(reference),
        TOKEN2WAV_RULES,
        ignore=TOKEN2WAV_IGNORE,
    )


def decoder(model: Token2Wav, max_batch: int = 8, planner: ChunkPlanner = PLANNER) -> ChunkedDecoder:
    return ChunkedDecoder(
        token2wav_chunk_compiled,
        model,
        planner,
        mel_dim=MEL,
        speaker_dim=SPK,
        reference_frames=REF_FRAMES,
        sample_rate=SAMPLE_RATE,
        max_batch=max_batch,
    )


def sharing(dec: ChunkedDecoder, monkeypatch: pytest.MonkeyPatch) -> ChunkedDecoder:
    """``dec`` with every ready chunk in one solve (:func:`stand_ins.rows_nearly_free`)."""
    rows_nearly_free(dec.cost, monkeypatch)
    return dec


def make_request(n: int) -> dict:
    """Codes, voice and seed of the request of ``n`` codes, and the noise its seed draws."""
    rng = np.random.default_rng(n)
    seed = 1000 + n
    return dict(
        codes=rng.integers(0, NUM_EMBEDS + 1, n).astype(np.int64),
        speaker=rng.standard_normal(SPK).astype(np.float32),
        ref_mel=(rng.standard_normal((REF_FRAMES - n % 7, MEL)) - 2).astype(np.float32),
        seed=seed,
        noise=np.random.default_rng(seed).standard_normal((n * REPEATS, MEL), dtype=np.float32),
    )


def hf_stream(
    t2w: Qwen2_5OmniToken2WavModel,
    req: dict,
    num_steps: int,
    guidance_scale: float,
    sway_coefficient: float,
    chunk: int = C,
    first: int | None = None,
    largest: int | None = None,
) -> list[np.ndarray]:
    """The reference's pieces for one of :func:`make_request`'s requests, at the scaled sizes
    (``first``: a shorter first chunk; ``largest``: later chunks doubling up to it)."""
    return chunked_reference(
        t2w,
        req["codes"],
        req["speaker"],
        req["ref_mel"],
        req["noise"],
        num_steps,
        guidance_scale,
        sway_coefficient,
        dataclasses.replace(PLANNER, chunk=chunk, first=first, max_chunk=largest),
    )


@pytest.fixture(scope="module")
def expected(reference: Qwen2_5OmniToken2WavModel) -> dict[int, list[np.ndarray]]:
    return {n: hf_stream(reference, make_request(n), **KNOBS[n]) for n in COUNTS}


def stream(
    dec: ChunkedDecoder,
    counts: dict[int, Token2WavParams],
    rounds: list[dict[int, int]],
    block: bool = True,
) -> tuple[dict[int, list[ChunkOutput]], list[set[ChunkKind]]]:
    """Decode requests whose codes arrive in ``rounds`` (each: request -> codes it has by then;
    all of them means finished), one step after each round that leaves a chunk ready, then the
    rest: each request's outputs in order, and each step's chunk kinds. ``block=False``: steps
    leave their solve in flight, to land in a later step."""
    requests = {n: make_request(n) for n in counts}
    for n, params in counts.items():
        dec.add(str(n), requests[n]["speaker"], requests[n]["ref_mel"], params)
    sent = {n: 0 for n in counts}
    outputs: dict[int, list[ChunkOutput]] = {n: [] for n in counts}
    kinds = []

    def step() -> None:
        chunks = dec.step(block)
        kinds.append({o.chunk.kind for o in chunks})
        for o in chunks:
            outputs[int(o.request_id)].append(o)

    for arrived in rounds:
        for n, upto in arrived.items():
            dec.extend(str(n), requests[n]["codes"][sent[n] : upto].tolist(), finished=upto == n)
            sent[n] = upto
        if dec.has_work():
            step()
    while dec.has_work():
        step()
    assert sent == {n: n for n in counts} and not dec.ready()
    return outputs, kinds


def trickle(counts: Sequence[int], increment: int) -> list[dict[int, int]]:
    """Rounds in which every request gets ``increment`` more codes (request ``i`` starts with
    ``i + 1``), so their chunks become ready at different steps and pile up."""
    rounds, have = [], dict.fromkeys(counts, 0)
    while any(have[n] < n for n in counts):
        before = dict(have)
        for i, n in enumerate(counts):
            have[n] = min(n, have[n] + (i + 1 if have[n] == 0 else increment))
        rounds.append({n: have[n] for n in counts if have[n] > before[n]})
    return rounds


def check_pieces(outputs: list[ChunkOutput], want: list[np.ndarray], n: int) -> None:
    """The pieces have the reference's lengths, follow each other, end the request, and match."""
    assert [len(o.audio) for o in outputs] == [len(w) for w in want]
    assert [o.chunk.offset for o in outputs] == list(np.cumsum([0] + [len(w) for w in want[:-1]]))
    assert sum(len(w) for w in want) == n * REPEATS * HOP
    assert [o.last for o in outputs] == [False] * (len(want) - 1) + [True]
    for o, w in zip(outputs, want, strict=True):
        assert np.mean(np.abs(w) >= 1.0) < 0.05, "test model saturates the clamp"
        err = rel_err(o.audio, w)
        assert err < 1e-5, (n, o.chunk.index, o.chunk.kind, err)


def params(n: int, knobs: dict | None = None, **extra) -> Token2WavParams:
    """The streamed params of the request of ``n`` codes (its seed; its knobs unless given)."""
    return Token2WavParams(stream=True, seed=make_request(n)["seed"], **(knobs or KNOBS[n]), **extra)


# --- the planner ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n,kinds,windows,final_keep",
    [
        (1, "L", [(0, 2)], 2),
        (10, "L", [(0, 20)], 20),
        (48, "L", [(0, 96)], 96),
        (49, "FE", [(0, 96), (24, 98)], 26),
        (84, "FE", [(0, 96), (24, 168)], 96),
        (85, "FME", [(0, 96), (24, 168), (96, 170)], 26),
        (150, "FMME", [(0, 96), (24, 168), (96, 240), (168, 300)], 84),
    ],
)
def test_split_at_the_boundaries(n, kinds, windows, final_keep) -> None:
    """Qwen2.5-Omni's split: little iff N <= C + F frames; else ceil((N - F) / C) chunks, the
    final keeping (F, C + F] frames; windows from 2 blocks before a chunk to 1 block after it."""
    letter = {ChunkKind.LITTLE: "L", ChunkKind.FIRST: "F", ChunkKind.MIDDLE: "M", ChunkKind.FINAL: "E"}
    chunks = QWEN.split(n)
    assert "".join(letter[c.kind] for c in chunks) == kinds
    assert [(c.start, c.end) for c in chunks] == windows
    assert chunks[-1].keep_len == final_keep
    assert QWEN.num_chunks(n) == len(chunks)
    for c in chunks:
        assert c.keep_lo == c.index * 72 - c.start
        assert c.prefix_len == (0 if c.index == 0 else 40)


def test_chunks_run_once_known_not_last() -> None:
    """Chunk p runs past (p + 1) C + F frames (one code after the reference would) or at the end."""
    assert QWEN.ready(48, finished=False) == []
    assert [c.kind for c in QWEN.ready(49, finished=False)] == [ChunkKind.FIRST]
    assert QWEN.ready(84, finished=False, done=1) == []
    assert [c.kind for c in QWEN.ready(85, finished=False, done=1)] == [ChunkKind.MIDDLE]
    assert [c.kind for c in QWEN.ready(84, finished=True, done=1)] == [ChunkKind.FINAL]
    assert [c.kind for c in QWEN.ready(150, finished=False)] == [
        ChunkKind.FIRST,
        ChunkKind.MIDDLE,
        ChunkKind.MIDDLE,
    ]
    with pytest.raises(ValueError, match="a finished request needs at least one code"):
        QWEN.ready(0, finished=True)


def test_a_shorter_first_chunk_runs_sooner() -> None:
    """``first`` = 48 frames (24 codes): chunk 0 runs past first + F = 72 frames (36 codes, not
    48), keeps [0, 48); chunk 1 keeps [48, 120) from a window that starts 48 frames before it."""
    planner = dataclasses.replace(QWEN, first=48)
    assert planner.ready(36, finished=False) == []
    (first,) = planner.ready(37, finished=False)
    assert (first.kind, first.start, first.end, first.keep_len) == (ChunkKind.FIRST, 0, 72, 48)
    assert planner.ready(72, finished=False, done=1) == []
    (middle,) = planner.ready(73, finished=False, done=1)
    assert (middle.kind, middle.start, middle.end, middle.keep_lo, middle.keep_len) == (
        ChunkKind.MIDDLE,
        0,
        144,
        48,
        72,
    )
    assert middle.offset == (48 - 20) * QWEN.hop
    assert [c.kind for c in planner.split(36)] == [ChunkKind.LITTLE]
    assert planner.num_chunks(37) == 2 and planner.window_frames == QWEN.window_frames
    assert dataclasses.replace(planner, chunk=48).first_chunk == 48  # never longer than a chunk
    assert dataclasses.replace(QWEN, first=96).split(150) == QWEN.split(150)


def test_growing_chunks_double_up_to_the_largest() -> None:
    """The shipped YAML's planner: chunks keep 48, 72, 144, 288, 288 frames; each runs once its
    window's end (its last kept frame + 24) is passed; the windows a solve pads to are the first
    chunk's and one per size; a request's own chunk is fixed, the first no longer."""
    assert [GROWING.chunk_size(p) for p in range(6)] == [48, 72, 144, 288, 288, 288]
    assert [GROWING.chunk_start(p) for p in range(6)] == [0, 48, 120, 264, 552, 840]
    assert GROWING.windows == [72, 144, 216, 360] and GROWING.growing == [72, 144]
    for ends, p in ((72, 0), (144, 1), (288, 2), (576, 3), (864, 4)):
        assert [c.index for c in GROWING.ready(ends // 2, finished=False, done=p)] == []
        assert [c.index for c in GROWING.ready(ends // 2 + 1, finished=False, done=p)] == [p]
    chunks = GROWING.split(500)  # 1000 frames: chunk 4 keeps [552, 840), the final [840, 1000)
    assert [(c.kind, c.start, c.end, c.keep_len) for c in chunks] == [
        (ChunkKind.FIRST, 0, 72, 48),
        (ChunkKind.MIDDLE, 0, 144, 72),
        (ChunkKind.MIDDLE, 72, 288, 144),
        (ChunkKind.MIDDLE, 216, 576, 288),
        (ChunkKind.MIDDLE, 504, 864, 288),
        (ChunkKind.FINAL, 792, 1000, 160),
    ]
    assert sum(c.window for c in chunks) == 1360  # against 1936 frames with Qwen's fixed chunks
    assert sum(c.window for c in dataclasses.replace(GROWING, max_chunk=None).split(500)) == 1936
    asked = GROWING.with_chunk(48)
    assert (asked.first_chunk, asked.largest_chunk, asked.growing) == (48, 48, [])
    assert [(c.start, c.end) for c in asked.split(100)] == [(0, 72), (0, 120), (48, 168), (96, 200)]


@pytest.mark.parametrize(
    "planner",
    [
        QWEN,
        dataclasses.replace(QWEN, chunk=48),
        dataclasses.replace(QWEN, chunk=96),
        dataclasses.replace(QWEN, first=48),
        PLANNER,
        dataclasses.replace(PLANNER, first=8),
        GROWING,
        dataclasses.replace(QWEN, first=48, max_chunk=216),
        dataclasses.replace(PLANNER, first=8, max_chunk=48),
    ],
    ids=[
        "qwen",
        "qwen-chunk-48",
        "qwen-chunk-96",
        "qwen-first-48",
        "tiny",
        "tiny-first-8",
        "qwen-growing",
        "qwen-growing-216",
        "tiny-growing",
    ],
)
def test_split_depends_only_on_the_count(planner: ChunkPlanner) -> None:
    """Codes arriving in any increments give the chunks of the final count; emitted pieces tile
    the request's N * hop samples in order, and every window and vocoder input fits the bucket:
    the smallest window that holds a chunk, which also holds what it keeps, for the stage's
    chunks and for a request's own (smaller, fixed) chunk."""
    rng = np.random.default_rng(planner.chunk)
    hop = planner.hop
    unit = math.lcm(planner.block_size, planner.repeats)
    for c in range(-(-2 * planner.overlap // unit) * unit, planner.largest_chunk + 1, unit):
        for n in range(1, 200):
            for chunk in planner.with_chunk(c).split(n):
                bucket = min(w for w in planner.windows if w >= chunk.window)
                assert chunk.keep_len <= planner.keep_bound(bucket), (c, n, chunk)
    for n in range(1, 260):
        split = planner.split(n)
        for _ in range(3):
            got, have = [], 0
            while have < n:
                have = min(n, have + int(rng.integers(1, 40)))
                got += planner.ready(have, finished=have == n and bool(rng.integers(2)), done=len(got))
            got += planner.ready(n, finished=True, done=len(got))
            assert got == split, n
        assert [c.offset for c in split] == list(np.cumsum([0] + [c.emitted for c in split[:-1]]))
        assert split[-1].offset + split[-1].emitted == n * REPEATS * hop
        for c in split:
            assert c.start % planner.block_size == 0 and c.window <= planner.window_frames
            assert c.keep_lo + c.keep_len <= c.window and c.vocoded <= planner.vocoder_frames
            bucket = min(w for w in planner.windows if w >= c.window)
            assert c.keep_len <= planner.keep_bound(bucket), (n, c)
            if c.kind in (ChunkKind.LITTLE, ChunkKind.FINAL):
                assert c.keep_lo + c.keep_len == c.window
            assert 0 <= c.emit_lo < c.emit_hi <= c.vocoded * hop


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(chunk=70), r"chunk=70 must be a multiple of the DiT's block_size \(4\)"),
        (dict(past=46), r"past=46 must be a multiple of the DiT's block_size \(4\)"),
        (dict(future=26), r"future=26 must be a multiple of the DiT's block_size \(4\)"),
        (dict(repeats=5), r"chunk=72 must be a multiple of the mel frames per code \(repeats\) \(5\)"),
        (dict(chunk=36), "chunk=36 must be at least 2 \\* overlap=40"),
        (dict(past=4), "past=4 must cover the 2 look-backward layers' reach of 8 frames"),
        (dict(future=0), "future=0 must cover the 1 look-ahead layers' reach of 4 frames"),
        (dict(chunk=0), "chunk=0 must be >= 1"),
        (dict(overlap=-1), "overlap=-1 must be >= 0"),
        (dict(first=36), "first_chunk=36 must be at least 2 \\* overlap=40"),
        (dict(first=70), r"first_chunk=70 must be a multiple of the DiT's block_size \(4\)"),
        (dict(max_chunk=48), "max_chunk=48 must be at least chunk=72"),
        (dict(max_chunk=150), r"max_chunk=150 must be a multiple of the DiT's block_size \(4\)"),
    ],
)
def test_constants_are_validated(kwargs, match) -> None:
    base = dict(repeats=2, block_size=4, look_backward_blocks=2, look_ahead_blocks=1, hop=HOP)
    with pytest.raises(ValueError, match=match):
        ChunkPlanner(**{**base, **kwargs})


def test_planner_of_the_model(ours: Token2Wav) -> None:
    assert ChunkPlanner.for_model(ours, chunk=C, past=P, future=F, overlap=V) == PLANNER
    assert ChunkPlanner.for_model(ours) == dataclasses.replace(QWEN, block_size=4, hop=HOP)
    assert (QWEN.window_frames, QWEN.keep_frames, QWEN.vocoder_frames) == (144, 96, 136)


@pytest.mark.parametrize(
    "stream,match",
    [
        ({"chunk_frames": 6}, r"unknown engine.stream keys \['chunk_frames'\]"),
        (
            {"max_chunk_codes": 12},
            r"engine.stream: max_chunk=24 must be at least chunk=72 "
            r"\(chunk is chunk_codes x 2, max_chunk is max_chunk_codes x 2\)$",
        ),
        (
            {"max_chunk_codes": 240},
            r"the longest chunk window, 552 mel frames, exceeds the DiT's max_position",
        ),
    ],
)
def test_stage_stream_settings_are_checked(ours: Token2Wav, stream: dict, match: str) -> None:
    """The stage YAML's ``engine.stream`` is refused at build time, naming the stage, for an
    unknown key, a largest chunk under the chunk (with the YAML keys of the planner's constants
    it names), or a window longer than the DiT's positions."""
    config = StageConfig("code2wav", "generation", "talker", engine={"stream": stream})
    with pytest.raises(ValueError, match=f"stage 'code2wav': .*{match}"):
        stream_planner(config, ours)
    grown = StageConfig("code2wav", "generation", "talker", engine={"stream": {"max_chunk_codes": 216}})
    assert stream_planner(grown, ours).window_frames == 504  # 48 + 432 + 24, within 512


def test_noise_rows_are_the_offline_draw() -> None:
    """Windows drawn as they come are the rows of one draw of the whole request."""
    whole = np.random.default_rng(5).standard_normal((300, MEL), dtype=np.float32)
    rows = NoiseRows.of(5, MEL)
    for c in QWEN.split(150):
        np.testing.assert_array_equal(rows.window(c.start, c.end), whole[c.start : c.end])
    assert rows.first == 168  # rows behind the last window were dropped
    with pytest.raises(ValueError, match="noise rows from 0 were dropped"):
        rows.window(0, 4)


# --- against the reference -----------------------------------------------------------------


@pytest.mark.parametrize("n", COUNTS)
def test_alone_matches_reference(ours, expected, n: int) -> None:
    outputs, _ = stream(decoder(ours), {n: params(n)}, trickle([n], 5))
    check_pieces(outputs[n], expected[n], n)


def test_solves_landing_in_later_steps_match_reference(ours, expected, monkeypatch) -> None:
    """Every step leaves its solve in flight (``block=False``), codes arriving meanwhile: the
    pieces of requests batched together are still the reference's."""
    counts = {n: params(n) for n in (77, 14, 9)}
    outputs, _ = stream(sharing(decoder(ours), monkeypatch), counts, trickle(list(counts), 4), block=False)
    for n in counts:
        check_pieces(outputs[n], expected[n], n)


def test_a_solve_left_in_flight_lands_once_the_device_has_it(ours, expected, monkeypatch) -> None:
    """``step(block=False)`` dispatches a solve and returns at once; while the device has not
    finished it the decoder has work and its steps return nothing (codes still arrive); a step
    after the device has it lands it and dispatches the next chunks. A request aborted while its
    chunk is in flight has that row dropped; a solve left with no live request is forgotten.
    The other request's pieces are the reference's. Chunks run at 9, 15, ... codes here."""
    dec = sharing(decoder(ours), monkeypatch)
    gate = Gate()
    dec.solve = held(dec.solve, gate)
    reqs = {n: make_request(n) for n in (77, 15, 9)}
    for n in (77, 15):
        dec.add(str(n), reqs[n]["speaker"], reqs[n]["ref_mel"], params(n))
        dec.extend(str(n), reqs[n]["codes"][:9].tolist())
    assert dec.step(block=False) == [] and dec.in_flight is not None
    assert [(r.request_id, c.index) for r, c in dec.in_flight.rows.values()] == [("77", 0), ("15", 0)]
    dec.extend("77", reqs[77]["codes"][9:15].tolist())
    assert dec.step(block=False) == [] and dec.has_work()
    assert dec.remove("15") and dec.in_flight is not None
    gate.open = True
    landed = dec.step(block=False)
    assert [(o.request_id, o.chunk.index) for o in landed] == [("77", 0)]
    assert [(r.request_id, c.index) for r, c in dec.in_flight.rows.values()] == [("77", 1)]
    dec.extend("77", reqs[77]["codes"][15:].tolist(), finished=True)
    while dec.has_work():
        landed += dec.step(block=False)
    check_pieces(landed, expected[77], 77)
    gate.open = False
    dec.add("9", reqs[9]["speaker"], reqs[9]["ref_mel"], params(9))
    dec.extend("9", reqs[9]["codes"].tolist(), finished=True)
    assert dec.step(block=False) == [] and dec.in_flight is not None
    assert dec.remove("9") and dec.in_flight is None and not dec.has_work()


def test_batched_matches_reference(ours, reference, expected, monkeypatch) -> None:
    """All requests in one decoder, every chunk kind in one solve, and a request with a smaller
    chunk (4 codes) riding along."""
    counts = {n: params(n) for n in COUNTS}
    counts[SMALL] = params(SMALL, chunk_codes=4)
    rounds = [
        {77: 20, 9: 9, SMALL: 12},
        {3: 3, 14: 14, 77: 40, SMALL: 30},
        {8: 8, 15: 15, 77: 77, SMALL: SMALL},
    ]
    outputs, kinds = stream(sharing(decoder(ours), monkeypatch), counts, rounds)
    every = set(ChunkKind)
    assert kinds[:3] == [{ChunkKind.FIRST}, every, every], kinds[:3]
    for n in COUNTS:
        check_pieces(outputs[n], expected[n], n)
    want = hf_stream(reference, make_request(SMALL), **KNOBS[SMALL], chunk=8)
    assert len(want) == 10
    check_pieces(outputs[SMALL], want, SMALL)


def test_a_shorter_first_chunk_matches_reference(ours, reference) -> None:
    """A stage whose first chunk is 8 frames (4 codes) beside its 12: the pieces equal the
    chunked reference cut the same way; a request asking for a chunk under the stage's first
    chunk gets both at its size."""
    first = dataclasses.replace(PLANNER, first=8)
    n = 15
    outputs, _ = stream(decoder(ours, planner=first), {n: params(n)}, trickle([n], 3))
    want = hf_stream(reference, make_request(n), **KNOBS[n], first=8)
    assert len(want) == 3 and len(outputs[n][0].audio) < len(outputs[n][1].audio)
    check_pieces(outputs[n], want, n)
    asked = decoder(ours, planner=dataclasses.replace(PLANNER, first=12)).plan(params(n, chunk_codes=4))
    assert (asked.chunk, asked.first_chunk) == (8, 8)


def test_growing_chunks_match_reference(ours, reference) -> None:
    """A stage whose chunks grow (8, 12, 24, 48, 48 frames): the pieces equal the chunked
    reference cut the same way, batched with a request that asks for its own fixed chunk (4
    codes), each solve padded to the smallest window that holds its chunks."""
    dec = decoder(ours, planner=TINY_GROWING)
    assert dec.buckets.lengths == (6, 12, 18, 30)
    counts = {77: params(77), SMALL: params(SMALL, chunk_codes=4)}
    outputs, _ = stream(dec, counts, trickle(list(counts), 5))
    want = hf_stream(reference, make_request(77), **KNOBS[77], first=8, largest=48)
    assert [len(w) // HOP for w in want] == [4, 12, 24, 48, 48, 18]
    check_pieces(outputs[77], want, 77)
    want = hf_stream(reference, make_request(SMALL), **KNOBS[SMALL], chunk=8)
    assert len(want) == 10
    check_pieces(outputs[SMALL], want, SMALL)


@pytest.mark.parametrize("block", [True, False])
@pytest.mark.parametrize("fault", ["device error", "non-finite"])
def test_a_failed_chunk_ends_only_its_request(ours, expected, fault: str, block: bool) -> None:
    """A device error in a batched chunk solve is retried one request at a time, and a row with
    non-finite audio fails alone: the culprit (request 15) gets one ``error`` output and is
    forgotten; the request beside it goes on to equal the reference. Alike when the solve
    landed in a later step than its dispatch (``block=False``)."""
    dec = decoder(ours)
    solve = dec.solve
    voice = make_request(15)["speaker"]

    def faulty(graph, state, codes, code_lengths, speaker_embedding, *rest, **kw):
        rows = [i for i, v in enumerate(np.asarray(speaker_embedding)) if np.array_equal(v, voice)]
        if fault == "device error" and rows:
            raise jax.errors.JaxRuntimeError("device fault")
        wave, valid, tail = solve(graph, state, codes, code_lengths, speaker_embedding, *rest, **kw)
        return (wave.at[rows[0]].set(jnp.nan) if rows else wave), valid, tail

    dec.solve = faulty
    for n in (15, 9):
        req = make_request(n)
        dec.add(str(n), req["speaker"], req["ref_mel"], params(n))
        dec.extend(str(n), req["codes"].tolist(), finished=True)
    outputs: dict[str, list[ChunkOutput]] = {"15": [], "9": []}
    while dec.has_work():
        for out in dec.step(block):
            outputs[out.request_id].append(out)
    (failed,) = outputs["15"]
    assert failed.last and failed.audio.size == 0 and failed.chunk.index == 0
    assert failed.error.startswith(
        "solve failed: device fault" if fault == "device error" else "non-finite waveform ("
    )
    assert dec.num_streaming == 0
    check_pieces(outputs["9"], expected[9], 9)


def test_chunking_shows_in_the_test_model(reference, expected) -> None:
    """The parity tests can tell chunked from offline: here the two differ by far more than
    their tolerance (one chunk of any size is the offline solve)."""
    for n in (15, 77):
        offline = hf_stream(reference, make_request(n), **KNOBS[n], chunk=4 * n)
        assert len(offline) == 1
        assert rel_err(np.concatenate(expected[n]), offline[0]) > 1e-4


@pytest.mark.parametrize("n", [3, 8])
def test_little_equals_offline(ours, expected, n: int) -> None:
    """One chunk covers the request: the offline solve with the same (seeded) noise (both
    requests padded to one offline shape, 8 codes)."""
    req, knobs = make_request(n), KNOBS[n]
    pad = lambda a, rows: np.concatenate([a, np.zeros((rows - len(a), *a.shape[1:]), a.dtype)])[None]
    graph, state = nnx.split(ours)
    wave, lengths = token2wav_compiled(
        StaticGraph(graph),
        state,
        codes=jnp.asarray(pad(req["codes"].astype(np.int32), 8)),
        code_lengths=jnp.asarray([n], jnp.int32),
        speaker_embedding=jnp.asarray(req["speaker"][None]),
        reference_mel=jnp.asarray(pad(req["ref_mel"], REF_FRAMES)),
        reference_lengths=jnp.asarray([len(req["ref_mel"])], jnp.int32),
        initial_noise=jnp.asarray(pad(req["noise"], 8 * REPEATS)),
        **{k: jnp.asarray([v]) for k, v in knobs.items()},
    )
    offline = np.asarray(wave[0, : int(lengths[0])])
    (streamed,) = stream(decoder(ours), {n: params(n)}, trickle([n], 3))[0][n]
    assert streamed.chunk.kind == ChunkKind.LITTLE
    err = rel_err(streamed.audio, offline)
    assert err < 1e-5, err
    assert rel_err(expected[n][0], offline) < 1e-5  # the reference's little chunk is its offline solve


def test_decoder_refuses_what_it_cannot_stream(ours) -> None:
    dec = decoder(ours)
    voice = (np.zeros(SPK, np.float32), np.zeros((4, MEL), np.float32))
    with pytest.raises(ValueError, match="chunk_codes=7 exceeds the stage's largest chunk of 6 codes"):
        dec.add("a", *voice, Token2WavParams(stream=True, chunk_codes=7))
    grows = decoder(ours, planner=TINY_GROWING)
    with pytest.raises(ValueError, match="chunk_codes=26 exceeds the stage's largest chunk of 24 codes"):
        grows.add("a", *voice, Token2WavParams(stream=True, chunk_codes=26))
    assert grows.plan(Token2WavParams(stream=True, chunk_codes=24)) == TINY_GROWING.with_chunk(48)
    rule = (
        r"must be a multiple of 2 codes \(whole DiT blocks\) and at least 4 codes \(two vocoder overlaps\)$"
    )
    with pytest.raises(ValueError, match="chunk_codes=2 " + rule):
        dec.add("a", *voice, Token2WavParams(stream=True, chunk_codes=2))
    with pytest.raises(ValueError, match="chunk_codes=5 " + rule):
        dec.add("a", *voice, Token2WavParams(stream=True, chunk_codes=5))
    with pytest.raises(ValueError, match="reference mel of 20 frames, more than the 19"):
        dec.add("a", voice[0], np.zeros((20, MEL), np.float32), Token2WavParams(stream=True))
    with pytest.raises(ValueError, match="draws its noise from a seed"):
        dec.add("a", *voice, Token2WavParams(initial_noise=np.zeros((2, MEL), np.float32)))
    dec.add("a", *voice, Token2WavParams(stream=True, seed=1))
    with pytest.raises(ValueError, match="'a' is already streaming"):
        dec.add("a", *voice, Token2WavParams(stream=True))
    with pytest.raises(ValueError, match="'a' finished without a code"):
        dec.extend("a", [], finished=True)
    assert dec.remove("a") and not dec.remove("a")


@pytest.mark.parametrize("then", ["waits", "deadline", "rows cost", "untimed", "all codes in"])
def test_a_later_chunk_waits_for_others_while_its_audio_plays(ours, monkeypatch, then: str) -> None:
    """On an accelerator (rows nearly free, solves of 1 ms), a request's later chunk waits for
    another request's to share its solve while the audio its listener has yet to hear, played from
    its first chunk's landing, covers its last chunk and ``SLACK`` times a solve and a step; then
    it runs alone. It does not wait with one chunk to play, for a request's first chunk, where one
    more solve costs less than a row (a CPU's fit), before any solve was timed, or once its
    request's codes are all in. Chunks run at 9, 15, 21, 27 and 33 codes here."""
    assert [PLANNER.codes_ready(p) for p in range(5)] == [9, 15, 21, 27, 33] and SLACK == 2
    dec = decoder(ours)
    solve_s = 0.001
    clock = on_an_accelerator(dec, monkeypatch, solve_s)
    reqs = {n: make_request(n) for n in (77, 40)}
    sent = dict.fromkeys(reqs, 0)

    def step(**have: int) -> list[tuple[str, int, int]]:
        for key, upto in have.items():
            n = int(key[1:])
            dec.extend(str(n), reqs[n]["codes"][sent[n] : upto].tolist(), finished=upto == n)
            sent[n] = upto
        return [(o.request_id, o.chunk.index, o.batch_size) for o in dec.step()]

    dec.add("77", reqs[77]["speaker"], reqs[77]["ref_mel"], params(77))
    assert step(a77=9) == [("77", 0, 1)]
    assert step(a77=15) == [("77", 1, 1)]  # one chunk to play, and no one else streams
    assert step(a77=21) == [("77", 2, 1)]  # no one else streams
    dec.add("40", reqs[40]["speaker"], reqs[40]["ref_mel"], params(40))
    assert step(a77=27, a40=9) == [("77", 3, 2), ("40", 0, 2)]  # 40's first chunk never waits
    played = dec._requests["77"].played
    assert played.start == 0 and played.left(0) > 3 * played.last > 0
    if then == "waits":
        assert step(a77=33, a40=11) == []  # 40 is four codes short of its chunk 1
        clock.now = (played.left(0) - played.last - 2 * solve_s) / 4  # margin: 2 x (solve + step)
        assert step() == [] and step(a40=14) == []  # however many steps, while its audio plays
        assert step(a40=15) == [("77", 4, 2), ("40", 1, 2)]
        return
    if then == "deadline":
        clock.now = played.left(0) - played.last  # its last chunk is all it has left to play
    elif then == "rows cost":
        monkeypatch.setattr(dec.cost, "overhead", lambda: 1.0)
    elif then == "untimed":
        monkeypatch.setattr(dec.cost, "seconds", lambda cells: None)
    if then == "all codes in":
        assert step(a77=77, a40=14) == [("77", 4, 1)]
    else:
        assert step(a77=33, a40=14) == [("77", 4, 1)]


def test_first_chunks_alone_solve_in_the_first_window(ours, monkeypatch) -> None:
    """A solve pads to the smallest window that holds its chunks: first chunks (no past: 8 codes
    here, against a middle chunk's 12) and short final chunks run in the first chunk's window,
    keeping what it holds; a middle chunk pads to the longest. The audio is the same as when every
    chunk solves in the longest window."""
    shapes = []

    def spy(graph, state, codes, *rest, keep_frames):
        shapes.append((codes.shape[0], codes.shape[1], keep_frames))
        return token2wav_chunk_compiled(graph, state, codes, *rest, keep_frames=keep_frames)

    dec = sharing(decoder(ours), monkeypatch)
    dec.solve = spy
    counts = {15: params(15), 9: params(9)}
    # 15 has its first chunk's window (first + future = 16 frames) and one code more: it runs alone;
    # then 15's middle chunk (window [4, 28) frames) beside 9's first, then both final chunks
    # (windows [16, 30) and [4, 18): 7 codes each).
    outputs, _ = stream(dec, counts, [{15: 9}, {15: 15, 9: 9}])
    first, longest = PLANNER.first_window_frames, PLANNER.window_frames
    assert (first // REPEATS, longest // REPEATS) == (8, 12)
    keep = PLANNER.keep_bound(first)
    assert (keep, PLANNER.keep_bound(longest)) == (first, PLANNER.keep_frames)
    assert shapes == [
        (1, first // REPEATS, keep),
        (2, longest // REPEATS, PLANNER.keep_frames),
        (2, first // REPEATS, keep),
    ]
    wide = sharing(decoder(ours), monkeypatch)
    wide.buckets = dataclasses.replace(wide.buckets, lengths=wide.buckets.lengths[1:])
    everything_wide, _ = stream(wide, counts, [{15: 9}, {15: 15, 9: 9}])
    for n in counts:
        for o, w in zip(outputs[n], everything_wide[n], strict=True):
            assert rel_err(o.audio, w.audio) < 1e-5, (n, o.chunk.index)


def test_chunks_of_different_windows_solve_apart_where_rows_cost(ours, monkeypatch) -> None:
    """Where a solve costs its padded rows x window and little more (a fitted overhead of one
    cell for one more solve), ready chunks of different windows solve apart, a first chunk (its
    request's first audio) before an older request's middle chunk, which runs the next step
    without waiting (a chunk waits for others only where one more solve costs more than a row);
    chunks of one window still share a solve. The audio is what
    the shared solves of an accelerator give."""
    shapes = []

    def spy(graph, state, codes, *rest, keep_frames):
        shapes.append((codes.shape[0], codes.shape[1]))
        return token2wav_chunk_compiled(graph, state, codes, *rest, keep_frames=keep_frames)

    dec = decoder(ours)
    monkeypatch.setattr(dec.cost, "overhead", lambda: 1.0)
    dec.solve = spy
    counts = {15: params(15), 9: params(9)}
    rounds = [{15: 9}, {15: 15, 9: 9}]
    outputs, _ = stream(dec, counts, rounds)
    first, longest = PLANNER.first_window_frames // REPEATS, PLANNER.window_frames // REPEATS
    # 15's first; 9's first (urgent) apart from 15's middle; 15's middle (the older) apart from
    # 9's final (7 codes: the first chunk's window); then both finals in that window together.
    assert shapes == [(1, first), (1, first), (1, longest), (2, first)]
    assert [o.chunk.kind for o in outputs[9]] == [ChunkKind.FIRST, ChunkKind.FINAL]
    shared, _ = stream(sharing(decoder(ours), monkeypatch), counts, rounds)
    for n in counts:
        assert len(outputs[n]) == len(shared[n])
        for o, w in zip(outputs[n], shared[n], strict=True):
            assert rel_err(o.audio, w.audio) < 1e-5, (n, o.chunk.index)


@pytest.mark.parametrize("planner,max_batch", [(PLANNER, 2), (TINY_GROWING, 1)], ids=["fixed", "growing"])
def test_nothing_compiles_after_warmup(ours, planner: ChunkPlanner, max_batch: int) -> None:
    """``warmup`` compiles one program per row count and window (the first chunk's, and a middle
    chunk's of each size: the longest alone when chunks do not grow); mixes of chunk kinds, chunk
    sizes, knobs and batch sizes then compile nothing. Row counts are the fixed chunks' dimension
    here, windows the growing ones' (one row: half the programs)."""
    token2wav_chunk_compiled.clear_cache()
    dec = decoder(ours, max_batch=max_batch, planner=planner)
    with CompileCounter() as counted:
        programs = dec.warmup()
    windows = tuple(w // planner.repeats for w in planner.windows)
    assert dec.buckets.lengths == windows and len(windows) == 2 + len(planner.growing)
    assert dec.buckets.rows == (1, 2)[:max_batch]
    shapes = max_batch * len(windows)
    assert programs == len(dec.buckets.shapes()) == shapes and counted.programs >= shapes
    assert token2wav_chunk_compiled._cache_size() == shapes
    mixes = [
        {3: params(3)},
        {9: params(9), 14: params(14, chunk_codes=4)},
        {n: params(n) for n in COUNTS},
        {77: params(77, chunk_codes=4), 8: params(8), 20: Token2WavParams(stream=True, num_steps=2)},
    ]
    for mix in mixes:
        with CompileCounter() as counted:
            outputs, _ = stream(dec, mix, trickle(list(mix), 5))
        assert (counted.traces, counted.compiles) == (0, 0), sorted(mix)
        for n in mix:
            assert sum(len(o.audio) for o in outputs[n]) == n * REPEATS * HOP
            assert all(np.isfinite(o.audio).all() for o in outputs[n])
    assert token2wav_chunk_compiled._cache_size() == shapes
