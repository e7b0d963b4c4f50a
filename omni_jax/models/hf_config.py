"""A checkpoint's ``config.json`` through transformers, without warnings about its own fields.

A Qwen2.5-Omni talker config holds thinker-vocabulary ids (:data:`THINKER_IDS_IN_TALKER`).
transformers checks every ``*_token_id`` of a config against that config's own vocabulary,
the talker's codec vocabulary here, so every correct checkpoint draws seven "may result in
unexpected behavior" warnings, each time a process first builds its config (``AutoConfig``,
and ``AutoTokenizer`` too, which reads the config to pick a class). Loads done here drop
exactly those seven messages and check the fields against the thinker's vocabulary instead;
every other message passes through.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

THINKER_IDS_IN_TALKER = (
    "tts_text_start_token_id",
    "tts_text_end_token_id",
    "tts_text_pad_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "audio_start_token_id",
    "audio_end_token_id",
)
"""Qwen2.5-Omni talker fields that index the *thinker's* vocabulary: the text specials the
talker embeds with the thinker's table, and the media markers its M-RoPE positions follow."""

_VALIDATION_LOGGER = "transformers.configuration_utils"


class _ThinkerIdsUnflagged(logging.Filter):
    """Drops transformers' vocabulary warning for exactly the :data:`THINKER_IDS_IN_TALKER` fields."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(f"Model config: {name} must be ") for name in THINKER_IDS_IN_TALKER)


@contextlib.contextmanager
def thinker_ids_unflagged() -> Iterator[None]:
    """While open, transformers' config validation does not warn about the talker's
    thinker-vocabulary ids (for loads that build the config themselves, e.g. ``AutoTokenizer``)."""
    logger = logging.getLogger(_VALIDATION_LOGGER)
    unflagged = _ThinkerIdsUnflagged()
    logger.addFilter(unflagged)
    try:
        yield
    finally:
        logger.removeFilter(unflagged)


def check_thinker_ids(cfg: Any) -> None:
    """``ValueError`` naming the field when a talker's thinker-vocabulary id lies outside the
    thinker's vocabulary (the check transformers makes against the wrong vocabulary)."""
    talker, thinker = getattr(cfg, "talker_config", None), getattr(cfg, "thinker_config", None)
    if talker is None or thinker is None:
        return
    vocab = thinker.get_text_config().vocab_size
    for name in THINKER_IDS_IN_TALKER:
        value = getattr(talker, name, None)
        if isinstance(value, int) and not 0 <= value < vocab:
            raise ValueError(f"talker_config.{name}={value} is outside the thinker's vocabulary [0, {vocab})")


def read_config(model_dir: str | Path) -> Any:
    """``AutoConfig.from_pretrained(model_dir)`` (local files only), quiet about the talker's
    thinker-vocabulary ids and checked by :func:`check_thinker_ids`."""
    from transformers import AutoConfig

    with thinker_ids_unflagged():
        cfg = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    check_thinker_ids(cfg)
    return cfg
