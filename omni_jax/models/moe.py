"""Sparse mixture-of-experts MLP (Qwen3-Omni's thinker and talker), as one batched computation.

Routing is transformers' ``Qwen3OmniMoe*TextTopKRouter``: float32 softmax over the router
logits, top-k, optionally renormalised over the k chosen (``norm_topk_prob``), cast back to the
activations' dtype. The talker's block adds a shared SwiGLU expert scaled by a sigmoid gate
(:attr:`MoESpec.shared_expert_size`).

How the experts run: the ``N * k`` (token, expert) assignments are sorted by expert, so each
expert's rows are contiguous, and each projection is one grouped matmul over all experts,
``jax.lax.ragged_dot(rows [N*k, D], weights [E, D, I], rows per expert [E])``. There is no
loop over experts, no capacity (no token is ever dropped, whatever the routing) and no
scatter-add: the rows go back to (token, slot) order by a permutation and each token sums its
k weighted outputs in a fixed order, so results are deterministic. Every row is multiplied by
its own expert's weights only, so float32 results are the reference's up to summation order.

Why a grouped matmul: it is the one formulation whose cost is the chosen experts' work and
whose memory is the activations' (a per-token gather of expert weights reads ``N * k`` weight
matrices; computing every expert for every token costs ``E / k`` times the FLOPs). How fast it
runs is the backend's lowering of ``ragged_dot``: a grouped GEMM on TPUs (the ragged-dot
instruction); on CPUs, and on GPUs with jax 0.11 (whose Pallas Triton lowering,
``jax_ragged_dot_use_gpu_pallas_triton_lowering``, is missing from the wheel: it raises
``ModuleNotFoundError``), XLA expands it into an exact masked dense product over all experts
(``E`` times the FLOPs, ``E * N * k * D`` temporary values). Where that is so, the block runs
every expert on every row instead (:func:`dense_experts`: plain matmuls, ``E / k`` times the
routed FLOPs, ``E * N * I`` temporary values) and weights each expert's output by the row's
routing weight for it, zero where it was not chosen. That reads every expert's weights, which a
step with few rows does not need: a decode step of one row routes ``k`` of Qwen3-Omni's 128
experts, and its cost is the bytes it reads. So on CPUs a step that routes fewer (row, expert)
pairs than the experts runs them one pair at a time (:func:`assigned_experts`), reading only
the chosen experts' weights; on GPUs, where a loop's cost is its kernels, a step of few pairs
gathers their experts at once (:func:`gathered_experts`: a fixed number of kernels). :func:`expert_path`
picks: ``grouped`` on TPUs; ``assigned`` for such steps and ``dense`` for the rest on CPUs;
``gathered`` for steps of at most an eighth as many pairs as experts and ``dense`` for the rest
on GPUs (:data:`GATHERED_SHARE`); or what ``OMNI_JAX_MOE`` names. The numbers
are the same every way in float32 (up to summation order); in bfloat16 ``assigned`` rounds as
``grouped`` does and ``dense`` otherwise, so on a CPU or a GPU a row's bfloat16 output can
depend on how many rows its step routes.

Experts are stored stacked, ``gate_proj``/``up_proj`` ``[E, D, I]`` and ``down_proj``
``[E, I, D]``, so a mesh axis can split the experts (first axis) or their intermediate width.
Checkpoints on disk hold one tensor per expert (``mlp.experts.{e}.gate_proj.weight``), while
transformers' modules hold them fused (``gate_up_proj [E, 2I, D]``, ``down_proj [E, D, I]``);
:func:`stack_expert_readers` turns either into one stacked tensor per projection, read
lazily (:class:`StackedExperts`), which :data:`EXPERT_RULES` then map.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from omni_jax.host_copy import copy_into
from omni_jax.models.formulation import formulation
from omni_jax.models.layers import SwiGLU
from omni_jax.models.param_map import ParamMismatchError, ParamRule, linear_kernel
from omni_jax.parallel.rules import ShardRule
from omni_jax.safetensors_io import TensorReader


@dataclasses.dataclass(frozen=True)
class MoESpec:
    """The parts of an HF MoE text config the sparse block needs, hashable for jit.

    shared_expert_size: intermediate width of the always-on shared expert (the talker's
        ``shared_expert_intermediate_size``); 0 for none (the thinker).
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    shared_expert_size: int = 0

    @classmethod
    def from_hf(cls, cfg: Any, *, shared_expert: bool = False) -> MoESpec:
        """From a ``Qwen3OmniMoeTextConfig`` (``shared_expert=False``) or a talker text config
        (``shared_expert=True``, which reads ``shared_expert_intermediate_size``)."""
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported MoE activation {act!r} (supported: silu)")
        if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
            raise ValueError(f"num_experts_per_tok {cfg.num_experts_per_tok} not in 1..{cfg.num_experts}")
        return cls(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.moe_intermediate_size,
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            norm_topk_prob=bool(cfg.norm_topk_prob),
            shared_expert_size=cfg.shared_expert_intermediate_size if shared_expert else 0,
        )


MOE_SWITCH = "OMNI_JAX_MOE"
"""Environment variable naming the experts' formulation, read when a block is traced:
``grouped``, ``dense``, ``assigned``, ``gathered`` or ``auto`` (unset: ``auto``,
:func:`expert_forms`)."""

MOE_FORMS = ("grouped", "dense", "assigned", "gathered")


GATHERED_SHARE = 8
"""On GPUs, ``gathered`` runs a step of at most ``experts // GATHERED_SHARE`` pairs, ``dense``
the rest: gathering copies each pair's expert before the products read it, and on an H200 at
Qwen3-Omni's widths it ran faster than dense at 8 and 16 pairs of 128 experts, slower from 32
(``benchmarks/RESULTS.md``, seventh GPU session)."""


def expert_forms() -> tuple[str, ...]:
    """The formulations a block may run, depending on how many rows a step routes
    (:func:`expert_path`): the one ``OMNI_JAX_MOE`` names; else ``grouped`` (``ragged_dot``) on
    TPUs, whose ragged dot is a grouped GEMM; else, where XLA lowers ``ragged_dot`` to a masked
    dense product over every expert for every routed row (``E`` times the routed FLOPs, against
    ``E / k`` for dense; measured slower than dense at Qwen3-Omni's widths on a GPU:
    ``benchmarks/RESULTS.md``, MoE formulations), a sparse form and ``dense``: ``assigned`` on
    CPUs (pair by pair measured faster below as many pairs as experts: ``benchmarks/RESULTS.md``,
    a decode step's experts), ``gathered`` on GPUs (:data:`GATHERED_SHARE`). ``ValueError`` on
    another value."""
    named = formulation(MOE_SWITCH, MOE_FORMS, "auto")
    if named != "auto":
        return (named,)
    return {"tpu": ("grouped",), "cpu": ("assigned", "dense"), "gpu": ("gathered", "dense")}.get(
        jax.default_backend(), ("dense",)
    )


def expert_path(pairs: int, experts: int) -> str:
    """How a block runs ``pairs`` routed (row, expert) pairs over the ``experts`` one device
    holds: the one formulation :func:`expert_forms` allows; else its sparse form where the step
    routes few enough pairs, ``dense`` otherwise. ``assigned`` reads one expert's weights per
    pair and dense every expert's once, the same products per pair: it runs below as many pairs
    as experts; ``gathered`` also copies each pair's expert first: it runs up to
    ``experts // GATHERED_SHARE`` pairs."""
    forms = expert_forms()
    if len(forms) == 1:
        return forms[0]
    sparse, dense = forms
    most = experts // GATHERED_SHARE if sparse == "gathered" else experts - 1
    return sparse if pairs <= most else dense


def route(
    logits: jax.Array, top_k: int, norm_topk_prob: bool, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """``(weights [N, k] in dtype, experts [N, k] int32)`` from router ``logits [N, E]``, as the
    reference: softmax in float32, top-k of the probabilities (descending), renormalised over
    the k when ``norm_topk_prob``, then cast to ``dtype``."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(dtype), experts.astype(jnp.int32)


class Experts(nnx.Module):
    """``E`` SwiGLU experts, stacked: ``down(silu(x @ gate[e]) * (x @ up[e]))`` for each row's ``e``."""

    def __init__(self, spec: MoESpec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        e, d, i = spec.num_experts, spec.hidden_size, spec.intermediate_size
        init = nnx.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
        )
        self.gate_proj = nnx.Param(init(rngs.params(), (e, d, i), dtype))
        self.up_proj = nnx.Param(init(rngs.params(), (e, d, i), dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (e, i, d), dtype))

    def __call__(self, x: jax.Array, experts: jax.Array, weights: jax.Array) -> jax.Array:
        """``sum_j weights[n, j] * expert_{experts[n, j]}(x[n])`` for ``x [N, D]``, ``experts``
        and ``weights`` ``[N, k]``, in the formulation :func:`expert_path` picks for this many
        pairs (see the module doc); on a mesh of several devices that does not split the
        experts, the one it picks for as many pairs as experts (XLA partitions the step).

        Under a mesh (``jax.set_mesh``) whose ``model`` axis splits the experts
        (:func:`experts_split`, as :func:`expert_partition_rules` lays them out), each device
        runs its own experts on its ``data`` share of the rows, and one all-reduce over
        ``model`` adds the devices' parts: expert parallelism, with no all-to-all because every
        device of a ``model`` group already holds the rows.
        """
        mesh = jax.sharding.get_abstract_mesh()
        model = 1 if mesh.empty else dict(mesh.shape).get("model", 1)
        params = (self.gate_proj[...], self.up_proj[...], self.down_proj[...])
        if not experts_split(params[0].shape[0], model):
            # XLA's partitioner would gather every ``data`` share's pairs into each device's loop
            # (and reduce over ``model`` inside it): pair by pair only where nothing partitions.
            one_device = mesh.empty or mesh.size == 1
            pairs = experts.size if one_device else max(experts.size, params[0].shape[0])
            return FORMULATIONS[expert_path(pairs, params[0].shape[0])](x, experts, weights, *params)
        data = dict(mesh.shape).get("data", 1)
        rows = P("data") if x.shape[0] % data == 0 else P()
        return jax.shard_map(
            _local_experts,
            in_specs=(rows, rows, rows, P("model"), P("model"), P("model")),
            out_specs=rows,
            check_vma=False,
        )(x, experts, weights, *params)


def experts_split(num_experts: int, model: int) -> bool:
    """Whether a ``model`` mesh axis of this size splits the experts themselves (whole experts
    per device); otherwise it splits every expert's intermediate width."""
    return model > 1 and num_experts % model == 0


def grouped_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
) -> jax.Array:
    """:meth:`Experts.__call__` on stacked ``gate``/``up`` ``[E, D, I]``, ``down`` ``[E, I, D]``.

    An ``experts`` id outside ``[0, E)`` (another device's) names no expert here: its pairs sort
    last, outside every group, and their outputs (whatever the backend leaves in rows no group
    covers) are zeroed, so it adds nothing, as in the other formulations.
    """
    k = experts.shape[1]
    num_experts = gate.shape[0]
    here = _named_here(experts, num_experts)
    flat = jnp.where(here, experts.reshape(-1), num_experts)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # the others' are dropped
    rows = x[order // k]
    h = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    out = jax.lax.ragged_dot(h, down, sizes)
    return _weighted_sum(jnp.zeros_like(out).at[order].set(out, unique_indices=True), here, weights)


def dense_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
) -> jax.Array:
    """:meth:`Experts.__call__` with every expert of the stack on every row: ``E`` SwiGLUs as
    batched matmuls, each output times the row's routing weight for that expert (zero where it
    was not chosen), summed over the experts. An ``experts`` id outside ``[0, E)`` (another
    device's) adds nothing."""
    chosen = experts[..., None] == jnp.arange(gate.shape[0])  # [N, k, E]
    combine = jnp.sum(jnp.where(chosen, weights[..., None], 0), axis=1).T  # [E, N]
    # The rows once per expert, so each projection is a batched matmul over the experts: XLA's
    # CPU dot of unbatched rows against a stack of weights is far slower (a decode row reads the
    # stack well short of the memory bandwidth).
    xs = jnp.broadcast_to(x, (gate.shape[0], *x.shape))
    h = jax.nn.silu(jnp.einsum("end,edi->eni", xs, gate)) * jnp.einsum("end,edi->eni", xs, up)
    out = jnp.einsum("eni,eid->end", h, down)
    return jnp.sum(out * combine[..., None].astype(out.dtype), axis=0)


def assigned_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
) -> jax.Array:
    """:meth:`Experts.__call__` one (row, expert) pair at a time, in a loop over the ``N * k``
    pairs: each takes its expert's weights from the stack by a dynamic index (XLA's CPU copies
    that one expert, ``3 * D * I`` values, and multiplies; a gather of every chosen expert at
    once would hold ``N * k`` of them), so the step reads only the chosen experts. Each pair's
    output times its routing weight, summed over the row's k in slot order as
    :func:`grouped_experts`. An ``experts`` id outside ``[0, E)`` (another device's, under expert
    parallelism) adds nothing, though its iteration still runs, on expert 0's weights: each
    device loops over all of its rows' pairs."""
    rows, ids, here = _pairs(x, experts, gate.shape[0])

    def pair(_: None, row_and_id: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        row, e = row_and_id
        g, u, d = (jax.lax.dynamic_index_in_dim(w, e, keepdims=False) for w in (gate, up, down))
        return None, (jax.nn.silu(row @ g) * (row @ u)) @ d

    _, out = jax.lax.scan(pair, None, (rows, ids))
    return _weighted_sum(out, here, weights)


def gathered_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
) -> jax.Array:
    """:meth:`Experts.__call__` with every pair's expert gathered from the stack at once
    (``N * k`` copies of ``3 * D * I`` values), then one batched matrix-vector product per
    projection: the chosen experts' bytes, like :func:`assigned_experts`, in a fixed number of
    operations instead of a loop over the pairs, for backends whose cost is per operation
    launched (a GPU's kernels): a GPU's steps of few pairs (:func:`expert_path`). Ids outside
    ``[0, E)`` add nothing."""
    rows, ids, here = _pairs(x, experts, gate.shape[0])
    g, u, d = (jnp.take(w, ids, axis=0) for w in (gate, up, down))
    h = jax.nn.silu(jnp.einsum("pd,pdi->pi", rows, g)) * jnp.einsum("pd,pdi->pi", rows, u)
    return _weighted_sum(jnp.einsum("pi,pid->pd", h, d), here, weights)


def _pairs(x: jax.Array, experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The ``N * k`` (row, expert) pairs of ``experts [N, k]`` in (row, slot) order: each pair's
    row of ``x``, its expert id (0 for an id outside ``[0, num_experts)``), and whether the id
    names one of these experts."""
    here = _named_here(experts, num_experts)
    return jnp.repeat(x, experts.shape[1], axis=0), jnp.where(here, experts.reshape(-1), 0), here


def _named_here(experts: jax.Array, num_experts: int) -> jax.Array:
    """Whether each of the ``N * k`` ids of ``experts [N, k]``, in (row, slot) order, names one
    of this device's ``num_experts`` (another device's id, under expert parallelism, does not)."""
    ids = experts.reshape(-1)
    return (ids >= 0) & (ids < num_experts)


def _weighted_sum(out: jax.Array, here: jax.Array, weights: jax.Array) -> jax.Array:
    """Per row, its pairs' outputs ``out [N * k, D]`` (zero where ``here`` is false) times their
    routing ``weights [N, k]``, summed over the k in slot order (every formulation's last step)."""
    n, k = weights.shape
    pairs = jnp.where(here[:, None], out, 0).reshape(n, k, out.shape[-1])  # N may be 0
    return jnp.sum(pairs * weights[..., None], axis=1)


FORMULATIONS: dict[str, Callable[..., jax.Array]] = {
    "grouped": grouped_experts,
    "dense": dense_experts,
    "assigned": assigned_experts,
    "gathered": gathered_experts,
}
""":data:`MOE_FORMS` -> the function that runs the experts so, on one device's stack:
``(x, experts, weights, gate, up, down) -> [N, D]``."""


def _local_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
) -> jax.Array:
    """One device's part under :func:`jax.shard_map`: its experts' outputs (the others' slots
    zero), summed over the ``model`` axis; the formulation by this device's pairs and experts."""
    per_device = gate.shape[0]
    local = experts - jax.lax.axis_index("model") * per_device
    path = expert_path(local.size, per_device)
    return jax.lax.psum(FORMULATIONS[path](x, local, weights, gate, up, down), "model")


class SparseMoeBlock(nnx.Module):
    """``Qwen3OmniMoeThinkerTextSparseMoeBlock``, or with a shared expert the talker's
    ``Qwen3OmniMoeTalkerTextSparseMoeBlock``: router (``gate``), routed ``experts``, and
    ``shared_expert`` scaled by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, spec: MoESpec, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs):
        kw: dict[str, Any] = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.spec = spec
        self.gate = nnx.Linear(spec.hidden_size, spec.num_experts, **kw)
        self.experts = Experts(spec, dtype=dtype, rngs=rngs)
        if spec.shared_expert_size:
            self.shared_expert = SwiGLU(spec.hidden_size, spec.shared_expert_size, dtype=dtype, rngs=rngs)
            self.shared_expert_gate = nnx.Linear(spec.hidden_size, 1, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [..., D]`` -> ``[..., D]``; every row is routed (padding rows too: harmless)."""
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = route(self.gate(flat), self.spec.top_k, self.spec.norm_topk_prob, x.dtype)
        out = self.experts(flat, experts, weights)
        if self.spec.shared_expert_size:
            out = out + jax.nn.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(x.shape)


def expert_kernel(x: np.ndarray | StackedExperts) -> np.ndarray | StackedExperts:
    """Stacked torch ``[E, out, in]`` -> ``[E, in, out]`` (a view; lazy for :class:`StackedExperts`)."""
    return x.swapaxes(-1, -2)


EXPERT_RULES: tuple[ParamRule, ...] = (
    ParamRule(r"gate\.weight", "gate.kernel", linear_kernel),
    ParamRule(r"experts\.(?P<proj>gate|up|down)_proj", r"experts.\g<proj>_proj", expert_kernel),
    ParamRule(
        r"shared_expert\.(?P<proj>gate|up|down)_proj\.weight",
        r"shared_expert.\g<proj>_proj.kernel",
        linear_kernel,
    ),
    ParamRule(r"shared_expert_gate\.weight", "shared_expert_gate.kernel", linear_kernel),
)
"""Names under an HF sparse block (``...mlp.``) -> :class:`SparseMoeBlock` paths, the experts'
as :func:`stack_expert_readers` gives them (one stacked tensor per projection). Groups are
named, so a decoder can put the rules under a pattern with groups of its own (the layer)."""


def expert_partition_rules(prefix: str, spec: MoESpec, model: int) -> tuple[ShardRule, ...]:
    """How a ``model`` mesh axis splits the sparse blocks whose paths match ``prefix`` (a regex
    ending in the block's dot): whole experts per device when :func:`experts_split` (the layout
    :meth:`Experts.__call__` runs in parallel), else each expert's intermediate width, as a
    dense MLP (gate/up by columns, down by rows; XLA partitions the grouped matmuls). Either way
    the block ends in one all-reduce. The router stays whole; a shared expert splits as a
    dense MLP."""
    if experts_split(spec.num_experts, model):
        experts = (
            ShardRule(prefix + r"experts\.(gate|up)_proj", ("model", None, None)),
            ShardRule(prefix + r"experts\.down_proj", ("model", None, None)),
        )
    else:
        experts = (
            ShardRule(prefix + r"experts\.(gate|up)_proj", (None, None, "model")),
            ShardRule(prefix + r"experts\.down_proj", (None, "model", None)),
        )
    return (
        *experts,
        ShardRule(prefix + r"shared_expert\.(gate|up)_proj\.kernel", (None, "model")),
        ShardRule(prefix + r"shared_expert\.down_proj\.kernel", ("model", None)),
    )


class StackedExperts:
    """``[E, *shape]``: expert ``e`` is ``per_expert(readers[e]())``, read only when a slice needs it.

    What :func:`stack_expert_readers` gives for a checkpoint's per-expert tensors: a parameter
    placed on a mesh reads only the experts of each device's shard
    (:func:`omni_jax.parallel.rules.put_cast` slices it), and the stack is never copied whole
    except into its final array. ``per_expert`` is a view (see :meth:`swapaxes`).
    """

    def __init__(
        self,
        readers: Sequence[TensorReader],
        name: str,
        per_expert: Callable[[np.ndarray], np.ndarray] = lambda w: w,
    ):
        self.readers, self.name, self.per_expert = tuple(readers), name, per_expert
        first = per_expert(self.readers[0]())  # maps expert 0; reads no bytes
        self.shape: tuple[int, ...] = (len(self.readers), *first.shape)
        self.dtype: np.dtype = first.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def swapaxes(self, a: int, b: int) -> StackedExperts:
        """The stack with two per-expert axes swapped (negative axes, as :func:`expert_kernel` uses)."""
        if a >= 0 or b >= 0:
            raise ValueError("StackedExperts.swapaxes takes per-expert axes, counted from the end")
        per = self.per_expert
        return StackedExperts(self.readers, self.name, lambda w: np.swapaxes(per(w), a, b))

    def expert(self, e: int) -> np.ndarray:
        """Expert ``e`` (a view of its tensor), checked against expert 0's shape."""
        w = self.per_expert(self.readers[e]())
        if w.shape != self.shape[1:]:
            raise ParamMismatchError(
                f"expert {e} of {self.name!r} has shape {w.shape}, expert 0 has {self.shape[1:]}"
            )
        return w

    def __getitem__(self, index: slice | tuple[slice, ...]) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        first, rest = index[0], index[1:]
        experts = range(*first.indices(self.shape[0]))
        shape = np.broadcast_to(np.empty((), self.dtype), self.shape[1:])[rest].shape  # no bytes
        out = np.empty((len(experts), *shape), self.dtype)
        for k, e in enumerate(experts):
            copy_into(out[k], self.expert(e)[rest])  # a swapped view is copied in tiles
        return out

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        del copy  # the stack is always a new array
        whole = self[(slice(None),)]
        return whole if dtype is None else whole.astype(dtype, copy=False)


_PER_EXPERT = re.compile(r"((?:.*\.)?experts)\.(\d+)\.(gate|up|down)_proj\.weight")
_FUSED_GATE_UP = re.compile(r"((?:.*\.)?experts)\.gate_up_proj")


def stack_expert_readers(
    tensors: Iterable[tuple[str, TensorReader]],
) -> Iterator[tuple[str, TensorReader]]:
    """The tensors of a checkpoint with its experts' stacked, one tensor per projection.

    ``<p>.experts.{e}.{gate,up,down}_proj.weight`` (``[out, in]`` each, as checkpoints store
    them) become ``<p>.experts.{gate,up,down}_proj`` ``[E, out, in]`` (:class:`StackedExperts`),
    given once the stream ends (a layer's experts may span files). transformers' in-memory
    fused ``<p>.experts.gate_up_proj [E, 2I, D]`` is split into the same two names (views);
    its ``<p>.experts.down_proj`` already has its stacked name and layout. Other tensors pass
    through as they come. A missing or repeated expert raises :class:`ParamMismatchError`.
    """
    groups: dict[str, dict[int, TensorReader]] = {}
    for name, read in tensors:
        per_expert = _PER_EXPERT.fullmatch(name)
        fused = _FUSED_GATE_UP.fullmatch(name)
        if per_expert:
            collect_numbered(groups, f"{per_expert[1]}.{per_expert[3]}_proj", int(per_expert[2]), name, read)
        elif fused:
            yield f"{fused[1]}.gate_proj", lambda read=read: _half(read(), 0)
            yield f"{fused[1]}.up_proj", lambda read=read: _half(read(), 1)
        else:
            yield name, read
    yield from stacked_groups(groups, "experts")


def collect_numbered(
    groups: dict[str, dict[int, TensorReader]], stacked: str, index: int, name: str, read: TensorReader
) -> None:
    """File tensor ``name`` (``read``) as number ``index`` of the stack ``stacked``; a number
    given twice raises :class:`ParamMismatchError`."""
    group = groups.setdefault(stacked, {})
    if index in group:
        raise ParamMismatchError(f"tensor {name!r} appears a second time")
    group[index] = read


def stacked_groups(
    groups: dict[str, dict[int, TensorReader]], what: str
) -> Iterator[tuple[str, TensorReader]]:
    """Each stack of :func:`collect_numbered` as one lazily read tensor (:class:`StackedExperts`,
    in number order); a gap in its numbers raises :class:`ParamMismatchError` naming the missing
    ``what`` (experts, codebooks)."""
    for stacked, group in groups.items():
        missing = sorted(set(range(max(group) + 1)) - group.keys())
        if missing:
            raise ParamMismatchError(f"{stacked!r}: the checkpoint lacks {what} {missing}")
        readers = [group[i] for i in range(len(group))]
        yield stacked, lambda readers=readers, stacked=stacked: StackedExperts(readers, stacked)


def stack_expert_arrays(tensors: Iterable[tuple[str, np.ndarray]]) -> Iterator[tuple[str, Any]]:
    """:func:`stack_expert_readers` for ``(name, array)`` pairs (what
    :func:`omni_jax.models.loading.build_model` takes); stacked experts stay lazy."""
    readers = ((name, lambda array=array: array) for name, array in tensors)
    return ((name, read()) for name, read in stack_expert_readers(readers))


def _half(gate_up: np.ndarray, which: int) -> np.ndarray:
    """Gate (0) or up (1) half of a fused ``[E, 2I, D]`` tensor, as the reference chunks it."""
    i = gate_up.shape[1] // 2
    return gate_up[:, which * i : (which + 1) * i]
