"""Faults at run time stay inside the request that hit them.

A request whose logits turn non-finite (checked on device, one reduction per step) ends with
``finish_reason="error"``; every other request of the same run, and of later runs that reuse
its KV pages, gets exactly its unconstrained greedy result. The same holds for a code2wav
request whose waveform comes back non-finite.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_run_greedy import hf_greedy

from omni_jax import OmniJaxPipeline, SamplingParams, Token2WavParams
from omni_jax.models.qwen2 import Qwen2ForCausalLM

POISON = 5  # a token id whose embedding the fault injection turns into NaN


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Qwen2 step embeds ``POISON`` as NaN (patched before the first trace)."""
    embed = Qwen2ForCausalLM.embed

    def nan_embed(self, tokens, extra=None):  # noqa: ANN001 - the patched method's signature
        out = embed(self, tokens, extra)
        return jnp.where((tokens == POISON)[..., None], jnp.nan, out)

    monkeypatch.setattr(Qwen2ForCausalLM, "embed", nan_embed)


def clean_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rs = np.random.RandomState(seed)
    return [[int(t) for t in rs.randint(POISON + 1, vocab, size=n)] for n in lengths]


def cache_has_nan(pipe: OmniJaxPipeline) -> bool:
    return any(
        bool(np.isnan(np.asarray(a)).any()) for layer in pipe.stages[0].engine.runner.kv_cache for a in layer
    )


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "one_at_a_time"])
def test_non_finite_logits_end_only_that_request(qwen2_dir, hf_qwen2, poisoned, overlap: bool) -> None:
    """A NaN request ends with ``"error"`` alone, its pages zeroed before reuse, with steps overlapped
    or read one at a time (``AREngine.overlap``). Overlapped, the failed request still has a row in
    flight and its pages are scrubbed when that row is dropped; one at a time, only the failing row's
    own read scrubs them, so both paths need a run: unscrubbed NaN pages poison whoever gets them."""
    # Few pages: the failed request's pages are handed to later requests in the same run.
    pipe = OmniJaxPipeline.from_pretrained(
        qwen2_dir, max_num_seqs=4, page_size=4, max_model_len=64, num_pages=24
    )
    pipe.stages[0].engine.overlap = overlap
    vocab = hf_qwen2.config.vocab_size
    good = clean_prompts(vocab, [7, 13, 5, 21, 9, 30], seed=1)
    bad = good[1][:6] + [POISON] + good[1][6:]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def check(outs: list) -> None:  # noqa: ANN001 - OmniRequestOutput list
        for p, out in zip(good, outs, strict=True):
            assert out.error is None and out.finish_reason == "length"
            assert out.token_ids == hf_greedy(hf_qwen2, p, 12, None)

    outs = pipe.run([{"prompt_token_ids": p} for p in [good[0], bad, *good[1:]]], params, progress=False)
    failed = outs[1]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert failed.error == "stage 'llm': non-finite logits at output token 0"
    check([outs[0], *outs[2:]])
    # Alone, nothing overwrites the failed request's pages: they must have been zeroed, so no
    # later owner's unwritten page tail (weighed 0 by attention; 0 * NaN is NaN) reads NaN.
    (alone,) = pipe.run({"prompt_token_ids": bad}, params, progress=False)
    assert alone.finish_reason == "error" and not cache_has_nan(pipe)
    check(pipe.run([{"prompt_token_ids": p} for p in good], params, progress=False))


def test_non_finite_waveform_ends_only_that_request(omni_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = OmniJaxPipeline.from_pretrained(omni_dir, stages=["code2wav"])
    runner = pipe.stages[0].runner
    monkeypatch.setattr(runner.cost, "overhead", lambda: runner.cost.cap)  # the three share a solve
    solve = runner.solve

    def second_row_broken(*args, **kwargs):  # noqa: ANN002, ANN003 - passed through
        wave, valid = solve(*args, **kwargs)
        wave = np.array(wave)
        wave[1, 3] = np.nan
        return wave, valid

    codes = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18]]
    params = Token2WavParams(num_steps=3, seed=0)
    want = pipe.run([{"prompt_token_ids": c} for c in codes], params, progress=False)
    runner.solve = second_row_broken
    got = pipe.run([{"prompt_token_ids": c} for c in codes], params, progress=False)
    assert got[1].finish_reason == "error" and got[1].audio is None
    assert got[1].error == "stage 'code2wav': non-finite waveform (1 of 720 samples)"
    for i in (0, 2):
        assert got[i].error is None
        np.testing.assert_array_equal(got[i].audio, want[i].audio)
