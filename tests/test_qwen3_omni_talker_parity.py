"""Flax Qwen3-Omni talker and code predictor vs transformers' ``Qwen3OmniMoeTalkerForConditionalGeneration``.

Float32 throughout, eager attention and experts on the reference. Ours is loaded from the
checkpoint the reference talker writes (fused experts and per-codebook heads, stacked by
``stack_talker_readers``), so the parameter map is checked too. Three levels:

- the MoE decoder and codec head: ragged rows through scattered cache pages, prefill in
  chunks then decode steps, 3-D M-RoPE positions on one row;
- the code predictor's compiled frame loop against the reference's per-frame ``generate`` and
  the sum ``prepare_inputs_for_generation`` forms from it;
- whole frames: prompts built the way ``Qwen3OmniMoeForConditionalGeneration.generate`` builds
  them, then talker step -> greedy first code -> code predictor -> next input, against the
  reference talker's greedy ``generate``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from parity import PagedSteps, compiled, randomize_moe_layers, rel_err
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTalkerConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeForConditionalGeneration,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerForConditionalGeneration as HFTalker,
)

from omni_jax.jit import StaticGraph
from omni_jax.models.loading import build_model
from omni_jax.models.qwen3_omni.code_predictor import FrameSampling, predict_frame
from omni_jax.models.qwen3_omni.talker import (
    SUPPRESSED_LOGIT,
    TALKER_RULES,
    Talker,
    TalkerEmbeds,
    TalkerSpec,
    stack_talker_readers,
    talker_ignore,
)
from omni_jax.safetensors_io import iter_checkpoint
from omni_jax.testing import randomize_weights

RTOL = 1e-5  # float32, same math as the reference (the MoE sums its k experts in another order)
SUM_RTOL = 1e-6  # the frame's embedding sum, G float32 additions in codebook order (0 measured on CPU)
D, THINKER_D, CODES, GROUPS, PAGE = 64, 48, 64, 6, 4
VOCAB = CODES + 1024  # ``generate`` suppresses the last 1024 ids but EOS: CODES codes stay drawable
PAD, BOS, EOS, NOTHINK, THINK_BOS, THINK_EOS, SPEAKER = range(CODES + 1000, CODES + 1007)


def tiny_talker_config() -> Qwen3OmniMoeTalkerConfig:
    """A 3-layer MoE talker (8 experts, top 3, shared expert; GQA with a head wider than
    ``hidden / heads``) and a 2-layer code predictor over 6 codebooks."""
    cfg = Qwen3OmniMoeTalkerConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=D,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            moe_intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=3,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],  # ignored by the talker: every layer is sparse
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5]},
        ),
        code_predictor_config=dict(
            vocab_size=80,
            hidden_size=D,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_code_groups=GROUPS,
        ),
        num_code_groups=GROUPS,
        thinker_hidden_size=THINKER_D,
        codec_eos_token_id=EOS,
        codec_pad_id=PAD,
        codec_bos_id=BOS,
        codec_nothink_id=NOTHINK,
        codec_think_bos_id=THINK_BOS,
        codec_think_eos_id=THINK_EOS,
        speaker_id={"ethan": SPEAKER},
        spatial_merge_size=2,
    )
    for c in (cfg, cfg.text_config, cfg.code_predictor_config):
        c._attn_implementation = "eager"
        c._experts_implementation = "eager"
    return cfg


def randomize_talker(hf: HFTalker) -> None:
    """Weights ~ 1/sqrt(fan_in) (the experts' fan-in is their last axis), router logits of order
    3 so routing is decided by the signal, and peaky heads so greedy choices are too."""
    randomize_weights(hf, 1.0)
    randomize_weights(hf.codec_head, 4.0)
    randomize_weights(hf.code_predictor.lm_head, 4.0)
    randomize_moe_layers(hf.model.layers)


Pair = tuple[HFTalker, Talker]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    torch.manual_seed(0)
    hf = HFTalker(tiny_talker_config()).eval()
    randomize_talker(hf)
    path = tmp_path_factory.mktemp("qwen3_omni_talker")
    hf.save_pretrained(path)
    spec = TalkerSpec.from_hf(hf.config)
    assert spec.text.sparse_layers == (True, True, True) and spec.suppressed_from() == CODES
    readers = ((name, lambda a=a: a) for name, a in iter_checkpoint(Path(path)))
    ours = build_model(
        lambda: Talker(spec, rngs=nnx.Rngs(0)),
        ((name, read()) for name, read in stack_talker_readers(readers)),
        TALKER_RULES,
        ignore=talker_ignore(spec),
    )
    return hf, ours


def pad_rows(rows: list[np.ndarray]) -> np.ndarray:
    """``[B, T, ...]`` of left-aligned ``rows``, zero-padded to the longest."""
    t = max(len(r) for r in rows)
    out = np.zeros((len(rows), t, *rows[0].shape[1:]), rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def reference_decoder(
    hf: HFTalker, embeds: np.ndarray, positions: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(codec logits, final hidden)`` of ``Qwen3OmniMoeTalkerModel`` + ``codec_head`` for one
    sequence's ``embeds [T, D]`` at ``positions [3, T]``."""
    with torch.no_grad():
        hidden = hf.model(
            inputs_embeds=torch.from_numpy(embeds)[None], position_ids=torch.from_numpy(positions)[:, None]
        ).last_hidden_state
        return hf.codec_head(hidden)[0].numpy(), hidden[0].numpy()


def test_ragged_batch_prefill_and_decode_match_transformers(pair: Pair) -> None:
    """Three prompts (11, 4, 9 rows; the first at 3-D positions around a 2x3 grid) prefilled in
    two padded chunks, the 4-row one decoding in the second; then decode steps whose inputs are
    the greedy code's codec embedding plus a row. Every position's hidden state and drawable
    logits equal the reference's on each whole sequence; the suppressed ids are masked."""
    hf, ours = pair
    rng = np.random.default_rng(1)
    lens = (11, 4, 9)
    embeds = [rng.standard_normal((n, D)).astype(np.float32) for n in lens]
    grid = np.concatenate(
        [
            np.stack([np.arange(3)] * 3),
            [[3] * 6, 3 + np.repeat(np.arange(2), 3), 3 + np.tile(np.arange(3), 2)],
        ],
        axis=1,
    )
    positions = [np.concatenate([grid, np.stack([np.arange(6, 8)] * 3)], axis=1)] + [
        np.stack([np.arange(n)] * 3) for n in lens[1:]
    ]
    steps = PagedSteps(ours, batch=3, pages_per_seq=6, page_size=PAGE)
    got_logits: list[list[np.ndarray]] = [[], [], []]
    got_hidden: list[list[np.ndarray]] = [[], [], []]

    def step(chunks: list[np.ndarray], chunk_positions: list[np.ndarray]) -> None:
        logits, hidden = steps.run(
            pad_rows(chunks),
            np.moveaxis(pad_rows([p.T for p in chunk_positions]), -1, 0),
            [len(c) for c in chunks],
        )
        for row in range(3):
            got_logits[row].append(logits[row])
            got_hidden[row].append(hidden[row])

    def decode_input(row: int) -> tuple[np.ndarray, np.ndarray]:
        """The row's next input (greedy code's embedding + a random row) and position."""
        code = int(np.argmax(np.concatenate(got_logits[row])[-1]))
        assert code < CODES or code == EOS
        extra = TalkerEmbeds(jnp.asarray(rng.standard_normal((1, 1, D)), jnp.float32), jnp.ones((1, 1), bool))
        x = np.asarray(compiled(ours, "embed", jnp.full((1, 1), code, jnp.int32), extra))[0]
        embeds[row] = np.concatenate([embeds[row], x])
        positions[row] = np.concatenate([positions[row], positions[row][:, -1:] + 1], axis=1)
        return x, positions[row][:, -1:]

    step([e[:8] for e in embeds], [p[:, :8] for p in positions])
    x1, p1 = decode_input(1)
    step([embeds[0][8:], x1, embeds[2][8:]], [positions[0][:, 8:], p1, positions[2][:, 8:]])
    for _ in range(4):
        inputs = [decode_input(row) for row in range(3)]
        step([x for x, _ in inputs], [p for _, p in inputs])

    for row in range(3):
        logits, hidden = np.concatenate(got_logits[row]), np.concatenate(got_hidden[row])
        ref_logits, ref_hidden = reference_decoder(
            hf, embeds[row][: len(logits)], positions[row][:, : len(logits)]
        )
        assert rel_err(hidden, ref_hidden) < RTOL
        drawable = np.r_[np.arange(CODES), EOS]
        assert rel_err(logits[:, drawable], ref_logits[:, drawable]) < RTOL
        assert (np.delete(logits, drawable, axis=1) == SUPPRESSED_LOGIT).all()
        top = np.sort(ref_logits[lens[row] - 1 :, drawable], axis=-1)  # where greedy codes were taken
        assert (top[:, -1] - top[:, -2]).min() > 1e-3  # greedy is decided by the signal


def split_predictor(ours: Talker) -> tuple[StaticGraph, nnx.State, jax.Array]:
    """What a stage keeps for :func:`predict_frame`: the code predictor's split and the talker's
    codec embedding table."""
    graphdef, state = nnx.split(ours.code_predictor)
    return StaticGraph(graphdef), state, ours.model.embed_tokens.embedding[...]


def reference_frame(
    hf: HFTalker, hidden: np.ndarray, first: np.ndarray
) -> tuple[np.ndarray, np.ndarray, list]:
    """``(codes [B, G], next-input sum [B, D], per-codebook logits)`` as the reference talker's
    ``prepare_inputs_for_generation`` forms them: the code predictor's greedy ``generate`` on
    (talker hidden, codec embedding of the first code), then the codebook embeddings summed."""
    with torch.no_grad():
        first_t = torch.from_numpy(first)[:, None]
        last_id_hidden = hf.get_input_embeddings()(first_t)
        result = hf.code_predictor.generate(
            inputs_embeds=torch.cat((torch.from_numpy(hidden)[:, None], last_id_hidden), dim=1),
            max_new_tokens=GROUPS - 1,
            do_sample=False,
            output_hidden_states=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
        mid = [hid[0] for hid in result.hidden_states[1:]]
        last = hf.code_predictor.get_input_embeddings()[-1](result.sequences[..., -1:])
        total = torch.cat([last_id_hidden, *mid, last], dim=1).sum(1)
        codes = torch.cat((first_t, result.sequences), dim=-1)
        return codes.numpy(), total.numpy(), [lg.numpy() for lg in result.logits]


def test_code_predictor_frames_match_reference_generate(pair: Pair) -> None:
    """Four frames of three rows each, greedy: the compiled loop's codes are the reference
    ``generate``'s, its sum the reference's next talker input (before the text row), and one
    program serves every frame."""
    hf, ours = pair
    graph, state, table = split_predictor(ours)
    rng = np.random.default_rng(2)
    seen: set[int] = set()
    compiled = None
    for _ in range(4):
        hidden = rng.standard_normal((3, D)).astype(np.float32)
        first = rng.integers(0, CODES, size=3)
        ref_codes, ref_sum, ref_logits = reference_frame(hf, hidden, first)
        codes, total = predict_frame(graph, state, table, jnp.asarray(hidden), jnp.asarray(first, jnp.int32))
        np.testing.assert_array_equal(np.asarray(codes), ref_codes)
        assert rel_err(total, ref_sum) < SUM_RTOL
        for lg in ref_logits:
            top = np.sort(lg, axis=-1)
            assert (top[:, -1] - top[:, -2]).min() > 1e-3
        seen.update(ref_codes[:, 1:].ravel().tolist())
        compiled = compiled or predict_frame._cache_size()
    assert len(seen) > 10  # the codes follow the inputs, not one favourite id
    assert predict_frame._cache_size() == compiled


def test_code_predictor_sampling(pair: Pair) -> None:
    """Per-row draws in one program: temperature 0, top-k 1 and a tiny top-p give the greedy
    codes; a row's key decides its draws; top-k keeps draws in the top k; the codebooks are
    one loop in the program, not unrolled."""
    hf, ours = pair
    graph, state, table = split_predictor(ours)
    b = 32
    rng = np.random.default_rng(3)
    hidden = jnp.asarray(np.repeat(rng.standard_normal((1, D)), b, axis=0), jnp.float32)
    first = jnp.full((b,), 5, jnp.int32)
    greedy, _ = predict_frame(graph, state, table, hidden, first)

    def draw(temperature: list[float], top_k: list[int], top_p: list[float], seed: int) -> np.ndarray:
        keys = jax.random.key_data(jax.random.split(jax.random.key(seed), b))
        sampling = FrameSampling(
            jnp.asarray(temperature, jnp.float32),
            jnp.asarray(top_k, jnp.int32),
            jnp.asarray(top_p, jnp.float32),
            keys,
        )
        codes, _ = predict_frame(graph, state, table, hidden, first, sampling)
        return np.asarray(codes)

    quarter = b // 4
    temperature = [0.0] * quarter + [1.0] * quarter + [1.0] * quarter + [2.0] * quarter
    top_k = [50] * quarter + [1] * quarter + [-1] * quarter + [-1] * quarter
    top_p = [1.0] * quarter + [1.0] * quarter + [1e-6] * quarter + [1.0] * quarter
    codes = draw(temperature, top_k, top_p, seed=0)
    np.testing.assert_array_equal(codes[: 3 * quarter], np.asarray(greedy)[: 3 * quarter])
    free = codes[3 * quarter :]
    assert len({tuple(r) for r in free}) > 1  # same inputs, different keys: different draws
    np.testing.assert_array_equal(draw(temperature, top_k, top_p, seed=0), codes)

    top3 = draw([1.5] * b, [3] * b, [1.0] * b, seed=1)[:, 1]
    _, _, ref_logits = reference_frame(hf, np.array(hidden[:1]), np.array(first[:1]))
    allowed = set(np.argsort(ref_logits[0][0])[-3:].tolist())
    assert set(top3.tolist()) <= allowed and len(set(top3.tolist())) > 1

    sampling = FrameSampling(jnp.ones(b), jnp.ones(b, jnp.int32), jnp.ones(b), jnp.zeros((b, 2), jnp.uint32))
    jaxpr = str(jax.make_jaxpr(lambda s: predict_frame(graph, s, table, hidden, first, sampling))(state))
    assert "scan[" in jaxpr or "while[" in jaxpr


@dataclasses.dataclass(frozen=True)
class ThinkerSide:
    """Random stand-ins for one request's thinker outputs over ``user`` user-turn tokens, then
    the assistant turn (3 prompt tokens and the generated reply): token embeddings and
    accepted-layer hidden states ``[L, THINKER_D]``, which positions are multimodal (every
    third), and the thinker embeddings of the tts specials (bos, eos, pad)."""

    user: int
    embed: np.ndarray
    hidden: np.ndarray
    multimodal: np.ndarray
    tts: np.ndarray

    @classmethod
    def draw(cls, rng: np.random.Generator, user: int, reply: int) -> ThinkerSide:
        n = user + 3 + reply

        def rows(k: int) -> np.ndarray:
            return rng.standard_normal((k, THINKER_D)).astype(np.float32)

        return cls(user, rows(n), rows(n), np.arange(n) % 3 == 1, rows(3))


def reference_prompt(hf: HFTalker, req: ThinkerSide) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(inputs_embeds, trailing_text_hidden, tts_pad_embed)`` by the reference's own
    ``_get_talker_user_parts`` and ``_get_talker_assistant_parts``."""
    omni = SimpleNamespace(talker=hf, config=SimpleNamespace(talker_config=hf.config, tts_pad_token_id=0))
    user = req.user
    embed, hidden = torch.from_numpy(req.embed)[None], torch.from_numpy(req.hidden)[None]
    with torch.no_grad():
        bos, eos, pad = hf.text_projection(torch.from_numpy(req.tts)[None]).chunk(3, dim=1)
        user_part = Qwen3OmniMoeForConditionalGeneration._get_talker_user_parts(
            omni, 0, user, torch.from_numpy(req.multimodal)[None], hidden, embed
        )
        assistant, _, trailing = Qwen3OmniMoeForConditionalGeneration._get_talker_assistant_parts(
            omni, user, embed.shape[1], SPEAKER, embed, pad, bos, eos
        )
    return torch.cat([user_part, assistant], dim=1), trailing, pad


def our_prompt(ours: Talker, req: ThinkerSide) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What the stage gives the talker: ``(prompt codec ids [P], prompt TalkerEmbeds rows
    [P, D], add_codec [P], trailing rows [R, D])``, the last trailing row (text pad) repeating
    once the reply runs out. User turn: ``hidden_projection`` of hidden states at multimodal
    positions, ``text_projection`` of embeddings elsewhere; assistant turn: its first 3 tokens,
    4 text pads, text bos and the first reply token, with codec nothink, think bos, think eos,
    speaker, pad, bos on the last 6; trailing: the other reply tokens, text eos, then pad."""
    user = req.user
    text = np.asarray(ours.text_projection(jnp.asarray(req.embed)))
    mm = np.asarray(ours.hidden_projection(jnp.asarray(req.hidden)))
    bos, eos, pad = np.asarray(ours.text_projection(jnp.asarray(req.tts)))
    user_rows = np.where(req.multimodal[:user, None], mm[:user], text[:user])
    assistant = text[user:]
    rows = np.concatenate([user_rows, assistant[:3], [pad] * 4, [bos], assistant[3:4]])
    ids = np.zeros(len(rows), np.int32)
    ids[-6:] = [NOTHINK, THINK_BOS, THINK_EOS, SPEAKER, PAD, BOS]
    add_codec = ids != 0
    trailing = np.concatenate([assistant[4:], [eos], [pad]])
    return ids, rows, add_codec, trailing


def test_greedy_frames_match_reference_talker_generate(pair: Pair) -> None:
    """Two requests of different prompt and reply lengths, batched through the paged cache:
    prefill, then per step the first code drawn greedily from our logits, the code predictor's
    frame, and the next input (frame sum + text row). Every frame's codes equal the reference
    talker's greedy ``generate`` run on each request alone, with its suppressed ids, and a
    request stops where the reference's does, at a first code of codec EOS."""
    hf, ours = pair
    graph, state, table = split_predictor(ours)
    rng = np.random.default_rng(4)
    reqs = [ThinkerSide.draw(rng, user=7, reply=3), ThinkerSide.draw(rng, user=4, reply=6)]
    frames = 8
    suppress = [i for i in range(VOCAB - 1024, VOCAB) if i != EOS]

    ref_codes, ref_firsts = [], []
    for req in reqs:
        embeds, trailing, pad = reference_prompt(hf, req)
        with torch.no_grad():
            result = hf.generate(
                inputs_embeds=embeds,
                trailing_text_hidden=trailing,
                tts_pad_embed=pad,
                attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long),
                max_new_tokens=frames + 1,
                do_sample=False,
                repetition_penalty=1.0,
                eos_token_id=EOS,
                suppress_tokens=suppress,
                output_hidden_states=True,
                output_scores=True,
                return_dict_in_generate=True,
            )
        codes = [hid[-1][0].numpy() for hid in result.hidden_states if hid[-1] is not None]
        ref_codes.append(np.stack(codes))
        ref_firsts.append(result.sequences[0].tolist())
        top = np.sort(np.concatenate([s.numpy() for s in result.scores]), axis=-1)
        assert (top[:, -1] - top[:, -2]).min() > 1e-3  # greedy is decided by the signal

    prompts = [our_prompt(ours, req) for req in reqs]
    steps = PagedSteps(ours, batch=2, pages_per_seq=8, page_size=PAGE)
    ids = pad_rows([p[0] for p in prompts])
    extra = TalkerEmbeds(
        jnp.asarray(pad_rows([p[1] for p in prompts])), jnp.asarray(pad_rows([p[2] for p in prompts]))
    )
    lens = [len(p[0]) for p in prompts]
    positions = np.broadcast_to(np.arange(ids.shape[1]), (3, *ids.shape))
    logits, hidden = steps.run(np.asarray(compiled(ours, "embed", jnp.asarray(ids), extra)), positions, lens)
    firsts: list[list[int]] = [[], []]
    got: list[list[np.ndarray]] = [[], []]
    for step in range(frames + 1):
        first = np.array([np.argmax(lg[-1]) for lg in logits], np.int32)
        for row in range(2):
            if EOS not in firsts[row]:
                firsts[row].append(int(first[row]))
        if step == frames:
            break
        last_hidden = np.stack([h[-1] for h in hidden])
        codes, total = predict_frame(graph, state, table, jnp.asarray(last_hidden), jnp.asarray(first))
        for row in range(2):
            if EOS not in firsts[row]:
                got[row].append(np.asarray(codes)[row])
        text_rows = np.stack([p[3][min(step, len(p[3]) - 1)] for p in prompts])
        rows = (total + jnp.asarray(text_rows))[:, None]
        x = compiled(ours, "embed", jnp.asarray(first)[:, None], TalkerEmbeds(rows, jnp.zeros((2, 1), bool)))
        at = np.array(lens)[None, :, None] + step
        logits, hidden = steps.run(np.asarray(x), np.broadcast_to(at, (3, 2, 1)), [1, 1])

    for row in range(2):
        assert firsts[row] == ref_firsts[row]
        np.testing.assert_array_equal(np.stack(got[row]), ref_codes[row])
    assert sum(len(c) for c in got) >= frames
