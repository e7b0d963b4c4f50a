"""The engine flags of ``omni-jax run``, ``serve`` and ``plan``: ``from_pretrained``'s arguments,
declared once.

One checkpoint is sized, placed and planned the same way whichever command reads it: ``omni-jax
plan MODEL --max-model-len 4096`` describes the pipeline ``omni-jax run`` or ``serve`` builds
with the same flags (``plan`` takes the flags that decide memory). The values are checked by
``from_pretrained`` and :func:`~omni_jax.planning.plan_memory` themselves (one ``ValueError``,
one line and exit 2); the parser only refuses what is not a positive number or not JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

DTYPE_CHOICES = ("float32", "bfloat16", "float16")
"""``--dtype``'s values (``omni_jax.weights.DTYPES``, kept apart so that ``--help`` needs no JAX)."""

ATTENTION_BACKENDS = ("auto", "jnp", "pallas", "pallas_interpret", "cpu")
"""``--attention-backend``'s values (``omni_jax.models.attention.Backend``'s names, kept apart so
that ``--help`` needs no JAX)."""


def positive(value: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return n


def gib(value: str) -> float:
    """An argparse type: a memory size in GiB, a number above 0 (``141``, ``93.5``)."""
    try:
        size = float(value)
    except ValueError:
        size = float("nan")
    if not size > 0 or size == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of GiB above 0, got {value}")
    return size


def media_limits(value: str) -> dict[str, int]:
    """``--limit-mm-per-prompt``'s JSON object (vLLM's form, e.g. ``{"image": 0, "video": 0}``);
    its kinds and counts are checked by ``from_pretrained``."""
    try:
        limits = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"image\": 0}}': {e}") from None
    if not isinstance(limits, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"image\": 0}}', got {value}")
    return limits


def _stage_list(value: str) -> list[str]:
    return value.split(",")


def add_engine_arguments(p: argparse.ArgumentParser, *, planning: bool = False) -> None:
    """Add ``from_pretrained``'s flags to ``p``; with ``planning``, only those that decide
    memory (no ``--num-pages``, which fixes what the plan works out, nor the attention backend;
    the media limits decide which encoder calls the thinker makes)."""
    p.add_argument("--stages", type=_stage_list, default=None, help="build only these stages, e.g. thinker")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=None, help="default: the checkpoint's")
    p.add_argument("--mesh", default=None, help="every stage's mesh, e.g. data=2,model=4")
    p.add_argument(
        "--max-num-seqs",
        type=positive,
        default=None,
        help="sequences each AR stage runs at once (default: the stage YAML's, else 64)",
    )
    p.add_argument(
        "--max-model-len",
        type=positive,
        default=None,
        help="tokens a sequence may hold (default: the stage YAML's, else the model's, at most 4096)",
    )
    p.add_argument("--page-size", type=positive, default=None, help="tokens a KV-cache page holds")
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive,
        default=None,
        help="token rows of one AR step (default: the stage YAML's, else 2048)",
    )
    p.add_argument("--stage-config", default=None, help="a stage YAML in place of the architecture's")
    p.add_argument(
        "--limit-mm-per-prompt",
        type=media_limits,
        default=None,
        help='most media items of each kind a prompt may hold, e.g. \'{"image": 0, "video": 0}\' '
        "(a kind at 0 is off: its encoder is not compiled)",
    )
    if planning:
        return
    p.add_argument(
        "--num-pages", type=positive, default=None, help="KV-cache pages (default: as many as fit)"
    )
    p.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="the paged attention path: auto (default: a decode kernel where one fits, Pallas on GPU "
        "below float32 or the C++ kernel on CPU, else jnp), jnp (gather), pallas, pallas_interpret "
        "(the Pallas kernel interpreted, on any backend) or cpu (the C++ kernel)",
    )


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The engine flags a command was given, as ``from_pretrained``'s arguments."""

    stages: list[str] | None
    dtype: str | None
    mesh: dict[str, int] | None
    max_num_seqs: int | None
    max_model_len: int | None
    page_size: int | None
    max_num_batched_tokens: int | None
    stage_config: str | None
    num_pages: int | None = None
    attention_backend: str = "auto"
    limit_mm_per_prompt: dict[str, int] | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        """The options parsed by a parser :func:`add_engine_arguments` filled (a planning
        parser's absent flags take their defaults); ``ValueError`` for a malformed ``--mesh``."""
        from omni_jax.parallel.mesh import parse_mesh

        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        if given["mesh"] is not None:
            given["mesh"] = parse_mesh(given["mesh"])
        return cls(**given)

    def pipeline_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``OmniJaxPipeline.from_pretrained`` (and the async pipeline's)."""
        return dataclasses.asdict(self)

    def plan_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`~omni_jax.planning.plan_memory`: the pipeline's, less
        those that do not change its memory."""
        kwargs = self.pipeline_kwargs()
        for name in ("num_pages", "attention_backend"):
            del kwargs[name]
        return kwargs
