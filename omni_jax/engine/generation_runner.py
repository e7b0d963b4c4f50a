"""The non-autoregressive execution path: a request in, its whole output out, in one jitted solve
per batch.

There is no KV cache, no logits and no sampler here: a request is its whole input, so a batch is
padded once to one of a closed set of shapes (:class:`SolveBuckets`: rows by a length), solved by
that shape's compiled program, and split back into per-request outputs trimmed to their valid
length. :meth:`GenerationRunner.warmup` compiles every program of the set, after which nothing
compiles, whatever the traffic. Requests waiting together are split into solves by length
(:meth:`GenerationRunner.groups`), weighing the padding a shared solve pays in full against what
one more solve costs on this device (:class:`~omni_jax.engine.solve_cost.SolveCost`, fitted to
the runner's own timings); the fit only chooses among the set's shapes, never makes one. Each
step runs one solve, the oldest request's, so results come back as soon as their own solve ends
and later arrivals can still join the others.

The runner knows no model and no stage: the stage supplies its requests' lengths and how they
fill one padded batch of a given shape (a :class:`BatchPadder`), and the solve function.

On a stage mesh, a solve's rows are split over ``data`` (rows padded to a multiple of it), each
device solving its own requests with the replicated weights: rows never interact, so XLA
partitions the whole program by rows.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from omni_jax.engine.buckets import bucket, padded_split, round_up
from omni_jax.engine.compilation import ProgramCall, compile_ahead
from omni_jax.engine.in_flight import InFlight
from omni_jax.engine.solve_cost import SolveCost
from omni_jax.jit import StaticGraph
from omni_jax.parallel.mesh import axis_size
from omni_jax.parallel.rules import fetch, put
from omni_jax.profiling import scope

Solve = Callable[..., tuple[jax.Array, jax.Array]]
"""``solve(graph, state, *arrays) -> (outputs [B, S, ...], valid lengths [B])``, a model's jitted
function: ``graph`` is the model's :class:`~omni_jax.jit.StaticGraph`, ``arrays``
a padded batch's (:meth:`PaddedBatch.arrays`), each with its rows on axis 0. It compiles once
per input shape (a jitted function), so that calling it on padding compiles the program a real
batch of that shape runs."""


@dataclasses.dataclass
class PaddedBatch:
    """A solve's inputs, batched and padded on the host: a stage subclasses it with its fields.

    Every ``np.ndarray`` field, in declaration order, is one argument of the solve (after the
    graph and the state), with the batch's rows on axis 0."""

    def arrays(self, mesh: Mesh | None = None) -> tuple[jax.Array, ...]:
        """The device arrays in the solve's argument order; on ``mesh``, rows split over ``data``."""
        fields = [f.name for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), np.ndarray)]
        if mesh is None:
            # device_put transfers alone; jnp.asarray compiles a copy program per shape and dtype.
            return tuple(jax.device_put(getattr(self, name)) for name in fields)
        rows = NamedSharding(mesh, P("data"))
        return tuple(put(getattr(self, name), rows) for name in fields)


T = TypeVar("T")
"""Whatever :meth:`SolveBuckets.split` cuts into solves (requests, chunks)."""
R = TypeVar("R")
"""A stage's request: the runner only queues it and hands it to the padder."""
B = TypeVar("B", bound=PaddedBatch)


class BatchPadder(Protocol[R, B]):
    """What a stage supplies to a :class:`GenerationRunner`: how long its requests are and how
    they fill one padded batch.

    ``output`` names one row of the solve's output in messages (``"waveform"``).
    ``pad(requests, rows, length)`` is a batch of ``rows`` rows padded to ``length``, the first
    ``len(requests)`` rows the requests' (the runner chose a bucket that holds them); with no
    request it is a warm-up batch whose every row solves without error (no empty reduction, no
    NaN). It raises ``ValueError`` naming the request when one does not fit the batch.
    """

    output: str

    def length(self, request: R) -> int: ...

    def pad(self, requests: Sequence[R], rows: int, length: int) -> B: ...


@dataclasses.dataclass
class GenerationResult(Generic[R]):
    """One request's ``output`` (trimmed to its valid length) or ``error``; the size of the
    solve it ran in, the solve's seconds, and the length its row was padded to (the bucket's:
    the work the request cost, which its own length understates)."""

    request: R
    output: np.ndarray | None
    error: str | None
    batch_size: int
    solve_s: float
    padded_length: int


@dataclasses.dataclass(frozen=True)
class SolveBuckets:
    """The closed set of solve shapes: every batch pads to one ``(rows, length)`` pair of it, and
    :meth:`GenerationRunner.warmup` compiles each pair's program.

    rows: a solve's request rows, powers of two up to ``max_batch`` (which caps the last), each
    rounded up to a multiple of the mesh's ``data`` axis (every shard the same rows).
    lengths: the padded lengths the stage asks for (e.g. a
    :func:`~omni_jax.engine.buckets.ladder`), ascending; the last is the longest request.
    max_cells: the most ``rows * length`` a solve may have (``None``: no limit), so that long
    requests are solved a few at a time: a solve's work and temporaries grow with its cells,
    and past a size that fills the device, more rows at once only add programs and memory. The
    smallest row count runs at every length whatever the limit, so every request fits.
    """

    rows: tuple[int, ...]
    lengths: tuple[int, ...]
    max_cells: int | None = None

    @classmethod
    def build(
        cls, max_batch: int, lengths: Sequence[int], data: int = 1, max_cells: int | None = None
    ) -> SolveBuckets:
        rows = {round_up(bucket(n, 1, max_batch), data) for n in range(1, max_batch + 1)}
        return cls(tuple(sorted(rows)), tuple(lengths), max_cells)

    def fits(self, rows: int, length: int) -> bool:
        """Whether a solve of ``rows`` x ``length`` is within :attr:`max_cells`."""
        return self.max_cells is None or rows == self.rows[0] or rows * length <= self.max_cells

    def shapes(self) -> list[tuple[int, int]]:
        """Every ``(rows, length)`` of a solve: one compiled program each."""
        return [(r, n) for r in self.rows for n in self.lengths if self.fits(r, n)]

    def largest(self) -> tuple[int, int]:
        """The shape of most rows x length (the longer one on a tie): the solve whose work and
        temporaries bound the others'."""
        return max(self.shapes(), key=lambda s: (s[0] * s[1], s[1]))

    def rows_for(self, requests: int) -> int:
        """Rows of a solve of ``requests`` requests."""
        return _smallest(self.rows, requests, f"{requests} requests exceed")

    def length_for(self, length: int) -> int:
        """Padded length of a solve whose longest request is ``length`` long."""
        return _smallest(self.lengths, length, f"a length of {length} exceeds")

    def split(self, items: Sequence[T], length: Callable[[T], int], overhead: float) -> list[list[T]]:
        """``items`` cut into solves, shortest first, each item in one: sorted by ``length``, cut
        into the contiguous groups that minimise the padded rows x length (both to these buckets)
        plus ``overhead`` per solve (:func:`~omni_jax.engine.buckets.padded_split`); every group's
        shape is one of the set's (within :attr:`max_cells`)."""
        order = sorted(items, key=length)
        lengths = [self.length_for(length(item)) for item in order]
        return [order[a:b] for a, b in padded_split(lengths, self.rows_for, overhead, self.fits)]


def _smallest(sizes: tuple[int, ...], n: int, too_large: str) -> int:
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"{too_large} the largest solve bucket ({sizes[-1]})")
    return sizes[i]


class GenerationRunner(Generic[R, B]):
    """FIFO batches of at most ``max_batch`` requests through one compiled ``solve``."""

    def __init__(
        self,
        solve: Solve,
        model: nnx.Module,
        padder: BatchPadder[R, B],
        *,
        lengths: Sequence[int],
        max_batch: int = 8,
        max_cells: int | None = None,
        mesh: Mesh | None = None,
        name: str = "generation",
    ):
        """``lengths``: the padded lengths a solve may have (:attr:`SolveBuckets.lengths`);
        ``max_cells``: the most rows x length of a solve (:attr:`SolveBuckets.max_cells`);
        ``mesh``: the stage's ``("data", "model")`` mesh, the model's weights already placed on
        it (replicated); ``None`` on one device. ``name`` (the stage's) prefixes the profiling
        spans: ``<name>/warmup``, ``<name>/pad``, ``<name>/solve``, ``<name>/split``."""
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        self.solve = solve
        self.graphdef, self.state = nnx.split(model)
        self.graph = StaticGraph(self.graphdef)
        self.padder = padder
        self.max_batch = max_batch
        self.mesh = mesh
        self.name = name
        self.data = axis_size(mesh, "data")
        self.buckets = SolveBuckets.build(max_batch, lengths, self.data, max_cells)
        self._waiting: collections.deque[R] = collections.deque()
        self.in_flight: InFlight[R] | None = None
        rows, length = self.buckets.largest()
        self.cost = SolveCost(cap=float(rows * length))

    def add(self, request: R) -> None:
        self._waiting.append(request)

    def has_work(self) -> bool:
        return bool(self._waiting) or self.in_flight is not None

    @property
    def num_waiting(self) -> int:
        """How many requests wait for a solve."""
        return len(self._waiting)

    @property
    def solving(self) -> list[R]:
        """The requests in the solve in flight."""
        return [] if self.in_flight is None else list(self.in_flight.rows.values())

    def remove(self, match: Callable[[R], bool]) -> None:
        """Drop the requests ``match`` selects (the stage knows its requests' ids): waiting, or
        in the solve in flight (no result of theirs is read; a solve left with none is forgotten)."""
        self._waiting = collections.deque(r for r in self._waiting if not match(r))
        if self.in_flight is not None and not self.in_flight.drop(match):
            self.in_flight = None

    def step(self, block: bool = True) -> list[GenerationResult[R]]:
        """The solve in flight lands when the device has finished it or ``block``; then, with
        none in flight, one solve: the group (:meth:`groups`) of the oldest waiting request,
        among the oldest ``max_batch`` (the rest wait, in their order, for the next step),
        waited for with ``block`` when none landed (one that did is returned now, not after
        another solve), else left in flight (:attr:`in_flight`) to land in a later step while
        the caller does other work."""
        results: list[GenerationResult[R]] = []
        if self.in_flight is not None:
            if not block and not self.in_flight.done():
                return results
            flight, self.in_flight = self.in_flight, None
            results = self.land(flight)
        if not self._waiting:
            return results
        batch = [self._waiting.popleft() for _ in range(min(self.max_batch, len(self._waiting)))]
        group = next(g for g in self.groups(batch) if any(r is batch[0] for r in g))
        chosen = {id(r) for r in group}
        self._waiting.extendleft(reversed([r for r in batch if id(r) not in chosen]))
        if block and not results:
            return self.run(group)
        self.in_flight = self._dispatch(group)
        return results

    def groups(self, requests: list[R]) -> list[list[R]]:
        """``requests`` split into solves, shortest first, each request in one.

        Sorted by length, the requests are cut into contiguous groups that minimise the padded
        rows x length (both to their :attr:`buckets`) plus :meth:`SolveCost.overhead` per solve
        (:func:`~omni_jax.engine.buckets.padded_split`). With little overhead a group holds one
        length bucket (or splits where its rows would pad to the next bucket); the larger a
        solve's fixed cost, the more lengths share one. Whatever the fit, every group's shape is
        one of the buckets' (within :attr:`SolveBuckets.max_cells`).
        """
        return self.buckets.split(requests, self.padder.length, self.cost.overhead())

    def shape(self, requests: Sequence[R]) -> tuple[int, int]:
        """``(rows, length)``: the smallest bucket that holds ``requests``."""
        if not 1 <= len(requests) <= self.max_batch:
            raise ValueError(f"a batch holds 1 to {self.max_batch} requests, got {len(requests)}")
        rows = self.buckets.rows_for(len(requests))
        length = self.buckets.length_for(max(self.padder.length(r) for r in requests))
        if not self.buckets.fits(rows, length):
            raise ValueError(
                f"a solve of {len(requests)} requests padded to {length} is {rows} x {length}, more than "
                f"the {self.buckets.max_cells} rows x length a solve may have"
            )
        return rows, length

    def pad(self, requests: Sequence[R]) -> B:
        """The solve's inputs for ``requests``, padded to the smallest bucket that holds them."""
        return self.padder.pad(requests, *self.shape(requests))

    def warmup(self) -> int:
        """Compile the program of every shape of :attr:`buckets`; returns how many there are.

        Each program is that of solving the padder's batch of its shape with no request in it,
        placed as a real batch is; they are compiled side by side (:func:`compile_ahead`), then
        each solved once, one after the other, and read back as :meth:`land` reads a solve (with
        several processes that read is a gather program of the solve's shape, built here too).
        """
        shapes = self.buckets.shapes()
        batches = [self.padder.pad([], rows, length).arrays(self.mesh) for rows, length in shapes]
        calls = [ProgramCall(self.solve, (self.graph, self.state, *arrays)) for arrays in batches]
        compile_ahead(calls)
        for (rows, length), call in zip(shapes, calls, strict=True):
            with scope(f"{self.name}/warmup", rows=rows, length=length):
                _host(call())
        return len(shapes)

    def run(self, requests: list[R]) -> list[GenerationResult[R]]:
        """One padded solve for ``requests``, waited for (the failure rules are :meth:`land`'s)."""
        return self.land(self._dispatch(requests))

    def _dispatch(self, requests: Sequence[R]) -> InFlight[R]:
        """Pad ``requests`` into the smallest bucket that holds them and start their solve
        (inputs to the device, one program); nothing waits for the device here."""
        rows, length = self.shape(requests)
        with scope(f"{self.name}/pad", requests=len(requests)):
            batch = self.padder.pad(requests, rows, length)

        def solve() -> tuple[jax.Array, jax.Array]:
            with scope(f"{self.name}/solve", rows=rows, length=length):
                return self.solve(self.graph, self.state, *batch.arrays(self.mesh))

        return InFlight.dispatch(requests, (rows, length), solve)

    def land(self, flight: InFlight[R]) -> list[GenerationResult[R]]:
        """A dispatched solve's outputs back to the host, split per request still wanted.

        A device failure is retried one request at a time, so only the failing ones end with its
        message (``error``) and the rest of the batch completes; a request whose output is not
        finite fails alone (rows do not mix). ``solve_s`` is :attr:`InFlight.seconds`.
        """
        requests = list(flight.rows.values())
        read = flight.read(_host)
        rows, length = flight.shape
        if isinstance(read, jax.errors.JaxRuntimeError):
            if len(requests) > 1:  # find the culprit: the others still complete
                return [result for r in requests for result in self.run([r])]
            return [
                GenerationResult(r, None, f"solve failed: {read}", 1, flight.seconds, length)
                for r in requests
            ]
        out, valid = read
        dt = flight.seconds
        self.cost.record(flight.shape, rows * length, dt)
        with scope(f"{self.name}/split", requests=len(requests)):
            results = []
            for i, r in flight.rows.items():
                o = out[i, : valid[i]]
                if np.isfinite(o).all():
                    results.append(GenerationResult(r, o.copy(), None, flight.size, dt, length))
                else:  # rows do not mix in the solve: only this request failed
                    bad = int((~np.isfinite(o)).sum())
                    message = f"non-finite {self.padder.output} ({bad} of {o.size} samples)"
                    results.append(GenerationResult(r, None, message, flight.size, dt, length))
            return results


def _host(outputs: tuple[jax.Array, ...]) -> tuple[np.ndarray, ...]:
    """A solve's outputs on this host (gathered from other processes' devices where they span them)."""
    return tuple(fetch(x) for x in outputs)
