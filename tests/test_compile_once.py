"""Compile once, run forever: after warm-up, ragged serving traces and compiles nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_reliability_limits import plan_of
from test_run_greedy import hf_greedy

from omni_jax import OmniJaxPipeline, ParamError, SamplingParams
from omni_jax.engine.compilation import (
    MAX_COMPILE_THREADS,
    CompileCounter,
    ProgramCall,
    compile_ahead,
    compile_threads,
)
from omni_jax.engine.sampling import MAX_LOGPROBS, SUPPRESS_WIDTH


def mixed_params(rs: np.random.RandomState, n: int) -> list[SamplingParams]:
    """Every sampler form in the same steps: greedy and sampled rows, penalties, log-probs of
    several widths, ``min_tokens`` holding back stop ids, and none of these."""
    out = []
    for i, m in enumerate(rs.randint(1, 30, n)):
        out.append(
            SamplingParams(
                temperature=float(i % 3 == 0),
                seed=i,
                top_k=5,
                max_tokens=int(m),
                ignore_eos=i % 4 != 1,
                repetition_penalty=1.1 if i % 5 == 2 else 1.0,
                presence_penalty=0.5 if i % 7 == 3 else 0.0,
                logprobs=(None, 0, 3, MAX_LOGPROBS)[i % 4],
                min_tokens=int(m) // 2 if i % 6 == 0 else 0,
                stop_token_ids=[7, 9, 11] if i % 6 == 0 else None,
            )
        )
    return out


def ar_programs(stage) -> int:  # noqa: ANN001 - an AR stage
    """What ``ARRunner.warmup`` compiles for ``stage``: a forward per step shape, four sampler
    programs per sequence bucket and the draw hook's forms there, the scrub."""
    runner = stage.engine.runner
    hooked = 0 if runner.draw_hook is None else len(runner.draw_hook.warmup_inputs(2))
    return len(runner.step_shapes()) + (4 + hooked) * len(runner.sequence_buckets()) + 1


def test_long_ragged_workload_after_warmup_never_compiles(qwen2_dir) -> None:
    pipe = OmniJaxPipeline.from_pretrained(
        qwen2_dir, max_num_seqs=4, page_size=8, max_model_len=128, max_num_batched_tokens=64
    )
    with CompileCounter() as warm:
        report = pipe.warmup(progress=False)
    assert report.programs == ar_programs(pipe.stages[0])
    assert report.compiles == warm.compiles  # fewer than programs when an earlier test compiled some
    rs = np.random.RandomState(11)
    for _ in range(2):  # a second mix: the first may have left nothing that the second reuses
        prompts = [
            {"prompt_token_ids": [int(t) for t in rs.randint(3, 300, size=n)]} for n in rs.randint(1, 90, 40)
        ]
        params = mixed_params(rs, 40)
        with CompileCounter() as steady:
            outs = pipe.run(prompts, params, progress=False)
        assert all(o.error is None for o in outs)
        assert all(
            len(o.token_ids) == p.max_tokens
            for o, p in zip(outs, params, strict=True)
            if p.ignore_eos and not p.stop_token_ids
        )
        assert (steady.traces, steady.compiles) == (0, 0)


def test_default_engine_sizes_make_few_programs(qwen2_dir) -> None:
    """A stage at vLLM's serving sizes (64 sequences, a 2048-token budget) holds 16 forward
    programs (two sizes an octave up to 64 token rows, powers of two up to 2048; one table
    width, as the kernels take any) and 6 sequence buckets of 4 sampler programs, plus the
    scrub: 41 programs, where the product of row buckets, table widths, greedy/sampled and
    hidden/no-hidden made 320. Counted from the bucket sets, nothing compiled."""
    pipe = OmniJaxPipeline.from_pretrained(
        qwen2_dir, max_num_seqs=64, page_size=16, max_model_len=512, max_num_batched_tokens=2048, num_pages=64
    )
    runner = pipe.stages[0].engine.runner
    forward = [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024, 2048]
    assert runner.step_shapes() == [(n, 32) for n in forward]
    assert runner.sequence_buckets() == [2, 4, 8, 16, 32, 64]
    # The scheduler cuts prompt steps back to these rather than pad to the next: it relies on
    # a step running as the smallest size that holds it.
    assert pipe.stages[0].engine.scheduler.cfg.row_edges == (64, 128, 256, 512, 1024, 2048)
    assert all(runner.rows_bucket(n) == min(s for s in forward if s >= n) for n in range(1, 2049))


def test_one_sequence_still_steps_two_rows() -> None:
    """``max_num_seqs=1`` steps carry :data:`MIN_ROWS` rows (one row made XLA copy each layer's
    whole cache per step on CPU), and the rows stay a multiple of the ``data`` axis."""
    from omni_jax.engine.buckets import MIN_ROWS, max_sequence_rows

    assert MIN_ROWS == 2
    assert [max_sequence_rows(n) for n in (1, 2, 3, 5)] == [2, 2, 4, 8]
    assert [max_sequence_rows(1, data) for data in (2, 3, 4)] == [2, 3, 4]


def test_step_ladder_stops_at_what_the_sequences_hold(qwen2_dir, hf_qwen2, monkeypatch) -> None:
    """Three sequences of 256 tokens hold 768, under the 2048-token budget: the forward sizes
    stop at 768 (no 1024 or 2048 program, which no step could fill), the memory plan's largest
    step is 768 rows, and a step of the three whole prompts runs on that program, nothing
    compiled after ``warmup()``; its greedy tokens are transformers'."""
    kw = dict(max_num_seqs=3, page_size=16, max_model_len=256, max_num_batched_tokens=2048)
    pipe = OmniJaxPipeline.from_pretrained(qwen2_dir, **kw)
    runner = pipe.stages[0].engine.runner
    assert [n for n, _ in runner.step_shapes()] == [2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 768]
    assert runner.rows_bucket(600) == 768
    assert plan_of(pipe, kw).max_token_rows == 768
    pipe.warmup()
    rs = np.random.RandomState(5)
    prompts = [{"prompt_token_ids": [int(t) for t in rs.randint(3, 300, size=250)]} for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    steps: list[int] = []  # each step's tokens
    dispatch = runner.dispatch

    def counted(rows, sources=()):  # noqa: ANN001, ANN202 - ARRunner.dispatch's
        steps.append(sum(len(r.token_ids) for r in rows))
        return dispatch(rows, sources)

    monkeypatch.setattr(runner, "dispatch", counted)
    with CompileCounter() as c:
        together = pipe.run(prompts, params, progress=False)
    assert (c.traces, c.compiles) == (0, 0)
    assert steps[0] == 750  # the three prompts in one step, padded to 768 rows
    for prompt, out in zip(prompts, together, strict=True):
        assert out.token_ids == hf_greedy(hf_qwen2, prompt["prompt_token_ids"], 3, None)


def test_too_many_held_back_stop_ids_are_refused(qwen2_dir) -> None:
    """``min_tokens`` suppresses the stop ids in a fixed-width row (one program for all): a
    request holding back more is refused before any work, naming it."""
    pipe = OmniJaxPipeline.from_pretrained(qwen2_dir, max_num_seqs=2, page_size=8, max_model_len=64)
    many = list(range(3, 3 + SUPPRESS_WIDTH + 1))
    with pytest.raises(ParamError, match=r"request 0: .*min_tokens=2 holds back \d+ stop ids") as e:
        pipe.run({"prompt_token_ids": [1, 2]}, SamplingParams(min_tokens=2, stop_token_ids=many), False)
    assert e.value.field == "min_tokens"  # a server's 400 names it
    (out,) = pipe.run({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2, stop_token_ids=many), False)
    assert out.error is None
    with pytest.raises(ValueError, match=rf"logprobs=21 must be in \[0, {MAX_LOGPROBS}\]"):
        pipe.run({"prompt_token_ids": [1, 2]}, SamplingParams(logprobs=MAX_LOGPROBS + 1), False)


def test_counter_sees_a_new_shape(qwen2_dir) -> None:
    """The counter is not blind: a pipeline whose cache shape no other test uses (programs are
    shared process-wide by shape) traces and compiles on its first request."""
    pipe = OmniJaxPipeline.from_pretrained(qwen2_dir, max_num_seqs=2, page_size=8, max_model_len=72)
    with CompileCounter() as c:
        pipe.run(
            {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=2, logprobs=2), False
        )
    assert c.traces > 0 and c.programs > 0  # compiled, or loaded from the persistent cache


def test_programs_compiled_ahead_are_the_ones_calls_run() -> None:
    """``compile_ahead`` compiles each call's program on its threads, and the calls made after it
    trace and compile nothing (jit's caches are shared), whatever the static arguments."""
    import functools

    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, static_argnames="power")
    def f(x: jax.Array, scale: jax.Array, power: int) -> jax.Array:
        return jnp.tanh(x @ x.T) ** power * scale

    calls = [
        ProgramCall(f, (jnp.ones((rows, 24)), jnp.float32(2.0)), {"power": power})
        for rows in (3, 5, 7)
        for power in (1, 2)
    ]
    with CompileCounter() as ahead:
        compile_ahead(calls)
    with CompileCounter() as after:
        outs = [call() for call in calls]
    assert ahead.programs == len(calls)  # six distinct programs, none built before in this process
    assert after.traces == after.compiles == 0
    # tanh(24) rounds to 1 in float32: (3 rows x 24 ones) @ its transpose, squared, times 2 is exactly 2
    np.testing.assert_array_equal(np.asarray(outs[1]), np.full((3, 3), 2.0, np.float32))
    assert compile_threads(1) == 1 and 1 <= compile_threads(100) <= MAX_COMPILE_THREADS


class _Call:
    """A program call whose compilation is recorded (``fail``: it raises instead)."""

    def __init__(self, log: list[int], index: int, fail: bool = False) -> None:
        self.log, self.index, self.fail = log, index, fail

    def compile(self) -> None:
        self.log.append(self.index)
        if self.fail:
            raise KeyboardInterrupt  # what Ctrl-C raises in the waiting thread, here raised by a compilation


def test_a_failed_compilation_cancels_the_queued_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread, the first program fails: the three queued behind it never start, and the
    failure reaches the caller (an interrupted warm-up ends instead of compiling on)."""
    import omni_jax.engine.compilation as compilation

    monkeypatch.setattr(compilation, "compile_threads", lambda programs: 1)
    log: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        compile_ahead([_Call(log, 0, fail=True), *(_Call(log, i) for i in (1, 2, 3))])  # type: ignore[list-item]
    assert log == [0]


def stage_programs(pipe: OmniJaxPipeline) -> dict[str, int]:
    """Each stage's warm-up programs, counted from its bucket sets (nothing compiled): the
    thinker's AR programs with its encoders' (the processor's bounds), the talker's,
    code2wav's offline solves and streamed chunks."""
    thinker, talker, code2wav = pipe.stages
    encoders = thinker.frontend.step_inputs.buckets
    return {
        "thinker": ar_programs(thinker) + len(encoders.audio_chunks) + len(encoders.vision_tokens),
        "talker": ar_programs(talker),
        "code2wav": len(code2wav.runner.buckets.shapes()) + len(code2wav.decoder.buckets.shapes()),
    }


def test_qwen2_5_omni_stages_hold_at_most_64_programs_at_the_default_sizes(omni_dir) -> None:
    """Every stage of the whole Qwen2.5-Omni graph at the engine defaults (64 sequences,
    2048-token steps) warms up at most 64 programs (the tiny thinker's 512 positions bound the
    vision calls at 2048 patches: 7 sizes, where the processor's largest image would take 17;
    code2wav's streamed chunks: 4 row counts x 4 windows, the first chunk's and one per chunk
    size, 36, 72 and 144 codes)."""
    pipe = OmniJaxPipeline.from_pretrained(omni_dir, max_num_seqs=64, max_num_batched_tokens=2048)
    counts = stage_programs(pipe)
    assert counts == {"thinker": 41 + 5 + 7, "talker": 41, "code2wav": 28 + 4 * 4}
    assert max(counts.values()) <= 64


def test_qwen3_omni_stages_hold_at_most_64_programs_at_the_default_sizes(qwen3_omni_dir) -> None:
    """The same bound for Qwen3-Omni: its talker adds the code predictor's two forms (greedy,
    sampled) per sequence bucket, its thinker's vision calls up to a frame of its 1024
    positions (4096 patches: 9 sizes), its code2wav offline decodes of 16 to 300 frames (two
    sizes an octave) at 1 to 8 rows and streamed windows of the first frame and of 25 frames of
    context before each chunk size, 25, 50 and 100 frames."""
    pipe = OmniJaxPipeline.from_pretrained(qwen3_omni_dir, max_num_seqs=64, max_num_batched_tokens=2048)
    counts = stage_programs(pipe)
    assert counts == {"thinker": 41 + 6 + 9, "talker": 41 + 2 * 6, "code2wav": 40 + 4 * 4}
    assert max(counts.values()) <= 64


def released_positions(tiny: Path, dst: Path, family: str) -> Path:
    """A copy of the tiny checkpoint ``tiny`` with every ``max_position_embeddings`` of the
    released model's config (transformers' defaults are the released sizes): what bounds the
    engine's default buckets (contexts, encoder calls, code lengths) is then the release's,
    while the weights, which no position count shapes, stay tiny."""
    from transformers import Qwen2_5OmniConfig, Qwen3OmniMoeConfig

    shutil.copytree(tiny, dst)
    config = json.loads((dst / "config.json").read_text())
    released = (Qwen2_5OmniConfig if family == "qwen2_5_omni" else Qwen3OmniMoeConfig)().to_dict()

    def copy_positions(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
        for key, value in ours.items():
            if isinstance(value, dict) and isinstance(theirs.get(key), dict):
                copy_positions(value, theirs[key])
            elif key == "max_position_embeddings":
                ours[key] = theirs[key]

    copy_positions(config, released)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "family,counts",
    [
        ("qwen2_5_omni", {"thinker": 41 + 5 + 13, "talker": 41, "code2wav": 48 + 4 * 4}),
        ("qwen3_omni", {"thinker": 41 + 6 + 13, "talker": 41 + 2 * 6, "code2wav": 40 + 4 * 4}),
    ],
)
def test_stages_hold_at_most_64_programs_at_the_released_positions(family, counts, request, tmp_path) -> None:
    """The 64-program bound at the defaults where the release's positions, not the tiny
    checkpoint's 512, bound the buckets: Qwen2.5-Omni's code2wav then decodes up to 4096 codes
    offline (15 lengths; rows x codes within 4096: 48 solves) besides its 16 chunk programs, and
    both thinkers' vision calls reach the default 4096-token context (16384 patches: 13 sizes)."""
    tiny = request.getfixturevalue({"qwen2_5_omni": "omni_dir", "qwen3_omni": "qwen3_omni_dir"}[family])
    pipe = OmniJaxPipeline.from_pretrained(released_positions(tiny, tmp_path / "released", family))
    assert stage_programs(pipe) == counts
    assert max(counts.values()) <= 64


def test_the_cache_switch_yields_to_a_path_given(tmp_path, monkeypatch) -> None:
    """``OMNI_JAX_COMPILATION_CACHE=0`` (the suite's setting) turns the default cache off, but a
    path given to ``from_pretrained(compilation_cache=...)`` is used; ``False`` is always off."""
    import jax

    from omni_jax.engine.compilation import enable_persistent_cache

    updates: dict[str, object] = {}
    monkeypatch.setattr(jax.config, "update", lambda name, value: updates.__setitem__(name, value))
    monkeypatch.setenv("OMNI_JAX_COMPILATION_CACHE", "0")
    assert enable_persistent_cache() is None and enable_persistent_cache(False) is None and not updates
    assert enable_persistent_cache(tmp_path / "xla") == tmp_path / "xla"
    assert updates["jax_compilation_cache_dir"] == str(tmp_path / "xla") and (tmp_path / "xla").is_dir()
    monkeypatch.setenv("OMNI_JAX_COMPILATION_CACHE", str(tmp_path / "env"))
    assert enable_persistent_cache() == enable_persistent_cache(True) == tmp_path / "env"


def test_a_program_from_the_persistent_cache_counts_as_a_load(tmp_path) -> None:
    """A program JAX's persistent cache holds is traced, then loaded instead of compiled: the
    counter tells the two apart (counts and seconds), and :attr:`CompileCounter.programs` counts
    both. Run in a fresh interpreter with a cache of its own (the suite runs with it off)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import jax, jax.numpy as jnp
        from omni_jax.engine.compilation import CompileCounter, enable_persistent_cache
        enable_persistent_cache({str(tmp_path)!r})
        f = jax.jit(lambda x: jnp.tanh(x) * 3.0)
        x = jnp.ones(5)
        counts, seconds = [], []
        for _ in range(2):
            with CompileCounter() as c:
                f(x).block_until_ready()
            counts.append((c.traces, c.compiles, c.loads, c.programs))
            seconds.append((c.trace_s > 0, c.compile_s > 0, c.load_s > 0))
            f.clear_cache()  # the in-memory cache: the second call must go to the persistent one
        print(counts, seconds)
        """
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "OMNI_JAX_COMPILATION_CACHE"}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = "[(1, 1, 0, 1), (1, 0, 1, 1)] [(True, True, False), (True, False, True)]"
    assert proc.stdout.strip().splitlines()[-1] == want, proc.stdout


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_code2wav_solves_stop_at_what_the_talker_hands_on(family, request) -> None:
    """A talker of ``max_model_len`` 64 hands code2wav at most 64 codes (Qwen3-Omni: frames) a
    request, so code2wav's offline solves stop there: its longest solve is 64 and it warms the
    smaller ladder; built alone (prompts of codes) it keeps the model's limit, as before (Qwen3-Omni:
    pieces of 300 frames, whose windows hold 25 more of context for longer requests)."""
    path = request.getfixturevalue({"qwen2_5_omni": "omni_dir", "qwen3_omni": "qwen3_omni_dir"}[family])

    def offline(pipe: OmniJaxPipeline) -> tuple[int, int]:
        code2wav = pipe.stages[-1]
        limit = code2wav.geometry.max_codes if family == "qwen2_5_omni" else code2wav.max_frames
        return limit, max(n for _, n in code2wav.runner.buckets.shapes())

    fed = OmniJaxPipeline.from_pretrained(path, max_model_len=64)
    alone = OmniJaxPipeline.from_pretrained(path, stages=["code2wav"], max_model_len=64)
    assert [s.config.name for s in fed.stages] == ["thinker", "talker", "code2wav"]
    assert offline(fed) == (64, 64)
    assert offline(alone) == {"qwen2_5_omni": (256, 256), "qwen3_omni": (300, 325)}[family]
    assert len(fed.stages[-1].runner.buckets.shapes()) < len(alone.stages[-1].runner.buckets.shapes())
