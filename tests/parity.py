"""Helpers shared by the parity tests (a plain module: import it as ``from parity import ...``)."""

from __future__ import annotations

import functools
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omni_jax.models.attention import AttentionMetadata


@functools.partial(nnx.jit, static_argnums=1)
def compiled(module: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """``getattr(module, method)(*args, **kwargs)`` as one XLA program, compiled once per module
    graph, method and input shapes: the parity tests run our modules compiled, as the engine
    does. Called eagerly, JAX compiles each operation as a program of its own, hundreds a test,
    which took most of these tests' time."""
    return getattr(module, method)(*args, **kwargs)


@nnx.jit
def decode_step(
    model: Any, embeds: jax.Array, positions: jax.Array, cache: Any, md: AttentionMetadata, model_kw: dict
) -> tuple[jax.Array, jax.Array, Any]:
    """The decoder over ``embeds`` (``model_kw`` to its call), then the logits, as one program:
    ``(logits, hidden, cache)``. :class:`PagedSteps`' step, and :func:`embed_step`'s after it
    embeds."""
    hidden, cache = model(embeds, positions, cache, md, **model_kw)
    return model.logits(hidden), hidden, cache


@nnx.jit
def embed_step(
    model: Any, tokens: jax.Array, extra: Any, positions: jax.Array, cache: Any, md: AttentionMetadata
) -> tuple[jax.Array, jax.Array, Any]:
    """One step of an AR model as one program, as the engine runs it: ``tokens`` embedded (with
    ``extra``, the model's step inputs beside them: encoder rows, talker rows; ``None``: the
    tokens alone), through the decoder and its paged ``cache``, its layers given what
    ``layer_inputs`` reads of ``extra`` (Qwen3-Omni's DeepStack features; ``None`` for the
    others): ``(logits, hidden, cache)``."""
    embeds = model.embed(tokens, extra)
    return decode_step(
        model, embeds, positions, cache, md, {"layer_inputs": model.layer_inputs(tokens, extra)}
    )


def check_bfloat16_greedy(pipe: Any, hf_bf16: Any, batch: list[list[int]], new_tokens: int) -> None:
    """``pipe``'s greedy run of ``batch`` (``new_tokens`` each) against transformers ``generate``
    by ``hf_bf16`` (the same weights, in bfloat16): every request's tokens equal generate's, or
    differ first where generate's two candidates were within the near-tie bound of each other;
    up to there (the prefixes being the same), the pipeline's log-probability of each token it
    chose is generate's to within twice the logit bound (the token's logit and the log-sum-exp
    may each move by it), which holds the paged decode steps' numbers as a whole-prompt
    forward's logits are held."""
    import torch

    from benchmarks import agreement
    from omni_jax import SamplingParams

    bound = agreement.LOGIT_RTOL["bfloat16"]
    eos = hf_bf16.generation_config.eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, logprobs=0)
    outs = pipe.run([{"prompt_token_ids": p} for p in batch], params, progress=False)
    ours = [o.token_ids for o in outs]
    ref, logits = [], []
    with torch.no_grad():
        for p in batch:
            ids = torch.tensor([p])
            out = hf_bf16.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                output_logits=True,
                return_dict_in_generate=True,
            )
            ref.append(out.sequences[0, len(p) :].tolist())
            logits.append(torch.cat(out.logits).double().numpy())  # [steps, vocab], before EOS is held back

    def scores(i: int, k: int) -> np.ndarray:  # what greedy step k chose from: EOS held back
        s = logits[i][k].copy()
        s[eos] = -np.inf
        return s

    result = agreement.compare(ours, ref, scores, agreement.near_tie_bound("bfloat16"))
    assert not result.disagreements, result.summary()
    assert all(len(t) == new_tokens for t in ours)
    for i, out in enumerate(outs):
        k = agreement.first_difference(ours[i], ref[i])
        for j in range(new_tokens if k is None else k + 1):
            x = logits[i][j]
            want = x[ours[i][j]] - (x.max() + np.log(np.exp(x - x.max()).sum()))
            got = out.logprobs[j][ours[i][j]]
            assert abs(got - want) <= 2 * bound * np.abs(x).max(), (i, j, got, want)


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    """Largest absolute difference relative to the reference's largest magnitude (``ours`` may be
    a jax array)."""
    return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


SPLIT_ROUNDING = 2e-6
"""Largest :func:`rel_err` of a result computed on a split mesh (or across processes) against
one device. Not 0: a split changes each device's shapes (rows, heads), and so XLA's fusions and
summation order, and a ``model`` split adds all-reduces. Measured, float32 rounding: waveforms
at most 5.8e-7 on the data 2, model 2 and 2x2 meshes; an AR step's final hidden states at most
1.1e-6 (3.9e-6 on values up to 3.7) on the 2x4, 1x8 and 2x2 meshes, over 10 random steps."""


KERNEL_ATOL = 2e-6
"""A decode kernel (the C++ CPU kernel, Pallas interpreted) against the jnp path, on outputs of
order 1: they differ only in summation order and in their float32 ``exp``, a few ulps. Worst
measured: 9.5e-7 for the CPU kernel (200 random steps), 4.8e-7 for Pallas (60 steps alone, 30
on a 2x4 mesh)."""


def chunk_metadata(pages: np.ndarray, page_size: int, start: int, end: int) -> AttentionMetadata:
    """One sequence's tokens ``[start, end)`` after ``start`` cached ones, its KV in ``pages`` (in
    that order; scattered over the pool, a wrong block-table or slot computation shows)."""
    idx = np.arange(start, end)
    return AttentionMetadata(
        slot_mapping=jnp.asarray(pages[idx // page_size] * page_size + idx % page_size)[None],
        block_tables=jnp.asarray(pages)[None],
        context_lens=jnp.array([end]),
        query_lens=jnp.array([end - start]),
    )


class CountedJit:
    """``jax.jit`` of a split module's call on one input, ``nnx.merge(graphdef, state)(x)``, that
    counts its traces (``traces``): another input of the same shapes must compile nothing."""

    def __init__(self, graphdef: nnx.GraphDef) -> None:
        self.traces = 0

        def forward(state: nnx.State, x: Any) -> Any:
            self.traces += 1
            return nnx.merge(graphdef, state)(x)

        self._jitted = jax.jit(forward)

    def __call__(self, state: nnx.State, x: Any) -> Any:
        return self._jitted(state, x)


def random_tokens(n: int, seed: int, high: int = 1000) -> list[int]:
    """``n`` text token ids below ``high``, drawn from ``RandomState(seed)``."""
    return np.random.RandomState(seed).randint(0, high, size=n).tolist()


def random_patches(rng: np.random.Generator, grid: tuple[int, int, int], dim: int) -> np.ndarray:
    """``[t * h * w, dim]`` standard-normal float32 patches of a vision input of ``grid``."""
    t, h, w = grid
    return rng.standard_normal((t * h * w, dim)).astype(np.float32)


def randomize_moe_block(block: Any) -> None:
    """An HF sparse MoE block's experts ~ 1/sqrt(fan_in) (their fan-in is the last axis, where
    :func:`omni_jax.testing.randomize_weights` would take a whole ``[out, in]`` slice) and its
    router scaled to logits of order 3, so routing is decided by the signal. Torch's global RNG."""
    import torch

    with torch.no_grad():
        for p in (block.experts.gate_up_proj, block.experts.down_proj):
            p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
        block.gate.weight.mul_(3.0)


def randomize_moe_layers(layers: Any) -> None:
    """:func:`randomize_moe_block` on the MLP of every decoder layer that has experts, in order."""
    for layer in layers:
        if hasattr(layer.mlp, "experts"):
            randomize_moe_block(layer.mlp)


class PagedSteps:
    """Padded ``[B, T]`` steps of several sequences through one paged cache of ``page_size``-token
    pages, as the engine runs rows: each sequence's pages scattered over the pool, rows
    left-aligned, padding tokens written to an out-of-range slot. ``model`` is an AR model
    (``__call__(embeds, positions, cache, md, **kw)``, ``logits``, ``spec``)."""

    def __init__(self, model: Any, batch: int, pages_per_seq: int, page_size: int):
        from omni_jax.engine.kv_cache import init_kv_cache

        spec = model.spec
        self.model, self.page_size, self.num_pages = model, page_size, batch * pages_per_seq
        perm = np.random.RandomState(7).permutation(self.num_pages).astype(np.int32)
        self.tables = perm.reshape(batch, pages_per_seq)
        self.cache = init_kv_cache(
            spec.num_layers, spec.num_kv_heads, self.num_pages, page_size, spec.head_dim, jnp.float32
        )
        self.done = np.zeros(batch, np.int64)

    def run(
        self, embeds: np.ndarray, positions: np.ndarray, lens: list[int], **model_kw: Any
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Append ``lens[b]`` tokens to sequence ``b`` (``embeds [B, T, D]``, ``positions
        [..., B, T]``, rows left-aligned; ``model_kw`` to the model's call, e.g. ``deepstack``);
        per sequence, the logits and hidden states of its tokens."""
        b, t = embeds.shape[:2]
        page = self.page_size
        slots = np.full((b, t), self.num_pages * page, np.int32)
        for row, n in enumerate(lens):
            idx = np.arange(self.done[row], self.done[row] + n)
            slots[row, :n] = self.tables[row, idx // page] * page + idx % page
        self.done += lens
        md = AttentionMetadata(
            jnp.asarray(slots),
            jnp.asarray(self.tables),
            jnp.asarray(self.done, jnp.int32),
            jnp.asarray(lens, jnp.int32),
        )
        args = (jnp.asarray(embeds), jnp.asarray(positions), self.cache, md)
        logits, hidden, self.cache = decode_step(self.model, *args, model_kw)
        logits, hidden = np.asarray(logits), np.asarray(hidden)
        return [logits[r, :n] for r, n in enumerate(lens)], [hidden[r, :n] for r, n in enumerate(lens)]


QWEN3_OMNI_POSITIONS_PER_SECOND = 13
"""Qwen3-Omni's ``position_id_per_seconds`` (its processor's default): M-RoPE time positions per
second of video or audio."""


def placeholder_owner(merge: int, vision_bos: str = "B") -> types.SimpleNamespace:
    """A stand-in ``self`` for an omni processor's placeholder methods, called unbound: merge
    sizes and one-letter tokens (``vision_bos``/``E`` vision start/end, ``s``/``e`` audio
    start/end, ``i``/``v``/``a`` image/video/audio), so the layout it writes reads as a string."""
    return types.SimpleNamespace(
        image_processor=types.SimpleNamespace(merge_size=merge),
        video_processor=types.SimpleNamespace(merge_size=merge),
        vision_bos_token=vision_bos,
        vision_eos_token="E",
        audio_bos_token="s",
        audio_eos_token="e",
        image_token="i",
        video_token="v",
        audio_token="a",
    )


def qwen3_video_audio_layout(
    grid: tuple[int, int, int], seconds: float, audio_tokens: int, merge: int = 2
) -> str:
    """transformers' own interleaving of a video's placeholders with its audio track's, in the
    vision brackets: ``B``/``E`` vision start/end, ``s``/``e`` audio start/end, ``v``/``a`` a
    video/audio token. ``replace_video_with_audio_token`` where the processor has it
    (transformers 5.24), else the video branch of ``replace_multimodal_special_tokens`` (5.17)."""
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

    owner = placeholder_owner(merge)
    if hasattr(Qwen3OmniMoeProcessor, "replace_video_with_audio_token"):
        inner = Qwen3OmniMoeProcessor.replace_video_with_audio_token(
            owner,
            {"video_grid_thw": np.array([grid]), "video_second_per_grid": [seconds]},
            0,
            {"num_audio_tokens": [audio_tokens]},
            0,
            position_id_per_seconds=QWEN3_OMNI_POSITIONS_PER_SECOND,
        )
        return "B" + inner + "E"
    (layout,) = Qwen3OmniMoeProcessor.replace_multimodal_special_tokens(
        owner,
        ["BvE"],
        iter([audio_tokens]),
        iter([]),
        iter([np.array(grid)]),
        video_second_per_grid=iter([seconds]),
        use_audio_in_video=True,
        position_id_per_seconds=QWEN3_OMNI_POSITIONS_PER_SECOND,
        seconds_per_chunk=None,
    )
    return layout
