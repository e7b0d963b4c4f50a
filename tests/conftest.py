"""Shared fixtures: tiny random-weight checkpoints built once per session."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# transformers 5.25 kernelizes the models it loads with kernels from the hub by default: the
# references are its own PyTorch modules, and no hub is reachable here.
os.environ.setdefault("USE_HUB_KERNELS", "0")
os.environ.setdefault("OMNI_JAX_COMPILATION_CACHE", "0")  # tests must not write to ~/.cache
# The vocoders trace SnakeBeta's sin natively, the form every accelerator runs: the CPU's own
# default, a polynomial that vectorises (bigvgan.sin_form), makes each code2wav program about a
# third slower to lower and compile, and the tests compile such programs by the hundred. The
# polynomial is held to transformers by its own tests (test_code2wav_parity::test_bigvgan).
os.environ.setdefault("OMNI_JAX_SNAKE_SIN", "native")
# The CPU kernels build once per test session (a few seconds), outside ~/.cache; test
# subprocesses inherit the directory, and it goes when the session ends.
if "OMNI_JAX_KERNEL_CACHE" not in os.environ:
    os.environ["OMNI_JAX_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="omni_jax_kernels_")
    atexit.register(shutil.rmtree, os.environ["OMNI_JAX_KERNEL_CACHE"], ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402

# Float32 modules are held to float32 transformers: a module a test traces itself (outside the
# engine's programs, which ask for it themselves: tests/test_precision.py) computes its float32
# products in float32 too, not in XLA's TensorFloat-32 default on GPUs.
jax.config.update("jax_default_matmul_precision", "highest")

from omni_jax.testing import build_tiny_qwen2, build_tiny_qwen2_5_omni  # noqa: E402

MAX_WORKERS = 4
"""Test worker processes at most (``-n auto``): one a core up to this. Each holds its own JAX
runtime and tiny checkpoints (a few GB at its peak), and the tests' XLA programs run on the
cores the others compile on, so more workers than this add memory more than speed."""


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory):
    """An untied, GQA tiny Qwen2 HF checkpoint with a tokenizer."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("qwen2") / "hf", seed=0)


@pytest.fixture(scope="session")
def hf_qwen2(qwen2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def omni_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen2.5-Omni HF checkpoint (thinker, talker, token2wav) with tokenizer and spk_dict.pt."""
    return build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("qwen2_5_omni") / "hf", seed=0)


@pytest.fixture(scope="session")
def omni_converted_dir(omni_dir, tmp_path_factory: pytest.TempPathFactory):
    """``omni_dir`` through ``checkpoints_convert`` (every served part, speakers torch-free)."""
    from omni_jax.weights import convert

    return convert(omni_dir, tmp_path_factory.mktemp("omni_conv") / "conv", progress=False)


@pytest.fixture(scope="session")
def qwen3_omni_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen3-Omni HF checkpoint (MoE thinker, talker with code predictor, code2wav) with
    tokenizer and processor files (:func:`omni_jax.testing_qwen3_omni.build_tiny_qwen3_omni`)."""
    from omni_jax.testing_qwen3_omni import build_tiny_qwen3_omni

    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("qwen3_omni") / "hf", seed=0)


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler for the test, as in a terminal (a test runner's worker may
    ignore SIGINT, and then no Ctrl-C reaches the code under test)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
