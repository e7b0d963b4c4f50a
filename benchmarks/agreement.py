"""Greedy agreement with the reference, up to checked near-ties.

Our engine and transformers compute the same float math in different orders, so their logits
differ by rounding (:data:`LOGIT_RTOL`), and where the reference's greedy choice won by less than
that, either side may pick the other candidate. Every suite compares our greedy tokens with the
reference's request by request; at the first position where they differ it looks at the
reference's own scores there (what ``generate`` chose from: logits after its processors) and
accepts the difference only as a near-tie: our token's score within :func:`near_tie_bound` of
the reference's token's. Anything else is a disagreement and the suite fails. Equal means equal
to the last token: one side stopping where the other went on is a difference at the position
where it stopped (the same caps on both sides leave no other reason for it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

LOGIT_RTOL = {"float32": 1e-5, "bfloat16": 16 * 2**-8}
"""The most our logits may differ from transformers' on the same prefix, relative to the largest
logit magnitude. float32: the parity tests' bound (``tests/test_qwen2_parity.py``: same math,
rounding only). bfloat16: 16 units of bf16's roundoff (2**-8): both sides round every activation
to bf16, at different places, and 16 units is the scale of transformers' own bf16 logits' distance
from float32 arithmetic on the same weights (``tests/test_bf16_parity.py`` holds ours to it;
figures in ``benchmarks/RESULTS.md``)."""


def near_tie_bound(dtype: str | None) -> float:
    """The largest score gap, relative to the largest score magnitude, that rounding can flip:
    each of the two candidates may move by :data:`LOGIT_RTOL`, in opposite directions."""
    return 2 * LOGIT_RTOL[dtype or "float32"]


ScoresAt = Callable[[int, int], np.ndarray]
"""``scores_at(request, position)``: the reference's processed scores ``[vocab]`` from which it
chose its token at ``position`` of ``request``'s output (suppressed ids ``-inf``)."""


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first position where our tokens and the reference's differ.

    ``ours`` / ``reference``: each side's token there (None: that side had stopped). ``gap``: the
    reference's score of its token minus its score of ours, over its largest finite score
    magnitude (None when a side had stopped, ``inf`` when ours was suppressed there).
    """

    request: int
    position: int
    ours: int | None
    reference: int | None
    gap: float | None
    near_tie: bool


@dataclasses.dataclass
class Agreement:
    """Our greedy tokens against the reference's, request by request."""

    requests: int
    identical: int
    bound: float
    near_ties: list[Divergence]
    disagreements: list[Divergence]

    def summary(self) -> str:
        text = f"{self.identical}/{self.requests} identical"
        if self.near_ties:
            text += f", {len(self.near_ties)} near-ties (gap <= {self.bound:.1e})"
        if self.disagreements:
            text += f", {len(self.disagreements)} DISAGREE"
        return text

    def failures(self, what: str) -> list[str]:
        """One line per disagreement, for the suite's ``failures``."""
        return [
            f"{what}: request {d.request} differs at token {d.position} (ours {d.ours}, reference "
            f"{d.reference}, score gap {d.gap if d.gap is None else f'{d.gap:.2e}'}), not a near-tie "
            f"(bound {self.bound:.1e})"
            for d in self.disagreements
        ]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"summary": self.summary()}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ, counting the end of the shorter one; None
    when they are equal."""
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def score_gap(scores: np.ndarray, reference: int, ours: int) -> float:
    """``scores[reference] - scores[ours]`` over the largest finite ``|scores|``."""
    s = np.asarray(scores, np.float64)
    if not np.isfinite(s[ours]):
        return float("inf")
    finite = np.abs(s[np.isfinite(s)])
    return float((s[reference] - s[ours]) / max(finite.max(), np.finfo(np.float64).tiny))


def compare(
    ours: Sequence[Sequence[int]],
    reference: Sequence[Sequence[int]],
    scores_at: ScoresAt,
    bound: float,
    requests: Sequence[int] | None = None,
) -> Agreement:
    """Our tokens against the reference's for ``requests`` (indices into both; default all).

    ``scores_at`` is called only at a first difference where both sides have a token.
    """
    indices = list(range(len(ours))) if requests is None else list(requests)
    identical, ties, disagree = 0, [], []
    for i in indices:
        k = first_difference(ours[i], reference[i])
        if k is None:
            identical += 1
            continue
        mine = ours[i][k] if k < len(ours[i]) else None
        theirs = reference[i][k] if k < len(reference[i]) else None
        gap = None if mine is None or theirs is None else score_gap(scores_at(i, k), theirs, mine)
        near = gap is not None and abs(gap) <= bound
        (ties if near else disagree).append(Divergence(i, k, mine, theirs, gap, near))
    return Agreement(len(indices), identical, bound, ties, disagree)


def causal_lm_scores(
    model: Any, prompt: Sequence[int], prefix: Sequence[int], suppress: Collection[int]
) -> np.ndarray:
    """A transformers causal LM's scores for the token after ``prompt + prefix``, alone and
    unpadded, with the ids ``generate`` suppressed there (EOS and stop ids under ``min_new_tokens``)
    at ``-inf``: the scores its greedy step chose from, up to the rounding its batch adds."""
    import torch

    ids = torch.tensor([[*prompt, *prefix]])
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, -1]
    scores = logits.double().numpy().copy()
    scores[list(suppress)] = -np.inf
    return scores
