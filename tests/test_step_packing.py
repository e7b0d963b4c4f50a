"""The host side of a flat step: ``ARRunner._pack`` lays a step's rows out as token rows
(token, position, cache slot, page table, causal horizon, the row a pending token reads), the
layout the forward's attention and the sampler read. Checked against the layout written out
row by row and token by token, for prompt chunks that start mid-sequence and decode rows,
some with a pending token, across page boundaries."""

from __future__ import annotations

import numpy as np

from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.engine.step import PENDING_TOKEN, StepRow


def step_rows(page_size: int) -> tuple[list[StepRow], list[int]]:
    """Prompt chunks (one from 0, one from mid-sequence across a page edge) and decode rows
    (two pending, one not), each with its own pages; ``sources`` for the pending ones."""
    params = SamplingParams(temperature=0)
    layout = [
        (0, 5, False),
        (page_size - 2, 7, False),
        (3 * page_size, 1, True),
        (17, 1, False),
        (40, 1, True),
    ]
    rows = []
    for k, (start, m, pending) in enumerate(layout):
        ids = [100 + k * 10 + j for j in range(m)]
        if pending:
            ids[-1] = PENDING_TOKEN
        rows.append(
            StepRow(
                token_ids=ids,
                positions=np.arange(start, start + m, dtype=np.int32),
                pages=[50 - 7 * k - j for j in range(7)],  # descending: a page's index is not its id
                start=start,
                sample=True,
                params=params,
                seed=k,
                draw_index=0,
                id_row=7 - k,  # not the row's index in the step
                prompt_len=start + m,
                suppress=[],
                pending_token=pending,
            )
        )
    return rows, [9, -1, -1, -1, 4]


def test_pack_lays_out_every_token_row(qwen2_dir) -> None:
    pipe = OmniJaxPipeline.from_pretrained(qwen2_dir, max_num_seqs=8, max_model_len=256)
    runner = pipe.stages[0].engine.runner
    page_size = runner.geometry.page_size
    rows, sources = step_rows(page_size)
    n = runner.rows_bucket(sum(len(r.token_ids) for r in rows))
    p = runner.pages_bucket(max(-(-r.end // page_size) for r in rows))
    tokens, source, positions, step, last, id_rows, _ = runner._pack(rows, n, p, sources)
    cache = runner.cache_cfg
    s = runner.sequences(n)
    want_tables = np.full((s, p), cache.null_page, np.int32)
    want = {
        "tokens": [],
        "positions": [],
        "slots": [],
        "sequence": [],
        "context": [],
        "source": [],
        "last": [],
    }
    for i, r in enumerate(rows):
        used = -(-r.end // page_size)
        want_tables[i, :used] = r.pages[:used]
        for j, token in enumerate(r.token_ids):
            t = r.start + j
            want["tokens"].append(token)
            want["positions"].append(t)
            want["slots"].append(r.pages[t // page_size] * page_size + t % page_size)
            want["sequence"].append(i)
            want["context"].append(t + 1)
            want["source"].append(sources[i] if r.pending_token and j == len(r.token_ids) - 1 else -1)
        want["last"].append(len(want["tokens"]) - 1)
    total = len(want["tokens"])
    pad = n - total
    np.testing.assert_array_equal(tokens[:, 0], want["tokens"] + [0] * pad)
    np.testing.assert_array_equal(positions[..., 0], want["positions"] + [0] * pad)
    np.testing.assert_array_equal(step.slots[:, 0], want["slots"] + [cache.dropped_slot] * pad)
    np.testing.assert_array_equal(step.tables, want_tables)
    np.testing.assert_array_equal(step.sequence, want["sequence"] + [0] * pad)
    np.testing.assert_array_equal(step.context, want["context"] + [0] * pad)
    np.testing.assert_array_equal(step.query, [1] * total + [0] * pad)
    np.testing.assert_array_equal(source, want["source"] + [-1] * pad)
    np.testing.assert_array_equal(last, want["last"] + [0] * (s - len(rows)))
    np.testing.assert_array_equal(id_rows, [r.id_row for r in rows] + [0] * (s - len(rows)))
    empty = runner._pack([], n, p)
    assert (empty[3].slots == cache.dropped_slot).all() and (empty[3].query == 0).all()


def test_a_text_models_steps_make_no_row_a_token(qwen2_dir, monkeypatch) -> None:
    """Step inputs that read nothing of the flat one-token rows (``TokenInputs``, a text model's)
    get them unmade: a prompt step of a text model builds no ``StepRow`` a token, which was
    most of its host work."""
    made: list[StepRow] = []
    one_token_rows = StepRow.one_token_rows

    def counted(row: StepRow) -> list[StepRow]:
        made.append(row)
        return one_token_rows(row)

    monkeypatch.setattr(StepRow, "one_token_rows", counted)
    pipe = OmniJaxPipeline.from_pretrained(qwen2_dir, max_num_seqs=8, max_model_len=256)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    (out,) = pipe.run([{"prompt_token_ids": list(range(3, 60))}], greedy, progress=False)
    assert len(out.token_ids) == 3 and made == []
