"""Random AR workloads and the per-request checks they imply: the reliability load test and the
soak suite draw the same kind of traffic and hold it to the same rules.

A workload is prompts of random lengths with random sampling params: greedy, seeded and
unseeded sampling (temperature, top-k/p, min-p), ``max_tokens``, ``min_tokens``, stop ids and
``ignore_eos``. It avoids logprobs, penalties and long stop-id lists only because each would
add another set of step programs to compile (their semantics are tested in ``test_sampling``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from omni_jax import SamplingParams


def random_workload(
    n: int, vocab: int, seed: int, max_prompt: int = 48, max_new: int = 24
) -> tuple[list[list[int]], list[SamplingParams]]:
    """``n`` prompts of 1..``max_prompt`` tokens and their params (``max_tokens`` up to
    ``max_new``, or unset for one request in 20: then only the model length stops it)."""
    rs = np.random.RandomState(seed)
    prompts, params = [], []
    for _ in range(n):
        prompts.append([int(t) for t in rs.randint(0, vocab, rs.randint(1, max_prompt + 1))])
        kind = rs.choice(["greedy", "seeded", "unseeded"], p=[0.4, 0.45, 0.15])
        max_tokens = None if rs.rand() < 0.05 else int(rs.randint(1, max_new + 1))
        p = SamplingParams(
            temperature=0.0 if kind == "greedy" else float(rs.uniform(0.5, 1.5)),
            top_k=int(rs.choice([-1, 5, 50])),
            top_p=float(rs.choice([1.0, 0.9])),
            min_p=float(rs.choice([0.0, 0.05])),
            seed=int(rs.randint(2**31)) if kind == "seeded" else None,
            max_tokens=max_tokens,
            min_tokens=int(rs.randint(0, (max_tokens or max_new) + 1)) if rs.rand() < 0.3 else 0,
            # at most 3 stop ids: with EOS, every suppress list fits one bucket (one set of programs)
            stop_token_ids=[int(t) for t in rs.randint(0, vocab, rs.randint(0, 4))] or None,
            ignore_eos=bool(rs.rand() < 0.3),
        )
        params.append(p)
    return prompts, params


def count_problem(
    prompt: list[int], params: SamplingParams, out: Any, eos: int, max_model_len: int
) -> str | None:
    """What is wrong with ``out``'s token count and finish reason given ``params`` (whatever the
    tokens), or None: the first stop id ends a request (none before ``min_tokens``), else the
    tighter of ``max_tokens`` and the model length does."""
    stops = set(params.stop_token_ids or []) | (set() if params.ignore_eos else {eos})
    toks = out.token_ids
    limit = max_model_len - len(prompt)
    if params.max_tokens is not None:
        limit = min(limit, params.max_tokens)
    if out.error is not None:
        return f"error: {out.error}"
    if not 1 <= len(toks) <= limit:
        return f"{len(toks)} tokens, expected 1..{limit}"
    if stops & set(toks[:-1]):
        return "a stop id before the last token"
    if out.finish_reason == "stop":
        if toks[-1] not in stops or len(toks) <= params.min_tokens:
            return f"finish 'stop' on {toks[-1]} after {len(toks)} tokens (min_tokens {params.min_tokens})"
    elif (out.finish_reason, len(toks)) != ("length", limit) or toks[-1] in stops:
        return f"finish {out.finish_reason!r} after {len(toks)} tokens, limit {limit}"
    return None
