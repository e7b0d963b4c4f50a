"""Runs scheduled AR steps: packs rows into bucketed host arrays, calls the jitted programs.

A step is a forward and a sampler program, and a log-probabilities program when a row asks
for them. The forward is a pure function of ``(params, kv_cache, inputs, metadata)`` that
donates the cache, so the cache is updated in place on device; it returns the logits of each
sequence's last token (kept on device), whether each of them is finite, and, when the stage
captures them (:attr:`ARRunner.capture_hidden`), every token's final hidden state and input
embedding. The sampler draws from the logits. A step is dispatched (:meth:`ARRunner.dispatch`)
and read later (:meth:`ARRunner.fetch`), so the engine may schedule the next step in between;
a row whose input token the step before drew and the host has not read takes it from that
step's draw on the device. The host reads the sampled tokens and the finite flags, and
log-probabilities, hidden states and input embeddings only for steps with a request that asked
for them. What is particular to a model (rotary positions, the extra
inputs its embedding merges) comes from the stage's :class:`~omni_jax.engine.step.StepInputs`.

Compile once: the programs are a small closed set, all compiled by :meth:`ARRunner.warmup`.
A stage whose model does more with each drawn token on device (a
:class:`~omni_jax.engine.step.DrawHook`: e.g. a talker-like stage's code predictor) adds one program per
sequence bucket and hook form, fed the sampled tokens and the final hidden state of each
sequence's last token, which the forward then returns too.
The forward's shape is its token rows (:meth:`ARRunner.rows_bucket`; with the jnp attention
path also its block-table width); everything else is a function of those: the sequences it
computes logits for (:meth:`ARRunner.sequences`), and whether it returns hidden states (fixed
per stage before warm-up: set by the pipeline when the next stage reads them). Splitting the
sampler out makes its variants (greedy, sampled, with penalties, log-probs) a sum over
sequence buckets instead of a product with the token-row buckets. Block tables are per
sequence, ``[sequences, pages]``, expanded to the token rows on device.

A step is flat: every scheduled token is a row of its own (``[tokens, 1]``), with its
sequence's block table and its own causal horizon as context length, the layout vLLM calls
flattened tokens. The matmuls, most of a step's compute, then see exactly the step's tokens,
where a ``[rows, tokens]`` block would pad every prompt chunk to the step's longest. A prompt
chunk's tokens attend through the decode path, each to its own prefix; the step writes all
its keys and values before any attention reads them, so a token sees the earlier tokens of
its own chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.engine.buckets import (
    MIN_ROWS,
    bucket,
    fine_bucket,
    max_sequence_rows,
    max_token_rows,
    round_up,
)
from omni_jax.engine.compilation import ProgramCall, compile_ahead
from omni_jax.engine.in_flight import on_host
from omni_jax.engine.kv_cache import CacheConfig, init_kv_cache, pages_needed
from omni_jax.engine.sampling import SamplingTensors, draw_tokens, pack_sampling, top_logprobs
from omni_jax.engine.step import DrawHook, FlatStep, StepInputs, StepResult, StepRow, TokenInputs
from omni_jax.jit import compute_dtype, exact_matmuls
from omni_jax.models.attention import AttentionMetadata, Backend, KVCache
from omni_jax.parallel.mesh import axis_size
from omni_jax.parallel.rules import put


class ARModel(Protocol):
    """What the engine needs of an AR model; nothing here is model-specific.

    ``embed``, ``layer_inputs``, ``forward`` and ``logits`` are a step's forward:
    ``model.forward(model.embed(tokens, extra), positions, kv_cache, md, backend,
    model.layer_inputs(tokens, extra), tap)``, where ``extra`` is the stage's packed step inputs
    (:meth:`~omni_jax.engine.step.StepInputs.pack`), ``layer_inputs`` what the model's layers
    read of them beyond the embeddings (e.g. features some layers add to their hidden states;
    ``None`` for a model whose layers read nothing more), and ``tap`` which of transformers'
    ``hidden_states`` to return beside the final ones (:attr:`ARRunner.capture_layer`;
    ``None``: none). The rest sizes the stage before
    anything is allocated (an abstract model, ``nnx.eval_shape``, answers them too):
    ``kv_cache_shape`` is ``(layers, kv_heads, head_dim)`` of the paged cache;
    ``num_query_heads`` the attention heads a query has (the cache may store KV heads
    replicated up to them); ``vocab_size`` the width of ``logits``; ``max_positions`` the
    longest sequence its positions reach; ``activation_width(model)`` how many float32 values
    one token row of a step holds at once on one device when a ``model`` mesh axis of that size
    splits the model (a dense MLP and an MoE one differ; the memory planner reads it).
    """

    def embed(self, tokens: jax.Array, extra: Any = None) -> jax.Array: ...

    def layer_inputs(self, tokens: jax.Array, extra: Any) -> Any: ...

    def forward(
        self,
        embeds: jax.Array,
        positions: jax.Array,
        kv_cache: KVCache,
        md: AttentionMetadata,
        backend: Backend,
        layer_inputs: Any,
        tap: int | None,
    ) -> tuple[jax.Array, KVCache, jax.Array | None]: ...

    def logits(self, hidden: jax.Array) -> jax.Array: ...

    def kv_cache_shape(self) -> tuple[int, int, int]: ...

    def num_query_heads(self) -> int: ...

    def vocab_size(self) -> int: ...

    def max_positions(self) -> int: ...

    def activation_width(self, model: int) -> int: ...


def _forward_fn(
    graphdef: nnx.GraphDef,
    treedef: Any,
    leaves: list[jax.Array],
    kv_cache: KVCache,
    ids: jax.Array,
    drawn: jax.Array,
    feedback: jax.Array | None,
    tokens: jax.Array,
    source: jax.Array,
    positions: jax.Array,
    step: FlatStep,
    logits_idx: jax.Array,
    id_rows: jax.Array,
    extra: Any,
    *,
    feed: Callable[[Any, jax.Array, jax.Array], Any] | None,
    backend: Backend,
    chunk_bytes: int | None,
    capture_hidden: bool,
    capture_layer: int | None,
    last_hidden: bool,
) -> tuple[Any, ...]:
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    # A pending token (``source >= 0``) is the one the step before drew, still on the device,
    # and so is what a draw hook made of it (its feedback).
    pending, index = source >= 0, jnp.maximum(source, 0)
    tokens = jnp.where(pending[:, None], drawn[index][:, None], tokens)
    # Each computed token goes to its sequence's row of the id table, at its index, where the
    # penalties read it (padding rows' writes are dropped).
    table_row = jnp.where(step.query > 0, id_rows[step.sequence], ids.shape[0])
    ids = ids.at[table_row, jnp.maximum(step.context - 1, 0)].set(tokens[:, 0], mode="drop")
    if feed is not None:  # a stage with a draw hook, whose runner keeps its feedback
        extra = feed(extra, feedback[index], pending)
    with exact_matmuls(compute_dtype(leaves)):
        embeds = model.embed(tokens, extra)
        md = step.metadata(chunk_bytes)
        tap = capture_layer if capture_hidden else None
        hidden, kv_cache, tapped = model.forward(
            embeds, positions, kv_cache, md, backend, model.layer_inputs(tokens, extra), tap
        )
        last = hidden.reshape(-1, hidden.shape[-1])[logits_idx]  # each sequence's last token
        logits = model.logits(last)
    finite = jnp.isfinite(logits).all(axis=-1)  # one pass over [rows, vocab]: a fault ends one row
    captured = ((hidden if tapped is None else tapped), embeds) if capture_hidden else None
    return logits, finite, captured, (last if last_hidden else None), kv_cache, ids


def _after_draw_fn(
    graphdef: nnx.GraphDef,
    treedef: Any,
    hook: DrawHook[Any],
    leaves: list[jax.Array],
    hidden: jax.Array,
    tokens: jax.Array,
    inputs: Any,
    *,
    width: int,
) -> tuple[Any, jax.Array]:
    """A :class:`~omni_jax.engine.step.DrawHook`'s device work on a step's drawn ``tokens``: its
    outputs, and their feedback padded to ``width`` (``max_rows``) rows, the fixed shape the next
    step's forward reads a pending token's from."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    with exact_matmuls(compute_dtype(leaves)):
        outputs = hook.run(model, hidden, tokens, inputs)
    feedback = hook.feedback(outputs)
    pad = [(0, width - feedback.shape[0])] + [(0, 0)] * (feedback.ndim - 1)
    return outputs, jnp.pad(feedback, pad)


def _draw_fn(
    logits: jax.Array,
    ids: jax.Array,
    st: SamplingTensors,
    id_rows: jax.Array,
    lengths: jax.Array,
    *,
    greedy: bool,
    penalised: bool,
    width: int,
) -> tuple[jax.Array, jax.Array]:
    """The step's tokens ``[S]``, and the same padded to ``width`` (``max_rows``), the fixed
    shape the next step's forward reads its pending tokens from. ``penalised``: the penalties
    read each row's first ``lengths`` ids from its row ``id_rows`` of the id table ``ids``
    (which the step's forward has just brought up to date)."""
    if penalised:
        known = jnp.arange(ids.shape[1])[None, :] < lengths[:, None]
        st = dataclasses.replace(st, history=jnp.where(known, ids[id_rows], -1))
    tokens = draw_tokens(logits, st, greedy=greedy)
    return tokens, jnp.pad(tokens, (0, width - tokens.shape[0]))


def _logprobs_fn(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    return top_logprobs(logits, tokens)


def _scrub_fn(kv_cache: KVCache, pages: jax.Array) -> KVCache:
    """Zero ``pages`` of every layer (out-of-range ids are dropped): a failed request's pages
    may hold NaN, which attention over a later owner's unwritten tail would read as ``0 * NaN``."""
    return [(k.at[:, pages].set(0, mode="drop"), v.at[:, pages].set(0, mode="drop")) for k, v in kv_cache]


@dataclasses.dataclass
class Dispatched:
    """A step on its way through the device (:meth:`ARRunner.dispatch`): its rows, each row's
    tokens, and its outputs, still device arrays: tokens ``[S]``, finite flags ``[S]``, the
    log-probabilities' ``(ids, logprobs)`` when a row asked, the hidden states and input
    embeddings when a row captures them, the draw hook's outputs for a stage with one."""

    rows: list[StepRow[Any]]
    lengths: list[int]
    tokens: jax.Array
    finite: jax.Array
    logprobs: tuple[jax.Array, jax.Array] | None
    hidden: tuple[jax.Array, jax.Array] | None
    drawn: Any


class ARRunner:
    """Owns the params, the KV cache arrays and the compiled programs of one AR stage."""

    def __init__(
        self,
        model: nnx.Module,
        cache: CacheConfig,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        backend: Backend = "auto",
        chunk_bytes: int | None = None,
        mesh: Mesh | None = None,
        step_inputs: StepInputs[Any] | None = None,
    ):
        """``mesh``: the stage's ``("data", "model")`` mesh; the model's parameters must already
        be placed on it. The cache is split on KV heads over ``model`` (its geometry's
        ``num_kv_heads`` counts stored, possibly replicated, heads), step rows over ``data``.
        ``chunk_bytes``: what one chunk of decode rows of the jnp attention path may gather and
        score (:attr:`AttentionMetadata.chunk_bytes`; the stage passes its platform's,
        :func:`~omni_jax.models.attention.chunk_bytes`, which its memory plan counts; ``None``:
        the whole step at once). ``step_inputs``: the stage's per-step inputs (default
        :class:`TokenInputs`: token ids alone, 1-D RoPE)."""
        self.graphdef, self.state = nnx.split(model)
        # The programs take the state's leaves, its structure bound in: jit flattens its
        # arguments on every call, and flattening the NNX state costs a Python call per variable
        # of every step's dispatch.
        self._leaves, treedef = jax.tree.flatten(self.state)
        self.cache_cfg = cache
        self.geometry = g = cache.geometry
        self.max_num_seqs = max_num_seqs
        self.mesh = mesh
        self.data = axis_size(mesh, "data")
        self.max_rows = max_sequence_rows(max_num_seqs, self.data)
        self.most_rows = max_token_rows(
            max_num_batched_tokens, self.max_rows, max_num_seqs * g.max_model_len, self.data
        )
        self.backend = backend
        self.chunk_bytes = chunk_bytes
        self.step_inputs: StepInputs[Any] = TokenInputs() if step_inputs is None else step_inputs
        self.position_shape = self.step_inputs.position_shape
        # Whether the forward returns hidden states and input embeddings: set by the pipeline at
        # build time, before warm-up, when the next stage reads them (one program set either way),
        # and which layer's states (transformers' ``hidden_states`` index; None: the final ones).
        self.capture_hidden = False
        self.capture_layer: int | None = None
        self.draw_hook = self.step_inputs.draw_hook
        self.kv_cache = init_kv_cache(
            g.num_layers,
            g.num_kv_heads,
            cache.num_pages + 1,  # + the null page
            g.page_size,
            g.head_dim,
            g.dtype,
            # Committed where the params are: a jit keys its programs on whether arguments are
            # committed, and the cache every step donates back is, so an uncommitted first cache
            # would compile the first step's program twice.
            sharding=(
                jax.sharding.SingleDeviceSharding(next(iter(self._leaves[0].devices())))
                if mesh is None
                else NamedSharding(mesh, P("model"))
            ),
        )
        fwd_layout: dict[str, Any] = {}
        out_layout: dict[str, Any] = {}
        if mesh is not None:  # outputs replicated: every process reads the sampled tokens
            rep = NamedSharding(mesh, P())
            fwd_layout["out_shardings"] = (rep, rep, rep, rep, self.kv_cache[0][0].sharding, rep)
            out_layout["out_shardings"] = rep
        self._forward = jax.jit(
            functools.partial(
                _forward_fn,
                self.graphdef,
                treedef,
                feed=None if self.draw_hook is None else self.draw_hook.feed,
            ),
            donate_argnames=("kv_cache", "ids"),
            static_argnames=("backend", "chunk_bytes", "capture_hidden", "capture_layer", "last_hidden"),
            **fwd_layout,
        )
        self._after = (
            None
            if self.draw_hook is None
            else jax.jit(
                functools.partial(_after_draw_fn, self.graphdef, treedef, self.draw_hook),
                static_argnames=("width",),
                **out_layout,
            )
        )
        self._draw = jax.jit(_draw_fn, static_argnames=("greedy", "penalised", "width"), **out_layout)
        # The last step's drawn tokens, ``[max_rows]``, where the next step reads its pending
        # tokens; placed (committed) as the sampler's output is, so every step's forward gets
        # the same argument layout.
        placed = self.kv_cache[0][0].sharding if mesh is None else NamedSharding(mesh, P())
        self._drawn = jax.device_put(np.zeros((self.max_rows,), np.int32), placed)
        # Each running request's token ids, ``[max_num_seqs, max_model_len]``, in its row
        # (:attr:`StepRow.id_row`): every forward writes the tokens it computes, the penalties
        # read them, and no step sends a request's ids from the host.
        self._ids = jax.device_put(np.zeros((max_num_seqs, g.max_model_len), np.int32), placed)
        # The last step's draw hook feedback, ``[max_rows, ...]``, likewise (a stage with a hook).
        self._feedback = (
            None
            if self.draw_hook is None
            else jax.device_put(
                np.zeros((self.max_rows, *self.draw_hook.feedback_shape), self.draw_hook.feedback_dtype),
                placed,
            )
        )
        self._logprobs = jax.jit(_logprobs_fn, **out_layout)
        self._scrub = jax.jit(_scrub_fn, donate_argnames=("kv_cache",))

    def scrub(self, pages: Sequence[int]) -> None:
        """Zero ``pages`` (a failed request's) before the allocator hands them out again, in
        calls of one sequence's worth of pages (one program)."""
        width = self.geometry.pages_per_seq
        for i in range(0, len(pages), width):
            ids = np.full((width,), self.cache_cfg.num_pages + 1, np.int32)
            chunk = pages[i : i + width]
            ids[: len(chunk)] = chunk
            self.kv_cache = self._scrub(self.kv_cache, ids)

    def rows_bucket(self, n: int) -> int:
        """Token rows of a step with ``n`` tokens, a multiple of ``data`` so each data shard
        gets the same number of rows, at least :data:`MIN_ROWS`. Up to ``max_rows`` (decode
        steps, and prompt steps of a few sequences) two sizes an octave, at most a third
        padding; above, powers of two up to the largest step (the budget's tokens, or all the
        sequences can hold where that is less): prompt steps that long are mostly filled to
        the budget by chunked prefill, and each octave's second size would cost another
        program."""
        b = fine_bucket(n, MIN_ROWS) if n <= self.max_rows else bucket(n)
        return min(round_up(b, self.data), self.most_rows)

    def row_sizes(self) -> list[int]:
        """Every token-row size of a step, ascending (:meth:`rows_bucket`'s values)."""
        return sorted({self.rows_bucket(n) for n in range(1, self.most_rows + 1)})

    def row_edges(self) -> tuple[int, ...]:
        """The token-row sizes from ``max_rows`` up, where a step with prompt tokens is better
        cut than padded (:class:`~omni_jax.engine.scheduler.SchedulerConfig`'s ``row_edges``):
        sizes there are an octave apart, so a step just past one would run nearly twice its
        rows, and its prompt tokens are compute the deferral moves, not adds. Below, the sizes
        are two an octave and a step costs about its weight read whatever its rows, so cutting
        would add steps for nothing."""
        return tuple(n for n in self.row_sizes() if n >= self.max_rows)

    def sequences(self, rows: int) -> int:
        """Sequence rows (logits and sampling) of a step of ``rows`` token rows: a power of two
        (a multiple of ``data``) covering them, up to the most sequences a step can hold. A
        fixed function of the token rows, so it adds no forward programs, and the sampler's
        programs are one per power of two."""
        return min(round_up(bucket(rows, MIN_ROWS), self.data), self.max_rows)

    def pages_bucket(self, max_pages: int) -> int:
        """Block-table width of a call: full width, except on the jnp attention path, which
        gathers every page in the table and so takes only the pages its longest row needs (a
        power of two, at least a quarter of the maximum to bound the number of programs). The
        kernels (``auto`` picks one for these one-token rows on GPU and for float32 on CPU) read
        only the pages under each row's context, whatever the width."""
        full = self.geometry.pages_per_seq
        if self.backend != "jnp":
            return full
        return min(full, bucket(max_pages, max(1, full // 4)))

    def step_shapes(self) -> list[tuple[int, int]]:
        """Every ``(token rows, pages)`` forward shape the scheduler can produce: any step up to
        the largest step's tokens (a prompt step) or ``max_rows`` (a decode step), any table width."""
        widths = sorted({self.pages_bucket(p) for p in range(1, self.geometry.pages_per_seq + 1)})
        return [(n, p) for n in self.row_sizes() for p in widths]

    def sequence_buckets(self) -> list[int]:
        """Every sequence-row count of a step (the sampler's shapes)."""
        return sorted({self.sequences(n) for n, _ in self.step_shapes()})

    def warmup(self) -> int:
        """Compile every program: the forward for each :meth:`step_shapes` (side by side,
        :func:`compile_ahead`, then each run once), and per :meth:`sequence_buckets` the
        sampler's greedy, sampling and penalised forms, the
        log-probabilities and the draw hook's forms; then the scrub. Returns the number of
        programs.

        The inputs are all padding: every cache and id-table write is dropped, so both are
        untouched.
        """
        out_of: dict[int, tuple[jax.Array, Any]] = {}  # one forward's logits and last rows per bucket
        compile_ahead([self._forward_program(*self._pack([], n, p)) for n, p in self.step_shapes()])
        for n, p in self.step_shapes():
            logits, _, _, last = self._run_forward(*self._pack([], n, p))
            out_of[self.sequences(n)] = logits, last
        hooked = 0
        for s, (logits, last) in sorted(out_of.items()):
            for greedy, penalised in ((True, False), (False, False), (False, True)):
                tokens, self._drawn = self._run_draw(logits, self._sampling([], s), greedy, penalised)
            self._run_logprobs(logits, tokens)
            if self.draw_hook is not None:
                for inputs in self.draw_hook.warmup_inputs(s):
                    jax.block_until_ready(self._run_after(last, tokens, inputs))
                    hooked += 1
        self.scrub([self.cache_cfg.num_pages + 1])
        return len(self.step_shapes()) + 4 * len(out_of) + hooked + 1

    def _pack(self, rows: Sequence[StepRow], n: int, p: int, sources: Sequence[int] = ()) -> tuple[Any, ...]:
        """Host arrays of one flat step's forward: ``rows``' tokens in order, padded to ``n``
        token rows, with :meth:`sequences` ``p``-page tables, logits rows and id-table rows;
        ``sources``: for each row with a pending token, the row of the step before that drew it
        (else -1; read only where a row's :attr:`StepRow.pending_token` is set)."""
        c, page_size = self.cache_cfg, self.geometry.page_size
        s = self.sequences(n)
        tokens = np.zeros((n, 1), np.int32)
        source = np.full((n,), -1, np.int32)
        positions = np.zeros((*self.position_shape, n, 1), np.int32)
        slots = np.full((n, 1), c.dropped_slot, np.int32)
        tables = np.full((s, p), c.null_page, np.int32)
        sequence = np.zeros((n,), np.int32)
        ctx = np.zeros((n,), np.int32)
        qlen = np.zeros((n,), np.int32)
        last = np.zeros((s,), np.int32)
        id_rows = np.zeros((s,), np.int32)
        firsts = np.zeros((0,), np.int64)  # each row's first token row
        if rows:
            # Vectorised over the step's token rows and their pages (a decode step has hundreds
            # of rows, each a row's worth of numpy calls in a loop): Python only reads each
            # row's fields.
            k = len(rows)
            lengths = np.fromiter((len(r.token_ids) for r in rows), np.int64, k)
            starts = np.fromiter((r.start for r in rows), np.int64, k)
            ends = np.cumsum(lengths)
            firsts = ends - lengths
            total = int(ends[-1])
            row_of = np.repeat(np.arange(k), lengths)
            idx = np.arange(total) - firsts[row_of] + starts[row_of]  # each token's index
            used = pages_needed(starts + lengths, page_size)  # each row's pages, from its end
            held = np.fromiter(
                itertools.chain.from_iterable(r.pages[:u] for r, u in zip(rows, used.tolist(), strict=True)),
                np.int32,
                int(used.sum()),
            )
            tables[:k][np.arange(p) < used[:, None]] = held  # a boolean mask fills row by row
            pending = np.fromiter((r.pending_token for r in rows), bool, k)
            if pending.any():  # a row reads the step before's draw only where it has a pending token
                source[ends - 1] = np.where(pending, sources, -1)
            tokens[:total, 0] = list(itertools.chain.from_iterable(r.token_ids for r in rows))
            positions[..., :total, 0] = np.concatenate([r.positions for r in rows], axis=-1)
            slots[:total, 0] = tables[row_of, idx // page_size] * page_size + idx % page_size
            sequence[:total] = row_of
            ctx[:total] = idx + 1  # each token's causal horizon
            qlen[:total] = 1
            last[: len(rows)] = ends - 1
            id_rows[: len(rows)] = [r.id_row for r in rows]
        extra = self.step_inputs.pack(rows, firsts.tolist(), n)
        return tokens, source, positions, FlatStep(slots, tables, sequence, ctx, qlen), last, id_rows, extra

    def _sampling(self, rows: Sequence[StepRow], s: int) -> tuple[SamplingTensors, np.ndarray, np.ndarray]:
        """The sampler's rows for ``rows``, padded to ``s``, with each row's id-table row and
        length (its ids the penalties read; padding rows read none)."""
        id_rows, lengths = np.zeros((s,), np.int32), np.zeros((s,), np.int32)
        id_rows[: len(rows)] = [r.id_row for r in rows]
        lengths[: len(rows)] = [r.end for r in rows]
        return (
            pack_sampling(
                [r.params for r in rows],
                [r.prompt_len for r in rows],
                [r.seed for r in rows],
                [r.draw_index for r in rows],
                [r.suppress for r in rows],
                batch=s,
            ),
            id_rows,
            lengths,
        )

    def _program(
        self,
        fn: Callable[..., Any],
        placed: Sequence[Any],
        host: Sequence[tuple[Any, int | None]],
        **static: Any,
    ) -> ProgramCall:
        """The call ``fn(*placed, *host, **static)``; on a mesh, each host array is put with its
        rows (axis given beside it, ``None``: replicated) split over ``data``, and the call is
        traced and run under the mesh (kernels that need it, shard_map, read it there)."""
        if self.mesh is None:
            return ProgramCall(fn, (*placed, *(a for a, _ in host)), static)
        args = [
            put(a, NamedSharding(self.mesh, P() if axis is None else P(*[None] * axis, "data")))
            for a, axis in host
        ]
        return ProgramCall(fn, (*placed, *args), static, mesh=self.mesh)

    def _forward_program(
        self, tokens: Any, source: Any, positions: Any, step: FlatStep, last: Any, id_rows: Any, extra: Any
    ) -> ProgramCall:
        """The forward's call on these host inputs (:meth:`_pack`'s), the current cache and id
        table, and the last step's drawn tokens and draw hook feedback (what a pending row
        reads)."""
        host = [
            (tokens, 0),
            (source, 0),
            (positions, len(self.position_shape)),
            (step, 0),
            (last, 0),
            (id_rows, None),
            (extra, None),
        ]
        return self._program(
            self._forward,
            [self._leaves, self.kv_cache, self._ids, self._drawn, self._feedback],
            host,
            backend=self.backend,
            chunk_bytes=self.chunk_bytes,
            capture_hidden=self.capture_hidden,
            capture_layer=self.capture_layer,
            last_hidden=self.draw_hook is not None,
        )

    def _run_forward(
        self, tokens: Any, source: Any, positions: Any, step: FlatStep, last: Any, id_rows: Any, extra: Any
    ) -> tuple[jax.Array, jax.Array, Any, jax.Array | None]:
        """The forward program: ``(logits [S, V], finite [S], (hidden, embeds) or None, the
        final hidden state of each sequence's last token [S, D] when a draw hook reads it)``,
        all on device; the cache and the id table are replaced by the donated results."""
        logits, finite, hidden, last_rows, self.kv_cache, self._ids = self._forward_program(
            tokens, source, positions, step, last, id_rows, extra
        )()
        return logits, finite, hidden, last_rows

    def _run_after(self, hidden: jax.Array | None, tokens: jax.Array, inputs: Any) -> tuple[Any, jax.Array]:
        """The draw hook's program on a step's drawn ``tokens`` (a stage with a hook only): its
        outputs, and their feedback in the ``[max_rows, ...]`` buffer the next step reads."""
        if self._after is None or hidden is None:
            raise RuntimeError("the draw hook's program runs only for a stage with a draw hook")
        return self._program(
            self._after, [self._leaves, hidden, tokens], [(inputs, 0)], width=self.max_rows
        )()

    def _run_draw(
        self,
        logits: jax.Array,
        sampling: tuple[SamplingTensors, np.ndarray, np.ndarray],
        greedy: bool,
        penalised: bool,
    ) -> tuple[jax.Array, jax.Array]:
        """The sampler on :meth:`_sampling`'s rows: the step's tokens ``[S]`` and the same in the
        ``[max_rows]`` buffer the next step reads its pending tokens from."""
        st, id_rows, lengths = sampling
        host = [(st, 0), (id_rows, 0), (lengths, 0)]
        return self._program(
            self._draw,
            [logits, self._ids],
            host,
            greedy=greedy,
            penalised=penalised,
            width=self.max_rows,
        )()

    def _run_logprobs(self, logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self._program(self._logprobs, [logits, tokens], [])()

    def embed_tokens(self, ids: Sequence[int]) -> np.ndarray:
        """``[len(ids), D]`` input embeddings of ``ids`` alone (no step inputs merged), for a
        later stage that reads special tokens through this model's table. Eager: called once
        per id set at build time, not per step."""
        model = nnx.merge(self.graphdef, self.state)
        tokens = jnp.asarray([list(ids)], jnp.int32)
        if self.mesh is None:
            return np.asarray(model.embed(tokens)[0])
        with jax.set_mesh(self.mesh):
            return np.asarray(model.embed(tokens)[0])

    def dispatch(self, rows: Sequence[StepRow[Any]], sources: Sequence[int] = ()) -> Dispatched:
        """Start one scheduler step on the device: the forward, then the sampler (and the draw
        hook's and log-probabilities' programs when asked); nothing waits for the device, so
        the host may schedule the next step meanwhile. ``sources``: per row, for a row with a
        pending token (:attr:`StepRow.pending_token`), its row in the step dispatched just
        before, whose draw it reads on the device. Read the results with :meth:`fetch`, in
        dispatch order."""
        lengths = [len(r.token_ids) for r in rows]
        n = self.rows_bucket(sum(lengths))
        p = self.pages_bucket(pages_needed(max(r.end for r in rows), self.geometry.page_size))
        logits, finite, hidden, last = self._run_forward(*self._pack(rows, n, p, sources))
        penalised = any(r.params.penalised for r in rows)
        greedy = not penalised and all(r.params.greedy for r in rows)
        toks, self._drawn = self._run_draw(logits, self._sampling(rows, logits.shape[0]), greedy, penalised)
        drawn = None
        if self.draw_hook is not None:
            drawn, self._feedback = self._run_after(last, toks, self.draw_hook.pack(rows, logits.shape[0]))
        logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            logprobs = self._run_logprobs(logits, toks)
        if hidden is None or not any(r.capture_hidden for r in rows):
            hidden = None  # stays on device, unread
        for a in jax.tree.leaves((toks, finite, logprobs, hidden, drawn)):  # all that fetch reads
            a.copy_to_host_async()
        return Dispatched(list(rows), lengths, toks, finite, logprobs, hidden, drawn)

    def done(self, step: Dispatched) -> bool:
        """Whether the device has finished the dispatched step (:meth:`fetch` would not wait)."""
        return on_host((step.tokens, step.finite, step.logprobs, step.hidden, step.drawn))

    def fetch(self, step: Dispatched) -> StepResult:
        """A dispatched step's results on the host, in its rows' order (waits for the device).
        The step's hidden states and input embeddings are fetched when a row's request captures
        them; a draw hook records its outputs in the rows' states here."""
        n_rows = len(step.rows)
        tokens = np.asarray(step.tokens)[:n_rows]
        if self.draw_hook is not None:
            outputs = jax.tree.map(lambda a: np.asarray(a)[:n_rows], step.drawn)
            self.draw_hook.record(step.rows, tokens, outputs)
        ids, lps = (None, None) if step.logprobs is None else step.logprobs
        hidden, embeds = (
            (None, None) if step.hidden is None else (self._per_row(h, step.lengths) for h in step.hidden)
        )
        return StepResult(
            tokens=tokens,
            finite=np.asarray(step.finite)[:n_rows],
            logprob_ids=None if ids is None else np.asarray(ids)[:n_rows],
            logprobs=None if lps is None else np.asarray(lps)[:n_rows],
            hidden=hidden,
            embeds=embeds,
        )

    @staticmethod
    def _per_row(states: jax.Array, lengths: Sequence[int]) -> list[np.ndarray]:
        """A flat step's ``[token rows, 1, D]`` states cut into each row's ``[tokens, D]``."""
        flat = np.asarray(states)[:, 0]
        return np.split(flat[: sum(lengths)], np.cumsum(lengths)[:-1])
