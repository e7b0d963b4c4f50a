"""A checkpoint's tokenizer, loaded only when its vocabulary is there.

``AutoTokenizer`` builds a tokenizer from ``tokenizer_config.json`` alone, with an empty
vocabulary that turns every text into no ids at all; a request then fails far from the cause
("empty prompt"). So a tokenizer counts as present only with the files that hold its
vocabulary, and the messages for a missing one name those files and the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omni_jax.models.hf_config import own_fields_unflagged

CHAT_TEMPLATE_JSON = "chat_template.json"
PROCESSOR_CONFIG = "preprocessor_config.json"
VOCABULARIES = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))
"""File sets any one of which holds a tokenizer's vocabulary (fast, byte-level BPE, SentencePiece)."""


def has_vocabulary(path: str | Path) -> bool:
    """Whether ``path`` holds one of :data:`VOCABULARIES` in full, or a ``*.tiktoken`` file."""
    path = Path(path)
    return any(all((path / f).is_file() for f in files) for files in VOCABULARIES) or any(
        path.glob("*.tiktoken")
    )


def no_tokenizer(path: str | Path) -> str:
    """``path`` has no tokenizer, naming what it would have to hold."""
    wanted = ", ".join(" with ".join(files) for files in VOCABULARIES)
    return f"{path} has no tokenizer (none of {wanted} or *.tiktoken)"


def load_tokenizer(path: str | Path) -> Any | None:
    """The checkpoint's tokenizer, or ``None`` when :func:`has_vocabulary` finds none. Its chat
    template is the one prompts are built with elsewhere: in a checkpoint with a processor
    (``preprocessor_config.json``), ``chat_template.json``'s before the tokenizer's own, as
    transformers' processor and vLLM pick it (a repo may ship both, and they may differ);
    without one, the tokenizer's own, else ``chat_template.json``'s (hub repos written for the
    processor ship it there alone)."""
    if not has_vocabulary(path):
        return None
    from transformers import AutoTokenizer

    with own_fields_unflagged():  # AutoTokenizer builds the checkpoint's config
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    template = processor_chat_template(Path(path))
    if template is not None and (
        tokenizer.chat_template is None or (Path(path) / PROCESSOR_CONFIG).is_file()
    ):
        tokenizer.chat_template = template
    return tokenizer


def processor_chat_template(path: Path) -> str | None:
    """The template in ``path/chat_template.json`` (``{"chat_template": ...}``), if any;
    ``ValueError`` naming the file when it holds none."""
    file = path / CHAT_TEMPLATE_JSON
    if not file.is_file():
        return None
    try:
        template = json.loads(file.read_text())["chat_template"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{file}: no chat template ({type(e).__name__}: {e})") from e
    if not isinstance(template, str):
        raise ValueError(f"{file}: 'chat_template' is a {type(template).__name__}, not a string")
    return template
