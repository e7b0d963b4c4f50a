"""``--verify``: the converted model's logits against transformers' on a fixed prompt."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from omni_jax.engine.forward import full_forward
from omni_jax.weights import load_hf_config, load_part, read_manifest


def verify(src: str | Path, dst: str | Path, num_tokens: int = 16) -> str:
    """Max relative logit error of ``dst`` (float32) vs ``src`` in transformers; raises if large."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise ValueError("--verify needs torch (pip install 'omni-jax[torch]')") from e
    cfg = load_hf_config(src)
    if "Qwen2ForCausalLM" not in (cfg.architectures or []):
        raise ValueError(f"--verify supports Qwen2ForCausalLM checkpoints, not {cfg.architectures}")
    ids = list(np.random.RandomState(0).randint(0, cfg.vocab_size, size=num_tokens))
    model, _ = load_part(dst, "llm", dtype="float32")
    ours, _ = full_forward(model, ids)
    ref_model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float().numpy()
    err = float(np.abs(ours - ref).max() / np.abs(ref).max())
    # bfloat16 weights round each parameter to 8 bits of mantissa: logits move by ~1e-2.
    limit = 1e-4 if read_manifest(dst)["dtype"] == "float32" else 5e-2
    if err > limit:
        raise ValueError(f"verify failed: max relative logit error {err:.2e} > {limit:.0e}")
    return f"verify: max relative logit error {err:.2e} over {num_tokens} tokens"
