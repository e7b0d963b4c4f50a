"""Qwen2.5-Omni voices: the per-speaker conditioning of the talker and of code2wav.

The hub ships them as ``spk_dict.pt``, a pickled ``{name: {"cond", "ref_mel", "bos_token", ...}}``
that only torch can read. Conversion rewrites it as ``speakers.safetensors`` (every tensor, as
float32, under ``"<name>/<key>"``) plus ``speakers.json`` (names in order and the scalar fields),
so a converted checkpoint serves without torch.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from omni_jax.safetensors_io import iter_safetensors
from omni_jax.voices import default_voice, voice_named

TORCH_FILE = "spk_dict.pt"
TENSOR_FILE = "speakers.safetensors"
INDEX_FILE = "speakers.json"
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Speaker:
    """One voice: ``cond [enc_emb_dim]`` and ``ref_mel [frames, mel_dim]`` feed the DiT, and
    ``bos_token`` (a thinker-vocabulary id) starts the talker's text stream."""

    name: str
    cond: np.ndarray
    ref_mel: np.ndarray
    bos_token: int | None


def _speaker(name: str, tensors: dict[str, np.ndarray], scalars: dict[str, Any]) -> Speaker:
    """Drop the hub's leading batch axis of one (``cond [1, D]``, ``ref_mel [1, T, M]``)."""
    for key in ("cond", "ref_mel"):
        if key not in tensors:
            raise ValueError(f"speaker {name!r} has no {key!r} tensor")
    cond = tensors["cond"].reshape(-1)
    ref_mel = tensors["ref_mel"]
    if ref_mel.ndim == 3 and ref_mel.shape[0] == 1:
        ref_mel = ref_mel[0]
    if ref_mel.ndim != 2:
        raise ValueError(f"speaker {name!r}: ref_mel has shape {ref_mel.shape}, expected [frames, mel_dim]")
    bos = scalars.get("bos_token")
    return Speaker(
        name, cond.astype(np.float32), ref_mel.astype(np.float32), None if bos is None else int(bos)
    )


def _read_torch(path: Path) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, dict[str, Any]]]:
    """``spk_dict.pt`` -> per speaker ``(float32 tensors, JSON-able scalars)``."""
    try:
        import torch
    except ImportError as e:
        raise ValueError(
            f"{path}: reading spk_dict.pt needs torch (pip install 'omni-jax[torch]'), or convert the "
            "checkpoint with `python -m checkpoints_convert`, which stores the speakers torch-free"
        ) from e
    raw = torch.load(path, map_location="cpu", weights_only=True)
    tensors: dict[str, dict[str, np.ndarray]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for name, fields in raw.items():
        tensors[name], scalars[name] = {}, {}
        for key, value in fields.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                tensors[name][key] = value.detach().float().numpy()
            elif isinstance(value, torch.Tensor):
                scalars[name][key] = value.item()
            elif isinstance(value, (int, float, str, bool)) or value is None:
                scalars[name][key] = value
            else:
                raise ValueError(f"{path}: speaker {name!r} field {key!r} has unsupported type {type(value)}")
    return tensors, scalars


def convert_speakers(src: Path, dst_dir: Path) -> None:
    """Write ``spk_dict.pt`` as ``speakers.safetensors`` + ``speakers.json`` in ``dst_dir``."""
    from safetensors.numpy import save_file

    tensors, scalars = _read_torch(src)
    for name in tensors:  # fail at conversion, not at serving time
        _speaker(name, tensors[name], scalars[name])
    flat = {f"{name}/{key}": np.ascontiguousarray(v) for name, fs in tensors.items() for key, v in fs.items()}
    save_file(flat, str(dst_dir / TENSOR_FILE))
    index = {"format": FORMAT_VERSION, "speakers": {name: scalars[name] for name in tensors}}
    (dst_dir / INDEX_FILE).write_text(json.dumps(index, indent=1))


def has_voices(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds voices: the hub's ``spk_dict.pt`` or conversion's files."""
    model_dir = Path(model_dir)
    return (model_dir / INDEX_FILE).exists() or (model_dir / TORCH_FILE).exists()


def load_speakers(model_dir: str | Path) -> dict[str, Speaker]:
    """The checkpoint's voices in file order: converted files if present, else ``spk_dict.pt``.

    Returns ``{}`` when the checkpoint has none.
    """
    model_dir = Path(model_dir)
    if (model_dir / INDEX_FILE).exists():
        index = json.loads((model_dir / INDEX_FILE).read_text())
        if index.get("format") != FORMAT_VERSION:
            raise ValueError(
                f"{model_dir / INDEX_FILE}: format {index.get('format')}, expected {FORMAT_VERSION}"
            )
        tensors: dict[str, dict[str, np.ndarray]] = {name: {} for name in index["speakers"]}
        for flat_name, array in iter_safetensors(model_dir / TENSOR_FILE):
            name, key = flat_name.rsplit("/", 1)
            if name not in tensors:
                raise ValueError(f"{model_dir / TENSOR_FILE}: speaker {name!r} is not in {INDEX_FILE}")
            tensors[name][key] = np.array(array)
        scalars = index["speakers"]
    elif (model_dir / TORCH_FILE).exists():
        tensors, scalars = _read_torch(model_dir / TORCH_FILE)
    else:
        return {}
    return {name: _speaker(name, tensors[name], scalars[name]) for name in tensors}


class Voices:
    """A checkpoint's voices and the one a prompt without ``"speaker"`` gets.

    The talker (its text-stream BOS) and code2wav (conditioning and reference mel) both read a
    request's voice, so both resolve it here and give the same answer and the same error.
    ``preferred``: the stage config's default voice (:func:`~omni_jax.voices.default_voice`:
    ``ValueError`` when the checkpoint has no such voice); ``None``: the checkpoint's first voice.
    """

    def __init__(self, speakers: dict[str, Speaker], preferred: str | None = None):
        if not speakers:
            raise ValueError(f"no speakers ({TORCH_FILE}, or {INDEX_FILE} from conversion)")
        self.speakers = speakers
        self.default = next(iter(speakers)) if preferred is None else default_voice(preferred, speakers)

    @classmethod
    def load(cls, model_dir: str | Path, preferred: str | None = None) -> Voices:
        speakers = load_speakers(model_dir)
        if not speakers:
            raise ValueError(
                f"{model_dir}: no speakers ({TORCH_FILE}, or {INDEX_FILE} from conversion): the checkpoint "
                "serves text only; load it with stages=['thinker']"
            )
        return cls(speakers, preferred)

    def pick(self, index: int, prompt: dict[str, Any]) -> Speaker:
        """The voice ``prompt["speaker"]`` names (:func:`~omni_jax.voices.voice_named`), or the
        default."""
        name = prompt.get("speaker")
        if name is None:
            return self.speakers[self.default]
        return self.speakers[voice_named(index, name, self.speakers)]
