"""Runs scheduled AR steps: packs rows into bucketed arrays, calls the one jitted step.

The step is a pure function of ``(params, kv_cache, inputs, metadata, sampling tensors)``
that donates the cache, so the cache is updated in place on device and the host only ever
sees sampled tokens (and hidden states and input embeddings when a later stage asked for them).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
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
    bucket_sizes,
    fine_bucket_sizes,
    padded_split,
    round_up,
    row_bucket,
    token_bucket,
)
from omni_jax.engine.kv_cache import init_kv_cache
from omni_jax.engine.sampling import SamplingParams, SamplingTensors, pack_sampling, sample
from omni_jax.models.attention import AttentionMetadata, Backend
from omni_jax.parallel.mesh import axis_size
from omni_jax.parallel.rules import put


class ARModel(Protocol):
    """What the engine needs of an AR model; nothing here is model-specific."""

    def embed(self, tokens: jax.Array, extra: Any = None) -> jax.Array: ...

    def __call__(
        self, embeds: jax.Array, positions: jax.Array, kv_cache: Any, md: AttentionMetadata, backend: Backend
    ) -> tuple[jax.Array, Any]: ...

    def logits(self, hidden: jax.Array) -> jax.Array: ...


CALL_COST = 64
"""What one more call of the step costs, in padded token-rows, when :meth:`ARRunner.groups`
splits a step: about a weight read (11 ms for the 40M benchmark model on this 2-core CPU, where a
prompt token-row costs 0.46 ms), rounded up so that splits buy real savings."""


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_pages: int
    page_size: int
    dtype: Any
    max_model_len: int

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def null_page(self) -> int:
        """A page past the allocator's, never written: unused block-table entries point here.

        Attention weighs keys past a row's context by exactly zero, but ``0 * NaN`` is NaN, so
        those entries must read finite values whatever another request left in its pages.
        """
        return self.num_pages

    @property
    def dropped_slot(self) -> int:
        """A slot index past the whole cache: writes there are dropped (padding tokens)."""
        return (self.num_pages + 1) * self.page_size


@dataclasses.dataclass
class StepRow:
    """One sequence's share of a step: tokens ``[start, end)`` of its full id list."""

    token_ids: Sequence[int]
    positions: np.ndarray
    pages: Sequence[int]
    start: int
    sample: bool
    params: SamplingParams
    seed: int
    draw_index: int
    history: Sequence[int]
    prompt_len: int
    suppress: Sequence[int]
    extra: Any = None  # the request's model-specific inputs (:attr:`ARRequest.extra`), opaque here

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


class StepInputs(Protocol):
    """Model-specific inputs of a step's embedding, e.g. encoder rows a multimodal model merges.

    ``pack`` runs on the host for every step (also for warm-up, with no rows) for a step of
    ``batch`` rows of ``tokens`` tokens, and returns the pytree passed as ``extra`` to
    ``model.embed(tokens, extra)``; its shapes must come from a few buckets, and a step whose
    rows need nothing must get the same shapes every time, so decode never recompiles.

    ``prepare`` runs first, once per step, for work a row needs before packing that can fail
    for one request alone (e.g. running encoders when a request is admitted); it returns
    ``{row index: message}`` for the rows that failed, which the engine ends with
    ``finish_reason="error"`` and leaves out of the step.
    """

    def prepare(self, rows: Sequence[StepRow]) -> dict[int, str]: ...

    def pack(self, rows: Sequence[StepRow], batch: int, tokens: int) -> Any: ...


@dataclasses.dataclass
class StepResult:
    tokens: np.ndarray  # [rows]
    finite: np.ndarray  # [rows] bool: the row's logits were all finite
    logprob_ids: np.ndarray | None  # [rows, 1 + N], when some row asked for logprobs
    logprobs: np.ndarray | None  # [rows, 1 + N]
    hidden: np.ndarray | None  # [rows, T, D] final (normed) hidden states, when requested
    embeds: np.ndarray | None  # [rows, T, D] the decoder's input embeddings, when requested


def _step_fn(
    graphdef: nnx.GraphDef,
    treedef: Any,
    leaves: list[jax.Array],
    kv_cache: Any,
    tokens: jax.Array,
    positions: jax.Array,
    md: AttentionMetadata,
    logits_idx: jax.Array,
    st: SamplingTensors,
    extra: Any,
    *,
    greedy: bool,
    num_logprobs: int | None,
    backend: Backend,
    return_hidden: bool,
) -> tuple[Any, ...]:
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    embeds = model.embed(tokens, extra)
    hidden, kv_cache = model(embeds, positions, kv_cache, md, backend)
    last = hidden[jnp.arange(hidden.shape[0]), logits_idx]
    logits = model.logits(last)
    finite = jnp.isfinite(logits).all(axis=-1)  # one pass over [rows, vocab]: a fault ends one row
    toks, ids, lps = sample(logits, st, num_logprobs, greedy=greedy)
    return toks, finite, ids, lps, ((hidden, embeds) if return_hidden else None), kv_cache


def _scrub_fn(kv_cache: Any, pages: jax.Array) -> Any:
    """Zero ``pages`` of every layer (out-of-range ids are dropped): a failed request's pages
    may hold NaN, which attention over a later owner's unwritten tail would read as ``0 * NaN``."""
    return [(k.at[:, pages].set(0, mode="drop"), v.at[:, pages].set(0, mode="drop")) for k, v in kv_cache]


class ARRunner:
    """Owns the params, the KV cache arrays and the compiled step of one AR stage."""

    def __init__(
        self,
        model: nnx.Module,
        cache: CacheConfig,
        *,
        max_num_seqs: int,
        backend: Backend = "auto",
        min_prefill_bucket: int = 16,
        position_shape: tuple[int, ...] = (),
        mesh: Mesh | None = None,
        step_inputs: StepInputs | None = None,
    ):
        """``mesh``: the stage's ``("data", "model")`` mesh; the model's parameters must already
        be placed on it. The cache is split on KV heads over ``model`` (``cache.num_kv_heads``
        counts stored, possibly replicated, heads), step rows over ``data``."""
        self.graphdef, self.state = nnx.split(model)
        # The step takes the state's leaves, its structure bound in: jit flattens its arguments
        # on every call, and flattening the NNX state (a Python call per variable) was a third
        # of a tiny talker step's dispatch (0.65 against 0.46 ms a step, measured).
        self._leaves, treedef = jax.tree.flatten(self.state)
        self.cache_cfg = cache
        self.max_num_seqs = max_num_seqs
        self.mesh = mesh
        self.data = axis_size(mesh, "data")
        self.max_rows = round_up(max(MIN_ROWS, bucket(max_num_seqs)), self.data)
        self.backend = backend
        self.min_prefill_bucket = min_prefill_bucket
        self.position_shape = position_shape  # () for 1-D RoPE, (3,) for M-RoPE
        self.step_inputs = step_inputs  # None: the model embeds tokens alone
        self.kv_cache = init_kv_cache(
            cache.num_layers,
            cache.num_kv_heads,
            cache.num_pages + 1,  # + the null page
            cache.page_size,
            cache.head_dim,
            cache.dtype,
            sharding=None if mesh is None else NamedSharding(mesh, P("model")),
        )
        layout: dict[str, Any] = {}
        if mesh is not None:  # outputs replicated: every process reads the sampled tokens
            rep = NamedSharding(mesh, P())
            layout["out_shardings"] = (rep, rep, rep, rep, rep, self.kv_cache[0][0].sharding)
        self._step = jax.jit(
            functools.partial(_step_fn, self.graphdef, treedef),
            donate_argnames=("kv_cache",),
            static_argnames=("greedy", "num_logprobs", "backend", "return_hidden"),
            **layout,
        )
        self._scrub = jax.jit(_scrub_fn, donate_argnames=("kv_cache",))

    def scrub(self, pages: Sequence[int]) -> None:
        """Zero ``pages`` (a failed request's) before the allocator hands them out again."""
        if not pages:
            return
        ids = np.full((bucket(len(pages), 8),), self.cache_cfg.num_pages + 1, np.int32)
        ids[: len(pages)] = pages
        self.kv_cache = self._scrub(self.kv_cache, ids)

    def rows_bucket(self, n: int) -> int:
        """Rows of a step with ``n`` real rows: a row bucket, padded to a multiple of ``data``
        so each data shard gets the same number of rows."""
        return round_up(row_bucket(n, self.max_rows), self.data)

    def pages_bucket(self, max_pages: int) -> int:
        """Block-table width of a call: only the pages its longest row needs (a power of two,
        at least an eighth of the maximum to bound the number of programs).

        The jnp path gathers every page in the table and, for a prompt chunk, computes a score
        for each of its keys: a full-width table made attention a third of the prompt compute
        on the AR benchmark (chunks of up to 192 tokens against 512-token tables).
        """
        full = self.cache_cfg.pages_per_seq
        return min(full, bucket(max_pages, max(1, full // 8)))

    def step_shapes(self, max_num_batched_tokens: int) -> list[tuple[int, int, int]]:
        """Every ``(rows, tokens, pages)`` bucket a scheduler with this budget can produce.

        The scheduler budgets real rows; a lone row is padded to ``MIN_ROWS`` after it.
        """
        rows = bucket_sizes(1, self.max_rows)
        c = self.cache_cfg
        widths = sorted({self.pages_bucket(p) for p in range(1, c.pages_per_seq + 1)})
        shapes = {(self.rows_bucket(b), 1, p) for b in rows for p in widths}
        for t in fine_bucket_sizes(self.min_prefill_bucket, max_num_batched_tokens):
            # a chunk of t tokens ends at least t tokens in: narrower tables never serve it
            fit = [p for p in widths if p * c.page_size >= min(t, c.max_model_len)]
            shapes |= {
                (self.rows_bucket(b), t, p) for b in rows if b * t <= max_num_batched_tokens for p in fit
            }
        return sorted(shapes)

    def warmup(self, max_num_batched_tokens: int, return_hidden: bool = False) -> int:
        """Compile the plain step (no penalty, no logprobs) for every bucket, in its greedy and
        its sampling program; returns the number of programs. A step with penalties or logprobs
        is another program, compiled when a bucket first meets one.

        The inputs are all padding: every cache write lands on the dropped slot, so the
        cache is untouched.
        """
        shapes = self.step_shapes(max_num_batched_tokens)
        for b, t, p in shapes:
            for greedy in (True, False):
                self._call(
                    *self._pack([], b, t, p), greedy=greedy, num_logprobs=None, return_hidden=return_hidden
                )
        return 2 * len(shapes)

    def _pack(self, rows: Sequence[StepRow], b: int, t: int, p: int) -> tuple[Any, ...]:
        """Host arrays of one step, ``rows`` padded to ``b`` rows of ``t`` tokens, ``p`` pages."""
        c = self.cache_cfg
        oob = c.dropped_slot
        tokens = np.zeros((b, t), np.int32)
        positions = np.zeros((*self.position_shape, b, t), np.int32)
        slots = np.full((b, t), oob, np.int32)
        tables = np.full((b, p), c.null_page, np.int32)
        ctx = np.zeros((b,), np.int32)
        qlen = np.zeros((b,), np.int32)
        for i, r in enumerate(rows):
            m = len(r.token_ids)
            tokens[i, :m] = r.token_ids
            positions[..., i, :m] = r.positions
            idx = np.arange(r.start, r.end)
            pages = np.asarray(r.pages, np.int32)
            slots[i, :m] = pages[idx // c.page_size] * c.page_size + idx % c.page_size
            used = -(-r.end // c.page_size)
            tables[i, :used] = pages[:used]
            ctx[i], qlen[i] = r.end, m
        needs_history = any(
            r.params.repetition_penalty != 1 or r.params.presence_penalty or r.params.frequency_penalty
            for r in rows
        )
        st = pack_sampling(
            [r.params for r in rows],
            [r.history if needs_history else [] for r in rows],
            [r.prompt_len for r in rows],
            [r.seed for r in rows],
            [r.draw_index for r in rows],
            [r.suppress for r in rows],
            batch=b,
            history_len=c.max_model_len if needs_history else 1,
            suppress_len=bucket(max([len(r.suppress) for r in rows], default=0), 4),
        )
        md = AttentionMetadata(slots, tables, ctx, qlen)
        extra = None if self.step_inputs is None else self.step_inputs.pack(rows, b, t)
        return tokens, positions, md, np.maximum(qlen - 1, 0), st, extra

    def _call(self, *args: Any, **static: Any) -> tuple[Any, ...]:
        """One compiled step; ``static`` picks the program (``greedy``, ``num_logprobs``,
        ``return_hidden``)."""
        if self.mesh is None:
            return self._run_step(args, static)
        with jax.set_mesh(self.mesh):  # kernels that need the mesh (shard_map) read it here
            return self._run_step(self._shard_rows(args), static)

    def _run_step(self, args: Sequence[Any], static: dict[str, Any]) -> tuple[Any, ...]:
        toks, finite, ids, lps, hidden, self.kv_cache = self._step(
            self._leaves, self.kv_cache, *args, backend=self.backend, **static
        )
        return toks, finite, ids, lps, hidden

    def _shard_rows(self, args: Sequence[Any]) -> list[Any]:
        """Put a step's host arrays on the mesh with their rows split over ``data``.

        ``tokens``, ``md``, ``logits_idx`` and the sampling tensors hold rows on axis 0, the
        positions after their M-RoPE axes; any further input is replicated.
        """
        row_axes = (0, len(self.position_shape), 0, 0, 0)
        placed = []
        for i, a in enumerate(args):
            axis = row_axes[i] if i < len(row_axes) else None
            spec = P() if axis is None else P(*[None] * axis, "data")
            placed.append(put(a, NamedSharding(self.mesh, spec)))
        return placed

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

    def prepare(self, rows: Sequence[StepRow]) -> dict[int, str]:
        """The step inputs' per-request work before a step (:meth:`StepInputs.prepare`):
        ``{row index: message}`` of rows that failed."""
        return {} if self.step_inputs is None else self.step_inputs.prepare(rows)

    def groups(self, rows: Sequence[StepRow]) -> list[list[int]]:
        """Row indices of the calls that run one scheduler step, in length order.

        Each call pads its rows to its longest one, so a step of ragged prompt chunks run as
        one ``[rows, tokens]`` program computes mostly padding (measured on the AR benchmark:
        6000 padded tokens for 3365 real ones). Rows sorted by length are cut into contiguous
        groups that minimise the padded token-rows plus :data:`CALL_COST` per call (a call
        reads every weight once however few its rows): an exact split, a dynamic program
        over at most ``max_rows`` rows. Every group's shape is one of :meth:`step_shapes`
        (fewer rows, no longer chunk than the whole step), so warm-up covers them all. A decode
        step (one token per row) is one call: its cost is the weight read a split would repeat.
        """
        if all(len(r.token_ids) == 1 for r in rows):  # decode: a call costs its weight read
            return [list(range(len(rows)))]
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].token_ids))
        tokens = [token_bucket(len(rows[i].token_ids), self.min_prefill_bucket) for i in order]
        return [order[a:b] for a, b in padded_split(tokens, self.rows_bucket, CALL_COST)]

    def execute(self, rows: Sequence[StepRow], return_hidden: bool = False) -> StepResult:
        """One scheduler step: its rows in one call or, when they are ragged prompt chunks, in
        the calls of :meth:`groups`, results back in ``rows``' order."""
        groups = self.groups(rows)
        # one logprobs width for the whole step, so that every call returns the same columns
        asked = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        num_logprobs = (bucket(max(asked)) if max(asked) else 0) if asked else None
        if len(groups) == 1:
            return self._execute(rows, return_hidden, num_logprobs)
        parts = [self._execute([rows[i] for i in g], return_hidden, num_logprobs) for g in groups]
        where = np.argsort(np.concatenate(groups))  # row i's position in the concatenation

        def joined(field: str) -> np.ndarray | None:
            arrays = [getattr(part, field) for part in parts]
            if arrays[0] is None:
                return None
            if arrays[0].ndim == 3:  # hidden / embeds [rows, T, D]: each call's own T
                width = max(a.shape[1] for a in arrays)
                arrays = [np.pad(a, ((0, 0), (0, width - a.shape[1]), (0, 0))) for a in arrays]
            return np.concatenate(arrays)[where]

        return StepResult(**{f.name: joined(f.name) for f in dataclasses.fields(StepResult)})

    def _execute(self, rows: Sequence[StepRow], return_hidden: bool, num_logprobs: int | None) -> StepResult:
        n = len(rows)
        b = self.rows_bucket(n)
        t = token_bucket(max(len(r.token_ids) for r in rows), self.min_prefill_bucket)
        p = self.pages_bucket(max(-(-r.end // self.cache_cfg.page_size) for r in rows))
        toks, finite, ids, lps, hidden = self._call(
            *self._pack(rows, b, t, p),
            greedy=all(r.params.greedy for r in rows),
            num_logprobs=num_logprobs,
            return_hidden=return_hidden,
        )
        hidden, embeds = (None, None) if hidden is None else (np.asarray(h)[:n] for h in hidden)
        return StepResult(
            tokens=np.asarray(toks)[:n],
            finite=np.asarray(finite)[:n],
            logprob_ids=None if ids is None else np.asarray(ids)[:n],
            logprobs=None if lps is None else np.asarray(lps)[:n],
            hidden=hidden,
            embeds=embeds,
        )
