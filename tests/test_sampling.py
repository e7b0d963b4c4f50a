"""The batched sampler: semantics against transformers' processors, seeds, per-request params."""

from __future__ import annotations

import dataclasses
import pickle

import jax
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from omni_jax import OmniJaxPipeline, ParamError, SamplingParams, Token2WavParams
from omni_jax.engine.sampling import (
    MAX_STOP_CHARS,
    SUPPRESS_WIDTH,
    SamplingTensors,
    draw_tokens,
    first_argmax,
    pack_sampling,
    processed_logits,
    seed_words,
)

V = 50
ROWS = [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, top_k=12, top_p=0.9),
    SamplingParams(temperature=0.5, min_p=0.2),
    SamplingParams(temperature=1.0, repetition_penalty=0.8, top_p=0.3, min_p=0.05, top_k=20),
    SamplingParams(temperature=2.0),
    SamplingParams(temperature=0.9, top_k=2**40),  # beyond int32: packed as "keep all"
]


def hf_processed(logits: np.ndarray, history: list[int], p: SamplingParams) -> np.ndarray:
    x = torch.tensor(logits[None])
    ids = torch.tensor([history])
    if p.repetition_penalty != 1:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    x = TemperatureLogitsWarper(p.temperature)(ids, x)
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(ids, x)
    if p.top_p < 1:
        x = TopPLogitsWarper(p.top_p)(ids, x)
    if p.min_p > 0:
        x = MinPLogitsWarper(p.min_p)(ids, x)
    return x[0].numpy()


def test_first_argmax_is_argmax() -> None:
    """Ties go to the first maximum, an all ``-inf`` row (everything suppressed) to id 0, as
    ``jnp.argmax`` gives them; random rows agree everywhere."""
    rng = np.random.RandomState(5)
    x = rng.randn(64, 1000).astype(np.float32)
    x[1, [7, 300, 999]] = 9.0
    x[2] = -np.inf
    x[3, :] = 0.5
    x[4, 998:] = 20.0
    x = jax.numpy.asarray(x)
    np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(x)), np.asarray(jax.numpy.argmax(x, -1)))
    assert int(jax.jit(first_argmax)(x)[1]) == 7


def with_history(st: SamplingTensors, histories: list[list[int]]) -> SamplingTensors:
    """``st`` with each row's ids for the penalties (``-1`` padded), as the AR runner reads
    them from its id table on the device."""
    width = max(len(h) for h in histories)
    history = np.full((st.temperature.shape[0], width), -1, np.int32)
    for i, h in enumerate(histories):
        history[i, : len(h)] = h
    return dataclasses.replace(st, history=history)


def test_packed_rows_hold_each_rows_own_values() -> None:
    """Every row's seed words (``seed_words``: the full 64-bit range) and suppressed ids land
    in its own row, padding rows stay neutral, the ids the penalties read are left to the
    device (one ``-1`` column), and a row past the suppression width is refused."""
    seeds = [0, 1, 2**32 + 5, 2**63 + 123456789012345, 2**64 - 1]
    rows = pack_sampling(
        [SamplingParams(temperature=0.5 + i) for i in range(5)],
        [0, 1, 0, 1, 0],
        seeds,
        [0, 1, 2, 3, 4],
        [[], [7], [], [1, 2], []],
        batch=8,
    )
    np.testing.assert_array_equal(rows.seeds, np.array([*map(seed_words, seeds), *[(0, 0)] * 3], np.uint32))
    assert rows.history.shape == (8, 1) and (rows.history == -1).all() and (rows.suppress[5:] == -1).all()
    assert (
        rows.suppress[1, 0] == 7
        and list(rows.suppress[3, :2]) == [1, 2]
        and (rows.suppress[[0, 2, 4]] == -1).all()
    )
    np.testing.assert_array_equal(rows.temperature, [0.5, 1.5, 2.5, 3.5, 4.5, 0, 0, 0])
    with pytest.raises(ValueError, match="token ids to suppress in one row"):
        pack_sampling([SamplingParams()], [0], [0], [0], [list(range(SUPPRESS_WIDTH + 1))], batch=1)
    full = pack_sampling([SamplingParams()], [0], [0], [0], [list(range(SUPPRESS_WIDTH))], batch=1)
    assert list(full.suppress[0]) == list(range(SUPPRESS_WIDTH))  # the width itself fits


def test_processed_logits_match_transformers_per_row() -> None:
    rs = np.random.RandomState(0)
    logits = (rs.randn(len(ROWS), V) * 3).astype(np.float32)
    histories = [list(rs.randint(0, V, size=rs.randint(1, 12))) for _ in ROWS]
    n = len(ROWS)
    st = with_history(
        pack_sampling(ROWS, [len(h) for h in histories], [0] * n, [0] * n, [[]] * n, batch=8), histories
    )
    padded = np.concatenate([logits, np.zeros((8 - n, V), np.float32)])
    got = np.asarray(jax.jit(processed_logits)(padded, st))[: len(ROWS)]
    for i, p in enumerate(ROWS):
        want = hf_processed(logits[i], histories[i], p)
        np.testing.assert_array_equal(np.isfinite(got[i]), np.isfinite(want), err_msg=f"row {i} mask")
        keep = np.isfinite(want)
        np.testing.assert_allclose(got[i][keep], want[keep], rtol=1e-6, atol=1e-6, err_msg=f"row {i}")


def test_all_greedy_step_picks_the_processed_argmax() -> None:
    """An all-greedy step skips truncation (no sort): with penalties, suppression and top-k/p,
    min-p set, each row's token is still the argmax of the full processed distribution, the
    one the sampling program picks for a greedy row."""
    rs = np.random.RandomState(6)
    logits = np.round(rs.randn(6, V) * 2, 1).astype(np.float32)  # rounded: ties occur
    rows = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, top_k=3, top_p=0.2, min_p=0.5),
        SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, repetition_penalty=0.7, top_k=1),
        SamplingParams(temperature=0.0),
    ]
    histories = [list(rs.randint(0, V, size=8)) for _ in rows]
    suppress = [[int(np.argmax(logits[i]))] if i % 2 else [] for i in range(len(rows))]
    st = with_history(pack_sampling(rows, [3] * 6, [0] * 6, [0] * 6, suppress, batch=6), histories)
    tokens = jax.jit(draw_tokens, static_argnames="greedy")(logits, st, greedy=True)
    want = np.argmax(np.asarray(jax.jit(processed_logits)(logits, st)), axis=-1)
    np.testing.assert_array_equal(np.asarray(tokens), want)
    assert all(int(tokens[i]) != suppress[i][0] for i in range(1, 6, 2))
    # the sampling program (a step with any sampled row) gives greedy rows the same choice
    drawn = jax.jit(draw_tokens, static_argnames="greedy")(logits, st, greedy=False)
    np.testing.assert_array_equal(np.asarray(drawn), want)


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = np.zeros((1, 8), np.float32)
    p = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    history = [3, 3, 5, 1, 1, 1]  # prompt [3, 3], output [5, 1, 1, 1]
    st = with_history(pack_sampling([p], [2], [0], [0], [[]], batch=1), [history])
    got = np.asarray(processed_logits(logits, st))[0]
    want = np.zeros(8, np.float32)
    want[5] -= 0.5 + 0.25
    want[1] -= 0.5 + 3 * 0.25
    np.testing.assert_allclose(got, want, atol=1e-7)


@pytest.mark.parametrize("field,value", [("presence_penalty", 0.5), ("frequency_penalty", 0.25)])
def test_each_count_penalty_applies_alone(field: str, value: float) -> None:
    """A row whose only penalty is presence or frequency is penalised (the step skips the
    penalties when no row has one, and a request reads its ids only when one is set)."""
    p = SamplingParams(temperature=1.0, **{field: value})
    assert p.penalised and not SamplingParams(temperature=1.0).penalised
    history = [3, 3, 5, 1, 1, 1]  # prompt [3, 3], output [5, 1, 1, 1]
    st = with_history(pack_sampling([p], [2], [0], [0], [[]], batch=1), [history])
    got = np.asarray(processed_logits(np.zeros((1, 8), np.float32), st))[0]
    want = np.zeros(8, np.float32)
    counts = {5: 1, 1: 3}
    for t, c in counts.items():
        want[t] -= value * (1 if field == "presence_penalty" else c)
    np.testing.assert_array_equal(got, want)  # penalties of halves and quarters: exact in float32


def test_each_draw_of_a_request_has_its_own_noise() -> None:
    """A request's noise is keyed by its seed and the draw's index: on a flat distribution its
    first and second draws agree about one time in V, not every time."""
    n = 2000
    p = SamplingParams(temperature=1.0)
    logits = np.zeros((n, V), np.float32)
    draw = jax.jit(draw_tokens, static_argnames="greedy")
    first, second = (
        np.asarray(
            draw(logits, pack_sampling([p] * n, [0] * n, list(range(n)), [i] * n, [[]] * n, n), greedy=False)
        )
        for i in (0, 1)
    )
    assert np.mean(first == second) < 3 / V


def test_draws_follow_the_distribution() -> None:
    """Many seeds, one row each: the empirical frequencies approach softmax(logits / T)."""
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    n = 4000
    p = SamplingParams(temperature=1.0)
    st = pack_sampling([p] * n, [0] * n, list(range(n)), [0] * n, [[]] * n, n)
    toks = jax.jit(draw_tokens, static_argnames="greedy")(np.repeat(logits, n, 0), st, greedy=False)
    freq = np.bincount(np.asarray(toks), minlength=4) / n
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)


@pytest.mark.parametrize(
    "params,name",
    [
        (SamplingParams(temperature=0.5, seed=3), "n"),
        (SamplingParams(temperature=0.5, seed=3), "prompt_logprobs"),
        (SamplingParams(temperature=0.5, seed=3), "max_token"),
        (Token2WavParams(num_steps=4, seed=3), "num_step"),
    ],
    ids=["n", "prompt_logprobs", "misspelt", "token2wav misspelt"],
)
def test_a_field_the_params_lack_cannot_be_set(params, name) -> None:
    """Setting a field the params do not have (vLLM's ``n`` or ``prompt_logprobs``, which are
    not served, or a misspelling) raises instead of being silently ignored; their own fields are
    still set, and they still copy and pickle (the engine copies them per request, and sends them
    to the other processes of a multi-process run)."""
    with pytest.raises(AttributeError, match=name):
        setattr(params, name, 3)
    params.seed = 4
    assert params.seed == 4 and not hasattr(params, name)
    assert pickle.loads(pickle.dumps(params)) == params == dataclasses.replace(params)


@pytest.mark.parametrize(
    "params,message",
    [
        # max_tokens left at its default (a client that never sent one): the message says it
        (SamplingParams(min_tokens=238), "min_tokens=238 must not exceed max_tokens=16"),
        (SamplingParams(min_tokens=9, max_tokens=8), "min_tokens=9 must not exceed max_tokens=8"),
        # refused for not being finite, which the message says (inf is > 0, nan neither way)
        (
            SamplingParams(repetition_penalty=float("inf")),
            "repetition_penalty=inf must be finite (as a float32) and > 0",
        ),
        (
            SamplingParams(repetition_penalty=float("nan")),
            "repetition_penalty=nan must be finite (as a float32) and > 0",
        ),
        (SamplingParams(temperature=float("nan")), "temperature=nan must be finite (as a float32) and >= 0"),
        (SamplingParams(temperature=float("inf")), "temperature=inf must be finite (as a float32) and >= 0"),
        (SamplingParams(temperature=-1.0), "temperature=-1.0 must be finite (as a float32) and >= 0"),
        # finite as a float64, infinite in the float32 rows the sampler reads
        (SamplingParams(temperature=1e39), "temperature=1e+39 must be finite (as a float32) and >= 0"),
        (
            SamplingParams(repetition_penalty=1e39),
            "repetition_penalty=1e+39 must be finite (as a float32) and > 0",
        ),
        (SamplingParams(min_p=1.5), "min_p=1.5 must be in [0, 1]"),
        (SamplingParams(presence_penalty=2.5), "presence_penalty=2.5 must be in [-2, 2]"),
        (SamplingParams(frequency_penalty=-2.5), "frequency_penalty=-2.5 must be in [-2, 2]"),
        (SamplingParams(stop_token_ids=[V]), f"stop_token_ids contains {V}, outside the vocabulary [0, {V})"),
    ],
    ids=[
        "min over default max",
        "min over max",
        "rep inf",
        "rep nan",
        "temp nan",
        "temp inf",
        "temp < 0",
        "temp past float32",
        "rep past float32",
        "min_p > 1",
        "presence > 2",
        "frequency < -2",
        "stop id = vocab",
    ],
)
def test_a_refusal_says_what_the_value_was_held_to(params: SamplingParams, message: str) -> None:
    with pytest.raises(ParamError) as e:
        params.validate(V)
    assert str(e.value) == message and e.value.field == message.split("=")[0].split(" ")[0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(min_tokens=8, max_tokens=8),
        SamplingParams(min_p=1.0, presence_penalty=2.0, frequency_penalty=-2.0),
        SamplingParams(stop_token_ids=[0, V - 1]),
    ],
    ids=["min = max", "ranges' ends", "vocabulary's ends"],
)
def test_the_ends_of_each_range_are_taken(params: SamplingParams) -> None:
    params.validate(V)


def test_stop_strings_are_bounded_by_their_total_length() -> None:
    """Their number alone costs a step nothing (``StopText`` looks them up by length), but many
    distinct lengths do, up to their total length: a request holding more is refused, naming
    ``stop`` (the server's 400)."""
    most = ["x" * 1000] * (MAX_STOP_CHARS // 1000) + ["y" * (MAX_STOP_CHARS % 1000)]
    SamplingParams(stop=most).validate()
    SamplingParams(stop=[str(i) for i in range(10_000)]).validate()  # many, short: served
    for stop in (most + ["z"], "s" * (MAX_STOP_CHARS + 1)):
        with pytest.raises(ParamError, match=rf"^stop strings hold {MAX_STOP_CHARS + 1} characters") as e:
            SamplingParams(stop=stop).validate()
        assert e.value.field == "stop" and str(e.value).endswith(f"together, at most {MAX_STOP_CHARS}")


@pytest.fixture(scope="module")
def pipe(qwen2_dir):
    return OmniJaxPipeline.from_pretrained(qwen2_dir, max_num_seqs=8, page_size=8, max_model_len=128)


def test_seeded_request_is_batch_invariant(pipe) -> None:
    rs = np.random.RandomState(5)
    target = {"prompt_token_ids": [int(t) for t in rs.randint(3, 300, size=11)]}
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = pipe.run([target], params, progress=False)[0].token_ids
    again = pipe.run([target], params, progress=False)[0].token_ids
    others = [{"prompt_token_ids": [int(t) for t in rs.randint(3, 300, size=n)]} for n in (40, 3, 17, 60, 8)]
    other_params = [SamplingParams(temperature=0.8, seed=s, max_tokens=9 + s, top_k=7) for s in range(5)]
    mixed = pipe.run(
        others[:2] + [target] + others[2:], other_params[:2] + [params] + other_params[2:], False
    )
    assert alone == again == mixed[2].token_ids
    different_seed = pipe.run([target], dataclasses.replace(params, seed=99), progress=False)
    assert different_seed[0].token_ids != alone


def test_negative_seeds_are_read_as_vllm_reads_them(pipe) -> None:
    """vLLM takes any int64 seed: ``-1`` as no seed, and any other as torch's ``manual_seed``
    reads it (a negative one as its 64-bit two's complement). So does the engine: ``-2`` samples
    as ``2**64 - 2``, two ``-1`` requests draw apart, and past either end of torch's range a
    seed is refused."""
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    drawn = [
        pipe.run(prompt, SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True), False)[0]
        for s in (-2, 2**64 - 2, 1, -1, -1)
    ]
    assert drawn[0].token_ids == drawn[1].token_ids != drawn[2].token_ids
    assert drawn[3].token_ids != drawn[4].token_ids
    for bad in (-(2**63) - 1, 2**64):
        with pytest.raises(
            ValueError, match=f"seed={bad} must be an integer from -2\\*\\*63 to 2\\*\\*64 - 1"
        ):
            pipe.run(prompt, SamplingParams(seed=bad), progress=False)


def test_a_temperature_below_vllms_floor_draws_at_it(pipe, caplog) -> None:
    """A temperature of 1e-9 drew token 0 at every step (XLA's softmax of logits divided by it
    is NaN); as in vLLM, a temperature above 0 and below 1e-2 draws at 1e-2, with a warning
    naming the request."""
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    tiny, floor = (
        pipe.run(prompt, SamplingParams(temperature=t, seed=3, max_tokens=12, ignore_eos=True), False)[0]
        for t in (1e-9, 1e-2)
    )
    assert tiny.token_ids == floor.token_ids and 0 not in tiny.token_ids
    assert "temperature 1e-09 is below 0.01" in caplog.text


def test_top_k_one_is_greedy(pipe) -> None:
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    greedy = pipe.run(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), progress=False)
    top1 = pipe.run(prompt, SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True), False)
    assert greedy[0].token_ids == top1[0].token_ids


def test_min_tokens_holds_back_stop_tokens(pipe) -> None:
    prompt = {"prompt_token_ids": [11, 12, 13]}
    free = pipe.run(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), progress=False)[0]
    stop = free.token_ids[0]
    early = pipe.run(prompt, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop]), False)[0]
    assert early.token_ids == [stop] and early.finish_reason == "stop"
    held = pipe.run(
        prompt, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop], min_tokens=4), False
    )
    out = held[0].token_ids
    assert len(out) >= 4 and stop not in out[:4]
    assert held[0].finish_reason == "stop" if stop in out else len(out) == 16


def test_logprobs_are_the_models_log_softmax(pipe, hf_qwen2) -> None:
    prompt = [21, 22, 23, 24]
    out = pipe.run(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=3, logprobs=3, ignore_eos=True),
        False,
    )[0]
    assert len(out.logprobs) == 3
    ids = prompt + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_qwen2(torch.tensor([ids])).logits[0], -1).numpy()
    for step, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + step]
        top = np.argsort(-row)[:3]
        assert set(lp) == {tok, *top.tolist()}
        for t, v in lp.items():
            assert abs(v - row[t]) < 1e-5


def test_logprobs_only_for_the_rows_that_ask(pipe, hf_qwen2) -> None:
    """A batch where one request asks for its tokens' log-probabilities alone (``logprobs=0``)
    and the others for none, with prompts far apart in length (their prompt steps run as
    separate calls) and one sampled row: only the asking request gets them, and they are the
    model's."""
    prompts = [[5, 6, 7], list(range(30, 90)), [9, 8]]
    params = [
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3, logprobs=0, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=3, ignore_eos=True),
    ]
    outs = pipe.run([{"prompt_token_ids": p} for p in prompts], params, False)
    assert outs[0].logprobs is None and outs[2].logprobs is None
    asked = outs[1]
    ids = prompts[1] + asked.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf_qwen2(torch.tensor([ids])).logits[0], -1).numpy()
    assert len(asked.logprobs) == 3
    for step, (tok, lp) in enumerate(zip(asked.token_ids, asked.logprobs, strict=True)):
        assert list(lp) == [tok]
        assert abs(lp[tok] - ref[len(prompts[1]) - 1 + step][tok]) < 1e-5
