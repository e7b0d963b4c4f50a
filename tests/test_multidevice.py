"""Runs ``tests/multidevice`` in a subprocess with eight emulated CPU devices (on the CPU
platform even where this run is on a GPU).

JAX fixes the device count when its backend starts, and this process must keep its single
device for the rest of the suite, so those tests get a fresh interpreter (one for the whole
directory, so they share its checkpoint and single-device reference run).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_multidevice_suite() -> None:
    from multidevice.conftest import XLA_FLAG

    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {XLA_FLAG}".strip(),
        "JAX_PLATFORMS": "cpu",  # the emulated devices are CPU ones, whatever platform this run is on
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "multidevice")],
        env=env,
        cwd=HERE.parent,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
