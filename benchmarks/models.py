"""Benchmark checkpoints: ``tiny`` and ``small`` are built locally per suite, anything else is a path."""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
from collections.abc import Callable
from pathlib import Path

from omni_jax.testing import TINY_BIGVGAN_CONFIG, TINY_DIT_CONFIG, build_tiny_qwen2, build_tiny_qwen2_5_omni

# ~40M parameters: Qwen2.5-0.5B's head layout at a width and depth this CPU runs in minutes.
SMALL = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=10,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    initializer_range=0.02,
)

SMALL_TOKEN2WAV = dict(
    dit_config=dict(num_hidden_layers=4, look_ahead_layers=[2], look_backward_layers=[0, 3]),
    bigvgan_config={},
)
"""Qwen2.5-Omni-7B's token2wav (transformers' config defaults are its layer shapes: DiT width
1024, 16 heads, ECAPA speaker encoder; BigVGAN from 1536 channels through six upsamplings) with
4 DiT layers instead of 22, one looking ahead and two looking back as in the real stack, so the
reference decodes a batch on this CPU in minutes. Thinker and talker stay tiny."""

LONG_REPLY_POSITIONS = 2048
"""``max_position_embeddings`` of the talker's decoder and of the DiT in the checkpoints of the
streamed-speech suite (:mod:`benchmarks.stream_suite`): the tiny builder's 512 hold a talker prompt
and its codes in 512 positions and an offline code2wav request in 256 codes (5 s at Qwen2.5-Omni's
50 codes per second); 2048 holds replies of up to 1024 codes (20 s) offline. Only the positions
change: no weight depends on them (both use rotary positions), so the weights are the seed's."""


def build_long_replies(path: Path, token2wav_config: dict | None = None) -> Path:
    """The ``tiny`` Qwen2.5-Omni (with ``token2wav_config``: ``small``'s) with the talker's and the
    DiT's positions at :data:`LONG_REPLY_POSITIONS`. The DiT's is set through ``token2wav_config``;
    the talker's in ``config.json`` after the build (its sub-config is the builder's own), which
    draws the same weights: a position count shapes no parameter."""
    t2w = token2wav_config or dict(dit_config=TINY_DIT_CONFIG, bigvgan_config=TINY_BIGVGAN_CONFIG)
    dit = dict(t2w.get("dit_config", {}), max_position_embeddings=LONG_REPLY_POSITIONS)
    build_tiny_qwen2_5_omni(path, seed=0, token2wav_config=dict(t2w, dit_config=dit))
    config = json.loads((path / "config.json").read_text())
    config["talker_config"]["max_position_embeddings"] = LONG_REPLY_POSITIONS
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


LONG_REPLIES = "qwen2_5_omni_long_replies"
"""The :data:`BUILDERS` key of :func:`build_long_replies`' checkpoints."""

BUILDERS: dict[str, dict[str, tuple[str, Callable[[Path], Path]]]] = {
    "qwen2": {
        "tiny": ("bench-tiny-qwen2", lambda p: build_tiny_qwen2(p, seed=0)),
        "small": ("bench-small-qwen2", lambda p: build_tiny_qwen2(p, seed=0, **SMALL)),
    },
    "qwen2_5_omni": {
        "tiny": ("bench-tiny-qwen2_5_omni", lambda p: build_tiny_qwen2_5_omni(p, seed=0)),
        "small": (
            "bench-small-qwen2_5_omni",
            lambda p: build_tiny_qwen2_5_omni(p, seed=0, token2wav_config=SMALL_TOKEN2WAV),
        ),
    },
    LONG_REPLIES: {  # model_type qwen2_5_omni (benchmarks.run.Suite.builds)
        "tiny": ("bench-tiny-long-qwen2_5_omni", build_long_replies),
        "small": ("bench-small-long-qwen2_5_omni", lambda p: build_long_replies(p, SMALL_TOKEN2WAV)),
    },
}
"""``BUILDERS[key][name]``: the locally built checkpoints, by the ``model_type`` a suite runs (or
the key a suite names in ``benchmarks.run.Suite.builds``: a variant of that model_type)."""


def builder_version(kind: str = "") -> str:
    """A digest of what the local checkpoints are built from (the builders in
    :mod:`omni_jax.testing` and the configs here), part of their cache directory's name, so a
    checkpoint built by an older builder (e.g. before the tiny talker learnt to stop) is never
    reused."""
    import omni_jax.testing

    text = inspect.getsource(omni_jax.testing) + repr(SMALL) + repr(SMALL_TOKEN2WAV)
    if kind == LONG_REPLIES:  # the other checkpoints' digests stay as they were
        text += inspect.getsource(build_long_replies) + repr(LONG_REPLY_POSITIONS)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def model_type(path: Path) -> str:
    return json.loads((path / "config.json").read_text()).get("model_type", "")


def resolve_model(name: str, cache_dir: Path, kind: str = "qwen2") -> Path:
    """The ``kind`` (a ``model_type``) checkpoint: ``tiny`` / ``small`` built once into ``cache_dir``
    (per :func:`builder_version`; builds by other versions are removed), or the checkpoint
    directory ``name``."""
    if name in BUILDERS[kind]:
        dirname, build = BUILDERS[kind][name]
        path = cache_dir / f"{dirname}-{builder_version(kind)}"
        if not (path / "config.json").exists():
            partial = path.with_name(path.name + ".partial")  # an interrupted build is never reused
            shutil.rmtree(partial, ignore_errors=True)
            build(partial)
            partial.rename(path)
            for stale in [cache_dir / dirname, *cache_dir.glob(f"{dirname}-*")]:
                if stale != path and stale.is_dir() and not stale.name.endswith(".partial"):
                    shutil.rmtree(stale, ignore_errors=True)
        return path
    path = Path(name)
    if not (path / "config.json").exists():
        raise SystemExit(f"--model {name}: not 'tiny', 'small' or a checkpoint directory")
    if model_type(path) != kind:
        raise SystemExit(f"--model {name}: a {model_type(path)!r} checkpoint, this suite runs {kind!r}")
    return path


def count_params(path: Path) -> int:
    from omni_jax.safetensors_io import iter_checkpoint

    return sum(a.size for _, a in iter_checkpoint(path))


def decode_read_params(path: Path) -> int:
    """Parameters one decode step must read: all but an untied input embedding (only gathered)."""
    from omni_jax.safetensors_io import iter_checkpoint

    sizes = {name: a.size for name, a in iter_checkpoint(path)}
    if "lm_head.weight" in sizes:
        sizes.pop("model.embed_tokens.weight", None)
    return sum(sizes.values())
