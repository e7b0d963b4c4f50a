"""What XLA's CPU scheduler holds beside an AR step (omni_jax.cpu_schedule); the estimate against
XLA's own count is in tests/test_reliability_limits.py."""

from __future__ import annotations

import pytest

from omni_jax.cpu_schedule import FLAG, concurrency_scheduler, cpu_step_bytes


@pytest.mark.parametrize(
    "flags,expected",
    [
        ("", True),
        ("--xla_force_host_platform_device_count=8", True),
        (f"--{FLAG}=false", False),
        (f"--xla_force_host_platform_device_count=8 --{FLAG}=False", False),
        (f"--{FLAG}=false --{FLAG}=true", True),
        (f"--{FLAG}=true", True),
    ],
)
def test_the_scheduler_xla_flags_ask_for(flags: str, expected: bool) -> None:
    assert concurrency_scheduler({"XLA_FLAGS": flags}) is expected
    assert concurrency_scheduler({}) is True


def test_what_each_scheduler_holds() -> None:
    """bfloat16: every weight's float32 copy under the concurrency scheduler, the largest alone
    under the depth-first one; float32 weights are not copied; the per-layer rows only with the
    concurrency scheduler (two a token row and layer)."""
    weights, layers, rows, width = [10, 30, 20], 3, 5, 7
    per_layer = 2 * layers * rows * width * 4
    depth_first = {"XLA_FLAGS": f"--{FLAG}=false"}
    assert cpu_step_bytes(weights, 2, layers, rows, width, {}) == 4 * 60 + per_layer
    assert cpu_step_bytes(weights, 2, layers, rows, width, depth_first) == 4 * 30
    assert cpu_step_bytes(weights, 4, layers, rows, width, {}) == per_layer
    assert cpu_step_bytes(weights, 4, layers, rows, width, depth_first) == 0
