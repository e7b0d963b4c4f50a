"""What XLA's CPU scheduler holds beside an AR step (omni_jax.cpu_schedule); the estimate against
XLA's own count is in tests/test_reliability_limits.py."""

from __future__ import annotations

import pytest

from omni_jax import cpu_schedule
from omni_jax.cpu_schedule import FLAG, concurrency_scheduler, cpu_step_bytes, gather_copies


def test_the_scheduler_in_effect_is_what_xla_started_with(monkeypatch) -> None:
    """This process's backend started with XLA's default, and turning the flag off in
    ``XLA_FLAGS`` now changes nothing (XLA read it at start-up): the probe asks the compiler,
    not the variable (the other scheduler: test_ar_step_estimate_under_the_depth_first_scheduler)."""
    assert concurrency_scheduler()
    monkeypatch.setenv("XLA_FLAGS", f"--{FLAG}=false")
    assert concurrency_scheduler.__wrapped__()


@pytest.mark.parametrize("concurrent", [True, False])
def test_what_each_scheduler_holds(concurrent: bool, monkeypatch) -> None:
    """bfloat16: every weight's float32 copy under the concurrency scheduler, the largest alone
    under the depth-first one; float32 weights are not copied; the per-layer rows (two a token
    row and layer) only with the concurrency scheduler; a bfloat16 cache's gathered chunk copied
    to float32 once a layer, or once."""
    monkeypatch.setattr(cpu_schedule, "concurrency_scheduler", lambda: concurrent)
    weights, layers, rows, width = [10, 30, 20], 3, 5, 7
    per_layer = 2 * layers * rows * width * 4 if concurrent else 0
    assert cpu_step_bytes(weights, 2, layers, rows, width) == 4 * (60 if concurrent else 30) + per_layer
    assert cpu_step_bytes(weights, 4, layers, rows, width) == per_layer
    assert (gather_copies(layers, 2), gather_copies(layers, 4)) == (layers if concurrent else 1, 0)
