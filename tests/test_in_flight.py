"""A dispatched solve starts its results' copies to the host at once (as an AR step does), so
the read that lands it does not wait for the transfer of a padded batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.array import ArrayImpl

from omni_jax.engine.in_flight import InFlight


def test_dispatch_starts_every_device_results_copy_to_the_host(monkeypatch) -> None:
    started: list[tuple[int, ...]] = []
    copy = ArrayImpl.copy_to_host_async

    def spy(self: ArrayImpl) -> None:
        started.append(self.shape)
        copy(self)

    monkeypatch.setattr(ArrayImpl, "copy_to_host_async", spy)
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
