"""An encoder's compiled programs (:class:`EncoderPrograms`), and what one call holds on its devices.

A thinker's encoders run on the AR stage's devices between its steps, and their largest calls
are not small beside the step (Qwen2.5-Omni-7B's 256-chunk audio call and 16384-patch vision
call each take over a GiB of temporaries): a cache sized without them would leave the first
long clip or large image to an out-of-memory error. So the memory plan counts the largest call
of each encoder (:func:`call_bytes`, the ``encoder`` of
:class:`~omni_jax.engine.memory.ARMemory`).

The count is XLA's own (``memory_analysis().temp_size_in_bytes``) of the stage's program for
the call, compiled from shapes (nothing is allocated) for this host's CPU in float32, once per
process: float32 counts every value at full width, where an accelerator's bfloat16 values take
half, and the CPU multiplies bfloat16 in float32 anyway. The whole encoder is compiled, not a
part that would stand for it: XLA's CPU scheduler holds some values of one layer into the next
(Qwen3-Omni's vision encoder holds about 120 MiB more with each layer at 16384 patches,
``benchmarks/RESULTS.md``), so a few layers do not tell the rest. That scheduler is the host's:
which one XLA took when its CPU backend started (:mod:`omni_jax.cpu_schedule`) moves the count
(Qwen2.5-Omni-7B's vision call: 1833 MiB under the default, 1379 MiB depth-first), on a plan for
a GPU too, where whether these counts bound the bfloat16 program's is still to be measured
(``benchmarks/gpu.sh``'s ``step_memory`` part). Without a CPU backend (``JAX_PLATFORMS=cuda``)
the float32 program is compiled for the default device and counted there. An analytic count would have
to follow every encoder's operations and be kept in step with them; this follows the code.
Beside the temporaries, a call holds its inputs and its output (counted in float32 too), and the
stage reads one call's output while the next runs (two outputs at once); on CPU, a bfloat16
encoder also holds its weights' float32 copies (:func:`~omni_jax.cpu_schedule.weight_copies`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax.cpu_schedule import weight_copies
from omni_jax.jit import compute_dtype, exact_matmuls


class CallBatch(Protocol):
    """An encoder call's input record: its fields' shapes for a call of ``size``."""

    @classmethod
    def shapes(cls, spec: Any, size: int) -> Any: ...


Output = Callable[[Any], jax.Array] | None


class EncoderPrograms:
    """One encoder's compiled programs, one per input shape: compiled ahead of traffic by
    :meth:`compile` (warm-up, from shapes alone) or at a shape's first call, then reused.
    ``output``, traced into them, makes the encoder's output the one ``[rows, width]`` array a
    step merges (default: the output as it is)."""

    def __init__(self, graphdef: nnx.GraphDef, output: Output = None):
        def encode(state: nnx.State, batch: Any) -> jax.Array:
            with exact_matmuls(compute_dtype(state)):
                out = nnx.merge(graphdef, state)(batch)
                return out if output is None else output(out)

        self._jit = jax.jit(encode)
        self._compiled: dict[tuple[Any, ...], jax.stages.Compiled] = {}

    def compile(self, state: nnx.State, batch: Any) -> jax.stages.Compiled:
        """The program for ``batch``'s shapes (arrays or ``jax.ShapeDtypeStruct``)."""
        key = tuple((tuple(x.shape), np.dtype(x.dtype)) for x in jax.tree.leaves(batch))
        if key not in self._compiled:
            self._compiled[key] = self._jit.lower(state, batch).compile()
        return self._compiled[key]

    def ahead(self, state: nnx.State, batch: Any) -> EncoderCall:
        """``batch``'s program as a :func:`compile_ahead` call (compiled on its threads,
        side by side with the others)."""
        return EncoderCall(self, state, batch)

    def __call__(self, state: nnx.State, batch: Any) -> jax.Array:
        return self.compile(state, batch)(state, batch)

    def __len__(self) -> int:
        return len(self._compiled)


@dataclasses.dataclass(frozen=True)
class EncoderCall:
    """One encoder program to compile ahead of traffic: its programs, weights and input shapes."""

    programs: EncoderPrograms
    state: nnx.State
    batch: Any  # the encoder's batch record, of arrays or jax.ShapeDtypeStruct

    def compile(self) -> jax.stages.Compiled:
        return self.programs.compile(self.state, self.batch)


def tree_bytes(tree: Any) -> int:
    """Bytes of ``tree``'s arrays (or their shapes)."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _on_host(tree: Any) -> Any:
    """``tree``'s shapes placed on this host's CPU (the default device without a CPU backend)."""
    try:
        device = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        device = jax.local_devices()[0]
    on = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on), tree)


@dataclasses.dataclass(frozen=True)
class CallBytes:
    """What one encoder call holds on a device: ``running``, while it runs (temporaries, inputs,
    output, and on CPU its weights' float32 copies), and ``output``, its output alone, which
    stays while the stage reads it and the next call runs."""

    running: int
    output: int


@functools.cache
def float32_call(
    encoder: type[nnx.Module], spec: Hashable, batch: type[CallBatch], size: int, output: Output
) -> CallBytes:
    """XLA's count of a call of ``size`` (chunks, tokens) of an ``encoder`` of ``spec``, its
    output through ``output`` as the stage's program returns it, compiled for the host's CPU in
    float32, once per process."""
    model = nnx.eval_shape(lambda: encoder(spec, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    shapes = batch.shapes(spec, size)
    counted = EncoderPrograms(graphdef, output).compile(_on_host(state), _on_host(shapes)).memory_analysis()
    out = int(counted.output_size_in_bytes)
    return CallBytes(int(counted.temp_size_in_bytes) + tree_bytes(shapes) + out, out)


def call_bytes(
    encoder: nnx.Module, batch: type[CallBatch], size: int, output: Output, platform: str
) -> CallBytes:
    """What a call of ``size`` of ``encoder`` (loaded or abstract: only its spec, class and
    parameter shapes are read) holds on a device of ``platform``: :func:`float32_call`, and on
    CPU its weights' float32 copies."""
    call = float32_call(type(encoder), encoder.spec, batch, size, output)
    if platform != "cpu":
        return call
    params = jax.tree.leaves(nnx.state(encoder, nnx.Param))
    copies = weight_copies([math.prod(p.shape) for p in params], np.dtype(params[0].dtype).itemsize)
    return dataclasses.replace(call, running=call.running + copies)
