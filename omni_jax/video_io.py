"""Video frames from a ``.npy`` file (``numpy.save`` of ``[frames, H, W, 3]``), frames a caller
decoded or made itself (video files are read by :mod:`omni_jax.media_files`).

The bytes are the sender's (a server's client, a CLI user's file): the header is read and checked
against the bytes that follow it before any array is allocated, since a header of a few hundred
bytes can claim terabytes, and pickled objects are refused (loading them would run the sender's
code).
"""

from __future__ import annotations

import io
import math
import tokenize

import numpy as np

NPY_MAGIC = b"\x93NUMPY"
"""The first bytes of every ``.npy`` file."""

HEADER_READERS = {
    (1, 0): np.lib.format.read_array_header_1_0,
    (2, 0): np.lib.format.read_array_header_2_0,
}
"""The ``.npy`` format versions read (``numpy.save`` writes 1.0, or 2.0 for a header past 64 KiB;
3.0 only for field names outside latin-1, which frames do not have)."""


def read_frames(raw: bytes) -> np.ndarray:
    """The array the ``.npy`` file ``raw`` holds. ``ValueError`` whose message says what is wrong, for the
    caller to put after the input's name (``"not a .npy array of frames (no .npy header)"``),
    for what is not a ``.npy`` file, a header that does not parse or claims more bytes than follow
    it, a pickled array, or data numpy cannot read."""
    if not raw.startswith(NPY_MAGIC):  # np.load reads anything else as a pickle, and says so
        raise ValueError("not a .npy array of frames (no .npy header)")
    fp = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(fp)
        if version not in HEADER_READERS:
            raise ValueError(f".npy format version {version[0]}.{version[1]} is not read (1.0 and 2.0 are)")
        shape, _, dtype = HEADER_READERS[version](fp)
    # numpy parses the header as a Python literal: its tokenizer and its sort of the keys raise too
    except (ValueError, TypeError, tokenize.TokenError) as e:
        raise ValueError(f"not a readable .npy array of frames ({type(e).__name__}: {e})") from None
    if dtype.hasobject:
        raise ValueError("not a readable .npy array of frames (it holds Python objects: allow_pickle is off)")
    claimed, held = math.prod(shape) * dtype.itemsize, len(raw) - fp.tell()
    if claimed > held:
        raise ValueError(
            f"not a readable .npy array of frames (its header claims shape {shape} of {dtype}, "
            f"{claimed} bytes, and {held} follow it)"
        )
    try:
        return np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"not a readable .npy array of frames ({e})") from None
