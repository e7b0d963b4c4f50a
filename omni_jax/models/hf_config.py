"""A checkpoint's ``config.json`` through transformers, without warnings about its own fields.

A Qwen2.5-Omni talker config holds thinker-vocabulary ids (:data:`THINKER_IDS_IN_TALKER`).
transformers checks every ``*_token_id`` of a config against that config's own vocabulary,
the talker's codec vocabulary here, so every correct checkpoint draws seven "may result in
unexpected behavior" warnings, each time a process first builds its config (``AutoConfig``,
and ``AutoTokenizer`` too, which reads the config to pick a class). Loads done here drop
exactly those seven messages and check the fields against the thinker's vocabulary instead.
Likewise a Qwen3-Omni config's M-RoPE keys (:data:`MROPE_KEYS`), which its models read and
transformers' rope validation does not know on some sub-configs: six warnings a pipeline load.
Every other message passes through.

A config transformers' own validation refuses (its strict dataclass checks: a field of the
wrong type, fields that contradict each other) raises :class:`ConfigRefusedError`, a
``ValueError`` whose one-line message says why.
"""

from __future__ import annotations

import contextlib
import logging
import re
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

MROPE_KEYS = frozenset({"mrope_section", "interleaved", "mrope_interleaved"})
"""``rope_parameters`` keys of a multimodal rotary embedding: the models read them
(``mrope_section`` splits the rotary dimensions between time, height and width)."""

_VALIDATION_LOGGER = "transformers.configuration_utils"
_ROPE_LOGGER = "transformers.modeling_rope_utils"
_UNRECOGNIZED_ROPE_KEYS = re.compile(
    r"^Unrecognized keys in `rope_parameters` for 'rope_type'='\w+': \{(.*)\}$"
)


class ConfigRefusedError(ValueError):
    """transformers refuses to build the config ``config.json`` describes; the message, one line,
    says why (without the path, which the caller names)."""


def _refusals() -> tuple[type[BaseException], ...]:
    """What transformers raises for a config it refuses, beyond the ``ValueError``, ``KeyError``
    and ``TypeError`` of its own checks: huggingface_hub's strict dataclass validation of a
    field or of the whole config, and ``AttributeError`` when ``config.json`` sets one of the
    config's read-only properties (e.g. ``use_return_dict``). A ``StrictDataclassDefinitionError``
    (a config class defined wrongly) is transformers' bug, not the checkpoint's, and passes."""
    from huggingface_hub.errors import (
        StrictDataclassClassValidationError,
        StrictDataclassFieldValidationError,
    )

    return StrictDataclassClassValidationError, StrictDataclassFieldValidationError, AttributeError


def _reason(e: BaseException) -> str:
    """One line saying why transformers refused: the validator's own message (the cause
    huggingface_hub wraps), then what the wrapper names (the field or validator)."""

    def first(x: BaseException) -> str:
        lines = [line.strip() for line in str(x).splitlines() if line.strip()]
        return lines[0] if lines else type(x).__name__

    if e.__cause__ is None:
        return first(e)
    return f"{first(e.__cause__)} ({first(e).rstrip(':')})"


class _ThinkerIdsUnflagged(logging.Filter):
    """Drops transformers' vocabulary warning for exactly the :data:`THINKER_IDS_IN_TALKER` fields."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(f"Model config: {name} must be ") for name in THINKER_IDS_IN_TALKER)


class _MropeKeysUnflagged(logging.Filter):
    """Drops transformers' rope warning when every key it names is one of :data:`MROPE_KEYS`."""

    def filter(self, record: logging.LogRecord) -> bool:
        found = _UNRECOGNIZED_ROPE_KEYS.match(record.getMessage())
        if found is None:
            return True
        keys = {key.strip().strip("'\"") for key in found.group(1).split(",")}
        return not keys <= MROPE_KEYS


class _RefusalUnlogged(logging.Filter):
    """Drops the error transformers logs, the whole config printed (tens of lines), before it
    raises the ``AttributeError`` of a read-only property set in ``config.json``; the
    :class:`ConfigRefusedError` :func:`read_config` raises says the same in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Can't set ")


@contextlib.contextmanager
def own_fields_unflagged() -> Iterator[None]:
    """While open, transformers' config validation does not warn about the talker's
    thinker-vocabulary ids or the M-RoPE keys (for code that builds the config itself:
    ``AutoTokenizer``, and the tiny checkpoints' builders, which it decorates)."""
    filters = [
        (logging.getLogger(_VALIDATION_LOGGER), _ThinkerIdsUnflagged()),
        (logging.getLogger(_ROPE_LOGGER), _MropeKeysUnflagged()),
    ]
    for logger, unflagged in filters:
        logger.addFilter(unflagged)
    try:
        yield
    finally:
        for logger, unflagged in filters:
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


SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)
"""The sizes a model's modules are built from: a config with one not a positive integer is
refused by name (``hidden_size: -4`` was a TypeError deep in a module's constructor, and
``num_hidden_layers: 0`` a ZeroDivisionError when the cache was planned)."""


def check_config_sizes(cfg: Any, where: str = "") -> None:
    """``ValueError`` naming the field (``thinker_config.text_config.hidden_size``) when one of
    :data:`SIZE_FIELDS`, in ``cfg`` or any config nested in it, is set and not a positive
    integer (``None``, which some configs use for "derive it", is left to the model)."""
    for name, value in vars(cfg).items():
        if (
            name in SIZE_FIELDS
            and value is not None
            and (isinstance(value, bool) or not isinstance(value, int) or value < 1)
        ):
            raise ValueError(f"{where}{name}={value!r} must be a positive integer")
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a nested PretrainedConfig
            check_config_sizes(value, f"{where}{name}.")


def read_config(model_dir: str | Path) -> Any:
    """``AutoConfig.from_pretrained(model_dir)`` (local files only), quiet about the talker's
    thinker-vocabulary ids and checked by :func:`check_thinker_ids`; a config transformers'
    validation refuses raises :class:`ConfigRefusedError` (one line, not huggingface_hub's
    multi-line wrapper, which the command line would show as a traceback)."""
    from transformers import AutoConfig

    logger = logging.getLogger(_VALIDATION_LOGGER)
    unlogged = _RefusalUnlogged()
    logger.addFilter(unlogged)
    try:
        with own_fields_unflagged():
            cfg = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except _refusals() as e:
        raise ConfigRefusedError(f"transformers refuses this config: {_reason(e)}") from e
    finally:
        logger.removeFilter(unlogged)
    check_thinker_ids(cfg)
    check_config_sizes(cfg)
    return cfg
