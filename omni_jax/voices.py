"""What every speaking model's voice lookup raises for a name it does not have."""

from __future__ import annotations


class UnknownSpeakerError(ValueError):
    """A prompt names a voice the checkpoint does not have; the message names the request, the
    voice and the known ones. Its own type so that a caller can say which of its fields was wrong
    (the server's 400 names ``audio.voice``)."""
