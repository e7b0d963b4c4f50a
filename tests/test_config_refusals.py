"""Configs a model would run otherwise than transformers are refused where the model is built.

transformers accepts each of these; our port computes something else, or fails later (at the
first request, after minutes of loading a real checkpoint), or fails with a message that does
not say what is wrong. Each is refused before any weight is read. The decoders' own cases
(activation, rotary types) are in ``tests/test_qwen2_parity.py``.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from flax import nnx

from omni_jax import OmniJaxPipeline
from omni_jax.models.qwen2_5_omni.bigvgan import BigVGAN
from omni_jax.models.qwen3_omni.code2wav_layers import Code2WavSpec


@pytest.mark.parametrize(
    "rope,match",
    [
        ({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "unsupported rope_type 'dynamic'"),
        (
            {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            "partial_rotary_factor 0.5",
        ),
    ],
)
def test_a_code2wav_rotary_it_cannot_compute_is_refused_at_load(rope: dict, match: str) -> None:
    """It loaded, then failed at the first decode."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig

    with pytest.raises(ValueError, match=re.escape(match)):
        Code2WavSpec.from_hf(Qwen3OmniMoeCode2WavConfig(rope_parameters=rope))


@pytest.mark.parametrize(
    "kernels,dilations",
    [([3, 7], [[1, 3, 5, 7], [1, 3, 5, 7]]), ([3, 7], [[1, 3, 5]]), ([3], [[1, 3]])],
    ids=["four dilations", "a list short", "two dilations"],
)
def test_bigvgan_dilations_other_than_three_per_kernel_are_named(kernels: list, dilations: list) -> None:
    """transformers' AMP blocks read three dilations each, zipped with the kernel sizes: more
    were a "missing parameters" error, fewer lists a bare zip() error."""
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniBigVGANConfig

    config = Qwen2_5OmniBigVGANConfig(resblock_kernel_sizes=kernels, resblock_dilation_sizes=dilations)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"BigVGAN takes one list of 3 dilations per resblock kernel size, got resblock_kernel_sizes="
            f"{kernels} and resblock_dilation_sizes={dilations}"
        ),
    ):
        BigVGAN(config, rngs=nnx.Rngs(0))


def test_a_code2wav_reading_frames_of_another_size_than_the_talker_makes_is_refused(
    qwen3_omni_dir, tmp_path
) -> None:
    """The talker makes ``num_code_groups`` codes a frame; a code2wav of another
    ``num_quantizers`` would read each frame's codes as parts of others and speak noise
    (transformers raises at the first decode). Refused before anything loads."""
    src = tmp_path / "src"
    shutil.copytree(qwen3_omni_dir, src)
    config = json.loads((src / "config.json").read_text())
    groups = config["talker_config"]["num_code_groups"]
    config["code2wav_config"]["num_quantizers"] = groups + 1
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"code2wav_config.num_quantizers={groups + 1}, but the talker makes {groups} codes a frame "
            "(talker_config.num_code_groups)"
        ),
    ):
        OmniJaxPipeline.from_pretrained(src, max_model_len=128)
