"""How every speaking model finds the voice a prompt names, and what it raises for a name it
does not have."""

from __future__ import annotations

from collections.abc import Collection


class UnknownSpeakerError(ValueError):
    """A prompt names a voice the checkpoint does not have; the message names the request, the
    voice and the known ones. Its own type so that a caller can say which of its fields was wrong
    (the server's 400 names ``audio.voice``)."""


def voice_named(index: int, name: object, voices: Collection[str]) -> str:
    """The one of ``voices`` that request ``index``'s ``speaker`` names: as written, else the
    one whose name matches it ignoring case (OpenAI's clients write voices in lower case, and
    Qwen3-Omni's ``generate`` ignores case). ``ValueError`` for a name that is not a str,
    :class:`UnknownSpeakerError` naming the known voices for one that matches none."""
    if not isinstance(name, str):
        raise ValueError(f"request {index}: speaker must be a voice name (str), got {type(name).__name__}")
    voice = _match(name, voices)
    if voice is None:
        raise UnknownSpeakerError(
            f"request {index}: unknown speaker {name!r}; known speakers: {sorted(voices)}"
        )
    return voice


def default_voice(name: str, voices: Collection[str]) -> str:
    """The one of ``voices`` a stage YAML's ``default_speaker`` names, matched as a prompt's
    speaker is; ``ValueError`` naming the known voices when none matches, so that a misspelt
    default is found when the stage loads instead of serving every prompt in another voice."""
    voice = _match(name, voices)
    if voice is None:
        raise ValueError(
            f"default_speaker {name!r} is not one of the checkpoint's voices {sorted(voices)}: "
            "name one of them in the stage YAML's default_speaker"
        )
    return voice


def _match(name: str, voices: Collection[str]) -> str | None:
    """``name`` as written, else the one voice equal to it ignoring case; ``None`` otherwise."""
    if name in voices:
        return name
    matches = [voice for voice in voices if voice.lower() == name.lower()]
    return matches[0] if len(matches) == 1 else None
