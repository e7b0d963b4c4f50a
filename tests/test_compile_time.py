"""``benchmarks.compile_time`` (a GPU session's start-up check) runs on the test widths: three
programs lowered and compiled, an XLA option compiled again beside the default, the JSON written;
a malformed option is refused."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import compile_time


def test_compile_time_times_three_programs(tmp_path: Path) -> None:
    out = tmp_path / "compile.json"
    option = "xla_cpu_enable_fast_math=False"
    args = ["--tiny", "--codes", "8", "--runs", "1", "--option", option, "--json", str(out)]
    assert compile_time.main(args) == 0
    result = json.loads(out.read_text())
    assert [r["program"] for r in result["rows"]] == ["whole solve", "dit solve", "vocoder"]
    for row in result["rows"]:
        assert row["lower_s"] > 0 and row["compile_s"] > 0
        assert row[f"compile_s[{option}]"] > 0
    assert result["shape"] == {"rows": 1, "codes": 8, "reference_frames": compile_time.REFERENCE_FRAMES}
    assert result["solve_s"] > 0


def test_option_needs_a_value() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected NAME=VALUE"):
        compile_time.parse_option("xla_gpu_autotune_level")
