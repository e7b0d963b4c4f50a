"""code2wav compiles once: ``warmup()`` compiles every solve program of a closed bucket set, and
after it no request mix traces or compiles anything (docs/ARCHITECTURE.md, "Compile once").

The bucket set itself (rows, code ladder, one reference length) is checked without a model,
and so is the grouping's promise: whatever the cost fit, every solve it makes has a shape of the
set. The end-to-end check runs the tiny Qwen2.5-Omni's code2wav stage with a smaller solve limit
(``max_batch`` 4, ``max_codes`` 48: six offline programs, and nine streamed chunk programs,
one per row count and window, the shipped streaming sizes with chunks growing to 72 codes, not
144) so that its warm-up stays short; the full tiny limits give 28 offline programs,
Qwen2.5-Omni-7B's 60 (checked on the bucket set).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from stage_yamls import edited_stages
from stand_ins import stand_in_code2wav_runner

from omni_jax import OmniJaxPipeline, Token2WavParams
from omni_jax.engine.compilation import CompileCounter
from omni_jax.engine.generation_runner import GenerationRunner, SolveBuckets
from omni_jax.engine.solve_cost import MIN_OVERHEAD
from omni_jax.models.qwen2_5_omni.token2wav import token2wav_compiled
from omni_jax.models.qwen2_5_omni.token2wav_chunk import token2wav_chunk_compiled
from omni_jax.stages.code2wav import DEFAULT_MAX_SOLVE_CODES
from omni_jax.stages.code2wav_batch import Code2WavRequest, code_buckets

TINY_LADDER = (32, 48, 64, 96, 128, 192, 256)
NUM_EMBEDS, REPEATS, HOP = 64, 2, 60  # the tiny DiT's codec ids, mel frames per code, samples per frame


def test_tiny_and_7b_bucket_sets(omni_dir) -> None:
    """Rows powers of two to ``max_batch``, codes two an octave from 32 to ``max_codes``, and the
    longest voice's reference length; at the 7B's sizes, rows x codes at most the shipped
    ``max_solve_codes`` (one row at any length): 48 programs where all rows at all lengths made 60."""
    stage = OmniJaxPipeline.from_pretrained(omni_dir, stages=["code2wav"]).stages[0]
    tiny = stage.runner.buckets  # the shipped YAML's limits: max_batch 8, max_codes 256 (the DiT's)
    longest = max(len(s.ref_mel) for s in stage.voices.speakers.values())
    assert (tiny.rows, tiny.lengths) == ((1, 2, 4, 8), TINY_LADDER)
    assert stage.runner.padder.reference_frames == longest
    assert len(tiny.shapes()) == 28
    cap = DEFAULT_MAX_SOLVE_CODES
    big = SolveBuckets.build(max_batch=8, lengths=code_buckets(4096), max_cells=cap)  # Qwen2.5-Omni-7B
    assert big.lengths == (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
    assert len(big.shapes()) == 48 and all(r * n <= cap for r, n in big.shapes())
    assert {n for r, n in big.shapes() if r == 1} == set(big.lengths)
    assert [r for r, n in big.shapes() if n == 4096] == [1] and (8, 512) in big.shapes()
    assert (2, 2048) in big.shapes() and (8, 768) not in big.shapes()


@pytest.mark.parametrize(
    "max_batch,max_codes,data,rows,codes",
    [
        (8, 256, 2, (2, 4, 8), TINY_LADDER),  # rows a multiple of the mesh's data axis
        (8, 256, 3, (3, 6, 9), TINY_LADDER),
        (6, 200, 1, (1, 2, 4, 6), (32, 48, 64, 96, 128, 192, 200)),  # caps are buckets themselves
        (1, 20, 1, (1,), (20,)),
    ],
)
def test_buckets_are_capped_and_closed(max_batch, max_codes, data, rows, codes) -> None:
    b = SolveBuckets.build(max_batch, code_buckets(max_codes), data=data)
    assert (b.rows, b.lengths) == (rows, codes)
    for n in range(1, max_codes + 1):
        c = b.length_for(n)
        assert c in b.lengths and c >= n and all(s < n for s in b.lengths if s < c)
    for n in range(1, max_batch + 1):
        r = b.rows_for(n)
        assert r in b.rows and r >= n and r % data == 0
    with pytest.raises(ValueError, match=f"a length of {max_codes + 1} exceeds the largest solve bucket"):
        b.length_for(max_codes + 1)


def stand_in_runner(max_solve_codes: int | None = None) -> GenerationRunner:
    """A runner whose solve returns zeros: what is tested is which shapes it is asked for."""
    return stand_in_code2wav_runner(samples_per_frame=HOP, max_codes=256, max_solve_codes=max_solve_codes)


def request(name: str, num_codes: int, reference_frames: int = 5) -> Code2WavRequest:
    return Code2WavRequest.new(
        name,
        np.ones(num_codes, np.int32),
        np.zeros(3, np.float32),
        np.zeros((reference_frames, 4), np.float32),
        Token2WavParams(seed=0),
    )


@pytest.mark.parametrize("max_solve_codes", [None, 512])
@pytest.mark.parametrize("overhead", [MIN_OVERHEAD, 37.0, 500.0, 5000.0, 8.0 * 256])
def test_grouping_chooses_only_among_the_buckets(
    overhead, max_solve_codes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever one more solve is thought to cost, each group pads to a shape of the set (with
    rows x codes capped too)."""
    runner = stand_in_runner(max_solve_codes)
    monkeypatch.setattr(runner.cost, "overhead", lambda: overhead)
    shapes = set(runner.buckets.shapes())
    rng = np.random.default_rng(0)
    for trial in range(200):
        lengths = rng.integers(1, 257, rng.integers(1, 9))
        waiting = [request(f"{trial}-{i}", int(n)) for i, n in enumerate(lengths)]
        groups = runner.groups(waiting)
        assert sorted(id(r) for g in groups for r in g) == sorted(id(r) for r in waiting)
        for group in groups:
            assert runner.pad(group).codes.shape in shapes


def test_reference_longer_than_the_bucket_is_refused() -> None:
    runner = stand_in_runner()
    with pytest.raises(ValueError, match="request 'long-voice': reference mel of 6 frames, more than the 5"):
        runner.pad([request("ok", 10), request("long-voice", 10, reference_frames=6)])


SMALL = {"max_batch": 4, "max_codes": 48}
"""The end-to-end stage's solve limits: rows 1, 2, 4 times codes 32, 48."""
SMALL_STREAM = {"max_chunk_codes": 72}
"""Its streamed chunks: 24, 36, then 72 codes (windows of 36, 72 and 108 codes)."""


@pytest.fixture(scope="module")
def warmed(omni_dir, tmp_path_factory: pytest.TempPathFactory) -> tuple[OmniJaxPipeline, int, CompileCounter]:
    """The code2wav stage at :data:`SMALL` limits, warmed up from a cold jit cache:
    ``(pipeline, programs warmup() reported, what compiled meanwhile)``."""
    engine = {**SMALL, "stream": SMALL_STREAM}
    cfg = edited_stages(
        tmp_path_factory.mktemp("code2wav_small") / "omni.yaml", "qwen2_5_omni", code2wav={"engine": engine}
    )
    pipe = OmniJaxPipeline.from_pretrained(omni_dir, stages=["code2wav"], stage_config=cfg)
    # Earlier tests' solves of the same shapes would be hits (the benchmark smoke test streams a
    # tiny checkpoint whose token2wav has the same graph).
    token2wav_compiled.clear_cache()
    token2wav_chunk_compiled.clear_cache()
    with CompileCounter() as counted:
        programs = pipe.stages[0].warmup()
    return pipe, programs, counted


def test_warmup_compiles_every_bucket(warmed) -> None:
    pipe, programs, counted = warmed
    buckets = pipe.stages[0].runner.buckets
    assert (buckets.rows, buckets.lengths) == ((1, 2, 4), (32, 48))
    # one offline solve program per shape, and one streamed chunk program per row count and
    # window (the first chunk's, and one per later chunk size: 36 and 72 codes)
    assert pipe.stages[0].decoder.buckets.lengths == (36, 72, 108)
    assert programs == len(buckets.shapes()) + len(pipe.stages[0].decoder.buckets.shapes()) == 6 + 9
    assert token2wav_compiled._cache_size() == 6
    assert token2wav_chunk_compiled._cache_size() == 9
    assert counted.programs >= programs


def codes(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, NUM_EMBEDS + 1, n).tolist()


def mixes() -> list[tuple[str, list[dict], list[Token2WavParams]]]:
    """Request mixes that between them reach every bucket: lengths spread over 1..max_codes,
    batches of 1 to more than ``max_batch``, guided, unguided and mixed, seeds, given noise,
    both voices."""
    out = []
    lengths = list(range(1, SMALL["max_codes"] + 1))
    for size in (1, 2, 3, 4, 7):
        for start in range(0, len(lengths), size * 5):
            chunk = lengths[start : start + size]
            prompts = [{"prompt_token_ids": codes(n, n)} for n in chunk]
            params = [Token2WavParams(num_steps=2, seed=n) for n in chunk]
            out.append((f"{size} guided from {chunk[0]}", prompts, params))
    rng = np.random.default_rng(1)
    for trial in range(6):
        chunk = rng.integers(1, SMALL["max_codes"] + 1, rng.integers(1, 9)).tolist()
        prompts = [
            {"prompt_token_ids": codes(n, n), "speaker": ("Ethan", "Chelsie")[i % 2]}
            for i, n in enumerate(chunk)
        ]
        params = [
            Token2WavParams(
                num_steps=1 + (i + trial) % 3,
                guidance_scale=(0.0, 0.5, -1.0, 2.0)[(i + trial) % 4],
                sway_coefficient=-1.0 if i % 2 else 0.0,
                seed=trial * 10 + i,
                initial_noise=None if i % 3 else rng.standard_normal((n * REPEATS, 8)).astype(np.float32),
            )
            for i, n in enumerate(chunk)
        ]
        out.append((f"mixed {trial}", prompts, params))
    unguided = [{"prompt_token_ids": codes(n, n)} for n in (5, 40, 48)]
    out.append(("unguided", unguided, [Token2WavParams(num_steps=2, guidance_scale=0.0, seed=3)] * 3))
    streamed = [{"prompt_token_ids": codes(n, n)} for n in (5, 40, 300, 100, 12, 33)]
    chunked = [
        Token2WavParams(
            stream=True,
            num_steps=1 + i % 2,
            guidance_scale=(0.5, 0.0)[i % 2],
            seed=i,
            chunk_codes=(None, 24)[i // 3],  # the stage's growing chunks, or a fixed one
        )
        for i in range(len(streamed))
    ]
    out.append(("streamed and offline", streamed + unguided, chunked + [Token2WavParams(seed=4)] * 3))
    return out


@pytest.mark.parametrize("overhead", ["fitted", "least", "most"])
def test_nothing_compiles_after_warmup(warmed, overhead, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every mix with the solve-cost fit as timed (each mix twice, the second reversed) or
    pinned at either end (every request alone, or as few solves as can be)."""
    pipe, _, _ = warmed
    cost = pipe.stages[0].runner.cost
    repeats = (False, True) if overhead == "fitted" else (False,)
    if overhead != "fitted":
        monkeypatch.setattr(cost, "overhead", lambda: MIN_OVERHEAD if overhead == "least" else cost.cap)
    for (name, prompts, params), again in itertools.product(mixes(), repeats):
        if again:
            prompts, params = prompts[::-1], params[::-1]
        with CompileCounter() as counted:
            outs = pipe.run(prompts, params, progress=False)
        assert (counted.traces, counted.compiles) == (0, 0), (name, again)
        for out in outs:
            assert out.error is None and out.finish_reason == "stop", (name, out.error)
            assert len(out.audio) == len(out.prompt_token_ids) * REPEATS * HOP, name
            assert np.isfinite(out.audio).all(), name
    assert token2wav_compiled._cache_size() == 6
