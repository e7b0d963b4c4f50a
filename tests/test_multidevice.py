"""Runs each file of ``tests/multidevice`` in a subprocess with eight emulated CPU devices (on
the CPU platform even where this run is on a GPU).

JAX fixes the device count when its backend starts, and this process must keep its single
device for the rest of the suite, so those tests get a fresh interpreter: one a file, so the
files run side by side on the suite's workers (the directory in one process was the suite's
longest test by far), each building the checkpoints it uses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


FILES = sorted(p.name for p in (HERE / "multidevice").glob("test_*.py"))


def test_the_files_are_found() -> None:
    assert len(FILES) >= 9, FILES


@pytest.mark.parametrize("name", FILES)
def test_multidevice_file(name: str) -> None:
    from multidevice.conftest import XLA_FLAG

    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {XLA_FLAG}".strip(),
        "JAX_PLATFORMS": "cpu",  # the emulated devices are CPU ones, whatever platform this run is on
    }
    proc = subprocess.run(
        # One worker: the file's tests share its fixtures, and the suite's workers already
        # fill the machine.
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            str(HERE / "multidevice" / name),
        ],
        env=env,
        cwd=HERE.parent,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
