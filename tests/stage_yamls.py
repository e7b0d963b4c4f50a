"""The shipped stage YAMLs with a test's edits: the one way the tests run a stage at other limits,
placement or defaults than the release's (each test names only what it changes, so a change to the
shipped YAML reaches every test that does not override it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

import omni_jax.stages

STAGES = Path(omni_jax.stages.__file__).parent
"""Where the shipped stage YAMLs are (``qwen2_5_omni.yaml``, ``qwen3_omni.yaml``, ``qwen2.yaml``)."""


class Whole(dict):
    """An edit's dict that replaces the shipped one at its key, instead of merging into it."""


def merged(shipped: Any, edit: Any) -> Any:
    """``edit`` over ``shipped``: a dict merges key by key (recursively) into a shipped dict, a
    :class:`Whole` or any other value replaces it."""
    if not isinstance(edit, dict):
        return edit
    base = shipped if isinstance(shipped, dict) and not isinstance(edit, Whole) else {}
    return {**base, **{key: merged(base.get(key), value) for key, value in edit.items()}}


def shipped_config(family: str) -> dict[str, Any]:
    """The release's stage YAML ``family`` (``"qwen2_5_omni"``, ``"qwen3_omni"``) as loaded."""
    return yaml.safe_load((STAGES / f"{family}.yaml").read_text())


def edited_stages(path: Path, family: str, **stages: dict[str, Any]) -> Path:
    """Write to ``path`` the shipped stage YAML ``family`` with each stage named in ``stages``
    edited (:func:`merged`), and return ``path``."""
    config = shipped_config(family)
    unknown = set(stages) - {stage["name"] for stage in config["stages"]}
    if unknown:
        raise ValueError(f"{family}.yaml has no stage {sorted(unknown)}")
    config["stages"] = [merged(stage, stages.get(stage["name"], {})) for stage in config["stages"]]
    path.write_text(yaml.safe_dump(config))
    return path
