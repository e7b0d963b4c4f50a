"""What every suite shares: the result schema, compile accounting, the profiled window, the
machine's threads and the backends that ran, versions.

A suite is a module with ``run(path, args) -> dict`` and ``table(result) -> str`` (see
:data:`benchmarks.run.SUITES`). ``run`` returns the suite-specific fields plus those in
:data:`SUITE_FIELDS` (and, where it has them, ``failures`` and ``backends``: see
:data:`OPTIONAL_FIELDS`); :func:`benchmarks.run.main` adds :data:`HARNESS_FIELDS` and checks the
lot with :func:`check_result` before printing and writing JSON, and exits non-zero when a suite
reports a failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar
from unittest import mock

import jax
import numpy as np
import yaml

from omni_jax import OmniJaxPipeline
from omni_jax.engine.compilation import CompileCounter
from omni_jax.kernels import cpu as cpu_kernels
from omni_jax.outputs import WarmupReport
from omni_jax.profiling import scope
from omni_jax.stages.config import SHIPPED_DIR

SUITE_FIELDS = ("suite", "ours", "reference", "ratio", "roofline_fraction", "ceilings", "compile")
"""``ours`` / ``reference``: measured figures, steady state (the reference is None without
``--reference``); ``ratio``: ours over reference on the suite's headline throughput, higher is
better (a number, or one per batch size; None without ``--reference``); ``roofline_fraction``:
the measured time's share of the ceiling-bound floor (None where no roofline applies);
``ceilings``: what the harness measured on this machine for that floor (``memory_bandwidth_GBps``,
``matmul_GFLOPs``); ``compile``: ``{"ours": ..., "reference": ...}`` from :func:`compile_entry`,
first run (compilation and warm-up) against the steady run, kept out of every other figure."""

HARNESS_FIELDS = (
    "model",
    "device",
    "versions",
    "command",
    "date_utc",
    "profile",
    "persistent_cache",
    "environment",
)
"""Added by :func:`benchmarks.run.main`; ``environment`` is :func:`environment`."""

OPTIONAL_FIELDS = ("failures", "backends")
"""``failures``: what makes the suite exit non-zero (greedy disagreement beyond a checked near-tie,
a compilation after ``warmup()``, audio beyond the parity bound), one line each; ``backends``:
:func:`backends`, for suites that run our pipeline."""


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "flax", "torch", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def device() -> str:
    d = jax.devices()[0]
    return f"{d.platform}: {getattr(d, 'device_kind', d)} x{jax.device_count()}"


def cores() -> int:
    """The cores this process may run on: XLA's CPU client sizes its intra-op thread pool by the
    CPU affinity mask (``tsl::port::MaxParallelism``), so this is XLA's thread count too."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def set_threads() -> None:
    """torch's intra-op threads to :func:`cores`, the number XLA uses, so neither side runs on
    fewer cores than the other (torch's own default can differ: it reads OMP_NUM_THREADS)."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(cores())


def wall_times(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall seconds of each of ``repeats`` calls of ``fn`` (which returns when its work is done)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """``result`` as indented JSON at ``path``; nothing when no path was asked for."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def torch_device() -> str:
    """Where a reference runs: ``cuda`` when torch sees a GPU and JAX runs on one (both sides on
    the same chip, transformers at its best), else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() and jax.default_backend() == "gpu" else "cpu"


def torch_synchronize(device: str) -> None:
    """Wait for the work torch has queued on ``device``: CUDA runs asynchronously, so a wall-clock
    time taken without it would end before the kernels do."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def environment() -> dict[str, Any]:
    """The machine as both sides saw it: cores, each side's threads, the 1-minute load average
    (another busy process slows both sides, torch's waiting threads most), XLA's flags."""
    threads: dict[str, Any] = {"xla_intra_op": cores()}
    try:
        import torch

        threads.update(torch_intra_op=torch.get_num_threads(), torch_inter_op=torch.get_num_interop_threads())
    except ImportError:
        pass
    return {
        "cpu_count": os.cpu_count() or 0,
        "cores": cores(),
        "threads": threads,
        "loadavg_1min": os.getloadavg()[0],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


class AttentionProbe:
    """Which paged-attention paths our programs were traced with, while active: the C++ CPU
    kernel (``cpu``), Pallas (``pallas``) or XLA's gather path (``jnp``), counted per traced call.

    ``auto`` picks a path when a step is traced (``omni_jax.models.attention.paged_attention``),
    so the probe is active over ``warmup()``, which traces every program the run executes.
    """

    PATHS = {"cpu": "_cpu_decode", "pallas": "_pallas_decode", "jnp": "_attention_jnp"}

    def __init__(self) -> None:
        self.traced = dict.fromkeys(self.PATHS, 0)
        self._stack = contextlib.ExitStack()

    def _counting(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.traced[name] += 1
            return fn(*args, **kwargs)

        return counted

    def __enter__(self) -> AttentionProbe:
        from omni_jax.models import attention

        for name, attr in self.PATHS.items():
            self._stack.enter_context(
                mock.patch.object(attention, attr, self._counting(name, getattr(attention, attr)))
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()


def backends(probe: AttentionProbe, attention: str = "auto") -> dict[str, Any]:
    """The attention backend asked for and the paths it resolved to (``probe``), the CPU kernel's
    switch and compiler, the pixel backend the processor resizes images and videos with, how
    MoE experts may run (:func:`~omni_jax.models.moe.expert_forms`) and how the Qwen2.5-Omni vocoder
    writes its ``sin^2`` (:func:`~omni_jax.models.qwen2_5_omni.bigvgan.sin_form`), how the
    code2wav models' dilated convolutions run (:func:`~omni_jax.models.dilated_conv.dilated_form`),
    and whether transformers may load hub kernels into the reference (``benchmarks/__init__.py``)."""
    from omni_jax.models.dilated_conv import dilated_form
    from omni_jax.models.moe import expert_forms
    from omni_jax.models.qwen2_5_omni.bigvgan import sin_form
    from omni_jax.models.qwen2_5_omni.processor import default_pixel_backend

    return {
        "attention": attention,
        "attention_traced": dict(probe.traced),
        "cpu_kernel_ran": probe.traced["cpu"] > 0,
        "cpu_kernels_switch": os.environ.get(cpu_kernels.ENV_SWITCH, "unset (on)"),
        "cxx_compiler": cpu_kernels._compiler(),
        "pixels": default_pixel_backend(),
        "moe_experts": " or ".join(expert_forms()),
        "vocoder_sin": sin_form(),
        "dilated_conv": dilated_form(),
        "reference_hub_kernels": os.environ.get("USE_HUB_KERNELS", "unset"),
    }


def describe(result: dict[str, Any]) -> str:
    """The lines every suite's table ends with: threads, load, backends, versions."""
    env, v = result["environment"], result["versions"]
    threads = ", ".join(f"{k} {n}" for k, n in env["threads"].items())
    lines = [
        f"host: {result['device']}, {env['cores']} of {env['cpu_count']} cores; threads: {threads}; "
        f"1-min load {env['loadavg_1min']:.1f} at the end"
    ]
    if "backends" in result:
        b = result["backends"]
        traced = ", ".join(f"{k} {n}" for k, n in b["attention_traced"].items() if n)
        lines.append(
            f"attention {b['attention']} traced as: {traced or 'none'} (CPU kernel ran: "
            f"{b['cpu_kernel_ran']}; {cpu_kernels.ENV_SWITCH}={b['cpu_kernels_switch']}, compiler "
            f"{b['cxx_compiler']}); pixels {b['pixels']}; MoE experts {b['moe_experts']}; "
            f"vocoder sin {b['vocoder_sin']}; dilated convolutions {b['dilated_conv']}"
        )
    lines.append("versions: " + ", ".join(f"{k} {x}" for k, x in v.items()))
    return "\n".join(lines)


def now_utc() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def persistent_cache() -> str | None:
    """JAX's persistent compilation cache directory, None when off (then compile times are real)."""
    return jax.config.jax_compilation_cache_dir or None


def compile_entry(first_run_s: float, steady_run_s: float, stats: CompileCounter | None = None) -> dict:
    """One side's compile figures: its first run against its best steady run of the same work,
    and, from ``stats`` (active over what built the programs), XLA's compilations and their
    seconds apart from the programs loaded from JAX's persistent cache."""
    out: dict[str, Any] = {
        "first_run_s": first_run_s,
        "steady_run_s": steady_run_s,
        "compile_and_warmup_s": first_run_s - steady_run_s,
    }
    if stats is not None:
        out.update(
            xla_compiles=stats.compiles,
            xla_compile_s=stats.compile_s,
            jaxpr_trace_s=stats.trace_s,
            persistent_cache_loads=stats.loads,
            persistent_cache_load_s=stats.load_s,
        )
    return out


@dataclasses.dataclass
class Warmup:
    """Our side's start: ``OmniJaxPipeline.warmup()`` (its report, and what XLA did meanwhile),
    the attention paths its programs were traced with, and a counter of every compilation after
    it (``after``: active from the end of ``warmup()`` until the suite's last measured run)."""

    report: WarmupReport
    stats: CompileCounter
    probe: AttentionProbe
    after: CompileCounter

    def entry(self, first_run_s: float, steady_run_s: float) -> dict[str, Any]:
        """``compile["ours"]``: ``warmup()`` (programs, seconds, per stage, XLA's compile and
        trace seconds), then the workload's first run after it against the steady run, and the
        compilations after ``warmup()``, which must be none."""
        r = self.report
        return compile_entry(first_run_s, steady_run_s, self.stats) | {
            "warmup_programs": r.programs,
            "warmup_s": r.seconds,
            "warmup_stages": {
                name: {"programs": s.programs, "seconds": s.seconds} for name, s in r.stages.items()
            },
            "compiles_after_warmup": self.after.programs,  # compiled, or loaded from the cache
        }

    def failures(self) -> list[str]:
        if not self.after.programs:
            return []
        return [f"{self.after.programs} XLA programs built after warmup() (none may be)"]


@contextlib.contextmanager
def warmed_up(pipe: OmniJaxPipeline) -> Iterator[Warmup]:
    """``with warmed_up(pipe) as w: <first run, measured runs>``: ``pipe.warmup()`` under compile
    accounting, then every compilation counted until the block ends; the attention probe watches
    both, so a program traced after ``warmup()`` (which must not happen) still counts."""
    with AttentionProbe() as probe:
        with CompileCounter() as stats:
            report = pipe.warmup()
        with CompileCounter() as after:
            yield Warmup(report, stats, probe, after)


@contextlib.contextmanager
def measured_window(
    profile_dir: str | None, name: str, python_tracer: bool = False, **metadata: object
) -> Iterator[None]:
    """The measured phase of a suite: a named span, and a ``jax.profiler`` trace into
    ``profile_dir`` (``plugins/profile/<run>/*.xplane.pb`` and ``*.trace.json.gz``) when one is
    given. The trace holds the device activity and the host spans (:mod:`omni_jax.profiling`);
    ``python_tracer`` adds every Python call, which shows where host time goes but slows the
    host several-fold, so the figures of such a window are not comparable."""
    if profile_dir:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = int(python_tracer)
        jax.profiler.start_trace(profile_dir, profiler_options=options)
    try:
        with scope(f"bench/{name}", **metadata):
            yield
    finally:
        if profile_dir:
            jax.profiler.stop_trace()


T = TypeVar("T")
"""What a suite's run of one batch reports beside its wall seconds and waveforms."""


@dataclasses.dataclass
class BatchRounds(Generic[T]):
    """Our side of a batch-size suite's rounds: each batch's first run after ``warmup()``
    (``first``, seconds), its fastest measured run (``best``: wall seconds and what that run
    reported) and the waveforms of the last measured run of every request (``audio``)."""

    first: dict[str, float]
    best: dict[str, tuple[float, T]]
    audio: list[np.ndarray]


def batch_rounds(
    run_batch: Callable[[list[int]], tuple[float, list[np.ndarray], T]],
    batches: dict[str, list[int]],
    args: Any,
    suite: str,
    reference: tuple[Callable[[], None], Callable[[], None]] | None = None,
) -> BatchRounds[T]:
    """The code2wav suites' measurement, inside :func:`warmed_up`: each batch (name -> request
    indices; the largest is every request) run once, then ``--repeats`` rounds of ours, under
    :func:`measured_window` (``--profile`` traces the last round's), then the ``reference``'s
    warm-up and ``--repeats`` rounds (its ``(warm_up, round)`` callables). All of ours first, as
    the e2e suites do: torch's threads, still spinning after its calls, slowed the XLA rounds
    that followed them on a 2-core machine. ``run_batch`` runs one batch: ``(wall s, waveforms,
    what it reports)``."""
    every = max(len(idx) for idx in batches.values())
    first = {b: run_batch(idx)[0] for b, idx in batches.items()}
    best: dict[str, tuple[float, T]] = {}
    audio: list[np.ndarray] = []
    for round_ in range(args.repeats):
        traced = args.profile if round_ == args.repeats - 1 else None
        with measured_window(traced, f"{suite}/measured round", args.profile_python, round=round_):
            for b, idx in batches.items():
                with scope(f"bench/{suite}/batch {b}"):
                    wall, waves, reported = run_batch(idx)
                if b not in best or wall < best[b][0]:
                    best[b] = (wall, reported)
                if len(idx) == every:
                    audio = waves
    if reference:
        warm_up, round_of_reference = reference
        warm_up()
        for _ in range(args.repeats):
            round_of_reference()
    return BatchRounds(first, best, audio)


def _numbers(x: Any, path: str) -> Iterator[tuple[str, float]]:
    if isinstance(x, bool):
        return
    if isinstance(x, (int, float)):
        yield path, float(x)
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _numbers(v, f"{path}[{i}]")


def check_result(result: dict[str, Any]) -> None:
    """Raise if a field of the schema is missing or a number is NaN / infinite."""
    missing = [k for k in (*SUITE_FIELDS, *HARNESS_FIELDS) if k not in result]
    if missing:
        raise ValueError(f"suite {result.get('suite')!r}: result lacks {missing}")
    bad = [p for p, v in _numbers(result, "result") if not math.isfinite(v)]
    if bad:
        raise ValueError(f"suite {result['suite']!r}: non-finite figures at {bad}")


@contextlib.contextmanager
def transformers_quiet() -> Iterator[None]:
    """transformers logging errors only, for a load: a Qwen3-Omni part loaded alone from the whole
    checkpoint (its thinker, its code2wav) would list every tensor of the others it leaves unread."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


CODE2WAV_LENGTH_KEY = {"qwen2_5_omni": "max_codes", "qwen3_omni": "max_frames"}
"""Per shipped stage YAML (its name without ``.yaml``), code2wav's ``engine`` key for the longest
offline request: Qwen2.5-Omni counts codes, Qwen3-Omni codec frames."""


def talker_start(args: Any) -> str:
    """When the talker starts, as the settings say it."""
    return (
        "started when the thinker ends (--late-talker)"
        if args.late_talker
        else "started on the thinker's first tokens"
    )


def steps_setting(args: Any) -> str:
    """How the engine's stages step (``--sequential-steps``), as the settings say it."""
    return (
        "each stage's step read before the next stage steps (--sequential-steps): a stage's seconds "
        "are its own device time"
        if args.sequential_steps
        else "a stage's step or solve left in flight while the others step (the engine's default)"
    )


def sized_code2wav_config(
    workdir: Path,
    max_batch: int,
    max_codes: int,
    family: str = "qwen2_5_omni",
    early_start: bool = True,
    stream_sizes: dict[str, int] | None = None,
    streaming: bool = True,
    code2wav_device: int | None = None,
) -> Path:
    """The shipped stage YAML of ``family`` (a :data:`CODE2WAV_LENGTH_KEY` key) with code2wav's
    ``engine`` sized to a suite's workload (``max_batch`` requests of at most ``max_codes`` codes,
    or frames for Qwen3-Omni), written under ``workdir``: what a serving user sets for their
    traffic. The shipped defaults (Qwen2.5-Omni: 8 requests of up to 4096 codes) make
    ``warmup()`` compile solves of that size and the start-up memory check reserve for them, far
    past a benchmark's requests. ``early_start`` false: the talker starts when the thinker ends
    (``--late-talker``). ``stream_sizes``: ``engine.stream`` keys set over the shipped ones
    (``--stream-sizes``; the stage refuses a key not its family's). ``streaming`` false: an
    offline-only stage (``engine.stream: false``), for a suite whose requests never stream, so
    that warm-up compiles no chunk program its traffic cannot use. ``code2wav_device``: code2wav
    alone on that device (an index into ``jax.devices()``), every other stage on device 0
    (``--code2wav-device``), so the talker and code2wav run at the same time."""
    raw = yaml.safe_load((SHIPPED_DIR / f"{family}.yaml").read_text())
    (code2wav,) = [s for s in raw["stages"] if s["name"] == "code2wav"]
    length = CODE2WAV_LENGTH_KEY[family]
    code2wav["engine"] = {**code2wav.get("engine", {}), "max_batch": max_batch, length: max_codes}
    if stream_sizes:
        code2wav["engine"]["stream"] = {**code2wav["engine"].get("stream", {}), **stream_sizes}
    if not streaming:
        code2wav["engine"]["stream"] = False
    for talker in (s for s in raw["stages"] if s["name"] == "talker"):
        talker["engine"] = {**talker.get("engine", {}), "early_start": early_start}
    placed = ""
    if code2wav_device is not None:
        for stage in raw["stages"]:
            stage["devices"] = [code2wav_device if stage is code2wav else 0]
        raw["allow_shared_devices"] = True  # the AR stages share device 0
        placed = f"-device{code2wav_device}"
    late = "" if early_start else "-late-talker"
    sizes = "".join(f"-{k}{v}" for k, v in (stream_sizes or {}).items()) if streaming else "-offline"
    path = workdir / f"{family}-code2wav-{max_batch}x{max_codes}{late}{sizes}{placed}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path
