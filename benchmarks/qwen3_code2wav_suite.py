"""code2wav_qwen3 suite: our Qwen3-Omni code2wav stage vs transformers' ``Qwen3OmniMoeCode2Wav`` on
the same codec frames.

Workload: ``N = max(--batch-sizes)`` requests (default 8) of random codec frames (a frame is one
code of each of the checkpoint's ``num_quantizers`` codebooks), their frame counts spread evenly
over ``[--min-codes, --max-codes]``, counted in frames here (12.5 a second in the released model,
whose frame is 1920 samples at 24 kHz). Batch ``b`` is the ``b`` requests around the median length
(batch ``N`` is all of them, batch 1 the median one alone), as in :mod:`benchmarks.code2wav_suite`.

transformers decodes a talker's codes with ``Qwen3OmniMoeCode2Wav.chunked_decode(codes,
chunk_size=300, left_context_size=25)``, which is what ``Qwen3OmniMoeForConditionalGeneration.generate``
calls. It is measured in two modes: one request at a time (``generate`` on one sequence calls it on
that request's codes; vLLM-omni too decodes request by request), the batch-``b`` figure being the
sum of its requests' times; and, for ``b > 1``, the batch at once as ``generate`` on a batch does
it (codes zero-padded to the longest request, each waveform cut at its own length). The ratio is
ours against the faster mode at each batch size. A request longer than one chunk (300 frames)
is decoded in pieces of 300 new frames after 25 of context by both sides (our stage's offline
pieces are ``chunked_decode``'s). The reference
runs in float32 unless ``--dtype`` says otherwise (``generate`` decodes in the model's dtype).

Ours runs the product path, ``OmniJaxPipeline.from_pretrained(path, stages=["code2wav"]).run``
with default ``Token2WavParams`` (offline decoding), the stage's engine sized to the workload
(``max_batch`` the largest batch size, ``max_frames`` ``--max-codes`` up to the chunk, streaming off:
:func:`benchmarks.harness.sized_code2wav_config`), after ``warmup()``: every XLA compilation after
it is counted and any fails the suite. Both sides then decode the whole workload once to warm up
(reported apart as ``compile``), and the measured figures are the best of each side's ``--repeats``
rounds, ours first, as in :mod:`benchmarks.code2wav_suite`; ``--profile`` traces our runs of the
last round. Our solve time is the pipeline's own solves (each output's ``metrics``).
The roofline is the decode's useful FLOPs (:func:`code2wav_flops`, unpadded frames) over that time
and the measured matmul ceiling. In float32 our audio must equal the reference's in every mode to
:data:`PARITY_RTOL`, or the suite fails. ``--num-steps`` and ``--guidance-scale`` do not apply
(Qwen3-Omni's code2wav is a ConvNet, not a flow-matching solve).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.code2wav_suite import around_median, param_dtype, rel_err
from benchmarks.harness import (
    backends,
    batch_rounds,
    compile_entry,
    sized_code2wav_config,
    transformers_quiet,
    warmed_up,
)
from benchmarks.roofline import matmul_flops
from omni_jax import OmniJaxPipeline

SAMPLE_RATE = 24_000
CHUNK_FRAMES = 300
LEFT_CONTEXT_FRAMES = 25
"""``chunked_decode``'s arguments in ``generate``: frames a call, frames of context before it."""
PARITY_RTOL = 1e-5
"""The waveform bound of ``tests/test_qwen3_code2wav_stage.py`` (largest difference over the
largest magnitude, float32): the reference's audio and ours are the same math."""
ONE_AT_A_TIME = "one request at a time"
BATCHED = "batched as generate"


@dataclasses.dataclass
class Workload:
    """The requests both sides decode: each one's codec frames ``[frames, num_quantizers]``."""

    frames: list[np.ndarray]

    def batch(self, size: int) -> list[int]:
        """Indices of the ``size`` requests around the median length (all of them at ``N``)."""
        return around_median([len(f) for f in self.frames], size)

    def prompt(self, i: int) -> dict[str, list[int]]:
        """Request ``i`` as our stage takes it: its frames flattened frame-major."""
        return {"prompt_token_ids": self.frames[i].reshape(-1).tolist()}


def make_workload(cfg: Any, args: Any) -> Workload:
    """``max(--batch-sizes)`` requests of random frames, ``--min-codes`` to ``--max-codes`` frames."""
    if not 1 <= args.min_codes <= args.max_codes:
        raise SystemExit(
            f"--min-codes {args.min_codes} / --max-codes {args.max_codes}: frames, need 1 <= min <= max"
        )
    lengths = np.linspace(args.min_codes, args.max_codes, max(args.batch_sizes)).round().astype(int)
    rng = np.random.default_rng(0)
    return Workload([rng.integers(0, cfg.codebook_size, (n, cfg.num_quantizers)) for n in lengths])


def code2wav_flops(cfg: Any, frames: int) -> float:
    """FLOPs of one request's decode of ``frames`` codec frames (2 a multiply-add): the
    transformer's projections, MLP and windowed attention, the upsampler's transposed convolutions
    and ConvNeXt blocks, and the ConvNet decoder's convolutions. Norms, activations and the
    codebook embedding are left out."""
    d, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or d // heads
    window = min(cfg.sliding_window or frames, frames)
    attention = 2 * d * head_dim * (2 * heads + 2 * kv) + 4 * heads * head_dim * window
    per_frame = cfg.num_hidden_layers * (attention + 6 * d * cfg.intermediate_size)
    rate = 1  # samples a frame at this point
    for ratio in cfg.upsampling_ratios:
        rate *= ratio
        # transposed convolution of kernel = stride (one tap an output), then a ConvNeXt block
        # (depthwise kernel 7, pointwise to 4x and back)
        per_frame += rate * (2 * d * d + 2 * 7 * d + 16 * d * d)
    channels = cfg.decoder_dim
    per_frame += rate * 2 * 7 * d * channels
    for up in cfg.upsample_rates:
        rate *= up
        out = channels // 2
        # transposed convolution of kernel 2u, stride u (two taps an output), then three
        # residual units (kernel 7 and kernel 1 convolutions)
        per_frame += rate * (2 * 2 * channels * out + 3 * 2 * 8 * out * out)
        channels = out
    per_frame += rate * 2 * 7 * channels
    return frames * per_frame


def _run_ours(
    pipe: OmniJaxPipeline, work: Workload, indices: list[int]
) -> tuple[float, list[np.ndarray], float]:
    """``(wall s, waveforms, solve s)``: the pipeline's own solves from the outputs' metrics, each
    request carrying its solve's seconds and size."""
    t0 = time.perf_counter()
    outs = pipe.run([work.prompt(i) for i in indices], progress=False)
    wall = time.perf_counter() - t0
    failed = [o.error for o in outs if o.error]
    if failed:
        raise RuntimeError(f"code2wav failed: {failed[0]}")
    solve_s = sum(o.metrics["code2wav"]["solve_s"] / o.metrics["code2wav"]["batch_size"] for o in outs)
    return wall, [o.audio for o in outs], solve_s


class Reference:
    """transformers' ``Qwen3OmniMoeCode2Wav`` (the checkpoint's ``code2wav.*`` tensors alone)
    decoding as ``generate`` does."""

    def __init__(self, path: Path, cfg: Any, dtype: str | None):
        import torch
        from transformers import Qwen3OmniMoeCode2Wav

        self.torch = torch
        with transformers_quiet():
            self.model = Qwen3OmniMoeCode2Wav.from_pretrained(
                str(path),
                config=cfg,
                key_mapping={r"^code2wav\.": ""},
                dtype=getattr(torch, dtype or "float32"),
            ).eval()
        self.samples_per_frame = int(self.model.total_upsample)

    def _decode(self, codes: np.ndarray) -> tuple[float, Any]:
        """``chunked_decode`` of ``codes [batch, num_quantizers, frames]``: seconds, waveforms."""
        with self.torch.no_grad():
            t0 = time.perf_counter()
            wav = self.model.chunked_decode(
                self.torch.from_numpy(codes), chunk_size=CHUNK_FRAMES, left_context_size=LEFT_CONTEXT_FRAMES
            )
            return time.perf_counter() - t0, wav

    def one(self, frames: np.ndarray) -> tuple[float, np.ndarray]:
        """One request alone, as ``generate`` on one sequence: seconds, waveform."""
        seconds, wav = self._decode(np.ascontiguousarray(frames.T[None]))
        return seconds, wav[0, 0].float().numpy()

    def batched(self, frames: list[np.ndarray]) -> tuple[float, list[np.ndarray]]:
        """Requests together, as ``generate`` on a batch: codes zero-padded to the longest, the
        samples each chunk loses derived from the decode, each waveform cut at its own length."""
        longest = max(len(f) for f in frames)
        codes = np.zeros((len(frames), frames[0].shape[1], longest), np.int64)
        for row, f in enumerate(frames):
            codes[row, :, : len(f)] = f.T
        seconds, wav = self._decode(codes)
        chunks = math.ceil(longest / CHUNK_FRAMES)
        lost = (longest * self.samples_per_frame - wav.shape[-1]) // chunks
        waves = [
            wav[row, 0, : len(f) * self.samples_per_frame - lost * math.ceil(len(f) / CHUNK_FRAMES)]
            for row, f in enumerate(frames)
        ]
        return seconds, [w.float().numpy() for w in waves]


def _figures(audio_s: float, wall_s: float, solve_s: float) -> dict[str, float]:
    return {"audio_s": audio_s, "wall_s": wall_s, "audio_s_per_s": audio_s / wall_s, "solve_s": solve_s}


@dataclasses.dataclass
class ReferenceRounds:
    """The reference's side of the measured rounds: each request alone and each batch ``b > 1``
    at once (``together``), their best seconds and last waveforms, and the warm-up pass's seconds."""

    work: Workload
    together: dict[str, list[int]]
    first_s: float = 0.0
    alone_s: list[float] = dataclasses.field(default_factory=list)
    batch_s: dict[str, float] = dataclasses.field(default_factory=dict)
    alone_wave: list[np.ndarray] = dataclasses.field(default_factory=list)
    batch_wave: dict[str, list[np.ndarray]] = dataclasses.field(default_factory=dict)

    def warm_up(self, reference: Reference) -> None:
        """Decode everything once, unmeasured but timed (the reference's compile entry)."""
        frames = self.work.frames
        self.first_s = sum(reference.one(f)[0] for f in frames)
        self.first_s += sum(reference.batched([frames[i] for i in idx])[0] for idx in self.together.values())
        self.alone_s = [math.inf] * len(frames)
        self.batch_s = dict.fromkeys(self.together, math.inf)

    def measure(self, reference: Reference) -> None:
        """One measured round: every request alone, then every batch at once."""
        frames = self.work.frames
        self.alone_wave = []
        for i, f in enumerate(frames):
            seconds, wave = reference.one(f)
            self.alone_s[i] = min(self.alone_s[i], seconds)
            self.alone_wave.append(wave)
        for b, idx in self.together.items():
            seconds, self.batch_wave[b] = reference.batched([frames[i] for i in idx])
            self.batch_s[b] = min(self.batch_s[b], seconds)


def run(path: Path, args: Any) -> dict[str, Any]:
    from omni_jax.weights import load_hf_config

    cfg = load_hf_config(path).code2wav_config
    work = make_workload(cfg, args)
    config = sized_code2wav_config(
        Path(args.cache_dir),
        max(args.batch_sizes),
        min(args.max_codes, CHUNK_FRAMES),
        "qwen3_omni",
        streaming=False,
    )
    pipe = OmniJaxPipeline.from_pretrained(
        path, stages=["code2wav"], dtype=args.dtype, mesh=args.mesh, stage_config=config
    )
    samples_per_frame = math.prod([*cfg.upsampling_ratios, *cfg.upsample_rates])
    batches = {str(b): work.batch(b) for b in args.batch_sizes}
    frames = {b: sum(len(work.frames[i]) for i in idx) for b, idx in batches.items()}
    audio = {b: f * samples_per_frame / SAMPLE_RATE for b, f in frames.items()}
    reference = Reference(path, cfg, args.dtype) if args.reference else None
    ref = ReferenceRounds(work, {b: idx for b, idx in batches.items() if len(idx) > 1})

    with warmed_up(pipe) as warm:
        rounds = batch_rounds(
            functools.partial(_run_ours, pipe, work),
            batches,
            args,
            "code2wav_qwen3",
            (functools.partial(ref.warm_up, reference), functools.partial(ref.measure, reference))
            if reference
            else None,
        )
    first, ours_best, ours_audio = rounds.first, rounds.best, rounds.audio
    dtype = param_dtype(pipe.stages[0].runner.state)
    peak = matmul_flops(dtype=dtype)
    flops = {b: sum(code2wav_flops(cfg, len(work.frames[i])) for i in idx) for b, idx in batches.items()}
    ours = {b: _figures(audio[b], wall, solve_s) for b, (wall, solve_s) in ours_best.items()}
    compile_ours = warm.entry(sum(first.values()), sum(wall for wall, _ in ours_best.values()))
    compile_ours["first_run_s_by_batch"] = first
    result: dict[str, Any] = {
        "suite": "code2wav_qwen3",
        "dtype": dtype,
        "frames_per_request": [len(f) for f in work.frames],
        "requests_by_batch": batches,
        "samples_per_frame": samples_per_frame,
        "repeats": args.repeats,
        "decode_gflop": {b: f / 1e9 for b, f in flops.items()},
        "ceilings": {"matmul_GFLOPs": peak / 1e9},
        "roofline_fraction": {b: flops[b] / ours[b]["solve_s"] / peak for b in batches},
        "backends": backends(warm.probe),
        "failures": warm.failures(),
        "ours": ours,
        "reference": None,
        "reference_mode": (
            f"chunked_decode(codes, chunk_size={CHUNK_FRAMES}, left_context_size={LEFT_CONTEXT_FRAMES}) as "
            f"generate calls it: {ONE_AT_A_TIME} (generate on one sequence, as vLLM-omni decodes) and "
            f"{BATCHED} (zero-padded to the longest, each cut at its length); the ratio takes the faster"
        ),
        "ratio": None,
        "compile": {"ours": compile_ours, "reference": None},
    }
    if reference:
        result.update(_compare(ours, ours_audio, ref, batches, audio, flops, peak, dtype, result["failures"]))
        result["compile"]["reference"] = compile_entry(
            ref.first_s, sum(ref.alone_s) + sum(ref.batch_s.values())
        )
    return result


def _compare(
    ours: dict[str, dict[str, float]],
    ours_audio: list[np.ndarray],
    ref: ReferenceRounds,
    batches: dict[str, list[int]],
    audio: dict[str, float],
    flops: dict[str, float],
    peak: float,
    dtype: str,
    failures: list[str],
) -> dict[str, Any]:
    """The result's reference fields: figures per mode and batch, the faster mode, the ratios,
    its roofline, and our waveforms' distance from each mode's (a failure, appended to
    ``failures``, beyond :data:`PARITY_RTOL` in float32)."""
    alone = {b: sum(ref.alone_s[i] for i in idx) for b, idx in batches.items()}
    by_mode = {
        ONE_AT_A_TIME: {b: _figures(audio[b], t, t) for b, t in alone.items()},
        BATCHED: {b: _figures(audio[b], t, t) for b, t in ref.batch_s.items()},
    }
    best = {
        b: max((m for m in by_mode if b in by_mode[m]), key=lambda m, b=b: by_mode[m][b]["audio_s_per_s"])
        for b in batches
    }
    errors = {ONE_AT_A_TIME: max(rel_err(o, r) for o, r in zip(ours_audio, ref.alone_wave, strict=True))}
    largest = max(batches, key=lambda b: len(batches[b]))
    if largest in ref.batch_wave:
        errors[BATCHED] = max(rel_err(o, r) for o, r in zip(ours_audio, ref.batch_wave[largest], strict=True))
    for mode, err in errors.items():
        if dtype == "float32" and not err <= PARITY_RTOL:
            failures.append(f"audio differs from the reference ({mode}) by {err:.2e} > {PARITY_RTOL:.0e}")
    return {
        "reference": {"by_mode": by_mode, "best_mode": best},
        "ratio": {b: ours[b]["audio_s_per_s"] / by_mode[m][b]["audio_s_per_s"] for b, m in best.items()},
        "ratio_by_mode": {
            m: {b: ours[b]["audio_s_per_s"] / f["audio_s_per_s"] for b, f in figures.items()}
            for m, figures in by_mode.items()
        },
        "reference_roofline_fraction": {
            b: flops[b] / by_mode[m][b]["solve_s"] / peak for b, m in best.items()
        },
        "max_rel_err_vs_reference": errors,
    }


def table(result: dict[str, Any]) -> str:
    """The suite's result as a text table: one column per side, mode and batch size."""
    ours, ref = result["ours"], result["reference"]
    cols = [("omni_jax", b, ours[b]) for b in ours]
    if ref:
        cols += [
            (f"hf {mode.split()[0]}", b, f) for mode, figs in ref["by_mode"].items() for b, f in figs.items()
        ]
    rows: list[tuple[str, list[str]]] = [
        ("audio s / wall s", [f"{c['audio_s_per_s']:.3f}" for _, _, c in cols]),
        ("wall s (best)", [f"{c['wall_s']:.2f}" for _, _, c in cols]),
        ("audio s", [f"{c['audio_s']:.2f}" for _, _, c in cols]),
        ("decode s", [f"{c['solve_s']:.2f}" for _, _, c in cols]),
        (
            "first run s (after warmup())",
            [f"{result['compile']['ours']['first_run_s_by_batch'][b]:.2f}" for b in ours]
            + ["-"] * (len(cols) - len(ours)),
        ),
    ]
    header = [f"{side} b={b}" for side, b, _ in cols]
    w = max(len(r[0]) for r in rows)
    lines = [
        f"{len(result['frames_per_request'])} requests of {min(result['frames_per_request'])}-"
        f"{max(result['frames_per_request'])} codec frames ({result['samples_per_frame']} samples each)",
        "  ".join([f"{'':<{w}}", *(f"{h:>16}" for h in header)]),
    ]
    lines += ["  ".join([f"{name:<{w}}", *(f"{v:>16}" for v in vals)]) for name, vals in rows]
    comp = result["compile"]["ours"]
    lines.append(
        f"our warmup(): {comp['warmup_programs']} programs, {comp['warmup_s']:.1f} s (XLA compile "
        f"{comp['xla_compile_s']:.1f} s); XLA compilations after it: {comp['compiles_after_warmup']}; "
        "excluded from every figure above"
    )
    lines.append(f"transformers ('hf one' / 'hf batched'): {result['reference_mode']}")
    peak = result["ceilings"]["matmul_GFLOPs"]
    for b, frac in result["roofline_fraction"].items():
        line = (
            f"roofline, batch {b}: {result['decode_gflop'][b]:.3g} GFLOP at {frac:.0%} of the measured "
            f"{peak:.0f} GFLOP/s over our decode"
        )
        if ref:
            line += f" (transformers, {ref['best_mode'][b]}: {result['reference_roofline_fraction'][b]:.0%})"
        lines.append(line)
    if result["ratio"]:
        ratio = ", ".join(
            f"batch {b}: {r:.2f}x (vs {ref['best_mode'][b]})" for b, r in result["ratio"].items()
        )
        lines.append(f"ratio (ours / transformers audio s per s, its faster mode): {ratio}")
        errors = ", ".join(f"{m} {e:.2e}" for m, e in result["max_rel_err_vs_reference"].items())
        lines.append(f"max rel err of our audio vs transformers: {errors} (bound {PARITY_RTOL:.0e})")
    return "\n".join(lines)
