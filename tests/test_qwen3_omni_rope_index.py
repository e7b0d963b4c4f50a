"""Host-side Qwen3-Omni ``get_rope_index`` equals transformers' on text, image, video, audio and
audio-in-video prompts (fractional video times included), with placeholder layouts written by
transformers' own ``Qwen3OmniMoeProcessor`` methods; and our processor lays placeholders out,
and featurises audio, as those methods do (transformers' composite processor itself cannot be
built without torchvision)."""

from __future__ import annotations

import functools
import types

import numpy as np
import pytest
import torch
from parity import qwen3_video_audio_layout
from parity import random_tokens as text
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoePreTrainedModelForConditionalGeneration as RefBase,
)
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
    Qwen3OmniMoeProcessor,
    Qwen3OmniMoeProcessorKwargs,
    _get_feat_extract_output_lengths,
)

from omni_jax.models.qwen2_5_omni.processor import VideoProcessor
from omni_jax.models.qwen2_5_omni.rope_index import positions_for
from omni_jax.models.qwen3_omni.processor import VIDEO_SIZE, Qwen3OmniProcessor
from omni_jax.models.qwen3_omni.rope_index import (
    RopeIndexSpec,
    audio_token_count,
    get_rope_index,
    media_rope_index,
)
from omni_jax.testing import build_tokenizer
from omni_jax.testing_qwen3_omni import QWEN3_OMNI_NAMED_TOKENS

VS, VE = 151652, 151653  # vision start / end, as in the released config
CFG = Qwen3OmniMoeThinkerConfig(vision_start_token_id=VS, position_id_per_seconds=13)
SPEC = RopeIndexSpec.from_hf(CFG)
MERGE = CFG.vision_config.spatial_merge_size
AS, AE = CFG.audio_start_token_id, CFG.audio_start_token_id + 1
N_WINDOW = CFG.audio_config.n_window


def reference(ids: list[int], **kw: object) -> tuple[np.ndarray, torch.Tensor]:
    """The reference method, run on a stand-in ``self`` that holds only what it reads."""
    owner = types.SimpleNamespace(config=CFG, spatial_merge_size=MERGE)
    owner.get_llm_pos_ids_for_vision = functools.partial(RefBase.get_llm_pos_ids_for_vision, owner)
    input_ids = torch.tensor([ids])
    pos, delta = RefBase.get_rope_index(
        owner,
        input_ids,
        image_grid_thw=torch.tensor(kw["image_grid_thw"]) if "image_grid_thw" in kw else None,
        video_grid_thw=torch.tensor(kw["video_grid_thw"]) if "video_grid_thw" in kw else None,
        attention_mask=torch.ones_like(input_ids),
        use_audio_in_video=bool(kw.get("use_audio_in_video", False)),
        audio_seqlens=torch.tensor(kw["audio_seqlens"]) if "audio_seqlens" in kw else None,
        second_per_grids=torch.tensor(kw["second_per_grid_ts"]) if "second_per_grid_ts" in kw else None,
    )
    return pos[:, 0].numpy(), delta[0, 0]


def image(grid: tuple[int, int, int]) -> list[int]:
    return [VS] + [CFG.image_token_id] * (int(np.prod(grid)) // MERGE**2) + [VE]


def video(grid: tuple[int, int, int]) -> list[int]:
    return [VS] + [CFG.video_token_id] * (int(np.prod(grid)) // MERGE**2) + [VE]


def audio(frames: int) -> list[int]:
    return [AS] + [CFG.audio_token_id] * int(_get_feat_extract_output_lengths(frames, N_WINDOW)) + [AE]


def video_with_audio(grid: tuple[int, int, int], seconds: float, frames: int) -> list[int]:
    """The processor's own interleaving (:func:`parity.qwen3_video_audio_layout`) of a clip of
    ``frames`` mel frames, in the chat template's vision start and end."""
    chars = {"B": VS, "E": VE, "s": AS, "e": AE, "v": CFG.video_token_id, "a": CFG.audio_token_id}
    tokens = int(_get_feat_extract_output_lengths(frames, N_WINDOW))
    return [chars[c] for c in qwen3_video_audio_layout(grid, seconds, tokens, merge=MERGE)]


CASES = {
    "text_only": dict(ids=text(17, 0)),
    "text_image": dict(ids=text(5, 1) + image((1, 4, 6)) + text(4, 2), image_grid_thw=[(1, 4, 6)]),
    "image_first_two_images": dict(
        ids=image((1, 6, 4)) + text(3, 3) + image((1, 2, 8)), image_grid_thw=[(1, 6, 4), (1, 2, 8)]
    ),
    "text_video": dict(
        ids=text(4, 4) + video((3, 4, 6)) + text(6, 5),
        video_grid_thw=[(3, 4, 6)],
        second_per_grid_ts=[2.0],
    ),
    "video_fractional_seconds": dict(
        # 0.3 s a grid step: times 3.9, 7.8 (float32), so positions and delta are fractional
        ids=text(2, 6) + video((3, 2, 4)) + text(2, 7),
        video_grid_thw=[(3, 2, 4)],
        second_per_grid_ts=[0.3],
    ),
    "text_audio": dict(ids=text(3, 8) + audio(37) + text(5, 9), audio_seqlens=[37]),
    "audio_several_chunks_with_image": dict(
        ids=text(3, 14) + audio(230) + text(2, 15) + image((1, 4, 4)) + text(3, 16),
        image_grid_thw=[(1, 4, 4)],
        audio_seqlens=[230],
    ),
    "audio_in_video_video_left_over": dict(
        # 4 frames 13 positions apart, 30 audio tokens: the video's last frame closes the span
        ids=text(3, 10) + video_with_audio((4, 4, 4), 1.0, 230) + text(4, 11),
        video_grid_thw=[(4, 4, 4)],
        second_per_grid_ts=[1.0],
        audio_seqlens=[230],
        use_audio_in_video=True,
    ),
    "audio_in_video_audio_left_over": dict(
        ids=text(2, 12) + video_with_audio((2, 2, 4), 1.0, 230) + text(3, 13),
        video_grid_thw=[(2, 2, 4)],
        second_per_grid_ts=[1.0],
        audio_seqlens=[230],
        use_audio_in_video=True,
    ),
    "audio_in_video_fractional": dict(
        ids=video_with_audio((3, 2, 2), 0.7, 61) + text(3, 17),
        video_grid_thw=[(3, 2, 2)],
        second_per_grid_ts=[0.7],
        audio_seqlens=[61],
        use_audio_in_video=True,
    ),
    "image_video_audio_fractional": dict(
        ids=text(2, 17) + video((2, 2, 4)) + audio(9) + image((1, 2, 2)) + text(2, 18),
        image_grid_thw=[(1, 2, 2)],
        video_grid_thw=[(2, 2, 4)],
        second_per_grid_ts=[0.5],  # 6.5 positions a grid step
        audio_seqlens=[9],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rope_index_matches_reference(name: str) -> None:
    case = dict(CASES[name])
    ids = case.pop("ids")
    want_pos, want_delta = reference(ids, **case)
    got_pos, got_delta = get_rope_index(SPEC, ids, **case)
    assert got_pos.shape == (3, len(ids))
    np.testing.assert_array_equal(got_pos, want_pos)
    assert got_delta == want_delta.item()
    fractional = "fractional" in name
    assert got_pos.dtype == (np.float32 if fractional else np.int64)
    assert isinstance(got_delta, float if fractional else int)


def test_audio_token_count_is_the_processors() -> None:
    for frames in (1, 2, 37, 99, 100, 101, 230, 3000):
        assert audio_token_count(frames, N_WINDOW) == int(_get_feat_extract_output_lengths(frames, N_WINDOW))


@pytest.mark.parametrize("name", ["text_image", "video_fractional_seconds"])
def test_decode_positions_continue_from_delta(name: str) -> None:
    """Generated tokens sit at ``index + delta`` on every axis, as the reference's decode adds
    its stored delta to the cache length (in float32 when the delta is fractional)."""
    case = dict(CASES[name])
    ids = case.pop("ids")
    pos, delta = get_rope_index(SPEC, ids, **case)
    _, ref_delta = reference(ids, **case)
    assert delta != 0
    p = len(ids)
    span = positions_for(pos, delta, p - 3, p + 4)
    np.testing.assert_array_equal(span[:, :3], pos[:, p - 3 :])
    want = (torch.arange(p, p + 4) + ref_delta).numpy()
    np.testing.assert_array_equal(span[:, 3:].astype(want.dtype), np.broadcast_to(want, (3, 4)))


def test_placeholder_mismatch_is_refused() -> None:
    ids = text(3, 19) + image((1, 4, 4)) + text(2, 20)
    with pytest.raises(ValueError, match="placeholders do not match"):
        get_rope_index(SPEC, ids, image_grid_thw=[(1, 4, 8)])


# -- the processor's placeholders -------------------------------------------------------------


@pytest.fixture(scope="module")
def processor() -> Qwen3OmniProcessor:
    """Our processor on a tiny tokenizer with Qwen3-Omni's placeholders, the real feature
    extractor (128 mel bins) and image processor (16-pixel patches), the numpy video processor."""
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen3OmniProcessor(
        build_tokenizer(named_special=QWEN3_OMNI_NAMED_TOKENS),
        WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, chunk_length=30),
        Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, min_pixels=32 * 32, max_pixels=32 * 32 * 16),
        VideoProcessor(
            patch_size=16, min_pixels=VIDEO_SIZE["shortest_edge"], max_pixels=VIDEO_SIZE["longest_edge"]
        ),
    )


@pytest.mark.parametrize(
    ("grid", "seconds", "audio_tokens"),
    [
        ((4, 4, 4), 1.0, 30),
        ((2, 2, 4), 2.0, 45),
        ((3, 2, 2), 0.7, 8),
        ((5, 2, 2), 1 / 3, 20),
        ((2, 2, 2), 1.0, 0),
    ],
)
def test_interleaving_is_the_processors(
    processor: Qwen3OmniProcessor, grid: tuple[int, int, int], seconds: float, audio_tokens: int
) -> None:
    p = processor
    chars = {"s": p.audio_bos_id, "e": p.audio_eos_id, "v": p.video_id, "a": p.audio_id}
    layout = qwen3_video_audio_layout(grid, seconds, audio_tokens, merge=MERGE)
    assert layout[0] == "B" and layout[-1] == "E"
    want = [chars[c] for c in layout[1:-1]]
    assert p.interleaved(grid, seconds, audio_tokens) == want


def test_audio_features_and_counts_are_the_processors(processor: Qwen3OmniProcessor) -> None:
    """Two clips featurised together as the composite's ``_process_audio`` does (padded to the
    longer clip, whose last frames so differ from a 30 s padding), each expanded to its count."""
    rng = np.random.default_rng(0)
    clips = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (36_800, 7_040)]
    if hasattr(Qwen3OmniMoeProcessor, "audio_kwargs"):  # transformers 5.24: its _process_audio
        owner = types.SimpleNamespace(
            feature_extractor=processor.feature_extractor,
            n_window=N_WINDOW,
            replace_audio_token=lambda inputs, audio_idx: "",
        )
        want, _ = Qwen3OmniMoeProcessor._process_audio(owner, clips, **Qwen3OmniMoeProcessor.audio_kwargs)
    else:  # transformers 5.17: the same steps inline in __call__, its kwargs in the defaults
        kwargs = dict(Qwen3OmniMoeProcessorKwargs._defaults["audio_kwargs"])
        n_window = kwargs.pop("n_window")
        want = processor.feature_extractor(clips, **kwargs)
        want["feature_attention_mask"] = want.pop("attention_mask")
        counts = want["feature_attention_mask"].sum(-1)
        want["num_audio_tokens"] = _get_feat_extract_output_lengths(counts, n_window)
    got = processor.audio_features(clips)
    for i, features in enumerate(got):
        frames = int(want["feature_attention_mask"][i].sum())
        np.testing.assert_array_equal(features, want["input_features"][i][:, :frames])
    p = processor
    ids = [p.audio_bos_id, p.audio_id, p.audio_eos_id, 300, p.audio_bos_id, p.audio_id, p.audio_eos_id]
    expanded = p.process(0, ids, {"audio": clips}).input_ids
    first, second = (int(n) for n in want["num_audio_tokens"])
    bos, pad, eos = p.audio_bos_id, p.audio_id, p.audio_eos_id
    assert expanded == [bos, *[pad] * first, eos, 300, bos, *[pad] * second, eos]


def test_processed_video_with_audio_positions_match_reference(processor: Qwen3OmniProcessor) -> None:
    """A prompt with an image and a video with its audio track, processed by ours (1 fps: 2 s a
    grid step), positions from :func:`media_rope_index` equal the reference's on the same ids."""
    p = processor
    rng = np.random.default_rng(1)
    video = (rng.random((4, 48, 64, 3)) * 255).astype(np.uint8)
    picture = (rng.random((40, 70, 3)) * 255).astype(np.uint8)
    track = rng.standard_normal(16_000 * 5).astype(np.float32) * 0.1
    vision_bos, vision_eos = (
        p.tokenizer.convert_tokens_to_ids(QWEN3_OMNI_NAMED_TOKENS[k])
        for k in ("vision_bos_token", "vision_eos_token")
    )
    ids = [300, vision_bos, p.video_id, vision_eos, 301, vision_bos, p.image_id, vision_eos, 302]
    out = p.process(0, ids, {"video": video, "image": picture, "audio": track}, use_audio_in_video=True)
    assert out.video_second_per_grid == [2.0]
    cfg = Qwen3OmniMoeThinkerConfig(
        vision_start_token_id=vision_bos,
        audio_start_token_id=p.audio_bos_id,
        audio_token_id=p.audio_id,
        image_token_id=p.image_id,
        video_token_id=p.video_id,
        position_id_per_seconds=13,
    )
    spec = RopeIndexSpec.from_hf(cfg)
    got_pos, got_delta = media_rope_index(spec, out.input_ids, out)
    owner = types.SimpleNamespace(config=cfg, spatial_merge_size=MERGE)
    owner.get_llm_pos_ids_for_vision = functools.partial(RefBase.get_llm_pos_ids_for_vision, owner)
    input_ids = torch.tensor([out.input_ids])
    want_pos, want_delta = RefBase.get_rope_index(
        owner,
        input_ids,
        image_grid_thw=torch.tensor(out.image_grid_thw),
        video_grid_thw=torch.tensor(out.video_grid_thw),
        attention_mask=torch.ones_like(input_ids),
        use_audio_in_video=True,
        audio_seqlens=torch.tensor(out.audio_seqlens),
        second_per_grids=torch.tensor(out.video_second_per_grid),
    )
    np.testing.assert_array_equal(got_pos, want_pos[:, 0].numpy())
    assert got_delta == want_delta.item()
    assert out.input_ids.count(p.audio_id) == audio_token_count(out.audio_seqlens[0], N_WINDOW) > 0
