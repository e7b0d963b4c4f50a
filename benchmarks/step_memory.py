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
``--model N`` splits the decoder over a ``model`` mesh axis of N devices by Qwen2's partition
rules and compares one device's share (on CPU, emulate the devices with
``XLA_FLAGS=--xla_force_host_platform_device_count=N``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from transformers import Qwen2Config

from omni_jax.cpu_schedule import concurrency_scheduler
from omni_jax.engine.ar_runner import _forward_fn
from omni_jax.engine.buckets import max_sequence_rows
from omni_jax.engine.kv_cache import init_kv_cache
from omni_jax.engine.step import FlatStep
from omni_jax.models.qwen2 import Qwen2ForCausalLM, Qwen2Spec, partition_rules
from omni_jax.parallel.rules import layout
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
    widths: dict[str, int] = QWEN2_7B,
    model_axis: int = 1,
) -> StepMemory:
    """Plan and compile the largest step of a ``layers``-layer decoder of ``widths`` in
    ``dtype`` with a token budget of ``budget`` (``max_num_batched_tokens``) on ``backend``'s
    attention, on this process's default device, or split over a ``model`` axis of the first
    ``model_axis`` devices (one device's share, as the stage would place it)."""
    config = Qwen2Config(**widths, num_hidden_layers=layers)
    spec = Qwen2Spec.from_hf(config)
    model = nnx.eval_shape(lambda: Qwen2ForCausalLM(spec, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))
    mesh = None
    rules = partition_rules(spec, model_axis)
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
            i32(n, 1),
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
        prog="python -m benchmarks.step_memory", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (a power of two)")
    parser.add_argument("--backend", choices=("jnp", "auto"), default="jnp")
    parser.add_argument("--model", type=int, default=1, help="devices of a model (tensor-parallel) axis")
    args = parser.parse_args()
    if args.model > len(jax.devices()):
        parser.error(f"--model {args.model}: this process has {len(jax.devices())} devices")
    m = step_memory(args.dtype, args.layers, args.budget, args.backend, model_axis=args.model)
    mib = 1 << 20
    scheduler = ""
    if jax.default_backend() == "cpu":
        scheduler = f", XLA's {'concurrency' if concurrency_scheduler() else 'depth-first'} scheduler"
    print(
        f"Qwen2-7B widths, {args.layers} layers, {args.dtype}, budget {args.budget}, "
        f"model axis {args.model}, {args.backend} attention, {jax.default_backend()}{scheduler}: "
        f"estimate {m.estimate / mib:.0f} MiB, XLA {m.xla / mib:.0f} MiB, ratio {m.ratio:.2f}"
    )


if __name__ == "__main__":
    main()
