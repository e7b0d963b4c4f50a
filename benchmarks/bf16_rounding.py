"""How far bfloat16 logits move, in units of bf16's roundoff ``u = 2**-8`` of the largest logit:
ours (a bf16-converted checkpoint) against transformers in bf16 on the same weights, and each
against float32 arithmetic on those weights (transformers in float32 with every weight rounded to
bf16). The scale that ``benchmarks.agreement.LOGIT_RTOL["bfloat16"]`` and
``tests/test_bf16_parity.py`` hold ours to.

``python -m benchmarks.bf16_rounding [--model tiny|PATH] [--prompts 12] [--cache-dir DIR]``
(a Qwen2 checkpoint; ``tiny`` is the benchmarks' locally built one).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from omni_jax.cli_errors import plain_text

U = 2.0**-8


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bf16_rounding", description=plain_text(__doc__.split("\n\n")[0])
    )
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "omni_jax" / "bench"))
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.models import resolve_model
    from omni_jax.full_forward import full_forward
    from omni_jax.weights import convert, load_part

    src = resolve_model(args.model, Path(args.cache_dir), "qwen2")
    with tempfile.TemporaryDirectory() as tmp:
        ours_model, _ = load_part(convert(src, Path(tmp) / "bf16", dtype="bfloat16", progress=False), "llm")
    hf16 = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).eval()
    exact = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.no_grad():
        for w in exact.parameters():
            w.copy_(w.to(torch.bfloat16).float())
    rs = np.random.RandomState(0)
    header = ("tokens", "ours - transformers", "ours - exact", "transformers - exact")
    print(f"{header[0]:>6}  {header[1]:>20}  {header[2]:>13}  {header[3]:>21}  (units of u)")
    worst = np.zeros(3)
    for _ in range(args.prompts):
        ids = rs.randint(0, hf16.config.vocab_size, size=int(rs.randint(4, 200))).tolist()
        ours, _ = full_forward(ours_model, ids, page_size=8)
        with torch.no_grad():
            ref = hf16(torch.tensor([ids])).logits[0].float().numpy()
            ex = exact(torch.tensor([ids])).logits[0].numpy()
        errs = np.array([rel_err(ours, ref), rel_err(ours, ex), rel_err(ref, ex)]) / U
        worst = np.maximum(worst, errs)
        print(f"{len(ids):>6}  {errs[0]:>20.2f}  {errs[1]:>13.2f}  {errs[2]:>21.2f}")
    print(f"{'worst':>6}  {worst[0]:>20.2f}  {worst[1]:>13.2f}  {worst[2]:>21.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
