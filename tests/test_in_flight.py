"""A dispatched solve, or encoder call, starts its results' copies to the host at once (as an AR
step does), so the read that lands it does not wait for the transfer after the computation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.array import ArrayImpl

from omni_jax.engine.in_flight import InFlight
from omni_jax.stages.thinker import _one_ahead


@pytest.fixture
def started(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the device arrays whose copy to the host was started, in order."""
    shapes: list[tuple[int, ...]] = []
    copy = ArrayImpl.copy_to_host_async

    def spy(self: ArrayImpl) -> None:
        shapes.append(self.shape)
        copy(self)

    monkeypatch.setattr(ArrayImpl, "copy_to_host_async", spy)
    return shapes


def test_dispatch_starts_every_device_results_copy_to_the_host(started) -> None:
    solve = jax.jit(lambda x: (x * 2, x.sum()))
    flight = InFlight.dispatch(["a", "b"], (2, 3), lambda: (*solve(jnp.ones((2, 3))), np.zeros(1)))
    assert sorted(started) == [(), (2, 3)]  # the device results; a host array needs no copy
    wave, total, host = flight.read(lambda outputs: tuple(np.asarray(x) for x in outputs))
    assert wave.tolist() == [[2.0] * 3] * 2 and total == 6 and host.tolist() == [0.0]


def test_a_dispatch_error_is_kept_for_the_read() -> None:
    def fails() -> None:
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")

    flight = InFlight.dispatch(["a"], (1, 1), fails)
    assert flight.done() and flight.outputs is None
    error = flight.read(lambda outputs: pytest.fail("nothing to read"))
    assert isinstance(error, jax.errors.JaxRuntimeError) and "out of memory" in str(error)


def test_encoder_calls_are_read_one_behind_their_copies_started_at_dispatch(started) -> None:
    """The thinker's encoder calls: each result's copy starts as the call is dispatched, and it
    is read (on the host, in order) once the next call is dispatched."""
    calls = [("audio", jnp.full((2,), 1.0)), ("vision", jnp.full((3,), 2.0))]

    def dispatched():
        for i, call in enumerate(calls):
            assert len(started) == i  # the previous call's copy began before this one ran
            yield call

    read = list(_one_ahead(dispatched()))
    assert started == [(2,), (3,)]
    assert [(owner, out.tolist()) for owner, out in read] == [("audio", [1.0, 1.0]), ("vision", [2.0] * 3)]
    assert all(isinstance(out, np.ndarray) for _, out in read)
