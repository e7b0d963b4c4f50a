"""Soak suite: the reliability load test, longer. Random AR traffic under a page budget far
below demand, round after round, checking that nothing is lost and nothing grows.

One pipeline serves ``--num-requests`` random requests (:mod:`benchmarks.workloads`): after
``warmup()`` (every XLA compilation after it is counted, and any fails the suite), once with
pages for every running request at full length (the unconstrained result), then
``--soak-rounds`` times with ``--soak-pages`` pages (default: one full-length sequence and a
quarter), so requests are preempted and recomputed all the time. Every round must return every
request, in order, with its own prompt and the token count and finish reason its params imply,
and leave the scheduler empty (queues, pages, per-request state); a violation ends the suite
with an error. Reported per round: wall time, requests/s, tokens/s, preemptions, greedy/seeded
requests whose tokens differ from the unconstrained run (float ties between programs make a rare
one legitimate: see ``test_reliability_load``), live device arrays and resident memory, whose
growth from the first to the last round is the leak figure.

With ``--reference``, transformers ``generate`` runs the first ``--soak-reference`` requests with
the same caps as ours (sampled and greedy alike, temperature, top-k/p, min-p, ``max_tokens`` or
the model length, ``min_tokens``, stop ids, EOS unless ``ignore_eos``), one request at a time as
each has its own params, once to warm up and once measured; ours runs the same requests in one
``run`` (after the unconstrained one, pages for all), and the ratio is those two tokens/s. The
greedy requests' tokens must equal the reference's, to the last token, up to checked near-ties
(:mod:`benchmarks.agreement`), or the suite fails.
"""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks import agreement
from benchmarks.harness import backends, compile_entry, measured_window, warmed_up
from benchmarks.workloads import count_problem, random_workload
from omni_jax import OmniJaxPipeline, SamplingParams
from omni_jax.engine.kv_cache import PageAllocator

DEFAULT_NUM_REQUESTS = 5000
MAX_MODEL_LEN, PAGE_SIZE, MAX_NUM_SEQS, TOKEN_BUDGET = 64, 4, 16, 64
MAX_PROMPT, MAX_NEW = 48, 24


def rss_mb() -> float | None:
    statm = Path("/proc/self/statm")
    if not statm.exists():
        return None
    return int(statm.read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class SoakFailure(RuntimeError):
    """A request lost, out of order, miscounted, or state left behind: the soak's findings."""


def _check_round(
    pipe: OmniJaxPipeline, prompts: list[list[int]], params: list[SamplingParams], outs: list[Any], pages: int
) -> None:
    stage = pipe.stages[0]
    (eos,) = stage.engine.eos_token_ids
    if len(outs) != len(prompts) or [o.prompt_token_ids for o in outs] != prompts:
        raise SoakFailure(f"{len(outs)} outputs for {len(prompts)} requests, or not in prompt order")
    for i, (prompt, p, out) in enumerate(zip(prompts, params, outs, strict=True)):
        if problem := count_problem(prompt, p, out, eos, MAX_MODEL_LEN):
            raise SoakFailure(f"request {i} ({p}): {problem}")
    scheduler = stage.engine.scheduler
    if scheduler.waiting or scheduler.running or scheduler.allocator.num_free != pages or stage._submitted:
        raise SoakFailure("state left behind after a round (queues, pages or per-request entries)")


def _ours(
    path: Path, prompts: list[list[int]], params: list[SamplingParams], args: Any, same: int
) -> dict[str, Any]:
    """The rounds; ``same``: how many of the first requests to run again alone for the ratio."""
    full = MAX_NUM_SEQS * MAX_MODEL_LEN // PAGE_SIZE
    pages = args.soak_pages or (MAX_MODEL_LEN // PAGE_SIZE) * 5 // 4
    pipe = OmniJaxPipeline.from_pretrained(
        path,
        dtype=args.dtype,
        mesh=args.mesh,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        page_size=PAGE_SIZE,
        max_num_batched_tokens=TOKEN_BUDGET,
        num_pages=full,
    )
    batch = [{"prompt_token_ids": p} for p in prompts]
    deterministic = [i for i, p in enumerate(params) if p.greedy or p.seed is not None]
    rounds = []
    with warmed_up(pipe) as warm:
        t0 = time.perf_counter()
        free = pipe.run(batch, params, progress=True)
        first_s = time.perf_counter() - t0
        _check_round(pipe, prompts, params, free, full)
        t0 = time.perf_counter()
        alone = pipe.run(batch[:same], params[:same], progress=False) if same else []
        same_s = time.perf_counter() - t0
        # The tight budget is the allocator's: the same device cache and compiled programs.
        pipe.stages[0].engine.scheduler.allocator = PageAllocator(pages)
        with measured_window(args.profile, "soak/tight rounds", args.profile_python, requests=len(batch)):
            for _ in range(args.soak_rounds):
                t0 = time.perf_counter()
                outs = pipe.run(batch, params, progress=True)
                wall = time.perf_counter() - t0
                _check_round(pipe, prompts, params, outs, pages)
                n_out = sum(len(o.token_ids) for o in outs)
                differ = sum(outs[i].token_ids != free[i].token_ids for i in deterministic)
                preempted = sum(o.metrics["llm"]["num_preemptions"] for o in outs)
                del outs
                gc.collect()
                rounds.append(
                    {
                        "wall_s": wall,
                        "requests_per_s": len(batch) / wall,
                        "tokens_per_s": n_out / wall,
                        "output_tokens": n_out,
                        "preemptions": preempted,
                        "deterministic_differ": differ,
                        "live_arrays": len(jax.live_arrays()),
                        "rss_mb": rss_mb(),
                    }
                )
    best = min(r["wall_s"] for r in rounds)
    rss = [r["rss_mb"] for r in rounds]
    same_tokens = sum(len(o.token_ids) for o in alone)
    return {
        "engine": "omni_jax",
        "pages": pages,
        "pages_unconstrained": full,
        "rounds": rounds,
        "deterministic_requests": len(deterministic),
        "tokens_per_s": float(np.mean([r["tokens_per_s"] for r in rounds])),
        "live_arrays_growth": rounds[-1]["live_arrays"] - rounds[0]["live_arrays"],
        "rss_growth_mb": rss[-1] - rss[0] if rss[0] is not None else None,
        "same_requests": {"requests": same, "wall_s": same_s, "output_tokens": same_tokens}
        | ({"tokens_per_s": same_tokens / same_s} if same else {}),
        # The tight rounds are one workload run again and again: the first against the best. (The
        # unconstrained run before them, ``first_s``, is other work: more pages, no preemption.)
        "compile": warm.entry(rounds[0]["wall_s"], best),
        "unconstrained_s": first_s,
        "failures": warm.failures(),
        "backends": backends(warm.probe),
        "token_ids": [o.token_ids for o in alone],
    }


class Reference:
    """transformers ``generate`` on one request at a time, with that request's caps."""

    def __init__(self, path: Path, dtype: str | None):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype or "float32"))
        self.model.eval()
        self.eos = self.model.generation_config.eos_token_id
        self.pad = self.model.generation_config.pad_token_id or 0

    def stops(self, p: SamplingParams) -> set[int]:
        """What ends the request: its stop ids, and EOS unless it ignores EOS."""
        return set(p.stop_token_ids or []) | (set() if p.ignore_eos else {self.eos})

    def generate(self, prompt: list[int], p: SamplingParams) -> list[int]:
        torch = self.torch
        limit = MAX_MODEL_LEN - len(prompt)
        sampling = (
            {}
            if p.greedy
            else {
                "temperature": p.temperature,
                "top_k": max(p.top_k, 0),  # generate: 0 turns top-k off
                "top_p": p.top_p,
                "min_p": p.min_p or None,
            }
        )
        ids = torch.tensor([prompt])
        with torch.no_grad():  # an explicit mask: generate would mask prompt tokens equal to pad
            seq = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=not p.greedy,
                max_new_tokens=limit if p.max_tokens is None else min(p.max_tokens, limit),
                min_new_tokens=p.min_tokens,
                eos_token_id=sorted(self.stops(p)) or None,
                pad_token_id=self.pad,
                **sampling,
            )
        return seq[0, len(prompt) :].tolist()

    def run(self, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        outs = [self.generate(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        return time.perf_counter() - t0, outs

    def scores(self, prompt: list[int], p: SamplingParams, prefix: list[int]) -> np.ndarray:
        """What greedy step ``len(prefix)`` chose from (stops held back under ``min_tokens``)."""
        held = self.stops(p) if len(prefix) < p.min_tokens else set()
        return agreement.causal_lm_scores(self.model, prompt, prefix, held)


def _reference(
    path: Path, prompts: list[list[int]], params: list[SamplingParams], ours_ids: list[list[int]], args: Any
) -> tuple[dict[str, Any], list[str]]:
    ref = Reference(path, args.dtype)
    first_s, _ = ref.run(prompts, params)
    wall, ids = ref.run(prompts, params)
    n_out = sum(len(o) for o in ids)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    agree = agreement.compare(
        ours_ids,
        ids,
        lambda i, k: ref.scores(prompts[i], params[i], ids[i][:k]),
        agreement.near_tie_bound(args.dtype),
        greedy,
    )
    figures = {
        "engine": "transformers generate, one request at a time (each with its own params)",
        "requests": len(prompts),
        "greedy_requests": len(greedy),
        "wall_s": wall,
        "output_tokens": n_out,
        "tokens_per_s": n_out / wall,
        "compile": compile_entry(first_s, wall),
        "agreement": agree.as_dict(),
    }
    return figures, agree.failures("greedy tokens")


def run(path: Path, args: Any) -> dict:
    from omni_jax.weights import load_hf_config

    cfg = load_hf_config(path)
    prompts, params = random_workload(
        args.num_requests, cfg.vocab_size, seed=0, max_prompt=MAX_PROMPT, max_new=MAX_NEW
    )
    same = min(args.soak_reference, len(prompts)) if args.reference else 0
    ours = _ours(path, prompts, params, args, same)
    ours_ids = ours.pop("token_ids")
    result: dict[str, Any] = {
        "suite": "soak",
        "requests": len(prompts),
        "rounds": args.soak_rounds,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": MAX_NUM_SEQS,
        "dtype": args.dtype,
        "mesh": args.mesh,
        "backends": ours.pop("backends"),
        "failures": ours.pop("failures"),
        "compile": {"ours": ours.pop("compile"), "reference": None},
        "ours": ours,
        "reference": None,
        "ratio": None,
        "roofline_fraction": None,
        "ceilings": {},
    }
    if same:
        ref, failures = _reference(path, prompts[:same], params[:same], ours_ids, args)
        result["compile"]["reference"] = ref.pop("compile")
        result["reference"] = ref
        result["ratio"] = ours["same_requests"]["tokens_per_s"] / ref["tokens_per_s"]
        result["failures"] += failures
    return result


def table(result: dict[str, Any]) -> str:
    ours, ref = result["ours"], result["reference"]
    lines = [
        f"{result['requests']} requests ({ours['deterministic_requests']} greedy or seeded), "
        f"{ours['pages']} pages (unconstrained: {ours['pages_unconstrained']})",
        f"{'round':>5}  {'wall s':>8}  {'req/s':>7}  {'tok/s':>8}  {'preempted':>9}  {'differ':>6}"
        f"  {'arrays':>6}  {'RSS MB':>8}",
    ]
    for k, r in enumerate(ours["rounds"]):
        rss = f"{r['rss_mb']:.0f}" if r["rss_mb"] is not None else "-"
        lines.append(
            f"{k:>5}  {r['wall_s']:>8.2f}  {r['requests_per_s']:>7.1f}  {r['tokens_per_s']:>8.1f}"
            f"  {r['preemptions']:>9}  {r['deterministic_differ']:>6}  {r['live_arrays']:>6}  {rss:>8}"
        )
    growth = ours["rss_growth_mb"]
    lines.append(
        f"growth first -> last round: {ours['live_arrays_growth']} live arrays, "
        + (f"{growth:.1f} MB resident" if growth is not None else "resident memory unknown")
    )
    comp = result["compile"]["ours"]
    lines.append(
        f"our warmup(): {comp['warmup_programs']} programs, {comp['warmup_s']:.1f} s; unconstrained "
        f"run {ours['unconstrained_s']:.1f} s; first tight round {comp['first_run_s']:.1f} s, "
        f"the best {comp['steady_run_s']:.1f} s; XLA compilations after warmup(): "
        f"{comp['compiles_after_warmup']}"
    )
    if ref is not None:
        same = ours["same_requests"]
        lines.append(
            f"the first {ref['requests']} requests, same caps: ours {same['tokens_per_s']:.1f} tok/s in one "
            f"run, transformers {ref['tokens_per_s']:.1f} tok/s one at a time: {result['ratio']:.2f}x; "
            f"greedy tokens: {ref['agreement']['summary']} of {ref['greedy_requests']} greedy"
        )
    return "\n".join(lines)
