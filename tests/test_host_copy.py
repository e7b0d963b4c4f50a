"""The tiled host copy every checkpoint view goes through (``omni_jax.host_copy``): equal to numpy's
own C-ordered copy for every kind of view a parameter map makes, in every dtype it casts to."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from omni_jax import host_copy
from omni_jax.host_copy import contiguous, copy_into
from omni_jax.models.param_map import conv1d_kernel, conv2d_kernel, conv_transpose1d_kernel, linear_kernel

BF16 = np.dtype(ml_dtypes.bfloat16)


def _source(shape: tuple[int, ...], dtype: np.dtype, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize(
    "transform, shape",
    [
        (linear_kernel, (600, 530)),  # tiles that do not divide either side
        (linear_kernel, (1, 300)),
        (linear_kernel, (300, 1)),
        (conv1d_kernel, (70, 40, 7)),
        (conv_transpose1d_kernel, (40, 70, 11)),  # a flip: negative strides
        (conv2d_kernel, (32, 3, 14, 14)),
        (lambda x: np.swapaxes(x, -1, -2), (3, 290, 270)),  # experts' per-expert swap
        (lambda x: x[:, 5:400:3].T, (260, 700)),  # a strided slice of a transposed view
    ],
)
@pytest.mark.parametrize(
    "stored, target", [(BF16, BF16), (BF16, np.float32), (np.float32, BF16), (np.float32, np.float32)]
)
def test_equals_numpys_copy(transform, shape, stored, target, monkeypatch) -> None:
    monkeypatch.setattr(host_copy, "TILE", 64)  # several tiles a side, and ragged last ones
    view = transform(_source(shape, np.dtype(stored)))
    got = contiguous(view, target)
    want = np.asarray(view, dtype=target, order="C")
    assert got.flags.c_contiguous and got.dtype == np.dtype(target) and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_a_contiguous_source_of_the_target_dtype_is_not_copied(tmp_path) -> None:
    path = tmp_path / "t.bin"
    data = _source((64, 48), BF16)
    data.tofile(path)
    mapped = np.memmap(path, dtype=BF16, mode="r", shape=data.shape)
    assert np.shares_memory(contiguous(mapped, BF16), mapped)
    assert not np.shares_memory(contiguous(mapped, np.float32), mapped)


def test_copy_into_writes_a_slice_of_a_larger_array() -> None:
    """The experts' stack writes each expert into its row of the stacked array."""
    experts = [_source((90, 70), np.float32, seed=e) for e in range(3)]
    out = np.zeros((3, 70, 90), BF16)
    for k, w in enumerate(experts):
        copy_into(out[k], w.T)
    np.testing.assert_array_equal(
        out.astype(np.float32), np.stack([w.T for w in experts]).astype(BF16).astype(np.float32)
    )


def test_the_transposed_copy_is_blocked(monkeypatch) -> None:
    """A transposed view is written tile by tile (what makes the copy fast), a view whose last axis
    is already the source's contiguous one in one assignment."""
    writes: list[tuple[slice, ...]] = []

    class Recorder(np.ndarray):
        def __setitem__(self, index, value) -> None:
            writes.append(index)
            super().__setitem__(index, value)

    monkeypatch.setattr(host_copy, "TILE", 100)
    out = np.empty((250, 120), np.float32).view(Recorder)
    copy_into(out, _source((120, 250), np.float32).T)
    assert len(writes) == 3 * 2
    writes.clear()
    copy_into(out, _source((250, 240), np.float32)[:, ::2])
    assert len(writes) == 1
