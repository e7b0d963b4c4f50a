"""``benchmarks.compile_time`` (a GPU session's start-up check) runs on the test widths, for both
families: three programs lowered and compiled and the whole one run, the JSON written; the
programs picked, under the options given; an XLA option reaches the compiler and its program runs;
a malformed option is refused."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from benchmarks import compile_time


def test_compile_time_times_three_programs(tmp_path: Path) -> None:
    out = tmp_path / "compile.json"
    assert compile_time.main(["--tiny", "--codes", "8", "--runs", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["program"] for r in result["rows"]] == ["whole solve", "dit solve", "vocoder"]
    for row in result["rows"]:
        assert row["lower_s"] > 0 and row["compile_s"] > 0
    assert result["shape"] == {"rows": 1, "codes": 8, "reference_frames": compile_time.REFERENCE_FRAMES}
    assert result["solve_s"] > 0 and result["options"] == {}


def test_compile_time_times_qwen3_omni_code2wav(tmp_path: Path) -> None:
    out = tmp_path / "compile.json"
    argv = [
        "--family",
        "qwen3_omni",
        "--tiny",
        "--rows",
        "2",
        "--codes",
        "16",
        "--runs",
        "1",
        "--json",
        str(out),
    ]
    assert compile_time.main(argv) == 0
    result = json.loads(out.read_text())
    assert [r["program"] for r in result["rows"]] == ["whole decode", "transformer + upsampling", "decoder"]
    for row in result["rows"]:
        assert row["lower_s"] > 0 and row["compile_s"] > 0
    assert result["model"] == "qwen3_omni tiny" and result["shape"] == {"rows": 2, "frames": 16}
    assert result["solve_s"] > 0


def test_compile_time_compiles_the_programs_asked_under_the_options_given(tmp_path: Path) -> None:
    """One program a process, one set of options for all its compiles: how a GPU session compares
    them (XLA's autotuning results last the process); the part alone runs no whole program."""
    out = tmp_path / "compile.json"
    argv = ["--family", "qwen3_omni", "--tiny", "--codes", "8", "--programs", "2", "--runs", "1"]
    argv += ["--option", "xla_cpu_enable_fast_math=False", "--json", str(out)]
    assert compile_time.main(argv) == 0
    result = json.loads(out.read_text())
    assert [r["program"] for r in result["rows"]] == ["decoder"] and result["solve_s"] is None
    assert result["options"] == {"xla_cpu_enable_fast_math": "False"}


def test_option_needs_a_value() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected NAME=VALUE"):
        compile_time.parse_option("xla_gpu_autotune_level")


def test_an_option_reaches_xla() -> None:
    """``--option`` values go to XLA's compiler (a small program here: the three above are the
    suite's cost); one XLA rejects is an error, not a silent default."""
    lowered = jax.jit(lambda x: jnp.tanh(x) * 2).lower(jnp.ones(8))
    seconds, compiled = compile_time.timed_compile(lowered, {"xla_cpu_enable_fast_math": "False"})
    assert seconds > 0 and float(compiled(jnp.full(8, 24.0))[0]) == 2.0  # tanh(24) is 1 in float32
    with pytest.raises(jax.errors.JaxRuntimeError, match="not a valid bool value"):
        compile_time.timed_compile(lowered, {"xla_cpu_enable_fast_math": "maybe"})
