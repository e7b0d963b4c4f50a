"""Validation of ``from_pretrained``'s engine arguments, shared with the memory plan.

``OmniJaxPipeline.from_pretrained`` and :func:`omni_jax.planning.plan_memory` take the same
``dtype``, ``stages`` and engine sizes; both refuse the same mistakes with the same
``ValueError`` before reading anything, so a plan never describes a pipeline that
``from_pretrained`` would not build.
"""

from __future__ import annotations

import typing
from typing import Any

import jax.numpy as jnp
import numpy as np

from omni_jax.models.attention import Backend
from omni_jax.weights import DTYPES


def dtype_name(dtype: Any) -> str | None:
    """``dtype`` as one of :data:`~omni_jax.weights.DTYPES` (a name or a numpy/JAX dtype);
    ``ValueError`` listing them for anything else."""
    if dtype is None:
        return None
    try:
        name = jnp.dtype(dtype).name
    except TypeError:  # not a dtype at all ("bf17")
        name = None
    if name not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    return name


def check_stage_names(stages: Any) -> None:
    """``stages`` is ``None`` or a non-empty list of names (a bare string would be read letter
    by letter)."""
    if stages is None:
        return
    if not isinstance(stages, (list, tuple)) or not stages or not all(isinstance(s, str) for s in stages):
        raise ValueError(f"stages must be a non-empty list of stage names, e.g. ['thinker'], got {stages!r}")
    twice = sorted({s for s in stages if stages.count(s) > 1})
    if twice:
        raise ValueError(f"stages lists {twice} more than once (each stage is built once): {stages!r}")


def check_attention_backend(backend: Any) -> None:
    """``backend`` is one of :data:`~omni_jax.models.attention.Backend`'s names (a typo would
    otherwise run as ``auto`` would not: silently on some other path)."""
    choices = typing.get_args(Backend)
    if backend not in choices:
        raise ValueError(f"attention_backend={backend!r} is not one of {', '.join(choices)}")


def check_backend_platform(backend: Backend, platform: str) -> None:
    """``backend`` runs on ``platform`` (JAX's default backend): the Pallas kernel compiles for
    a GPU or TPU and the C++ kernel for the CPU. Checked once JAX's backend is up, so that the
    flag is named at start-up, not in the first step's compiler error."""
    if backend == "pallas" and platform == "cpu":
        raise ValueError(
            "attention_backend='pallas' compiles its kernel for a GPU or TPU; on CPU use 'cpu', 'jnp' "
            "or 'pallas_interpret' (the kernel interpreted, for tests)"
        )
    if backend == "cpu" and platform != "cpu":
        raise ValueError(f"attention_backend='cpu' is the CPU backend's kernel; this is a {platform} backend")


def check_sizes(**sizes: Any) -> None:
    """Each engine size given is a positive integer (``None`` takes the default), so a 0 or a
    negative is refused by name instead of falling back to a default or failing later."""
    for name, value in sizes.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer (or None for the default)")
