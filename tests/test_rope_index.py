"""Host-side ``get_rope_index`` equals transformers' on text, image, video, audio, audio-in-video prompts."""

from __future__ import annotations

import functools
import types

import numpy as np
import pytest
import torch
from parity import placeholder_owner
from parity import random_tokens as text
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniThinkerConfig
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniPreTrainedModelForConditionalGeneration as RefBase,
)
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor

try:  # the processor's own count of an audio clip's tokens (newer transformers)
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths
except ImportError:  # transformers 5.17 counts inline there, as its audio encoder's method does

    def _get_feat_extract_output_lengths(input_lengths):
        return Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths(None, input_lengths)[1]


from omni_jax.models.qwen2_5_omni.rope_index import RopeIndexSpec, get_rope_index, positions_for

CFG = Qwen2_5OmniThinkerConfig(vision_start_token_id=151652)  # the sub-configs' defaults are never built
SPEC = RopeIndexSpec.from_hf(CFG)
MERGE = CFG.vision_config.spatial_merge_size
VS, VE = 151652, 151653  # vision start / end
AS, AE = CFG.audio_start_token_id, CFG.audio_end_token_id


def reference(ids: list[int], **kw: object) -> tuple[np.ndarray, int]:
    """The reference method, run on a stand-in ``self`` that holds only what it reads."""
    owner = types.SimpleNamespace(config=CFG, spatial_merge_size=MERGE)
    owner.get_llm_pos_ids_for_vision = functools.partial(RefBase.get_llm_pos_ids_for_vision, owner)
    owner.get_chunked_index = functools.partial(RefBase.get_chunked_index, owner)
    names = {"second_per_grid_ts": "second_per_grids"}
    tensors = {names.get(k, k): torch.tensor(v) for k, v in kw.items() if k != "use_audio_in_video"}
    input_ids = torch.tensor([ids])
    pos, delta = RefBase.get_rope_index(
        owner,
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        use_audio_in_video=bool(kw.get("use_audio_in_video", False)),
        **tensors,
    )
    return pos[:, 0].numpy(), int(delta[0, 0])


def image(grid: tuple[int, int, int]) -> list[int]:
    return [VS] + [CFG.image_token_id] * (int(np.prod(grid)) // MERGE**2) + [VE]


def video(grid: tuple[int, int, int]) -> list[int]:
    return [VS] + [CFG.video_token_id] * (int(np.prod(grid)) // MERGE**2) + [VE]


def audio(frames: int) -> list[int]:
    return [AS] + [CFG.audio_token_id] * int(_get_feat_extract_output_lengths(frames)) + [AE]


def video_with_audio(grid: tuple[int, int, int], seconds: float, frames: int) -> list[int]:
    """The processor's own interleaving of a video's and its audio track's placeholders: its
    ``replace_video_with_audio_token``, or in transformers 5.17, which has no such method, the
    same code inside ``replace_multimodal_special_tokens`` (which also writes the vision start and end)."""
    chars = {"S": VS, "E": VE, "s": AS, "e": AE, "v": CFG.video_token_id, "a": CFG.audio_token_id}
    owner = placeholder_owner(MERGE, vision_bos="S")
    owner.get_chunked_index = functools.partial(Qwen2_5OmniProcessor.get_chunked_index, owner)
    num_audio = int(_get_feat_extract_output_lengths(frames))
    chunks = dict(
        position_id_per_seconds=CFG.position_id_per_seconds, seconds_per_chunk=CFG.seconds_per_chunk
    )
    if hasattr(Qwen2_5OmniProcessor, "replace_video_with_audio_token"):
        layout = Qwen2_5OmniProcessor.replace_video_with_audio_token(
            owner,
            {"video_grid_thw": np.array([grid]), "video_second_per_grid": [seconds]},
            0,
            {"num_audio_tokens": [num_audio]},
            0,
            **chunks,
        )
        layout = "S" + layout + "E"
    else:
        (layout,) = Qwen2_5OmniProcessor.replace_multimodal_special_tokens(
            owner,
            ["SvE"],
            audio_lengths=iter([num_audio]),
            image_grid_thw=iter([]),
            video_grid_thw=iter([np.array(grid)]),
            video_second_per_grid=iter([seconds]),
            use_audio_in_video=True,
            **chunks,
        )
    return [chars[c] for c in layout]


CASES = {
    "text_only": dict(ids=text(17, 0)),
    "text_image": dict(ids=text(5, 1) + image((1, 4, 6)) + text(4, 2), image_grid_thw=[(1, 4, 6)]),
    "image_first_two_images": dict(
        ids=image((1, 6, 4)) + text(3, 3) + image((1, 2, 8)), image_grid_thw=[(1, 6, 4), (1, 2, 8)]
    ),
    "text_video": dict(
        ids=text(4, 4) + video((2, 4, 6)) + text(6, 5),
        video_grid_thw=[(2, 4, 6)],
        second_per_grid_ts=[2.0],
    ),
    "video_fractional_seconds": dict(
        ids=text(2, 6) + video((3, 2, 4)) + text(2, 7),
        video_grid_thw=[(3, 2, 4)],
        second_per_grid_ts=[0.3],  # 0.3 * 25 truncates in float32
    ),
    "text_audio": dict(ids=text(3, 8) + audio(37) + text(5, 9), audio_seqlens=[37]),
    "audio_in_video": dict(
        # two chunks each; the last audio chunk ends below the video's last frame, so the
        # closing tokens start one past the audio, not past the running maximum
        ids=text(3, 10) + video_with_audio((4, 4, 4), 1.0, 230) + text(4, 11),
        video_grid_thw=[(4, 4, 4)],
        second_per_grid_ts=[1.0],
        audio_seqlens=[230],
        use_audio_in_video=True,
    ),
    "audio_in_video_sparse_frames_short_audio": dict(
        ids=text(2, 12) + video_with_audio((3, 2, 2), 4.0, 90) + text(3, 13),
        video_grid_thw=[(3, 2, 2)],
        second_per_grid_ts=[4.0],  # frames 100 positions apart: chunks skip, audio ends first
        audio_seqlens=[90],
        use_audio_in_video=True,
    ),
    "image_and_audio": dict(
        ids=text(3, 14) + audio(21) + text(2, 15) + image((1, 4, 4)) + text(3, 16),
        image_grid_thw=[(1, 4, 4)],
        audio_seqlens=[21],
    ),
    "image_video_audio": dict(
        ids=text(2, 17) + video((2, 2, 4)) + audio(9) + image((1, 2, 2)) + text(2, 18),
        image_grid_thw=[(1, 2, 2)],
        video_grid_thw=[(2, 2, 4)],
        second_per_grid_ts=[0.5],
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
    assert got_delta == want_delta


def test_decode_positions_continue_from_delta() -> None:
    """Generated tokens sit at ``index + delta`` on every axis, also inside a recomputed span."""
    case = dict(CASES["text_image"])
    ids = case.pop("ids")
    pos, delta = get_rope_index(SPEC, ids, **case)
    assert delta != 0
    p = len(ids)
    span = positions_for(pos, delta, p - 3, p + 4)
    np.testing.assert_array_equal(span[:, :3], pos[:, p - 3 :])
    np.testing.assert_array_equal(span[:, 3:], np.broadcast_to(np.arange(p, p + 4) + delta, (3, 4)))
    np.testing.assert_array_equal(positions_for(pos, delta, p + 2, p + 3), [[p + 2 + delta]] * 3)


def test_placeholder_mismatch_is_refused() -> None:
    ids = text(3, 19) + image((1, 4, 4)) + text(2, 20)
    with pytest.raises(ValueError, match="placeholders do not match"):
        get_rope_index(SPEC, ids, image_grid_thw=[(1, 4, 8)])
