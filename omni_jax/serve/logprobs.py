"""Log-probabilities in OpenAI's response forms, from the pipeline's (vLLM's) form.

The pipeline gives, per output token, ``{token id: log-probability}``: the sampled token first,
then the ``SamplingParams.logprobs`` most likely ones (:class:`~omni_jax.OmniRequestOutput`).
Chat completions show them as ``logprobs.content``: per token its text, log-probability, bytes
and ``top_logprobs`` (the most likely first); completions as the legacy lists ``tokens``,
``token_logprobs``, ``top_logprobs`` (text -> log-probability: the sampled token first, then
the most likely, as vLLM lists them and as OpenAI's legacy API promises "up to logprobs + 1"
of them; with ``logprobs: 0`` the sampled token alone) and ``text_offset``.

A token's ``bytes`` are the token's own, so that, as OpenAI means them, a reply's tokens' bytes
joined are its text's UTF-8 even where a character spans tokens (for byte-level BPE
vocabularies, Qwen's: the bytes each vocabulary character stands for; for other tokenizers the
UTF-8 of the token's text). Its text is the tokenizer's decoding of it alone (special tokens
included), except for a token that holds part of a character: that reads as OpenAI writes one,
``bytes:`` and its bytes escaped (``bytes:\\xe2\\x80``). vLLM reads each as U+FFFD, so that
all of them at a step share one key of a completion's ``top_logprobs``, and the sampled one's
value can be lost. A completion's ``text_offset`` is where each token's text starts in the
text its tokens' bytes spell (a token inside a character: where that character starts).

Every generated token is listed, as vLLM lists them: the stop token and the tokens a ``stop``
string cut off follow the reply's own, so their bytes (and a completion's ``text_offset``) run
past its text. Without a tokenizer a token reads ``token_id:<id>``, vLLM's
``return_tokens_as_token_ids`` form.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclasses.dataclass(frozen=True)
class TokenReader:
    """How a token id reads in a response: its text, and its bytes."""

    text: Callable[[int], str]
    raw: Callable[[int], bytes]


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the character a byte-level vocabulary writes
    for each byte -> the byte. Printable Latin-1 bytes stand for themselves; the other 68
    (controls, space, DEL, NBSP, soft hyphen) for ``chr(256 + n)``, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)}
    table = {chr(b): b for b in printable}
    others = (b for b in range(256) if b not in printable)
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def token_reader(tokenizer: PreTrainedTokenizerBase | None) -> TokenReader:
    """How token ids read with ``tokenizer`` (``None``: ``token_id:<id>``)."""
    if tokenizer is None:
        return TokenReader(lambda i: f"token_id:{i}", lambda i: f"token_id:{i}".encode())

    from tokenizers.decoders import ByteLevel

    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    byte_level = isinstance(decoder, ByteLevel)
    alphabet = byte_level_alphabet()
    added = frozenset(tokenizer.added_tokens_decoder)  # a property that builds its dict anew

    def decoded(token_id: int) -> str:
        return tokenizer.decode([token_id])

    def raw(token_id: int) -> bytes:
        """Added tokens (the chat specials) are written as text, not in the byte alphabet."""
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if (
            byte_level
            and token_id not in added
            and isinstance(piece, str)
            and all(c in alphabet for c in piece)
        ):
            return bytes(alphabet[c] for c in piece)
        return decoded(token_id).encode("utf-8")

    def text(token_id: int) -> str:
        s = decoded(token_id)
        if "\ufffd" not in s:
            return s
        own = raw(token_id)
        try:
            return own.decode("utf-8")  # a token of U+FFFD itself
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in own)

    return TokenReader(text, raw)


def _top(entry: dict[int, float], top: int) -> list[tuple[int, float]]:
    """The ``top`` most likely tokens of one entry, the most likely first (the entry holds the
    sampled token too, which is among them only when it ranks there)."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:top]


def chat(entries: Sequence[dict[int, float]], top: int, tokens: TokenReader) -> dict[str, Any]:
    """A chat choice's ``logprobs``: ``{"content": [...], "refusal": None}``."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": tokens.text(token_id), "logprob": logprob, "bytes": list(tokens.raw(token_id))}

    content = []
    for entry in entries:
        sampled, logprob = next(iter(entry.items()))
        content.append({**item(sampled, logprob), "top_logprobs": [item(t, v) for t, v in _top(entry, top)]})
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """A completion's ``logprobs`` lists, piece by piece: ``text_offset`` counts on from the
    pieces before (a stream's chunks continue one text)."""

    def __init__(self, top: int, tokens: TokenReader):
        self.top, self.tokens = top, tokens
        self.spelled = codecs.getincrementaldecoder("utf-8")(errors="replace")
        """Reads the tokens' bytes as they are listed; a character not yet whole waits in it."""
        self.offset = 0

    def json(self, entries: Sequence[dict[int, float]]) -> dict[str, Any]:
        tokens, logprobs, tops, offsets = [], [], [], []
        for entry in entries:
            sampled, logprob = next(iter(entry.items()))
            tokens.append(self.tokens.text(sampled))
            logprobs.append(logprob)
            tops.append({self.tokens.text(t): v for t, v in [(sampled, logprob), *_top(entry, self.top)]})
            offsets.append(self.offset)
            self.offset += len(self.spelled.decode(self.tokens.raw(sampled)))
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
