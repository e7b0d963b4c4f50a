"""e2e suite: thinker -> talker -> code2wav, our pipeline vs transformers ``generate`` per request.

Workload: ``--num-requests`` chat requests (default 16) of mixed input modalities, in turn
text only, text + image and text + audio (media drawn deterministically with numpy: a random
RGB picture, a sine tone with a little noise), voices alternating over the checkpoint's
speakers; every request asks for text and speech. Both sides run the same settings:

- thinker: greedy, at least 2 and at most ``--max-tokens`` new tokens, stopping on ``<|im_end|>``
  (at least 2: transformers' ``generate`` fails on a one-token reply, its talker input is built
  from the reply's tokens after the first; ours voices nothing then);
- talker: greedy with repetition penalty 1.05 (deterministic, unlike the sampling defaults),
  at most ``--talker-max-tokens`` codes, stopping on codec EOS or pad;
- token2wav: ``--num-steps`` grid points, ``--guidance-scale`` CFG, sway -1 (generate's defaults
  10 / 0.5 / -1).

Ours is the product path, every request in one ``OmniJaxPipeline.run`` (continuous batching in
each AR stage, code2wav batching, requests in different stages at once). transformers runs
``Qwen2_5OmniForConditionalGeneration.generate`` one request at a time, as a user of it would,
each time after its processor; float32 unless ``--dtype`` (generate runs token2wav in float32
whatever the dtype). Each side's first run is reported apart (``compile``: ours is the whole
workload, during which it compiles; the reference's is request 0 alone). The measured figures
are the best of ``--repeats`` rounds in which the sides take turns, as this machine may be
shared; ``--profile`` traces our run of the last round.

Figures per side: requests/s, thinker tokens/s (new text tokens, EOS included), codec tokens/s
(talker tokens, stop token included), audio seconds per wall second (the real-time factor,
higher is better) and time per stage: seconds spent inside each stage (ours: inside the stage's
``step`` in the pipeline loop; the reference: inside ``thinker.generate``, ``talker.generate``
and ``token2wav.forward``, its processor apart), plus ours' mean per-request latency per stage
from the outputs' ``metrics``, and the time inside the audio and vision encoders (part of the
thinker's; ``--audio-seconds 10 --image-size 448`` measures them on a 10 s clip and a 448 x 448
image, the thinker issue's encoder workload). Each side's figures count its own outputs (see the talker note
below, the codes and so the audio differ in length between the sides).

Each reference request carries one left pad token (attention mask 0 there). transformers 5 drops
an all-ones attention mask inside ``generate``, and its talker adds the codec pad/BOS embeddings to
its last two prompt rows and computes its M-RoPE index only when it gets a mask, so a single
unpadded request skips that code and its talker runs off its trained path (transformers 4, which
kept the mask, ran it for every request): its codes then differ from ours, and so does the work
the talker and token2wav do. With the pad the reference runs each request as it runs a padded
batch, the way tests/test_omni_pipeline.py checks ours (identical text and codes, same waveform),
at the cost of one masked prompt token.

Correctness, request by request: identical greedy thinker tokens (``agreement["thinker"]``) and
identical voiced codes (``agreement["codes"]``; the talker is greedy too). The waveforms are not
compared, as each side draws its own DiT start noise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import CompileStats, compile_entry, measured_window
from omni_jax import OmniJaxPipeline, SamplingParams, Token2WavParams
from omni_jax.profiling import scope
from omni_jax.testing import reference_omni_processor

SAMPLE_RATE = 24_000
AUDIO_RATE = 16_000  # the thinker's audio input
STAGES = ("thinker", "talker", "code2wav")
KINDS = ("text", "image", "audio")
REPETITION_PENALTY = 1.05
MIN_THINKER_TOKENS = 2
DEFAULT_NUM_REQUESTS = 16
"""``--num-requests`` when not given (:func:`benchmarks.run.main` reads it)."""

QUESTIONS = (
    "tell me a story about a cat",
    "what is the weather like on the moon",
    "describe a quiet morning by the sea",
    "how do bees make honey",
    "say something kind to a friend",
    "why is the sky blue",
    "give me a recipe for bread",
    "what do trains sound like",
)


def tone(seconds: float, freq: float, seed: int) -> np.ndarray:
    """A 16 kHz sine tone with a little noise (as tests/omni_reference.py draws it)."""
    t = np.arange(int(AUDIO_RATE * seconds)) / AUDIO_RATE
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return (0.3 * np.sin(2 * np.pi * freq * t) + 0.05 * noise).astype(np.float32)


def picture(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@dataclasses.dataclass
class Workload:
    """The requests both sides run: our prompt dicts (text with the chat template, raw media)."""

    prompts: list[dict[str, Any]]
    kinds: list[str]
    thinker_max_tokens: int
    talker_max_tokens: int
    num_steps: int
    guidance_scale: float
    sway_coefficient: float = -1.0

    def params(self) -> list[Any]:
        return [
            SamplingParams(
                temperature=0.0, min_tokens=MIN_THINKER_TOKENS, max_tokens=self.thinker_max_tokens
            ),
            SamplingParams(
                temperature=0.0, repetition_penalty=REPETITION_PENALTY, max_tokens=self.talker_max_tokens
            ),
            Token2WavParams(
                num_steps=self.num_steps,
                guidance_scale=self.guidance_scale,
                sway_coefficient=self.sway_coefficient,
            ),
        ]


def make_workload(pipe: OmniJaxPipeline, speakers: list[str], args: Any) -> Workload:
    if args.num_requests < 1:
        raise SystemExit("--num-requests must be >= 1")
    if args.talker_max_tokens < 1:
        raise SystemExit("--talker-max-tokens must be >= 1")
    if args.num_steps < 2:
        raise SystemExit("--num-steps must be >= 2 (grid points; RK4 steps are num_steps - 1)")
    prompts, kinds = [], []
    for i in range(args.num_requests):
        kind = KINDS[i % len(KINDS)]
        media: list[dict[str, Any]] = []
        if kind == "image":  # default 56 x 56 to 84 x 112 pixels: 4 to 12 image tokens
            side = args.image_size
            h, w = (56 + 28 * (i % 2), 56 + 28 * (i % 3)) if side is None else (side, side)
            media.append({"type": "image", "image": picture(h, w, seed=i)})
        elif kind == "audio":  # default 0.5 to 1.5 s
            seconds = 0.5 + 0.25 * (i % 5) if args.audio_seconds is None else args.audio_seconds
            media.append({"type": "audio", "audio": tone(seconds, 220.0 + 55 * i, seed=i)})
        text = QUESTIONS[i % len(QUESTIONS)]
        prompt = pipe.chat_prompt([{"role": "user", "content": [*media, {"type": "text", "text": text}]}])
        prompt["speaker"] = speakers[i % len(speakers)]
        prompts.append(prompt)
        kinds.append(kind)
    return Workload(
        prompts, kinds, args.max_tokens, args.talker_max_tokens, args.num_steps, args.guidance_scale
    )


class StageClock:
    """Seconds spent inside named callables while active (patched on their instances)."""

    def __init__(self, targets: dict[str, tuple[Any, str]]):
        self.targets = targets  # name -> (object, method name)
        self.seconds = dict.fromkeys(targets, 0.0)

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                with scope(f"bench/{name}"):  # the pipeline itself names stage/<name>
                    return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0

        return timed

    @contextlib.contextmanager
    def active(self) -> Iterator[StageClock]:
        self.seconds = dict.fromkeys(self.targets, 0.0)
        for name, (obj, attr) in self.targets.items():
            setattr(obj, attr, self._timed(name, getattr(obj, attr)))
        try:
            yield self
        finally:
            for obj, attr in self.targets.values():
                delattr(obj, attr)  # back to the class's method


@dataclasses.dataclass
class SideRun:
    """One side's run of the whole workload."""

    wall_s: float
    stage_s: dict[str, float]
    thinker_tokens: list[list[int]]
    codec_tokens: list[int]
    codes: list[list[int]]
    audio_samples: list[int]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def figures(run: SideRun) -> dict[str, Any]:
    n = len(run.thinker_tokens)
    thinker = sum(len(t) for t in run.thinker_tokens)
    codec = sum(run.codec_tokens)
    audio_s = sum(run.audio_samples) / SAMPLE_RATE
    return {
        "requests": n,
        "wall_s": run.wall_s,
        "requests_per_s": n / run.wall_s,
        "thinker_tokens": thinker,
        "thinker_tokens_per_s": thinker / run.wall_s,
        "codec_tokens": codec,
        "codec_tokens_per_s": codec / run.wall_s,
        "audio_s": audio_s,
        "audio_s_per_s": audio_s / run.wall_s,
        "stage_s": dict(run.stage_s),
        **run.extra,
    }


# -- ours ---------------------------------------------------------------------------------------
def encoder_clock(module: Any, classes: tuple[str, ...]) -> StageClock:
    """Time inside ``module``'s submodules of the named classes (their ``forward``)."""
    found = {type(m).__name__: m for m in module.modules() if type(m).__name__ in classes}
    return StageClock({name: (m, "forward") for name, m in found.items()})


def _run_ours(pipe: OmniJaxPipeline, work: Workload, clock: StageClock) -> SideRun:
    # Both encoders run inside the thinker's one encode call per step (audio and vision).
    encoders = StageClock({"encoders": (pipe.stages[0].frontend.step_inputs, "encode")})
    with clock.active(), encoders.active():
        t0 = time.perf_counter()
        outs = pipe.run(work.prompts, work.params(), progress=False)
        wall = time.perf_counter() - t0
    failed = [o.error for o in outs if o.error]
    if failed:
        raise RuntimeError(f"e2e: our pipeline failed a request: {failed[0]}")
    latency = {s: float(np.mean([o.metrics[s]["wall_s"] for o in outs if s in o.metrics])) for s in STAGES}
    return SideRun(
        wall_s=wall,
        stage_s=dict(clock.seconds),
        thinker_tokens=[list(o.token_ids) for o in outs],
        codec_tokens=[len(o.stage_outputs["talker"].token_ids) for o in outs],
        codes=[
            list(o.stage_outputs["code2wav"].token_ids) if "code2wav" in o.stage_outputs else [] for o in outs
        ],
        audio_samples=[0 if o.audio is None else len(o.audio) for o in outs],
        extra={
            "encoders_s": encoders.seconds["encoders"],
            "loop_other_s": wall - sum(clock.seconds.values()),
            "thinker_ttft_s_mean": float(np.mean([o.metrics["thinker"]["ttft_s"] for o in outs])),
            "stage_latency_s_mean": latency,
            "request_latency_s_mean": float(
                np.mean([sum(o.metrics[s]["wall_s"] for s in STAGES if s in o.metrics) for o in outs])
            ),
        },
    )


# -- the reference ------------------------------------------------------------------------------


class Reference:
    """``Qwen2_5OmniForConditionalGeneration.generate`` on one request at a time."""

    def __init__(self, path: Path, dtype: str | None, eos: int, pad: int):
        import torch
        from transformers import Qwen2_5OmniForConditionalGeneration

        self.torch = torch
        self.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(
            str(path), dtype=getattr(torch, dtype or "float32")
        ).eval()
        self.proc = reference_omni_processor(path)
        self.eos, self.pad = eos, pad
        m = self.model
        self.codec_stops = [m.talker.codec_pad_token, m.talker.codec_eos_token]
        self.clock = StageClock(
            {
                "thinker": (m.thinker, "generate"),
                "talker": (m.talker, "generate"),
                "code2wav": (m.token2wav, "forward"),
            }
        )
        self.encoders = encoder_clock(m.thinker, ("Qwen2_5OmniAudioEncoder", "Qwen2_5OmniVisionEncoder"))

    def _one(self, prompt: dict[str, Any], work: Workload) -> tuple[list[int], list[int], int, int, float]:
        """``(thinker new tokens up to EOS, voiced codes, talker tokens up to the stop, samples,
        processor s)``."""
        torch, m = self.torch, self.model
        data = prompt.get("multi_modal_data", {})
        t0 = time.perf_counter()
        inputs = dict(
            self.proc(
                text=[prompt["prompt"]],
                images=data.get("image"),
                audio=data.get("audio"),
                return_tensors="pt",
            )
        )
        # generate hands unprefixed inputs to the talker too, whose forward refuses pixels
        if "pixel_values" in inputs:
            inputs["thinker_pixel_values"] = inputs.pop("pixel_values")
        # one left pad, so that generate keeps the attention mask (module docstring)
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        inputs["input_ids"] = torch.cat([torch.full_like(ids[:, :1], self.pad), ids], dim=1)
        inputs["attention_mask"] = torch.cat([torch.zeros_like(mask[:, :1]), mask], dim=1)
        preprocess_s = time.perf_counter() - t0
        codes: list[torch.Tensor] = []
        talker_generate = m.talker.generate  # the clocks' timed wrappers while they are active

        def record(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = talker_generate(*args, **kwargs)
            codes.append(out[0, kwargs["input_ids"].shape[1] :])
            return out

        def voice(code: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            # A talker that stops on its first code leaves nothing to voice, and token2wav fails
            # on no codes; that request gets no audio, as ours does.
            return token2wav(code, *args, **kwargs) if code.shape[-1] else torch.zeros(0)

        token2wav = m.token2wav.forward
        m.talker.generate, m.token2wav.forward = record, voice
        try:
            with torch.no_grad():
                seq, wave = m.generate(
                    **inputs,
                    speaker=prompt["speaker"],
                    thinker_max_new_tokens=work.thinker_max_tokens,
                    thinker_do_sample=False,
                    thinker_min_new_tokens=MIN_THINKER_TOKENS,
                    thinker_eos_token_id=self.eos,
                    thinker_pad_token_id=self.pad,
                    talker_max_new_tokens=work.talker_max_tokens,
                    talker_do_sample=False,
                    talker_repetition_penalty=REPETITION_PENALTY,
                    talker_eos_token_id=self.codec_stops,
                    token2wav_num_steps=work.num_steps,
                    token2wav_guidance_scale=work.guidance_scale,
                    token2wav_sway_coefficient=work.sway_coefficient,
                )
        finally:
            m.talker.generate, m.token2wav.forward = talker_generate, token2wav
        row = seq[0, inputs["input_ids"].shape[1] :].tolist()
        tokens = row[: row.index(self.eos) + 1] if self.eos in row else row
        code = codes[0].tolist()
        stop = min((code.index(s) for s in self.codec_stops if s in code), default=len(code))
        return tokens, code[:stop], min(stop + 1, len(code)), int(wave.numel()), preprocess_s

    def run(self, work: Workload, indices: list[int]) -> tuple[SideRun, list[float]]:
        """The requests ``indices`` one after the other; also each one's wall seconds."""
        thinker, codes, codec, samples, each = [], [], [], [], []
        preprocess = 0.0
        with self.clock.active(), self.encoders.active():
            t0 = time.perf_counter()
            for i in indices:
                t = time.perf_counter()
                tokens, voiced, n_codes, n_samples, pre_s = self._one(work.prompts[i], work)
                each.append(time.perf_counter() - t)
                thinker.append(tokens)
                codes.append(voiced)
                codec.append(n_codes)
                samples.append(n_samples)
                preprocess += pre_s
            wall = time.perf_counter() - t0
        run = SideRun(
            wall_s=wall,
            stage_s=dict(self.clock.seconds),
            thinker_tokens=thinker,
            codec_tokens=codec,
            codes=codes,
            audio_samples=samples,
            extra={
                "encoders_s": sum(self.encoders.seconds.values()),
                "preprocess_s": preprocess,
                "loop_other_s": wall - preprocess - sum(self.clock.seconds.values()),
                "request_latency_s_mean": float(np.mean(each)),
            },
        )
        return run, each


def host(load_start: tuple[float, ...]) -> dict[str, Any]:
    """What else the CPU was doing: the 1-minute load average when the suite started and ended,
    and the threads torch uses. With another process busy, torch's default of one thread per
    core can slow the reference several-fold (its threads wait on each other), so read both
    sides' figures with these in mind."""
    try:
        import torch

        threads = torch.get_num_threads()
    except ImportError:
        threads = 0
    return {
        "cpu_count": os.cpu_count() or 0,
        "loadavg_1min_start": load_start[0],
        "loadavg_1min_end": os.getloadavg()[0],
        "torch_threads": threads,
    }


def run(path: Path, args: Any) -> dict[str, Any]:
    pipe = OmniJaxPipeline.from_pretrained(path, dtype=args.dtype, mesh=args.mesh)
    names = [s.config.name for s in pipe.stages]
    if names != list(STAGES):
        raise SystemExit(f"--model {args.model}: the e2e suite needs stages {list(STAGES)}, got {names}")
    speakers = sorted(pipe.stages[-1].voices.speakers)
    work = make_workload(pipe, speakers, args)
    n = len(work.prompts)
    clock = StageClock({s.config.name: (s, "step") for s in pipe.stages})
    load_start = os.getloadavg()

    with CompileStats() as stats:
        ours_first = _run_ours(pipe, work, clock)
    reference = None
    ref_first_s = 0.0
    if args.reference:
        eos = pipe.tokenizer.convert_tokens_to_ids("<|im_end|>")
        reference = Reference(path, args.dtype, eos, pipe.tokenizer.pad_token_id)
        _, (ref_first_s,) = reference.run(work, [0])

    ours_best: SideRun | None = None
    ref_best: SideRun | None = None
    ref_request0_s = float("inf")
    for round_ in range(args.repeats):
        traced = args.profile if round_ == args.repeats - 1 else None
        with measured_window(traced, "e2e/measured round", args.profile_python, round=round_, requests=n):
            ours = _run_ours(pipe, work, clock)
        if ours_best is None or ours.wall_s < ours_best.wall_s:
            ours_best = ours
        if reference is not None:
            ref, each = reference.run(work, list(range(n)))
            ref_request0_s = min(ref_request0_s, each[0])
            if ref_best is None or ref.wall_s < ref_best.wall_s:
                ref_best = ref
    assert ours_best is not None

    result: dict[str, Any] = {
        "suite": "e2e",
        "dtype": args.dtype,
        "mesh": args.mesh,
        "requests": n,
        "kinds": {k: work.kinds.count(k) for k in KINDS},
        "speakers": speakers,
        "settings": {
            "thinker": f"greedy, {MIN_THINKER_TOKENS} to {work.thinker_max_tokens} new tokens, "
            "stop on <|im_end|>",
            "talker": f"greedy, repetition penalty {REPETITION_PENALTY}, max {work.talker_max_tokens} codes",
            "token2wav": f"num_steps {work.num_steps}, guidance {work.guidance_scale}, "
            f"sway {work.sway_coefficient}",
        },
        "repeats": args.repeats,
        "host": host(load_start),
        "ceilings": {},
        "roofline_fraction": None,
        "ours": figures(ours_best),
        "reference": None,
        "ratio": None,
        "compile": {"ours": compile_entry(ours_first.wall_s, ours_best.wall_s, stats), "reference": None},
    }
    if reference is not None and ref_best is not None:
        ref_fig = figures(ref_best)
        result["reference"] = ref_fig
        result["compile"]["reference"] = compile_entry(ref_first_s, ref_request0_s)
        keys = ("requests_per_s", "thinker_tokens_per_s", "codec_tokens_per_s", "audio_s_per_s")
        result["ratio"] = {k: result["ours"][k] / ref_fig[k] for k in keys if ref_fig[k] > 0}
        result["agreement"] = {
            "thinker": sum(
                a == b for a, b in zip(ours_best.thinker_tokens, ref_best.thinker_tokens, strict=True)
            ),
            "codes": sum(a == b for a, b in zip(ours_best.codes, ref_best.codes, strict=True)),
            "requests": n,
        }
    return result


def table(result: dict[str, Any]) -> str:
    """The suite's result as a text table: one column per side."""
    ours, ref = result["ours"], result["reference"]
    sides = [ours, ref] if ref else [ours]

    def row(name: str, fmt: Callable[[dict[str, Any]], str]) -> tuple[str, list[str]]:
        return name, [fmt(s) for s in sides]

    rows = [
        row("requests / s", lambda s: f"{s['requests_per_s']:.3f}"),
        row("thinker tokens / s", lambda s: f"{s['thinker_tokens_per_s']:.1f}"),
        row("codec tokens / s", lambda s: f"{s['codec_tokens_per_s']:.1f}"),
        row("audio s / wall s (RTF)", lambda s: f"{s['audio_s_per_s']:.3f}"),
        row("wall s (best round)", lambda s: f"{s['wall_s']:.2f}"),
        row("thinker / codec tokens", lambda s: f"{s['thinker_tokens']} / {s['codec_tokens']}"),
        row("audio s", lambda s: f"{s['audio_s']:.2f}"),
        *(row(f"in {st} s", lambda s, st=st: f"{s['stage_s'][st]:.2f}") for st in STAGES),
        row("  of which audio + vision encoders s", lambda s: f"{s['encoders_s']:.2f}"),
        row("processor s", lambda s: f"{s['preprocess_s']:.2f}" if "preprocess_s" in s else "(in stages)"),
        row("other (loop, host) s", lambda s: f"{s['loop_other_s']:.2f}"),
        row("request latency s (mean)", lambda s: f"{s['request_latency_s_mean']:.2f}"),
    ]
    comp = result["compile"]
    rows.append(
        (
            "first run s (incl. compile)",
            [f"{comp['ours']['first_run_s']:.2f}"]
            + ([f"{comp['reference']['first_run_s']:.2f} (request 0)"] if ref else []),
        )
    )
    header = ["omni_jax", "transformers"][: len(sides)]
    w = max(len(r[0]) for r in rows)
    lines = ["  ".join([f"{'':<{w}}", *(f"{h:>22}" for h in header)])]
    lines += ["  ".join([f"{name:<{w}}", *(f"{v:>22}" for v in vals)]) for name, vals in rows]
    lat = ", ".join(f"{s} {v:.2f}" for s, v in ours["stage_latency_s_mean"].items())
    lines.append(
        f"our per-request stage latency s (mean): {lat}; thinker TTFT {ours['thinker_ttft_s_mean']:.3f} s"
    )
    c = comp["ours"]
    lines.append(
        f"our first run: {c['first_run_s']:.1f} s, of which XLA compile {c['xla_compile_s']:.1f} s "
        f"({c['xla_compiles']} programs); excluded from every figure above"
    )
    lines.append(
        f"{result['requests']} requests {result['kinds']}; "
        + "; ".join(f"{k}: {v}" for k, v in result["settings"].items())
    )
    h = result["host"]
    lines.append(
        f"host: {h['cpu_count']} CPUs, 1-min load {h['loadavg_1min_start']:.1f} at start, "
        f"{h['loadavg_1min_end']:.1f} at end; torch threads {h['torch_threads']}"
    )
    if result["ratio"]:
        ratio = ", ".join(f"{k} {v:.2f}x" for k, v in result["ratio"].items())
        agree = result["agreement"]
        lines.append(f"ratio (ours / transformers): {ratio}")
        lines.append(
            f"identical to transformers (greedy): thinker tokens {agree['thinker']}/{agree['requests']}, "
            f"voiced codes {agree['codes']}/{agree['requests']} requests"
        )
    return "\n".join(lines)
