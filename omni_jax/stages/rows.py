"""A table of rows that grows at its end: what a talker reads of the thinker while the thinker
still writes its reply (:class:`GrowingRows`)."""

from __future__ import annotations

import numpy as np


class GrowingRows:
    """Rows ``[n, D]`` read as an array and appended to at amortized constant cost: a buffer
    that doubles when full. Why not ``np.concatenate`` per append: a talker's table gains a row a
    step for the whole reply, and copying it every step would make a reply quadratic in its
    length."""

    def __init__(self, rows: np.ndarray):
        self._data = np.array(rows)
        self._size = len(rows)

    @property
    def array(self) -> np.ndarray:
        """The rows, ``[len(self), D]`` (a view: valid until the next :meth:`extend`)."""
        return self._data[: self._size]

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: object) -> np.ndarray:
        return self.array[index]

    def extend(self, rows: np.ndarray) -> None:
        """Append ``rows`` ``[k, D]``."""
        need = self._size + len(rows)
        if need > len(self._data):
            grown = np.empty((max(need, 2 * len(self._data)), *self._data.shape[1:]), self._data.dtype)
            grown[: self._size] = self.array
            self._data = grown
        self._data[self._size : need] = rows
        self._size = need
