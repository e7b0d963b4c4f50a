"""Stop strings, cut out of a reply as its text streams.

The engine stops on token ids; OpenAI's ``stop`` are strings, which a reply can complete across
token boundaries. So the server watches the text: each delta is passed on except a tail that could
still become a stop string, and at the first stop string the text is cut there (the stop string
itself is not returned, as OpenAI does) and the request is ended.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopText:
    """``feed`` each text delta, get what may be sent; ``hit`` once a stop string appeared;
    ``flush`` at the end for the held tail."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.hit = False
        self._held = ""
        self._keep = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, delta: str) -> str:
        if self.hit:
            return ""
        text = self._held + delta
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit, self._held = True, ""
            return text[: min(found)]
        split = max(0, len(text) - self._keep)
        self._held = text[split:]
        return text[:split]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
