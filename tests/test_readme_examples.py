"""README's Python examples run as written, on the tiny checkpoints.

Each ```` ```python ```` block of README.md is executed with its ``"path/to/..."`` checkpoint
replaced by the tiny one of that family and the names it leaves to the reader (``wave_16k``,
``frames``, ``codes_a``, ...) and files it reads (``question.wav``, ``cat.png``) supplied, so an
example that drifts from the API (a renamed argument, field or method) fails here. Two blocks are
not run, each for the reason :data:`NOT_RUN` gives; a new block must be added to one of the two
tables, or the first test fails.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from scipy.io import wavfile

from omni_jax.testing_qwen3_omni import NUM_CODE_GROUPS

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)

CHECKPOINTS = {
    "path/to/Qwen2-checkpoint": "qwen2_dir",
    "path/to/Qwen2.5-Omni": "omni_dir",
    "path/to/Qwen3-Omni": "qwen3_omni_dir",
}


def _video() -> np.ndarray:
    return np.random.default_rng(1).integers(0, 256, (4, 28, 28, 3), dtype=np.uint8)


def _qwen3_frames() -> list[int]:
    """Eight codec frames of the tiny Qwen3-Omni's quantizers, flattened frame-major."""
    return [int(c) for c in np.random.default_rng(2).integers(0, 16, 8 * NUM_CODE_GROUPS)]


# A line that names the block -> the names it leaves to the reader and the files it must write.
RUN: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    'pipe = OmniJaxPipeline.from_pretrained("path/to/Qwen2-checkpoint")': ({}, ()),
    'pipe = OmniJaxPipeline.from_pretrained("path/to/Qwen2.5-Omni")  # all three stages': (
        {},
        ("answer.wav",),
    ),
    '{"type": "audio", "audio": wave_16k}': (
        {"wave_16k": (0.3 * np.sin(np.arange(8000) / 5.0)).astype(np.float32), "frames": _video()},
        (),
    ),
    '{"prompt_token_ids": codes_a, "speaker": "Ethan"}': (
        {"codes_a": list(range(1, 40)), "codes_b": list(range(5, 30))},
        (),
    ),
    'pipe = OmniJaxPipeline.from_pretrained("path/to/Qwen3-Omni")': ({"frames": _qwen3_frames()}, ()),
    "async with AsyncOmniJaxPipeline.from_pretrained": ({}, ()),
}

NOT_RUN = {
    'client = OpenAI(base_url="http://127.0.0.1:8000/v1"': "needs a running server: the official client "
    "against `omni-jax serve` is tests/test_serve.py's",
    'mesh={"data": 2, "model": 4}': "needs 8 devices: meshes are tests/test_parallel.py's",
}


def _key(block: str, keys: dict[str, Any]) -> str | None:
    found = [k for k in keys if k in block]
    assert len(found) <= 1, f"README block matches several keys: {found}"
    return found[0] if found else None


def test_every_python_block_is_run_or_says_why_not() -> None:
    for block in BLOCKS:
        assert (_key(block, RUN) is None) != (_key(block, NOT_RUN) is None), block
    for keys in (RUN, NOT_RUN):  # no entry outlives its block
        assert sorted(k for b in BLOCKS if (k := _key(b, keys))) == sorted(keys)


@pytest.mark.parametrize("key", list(RUN), ids=[f"block_{i}" for i in range(len(RUN))])
def test_the_example_runs_as_written(key: str, request, tmp_path, monkeypatch) -> None:
    (block,) = [b for b in BLOCKS if key in b]
    for placeholder, fixture in CHECKPOINTS.items():
        if f'"{placeholder}"' in block:
            block = block.replace(f'"{placeholder}"', repr(str(request.getfixturevalue(fixture))))
    assert '"path/to/' not in block, block
    monkeypatch.chdir(tmp_path)
    wavfile.write("question.wav", 16_000, (0.3 * np.sin(np.arange(16_000) / 8.0)).astype(np.float32))
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)).save("cat.png")
    names, writes = RUN[key]
    exec(compile(block, f"README.md block {key!r}", "exec"), dict(names))  # noqa: S102 - the doc's own code
    for name in writes:
        assert (tmp_path / name).stat().st_size > 0, name
