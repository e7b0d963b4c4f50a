"""A solve dispatched to the device whose results the host has not read yet.

The engine core steps every stage from one thread. A stage that waited for each solve it
dispatched held the other stages' steps back for the solve's whole length, even where they run on
other devices; a solve kept as an :class:`InFlight` lets the caller go on and read it in a later
step, once :meth:`InFlight.done` says the device has its results. The
:class:`~omni_jax.engine.generation_runner.GenerationRunner` keeps its solves this way, and so
does a stage's own streamed-decode loop; an AR step's readiness is the same test
(:func:`on_host`, :meth:`~omni_jax.engine.ar_runner.ARRunner.done`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import jax
import numpy as np

T = TypeVar("T")
"""What a solve's rows are (requests, streamed chunks)."""
H = TypeVar("H")
"""A solve's results on the host."""


def on_host(outputs: Any) -> bool:
    """Whether reading ``outputs`` (a pytree of a program's results) would not wait for the
    device: every leaf a host array or a device array whose computation has finished."""
    return all(isinstance(x, np.ndarray) or x.is_ready() for x in jax.tree.leaves(outputs))


@dataclasses.dataclass
class InFlight(Generic[T]):
    """A dispatched solve: ``rows`` (row index -> what it solves, those still wanted), its padded
    ``shape``, the program's ``outputs`` (device arrays) or the device ``error`` its dispatch
    raised, how many rows it was dispatched with (``size``) and when (``started``)."""

    rows: dict[int, T]
    shape: tuple[int, ...]
    outputs: Any
    error: jax.errors.JaxRuntimeError | None
    size: int
    started: float

    @classmethod
    def dispatch(cls, items: Sequence[T], shape: tuple[int, ...], call: Callable[[], Any]) -> InFlight[T]:
        """Start ``call`` (the solve of ``items``, row ``i`` item ``i``) and the copies of its
        results to the host, which then run as soon as the device has them (as an AR step's do),
        so the read that lands the solve does not wait for the transfer of its padded batch; a
        device error raised at once is kept, to be handled where the results are read, as one
        raised there."""
        started = time.perf_counter()
        rows = dict(enumerate(items))
        try:
            outputs = call()
            for leaf in jax.tree.leaves(outputs):
                if isinstance(leaf, jax.Array):
                    leaf.copy_to_host_async()
            return cls(rows, shape, outputs, None, len(items), started)
        except jax.errors.JaxRuntimeError as e:
            return cls(rows, shape, None, e, len(items), started)

    def done(self) -> bool:
        """Whether reading the outputs would not wait for the device (a host array never does)."""
        return self.error is not None or on_host(self.outputs)

    def read(self, fetched: Callable[[Any], H]) -> H | jax.errors.JaxRuntimeError:
        """The solve's results on the host (``fetched`` of its outputs, which waits for the
        device), or the device error its dispatch or this read raised: the caller retries or
        fails the rows, as a solve waited for at once would."""
        if self.error is not None:
            return self.error
        try:
            return fetched(self.outputs)
        except jax.errors.JaxRuntimeError as e:
            return e

    def drop(self, match: Callable[[T], bool]) -> bool:
        """Stop wanting the rows ``match`` selects (their requests were aborted); whether any row
        is still wanted (if not, nothing need read the solve: the device finishes it alone)."""
        self.rows = {i: item for i, item in self.rows.items() if not match(item)}
        return bool(self.rows)

    @property
    def seconds(self) -> float:
        """From the dispatch to now: the solve's seconds when read as soon as it was done, else
        also the caller's work until it looked (a cost fit should keep each shape's fastest)."""
        return time.perf_counter() - self.started
