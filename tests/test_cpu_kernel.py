"""The C++ CPU decode kernel against the portable jnp path, and how it is built and chosen."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity import KERNEL_ATOL

from omni_jax.kernels import cpu
from omni_jax.models.attention import AttentionMetadata, paged_attention

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="the C++ paged-attention kernel serves the CPU backend; accelerators decode with Pallas or jnp",
)


def _decode_step(
    rng: np.random.RandomState, lens: list[int], heads: int, kv_heads: int, d: int, page_size: int = 4
) -> tuple[jax.Array, jax.Array, jax.Array, AttentionMetadata]:
    """A decode step of rows with context ``lens`` over shuffled pages, tables as wide as the
    longest row."""
    batch, pps = len(lens), -(-max(lens) // page_size)
    num_pages = batch * pps + 3
    k = jnp.asarray(rng.randn(kv_heads, num_pages, page_size, d), jnp.float32)
    v = jnp.asarray(rng.randn(kv_heads, num_pages, page_size, d), jnp.float32)
    md = AttentionMetadata(
        slot_mapping=jnp.zeros((batch, 1), jnp.int32),
        block_tables=jnp.asarray(rng.permutation(num_pages)[: batch * pps].reshape(batch, pps), jnp.int32),
        context_lens=jnp.asarray(lens, jnp.int32),
        query_lens=jnp.ones((batch,), jnp.int32),
    )
    return jnp.asarray(rng.randn(batch, 1, heads, d), jnp.float32), k, v, md


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [
        (4, 2, 16),  # the tiny test models
        (8, 2, 64),  # the benchmark's small Qwen2
        (14, 2, 32),  # groups of 7 heads: a pass of 4 and a pass of 3
        (2, 2, 80),  # head_dim in a 64-lane pass and a 16-lane pass
        (8, 1, 128),  # two 64-lane passes, 8 heads in two passes
    ],
)
def test_cpu_kernel_matches_jnp(heads: int, kv_heads: int, head_dim: int) -> None:
    q, k, v, md = _decode_step(
        np.random.RandomState(0), [1, 3, 4, 17, 40, 64, 9, 33], heads, kv_heads, head_dim
    )
    scale = head_dim**-0.5
    want = jax.jit(lambda *a: paged_attention(*a, scale=scale, backend="jnp"))(q, k, v, md)
    got = jax.jit(lambda *a: paged_attention(*a, scale=scale, backend="cpu"))(q, k, v, md)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=KERNEL_ATOL)


def test_cpu_kernel_sliding_window() -> None:
    q, k, v, md = _decode_step(np.random.RandomState(1), [1, 5, 12, 30, 31], 4, 2, 16)
    for window in (1, 6, 64):
        want = paged_attention(q, k, v, md, scale=0.25, sliding_window=window, backend="jnp")
        got = paged_attention(q, k, v, md, scale=0.25, sliding_window=window, backend="cpu")
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=KERNEL_ATOL)


def test_cpu_kernel_rows_are_independent() -> None:
    """Many rows (the thread pool shares them out) give each row what it gives alone, bit for
    bit: a request's decode does not depend on its batch. Padding rows (no context) give
    zeros."""
    rng = np.random.RandomState(2)
    lens = rng.randint(1, 80, 96).tolist() + [0]
    q, k, v, md = _decode_step(rng, lens, 8, 2, 64)
    attend = jax.jit(lambda *a: paged_attention(*a, scale=0.125, backend="cpu"))
    whole = np.asarray(attend(q, k, v, md))
    assert not whole[-1].any()
    for row in (0, 37, 95):
        alone = jax.tree.map(lambda a, r=row: a[r : r + 1], md)
        np.testing.assert_array_equal(np.asarray(attend(q[row : row + 1], k, v, alone)), whole[row : row + 1])


def test_auto_picks_the_kernel_for_float32_decode_on_cpu() -> None:
    q, k, v, md = _decode_step(np.random.RandomState(3), [3, 9], 4, 2, 16)

    def calls_kernel(*args: jax.Array) -> bool:
        return "ffi_call" in str(jax.make_jaxpr(lambda *a: paged_attention(*a, scale=0.25))(*args))

    assert calls_kernel(q, k, v, md)
    assert not calls_kernel(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), md)
    q_prefill = jnp.zeros((2, 3, 4, 16), jnp.float32)
    assert not calls_kernel(q_prefill, k, v, md)
    with pytest.raises(ValueError, match="CPU paged-attention kernel"):
        paged_attention(q_prefill, k, v, md, scale=0.25, backend="cpu")
    with pytest.raises(ValueError, match="CPU paged-attention kernel"):
        paged_attention(q[..., :8], k[..., :8], v[..., :8], md, scale=0.25, backend="cpu")


def test_loading_the_kernel_keeps_denormals() -> None:
    """Built with -ffast-math, a shared library linked the same way would set flush-to-zero for
    the whole process on load (crtfastmath.o), changing every float computation after it."""
    assert cpu.paged_decode_target() is not None
    tiny = np.array([1e-38], np.float32) / np.float32(4)
    assert tiny[0] > 0
    import torch

    assert torch.tensor([1e-38], dtype=torch.float32).div(4).item() > 0


def test_switched_off_or_without_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu._paged_decode_target.cache_clear()
    try:
        monkeypatch.setenv(cpu.ENV_SWITCH, "0")
        assert cpu.paged_decode_target() is None
        cpu._paged_decode_target.cache_clear()
        monkeypatch.delenv(cpu.ENV_SWITCH)
        monkeypatch.setattr(cpu, "_compiler", lambda: None)
        with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
            assert cpu.paged_decode_target() is None
    finally:
        cpu._paged_decode_target.cache_clear()


def test_threads_asking_at_once_build_the_kernel_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Warm-up traces programs on several threads: each asked for the kernel first and built it
    (the server logged "building" twice). Now the first builds and the others wait for it."""
    import threading
    import time

    built = cpu._build
    lib = built(cpu._compiler())
    calls: list[str] = []

    def slow_build(compiler: str) -> Path:
        calls.append(compiler)
        time.sleep(0.2)
        return lib

    cpu._paged_decode_target.cache_clear()
    try:
        monkeypatch.setattr(cpu, "_build", slow_build)
        targets: list[str | None] = []
        threads = [
            threading.Thread(target=lambda: targets.append(cpu.paged_decode_target())) for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(calls) == 1 and targets == [cpu.PAGED_DECODE_TARGET] * 4
    finally:
        cpu._paged_decode_target.cache_clear()


def test_a_failed_build_says_what_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "broken-c++"
    broken.write_text(
        "#!/bin/sh\nif [ \"$1\" = --version ]; then echo broken 1.0; exit 0; fi\necho 'no' >&2\nexit 1\n"
    )
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv(cpu.ENV_CACHE_DIR, str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=f"(?s)failed.*{cpu.ENV_SWITCH}=0"):
        cpu._build(str(broken))


def test_a_second_process_reuses_the_build(tmp_path: Path) -> None:
    """The cached library loads in a fresh process, without building again."""
    code = "from omni_jax.kernels import cpu; print(cpu.paged_decode_target())"
    env = {**os.environ, cpu.ENV_CACHE_DIR: str(tmp_path)}
    built = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == cpu.PAGED_DECODE_TARGET
        built.append([(p.name, p.stat().st_mtime_ns) for p in tmp_path.glob("*.so")])
    assert len(built[0]) == 1 and built[1] == built[0]
