"""Log-probabilities in OpenAI's response forms, from the pipeline's (vLLM's) form.

The pipeline gives, per output token, ``{token id: log-probability}``: the sampled token first,
then the ``SamplingParams.logprobs`` most likely ones (:class:`~omni_jax.OmniRequestOutput`).
Chat completions show them as ``logprobs.content``: per token its text, log-probability, UTF-8
bytes and ``top_logprobs`` (the most likely first); completions as the legacy lists ``tokens``,
``token_logprobs``, ``top_logprobs`` (text -> log-probability) and ``text_offset``. A token's text
is the tokenizer's decoding of it alone (special tokens included), so a token that holds part of
a character reads as U+FFFD, as in vLLM; without a tokenizer it is ``token_id:<id>``, vLLM's
``return_tokens_as_token_ids`` form.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TokenText = Callable[[int], str]


def token_text(tokenizer: PreTrainedTokenizerBase | None) -> TokenText:
    """How a token id reads in a response."""
    if tokenizer is None:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id])


def _top(entry: dict[int, float], top: int) -> list[tuple[int, float]]:
    """The ``top`` most likely tokens of one entry, the most likely first (the entry holds the
    sampled token too, which is among them only when it ranks there)."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:top]


def chat(entries: Sequence[dict[int, float]], top: int, text: TokenText) -> dict[str, Any]:
    """A chat choice's ``logprobs``: ``{"content": [...], "refusal": None}``."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        s = text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    content = []
    for entry in entries:
        sampled, logprob = next(iter(entry.items()))
        content.append({**item(sampled, logprob), "top_logprobs": [item(t, v) for t, v in _top(entry, top)]})
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """A completion's ``logprobs`` lists, piece by piece: ``text_offset`` counts on from the
    pieces before (a stream's chunks continue one text)."""

    def __init__(self, top: int, text: TokenText):
        self.top, self.text = top, text
        self.offset = 0

    def json(self, entries: Sequence[dict[int, float]]) -> dict[str, Any]:
        tokens, logprobs, tops, offsets = [], [], [], []
        for entry in entries:
            sampled, logprob = next(iter(entry.items()))
            s = self.text(sampled)
            tokens.append(s)
            logprobs.append(logprob)
            tops.append({self.text(t): v for t, v in _top(entry, self.top)})
            offsets.append(self.offset)
            self.offset += len(s)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
