"""Which stages stepped: a test of a refusal checks that it came before any work."""

from __future__ import annotations

import pytest

from omni_jax import OmniJaxPipeline


def count_steps(pipe: OmniJaxPipeline, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of stages whose ``step`` ran, from now on (while ``monkeypatch`` holds)."""
    calls: list[str] = []
    for stage in pipe.stages:
        step = stage.step

        def counted(block: bool = True, step=step, name=stage.config.name):  # noqa: ANN001, ANN202 - bound per stage
            calls.append(name)
            return step(block)

        monkeypatch.setattr(stage, "step", counted)
    return calls
