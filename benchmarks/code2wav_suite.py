"""code2wav suite: our code2wav stage vs transformers' token2wav on the same codes and noise.

Workload: ``N = max(--batch-sizes)`` requests (default 8) whose code counts are spread evenly over
``[min_codes, max_codes]`` (50 codes are one second of audio), one voice, ``num_steps`` 10 and
guidance 0.5, each request with its own fixed initial noise that both sides start from. Batch
``b`` is the ``b`` requests around the median length (batch ``N`` is all of them, batch 1 the
median one alone).

transformers decodes one request at a time: ``Qwen2_5OmniForConditionalGeneration.generate``
calls token2wav per request, and that is token2wav's only mode, so its batch-``b`` figure is the
sum of those requests' times. It runs in float32 whatever ``--dtype`` is, as ``generate`` does (it
calls ``token2wav.float()``).

Ours runs the product path, ``OmniJaxPipeline.from_pretrained(path, stages=["code2wav"]).run``,
with the stage's engine sized to the workload (``max_batch`` the largest batch size,
``max_codes`` ``--max-codes``, offline only: :func:`benchmarks.harness.sized_code2wav_config`), after
``warmup()``: every XLA compilation after it is counted, and any fails the suite. Both sides then
decode the whole workload once to warm up (each batch for ours, each request for the
reference; reported apart as ``compile``), and the measured figures are the best of each side's
``--repeats`` rounds, all of ours first, then the reference's
(:func:`benchmarks.harness.batch_rounds`: torch's threads spinning after its calls slowed the XLA
rounds that followed them); ``--profile`` traces our runs of the last round. Our solve time is
the pipeline's own solves (each output's ``metrics``: the solve's seconds and size, and the code
bucket its row was padded to, from the engine's set for ``--max-codes``), DiT and vocoder in one
program; the reference's DiT and vocoder are timed apart. The DiT roofline is its
useful FLOPs (unpadded frames) over that time and the measured matmul ceiling; the solve floor
adds the vocoder's FLOPs (:func:`vocoder_flops`) and is the least time any engine could decode
the workload in at that ceiling, so the reference's time over it bounds the ratio. At batch 1,
the solve's products are also timed alone in XLA at the median request's shapes (the DiT's
weight matmuls, the vocoder's convolutions: :mod:`benchmarks.code2wav_ops`): the reference's time
over theirs is the ratio of an engine running XLA's kernels at those shapes with nothing else to
do. Our audio must equal the reference's to :data:`PARITY_RTOL` in float32, or the suite
fails.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import jax
import numpy as np
from flax import nnx

from benchmarks.code2wav_ops import ops_alone
from benchmarks.harness import (
    backends,
    batch_rounds,
    compile_entry,
    sized_code2wav_config,
    torch_device,
    torch_synchronize,
    warmed_up,
)
from benchmarks.roofline import matmul_flops
from omni_jax import OmniJaxPipeline, Token2WavParams
from omni_jax.models.qwen2_5_omni.token2wav import MIN_GUIDANCE

SAMPLE_RATE = 24_000
MEL_FRAMES_PER_SECOND = 100  # 24 kHz / the vocoder's 240 samples per mel frame
PARITY_RTOL = 1e-5
"""The waveform bound of ``tests/test_code2wav_parity.py`` (largest difference over the largest
magnitude, float32, same noise): the reference's audio and ours are the same math."""


def around_median(lengths: Sequence[int], size: int) -> list[int]:
    """Indices of the ``size`` requests around the median of ``lengths`` (all of them when
    ``size`` is their number), in index order: a batch of ``size`` of the workload."""
    by_length = sorted(range(len(lengths)), key=lambda i: lengths[i])
    start = min(max(len(by_length) // 2 - (size - 1) // 2, 0), len(by_length) - size)
    return sorted(by_length[start : start + size])


@dataclasses.dataclass
class Workload:
    """The requests both sides decode: codes, the noise each starts from, the knobs."""

    codes: list[list[int]]
    noise: list[np.ndarray]
    speaker: str
    num_steps: int
    guidance_scale: float
    sway_coefficient: float = -1.0

    @property
    def single(self) -> int:
        """Index of the batch-1 request: the median length."""
        return self.batch(1)[0]

    def batch(self, size: int) -> list[int]:
        """Indices of the ``size`` requests around the median length (all of them at ``N``)."""
        return around_median([len(c) for c in self.codes], size)

    def params(self, i: int) -> Token2WavParams:
        return Token2WavParams(
            num_steps=self.num_steps,
            guidance_scale=self.guidance_scale,
            sway_coefficient=self.sway_coefficient,
            initial_noise=self.noise[i],
        )


def make_workload(dit_config: Any, speaker: str, args: Any) -> Workload:
    if not 1 <= args.min_codes <= args.max_codes:
        raise SystemExit(f"--min-codes {args.min_codes} / --max-codes {args.max_codes}: need 1 <= min <= max")
    if args.num_steps < 2:
        raise SystemExit("--num-steps must be >= 2 (grid points; RK4 steps are num_steps - 1)")
    lengths = np.linspace(args.min_codes, args.max_codes, max(args.batch_sizes)).round().astype(int)
    rng = np.random.default_rng(0)
    codes = [[int(c) for c in rng.integers(0, dit_config.num_embeds, n)] for n in lengths]
    noise = [
        np.random.default_rng(1000 + i).standard_normal(
            (n * dit_config.repeats, dit_config.mel_dim), np.float32
        )
        for i, n in enumerate(lengths)
    ]
    return Workload(codes, noise, speaker, args.num_steps, args.guidance_scale)


def dit_flops(cfg: Any, frames: int) -> float:
    """FLOPs of one DiT evaluation of one row over ``frames`` mel frames (the CFG pair is 2 rows).

    Matmuls with weights, plus attention over each frame's window of key blocks (what a
    block-local implementation needs); the per-row timestep MLP and modulation are included, the
    once-per-solve conditioning (codec embedding, speaker encoder) is not.
    """
    h, inner, ff = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, int(cfg.hidden_size * cfg.ff_mult)
    in_dim = cfg.mel_dim + cfg.enc_dim + cfg.enc_emb_dim + cfg.emb_dim
    per_frame = 2 * in_dim * h + 2 * h * cfg.mel_dim
    per_row = 2 * 256 * h + 2 * h * h + 2 * h * 2 * h
    for i in range(cfg.num_hidden_layers):
        blocks = 1 + (i in cfg.look_ahead_layers) + (i in cfg.look_backward_layers)
        keys = min(blocks * cfg.block_size, frames)
        per_frame += 8 * h * inner + 4 * h * ff + 4 * inner * keys
        per_row += 2 * h * 6 * h
    return frames * per_frame + per_row


def vocoder_flops(cfg: Any, mel_frames: int) -> float:
    """FLOPs of BigVGAN over ``mel_frames`` mel frames of one row: its convolutions (pre and post,
    the transposed upsamplings, the AMP blocks' dilated pairs) and the anti-aliasing filters around
    each SnakeBeta (a depthwise 2x upsampling of the replicate-padded input, then a 2x
    downsampling), counted as torch's ``FlopCounterMode`` counts them, padding included, so the
    count is the reference's own work; elementwise work (SnakeBeta, the residual sums) is not.
    With :func:`dit_flops` it is the solve's floor at the matmul ceiling."""
    up, down = 12, 12  # Qwen2_5OmniAntiAliasedActivation1d's filter taps
    pad = up // 2 - 1  # Qwen2_5OmniUpSample1d's replicate padding (ratio 2) of each side

    def activation(channels: int, length: int) -> int:
        return 2 * channels * up * (length + 2 * pad) + 2 * channels * down * length

    channels, length = cfg.upsample_initial_channel, mel_frames
    flops = 2 * cfg.mel_dim * channels * 7 * length
    for rate, kernel in zip(cfg.upsample_rates, cfg.upsample_kernel_sizes, strict=True):
        flops += 2 * channels * (channels // 2) * kernel * length
        channels, length = channels // 2, length * rate
        for size, dilations in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True):
            flops += (
                len(dilations) * 2 * (2 * channels * channels * size * length + activation(channels, length))
            )
    return flops + activation(channels, length) + 2 * channels * 7 * length


def solve_flops(cfg: Any, work: Workload, indices: list[int]) -> float:
    """DiT FLOPs of the ODE solves of ``indices``: CFG pair x 4 RK4 stages x (num_steps - 1)."""
    evals = 2 * 4 * (work.num_steps - 1)
    return sum(evals * dit_flops(cfg, len(work.codes[i]) * cfg.repeats) for i in indices)


def audio_seconds(work: Workload, indices: list[int], repeats: int) -> float:
    return sum(len(work.codes[i]) * repeats for i in indices) / MEL_FRAMES_PER_SECOND


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def _run_ours(
    pipe: OmniJaxPipeline, work: Workload, indices: list[int]
) -> tuple[float, list[np.ndarray], dict[str, float]]:
    """``(wall s, waveforms, the pipeline's own solves)``: ``solves``, ``solve_s`` (DiT and
    vocoder are one program per solve) and ``padded_codes`` (the requests' rows as solved, each
    padded to its solve's code bucket) from the outputs' metrics, where each request carries its
    solve's seconds, size and padded length."""
    prompts = [{"prompt_token_ids": work.codes[i], "speaker": work.speaker} for i in indices]
    t0 = time.perf_counter()
    outs = pipe.run(prompts, [work.params(i) for i in indices], progress=False)
    wall = time.perf_counter() - t0
    failed = [o.error for o in outs if o.error]
    if failed:
        raise RuntimeError(f"code2wav failed: {failed[0]}")
    metrics = [o.metrics["code2wav"] for o in outs]
    solves = {
        "solves": round(sum(1 / m["batch_size"] for m in metrics)),
        "solve_s": sum(m["solve_s"] / m["batch_size"] for m in metrics),
        "padded_codes": sum(m["padded_length"] for m in metrics),
    }
    return wall, [o.audio for o in outs], solves


class Reference:
    """transformers' token2wav for one request at a time, started from the workload's noise."""

    def __init__(self, path: Path):
        import torch
        from transformers import Qwen2_5OmniForConditionalGeneration

        self.torch = torch
        self.device = torch_device()
        self.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(
            str(path), dtype=torch.float32
        ).eval()
        self.model.token2wav.to(self.device)
        # float32 as on a CPU: cuDNN's default TF32 convolutions would round the vocoder to 10 bits.
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False

    def run(self, work: Workload, i: int) -> tuple[float, float, np.ndarray]:
        """``(DiT seconds, vocoder seconds, waveform)`` of request ``i``.

        ``Qwen2_5OmniToken2WavModel.forward`` is ``DiT.sample`` then the vocoder; they are called
        one after the other here so that each is timed. ``generate`` passes the voice's
        ``cond`` and ``ref_mel`` the same way.
        """
        torch, device = self.torch, self.device
        token2wav, voice = self.model.token2wav, self.model.speaker_map[work.speaker]
        start = torch.from_numpy(work.noise[i][None].copy()).to(device)
        cond = voice["cond"].float().to(device).expand(1, -1)
        ref_mel = voice["ref_mel"].float().to(device).expand(1, -1, -1)
        codes = torch.tensor([work.codes[i]], device=device)
        with torch.no_grad(), mock.patch.object(torch, "randn", lambda *a, **k: start):
            torch_synchronize(device)
            t0 = time.perf_counter()
            mel = token2wav.code2wav_dit_model.sample(
                cond,
                ref_mel,
                codes,
                num_steps=work.num_steps,
                guidance_scale=work.guidance_scale,
                sway_coefficient=work.sway_coefficient,
            )
            torch_synchronize(device)
            t1 = time.perf_counter()
            wave = token2wav.code2wav_bigvgan_model(mel)
            torch_synchronize(device)
            t2 = time.perf_counter()
        return t1 - t0, t2 - t1, wave.reshape(-1).float().cpu().numpy()


def _figures(audio_s: float, wall_s: float, steps: int, solve_s: float) -> dict[str, float]:
    return {
        "audio_s": audio_s,
        "wall_s": wall_s,
        "audio_s_per_s": audio_s / wall_s,
        "solve_s": solve_s,
        "dit_steps_per_s": steps / solve_s,
    }


def param_dtype(state: nnx.State) -> str:
    """The dtype of a model's floating-point parameters (the first one's)."""
    floats = [x.dtype for x in jax.tree.leaves(state) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)]
    return str(floats[0]) if floats else "float32"


def run(path: Path, args: Any) -> dict[str, Any]:
    from omni_jax.weights import load_hf_config

    t2w_cfg = load_hf_config(path).token2wav_config
    dit_cfg = t2w_cfg.dit_config
    config = sized_code2wav_config(
        Path(args.cache_dir), max(args.batch_sizes), args.max_codes, streaming=False
    )
    pipe = OmniJaxPipeline.from_pretrained(
        path, stages=["code2wav"], dtype=args.dtype, mesh=args.mesh, stage_config=config
    )
    work = make_workload(dit_cfg, pipe.stages[0].default_speaker, args)
    n = len(work.codes)
    batches = {str(b): work.batch(b) for b in args.batch_sizes}
    # RK4 steps summed over requests: a batched step advances every request in it.
    steps = {b: len(idx) * (work.num_steps - 1) for b, idx in batches.items()}
    audio = {b: audio_seconds(work, idx, dit_cfg.repeats) for b, idx in batches.items()}
    reference = Reference(path) if args.reference else None

    ref_times = [[float("inf")] * 3 for _ in range(n)]  # per request: DiT, vocoder, total
    ref_first = [0.0] * n
    ref_audio: list[np.ndarray] = [np.zeros(0)] * n

    def ref_warm_up() -> None:
        for i in range(n):
            ref_first[i] = sum(reference.run(work, i)[:2])

    def ref_round() -> None:
        for i in range(n):
            dit_s, voc_s, ref_audio[i] = reference.run(work, i)
            ref_times[i] = [
                min(a, x) for a, x in zip(ref_times[i], (dit_s, voc_s, dit_s + voc_s), strict=True)
            ]

    with warmed_up(pipe) as warm:
        rounds = batch_rounds(
            functools.partial(_run_ours, pipe, work),
            batches,
            args,
            "code2wav",
            (ref_warm_up, ref_round) if reference else None,
        )
    first, ours_best, ours_audio = rounds.first, rounds.best, rounds.audio
    dtype = param_dtype(pipe.stages[0].runner.state)
    peak = matmul_flops(dtype=dtype)
    flops = {b: solve_flops(dit_cfg, work, idx) for b, idx in batches.items()}
    voc_flops = {
        b: sum(vocoder_flops(t2w_cfg.bigvgan_config, len(work.codes[i]) * dit_cfg.repeats) for i in idx)
        for b, idx in batches.items()
    }
    floor = {b: (flops[b] + voc_flops[b]) / peak for b in batches}
    ops = (
        ops_alone(
            dit_cfg,
            t2w_cfg.bigvgan_config,
            len(work.codes[work.single]),
            work.num_steps,
            work.guidance_scale >= MIN_GUIDANCE,
            dtype,
            args.repeats,
        )
        if "1" in batches
        else None
    )
    ours = {
        b: _figures(audio[b], wall, steps[b], solves["solve_s"])
        | {"solves": solves["solves"], "padded_codes": solves["padded_codes"]}
        for b, (wall, solves) in ours_best.items()
    }
    compile_ours = warm.entry(sum(first.values()), sum(wall for wall, _ in ours_best.values()))
    compile_ours["first_run_s_by_batch"] = first
    result: dict[str, Any] = {
        "suite": "code2wav",
        "dtype": dtype,
        "codes_per_request": [len(c) for c in work.codes],
        "requests_by_batch": batches,
        "num_steps": work.num_steps,
        "guidance_scale": work.guidance_scale,
        "speaker": work.speaker,
        "repeats": args.repeats,
        "dit_layers": dit_cfg.num_hidden_layers,
        "dit_solve_gflop": {b: f / 1e9 for b, f in flops.items()},
        "vocoder_gflop": {b: f / 1e9 for b, f in voc_flops.items()},
        "ceilings": {"matmul_GFLOPs": peak / 1e9},
        "roofline_fraction": {b: flops[b] / ours[b]["solve_s"] / peak for b in batches},
        "floor_s": floor,
        "floor_fraction": {b: floor[b] / ours[b]["solve_s"] for b in batches},
        "ops_alone_batch1": dataclasses.asdict(ops) | {"solve_s": ops.solve_s} if ops else None,
        "backends": backends(warm.probe),
        "failures": warm.failures(),
        "ours": ours,
        "reference": None,
        "reference_mode": "token2wav one request at a time, as generate calls it (its only mode)",
        "reference_device": reference.device if reference else None,
        "ratio": None,
        "compile": {"ours": compile_ours, "reference": None},
    }
    if reference:
        per_batch = {b: np.sum([ref_times[i] for i in idx], axis=0) for b, idx in batches.items()}
        result["reference"] = {
            b: _figures(audio[b], float(t[2]), steps[b], float(t[2]))
            | {"dit_s": float(t[0]), "vocoder_s": float(t[1])}
            for b, t in per_batch.items()
        }
        result["compile"]["reference"] = compile_entry(sum(ref_first), sum(t[2] for t in ref_times))
        result["ratio"] = {
            b: ours[b]["audio_s_per_s"] / result["reference"][b]["audio_s_per_s"] for b in batches
        }
        result["reference_roofline_fraction"] = {b: flops[b] / float(per_batch[b][0]) / peak for b in batches}
        result["ratio_at_floor"] = {b: float(per_batch[b][2]) / floor[b] for b in batches}
        if ops:
            result["ratio_at_ops_alone"] = float(per_batch["1"][2]) / ops.solve_s
        err = max(rel_err(o, r) for o, r in zip(ours_audio, ref_audio, strict=True))
        result["max_rel_err_vs_reference"] = err
        if dtype == "float32" and not err <= PARITY_RTOL:
            result["failures"].append(f"audio differs from the reference by {err:.2e} > {PARITY_RTOL:.0e}")
    return result


def table(result: dict[str, Any]) -> str:
    """The suite's result as a text table: one column per side and batch size."""
    ours, ref = result["ours"], result["reference"]
    cols = [("omni_jax", b, ours[b]) for b in ours] + (
        [("transformers", b, ref[b]) for b in ref] if ref else []
    )
    rows: list[tuple[str, list[str]]] = [
        ("audio s / wall s", [f"{c['audio_s_per_s']:.3f}" for _, _, c in cols]),
        ("wall s (best)", [f"{c['wall_s']:.2f}" for _, _, c in cols]),
        ("audio s", [f"{c['audio_s']:.2f}" for _, _, c in cols]),
        ("solve s (DiT + vocoder)", [f"{c['solve_s']:.2f}" for _, _, c in cols]),
        (
            "  of which vocoder s",
            ["-"] * len(ours) + [f"{c['vocoder_s']:.2f}" for _, _, c in cols[len(ours) :]],
        ),
        ("RK4 steps/s of solve (x requests)", [f"{c['dit_steps_per_s']:.2f}" for _, _, c in cols]),
        (
            "solves",
            [str(c.get("solves", len(result["requests_by_batch"][b]))) for _, b, c in cols],
        ),
        (
            "codes (as solved, padded to buckets)",
            [
                str(sum(result["codes_per_request"][i] for i in result["requests_by_batch"][b]))
                + (f" ({c['padded_codes']})" if "padded_codes" in c else "")
                for _, b, c in cols
            ],
        ),
        (
            "first run s (after warmup())",
            [f"{result['compile']['ours']['first_run_s_by_batch'][b]:.2f}" for b in ours]
            + ["-"] * (len(cols) - len(ours)),
        ),
    ]
    header = [f"{side} b={b}" for side, b, _ in cols]
    w = max(len(r[0]) for r in rows)
    lines = ["  ".join([f"{'':<{w}}", *(f"{h:>16}" for h in header)])]
    lines += ["  ".join([f"{name:<{w}}", *(f"{v:>16}" for v in vals)]) for name, vals in rows]
    comp = result["compile"]["ours"]
    lines.append(
        f"our warmup(): {comp['warmup_programs']} programs, {comp['warmup_s']:.1f} s (XLA compile "
        f"{comp['xla_compile_s']:.1f} s); XLA compilations after it: {comp['compiles_after_warmup']}; "
        "excluded from every figure above"
    )
    lines.append(f"transformers: {result['reference_mode']}")
    peak = result["ceilings"]["matmul_GFLOPs"]
    for b, frac in result["roofline_fraction"].items():
        gflop = result["dit_solve_gflop"][b]
        line = (
            f"DiT roofline, batch {b}: {gflop:.3g} GFLOP at {frac:.0%} of the measured {peak:.0f} GFLOP/s "
            "over our whole solve"
        )
        if ref:
            line += f" (transformers, DiT alone: {result['reference_roofline_fraction'][b]:.0%})"
        lines.append(line)
    for b, floor in result["floor_s"].items():
        line = (
            f"solve floor, batch {b}: {floor:.2f} s (DiT and vocoder FLOPs at {peak:.0f} GFLOP/s); "
            f"our solves at {result['floor_fraction'][b]:.0%} of it"
        )
        if ref:
            line += f"; an engine at the floor would be {result['ratio_at_floor'][b]:.2f}x transformers"
        lines.append(line)
    ops = result["ops_alone_batch1"]
    if ops:
        line = (
            f"solve products alone in XLA, batch 1: DiT weight matmuls {ops['dit_s']:.2f} s + vocoder "
            f"convolutions {ops['vocoder_s']:.2f} s = {ops['solve_s']:.2f} s (benchmarks.code2wav_ops)"
        )
        if ref:
            at_ops = result["ratio_at_ops_alone"]
            line += f"; an engine whose solve took only these would be {at_ops:.2f}x transformers"
        lines.append(line)
    if result["ratio"]:
        ratio = ", ".join(f"batch {b}: {r:.2f}x" for b, r in result["ratio"].items())
        lines.append(f"ratio (ours / transformers audio s per s): {ratio}")
        lines.append(
            f"max rel err of our audio vs transformers: {result['max_rel_err_vs_reference']:.2e} "
            f"(bound {PARITY_RTOL:.0e})"
        )
    return "\n".join(lines)
