"""The host side of a flat step: ``ARRunner._pack`` lays a step's rows out as token rows
(token, position, cache slot, page table, causal horizon, the row a pending token reads), the
layout the forward's attention and the sampler read. Checked against the layout written out
row by row and token by token, for prompt chunks that start mid-sequence and decode rows,
some with a pending token, across page boundaries; and the talkers' step inputs, filled a
slice per row, against what each token reads."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from transformers import AutoConfig

from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.engine.step import PENDING_TOKEN, StepRow, TokenInputs
from omni_jax.models.qwen3_omni.talker import PROJECT_NONE, PROJECT_TEXT
from omni_jax.models.qwen3_omni.talker import TalkerSpec as Qwen3TalkerSpec
from omni_jax.stages.qwen3_talker import TalkerRequest as Qwen3TalkerRequest
from omni_jax.stages.qwen3_talker import TalkerStepInputs as Qwen3TalkerStepInputs
from omni_jax.stages.rows import GrowingRows
from omni_jax.stages.talker import TalkerRequest, TalkerStepInputs


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


def test_step_inputs_get_a_prompt_chunk_as_one_row(qwen2_dir, monkeypatch) -> None:
    """``StepInputs.pack`` gets the scheduler's rows as they are (a prompt chunk one row, which
    a stage's pack fills a slice at a time), not a row made a token, which was most of a prompt
    step's host work."""
    seen: list[list[int]] = []
    pack = TokenInputs.pack

    def recorded(self: TokenInputs, rows: Sequence[StepRow], firsts: Sequence[int], tokens: int) -> None:
        if rows:
            seen.append([len(r.token_ids) for r in rows])
        return pack(self, rows, firsts, tokens)

    monkeypatch.setattr(TokenInputs, "pack", recorded)
    pipe = OmniJaxPipeline.from_pretrained(qwen2_dir, max_num_seqs=8, max_model_len=256)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    (out,) = pipe.run([{"prompt_token_ids": list(range(3, 60))}], greedy, progress=False)
    assert len(out.token_ids) == 3 and seen == [[57], [1], [1]]


def talker_row(state: object, start: int, end: int) -> StepRow:
    """A talker step row of tokens ``[start, end)`` (what its ``pack`` reads: the span and the
    request's record)."""
    return StepRow(
        token_ids=[7] * (end - start),
        positions=np.zeros((3, end - start), np.int32),
        pages=[],
        start=start,
        sample=True,
        params=SamplingParams(temperature=0),
        seed=0,
        draw_index=0,
        id_row=0,
        prompt_len=0,
        suppress=[],
        state=state,
    )


# Spans of one request's rows in a step: a prompt chunk, a row crossing the prompt's end and the
# table's (a recompute after a preemption takes prompt and reply in one row), a decode row.
SPANS = [(0, 5), (5, 13), (13, 14)]
FIRSTS = [0, 5, 13]  # each row's first token row: the spans laid out in order


def test_qwen2_5_omni_talker_packs_each_token_its_row() -> None:
    """The talker's pack, a few slices a step row, gives each token row its token's table row
    (past the table: the last one, the text pad) and adds the codec from ``codec_from`` on,
    token by token as the model reads them, for rows crossing both borders."""
    width, held, codec_from = 4, 10, 3
    rng = np.random.default_rng(0)
    table = rng.standard_normal((held, width)).astype(np.float32)
    state = TalkerRequest(GrowingRows(table), codec_from, np.zeros((3, 8), np.int32), 0, final=True)
    rows = [talker_row(state, a, b) for a, b in SPANS]
    embeds = TalkerStepInputs(width, np.dtype(np.float32)).pack(rows, FIRSTS, 16)
    p = np.arange(14)
    np.testing.assert_array_equal(embeds.rows[:14, 0], table[np.minimum(p, held - 1)])
    np.testing.assert_array_equal(embeds.add_codec[:14, 0], p >= codec_from)
    assert not embeds.rows[14:].any() and not embeds.add_codec[14:].any()


def test_qwen3_omni_talker_packs_each_token_its_row(qwen3_omni_dir) -> None:
    """Qwen3-Omni's talker pack: a prompt token reads its prompt rows (thinker row, projection,
    codec flag); a reply token ``j`` its frame's sum while the host has it (else nothing: the
    device feeds it), its text row while there is one, then the pad; token by token, for rows
    crossing the prompt's end, the known frames' and the text's."""
    spec = Qwen3TalkerSpec.from_hf(AutoConfig.from_pretrained(qwen3_omni_dir).talker_config)
    inputs = Qwen3TalkerStepInputs(spec, np.dtype(np.float32))
    inputs.pad_row = np.full((spec.thinker_hidden_size,), 0.5, np.float32)
    prompt, rng = 6, np.random.default_rng(1)
    thinker = rng.standard_normal((prompt, spec.thinker_hidden_size)).astype(np.float32)
    trailing = rng.standard_normal((3, spec.thinker_hidden_size)).astype(np.float32)
    sums = list(rng.standard_normal((4, spec.text.hidden_size)).astype(np.float32))
    state = Qwen3TalkerRequest(
        thinker=thinker,
        project=rng.integers(0, 2, prompt).astype(np.int32),
        add_codec=np.array([0, 1, 1, 0, 1, 0], bool),
        trailing=GrowingRows(trailing),
        taken=prompt + 3,
        positions=np.zeros((3, prompt), np.int32),
        rope_delta=0,
        final=True,
        sums=sums,
    )
    embeds = inputs.pack([talker_row(state, a, b) for a, b in SPANS], FIRSTS, 16)
    for p in range(14):
        j = p - prompt
        if p < prompt:
            want = (np.zeros(spec.text.hidden_size), state.add_codec[p], thinker[p], state.project[p])
        else:
            text = trailing[j] if j < len(trailing) else inputs.pad_row
            want = (sums[j] if j < len(sums) else np.zeros(spec.text.hidden_size), False, text, PROJECT_TEXT)
        got = (
            embeds.rows[p, 0],
            embeds.add_codec[p, 0],
            embeds.thinker.rows[p, 0],
            embeds.thinker.project[p, 0],
        )
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w, err_msg=f"token {p}")
    assert (embeds.thinker.project[14:] == PROJECT_NONE).all() and not embeds.thinker.rows[14:].any()
