"""A checkpoint's tokenizer, loaded only when its vocabulary is there.

``AutoTokenizer`` builds a tokenizer from ``tokenizer_config.json`` alone, with an empty
vocabulary that turns every text into no ids at all; a request then fails far from the cause
("empty prompt"). So a tokenizer counts as present only with the files that hold its
vocabulary, and the messages for a missing one name those files and the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_jax.models.hf_config import own_fields_unflagged

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
    """The checkpoint's tokenizer, or ``None`` when :func:`has_vocabulary` finds none."""
    if not has_vocabulary(path):
        return None
    from transformers import AutoTokenizer

    with own_fields_unflagged():  # AutoTokenizer builds the checkpoint's config
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
