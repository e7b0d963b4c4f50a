"""Stop strings, cut out of a reply as its text arrives.

The stages stop on token ids; vLLM's and OpenAI's ``stop`` are strings, which a reply can
complete across token boundaries. So the engine core watches the text: each delta is passed on
except a tail that could still become a stop string, and at the first stop string the text is
cut there (the stop string itself left out, as vLLM and OpenAI do, unless asked to keep it) and
the request ends.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopText:
    """``feed`` each text delta, get what may be sent; ``hit`` once a stop string appeared;
    ``flush`` at the end for the held tail. ``kept`` is everything sent so far: the reply's text
    once a stop string cut it. ``include``: the stop string that cut the reply ends it."""

    def __init__(self, stops: Sequence[str], include: bool = False):
        self.stops = tuple(stops)
        self.include = include
        self.hit = False
        self.kept = ""
        self._held = ""
        self._keep = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, delta: str) -> str:
        if self.hit:
            return ""
        text = self._held + delta
        found = [(i, s) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0]
        if found:
            at, stop = min(found, key=lambda f: (f[0], len(f[1])))  # the earliest; of those the shortest
            self.hit, self._held = True, ""
            return self._sent(text[: at + len(stop)] if self.include else text[:at])
        split = max(0, len(text) - self._keep)
        self._held = text[split:]
        return self._sent(text[:split])

    def flush(self) -> str:
        held, self._held = self._held, ""
        return self._sent(held)

    def _sent(self, text: str) -> str:
        self.kept += text
        return text
