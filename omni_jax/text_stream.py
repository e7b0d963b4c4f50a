"""A request's reply text as its tokens arrive, a few tokens decoded at a time.

Decoding the whole reply at every step would cost a request time quadratic in its length, so
each step decodes a short window: the tokens since the previous emission and the ones just
before them (vLLM's incremental detokenization). A piece of text is emitted once it no longer
ends in an incomplete character (U+FFFD, a byte-level token holding part of one). The reply
decoded whole at the end (what ``run`` returns as ``text``) settles the last piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"
"""What decoding gives for bytes that do not (yet) form a character."""


class TextStream:
    """``update`` with the reply's token ids so far after each step, get the text the new ones
    complete; ``finish`` with the whole reply's text for the rest."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.sent = ""
        self._prefix = 0  # the window's first token: context for the tokens after _read
        self._read = 0  # tokens before it have been emitted as text

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def update(self, ids: Sequence[int]) -> str:
        """The text completed by the tokens of ``ids`` (the reply so far) past the previous
        call's; ``""`` while it is incomplete."""
        before = self._decode(ids[self._prefix : self._read])
        text = self._decode(ids[self._prefix :])
        if len(text) <= len(before) or text.endswith(REPLACEMENT):
            return ""
        delta = text[len(before) :]
        self._prefix, self._read = self._read, len(ids)
        self.sent += delta
        return delta

    def finish(self, text: str) -> str:
        """What ``text``, the whole reply decoded at once, holds beyond what was sent: pieces held
        back as incomplete. Empty when the windows decoded it differently (they never do for
        byte-level BPE tokenizers such as Qwen's, which decode byte for byte)."""
        return text[len(self.sent) :] if text.startswith(self.sent) else ""
