"""What spoken replies said, by their audio's id, until the audio expires.

OpenAI's multi-turn audio sends an earlier spoken reply back as ``{"role": "assistant",
"audio": {"id": ...}}``, without its content: the id stands for what the reply said, and it may
be referred to until the audio's ``expires_at``. The server keeps each spoken reply's transcript
(text, not audio) for that long, and at most :data:`KEPT_TRANSCRIPTS` of them (the oldest are
dropped first), so that such a conversation goes on.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

KEPT_TRANSCRIPTS = 10_000
"""The most transcripts kept at once: a bound on the server's memory whatever the traffic (a
reply's transcript is its text, some kilobytes)."""


@dataclasses.dataclass(frozen=True)
class _Kept:
    transcript: str
    expires_at: int


class Transcripts:
    """Spoken replies' transcripts by audio id. Conversion reads them in a worker thread while
    replies end on the event loop, hence the lock."""

    def __init__(self, limit: int = KEPT_TRANSCRIPTS, clock: Callable[[], float] = time.time):
        self.limit, self.clock = limit, clock
        self._kept: collections.OrderedDict[str, _Kept] = collections.OrderedDict()
        self._lock = threading.Lock()

    def keep(self, audio_id: str, transcript: str, expires_at: int) -> None:
        with self._lock:
            self._kept[audio_id] = _Kept(transcript, expires_at)
            while len(self._kept) > self.limit:
                self._kept.popitem(last=False)

    def said(self, audio_id: str) -> str | None:
        """The transcript of the reply whose audio has this id; ``None`` when no reply's audio
        had it, or it expired (dropped then)."""
        with self._lock:
            kept = self._kept.get(audio_id)
            if kept is not None and kept.expires_at <= self.clock():
                del self._kept[audio_id]
                return None
        return None if kept is None else kept.transcript
