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


class StopText:
    """``feed`` each text delta, get what may be sent; ``hit`` once a stop string appeared;
    ``flush`` at the end for the held tail. ``kept`` is everything sent so far: the reply's text
    once a stop string cut it. ``include``: the stop string that cut the reply ends it.

    Every stop string found ends in the delta just fed: the held tail was searched when it came
    (or was not to be, fed with ``check=False``), and holds no whole stop string that counts."""

    def __init__(self, stops: Sequence[str], include: bool = False):
        self.stops = tuple(stops)
        self.include = include
        self.hit = False
        self.kept = ""
        self._held = ""
        self._keep = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, delta: str, check: bool = True) -> str:
        """What of ``delta`` may be sent now. ``check=False``: ``delta`` is text in which no stop
        string may end (the reply is still under ``min_tokens``); it is passed on all the same,
        but for a tail a stop string ending in a later delta could start in."""
        if self.hit:
            return ""
        text = self._held + delta
        after = len(self._held)  # a stop string must end past the held tail: in delta
        starts = ((text.find(s, max(0, after - len(s) + 1)), s) for s in self.stops) if check else ()
        found = [(i, s) for i, s in starts if i >= 0]
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
