"""The benchmark harness end to end on tiny models: every suite with its reference, the JSON schema,
the profiler trace, and what makes a suite fail. Figures from these runs mean nothing; their
presence and sanity are checked, and so is everything a suite holds the two sides to: greedy
agreement up to checked near-ties, no compilation after ``warmup()``, audio within the parity bound.

Each run keeps our engine small (few sequences, short model length, small step budget) so that
``warmup()``, which compiles every program those sizes allow, stays short."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import agreement, harness
from benchmarks.run import SUITES, main, parser

pytestmark = pytest.mark.filterwarnings("ignore")

CODE2WAV_PARITY = 1e-5
"""The waveform bound of tests/test_code2wav_parity.py: same codes, same noise, same math."""


def _numbers(x: object) -> list[float]:
    return [v for _, v in harness._numbers(x, "")]


def _check_common(result: dict, suite: str) -> None:
    for key in (*harness.SUITE_FIELDS, *harness.HARNESS_FIELDS, *harness.OPTIONAL_FIELDS):
        assert key in result, key
    assert result["suite"] == suite and result["model"] == "tiny"
    assert result["failures"] == []
    assert result["device"].startswith("cpu")
    assert {"jax", "jaxlib", "torch", "transformers"} <= set(result["versions"])
    assert result["command"].startswith(f"python -m benchmarks.run --suite {suite} --model tiny")
    assert result["persistent_cache"] is None  # compile times are real ones
    assert all(math.isfinite(v) for v in _numbers(result))
    env = result["environment"]
    assert env["threads"]["torch_intra_op"] == env["threads"]["xla_intra_op"] == env["cores"] >= 1
    backends = result["backends"]
    assert backends["attention"] == "auto" and backends["pixels"] in ("pil", "torchvision")
    assert (
        backends["moe_experts"]
        == {"cpu": "assigned or dense", "gpu": "gathered or dense", "tpu": "grouped"}.get(
            jax.default_backend(), "dense"
        )
        and backends["vocoder_sin"] == "native"
        and backends["dilated_conv"] == ("phased" if jax.default_backend() == "gpu" else "direct")
        and backends["reference_hub_kernels"] == "0"
    )  # conftest's
    ours = result["compile"]["ours"]
    assert ours["warmup_programs"] > 0 and ours["warmup_s"] > 0 and ours["xla_compiles"] > 0
    assert (
        ours["xla_compile_s"] > 0 and ours["persistent_cache_loads"] == ours["persistent_cache_load_s"] == 0
    )
    assert ours["compiles_after_warmup"] == 0
    assert ours["first_run_s"] > 0 and ours["steady_run_s"] > 0
    assert result["reference"] is not None
    assert result["compile"]["reference"]["first_run_s"] > 0
    ratios = _numbers(result["ratio"])
    assert ratios and all(r > 0 for r in ratios)


def _check_agreement(summary: dict, requests: int) -> None:
    assert summary["requests"] == requests and summary["disagreements"] == []
    assert summary["identical"] + len(summary["near_ties"]) == requests


def _check_stream_common(result: dict, suite: str, flags: str) -> None:
    """What a streamed-speech suite's result holds whatever its family: the schema, no failure,
    the command, versions and threads, compile times real, finite figures."""
    for key in (*harness.SUITE_FIELDS, *harness.HARNESS_FIELDS, *harness.OPTIONAL_FIELDS):
        assert key in result, key
    assert result["suite"] == suite and result["model"] == "tiny" and result["failures"] == []
    assert result["command"].startswith(f"python -m benchmarks.run {flags} --model tiny")
    assert {"jax", "jaxlib", "torch", "transformers"} <= set(result["versions"])
    assert result["environment"]["threads"]["xla_intra_op"] == result["environment"]["cores"] >= 1
    assert result["persistent_cache"] is None and all(math.isfinite(v) for v in _numbers(result))


def run_suite(tmp_path: Path, argv: str) -> dict:
    """``benchmarks.run`` on ``argv`` with a cache and JSON file under ``tmp_path``: its checked result.
    JAX's in-process caches are emptied first, so the suite compiles as in the fresh process
    ``python -m benchmarks.run`` is: a program an earlier test of this worker built (the same
    tiny shapes) would otherwise be a cache hit, and the suite would count no compilation."""
    jax.clear_caches()
    out = tmp_path / "result.json"
    assert main([*argv.split(), "--cache-dir", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    harness.check_result(result)
    return result


def test_code2wav_suite(tmp_path: Path) -> None:
    prof = tmp_path / "prof"
    # Two ragged requests in one code bucket: one batched solve.
    argv = "--suite code2wav --model tiny --reference --batch-sizes 1,2 --min-codes 12 --max-codes 16"
    result = run_suite(tmp_path, argv + f" --num-steps 2 --repeats 1 --profile {prof}")
    _check_common(result, "code2wav")
    assert result["codes_per_request"] == [12, 16]
    assert "one request at a time" in result["reference_mode"]
    for side in ("ours", "reference"):
        figures = result[side]["2"]
        assert figures["audio_s"] == pytest.approx(28 * 2 / 100)  # codes x repeats / 100 frames per s
        assert figures["audio_s_per_s"] > 0 and figures["dit_steps_per_s"] > 0 and figures["solve_s"] > 0
    assert result["ours"]["2"]["solves"] == 1  # the pipeline's own solve, from its outputs' metrics
    # 16 codes alone, and 12 + 16 in one solve, both rows padded to the longest bucket (16 codes)
    assert (result["ours"]["1"]["padded_codes"], result["ours"]["2"]["padded_codes"]) == (16, 32)
    # rows 1, 2 of one code bucket, and no chunk program: the suite's stage never streams
    assert result["compile"]["ours"]["warmup_stages"]["code2wav"]["programs"] == 2
    assert result["ours"]["2"]["solve_s"] <= result["ours"]["2"]["wall_s"]
    assert all(f > 0 for f in _numbers(result["roofline_fraction"]))
    floor = result["floor_s"]["2"]
    assert floor == pytest.approx(
        (result["dit_solve_gflop"]["2"] + result["vocoder_gflop"]["2"]) / result["ceilings"]["matmul_GFLOPs"]
    )
    assert result["floor_fraction"]["2"] == pytest.approx(floor / result["ours"]["2"]["solve_s"])
    assert result["ratio_at_floor"]["2"] == pytest.approx(result["reference"]["2"]["solve_s"] / floor)
    ops = result["ops_alone_batch1"]  # the median request (16 codes) alone
    assert ops["dit_s"] > 0 and ops["vocoder_s"] > 0
    assert ops["solve_s"] == pytest.approx(ops["dit_s"] + ops["vocoder_s"])
    assert result["ratio_at_ops_alone"] == pytest.approx(result["reference"]["1"]["solve_s"] / ops["solve_s"])
    assert result["max_rel_err_vs_reference"] < CODE2WAV_PARITY
    assert result["profile"] == str(prof / "code2wav")
    assert list((prof / "code2wav").glob("plugins/profile/*/*.xplane.pb"))


@pytest.mark.parametrize("config", ["tiny", "released"])
def test_vocoder_flops_count_what_the_reference_runs(config: str) -> None:
    """The solve floor's vocoder term equals torch's own count of transformers' BigVGAN on the
    same mel frames, the tiny test config and the released model's (transformers' defaults)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniBigVGANConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniToken2WavBigVGANModel

    from benchmarks.code2wav_suite import vocoder_flops
    from omni_jax.testing import TINY_BIGVGAN_CONFIG

    cfg = Qwen2_5OmniBigVGANConfig(**(TINY_BIGVGAN_CONFIG if config == "tiny" else {}))
    model = Qwen2_5OmniToken2WavBigVGANModel(cfg).eval()
    for frames in (3, 10):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.randn(1, cfg.mel_dim, frames))
        assert vocoder_flops(cfg, frames) == counter.get_total_flops()


def test_code2wav_ops_are_the_solves_products() -> None:
    """The products the code2wav suite times alone are the DiT's per-frame weight matmuls and
    BigVGAN's convolutions: as many weights as transformers' models hold in them (the input
    projection's noisy-mel rows only: the rest is conditioning, once per solve), and a chain that
    turns mel frames into as many samples as the vocoder does."""
    import torch
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
        Qwen2_5OmniBigVGANConfig,
        Qwen2_5OmniDiTConfig,
    )
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniToken2WavBigVGANModel,
        Qwen2_5OmniToken2WavDiTModel,
    )

    from benchmarks.code2wav_ops import dit_matmul_shapes, vocoder_convs
    from omni_jax.testing import TINY_BIGVGAN_CONFIG, TINY_DIT_CONFIG

    dit_cfg = Qwen2_5OmniDiTConfig(**TINY_DIT_CONFIG)
    dit = dict(Qwen2_5OmniToken2WavDiTModel(dit_cfg).named_parameters())
    per_frame = (
        r"transformer_blocks\.\d+\.(attn\.to_[qkv]|attn\.to_out\.0|ff\.ff\.[03])\.weight",
        "proj_out.weight",
    )
    weights = sum(p.numel() for n, p in dit.items() if any(re.fullmatch(r, n) for r in per_frame))
    weights += dit_cfg.mel_dim * dit["input_embed.proj.weight"].shape[0]
    assert sum(i * o for i, o in dit_matmul_shapes(dit_cfg)) == weights

    voc_cfg = Qwen2_5OmniBigVGANConfig(**TINY_BIGVGAN_CONFIG)
    vocoder = Qwen2_5OmniToken2WavBigVGANModel(voc_cfg).eval()
    convs = [m.weight for m in vocoder.modules() if isinstance(m, torch.nn.Conv1d | torch.nn.ConvTranspose1d)]
    chain = vocoder_convs(voc_cfg, "float32")
    assert sorted(k.size for k in chain.kernels) == sorted(w.numel() for w in convs)
    frames = 10
    with torch.no_grad():
        samples = vocoder(torch.randn(1, voc_cfg.mel_dim, frames)).shape[-1]
    mel = jax.ShapeDtypeStruct((1, frames, voc_cfg.mel_dim), jnp.float32)
    assert jax.eval_shape(chain, mel, chain.state).shape == (1, samples, 1)


def test_decode_matmul_shapes_are_the_decoders_weights() -> None:
    """The chain timed against a decode step multiplies by every projection and the LM head of
    the decoder: as many weights as transformers' Qwen2 holds in them, no more."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from benchmarks.ar_suite import decode_matmul_shapes

    cfg = Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    linear = sum(
        p.numel() for n, p in model.named_parameters() if n.endswith(("proj.weight", "lm_head.weight"))
    )
    assert sum(i * o for i, o in decode_matmul_shapes(cfg)) == linear


def test_workload_floor_is_prompt_flops_then_decode_waves() -> None:
    """Three requests, two at a time: prompt FLOPs at the ceiling (the head on each prompt's last
    token only), then two waves of decode steps (2 rows, then 1), each step the larger of its
    weight read and its FLOPs."""
    from benchmarks.ar_suite import Ceilings, workload_floor
    from benchmarks.models import DecodeWeights

    weights = DecodeWeights(params=1000, dense=1000)  # 100 of them the head
    ceil = Ceilings(bandwidth=4000.0, flops=8000.0, itemsize=4)  # a step reads for 1 s
    floor = workload_floor(weights, 100, [10, 20, 30], max_new=5, max_num_seqs=2, ceil=ceil)
    assert floor["prefill_s"] == pytest.approx(2 * (900 * 60 + 100 * 3) / 8000)
    # 2 rows: FLOPs 2 * 1000 * 2 / 8000 = 0.5 s < the 1 s read; 4 steps a wave
    assert floor["decode_s"] == pytest.approx(4 * (1.0 + 1.0))
    assert ceil.step_s(weights, 8) == pytest.approx(2 * 1000 * 8 / 8000)  # compute-bound from here


def test_ar_suite(tmp_path: Path) -> None:
    """Three requests; transformers sorted by length in batches of 2 and of all 3."""
    argv = "--suite ar --model tiny --reference --num-requests 3 --max-tokens 3 --min-prompt 4 --max-prompt 8"
    result = run_suite(
        tmp_path,
        argv + " --ref-batches 2,all --max-num-seqs 2 --max-model-len 32 --max-num-batched-tokens 16",
    )
    _check_common(result, "ar")
    assert result["backends"]["cpu_kernel_ran"]  # float32 decode on CPU, a compiler present
    ours, ref = result["ours"], result["reference"]
    assert ours["output_tokens"] == 9 and ours["tokens_per_s"] > 0 and ours["ttft_s_mean"] > 0
    assert set(ref["by_batch"]) == {"2", "3"} and ref["skipped"] == {}
    assert all(r["output_tokens"] == 9 for r in ref["by_batch"].values())
    best = ref["by_batch"][str(ref["best_batch"])]
    assert best["tokens_per_s"] == max(r["tokens_per_s"] for r in ref["by_batch"].values())
    assert result["ratio"] == pytest.approx(ours["tokens_per_s"] / best["tokens_per_s"])
    for b in ("2", "3"):
        _check_agreement(result["agreement"][b], 3)
    assert set(ours["decode_step_s"]) == {"1", "2"} and all(
        f > 0 for f in _numbers(result["roofline_fraction"])
    )
    assert set(result["decode_matmuls_s"]) == {"1", "2"} and all(
        s > 0 for s in result["decode_matmuls_s"].values()
    )
    floor = result["workload_floor_s"]
    assert (
        floor["total_s"] == pytest.approx(floor["prefill_s"] + floor["decode_s"]) and floor["prefill_s"] > 0
    )
    assert floor["decode_s"] > 0 and result["workload_floor_fraction"] == pytest.approx(
        floor["total_s"] / ours["wall_s"]
    )
    assert result["ratio_at_floor"] == pytest.approx(best["wall_s"] / floor["total_s"])
    # Every prompt token and every output token but each request's last is computed once (the
    # pages hold every request: no preemption), in steps of the runner's row sizes.
    steps = ours["steps"]
    assert ours["overlapped_steps"] is True  # the engine's default
    assert steps["tokens"] == result["prompt_tokens"] + 9 - 3
    by_rows = steps["by_rows"]
    assert sum(e["steps"] for e in by_rows.values()) == steps["steps"]
    assert sum(e["tokens"] for e in by_rows.values()) == steps["tokens"]
    assert steps["rows"] == sum(int(r) * e["steps"] for r, e in by_rows.items())
    assert (
        0 < steps["dispatch_s"]
        and 0 < steps["fetch_s"]
        and steps["dispatch_s"] + steps["fetch_s"] < ours["wall_s"]
    )
    assert all(e["tokens"] <= int(r) * e["steps"] for r, e in by_rows.items())
    assert set(map(int, by_rows)) <= {2, 4, 8, 16} and list(map(int, by_rows)) == sorted(
        map(int, by_rows), reverse=True
    )
    assert steps["padding"] == pytest.approx(1 - steps["tokens"] / steps["rows"])
    assert 0 < steps["s"] <= ours["wall_s"]
    assert "token_ids" not in ours
    assert result["profile"] is None


def test_ar_qwen3_suite(tmp_path: Path) -> None:
    """The AR suite on Qwen3-Omni's MoE thinker (``--suite ar_qwen3``): three requests through our
    thinker stage against transformers' thinker ``generate`` sorted in batches of 2 and of all 3,
    greedy tokens compared request by request in both; the MoE decode floor's fields."""
    argv = "--suite ar_qwen3 --model tiny --reference --num-requests 3 --max-tokens 3 --min-prompt 4"
    argv += (
        " --max-prompt 8 --ref-batches 2,all --max-num-seqs 2 --max-model-len 32 --max-num-batched-tokens 16"
    )
    result = run_suite(tmp_path, argv)
    _check_common(result, "ar_qwen3")
    ours, ref = result["ours"], result["reference"]
    assert ours["output_tokens"] == 9 and ours["tokens_per_s"] > 0 and ours["ttft_s_mean"] > 0
    assert "Qwen3OmniMoeForConditionalGeneration.thinker generate" in ref["engine"]
    assert set(ref["by_batch"]) == {"2", "3"} and all(
        r["output_tokens"] == 9 for r in ref["by_batch"].values()
    )
    assert result["ratio"] == pytest.approx(
        ours["tokens_per_s"] / ref["by_batch"][str(ref["best_batch"])]["tokens_per_s"]
    )
    for b in ("2", "3"):
        _check_agreement(result["agreement"][b], 3)
    assert result["decode_matmuls_s"] is None  # a dense chain would not be the MoE step's work
    moe = result["moe"]  # the tiny thinker: 2 of its 3 layers MoE, 8 experts, top-2
    assert (moe["layers"], moe["experts"], moe["top_k"]) == (2, 8, 2)
    assert moe["experts_read_by_batch"]["1"] == pytest.approx(2.0) and moe["experts_read_by_batch"]["2"] > 2
    assert result["decode_weight_bytes"]["2"] > result["decode_weight_bytes"]["1"]
    assert set(ours["decode_step_s"]) == {"1", "2"} and all(
        f > 0 for f in _numbers(result["roofline_fraction"])
    )


def test_ar_prompts_avoid_added_tokens() -> None:
    """Prompts drawn without some ids never hold them; without exclusions they are the draw the
    Qwen2 workload always was (its figures stay comparable)."""
    from benchmarks.ar_suite import make_requests

    plain = make_requests(64, 20, 4, 12)
    rs = np.random.RandomState(0)
    assert plain == [[int(t) for t in rs.randint(3, 64, size=int(m))] for m in rs.randint(4, 13, 20)]
    avoided = make_requests(64, 20, 4, 12, exclude=range(3, 40))
    assert [len(p) for p in avoided] == [len(p) for p in plain]
    assert all(40 <= t < 64 for p in avoided for t in p)


def test_code2wav_qwen3_suite(tmp_path: Path) -> None:
    """The code2wav suite on Qwen3-Omni (``--suite code2wav_qwen3``): two ragged requests in one
    solve against transformers' ``chunked_decode`` one request at a time and as a batch, the
    waveforms within the parity bound of tests/test_qwen3_code2wav_stage.py in both modes."""
    argv = "--suite code2wav_qwen3 --model tiny --reference --batch-sizes 2 --min-codes 12 --max-codes 16"
    result = run_suite(tmp_path, argv + " --repeats 1")
    _check_common(result, "code2wav_qwen3")
    assert result["frames_per_request"] == [12, 16] and result["samples_per_frame"] == 48
    assert "chunked_decode(codes, chunk_size=300, left_context_size=25)" in result["reference_mode"]
    # rows 1, 2 of the offline solves alone: the suite's stage never streams (engine.stream: false);
    # lengths 16, 24, 32, 41: up to a 16-frame piece after 25 of context (a longer request's)
    assert result["compile"]["ours"]["warmup_stages"]["code2wav"]["programs"] == 2 * 4
    figures = [result["ours"]["2"], *(modes["2"] for modes in result["reference"]["by_mode"].values())]
    for f in figures:
        assert f["audio_s"] == pytest.approx(28 * 48 / 24_000) and f["audio_s_per_s"] > 0 and f["solve_s"] > 0
    assert result["ours"]["2"]["solve_s"] <= result["ours"]["2"]["wall_s"]
    assert set(result["ratio_by_mode"]) == {"one request at a time", "batched as generate"}
    best = result["reference"]["best_mode"]["2"]
    assert result["ratio"]["2"] == pytest.approx(result["ratio_by_mode"][best]["2"])
    errors = result["max_rel_err_vs_reference"]
    assert set(errors) == {"one request at a time", "batched as generate"}
    assert all(e < CODE2WAV_PARITY for e in errors.values())
    assert all(f > 0 for f in _numbers(result["roofline_fraction"]))


def test_code2wav_qwen3_parity_fails(tmp_path: Path) -> None:
    """Audio off the reference's by more than the bound, in either mode, is a failure; a
    workload whose shortest request is longer than its longest is refused."""
    from benchmarks import qwen3_code2wav_suite as suite

    wave = np.sin(np.arange(480, dtype=np.float32))
    work = suite.Workload([np.zeros((10, 4), np.int64)])
    ref = suite.ReferenceRounds(work, {}, alone_s=[1.0], alone_wave=[wave])
    failures: list[str] = []
    figures = {"1": {"audio_s_per_s": 1.0}}
    out = suite._compare(
        figures, [wave * (1 + 1e-3)], ref, {"1": [0]}, {"1": 0.2}, {"1": 1e6}, 1e9, "float32", failures
    )
    assert out["max_rel_err_vs_reference"]["one request at a time"] == pytest.approx(1e-3, rel=1e-3)
    assert failures == ["audio differs from the reference (one request at a time) by 1.00e-03 > 1e-05"]
    args = parser().parse_args(["--suite", "code2wav_qwen3", "--min-codes", "40", "--max-codes", "30"])
    with pytest.raises(SystemExit, match="need 1 <= min <= max"):
        suite.make_workload(None, args)


def test_e2e_suite(tmp_path: Path) -> None:
    """Three requests (text, text + image, text + audio) through thinker, talker and code2wav, ours
    against transformers request by request and in per-voice batches; both greedy."""
    argv = "--suite e2e --model tiny --reference --num-requests 3 --max-tokens 6 --talker-max-tokens 8"
    result = run_suite(tmp_path, argv + " --num-steps 2 --repeats 1 --max-num-seqs 4 --max-model-len 256")
    _check_common(result, "e2e")
    assert result["requests"] == 3 and result["kinds"] == {"text": 1, "image": 1, "audio": 1}
    assert result["roofline_fraction"] is None
    ref = result["reference"]
    # Two voices: requests 0 and 2 share one, so a batch of 4 per voice is all of that voice.
    assert set(ref["batches"]) == {"request by request", "batches of 4 per voice"}
    assert ref["batches"]["request by request"] == [[0], [1], [2]]
    assert sorted(map(sorted, ref["batches"]["batches of 4 per voice"])) == [[0, 2], [1]]
    assert ref["same_as"] == {"all of a voice": "batches of 4 per voice"}
    assert ref["best"] in ref["by_config"]
    for figures in (result["ours"], *ref["by_config"].values()):
        for key in (
            "requests_per_s",
            "thinker_tokens_per_s",
            "codec_tokens_per_s",
            "audio_s_per_s",
            "wall_s",
        ):
            assert figures[key] > 0, key
        assert set(figures["stage_s"]) == {"thinker", "talker", "code2wav"}
        assert all(t > 0 for t in figures["stage_s"].values())
        assert 3 * 2 <= figures["thinker_tokens"] <= 3 * 6  # at least 2, at most 6 per request
        assert 0 < figures["codec_tokens"] <= 3 * 8
    assert set(result["ratio"]) == {
        "requests_per_s",
        "thinker_tokens_per_s",
        "codec_tokens_per_s",
        "audio_s_per_s",
    }
    assert result["ratio"]["requests_per_s"] == pytest.approx(
        result["ours"]["requests_per_s"] / ref["by_config"][ref["best"]]["requests_per_s"]
    )
    for name in ref["by_config"]:
        _check_agreement(result["agreement"][name]["thinker"], 3)
        talker = result["agreement"][name]["talker"]
        assert talker["disagreements"] == [] and talker["requests"] >= 3 - len(
            result["agreement"][name]["thinker"]["near_ties"]
        )


def test_e2e_qwen3_suite(tmp_path: Path) -> None:
    """``--suite e2e_qwen3``: four requests (text, text + image, text + audio, text; requests 0 and 3
    in one voice) through Qwen3-Omni's thinker, talker and code2wav, against
    ``generate(return_audio=True)`` request by request and in a per-voice batch; thinker tokens held
    in both, talker frames (every codebook) to request by request, reported for the batch. The talker
    speaks at least 3 frames on both sides (``--talker-min-tokens``)."""
    argv = "--suite e2e_qwen3 --model tiny --reference --num-requests 4 --max-tokens 4 --talker-max-tokens 4"
    argv += (
        " --talker-min-tokens 3 --repeats 1 --max-num-seqs 2 --max-model-len 128 --max-num-batched-tokens 32"
    )
    result = run_suite(tmp_path, argv)
    _check_common(result, "e2e_qwen3")
    assert result["requests"] == 4 and result["kinds"] == {"text": 2, "image": 1, "audio": 1}
    assert (
        result["speakers"] == ["aiden", "chelsie", "ethan"]
        and "3 to 4 frames" in result["settings"]["talker"]
    )
    ref = result["reference"]
    assert ref["engine"] == "transformers Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)"
    assert ref["batches"]["request by request"] == [[0], [1], [2], [3]]
    assert sorted(map(sorted, ref["batches"]["batches of 4 per voice"])) == [[0, 3], [1], [2]]
    assert ref["same_as"] == {"all of a voice": "batches of 4 per voice"}
    for figures in (result["ours"], *ref["by_config"].values()):
        assert figures["requests_per_s"] > 0 and figures["audio_s"] > 0
        assert set(figures["stage_s"]) == {"thinker", "talker", "code2wav"}
        assert 4 * 2 <= figures["thinker_tokens"] <= 4 * 4
    # 4 codes a frame, 3 to 4 frames (a reply of n tokens voices n - 1), the stop code after each
    assert 4 * 3 * 4 <= result["ours"]["codec_tokens"] <= 4 * (4 * 4 + 1)
    assert result["ratio"]["requests_per_s"] == pytest.approx(
        result["ours"]["requests_per_s"] / ref["by_config"][ref["best"]]["requests_per_s"]
    )
    alone, batched = result["agreement"]["request by request"], result["agreement"]["batches of 4 per voice"]
    _check_agreement(alone["thinker"], 4)
    _check_agreement(alone["talker"], 4)
    _check_agreement(batched["thinker"], 4)
    assert alone["talker_held"] and not batched["talker_held"] and batched["talker"]["requests"] == 4


def test_qwen3_talker_tokens_and_scores() -> None:
    """How the Qwen3-Omni e2e suite compares talkers: our frames, then codec EOS when the talker
    stopped on it (not when cut by max_tokens); a reference score at flat position ``k`` comes from
    the talker's step for a frame's first code, else from the code predictor's call for that frame."""
    from types import SimpleNamespace

    from benchmarks.qwen3_e2e_suite import Qwen3Omni, Qwen3Reference

    family = Qwen3Omni.__new__(Qwen3Omni)
    family.codec_eos = 99

    def out(codes: list[int], reason: str) -> SimpleNamespace:
        return SimpleNamespace(
            stage_outputs={"talker": SimpleNamespace(token_ids=codes, finish_reason=reason)}
        )

    assert family.talker_tokens(out([1, 2, 3, 4], "stop")) == [1, 2, 3, 4, 99]
    assert family.talker_tokens(out([1, 2, 3, 4], "length")) == [1, 2, 3, 4]
    reference = Qwen3Reference.__new__(Qwen3Reference)
    reference.groups = 4
    found = {
        "thinker": SimpleNamespace(scores=[[f"thinker {k} row {r}" for r in range(2)] for k in range(3)]),
        "talker": SimpleNamespace(scores=[[f"talker {f} row {r}" for r in range(2)] for f in range(3)]),
        "predictor": [
            [[f"predictor {f} group {g} row {r}" for r in range(2)] for g in (1, 2, 3)] for f in range(3)
        ],
    }
    assert reference._scores(found, "thinker", 1, 2) == "thinker 2 row 1"
    assert reference._scores(found, "talker", 1, 8) == "talker 2 row 1"
    assert reference._scores(found, "talker", 0, 6) == "predictor 1 group 2 row 0"


def test_e2e_qwen3_stream_suite(tmp_path: Path) -> None:
    """``--suite e2e_qwen3 --stream``: closed loops of 1 and 2 clients, one reply of 8 frames each,
    offline and streamed (a first chunk of one frame, the ramp's 2 and 4, then the last: 4 audio
    updates), against transformers' time to its whole audio for the same prompts, whose tokens and
    frames are held to ours; nothing compiled after warm-up."""
    argv = "--suite e2e_qwen3 --stream --model tiny --reference --concurrency 1,2 --frames 8 --max-tokens 3"
    argv += " --requests-per-client 1 --repeats 1 --max-num-seqs 2 --max-model-len 128"
    argv += " --max-num-batched-tokens 32"
    result = run_suite(tmp_path, argv)
    _check_stream_common(result, "e2e_qwen3_stream", "--suite e2e_qwen3 --stream")
    assert result["frames_per_request"] == 8 and result["codes_per_frame"] == 4
    assert result["speech_s_per_request"] == 8 / 12.5
    distance = result["waveform_distance"]  # streamed against offline: the same length, no other seed
    assert distance["length_differs"] == 0 and distance["offline_other_seed"] is None
    assert (
        distance["streamed_vs_offline"]["pairs"] == 3 and distance["streamed_vs_offline"]["rel_l2_max"] < 1e-5
    )
    assert result["compile"]["ours"]["compiles_after_warmup"] == 0
    assert result["codes"] == {"compared": 4, "identical": 4, "differ_from_first_run_of_prompt": 0}
    for mode, updates in (("offline", 1), ("streamed", 4)):
        for level in ("1", "2"):
            f = result["ours"][mode][level]
            assert f["requests"] == int(level) and f["failed"] == 0 and f["audio_updates_mean"] == updates
            assert f["speech_s"] == pytest.approx(int(level) * 8 / 12.5)
            assert 0 < f["ttfa_s"]["p50"] <= f["e2e_s"]["max"]
    ref = result["reference"]
    assert result["reference_prompts"] == 2 and len(ref["time_to_audio_s_by_prompt"]) == 2
    assert ref["time_to_audio_s"]["p50"] > 0 and set(ref["stage_s"]) == {"thinker", "talker", "code2wav"}
    _check_agreement(ref["agreement"]["thinker"], 2)
    _check_agreement(ref["agreement"]["talker"], 2)
    for level in ("1", "2"):
        ratio = result["ratio"][level]
        streamed = result["ours"]["streamed"][level]["ttfa_s"]["p50"]
        assert ratio["ttfa_p50_reference_audio_over_streamed"] == pytest.approx(
            ref["time_to_audio_s"]["p50"] / streamed
        )
        assert ratio["reference_fastest_audio_over_streamed_ttfa_p50"] == pytest.approx(
            min(ref["time_to_audio_s_by_prompt"]) / streamed
        )
        assert result["targets"][level]["ttfa_met"] is None  # 8 frames: the target is for 125 or more


def test_stream_suite(tmp_path: Path) -> None:
    """``--suite e2e --stream``: closed loops of 1 and 2 clients, one reply of 32 codes each,
    code2wav offline and streamed (the small chunks of tests/test_streamed_audio.py: 5 a reply),
    on the suite's tiny checkpoint (talker and DiT positions raised), two rounds a level (the suite
    keeps each mode's faster, so one round slowed by the other test worker cannot decide the
    comparison): the schema, both modes' figures, identical talker codes, nothing compiled after
    warm-up, the waveform distances, and the first audio sooner streamed than offline."""
    argv = "--suite e2e --stream --model tiny --concurrency 1,2 --codes 32 --requests-per-client 1"
    argv += " --stream-sizes chunk_codes=6,max_chunk_codes=6,past_codes=4,future_codes=2,overlap_frames=4"
    argv += " --max-tokens 2"
    argv += " --num-steps 2 --repeats 2 --max-num-seqs 2 --max-model-len 128 --max-num-batched-tokens 16"
    result = run_suite(tmp_path, argv)
    _check_stream_common(result, "e2e_stream", "--suite e2e --stream")
    assert result["reference"] is None and result["backends"]["cpu_kernel_ran"]
    assert result["concurrency"] == [1, 2] and result["codes_per_request"] == 32
    assert result["stream"]["chunk_codes"] == 6 and result["audio_s_per_request"] == 32 * 2 * 60 / 24_000
    assert result["stream"]["request_chunks_codes"] == [6, 6, 6, 6, 8]
    c = result["compile"]["ours"]
    # rows 1, 2: one offline length, and chunks in the first chunk's window and the longest
    assert c["warmup_programs"] > 0 and c["warmup_stages"]["code2wav"]["programs"] == 2 * 1 + 2 * 2
    assert c["compiles_after_warmup"] == 0 and c["first_run_s"] > 0 and c["steady_run_s"] > 0
    # the unmeasured first run (1 request) and the measured ones (1 + 2, two rounds), each in both modes
    assert result["codes"] == {"compared": 7, "identical": 7, "differ_from_first_run_of_prompt": 0}
    for mode, updates in (("offline", 1), ("streamed", 5)):
        for level in ("1", "2"):
            f = result["ours"][mode][level]
            assert f["requests"] == int(level) and f["failed"] == 0
            assert f["speech_s"] == pytest.approx(int(level) * 32 / 50) and f["speech_s_per_s"] > 0
            assert f["audio_updates_mean"] == updates
            for key in ("ttfa_s", "ttft_s", "e2e_s", "rtf"):
                assert 0 < f[key]["p50"] <= f[key]["max"], key
            assert f["ttfa_s"]["max"] <= f["e2e_s"]["max"] and f["stage_s"]["code2wav"] > 0
            assert f["stall_s"]["max"] >= 0 and 0 <= f["stalled_requests"] <= f["requests"]
            if mode == "offline":  # one update: nothing to wait for once it plays
                assert f["stall_s"]["max"] == 0 and f["stalled_requests"] == 0
            solves = f["code2wav_solves"]
            assert (solves["offline_rows"], solves["chunk_rows"]) == (
                (int(level), 0) if mode == "offline" else (0, 5 * int(level))
            )
    # Which mode plays first is a measurement, the benchmark's to show (a 32-code tiny reply on a
    # loaded CI machine gave either): the ratios are held to their definitions.
    off, on = result["ours"]["offline"]["1"], result["ours"]["streamed"]["1"]
    ratio = result["ratio"]["1"]
    assert ratio["ttfa_p50_offline_over_streamed"] == pytest.approx(
        off["ttfa_s"]["p50"] / on["ttfa_s"]["p50"]
    )
    assert ratio["throughput_streamed_over_offline"] == pytest.approx(
        on["speech_s_per_s"] / off["speech_s_per_s"]
    )
    assert result["targets"]["1"]["ttfa_met"] is None  # 32 codes: the target is for 500 or more
    distance = result["waveform_distance"]["streamed_vs_offline"]
    assert distance["pairs"] == 3 and 0 <= distance["rel_l2_mean"] < 1 and distance["log_mel_l1_max"] >= 0
    assert result["waveform_distance"]["length_differs"] == 0


def test_stall_seconds_counts_the_gaps_a_listener_hears() -> None:
    """Updates played as they come at 1 ms a sample: the first plays 0.1-0.2 s; the second
    came at 0.15 s (queued, no gap) and plays to 0.3 s; the third comes at 0.5 s (0.2 s of
    silence) and the fourth at 0.55 s, while the third still plays."""
    from benchmarks.stream_suite import stall_seconds

    arrivals = [(0.1, 100), (0.15, 100), (0.5, 100), (0.55, 10)]
    assert stall_seconds(arrivals, 1e-3) == pytest.approx(0.2)
    assert stall_seconds(arrivals[:2], 1e-3) == 0.0 and stall_seconds([], 1e-3) == 0.0
    assert stall_seconds([(0.1, 100), (0.4, 10), (0.45, 10)], 1e-3) == pytest.approx(0.2 + 0.04)


def test_stream_suite_arguments(tmp_path: Path) -> None:
    """``--stream`` goes with ``--suite e2e`` only; no transformers reference; bad sizes refused."""
    with pytest.raises(SystemExit, match="--stream goes with --suite e2e"):
        main(["--suite", "ar", "--stream", "--cache-dir", str(tmp_path)])
    for bad in (["--concurrency", "0,2"], ["--stream-sizes", "chunk=6"], ["--stream-sizes", "chunk_codes=x"]):
        with pytest.raises(SystemExit):
            parser().parse_args(bad)
    args = parser().parse_args(["--stream-sizes", "chunk_codes=6,overlap_frames=4", "--concurrency", "4,1"])
    assert args.stream_sizes == {"chunk_codes": 6, "overlap_frames": 4} and args.concurrency == [1, 4]
    from benchmarks import stream_suite

    with pytest.raises(SystemExit, match="no transformers reference"):
        stream_suite.run(tmp_path, parser().parse_args(["--suite", "e2e", "--stream", "--reference"]))


def test_log_mel_distance() -> None:
    """The waveform distances: zero for one waveform, relative L2 of a scaled copy is the scale's
    distance from 1, and a 2x amplitude moves every log-mel bin by log 4 (where above the floor)."""
    from benchmarks.stream_suite import distance, log_mel

    t = np.arange(24_000) / 24_000
    wave = (
        0.3 * np.sin(2 * np.pi * 440 * t) + 0.01 * np.random.default_rng(0).standard_normal(t.size)
    ).astype(np.float32)
    assert distance(wave, wave) == {"rel_l2": 0.0, "log_mel_l1": 0.0}
    d = distance(2 * wave, wave)
    assert d["rel_l2"] == pytest.approx(1.0) and d["log_mel_l1"] == pytest.approx(np.log(4), rel=1e-3)
    mel = log_mel(wave)
    assert mel.shape == (24_000 // 256 + 1, 80) and np.isfinite(mel).all()
    assert distance(wave[:1000], wave)["rel_l2"] == 0.0  # over the common length


def test_soak_suite(tmp_path: Path) -> None:
    """Two tight rounds of random traffic: every request back, nothing left behind (the suite
    raises on a lost or miscounted request); the first 40 requests with the same caps in
    transformers, greedy ones equal to ours."""
    argv = "--suite soak --model tiny --reference --num-requests 80 --soak-rounds 2 --soak-reference 40"
    result = run_suite(tmp_path, argv)
    _check_common(result, "soak")
    ours, ref = result["ours"], result["reference"]
    assert result["requests"] == 80 and len(ours["rounds"]) == 2
    assert ours["pages"] == 20 and ours["pages_unconstrained"] == 256
    for r in ours["rounds"]:
        assert r["preemptions"] > 0 and r["output_tokens"] >= 80 and r["tokens_per_s"] > 0
        assert r["deterministic_differ"] <= 1  # a float tie between programs, at most
    assert ours["live_arrays_growth"] == 0 and ours["unconstrained_s"] > 0
    comp = result["compile"]["ours"]  # the tight rounds' first against their best: the same work
    assert comp["first_run_s"] == ours["rounds"][0]["wall_s"]
    assert (
        comp["steady_run_s"] == min(r["wall_s"] for r in ours["rounds"]) and comp["compile_and_warmup_s"] >= 0
    )
    assert ref["requests"] == ours["same_requests"]["requests"] == 40
    assert 0 < ref["greedy_requests"] < 40  # the ratio's work has sampled requests too
    _check_agreement(ref["agreement"], ref["greedy_requests"])
    assert result["ratio"] == pytest.approx(ours["same_requests"]["tokens_per_s"] / ref["tokens_per_s"])


def test_serve_suite(tmp_path: Path) -> None:
    """Three streamed chat requests at one Poisson rate against a live ``omni-jax serve`` and the
    transformers reference server (each a subprocess, one after the other): the schema, every
    figure present and sane, our server compiling nothing after its warm-up, and our replies
    identical to the reference's, request by request, in every run."""
    argv = "--suite serve --model tiny --num-requests 3 --rates 4 --max-tokens 4 --min-prompt 4"
    result = run_suite(
        tmp_path, argv + " --max-prompt 8 --max-num-seqs 2 --max-model-len 48 --max-num-batched-tokens 32"
    )
    for key in (*harness.SUITE_FIELDS, *harness.HARNESS_FIELDS):
        assert key in result, key
    assert result["suite"] == "serve" and result["model"] == "tiny" and result["failures"] == []
    assert result["command"].startswith("python -m benchmarks.run --suite serve --model tiny")
    assert result["requests"] == 3 and result["speech"] is False and result["rates_given"] == [4.0]
    ours, ref = result["ours"], result["reference"]
    assert [r["label"] for r in ref["runs"]] == ["unloaded", "4/s"]
    assert [r["label"] for r in ours["runs"]] == ["unloaded", "burst", "4/s"]
    for run in (*ref["runs"], *ours["runs"]):
        assert run["completed"] == 3 and run["failed"] == 0 and run["output_tokens"] == 3 * 4
        assert run["requests_per_s"] > 0 and run["output_tokens_per_s"] > 0
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            s = run[key]
            assert 0 < s["p50"] <= s["p90"] <= s["p99"], key
        assert run["ttfa_s"] is None and run["audio_s"] == 0
        assert all(r["status"] == "ok" and r["output_tokens"] == 4 for r in run["records"])
        assert run["agreement"] == "3/3 identical"
    assert ref["doubling_rate"] == 4.0 and ref["unloaded_p50_s"] > 0
    below = ours["runs"][-1]["e2e_s"]["p50"] < ref["p50_at_doubling_s"]
    assert result["ratio"] == (1.0 if below else 0.0)
    c = result["compile"]["ours"]
    assert c["warmup_programs"] > 0 and c["warmup_xla_compiles"] > 0 and c["warmup_cache_loads"] == 0
    assert c["compiles_after_warmup"] == 0
    assert c["ready_s"] > 0 and result["compile"]["reference"]["ready_s"] > 0


def test_poisson_arrivals() -> None:
    """Seeded exponential gaps, the same draw at every rate (scaled by it); all at once at inf."""
    from benchmarks.load_generator import poisson_arrivals

    one, two = poisson_arrivals(200, 1.0), poisson_arrivals(200, 2.0)
    assert one[0] == 0.0 and np.all(np.diff(one) > 0) and np.allclose(np.array(one) / 2, two)
    assert 0.8 < np.mean(np.diff(one)) < 1.2
    assert poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0]


def test_agreement_accepts_only_checked_near_ties() -> None:
    """Equal to the last token; a difference passes only where the reference's scores for its
    token and ours are within the bound; a side that stopped early is a difference."""
    scores = np.array([0.0, 10.0, 10.0 - 1e-5, 9.0, -np.inf])
    bound = agreement.near_tie_bound("float32")
    result = agreement.compare(
        [[1, 1], [1, 2], [1, 3], [1, 4], [1], [1, 1]],
        [[1, 1], [1, 1], [1, 1], [1, 1], [1, 1, 1], [1, 1, 2]],
        lambda i, k: scores,
        bound,
    )
    assert result.identical == 1
    assert [(d.request, d.position) for d in result.near_ties] == [(1, 1)]
    assert [(d.request, d.position, d.ours, d.reference) for d in result.disagreements] == [
        (2, 1, 3, 1),  # a gap of a tenth of the largest score
        (3, 1, 4, 1),  # ours was suppressed there
        (4, 1, None, 1),  # a one-token output is not a prefix match
        (5, 2, None, 2),
    ]
    assert result.disagreements[1].gap == math.inf
    assert len(result.failures("tokens")) == 4


def test_a_failure_exits_non_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # noqa: ANN001
    """A suite's failures are printed on stderr after its table, written to the JSON, and make the
    exit code 1."""
    import benchmarks.ar_suite as ar

    result = {k: None for k in harness.SUITE_FIELDS} | {"suite": "ar", "failures": ["tokens disagree"]}
    monkeypatch.setattr(ar, "run", lambda path, args: dict(result))
    monkeypatch.setattr(ar, "table", lambda result: "the table")
    out = tmp_path / "result.json"
    assert main(["--suite", "ar", "--model", "tiny", "--cache-dir", str(tmp_path), "--json", str(out)]) == 1
    captured = capsys.readouterr()
    assert "the table" in captured.out and "FAILED ar: tokens disagree" in captured.err
    assert json.loads(out.read_text())["failures"] == ["tokens disagree"]


def test_suite_all_runs_each_suite_in_its_own_process(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys,  # noqa: ANN001
) -> None:
    """``--suite all`` starts one process per suite, in order, each told its suite and its JSON
    last (argparse keeps the last value); their results are gathered with the command given; a
    suite whose process dies (before or after writing its result) is a failure, and the suites
    after it still run."""
    import subprocess

    import benchmarks

    launched: list[str] = []

    def child(cmd: list[str], env: dict[str, str], check: bool) -> subprocess.CompletedProcess:
        assert cmd[1:3] == ["-m", "benchmarks.run"] and not check
        assert str(Path(benchmarks.__file__).resolve().parent.parent) in env["PYTHONPATH"].split(":")
        args = parser().parse_args(cmd[3:])
        assert args.reference and args.model == "tiny"
        launched.append(args.suite)
        if args.suite == "code2wav":
            return subprocess.CompletedProcess(cmd, -11)  # killed before it wrote anything
        record = {"suite": args.suite, "command": "the child's", "failures": []}
        Path(args.json).write_text(json.dumps(record))
        return subprocess.CompletedProcess(cmd, 1 if args.suite == "e2e" else 0)  # e2e: died after

    monkeypatch.setattr(subprocess, "run", child)
    out = tmp_path / "all.json"
    argv = ["--suite", "all", "--model", "tiny", "--reference", "--json", str(out)]
    assert main(argv) == 1
    expected = ["ar", "code2wav", "e2e", "ar_qwen3", "code2wav_qwen3", "e2e_qwen3"]
    assert launched == expected
    results = json.loads(out.read_text())
    assert [r["suite"] for r in results] == expected
    assert {r["command"] for r in results} == {"python -m benchmarks.run " + " ".join(argv)}
    assert results[1]["failures"] == ["its process exited with status -11 before writing a result"]
    assert results[2]["failures"] == ["its process exited with status 1"]
    assert all(not r["failures"] for i, r in enumerate(results) if i not in (1, 2))
    assert "FAILED code2wav: its process exited with status -11" in capsys.readouterr().err


def test_suite_choices() -> None:
    """``--suite all`` runs the registered suites marked for it (not the soak nor the memory
    suite); one Suite line registers another."""
    from benchmarks.run import suites_for

    assert list(SUITES) == [
        "ar",
        "code2wav",
        "e2e",
        "soak",
        "memory",
        "serve",
        "e2e_stream",
        "ar_qwen3",
        "code2wav_qwen3",
        "e2e_qwen3",
        "e2e_qwen3_stream",
    ]
    assert suites_for("all", "tiny") == ["ar", "code2wav", "e2e", "ar_qwen3", "code2wav_qwen3", "e2e_qwen3"]
    assert suites_for("soak", "tiny") == ["soak"]
    assert parser().parse_args(["--ref-batches", "16,all,8"]).ref_batches == [16, "all", 8]
    for bad in (["--suite", "nope"], ["--ref-batches", "0"], ["--ref-batches", "eight"]):
        with pytest.raises(SystemExit):
            parser().parse_args(bad)
    with pytest.raises(SystemExit):
        main(["--suite", "ar", "--max-tokens", "1"])


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--num-requests", "0"], "--num-requests must be >= 1, got 0"),
        (["--min-prompt", "50", "--max-prompt", "10"], "--min-prompt 50 exceeds --max-prompt 10"),
        (["--min-codes", "90", "--max-codes", "60"], "--min-codes 90 exceeds --max-codes 60"),
        (["--batch-sizes", "0,x"], "argument --batch-sizes: '0,x': positive batch sizes"),
        (["--json", "/nonexistent/dir/out.json"], "--json /nonexistent/dir/out.json: cannot write a file in"),
    ],
)
def test_a_bench_mistake_is_one_line_before_any_work(argv, message, tmp_path, capsys) -> None:
    """Counts no suite can use and a ``--json`` that could not be written are refused before any
    checkpoint is built (they were numpy's errors, or a finished run's lost result)."""
    with pytest.raises(SystemExit) as exited:
        main(["--suite", "ar", "--model", "tiny", "--cache-dir", str(tmp_path), *argv])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: python -m benchmarks.run: ") and message in line, line
    assert not any(tmp_path.iterdir())  # no checkpoint was built


def test_omni_jax_bench_passes_through(monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_jax import cli

    seen = {}
    monkeypatch.setattr("benchmarks.run.main", lambda argv, prog: seen.update(argv=argv, prog=prog) or 0)
    assert cli.main(["bench", "--suite", "code2wav", "--model", "tiny"]) == 0
    assert seen == {"argv": ["--suite", "code2wav", "--model", "tiny"], "prog": "omni-jax bench"}
    for argv in (["--debug", "bench", "--suite", "ar"], ["bench", "--suite", "ar", "--debug"]):
        assert cli.main(argv) == 0  # --debug before the subcommand, as for every other one
        assert seen == {"argv": ["--suite", "ar"], "prog": "omni-jax bench"}


def test_shaped_suite_on_small_widths(tmp_path: Path) -> None:
    """The real-width suite's whole path (checkpoint written as sharded safetensors, loaded by
    ``from_pretrained``, decode and prompt probes, transformers in its own process) at widths this
    CPU runs in seconds; on a GPU it runs Qwen2.5-7B's (benchmarks/gpu.sh)."""
    from benchmarks import shaped_suite

    small = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    out = tmp_path / "shaped.json"
    argv = ["--json", str(out), "--checkpoint", str(tmp_path / "ckpt"), "--layers", "2", "--config"]
    argv += [json.dumps(small), "--batches", "1,4", "--prefill", "40", "--max-tokens", "4", "--reference"]
    assert shaped_suite.main(argv) == 0
    result = json.loads(out.read_text())
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) and result["config"]["hidden_size"] == 64
    for b in ("1", "4"):
        d = result["ours"]["decode"][b]
        assert 0 < d["floor_s"] < d["step_s"] and d["tokens_per_s"] > 0
        assert result["reference"]["by_batch"][b]["tokens_per_s"] > 0 and result["ratio_by_batch"][b] > 0
    assert result["ours"]["prefill"]["40"]["ttft_s"] > 0
    assert result["ours"]["backends"]["attention_traced"]
    with pytest.raises(SystemExit, match="other widths"):
        shaped_suite.main([*argv[:6], "--config", json.dumps(small | {"hidden_size": 128})])


def test_host_step_times_each_phase(tmp_path: Path) -> None:
    """The host phases of a decode step at two batch sizes: every phase timed, on steps that hold
    every request (the benchmark refuses a step that does not), the requests gone after; with a
    repetition penalty, so the sampler's rows carry the requests' ids (the talker's form)."""
    from benchmarks import host_step

    out = tmp_path / "host.json"
    argv = [
        "--rows",
        "1,4",
        "--repeats",
        "3",
        "--prompt",
        "20",
        "--penalty",
        "1.05",
        "--cache-dir",
        str(tmp_path),
        "--json",
        str(out),
    ]
    assert host_step.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["prompt"] == 20 and result["penalty"] == 1.05 and set(result["s"]) == {"1", "4"}
    for phases in result["s"].values():
        assert set(phases) == set(host_step.PHASES) and all(0 < t < 1 for t in phases.values())


def test_host_copy_times_both_copies_of_every_shape(tmp_path: Path) -> None:
    """Every weight shape copied both ways into both dtypes, timed, and checked equal (the
    benchmark exits non-zero where the tiled copy differs from numpy's)."""
    from benchmarks import host_copy

    out = tmp_path / "copy.json"
    assert host_copy.main(["--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * len(host_copy.SHAPES)
    assert all(r["numpy_s"] > 0 and r["tiles_s"] > 0 and r["bytes"] > 0 for r in rows)


def test_media_files_times_a_clip_against_transformers_load_video(omni_dir, tmp_path: Path) -> None:
    """A small clip built, sampled as transformers samples it (the benchmark exits non-zero where
    the frames differ), and each part of its host cost timed."""
    from benchmarks import media_files

    out = tmp_path / "media.json"
    argv = ["--seconds", "3", "--width", "160", "--height", "96", "--repeats", "1", "--model", str(omni_dir)]
    assert media_files.main([*argv, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["frames"], result["width"], result["height"]) == (6, 160, 96)
    assert len(result["times_s"]) == 4 and all(t > 0 for t in result["times_s"].values())


def test_host_pack_times_each_stages_steps(tmp_path: Path) -> None:
    """The host layout of each omni stage's prompt step and the talkers' decode steps: each
    talker's prompt step holds both prompts whole, the thinker's more than an image's
    placeholders (the frontend's expanded ids, not the tokenizer's one placeholder an image), a
    decode step a row a request; every step timed."""
    from benchmarks import host_pack

    out = tmp_path / "pack.json"
    argv = ["--requests", "2", "--prompt", "32", "--decode-rows", "8", "--repeats", "2"]
    assert host_pack.main([*argv, "--cache-dir", str(tmp_path), "--json", str(out)]) == 0
    result = json.loads(out.read_text())["s"]
    assert set(result) == {"thinker", "talker", "qwen3_talker"} and set(result["thinker"]) == {"prompt"}
    for talker in ("talker", "qwen3_talker"):
        assert result[talker]["prompt"]["tokens"] == 64
        assert result[talker]["decode"]["rows"] == result[talker]["decode"]["tokens"] == 8
    image = (host_pack.IMAGE_SIDE // 28) ** 2  # 14-pixel patches merged 2 x 2
    assert result["thinker"]["prompt"]["tokens"] > image
    assert all(
        0 < step[t] < 1 for steps in result.values() for step in steps.values() for t in ("s", "positions_s")
    )


def test_a_suite_can_place_code2wav_on_its_own_device(tmp_path: Path) -> None:
    """``--code2wav-device 1``: the stage YAML puts code2wav alone on device 1 and the AR stages
    on device 0, which they share; without it no stage names a device."""
    from omni_jax.stages.config import load_pipeline_config

    placed = load_pipeline_config(harness.sized_code2wav_config(tmp_path, 2, 50, code2wav_device=1))
    assert {s.name: list(s.devices or []) for s in placed.stages} == {
        "thinker": [0],
        "talker": [0],
        "code2wav": [1],
    }
    assert placed.allow_shared_devices
    default = load_pipeline_config(harness.sized_code2wav_config(tmp_path, 2, 50))
    assert all(s.devices is None for s in default.stages) and not default.allow_shared_devices


def test_text_prompts_turn_the_encoders_off(omni_dir: Path, tmp_path: Path) -> None:
    """The stream suites' prompts are text: they build the pipeline with every kind of media
    capped at 0 (no encoder compiled at warm-up), beside code2wav's sizes from their stage YAML;
    without it the thinker's media are the shipped ones (no limit). ``--sequential-steps``
    turns the engine core's overlap off."""
    import argparse

    from benchmarks.e2e_suite import TEXT_PROMPTS, build_pipeline
    from omni_jax.stages.thinker import EncoderBuckets, MediaLimits

    assert TEXT_PROMPTS == {"audio": 0, "image": 0, "video": 0}
    args = argparse.Namespace(
        dtype=None,
        mesh=None,
        max_model_len=None,
        max_num_batched_tokens=None,
        model="tiny",
        sequential_steps=True,
    )
    config = harness.sized_code2wav_config(tmp_path, 2, 50)
    text = build_pipeline(omni_dir, args, config, 2, "stream", TEXT_PROMPTS)
    assert text.stages[0].frontend.step_inputs.buckets == EncoderBuckets((), ())
    assert text.stages[-1].config.engine["max_batch"] == 2
    assert not text.core.overlap
    args.sequential_steps = False
    shipped = build_pipeline(omni_dir, args, config, 2, "stream")
    assert shipped.stages[0].frontend.limits == MediaLimits()
    assert shipped.core.overlap
    assert shipped.stages[0].frontend.step_inputs.buckets.vision_tokens
