"""``--verify``: the converted model's numbers against transformers' on fixed inputs.

- Qwen2: the logits of a fixed prompt.
- Qwen2.5-Omni: the thinker's logits on a text prompt; the talker's logits on a prefill of
  random thinker rows (what the thinker hands it, with the text BOS and codec pad/BOS the
  reference adds); one code2wav solve (DiT flow matching, then BigVGAN) of random codes in the
  checkpoint's first voice, started from the reference's own noise.

Each check is the largest absolute difference over the reference's largest magnitude. Logits
of a float32 conversion are held to :data:`FLOAT32_LIMIT`, of a reduced-precision one to
:data:`ROUNDED_LIMIT` (the weights themselves are rounded); code2wav always runs in float32.
The transformers model is loaded whole in float32 (about 4 bytes per parameter of host memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax import Token2WavParams
from omni_jax.full_forward import full_forward
from omni_jax.jit import StaticGraph
from omni_jax.models.hf_config import own_fields_unflagged
from omni_jax.models.qwen2_5_omni.rope_index import get_rope_index
from omni_jax.models.qwen2_5_omni.speakers import TORCH_FILE, load_speakers
from omni_jax.models.qwen2_5_omni.talker import TalkerEmbeds
from omni_jax.models.qwen2_5_omni.token2wav import token2wav_compiled
from omni_jax.weights import architecture, load_hf_config, load_part, read_manifest

NUM_TOKENS = 16
NUM_CODES = 16
FLOAT32_LIMIT = 1e-4
ROUNDED_LIMIT = 5e-2
"""bfloat16 weights keep 8 bits of mantissa: logits move by about 1e-2."""


@dataclasses.dataclass(frozen=True)
class Check:
    """One comparison: what was compared, its relative error and the limit it is held to."""

    what: str
    error: float
    limit: float

    @property
    def passed(self) -> bool:
        return self.error <= self.limit

    def __str__(self) -> str:
        return f"{self.what}: max relative error {self.error:.2e} (limit {self.limit:.0e})"


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise ValueError("--verify needs torch (pip install 'omni-jax[torch]')") from e
    return torch


@contextlib.contextmanager
def _reference_loading(progress: bool) -> Iterator[None]:
    """Load a transformers model quietly: no warnings about the talker's thinker-vocabulary
    ids, and no loading bar unless ``progress``."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        with own_fields_unflagged():
            yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(np.asarray(ours, np.float64) - ref).max() / np.abs(ref).max())


def _qwen2(src: Path, dst: Path, cfg: Any, limit: float, progress: bool) -> list[Check]:
    torch = _torch()
    from transformers import AutoModelForCausalLM

    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, size=NUM_TOKENS).tolist()
    model, _ = load_part(dst, "llm", dtype="float32")
    ours, _ = full_forward(model, ids)
    del model
    with _reference_loading(progress):
        ref_model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float().numpy()
    return [Check(f"logits over {len(ids)} tokens", _rel_err(ours, ref), limit)]


def _text_ids(rope_index: Any, vocab_size: int, n: int, seed: int) -> list[int]:
    """``n`` ordinary text ids: below every media placeholder and start marker of the vocabulary."""
    specials = (
        rope_index.image_token_id,
        rope_index.video_token_id,
        rope_index.audio_token_id,
        rope_index.vision_start_token_id,
        rope_index.audio_start_token_id,
    )
    return np.random.RandomState(seed).randint(0, min(vocab_size, *specials), size=n).tolist()


def _thinker(ref: Any, dst: Path, limit: float) -> Check:
    torch = _torch()
    model, _ = load_part(dst, "thinker", dtype="float32")
    spec = model.thinker_spec
    ids = _text_ids(spec.rope_index, spec.text.vocab_size, NUM_TOKENS, seed=0)
    positions, _ = get_rope_index(spec.rope_index, ids)
    ours, _ = full_forward(model, ids, positions=positions)
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return Check(
        f"thinker logits over {len(ids)} tokens", _rel_err(ours, want.logits[0].float().numpy()), limit
    )


def _talker(ref: Any, dst: Path, cfg: Any, limit: float) -> Check:
    """The reference's prefill of a text prompt: thinker rows for every position, codec masks
    over the prompt, then the codec pad and BOS (which the reference adds itself) under the
    text BOS and the first reply token."""
    torch = _torch()
    model, _ = load_part(dst, "talker", dtype="float32")
    spec = model.talker_spec
    vocab = cfg.thinker_config.get_text_config().vocab_size
    prompt = _text_ids(spec.rope_index, vocab, NUM_TOKENS - 2, seed=1)
    text_ids = [*prompt, spec.text_bos, *_text_ids(spec.rope_index, vocab, 1, seed=2)]
    codec_ids = [spec.codec_mask] * len(prompt) + [spec.codec_pad, spec.codec_bos]
    rows = np.random.default_rng(3).standard_normal((len(text_ids), spec.embedding_size)).astype(np.float32)
    positions, _ = get_rope_index(spec.rope_index, text_ids)
    with_codec = jnp.asarray(np.arange(len(text_ids)) >= len(prompt))
    embeds = model.embed(
        jnp.asarray(codec_ids)[None], TalkerEmbeds(jnp.asarray(rows)[None], with_codec[None])
    )
    ours, _ = full_forward(model, codec_ids, positions=positions, embeds=embeds[0])
    ref.rope_deltas = None
    with torch.no_grad():
        want = ref(
            input_ids=torch.tensor([codec_ids]),
            input_text_ids=torch.tensor([text_ids]),
            inputs_embeds=torch.from_numpy(rows[None].copy()),
            attention_mask=torch.ones(1, len(text_ids), dtype=torch.long),
            thinker_reply_part=torch.from_numpy(rows[None, -1:].copy()),
        )
    return Check(
        f"talker logits over {len(codec_ids)} tokens", _rel_err(ours, want.logits[0].float().numpy()), limit
    )


def _code2wav(ref: Any, dst: Path, cfg: Any) -> Check:
    """One solve with the reference's defaults (10 steps, guidance 0.5, sway -1: the defaults of
    ``Token2WavParams``), as the stage runs it (one program); the reference draws its start with
    ``torch.randn`` first thing, so the same seed gives us its noise."""
    torch = _torch()

    model, _ = load_part(dst, "code2wav")
    dit = cfg.token2wav_config.dit_config
    speaker = next(iter(load_speakers(dst).values()))
    codes = np.random.RandomState(4).randint(0, dit.num_embeds, size=NUM_CODES)
    frames = NUM_CODES * dit.repeats
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        noise = torch.randn([1, frames, dit.mel_dim], dtype=torch.float32).numpy()
        torch.manual_seed(0)
        with torch.no_grad():
            reference_wave = ref(
                torch.from_numpy(codes[None]).long(),
                torch.from_numpy(speaker.cond[None]),
                torch.from_numpy(speaker.ref_mel[None]),
            )
    want = reference_wave.numpy().reshape(-1)  # the vocoder squeezes its batch axis
    graphdef, state = nnx.split(model)
    defaults = Token2WavParams()
    wave, lengths = token2wav_compiled(
        StaticGraph(graphdef),
        state,
        jnp.asarray(codes[None], jnp.int32),
        jnp.asarray([NUM_CODES], jnp.int32),
        jnp.asarray(speaker.cond[None]),
        jnp.asarray(speaker.ref_mel[None]),
        jnp.asarray([len(speaker.ref_mel)], jnp.int32),
        jnp.asarray(noise),
        jnp.asarray([defaults.num_steps]),
        jnp.asarray([defaults.guidance_scale]),
        jnp.asarray([defaults.sway_coefficient]),
    )
    ours = np.asarray(wave[0, : int(lengths[0])])
    if ours.shape != want.shape:
        raise ValueError(f"verify: code2wav made {ours.shape[0]} samples, the reference {want.shape[0]}")
    return Check(
        f"code2wav waveform of {NUM_CODES} codes ({speaker.name})", _rel_err(ours, want), FLOAT32_LIMIT
    )


def _qwen2_5_omni(src: Path, dst: Path, cfg: Any, limit: float, progress: bool) -> list[Check]:
    torch = _torch()
    from transformers import Qwen2_5OmniForConditionalGeneration

    with _reference_loading(progress):
        ref = Qwen2_5OmniForConditionalGeneration.from_pretrained(str(src), dtype=torch.float32).eval()
    checks = [_thinker(ref.thinker, dst, limit)]
    if "talker" in architecture(src, cfg).config_stages(cfg):  # else transformers builds no talker
        checks += [_talker(ref.talker, dst, cfg, limit), _code2wav(ref.token2wav, dst, cfg)]
    return checks


_VERIFIERS: dict[str, Callable[[Path, Path, Any, float, bool], list[Check]]] = {
    "Qwen2ForCausalLM": _qwen2,
    "Qwen2_5OmniForConditionalGeneration": _qwen2_5_omni,
}
_NEEDS = {"Qwen2_5OmniForConditionalGeneration": (TORCH_FILE, "transformers' model loads its voices")}


def check_verifiable(src: str | Path) -> None:
    """Refuse, before any conversion work, a source ``--verify`` cannot check: no torch, an
    architecture without a verifier, or a file the reference model cannot load without."""
    src = Path(src)
    _torch()
    arch = architecture(src, load_hf_config(src))
    if arch.name not in _VERIFIERS:
        raise ValueError(f"--verify supports {sorted(_VERIFIERS)}, not {arch.name}")
    if arch.name in _NEEDS and not (src / _NEEDS[arch.name][0]).exists():
        name, why = _NEEDS[arch.name]
        raise ValueError(f"--verify: {src} has no {name} ({why}); convert without --verify")


def verify(src: str | Path, dst: str | Path, progress: bool = True) -> list[Check]:
    """Every check of the converted ``dst`` against ``src`` in transformers (see the module
    docstring); the caller decides what a failed one means. ``progress``: transformers'
    loading bar."""
    src, dst = Path(src), Path(dst)
    cfg = load_hf_config(src)
    limit = FLOAT32_LIMIT if read_manifest(dst)["dtype"] == "float32" else ROUNDED_LIMIT
    return _VERIFIERS[architecture(src, cfg).name](src, dst, cfg, limit, progress)
