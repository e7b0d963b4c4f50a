"""Stop strings, cut out of a reply as its text arrives.

The stages stop on token ids; vLLM's and OpenAI's ``stop`` are strings, which a reply can
complete across token boundaries. So the engine core watches the text: each delta is passed on
except a tail that could still become a stop string, and at the first stop string the text is
cut there (the stop string itself left out, as vLLM and OpenAI do, unless asked to keep it) and
the request ends. As in vLLM, a stop string counts only where it ends in text that is checked:
the text of a reply's first ``min_tokens`` tokens is not (a stop string may start in it, and end
after it).
"""

from __future__ import annotations

from collections.abc import Sequence

FEW = 8
"""Stop strings of one length ending in one character that are compared one by one (``startswith``
of a tuple: a mismatch is found at their first or last character, mostly); more are a set, which
the text of that length is looked up in (hashing it: a cost of its length)."""


class StopText:
    """``feed`` each text delta, get what may be sent; ``hit`` once a stop string appeared;
    ``flush`` at the end for the held tail. ``kept`` is everything sent so far: the reply's text
    once a stop string cut it. ``include``: the stop string that cut the reply ends it.

    Every stop string found ends in the delta just fed: the held tail was searched when it came
    (or was not to be, fed with ``check=False``), and holds no whole stop string that counts.

    So a delta is searched by where a stop string could end in it, never stop string by stop
    string: the stop strings are grouped by their last character and length, and at each
    character of the delta only the text of those lengths that ends there is looked up in the
    group of that character and length (:data:`FEW` or fewer compared, more a set).
    A step costs its delta's length times the distinct lengths of the stop strings ending in
    one character (at most the square root of twice their total length, which
    :data:`~omni_jax.engine.sampling.MAX_STOP_CHARS` bounds), whatever their number: searched one
    by one, a request with many stop strings slowed every request in its batch."""

    def __init__(self, stops: Sequence[str], include: bool = False):
        self.stops = tuple(stops)
        if not all(self.stops):
            raise ValueError("stop strings must not be empty")
        self.include = include
        self.hit = False
        self.kept = ""
        self._held = ""
        self._keep = max((len(s) for s in self.stops), default=1) - 1
        ending: dict[str, dict[int, set[str]]] = {}
        for s in self.stops:
            ending.setdefault(s[-1], {}).setdefault(len(s), set()).add(s)
        self._ending = {
            last: [(n, tuple(g) if len(g) <= FEW else frozenset(g)) for n, g in sorted(by_length.items())]
            for last, by_length in ending.items()
        }  # shortest first

    def feed(self, delta: str, check: bool = True) -> str:
        """What of ``delta`` may be sent now. ``check=False``: ``delta`` is text in which no stop
        string may end (the reply is still under ``min_tokens``); it is passed on all the same,
        but for a tail a stop string ending in a later delta could start in."""
        if self.hit:
            return ""
        text = self._held + delta
        found = self._first(text, len(self._held)) if check else None
        if found is not None:
            at, length = found
            self.hit, self._held = True, ""
            return self._sent(text[: at + length] if self.include else text[:at])
        split = max(0, len(text) - self._keep)
        self._held = text[split:]
        return self._sent(text[:split])

    def _first(self, text: str, after: int) -> tuple[int, int] | None:
        """``(start, length)`` of the stop string in ``text`` that ends past ``after`` (in the
        delta), the earliest to start and, of those, the shortest; ``None`` if none does."""
        best: tuple[int, int] | None = None
        for end in range(after + 1, len(text) + 1):
            for length, stops in self._ending.get(text[end - 1], ()):
                if length > end:
                    break
                start = end - length
                if best is not None and (start, length) >= best:
                    continue
                if text.startswith(stops, start) if type(stops) is tuple else text[start:end] in stops:
                    best = (start, length)
        return best

    def flush(self) -> str:
        held, self._held = self._held, ""
        return self._sent(held)

    def _sent(self, text: str) -> str:
        self.kept += text
        return text
