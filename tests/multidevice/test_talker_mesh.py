"""The Qwen2.5-Omni talker split over ``model``: its forward equals the single-device one.

The tiny talker has 4 query and 2 KV heads: ``model=2`` splits every projection, ``model=4``
keeps k/v whole. The projection from the thinker's width stays replicated.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from omni_jax.full_forward import full_forward
from omni_jax.models.qwen2_5_omni.rope_index import get_rope_index
from omni_jax.models.qwen2_5_omni.talker import TalkerEmbeds
from omni_jax.parallel import make_mesh
from omni_jax.weights import load_part


def forward(model, n: int) -> np.ndarray:  # noqa: ANN001
    spec = model.talker_spec
    rows = np.random.default_rng(0).standard_normal((1, n, spec.embedding_size)).astype(np.float32)
    ids = [spec.codec_mask] * (n - 2) + [spec.codec_pad, spec.codec_bos]
    add = jnp.asarray(np.arange(n) >= n - 2)[None]
    embeds = model.embed(jnp.asarray(ids)[None], TalkerEmbeds(jnp.asarray(rows), add))
    positions, _ = get_rope_index(spec.rope_index, list(range(n)))
    return full_forward(model, ids, 8, positions=positions, embeds=embeds[0])[0]


@pytest.mark.parametrize("model_axis", [2, 4])
def test_talker_split_over_model_equals_one_device(omni_dir, model_axis: int) -> None:
    single, _ = load_part(omni_dir, "talker")
    split, _ = load_part(omni_dir, "talker", mesh=make_mesh({"data": 1, "model": model_axis}))
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(split))}
    q, head = flat["model.layers.0.self_attn.q_proj.kernel"], flat["codec_head.kernel"]
    assert {s.data.shape for s in q.addressable_shards} == {(q.shape[0], q.shape[1] // model_axis)}
    assert {s.data.shape for s in head.addressable_shards} == {(head.shape[0], head.shape[1] // model_axis)}
    assert flat["thinker_to_talker_proj.kernel"].sharding.is_fully_replicated
    want = forward(single, 13)
    np.testing.assert_allclose(forward(split, 13), want, rtol=0, atol=1e-5 * np.abs(want).max())
