"""e2e suite: thinker -> talker -> code2wav, our pipeline vs transformers ``generate`` at its best.

Written once for both Omni families: what differs is a :class:`Family` (speakers, how a talker's
tokens are read, the reference's :meth:`Reference.batch`). This docstring describes Qwen2.5-Omni's
(suite ``e2e``); :mod:`benchmarks.qwen3_e2e_suite` says what differs for Qwen3-Omni (``e2e_qwen3``).

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

Ours is the product path: every request in one ``OmniJaxPipeline.run`` (continuous batching in
each AR stage, code2wav batching, requests in different stages at once; code2wav offline only,
as the workload never streams), after ``warmup()``
(every XLA compilation after it is counted, and any fails the suite) and one run of the workload
that warms up the rest. transformers runs ``Qwen2_5OmniForConditionalGeneration.generate``, which
takes one voice per call, each call after its processor, in three configurations
(:data:`REFERENCE_CONFIGS`): request by request, left-padded batches of 4 requests of one voice,
and all of a voice's requests in one batch (each voice's requests sorted by prompt length). A
configuration whose batches are another's (a voice with 4 requests or fewer) is run once. Each
configuration runs the whole workload once to warm up, the same requests and media, so no first
encoder call lands in a measured run, and the ratio is taken against the fastest. Float32 unless
``--dtype`` (``generate`` runs token2wav in float32 whatever the dtype). The measured figures are
the best of each side's ``--repeats`` rounds, ours first, then each configuration's: with the
sides taking turns, torch's threads, still spinning after its calls, slowed the XLA rounds that
followed them on a 2-core machine (the Qwen3-Omni ``small`` thinker by 75%; see RESULTS.md).
``--profile`` traces our run of the last round.

Figures per side: requests/s, thinker tokens/s (new text tokens, EOS included), codec tokens/s
(talker tokens, stop token included), audio seconds per wall second (the real-time factor,
higher is better) and time per stage: seconds spent inside each stage (ours: inside the stage's
``step`` in the pipeline loop, the engine thread's time there: a code2wav solve left in flight
while another stage has work counts where the thread waits for the device, in that stage's step
when the two share it; the reference: inside ``thinker.generate``, ``talker.generate``
and ``token2wav.forward``, its processor apart), plus ours' mean per-request latency per stage
from the outputs' ``metrics``, and the time inside the audio and vision encoders (part of the
thinker's; ``--audio-seconds 10 --image-size 448`` measures them on a 10 s clip and a 448 x 448
image). Each side's figures count its own outputs.

Every reference batch carries one extra left pad column (attention mask 0 there), a single
request too. transformers 5 drops an all-ones attention mask inside ``generate``, and its talker
adds the codec pad/BOS embeddings to its last two prompt rows and computes its M-RoPE index only
when it gets a mask, so an unpadded batch skips that code and its talker runs off its trained path
(transformers 4, which kept the mask, ran it for every request): its codes then differ from ours,
and so does the work the talker and token2wav do. With the pad column the reference runs the way
tests/test_omni_pipeline.py checks ours against (identical text and codes, same waveform), at the
cost of one masked prompt token a row.

Correctness, request by request and in every configuration: our greedy thinker tokens and, where
those are identical, our talker tokens (the talker is greedy too, stop code included) against the
reference's, up to checked near-ties (:mod:`benchmarks.agreement`). A configuration's warm-up run
records ``generate``'s processed scores at each request's first difference from our tokens; its
measured runs record nothing, so their time is ``generate``'s alone, and must reproduce the
warm-up run's tokens. A disagreement fails the suite. The waveforms are not compared, as each side
draws its own DiT start noise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import agreement
from benchmarks.harness import (
    backends,
    compile_entry,
    measured_window,
    sized_code2wav_config,
    steps_setting,
    talker_start,
    warmed_up,
)
from omni_jax import OmniJaxPipeline, SamplingParams, Token2WavParams
from omni_jax.profiling import scope
from omni_jax.stages.thinker import MEDIA_KINDS
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

E2E_MAX_BATCH = 8
"""code2wav requests per solve (the shipped default); its ``max_codes`` is ``--talker-max-tokens``,
the most codes a request can bring, so warm-up compiles no solve longer than the workload's."""


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
    thinker_min_tokens: int = MIN_THINKER_TOKENS
    talker_min_tokens: int = 0

    def params(self) -> list[Any]:
        return [
            SamplingParams(
                temperature=0.0, min_tokens=self.thinker_min_tokens, max_tokens=self.thinker_max_tokens
            ),
            SamplingParams(
                temperature=0.0,
                repetition_penalty=REPETITION_PENALTY,
                min_tokens=self.talker_min_tokens,
                max_tokens=self.talker_max_tokens,
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
    if not 0 <= args.talker_min_tokens <= args.talker_max_tokens:
        raise SystemExit("--talker-min-tokens must be in [0, --talker-max-tokens]")
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
        prompts,
        kinds,
        args.max_tokens,
        args.talker_max_tokens,
        args.num_steps,
        args.guidance_scale,
        talker_min_tokens=args.talker_min_tokens,
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


REFERENCE_CONFIGS = {"request by request": 1, "batches of 4 per voice": 4, "all of a voice": None}
"""transformers ``generate`` configurations: the batch size within a voice (None: all of it)."""


@dataclasses.dataclass
class SideRun:
    """One side's run of the whole workload, per request in workload order."""

    wall_s: float
    stage_s: dict[str, float]
    thinker_tokens: list[list[int]]
    talker_tokens: list[list[int]]
    codes: list[list[int]]
    audio_samples: list[int]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


def figures(run: SideRun) -> dict[str, Any]:
    n = len(run.thinker_tokens)
    thinker = sum(len(t) for t in run.thinker_tokens)
    codec = sum(len(t) for t in run.talker_tokens)
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


def _run_ours(
    pipe: OmniJaxPipeline, work: Workload, clock: StageClock, talker_tokens: Callable[[Any], list[int]]
) -> SideRun:
    """Every request in one ``run``; ``talker_tokens`` reads an output's talker tokens as the
    reference's are compared (:meth:`Family.talker_tokens`)."""
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
        talker_tokens=[talker_tokens(o) for o in outs],
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
Scores = dict[tuple[str, int, int], np.ndarray]
"""``(stage, request, position) -> generate's processed scores`` at first differences."""


@dataclasses.dataclass
class Row:
    """One request's reference outputs."""

    thinker: list[int]  # new tokens up to EOS
    talker: list[int]  # codes up to the first stop code, included
    codes: list[int]  # the voiced codes (before the stop)
    samples: int


Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]
"""A callable's replacement, given the callable it replaces."""


@contextlib.contextmanager
def wrapped(targets: list[tuple[Any, str, Wrap]]) -> Iterator[None]:
    """Each ``(obj, name, wrap)``: ``obj.name`` replaced by ``wrap(obj.name)`` while active, then
    put back as it was (an attribute of the instance, such as a :class:`StageClock`'s timed
    wrapper, restored; else removed, so the class's method shows again)."""
    saved = [(obj, name, name in vars(obj), getattr(obj, name)) for obj, name, _ in targets]
    for obj, name, wrap in targets:
        setattr(obj, name, wrap(getattr(obj, name)))
    try:
        yield
    finally:
        for obj, name, own, original in saved:
            if own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)


class Reference:
    """transformers' ``generate(return_audio=True)`` of one model family on left-padded batches
    of one voice: the processor's inputs, the batches in turn under the stage and encoder clocks,
    the per-request outputs and, where our tokens differ, ``generate``'s scores there. A family
    supplies the model and :meth:`batch` (one ``generate`` call)."""

    engine = ""
    """What runs, for the result (``reference.engine``)."""

    def __init__(self, model: Any, proc: Any, clock: StageClock, encoders: StageClock):
        import torch

        self.torch = torch
        self.model = model
        self.proc = proc
        self.proc.tokenizer.padding_side = "left"
        self.clock = clock
        self.encoders = encoders

    def _inputs(self, prompts: list[dict[str, Any]]) -> dict[str, Any]:
        """The processor's batch of ``prompts``, left-padded."""
        media: dict[str, list[Any]] = {"images": [], "audio": []}
        for prompt in prompts:
            data = prompt.get("multi_modal_data", {})
            media["images"] += data.get("image", [])
            media["audio"] += data.get("audio", [])
        return dict(
            self.proc(
                text=[p["prompt"] for p in prompts],
                **{k: v for k, v in media.items() if v},
                padding=True,
                return_tensors="pt",
            )
        )

    def _prepared(self, work: Workload, indices: list[int]) -> tuple[dict[str, Any], float]:
        """:meth:`_inputs` of requests ``indices`` and the processor's seconds."""
        t0 = time.perf_counter()
        inputs = self._inputs([work.prompts[i] for i in indices])
        return inputs, time.perf_counter() - t0

    def prompt_length(self, prompt: dict[str, Any]) -> int:
        """Prompt tokens after the processor's placeholder expansion (the batches' sort key)."""
        return int(self._inputs([prompt])["input_ids"].shape[1])

    def batch(
        self, work: Workload, indices: list[int], ours: SideRun | None, scores: Scores
    ) -> tuple[list[Row], float]:
        """Requests ``indices`` (one voice) in one ``generate``: their rows and the processor's
        seconds. With ``ours``, ``scores`` gets generate's processed scores at each row's first
        difference from our tokens (:meth:`_note_differences`)."""
        raise NotImplementedError

    @staticmethod
    def _note_differences(
        ours: SideRun | None, i: int, row: Row, scores: Scores, at: Callable[[str, int], Any]
    ) -> None:
        """Where request ``i``'s thinker or talker tokens first differ from ``ours`` while both
        sides have a token there, ``scores[(stage, i, k)]`` is ``at(stage, k)``: the reference's
        processed scores (a torch row) from which it chose its token ``k``."""
        if ours is None:
            return
        for stage, mine, theirs in (
            ("thinker", ours.thinker_tokens[i], row.thinker),
            ("talker", ours.talker_tokens[i], row.talker),
        ):
            k = agreement.first_difference(mine, theirs)
            if k is not None and k < min(len(mine), len(theirs)):
                scores[(stage, i, k)] = at(stage, k).double().numpy()


class Qwen25Reference(Reference):
    """``Qwen2_5OmniForConditionalGeneration.generate`` on left-padded batches of one voice."""

    engine = "transformers Qwen2_5OmniForConditionalGeneration.generate"

    def __init__(self, path: Path, dtype: str | None, eos: int, pad: int):
        import torch
        from transformers import Qwen2_5OmniForConditionalGeneration

        m = Qwen2_5OmniForConditionalGeneration.from_pretrained(
            str(path), dtype=getattr(torch, dtype or "float32")
        ).eval()
        clock = StageClock(
            {
                "thinker": (m.thinker, "generate"),
                "talker": (m.talker, "generate"),
                "code2wav": (m.token2wav, "forward"),
            }
        )
        encoders = encoder_clock(m.thinker, ("Qwen2_5OmniAudioEncoder", "Qwen2_5OmniVisionEncoder"))
        super().__init__(m, reference_omni_processor(path), clock, encoders)
        self.eos, self.pad = eos, pad
        self.codec_stops = [m.talker.codec_pad_token, m.talker.codec_eos_token]

    def _inputs(self, prompts: list[dict[str, Any]]) -> dict[str, Any]:
        """The processor's batch, left-padded, with one more pad column (module docstring)."""
        torch = self.torch
        inputs = super()._inputs(prompts)
        # generate hands unprefixed inputs to the talker too, whose forward refuses pixels
        if "pixel_values" in inputs:
            inputs["thinker_pixel_values"] = inputs.pop("pixel_values")
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        inputs["input_ids"] = torch.cat([torch.full_like(ids[:, :1], self.pad), ids], dim=1)
        inputs["attention_mask"] = torch.cat([torch.zeros_like(mask[:, :1]), mask], dim=1)
        return inputs

    def batch(
        self, work: Workload, indices: list[int], ours: SideRun | None, scores: Scores
    ) -> tuple[list[Row], float]:
        torch, m = self.torch, self.model
        inputs, preprocess_s = self._prepared(work, indices)
        width = inputs["input_ids"].shape[1]
        found: dict[str, Any] = {}

        # These wrap the clocks' timed wrappers while the clocks are active.
        def thinker(generate: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                if ours is not None:  # generate asks for a dict already (it reads the hidden states)
                    kwargs["output_scores"] = True
                out = generate(*args, **kwargs)
                found["thinker_scores"] = out.scores
                return out

            return call

        def talker(generate: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> torch.Tensor:
                if ours is not None:
                    kwargs.update(output_scores=True, return_dict_in_generate=True)
                out = generate(*args, **kwargs)
                seq = out.sequences if ours is not None else out
                found["talker"] = seq[:, kwargs["input_ids"].shape[1] :].tolist()
                found["talker_scores"] = out.scores if ours is not None else None
                return seq

            return call

        def voice(token2wav: Callable[..., Any]) -> Callable[..., Any]:
            # A talker that stops on its first code leaves nothing to voice, and token2wav fails
            # on no codes; that request gets no audio, as ours does.
            def call(code: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
                return token2wav(code, *args, **kwargs) if code.shape[-1] else torch.zeros(0)

            return call

        patches = [
            (m.thinker, "generate", thinker),
            (m.talker, "generate", talker),
            (m.token2wav, "forward", voice),
        ]
        with wrapped(patches):
            with torch.no_grad():
                seq, waves = m.generate(
                    **inputs,
                    speaker=work.prompts[indices[0]]["speaker"],
                    thinker_max_new_tokens=work.thinker_max_tokens,
                    thinker_do_sample=False,
                    thinker_min_new_tokens=work.thinker_min_tokens,
                    thinker_eos_token_id=self.eos,
                    thinker_pad_token_id=self.pad,
                    talker_max_new_tokens=work.talker_max_tokens,
                    talker_min_new_tokens=work.talker_min_tokens,
                    talker_do_sample=False,
                    talker_repetition_penalty=REPETITION_PENALTY,
                    talker_eos_token_id=self.codec_stops,
                    token2wav_num_steps=work.num_steps,
                    token2wav_guidance_scale=work.guidance_scale,
                    token2wav_sway_coefficient=work.sway_coefficient,
                )
        waves = [waves] if len(indices) == 1 else waves
        rows = []
        for r, i in enumerate(indices):
            new = seq[r, width:].tolist()
            tokens = new[: new.index(self.eos) + 1] if self.eos in new else new
            code = found["talker"][r]
            stop = min((code.index(s) for s in self.codec_stops if s in code), default=len(code))
            rows.append(Row(tokens, code[: stop + 1], code[:stop], int(waves[r].numel())))
            self._note_differences(
                ours, i, rows[-1], scores, lambda stage, k, r=r: found[f"{stage}_scores"][k][r]
            )
        return rows, preprocess_s


def run_reference(
    reference: Reference, work: Workload, batches: list[list[int]], ours: SideRun | None = None
) -> tuple[SideRun, Scores]:
    """``reference``'s run of every batch of ``batches`` (request indices) in turn, under its stage
    and encoder clocks; with ``ours``, the scores at first differences from it
    (:meth:`Reference.batch`)."""
    rows: dict[int, Row] = {}
    latency: dict[int, float] = {}
    scores: Scores = {}
    preprocess = 0.0
    with reference.clock.active(), reference.encoders.active():
        t0 = time.perf_counter()
        for indices in batches:
            t = time.perf_counter()
            got, pre_s = reference.batch(work, indices, ours, scores)
            rows.update(zip(indices, got, strict=True))
            latency.update(dict.fromkeys(indices, time.perf_counter() - t))
            preprocess += pre_s
        wall = time.perf_counter() - t0
    order = sorted(rows)
    run = SideRun(
        wall_s=wall,
        stage_s=dict(reference.clock.seconds),
        thinker_tokens=[rows[i].thinker for i in order],
        talker_tokens=[rows[i].talker for i in order],
        codes=[rows[i].codes for i in order],
        audio_samples=[rows[i].samples for i in order],
        extra={
            "encoders_s": sum(reference.encoders.seconds.values()),
            "preprocess_s": preprocess,
            "loop_other_s": wall - preprocess - sum(reference.clock.seconds.values()),
            "request_latency_s_mean": float(np.mean([latency[i] for i in order])),
        },
    )
    return run, scores


def reference_batches(work: Workload, size: int | None, lengths: list[int]) -> list[list[int]]:
    """Request indices per ``generate`` call: one request each (``size`` 1, in workload order), or
    each voice's requests sorted by prompt length in batches of ``size`` (None: all of them)."""
    if size == 1:
        return [[i] for i in range(len(work.prompts))]
    by_voice: dict[str, list[int]] = {}
    for i, prompt in enumerate(work.prompts):
        by_voice.setdefault(prompt["speaker"], []).append(i)
    out = []
    for indices in by_voice.values():
        indices = sorted(indices, key=lambda i: lengths[i])
        step = size or len(indices)
        out += [indices[a : a + step] for a in range(0, len(indices), step)]
    return out


def token_agreement(
    ours: SideRun, ref: SideRun, scores: Scores, bound: float
) -> tuple[agreement.Agreement, agreement.Agreement]:
    """Thinker tokens of every request; talker tokens of those whose thinker tokens are identical
    (a thinker near-tie changes the talker's input)."""
    thinker = agreement.compare(
        ours.thinker_tokens, ref.thinker_tokens, lambda i, k: scores[("thinker", i, k)], bound
    )
    same = [i for i, (a, b) in enumerate(zip(ours.thinker_tokens, ref.thinker_tokens, strict=True)) if a == b]
    talker = agreement.compare(
        ours.talker_tokens, ref.talker_tokens, lambda i, k: scores[("talker", i, k)], bound, same
    )
    return thinker, talker


def _tokens(run: SideRun) -> tuple[list[list[int]], list[list[int]]]:
    return run.thinker_tokens, run.talker_tokens


TEXT_PROMPTS = dict.fromkeys(MEDIA_KINDS, 0)
"""``limit_mm_per_prompt`` of a suite whose prompts are text: every kind of media off, so the
thinker's encoders are not compiled at warm-up (as a text-in deployment sets it)."""


def build_pipeline(
    path: Path,
    args: Any,
    stage_config: Path,
    max_num_seqs: int | None,
    suite: str,
    limit_mm_per_prompt: dict[str, int] | None = None,
) -> OmniJaxPipeline:
    """Our whole pipeline as a speech suite (``suite``, for the message) builds it from its
    arguments (dtype, mesh, the AR stages' sizes), ``stage_config`` and ``limit_mm_per_prompt``
    (e.g. :data:`TEXT_PROMPTS`); SystemExit unless its stages are :data:`STAGES`."""
    pipe = OmniJaxPipeline.from_pretrained(
        path,
        dtype=args.dtype,
        mesh=args.mesh,
        max_num_seqs=max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        stage_config=stage_config,
        limit_mm_per_prompt=limit_mm_per_prompt,
    )
    pipe.core.overlap = pipe.core.overlap and not args.sequential_steps
    names = [s.config.name for s in pipe.stages]
    if names != list(STAGES):
        raise SystemExit(f"--model {args.model}: the {suite} suite needs stages {list(STAGES)}, got {names}")
    return pipe


class Family:
    """What the suite needs to know of a model family: this class is Qwen2.5-Omni's (suite
    ``e2e``); :class:`benchmarks.qwen3_e2e_suite.Qwen3Omni` is Qwen3-Omni's (``e2e_qwen3``).
    Everything else (workload, our side, the measured rounds, agreement, figures) is shared."""

    suite = "e2e"
    stage_yaml = "qwen2_5_omni"
    """The shipped stage YAML whose code2wav :func:`sized_code2wav_config` sizes."""
    talker_unit = "codes"
    """What ``--talker-max-tokens`` counts."""
    code2wav_chunk: int | None = None
    """The most a reference ``generate`` voices in one code2wav call (``None``: a reply whole), so
    that our code2wav's offline pieces are its."""
    batched_talker_held = True
    """Whether the reference's batched configurations compute each request's talker tokens as it
    computes them alone, so that ours are held to them too (else only to request by request)."""

    def __init__(self, path: Path):
        self.path = path

    def speakers(self, pipe: OmniJaxPipeline) -> list[str]:
        return sorted(pipe.stages[-1].voices.speakers)

    def talker_tokens(self, out: Any) -> list[int]:
        """Our output's talker tokens as the reference's :attr:`Row.talker` counts them."""
        return list(out.stage_outputs["talker"].token_ids)

    def token2wav_settings(self, work: Workload) -> str:
        return f"num_steps {work.num_steps}, guidance {work.guidance_scale}, sway {work.sway_coefficient}"

    def reference(self, dtype: str | None, pipe: OmniJaxPipeline) -> Reference:
        eos = pipe.tokenizer.convert_tokens_to_ids("<|im_end|>")
        return Qwen25Reference(self.path, dtype, eos, pipe.tokenizer.pad_token_id)


def run(path: Path, args: Any, family: Family | None = None) -> dict[str, Any]:
    """The suite on ``family`` (default: Qwen2.5-Omni's)."""
    family = family or Family(path)
    stage_config = sized_code2wav_config(
        Path(args.cache_dir),
        E2E_MAX_BATCH,
        min(args.talker_max_tokens, family.code2wav_chunk or args.talker_max_tokens),
        family.stage_yaml,
        not args.late_talker,
        streaming=False,
    )
    pipe = build_pipeline(path, args, stage_config, args.max_num_seqs, family.suite)
    speakers = family.speakers(pipe)
    work = make_workload(pipe, speakers, args)
    n = len(work.prompts)
    clock = StageClock({s.config.name: (s, "step") for s in pipe.stages})
    bound = agreement.near_tie_bound(args.dtype)
    failures: list[str] = []

    def ours_run() -> SideRun:
        return _run_ours(pipe, work, clock, family.talker_tokens)

    reference = None
    configs: dict[str, list[list[int]]] = {}
    same_as: dict[str, str] = {}
    if args.reference:
        reference = family.reference(args.dtype, pipe)
        lengths = [reference.prompt_length(p) for p in work.prompts]
        for name, size in REFERENCE_CONFIGS.items():
            batches = reference_batches(work, size, lengths)
            twin = next((other for other, b in configs.items() if b == batches), None)
            if twin is None:
                configs[name] = batches
            else:
                same_as[name] = twin

    ref_first: dict[str, tuple[SideRun, Scores]] = {}
    ref_best: dict[str, SideRun] = {}
    with warmed_up(pipe) as warm:
        ours_first = ours_run()
        ours_best: SideRun | None = None
        for round_ in range(args.repeats):
            traced = args.profile if round_ == args.repeats - 1 else None
            window = f"{family.suite}/measured round"
            with measured_window(traced, window, args.profile_python, round=round_, requests=n):
                ours = ours_run()
            if _tokens(ours) != _tokens(ours_first):
                failures.append(f"round {round_}: our greedy tokens differ from our first run's")
            if ours_best is None or ours.wall_s < ours_best.wall_s:
                ours_best = ours
    for name, batches in configs.items():
        ref_first[name] = run_reference(reference, work, batches, ours_first)
        for round_ in range(args.repeats):
            ref, _ = run_reference(reference, work, batches)
            if _tokens(ref) != _tokens(ref_first[name][0]):
                failures.append(f"round {round_}: transformers ({name}) changed its tokens between runs")
            if name not in ref_best or ref.wall_s < ref_best[name].wall_s:
                ref_best[name] = ref
    assert ours_best is not None
    failures += warm.failures()

    result: dict[str, Any] = {
        "suite": family.suite,
        "dtype": args.dtype,
        "mesh": args.mesh,
        "requests": n,
        "kinds": {k: work.kinds.count(k) for k in KINDS},
        "speakers": speakers,
        "settings": {
            "thinker": f"greedy, {work.thinker_min_tokens} to {work.thinker_max_tokens} new tokens, "
            "stop on <|im_end|>",
            "talker": f"greedy, repetition penalty {REPETITION_PENALTY}, "
            f"{work.talker_min_tokens} to {work.talker_max_tokens} {family.talker_unit}, "
            f"{talker_start(args)}",
            "token2wav": family.token2wav_settings(work),
            "steps": steps_setting(args),
        },
        "repeats": args.repeats,
        "ceilings": {},
        "roofline_fraction": None,
        "backends": backends(warm.probe),
        "ours": figures(ours_best),
        "reference": None,
        "ratio": None,
        "compile": {"ours": warm.entry(ours_first.wall_s, ours_best.wall_s), "reference": None},
    }
    if reference is not None:
        result["backends"]["reference_image_processor"] = type(reference.proc.image_processor).__name__
        by_config = {name: figures(run) for name, run in ref_best.items()}
        best = max(by_config, key=lambda name: by_config[name]["requests_per_s"])
        agree = {}
        for name, (first, scores) in ref_first.items():
            thinker, talker = token_agreement(ours_first, first, scores, bound)
            held = family.batched_talker_held or all(len(b) == 1 for b in configs[name])
            agree[name] = {"thinker": thinker.as_dict(), "talker": talker.as_dict(), "talker_held": held}
            failures += thinker.failures(f"thinker tokens against {name}")
            if held:
                failures += talker.failures(f"talker tokens against {name}")
        keys = ("requests_per_s", "thinker_tokens_per_s", "codec_tokens_per_s", "audio_s_per_s")
        result.update(
            reference={
                "engine": reference.engine,
                "by_config": by_config,
                "batches": configs,
                "same_as": same_as,
                "best": best,
                **by_config[best],
            },
            ratio={k: result["ours"][k] / by_config[best][k] for k in keys if by_config[best][k] > 0},
            ratio_by_config={
                name: result["ours"]["requests_per_s"] / fig["requests_per_s"]
                for name, fig in by_config.items()
            },
            agreement=agree,
        )
        result["compile"]["reference"] = compile_entry(ref_first[best][0].wall_s, ref_best[best].wall_s)
    result["failures"] = failures
    return result


def table(result: dict[str, Any]) -> str:
    """The suite's result as a text table: one column for ours, one per reference configuration."""
    ours, ref = result["ours"], result["reference"]
    sides = [("omni_jax", ours)]
    if ref:
        sides += [(f"tf: {name}", fig) for name, fig in ref["by_config"].items()]

    def row(name: str, fmt: Callable[[dict[str, Any]], str]) -> tuple[str, list[str]]:
        return name, [fmt(s) for _, s in sides]

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
    w = max(len(r[0]) for r in rows)
    cw = max(24, *(len(name) for name, _ in sides))
    lines = ["  ".join([f"{'':<{w}}", *(f"{name:>{cw}}" for name, _ in sides)])]
    lines += ["  ".join([f"{name:<{w}}", *(f"{v:>{cw}}" for v in vals)]) for name, vals in rows]
    lat = ", ".join(f"{s} {v:.2f}" for s, v in ours["stage_latency_s_mean"].items())
    lines.append(
        f"our per-request stage latency s (mean): {lat}; thinker TTFT {ours['thinker_ttft_s_mean']:.3f} s"
    )
    c = result["compile"]["ours"]
    lines.append(
        f"our warmup(): {c['warmup_programs']} programs, {c['warmup_s']:.1f} s (XLA compile "
        f"{c['xla_compile_s']:.1f} s); first run after it {c['first_run_s']:.1f} s; XLA compilations "
        f"after warmup(): {c['compiles_after_warmup']}; excluded from every figure above"
    )
    lines.append(
        f"{result['requests']} requests {result['kinds']}; "
        + "; ".join(f"{k}: {v}" for k, v in result["settings"].items())
    )
    if result["ratio"]:
        ratio = ", ".join(f"{k} {v:.2f}x" for k, v in result["ratio"].items())
        lines.append(f"ratio (ours / transformers at its best, {ref['best']}): {ratio}")
        for name, twin in ref["same_as"].items():
            lines.append(f"transformers {name}: the same batches as {twin}")
        for name, agree in result["agreement"].items():
            lines.append(
                f"greedy agreement with transformers ({name}): thinker {agree['thinker']['summary']}; "
                f"talker {agree['talker']['summary']}"
                + ("" if agree["talker_held"] else " (not held: its batches change the talker's input)")
            )
    return "\n".join(lines)
