"""``OmniJaxPipeline.run`` on a Qwen2 checkpoint against transformers ``generate``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_jax import OmniJaxPipeline, SamplingParams

LENGTHS = (3, 61, 17, 1, 40, 9, 100, 25)


def hf_greedy(
    hf, ids: list[int], max_new: int, eos: int | None, repetition_penalty: float = 1.0
) -> list[int]:
    kw = dict(
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=eos,
        pad_token_id=0,
        repetition_penalty=repetition_penalty,
    )
    if eos is None:
        kw["min_new_tokens"] = max_new
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), **kw)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def prompts(hf_qwen2) -> list[list[int]]:
    rs = np.random.RandomState(7)
    return [[int(t) for t in rs.randint(3, hf_qwen2.config.vocab_size, size=n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def pipe(qwen2_dir):
    return OmniJaxPipeline.from_pretrained(qwen2_dir, max_num_seqs=4, page_size=8, max_model_len=256)


def test_ragged_batch_equals_generate_per_prompt(pipe, hf_qwen2, prompts) -> None:
    """More prompts than ``max_num_seqs``: finished requests leave, waiting ones join."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = pipe.run([{"prompt_token_ids": p} for p in prompts], params, progress=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(hf_qwen2, p, 24, None)
        assert o.finish_reason == "length"
        assert o.stage_outputs["llm"].token_ids == o.token_ids


def test_eos_from_generation_config_stops(pipe, hf_qwen2, prompts) -> None:
    eos = hf_qwen2.generation_config.eos_token_id
    outs = pipe.run(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=60),
        progress=False,
    )
    for p, o in zip(prompts, outs, strict=True):
        ref = hf_greedy(hf_qwen2, p, 60, eos)
        assert o.token_ids == ref
        assert o.finish_reason == ("stop" if ref[-1] == eos else "length")


def test_stop_token_ids_end_the_request(pipe, prompts) -> None:
    free = pipe.run(
        {"prompt_token_ids": prompts[1]}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )
    stop_at = free[0].token_ids[5]
    first = free[0].token_ids.index(stop_at)
    out = pipe.run(
        {"prompt_token_ids": prompts[1]},
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at]),
        progress=False,
    )[0]
    assert out.token_ids == free[0].token_ids[: first + 1]
    assert out.finish_reason == "stop"


def test_text_prompt_is_tokenized_and_decoded(pipe) -> None:
    out = pipe.run("hello world the model", SamplingParams(temperature=0, max_tokens=8), progress=False)[0]
    assert out.prompt_token_ids == pipe.tokenizer("hello world the model")["input_ids"]
    assert out.text == pipe.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_tiny_page_budget_preempts_and_still_matches(qwen2_dir, prompts) -> None:
    """Pages for barely more than one max-length sequence: requests are preempted and recomputed."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    free = OmniJaxPipeline.from_pretrained(qwen2_dir, max_num_seqs=8, page_size=4, max_model_len=160)
    tight = OmniJaxPipeline.from_pretrained(
        qwen2_dir, max_num_seqs=8, page_size=4, max_model_len=160, num_pages=45
    )
    batch = [{"prompt_token_ids": p} for p in prompts]
    want = free.run(batch, params, progress=False)
    got = tight.run(batch, params, progress=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.metrics["llm"]["num_preemptions"] for o in got) > 0
    sched = tight.stages[0].engine.scheduler
    assert sched.allocator.num_free == sched.allocator.num_pages


def test_repetition_penalty_equals_generate_through_reused_id_rows_and_preemption(
    qwen2_dir, hf_qwen2, prompts
):
    """The penalties read each request's ids from the runner's id table on the device: with
    more requests than its rows (each row serves several requests in turn) and pages so few that
    requests are preempted and recomputed, penalised greedy replies beside plain ones equal
    transformers' ``generate`` with the same ``repetition_penalty``."""
    tight = OmniJaxPipeline.from_pretrained(
        qwen2_dir, max_num_seqs=3, page_size=4, max_model_len=160, num_pages=45
    )
    penalties = [1.5 if i % 3 else 1.0 for i in range(len(prompts))]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=r)
        for r in penalties
    ]
    got = tight.run([{"prompt_token_ids": p} for p in prompts], params, progress=False)
    for p, r, o in zip(prompts, penalties, got, strict=True):
        assert o.token_ids == hf_greedy(hf_qwen2, p, 30, None, repetition_penalty=r)
    assert sum(o.metrics["llm"]["num_preemptions"] for o in got) > 0


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"prompt_token_ids": []}, "request 1: empty prompt"),
        ({"prompt_token_ids": [1, 10**6]}, "request 1: token id 1000000 outside the vocabulary"),
        ({"prompt_token_ids": [1] * 300}, "request 1: prompt has 300 tokens, max_model_len is 256"),
        ({"nothing": 1}, r"request 1: unknown prompt key\(s\) \['nothing'\]"),
        ({"modalities": ["text"]}, "request 1: prompt dict needs 'prompt' or 'prompt_token_ids'"),
        (
            {"prompt": ["a", "b"]},
            r"request 1: 'prompt' must be a str \(token ids go in 'prompt_token_ids'\), got list",
        ),
        ({"prompt": None}, "request 1: 'prompt' must be a str .*got NoneType"),
        ({"prompt": b"abc"}, "request 1: 'prompt' must be a str .*got bytes"),
    ],
)
def test_bad_prompt_refused_before_work_and_pipeline_still_usable(pipe, prompts, bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        pipe.run([{"prompt_token_ids": prompts[0]}, bad], progress=False)
    assert not pipe.stages[0].engine.has_work()
    out = pipe.run(
        {"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=3), progress=False
    )
    assert len(out[0].token_ids) == 3


@pytest.mark.parametrize(
    "params,match",
    [
        (SamplingParams(temperature=-1), "request 0: stage 'llm': temperature=-1"),
        (SamplingParams(top_p=0.0), "top_p=0.0 must be in"),
        (SamplingParams(top_k=-2), "top_k=-2 must be -1 or 0 \\(off\\) or >= 1"),
        (SamplingParams(max_tokens=0), "max_tokens=0"),
        (SamplingParams(stop_token_ids=[10**7]), "stop_token_ids contains 10000000"),
    ],
)
def test_bad_sampling_values_refused(pipe, prompts, params, match) -> None:
    with pytest.raises(ValueError, match=match):
        pipe.run([{"prompt_token_ids": prompts[0]}], params, progress=False)


def test_the_vocabulary_and_context_are_refused_at_their_edges(pipe) -> None:
    """Ids are in ``[0, vocab_size)`` and a prompt leaves room for one token: the first id past
    the vocabulary (an embedding read out of bounds) and a prompt of exactly ``max_model_len``
    tokens (no room, as vLLM refuses it) are refused; one less of each runs."""
    stage = pipe.stages[0]
    v, n = stage.vocab_size, stage.max_model_len
    for ids, match in (
        ([1, v], rf"request 0: token id {v} outside the vocabulary"),
        ([1] * n, rf"request 0: prompt has {n} tokens, max_model_len is {n}"),
    ):
        with pytest.raises(ValueError, match=match):
            pipe.run([{"prompt_token_ids": ids}], progress=False)
    one = SamplingParams(temperature=0, max_tokens=1)
    outs = pipe.run(
        [{"prompt_token_ids": [1, v - 1]}, {"prompt_token_ids": [1] * (n - 1)}], one, progress=False
    )
    assert [len(o.token_ids) for o in outs] == [1, 1]


def test_per_prompt_params_list(pipe, prompts) -> None:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 5, 1)]
    outs = pipe.run([{"prompt_token_ids": p} for p in prompts[:3]], params, progress=False)
    assert [len(o.token_ids) for o in outs] == [2, 5, 1]
    for wrong in (params[:2], [*params, params[0]]):  # one too few, one too many (not cut to fit)
        with pytest.raises(ValueError, match="one SamplingParams or a list of 3"):
            pipe.run([{"prompt_token_ids": p} for p in prompts[:3]], wrong, progress=False)


def test_ragged_steps_are_flat(qwen2_dir, hf_qwen2, prompts, monkeypatch) -> None:
    """Prompt chunks and decode rows share flat steps: one call a step, as many token rows as
    the step has tokens (to a fine bucket up to the most sequences, a power of two above, the
    newest prompt tokens deferred where that would pad by more than a third), each
    ``(rows, pages)`` a shape warm-up compiles.
    A 64-token budget chunks the longer prompts and mixes decode rows into prompt steps; the
    tokens are generate's."""
    from omni_jax.engine.ar_runner import ARRunner

    budget = 64
    pipe = OmniJaxPipeline.from_pretrained(
        qwen2_dir, max_num_seqs=8, page_size=8, max_model_len=256, max_num_batched_tokens=budget
    )
    calls: list[tuple[list[int], int]] = []
    pack = ARRunner._pack

    def seen(self, rows, n, p, sources=()):  # noqa: ANN001, ANN202
        if rows:
            lengths = [len(r.token_ids) for r in rows]
            calls.append((lengths, n))
            assert (n, p) in self.step_shapes()
            assert n == self.rows_bucket(sum(lengths))
            # Two sizes an octave up to max_rows; above, powers of two, but a step padding past
            # a third of its tokens was cut back to the edge below (the scheduler's row edges).
            assert n < (1.5 if sum(lengths) <= self.max_rows else 4 / 3) * sum(lengths) + 2
        return pack(self, rows, n, p, sources)

    monkeypatch.setattr(ARRunner, "_pack", seen)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = pipe.run([{"prompt_token_ids": p} for p in prompts], params, progress=False)
    assert all(sum(lengths) <= budget for lengths, _ in calls)
    assert max(max(lengths) for lengths, _ in calls) < max(LENGTHS)  # the longest prompt in chunks
    assert any(1 in lengths and max(lengths) > 1 for lengths, _ in calls)  # decode rows ride along
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(hf_qwen2, p, 8, None)
