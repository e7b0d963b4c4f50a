"""Runs scheduled AR steps: packs rows into bucketed arrays, calls the one jitted step.

The step is a pure function of ``(params, kv_cache, inputs, metadata, sampling tensors)``
that donates the cache, so the cache is updated in place on device and the host only ever
sees sampled tokens (and hidden states and input embeddings when a later stage asked for them).

A step is flat: every scheduled token is a row of its own (``[tokens, 1]``), with its
sequence's block table and its own causal horizon as context length, the layout vLLM calls
flattened tokens. The matmuls, most of a step's compute, then see exactly the step's tokens,
where a ``[rows, tokens]`` block pads every prompt chunk to the step's longest (28% of the
prompt compute on the AR benchmark, after splitting steps into calls of similar lengths). A
prompt chunk's tokens attend through the decode path, each to its own prefix; the step writes
all its keys and values before any attention reads them, so a token sees the earlier tokens
of its own chunk. Logits and sampling run for each sequence's last token only.
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
    fine_bucket,
    fine_bucket_sizes,
    max_sequence_rows,
    max_token_rows,
    round_up,
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

    def one_token_rows(self) -> list[StepRow]:
        """The row as rows of one token each, in order (a flat step's layout); only the last
        samples."""
        m = len(self.token_ids)
        if m == 1:
            return [self]
        return [
            dataclasses.replace(
                self,
                token_ids=self.token_ids[j : j + 1],
                positions=self.positions[..., j : j + 1],
                start=self.start + j,
                sample=self.sample and j == m - 1,
            )
            for j in range(m)
        ]


class StepInputs(Protocol):
    """Model-specific inputs of a step's embedding, e.g. encoder rows a multimodal model merges.

    ``pack`` runs on the host for every step (also for warm-up, with no rows) for a step of
    ``batch`` rows of ``tokens`` tokens, and returns the pytree passed as ``extra`` to
    ``model.embed(tokens, extra)``; its shapes must come from a few buckets, and a step whose
    rows need nothing must get the same shapes every time, so decode never recompiles. The
    runner's steps are flat: ``rows`` are one-token rows (:meth:`StepRow.one_token_rows`, a
    prompt chunk's in order), ``batch`` the step's token rows and ``tokens`` 1.

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
    hidden: list[np.ndarray] | None  # per row [its tokens, D] final (normed) hidden states, when requested
    embeds: list[np.ndarray] | None  # per row [its tokens, D] the decoder's input embeddings, when requested


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
    last = hidden.reshape(-1, hidden.shape[-1])[logits_idx]  # each sequence's last token
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
        self.max_rows = max_sequence_rows(max_num_seqs, self.data)
        self.backend = backend
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
        """Token rows of a step with ``n`` tokens: a fine bucket (at most a third padding), at
        least :data:`MIN_ROWS`, padded to a multiple of ``data`` so each data shard gets the
        same number of rows."""
        return round_up(fine_bucket(n, MIN_ROWS), self.data)

    def sequences(self, rows: int) -> int:
        """Sequence rows (logits and sampling) of a step of ``rows`` token rows: one per token
        up to the most sequences a step can hold. A fixed function of the token rows, so it
        adds no programs; a prompt step samples at most ``max_rows`` rows however long it is."""
        return min(rows, self.max_rows)

    def pages_bucket(self, max_pages: int) -> int:
        """Block-table width of a call: only the pages its longest row needs (a power of two,
        at least an eighth of the maximum to bound the number of programs).

        The jnp path gathers every page in the table: a full-width table made attention a
        third of the prompt compute on the AR benchmark (512-token tables for chunks of up to
        192 tokens).
        """
        full = self.cache_cfg.pages_per_seq
        return min(full, bucket(max_pages, max(1, full // 8)))

    def step_shapes(self, max_num_batched_tokens: int) -> list[tuple[int, int]]:
        """Every ``(token rows, pages)`` bucket a scheduler with this budget can produce: up to
        the budget's tokens (a prompt step) or ``max_rows`` (a decode step), any table width."""
        c = self.cache_cfg
        widths = sorted({self.pages_bucket(p) for p in range(1, c.pages_per_seq + 1)})
        most = max_token_rows(max_num_batched_tokens, self.max_rows, self.data)
        rows = {self.rows_bucket(n) for n in fine_bucket_sizes(MIN_ROWS, most)}
        return sorted((n, p) for n in rows for p in widths)

    def warmup(self, max_num_batched_tokens: int, return_hidden: bool = False) -> int:
        """Compile the plain step (no penalty, no logprobs) for every bucket, in its greedy and
        its sampling program; returns the number of programs. A step with penalties or logprobs
        is another program, compiled when a bucket first meets one.

        The inputs are all padding: every cache write lands on the dropped slot, so the
        cache is untouched.
        """
        shapes = self.step_shapes(max_num_batched_tokens)
        for n, p in shapes:
            for greedy in (True, False):
                args = self._pack([], n, p)
                self._call(*args, greedy=greedy, num_logprobs=None, return_hidden=return_hidden)
        return 2 * len(shapes)

    def _pack(self, rows: Sequence[StepRow], n: int, p: int) -> tuple[Any, ...]:
        """Host arrays of one flat step: ``rows``' tokens in order, padded to ``n`` token rows
        with ``p``-page tables, and :meth:`sequences` sampling rows."""
        c = self.cache_cfg
        s = self.sequences(n)
        tokens = np.zeros((n, 1), np.int32)
        positions = np.zeros((*self.position_shape, n, 1), np.int32)
        slots = np.full((n, 1), c.dropped_slot, np.int32)
        tables = np.full((n, p), c.null_page, np.int32)
        ctx = np.zeros((n,), np.int32)
        qlen = np.zeros((n,), np.int32)
        last = np.zeros((s,), np.int32)
        offset = 0
        for i, r in enumerate(rows):
            m = len(r.token_ids)
            seg = slice(offset, offset + m)
            tokens[seg, 0] = r.token_ids
            positions[..., seg, 0] = r.positions
            idx = np.arange(r.start, r.end)
            pages = np.asarray(r.pages, np.int32)
            slots[seg, 0] = pages[idx // c.page_size] * c.page_size + idx % c.page_size
            used = -(-r.end // c.page_size)
            tables[seg, :used] = pages[:used]
            ctx[seg] = idx + 1  # each token's causal horizon
            qlen[seg] = 1
            offset += m
            last[i] = offset - 1
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
            batch=s,
            history_len=c.max_model_len if needs_history else 1,
            suppress_len=bucket(max([len(r.suppress) for r in rows], default=0), 4),
        )
        md = AttentionMetadata(slots, tables, ctx, qlen)
        extra = None
        if self.step_inputs is not None:
            extra = self.step_inputs.pack([t for r in rows for t in r.one_token_rows()], n, 1)
        return tokens, positions, md, last, st, extra

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

    def execute(self, rows: Sequence[StepRow], return_hidden: bool = False) -> StepResult:
        """One scheduler step as one flat call; results in ``rows``' order."""
        n_rows = len(rows)
        lengths = [len(r.token_ids) for r in rows]
        n = self.rows_bucket(sum(lengths))
        p = self.pages_bucket(max(-(-r.end // self.cache_cfg.page_size) for r in rows))
        asked = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        toks, finite, ids, lps, hidden = self._call(
            *self._pack(rows, n, p),
            greedy=all(r.params.greedy for r in rows),
            num_logprobs=(bucket(max(asked)) if max(asked) else 0) if asked else None,
            return_hidden=return_hidden,
        )
        hidden, embeds = (None, None) if hidden is None else (self._per_row(h, lengths) for h in hidden)
        return StepResult(
            tokens=np.asarray(toks)[:n_rows],
            finite=np.asarray(finite)[:n_rows],
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
