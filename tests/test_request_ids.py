"""A request's ids as its step rows carry them: ``ARRequest.ids`` (a slice across the prompt and
the outputs), checked against ``prompt_ids + output_ids`` written out as outputs are read one at
a time, and on the rows a scheduler builds step after step, each with its request's row of the
runner's id table (``StepRow.id_row``), one row per running request."""

from __future__ import annotations

import numpy as np

from omni_jax import SamplingParams
from omni_jax.engine.kv_cache import CacheGeometry, PageAllocator
from omni_jax.engine.scheduler import ARRequest, Scheduler, SchedulerConfig
from omni_jax.engine.step import PENDING_TOKEN, StepResult


def test_slices_follow_the_outputs():
    """Ids read one at a time: the slices of any range, across the prompt and the outputs."""
    req = ARRequest("r", 0, [7, 8, 9], SamplingParams(), seed=0)
    for tok in range(20, 60):
        req.output_ids.append(tok)
        every = req.prompt_ids + req.output_ids
        assert req.num_known == len(every)
        for start in range(len(every)):
            for end in (start, start + 1, min(start + 5, len(every)), len(every)):
                assert req.ids(start, end) == every[start:end], (start, end)


def test_stop_ids_are_built_once():
    """Stop ids and EOS ids, EOS left out when ignored; one set a request (read every step while
    under ``min_tokens`` and for every drawn token)."""
    params = SamplingParams(stop_token_ids=[5], min_tokens=2)
    req = ARRequest("r", 0, [1, 2], params, seed=0, eos_token_ids=(3,))
    assert req.stop_ids() == {3, 5} and req.stop_ids() is req.stop_ids()
    ignoring = ARRequest(
        "s", 1, [1], SamplingParams(stop_token_ids=[5], ignore_eos=True), seed=0, eos_token_ids=(3,)
    )
    assert ignoring.stop_ids() == {5}


def _scheduler(max_len: int = 64) -> Scheduler:
    geometry = CacheGeometry(
        num_layers=1, num_kv_heads=1, head_dim=4, dtype=np.float32, page_size=4, max_model_len=max_len
    )
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=32, cache=geometry)
    return Scheduler(config, PageAllocator(64))


def test_scheduled_rows_carry_their_requests_ids():
    """Rows of prompt chunks and decode steps, sampling and not: tokens and the suppression of
    stop ids while under ``min_tokens``, against the ids written out; each running request holds
    its own id-table row, which goes to a later request when it ends."""
    scheduler = _scheduler()
    params = SamplingParams(temperature=0, min_tokens=3, max_tokens=8, stop_token_ids=[4])
    reqs = [
        ARRequest(f"r{k}", k, list(range(10 * k + 10, 10 * k + 10 + n)), params, seed=k, eos_token_ids=(2,))
        for k, n in enumerate((3, 20, 40, 5, 9, 2))  # more than max_num_seqs
    ]
    for req in reqs:
        scheduler.add(req)
    owners: dict[int, set[str]] = {}
    tok, in_flight, pending_rows = 100, None, 0
    while scheduler.has_work() or in_flight:
        step = scheduler.schedule()  # while the step before is in flight, as the engine overlaps them
        assert sorted(r.id_row for r in scheduler.running) == sorted({r.id_row for r in scheduler.running})
        for req, row in step:
            every = req.prompt_ids + req.output_ids
            assert row.id_row == req.id_row and 0 <= row.id_row < scheduler.cfg.max_num_seqs
            owners.setdefault(row.id_row, set()).add(req.request_id)
            known = row.token_ids[:-1] if row.pending_token else row.token_ids
            assert list(known) == every[row.start : row.start + len(known)]
            if row.pending_token:
                assert row.token_ids[-1] == PENDING_TOKEN and row.end == len(every) + 1
                pending_rows += 1
            under = len(req.output_ids) + req.pending < params.min_tokens
            assert list(row.suppress) == (sorted({2, 4}) if row.sample and under else [])
        scheduler.commit(step)
        if in_flight:
            scheduler.update(
                in_flight,
                StepResult(
                    np.arange(tok, tok + len(in_flight)),
                    np.ones(len(in_flight), bool),
                    None,
                    None,
                    None,
                    None,
                ),
            )
            tok += len(in_flight)
        in_flight = step or None
    assert all(len(r.output_ids) == 8 for r in reqs) and pending_rows
    assert any(len(held) > 1 for held in owners.values())  # a row went to a later request
    assert all(r.id_row == -1 for r in reqs)
