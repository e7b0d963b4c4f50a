"""``python -m benchmarks.moe_lowering``: Qwen3-Omni's sparse MoE block, ours against transformers', per
formulation of the experts and lowering of ``jax.lax.ragged_dot``.

Our block (:class:`omni_jax.models.moe.SparseMoeBlock`) runs each projection as one grouped
matmul, ``ragged_dot`` (``grouped``), whose speed is the backend's lowering, as every expert on
every row (``dense``, ``E / k`` times the routed FLOPs in plain matmuls), one (row, expert)
pair at a time, reading only the chosen experts (``assigned``), or with the chosen experts
gathered first (``gathered``, a fixed number of operations); ``OMNI_JAX_MOE`` picks, else
:func:`omni_jax.models.moe.expert_path` (grouped on TPUs; on CPUs assigned where a step routes
fewer pairs than the experts, on GPUs gathered up to an eighth as many, dense otherwise). On a
GPU, XLA's default lowering of ``ragged_dot`` is a masked dense product over every expert for
every routed row (``E`` times the routed FLOPs), while
``jax_ragged_dot_use_gpu_pallas_triton_lowering`` would make it a grouped GEMM (a lowering this
jax cannot build is reported as such in its row: jax 0.11.2's wheel lacks
the module). This measures the five (grouped with either lowering, dense, assigned, gathered), at the
released thinker's widths by default (hidden 2048, experts of width 768, 128 experts, top 8),
for several token counts (a decode step's rows up to a prefill chunk's), and transformers' block
on the same weights with each of its experts implementations it can run here (``eager``: a loop
over the hit experts; ``grouped_mm`` / ``batched_mm``), taking its fastest. Per token count it
prints milliseconds per call (best of ``--repeats`` after a warm-up call, compile apart), the
routed work's TFLOP/s (``6 * N * k * D * I``), the ratio to transformers' fastest, and the
largest difference of each of our outputs from transformers' (float32 by default, so the
lowerings must agree to rounding). ``--json`` writes the table. On CPU, the released widths
(2.4 GB of float32 experts) take decode-sized token counts (``--tokens 1,2,4,8,16``); larger
ones, small widths (``--experts 16 --hidden 256 --inner 128``).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from benchmarks.harness import torch_device, torch_synchronize, wall_times, write_json
from omni_jax.cli_errors import plain_text
from omni_jax.jit import compute_dtype, exact_matmuls
from omni_jax.models.loading import build_model, torch_state_items
from omni_jax.models.moe import EXPERT_RULES, MOE_SWITCH, MoESpec, SparseMoeBlock, stack_expert_arrays

LOWERINGS = {
    "grouped": ("grouped", False),
    "grouped_pallas_triton": ("grouped", True),
    "dense": ("dense", False),
    "assigned": ("assigned", False),
    "gathered": ("gathered", False),
}
"""Ours: the experts' formulation (``OMNI_JAX_MOE``) and the value of
``jax_ragged_dot_use_gpu_pallas_triton_lowering``, both read at trace time."""


def best_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Best wall time of ``fn`` (which returns when its work is done) over ``repeats`` calls."""
    return 1e3 * min(wall_times(fn, repeats))


def reference_block(args: argparse.Namespace) -> torch.nn.Module:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerTextSparseMoeBlock,
    )

    cfg = Qwen3OmniMoeTextConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.inner,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
    )
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    block = Qwen3OmniMoeThinkerTextSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    return block


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch_device()
    ref = reference_block(args)
    spec = MoESpec(args.hidden, args.inner, args.experts, args.top_k, norm_topk_prob=True)
    ours = build_model(
        lambda: SparseMoeBlock(spec, rngs=nnx.Rngs(0)),
        stack_expert_arrays(torch_state_items(ref)),
        EXPERT_RULES,
    )
    graph, state = nnx.split(ours)

    def exactly(s: nnx.State, v: jax.Array) -> jax.Array:
        """Our block as the engine traces it: float32 products at full precision (not TF32)."""
        with exact_matmuls(compute_dtype(s)):
            return nnx.merge(graph, s)(v)

    ref = ref.to(device)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products on both sides
    rows: list[dict[str, Any]] = []
    for n in args.tokens:
        x = np.random.default_rng(n).standard_normal((n, args.hidden), dtype=np.float32)
        tx = torch.from_numpy(x).to(device)
        want, best_ref, impl = None, float("inf"), ""
        for name in ("eager", "grouped_mm", "batched_mm"):
            ref.experts.config._experts_implementation = name
            try:
                with torch.no_grad():
                    out = ref(tx[None])[0]
            except (RuntimeError, NotImplementedError, ValueError) as e:
                print(f"transformers {name}: cannot run here ({type(e).__name__}: {str(e)[:80]})")
                continue
            if want is None:
                want = out.float().cpu().numpy()

            def ref_call(tx: torch.Tensor = tx) -> None:
                with torch.no_grad():
                    ref(tx[None])
                torch_synchronize(device)

            ms = best_ms(ref_call, args.repeats)
            if ms < best_ref:
                best_ref, impl = ms, name
        flops = 6 * n * args.top_k * args.hidden * args.inner
        row: dict[str, Any] = {"tokens": n, "transformers_ms": best_ref, "transformers_impl": impl}
        for lowering, (path, flag) in LOWERINGS.items():
            os.environ[MOE_SWITCH] = path
            jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", flag)
            # A new function for each: jit keeps one trace per function, and both settings are
            # read only when it traces (a second jax.jit(exactly) would run the first's program).
            fn = jax.jit(lambda s, v: exactly(s, v))
            xs = jnp.asarray(x)
            start = time.perf_counter()
            try:
                out = np.asarray(jax.block_until_ready(fn(state, xs)))
            except (ModuleNotFoundError, NotImplementedError, RuntimeError) as e:
                # A lowering this jax cannot build here (jax 0.11.2 lacks the Pallas Triton one).
                row[lowering] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                continue
            compile_s = time.perf_counter() - start
            ms = best_ms(lambda fn=fn, xs=xs: jax.block_until_ready(fn(state, xs)), args.repeats)
            row[lowering] = {
                "ms": ms,
                "compile_s": compile_s,
                "routed_tflops": flops / ms / 1e9,
                "vs_transformers": best_ref / ms,
                "max_abs_diff": float(np.abs(out - want).max()) if want is not None else None,
            }
        jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", False)
        os.environ.pop(MOE_SWITCH)
        rows.append(row)
        print(table_row(row))
    return {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "widths": {"hidden": args.hidden, "inner": args.inner, "experts": args.experts, "top_k": args.top_k},
        "rows": rows,
    }


def table_row(row: dict[str, Any]) -> str:
    ours = "  ".join(
        f"{k}: cannot run here ({r['error']})"
        if "error" in r
        else f"{k}: {r['ms']:8.3f} ms {r['routed_tflops']:7.2f} TFLOP/s x{r['vs_transformers']:.2f} "
        f"(diff {r['max_abs_diff']:.1e}, compile {r['compile_s']:.1f} s)"
        for k, r in ((k, row[k]) for k in LOWERINGS)
    )
    ref = f"transformers {row['transformers_impl']}: {row['transformers_ms']:8.3f} ms"
    return f"N={row['tokens']:5d}  {ref}  {ours}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.moe_lowering", description=plain_text(__doc__.split("\n\n")[0])
    )
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inner", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument(
        "--tokens", type=lambda s: [int(t) for t in s.split(",")], default=[1, 16, 128, 1024, 4096]
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    write_json(args.json, run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
