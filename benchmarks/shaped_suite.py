"""Real-width AR suite: a Qwen2.5-7B-shaped Qwen2 with random bfloat16 weights, decode steps against
the memory roofline, prompt steps against the matmul floor, and transformers on the same shapes.

``python -m benchmarks.shaped_suite --json out.json [--layers 28] [--batches 1,8,64,256]
[--prefill 512,2048,8192] [--reference]``

No real checkpoint is needed: the suite writes one with Qwen2.5-7B's widths (``QWEN2_5_7B``;
``--layers`` may shorten the stack) as sharded bfloat16 safetensors with an index, as the hub
ships them, filled from one random block repeated (the values do not change the work), and
loads it through ``OmniJaxPipeline.from_pretrained`` like any checkpoint.

Ours, per batch ``b`` in ``--batches``: ``b`` different prompts of ``--prompt`` tokens, each
asking for exactly ``--max-tokens`` greedy tokens; the first run compiles what the shapes need
(its XLA compilations and seconds are recorded apart), the second is measured. The decode step is
the slowest request's time per token after its first; its floor is the bytes a step must read
(every weight but the gathered input embedding, plus the batch's KV cache at the mean context)
over the memory bandwidth measured here, or its matmul FLOPs over the measured matmul rate,
whichever is larger. Per prompt length in ``--prefill``: one request of that many tokens and one
new token, time to first token against the prompt's matmul FLOPs (weights) and its causal
attention FLOPs over the measured matmul rate.

The reference (``--reference``, a separate process so the two never share device memory):
transformers ``generate`` on the same shapes (its own random initialisation on the same device,
bfloat16, SDPA attention, its default dynamic cache), each batch size run once to warm up and
once measured, the same prompts' lengths and ``min_new_tokens = max_new_tokens``. Greedy
agreement is not checked here (random 7B-wide weights in bfloat16 are near-tie everywhere); the
parity suites hold the numerics.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from omni_jax.cli_errors import plain_text

QWEN2_5_7B = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=151643,
    eos_token_id=151645,
)
"""Qwen2.5-7B-Instruct's text widths (its ``config.json``): Qwen2.5-Omni-7B's thinker decoder."""

SHARD_BYTES = 4 << 30
"""Largest safetensors shard written, as the hub's checkpoints are cut."""


def widths(args: argparse.Namespace) -> dict[str, Any]:
    """Qwen2.5-7B's config with ``--layers`` and ``--config``'s fields over it."""
    return QWEN2_5_7B | {"num_hidden_layers": args.layers} | args.config


def hf_config(args: argparse.Namespace) -> Any:
    from transformers import Qwen2Config

    cfg = Qwen2Config(**widths(args))
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.dtype = "bfloat16"
    return cfg


def write_checkpoint(path: Path, args: argparse.Namespace, seed: int = 0) -> Path:
    """A sharded bfloat16 checkpoint of ``hf_config(args)``'s shapes (names and shapes from
    transformers' own module on the meta device), each tensor a slice of one random block."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2ForCausalLM

    cfg = hf_config(args)
    if (path / "model.safetensors.index.json").exists():
        saved = json.loads((path / "config.json").read_text())
        if any(saved.get(k) != v for k, v in widths(args).items()):
            raise SystemExit(f"{path} holds a checkpoint of other widths: remove it or pick --checkpoint")
        return path
    path.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Qwen2ForCausalLM(cfg).state_dict().items()}
    block = (torch.randn(1 << 22, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, n = 0, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, n
        name = f"model-{n:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard, shard_bytes, n = {}, 0, n + 1

    for name, shape in shapes.items():
        numel = math.prod(shape)
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = block.repeat(-(-numel // block.numel()))[:numel].reshape(shape).clone()
        if shard and shard_bytes + 2 * numel > SHARD_BYTES:
            flush()
        shard[name] = t
        shard_bytes += 2 * numel
    flush()
    index = {
        "metadata": {"total_size": sum(2 * math.prod(s) for s in shapes.values())},
        "weight_map": weight_map,
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    cfg.save_pretrained(path)
    return path


def prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, min(vocab, 150000), size=(n, length)).tolist()


def kv_bytes_per_token(cfg: Any, itemsize: int = 2) -> int:
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * itemsize


def decode_weight_params(cfg: Any) -> int:
    """Parameters one decode step reads: every weight but the (untied) input embedding."""
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    return layers * per_layer + h + h * cfg.vocab_size


def _step_s(outs: list[Any], max_new: int) -> float:
    return max((o.metrics["llm"]["wall_s"] - o.metrics["llm"]["ttft_s"]) / (max_new - 1) for o in outs)


def _dump(result: dict[str, Any], out: Path | None) -> None:
    if out is not None:
        out.write_text(json.dumps(result, indent=1))


@dataclasses.dataclass
class Recorder:
    """Our side's measurements into ``result["ours"]``, the JSON rewritten after each one, so a
    run cut short still reports what it measured."""

    pipe: Any
    cfg: Any
    args: argparse.Namespace
    bandwidth: float
    peak: float
    result: dict[str, Any]
    out: Path | None

    def decode(self, b: int) -> None:
        from omni_jax import SamplingParams
        from omni_jax.engine.compilation import CompileCounter

        args, cfg = self.args, self.cfg
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens)
        batch = [{"prompt_token_ids": p} for p in prompts(cfg.vocab_size, b, args.prompt, seed=b)]
        with CompileCounter() as stats:
            t0 = time.perf_counter()
            self.pipe.run(batch, params, progress=False)
            first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        outs = self.pipe.run(batch, params, progress=False)
        wall = time.perf_counter() - t0
        step = _step_s(outs, args.max_tokens)
        kv = b * (args.prompt + args.max_tokens / 2) * kv_bytes_per_token(cfg)
        weights = decode_weight_params(cfg)
        floor = max((2 * weights + kv) / self.bandwidth, 2 * weights * b / self.peak)
        self.result["ours"]["decode"][str(b)] = {
            "step_s": step,
            "floor_s": floor,
            "roofline_fraction": floor / step,
            "tokens_per_s": b * args.max_tokens / wall,
            "wall_s": wall,
            "first_run_s": first_s,
            "xla_compiles": stats.compiles,
            "xla_compile_s": stats.compile_s,
        }
        _dump(self.result, self.out)
        print(f"ours decode b={b}: step {step * 1e3:.2f} ms, floor {floor * 1e3:.2f} ms", flush=True)

    def prefill(self, n: int) -> None:
        from omni_jax import SamplingParams
        from omni_jax.engine.compilation import CompileCounter

        cfg = self.cfg
        one = SamplingParams(temperature=0.0, max_tokens=1)
        batch = [{"prompt_token_ids": prompts(cfg.vocab_size, 1, n, seed=n)[0]}]
        with CompileCounter() as stats:
            t0 = time.perf_counter()
            self.pipe.run(batch, one, progress=False)
            first_s = time.perf_counter() - t0
        ttft = self.pipe.run(batch, one, progress=False)[0].metrics["llm"]["ttft_s"]
        matmul_s = 2 * decode_weight_params(cfg) * n / self.peak
        attention_s = 2 * n * n * cfg.hidden_size * cfg.num_hidden_layers / self.peak
        self.result["ours"]["prefill"][str(n)] = {
            "ttft_s": ttft,
            "matmul_floor_s": matmul_s,
            "attention_floor_s": attention_s,
            "fraction_of_floor": (matmul_s + attention_s) / ttft,
            "first_run_s": first_s,
            "xla_compiles": stats.compiles,
            "xla_compile_s": stats.compile_s,
        }
        _dump(self.result, self.out)
        floor_ms = (matmul_s + attention_s) * 1e3
        print(f"ours prefill {n}: ttft {ttft * 1e3:.1f} ms, floor {floor_ms:.1f} ms", flush=True)


def ours(path: Path, args: argparse.Namespace, result: dict[str, Any], out: Path | None) -> None:
    """Load the checkpoint into our engine and measure each batch size, then each prompt length."""
    from benchmarks.harness import AttentionProbe, backends, device, environment, versions
    from benchmarks.roofline import matmul_flops, memory_bandwidth
    from omni_jax import OmniJaxPipeline
    from omni_jax.engine.compilation import CompileCounter

    result["environment"] = environment() | {"device": device(), "versions": versions()}
    bw, peak = memory_bandwidth(), matmul_flops(dtype="bfloat16")
    result["ceilings"] = {"memory_bandwidth_GBps": bw / 1e9, "matmul_bf16_TFLOPs": peak / 1e12}
    _dump(result, out)
    batches = [int(b) for b in args.batches.split(",")]
    lengths = [int(n) for n in args.prefill.split(",")] if args.prefill else []
    page = 16
    max_len = -(-(max([args.prompt + args.max_tokens, *(n + 2 for n in lengths)])) // page) * page
    pages = max(batches) * -(-(args.prompt + args.max_tokens) // page) + max_len // page + max(batches)
    t0 = time.perf_counter()
    with CompileCounter() as load_stats:
        pipe = OmniJaxPipeline.from_pretrained(
            path,
            dtype="bfloat16",
            max_num_seqs=max(batches),
            max_model_len=max_len,
            num_pages=pages,
            page_size=page,
            compilation_cache=False,
        )
    result["ours"] = {
        "load_s": time.perf_counter() - t0,
        "load_compiles": load_stats.compiles,
        "max_model_len": max_len,
        "num_pages": pages,
        "decode": {},
        "prefill": {},
    }
    _dump(result, out)
    rec = Recorder(pipe, hf_config(args), args, bw, peak, result, out)
    with AttentionProbe() as probe:
        for b in batches:
            rec.decode(b)
        for n in lengths:
            rec.prefill(n)
    result["ours"]["backends"] = backends(probe)
    _dump(result, out)


def reference(args: argparse.Namespace) -> dict[str, Any]:
    """transformers ``generate`` on the same shapes, per batch size (run in its own process)."""
    import torch
    from transformers import Qwen2ForCausalLM

    cfg = hf_config(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    by_batch: dict[str, Any] = {}
    for b in [int(b) for b in args.batches.split(",")]:
        ids = torch.tensor(prompts(cfg.vocab_size, b, args.prompt, seed=b), device=device)
        times = []
        for _ in range(2):
            sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=args.max_tokens,
                    min_new_tokens=args.max_tokens,
                    pad_token_id=0,
                )
            sync()
            times.append(time.perf_counter() - t0)
        by_batch[str(b)] = {
            "wall_s": times[1],
            "first_run_s": times[0],
            "tokens_per_s": b * args.max_tokens / times[1],
        }
        print(f"transformers b={b}: {b * args.max_tokens / times[1]:.1f} tok/s", flush=True)
    best = max(by_batch, key=lambda b: by_batch[b]["tokens_per_s"])
    return {
        "engine": "transformers generate, bfloat16, sdpa, dynamic cache",
        "device": device,
        "torch": torch.__version__,
        "by_batch": by_batch,
        "best_batch": int(best),
        "tokens_per_s": by_batch[best]["tokens_per_s"],
    }


def _reference_process(argv: list[str]) -> dict[str, Any]:
    """The reference in a child process, run before ours so that neither holds the other's
    device memory; its figures, or its error output when it failed."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.shaped_suite",
            *(a for a in argv if a != "--reference"),
            "--reference-only",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REFERENCE ")]
    if proc.returncode or not lines:
        return {"error": proc.stderr[-4000:], "returncode": proc.returncode}
    return json.loads(lines[-1].removeprefix("REFERENCE "))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.shaped_suite", description=plain_text(__doc__.split("\n\n")[0])
    )
    p.add_argument("--json", type=Path, default=None, help="write the result here (rewritten as it grows)")
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/omni_jax_shaped"), help="where to write it")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument(
        "--config",
        type=json.loads,
        default={},
        help="config fields over Qwen2.5-7B's, as JSON (other widths)",
    )
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--prefill", default="512,2048,8192", help="prompt lengths ('' for none)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens of each decode request")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens of each decode request")
    p.add_argument("--reference", action="store_true", help="also run transformers (own process)")
    p.add_argument("--reference-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2")
    if args.reference_only:
        print("REFERENCE " + json.dumps(reference(args)), flush=True)
        return 0
    result: dict[str, Any] = {
        "suite": "shaped",
        "config": widths(args),
        "prompt": args.prompt,
        "max_tokens": args.max_tokens,
        "ours": None,
        "reference": None,
    }
    t0 = time.perf_counter()
    path = write_checkpoint(args.checkpoint, args)
    result["checkpoint_write_s"] = time.perf_counter() - t0
    _dump(result, args.json)
    if args.reference:
        result["reference"] = _reference_process(argv if argv is not None else sys.argv[1:])
        _dump(result, args.json)
    ours(path, args, result, args.json)
    ref = result["reference"]
    if ref and "by_batch" in ref:
        decode = result["ours"]["decode"]
        result["ratio_by_batch"] = {
            b: decode[b]["tokens_per_s"] / r["tokens_per_s"]
            for b, r in ref["by_batch"].items()
            if b in decode
        }
        result["ratio_vs_best_reference"] = {
            b: d["tokens_per_s"] / ref["tokens_per_s"] for b, d in decode.items()
        }
    _dump(result, args.json)
    print(json.dumps({k: result[k] for k in ("ceilings", "ours", "reference") if k in result}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
