"""AR suite: our engine vs transformers ``generate`` on the same ragged greedy requests.

Both sides run the workload once to warm up (compilation, caches, allocator) and are
measured on the second run, so compile time is reported on its own and excluded from the
ratio. transformers gets left-padded batches of ``ref_batch``; our engine schedules all
requests with continuous batching, which is the point of an engine. ``--profile`` traces our
measured run (not the decode-step probes after it, nor the reference).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import CompileStats, compile_entry, measured_window
from benchmarks.models import count_params, decode_read_params
from benchmarks.roofline import memory_bandwidth
from omni_jax import OmniJaxPipeline, SamplingParams


def make_requests(vocab: int, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rs = np.random.RandomState(seed)
    return [[int(t) for t in rs.randint(3, vocab, size=int(m))] for m in rs.randint(lo, hi + 1, n)]


def _ours(
    path: Path,
    prompts: list[list[int]],
    max_new: int,
    dtype: str | None,
    profile: str | None,
    mesh: dict[str, int] | None = None,
    profile_python: bool = False,
    max_num_seqs: int = 32,
) -> dict:
    pipe = OmniJaxPipeline.from_pretrained(
        path,
        dtype=dtype,
        mesh=mesh,
        max_num_seqs=max_num_seqs,
        max_model_len=max(512, -(-(max(map(len, prompts)) + max_new) // 16) * 16),
        max_num_batched_tokens=2048,
    )
    # min_tokens as the reference's min_new_tokens: both keep EOS from being sampled, so a
    # request whose greedy choice is EOS continues with the same next-best token on both sides.
    # Not ignore_eos: as in vLLM, it makes EOS an ordinary token, which min_tokens then no
    # longer holds back (so it would be emitted where generate had suppressed it).
    params = SamplingParams(temperature=0.0, max_tokens=max_new, min_tokens=max_new)
    batch = [{"prompt_token_ids": p} for p in prompts]
    with CompileStats() as stats:
        t0 = time.perf_counter()
        pipe.run(batch, params, progress=False)
        warm_s = time.perf_counter() - t0
    with measured_window(profile, "ar/measured run", profile_python, requests=len(batch)):
        t0 = time.perf_counter()
        outs = pipe.run(batch, params, progress=False)
        wall = time.perf_counter() - t0
    n_out = sum(len(o.token_ids) for o in outs)
    ttft = [o.metrics["llm"]["ttft_s"] for o in outs]
    tpot = [
        (o.metrics["llm"]["wall_s"] - o.metrics["llm"]["ttft_s"]) / max(len(o.token_ids) - 1, 1) for o in outs
    ]
    step = {}
    for b in (1, 8):
        single = [{"prompt_token_ids": prompts[0][:32]}] * b
        pipe.run(single, params, progress=False)
        o = pipe.run(single, params, progress=False)
        step[b] = max((x.metrics["llm"]["wall_s"] - x.metrics["llm"]["ttft_s"]) / (max_new - 1) for x in o)
    return {
        "engine": "omni_jax",
        "output_tokens": n_out,
        "wall_s": wall,
        "tokens_per_s": n_out / wall,
        "ttft_s_mean": float(np.mean(ttft)),
        "tpot_s_mean": float(np.mean(tpot)),
        "decode_step_s": {str(k): v for k, v in step.items()},
        "compile": compile_entry(warm_s, wall, stats),
        "token_ids": [o.token_ids for o in outs],
    }


def _reference(path: Path, prompts: list[list[int]], max_new: int, dtype: str | None, ref_batch: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype) if dtype else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype).eval()
    pad = model.generation_config.pad_token_id or 0

    def run_all() -> list[list[int]]:
        outs = []
        for i in range(0, len(prompts), ref_batch):
            chunk = prompts[i : i + ref_batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=max_new,
                    min_new_tokens=max_new,
                    pad_token_id=pad,
                )
            outs += out[:, width:].tolist()
        return outs

    t0 = time.perf_counter()
    run_all()
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = run_all()
    wall = time.perf_counter() - t0
    n_out = sum(len(o) for o in outs)
    return {
        "engine": f"transformers generate (batches of {ref_batch}, left-padded)",
        "output_tokens": n_out,
        "wall_s": wall,
        "tokens_per_s": n_out / wall,
        "compile": compile_entry(warm_s, wall),
        "token_ids": outs,
    }


def run(path: Path, args: Any) -> dict:
    from omni_jax.weights import load_hf_config

    cfg = load_hf_config(path)
    prompts = make_requests(cfg.vocab_size, args.num_requests, args.min_prompt, args.max_prompt)
    ours = _ours(
        path,
        prompts,
        args.max_tokens,
        args.dtype,
        args.profile,
        args.mesh,
        args.profile_python,
        args.max_num_seqs,
    )
    bw = memory_bandwidth()
    itemsize = 2 if args.dtype in ("bfloat16", "float16") else 4
    weight_bytes = decode_read_params(path) * itemsize
    floor = weight_bytes / bw
    ours_ids = ours.pop("token_ids")
    result: dict[str, Any] = {
        "suite": "ar",
        "requests": len(prompts),
        "prompt_len_range": [args.min_prompt, args.max_prompt],
        "max_tokens": args.max_tokens,
        "max_num_seqs": args.max_num_seqs,
        "dtype": args.dtype,
        "mesh": args.mesh,
        "params": count_params(path),
        "ceilings": {"memory_bandwidth_GBps": bw / 1e9},
        "decode_weight_bytes": weight_bytes,
        "decode_floor_s": floor,
        "roofline_fraction": {b: floor / s for b, s in ours["decode_step_s"].items()},
        "ours": ours,
        "reference": None,
        "ratio": None,
    }
    result["compile"] = {"ours": ours.pop("compile"), "reference": None}
    if args.reference:
        ref = _reference(path, prompts, args.max_tokens, args.dtype, ref_batch=args.ref_batch)
        ref_ids = ref.pop("token_ids")
        result["compile"]["reference"] = ref.pop("compile")
        result["reference"] = ref
        result["ratio"] = ours["tokens_per_s"] / ref["tokens_per_s"]
        same = sum(a == b for a, b in zip(ours_ids, ref_ids, strict=True))
        result["greedy_agreement"] = f"{same}/{len(prompts)} requests with identical tokens"
    return result


def table(result: dict[str, Any]) -> str:
    ours, ref = result["ours"], result["reference"]
    comp = result["compile"]
    rows = [
        ("output tokens/s", f"{ours['tokens_per_s']:.1f}", f"{ref['tokens_per_s']:.1f}" if ref else "-"),
        ("wall s (measured run)", f"{ours['wall_s']:.2f}", f"{ref['wall_s']:.2f}" if ref else "-"),
        (
            "first run s (incl. compile)",
            f"{comp['ours']['first_run_s']:.2f}",
            f"{comp['reference']['first_run_s']:.2f}" if ref else "-",
        ),
        (
            "XLA compile s (programs)",
            f"{comp['ours']['xla_compile_s']:.2f} ({comp['ours']['xla_compiles']})",
            "-",
        ),
        ("TTFT s (mean)", f"{ours['ttft_s_mean']:.3f}", "-"),
        ("TPOT s (mean)", f"{ours['tpot_s_mean']:.4f}", "-"),
    ]
    for b, s in ours["decode_step_s"].items():
        frac = result["roofline_fraction"][b]
        rows.append((f"decode step s, batch {b}", f"{s * 1e3:.2f} ms ({frac:.0%} of roofline)", "-"))
    w = max(len(r[0]) for r in rows)
    lines = [f"{'':<{w}}  {'omni_jax':>28}  {'reference':>12}"]
    lines += [f"{a:<{w}}  {b:>28}  {c:>12}" for a, b, c in rows]
    if result["ratio"] is not None:
        lines.append(
            f"ratio (ours / reference tokens/s): {result['ratio']:.2f}x; {result['greedy_agreement']}"
        )
    lines.append(
        f"decode floor (weights / measured {result['ceilings']['memory_bandwidth_GBps']:.1f} GB/s): "
        f"{result['decode_floor_s'] * 1e3:.2f} ms"
    )
    return "\n".join(lines)
