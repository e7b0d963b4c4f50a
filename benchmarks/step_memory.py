"""The memory plan's largest AR step against XLA's own count of that step's temporaries.

:attr:`~omni_jax.engine.memory.ARMemory.step_bytes` is an estimate the plan refuses caches with
before anything is allocated; XLA's buffer assignment of the compiled step
(``memory_analysis().temp_size_in_bytes``) is what the step takes. This compiles the runner's
own forward (:func:`omni_jax.engine.ar_runner._forward_fn`) at a Qwen2 decoder's widths, traced
from shapes (no weights are made), with the stage's own plan (:meth:`CachePlan.of`), and
prints both. ``tests/test_reliability_limits.py`` holds the estimate to XLA's count with it.

    python -m benchmarks.step_memory --dtype bfloat16 --layers 4 --budget 2048

XLA's CPU scheduler decides part of the answer (:mod:`omni_jax.cpu_schedule`): run it again
with ``XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false`` to see the other.
``--model N`` splits the decoder over a ``model`` mesh axis of N devices by its partition rules
and compares one device's share (on CPU, emulate the devices with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``). ``--decoder qwen3-omni`` compiles
Qwen3-Omni-30B-A3B's thinker decoder instead (its released widths and 128 experts, M-RoPE
positions), whose step the plan sizes by the experts' rows
(:meth:`~omni_jax.models.qwen3_omni.text_decoder.Qwen3OmniTextLM.activation_width`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from transformers import Qwen2Config
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig

from benchmarks.models import SMALL_QWEN3_THINKER_TEXT
from omni_jax.cli_errors import plain_text
from omni_jax.cpu_schedule import concurrency_scheduler
from omni_jax.engine.ar_runner import _forward_fn
from omni_jax.engine.buckets import max_sequence_rows
from omni_jax.engine.kv_cache import init_kv_cache
from omni_jax.engine.step import FlatStep
from omni_jax.models.qwen2 import Qwen2ForCausalLM, Qwen2Spec, partition_rules
from omni_jax.models.qwen3_omni.text_decoder import (
    Qwen3OmniTextLM,
    Qwen3OmniTextSpec,
    text_lm_partition_rules,
)
from omni_jax.parallel.rules import ShardRule, layout
from omni_jax.stages.ar import CachePlan

QWEN2_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
}
"""Qwen2-7B's (and the Qwen2.5-Omni-7B thinker's) decoder widths."""

QWEN3_OMNI_30B = {**SMALL_QWEN3_THINKER_TEXT, "num_experts": 128}
"""Qwen3-Omni-30B-A3B's thinker decoder widths, the release's 128 experts (``small`` has 16)."""


@dataclasses.dataclass(frozen=True)
class Decoder:
    """A decoder the step is compiled for: its default ``widths`` (a transformers text config's
    fields), its ``spec`` from them at a number of layers, its ``model`` class and partition
    ``rules``, and the leading axes of a token's rotary position (``()`` RoPE, ``(3,)`` M-RoPE)."""

    label: str
    widths: dict[str, Any]
    spec: Callable[[dict[str, Any], int], Qwen2Spec]
    model: type[Qwen2ForCausalLM]
    rules: Callable[[Any, int], tuple[ShardRule, ...]]
    position_axes: tuple[int, ...]


DECODERS = {
    "qwen2": Decoder(
        "Qwen2-7B widths",
        QWEN2_7B,
        lambda widths, layers: Qwen2Spec.from_hf(Qwen2Config(**widths, num_hidden_layers=layers)),
        Qwen2ForCausalLM,
        partition_rules,
        (),
    ),
    "qwen3-omni": Decoder(
        "Qwen3-Omni-30B-A3B thinker widths",
        QWEN3_OMNI_30B,
        lambda widths, layers: Qwen3OmniTextSpec.from_hf(
            Qwen3OmniMoeTextConfig(**{**widths, "num_hidden_layers": layers})
        ),
        Qwen3OmniTextLM,
        text_lm_partition_rules,
        (3,),
    ),
}


@dataclasses.dataclass(frozen=True)
class StepMemory:
    estimate: int  # ARMemory.step_bytes, as the stage plans it
    xla: int  # XLA's temporaries of the compiled step

    @property
    def ratio(self) -> float:
        return self.estimate / self.xla


def step_memory(
    dtype: str,
    layers: int,
    budget: int,
    backend: str = "jnp",
    max_num_seqs: int = 16,
    max_model_len: int = 4096,
    page_size: int = 16,
    widths: dict[str, Any] | None = None,
    model_axis: int = 1,
    decoder: str = "qwen2",
) -> StepMemory:
    """Plan and compile the largest step of a ``layers``-layer ``decoder`` (:data:`DECODERS`) of
    ``widths`` (default: its own) in ``dtype`` with a token budget of ``budget``
    (``max_num_batched_tokens``) on ``backend``'s attention, on this process's default device, or
    split over a ``model`` axis of the first ``model_axis`` devices (one device's share, as the
    stage would place it)."""
    family = DECODERS[decoder]
    spec = family.spec(family.widths if widths is None else widths, layers)
    model = nnx.eval_shape(lambda: family.model(spec, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))
    mesh = None
    rules = family.rules(spec, model_axis)
    if model_axis > 1:
        mesh = Mesh(np.array(jax.devices()[:model_axis]).reshape(1, model_axis), ("data", "model"))
    plan = CachePlan.of(
        model,
        mesh,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        page_size=page_size,
        max_num_batched_tokens=budget,
        rules=rules,
    )
    g, mem = plan.geometry, plan.memory
    graphdef, state = nnx.split(model)
    n, s, p = mem.max_token_rows, max_sequence_rows(max_num_seqs), g.pages_per_seq
    cache = jax.eval_shape(
        lambda: init_kv_cache(g.num_layers, g.num_kv_heads, p + 1, page_size, g.head_dim, g.dtype)
    )
    replicated = None
    if mesh is not None:  # parameters split by the rules, the cache by KV heads, the rest replicated
        place = layout(rules, mesh)
        flat = nnx.to_flat_state(state)
        state = nnx.from_flat_state(
            {path: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=place(path, v.shape)) for path, v in flat}
        )
        on_heads = NamedSharding(mesh, P("model"))
        cache = jax.tree.map(lambda c: jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=on_heads), cache)
        replicated = NamedSharding(mesh, P())
    leaves, treedef = jax.tree.flatten(state)

    def i32(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=replicated)

    step = FlatStep(i32(n, 1), i32(s, p), i32(n), i32(n), i32(n))
    forward = jax.jit(
        functools.partial(_forward_fn, graphdef, treedef, feed=None),
        donate_argnames=("kv_cache", "ids"),
        static_argnames=("backend", "chunk_bytes", "capture_hidden", "capture_layer", "last_hidden"),
    )
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        lowered = forward.lower(
            leaves,
            cache,
            i32(max_num_seqs, g.max_model_len),
            i32(s),
            None,
            i32(n, 1),
            i32(n),
            i32(*family.position_axes, n, 1),
            step,
            i32(s),
            i32(s),
            None,
            backend=backend,
            chunk_bytes=mem.chunk_bytes,
            capture_hidden=False,
            capture_layer=None,
            last_hidden=False,
        )
    compiled = lowered.compile()
    return StepMemory(mem.step_bytes, compiled.memory_analysis().temp_size_in_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.step_memory", description=plain_text(__doc__.split("\n\n")[0])
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (a power of two)")
    parser.add_argument("--backend", choices=("jnp", "auto"), default="jnp")
    parser.add_argument("--model", type=int, default=1, help="devices of a model (tensor-parallel) axis")
    parser.add_argument("--decoder", choices=sorted(DECODERS), default="qwen2")
    args = parser.parse_args()
    if args.model > len(jax.devices()):
        parser.error(f"--model {args.model}: this process has {len(jax.devices())} devices")
    m = step_memory(
        args.dtype, args.layers, args.budget, args.backend, model_axis=args.model, decoder=args.decoder
    )
    mib = 1 << 20
    scheduler = ""
    if jax.default_backend() == "cpu":
        scheduler = f", XLA's {'concurrency' if concurrency_scheduler() else 'depth-first'} scheduler"
    print(
        f"{DECODERS[args.decoder].label}, {args.layers} layers, {args.dtype}, budget {args.budget}, "
        f"model axis {args.model}, {args.backend} attention, {jax.default_backend()}{scheduler}: "
        f"estimate {m.estimate / mib:.0f} MiB, XLA {m.xla / mib:.0f} MiB, ratio {m.ratio:.2f}"
    )


if __name__ == "__main__":
    main()
