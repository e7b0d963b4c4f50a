"""The benchmark harness end to end on tiny models: every suite with its reference, the JSON schema,
the profiler trace. Figures from these runs mean nothing; only their presence and sanity are checked."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import harness
from benchmarks.run import SUITES, main, parser

pytestmark = pytest.mark.filterwarnings("ignore")


def _numbers(x: object) -> list[float]:
    return [v for _, v in harness._numbers(x, "")]


def _check_schema(result: dict, suite: str) -> None:
    for key in (*harness.SUITE_FIELDS, *harness.HARNESS_FIELDS):
        assert key in result, key
    assert result["suite"] == suite
    assert result["model"] == "tiny"
    assert result["device"].startswith("cpu")
    assert {"jax", "jaxlib", "torch", "transformers"} <= set(result["versions"])
    assert result["command"].startswith(f"python -m benchmarks.run --suite {suite} --model tiny")
    assert result["persistent_cache"] is None  # compile times are real ones
    assert result["reference"] is not None
    assert all(math.isfinite(v) for v in _numbers(result))
    ratios = _numbers(result["ratio"])
    assert ratios and all(r > 0 for r in ratios)
    fractions = _numbers(result["roofline_fraction"])
    assert fractions and all(f > 0 for f in fractions)
    assert all(c > 0 for c in _numbers(result["ceilings"]))
    ours = result["compile"]["ours"]
    assert ours["first_run_s"] > 0 and ours["steady_run_s"] > 0
    assert ours["xla_compiles"] > 0 and ours["xla_compile_s"] > 0
    assert result["compile"]["reference"]["first_run_s"] > 0


def run_suite(tmp_path: Path, argv: str) -> dict:
    """``benchmarks.run`` on ``argv`` with a cache and JSON file under ``tmp_path``: its checked result."""
    out = tmp_path / "result.json"
    assert main([*argv.split(), "--cache-dir", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    harness.check_result(result)
    return result


def test_code2wav_suite(tmp_path: Path) -> None:
    prof = tmp_path / "prof"
    # Two ragged requests in one code bucket: one batched solve, one compile.
    argv = "--suite code2wav --model tiny --reference --batch-sizes 2 --min-codes 12 --max-codes 16"
    result = run_suite(tmp_path, argv + f" --num-steps 2 --repeats 1 --profile {prof}")
    _check_schema(result, "code2wav")
    assert result["codes_per_request"] == [12, 16]
    for side in ("ours", "reference"):
        figures = result[side]["2"]
        assert figures["audio_s"] == pytest.approx(28 * 2 / 100)  # codes x repeats / 100 frames per s
        assert figures["audio_s_per_s"] > 0 and figures["dit_steps_per_s"] > 0
    assert result["max_rel_err_vs_reference"] < 1e-3  # same noise, same math: same audio
    assert result["profile"] == str(prof / "code2wav")
    assert list((prof / "code2wav").glob("plugins/profile/*/*.xplane.pb"))


def test_ar_suite(tmp_path: Path) -> None:
    argv = "--suite ar --model tiny --reference --num-requests 2 --max-tokens 3 --min-prompt 4"
    result = run_suite(tmp_path, argv + " --max-prompt 8 --ref-batch 2")
    _check_schema(result, "ar")
    assert result["ours"]["output_tokens"] == result["reference"]["output_tokens"] == 6
    assert result["ours"]["tokens_per_s"] > 0 and result["ours"]["ttft_s_mean"] > 0
    assert "token_ids" not in result["ours"]
    assert result["profile"] is None


def test_e2e_suite(tmp_path: Path) -> None:
    """Three requests (text, text + image, text + audio) through thinker, talker and code2wav,
    ours against transformers generate one by one; both greedy, so the tokens agree."""
    argv = "--suite e2e --model tiny --reference --num-requests 3 --max-tokens 6 --talker-max-tokens 8"
    result = run_suite(tmp_path, argv + " --num-steps 2 --repeats 1")
    assert result["suite"] == "e2e" and result["model"] == "tiny"
    assert result["command"].startswith("python -m benchmarks.run --suite e2e --model tiny")
    assert result["requests"] == 3 and result["kinds"] == {"text": 1, "image": 1, "audio": 1}
    assert result["roofline_fraction"] is None
    assert all(math.isfinite(v) for v in _numbers(result))
    for side in ("ours", "reference"):
        figures = result[side]
        for key in (
            "requests_per_s",
            "thinker_tokens_per_s",
            "codec_tokens_per_s",
            "audio_s_per_s",
            "wall_s",
        ):
            assert figures[key] > 0, (side, key)
        assert set(figures["stage_s"]) == {"thinker", "talker", "code2wav"}
        assert all(t > 0 for t in figures["stage_s"].values())
        assert 3 * 2 <= figures["thinker_tokens"] <= 3 * 6  # at least 2, at most 6 per request
        assert 0 < figures["codec_tokens"] <= 3 * 8, side
    assert set(result["ratio"]) == {
        "requests_per_s",
        "thinker_tokens_per_s",
        "codec_tokens_per_s",
        "audio_s_per_s",
    }
    assert all(r > 0 for r in result["ratio"].values())
    assert result["agreement"] == {"thinker": 3, "codes": 3, "requests": 3}
    ours = result["compile"]["ours"]
    assert ours["first_run_s"] > 0 and ours["xla_compiles"] > 0
    assert result["compile"]["reference"]["first_run_s"] > 0


def test_soak_suite(tmp_path: Path) -> None:
    """Two tight rounds of random traffic: every request back, nothing left behind, greedy
    requests equal to transformers (the suite raises on a lost or miscounted request)."""
    argv = "--suite soak --model tiny --reference --num-requests 80 --soak-rounds 2 --soak-reference 40"
    result = run_suite(tmp_path, argv)
    ours = result["ours"]
    assert result["requests"] == 80 and len(ours["rounds"]) == 2
    assert ours["pages"] == 20 and ours["pages_unconstrained"] == 256
    for r in ours["rounds"]:
        assert r["preemptions"] > 0 and r["output_tokens"] >= 80 and r["tokens_per_s"] > 0
        assert r["deterministic_differ"] <= 1  # a float tie between programs, at most
    assert ours["live_arrays_growth"] == 0
    agree, total = result["reference"]["greedy_agreement"].split()[0].split("/")
    assert int(total) > 0 and agree == total
    assert result["ratio"] > 0


def test_suite_choices() -> None:
    """``--suite all`` runs every registered suite but the soak and the memory suite (each its
    own long run); one Suite line registers another."""
    from benchmarks.run import suites_for

    assert list(SUITES) == ["ar", "code2wav", "e2e", "soak", "memory"]
    assert suites_for("all", "tiny") == ["ar", "code2wav", "e2e"]
    assert suites_for("soak", "tiny") == ["soak"]
    assert suites_for("memory", "tiny") == ["memory"]
    with pytest.raises(SystemExit):
        parser().parse_args(["--suite", "nope"])
    with pytest.raises(SystemExit):
        main(["--suite", "ar", "--max-tokens", "1"])


def test_omni_jax_bench_passes_through(monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_jax import cli

    seen = {}
    monkeypatch.setattr("benchmarks.run.main", lambda argv, prog: seen.update(argv=argv, prog=prog) or 0)
    assert cli.main(["bench", "--suite", "code2wav", "--model", "tiny"]) == 0
    assert seen == {"argv": ["--suite", "code2wav", "--model", "tiny"], "prog": "omni-jax bench"}
