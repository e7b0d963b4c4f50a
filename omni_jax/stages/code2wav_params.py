"""``Token2WavParams``: how the code2wav stage solves its flow-matching ODE for a request (the
stage's per-request parameters; re-exported as ``omni_jax.Token2WavParams``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from omni_jax.engine.sampling import (
    FLOAT32_MAX,
    SEED_RANGE,
    FieldType,
    ParamError,
    check_field_types,
    is_bool,
    is_finite,
    is_int,
    is_real,
    seed_in_range,
)

_TOKEN2WAV_TYPES: tuple[FieldType, ...] = (
    ("num_steps", is_int, False, "an integer from 1 to 2**31 - 1"),
    ("guidance_scale", is_real, False, "a finite real number"),
    ("sway_coefficient", is_real, False, "a finite real number"),
    ("seed", is_int, True, f"an integer {SEED_RANGE}"),
    ("stream", is_bool, False, "True or False"),
    ("chunk_codes", is_int, True, "an integer >= 1"),
)
"""Each :class:`Token2WavParams` field's type (``initial_noise`` is checked as an array)."""


@dataclasses.dataclass(slots=True)
class Token2WavParams:
    """Solver settings; ``initial_noise [mel_frames, mel_dim]`` replaces the random start.

    ``stream``: decode in chunks as the codes arrive (the stage's chunk sizes, or every chunk
    after the first ``chunk_codes`` new codes, none longer than the stage's largest) instead of once the
    request's codes are all there; a streamed request's noise comes from its seed, since its
    length is unknown when its first chunk is solved. Slotted: assigning a field it does not
    have (a misspelling) raises ``AttributeError`` instead of being silently ignored.
    """

    num_steps: int = 10
    guidance_scale: float = 0.5
    sway_coefficient: float = -1.0
    seed: int | None = None
    initial_noise: np.ndarray | None = None
    stream: bool = False
    chunk_codes: int | None = None

    def validate(self) -> None:
        """Raise :class:`ParamError` naming the first field of the wrong type, else the first bad
        value (shape checks need the codes); types come first so that the value checks only ever
        compare numbers."""
        check_field_types(self, _TOKEN2WAV_TYPES)
        if not 1 <= self.num_steps < 2**31:  # the solve's step count is an int32
            raise ParamError(
                f"num_steps={self.num_steps!r} must be an integer from 1 to 2**31 - 1", "num_steps"
            )
        for name in ("guidance_scale", "sway_coefficient"):
            if not is_finite(getattr(self, name)):
                raise ParamError(f"{name}={getattr(self, name)!r} must be finite (as a float32)", name)
        if not seed_in_range(self.seed):
            raise ParamError(f"seed={self.seed!r} must be an integer {SEED_RANGE}", "seed")
        if self.initial_noise is not None:
            noise = np.asarray(self.initial_noise)
            if noise.ndim != 2 or not np.issubdtype(noise.dtype, np.floating):
                raise ParamError(
                    "initial_noise must be a float array [mel_frames, mel_dim], got shape "
                    f"{noise.shape}, dtype {noise.dtype}",
                    "initial_noise",
                )
            if not np.all(np.abs(noise) <= FLOAT32_MAX):  # NaN compares False
                raise ParamError(
                    "initial_noise contains values that are not finite as float32", "initial_noise"
                )
        if self.stream and self.initial_noise is not None:
            raise ParamError("initial_noise cannot be given with stream=True: give a seed", "initial_noise")
        if self.chunk_codes is not None:
            if not self.stream:
                raise ParamError(f"chunk_codes={self.chunk_codes!r} needs stream=True", "chunk_codes")
            if self.chunk_codes < 1:
                raise ParamError(f"chunk_codes={self.chunk_codes!r} must be an integer >= 1", "chunk_codes")
