"""AR suite: our engine vs transformers ``generate`` at its best, on the same ragged greedy requests.

Two checkpoint kinds (:data:`FAMILIES`): a Qwen2 causal LM (suite ``ar``) and Qwen3-Omni's MoE
thinker (suite ``ar_qwen3``: our pipeline built with ``stages=["thinker"]``, text prompts through
its frontend; the reference is ``Qwen3OmniMoeThinkerForConditionalGeneration.generate``, the
thinker of ``Qwen3OmniMoeForConditionalGeneration`` loaded with ``enable_audio_output=False``).
Everything below holds for both.

Workload: ``--num-requests`` prompts of ``--min-prompt`` to ``--max-prompt`` random tokens (for
Qwen3-Omni none of the tokenizer's added tokens: its frontend reads the media placeholders), each
asking for exactly ``--max-tokens`` greedy tokens (``min_tokens = max_tokens`` on our side,
``min_new_tokens`` on the reference's: both hold EOS back, so a request whose greedy choice is EOS
continues with the same next-best token on both sides).

Ours: ``OmniJaxPipeline.run`` on every request at once (continuous batching, up to
``--max-num-seqs`` running), after ``warmup()``, which compiles every program; one run of the
workload warms the rest up (allocator, caches), the second is measured, and the suite fails if
anything compiles after ``warmup()``. The reference is transformers as a careful user runs it:
prompts sorted by length, cut into left-padded batches of each size in ``--ref-batches``
(default 8, 16, 32, 64 and all of them; a size whose KV cache and activations would not fit in
half the available memory is skipped and the reason recorded), each size run once to warm up and
once measured. The ratio is ours against the fastest size; every size's figures are reported.

Greedy agreement: our tokens against every size's, request by request, up to checked near-ties
(:mod:`benchmarks.agreement`; the reference's scores at a first difference come from its model on
that request's prefix alone). A disagreement fails the suite.

Decode-step probes after the measured run: ``b`` copies of one prompt at batch 1, 8 and the
workload's concurrency, their time per output token against the step's floor, the larger of the
weights it reads over the measured memory bandwidth and its matmul FLOPs over the measured matmul
ceiling (an MoE step reads the experts its rows route to, counted as under uniform routing, and
each row multiplies its top-k: :class:`benchmarks.models.DecodeWeights`); for a dense decoder, also
against XLA's own matmuls of the step's weight shapes at those rows alone
(:func:`benchmarks.roofline.decoder_matmuls_s`), which a few rows run far below the square
ceiling. The whole workload's floor (:func:`workload_floor`) is the same arithmetic over every
prompt token and decode step: transformers' time over it is the largest ratio this machine
allows. Our measured run's steps are logged (:class:`StepLog`): how many ran at each token-row
size, the tokens they held and their time, so the padding the row sizes cost and where the time
goes are figures of the run. ``--profile`` traces our measured run (not the probes, nor the
reference).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import agreement
from benchmarks.harness import backends, compile_entry, measured_window, transformers_quiet, warmed_up
from benchmarks.models import QWEN3_OMNI, DecodeWeights, decode_weights, model_type
from benchmarks.roofline import decoder_matmuls_s, matmul_flops, memory_bandwidth
from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.engine.ar_runner import ARRunner, Dispatched
from omni_jax.engine.step import StepResult, StepRow
from omni_jax.outputs import OmniRequestOutput

PROBE_PROMPT = 32
"""Prompt tokens of each decode-step probe request."""
DEFAULT_MAX_NUM_SEQS = 32
"""``--max-num-seqs`` when not given."""


@dataclasses.dataclass(frozen=True)
class Family:
    """How the suite runs one checkpoint kind.

    ``suite``: the result's name (its ``benchmarks.run.SUITES`` key); ``stages``: the pipeline's
    stages (None: all of a one-stage model), ``stage`` the measured one's name (its outputs'
    ``metrics`` key); ``text_config``: attributes from the HF config to the decoder's config;
    ``prefix``: the decoder's tensor names in the checkpoint; ``reference``: the transformers class
    loaded with ``reference_kwargs``, then its ``submodule`` (None: itself) generates;
    ``exclude_added``: prompts avoid the tokenizer's added tokens."""

    suite: str
    stages: tuple[str, ...] | None
    stage: str
    text_config: tuple[str, ...]
    prefix: str
    reference: str
    reference_kwargs: tuple[tuple[str, Any], ...] = ()
    submodule: str | None = None
    exclude_added: bool = False

    def decoder_config(self, cfg: Any) -> Any:
        """The decoder's config within the checkpoint's HF config ``cfg`` (sizes, vocabulary)."""
        return functools.reduce(getattr, self.text_config, cfg)


FAMILIES = {
    "qwen2": Family("ar", None, "llm", (), "", "AutoModelForCausalLM"),
    QWEN3_OMNI: Family(
        "ar_qwen3",
        ("thinker",),
        "thinker",
        ("thinker_config", "text_config"),
        "thinker.",
        "Qwen3OmniMoeForConditionalGeneration",
        (("enable_audio_output", False),),  # the thinker alone: no talker, no code2wav built
        "thinker",
        exclude_added=True,
    ),
}
"""The suite's checkpoint kinds, by ``model_type``."""


def make_requests(
    vocab: int, n: int, lo: int, hi: int, seed: int = 0, exclude: Collection[int] = ()
) -> list[list[int]]:
    """``n`` prompts of ``lo`` to ``hi`` tokens drawn from ``[3, vocab)`` without ``exclude``."""
    allowed = np.setdiff1d(np.arange(3, vocab), np.asarray(list(exclude), np.int64))
    rs = np.random.RandomState(seed)
    lengths = rs.randint(lo, hi + 1, n)
    return [[int(allowed[t]) for t in rs.randint(0, len(allowed), size=int(m))] for m in lengths]


def added_token_ids(path: Path) -> list[int]:
    """The ids of the checkpoint tokenizer's added tokens (specials, placeholders)."""
    from transformers import AutoTokenizer

    return sorted(AutoTokenizer.from_pretrained(str(path)).added_tokens_decoder)


def reference_batch_sizes(spec: list[int | str], n: int) -> list[int]:
    """The sizes of ``spec`` (ints and ``"all"``) for ``n`` requests: each at most ``n``, ``"all"``
    being ``n``, without repeats."""
    return sorted({n if s == "all" else min(int(s), n) for s in spec})


def _params(max_new: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_new, min_tokens=max_new)


def _step_s(outs: list[OmniRequestOutput], max_new: int, stage: str) -> float:
    """The slowest request's time per output token after its first: a decode step at the batch."""
    return max((o.metrics[stage]["wall_s"] - o.metrics[stage]["ttft_s"]) / (max_new - 1) for o in outs)


class StepLog:
    """The AR steps ``runner`` runs while active: each one's tokens, the token rows it ran as
    (:meth:`ARRunner.rows_bucket`) and its seconds: from its dispatch, or from when the host read
    the step before if that came later, to when the host has its results (with steps
    overlapped, the next one is dispatched before this one is read, so a step's seconds are the
    time it held the device, not counting the host's work the overlap hides). Beside them, the
    host's seconds in ``dispatch`` (packing and launching the step's programs) and in ``fetch``
    (mostly waiting for the device). It wraps the runner instance's ``dispatch`` and ``fetch``
    and takes the wrappers off at exit."""

    def __init__(self, runner: ARRunner):
        self.runner = runner
        self.steps: list[tuple[int, int, float]] = []
        self.dispatch_s = 0.0
        self.fetch_s = 0.0

    def __enter__(self) -> StepLog:
        dispatch, fetch = self.runner.dispatch, self.runner.fetch
        started: dict[int, tuple[int, float]] = {}  # id(Dispatched) -> (tokens, dispatched at)
        last_read = [0.0]

        def timed_dispatch(rows: Sequence[StepRow], sources: Sequence[int] = ()) -> Dispatched:
            t0 = time.perf_counter()
            step = dispatch(rows, sources)
            started[id(step)] = (sum(len(r.token_ids) for r in rows), t0)
            self.dispatch_s += time.perf_counter() - t0
            return step

        def timed_fetch(step: Dispatched) -> StepResult:
            t_in = time.perf_counter()
            result = fetch(step)
            now = time.perf_counter()
            self.fetch_s += now - t_in
            tokens, t0 = started.pop(id(step))
            self.steps.append((tokens, self.runner.rows_bucket(tokens), now - max(t0, last_read[0])))
            last_read[0] = now
            return result

        self.runner.dispatch = timed_dispatch  # type: ignore[method-assign]
        self.runner.fetch = timed_fetch  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.runner.dispatch, self.runner.fetch

    def summary(self) -> dict[str, Any]:
        """Steps, tokens, token rows, the padding share and seconds, in all and by row size
        (largest first)."""
        by_rows: dict[str, dict[str, float]] = {}
        for tokens, rows, seconds in sorted(self.steps, key=lambda step: -step[1]):
            entry = by_rows.setdefault(str(rows), {"steps": 0, "tokens": 0, "s": 0.0})
            entry["steps"] += 1
            entry["tokens"] += tokens
            entry["s"] += seconds
        tokens = sum(t for t, _, _ in self.steps)
        rows = sum(r for _, r, _ in self.steps)
        return {
            "steps": len(self.steps),
            "tokens": tokens,
            "rows": rows,
            "padding": 1 - tokens / rows if rows else 0.0,
            "s": sum(s for _, _, s in self.steps),
            "dispatch_s": self.dispatch_s,
            "fetch_s": self.fetch_s,
            "by_rows": by_rows,
        }


def _ours(
    path: Path, family: Family, prompts: list[list[int]], args: Any, max_num_seqs: int
) -> tuple[dict[str, Any], list[list[int]]]:
    max_new = args.max_tokens
    stage = family.stage
    pipe = OmniJaxPipeline.from_pretrained(
        path,
        stages=list(family.stages) if family.stages else None,
        dtype=args.dtype,
        mesh=args.mesh,
        max_num_seqs=max_num_seqs,
        max_model_len=args.max_model_len or max(512, -(-(max(map(len, prompts)) + max_new) // 16) * 16),
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    engine = pipe.stages[0].engine
    engine.overlap = engine.overlap and not args.sequential_steps
    params = _params(max_new)
    batch = [{"prompt_token_ids": p} for p in prompts]
    concurrency = min(len(prompts), max_num_seqs)
    with warmed_up(pipe) as warm:
        t0 = time.perf_counter()
        pipe.run(batch, params, progress=False)
        first_s = time.perf_counter() - t0
        window = measured_window(args.profile, "ar/measured run", args.profile_python, requests=len(batch))
        with window, StepLog(engine.runner) as steps:
            t0 = time.perf_counter()
            outs = pipe.run(batch, params, progress=False)
            wall = time.perf_counter() - t0
        probe = {}
        for b in sorted({1, min(8, concurrency), concurrency}):
            probe[str(b)] = _step_s(
                pipe.run([{"prompt_token_ids": prompts[0][:PROBE_PROMPT]}] * b, params, progress=False),
                max_new,
                stage,
            )
    n_out = sum(len(o.token_ids) for o in outs)
    ours = {
        "engine": "omni_jax",
        "output_tokens": n_out,
        "wall_s": wall,
        "tokens_per_s": n_out / wall,
        "ttft_s_mean": float(np.mean([o.metrics[stage]["ttft_s"] for o in outs])),
        "tpot_s_mean": float(
            np.mean(
                [
                    (o.metrics[stage]["wall_s"] - o.metrics[stage]["ttft_s"]) / max(len(o.token_ids) - 1, 1)
                    for o in outs
                ]
            )
        ),
        "decode_step_s": probe,
        "steps": steps.summary(),
        "overlapped_steps": engine.overlap,
        "compile": warm.entry(first_s, wall),
        "failures": warm.failures(),
        "backends": backends(warm.probe),
    }
    return ours, [o.token_ids for o in outs]


def _available_bytes() -> int | None:
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def reference_bytes(cfg: Any, batch: int, length: int, itemsize: int) -> int:
    """What ``generate`` holds for a batch beyond the weights: its KV cache at ``length`` tokens,
    the prompt step's widest activations (MLP or a token's routed experts, attention scores) and
    the last rows' logits."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * length
    routed = getattr(cfg, "num_experts_per_tok", 0) * getattr(cfg, "moe_intermediate_size", 0)
    mlp = max(cfg.intermediate_size, routed)
    act = length * (3 * mlp + 4 * cfg.hidden_size) + cfg.num_attention_heads * length**2
    return batch * ((kv + act) * itemsize + 4 * cfg.vocab_size)


class Reference:
    """transformers ``generate`` on prompts sorted by length, in left-padded batches, stopping on
    (and, under ``min_new_tokens``, holding back) the checkpoint's ``generation_config.json`` EOS."""

    def __init__(self, path: Path, family: Family, dtype: str | None, max_new: int):
        import torch
        import transformers
        from transformers import GenerationConfig

        self.torch = torch
        with transformers_quiet():
            model = getattr(transformers, family.reference).from_pretrained(
                str(path), dtype=getattr(torch, dtype or "float32"), **dict(family.reference_kwargs)
            )
        self.model = (getattr(model, family.submodule) if family.submodule else model).eval()
        try:
            generation = GenerationConfig.from_pretrained(str(path))
        except OSError:  # no generation_config.json: what the model derived from its config
            generation = self.model.generation_config
        self.pad = generation.pad_token_id or 0
        eos = generation.eos_token_id
        self.eos = {eos} if isinstance(eos, int) else set(eos or [])
        self.max_new = max_new

    def run(self, prompts: list[list[int]], batch: int) -> list[list[int]]:
        """Every prompt's new tokens, in prompt order."""
        torch = self.torch
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(order), batch):
            chunk = order[start : start + batch]
            width = max(len(prompts[i]) for i in chunk)
            ids = torch.tensor([[self.pad] * (width - len(prompts[i])) + prompts[i] for i in chunk])
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in chunk])
            with torch.no_grad():
                seq = self.model.generate(
                    ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=self.max_new,
                    min_new_tokens=self.max_new,
                    pad_token_id=self.pad,
                    eos_token_id=sorted(self.eos),
                )
            for i, row in zip(chunk, seq[:, width:].tolist(), strict=True):
                out[i] = row
        return out

    def scores(self, prompt: list[int], prefix: list[int]) -> np.ndarray:
        """What the greedy step after ``prefix`` chose from (EOS held back, as every step here)."""
        return agreement.causal_lm_scores(self.model, prompt, prefix, self.eos)


def _reference(
    path: Path, family: Family, prompts: list[list[int]], args: Any, ours_ids: list[list[int]]
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """``(figures, agreement per batch size, failures)``."""
    from omni_jax.weights import load_hf_config

    ref = Reference(path, family, args.dtype, args.max_tokens)
    cfg = family.decoder_config(load_hf_config(path))
    itemsize = 2 if args.dtype in ("bfloat16", "float16") else 4
    available = _available_bytes()
    length = max(map(len, prompts)) + args.max_tokens
    bound = agreement.near_tie_bound(args.dtype)
    by_batch: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    agree: dict[str, Any] = {}
    failures: list[str] = []
    for b in reference_batch_sizes(args.ref_batches, len(prompts)):
        need = reference_bytes(cfg, b, length, itemsize)
        if available is not None and need > available // 2:
            skipped[str(b)] = (
                f"needs ~{need / 2**30:.1f} GiB beyond the weights, {available / 2**30:.1f} available"
            )
            continue
        t0 = time.perf_counter()
        ref.run(prompts, b)
        first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ids = ref.run(prompts, b)
        wall = time.perf_counter() - t0
        n_out = sum(len(o) for o in ids)
        by_batch[str(b)] = {
            "wall_s": wall,
            "output_tokens": n_out,
            "tokens_per_s": n_out / wall,
            "compile": compile_entry(first_s, wall),
        }
        result = agreement.compare(
            ours_ids, ids, lambda i, k, ids=ids: ref.scores(prompts[i], ids[i][:k]), bound
        )
        agree[str(b)] = result.as_dict()
        failures += result.failures(f"greedy tokens against batch {b}")
    if not by_batch:
        raise SystemExit(f"ar: no reference batch size fits in memory: {skipped}")
    best = max(by_batch, key=lambda b: by_batch[b]["tokens_per_s"])
    figures = {
        "engine": f"transformers {family.reference}"
        + (f".{family.submodule}" if family.submodule else "")
        + " generate, prompts sorted by length, left-padded batches",
        "by_batch": by_batch,
        "skipped": skipped,
        "best_batch": int(best),
        "tokens_per_s": by_batch[best]["tokens_per_s"],
        "wall_s": by_batch[best]["wall_s"],
    }
    return figures, agree, failures


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """What the floors divide by: bytes/s and FLOP/s measured on this machine
    (:mod:`benchmarks.roofline`), and the bytes of one parameter."""

    bandwidth: float
    flops: float
    itemsize: int

    def step_s(self, weights: DecodeWeights, batch: int) -> float:
        """A decode step's floor at ``batch`` rows: the larger of the weights it reads over the
        bandwidth and its matmul FLOPs over the matmul ceiling."""
        read = weights.read(batch) * self.itemsize / self.bandwidth
        return max(read, 2 * weights.active() * batch / self.flops)


def workload_floor(
    weights: DecodeWeights, head: int, prompts: list[int], max_new: int, max_num_seqs: int, ceil: Ceilings
) -> dict[str, float]:
    """The least time any engine could run the workload in on this machine: every prompt token's
    matmul FLOPs at the ceiling (the ``head`` parameters of the LM head on each prompt's last
    token only; attention's own FLOPs left out), then ``max_new - 1`` decode steps of each wave
    of ``max_num_seqs`` requests at their floor (:meth:`Ceilings.step_s`). transformers' time over
    it is the most any engine could beat transformers by here."""
    body = weights.active() - head
    prefill = 2 * (body * sum(prompts) + head * len(prompts)) / ceil.flops
    full, rest = divmod(len(prompts), max_num_seqs)
    waves = [max_num_seqs] * full + ([rest] if rest else [])
    decode = (max_new - 1) * sum(ceil.step_s(weights, b) for b in waves)
    return {"prefill_s": prefill, "decode_s": decode, "total_s": prefill + decode}


def decode_matmul_shapes(cfg: Any) -> tuple[tuple[int, int], ...]:
    """A dense decoder's weight products in a decode step, ``(in, out)`` in order: each layer's
    fused QKV, output, fused gate-up and down projections, then the LM head."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    d, q, kv = cfg.hidden_size, cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    layer = ((d, q + 2 * kv), (q, d), (d, 2 * cfg.intermediate_size), (cfg.intermediate_size, d))
    return layer * cfg.num_hidden_layers + ((d, cfg.vocab_size),)


def run(path: Path, args: Any) -> dict:
    from omni_jax.weights import load_hf_config

    family = FAMILIES[model_type(path)]
    cfg = family.decoder_config(load_hf_config(path))
    exclude = added_token_ids(path) if family.exclude_added else ()
    prompts = make_requests(
        cfg.vocab_size, args.num_requests, args.min_prompt, args.max_prompt, exclude=exclude
    )
    max_num_seqs = args.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    ours, ours_ids = _ours(path, family, prompts, args, max_num_seqs)
    bw, peak = memory_bandwidth(), matmul_flops(dtype=args.dtype or "float32")
    ceil = Ceilings(bw, peak, 2 if args.dtype in ("bfloat16", "float16") else 4)
    weights = decode_weights(path, family.prefix, cfg)
    read = {b: weights.read(int(b)) * ceil.itemsize for b in ours["decode_step_s"]}
    floors = {b: ceil.step_s(weights, int(b)) for b in ours["decode_step_s"]}
    floor = workload_floor(
        weights,
        cfg.vocab_size * cfg.hidden_size,
        list(map(len, prompts)),
        args.max_tokens,
        max_num_seqs,
        ceil,
    )
    result: dict[str, Any] = {
        "suite": family.suite,
        "requests": len(prompts),
        "prompt_len_range": [args.min_prompt, args.max_prompt],
        "prompt_tokens": sum(map(len, prompts)),
        "max_tokens": args.max_tokens,
        "max_num_seqs": max_num_seqs,
        "dtype": args.dtype,
        "mesh": args.mesh,
        "params": weights.params,
        "ceilings": {"memory_bandwidth_GBps": bw / 1e9, "matmul_GFLOPs": peak / 1e9},
        "decode_weight_bytes": read,
        "decode_floor_s": floors,
        "roofline_fraction": {b: floors[b] / s for b, s in ours["decode_step_s"].items()},
        "decode_matmuls_s": None
        if weights.num_experts
        else {
            b: decoder_matmuls_s(decode_matmul_shapes(cfg), int(b), args.dtype or "float32")
            for b in ours["decode_step_s"]
        },
        "workload_floor_s": floor,
        "workload_floor_fraction": floor["total_s"] / ours["wall_s"],
        "backends": ours.pop("backends"),
        "failures": ours.pop("failures"),
        "compile": {"ours": ours.pop("compile"), "reference": None},
        "ours": ours,
        "reference": None,
        "ratio": None,
    }
    if weights.num_experts:
        result["moe"] = {
            "layers": weights.moe_layers,
            "experts": weights.num_experts,
            "top_k": weights.top_k,
            "experts_read_by_batch": {b: weights.experts_read(int(b)) for b in ours["decode_step_s"]},
            "active_params": weights.active(),
        }
    if args.reference:
        ref, agree, failures = _reference(path, family, prompts, args, ours_ids)
        result["reference"] = ref
        result["compile"]["reference"] = ref["by_batch"][str(ref["best_batch"])]["compile"]
        result["ratio"] = ours["tokens_per_s"] / ref["tokens_per_s"]
        result["ratio_at_floor"] = ref["wall_s"] / floor["total_s"]
        result["ratio_by_batch"] = {
            b: ours["tokens_per_s"] / r["tokens_per_s"] for b, r in ref["by_batch"].items()
        }
        result["agreement"] = agree
        result["failures"] += failures
    return result


def table(result: dict[str, Any]) -> str:
    ours, ref = result["ours"], result["reference"]
    comp = result["compile"]["ours"]
    lo, hi = result["prompt_len_range"]
    lines = [
        f"{result['requests']} requests, prompts {lo}-{hi} tokens, {result['max_tokens']} new each, "
        f"greedy; ours up to {result['max_num_seqs']} at once",
        f"{'':<34} {'tokens/s':>10} {'wall s':>8} {'ratio':>7}  greedy agreement",
        f"{'omni_jax':<34} {ours['tokens_per_s']:>10.1f} {ours['wall_s']:>8.2f} {'':>7}",
    ]
    if ref:
        for b, r in ref["by_batch"].items():
            name = f"transformers, sorted, batch {b}" + (" (best)" if int(b) == ref["best_batch"] else "")
            lines.append(
                f"{name:<34} {r['tokens_per_s']:>10.1f} {r['wall_s']:>8.2f} "
                f"{result['ratio_by_batch'][b]:>6.2f}x  {result['agreement'][b]['summary']}"
            )
        for b, why in ref["skipped"].items():
            lines.append(f"transformers batch {b}: skipped, {why}")
        lines.append(
            f"ratio against transformers at its best (batch {ref['best_batch']}): {result['ratio']:.2f}x"
        )
    lines.append(
        f"TTFT mean {ours['ttft_s_mean']:.3f} s, TPOT mean {ours['tpot_s_mean'] * 1e3:.1f} ms; "
        f"our warmup(): {comp['warmup_programs']} programs, {comp['warmup_s']:.1f} s "
        f"(XLA compile {comp['xla_compile_s']:.1f} s); first run after it {comp['first_run_s']:.2f} s; "
        f"compilations after warmup(): {comp['compiles_after_warmup']}; all excluded from the figures above"
    )
    steps = ours["steps"]
    sizes = ", ".join(
        f"{rows} x{e['steps']} ({e['tokens']} tokens) {e['s']:.2f} s" for rows, e in steps["by_rows"].items()
    )
    lines.append(
        f"our steps ({'overlapped' if ours['overlapped_steps'] else 'each read before the next'}): "
        f"{steps['steps']}, {steps['tokens']} tokens in {steps['rows']} token rows "
        f"({steps['padding']:.0%} padding), {steps['s']:.2f} s (host: {steps['dispatch_s']:.2f} s "
        f"dispatching, {steps['fetch_s']:.2f} s reading results); by rows: {sizes}"
    )
    ceil = result["ceilings"]
    if "moe" in result:
        moe = result["moe"]
        read = ", ".join(f"{n:.1f} at batch {b}" for b, n in moe["experts_read_by_batch"].items())
        lines.append(
            f"MoE: {moe['layers']} layers of {moe['experts']} experts, {moe['top_k']} a token; a decode step "
            f"reads {read} of them a layer (uniform routing), {moe['active_params'] / 1e6:.3g}M "
            "parameters multiply each row"
        )
    floor = result["workload_floor_s"]
    line = (
        f"workload floor {floor['total_s']:.2f} s (prompt FLOPs at the ceiling {floor['prefill_s']:.2f} s, "
        f"decode steps at their floor {floor['decode_s']:.2f} s): "
        f"ours at {result['workload_floor_fraction']:.0%} of it"
    )
    if ref:
        line += f"; an engine at the floor would be {result['ratio_at_floor']:.2f}x transformers at its best"
    lines.append(line)
    matmuls = result["decode_matmuls_s"]
    for b, s in ours["decode_step_s"].items():
        lines.append(
            f"decode step, batch {b}: {s * 1e3:.2f} ms, {result['roofline_fraction'][b]:.0%} of its floor "
            f"{result['decode_floor_s'][b] * 1e3:.2f} ms (max of weights / "
            f"{ceil['memory_bandwidth_GBps']:.1f} GB/s and FLOPs / {ceil['matmul_GFLOPs']:.0f} GFLOP/s, "
            "both measured)"
            + (f"; its weight matmuls alone in XLA {matmuls[b] * 1e3:.2f} ms" if matmuls else "")
        )
    return "\n".join(lines)
