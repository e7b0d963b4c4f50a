"""e2e --stream suite: streamed speech against offline decoding (issue 22), the whole Qwen2.5-Omni
pipeline in process.

``python -m benchmarks.run --suite e2e --stream --model tiny``. Every request runs thinker ->
talker -> code2wav through ``AsyncOmniJaxPipeline.generate`` with ``modalities`` text and audio,
once with code2wav offline (``Token2WavParams(stream=False)``: the whole reply decoded once the
talker has finished it) and once streamed (``stream=True``: decoded chunk by chunk while the
talker speaks, the shipped stage YAML's ``engine.stream``: a first chunk of 24 new codes, then
36 doubling up to 144 (36 throughout is Qwen's schedule: ``--stream-sizes max_chunk_codes=36``),
24 codes of DiT context before each, 12 after, 20 mel frames of vocoder overlap;
``--stream-sizes`` overrides them, e.g. for a quick check). Both modes
run the same requests in the same process on the same warmed-up pipeline, one after the other,
taking turns over ``--repeats`` rounds (the first mode alternates), and do the same work:

- thinker: greedy, exactly ``--max-tokens`` text tokens (``ignore_eos``);
- talker: greedy, repetition penalty 1.05, exactly ``--codes`` codes (``min_tokens`` =
  ``max_tokens``: its stop codes are held back until then; ``ignore_eos`` would not do, as it
  lets the talker *emit* codec EOS / pad as codes, which the DiT cannot voice);
- code2wav: ``--num-steps`` grid points, ``--guidance-scale`` CFG, sway -1, the noise seed of
  request ``j`` fixed (``SEED + j``; a streamed request draws its rows from the seed exactly as
  the offline solve does).

Request ``j`` asks ``QUESTIONS[j % 8]`` in voice ``j % voices``. Load: closed loop at each
concurrency ``c`` of ``--concurrency`` (default 1, 4, 16): ``c`` clients, client ``k`` sending
requests ``k, k + c, k + 2c, ...`` one after the other (its next when the previous one's last
update came), ``--requests-per-client`` each (default 2), all clients starting together
(``--num-requests`` is not read).

Per request: TTFA (from calling ``generate`` to the first update with a non-empty
``audio_delta``; offline that is the one update that carries the whole waveform), TTFT (first text
delta), e2e (to the last update), the audio updates. Per mode and concurrency: p50 / p90 / max of
those, RTF (a request's e2e seconds per second of its speech, lower is better), throughput (speech
seconds produced per wall second over the run), playback stalls (:func:`stall_seconds`: a
listener playing each audio update as it comes, at the speech rate below, hears a gap where an
update comes after the audio before it has played out; the requests that had any, the longest
total), seconds inside each stage's ``step`` (the engine
thread's: a solve left in flight counts where the thread waits for the device), and ratios:
TTFA offline p50 over streamed p50 (the issue's target: at least 5 at concurrency 1 and 4, for
replies of 10 s or more) and throughput streamed over offline (target: at least 0.85).

Speech seconds are the codes over 50: Qwen2.5-Omni-7B's code rate (2 mel frames a code, 240
samples a frame at 24 kHz), the length the real model's vocoder would make of them. The tiny
vocoder makes 60 samples a frame (0.25 of that: 500 codes are 2.5 s of its audio, recorded as
``audio_s``), ``small``'s the real 240. "10 s of audio" is therefore ``--codes 500`` (default).
The tiny builder's positions (512) hold a talker prompt and its codes in 512 positions and an
offline code2wav request in 256 codes, so the suite's ``tiny`` and ``small`` are built with the
talker's and the DiT's ``max_position_embeddings`` at 2048
(:func:`benchmarks.models.build_long_replies`: only positions change, the weights are the
builder's), and code2wav's ``max_codes`` is ``--codes`` (a stage YAML written for the run,
``max_batch`` the largest concurrency up to the shipped 8: a closed loop never has more requests
than clients, ``engine.stream`` with ``--stream-sizes``). A checkpoint PATH is used as it is.

Warm-up: ``OmniJaxPipeline.warmup()`` (every program, offline and chunk solves; its programs and
seconds reported apart), then one unmeasured run of the first concurrency's workload in each mode;
every XLA compilation after ``warmup()`` is counted and any fails the suite. Other failures:
streamed and offline runs disagreeing on a request's talker codes (same seeds, same work: they
must be identical), a request failing or making other than ``--codes`` codes.

Waveforms (reported, not asserted): for each request, its streamed and offline audio (same codes,
same noise seed) as relative L2 ``||s - o|| / ||o||`` and log-mel L1 (mean absolute difference of
natural-log mel spectrograms: numpy STFT, 1024-point periodic Hann window, hop 256, 80 HTK mel
bands 0-12 kHz, floor 1e-5); beside them the same distances between two offline decodes of the
same codes with different seeds (requests ``j`` and ``j + 8``, where a level has both), the scale
of what the noise alone changes.

``--reference`` is refused: transformers has no streamed token2wav; the baseline is ours offline.

The closed loop, its warm-up and measured rounds (:func:`measure`), the figures and the codes check
serve Qwen3-Omni's time-to-first-audio suite too (:mod:`benchmarks.qwen3_stream_suite`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np

from benchmarks.e2e_suite import QUESTIONS, REPETITION_PENALTY, TEXT_PROMPTS, StageClock, build_pipeline
from benchmarks.harness import (
    Warmup,
    backends,
    measured_window,
    sized_code2wav_config,
    steps_setting,
    talker_start,
    warmed_up,
)
from omni_jax import AsyncOmniJaxPipeline, OmniJaxPipeline, SamplingParams, Token2WavParams

MODES = ("offline", "streamed")
SAMPLE_RATE = 24_000
CODES_PER_SPEECH_SECOND = 50
"""Qwen2.5-Omni-7B: 2 mel frames a code, 240 samples a frame at 24 kHz."""
SEED = 1000
"""Request ``j``'s code2wav noise seed is ``SEED + j``, in both modes."""
MAX_CODE2WAV_BATCH = 8
"""The shipped code2wav ``max_batch``; the suite's is the largest concurrency up to it."""
TTFA_TARGET = 5.0
TTFA_TARGET_CONCURRENCY = (1, 4)
TARGET_CODES = 500
"""The TTFA target holds for replies of 10 s or more: 500 codes at the real model's rate."""
THROUGHPUT_TARGET = 0.85


class Requests(Protocol):
    """What the closed loop sends: request ``j`` is ``prompts[j % len(prompts)]`` with
    ``params(j, stream)``, the pipeline's per-stage params."""

    prompts: list[dict[str, Any]]

    def params(self, j: int, stream: bool) -> list[Any]: ...


@dataclasses.dataclass
class Workload:
    prompts: list[dict[str, Any]]
    text_tokens: int
    codes: int
    num_steps: int
    guidance_scale: float

    def params(self, j: int, stream: bool) -> list[Any]:
        return [
            SamplingParams(temperature=0.0, max_tokens=self.text_tokens, ignore_eos=True),
            SamplingParams(
                temperature=0.0,
                repetition_penalty=REPETITION_PENALTY,
                min_tokens=self.codes,
                max_tokens=self.codes,
            ),
            Token2WavParams(
                num_steps=self.num_steps,
                guidance_scale=self.guidance_scale,
                seed=SEED + j,
                stream=stream,
            ),
        ]


@dataclasses.dataclass
class Record:
    """One request as its client saw it (seconds from calling ``generate``)."""

    index: int
    ttft_s: float | None
    ttfa_s: float | None
    e2e_s: float
    audio_updates: int
    samples: int
    codes: list[int]
    metrics: dict[str, dict[str, Any]]
    audio: np.ndarray | None = None
    error: str | None = None
    text_ids: list[int] = dataclasses.field(default_factory=list)
    arrivals: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    """Each non-empty audio update: when it came (seconds from calling ``generate``), its samples."""


def stall_seconds(arrivals: Sequence[tuple[float, int]], seconds_per_sample: float) -> float:
    """How long a listener's playback stops after it has begun: the client plays each audio update
    as it comes, from the first on, at ``seconds_per_sample``; an update that comes after the audio
    before it has played out leaves a gap (the player waits, then plays on). Offline audio (one
    update) never stalls; a streamed reply stalls when its chunks come slower than they play."""
    if not arrivals:
        return 0.0
    stalled, played_until = 0.0, arrivals[0][0]
    for at, samples in arrivals:
        stalled += max(0.0, at - played_until)
        played_until = max(played_until, at) + samples * seconds_per_sample
    return stalled


@dataclasses.dataclass
class Run:
    """One mode's run of one concurrency level."""

    mode: str
    concurrency: int
    wall_s: float
    stage_s: dict[str, float]
    records: list[Record]
    solves: dict[str, int]


class SolveCounter:
    """code2wav's solves while active: offline and chunk solves, counted where each lands
    (``runner.land``, ``decoder.land``: waited for or left in flight), with the requests it
    decoded (a solve returns one output a request)."""

    def __init__(self, stage: Any):
        self.targets = {"offline": (stage.runner, "land"), "chunk": (stage.decoder, "land")}
        self.counts = {f"{k}_{n}": 0 for k in self.targets for n in ("solves", "rows")}

    def _counted(self, kind: str, fn: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
        def counted(*args: Any, **kwargs: Any) -> list[Any]:
            out = fn(*args, **kwargs)
            if out:
                self.counts[f"{kind}_solves"] += 1
                self.counts[f"{kind}_rows"] += len(out)
            return out

        return counted

    @contextlib.contextmanager
    def active(self) -> Iterator[SolveCounter]:
        self.counts = dict.fromkeys(self.counts, 0)
        for kind, (obj, attr) in self.targets.items():
            setattr(obj, attr, self._counted(kind, getattr(obj, attr)))
        try:
            yield self
        finally:
            for obj, attr in self.targets.values():
                delattr(obj, attr)


async def _request(served: AsyncOmniJaxPipeline, work: Requests, j: int, stream: bool) -> Record:
    prompt = work.prompts[j % len(work.prompts)]
    params = work.params(j, stream)
    ttft = ttfa = None
    pieces: list[np.ndarray] = []
    arrivals: list[tuple[float, int]] = []
    last = None
    t0 = time.perf_counter()
    async for out in served.generate(prompt, params):
        now = time.perf_counter() - t0
        if ttft is None and out.text_delta:
            ttft = now
        if out.audio_delta is not None and out.audio_delta.size:
            pieces.append(out.audio_delta)
            arrivals.append((now, out.audio_delta.size))
            if ttfa is None:
                ttfa = now
        last = out
    e2e = time.perf_counter() - t0
    assert last is not None
    talker = last.stage_outputs.get("talker")
    error = last.error
    if error is None and last.finish_reason != "length":
        error = f"finish_reason {last.finish_reason!r}, expected 'length'"
    if error is None and not np.array_equal(np.concatenate(pieces or [np.zeros(0)]), last.audio):
        error = f"its {len(pieces)} audio deltas are not its whole waveform (samples lost or reordered)"
    return Record(
        index=j,
        ttft_s=ttft,
        ttfa_s=ttfa,
        e2e_s=e2e,
        audio_updates=len(pieces),
        samples=0 if last.audio is None else len(last.audio),
        codes=[] if talker is None else list(talker.token_ids),
        metrics=last.metrics,
        audio=last.audio,
        error=error,
        text_ids=list(last.token_ids),
        arrivals=arrivals,
    )


async def _level(
    served: AsyncOmniJaxPipeline, work: Requests, c: int, per_client: int, stream: bool
) -> tuple[float, list[Record]]:
    """Closed loop: ``c`` clients, client ``k`` sending requests ``k, k + c, ...`` in turn."""
    n = c * per_client
    records: list[Record | None] = [None] * n

    async def client(k: int) -> None:
        for j in range(k, n, c):
            records[j] = await _request(served, work, j, stream)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(c)))
    wall = time.perf_counter() - t0
    return wall, [r for r in records if r is not None]


def _run(
    loop: asyncio.AbstractEventLoop,
    served: AsyncOmniJaxPipeline,
    clock: StageClock,
    solves: SolveCounter,
    work: Requests,
    c: int,
    per_client: int,
    mode: str,
) -> Run:
    with clock.active(), solves.active():
        wall, records = loop.run_until_complete(_level(served, work, c, per_client, mode == "streamed"))
    return Run(mode, c, wall, dict(clock.seconds), records, dict(solves.counts))


# -- figures ------------------------------------------------------------------------------------
def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    a = np.asarray(values, np.float64)
    return {
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "max": float(a.max()),
        "mean": float(a.mean()),
    }


def figures(run: Run, codes_per_second: float = CODES_PER_SPEECH_SECOND) -> dict[str, Any]:
    """One run's figures; a request's speech seconds are its talker codes over ``codes_per_second``."""
    ok = [r for r in run.records if r.error is None]
    speech = [len(r.codes) / codes_per_second for r in ok]
    audio = [r.samples / SAMPLE_RATE for r in ok]
    # played at the speech rate (the released model's length of these codes), as speech s/s counts
    stalls = [stall_seconds(r.arrivals, s / r.samples) for r, s in zip(ok, speech, strict=True) if r.samples]

    def metric(stage: str, key: str) -> list[float]:
        return [float(r.metrics[stage][key]) for r in ok if key in r.metrics.get(stage, {})]

    return {
        "requests": len(run.records),
        "failed": len(run.records) - len(ok),
        "wall_s": run.wall_s,
        "speech_s": float(sum(speech)),
        "audio_s": float(sum(audio)),
        "speech_s_per_s": float(sum(speech)) / run.wall_s,
        "audio_s_per_s": float(sum(audio)) / run.wall_s,
        "requests_per_s": len(ok) / run.wall_s,
        "ttfa_s": _stats([r.ttfa_s for r in ok if r.ttfa_s is not None]),
        "ttft_s": _stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "e2e_s": _stats([r.e2e_s for r in ok]),
        "rtf": _stats([r.e2e_s / s for r, s in zip(ok, speech, strict=True) if s > 0]),
        "stall_s": _stats(stalls),
        "stalled_requests": sum(x > 0 for x in stalls),
        "audio_updates_mean": float(np.mean([r.audio_updates for r in ok])) if ok else 0.0,
        "stage_s": run.stage_s,
        "code2wav_solves": run.solves,
        "loop_other_s": run.wall_s - sum(run.stage_s.values()),
        "talker_wall_s_mean": float(np.mean(metric("talker", "wall_s"))) if ok else 0.0,
        "code2wav_wall_s_mean": float(np.mean(metric("code2wav", "wall_s"))) if ok else 0.0,
    }


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + f / 700.0)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    return 700.0 * (10.0 ** (m / 2595.0) - 1.0)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """``[n_mels, n_fft // 2 + 1]`` triangular HTK-mel filters from 0 Hz to Nyquist."""
    edges = _mel_to_hz(np.linspace(0.0, _hz_to_mel(np.asarray(sample_rate / 2)), n_mels + 2))
    freqs = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    return np.maximum(0.0, np.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)))


def log_mel(
    wave: np.ndarray, sample_rate: int = SAMPLE_RATE, n_fft: int = 1024, hop: int = 256
) -> np.ndarray:
    """``[frames, 80]`` natural-log mel power spectrogram (centred frames, reflect padding)."""
    x = np.asarray(wave, np.float64)
    x = np.pad(x, n_fft // 2, mode="reflect" if len(x) > n_fft // 2 else "constant")
    window = np.hanning(n_fft + 1)[:-1]
    frames = np.lib.stride_tricks.sliding_window_view(x, n_fft)[::hop] * window
    power = np.abs(np.fft.rfft(frames, axis=-1)) ** 2
    return np.log(np.maximum(power @ mel_filterbank(sample_rate, n_fft, 80).T, 1e-5))


def distance(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """``a`` against ``b`` (the offline one): relative L2 and log-mel L1, over their common length."""
    n = min(len(a), len(b))
    a, b = np.asarray(a[:n], np.float64), np.asarray(b[:n], np.float64)
    return {
        "rel_l2": float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)),
        "log_mel_l1": float(np.mean(np.abs(log_mel(a) - log_mel(b)))),
    }


def _summary(pairs: list[dict[str, float]]) -> dict[str, Any] | None:
    if not pairs:
        return None
    return {
        "pairs": len(pairs),
        **{
            f"{k}_{how}": float(fn([p[k] for p in pairs]))
            for k in ("rel_l2", "log_mel_l1")
            for how, fn in (("mean", np.mean), ("max", np.max))
        },
    }


def waveform_distances(best: dict[tuple[str, int], Run], prompts: int) -> dict[str, Any]:
    """Streamed against offline per request (same codes and seed); offline against offline for
    the same codes and another seed (requests ``j`` and ``j + prompts``)."""
    streamed, reseeded, length_differs = [], [], 0
    for (mode, c), off in best.items():
        if mode != "offline":
            continue
        on = {r.index: r for r in best[("streamed", c)].records}
        offline = {r.index: r for r in off.records}
        for j, o in offline.items():
            s = on.get(j)
            if o.audio is None or s is None or s.audio is None or s.codes != o.codes:
                continue
            length_differs += len(s.audio) != len(o.audio)
            streamed.append(distance(s.audio, o.audio))
            other = offline.get(j + prompts)
            if other is not None and other.audio is not None and other.codes == o.codes:
                reseeded.append(distance(other.audio, o.audio))
    return {
        "streamed_vs_offline": _summary(streamed),
        "offline_other_seed": _summary(reseeded),
        "length_differs": length_differs,
    }


def code_checks(runs: list[Run], prompts: int, codes: int) -> tuple[dict[str, Any], list[str]]:
    """``runs`` in pairs (one level and round, both modes). Failures: a request failed or made
    other than ``codes`` codes; the two runs of a pair disagree on a request's codes. Reported:
    requests whose codes differ from the first run of the same prompt (another level: other
    batches)."""
    failures: list[str] = []
    first: dict[int, list[int]] = {}
    differ_across = 0
    for run in runs:
        for r in run.records:
            if r.error is not None:
                failures.append(f"{run.mode} c={run.concurrency} request {r.index}: {r.error}")
            elif len(r.codes) != codes:
                failures.append(
                    f"{run.mode} c={run.concurrency} request {r.index}: {len(r.codes)} codes, not {codes}"
                )
            seen = first.setdefault(r.index % prompts, r.codes)
            differ_across += seen != r.codes
    disagree = 0
    pairs = [(a, b) for a, b in zip(runs[::2], runs[1::2], strict=True)]
    for a, b in pairs:
        assert a.concurrency == b.concurrency and {a.mode, b.mode} == set(MODES)
        theirs = {r.index: r.codes for r in b.records}
        for r in a.records:
            if r.codes != theirs.get(r.index):
                disagree += 1
                failures.append(
                    f"c={a.concurrency} request {r.index}: streamed and offline talker codes differ "
                    "(same seeds and work: they must be identical)"
                )
    requests = sum(len(a.records) for a, _ in pairs)
    return {
        "compared": requests,
        "identical": requests - disagree,
        "differ_from_first_run_of_prompt": differ_across,
    }, failures


# -- the suite ----------------------------------------------------------------------------------
@dataclasses.dataclass
class Measured:
    """Our side of a streamed-speech suite: the warm-up, the unmeasured first run of each mode at
    the first level, the measured runs (in pairs: one level and round, both modes) and each mode
    and level's fastest."""

    warm: Warmup
    first: dict[str, Run]
    runs: list[Run]
    best: dict[tuple[str, int], Run]

    def compile_entry(self, level: int) -> dict[str, Any]:
        """``compile["ours"]``: the first runs of both modes against the fastest at ``level``."""
        steady = self.best[("offline", level)].wall_s + self.best[("streamed", level)].wall_s
        return self.warm.entry(self.first["offline"].wall_s + self.first["streamed"].wall_s, steady)


def measure(
    pipe: OmniJaxPipeline, work: Requests, levels: list[int], per_client: int, args: Any, name: str
) -> Measured:
    """``pipe.warmup()``, then through ``AsyncOmniJaxPipeline.generate``: one unmeasured run of the
    first level in each mode, then every level ``--repeats`` times in both modes (the first mode
    alternating), every compilation after ``warmup()`` counted; ``name`` names the profiled
    window."""
    clock = StageClock({s.config.name: (s, "step") for s in pipe.stages})
    solves = SolveCounter(pipe.stages[-1])
    runs: list[Run] = []
    best: dict[tuple[str, int], Run] = {}
    loop = asyncio.new_event_loop()
    try:
        with warmed_up(pipe) as warm:
            served = AsyncOmniJaxPipeline(pipe)
            try:
                first = {m: _run(loop, served, clock, solves, work, levels[0], per_client, m) for m in MODES}
                with measured_window(args.profile, f"{name}/measured", args.profile_python):
                    for c in levels:
                        for round_ in range(args.repeats):
                            for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                                r = _run(loop, served, clock, solves, work, c, per_client, mode)
                                runs.append(r)
                                if (mode, c) not in best or r.wall_s < best[(mode, c)].wall_s:
                                    best[(mode, c)] = r
            finally:
                served.close()
    finally:
        loop.close()
    return Measured(warm, first, runs, best)


def common_fields(args: Any, measured: Measured, levels: list[int], speakers: list[str]) -> dict[str, Any]:
    """The result fields both streamed-speech suites fill alike: the run's settings and load, the
    first request's audio length, the backends, and no roofline."""
    sample = next((r for r in measured.first["offline"].records if r.error is None), None)
    return {
        "dtype": args.dtype,
        "mesh": args.mesh,
        "concurrency": levels,
        "requests_per_client": args.requests_per_client,
        "load": "closed loop: c clients, each sending its next request when its previous one ended, "
        "all starting together",
        "audio_s_per_request": None if sample is None else sample.samples / SAMPLE_RATE,
        "text_tokens_per_request": args.max_tokens,
        "speakers": speakers,
        "repeats": args.repeats,
        "ceilings": {},
        "roofline_fraction": None,
        "backends": backends(measured.warm.probe),
    }


def mode_ratios(ours: dict[str, dict[str, dict[str, Any]]], c: int) -> dict[str, float | None]:
    """Streamed against offline at level ``c`` (``ours[mode][str(c)]``: :func:`figures`): TTFA
    p50 offline over streamed, throughput streamed over offline, e2e p50 streamed over offline."""
    off, on = ours["offline"][str(c)], ours["streamed"][str(c)]
    return {
        "ttfa_p50_offline_over_streamed": (
            off["ttfa_s"]["p50"] / on["ttfa_s"]["p50"] if off["ttfa_s"] and on["ttfa_s"] else None
        ),
        "throughput_streamed_over_offline": (
            on["speech_s_per_s"] / off["speech_s_per_s"] if off["speech_s_per_s"] else None
        ),
        "e2e_p50_streamed_over_offline": (
            on["e2e_s"]["p50"] / off["e2e_s"]["p50"] if off["e2e_s"] and on["e2e_s"] else None
        ),
    }


def run(path: Path, args: Any) -> dict[str, Any]:
    if args.reference:
        raise SystemExit(
            "--suite e2e --stream runs no transformers reference (it has no streamed token2wav): "
            "its baseline is our offline decoding; drop --reference"
        )
    levels = sorted(set(args.concurrency))
    if args.codes < 1 or args.requests_per_client < 1:
        raise SystemExit("--codes and --requests-per-client must be >= 1")
    if args.max_tokens < 1:
        raise SystemExit("--max-tokens must be >= 1")
    max_batch = min(MAX_CODE2WAV_BATCH, max(levels))
    stage_config = sized_code2wav_config(
        Path(args.cache_dir),
        max_batch,
        args.codes,
        early_start=not args.late_talker,
        stream_sizes=args.stream_sizes,
        code2wav_device=args.code2wav_device,
    )
    pipe = build_pipeline(path, args, stage_config, args.max_num_seqs or max(levels), "stream", TEXT_PROMPTS)
    code2wav = pipe.stages[-1]
    if code2wav.geometry.max_codes < args.codes:
        raise SystemExit(
            f"--codes {args.codes}: this checkpoint's DiT holds {code2wav.geometry.max_codes} codes "
            "offline (max_position_embeddings // repeats)"
        )
    planner = code2wav.decoder.planner
    speakers = sorted(code2wav.voices.speakers)
    prompts = []
    for i, question in enumerate(QUESTIONS):
        prompt = pipe.chat_prompt([{"role": "user", "content": question}])
        prompts.append(dict(prompt, speaker=speakers[i % len(speakers)], modalities=["text", "audio"]))
    work = Workload(prompts, args.max_tokens, args.codes, args.num_steps, args.guidance_scale)
    per_client = args.requests_per_client
    measured = measure(pipe, work, levels, per_client, args, "e2e_stream")
    first, runs, best, warm = measured.first, measured.runs, measured.best, measured.warm
    failures = warm.failures()
    codes, code_failures = code_checks([first["offline"], first["streamed"], *runs], len(prompts), args.codes)
    failures += code_failures

    ours = {m: {str(c): figures(best[(m, c)]) for c in levels} for m in MODES}
    ratio = {str(c): mode_ratios(ours, c) for c in levels}
    targets = {}
    for c in levels:
        ttfa, thr = (
            ratio[str(c)][k] for k in ("ttfa_p50_offline_over_streamed", "throughput_streamed_over_offline")
        )
        targets[str(c)] = {
            "ttfa_met": None
            if c not in TTFA_TARGET_CONCURRENCY or args.codes < TARGET_CODES or ttfa is None
            else ttfa >= TTFA_TARGET,
            "throughput_met": None if thr is None else thr >= THROUGHPUT_TARGET,
        }
    result: dict[str, Any] = {
        "suite": "e2e_stream",
        **common_fields(args, measured, levels, speakers),
        "codes_per_request": args.codes,
        "speech_s_per_request": args.codes / CODES_PER_SPEECH_SECOND,
        "settings": {
            "thinker": f"greedy, exactly {args.max_tokens} tokens (ignore_eos); text prompts, media off "
            "(limit_mm_per_prompt 0: no encoder compiled)",
            "talker": f"greedy, repetition penalty {REPETITION_PENALTY}, exactly {args.codes} codes "
            f"(min_tokens = max_tokens), {talker_start(args)}",
            "code2wav": f"num_steps {args.num_steps}, guidance {args.guidance_scale}, sway -1, seed "
            f"{SEED} + request index; max_batch {max_batch}, max_codes {args.codes}"
            + (
                ""
                if args.code2wav_device is None
                else f"; on device {args.code2wav_device} of {len(jax.devices())}, the others on device 0"
            ),
            "steps": steps_setting(args),
        },
        "stream": {
            "first_chunk_codes": planner.first_chunk // planner.repeats,
            "chunk_codes": planner.chunk // planner.repeats,
            "max_chunk_codes": planner.largest_chunk // planner.repeats,
            "request_chunks_codes": [c.keep_len // planner.repeats for c in planner.split(args.codes)],
            "past_codes": planner.past // planner.repeats,
            "future_codes": planner.future // planner.repeats,
            "overlap_frames": planner.overlap,
            "source": "the shipped stage YAML's engine.stream"
            + ("" if not args.stream_sizes else f", with --stream-sizes {args.stream_sizes}"),
        },
        "ours": ours,
        "reference": None,
        "ratio": ratio,
        "targets": targets,
        "waveform_distance": waveform_distances(best, len(prompts)),
        "codes": codes,
        "compile": {"ours": measured.compile_entry(levels[0]), "reference": None},
        "failures": failures,
    }
    return result


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _cell(figures: dict[str, Any], key: str, quantile: str) -> str:
    return _fmt(None if figures[key] is None else figures[key][quantile])


def _solves(counts: dict[str, int]) -> str:
    """``solves x mean rows`` of the code2wav solves of a run (offline and chunk ones)."""
    parts = []
    for kind in ("offline", "chunk"):
        n = counts[f"{kind}_solves"]
        if n:
            parts.append(f"{n} x {counts[f'{kind}_rows'] / n:.1f}" + (" chunk" if kind == "chunk" else ""))
    return " + ".join(parts) or "0"


def _met(x: bool | None) -> str:
    return "n/a" if x is None else ("met" if x else "NOT met")


def level_rows(result: dict[str, Any], title: str) -> list[str]:
    """``title``, then a table row per concurrency level and mode of ``result["ours"]``."""
    head = ("c", "mode", "reqs", "TTFA p50", "TTFA p90", "e2e p50", "e2e p90", "RTF p50")
    head += ("stalls", "stall max", "speech s/s", "audio updates", "in code2wav s", "solves x rows")
    rows = []
    for c in result["concurrency"]:
        for mode in MODES:
            f = result["ours"][mode][str(c)]
            rows.append(
                (str(c), mode, str(f["requests"]), _cell(f, "ttfa_s", "p50"), _cell(f, "ttfa_s", "p90"))
                + (_cell(f, "e2e_s", "p50"), _cell(f, "e2e_s", "p90"), _cell(f, "rtf", "p50"))
                + (str(f["stalled_requests"]), _cell(f, "stall_s", "max"))
                + (f"{f['speech_s_per_s']:.2f}", f"{f['audio_updates_mean']:.1f}")
                + (f"{f['stage_s']['code2wav']:.2f}", _solves(f["code2wav_solves"]))
            )
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = [
        f"{title}; {result['load']}; times in s, best of {result['repeats']} round(s)",
        "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)),
    ]
    return lines + ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]


def closing_lines(result: dict[str, Any]) -> list[str]:
    """The settings, the waveform distances (where the suite measures them), the codes check and
    the warm-up, one line each."""
    lines = ["; ".join(f"{k}: {v}" for k, v in result["settings"].items())]
    labels = {
        "streamed_vs_offline": "streamed vs offline, same codes and seed",
        "offline_other_seed": "offline vs offline, same codes, another seed",
    }
    for name, label in labels.items():
        x = (result["waveform_distance"] or {}).get(name)
        if x is not None:
            lines.append(
                f"waveform {label} ({x['pairs']} pairs): relative L2 mean {x['rel_l2_mean']:.2e} "
                f"max {x['rel_l2_max']:.2e}; log-mel L1 mean {x['log_mel_l1_mean']:.2e} "
                f"max {x['log_mel_l1_max']:.2e}"
            )
    codes = result["codes"]
    lines.append(
        f"talker codes, streamed vs offline: {codes['identical']}/{codes['compared']} requests identical; "
        f"differing from the prompt's first run (other batches): {codes['differ_from_first_run_of_prompt']}"
    )
    c = result["compile"]["ours"]
    stages = ", ".join(f"{k} {v['programs']} / {v['seconds']:.1f} s" for k, v in c["warmup_stages"].items())
    lines.append(
        f"warmup(): {c['warmup_programs']} programs, {c['warmup_s']:.1f} s (XLA compile "
        f"{c['xla_compile_s']:.1f} s; {stages}); first run after it {c['first_run_s']:.2f} s against "
        f"{c['steady_run_s']:.2f} s; XLA compilations after warmup(): {c['compiles_after_warmup']}; "
        "excluded from every figure above"
    )
    return lines


def table(result: dict[str, Any]) -> str:
    title = (
        "e2e --stream: Qwen2.5-Omni thinker -> talker -> code2wav in process "
        "(AsyncOmniJaxPipeline.generate), code2wav offline against streamed"
    )
    lines = level_rows(result, title)
    for c in result["concurrency"]:
        r, t = result["ratio"][str(c)], result["targets"][str(c)]
        lines.append(
            f"c={c}: TTFA {_fmt(r['ttfa_p50_offline_over_streamed'], '.1f')}x lower streamed (target >= "
            f"{TTFA_TARGET:g}x at c=1, 4 for >= {TARGET_CODES} codes: {_met(t['ttfa_met'])}); throughput "
            f"streamed / offline {_fmt(r['throughput_streamed_over_offline'], '.2f')} (target >= "
            f"{THROUGHPUT_TARGET}: {_met(t['throughput_met'])}); e2e p50 streamed / offline "
            f"{_fmt(r['e2e_p50_streamed_over_offline'], '.2f')}"
        )
    s = result["stream"]
    lines.append(
        f"each request: {result['text_tokens_per_request']} text tokens, "
        f"{result['codes_per_request']} codes = {result['speech_s_per_request']:g} s of speech at the "
        "7B's 50 codes/s (speech s/s and RTF count these; this checkpoint's vocoder makes "
        f"{_fmt(result['audio_s_per_request'], '.2f')} s of audio of them); streamed chunks of "
        f"{', '.join(map(str, s['request_chunks_codes']))} codes (first {s['first_chunk_codes']}, then "
        f"{s['chunk_codes']} doubling up to {s['max_chunk_codes']}), DiT context {s['past_codes']} before / "
        f"{s['future_codes']} after, "
        f"vocoder overlap {s['overlap_frames']} frames ({s['source']})"
    )
    return "\n".join(lines + closing_lines(result))
